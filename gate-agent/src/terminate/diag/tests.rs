//! The sock_diag wire format against hand-built kernel messages, and one read-only dump of
//! the running kernel. `sockid`, `v4` and `mapped` also build the scan tests' sockets.
use gate_common::abi::{PROTO_TCP, PROTO_UDP};

use super::*;
use crate::netlink::{HDR_LEN, NlMsgHdr, attr};

fn hdr(len: usize, ty: u16, flags: u16, seq: u32) -> Vec<u8> {
    bytes_of(&NlMsgHdr { len: len as u32, ty, flags, seq, pid: 0 }).to_vec()
}

pub(in crate::terminate) fn sockid(
    src: [u8; 16],
    sport: u16,
    dst: [u8; 16],
    dport: u16,
) -> InetDiagSockId {
    InetDiagSockId {
        sport: sport.to_be_bytes(),
        dport: dport.to_be_bytes(),
        src,
        dst,
        ifindex: 0,
        cookie: [0x1234, 0x5678],
    }
}

pub(in crate::terminate) fn v4(a: [u8; 4]) -> [u8; 16] {
    let mut o = [0; 16];
    o[..4].copy_from_slice(&a);
    o
}

pub(in crate::terminate) fn mapped(a: [u8; 4]) -> [u8; 16] {
    let mut o = [0; 16];
    o[10] = 0xff;
    o[11] = 0xff;
    o[12..].copy_from_slice(&a);
    o
}

/// A SOCK_DIAG_BY_FAMILY reply message as the kernel builds it.
fn sock_msg(seq: u32, family: u8, id: InetDiagSockId, attrs: &[Vec<u8>]) -> Vec<u8> {
    let msg = InetDiagMsg { family, state: 1, id, inode: 4242, ..Default::default() };
    let mut body = bytes_of(&msg).to_vec();
    for a in attrs {
        body.extend_from_slice(a);
    }
    let mut out = hdr(HDR_LEN + body.len(), SOCK_DIAG_BY_FAMILY, 2, seq);
    out.extend(body);
    out
}

fn done(seq: u32, errno: i32) -> Vec<u8> {
    let mut out = hdr(HDR_LEN + 4, NLMSG_DONE, 2, seq);
    out.extend_from_slice(&(-errno).to_ne_bytes());
    out
}

fn error(seq: u32, errno: i32) -> Vec<u8> {
    let mut out = hdr(HDR_LEN + 4 + HDR_LEN, NLMSG_ERROR, 0, seq);
    out.extend_from_slice(&(-errno).to_ne_bytes());
    out.extend(hdr(HDR_LEN + REQ_LEN, SOCK_DESTROY, 5, seq));
    out
}

#[test]
fn dump_request_layout() {
    let r = dump_request(7, libc::AF_INET6 as u8, PROTO_TCP, TCP_CONNECTED_STATES);
    assert_eq!(r.len(), 72);
    assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 72);
    assert_eq!(u16::from_ne_bytes(r[4..6].try_into().unwrap()), SOCK_DIAG_BY_FAMILY);
    assert_eq!(u16::from_ne_bytes(r[6..8].try_into().unwrap()), 0x301);
    assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), 7);
    assert_eq!(r[16], libc::AF_INET6 as u8);
    assert_eq!(r[17], 6);
    assert_eq!(u32::from_ne_bytes(r[20..24].try_into().unwrap()), 0b1011_0011_0110);
    assert!(r[24..].iter().all(|&b| b == 0), "no socket id in a dump request");
    // Listening sockets (state 10) are never dumped, nor TIME_WAIT (6).
    assert_eq!(TCP_CONNECTED_STATES & (1 << 10 | 1 << 6 | 1 << 7 | 1 << 3), 0);
}

#[test]
fn destroy_request_carries_the_socket_id_and_cookie() {
    let id = sockid(v4([10, 0, 0, 1]), 40000, v4([169, 254, 169, 254]), 80);
    let s = DiagSock { family: libc::AF_INET as u8, state: 1, id, cgroup_id: Some(9) };
    let r = destroy_request(3, &s, PROTO_UDP);
    assert_eq!(r.len(), 72);
    assert_eq!(u16::from_ne_bytes(r[4..6].try_into().unwrap()), SOCK_DESTROY);
    assert_eq!(u16::from_ne_bytes(r[6..8].try_into().unwrap()), NLM_F_REQUEST | NLM_F_ACK);
    assert_eq!((r[16], r[17]), (libc::AF_INET as u8, PROTO_UDP));
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
    let b = sockid([0; 16], 41001, mapped([169, 254, 169, 254]), 80);
    let mut buf = sock_msg(
        5,
        libc::AF_INET as u8,
        a,
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
    let part = parse_dump(&buf, 5).unwrap();
    assert!(part.done);
    assert_eq!(part.error, None);
    assert_eq!(part.socks.len(), 2);
    let (s0, s1) = (part.socks[0], part.socks[1]);
    assert_eq!(s0.cgroup_id, Some(77));
    assert_eq!(s0.dst(), "169.254.169.254:80".parse().unwrap());
    assert_eq!(s0.src(), "169.254.0.1:41000".parse().unwrap());
    assert_eq!(s0.dst_addr(), Addr::v4([169, 254, 169, 254]));
    assert_eq!(s0.id.cookie, [0x1234, 0x5678]);
    // IPv4-mapped IPv6 is looked up as IPv4.
    assert_eq!(s1.cgroup_id, Some(78));
    assert_eq!(s1.dst_addr(), Addr::v4([169, 254, 169, 254]));
    assert_eq!(s1.dst(), "[::ffff:169.254.169.254]:80".parse().unwrap());
}

#[test]
fn dump_without_cgroup_attribute_and_errors() {
    let a = sockid(v4([1, 2, 3, 4]), 1, v4([5, 6, 7, 8]), 2);
    let part = parse_dump(&sock_msg(1, libc::AF_INET as u8, a, &[]), 1).unwrap();
    assert!(!part.done);
    assert_eq!(part.socks[0].cgroup_id, None);
    assert_eq!(parse_dump(&done(1, libc::ENOENT), 1).unwrap().error, Some(libc::ENOENT));
    assert_eq!(parse_dump(&error(1, libc::EINVAL), 1).unwrap().error, Some(libc::EINVAL));
    // DONE without payload (old kernels).
    assert!(parse_dump(&hdr(HDR_LEN, NLMSG_DONE, 2, 1), 1).unwrap().done);
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
    let good =
        sock_msg(1, libc::AF_INET as u8, a, &[attr(INET_DIAG_CGROUP_ID, &1u64.to_ne_bytes())]);
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
    assert!(matches!(parse_dump(&short[..20], 1), Err(WireError::Truncated { .. })));
    let mut long = good.clone();
    long[0] = 0xff;
    assert!(matches!(parse_dump(&long, 1), Err(WireError::BadLength { .. })));
    // Cgroup attribute with a 4-byte payload.
    let bad = sock_msg(1, libc::AF_INET as u8, a, &[attr(INET_DIAG_CGROUP_ID, &[1, 2, 3, 4])]);
    assert!(parse_dump(&bad, 1).is_err());
    assert!(errno_of(&[1, 2]).is_err());
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
