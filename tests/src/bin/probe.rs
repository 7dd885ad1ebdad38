//! A workload: joins a cgroup and a test network namespace, performs one socket operation
//! and prints one JSON line `{"ok","errno","stage","elapsed_us","reply"}`.
//!
//! `probe --netns PATH --cgroup DIR <tcp|udp|udp-connected|raw|hold-tcp|hold-udp> ADDR PORT [TOKEN]`
//!
//! Hold commands connect first, print `{"stage":"connected"}`, read the token from stdin,
//! then send. `hammer-tcp` prints `{"stage":"connected"}`, then connect()s and sends the
//! token in a loop until a line arrives on stdin, and reports
//! `attempts=N successes=N eperm=N other=N` as its reply (ok = no success). It refuses to run without --netns: it never sends from the host namespace.
use std::{
    io::{BufRead as _, Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use serde_json::json;

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
    let mut seg = vec![0u8; 20];
    seg[0..2].copy_from_slice(&(40000 + (std::process::id() % 20000) as u16).to_be_bytes());
    seg[2..4].copy_from_slice(&dst.port().to_be_bytes());
    seg[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    seg[12] = 5 << 4; // data offset: 5 words
    seg[13] = 0x02; // SYN
    seg[14..16].copy_from_slice(&64240u16.to_be_bytes());
    seg.extend_from_slice(token.as_bytes());
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: buffers valid for the given lengths.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            seg.as_ptr().cast(),
            seg.len(),
            0,
            (&sin as *const libc::sockaddr_in).cast(),
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if n < 0 {
        fail("send", &std::io::Error::last_os_error())
    } else {
        Outcome { ok: true, errno: None, stage: "send", reply: None }
    }
}

/// Make every datagram of an IPv6 socket carry a hop-by-hop options header (one PadN option),
/// so the transport header is no longer right after the IPv6 header.
fn hop_by_hop(s: &UdpSocket) -> std::io::Result<()> {
    // next header (filled in by the kernel), length 0 (8 bytes), PadN with 4 zero bytes.
    let opts: [u8; 8] = [0, 0, 1, 4, 0, 0, 0, 0];
    // SAFETY: valid fd and option buffer.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_HOPOPTS,
            opts.as_ptr().cast(),
            opts.len() as libc::socklen_t,
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

fn run(cmd: &str, dst: SocketAddr, token: &str, iface: &str) -> Outcome {
    match cmd {
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
        "packet" => packet_udp(dst, token, iface),
        _ => Outcome { ok: false, errno: Some(libc::EINVAL), stage: "usage", reply: None },
    }
}

fn ip_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = h.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
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
    let Ok(cname) = std::ffi::CString::new(iface) else {
        return Outcome { ok: false, errno: Some(libc::EINVAL), stage: "usage", reply: None };
    };
    // SAFETY: plain libc calls with valid arguments; the fd is owned right away.
    let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    if ifindex == 0 {
        return fail("ifindex", &std::io::Error::last_os_error());
    }
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return fail("socket", &std::io::Error::last_os_error());
    }
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let payload = token.as_bytes();
    let udp_len = 8 + payload.len();
    let total = 20 + udp_len;
    let mut f = Vec::with_capacity(14 + total);
    f.extend_from_slice(&[0xff; 6]); // dst MAC: broadcast
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]); // src MAC: locally administered
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let mut iph = [0u8; 20];
    iph[0] = 0x45;
    iph[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    iph[8] = 64;
    iph[9] = 17;
    iph[12..16].copy_from_slice(&[169, 254, 0, 1]);
    iph[16..20].copy_from_slice(&ip.octets());
    let csum = ip_checksum(&iph);
    iph[10..12].copy_from_slice(&csum.to_be_bytes());
    f.extend_from_slice(&iph);
    f.extend_from_slice(&40000u16.to_be_bytes());
    f.extend_from_slice(&dst.port().to_be_bytes());
    f.extend_from_slice(&(udp_len as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]); // no UDP checksum (allowed for IPv4)
    f.extend_from_slice(payload);
    // SAFETY: zeroed sockaddr_ll is valid; the fields set below are all it needs.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = 0x0800u16.to_be();
    sll.sll_ifindex = ifindex as i32;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&[0xff; 6]);
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
    if rc < 0 {
        return fail("send", &std::io::Error::last_os_error());
    }
    Outcome { ok: true, errno: None, stage: "send", reply: None }
}

/// connect() + send the token in a tight loop until stdin yields a line.
fn hammer_tcp(dst: SocketAddr, token: &str) -> Outcome {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    };
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    std::thread::spawn(move || {
        read_token();
        s2.store(true, Ordering::Release);
    });
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
    let [cmd, addr, port, tail @ ..] = rest.as_slice() else {
        eprintln!("usage: probe --netns PATH [--cgroup DIR] CMD ADDR PORT [TOKEN]");
        std::process::exit(2);
    };
    let (Ok(ip), Ok(port)) = (addr.parse::<IpAddr>(), port.parse::<u16>()) else {
        eprintln!("probe: bad address or port {addr} {port}");
        std::process::exit(2);
    };
    let token = tail.first().map(String::as_str).unwrap_or("");
    let started = Instant::now();
    let iface = tail.get(1).map(String::as_str).unwrap_or("");
    let outcome = run(cmd, SocketAddr::new(ip, port), token, iface);
    print(&outcome, started);
}
