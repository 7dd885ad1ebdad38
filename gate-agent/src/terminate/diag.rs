//! The NETLINK_SOCK_DIAG client: the dump and `SOCK_DESTROY` requests of
//! `netlink-packet-sock-diag` and the reading of their replies, and the probe that asks the
//! kernel whether it can destroy sockets at all. [`Diag`] is the part a scan uses (a fake in
//! the unit tests).
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

use super::TerminateError;
use crate::netlink::{ACKED, DUMP, DecodeError, NetlinkError, NlSocket};

/// The error of the scan of namespace `label` for a failed `op`.
pub(super) fn scan_error(e: NetlinkError, label: &str, op: &'static str) -> TerminateError {
    let netns = label.to_string();
    match e {
        NetlinkError::Io(source) => TerminateError::Io { netns, op, source },
        NetlinkError::Kernel(errno) => {
            TerminateError::Io { netns, op, source: io::Error::from_raw_os_error(errno) }
        }
        NetlinkError::Wire(error) => TerminateError::Wire { netns, error },
    }
}

/// TCP states of a connected socket: ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2,
/// CLOSE_WAIT, LAST_ACK, CLOSING (not LISTEN, SYN_RECV, TIME_WAIT, CLOSE).
pub(super) const TCP_CONNECTED_STATES: u32 =
    (1 << 1) | (1 << 2) | (1 << 4) | (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11);
/// A connected UDP socket is in state ESTABLISHED.
pub(super) const UDP_CONNECTED_STATES: u32 = 1 << 1;

/// The two sock_diag operations a scan uses (a fake in the unit tests).
pub(super) trait Diag {
    fn dump(&mut self, family: u8, proto: u8, states: u32) -> Result<Vec<DiagSock>, NetlinkError>;
    fn destroy(&mut self, s: &DiagSock, proto: u8) -> Result<(), NetlinkError>;
}

const INET_DIAG_CGROUP_ID: u16 = 21;
/// `struct inet_diag_msg`, ahead of the attributes.
const MSG_LEN: usize = 72;

/// One socket of a dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct DiagSock {
    pub(super) family: u8,
    pub(super) state: u8,
    pub(super) id: SocketId,
    pub(super) cgroup_id: Option<u64>,
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

    pub(super) fn dport(&self) -> u16 {
        self.id.destination_port
    }

    /// The destination as the gate's hooks see it (IPv4-mapped IPv6 as IPv4).
    pub(super) fn dst_addr(&self) -> Addr {
        match self.id.destination_address {
            IpAddr::V4(a) => Addr::v4(a.octets()),
            IpAddr::V6(a) => Addr::from_v6(a.octets()),
        }
    }

    pub(super) fn src(&self) -> SocketAddr {
        SocketAddr::new(self.id.source_address, self.id.source_port)
    }

    pub(super) fn dst(&self) -> SocketAddr {
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

/// A NETLINK_SOCK_DIAG socket, bound to the namespace of the thread that opened it.
pub(super) struct DiagSocket(NlSocket);

/// A reply that takes longer than this means something is badly wrong.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);

impl DiagSocket {
    pub(super) fn open() -> io::Result<DiagSocket> {
        NlSocket::open(libc::NETLINK_SOCK_DIAG as isize, RECV_TIMEOUT).map(DiagSocket)
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
pub(super) fn support_probe(sock: &mut impl Diag, proto: u8) -> Option<bool> {
    let nobody =
        DiagSock { family: libc::AF_INET as u8, state: 0, id: SocketId::new_v4(), cgroup_id: None };
    match sock.destroy(&nobody, proto) {
        Err(NetlinkError::Kernel(libc::EOPNOTSUPP)) => Some(false),
        Err(NetlinkError::Kernel(libc::ENOENT)) => Some(true),
        _ => None,
    }
}

#[cfg(test)]
pub(super) mod tests;
