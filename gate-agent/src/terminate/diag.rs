//! The NETLINK_SOCK_DIAG client: the wire structs of `inet_diag`, the dump and
//! `SOCK_DESTROY` requests and the parsing of their replies, the netlink socket itself, and
//! the probe that asks the kernel whether it can destroy sockets at all. [`Diag`] is the part a
//! scan uses (a fake in the unit tests).
//!
//! The socket is bound to the network namespace of the thread that opens it; the framing
//! is [`crate::netlink`]'s.
use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use gate_common::{user::bytes_of, verdict::Addr};

use super::TerminateError;
pub(crate) use crate::netlink::WireError;
use crate::netlink::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR, NlSocket, attrs, errno_of,
    message, messages, read,
};

/// Why a sock_diag request failed.
#[derive(Debug)]
pub(super) enum DiagError {
    Io(io::Error),
    /// The kernel answered with this errno.
    Kernel(i32),
    Wire(WireError),
}

impl DiagError {
    /// The error of the scan of namespace `label` for a failed `op`.
    pub(super) fn into_error(self, label: &str, op: &'static str) -> TerminateError {
        let netns = label.to_string();
        match self {
            DiagError::Io(source) => TerminateError::Io { netns, op, source },
            DiagError::Kernel(errno) => {
                TerminateError::Io { netns, op, source: io::Error::from_raw_os_error(errno) }
            }
            DiagError::Wire(error) => TerminateError::Wire { netns, error },
        }
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
    fn dump(&mut self, family: u8, proto: u8, states: u32) -> Result<Vec<DiagSock>, DiagError>;
    fn destroy(&mut self, s: &DiagSock, proto: u8) -> Result<(), DiagError>;
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const INET_DIAG_CGROUP_ID: u16 = 21;

/// `struct inet_diag_sockid`; ports and addresses in network order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct InetDiagSockId {
    sport: [u8; 2],
    dport: [u8; 2],
    src: [u8; 16],
    dst: [u8; 16],
    ifindex: u32,
    cookie: [u32; 2],
}

/// `struct inet_diag_req_v2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InetDiagReqV2 {
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: InetDiagSockId,
}

/// `struct inet_diag_msg`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InetDiagMsg {
    family: u8,
    state: u8,
    timer: u8,
    retrans: u8,
    id: InetDiagSockId,
    expires: u32,
    rqueue: u32,
    wqueue: u32,
    uid: u32,
    inode: u32,
}

const REQ_LEN: usize = size_of::<InetDiagReqV2>();
const MSG_LEN: usize = size_of::<InetDiagMsg>();

const _: () = {
    assert!(size_of::<InetDiagSockId>() == 48);
    assert!(REQ_LEN == 56);
    assert!(MSG_LEN == 72);
};

// SAFETY: see the size asserts: integers and integer arrays only, no padding.
unsafe impl aya::Pod for InetDiagSockId {}
// SAFETY: as above.
unsafe impl aya::Pod for InetDiagReqV2 {}
// SAFETY: as above.
unsafe impl aya::Pod for InetDiagMsg {}

/// A request message: header + `inet_diag_req_v2`.
fn request(ty: u16, flags: u16, seq: u32, req: &InetDiagReqV2) -> Vec<u8> {
    message(ty, flags, seq, &[bytes_of(req)])
}

/// One socket of a dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct DiagSock {
    pub(super) family: u8,
    pub(super) state: u8,
    pub(super) id: InetDiagSockId,
    pub(super) cgroup_id: Option<u64>,
}

impl DiagSock {
    fn parse(payload: &[u8]) -> Result<DiagSock, WireError> {
        let msg: InetDiagMsg = read(payload, "inet_diag_msg")?;
        let mut cgroup_id = None;
        for (ty, data) in attrs(&payload[MSG_LEN..])? {
            if ty == INET_DIAG_CGROUP_ID {
                let v: [u8; 8] = data.try_into().map_err(|_| WireError::BadLength {
                    what: "INET_DIAG_CGROUP_ID",
                    len: data.len() + 4,
                    avail: 12,
                })?;
                cgroup_id = Some(u64::from_ne_bytes(v));
            }
        }
        Ok(DiagSock { family: msg.family, state: msg.state, id: msg.id, cgroup_id })
    }

    fn is_v4(&self) -> bool {
        i32::from(self.family) == libc::AF_INET
    }

    fn ip(&self, a: [u8; 16]) -> IpAddr {
        if self.is_v4() {
            IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))
        } else {
            IpAddr::V6(Ipv6Addr::from(a))
        }
    }

    pub(super) fn dport(&self) -> u16 {
        u16::from_be_bytes(self.id.dport)
    }

    /// The destination as the gate's hooks see it (IPv4-mapped IPv6 as IPv4).
    pub(super) fn dst_addr(&self) -> Addr {
        let a = self.id.dst;
        if self.is_v4() { Addr::v4([a[0], a[1], a[2], a[3]]) } else { Addr::from_v6(a) }
    }

    pub(super) fn src(&self) -> SocketAddr {
        SocketAddr::new(self.ip(self.id.src), u16::from_be_bytes(self.id.sport))
    }

    pub(super) fn dst(&self) -> SocketAddr {
        SocketAddr::new(self.ip(self.id.dst), self.dport())
    }
}

/// The request that dumps `proto` sockets of `family` in `states`.
fn dump_request(seq: u32, family: u8, proto: u8, states: u32) -> Vec<u8> {
    let req = InetDiagReqV2 { family, protocol: proto, states, ..Default::default() };
    request(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, &req)
}

/// The request that destroys one socket of a dump (the id includes its cookie).
fn destroy_request(seq: u32, s: &DiagSock, proto: u8) -> Vec<u8> {
    let req = InetDiagReqV2 {
        family: s.family,
        protocol: proto,
        states: u32::MAX,
        id: s.id,
        ..Default::default()
    };
    request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, seq, &req)
}

/// What one received datagram of a dump holds.
#[derive(Debug, Default, PartialEq, Eq)]
struct DumpPart {
    socks: Vec<DiagSock>,
    done: bool,
    /// errno of an `NLMSG_ERROR` or failed `NLMSG_DONE`.
    error: Option<i32>,
}

fn parse_dump(buf: &[u8], seq: u32) -> Result<DumpPart, WireError> {
    let mut part = DumpPart::default();
    for (hdr, payload) in messages(buf)? {
        if hdr.seq != seq {
            continue;
        }
        match hdr.ty {
            NLMSG_DONE => {
                part.done = true;
                // Older kernels send DONE without a payload.
                let e = if payload.len() >= 4 { errno_of(payload)? } else { 0 };
                if e != 0 {
                    part.error = Some(e);
                }
            }
            NLMSG_ERROR => {
                part.done = true;
                part.error = Some(errno_of(payload)?);
            }
            SOCK_DIAG_BY_FAMILY => part.socks.push(DiagSock::parse(payload)?),
            _ => {}
        }
    }
    Ok(part)
}

/// The ack of a request: `Some(errno)` (0 = success) once found.
fn parse_ack(buf: &[u8], seq: u32) -> Result<Option<i32>, WireError> {
    for (hdr, payload) in messages(buf)? {
        if hdr.seq == seq && hdr.ty == NLMSG_ERROR {
            return Ok(Some(errno_of(payload)?));
        }
    }
    Ok(None)
}

/// A NETLINK_SOCK_DIAG socket, bound to the namespace of the thread that opened it.
pub(super) struct DiagSocket(NlSocket);

/// A reply that takes longer than this means something is badly wrong.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);

impl DiagSocket {
    pub(super) fn open() -> io::Result<DiagSocket> {
        NlSocket::open(libc::NETLINK_SOCK_DIAG, RECV_TIMEOUT).map(DiagSocket)
    }
}

impl Diag for DiagSocket {
    fn dump(&mut self, family: u8, proto: u8, states: u32) -> Result<Vec<DiagSock>, DiagError> {
        let seq = self.0.next_seq();
        self.0.send(&dump_request(seq, family, proto, states)).map_err(DiagError::Io)?;
        let mut socks = Vec::new();
        loop {
            let buf = self.0.recv().map_err(DiagError::Io)?;
            let part = parse_dump(buf, seq).map_err(DiagError::Wire)?;
            socks.extend(part.socks);
            if let Some(e) = part.error {
                return Err(DiagError::Kernel(e));
            }
            if part.done {
                return Ok(socks);
            }
        }
    }

    fn destroy(&mut self, s: &DiagSock, proto: u8) -> Result<(), DiagError> {
        let seq = self.0.next_seq();
        self.0.send(&destroy_request(seq, s, proto)).map_err(DiagError::Io)?;
        loop {
            let buf = self.0.recv().map_err(DiagError::Io)?;
            match parse_ack(buf, seq).map_err(DiagError::Wire)? {
                Some(0) => return Ok(()),
                Some(e) => return Err(DiagError::Kernel(e)),
                None => continue,
            }
        }
    }
}

/// Whether the kernel implements `SOCK_DESTROY` for `proto`: `Some(false)` if it answers
/// `EOPNOTSUPP`, `None` if the answer says nothing. The request names no socket (all-zero
/// addresses and ports, and a cookie no socket has), so the kernel, which checks for support
/// before looking the socket up, answers `ENOENT` when it has support; nothing is destroyed.
pub(super) fn support_probe(sock: &mut impl Diag, proto: u8) -> Option<bool> {
    let nobody = DiagSock {
        family: libc::AF_INET as u8,
        state: 0,
        id: InetDiagSockId::default(),
        cgroup_id: None,
    };
    match sock.destroy(&nobody, proto) {
        Err(DiagError::Kernel(libc::EOPNOTSUPP)) => Some(false),
        Err(DiagError::Kernel(libc::ENOENT)) => Some(true),
        _ => None,
    }
}

#[cfg(test)]
pub(super) mod tests;
