//! Which interfaces the node-level program belongs on, from the namespace's interfaces and
//! routes: pure, so every rule is unit-tested.
//!
//! * **Egress, on every interface, loopback included.** A gated socket with CAP_NET_RAW can
//!   send an AF_PACKET frame on any interface that reaches the metadata service's segment —
//!   the uplink, a second NIC, the parent of a VLAN uplink, a bridge port, or loopback, which
//!   hands it back to the node as forwarded traffic without its socket — and forwarded traffic
//!   leaves by whichever interface the route (in any table: pods may be routed by policy)
//!   or the bridge or Open vSwitch datapath picks. The program's common case is two loads and
//!   a bit test, so guarding every egress costs less than guessing which ones matter.
//! * **Uplinks**: the interfaces a route to a protected address leaves by, in any routing
//!   table. They take no ingress program: what enters there comes from outside the node.
//! * **Workload-facing** (ingress): every other interface but loopback — pod veths, VM taps,
//!   tunnels, OVS internal ports such as OVN-Kubernetes' management port: whatever a frame
//!   can enter the node by from a workload. Not used where pod-network traffic is left to
//!   the SDN (`--gate-scope host-network-only`).
//! * Flags add interfaces to either role (`--tc-interface`, `--tc-workload-interface`), also
//!   with node-level discovery off; the ones `--tc-workload-interface` names are strict.
use std::{collections::BTreeSet, net::IpAddr};

use gate_common::user::TcDirection;
use globset::{Glob, GlobSet, GlobSetBuilder};

use super::rtnl::{Link, Route};
use crate::loader::TcTarget;

/// Interface-name globs that are not valid.
#[derive(Debug, thiserror::Error)]
#[error("interface glob {pattern:?}: {reason}")]
pub(crate) struct GlobError {
    pub pattern: String,
    pub reason: String,
}

/// The rules the classification follows besides the namespace itself.
#[derive(Clone, Debug)]
pub(crate) struct Rules {
    /// Node-level discovery on: egress on every interface, ingress per `workload_ingress`.
    /// Off: only what the flags name.
    pub discover: bool,
    /// Find workload-facing interfaces (all but uplinks and loopback).
    pub workload_ingress: bool,
    /// Whether the interfaces found that way are strict (only an allowed gated socket
    /// passes), or let sockets outside the gated root through (standalone). Interfaces named
    /// by flag are always strict.
    pub strict_found: bool,
    /// Extra uplinks (egress).
    pub uplinks: GlobSet,
    /// Extra workload-facing interfaces (ingress).
    pub workloads: GlobSet,
    /// Trusted interfaces: no ingress program, and their forwarded traffic passes the uplinks.
    pub trusted: GlobSet,
}

impl Rules {
    pub(crate) fn new(
        discover: bool,
        workload_ingress: bool,
        strict_found: bool,
        uplinks: &[String],
        workloads: &[String],
        trusted: &[String],
    ) -> Result<Rules, GlobError> {
        Ok(Rules {
            discover,
            workload_ingress,
            strict_found,
            uplinks: globset(uplinks)?,
            workloads: globset(workloads)?,
            trusted: globset(trusted)?,
        })
    }
}

fn globset(patterns: &[String]) -> Result<GlobSet, GlobError> {
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        let glob = Glob::new(p)
            .map_err(|e| GlobError { pattern: p.clone(), reason: e.kind().to_string() })?;
        b.add(glob);
    }
    b.build().map_err(|e| GlobError { pattern: patterns.join(","), reason: e.to_string() })
}

/// Where the program goes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Classified {
    /// (ifindex, name, direction) of every attachment.
    pub targets: BTreeSet<TcTarget>,
    /// Workload-facing interfaces where only an allowed gated socket passes.
    pub strict: BTreeSet<u32>,
    /// The interfaces a route to a protected address leaves by.
    pub uplinks: BTreeSet<u32>,
    /// Trusted interfaces.
    pub trusted: BTreeSet<u32>,
}

/// Where the program goes, by the rules above.
pub(crate) fn classify(
    links: &[Link],
    routes: &[Route],
    protected: &[IpAddr],
    rules: &Rules,
) -> Classified {
    let exists: BTreeSet<u32> = links.iter().map(|l| l.ifindex).collect();
    let uplinks: BTreeSet<u32> = routes
        .iter()
        .filter(|r| protected.iter().any(|a| r.covers(*a)))
        .flat_map(|r| r.oifs.iter().copied())
        .filter(|i| exists.contains(i))
        .collect();
    let mut out = Classified { uplinks: uplinks.clone(), ..Classified::default() };
    for l in links {
        let mut add = |direction| {
            out.targets.insert(TcTarget { ifindex: l.ifindex, name: l.name.clone(), direction });
        };
        // Loopback's egress too: an AF_PACKET frame sent on `lo` loses its socket there and
        // comes back in as forwarded traffic.
        if rules.discover || rules.uplinks.is_match(&l.name) {
            add(TcDirection::Egress);
        }
        let named = rules.workloads.is_match(&l.name);
        let trusted = rules.trusted.is_match(&l.name);
        if trusted {
            out.trusted.insert(l.ifindex);
        }
        let found = rules.discover
            && rules.workload_ingress
            && !l.loopback
            && !trusted
            && !uplinks.contains(&l.ifindex);
        if named || found {
            add(TcDirection::Ingress);
            if named || rules.strict_found {
                out.strict.insert(l.ifindex);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(ifindex: u32, name: &str, kind: Option<&str>, master: Option<u32>) -> Link {
        Link { ifindex, name: name.into(), kind: kind.map(Into::into), master, loopback: false }
    }

    fn route(dst: &str, len: u8, table: u32, oifs: &[u32]) -> Route {
        Route { dst: dst.parse().unwrap(), dst_len: len, table, oifs: oifs.to_vec() }
    }

    fn names(c: &Classified, dir: TcDirection) -> Vec<&str> {
        c.targets.iter().filter(|t| t.direction == dir).map(|t| t.name.as_str()).collect()
    }

    fn imds() -> Vec<IpAddr> {
        vec!["169.254.169.254".parse().unwrap(), "fd00:ec2::254".parse().unwrap()]
    }

    #[test]
    fn every_egress_and_every_ingress_but_the_uplinks() {
        let mut lo = link(1, "lo", None, None);
        lo.loopback = true;
        let links = vec![
            lo,
            link(2, "eth0", None, None),
            link(3, "veth1a", Some("veth"), None),
            link(4, "tap0", Some("tun"), None),
            link(5, "eth1", None, None),
        ];
        // Main table via eth0; a per-ENI table routes pods by eth1.
        let routes = vec![
            route("0.0.0.0", 0, 254, &[2]),
            route("0.0.0.0", 0, 2, &[5]),
            route("10.0.0.0", 24, 254, &[3]),
            route("fd00::", 8, 254, &[9]), // an interface that does not exist
        ];
        let rules = Rules::new(true, true, false, &[], &[], &[]).unwrap();
        let t = classify(&links, &routes, &imds(), &rules);
        assert_eq!(t.uplinks, [2, 5].into());
        assert_eq!(names(&t, TcDirection::Egress), vec!["lo", "eth0", "veth1a", "tap0", "eth1"]);
        assert_eq!(names(&t, TcDirection::Ingress), vec!["veth1a", "tap0"]);
        assert!(t.strict.is_empty(), "found interfaces are lenient unless the rules say");
        let rules = Rules::new(true, true, true, &[], &[], &[]).unwrap();
        assert_eq!(classify(&links, &routes, &imds(), &rules).strict, [3, 4].into());
        // Pod-network traffic left to the SDN: no ingress but what a flag names, strict.
        let rules = Rules::new(true, false, false, &[], &["tap*".into()], &[]).unwrap();
        let t = classify(&links, &routes, &imds(), &rules);
        assert_eq!(names(&t, TcDirection::Ingress), vec!["tap0"]);
        assert_eq!(t.strict, [4].into());
        // Discovery off: only what the flags name.
        let rules = Rules::new(false, true, true, &["eth1".into()], &[], &[]).unwrap();
        let t = classify(&links, &routes, &imds(), &rules);
        assert_eq!(names(&t, TcDirection::Egress), vec!["eth1"]);
        assert!(names(&t, TcDirection::Ingress).is_empty());
        // A trusted interface: egress still guarded, no ingress program, in the trusted set.
        let rules = Rules::new(true, true, true, &[], &[], &["tap*".into()]).unwrap();
        let t = classify(&links, &routes, &imds(), &rules);
        assert_eq!(names(&t, TcDirection::Ingress), vec!["veth1a"]);
        assert_eq!(names(&t, TcDirection::Egress), vec!["lo", "eth0", "veth1a", "tap0", "eth1"]);
        assert_eq!((t.trusted, t.strict), ([4].into(), [3].into()));
    }

    #[test]
    fn bridges_and_ovs() {
        // Linux bridge holding the address, with the NIC and a pod veth as ports: the NIC
        // and the pod veth take ingress (frames can enter there), the bridge does not.
        let links = vec![
            link(2, "eth0", None, Some(10)),
            link(3, "vethpod", Some("veth"), Some(10)),
            link(10, "br0", Some("bridge"), None),
        ];
        let routes = vec![route("169.254.0.0", 16, 254, &[10])];
        let rules = Rules::new(true, true, false, &[], &[], &[]).unwrap();
        let t = classify(&links, &routes, &imds(), &rules);
        assert_eq!(names(&t, TcDirection::Egress), vec!["eth0", "vethpod", "br0"]);
        assert_eq!(names(&t, TcDirection::Ingress), vec!["eth0", "vethpod"]);

        // OVN-Kubernetes: br-ex is an OVS internal port; the NIC and pod veths are ports
        // of the ovs-system datapath; the management port is internal too.
        let links = vec![
            link(2, "ens3", None, Some(20)),
            link(20, "ovs-system", Some("openvswitch"), None),
            link(21, "br-ex", Some("openvswitch"), Some(20)),
            link(22, "ovn-k8s-mp0", Some("openvswitch"), Some(20)),
            link(30, "0a1b2c3d4e5f", Some("veth"), Some(20)),
            link(31, "genev_sys_6081", Some("geneve"), Some(20)),
        ];
        let routes = vec![route("0.0.0.0", 0, 254, &[21])];
        let t = classify(&links, &routes, &imds(), &rules);
        assert_eq!(t.uplinks, [21].into());
        assert!(names(&t, TcDirection::Egress).contains(&"ens3"));
        let ingress = names(&t, TcDirection::Ingress);
        assert!(ingress.contains(&"0a1b2c3d4e5f") && ingress.contains(&"ovn-k8s-mp0"));
        assert!(!ingress.contains(&"br-ex"), "the uplink itself takes no ingress program");
        assert!(Rules::new(true, true, false, &["[".into()], &[], &[]).is_err());
        assert!(Rules::new(true, true, false, &[], &[], &["[".into()]).is_err());
    }
}
