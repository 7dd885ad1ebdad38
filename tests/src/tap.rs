//! A VM's network path: a multi-queue tap device in the node netns, into which frames are
//! written as a VM's backend does. Which socket the node sees them with depends on how they
//! are written:
//! * through a NAPI-frags queue (IFF_NAPI | IFF_NAPI_FRAGS), the test's own ([`Tap::send`]):
//!   no socket at all, like vhost-net's batched path;
//! * through a plain queue (the `probe tap` command, [`attach`]): charged to the tun socket
//!   of the process that opened /dev/net/tun, so to that process's cgroup, like a VMM's
//!   write().
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use anyhow::{Context as _, Result};

use crate::{
    frame::Mac,
    net::{TestNet, ip, mac},
    sys::in_netns,
};

/// The tap's name in the node netns.
pub const TAP_IFACE: &str = "vmtap";
/// The VM's address, behind the tap (the node's end is 10.98.0.1/24).
pub const VM_V4: &str = "10.98.0.2";

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NAPI: libc::c_short = 0x0010;
const IFF_NAPI_FRAGS: libc::c_short = 0x0020;
const IFF_MULTI_QUEUE: libc::c_short = 0x0100;
const IFF_NO_PI: libc::c_short = 0x1000;

/// Open /dev/net/tun and attach a queue of the multi-queue tap `name` (created if missing,
/// in the calling thread's network namespace) with the extra flags `extra`.
pub fn attach(name: &str, extra: libc::c_short) -> std::io::Result<OwnedFd> {
    // SAFETY: plain open(2); owned right away.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh valid fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // struct ifreq: the name, then the flags.
    let mut req = [0u8; 40];
    let n = name.len().min(15);
    req[..n].copy_from_slice(&name.as_bytes()[..n]);
    let flags = IFF_TAP | IFF_NO_PI | IFF_MULTI_QUEUE | extra;
    req[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: valid fd; the buffer is a struct ifreq.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, req.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// A tap owned by this process: the device lives as long as its first queue's file
/// descriptor, so dropping the guard (or the test process dying) removes it.
pub struct Tap {
    fd: OwnedFd,
    netns: String,
    /// The node end's MAC: the destination of the VM's frames.
    pub mac: Mac,
}

impl Tap {
    /// Create [`TAP_IFACE`] in the node netns of `net` (its first queue NAPI-frags), at
    /// 10.98.0.1/24, up.
    pub fn vm(net: &TestNet) -> Result<Tap> {
        let fd = in_netns(&net.node_path(), || {
            attach(TAP_IFACE, IFF_NAPI | IFF_NAPI_FRAGS).context("creating the tap")
        })?;
        ip(&net.node, &format!("addr add 10.98.0.1/24 dev {TAP_IFACE}"))?;
        ip(&net.node, &format!("link set {TAP_IFACE} up"))?;
        let mac = mac(&net.node, TAP_IFACE)?;
        Ok(Tap { fd, netns: net.node_path(), mac })
    }

    /// Write one Ethernet frame into the tap's NAPI-frags queue, from a thread inside the
    /// node netns: the node receives it on the tap without a socket.
    pub fn send(&self, frame: &[u8]) -> Result<()> {
        in_netns(&self.netns, || {
            // SAFETY: valid fd and buffer.
            let n = unsafe { libc::write(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
            if n < 0 {
                return Err(std::io::Error::last_os_error()).context("writing into the tap");
            }
            Ok(())
        })
    }
}
