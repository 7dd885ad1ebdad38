//! The probe's attacks on the way to the metadata proxy: handshakes that never reach the
//! proxy's side (each would leave a caller record waiting in the kernel), and a listener that
//! poses as the proxy behind a DNAT.
use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use super::{Outcome, fail, print, read_token, setsockopt};

/// A TCP socket of `dst`'s family.
fn tcp_socket(dst: &SocketAddr) -> std::io::Result<OwnedFd> {
    let family = if dst.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh valid fd, owned from here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A flag raised when a line arrives on stdin (the test's word to stop).
pub(super) fn stop_on_stdin() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let raised = stop.clone();
    std::thread::spawn(move || {
        read_token();
        raised.store(true, Ordering::Release);
    });
    stop
}

/// A blocking connect of `fd` to `dst`.
fn connect(fd: &OwnedFd, dst: &SocketAddr) -> std::io::Result<()> {
    // SAFETY: zeroed sockaddr_storage is valid; filled below for the family.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match dst {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            let sin = unsafe { &mut *(&raw mut ss).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as u16;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            let sin6 = unsafe { &mut *(&raw mut ss).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as u16;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: valid address of `len` bytes.
    let rc =
        unsafe { libc::connect(fd.as_raw_fd(), (&raw const ss).cast(), len as libc::socklen_t) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Until a line arrives on stdin: connect with TCP_DEFER_ACCEPT set (the kernel then delays
/// the handshake's last ACK) and close at once with SO_LINGER {1, 0} (a reset goes first), so
/// that the far end never completes its side of the handshake. No capability needed. Reports
/// `attempts=N connected=N eperm=N other=N` (ok: some connected).
pub(super) fn orphan_flood(dst: SocketAddr) -> Outcome {
    let stop = stop_on_stdin();
    print(&Outcome { ok: true, errno: None, stage: "connected", reply: None }, Instant::now());
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    let (mut attempts, mut connected, mut eperm, mut other) = (0u64, 0u64, 0u64, 0u64);
    while !stop.load(Ordering::Acquire) {
        attempts += 1;
        let Ok(fd) = tcp_socket(&dst) else {
            other += 1;
            continue;
        };
        let set = setsockopt(&fd, libc::IPPROTO_TCP, libc::TCP_DEFER_ACCEPT, &1i32)
            .and_then(|()| setsockopt(&fd, libc::SOL_SOCKET, libc::SO_LINGER, &linger));
        if set.is_err() {
            other += 1;
            continue;
        }
        match connect(&fd, &dst) {
            Ok(()) => connected += 1,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => eperm += 1,
            Err(_) => other += 1,
        }
        drop(fd);
    }
    Outcome {
        ok: connected > 0,
        errno: None,
        stage: "flood",
        reply: Some(format!(
            "attempts={attempts} connected={connected} eperm={eperm} other={other}"
        )),
    }
}

/// Open `count` connections to `dst` and keep them, then print `{"stage":"connected"}` and
/// wait for a line on stdin before closing them. Reports `connected=N eperm=N other=N`.
pub(super) fn hold_many(dst: SocketAddr, count: &str) -> Outcome {
    let Ok(count) = count.parse::<usize>() else {
        return Outcome { ok: false, errno: Some(libc::EINVAL), stage: "usage", reply: None };
    };
    raise_nofile();
    let (mut held, mut eperm, mut other) = (Vec::new(), 0u64, 0u64);
    for _ in 0..count {
        match TcpStream::connect_timeout(&dst, Duration::from_secs(2)) {
            Ok(s) => held.push(s),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => eperm += 1,
            Err(_) => other += 1,
        }
    }
    let counts = format!("connected={} eperm={eperm} other={other}", held.len());
    print(
        &Outcome { ok: true, errno: None, stage: "connected", reply: Some(counts.clone()) },
        Instant::now(),
    );
    read_token();
    drop(held);
    Outcome { ok: true, errno: None, stage: "held", reply: Some(counts) }
}

/// The soft limit on open files raised to the hard one (a pod's default soft limit is low).
fn raise_nofile() {
    // SAFETY: plain getrlimit/setrlimit on a local struct.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Listen on `addr` as if it were the metadata proxy, print `{"stage":"connected"}`, and
/// answer every connection `200` with `marker` in the body until a line arrives on stdin.
/// Reports `accepted=N` (ok: none).
pub(super) fn hold_forge(addr: SocketAddr, marker: &str) -> Outcome {
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => return fail("bind", &e),
    };
    let _ = listener.set_nonblocking(true);
    let stop = stop_on_stdin();
    print(&Outcome { ok: true, errno: None, stage: "connected", reply: None }, Instant::now());
    let accepted = AtomicU64::new(0);
    let body = format!("forged {marker}\n");
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((mut s, _)) => {
                accepted.fetch_add(1, Ordering::Relaxed);
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                let mut buf = [0u8; 2048];
                let _ = s.read(&mut buf);
                let _ = s.write_all(reply.as_bytes());
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    let n = accepted.load(Ordering::Relaxed);
    Outcome { ok: n == 0, errno: None, stage: "forge", reply: Some(format!("accepted={n}")) }
}
