//! The NETLINK_SOCK_DIAG client: the dump, one-socket and `SOCK_DESTROY` requests of
//! `netlink-packet-sock-diag` and the reading of their replies, and the probe that asks the
//! kernel whether it can destroy sockets at all. [`Diag`] is the part the termination scan
//! uses (a fake in its unit tests); [`DiagSocket::cgroup_of`] tells the probe listeners which
//! cgroup a peer on the node connects from.
//!
//! The socket is bound to the network namespace of the thread that opens it; the socket and
//! the request loop are [`crate::netlink`]'s.
use std::{
    io,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use gate_common::verdict::Addr;
use netlink_packet_core::{NlasIterator, Parseable as _, parse_u64};
use netlink_packet_sock_diag::{
    SOCK_DIAG_BY_FAMILY, SockDiagDestroy, SockDiagMessage,
    inet::{ExtensionFlags, InetRequest, InetResponseHeader, SocketId, StateFlags},
};

use crate::netlink::{ACKED, DUMP, DecodeError, NetlinkError, NlSocket};

/// TCP states of a connected socket: ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2,
/// CLOSE_WAIT, LAST_ACK, CLOSING (not LISTEN, SYN_RECV, TIME_WAIT, CLOSE).
pub(crate) const TCP_CONNECTED_STATES: u32 =
    (1 << 1) | (1 << 2) | (1 << 4) | (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11);
/// A connected UDP socket is in state ESTABLISHED.
pub(crate) const UDP_CONNECTED_STATES: u32 = 1 << 1;

/// The two sock_diag operations a scan uses (a fake in the unit tests).
pub(crate) trait Diag {
    fn dump(&mut self, family: u8, proto: u8, states: u32) -> Result<Vec<DiagSock>, NetlinkError>;
    fn destroy(&mut self, s: &DiagSock, proto: u8) -> Result<(), NetlinkError>;
}

const INET_DIAG_CGROUP_ID: u16 = 21;
/// `struct inet_diag_msg`, ahead of the attributes.
const MSG_LEN: usize = 72;

/// One socket of a dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DiagSock {
    pub(crate) family: u8,
    pub(crate) state: u8,
    pub(crate) id: SocketId,
    pub(crate) cgroup_id: Option<u64>,
}

impl DiagSock {
    /// A `SOCK_DIAG_BY_FAMILY` reply: the header and the cgroup id; the other attributes are
    /// not read, so one the crate cannot parse does not hide the socket.
    fn parse(payload: &[u8]) -> Result<DiagSock, DecodeError> {
        let msg = InetResponseHeader::parse(payload)?;
        let mut cgroup_id = None;
        for nla in NlasIterator::new(payload.get(MSG_LEN..).unwrap_or_default()) {
            let nla = nla?;
            if nla.kind() == INET_DIAG_CGROUP_ID {
                cgroup_id = Some(parse_u64(nla.value())?);
            }
        }
        Ok(DiagSock { family: msg.family, state: msg.state, id: msg.socket_id, cgroup_id })
    }

    pub(crate) fn dport(&self) -> u16 {
        self.id.destination_port
    }

    /// The destination as the gate's hooks see it (IPv4-mapped IPv6 as IPv4).
    pub(crate) fn dst_addr(&self) -> Addr {
        match self.id.destination_address {
            IpAddr::V4(a) => Addr::v4(a.octets()),
            IpAddr::V6(a) => Addr::from_v6(a.octets()),
        }
    }

    pub(crate) fn src(&self) -> SocketAddr {
        SocketAddr::new(self.id.source_address, self.id.source_port)
    }

    pub(crate) fn dst(&self) -> SocketAddr {
        SocketAddr::new(self.id.destination_address, self.dport())
    }
}

/// The request that dumps `proto` sockets of `family` in `states` (sent with [`DUMP`]).
fn dump_request(family: u8, proto: u8, states: u32) -> SockDiagMessage {
    let socket_id =
        if i32::from(family) == libc::AF_INET { SocketId::new_v4() } else { SocketId::new_v6() };
    SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: proto,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::from_bits_retain(states),
        socket_id,
    })
}

/// The request that destroys one socket of a dump (the id includes its cookie; sent with
/// [`ACKED`]).
fn destroy_request(s: &DiagSock, proto: u8) -> SockDiagDestroy {
    SockDiagDestroy::new(SockDiagMessage::InetRequest(InetRequest {
        family: s.family,
        protocol: proto,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::from_bits_retain(u32::MAX),
        socket_id: s.id.clone(),
    }))
}

/// The request for the one TCP socket whose own address is `src` and whose peer is `dst`,
/// whatever its state and cookie (sent with [`ACKED`]).
fn lookup_request(src: SocketAddr, dst: SocketAddr) -> SockDiagMessage {
    let v4 = src.is_ipv4() && dst.is_ipv4();
    let addr = |a: IpAddr| match a {
        IpAddr::V4(a) if !v4 => IpAddr::V6(a.to_ipv6_mapped()),
        a => a,
    };
    let mut socket_id = if v4 { SocketId::new_v4() } else { SocketId::new_v6() };
    socket_id.source_address = addr(src.ip());
    socket_id.source_port = src.port();
    socket_id.destination_address = addr(dst.ip());
    socket_id.destination_port = dst.port();
    // INET_DIAG_NOCOOKIE: any socket with these addresses.
    socket_id.cookie = [0xff; 8];
    SockDiagMessage::InetRequest(InetRequest {
        family: if v4 { libc::AF_INET as u8 } else { libc::AF_INET6 as u8 },
        protocol: libc::IPPROTO_TCP as u8,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::from_bits_retain(u32::MAX),
        socket_id,
    })
}

/// The TCP state LISTEN.
const TCP_LISTEN: u8 = 10;

/// A NETLINK_SOCK_DIAG socket, bound to the namespace of the thread that opened it.
pub(crate) struct DiagSocket(NlSocket);

/// A reply that takes longer than this means something is badly wrong.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);

impl DiagSocket {
    pub(crate) fn open() -> io::Result<DiagSocket> {
        NlSocket::open(libc::NETLINK_SOCK_DIAG as isize, RECV_TIMEOUT).map(DiagSocket)
    }
}

impl DiagSocket {
    /// The cgroup id of the TCP socket in this namespace whose own address is `src` and whose
    /// peer is `dst`: the client's side of a connection accepted from `src` on `dst`. `None`
    /// if there is no such connection (any more), or the kernel names no cgroup (before 5.9).
    /// The kernel looks it up as it would an arriving packet, so a listener on `src` could
    /// answer in its place: that answer, or one for other addresses, is no answer.
    pub(crate) fn cgroup_of(
        &mut self,
        src: SocketAddr,
        dst: SocketAddr,
    ) -> Result<Option<u64>, NetlinkError> {
        let mut found = None;
        let asked = |a: SocketAddr, b: SocketAddr| {
            a.port() == b.port() && a.ip().to_canonical() == b.ip().to_canonical()
        };
        let answer = self.0.request(lookup_request(src, dst), ACKED, |ty, payload| {
            if ty == SOCK_DIAG_BY_FAMILY {
                let s = DiagSock::parse(payload)?;
                if s.state != TCP_LISTEN && asked(s.src(), src) && asked(s.dst(), dst) {
                    found = s.cgroup_id;
                }
            }
            Ok(())
        });
        match answer {
            Ok(()) => Ok(found),
            Err(NetlinkError::Kernel(libc::ENOENT)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Diag for DiagSocket {
    fn dump(&mut self, family: u8, proto: u8, states: u32) -> Result<Vec<DiagSock>, NetlinkError> {
        let mut socks = Vec::new();
        self.0.request(dump_request(family, proto, states), DUMP, |ty, payload| {
            if ty == SOCK_DIAG_BY_FAMILY {
                socks.push(DiagSock::parse(payload)?);
            }
            Ok(())
        })?;
        Ok(socks)
    }

    fn destroy(&mut self, s: &DiagSock, proto: u8) -> Result<(), NetlinkError> {
        self.0.request(destroy_request(s, proto), ACKED, |_, _| Ok(()))
    }
}

/// Whether the kernel implements `SOCK_DESTROY` for `proto`: `Some(false)` if it answers
/// `EOPNOTSUPP`, `None` if the answer says nothing. The request names no socket (all-zero
/// addresses and ports, and a cookie no socket has), so the kernel, which checks for support
/// before looking the socket up, answers `ENOENT` when it has support; nothing is destroyed.
pub(crate) fn support_probe(sock: &mut impl Diag, proto: u8) -> Option<bool> {
    let nobody =
        DiagSock { family: libc::AF_INET as u8, state: 0, id: SocketId::new_v4(), cgroup_id: None };
    match sock.destroy(&nobody, proto) {
        Err(NetlinkError::Kernel(libc::EOPNOTSUPP)) => Some(false),
        Err(NetlinkError::Kernel(libc::ENOENT)) => Some(true),
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests;
