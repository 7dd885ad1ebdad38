//! What is known about each platform's metadata service and the services beside it: the one
//! table `gate-agent check` holds a policy against. docs/platforms.md gives the sources of
//! every row; the shipped policies in deploy/policies/ follow it.
//!
//! A platform is named as the agent's `--platform` names it: the OpenShift `PlatformType`
//! (`AWS`, `GCP`, ...), and `External/<platformName>` for an External platform
//! (`External/oci`).
use ipnet::IpNet;

use super::Protocol;

/// A service at a fixed address: the metadata service to protect, or a neighbour that every
/// workload needs and no policy may protect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Service {
    /// What it is, for messages ("Amazon DNS server").
    pub what: &'static str,
    /// Its address, as a CIDR (`169.254.169.253/32`).
    pub net: &'static str,
    /// Its ports; empty = every port.
    pub ports: &'static [u16],
    /// Its protocols; empty = every protocol.
    pub protocols: &'static [Protocol],
}

impl Service {
    /// The address. Every entry of [`PLATFORM_FACTS`] parses (a unit test holds it to that).
    pub fn net(&self) -> IpNet {
        self.net.parse().unwrap_or_else(|e| panic!("platform table: {:?}: {e}", self.net))
    }

    /// `169.254.169.253 port 53`, `fd00:ec2::123 UDP 123`, `100.100.0.0/16`.
    pub fn describe(&self) -> String {
        let net = self.net();
        let addr = if net.prefix_len() == net.max_prefix_len() {
            net.addr().to_string()
        } else {
            net.to_string()
        };
        let protos = match self.protocols {
            [] => String::new(),
            ps => ps.iter().map(|p| p.as_str()).collect::<Vec<_>>().join("/") + " ",
        };
        match self.ports {
            [] if protos.is_empty() => addr,
            [] => format!("{addr} {}", protos.trim_end()),
            [p] => format!("{addr} {}{p}", if protos.is_empty() { "port " } else { &protos }),
            ps => format!(
                "{addr} {}{}",
                if protos.is_empty() { "ports " } else { &protos },
                ps.iter().map(u16::to_string).collect::<Vec<_>>().join(", ")
            ),
        }
    }
}

/// What one platform offers at fixed addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlatformFacts {
    /// The platform as `--platform` names it.
    pub name: &'static str,
    /// The metadata service: what a policy for this platform protects.
    pub metadata: &'static [Service],
    /// Neighbours on the same or nearby addresses that workloads need: never protected.
    pub keep_open: &'static [Service],
    /// For a platform without a metadata service at a fixed address: why. A policy that
    /// protects nothing is then expected.
    pub no_metadata_service: Option<&'static str>,
}

const TCP: &[Protocol] = &[Protocol::Tcp];
const UDP: &[Protocol] = &[Protocol::Udp];

const fn svc(
    what: &'static str,
    net: &'static str,
    ports: &'static [u16],
    protocols: &'static [Protocol],
) -> Service {
    Service { what, net, ports, protocols }
}

const fn without_metadata(name: &'static str, why: &'static str) -> PlatformFacts {
    PlatformFacts { name, metadata: &[], keep_open: &[], no_metadata_service: Some(why) }
}

const CONFIG_DRIVE: &str = "nodes take their configuration from a config drive, guest properties or the kernel command \
     line, not from a link-local metadata service";

/// Every platform the agent knows, with its sources in docs/platforms.md.
pub const PLATFORM_FACTS: &[PlatformFacts] = &[
    PlatformFacts {
        name: "AWS",
        metadata: &[
            svc("EC2 instance metadata service", "169.254.169.254/32", &[80], TCP),
            svc("EC2 instance metadata service (IPv6)", "fd00:ec2::254/128", &[80], TCP),
        ],
        keep_open: &[
            svc("the Amazon DNS server", "169.254.169.253/32", &[53], &[]),
            svc("the Amazon DNS server (IPv6)", "fd00:ec2::253/128", &[53], &[]),
            svc("Amazon Time Sync (NTP)", "169.254.169.123/32", &[123], UDP),
            svc("Amazon Time Sync (NTP, IPv6)", "fd00:ec2::123/128", &[123], UDP),
            svc(
                "the EKS Pod Identity agent, which serves pods their own credentials",
                "169.254.170.23/32",
                &[80],
                TCP,
            ),
            svc(
                "the EKS Pod Identity agent (IPv6), which serves pods their own credentials",
                "fd00:ec2::23/128",
                &[80],
                TCP,
            ),
        ],
        no_metadata_service: None,
    },
    PlatformFacts {
        name: "GCP",
        metadata: &[
            svc("the Compute Engine metadata server", "169.254.169.254/32", &[80, 443, 8080], TCP),
            svc(
                "the Compute Engine metadata server (IPv6)",
                "fd20:ce::254/128",
                &[80, 443, 8080],
                TCP,
            ),
        ],
        keep_open: &[
            svc("the VM's DNS resolver", "169.254.169.254/32", &[53], &[]),
            svc("the metadata server's NTP service", "169.254.169.254/32", &[123], UDP),
        ],
        no_metadata_service: None,
    },
    PlatformFacts {
        name: "Azure",
        metadata: &[
            svc("Azure Instance Metadata Service", "169.254.169.254/32", &[80], TCP),
            svc("the WireServer and host agent plugin", "168.63.129.16/32", &[80, 32526], TCP),
        ],
        keep_open: &[svc("Azure DNS", "168.63.129.16/32", &[53], &[])],
        no_metadata_service: None,
    },
    PlatformFacts {
        name: "OpenStack",
        metadata: &[
            svc("the Nova metadata service", "169.254.169.254/32", &[80], TCP),
            svc("the Nova metadata service (IPv6)", "fe80::a9fe:a9fe/128", &[80], TCP),
        ],
        keep_open: &[],
        no_metadata_service: None,
    },
    PlatformFacts {
        name: "IBMCloud",
        metadata: &[svc(
            "the VPC instance metadata service",
            "169.254.169.254/32",
            &[80, 443],
            TCP,
        )],
        keep_open: &[],
        no_metadata_service: None,
    },
    PlatformFacts {
        name: "AlibabaCloud",
        metadata: &[svc("the ECS instance metadata service", "100.100.100.200/32", &[80], TCP)],
        keep_open: &[
            svc("the VPC DNS server", "100.100.2.136/32", &[53], &[]),
            svc("the VPC DNS server", "100.100.2.138/32", &[53], &[]),
        ],
        no_metadata_service: None,
    },
    PlatformFacts {
        name: "External/oci",
        metadata: &[
            svc("the OCI instance metadata service", "169.254.169.254/32", &[80], TCP),
            svc("the OCI instance metadata service (IPv6)", "fd00:c1::a9fe:a9fe/128", &[80], TCP),
        ],
        // The iSCSI boot and block volume targets (169.254.0.2, 169.254.2.0/24 port 3260) lie
        // in the OVN-Kubernetes masquerade subnet, which validation already rejects to protect.
        keep_open: &[
            svc("the VCN DNS resolver", "169.254.169.254/32", &[53], &[]),
            svc("the OCI NTP service", "169.254.169.254/32", &[123], UDP),
        ],
        no_metadata_service: None,
    },
    without_metadata(
        "EquinixMetal",
        "Equinix Metal's metadata service was a public HTTPS name, shut down with the platform \
         on 2026-06-30",
    ),
    without_metadata("PowerVS", CONFIG_DRIVE),
    without_metadata("VSphere", CONFIG_DRIVE),
    without_metadata("Nutanix", CONFIG_DRIVE),
    without_metadata("KubeVirt", CONFIG_DRIVE),
    without_metadata("BareMetal", CONFIG_DRIVE),
    without_metadata("None", CONFIG_DRIVE),
    without_metadata("Libvirt", CONFIG_DRIVE),
    without_metadata("oVirt", CONFIG_DRIVE),
];

/// The facts of a platform named as `--platform` names it (case-insensitive), if known.
pub fn facts(platform: &str) -> Option<&'static PlatformFacts> {
    PLATFORM_FACTS.iter().find(|f| f.name.eq_ignore_ascii_case(platform))
}

/// The policy `platform` value for a `--platform` name: `External/oci` -> `External`.
pub fn policy_platform(platform: &str) -> &str {
    platform.split_once('/').map_or(platform, |(base, _)| base)
}

#[cfg(test)]
mod tests {
    use super::super::PLATFORMS;
    use super::*;

    #[test]
    fn every_address_parses_and_is_exact_or_a_network() {
        for f in PLATFORM_FACTS {
            for s in f.metadata.iter().chain(f.keep_open) {
                let net = s.net();
                assert_eq!(net, net.trunc(), "{}: {} has host bits set", f.name, s.net);
                assert!(!s.what.is_empty());
            }
        }
    }

    #[test]
    fn every_platform_is_named_once_and_is_a_platform_type() {
        for (i, f) in PLATFORM_FACTS.iter().enumerate() {
            assert!(
                PLATFORMS.contains(&policy_platform(f.name)),
                "{} is no OpenShift platform type",
                f.name
            );
            assert!(
                PLATFORM_FACTS[i + 1..].iter().all(|g| !g.name.eq_ignore_ascii_case(f.name)),
                "{} listed twice",
                f.name
            );
            assert_eq!(
                f.metadata.is_empty(),
                f.no_metadata_service.is_some(),
                "{}: a platform either has a metadata service or says why not",
                f.name
            );
        }
        // Every platform type but External (whose facts are per platformName) is in the table.
        for p in PLATFORMS.iter().filter(|p| **p != "External") {
            assert!(facts(p).is_some(), "no facts for {p}");
        }
    }

    #[test]
    fn no_neighbour_is_a_metadata_port() {
        // A neighbour on the metadata address itself (GCP's DNS on :53) must not share a port
        // with the metadata service, or no policy could protect one and leave the other open.
        for f in PLATFORM_FACTS {
            for m in f.metadata {
                for k in f.keep_open.iter().filter(|k| k.net == m.net) {
                    assert!(
                        k.ports.iter().all(|p| !m.ports.contains(p)),
                        "{}: {} and {} share a port",
                        f.name,
                        m.describe(),
                        k.describe()
                    );
                }
            }
        }
    }

    #[test]
    fn lookup_and_description() {
        assert_eq!(facts("aws").map(|f| f.name), Some("AWS"));
        assert_eq!(facts("external/OCI").map(|f| f.name), Some("External/oci"));
        assert!(facts("External").is_none(), "External alone names no provider");
        assert!(facts("External/foo").is_none());
        assert_eq!(policy_platform("External/oci"), "External");
        assert_eq!(policy_platform("GCP"), "GCP");
        let aws = facts("AWS").expect("AWS");
        let described: Vec<String> = aws.keep_open.iter().map(Service::describe).collect();
        assert!(described.contains(&"169.254.169.253 port 53".to_owned()), "{described:?}");
        assert!(described.contains(&"fd00:ec2::123 UDP 123".to_owned()), "{described:?}");
        assert!(described.contains(&"169.254.170.23 TCP 80".to_owned()), "{described:?}");
        let gcp = facts("GCP").expect("GCP");
        assert_eq!(gcp.metadata[0].describe(), "169.254.169.254 TCP 80, 443, 8080");
        assert_eq!(
            svc("x", "100.100.0.0/16", &[], &[]).describe(),
            "100.100.0.0/16",
            "a network is shown as a network"
        );
    }
}
