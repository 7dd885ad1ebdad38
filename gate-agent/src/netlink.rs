//! The netlink socket shared by the two netlink clients of the agent: sock_diag
//! ([`crate::terminate`], destroying connections) and rtnetlink ([`crate::node`], interfaces,
//! and [`crate::loader`]'s tc filter dump). Sockets are `netlink-sys`'s; messages are built
//! and read with the `netlink-packet-*` crates; this module holds the one request loop.
//!
//! A socket is bound to the network namespace of the thread that opens it.
use std::{io, os::fd::BorrowedFd, time::Duration};

pub(crate) use netlink_packet_core::DecodeError;
use netlink_packet_core::{
    DoneBuffer, ErrorBuffer, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR,
    NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
};
use netlink_sys::{Socket, SocketAddr};

/// Flags of a dump request.
pub(crate) const DUMP: u16 = NLM_F_REQUEST | NLM_F_DUMP;
/// Flags of a request the kernel acknowledges.
pub(crate) const ACKED: u16 = NLM_F_REQUEST | NLM_F_ACK;

/// Why a netlink request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NetlinkError {
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The kernel answered with this errno.
    #[error("the kernel answered: {}", io::Error::from_raw_os_error(*.0))]
    Kernel(i32),
    #[error("malformed reply: {0}")]
    Wire(#[from] DecodeError),
}

/// The bytes of request `payload` with `flags` and sequence number `seq`.
pub(crate) fn encode<T>(payload: T, flags: u16, seq: u32) -> Vec<u8>
where
    T: NetlinkSerializable,
{
    let mut hdr = NetlinkHeader::default();
    hdr.flags = flags;
    hdr.sequence_number = seq;
    let mut msg = NetlinkMessage::new(hdr, NetlinkPayload::InnerMessage(payload));
    msg.finalize();
    let mut out = vec![0; msg.buffer_len()];
    msg.serialize(&mut out);
    out
}

/// Read the messages of one datagram that answer request `seq`: each payload goes to `each`
/// (with its type) until the end of the answer, whose errno this returns (0 = success or
/// ack); `None` while the answer goes on in the next datagram.
pub(crate) fn read_reply(
    mut buf: &[u8],
    seq: u32,
    mut each: impl FnMut(u16, &[u8]) -> Result<(), NetlinkError>,
) -> Result<Option<i32>, NetlinkError> {
    while !buf.is_empty() {
        let msg = NetlinkBuffer::new_checked(buf)?;
        let len = msg.length() as usize;
        if msg.sequence_number() == seq {
            let payload = msg.payload();
            match msg.message_type() {
                // Older kernels send DONE without a payload.
                NLMSG_DONE if payload.len() < 4 => return Ok(Some(0)),
                NLMSG_DONE => {
                    return Ok(Some(DoneBuffer::new_checked(payload)?.code().saturating_neg()));
                }
                NLMSG_ERROR => {
                    let code = ErrorBuffer::new_checked(payload)?.code();
                    return Ok(Some(code.map_or(0, |c| c.get().saturating_neg())));
                }
                ty => each(ty, payload)?,
            }
        }
        // Messages are 4-byte aligned; the last may end unpadded.
        buf = &buf[((len + 3) & !3).min(buf.len())..];
    }
    Ok(None)
}

/// A netlink socket of one protocol, bound to the namespace of the thread that opened it.
pub(crate) struct NlSocket {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl NlSocket {
    /// A socket for requests; replies that take longer than `timeout` are errors.
    pub(crate) fn open(protocol: isize, timeout: Duration) -> io::Result<NlSocket> {
        let sock = Socket::new(protocol)?;
        rustix::net::sockopt::set_socket_timeout(
            &sock,
            rustix::net::sockopt::Timeout::Recv,
            Some(timeout),
        )?;
        Ok(NlSocket { sock, seq: 0, buf: Vec::with_capacity(64 * 1024) })
    }

    /// A non-blocking socket subscribed to the multicast `groups` (`RTMGRP_*` bits).
    pub(crate) fn subscribe(protocol: isize, groups: u32) -> io::Result<NlSocket> {
        let mut sock = Socket::new(protocol)?;
        sock.set_non_blocking(true)?;
        sock.bind(&SocketAddr::new(0, groups))?;
        Ok(NlSocket { sock, seq: 0, buf: Vec::new() })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd as _;
        self.sock.as_fd()
    }

    /// Read and discard one queued datagram without waiting; its length.
    pub(crate) fn discard(&self) -> io::Result<usize> {
        let mut scratch = [0u8; 16 * 1024];
        self.sock.recv(&mut &mut scratch[..], libc::MSG_DONTWAIT)
    }

    /// One datagram from the kernel (datagrams from other senders are skipped).
    fn recv(&mut self) -> io::Result<&[u8]> {
        loop {
            self.buf.clear();
            match self.sock.recv_from(&mut self.buf, 0) {
                Ok((_, from)) if from.port_number() == 0 => return Ok(&self.buf),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Send `payload` with `flags` (a [`DUMP`] or an [`ACKED`] request) and hand each message
    /// of the answer to `each`, with its type, until the kernel ends the answer.
    pub(crate) fn request<T>(
        &mut self,
        payload: T,
        flags: u16,
        mut each: impl FnMut(u16, &[u8]) -> Result<(), NetlinkError>,
    ) -> Result<(), NetlinkError>
    where
        T: NetlinkSerializable,
    {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        self.sock.send_to(&encode(payload, flags, seq), &SocketAddr::new(0, 0), 0)?;
        loop {
            let buf = self.recv()?;
            match read_reply(buf, seq, &mut each)? {
                None => {}
                Some(0) => return Ok(()),
                Some(errno) => return Err(NetlinkError::Kernel(errno)),
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use netlink_packet_route::{RouteNetlinkMessage, link::LinkMessage};

    use super::*;

    /// A reply message as the kernel frames it.
    pub(crate) fn frame(ty: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&((16 + payload.len()) as u32).to_ne_bytes());
        out.extend_from_slice(&ty.to_ne_bytes());
        out.extend_from_slice(&2u16.to_ne_bytes());
        out.extend_from_slice(&seq.to_ne_bytes());
        out.extend_from_slice(&0u32.to_ne_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn framing_round_trips() {
        let m = encode(RouteNetlinkMessage::GetLink(LinkMessage::default()), DUMP, 9);
        assert_eq!(m.len(), 32);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 32);
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), libc::RTM_GETLINK);
        assert_eq!(u16::from_ne_bytes(m[6..8].try_into().unwrap()), 0x301);
        assert_eq!(u32::from_ne_bytes(m[8..12].try_into().unwrap()), 9);
        let mut seen = Vec::new();
        let mut buf = frame(16, 9, &[1, 2, 3, 4, 5]);
        buf.extend([0; 3]);
        buf.extend(frame(16, 8, &[9; 4])); // another request's: skipped
        buf.extend(frame(NLMSG_DONE, 9, &0i32.to_ne_bytes()));
        let end = read_reply(&buf, 9, |ty, p| {
            seen.push((ty, p.to_vec()));
            Ok(())
        });
        assert_eq!(end.unwrap(), Some(0));
        assert_eq!(seen, vec![(16, vec![1, 2, 3, 4, 5])]);
        let err = frame(NLMSG_ERROR, 9, &(-19i32).to_ne_bytes());
        assert_eq!(read_reply(&err, 9, |_, _| Ok(())).unwrap(), Some(19));
        assert!(matches!(read_reply(&buf[..10], 9, |_, _| Ok(())), Err(NetlinkError::Wire(_))));
    }
}
