//! Endpoints: names, CIDRs (no host bits, no OVN-Kubernetes masquerade subnet), ports and
//! protocols.
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::{Ctx, Result};
use crate::policy::{Endpoint, Protocol, schema::RawEndpoint};

/// OVN-Kubernetes masquerade subnets: node networking breaks if traffic to them is denied. The
/// current defaults are 169.254.0.0/17 and fd69::/112; clusters installed before OpenShift 4.14
/// keep the old 169.254.169.0/29 (169.254.169.1-.5; docs/policy.md) and fd69::/125, which the
/// /112 contains.
fn masquerade_nets() -> [IpNet; 3] {
    [
        IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(169, 254, 0, 0), 17)),
        IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(169, 254, 169, 0), 29)),
        IpNet::V6(Ipv6Net::new_assert(Ipv6Addr::new(0xfd69, 0, 0, 0, 0, 0, 0, 0), 112)),
    ]
}

fn overlaps(a: IpNet, b: IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// The masquerade subnet `net` overlaps, also through the IPv4-mapped IPv6 form.
fn masquerade_overlap(net: IpNet) -> Option<IpNet> {
    masquerade_nets().into_iter().find(|m| {
        overlaps(net, *m)
            || match (net, m) {
                (IpNet::V6(_), IpNet::V4(m4)) => {
                    let mapped = Ipv6Net::new(m4.network().to_ipv6_mapped(), 96 + m4.prefix_len());
                    mapped.is_ok_and(|mapped| overlaps(net, IpNet::V6(mapped)))
                }
                _ => false,
            }
    })
}

pub(super) fn endpoint(
    cx: &Ctx,
    at: &str,
    raw: RawEndpoint,
    names: &mut HashMap<String, String>,
) -> Result<Endpoint> {
    let name = cx.name(&format!("{at}.name"), "endpoint", raw.name, names)?;
    let cidr = cidr(cx, &format!("{at}.cidr"), raw.cidr)?;

    let mut ports = Vec::new();
    if let Some(raw_ports) = raw.ports {
        if raw_ports.is_empty() {
            return Err(cx.err(
                format!("{at}.ports"),
                "an empty list would match no port; omit the field to mean all ports",
            ));
        }
        let mut seen = BTreeMap::new();
        for (j, p) in raw_ports.into_iter().enumerate() {
            let field = format!("{at}.ports[{j}]");
            let port = match u16::try_from(p.0) {
                Ok(port) if port != 0 => port,
                _ => return Err(cx.err(field, format!("port {} is outside 1-65535", p.0))),
            };
            if let Some(first) = seen.insert(port, j) {
                return Err(cx.err(field, format!("duplicate port {port} (also ports[{first}])")));
            }
            ports.push(port);
        }
    }

    let mut protocols = Vec::new();
    if let Some(raw_protocols) = raw.protocols {
        if raw_protocols.is_empty() {
            return Err(cx.err(
                format!("{at}.protocols"),
                "an empty list would match no protocol; omit the field to mean all protocols",
            ));
        }
        for (j, p) in raw_protocols.iter().enumerate() {
            let field = format!("{at}.protocols[{j}]");
            let proto = match p.as_str() {
                "TCP" => Protocol::Tcp,
                "UDP" => Protocol::Udp,
                other if other.eq_ignore_ascii_case("tcp") || other.eq_ignore_ascii_case("udp") => {
                    return Err(cx.err(
                        field,
                        format!(
                            "unknown protocol {other:?}; write {} (upper case)",
                            other.to_ascii_uppercase()
                        ),
                    ));
                }
                other => {
                    return Err(cx.err(
                        field,
                        format!(
                            "unknown protocol {other:?}; expected TCP or UDP (omit `protocols` to \
                             protect every protocol)"
                        ),
                    ));
                }
            };
            if let Some(first) = protocols.iter().position(|&q| q == proto) {
                return Err(
                    cx.err(field, format!("duplicate protocol {proto} (also protocols[{first}])"))
                );
            }
            protocols.push(proto);
        }
    }

    Ok(Endpoint { name, cidr, ports, protocols })
}

fn cidr(cx: &Ctx, field: &str, raw: Option<String>) -> Result<IpNet> {
    let Some(s) = raw else {
        return Err(cx.err(field, "missing; e.g. 169.254.169.254/32"));
    };
    let net: IpNet = match s.parse() {
        Ok(net) => net,
        Err(e) => {
            let reason = match s.parse::<IpAddr>() {
                Ok(a) => format!(
                    "{s:?} has no prefix length; write {a}/{} for the single address",
                    if a.is_ipv4() { 32 } else { 128 }
                ),
                Err(_) => format!(
                    "{s:?} is not a CIDR ({e}); expected address/prefix-length, e.g. \
                     169.254.169.254/32 or fd00:ec2::254/128"
                ),
            };
            return Err(cx.err(field, reason));
        }
    };
    if net != net.trunc() {
        return Err(cx.err(
            field,
            format!(
                "{net} has host bits set: did you mean the network {}? (or {}/{} for the single \
                 address)",
                net.trunc(),
                net.addr(),
                net.max_prefix_len()
            ),
        ));
    }
    if let Some(m) = masquerade_overlap(net) {
        // A single address has no narrower form to suggest: the reason is the subnet itself.
        let reason = if net.prefix_len() == net.max_prefix_len() {
            format!(
                "{net} lies inside the OVN-Kubernetes masquerade subnet {m}, from which \
                 OVN-Kubernetes allocates the node's own addresses (also per user-defined \
                 network): denying it could break node networking. A service at this address \
                 cannot be protected without knowing the cluster's masquerade subnet; leave it \
                 out of the policy (docs/platforms.md, \"Checked and not shipped: Scaleway\")"
            )
        } else {
            format!(
                "{net} overlaps the OVN-Kubernetes masquerade subnet {m}: denying it would break \
                 node networking; protect exact /32 or /128 addresses instead"
            )
        };
        return Err(cx.err(field, reason));
    }
    Ok(net)
}
