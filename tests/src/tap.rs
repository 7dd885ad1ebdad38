//! A VM's network path: a tap device in the node netns, into which the test writes Ethernet
//! frames as a VM's virtio backend does. They enter the node on the tap with no socket, like
//! everything a VM (Kata, KubeVirt) sends.
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use anyhow::{Context as _, Result, bail};

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
const IFF_NO_PI: libc::c_short = 0x1000;

/// A tap owned by this process: the device lives as long as its file descriptor, so dropping
/// the guard (or the test process dying) removes it.
pub struct Tap {
    fd: OwnedFd,
    netns: String,
    /// The node end's MAC: the destination of the VM's frames.
    pub mac: Mac,
}

impl Tap {
    /// Create [`TAP_IFACE`] in the node netns of `net`, 10.98.0.1/24, up.
    pub fn vm(net: &TestNet) -> Result<Tap> {
        let netns = net.node_path();
        let fd = in_netns(&netns, || {
            // SAFETY: plain open(2); owned right away.
            let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            if fd < 0 {
                bail!("open /dev/net/tun: {}", std::io::Error::last_os_error());
            }
            // SAFETY: fresh valid fd.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // struct ifreq: the name, then the flags.
            let mut req = [0u8; 40];
            req[..TAP_IFACE.len()].copy_from_slice(TAP_IFACE.as_bytes());
            req[16..18].copy_from_slice(&(IFF_TAP | IFF_NO_PI).to_ne_bytes());
            // SAFETY: valid fd; the buffer is a struct ifreq.
            if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, req.as_mut_ptr()) } != 0 {
                bail!("TUNSETIFF {TAP_IFACE}: {}", std::io::Error::last_os_error());
            }
            Ok(fd)
        })?;
        ip(&net.node, &format!("addr add 10.98.0.1/24 dev {TAP_IFACE}"))?;
        ip(&net.node, &format!("link set {TAP_IFACE} up"))?;
        let mac = mac(&net.node, TAP_IFACE)?;
        Ok(Tap { fd, netns, mac })
    }

    /// Write one Ethernet frame into the tap, from a thread inside the node netns: the node
    /// receives it on the tap.
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
