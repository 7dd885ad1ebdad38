//! The `frame` fuzz target's body (fuzz/fuzz_targets/frame.rs), also run by the tests: any
//! bytes as an Ethernet frame or a bare IP packet, read by the parser the kernel programs
//! run, then checked against a plain reading of the fixed header fields. Panics if the parser
//! panics, lets a packet for a protected endpoint pass, stops one bound elsewhere, or reads
//! an address, port or fragment differently from the header.
use super::*;
use crate::{
    abi::{PROTO_TCP, PROTO_UDP},
    compile::{EndpointSpec, HostTables, Net, compile},
    verdict::Addr,
};

const GENERATION: u32 = 7;

/// A mixed policy: a port and protocol rule, a port-only rule on an IPv6 address, an address
/// with every port and protocol, and two ports on a fourth.
fn endpoints() -> Vec<EndpointSpec> {
    let v4 = |addr, ports: &[u16], protos: &[u8]| EndpointSpec {
        net: Net::V4 { addr, len: 32 },
        ports: ports.to_vec(),
        protos: protos.to_vec(),
    };
    let mut imds6 = [0u8; 16];
    imds6[..4].copy_from_slice(&[0xfd, 0x00, 0x0e, 0xc2]);
    imds6[14..].copy_from_slice(&[0x02, 0x54]);
    vec![
        v4([169, 254, 169, 254], &[80], &[PROTO_TCP]),
        EndpointSpec { net: Net::V6 { addr: imds6, len: 128 }, ports: vec![80], protos: vec![] },
        v4([100, 100, 100, 200], &[], &[]),
        v4([168, 63, 129, 16], &[80, 32526], &[PROTO_TCP]),
    ]
}

/// What the first byte asks for: bit 0 clear, an Ethernet frame; set, a packet read at its
/// network header, which the sk_buff calls by the next two bytes' protocol.
pub fn check(data: &[u8]) {
    // Compiled once: the policy is fixed, and compiling it per input cost most of a run.
    static POLICY: std::sync::OnceLock<(Vec<EndpointSpec>, HostTables, Prefilter)> =
        std::sync::OnceLock::new();
    let (eps, t, prefilter) = POLICY.get_or_init(|| {
        let eps = endpoints();
        let Ok(image) = compile(&eps) else { panic!("the fixed policy compiles") };
        let mut t = HostTables::default();
        t.load(&image, GENERATION);
        (eps, t, image.prefilter)
    });
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode & 1 == 0 {
        check_frame(t, prefilter, eps, rest);
    } else {
        let Some((proto, packet)) = rest.split_first_chunk::<2>() else { return };
        let protocol = u16::from_be_bytes(*proto);
        match network_of_packet(packet.first().map(|b| b >> 4), protocol) {
            CARRIES_IPV4 => check_ip(t, prefilter, eps, packet, 0, false),
            CARRIES_IPV6 => check_ip(t, prefilter, eps, packet, 0, true),
            CARRIES_OTHER => assert!(
                protocol != ETH_P_IP && protocol != ETH_P_IPV6,
                "a packet the sk_buff calls IP passed as not IP"
            ),
            _ => {} // unreadable: denied
        }
    }
}

fn check_frame(t: &HostTables, filter: &Prefilter, eps: &[EndpointSpec], f: &[u8]) {
    let n = network_of_frame(f);
    // The plain reading: the first Ethernet type that is not a VLAN tag, however many.
    let mut off = 12;
    let mut tags = 0;
    let ethertype = loop {
        let Some(&[a, b]) = f.get(off..off + 2) else { break None };
        let e = u16::from_be_bytes([a, b]);
        if e != ETH_P_8021Q && e != ETH_P_8021AD {
            break Some(e);
        }
        tags += 1;
        off += 4;
    };
    match n.carries {
        CARRIES_OTHER => assert!(
            tags <= MAX_VLAN_TAGS && !matches!(ethertype, Some(ETH_P_IP | ETH_P_IPV6) | None),
            "an IP frame (or one cut short) passed as not IP: {tags} tags, type {ethertype:?}"
        ),
        CARRIES_IPV4 | CARRIES_IPV6 => {
            assert_eq!(n.l3 as usize, off + 2, "the network header is after the last tag");
            check_ip(t, filter, eps, f, off + 2, n.carries == CARRIES_IPV6);
        }
        _ => {} // unreadable: denied
    }
}

/// Whether the policy protects `addr` for some port and protocol.
fn address_protected(eps: &[EndpointSpec], addr: &Addr) -> bool {
    eps.iter().any(|e| contains(&e.net, addr))
}

/// Whether the policy protects this exact destination.
fn destination_protected(eps: &[EndpointSpec], addr: &Addr, port: u16, proto: u8) -> bool {
    eps.iter().any(|e| {
        contains(&e.net, addr)
            && (e.ports.is_empty() || e.ports.contains(&port))
            && (e.protos.is_empty() || e.protos.contains(&proto))
    })
}

/// The endpoints are all host routes: containment is equality.
fn contains(net: &Net, addr: &Addr) -> bool {
    match *net {
        Net::V4 { addr: a, .. } => *addr == Addr::v4(a),
        Net::V6 { addr: a, .. } => *addr == Addr::v6(a),
    }
}

fn check_ip(
    t: &HostTables,
    filter: &Prefilter,
    eps: &[EndpointSpec],
    f: &[u8],
    l3: usize,
    v6: bool,
) {
    let p = if v6 { parse_ipv6(f, l3) } else { parse_ipv4(f, l3) };
    let verdict = subject(t, Some(GENERATION), &p);
    let Some(h) = f.get(l3..) else { return };
    if !p.readable {
        assert_eq!(verdict, Some(crate::abi::ENDPOINT_NONE));
        return;
    }
    // The destination is the header's (an IPv4-mapped one as the IPv4 address).
    let (addr, fixed_next) = if v6 {
        let mut a = [0u8; 16];
        a.copy_from_slice(&h[24..40]);
        let mapped = a[..10] == [0; 10] && a[10..12] == [0xff, 0xff];
        let addr = if mapped { Addr::v4([a[12], a[13], a[14], a[15]]) } else { Addr::v6(a) };
        (addr, h[6])
    } else {
        (Addr::v4([h[16], h[17], h[18], h[19]]), h[9])
    };
    assert_eq!(p.dst.addr, addr, "the destination read is not the header's");
    // Fragments and source routes the fixed header shows.
    let ihl = usize::from(h[0] & 0x0f) * 4;
    let fragment =
        if v6 { fixed_next == 44 } else { u16::from_be_bytes([h[6], h[7]]) & 0x3fff != 0 };
    assert!(!(fragment && p.complete), "a fragment read as complete: {p:?}");
    let first_option = h.get(20).copied().filter(|_| ihl > 20);
    let routed = if v6 {
        fixed_next == 43 && h.get(43).is_some_and(|&left| left != 0)
    } else {
        matches!(first_option, Some(IPOPT_LSRR | IPOPT_SSRR))
    };
    assert!(!routed || p.routed, "a source route missed: {p:?}");
    // Where the transport header is plain to see, the port read is the one there.
    let l4 = if v6 { (!is_v6_extension(fixed_next)).then_some(40) } else { Some(ihl) };
    if let (true, Some(l4), PROTO_TCP | PROTO_UDP) = (p.complete, l4, p.dst.proto) {
        let port = h.get(l4 + 2..l4 + 4).map(|b| u16::from_be_bytes([b[0], b[1]]));
        assert_eq!(Some(p.dst.port), port, "the port read is not the header's");
        assert_eq!(p.dst.proto, fixed_next);
    }
    // The verdict: never a protected destination passed, never another one stopped.
    if p.routed {
        assert_eq!(
            verdict,
            Some(crate::abi::ENDPOINT_NONE),
            "a routed packet judged by its header"
        );
    } else if !address_protected(eps, &addr) {
        assert_eq!(verdict, None, "an address no endpoint holds was stopped: {p:?}");
    } else if !p.complete {
        assert!(verdict.is_some(), "an unknown transport to a protected address passed: {p:?}");
    } else if destination_protected(eps, &addr, p.dst.port, p.dst.proto) {
        assert!(verdict.is_some(), "a protected destination passed: {p:?}");
    }
    // The fast path is a shortcut: what it passes, the full path passes.
    let fast = if v6 {
        passes_fast_v6(filter, h[0], h[6], h[24], h[39])
    } else {
        passes_fast_v4(filter, h[0], h[16], h[19])
    };
    assert!(!fast || verdict.is_none(), "the fast path passed what the full path stops: {p:?}");
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use proptest::prelude::*;

    use super::check;

    /// The fuzz target's seeds run clean here too, so they stay valid as the parser changes.
    #[test]
    fn seeds_run_clean() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/frame");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).expect("the seed dir") {
            let bytes = std::fs::read(entry.expect("a seed").path()).expect("a seed's bytes");
            check(&bytes);
            n += 1;
        }
        assert!(n >= 8, "{n} seeds");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

        /// Random bytes behind a plausible start: an Ethernet or bare IP header prefix whose
        /// version, tags and protocol are mostly right, the rest anything.
        #[test]
        fn any_bytes_are_read_safely(
            mode in any::<u8>(),
            start in prop_oneof![
                Just(vec![0x08, 0x00, 0x45]),
                Just(vec![0x86, 0xdd, 0x60]),
                Just(vec![0x81, 0x00, 0, 1, 0x86, 0xdd, 0x60]),
                Just(vec![0x88, 0xa8, 0, 1, 0x81, 0x00, 0, 2, 0x08, 0x00, 0x46]),
            ],
            dst in prop_oneof![
                Just(vec![169, 254, 169, 254]),
                Just(vec![100, 100, 100, 200]),
                any::<[u8; 4]>().prop_map(|a| a.to_vec()),
            ],
            tail in proptest::collection::vec(any::<u8>(), 0..120),
        ) {
            let mut data = vec![mode];
            if mode & 1 == 0 {
                data.extend([0u8; 12]);
                data.extend(&start);
            } else {
                data.extend(&start[start.len() - 3..]);
            }
            let header_at = data.len() - 1;
            data.extend(&tail);
            // The destination where an IPv4 header has it.
            if data.len() >= header_at + 20 && data[header_at] >> 4 == 4 {
                data[header_at + 16..header_at + 20].copy_from_slice(&dst);
            }
            check(&data);
        }
    }
}
