//! The probe's ways around the socket hooks that need more than one plain call: the 32-bit
//! compat syscall ABI (`int 0x80`), and sockets that read the node's traffic.
use std::{
    io::ErrorKind,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use super::{Outcome, fail, print, read_token};

/// ia32 syscall numbers (arch/x86/entry/syscalls/syscall_32.tbl).
const IA32_SOCKET: u32 = 359;
const IA32_SETSOCKOPT: u32 = 366;

/// One syscall through the 32-bit compat entry (`int 0x80`), as a 32-bit program makes it:
/// the kernel runs it with `in_compat_syscall()` true. Pointer arguments must lie below 4 GiB.
/// Returns the result or the errno.
fn ia32_syscall(nr: u32, args: [u32; 5]) -> Result<u32, std::io::Error> {
    let ret: i32;
    // SAFETY: `int 0x80` with the ia32 calling convention (ebx, ecx, edx, esi, edi); rbx is
    // reserved by the compiler, so it is saved and loaded by hand; the compat entry may not
    // preserve r8-r15, which are declared clobbered. Pointers passed are the caller's.
    unsafe {
        std::arch::asm!(
            "push rbx",
            "mov ebx, {a0:e}",
            "int 0x80",
            "pop rbx",
            a0 = in(reg) args[0],
            inlateout("eax") nr as i32 => ret,
            in("ecx") args[1],
            in("edx") args[2],
            in("esi") args[3],
            in("edi") args[4],
            out("r8") _, out("r9") _, out("r10") _, out("r11") _,
            out("r12") _, out("r13") _, out("r14") _, out("r15") _,
        );
    }
    if (-4095..0).contains(&ret) {
        Err(std::io::Error::from_raw_os_error(-ret))
    } else {
        Ok(ret as u32)
    }
}

/// An `i32` in memory below 4 GiB (MAP_32BIT), for the compat ABI's pointer arguments.
struct Low32(*mut i32);

impl Low32 {
    fn new(v: i32) -> std::io::Result<Low32> {
        // SAFETY: an anonymous private page; unmapped on drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_32BIT,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let p = p.cast::<i32>();
        // SAFETY: the page just mapped, writable and aligned.
        unsafe { p.write(v) };
        Ok(Low32(p))
    }

    fn addr(&self) -> u32 {
        self.0 as usize as u32
    }
}

impl Drop for Low32 {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.0.cast(), 4096) };
    }
}

/// `setsockopt(fd, level, optname, &1, 4)` through the 32-bit compat ABI.
pub(super) fn compat_setsockopt_one(fd: &OwnedFd, level: i32, optname: i32) -> std::io::Result<()> {
    let one = Low32::new(1)?;
    let args = [fd.as_raw_fd() as u32, level as u32, optname as u32, one.addr(), 4];
    ia32_syscall(IA32_SETSOCKOPT, args).map(drop)
}

/// What a capture probe opens.
#[derive(Clone, Copy)]
enum Capture {
    /// AF_PACKET, ETH_P_ALL at `socket()`.
    PacketAll,
    /// The same through the 32-bit compat `socket()`.
    PacketAllCompat,
    /// AF_PACKET with protocol 0 (reads nothing), then `bind()` to ETH_P_IP.
    PacketBind,
    /// A raw IPv4 socket of IPPROTO_TCP: a copy of every TCP segment the node receives.
    RawTcp,
    /// Controls that read no IP: AF_PACKET of ETH_P_ARP (an ARP announcer), raw ICMP (ping).
    PacketArp,
    RawIcmp,
}

const ETH_P_ALL: u16 = 0x0003;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_ARP: u16 = 0x0806;

fn socket(kind: Capture) -> Result<OwnedFd, Outcome> {
    let (family, ty, proto) = match kind {
        Capture::PacketAll | Capture::PacketAllCompat => {
            (libc::AF_PACKET, libc::SOCK_RAW, i32::from(ETH_P_ALL.to_be()))
        }
        Capture::PacketBind => (libc::AF_PACKET, libc::SOCK_RAW, 0),
        Capture::RawTcp => (libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP),
        Capture::PacketArp => (libc::AF_PACKET, libc::SOCK_RAW, i32::from(ETH_P_ARP.to_be())),
        Capture::RawIcmp => (libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP),
    };
    let fd = if let Capture::PacketAllCompat = kind {
        ia32_syscall(IA32_SOCKET, [family as u32, ty as u32, proto as u32, 0, 0])
            .map(|fd| fd as i32)
            .map_err(|e| fail("socket", &e))?
    } else {
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(family, ty, proto) };
        if fd < 0 {
            return Err(fail("socket", &std::io::Error::last_os_error()));
        }
        fd
    };
    // SAFETY: a fresh fd of ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn bind_packet(sock: &OwnedFd, ifindex: u32, proto: u16) -> std::io::Result<()> {
    // SAFETY: a zeroed sockaddr_ll is valid; family, protocol and ifindex are all bind needs.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto.to_be();
    sll.sll_ifindex = ifindex as i32;
    // SAFETY: valid fd and address of the given length.
    let rc = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&sll as *const libc::sockaddr_ll).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// `hold-capture KIND IFACE NEEDLE`: open a socket that reads the node's traffic (KIND:
/// `packet-all`, `packet-all-compat`, `packet-bind`, `raw-tcp`; or, reading no IP,
/// `packet-arp`, `raw-icmp`; the packet ones bound to IFACE), print `{"stage":"connected"}`, and once a line arrives on stdin read what the
/// socket queued meanwhile, for up to 3 s: `ok` when a packet held NEEDLE (someone else's
/// traffic, read off the wire). A denied socket is the result (`stage` `socket`/`bind`).
pub(super) fn hold_capture(kind: &str, iface: &str, needle: &str) -> Outcome {
    let kind = match kind {
        "packet-all" => Capture::PacketAll,
        "packet-all-compat" => Capture::PacketAllCompat,
        "packet-bind" => Capture::PacketBind,
        "raw-tcp" => Capture::RawTcp,
        "packet-arp" => Capture::PacketArp,
        "raw-icmp" => Capture::RawIcmp,
        _ => return Outcome { ok: false, errno: Some(libc::EINVAL), stage: "usage", reply: None },
    };
    let sock = match socket(kind) {
        Ok(s) => s,
        Err(o) => return o,
    };
    if !matches!(kind, Capture::RawTcp | Capture::RawIcmp) {
        let Ok(cname) = std::ffi::CString::new(iface) else {
            return Outcome { ok: false, errno: Some(libc::EINVAL), stage: "usage", reply: None };
        };
        // SAFETY: valid C string.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        let proto = match kind {
            Capture::PacketBind => ETH_P_IP,
            Capture::PacketArp => ETH_P_ARP,
            _ => ETH_P_ALL,
        };
        if let Err(e) = bind_packet(&sock, ifindex, proto) {
            return fail("bind", &e);
        }
    }
    print(&Outcome { ok: true, errno: None, stage: "connected", reply: None }, Instant::now());
    read_token();
    integration_tests::imds::set_rcvtimeo(&sock, Duration::from_millis(200));
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut buf = vec![0u8; 65536];
    let mut packets = 0u32;
    while Instant::now() < deadline {
        // SAFETY: valid fd and buffer.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                continue;
            }
            return fail("recv", &e);
        }
        packets += 1;
        let got = &buf[..n as usize];
        if got.windows(needle.len()).any(|w| w == needle.as_bytes()) {
            let reply = Some(format!("captured after {packets} packets"));
            return Outcome { ok: true, errno: None, stage: "recv", reply };
        }
    }
    Outcome { ok: false, errno: None, stage: "recv", reply: Some(format!("{packets} packets")) }
}
