//! Which interfaces the node-level program belongs on, and which variant, from the
//! namespace's interfaces alone: pure, so every rule is unit-tested. Routes decide nothing:
//! anyone who can add a route (a pod's Router Advertisement, a host-network `NET_ADMIN`)
//! could otherwise take a program off an interface.
//!
//! * **Egress, on every interface, loopback included.** A gated socket with CAP_NET_RAW can
//!   send an AF_PACKET frame on any interface that reaches the metadata service's segment —
//!   the uplink, a second NIC, the parent of a VLAN uplink, a bridge port, or loopback, which
//!   hands it back to the node as forwarded traffic without its socket — and forwarded traffic
//!   leaves by whichever interface a route, the bridge or Open vSwitch picks. The program's
//!   common case is two loads and a bit test, so guarding every egress costs less than
//!   guessing which ones matter.
//! * **Ingress, on every interface but loopback and the trusted ones** (workload-facing: pod
//!   veths, VM taps, tunnels, OVS internal ports such as OVN-Kubernetes' management port, and
//!   the uplinks too, where nothing legitimate enters bound for a metadata address). Not used
//!   where pod-network traffic is left to the SDN (`--gate-scope host-network-only`).
//! * **The variant by link type**: `gate_tc` reads Ethernet frames (Ethernet and loopback
//!   devices, with VLAN tags in the frame); every other link type — tun, WireGuard, ipip,
//!   gre, sit, ip6tnl, IPoIB, and types not known here — gets `gate_tc_l3`, which reads at the
//!   kernel's network header and denies what it cannot read.
//! * Flags add interfaces to either role (`--tc-interface`, `--tc-workload-interface`), also
//!   with node-level discovery off; the ones `--tc-workload-interface` names are strict.
use std::collections::BTreeSet;

use gate_common::user::TcDirection;
use globset::{Glob, GlobSet, GlobSetBuilder};

use super::rtnl::Link;
use crate::loader::{Framing, TcTarget};

/// `ARPHRD_ETHER`, `ARPHRD_LOOPBACK` (include/uapi/linux/if_arp.h): the link types whose
/// packets start with an Ethernet header at tc.
const ARPHRD_ETHER: u16 = 1;
const ARPHRD_LOOPBACK: u16 = 772;

/// What a link type's packets start with at tc. Only the types known to carry an Ethernet
/// header read as frames; every other type is read at the kernel's network header.
pub(crate) fn framing(link_type: u16) -> Framing {
    match link_type {
        ARPHRD_ETHER | ARPHRD_LOOPBACK => Framing::Ethernet,
        _ => Framing::Network,
    }
}

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
    /// Find workload-facing interfaces (all but loopback and the trusted ones).
    pub workload_ingress: bool,
    /// Whether the interfaces found that way are strict (only an allowed gated socket
    /// passes), or let sockets outside the gated root through (standalone). Interfaces named
    /// by flag are always strict.
    pub strict_found: bool,
    /// Extra egress interfaces (`--tc-interface`, for discovery off).
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
    /// (ifindex, name, direction, variant) of every attachment.
    pub targets: BTreeSet<TcTarget>,
    /// Workload-facing interfaces where only an allowed gated socket passes.
    pub strict: BTreeSet<u32>,
    /// Trusted interfaces.
    pub trusted: BTreeSet<u32>,
}

/// Where the program goes, by the rules above.
pub(crate) fn classify(links: &[Link], rules: &Rules) -> Classified {
    let mut out = Classified::default();
    for l in links {
        let mut add = |direction| {
            out.targets.insert(TcTarget {
                ifindex: l.ifindex,
                name: l.name.clone(),
                direction,
                framing: framing(l.link_type),
            });
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
        let found = rules.discover && rules.workload_ingress && !l.loopback && !trusted;
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

    fn link(ifindex: u32, name: &str) -> Link {
        Link { ifindex, name: name.into(), loopback: false, link_type: ARPHRD_ETHER }
    }

    fn names(c: &Classified, dir: TcDirection) -> Vec<&str> {
        c.targets.iter().filter(|t| t.direction == dir).map(|t| t.name.as_str()).collect()
    }

    #[test]
    fn every_egress_and_every_ingress_but_loopback() {
        let mut lo = link(1, "lo");
        (lo.loopback, lo.link_type) = (true, ARPHRD_LOOPBACK);
        let links =
            vec![lo, link(2, "eth0"), link(3, "veth1a"), link(4, "tap0"), link(5, "eth1.100")];
        let rules = Rules::new(true, true, false, &[], &[], &[]).unwrap();
        let t = classify(&links, &rules);
        assert_eq!(
            names(&t, TcDirection::Egress),
            vec!["lo", "eth0", "veth1a", "tap0", "eth1.100"]
        );
        // The uplinks too: whatever a route says, a program is never taken off.
        assert_eq!(names(&t, TcDirection::Ingress), vec!["eth0", "veth1a", "tap0", "eth1.100"]);
        assert!(t.strict.is_empty(), "found interfaces are lenient unless the rules say");
        let rules = Rules::new(true, true, true, &[], &[], &[]).unwrap();
        assert_eq!(classify(&links, &rules).strict, [2, 3, 4, 5].into());
        // Pod-network traffic left to the SDN: no ingress but what a flag names, strict.
        let rules = Rules::new(true, false, false, &[], &["tap*".into()], &[]).unwrap();
        let t = classify(&links, &rules);
        assert_eq!(names(&t, TcDirection::Ingress), vec!["tap0"]);
        assert_eq!(t.strict, [4].into());
        // Discovery off: only what the flags name.
        let rules = Rules::new(false, true, true, &["eth0".into()], &[], &[]).unwrap();
        let t = classify(&links, &rules);
        assert_eq!(names(&t, TcDirection::Egress), vec!["eth0"]);
        assert!(names(&t, TcDirection::Ingress).is_empty());
        // A trusted interface: egress still guarded, no ingress program, in the trusted set.
        let rules = Rules::new(true, true, true, &[], &[], &["tap*".into()]).unwrap();
        let t = classify(&links, &rules);
        assert_eq!(names(&t, TcDirection::Ingress), vec!["eth0", "veth1a", "eth1.100"]);
        assert_eq!(
            names(&t, TcDirection::Egress),
            vec!["lo", "eth0", "veth1a", "tap0", "eth1.100"]
        );
        assert_eq!((t.trusted, t.strict), ([4].into(), [2, 3, 5].into()));
        assert!(Rules::new(true, true, false, &["[".into()], &[], &[]).is_err());
        assert!(Rules::new(true, true, false, &[], &[], &["[".into()]).is_err());
    }

    #[test]
    fn the_variant_follows_the_link_type() {
        // ARPHRD_NONE (tun, WireGuard), TUNNEL (ipip), SIT, IPGRE, TUNNEL6, INFINIBAND, and
        // a type nobody listed: read at the network header.
        for ty in [0xfffe, 768, 776, 778, 769, 32, 0x1234] {
            assert_eq!(framing(ty), Framing::Network, "link type {ty}");
        }
        for ty in [ARPHRD_ETHER, ARPHRD_LOOPBACK] {
            assert_eq!(framing(ty), Framing::Ethernet, "link type {ty}");
        }
        let mut wg = link(7, "wg0");
        wg.link_type = 0xfffe;
        let rules = Rules::new(true, true, true, &[], &[], &[]).unwrap();
        let t = classify(&[wg], &rules);
        assert!(t.targets.iter().all(|t| t.framing == Framing::Network) && t.targets.len() == 2);
    }
}
