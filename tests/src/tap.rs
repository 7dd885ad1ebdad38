//! A VM's network path: a multi-queue tap device in the node netns, into which frames are
//! written as a VM's backend does; and a userspace VPN ([`TunLink`]): two TUN devices, packets
//! read from one written into the other. Which socket the node sees them with depends on how they
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
const IFF_TUN: libc::c_short = 0x0001;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NAPI: libc::c_short = 0x0010;
const IFF_NAPI_FRAGS: libc::c_short = 0x0020;
const IFF_MULTI_QUEUE: libc::c_short = 0x0100;
const IFF_NO_PI: libc::c_short = 0x1000;

/// Open /dev/net/tun and attach a queue of the multi-queue tap `name` (created if missing,
/// in the calling thread's network namespace) with the extra flags `extra`.
pub fn attach(name: &str, extra: libc::c_short) -> std::io::Result<OwnedFd> {
    open_tun(name, IFF_TAP | IFF_NO_PI | IFF_MULTI_QUEUE | extra)
}

/// Open /dev/net/tun and attach to the device `name` with `flags` (TUNSETIFF).
fn open_tun(name: &str, flags: libc::c_short) -> std::io::Result<OwnedFd> {
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

/// The TUN devices' name, in the node netns and in the imds netns.
pub const TUN_IFACE: &str = "mgvpn";
/// The node's address on its TUN device (/24); the VPN's peers are the rest of the /24.
pub const TUN_NODE_V4: &str = "10.96.0.1";
/// A peer behind the node's TUN device.
pub const TUN_PEER_V4: &str = "10.96.0.2";

/// A userspace VPN between the node and the metadata service's side, as WireGuard-go or
/// OpenVPN run one: a TUN device (an L3 interface: packets start with the IP header) in each
/// namespace, and a thread that writes every packet the node sends into its TUN into the
/// imds side's, which receives it as if decapsulated. The devices go with the guard.
pub struct TunLink {
    /// The node's end: what is written here the node receives on its TUN device.
    node: std::sync::Arc<OwnedFd>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    relay: Option<std::thread::JoinHandle<()>>,
}

impl TunLink {
    pub fn new(net: &TestNet) -> Result<TunLink> {
        let open = |path: &str| {
            in_netns(path, || open_tun(TUN_IFACE, IFF_TUN | IFF_NO_PI).context("creating the tun"))
        };
        let node = std::sync::Arc::new(open(&net.node_path())?);
        let imds = open(&net.imds_path())?;
        ip(&net.node, &format!("addr add {TUN_NODE_V4}/24 dev {TUN_IFACE}"))?;
        ip(&net.node, &format!("link set {TUN_IFACE} up"))?;
        ip(&net.imds, &format!("link set {TUN_IFACE} up"))?;
        // What arrives by the tun comes from an address routed elsewhere: no reverse-path check.
        crate::net::sysctl(
            &net.imds,
            &["net.ipv4.conf.all.rp_filter=0", &format!("net.ipv4.conf.{TUN_IFACE}.rp_filter=0")],
        )?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, reader) = (stop.clone(), node.clone());
        let relay = std::thread::spawn(move || {
            let node = reader;
            let mut buf = [0u8; 65536];
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let mut pfd =
                    libc::pollfd { fd: node.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd.
                if unsafe { libc::poll(&mut pfd, 1, 50) } <= 0 {
                    continue;
                }
                // SAFETY: valid fd and buffer.
                let n = unsafe { libc::read(node.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n > 0 {
                    // SAFETY: valid fd; the first n bytes of the buffer were just read.
                    unsafe { libc::write(imds.as_raw_fd(), buf.as_ptr().cast(), n as usize) };
                }
            }
        });
        Ok(TunLink { node, stop, relay: Some(relay) })
    }

    /// Write an IP packet into the node's TUN device, as the VPN does with what it
    /// decapsulated: the node receives it there, without a socket, and forwards it.
    pub fn inject(&self, packet: &[u8]) -> Result<()> {
        // SAFETY: valid fd and buffer.
        let n = unsafe { libc::write(self.node.as_raw_fd(), packet.as_ptr().cast(), packet.len()) };
        if n < 0 {
            return Err(std::io::Error::last_os_error()).context("writing into the tun");
        }
        Ok(())
    }
}

impl Drop for TunLink {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.relay.take() {
            let _ = t.join();
        }
    }
}
