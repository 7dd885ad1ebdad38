//! The benchmark workload: joins a cgroup and a test network namespace, runs one tight loop
//! and prints one JSON line with what it measured.
//!
//! `bench-probe --netns PATH [--cgroup DIR] MODE ADDR PORT ARGS…`
//!
//! | mode | args | measures |
//! |---|---|---|
//! | `connect-rate` | SECS | socket()+connect()+close() (linger 0: no TIME_WAIT) per second |
//! | `udp-rate` | SECS | 16-byte sendto() per second on one unconnected UDP socket |
//! | `bulk` | SECS | bytes per second written over one TCP connection |
//! | `deny` | N TIMEOUT_MS | N connect() calls to a denied destination: µs until each returns |
//! | `flip` | refused\|served TIMEOUT_MS | connects every ~200 µs; prints `{"stage":"ready"}` after the first attempt, then the CLOCK_MONOTONIC time of the first attempt with the wanted outcome |
//! | `serve` | MODE | one rate mode kept open: each line on stdin is a number of milliseconds to run it for, each answer one JSON line |
//! | `http` | PATH N | N sequential `GET PATH` (a connection each, as metadata clients do): µs until each response is read whole, its status, and requests per second |
//!
//! The rate modes also report `cpu_s`, the CPU time (user + system) the loop took.
//!
//! It will not run without --netns: it never sends from the host namespace.
use std::{
    io::Write as _,
    net::{IpAddr, SocketAddr, TcpStream},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

// The bench reads the same clock to time what `flip` reports (src/clock.rs).
#[path = "../clock.rs"]
mod clock;
use clock::monotonic_ns;

fn os_err() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// A socket address for the libc calls.
struct RawAddr {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
    family: i32,
}

fn raw_addr(dst: SocketAddr) -> RawAddr {
    // SAFETY: all-zero sockaddr_storage is valid.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match dst {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            RawAddr {
                storage,
                len: size_of::<libc::sockaddr_in>() as libc::socklen_t,
                family: libc::AF_INET,
            }
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: 0,
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in6 and suitably aligned.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            RawAddr {
                storage,
                len: size_of::<libc::sockaddr_in6>() as libc::socklen_t,
                family: libc::AF_INET6,
            }
        }
    }
}

impl RawAddr {
    fn ptr(&self) -> *const libc::sockaddr {
        (&self.storage as *const libc::sockaddr_storage).cast()
    }

    fn socket(&self, kind: i32) -> Result<OwnedFd, i32> {
        // SAFETY: plain socket(2); the fd is owned right away.
        let fd = unsafe { libc::socket(self.family, kind | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(os_err());
        }
        // SAFETY: fresh valid fd.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// close() sends RST instead of FIN: no TIME_WAIT, so a long loop never runs out of ports.
fn linger0(fd: &OwnedFd) {
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: valid fd and option buffer.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// One blocking connect(); Ok or the errno.
fn connect_once(a: &RawAddr) -> Result<(), i32> {
    let fd = a.socket(libc::SOCK_STREAM)?;
    // SAFETY: valid fd and address.
    let rc = unsafe { libc::connect(fd.as_raw_fd(), a.ptr(), a.len) };
    if rc != 0 {
        return Err(os_err());
    }
    linger0(&fd);
    Ok(())
}

/// A non-blocking connect() waited for up to `timeout`: the outcome (ETIMEDOUT when it did
/// not finish) and the microseconds connect()+poll() took.
fn connect_timed(a: &RawAddr, timeout: Duration) -> (Result<(), i32>, f64) {
    let fd = match a.socket(libc::SOCK_STREAM | libc::SOCK_NONBLOCK) {
        Ok(fd) => fd,
        Err(e) => return (Err(e), 0.0),
    };
    linger0(&fd);
    let t = Instant::now();
    // SAFETY: valid fd and address.
    let rc = unsafe { libc::connect(fd.as_raw_fd(), a.ptr(), a.len) };
    let res = if rc == 0 {
        Ok(())
    } else {
        match os_err() {
            libc::EINPROGRESS => {
                let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                // SAFETY: one valid pollfd.
                let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) };
                if n <= 0 {
                    Err(libc::ETIMEDOUT)
                } else {
                    let mut err: i32 = 0;
                    let mut len = size_of::<i32>() as libc::socklen_t;
                    // SAFETY: valid fd and option buffer.
                    unsafe {
                        libc::getsockopt(
                            fd.as_raw_fd(),
                            libc::SOL_SOCKET,
                            libc::SO_ERROR,
                            (&mut err as *mut i32).cast(),
                            &mut len,
                        )
                    };
                    if err == 0 { Ok(()) } else { Err(err) }
                }
            }
            e => Err(e),
        }
    };
    (res, t.elapsed().as_nanos() as f64 / 1000.0)
}

fn errno_counts(errs: &[i32]) -> Value {
    let mut m = serde_json::Map::new();
    for e in errs {
        let k = std::io::Error::from_raw_os_error(*e).to_string();
        let n = m.get(&k).and_then(Value::as_u64).unwrap_or(0);
        m.insert(k, json!(n + 1));
    }
    Value::Object(m)
}

/// A rate workload and what it keeps between slices: the UDP socket, the bulk connection.
enum Rate {
    /// socket()+connect()+close() (linger 0) in a loop.
    Connect(RawAddr),
    /// 16-byte sendto() on one unconnected socket.
    Udp(RawAddr, OwnedFd),
    /// 128 KiB write()s on one TCP connection.
    Bulk(TcpStream, Vec<u8>),
}

impl Rate {
    fn open(mode: &str, dst: SocketAddr) -> Result<Rate, Value> {
        let a = raw_addr(dst);
        match mode {
            "connect-rate" => Ok(Rate::Connect(a)),
            "udp-rate" => match a.socket(libc::SOCK_DGRAM) {
                Ok(fd) => Ok(Rate::Udp(a, fd)),
                Err(e) => Err(json!({"ok": false, "errno": e})),
            },
            "bulk" => match TcpStream::connect_timeout(&dst, Duration::from_secs(2)) {
                Ok(s) => Ok(Rate::Bulk(s, vec![0xa5u8; 128 * 1024])),
                Err(e) => Err(json!({"ok": false, "errno": e.raw_os_error()})),
            },
            _ => Err(json!({"ok": false, "error": format!("unknown rate mode {mode}")})),
        }
    }

    /// Run for `dur`; what was done, per second, and the CPU time (user + system, softirq
    /// work done on the loop's behalf included) it took.
    fn run(&mut self, dur: Duration) -> Value {
        let cpu0 = cpu_s();
        let t = Instant::now();
        let (mut work, mut errs) = (0u64, Vec::new());
        // The slowest operation: a stall (e.g. a SYN retransmit) shows here.
        let mut max = Duration::ZERO;
        match self {
            Rate::Connect(a) => loop {
                let t0 = Instant::now();
                if t0 - t >= dur {
                    break;
                }
                match connect_once(a) {
                    Ok(()) => work += 1,
                    Err(e) if errs.len() < 1000 => errs.push(e),
                    Err(_) => {}
                }
                max = max.max(t0.elapsed());
            },
            Rate::Udp(a, fd) => {
                let payload = [0x5au8; 16];
                let mut i = 0u64;
                loop {
                    i += 1;
                    if i.is_multiple_of(64) && t.elapsed() >= dur {
                        break;
                    }
                    // SAFETY: valid fd, buffer and address.
                    let n = unsafe {
                        libc::sendto(
                            fd.as_raw_fd(),
                            payload.as_ptr().cast(),
                            payload.len(),
                            0,
                            a.ptr(),
                            a.len,
                        )
                    };
                    if n >= 0 {
                        work += 1;
                    } else if errs.len() < 1000 {
                        errs.push(os_err());
                    }
                }
            }
            Rate::Bulk(s, buf) => {
                while t.elapsed() < dur {
                    match s.write(buf) {
                        Ok(n) => work += n as u64,
                        Err(e) => {
                            errs.push(e.raw_os_error().unwrap_or(0));
                            break;
                        }
                    }
                }
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let unit = if matches!(self, Rate::Bulk(..)) { "bytes" } else { "ops" };
        let mut v = json!({"ok": errs.is_empty(), unit: work, "secs": secs,
                           "rate": work as f64 / secs, "cpu_s": cpu_s() - cpu0,
                           "errors": errs.len(), "errnos": errno_counts(&errs)});
        if matches!(self, Rate::Connect(_)) {
            v["max_us"] = json!(max.as_micros() as u64);
        }
        v
    }
}

/// `serve MODE`: one rate workload kept open, run for as many milliseconds as each line on
/// stdin says, one JSON line per slice; `{"stage":"ready"}` first. Ends at EOF.
fn serve(mode: &str, dst: SocketAddr) -> Value {
    let mut rate = match Rate::open(mode, dst) {
        Ok(r) => r,
        Err(v) => return v,
    };
    let mut out = std::io::stdout().lock();
    let ready = writeln!(out, "{}", json!({"stage": "ready"})).and_then(|()| out.flush());
    if ready.is_err() {
        return json!({"ok": false, "error": "stdout closed"});
    }
    let mut slices = 0u64;
    for line in std::io::stdin().lines() {
        let Ok(ms) = line.map_err(drop).and_then(|l| l.trim().parse::<f64>().map_err(drop)) else {
            return json!({"ok": false, "error": "serve: each line is a number of milliseconds"});
        };
        let v = rate.run(Duration::from_secs_f64(ms / 1000.0));
        if writeln!(out, "{v}").and_then(|()| out.flush()).is_err() {
            break;
        }
        slices += 1;
    }
    json!({"ok": true, "slices": slices})
}

fn deny(dst: SocketAddr, n: usize, timeout: Duration) -> Value {
    let a = raw_addr(dst);
    let mut us = Vec::with_capacity(n);
    let mut errs = Vec::new();
    let mut served = 0u64;
    for _ in 0..n {
        let (res, t) = connect_timed(&a, timeout);
        us.push(t);
        match res {
            Ok(()) => served += 1,
            Err(e) => errs.push(e),
        }
    }
    json!({"ok": served == 0, "samples_us": us, "served": served, "errnos": errno_counts(&errs)})
}

/// `n` sequential GETs of `path`, a connection each, every response read to its end (the
/// proxy and the fake metadata service close after one).
fn http(dst: SocketAddr, path: &str, n: usize) -> Value {
    use std::io::Read as _;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", dst.ip());
    let mut us = Vec::with_capacity(n);
    let mut statuses = std::collections::BTreeMap::<String, u64>::new();
    let mut reply = Vec::with_capacity(4096);
    let started = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        let status = TcpStream::connect_timeout(&dst, Duration::from_secs(5))
            .and_then(|mut c| {
                c.set_read_timeout(Some(Duration::from_secs(5)))?;
                c.write_all(request.as_bytes())?;
                reply.clear();
                c.read_to_end(&mut reply)?;
                Ok(String::from_utf8_lossy(&reply).split(' ').nth(1).unwrap_or("none").to_owned())
            })
            .unwrap_or_else(|e| format!("error {}", e.raw_os_error().unwrap_or(0)));
        us.push(t.elapsed().as_secs_f64() * 1e6);
        *statuses.entry(status).or_default() += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    let ok = statuses.get("200").copied() == Some(n as u64);
    json!({"ok": ok, "samples_us": us, "statuses": statuses, "rps": n as f64 / secs})
}

fn flip(dst: SocketAddr, want_refused: bool, timeout: Duration) -> Value {
    let a = raw_addr(dst);
    let t = Instant::now();
    let mut attempts = 0u64;
    while t.elapsed() < timeout {
        attempts += 1;
        let (res, _) = connect_timed(&a, Duration::from_millis(200));
        let now = monotonic_ns();
        let refused = res.is_err();
        if attempts == 1 {
            println!("{}", json!({"stage": "ready", "first_refused": refused}));
            let _ = std::io::stdout().flush();
        }
        if refused == want_refused {
            return json!({"ok": true, "t_ns": now, "attempts": attempts, "errno": res.err()});
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    json!({"ok": false, "attempts": attempts})
}

/// Abuse: for `secs`, `visits` times a second, make a new cgroup under `base`, move this
/// process into it, connect() `per` times (each denied), move back to `home` and remove
/// the cgroup: `visits` distinct denied cgroups a second, `visits × per` denials.
fn churn(dst: SocketAddr, base: &str, home: &str, visits: f64, per: usize, secs: f64) -> Value {
    let a = raw_addr(dst);
    let pid = std::process::id().to_string();
    let (mut refused, mut served, mut cgroups, mut errors) = (0u64, 0u64, 0u64, Vec::new());
    let start = Instant::now();
    let period = Duration::from_secs_f64(1.0 / visits.max(1.0));
    let mut next = start;
    let mut seq = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        let dir = format!("{base}/churn-{}-{seq}", std::process::id());
        seq += 1;
        let visit = std::fs::create_dir(&dir)
            .and_then(|()| std::fs::write(format!("{dir}/cgroup.procs"), &pid));
        if let Err(e) = visit {
            errors.push(format!("{dir}: {e}"));
            let _ = std::fs::remove_dir(&dir);
            if errors.len() > 10 {
                break;
            }
            continue;
        }
        cgroups += 1;
        for _ in 0..per {
            match connect_once(&a) {
                Ok(()) => served += 1,
                Err(_) => refused += 1,
            }
        }
        let back = std::fs::write(format!("{home}/cgroup.procs"), &pid)
            .and_then(|()| std::fs::remove_dir(&dir));
        if let Err(e) = back {
            errors.push(format!("back to {home}: {e}"));
            break;
        }
        next += period;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    json!({"ok": served == 0 && errors.is_empty(), "cgroups": cgroups, "refused": refused,
           "served": served, "secs": secs, "cgroups_per_s": cgroups as f64 / secs,
           "refused_per_s": refused as f64 / secs, "errors": errors})
}

/// This process's CPU time so far (user + system), seconds.
fn cpu_s() -> f64 {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn run(mode: &str, dst: SocketAddr, args: &[String]) -> Value {
    let num = |i: usize, default: f64| -> f64 {
        args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default)
    };
    let ms = |i: usize| Duration::from_millis(num(i, 1000.0) as u64);
    match mode {
        "connect-rate" | "udp-rate" | "bulk" => match Rate::open(mode, dst) {
            Ok(mut r) => r.run(Duration::from_secs_f64(num(0, 1.0))),
            Err(v) => v,
        },
        "serve" => match args.first() {
            Some(m) => serve(m, dst),
            None => json!({"ok": false, "error": "serve MODE"}),
        },
        "deny" => deny(dst, num(0, 100.0) as usize, ms(1)),
        "http" => match args.first() {
            Some(path) => http(dst, path, num(1, 100.0) as usize),
            None => json!({"ok": false, "error": "http PATH [N]"}),
        },
        "flip" => flip(dst, args.first().is_some_and(|a| a == "refused"), ms(1)),
        "churn" => match args {
            [base, home, ..] => {
                churn(dst, base, home, num(2, 1000.0), num(3, 10.0) as usize, num(4, 1.0))
            }
            _ => json!({"ok": false, "error": "churn BASE HOME [VISITS/S PER SECS]"}),
        },
        _ => json!({"ok": false, "error": format!("unknown mode {mode}")}),
    }
}

fn main() {
    let rest = integration_tests::imds::enter_workload("bench-probe");
    let [mode, addr, port, args @ ..] = rest.as_slice() else {
        eprintln!("usage: bench-probe --netns PATH [--cgroup DIR] MODE ADDR PORT ARGS...");
        std::process::exit(2);
    };
    let (Ok(ip), Ok(port)) = (addr.parse::<IpAddr>(), port.parse::<u16>()) else {
        eprintln!("bench-probe: bad address or port {addr} {port}");
        std::process::exit(2);
    };
    println!("{}", run(mode, SocketAddr::new(ip, port), args));
}
