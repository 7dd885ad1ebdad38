//! Frames built byte by byte: what the parser reads, and the safety property that matters —
//! a packet bound for a protected endpoint is never read as bound elsewhere.
use proptest::prelude::*;

use super::*;
use crate::{
    abi::{PROTO_TCP, PROTO_UDP},
    compile::{EndpointSpec, HostTables, Net, compile},
    verdict::{Addr, Dst},
};

const IMDS: [u8; 4] = [169, 254, 169, 254];
const IMDS6: [u8; 16] = [0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54];

fn tcp(dport: u16, flags: u8, data: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 20];
    h[0..2].copy_from_slice(&40000u16.to_be_bytes());
    h[2..4].copy_from_slice(&dport.to_be_bytes());
    h[12] = 5 << 4;
    h[13] = flags;
    h.extend_from_slice(data);
    h
}

fn udp(dport: u16, data: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 8];
    h[0..2].copy_from_slice(&40000u16.to_be_bytes());
    h[2..4].copy_from_slice(&dport.to_be_bytes());
    h[4..6].copy_from_slice(&((8 + data.len()) as u16).to_be_bytes());
    h.extend_from_slice(data);
    h
}

/// IPv4 with `options` words of options and the fragment field `frag`.
fn ipv4(dst: [u8; 4], proto: u8, options: usize, frag: u16, payload: &[u8]) -> Vec<u8> {
    let ihl = 5 + options;
    let mut h = vec![0u8; ihl * 4];
    h[0] = 0x40 | ihl as u8;
    h[2..4].copy_from_slice(&((ihl * 4 + payload.len()) as u16).to_be_bytes());
    h[6..8].copy_from_slice(&frag.to_be_bytes());
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&[10, 0, 0, 2]);
    h[16..20].copy_from_slice(&dst);
    h.extend_from_slice(payload);
    h
}

/// IPv6 with a chain of extension headers (type, length in 8-byte units beyond the first)
/// before `proto`.
fn ipv6(dst: [u8; 16], chain: &[(u8, u8)], proto: u8, payload: &[u8]) -> Vec<u8> {
    let mut ext = Vec::new();
    for (i, &(_, len)) in chain.iter().enumerate() {
        let next = chain.get(i + 1).map_or(proto, |n| n.0);
        let mut e = vec![0u8; (usize::from(len) + 1) * 8];
        e[0] = next;
        e[1] = len;
        // Pad1/PadN options are zeros; an all-zero body is valid padding.
        ext.extend_from_slice(&e);
    }
    let mut h = vec![0u8; 40];
    h[0] = 0x60;
    h[4..6].copy_from_slice(&((ext.len() + payload.len()) as u16).to_be_bytes());
    h[6] = chain.first().map_or(proto, |c| c.0);
    h[7] = 64;
    h[24..40].copy_from_slice(&dst);
    h.extend_from_slice(&ext);
    h.extend_from_slice(payload);
    h
}

fn eth(tags: &[u16], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 12];
    for &tpid in tags {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&[0, 7]);
    }
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn parse_frame(f: &[u8]) -> Option<Parsed> {
    let n = network_of_frame(f);
    let p = match n.carries {
        CARRIES_IPV4 => parse_ipv4(f, n.l3 as usize),
        CARRIES_IPV6 => parse_ipv6(f, n.l3 as usize),
        _ => return None,
    };
    p.readable.then_some(p)
}

fn v4(f: &[u8]) -> Option<Parsed> {
    let p = parse_ipv4(f, 0);
    p.readable.then_some(p)
}

fn v6(f: &[u8]) -> Option<Parsed> {
    let p = parse_ipv6(f, 0);
    p.readable.then_some(p)
}

#[test]
fn ethertype_comes_from_the_frame_after_vlan_tags() {
    let ip = ipv4(IMDS, PROTO_TCP, 0, 0, &tcp(80, 0x02, b""));
    let net = |f: &[u8]| {
        let n = network_of_frame(f);
        (n.carries, n.l3)
    };
    assert_eq!(net(&eth(&[], ETH_P_IP, &ip)), (CARRIES_IPV4, 14));
    assert_eq!(net(&eth(&[ETH_P_8021Q], ETH_P_IP, &ip)), (CARRIES_IPV4, 18));
    assert_eq!(net(&eth(&[ETH_P_8021AD, ETH_P_8021Q], ETH_P_IPV6, &ip)), (CARRIES_IPV6, 22));
    // Three tags: more than we skip, so unreadable (the programs fail closed on it).
    let three = eth(&[ETH_P_8021AD, ETH_P_8021Q, ETH_P_8021Q], ETH_P_IP, &ip);
    assert_eq!(net(&three).0, CARRIES_UNREADABLE);
    assert_eq!(net(&eth(&[], 0x0806, b"arp")).0, CARRIES_OTHER);
    assert_eq!(net(&[0u8; 13]).0, CARRIES_UNREADABLE);
    let p = parse_frame(&eth(&[ETH_P_8021Q], ETH_P_IP, &ip)).unwrap();
    assert_eq!(p.dst, Dst { addr: Addr::v4(IMDS), port: 80, proto: PROTO_TCP });
    assert!(p.complete && !p.rst);
}

#[test]
fn ipv4_fragments_options_and_truncation() {
    let seg = tcp(80, 0x02, b"GET");
    let p = v4(&ipv4(IMDS, PROTO_TCP, 3, 0, &seg)[..]).unwrap();
    assert_eq!((p.dst.port, p.complete), (80, true));
    // MF set (first fragment) and a later fragment: address only.
    for frag in [0x2000u16, 0x0010] {
        let p = v4(&ipv4(IMDS, PROTO_TCP, 0, frag, &seg)[..]).unwrap();
        assert!(!p.complete, "fragment {frag:#x}");
    }
    // The transport header cut off: address only.
    let p = v4(&ipv4(IMDS, PROTO_TCP, 0, 0, &seg[..2])[..]).unwrap();
    assert!(!p.complete);
    // The IP header itself cut off, or not IPv4 at all: unreadable.
    assert_eq!(v4(&ipv4(IMDS, PROTO_TCP, 0, 0, &seg)[..19]), None);
    let mut v6 = ipv4(IMDS, PROTO_TCP, 0, 0, &seg);
    v6[0] = 0x65;
    assert_eq!(v4(&v6[..]), None);
    // ICMP has no port: complete, port 0.
    let p = v4(&ipv4(IMDS, 1, 0, 0, b"ping")[..]).unwrap();
    assert_eq!((p.dst.port, p.dst.proto, p.complete), (0, 1, true));
}

#[test]
fn tcp_reset_without_payload() {
    let p = v4(&ipv4(IMDS, PROTO_TCP, 0, 0, &tcp(80, 0x04, b""))[..]).unwrap();
    assert!(p.rst);
    let p = v4(&ipv4(IMDS, PROTO_TCP, 0, 0, &tcp(80, 0x04, b"x"))[..]).unwrap();
    assert!(!p.rst, "a reset carrying data is not bare");
}

#[test]
fn ipv6_extension_chains() {
    let seg = udp(80, b"x");
    for n in 0..=MAX_V6_EXT_HEADERS {
        let chain = vec![(60u8, 0u8); n];
        let p = v6(&ipv6(IMDS6, &chain, PROTO_UDP, &seg)[..]).unwrap();
        assert_eq!((p.dst.port, p.dst.proto, p.complete), (80, PROTO_UDP, true), "{n} headers");
    }
    // The most we walk is still read; one more, and 30, leave the transport unknown.
    let chain = vec![(60u8, 0u8); MAX_V6_EXT_HEADERS];
    assert!(v6(&ipv6(IMDS6, &chain, PROTO_UDP, &seg)[..]).unwrap().complete);
    for n in [MAX_V6_EXT_HEADERS + 1, 30] {
        let chain = vec![(60u8, 0u8); n];
        let p = v6(&ipv6(IMDS6, &chain, PROTO_UDP, &seg)[..]).unwrap();
        assert!(!p.complete, "{n} headers");
        assert_eq!(p.dst.addr, Addr::v6(IMDS6));
    }
    // A fragment header: address only.
    let p = v6(&ipv6(IMDS6, &[(44, 0)], PROTO_UDP, &seg)[..]).unwrap();
    assert!(!p.complete);
    // An extension header running off the end.
    let mut cut = ipv6(IMDS6, &[(0, 4)], PROTO_TCP, &tcp(80, 2, b""));
    cut.truncate(44);
    assert!(!v6(&cut[..]).unwrap().complete);
    // IPv4-mapped destinations read as IPv4.
    let mut mapped = [0u8; 16];
    mapped[10..12].copy_from_slice(&[0xff, 0xff]);
    mapped[12..].copy_from_slice(&IMDS);
    let p = v6(&ipv6(mapped, &[], PROTO_TCP, &tcp(80, 2, b""))[..]).unwrap();
    assert_eq!(p.dst.addr, Addr::v4(IMDS));
}

/// IPv4 with the given raw option bytes (padded with end-of-options to a word).
fn ipv4_opts(dst: [u8; 4], opts: &[u8], payload: &[u8]) -> Vec<u8> {
    let words = opts.len().div_ceil(4);
    let mut ip = ipv4(dst, PROTO_UDP, words, 0, payload);
    ip[20..20 + opts.len()].copy_from_slice(opts);
    ip
}

#[test]
fn ipv4_source_routes_fail_closed() {
    let dgram = udp(80, b"x");
    let neighbour = [10, 0, 0, 9];
    // A loose source route through the neighbour to the metadata service.
    let lsrr = [IPOPT_LSRR, 7, 4, 169, 254, 169, 254];
    let p = v4(&ipv4_opts(neighbour, &lsrr, &dgram)).unwrap();
    assert!(p.routed && !p.judgeable(), "{p:?}");
    assert_eq!((p.dst.addr, p.dst.port, p.complete), (Addr::v4(neighbour), 80, true));
    // Strict, after no-ops.
    let ssrr = [1, 1, IPOPT_SSRR, 7, 4, 169, 254, 169, 254];
    assert!(v4(&ipv4_opts(neighbour, &ssrr, &dgram)).unwrap().routed);
    // Record route and a timestamp are no route; nor are options that end early.
    let rr = [7, 7, 4, 0, 0, 0, 0, 0, IPOPT_LSRR];
    assert!(!v4(&ipv4_opts(neighbour, &rr[..8], &dgram)).unwrap().routed);
    let eol_first = [0, IPOPT_LSRR, 7, 4, 1, 2, 3, 4];
    assert!(!v4(&ipv4_opts(neighbour, &eol_first, &dgram)).unwrap().routed);
    // What cannot be walked is taken for a route: a length below 2, one past the header.
    assert!(v4(&ipv4_opts(neighbour, &[68, 1, 0, 0], &dgram)).unwrap().routed);
    assert!(v4(&ipv4_opts(neighbour, &[68, 12, 0, 0], &dgram)).unwrap().routed);
    // More options than we walk: taken for a route, however harmless (no-ops cannot pad a
    // route out of sight); as many as we walk, and the end, are read.
    let nops = [1u8; MAX_IPV4_OPTIONS + 1];
    assert!(v4(&ipv4_opts(neighbour, &nops, &dgram)).unwrap().routed);
    let mut padded = vec![1u8; MAX_IPV4_OPTIONS - 1];
    padded.extend_from_slice(&lsrr);
    assert!(v4(&ipv4_opts(neighbour, &padded, &dgram)).unwrap().routed);
    let nops = [1u8; MAX_IPV4_OPTIONS];
    assert!(!v4(&ipv4_opts(neighbour, &nops, &dgram)).unwrap().routed);
    let words = [1u8, 1, 1, 0];
    assert!(!v4(&ipv4_opts(neighbour, &words, &dgram)).unwrap().routed);
    // A source route in a fragment: still routed.
    let mut frag = ipv4_opts(neighbour, &lsrr, &dgram);
    frag[6] = 0x20;
    assert!(v4(&frag).unwrap().routed);
    // No options: no route.
    let plain = ipv4(neighbour, PROTO_UDP, 0, 0, &dgram);
    assert!(!v4(&plain).unwrap().routed);
}

#[test]
fn ipv6_routing_headers_fail_closed() {
    let dgram = udp(80, b"x");
    let neighbour: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];
    // A routing header (segment routing, type 4) with one segment left.
    let mut ip = ipv6(neighbour, &[(60, 0), (43, 2)], PROTO_UDP, &dgram);
    ip[40 + 8 + 2] = 4;
    ip[40 + 8 + 3] = 1;
    let p = v6(&ip).unwrap();
    assert!(p.routed && p.complete, "{p:?}");
    assert_eq!(p.dst.port, 80);
    // Segments left 0: the route is done, the destination is the last stop.
    ip[40 + 8 + 3] = 0;
    assert!(!v6(&ip).unwrap().routed);
}

#[test]
fn fast_path_passes_only_what_the_full_path_passes() {
    let t = tables();
    let filter = {
        let mut f = crate::abi::Prefilter::default();
        f.add(false, &IMDS, 32);
        f.add(true, &IMDS6, 128);
        f
    };
    let dgram = udp(80, b"x");
    // IPv4: the DNS neighbour passes on the fast path; the service, a header with options,
    // a wrong version do not (the full path decides them).
    let h = ipv4([169, 254, 169, 253], PROTO_UDP, 0, 0, &dgram);
    assert!(passes_fast_v4(&filter, h[0], h[16], h[19]));
    let h = ipv4(IMDS, PROTO_UDP, 0, 0, &dgram);
    assert!(!passes_fast_v4(&filter, h[0], h[16], h[19]));
    let h = ipv4([10, 0, 0, 1], PROTO_UDP, 1, 0, &dgram);
    assert!(!passes_fast_v4(&filter, h[0], h[16], h[19]));
    assert!(!passes_fast_v4(&filter, 0x65, 10, 1));
    // IPv6: an unprotected address passes; the service, a chain that may hold a route, an
    // address that may be IPv4-mapped, a wrong version do not.
    let mut other = IMDS6;
    other[15] = 0x53;
    let h = ipv6(other, &[], PROTO_UDP, &dgram);
    assert!(passes_fast_v6(&filter, h[0], h[6], h[24], h[39]));
    let h = ipv6(IMDS6, &[], PROTO_UDP, &dgram);
    assert!(!passes_fast_v6(&filter, h[0], h[6], h[24], h[39]));
    // Any extension header: a routing header may come behind it (the fuzzer found one
    // behind shim6, 140, that the fast path passed and the full path judged routed).
    for next in [0u8, 43, 44, 50, 51, 60, 135, 139, 140, 253, 254] {
        assert!(!passes_fast_v6(&filter, 0x60, next, 0xfd, 0x53), "next header {next}");
    }
    let mut h = ipv6(other, &[(140, 0), (43, 0)], PROTO_UDP, &dgram);
    h[40 + 8 + 3] = 1; // the routing header's segments left
    assert!(v6(&h).unwrap().routed, "a route behind shim6 is seen");
    assert!(!passes_fast_v6(&filter, h[0], h[6], h[24], h[39]));
    assert!(!passes_fast_v6(&filter, 0x60, PROTO_UDP, 0, 0xfe), "may be IPv4-mapped");
    assert!(!passes_fast_v6(&filter, 0x40, PROTO_UDP, 0xfd, 0x53));
    // Whatever the fast path passes, the full path passes too (it is only a shortcut).
    for (dst, opts) in
        [([10u8, 0, 0, 1], 0usize), ([169, 254, 169, 253], 0), ([169, 254, 1, 254], 0)]
    {
        let h = ipv4(dst, PROTO_UDP, opts, 0, &dgram);
        if passes_fast_v4(&filter, h[0], h[16], h[19]) {
            assert_eq!(subject(&t, Some(0), &v4(&h).unwrap()), None, "{dst:?}");
        }
    }
}

proptest! {
    /// The fast path never passes what the full path would judge: for any IPv4 or IPv6
    /// header bytes, a fast pass means the full parse finds no protected endpoint.
    #[test]
    fn fast_path_is_a_shortcut(v6 in any::<bool>(), dst in any::<[u8; 16]>(), b0 in any::<u8>(),
                               next in prop_oneof![Just(0u8), Just(43), Just(60), Just(6), Just(17), any::<u8>()],
                               near in any::<bool>()) {
        let t = tables();
        let mut filter = crate::abi::Prefilter::default();
        filter.add(false, &IMDS, 32);
        filter.add(true, &IMDS6, 128);
        let dgram = udp(80, b"x");
        if v6 {
            let mut d = dst;
            if near { d[..15].copy_from_slice(&IMDS6[..15]); }
            let mut h = ipv6(d, &[], next, &dgram);
            h[0] = b0;
            if passes_fast_v6(&filter, h[0], h[6], h[24], h[39]) {
                let p = parse_ipv6(&h[..], 0);
                prop_assert_eq!(subject(&t, Some(0), &p), None);
            }
        } else {
            let mut d = [dst[0], dst[1], dst[2], dst[3]];
            if near { d[..3].copy_from_slice(&IMDS[..3]); }
            let mut h = ipv4(d, PROTO_TCP, 0, 0, &tcp(80, 2, b""));
            h[0] = b0;
            if passes_fast_v4(&filter, h[0], h[16], h[19]) {
                let p = parse_ipv4(&h[..], 0);
                prop_assert_eq!(subject(&t, Some(0), &p), None);
            }
        }
    }
}

/// The AWS-like policy the property below judges against: TCP 80 on the IPv4 address, any
/// protocol on port 80 of the IPv6 one; port 53 stays open.
fn tables() -> HostTables {
    let eps = [
        EndpointSpec {
            net: Net::V4 { addr: IMDS, len: 32 },
            ports: vec![80],
            protos: vec![PROTO_TCP],
        },
        EndpointSpec { net: Net::V6 { addr: IMDS6, len: 128 }, ports: vec![80], protos: vec![] },
    ];
    let mut t = HostTables::default();
    t.load(&compile(&eps).expect("compiles"), 0);
    t
}

#[derive(Clone, Debug)]
struct Sent {
    v6: bool,
    proto: u8,
    port: u16,
    ext: Vec<u8>,
    options: usize,
    frag: u16,
    tags: Vec<u16>,
    cut: usize,
}

fn arb_sent() -> impl Strategy<Value = Sent> {
    (
        any::<bool>(),
        prop_oneof![Just(PROTO_TCP), Just(PROTO_UDP), Just(1u8), Just(58u8), any::<u8>()],
        prop_oneof![Just(80u16), Just(53), any::<u16>()],
        proptest::collection::vec(
            prop_oneof![Just(0u8), Just(43), Just(60), Just(44), Just(51), Just(135)],
            0..34,
        ),
        0usize..11,
        prop_oneof![Just(0u16), Just(0x2000), Just(0x0001), any::<u16>()],
        proptest::collection::vec(prop_oneof![Just(ETH_P_8021Q), Just(ETH_P_8021AD)], 0..4),
        0usize..200,
    )
        .prop_filter("an extension header is no upper-layer protocol", |(v6, proto, ..)| {
            !(*v6 && is_v6_extension(*proto))
        })
        .prop_map(|(v6, proto, port, ext, options, frag, tags, cut)| Sent {
            v6,
            proto,
            port,
            ext,
            options,
            frag,
            tags,
            cut,
        })
}

fn build(s: &Sent) -> Vec<u8> {
    let l4 = match s.proto {
        PROTO_TCP => tcp(s.port, 0x18, b"GET / HTTP/1.0\r\n\r\n"),
        PROTO_UDP => udp(s.port, b"query"),
        _ => b"opaque payload".to_vec(),
    };
    let ip = if s.v6 {
        // AH is (len + 2) * 4 bytes: len 0 gives 8, the same as the others' (0 + 1) * 8.
        let chain: Vec<(u8, u8)> = s.ext.iter().map(|&t| (t, 0)).collect();
        ipv6(IMDS6, &chain, s.proto, &l4)
    } else {
        ipv4(IMDS, s.proto, s.options, s.frag, &l4)
    };
    let ethertype = if s.v6 { ETH_P_IPV6 } else { ETH_P_IP };
    let mut f = eth(&s.tags, ethertype, &ip);
    let keep = f.len().saturating_sub(s.cut % f.len().max(1));
    f.truncate(keep);
    f
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    /// No false negative: whatever the frame's shape (VLAN tags, IPv4 options, fragments,
    /// extension chains of any length, truncation), a frame bound for a protected endpoint is
    /// judged protected, or it could not be read at all (which the programs also deny).
    /// When the parser says it read the transport, it read it right.
    #[test]
    fn protected_destinations_are_never_missed(s in arb_sent()) {
        let t = tables();
        let frame = build(&s);
        // IPv6: port 80 of any protocol that has ports; IPv4: TCP port 80.
        let truth_protected = s.port == 80
            && if s.v6 { matches!(s.proto, PROTO_TCP | PROTO_UDP) } else { s.proto == PROTO_TCP };
        match parse_frame(&frame) {
            None => {} // unreadable: denied as if protected
            Some(p) => {
                if p.complete {
                    let fragmented = if s.v6 { s.ext.contains(&44) } else { s.frag & 0x3fff != 0 };
                    prop_assert!(!fragmented, "a fragment read as complete");
                    prop_assert_eq!(p.dst.proto, s.proto);
                    if matches!(s.proto, PROTO_TCP | PROTO_UDP) {
                        prop_assert_eq!(p.dst.port, s.port);
                    }
                }
                let hit = subject(&t, Some(0), &p).is_some();
                if truth_protected {
                    prop_assert!(hit, "protected frame judged unprotected: {:?}", p);
                }
                if !p.complete {
                    prop_assert!(hit, "an unreadable transport to a protected address must be judged on the address");
                }
            }
        }
    }
}

#[test]
fn packets_without_an_ethernet_header_by_their_version_nibble() {
    let ip = ipv4(IMDS, PROTO_TCP, 0, 0, &tcp(80, 0x02, b""));
    let carries = |p: &[u8], proto| network_of_packet(p.first().map(|b| b >> 4), proto);
    assert_eq!(carries(&ip, ETH_P_IP), CARRIES_IPV4);
    // The header decides, whatever the sk_buff's protocol says (a tun's packet information).
    assert_eq!(carries(&ip, 0x0806), CARRIES_IPV4);
    assert_eq!(carries(&[0x60; 40], 0), CARRIES_IPV6);
    // Called IP, not IP at the network header (or nothing there): unreadable, denied.
    assert_eq!(carries(&[0x00; 20], ETH_P_IP), CARRIES_UNREADABLE);
    assert_eq!(carries(&[], ETH_P_IPV6), CARRIES_UNREADABLE);
    // IPoIB's ARP, MPLS with a label not starting 4 or 6: not IP.
    assert_eq!(carries(&[0x00, 0x20], 0x0806), CARRIES_OTHER);
    assert_eq!(carries(&[], 0x8847), CARRIES_OTHER);
}

proptest! {
    /// A packet the sk_buff calls IP is never passed as "not IP", whatever its bytes; a
    /// header that says IP is read as IP whatever the sk_buff calls it.
    #[test]
    fn an_ip_packet_is_never_other(nibble in proptest::option::of(0u8..16), proto in any::<u16>()) {
        let c = network_of_packet(nibble, proto);
        if proto == ETH_P_IP || proto == ETH_P_IPV6 {
            prop_assert_ne!(c, CARRIES_OTHER);
        }
        if matches!(nibble, Some(4 | 6)) {
            prop_assert!(c == CARRIES_IPV4 || c == CARRIES_IPV6);
        }
    }
}

#[test]
fn packet_subject_fails_closed() {
    let t = HostTables::default();
    let dst = Dst { addr: Addr::v4([10, 0, 0, 1]), port: 80, proto: 6 };
    let p = Parsed::complete(dst);
    // Nothing protected in the tables: the packet passes.
    assert_eq!(subject(&t, Some(0), &p), None);
    // No generation, an unreadable packet, a source route: judged as if protected.
    assert_eq!(subject(&t, None, &p), Some(ENDPOINT_NONE));
    assert_eq!(subject(&t, Some(0), &Parsed::UNREADABLE), Some(ENDPOINT_NONE));
    let routed = Parsed { routed: true, ..p };
    assert_eq!(subject(&t, Some(0), &routed), Some(ENDPOINT_NONE));
}
