//! A workload: joins a cgroup and a test network namespace, performs one socket operation
//! and prints one JSON line `{"ok","errno","stage","elapsed_us","reply"}`.
//!
//! `probe --netns PATH --cgroup DIR <tcp|udp|udp-connected|raw|hold-tcp|hold-udp> ADDR PORT [TOKEN]`
//!
//! `http ADDR PORT TOKEN PATH` GETs PATH; `imdsv2 ADDR PORT TOKEN PATH` first gets an IMDSv2
//! session token (`stage: "token"` when none came) and GETs PATH with it.
//!
//! Hand-built bytes (hex, several separated by `,`; see `integration_tests::frame`):
//! * `frame IFACE SLL_PROTO FRAMES`: send the Ethernet frames on an AF_PACKET socket bound
//!   to IFACE, with `sll_protocol` SLL_PROTO (hex, e.g. `0800`).
//! * `frame-bypass IFACE SLL_PROTO FRAMES`: the same after setting PACKET_QDISC_BYPASS; if
//!   the option is denied, the frames are sent anyway (without it) and the result says
//!   `stage: "setsockopt"` with its errno, and in `reply` how the sends went.
//!   `frame-bypass-compat` sets the option through the 32-bit compat ABI (`int 0x80`).
//! * `hold-capture KIND IFACE NEEDLE`: open a socket that reads the node's traffic
//!   (`packet-all`, `packet-all-compat`, `packet-bind`, `raw-tcp`), print
//!   `{"stage":"connected"}`, and on a stdin line report whether a packet held NEEDLE.
//! * `ip-raw PACKETS`: send IP packets as they are on a raw IPPROTO_RAW socket (IPv4 or IPv6).
//! * `xdp-umem-reg`: open an AF_XDP socket and register a UMEM (`setsockopt XDP_UMEM_REG`);
//!   `stage` names the call that failed.
//! * `tap IFACE FRAMES`: attach a queue to the multi-queue tap IFACE and write the frames.
//! * `udp-lsrr VIA ADDR PORT TOKEN`: send the token with `sendto(ADDR:PORT)` on a UDP socket
//!   whose IP_OPTIONS hold a loose source route through VIA: the datagram is addressed to
//!   VIA and names ADDR in its route (IPv4).
//! * `hold-frame-bypass IFACE SLL_PROTO`: set PACKET_QDISC_BYPASS up now, print
//!   `{"stage":"connected"}`, then send the frames of the next stdin line.
//!
//! * `test-run tc|egress PROG_ID FRAMES`: run the loaded packet program PROG_ID once on each
//!   frame with BPF_PROG_TEST_RUN, from this cgroup (the kernel gives the run's socket the
//!   caller's cgroup, from 5.15 on); `reply` lists the return codes (as i32), comma-separated.
//!
//! * `exec PROGRAM [ARGS…]`: become PROGRAM (execvp) once in the cgroup and the netns: a
//!   workload of any language (the clouds' Python SDKs), which never runs outside them. It
//!   prints nothing of its own.
//!
//! Hold commands connect first, print `{"stage":"connected"}`, read the token from stdin,
//! then send. `hammer-tcp` prints `{"stage":"connected"}`, then connect()s and sends the
//! token in a loop until a line arrives on stdin, and reports
//! `attempts=N successes=N eperm=N other=N` as its reply (ok = no success). It will not run
//! without --netns: it never sends from the host namespace.
//!
//! The way to the metadata proxy (`handshake`): `orphan-flood ADDR PORT` connects with the
//! handshake's last ACK delayed and resets at once, in a loop until a stdin line;
//! `hold-many ADDR PORT N` opens N connections and holds them until a stdin line;
//! `hold-forge ADDR PORT MARKER` listens and answers every connection 200 with MARKER.
use std::{
    io::{BufRead as _, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket},
    os::fd::{AsRawFd, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use integration_tests::{frame, testrun};
use serde_json::json;

#[path = "probe/handshake.rs"]
mod handshake;
#[path = "probe/sidedoor.rs"]
mod sidedoor;

struct Outcome {
    ok: bool,
    errno: Option<i32>,
    stage: &'static str,
    reply: Option<String>,
}

fn fail(stage: &'static str, e: &std::io::Error) -> Outcome {
    Outcome { ok: false, errno: e.raw_os_error(), stage, reply: None }
}

fn request(token: &str) -> String {
    format!("GET /latest/meta-data/instance-id?token={token} HTTP/1.0\r\nHost: metadata\r\n\r\n")
}

fn tcp_exchange(mut s: TcpStream, token: &str) -> Outcome {
    if let Err(e) = s.write_all(request(token).as_bytes()) {
        return fail("send", &e);
    }
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut reply = String::new();
    match s.read_to_string(&mut reply) {
        Ok(_) if !reply.is_empty() => {
            Outcome { ok: true, errno: None, stage: "recv", reply: Some(reply) }
        }
        Ok(_) => Outcome { ok: false, errno: None, stage: "recv", reply: None },
        Err(e) => fail("recv", &e),
    }
}

fn udp_exchange(s: &UdpSocket, dst: Option<SocketAddr>, token: &str) -> Outcome {
    let sent = match dst {
        Some(d) => s.send_to(token.as_bytes(), d),
        None => s.send(token.as_bytes()),
    };
    if let Err(e) = sent {
        return fail("send", &e);
    }
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let mut buf = [0u8; 2048];
    match s.recv(&mut buf) {
        Ok(n) => Outcome {
            ok: true,
            errno: None,
            stage: "recv",
            reply: Some(String::from_utf8_lossy(&buf[..n]).into_owned()),
        },
        Err(e) => fail("recv", &e),
    }
}

fn udp_socket(dst: &SocketAddr) -> std::io::Result<UdpSocket> {
    UdpSocket::bind(if dst.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })
}

/// A TCP SYN carrying the token as payload, sent on a raw IPv4 socket (the kernel adds the
/// IP header). The checksum is left 0: a raw receiver sees the segment before TCP checks it.
fn raw_syn(dst: &SocketAddr, token: &str) -> Outcome {
    let IpAddr::V4(ip) = dst.ip() else {
        return Outcome {
            ok: false,
            errno: Some(libc::EAFNOSUPPORT),
            stage: "socket",
            reply: None,
        };
    };
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP) };
    if fd < 0 {
        return fail("socket", &std::io::Error::last_os_error());
    }
    // SAFETY: fresh valid fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // The kernel adds the IP header; the checksum stays 0 (the source is the kernel's pick).
    let sport = 40000 + (std::process::id() % 20000) as u16;
    let mut seg = frame::tcp_syn(&[0; 4], &[0; 4], sport, dst.port(), 0, token.as_bytes());
    seg[16..18].copy_from_slice(&[0, 0]);
    match CSockAddr::from(SocketAddr::new(ip.into(), 0)).sendto(&fd, &seg) {
        Ok(()) => Outcome { ok: true, errno: None, stage: "send", reply: None },
        Err(e) => fail("send", &e),
    }
}

/// `udp-lsrr`: a UDP datagram to `dst` with a loose source route through `via` (IP_OPTIONS:
/// the kernel addresses it to `via` and puts `dst` in the route; a host that accepts source
/// routes and owns `via` hands it on to `dst`).
fn udp_lsrr(via: Ipv4Addr, dst: SocketAddr, token: &str) -> Outcome {
    let s = match udp_socket(&dst) {
        Ok(s) => s,
        Err(e) => return fail("socket", &e),
    };
    // LSRR (131), length 7, pointer 4, the first hop; then end of options.
    let v = via.octets();
    let opts: [u8; 8] = [131, 7, 4, v[0], v[1], v[2], v[3], 0];
    if let Err(e) = setsockopt(&s, libc::IPPROTO_IP, libc::IP_OPTIONS, &opts) {
        return fail("setsockopt", &e);
    }
    udp_exchange(&s, Some(dst), token)
}

/// Make every datagram of an IPv6 socket carry a hop-by-hop options header (one PadN option),
/// so the transport header is no longer right after the IPv6 header.
fn hop_by_hop(s: &UdpSocket) -> std::io::Result<()> {
    // next header (filled in by the kernel), length 0 (8 bytes), PadN with 4 zero bytes.
    let opts: [u8; 8] = [0, 0, 1, 4, 0, 0, 0, 0];
    setsockopt(s, libc::IPPROTO_IPV6, libc::IPV6_HOPOPTS, &opts)
}

/// setsockopt(2) with the option value `value`, as its bytes.
fn setsockopt<T>(fd: &impl AsRawFd, level: i32, name: i32, value: &T) -> std::io::Result<()> {
    // SAFETY: valid fd; the option buffer is `value`, valid for its size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (value as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

fn read_token() -> String {
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    line.trim().to_string()
}

fn print(o: &Outcome, started: Instant) {
    let v = json!({
        "ok": o.ok, "errno": o.errno, "stage": o.stage,
        "elapsed_us": started.elapsed().as_micros() as u64, "reply": o.reply,
    });
    println!("{v}");
    let _ = std::io::stdout().flush();
}

/// An HTTP GET of `path` carrying `token` in a header (the metadata service logs it), over a
/// TCP connection to `dst`; the reply starts with `peer=<getpeername()>` on its own line.
fn http_get(dst: SocketAddr, token: &str, path: &str) -> Outcome {
    http(dst, "GET", path, &format!("X-Probe-Token: {token}\r\n"))
}

/// IMDSv2 as the AWS SDKs do it: a session token from `PUT /latest/api/token`, then a GET of
/// `path` with it. A PUT that gets no answer fails at stage `token` (a hop limit the answer
/// could not cross); the GET's outcome otherwise.
fn imdsv2_get(dst: SocketAddr, token: &str, path: &str) -> Outcome {
    let put = http(
        dst,
        "PUT",
        "/latest/api/token",
        &format!("X-Probe-Token: {token}-put\r\nX-aws-ec2-metadata-token-ttl-seconds: 60\r\n"),
    );
    let reply = put.reply.as_deref().unwrap_or("");
    let session = match reply.split_once("\r\n\r\n") {
        Some((head, body)) if put.ok && head.contains(" 200 ") => body.trim().to_string(),
        _ => return Outcome { stage: "token", ..put },
    };
    http(
        dst,
        "GET",
        path,
        &format!("X-Probe-Token: {token}\r\nX-aws-ec2-metadata-token: {session}\r\n"),
    )
}

/// One HTTP/1.1 request with `headers` (each ending in CRLF), its connection closed after.
fn http(dst: SocketAddr, method: &str, path: &str, headers: &str) -> Outcome {
    let mut s = match TcpStream::connect_timeout(&dst, Duration::from_secs(2)) {
        Ok(s) => s,
        Err(e) => return fail("connect", &e),
    };
    let peer = s.peer_addr().map(|p| p.to_string()).unwrap_or_else(|e| format!("error {e}"));
    let host = match dst.ip() {
        IpAddr::V4(a) => a.to_string(),
        IpAddr::V6(a) => format!("[{a}]"),
    };
    let req =
        format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n");
    if let Err(e) = s.write_all(req.as_bytes()) {
        return fail("send", &e);
    }
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    let mut reply = Vec::new();
    match s.read_to_end(&mut reply) {
        Ok(_) if !reply.is_empty() => Outcome {
            ok: true,
            errno: None,
            stage: "recv",
            reply: Some(format!("peer={peer}\n{}", String::from_utf8_lossy(&reply))),
        },
        Ok(_) => {
            Outcome { ok: false, errno: None, stage: "recv", reply: Some(format!("peer={peer}\n")) }
        }
        Err(e) => fail("recv", &e),
    }
}

fn run(cmd: &str, dst: SocketAddr, token: &str, iface: &str) -> Outcome {
    match cmd {
        // `iface` is the path here.
        "http" => http_get(dst, token, iface),
        "imdsv2" => imdsv2_get(dst, token, iface),
        "bind" => match std::net::TcpListener::bind(dst) {
            Ok(_) => Outcome { ok: true, errno: None, stage: "bind", reply: None },
            Err(e) => fail("bind", &e),
        },
        "tcp" => match TcpStream::connect_timeout(&dst, Duration::from_secs(2)) {
            Ok(s) => tcp_exchange(s, token),
            Err(e) => fail("connect", &e),
        },
        "udp" => match udp_socket(&dst) {
            Ok(s) => udp_exchange(&s, Some(dst), token),
            Err(e) => fail("socket", &e),
        },
        "udp-connected" => match udp_socket(&dst).and_then(|s| s.connect(dst).map(|()| s)) {
            Ok(s) => udp_exchange(&s, None, token),
            Err(e) => fail("connect", &e),
        },
        "raw" => raw_syn(&dst, token),
        "hold-tcp" => match TcpStream::connect_timeout(&dst, Duration::from_secs(2)) {
            Ok(s) => {
                print(
                    &Outcome { ok: true, errno: None, stage: "connected", reply: None },
                    Instant::now(),
                );
                let token = read_token();
                tcp_exchange(s, &token)
            }
            Err(e) => fail("connect", &e),
        },
        "hold-udp" | "hold-udp-hbh" => match udp_socket(&dst)
            .and_then(|s| s.connect(dst).map(|()| s))
            .and_then(|s| if cmd == "hold-udp-hbh" { hop_by_hop(&s).map(|()| s) } else { Ok(s) })
        {
            Ok(s) => {
                print(
                    &Outcome { ok: true, errno: None, stage: "connected", reply: None },
                    Instant::now(),
                );
                let token = read_token();
                udp_exchange(&s, None, &token)
            }
            Err(e) => fail("connect", &e),
        },
        "hammer-tcp" => hammer_tcp(dst, token),
        "orphan-flood" => handshake::orphan_flood(dst),
        "hold-many" => handshake::hold_many(dst, token),
        "hold-forge" => handshake::hold_forge(dst, token),
        "packet" => packet_udp(dst, token, iface),
        _ => Outcome { ok: false, errno: Some(libc::EINVAL), stage: "usage", reply: None },
    }
}

/// A hand-built Ethernet + IPv4 + UDP frame carrying the token, sent on an AF_PACKET socket
/// bound to `iface`: it never passes the cgroup socket hooks. L2 broadcast, so no ARP is
/// needed; the receiver delivers it by its IP destination.
fn packet_udp(dst: SocketAddr, token: &str, iface: &str) -> Outcome {
    let IpAddr::V4(ip) = dst.ip() else {
        return Outcome {
            ok: false,
            errno: Some(libc::EAFNOSUPPORT),
            stage: "socket",
            reply: None,
        };
    };
    let ip = frame::udp4(Ipv4Addr::new(169, 254, 0, 1), ip, dst.port(), token.as_bytes());
    let f = frame::ethernet([0xff; 6], frame::SRC_MAC, &[], frame::ETH_P_IP, &ip);
    send_frames(iface, frame::ETH_P_IP, &[f], Bypass::No)
}

/// An AF_PACKET socket and the index of `iface`.
fn packet_socket(iface: &str) -> Result<(OwnedFd, u32), Outcome> {
    let Ok(cname) = std::ffi::CString::new(iface) else {
        return Err(Outcome { ok: false, errno: Some(libc::EINVAL), stage: "usage", reply: None });
    };
    // SAFETY: valid C string.
    let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    if ifindex == 0 {
        return Err(fail("ifindex", &std::io::Error::last_os_error()));
    }
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(fail("socket", &std::io::Error::last_os_error()));
    }
    // SAFETY: fresh valid fd.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, ifindex))
}

/// Send the frame `f` on `sock` out of `ifindex`, with `sll_protocol` `proto` (which the
/// sender chooses freely; the frame's own Ethernet type may say otherwise).
fn af_packet_send(sock: &OwnedFd, ifindex: u32, proto: u16, f: &[u8]) -> std::io::Result<()> {
    // SAFETY: zeroed sockaddr_ll is valid; the fields set below are all it needs.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto.to_be();
    sll.sll_ifindex = ifindex as i32;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&f[..6]);
    // SAFETY: valid buffer and address.
    let rc = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            f.as_ptr().cast(),
            f.len(),
            0,
            (&sll as *const libc::sockaddr_ll).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// Whether, and through which syscall ABI, a frame sender asks for PACKET_QDISC_BYPASS.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Bypass {
    No,
    Native,
    /// Through the 32-bit compat ABI (`int 0x80`), which runs no cgroup/setsockopt program.
    Compat,
}

/// `frame` / `frame-bypass` / `frame-bypass-compat`: send `frames` on `iface`, after asking
/// for PACKET_QDISC_BYPASS as `bypass` says. Every frame is sent even when one fails (a tc drop on egress shows as
/// ENOBUFS); the first failure is the result. If the option is denied, that is the result
/// (`stage: "setsockopt"`), and `reply` says how the sends went.
fn send_frames(iface: &str, proto: u16, frames: &[Vec<u8>], bypass: Bypass) -> Outcome {
    let (sock, ifindex) = match packet_socket(iface) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let (level, opt) = (libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS);
    let denied = match bypass {
        Bypass::No => None,
        Bypass::Native => setsockopt(&sock, level, opt, &1i32).err(),
        Bypass::Compat => sidedoor::compat_setsockopt_one(&sock, level, opt).err(),
    };
    let results: Vec<_> = frames.iter().map(|f| af_packet_send(&sock, ifindex, proto, f)).collect();
    let failed = results.into_iter().find_map(Result::err);
    let sent = match &failed {
        None => "sent".to_owned(),
        Some(e) => format!("send failed: {e}"),
    };
    match (denied, failed) {
        (Some(e), _) => {
            Outcome { ok: false, errno: e.raw_os_error(), stage: "setsockopt", reply: Some(sent) }
        }
        (None, Some(e)) => fail("send", &e),
        (None, None) => Outcome { ok: true, errno: None, stage: "send", reply: None },
    }
}

/// `ip-raw`: send IP packets as they are (header included) on a raw socket of their family.
fn send_raw_ip(packets: &[Vec<u8>]) -> Outcome {
    for p in packets {
        let v6 = p.first().is_some_and(|b| b >> 4 == 6);
        let family = if v6 { libc::AF_INET6 } else { libc::AF_INET };
        // SAFETY: plain socket(2); owned right away.
        let fd = unsafe { libc::socket(family, libc::SOCK_RAW, libc::IPPROTO_RAW) };
        if fd < 0 {
            return fail("socket", &std::io::Error::last_os_error());
        }
        // SAFETY: fresh valid fd.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let dst: SocketAddr = if v6 {
            let a: [u8; 16] = p[24..40].try_into().unwrap_or_default();
            SocketAddr::new(IpAddr::from(a), 0)
        } else {
            let a: [u8; 4] = p[16..20].try_into().unwrap_or_default();
            SocketAddr::new(IpAddr::from(a), 0)
        };
        let sent = CSockAddr::from(dst).sendto(&sock, p);
        if let Err(e) = sent {
            return fail("send", &e);
        }
    }
    Outcome { ok: true, errno: None, stage: "send", reply: None }
}

/// A socket address in its C form, for sendto(2).
enum CSockAddr {
    V4(libc::sockaddr_in),
    V6(libc::sockaddr_in6),
}

impl From<SocketAddr> for CSockAddr {
    fn from(a: SocketAddr) -> Self {
        match a {
            SocketAddr::V4(a) => CSockAddr::V4(libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                sin_zero: [0; 8],
            }),
            SocketAddr::V6(a) => {
                // SAFETY: an all-zero sockaddr_in6 is valid.
                let mut s: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
                s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                s.sin6_port = a.port().to_be();
                s.sin6_addr.s6_addr = a.ip().octets();
                CSockAddr::V6(s)
            }
        }
    }
}

impl CSockAddr {
    fn sendto(&self, sock: &OwnedFd, buf: &[u8]) -> std::io::Result<()> {
        let (ptr, len) = match self {
            CSockAddr::V4(s) => ((s as *const libc::sockaddr_in).cast(), size_of_val(s)),
            CSockAddr::V6(s) => ((s as *const libc::sockaddr_in6).cast(), size_of_val(s)),
        };
        // SAFETY: valid buffer and address of the given lengths.
        let n = unsafe {
            libc::sendto(
                sock.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                0,
                ptr,
                len as libc::socklen_t,
            )
        };
        if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
    }
}

/// `struct xdp_umem_reg` (with `flags` and `tx_metadata_len`).
#[repr(C)]
struct XdpUmemReg {
    addr: u64,
    len: u64,
    chunk_size: u32,
    headroom: u32,
    flags: u32,
    tx_metadata_len: u32,
}

const SOL_XDP: i32 = 283;
const XDP_UMEM_REG: i32 = 4;

/// `xdp-umem-reg`: the first step of an AF_XDP socket, which sends and receives frames
/// beside the whole stack (tc included): register a UMEM of 16 pages.
fn xdp_umem_reg() -> Outcome {
    // SAFETY: plain socket(2); owned right away.
    let fd = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return fail("socket", &std::io::Error::last_os_error());
    }
    // SAFETY: fresh valid fd.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = 16 * 4096;
    // SAFETY: anonymous private mapping; unmapped below.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if mem == libc::MAP_FAILED {
        return fail("mmap", &std::io::Error::last_os_error());
    }
    let reg = XdpUmemReg {
        addr: mem as u64,
        len: len as u64,
        chunk_size: 2048,
        headroom: 0,
        flags: 0,
        tx_metadata_len: 0,
    };
    let registered = setsockopt(&sock, SOL_XDP, XDP_UMEM_REG, &reg);
    drop(sock);
    // SAFETY: the mapping made above; the socket holding it is closed.
    unsafe { libc::munmap(mem, len) };
    match registered {
        Ok(()) => Outcome { ok: true, errno: None, stage: "setsockopt", reply: None },
        Err(e) => fail("setsockopt", &e),
    }
}

/// `hold-frame-bypass`: an AF_PACKET socket with PACKET_QDISC_BYPASS, set up now; prints
/// `connected`, then sends the frames of the next stdin line (hex, `,`-separated) on it.
fn hold_frame_bypass(iface: &str, proto: u16) -> Outcome {
    let (sock, ifindex) = match packet_socket(iface) {
        Ok(s) => s,
        Err(o) => return o,
    };
    if let Err(e) = setsockopt(&sock, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, &1i32) {
        return fail("setsockopt", &e);
    }
    print(&Outcome { ok: true, errno: None, stage: "connected", reply: None }, Instant::now());
    let line = read_token();
    for h in line.split(',') {
        let Ok(f) = frame::from_hex(h) else {
            return Outcome { ok: false, errno: Some(libc::EINVAL), stage: "usage", reply: None };
        };
        if let Err(e) = af_packet_send(&sock, ifindex, proto, &f) {
            return fail("send", &e);
        }
    }
    Outcome { ok: true, errno: None, stage: "send", reply: None }
}

/// `tap`: attach a queue of our own to the multi-queue tap `iface`, as a VM's VMM does, and
/// write the frames into it: the node receives them charged to this process's tun socket.
fn tap_write(iface: &str, frames: &[Vec<u8>]) -> Outcome {
    let fd = match integration_tests::tap::attach(iface, 0) {
        Ok(fd) => fd,
        Err(e) => return fail("attach", &e),
    };
    for f in frames {
        // SAFETY: valid fd and buffer.
        if unsafe { libc::write(fd.as_raw_fd(), f.as_ptr().cast(), f.len()) } < 0 {
            return fail("write", &std::io::Error::last_os_error());
        }
    }
    Outcome { ok: true, errno: None, stage: "send", reply: None }
}

/// The hand-built-bytes commands (see the module doc), or `None` for the others.
fn run_bytes(rest: &[String]) -> Option<Outcome> {
    let hex = |list: &str| -> Option<Vec<Vec<u8>>> {
        list.split(',').map(|h| frame::from_hex(h).ok()).collect()
    };
    let usage = Outcome { ok: false, errno: Some(libc::EINVAL), stage: "usage", reply: None };
    Some(match rest {
        [cmd, iface, proto, frames]
            if ["frame", "frame-bypass", "frame-bypass-compat"].contains(&cmd.as_str()) =>
        {
            let bypass = match cmd.as_str() {
                "frame" => Bypass::No,
                "frame-bypass" => Bypass::Native,
                _ => Bypass::Compat,
            };
            match (u16::from_str_radix(proto, 16), hex(frames)) {
                (Ok(proto), Some(frames)) => send_frames(iface, proto, &frames, bypass),
                _ => usage,
            }
        }
        [cmd, kind, iface, needle] if cmd == "hold-capture" => {
            sidedoor::hold_capture(kind, iface, needle)
        }
        [cmd, packets] if cmd == "ip-raw" => match hex(packets) {
            Some(p) => send_raw_ip(&p),
            None => usage,
        },
        [cmd] if cmd == "xdp-umem-reg" => xdp_umem_reg(),
        [cmd, iface, proto] if cmd == "hold-frame-bypass" => match u16::from_str_radix(proto, 16) {
            Ok(proto) => hold_frame_bypass(iface, proto),
            Err(_) => usage,
        },
        [cmd, iface, frames] if cmd == "tap" => match hex(frames) {
            Some(f) => tap_write(iface, &f),
            None => usage,
        },
        [cmd, via, addr, port, token] if cmd == "udp-lsrr" => {
            match (via.parse::<Ipv4Addr>(), addr.parse::<Ipv4Addr>(), port.parse::<u16>()) {
                (Ok(via), Ok(addr), Ok(port)) => {
                    udp_lsrr(via, SocketAddr::new(addr.into(), port), token)
                }
                _ => usage,
            }
        }
        [cmd, kind, id, frames] if cmd == "test-run" => {
            match (kind.as_str(), id.parse(), hex(frames)) {
                ("tc", Ok(id), Some(f)) => test_run(id, testrun::Kind::Tc, &f),
                ("egress", Ok(id), Some(f)) => test_run(id, testrun::Kind::Egress, &f),
                _ => usage,
            }
        }
        _ => return None,
    })
}

fn test_run(id: u32, kind: testrun::Kind, frames: &[Vec<u8>]) -> Outcome {
    let codes: anyhow::Result<Vec<String>> = testrun::SkbProgram::by_id(id, kind)
        .and_then(|p| frames.iter().map(|f| Ok((p.run(f, 1)?.code as i32).to_string())).collect());
    match codes {
        Ok(c) => Outcome { ok: true, errno: None, stage: "test-run", reply: Some(c.join(",")) },
        Err(e) => {
            Outcome { ok: false, errno: None, stage: "test-run", reply: Some(format!("{e:#}")) }
        }
    }
}

/// connect() + send the token in a tight loop until stdin yields a line.
fn hammer_tcp(dst: SocketAddr, token: &str) -> Outcome {
    use std::sync::atomic::Ordering;
    let stop = handshake::stop_on_stdin();
    print(&Outcome { ok: true, errno: None, stage: "connected", reply: None }, Instant::now());
    let (mut attempts, mut successes, mut eperm, mut other) = (0u64, 0u64, 0u64, 0u64);
    while !stop.load(Ordering::Acquire) {
        attempts += 1;
        match TcpStream::connect_timeout(&dst, Duration::from_millis(300)) {
            Ok(mut s) => {
                successes += 1;
                let _ = s.write_all(request(token).as_bytes());
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => eperm += 1,
            Err(_) => other += 1,
        }
    }
    Outcome {
        ok: successes == 0,
        errno: None,
        stage: "hammer",
        reply: Some(format!(
            "attempts={attempts} successes={successes} eperm={eperm} other={other}"
        )),
    }
}

fn main() {
    let rest = integration_tests::imds::enter_workload("probe");
    if let [cmd, program, args @ ..] = rest.as_slice()
        && cmd == "exec"
    {
        use std::os::unix::process::CommandExt as _;
        let e = std::process::Command::new(program).args(args).exec();
        eprintln!("probe: exec {program}: {e}");
        std::process::exit(127);
    }
    let started = Instant::now();
    if let Some(outcome) = run_bytes(&rest) {
        print(&outcome, started);
        return;
    }
    let [cmd, addr, port, tail @ ..] = rest.as_slice() else {
        eprintln!("usage: probe --netns PATH [--cgroup DIR] CMD ADDR PORT [TOKEN]");
        std::process::exit(2);
    };
    let (Ok(ip), Ok(port)) = (addr.parse::<IpAddr>(), port.parse::<u16>()) else {
        eprintln!("probe: bad address or port {addr} {port}");
        std::process::exit(2);
    };
    let token = tail.first().map(String::as_str).unwrap_or("");
    let iface = tail.get(1).map(String::as_str).unwrap_or("");
    let outcome = run(cmd, SocketAddr::new(ip, port), token, iface);
    print(&outcome, started);
}
