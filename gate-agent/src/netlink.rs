//! Netlink framing and sockets, shared by the two netlink clients of the agent: sock_diag
//! ([`crate::terminate`], destroying connections) and rtnetlink ([`crate::node`], interfaces,
//! routes and tc filters). Messages are built and read with gate-common's one plain-data
//! mechanism ([`read_pod`], [`bytes_of`]).
//!
//! A socket is bound to the network namespace of the thread that opens it.
use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    time::Duration,
};

use gate_common::user::{bytes_of, read_pod};

pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLMSG_DONE: u16 = 3;
pub(crate) const NLM_F_REQUEST: u16 = 0x01;
pub(crate) const NLM_F_ACK: u16 = 0x04;
pub(crate) const NLM_F_DUMP: u16 = 0x300;
const NLA_TYPE_MASK: u16 = 0x3fff;

/// `struct nlmsghdr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct NlMsgHdr {
    pub len: u32,
    pub ty: u16,
    pub flags: u16,
    pub seq: u32,
    pub pid: u32,
}

pub(crate) const HDR_LEN: usize = size_of::<NlMsgHdr>();
const _: () = assert!(HDR_LEN == 16);

// SAFETY: integers only, no padding (size asserted above).
unsafe impl aya::Pod for NlMsgHdr {}

/// Malformed netlink data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WireError {
    #[error("truncated {what}: {len} bytes")]
    Truncated { what: &'static str, len: usize },
    #[error("{what} length {len} outside the {avail} bytes left")]
    BadLength { what: &'static str, len: usize, avail: usize },
}

/// Why a netlink request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NetlinkError {
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The kernel answered with this errno.
    #[error("the kernel answered: {}", io::Error::from_raw_os_error(*.0))]
    Kernel(i32),
    #[error("malformed reply: {0}")]
    Wire(#[from] WireError),
}

/// A plain-data struct at the front of `b`, or what is missing.
pub(crate) fn read<T: aya::Pod>(b: &[u8], what: &'static str) -> Result<T, WireError> {
    read_pod(b).ok_or(WireError::Truncated { what, len: b.len() })
}

pub(crate) const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A request: the header, then `parts` back to back (each a plain-data struct or attribute).
pub(crate) fn message(ty: u16, flags: u16, seq: u32, parts: &[&[u8]]) -> Vec<u8> {
    let len = HDR_LEN + parts.iter().map(|p| p.len()).sum::<usize>();
    let hdr = NlMsgHdr { len: len as u32, ty, flags, seq, pid: 0 };
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(bytes_of(&hdr));
    for p in parts {
        out.extend_from_slice(p);
    }
    out
}

/// A netlink attribute (`struct nlattr` + data, padded to 4 bytes): test frames.
#[cfg(test)]
pub(crate) fn attr(ty: u16, data: &[u8]) -> Vec<u8> {
    let mut v = ((4 + data.len()) as u16).to_ne_bytes().to_vec();
    v.extend_from_slice(&ty.to_ne_bytes());
    v.extend_from_slice(data);
    v.resize(align4(v.len()), 0);
    v
}

/// The netlink messages in one datagram: (header, payload).
pub(crate) fn messages(mut buf: &[u8]) -> Result<Vec<(NlMsgHdr, &[u8])>, WireError> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let hdr: NlMsgHdr = read(buf, "netlink header")?;
        let len = hdr.len as usize;
        if len < HDR_LEN || len > buf.len() {
            return Err(WireError::BadLength { what: "netlink message", len, avail: buf.len() });
        }
        out.push((hdr, &buf[HDR_LEN..len]));
        buf = &buf[align4(len).min(buf.len())..];
    }
    Ok(out)
}

/// The attributes in `buf`: (type without the nested/byte-order flags, data).
pub(crate) fn attrs(mut buf: &[u8]) -> Result<Vec<(u16, &[u8])>, WireError> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([buf[0], buf[1]]));
        let ty = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return Err(WireError::BadLength { what: "netlink attribute", len, avail: buf.len() });
        }
        out.push((ty, &buf[4..len]));
        buf = &buf[align4(len).min(buf.len())..];
    }
    Ok(out)
}

/// The errno of an `NLMSG_ERROR` / `NLMSG_DONE` payload (0 = success / ack).
pub(crate) fn errno_of(payload: &[u8]) -> Result<i32, WireError> {
    let b: [u8; 4] = payload
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or(WireError::Truncated { what: "netlink error", len: payload.len() })?;
    Ok(i32::from_ne_bytes(b).saturating_neg())
}

/// A netlink socket of one protocol, bound to the namespace of the thread that opened it.
pub(crate) struct NlSocket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl NlSocket {
    /// A socket for requests; replies that take longer than `timeout` are errors.
    pub(crate) fn open(protocol: i32, timeout: Duration) -> io::Result<NlSocket> {
        let s = Self::raw(protocol, 0)?;
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: libc::suseconds_t::from(timeout.subsec_micros()),
        };
        // SAFETY: valid fd and option value of the right size.
        let rc = unsafe {
            libc::setsockopt(
                s.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(s)
    }

    /// A non-blocking socket subscribed to the multicast `groups` (`RTMGRP_*` bits).
    pub(crate) fn subscribe(protocol: i32, groups: u32) -> io::Result<NlSocket> {
        let s = Self::raw(protocol, libc::SOCK_NONBLOCK)?;
        // SAFETY: sockaddr_nl is plain integers.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = groups;
        // SAFETY: valid fd and address of the given size.
        let rc = unsafe {
            libc::bind(
                s.fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(s)
    }

    fn raw(protocol: i32, flags: i32) -> io::Result<NlSocket> {
        // SAFETY: plain socket(2).
        let fd = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC | flags, protocol)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(NlSocket { fd, seq: 0, buf: vec![0; 64 * 1024] })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd as _;
        self.fd.as_fd()
    }

    pub(crate) fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    pub(crate) fn send(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_nl is plain integers.
        let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: valid fd, buffer and address of the given sizes.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&to as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }

    /// One datagram from the kernel (datagrams from other senders are skipped).
    pub(crate) fn recv(&mut self) -> io::Result<&[u8]> {
        loop {
            // SAFETY: sockaddr_nl is plain integers.
            let mut from: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
            let mut from_len = size_of::<libc::sockaddr_nl>() as libc::socklen_t;
            // SAFETY: valid fd; buffer and address valid for their lengths.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    0,
                    (&mut from as *mut libc::sockaddr_nl).cast(),
                    &mut from_len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if from.nl_pid == 0 {
                return Ok(&self.buf[..n as usize]);
            }
        }
    }

    /// Send a dump request and collect the payloads of the reply messages of type `ty`.
    pub(crate) fn dump(
        &mut self,
        ty: u16,
        req: &[&[u8]],
        reply_ty: u16,
    ) -> Result<Vec<Vec<u8>>, NetlinkError> {
        let seq = self.next_seq();
        self.send(&message(ty, NLM_F_REQUEST | NLM_F_DUMP, seq, req))?;
        let mut out = Vec::new();
        loop {
            let buf = self.recv()?;
            for (hdr, payload) in messages(buf)? {
                if hdr.seq != seq {
                    continue;
                }
                match hdr.ty {
                    NLMSG_DONE => {
                        let e = if payload.len() >= 4 { errno_of(payload)? } else { 0 };
                        return if e == 0 { Ok(out) } else { Err(NetlinkError::Kernel(e)) };
                    }
                    NLMSG_ERROR => {
                        let e = errno_of(payload)?;
                        return if e == 0 { Ok(out) } else { Err(NetlinkError::Kernel(e)) };
                    }
                    t if t == reply_ty => out.push(payload.to_vec()),
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_round_trips() {
        let a = attr(3, b"eth0\0");
        assert_eq!(a.len(), 12);
        let m = message(18, NLM_F_REQUEST, 9, &[&[1, 2, 3, 4], &a]);
        let msgs = messages(&m).unwrap();
        assert_eq!(msgs.len(), 1);
        assert_eq!((msgs[0].0.ty, msgs[0].0.seq), (18, 9));
        let at = attrs(&msgs[0].1[4..]).unwrap();
        assert_eq!(at, vec![(3, &b"eth0\0"[..])]);
        assert!(matches!(attrs(&[8, 0, 1, 0]), Err(WireError::BadLength { .. })));
        assert!(matches!(messages(&m[..10]), Err(WireError::Truncated { .. })));
        assert_eq!(errno_of(&(-19i32).to_ne_bytes()).unwrap(), 19);
    }
}
