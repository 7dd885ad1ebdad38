//! The sock_diag wire format against hand-built kernel messages, and one read-only dump of
//! the running kernel. `sockid`, `v4` and `mapped` also build the scan tests' sockets.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use gate_common::abi::{PROTO_TCP, PROTO_UDP};
use netlink_packet_core::{NLMSG_DONE, NLMSG_ERROR};

use super::*;
use crate::netlink::{encode, read_reply, tests::frame};

/// A netlink attribute (`struct nlattr` + data, padded to 4 bytes) as the kernel builds it.
fn attr(ty: u16, data: &[u8]) -> Vec<u8> {
    let mut v = ((4 + data.len()) as u16).to_ne_bytes().to_vec();
    v.extend_from_slice(&ty.to_ne_bytes());
    v.extend_from_slice(data);
    v.resize((v.len() + 3) & !3, 0);
    v
}

pub(crate) fn sockid(src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> SocketId {
    let mut cookie = [0; 8];
    cookie[..4].copy_from_slice(&0x1234u32.to_ne_bytes());
    cookie[4..].copy_from_slice(&0x5678u32.to_ne_bytes());
    SocketId {
        source_port: sport,
        destination_port: dport,
        source_address: src,
        destination_address: dst,
        interface_id: 0,
        cookie,
    }
}

pub(crate) fn v4(a: [u8; 4]) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(a))
}

pub(crate) fn mapped(a: [u8; 4]) -> IpAddr {
    IpAddr::V6(Ipv4Addr::from(a).to_ipv6_mapped())
}

/// The `struct inet_diag_sockid` bytes of `id`, as the kernel fills them in.
fn sockid_bytes(id: &SocketId) -> Vec<u8> {
    let addr = |a: IpAddr| match a {
        IpAddr::V4(a) => {
            let mut o = [0; 16];
            o[..4].copy_from_slice(&a.octets());
            o
        }
        IpAddr::V6(a) => a.octets(),
    };
    let mut out = id.source_port.to_be_bytes().to_vec();
    out.extend_from_slice(&id.destination_port.to_be_bytes());
    out.extend_from_slice(&addr(id.source_address));
    out.extend_from_slice(&addr(id.destination_address));
    out.extend_from_slice(&id.interface_id.to_ne_bytes());
    out.extend_from_slice(&id.cookie);
    out
}

/// A SOCK_DIAG_BY_FAMILY reply message as the kernel builds it.
fn sock_msg(seq: u32, family: u8, id: SocketId, attrs: &[Vec<u8>]) -> Vec<u8> {
    // family, state (ESTABLISHED), timer, retrans; the id; expires, queues, uid, inode.
    let mut body = vec![family, 1, 0, 0];
    body.extend(sockid_bytes(&id));
    body.extend([0; 16]);
    body.extend_from_slice(&4242u32.to_ne_bytes());
    assert_eq!(body.len(), MSG_LEN);
    for a in attrs {
        body.extend_from_slice(a);
    }
    frame(SOCK_DIAG_BY_FAMILY, seq, &body)
}

fn done(seq: u32, errno: i32) -> Vec<u8> {
    frame(NLMSG_DONE, seq, &(-errno).to_ne_bytes())
}

fn error(seq: u32, errno: i32) -> Vec<u8> {
    let mut payload = (-errno).to_ne_bytes().to_vec();
    payload.extend(&frame(netlink_packet_sock_diag::SOCK_DESTROY, seq, &[0; 56])[..16]);
    frame(NLMSG_ERROR, seq, &payload)
}

/// What one received datagram of a dump holds: the sockets, and `Some(errno)` once the dump
/// ended (0 = done).
fn parse_dump(buf: &[u8], seq: u32) -> Result<(Vec<DiagSock>, Option<i32>), NetlinkError> {
    let mut socks = Vec::new();
    let end = read_reply(buf, seq, |ty, payload| {
        if ty == SOCK_DIAG_BY_FAMILY {
            socks.push(DiagSock::parse(payload)?);
        }
        Ok(())
    })?;
    Ok((socks, end))
}

/// The ack of a request: `Some(errno)` (0 = success) once found.
fn parse_ack(buf: &[u8], seq: u32) -> Result<Option<i32>, NetlinkError> {
    read_reply(buf, seq, |_, _| Ok(()))
}

#[test]
fn dump_request_layout() {
    let r = encode(dump_request(libc::AF_INET6 as u8, PROTO_TCP, TCP_CONNECTED_STATES), DUMP, 7);
    assert_eq!(r.len(), 72);
    assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 72);
    assert_eq!(u16::from_ne_bytes(r[4..6].try_into().unwrap()), SOCK_DIAG_BY_FAMILY);
    assert_eq!(u16::from_ne_bytes(r[6..8].try_into().unwrap()), 0x301);
    assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), 7);
    assert_eq!(r[16], libc::AF_INET6 as u8);
    assert_eq!(r[17], 6);
    assert_eq!(u32::from_ne_bytes(r[20..24].try_into().unwrap()), 0b1011_0011_0110);
    assert!(r[18..20].iter().chain(&r[24..]).all(|&b| b == 0), "no socket id in a dump request");
    // Listening sockets (state 10) are never dumped, nor TIME_WAIT (6).
    assert_eq!(TCP_CONNECTED_STATES & (1 << 10 | 1 << 6 | 1 << 7 | 1 << 3), 0);
}

#[test]
fn destroy_request_carries_the_socket_id_and_cookie() {
    let id = sockid(v4([10, 0, 0, 1]), 40000, v4([169, 254, 169, 254]), 80);
    let s = DiagSock { family: libc::AF_INET as u8, state: 1, id, cgroup_id: Some(9) };
    let r = encode(destroy_request(&s, PROTO_UDP), ACKED, 3);
    assert_eq!(r.len(), 72);
    assert_eq!(
        u16::from_ne_bytes(r[4..6].try_into().unwrap()),
        netlink_packet_sock_diag::SOCK_DESTROY
    );
    assert_eq!(u16::from_ne_bytes(r[6..8].try_into().unwrap()), 0x01 | 0x04);
    assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), 3);
    assert_eq!((r[16], r[17]), (libc::AF_INET as u8, PROTO_UDP));
    assert_eq!(u32::from_ne_bytes(r[20..24].try_into().unwrap()), u32::MAX, "every state");
    // inet_diag_sockid at offset 16 + 8.
    assert_eq!(&r[24..26], &40000u16.to_be_bytes());
    assert_eq!(&r[26..28], &80u16.to_be_bytes());
    assert_eq!(&r[28..32], &[10, 0, 0, 1]);
    assert_eq!(&r[44..48], &[169, 254, 169, 254]);
    assert_eq!(u32::from_ne_bytes(r[64..68].try_into().unwrap()), 0x1234);
    assert_eq!(u32::from_ne_bytes(r[68..72].try_into().unwrap()), 0x5678);
}

#[test]
fn parses_a_dump_with_cgroup_ids_and_other_attributes() {
    let a = sockid(v4([169, 254, 0, 1]), 41000, v4([169, 254, 169, 254]), 80);
    let b = sockid(Ipv6Addr::UNSPECIFIED.into(), 41001, mapped([169, 254, 169, 254]), 80);
    let mut buf = sock_msg(
        5,
        libc::AF_INET as u8,
        a.clone(),
        &[
            attr(1, &[0; 6]), // INET_DIAG_MEMINFO-like, odd length, padded
            attr(INET_DIAG_CGROUP_ID, &77u64.to_ne_bytes()),
        ],
    );
    buf.extend(sock_msg(
        5,
        libc::AF_INET6 as u8,
        b,
        &[attr(INET_DIAG_CGROUP_ID | 0x8000, &78u64.to_ne_bytes())],
    ));
    // A stale message of an earlier request is ignored.
    buf.extend(sock_msg(4, libc::AF_INET as u8, a, &[]));
    buf.extend(done(5, 0));
    let (socks, end) = parse_dump(&buf, 5).unwrap();
    assert_eq!(end, Some(0));
    assert_eq!(socks.len(), 2);
    let (s0, s1) = (&socks[0], &socks[1]);
    assert_eq!(s0.cgroup_id, Some(77));
    assert_eq!(s0.dst(), "169.254.169.254:80".parse().unwrap());
    assert_eq!(s0.src(), "169.254.0.1:41000".parse().unwrap());
    assert_eq!(s0.dst_addr(), Addr::v4([169, 254, 169, 254]));
    assert_eq!(s0.id.cookie[..4], 0x1234u32.to_ne_bytes());
    assert_eq!(s0.id.cookie[4..], 0x5678u32.to_ne_bytes());
    // IPv4-mapped IPv6 is looked up as IPv4.
    assert_eq!(s1.cgroup_id, Some(78));
    assert_eq!(s1.dst_addr(), Addr::v4([169, 254, 169, 254]));
    assert_eq!(s1.dst(), "[::ffff:169.254.169.254]:80".parse().unwrap());
}

#[test]
fn dump_without_cgroup_attribute_and_errors() {
    let a = sockid(v4([1, 2, 3, 4]), 1, v4([5, 6, 7, 8]), 2);
    let (socks, end) = parse_dump(&sock_msg(1, libc::AF_INET as u8, a, &[]), 1).unwrap();
    assert_eq!(end, None, "the dump goes on");
    assert_eq!(socks[0].cgroup_id, None);
    assert_eq!(parse_dump(&done(1, libc::ENOENT), 1).unwrap().1, Some(libc::ENOENT));
    assert_eq!(parse_dump(&error(1, libc::EINVAL), 1).unwrap().1, Some(libc::EINVAL));
    // DONE without payload (old kernels).
    assert_eq!(parse_dump(&frame(NLMSG_DONE, 1, &[]), 1).unwrap().1, Some(0));
}

#[test]
fn acks() {
    assert_eq!(parse_ack(&error(9, 0), 9).unwrap(), Some(0));
    assert_eq!(parse_ack(&error(9, libc::EOPNOTSUPP), 9).unwrap(), Some(libc::EOPNOTSUPP));
    assert_eq!(parse_ack(&error(8, 0), 9).unwrap(), None);
}

#[test]
fn malformed_input_is_an_error_not_a_panic() {
    let a = sockid(v4([1, 2, 3, 4]), 1, v4([5, 6, 7, 8]), 2);
    let good = sock_msg(
        1,
        libc::AF_INET as u8,
        a.clone(),
        &[attr(INET_DIAG_CGROUP_ID, &1u64.to_ne_bytes())],
    );
    // Every truncation, and every corrupted length byte, fails cleanly.
    for cut in 0..good.len() {
        let _ = parse_dump(&good[..cut], 1);
    }
    for i in 0..good.len() {
        for v in [0u8, 1, 3, 4, 0x7f, 0xff] {
            let mut b = good.clone();
            b[i] = v;
            let _ = parse_dump(&b, 1);
        }
    }
    let mut short = good.clone();
    short[0] = 20; // header says 20 bytes: inet_diag_msg truncated
    assert!(matches!(parse_dump(&short[..20], 1), Err(NetlinkError::Wire(_))));
    let mut long = good.clone();
    long[0] = 0xff;
    assert!(matches!(parse_dump(&long, 1), Err(NetlinkError::Wire(_))));
    // Cgroup attribute with a 4-byte payload.
    let bad = sock_msg(1, libc::AF_INET as u8, a, &[attr(INET_DIAG_CGROUP_ID, &[1, 2, 3, 4])]);
    assert!(matches!(parse_dump(&bad, 1), Err(NetlinkError::Wire(_))));
    // An error message too short for its errno.
    assert!(matches!(parse_ack(&frame(NLMSG_ERROR, 9, &[1, 2]), 9), Err(NetlinkError::Wire(_))));
}

/// Read-only against the running kernel: a dump of this namespace parses, and the support
/// probe gets a definite answer. Skipped where sock_diag is not available.
#[test]
fn real_kernel_dump_and_support_probe() {
    let Ok(mut sock) = DiagSocket::open() else { return };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let client = std::net::TcpStream::connect(addr).unwrap();
    let local = client.local_addr().unwrap();
    let socks = sock.dump(libc::AF_INET as u8, PROTO_TCP, TCP_CONNECTED_STATES).unwrap();
    let mine = socks.iter().find(|s| s.src() == local && s.dst() == addr);
    let mine = mine.expect("our own connection is in the dump");
    assert_eq!(mine.state, 1, "established");
    assert!(socks.iter().all(|s| s.state != 10), "no listeners");
    assert!(support_probe(&mut sock, PROTO_TCP).is_some());
    assert!(support_probe(&mut sock, PROTO_UDP).is_some());
    drop(client);
}

#[test]
fn lookup_request_names_one_socket_with_any_cookie() {
    let src: SocketAddr = "10.0.0.5:40000".parse().unwrap();
    let dst: SocketAddr = "10.0.0.5:9750".parse().unwrap();
    let r = encode(lookup_request(src, dst), ACKED, 4);
    assert_eq!(r.len(), 72);
    assert_eq!(u16::from_ne_bytes(r[4..6].try_into().unwrap()), SOCK_DIAG_BY_FAMILY);
    assert_eq!(u16::from_ne_bytes(r[6..8].try_into().unwrap()), 0x01 | 0x04, "not a dump");
    assert_eq!((r[16], r[17]), (libc::AF_INET as u8, PROTO_TCP));
    assert_eq!(&r[24..26], &40000u16.to_be_bytes());
    assert_eq!(&r[26..28], &9750u16.to_be_bytes());
    assert_eq!(&r[28..32], &[10, 0, 0, 5]);
    assert_eq!(&r[44..48], &[10, 0, 0, 5]);
    assert_eq!(&r[64..72], &[0xff; 8], "INET_DIAG_NOCOOKIE");
    // A v4 peer of a v6 listener is asked for as IPv4-mapped IPv6.
    let r = encode(lookup_request(src, "[::1]:9750".parse().unwrap()), ACKED, 5);
    assert_eq!(r[16], libc::AF_INET6 as u8);
    assert_eq!(&r[28..44], &Ipv4Addr::new(10, 0, 0, 5).to_ipv6_mapped().octets());
}

/// Against the running kernel: the client side of a loopback connection is found, with this
/// process's cgroup; a pair no connection has is not, nor is a listener that the kernel's
/// packet-style lookup would find in its place. Skipped where sock_diag is not available.
#[test]
fn real_kernel_names_the_cgroup_of_a_connections_client() {
    let Ok(mut sock) = DiagSocket::open() else { return };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let client = std::net::TcpStream::connect(addr).unwrap();
    let (_accepted, peer) = listener.accept().unwrap();
    assert_eq!(peer, client.local_addr().unwrap());
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let rel = own.lines().find_map(|l| l.strip_prefix("0::")).expect("a cgroup v2 line");
    let dir = crate::cgroup::cgroup2_mount().unwrap().join(rel.trim_start_matches('/'));
    let id = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&dir).unwrap());
    assert_eq!(sock.cgroup_of(peer, addr).unwrap(), Some(id), "the client's cgroup");
    let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
    assert_eq!(sock.cgroup_of(nobody, addr).unwrap(), None, "no such connection");
    assert_eq!(sock.cgroup_of(addr, nobody).unwrap(), None, "the listener is no answer");
}
