//! Program-level tests: the packet programs the agent loaded, run by BPF_PROG_TEST_RUN on
//! hand-built packets, each asserting the program's return code. gate-common's parser and
//! verdicts are unit-tested on the host; these prove the kernel side agrees on the edge
//! cases (truncated headers, IPv4 options and source routes, IPv6 extension chains,
//! fragments, IPv4-mapped addresses, neighbouring addresses), each table with its controls:
//! the same destination on an unprotected port, or a neighbouring address, passes. A run
//! takes microseconds; no packet leaves any interface.
//!
//! Policy (`super::policy`): 169.254.169.254 TCP 80 and UDP 80, fd00:ec2::254 port 80.
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    time::Instant,
};

use integration_tests::{
    frame::{self, ETH_P_8021AD, ETH_P_8021Q, ETH_P_IP, PROTO_TCP, PROTO_UDP},
    net::{IMDS_V4, IMDS_V6, NODE_V4},
    probe::Outcome,
    sys::{in_ci, kernel_version},
    testrun::{Kind, SkbProgram, gate_program_id},
};

use super::Env;

/// gate_egress: pass, drop.
const PASS: u32 = 1;
const DROP: u32 = 0;
/// gate_tc: TC_NEXT (-1), TC_ACT_SHOT.
const TC_NEXT: i32 = -1;
const TC_SHOT: i32 = 2;

/// Shares the protected address's first and last byte, so the fast path's filter cannot
/// tell them apart: the full parse decides.
const NEIGHBOUR_V4: &str = "169.254.168.254";
const NEIGHBOUR_V6: &str = "fd00:ec2::1:254";
const IPPROTO_ESP: u8 = 50;
const IPPROTO_AH: u8 = 51;
const HOP_BY_HOP: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const DSTOPTS: u8 = 60;

fn v4(s: &str) -> Ipv4Addr {
    s.parse().expect("IPv4 address")
}

fn v6(s: &str) -> Ipv6Addr {
    s.parse().expect("IPv6 address")
}

/// IPv4 to `dst` carrying `l4` as `proto`, with `options` (a multiple of 4 bytes) and the
/// flags-and-offset field `frag`.
fn ipv4(dst: &str, proto: u8, frag: u16, options: &[u8], l4: &[u8]) -> Vec<u8> {
    assert!(options.len().is_multiple_of(4) && options.len() <= 40);
    let mut p = frame::ipv4(v4(NODE_V4), v4(dst), proto, 0x4d47, frag, &[options, l4].concat());
    p[0] = 0x45 + (options.len() / 4) as u8;
    p
}

fn udp4(dst: &str, port: u16) -> Vec<u8> {
    frame::udp(&v4(NODE_V4).octets(), &v4(dst).octets(), 40000, port, b"token")
}

fn udp4_to(dst: &str, port: u16) -> Vec<u8> {
    ipv4(dst, PROTO_UDP, 0, &[], &udp4(dst, port))
}

/// A TCP segment to `port` with `flags` and `payload`.
fn tcp(dst: &[u8], port: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut s = frame::tcp_syn(&v4(NODE_V4).octets(), dst, 40001, port, 0, payload);
    s[13] = flags;
    s
}

/// A source-route option (`kind` LSRR or SSRR) naming `hop`, padded with end-of-options.
fn source_route(kind: u8, hop: &str) -> Vec<u8> {
    let mut o = vec![kind, 7, 4];
    o.extend_from_slice(&v4(hop).octets());
    o.push(0);
    o
}

/// IPv6 from fd00:99::2 to `dst`: the extension headers `chain` (each header's bytes from
/// its second byte on; the next-header bytes are filled in), then `l4` as `proto`.
fn ipv6(dst: &str, chain: &[(u8, Vec<u8>)], proto: u8, l4: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    for (i, (_, rest)) in chain.iter().enumerate() {
        body.push(chain.get(i + 1).map_or(proto, |h| h.0));
        body.extend_from_slice(rest);
    }
    body.extend_from_slice(l4);
    let mut h = vec![0x60, 0, 0, 0];
    h.extend_from_slice(&(body.len() as u16).to_be_bytes());
    h.push(chain.first().map_or(proto, |h| h.0));
    h.push(64);
    h.extend_from_slice(&v6("fd00:99::2").octets());
    h.extend_from_slice(&v6(dst).octets());
    [h, body].concat()
}

fn udp6(dst: &str, port: u16) -> Vec<u8> {
    frame::udp(&v6("fd00:99::2").octets(), &v6(dst).octets(), 40000, port, b"token")
}

fn udp6_to(dst: &str, chain: &[(u8, Vec<u8>)], port: u16) -> Vec<u8> {
    ipv6(dst, chain, PROTO_UDP, &udp6(dst, port))
}

/// An 8-byte option header (hop-by-hop, destination options): length 0, one PadN.
fn opts8(kind: u8) -> (u8, Vec<u8>) {
    (kind, vec![0, 1, 4, 0, 0, 0, 0])
}

/// A routing header (type 0) with `left` segments left, naming one address.
fn routing(left: u8) -> (u8, Vec<u8>) {
    let mut r = vec![2, 0, left, 0, 0, 0, 0];
    r.extend_from_slice(&v6(IMDS_V6).octets());
    (ROUTING, r)
}

/// A fragment header at `offset` (8-byte units), more fragments following.
fn fragment(offset: u16) -> (u8, Vec<u8>) {
    let mut f = vec![0];
    f.extend_from_slice(&((offset << 3) | 1).to_be_bytes());
    f.extend_from_slice(&0x4d47u32.to_be_bytes());
    (FRAGMENT, f)
}

/// `packet` behind an Ethernet header (`tags`: VLAN tags), of the IP type its version
/// nibble names.
fn eth(tags: &[(u16, u16)], packet: &[u8]) -> Vec<u8> {
    let ethertype = frame::ethertype_of(packet);
    frame::ethernet([0x02, 0, 0, 0, 0, 0x02], frame::SRC_MAC, tags, ethertype, packet)
}

/// Whether `packet` is too short for its IP header: the kernel's test run rejects such a
/// packet under an IP Ethernet type.
fn cut_short(packet: &[u8]) -> bool {
    packet.len() < if frame::ethertype_of(packet) == ETH_P_IP { 20 } else { 40 }
}

/// For the egress program, which reads the packet by its version nibble whatever the
/// Ethernet type: a packet cut short goes under a local experimental type instead.
fn egress_frame(packet: &[u8]) -> Vec<u8> {
    if !cut_short(packet) {
        return eth(&[], packet);
    }
    frame::ethernet([0x02, 0, 0, 0, 0, 0x02], frame::SRC_MAC, &[], 0x88b5, packet)
}

/// The IP-level cases: name, packet (behind an Ethernet header of the type its version
/// says), whether the gate denies it.
fn ip_cases() -> Vec<(&'static str, Vec<u8>, bool)> {
    let imds4 = v4(IMDS_V4).octets();
    let nb4 = v4(NEIGHBOUR_V4).octets();
    let udp4_53 = udp4(IMDS_V4, 53);
    let nops = [1, 1, 1, 0];
    let mapped = "::ffff:169.254.169.254";
    let dstopts = |n: usize| vec![opts8(DSTOPTS); n];
    let mut cut_udp = udp4_to(IMDS_V4, 53);
    cut_udp.truncate(22);
    cut_udp[2..4].copy_from_slice(&22u16.to_be_bytes());
    let mut ihl4 = udp4_to(IMDS_V4, 53);
    ihl4[0] = 0x44;
    let mut ihl4_nb = udp4_to(NEIGHBOUR_V4, 53);
    ihl4_nb[0] = 0x44;
    let mut version5 = udp4_to(NEIGHBOUR_V4, 53);
    version5[0] = 0x55;
    let hbh_cut = ipv6(IMDS_V6, &[], HOP_BY_HOP, &[]);
    vec![
        // IPv4: the verdict itself.
        ("udp4 to the protected port", udp4_to(IMDS_V4, 80), true),
        ("udp4 to another port of the protected address", udp4_to(IMDS_V4, 53), false),
        ("udp4 to a neighbour's protected port", udp4_to(NEIGHBOUR_V4, 80), false),
        (
            "tcp4 syn to the protected port",
            ipv4(IMDS_V4, PROTO_TCP, 0, &[], &tcp(&imds4, 80, 0x02, b"")),
            true,
        ),
        (
            "tcp4 syn to another port",
            ipv4(IMDS_V4, PROTO_TCP, 0, &[], &tcp(&imds4, 443, 0x02, b"")),
            false,
        ),
        (
            "tcp4 bare reset to the protected port",
            ipv4(IMDS_V4, PROTO_TCP, 0, &[], &tcp(&imds4, 80, 0x04, b"")),
            false,
        ),
        (
            "tcp4 reset carrying data",
            ipv4(IMDS_V4, PROTO_TCP, 0, &[], &tcp(&imds4, 80, 0x04, b"GET /")),
            true,
        ),
        (
            "tcp4 syn to a neighbour",
            ipv4(NEIGHBOUR_V4, PROTO_TCP, 0, &[], &tcp(&nb4, 80, 0x02, b"")),
            false,
        ),
        // IPv4 fragments: judged on the address alone.
        (
            "udp4 first fragment, another port",
            ipv4(IMDS_V4, PROTO_UDP, 0x2000, &[], &udp4_53),
            true,
        ),
        ("udp4 non-first fragment", ipv4(IMDS_V4, PROTO_UDP, 1, &[], &udp4_53[..8]), true),
        (
            "udp4 last fragment (offset, no MF)",
            ipv4(IMDS_V4, PROTO_UDP, 3, &[], &udp4_53[..8]),
            true,
        ),
        (
            "udp4 first fragment to a neighbour",
            ipv4(NEIGHBOUR_V4, PROTO_UDP, 0x2000, &[], &udp4(NEIGHBOUR_V4, 80)),
            false,
        ),
        (
            "udp4 don't-fragment set, another port",
            ipv4(IMDS_V4, PROTO_UDP, 0x4000, &[], &udp4_53),
            false,
        ),
        // IPv4 options: the transport header is read behind them; routes deny.
        (
            "udp4 options, then the protected port",
            ipv4(IMDS_V4, PROTO_UDP, 0, &nops, &udp4(IMDS_V4, 80)),
            true,
        ),
        ("udp4 options, then another port", ipv4(IMDS_V4, PROTO_UDP, 0, &nops, &udp4_53), false),
        (
            "udp4 options to a neighbour",
            ipv4(NEIGHBOUR_V4, PROTO_UDP, 0, &nops, &udp4(NEIGHBOUR_V4, 80)),
            false,
        ),
        (
            "udp4 loose source route via the protected address",
            ipv4(NEIGHBOUR_V4, PROTO_UDP, 0, &source_route(131, IMDS_V4), &udp4(NEIGHBOUR_V4, 53)),
            true,
        ),
        (
            "udp4 strict source route",
            ipv4(NEIGHBOUR_V4, PROTO_UDP, 0, &source_route(137, IMDS_V4), &udp4(NEIGHBOUR_V4, 53)),
            true,
        ),
        (
            "udp4 more options than are walked",
            ipv4(NEIGHBOUR_V4, PROTO_UDP, 0, &[1, 1, 1, 1, 1, 0, 0, 0], &udp4(NEIGHBOUR_V4, 53)),
            true,
        ),
        (
            "udp4 three no-ops, then the end",
            ipv4(NEIGHBOUR_V4, PROTO_UDP, 0, &[1, 1, 1, 0, 0, 0, 0, 0], &udp4(NEIGHBOUR_V4, 53)),
            false,
        ),
        (
            "udp4 an option of length 1",
            ipv4(NEIGHBOUR_V4, PROTO_UDP, 0, &[68, 1, 0, 0], &udp4(NEIGHBOUR_V4, 53)),
            true,
        ),
        (
            "udp4 an option past the header",
            ipv4(NEIGHBOUR_V4, PROTO_UDP, 0, &[68, 12, 5, 0], &udp4(NEIGHBOUR_V4, 53)),
            true,
        ),
        // IPv4 headers that cannot be read in full: fail closed where it matters.
        ("ipv4 header cut at 12 bytes", udp4_to(NEIGHBOUR_V4, 53)[..12].to_vec(), true),
        // (The kernel runs nothing on an empty packet: one byte is the least.)
        ("one byte of an IPv4 header", vec![0x45], true),
        ("version 5", version5, true),
        ("ipv4 header length below 20, protected address", ihl4, true),
        ("ipv4 header length below 20, neighbour", ihl4_nb, false),
        ("udp4 header cut off, protected address", cut_udp, true),
        // IPv6: the verdict, and the extension chain walked.
        ("udp6 to the protected port", udp6_to(IMDS_V6, &[], 80), true),
        ("udp6 to another port", udp6_to(IMDS_V6, &[], 53), false),
        ("udp6 to a neighbour's protected port", udp6_to(NEIGHBOUR_V6, &[], 80), false),
        (
            "udp6 hop-by-hop, then the protected port",
            udp6_to(IMDS_V6, &[opts8(HOP_BY_HOP)], 80),
            true,
        ),
        ("udp6 hop-by-hop, then another port", udp6_to(IMDS_V6, &[opts8(HOP_BY_HOP)], 53), false),
        (
            "udp6 eight destination options, then another port",
            udp6_to(IMDS_V6, &dstopts(8), 53),
            false,
        ),
        (
            "udp6 eight destination options, then the protected port",
            udp6_to(IMDS_V6, &dstopts(8), 80),
            true,
        ),
        (
            "udp6 nine destination options (more than walked)",
            udp6_to(IMDS_V6, &dstopts(9), 53),
            true,
        ),
        (
            "udp6 nine destination options to a neighbour",
            udp6_to(NEIGHBOUR_V6, &dstopts(9), 53),
            false,
        ),
        (
            "udp6 routing header, segments left, to a neighbour",
            udp6_to(NEIGHBOUR_V6, &[routing(1)], 53),
            true,
        ),
        (
            "udp6 routing header after hop-by-hop, segments left",
            udp6_to(NEIGHBOUR_V6, &[opts8(HOP_BY_HOP), routing(1)], 53),
            true,
        ),
        ("udp6 routing header, no segments left", udp6_to(NEIGHBOUR_V6, &[routing(0)], 53), false),
        ("udp6 first fragment, another port", udp6_to(IMDS_V6, &[fragment(0)], 53), true),
        (
            "udp6 non-first fragment",
            ipv6(IMDS_V6, &[fragment(1)], PROTO_UDP, &udp6(IMDS_V6, 53)[..8]),
            true,
        ),
        ("udp6 fragment to a neighbour", udp6_to(NEIGHBOUR_V6, &[fragment(0)], 80), false),
        (
            "udp6 authentication header, then the protected port",
            udp6_to(IMDS_V6, &[(IPPROTO_AH, vec![1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])], 80),
            true,
        ),
        (
            "udp6 authentication header, then another port",
            udp6_to(IMDS_V6, &[(IPPROTO_AH, vec![1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])], 53),
            false,
        ),
        ("esp6 to the protected address", ipv6(IMDS_V6, &[], IPPROTO_ESP, &[0; 16]), true),
        ("esp6 to a neighbour", ipv6(NEIGHBOUR_V6, &[], IPPROTO_ESP, &[0; 16]), false),
        ("ipv6 header cut at 30 bytes", udp6_to(NEIGHBOUR_V6, &[], 53)[..30].to_vec(), true),
        ("ipv6 hop-by-hop header cut off, protected address", hbh_cut, true),
        // IPv4-mapped IPv6: judged as the IPv4 address.
        ("udp6 to the IPv4-mapped protected port", udp6_to(mapped, &[], 80), true),
        ("udp6 to another port of the IPv4-mapped address", udp6_to(mapped, &[], 53), false),
        ("udp6 to an IPv4-mapped neighbour", udp6_to("::ffff:169.254.168.254", &[], 80), false),
        (
            "udp6 to the IPv4-compatible form (not mapped)",
            udp6_to("::169.254.169.254", &[], 80),
            false,
        ),
    ]
}

/// The pinned gate of this build's ABI: the one `v<N>` dir under the agent's pin dir.
fn versioned(env: &Env) -> PathBuf {
    std::fs::read_dir(&env.agent().pin_dir)
        .expect("pin dir")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('v')))
        .expect("a v<ABI> dir")
}

/// Every IP-level case through the egress program the agent attached, from this process
/// (outside the allow set): denied ones dropped, the rest passed.
#[test]
fn egress_program_decides_every_parser_edge_as_the_host_does() {
    privileged!(egress_program_decides_every_parser_edge_as_the_host_does);
    let env = Env::with_agent("enforce");
    let egress = SkbProgram::from_pin(&versioned(&env).join("progs/egress"), Kind::Egress)
        .expect("the pinned egress program");
    let cases = ip_cases();
    let started = Instant::now();
    let mut wrong = Vec::new();
    for (name, packet, denied) in &cases {
        let code =
            egress.run(&egress_frame(packet), 1).unwrap_or_else(|e| panic!("{name}: {e:#}")).code;
        let want = if *denied { DROP } else { PASS };
        if code != want {
            wrong.push(format!("{name}: returned {code}, expected {want}"));
        }
    }
    eprintln!("{} cases in {:?}", cases.len(), started.elapsed());
    assert!(wrong.is_empty(), "the egress program disagrees:\n{}", wrong.join("\n"));
}

/// `probe test-run` from `cgroup`: the codes the program returned on `frames`.
fn run_from(env: &Env, cgroup: &str, kind: &str, id: u32, frames: &[Vec<u8>]) -> Vec<i32> {
    let hex: Vec<String> = frames.iter().map(|f| frame::to_hex(f)).collect();
    let o: Outcome = env.probe(cgroup, &["test-run", kind, &id.to_string(), &hex.join(",")]);
    assert!(o.ok, "test-run from {cgroup}: {o:?}");
    let reply = o.reply.unwrap_or_default();
    reply.split(',').map(|c| c.parse().unwrap_or_else(|_| panic!("code {c:?}"))).collect()
}

/// From 5.15 on, the socket a test run's packet carries belongs to the caller's cgroup
/// (before, to the root cgroup): only then can a run stand for a gated or allowed workload.
fn test_run_has_the_callers_cgroup() -> bool {
    kernel_version() >= (5, 15)
}

/// The node-level program on Ethernet frames of a gated workload's socket: the Ethernet
/// layer (VLAN tags, truncation, other types) and the IP cases; and the same frames from an
/// allowed workload and from outside the gated root, which pass.
#[test]
fn tc_program_reads_ethernet_and_ip_edges_and_the_callers_cgroup() {
    privileged!(tc_program_reads_ethernet_and_ip_edges_and_the_callers_cgroup);
    if !test_run_has_the_callers_cgroup() {
        // Not in CI: xtask/src/kernels.rs runs this test on 6.1 and later only, and a skip
        // there would be a pass that proved nothing.
        assert!(!in_ci(), "a test run's socket has the caller's cgroup from 5.15 on only");
        eprintln!("skipped: a test run's socket has the caller's cgroup from 5.15 on");
        return;
    }
    let env = Env::with_agent("enforce");
    let dir = versioned(&env);
    let tc = gate_program_id(&dir, "gate_tc").expect("the gate's tc program");
    let egress = aya::programs::ProgramInfo::from_pin(dir.join("progs/egress"))
        .expect("the pinned egress program")
        .id();
    let imds = udp4_to(IMDS_V4, 80);
    let other = udp4_to(IMDS_V4, 53);
    let q = (ETH_P_8021Q, 7);
    let ad = (ETH_P_8021AD, 8);
    let mut cut_tag = eth(&[q], &imds);
    cut_tag.truncate(17);
    let mut arp = eth(&[], &imds);
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    let mut lying = eth(&[], &udp6_to(IMDS_V6, &[], 80));
    lying[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
    let mut frames: Vec<(&str, Vec<u8>, bool)> = vec![
        ("udp4 to the protected port", eth(&[], &imds), true),
        ("udp4 to another port", eth(&[], &other), false),
        ("one 802.1Q tag", eth(&[q], &imds), true),
        ("802.1ad and 802.1Q tags", eth(&[ad, q], &imds), true),
        ("two tags, another port", eth(&[ad, q], &other), false),
        ("three tags (more than are skipped)", eth(&[ad, q, q], &other), true),
        ("a tag cut off", cut_tag, true),
        ("one byte after a tag, IPv4 type", eth(&[q], &[0x45]), true),
        ("ARP type", arp, false),
        ("IPv6 packet under the IPv4 type", lying, true),
    ];
    // The tc program reads the Ethernet type from the frame: a packet cut short goes behind
    // a VLAN tag, which the kernel's test run does not look past.
    let tagged = |p: &[u8]| if cut_short(p) { eth(&[q], p) } else { eth(&[], p) };
    frames.extend(ip_cases().into_iter().map(|(n, p, r)| (n, tagged(&p), r)));
    let bytes: Vec<Vec<u8>> = frames.iter().map(|f| f.1.clone()).collect();
    let started = Instant::now();
    let gated = run_from(&env, "gated/pod-a", "tc", tc, &bytes);
    eprintln!("{} frames in {:?} (one probe)", frames.len(), started.elapsed());
    let wrong: Vec<String> = frames
        .iter()
        .zip(&gated)
        .filter(|((_, _, denied), code)| **code != if *denied { TC_SHOT } else { TC_NEXT })
        .map(|((name, _, denied), code)| format!("{name}: returned {code}, denied: {denied}"))
        .collect();
    assert!(wrong.is_empty(), "the tc program disagrees (gated workload):\n{}", wrong.join("\n"));
    // The same frames from an allowed workload and from outside the gated root: none denied.
    for cgroup in ["gated/cloud-agent", "outside"] {
        let codes = run_from(&env, cgroup, "tc", tc, &bytes);
        assert!(codes.iter().all(|c| *c == TC_NEXT), "tc from {cgroup}: {codes:?}");
    }
    // The egress program: the allow set lets the allowed workload through, not the gated one.
    let pair = [eth(&[], &imds), eth(&[], &udp4_to(NEIGHBOUR_V4, 80))];
    assert_eq!(run_from(&env, "gated/pod-a", "egress", egress, &pair), [0, 1], "gated");
    assert_eq!(run_from(&env, "gated/cloud-agent", "egress", egress, &pair), [1, 1], "allowed");
}
