//! A fake instance-metadata service inside the imds netns: HTTP on TCP, UDP echo, and a raw
//! socket that sees every TCP segment arriving. Every probe carries a unique token; the
//! service records what it receives so tests can prove a token never got there.
//!
//! Over HTTP it answers the platforms' own requests as the real services do ([`platforms`]:
//! IMDSv2's session token, GCP's and Azure's headers), and everything else with one default
//! reply ([`INSTANCE_ID`]).
use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};

use crate::{
    net::{DNS_V4, DNS_V6, IMDS_V4, IMDS_V6, NTP_V4, TestNet},
    sys::pin_to_cpu,
};

pub mod platforms;

/// What the metadata service answers by default, and as the instance id.
pub const INSTANCE_ID: &str = "i-0123456789abcdef0";

#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl Log {
    fn record(&self, via: &str, payload: &[u8]) {
        if let Ok(mut v) = self.0.lock() {
            v.push(format!("{via} {}", String::from_utf8_lossy(payload)));
        }
    }
}

pub struct FakeImds {
    stop: Arc<AtomicBool>,
    log: Arc<Log>,
    /// HTTP connections accepted, on every address.
    accepted: Arc<AtomicUsize>,
    /// The hop limit of IMDSv2's token answers (0: the system default), as EC2's
    /// `HttpPutResponseHopLimit`.
    token_hops: Arc<AtomicU32>,
    threads: Vec<JoinHandle<()>>,
}

/// The start of every workload binary (`probe`, the bench's `bench-probe`): parse `--netns
/// PATH`, `--cgroup DIR` and `--cpu N` out of the arguments, join the cgroup, enter the netns,
/// pin itself to CPU N if asked, and return the remaining arguments. Exits with 2 and a message
/// on any failure; will not run without `--netns`, so a workload never sends from the host
/// namespace by accident (`--netns self` stays where it was started: inside a pod).
pub fn enter_workload(program: &str) -> Vec<String> {
    let mut netns = None;
    let mut cgroup = None;
    let mut cpu = None;
    let mut rest = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--netns" => netns = it.next(),
            "--cgroup" => cgroup = it.next(),
            "--cpu" => cpu = it.next(),
            _ => rest.push(a),
        }
    }
    let Some(netns) = netns else {
        eprintln!("{program}: --netns is required (never send from the host namespace)");
        std::process::exit(2);
    };
    if let Some(cg) = cgroup
        && let Err(e) = std::fs::write(format!("{cg}/cgroup.procs"), "0")
    {
        eprintln!("{program}: joining cgroup {cg}: {e}");
        std::process::exit(2);
    }
    // `self`: the namespace it was started in, a pod's (a pod may not setns): the cluster
    // test runs `probe` inside its pods, never on the machine.
    if netns != "self"
        && let Err(e) = enter_netns(&netns)
    {
        eprintln!("{program}: {e:#}");
        std::process::exit(2);
    }
    if let Some(cpu) = cpu {
        let pinned = cpu.parse().map_err(anyhow::Error::from).and_then(pin_to_cpu);
        if let Err(e) = pinned {
            eprintln!("{program}: --cpu {cpu}: {e:#}");
            std::process::exit(2);
        }
    }
    rest
}

/// SO_RCVTIMEO on a socket, so blocking calls wake up to check a stop flag.
pub fn set_rcvtimeo(fd: &impl std::os::fd::AsRawFd, t: Duration) {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv);
}

/// `setsockopt(2)` with `value` as the option's buffer; best effort (a test socket that
/// refuses an option shows it in what the test then sees).
fn setsockopt<T>(fd: &impl std::os::fd::AsRawFd, level: i32, name: i32, value: &T) {
    // SAFETY: valid fd; the buffer is `value`, of its own size.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (value as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        );
    }
}

pub use crate::sys::enter_netns;

const TICK: Duration = Duration::from_millis(100);

impl FakeImds {
    pub fn start(net: &TestNet) -> Result<FakeImds> {
        let mut me = FakeImds {
            stop: Arc::new(AtomicBool::new(false)),
            log: Default::default(),
            accepted: Default::default(),
            token_hops: Default::default(),
            threads: vec![],
        };
        let tcp = [
            format!("{IMDS_V4}:80"),
            format!("{IMDS_V4}:53"),
            format!("{DNS_V4}:80"),
            format!("[{IMDS_V6}]:80"),
            format!("[{DNS_V6}]:80"),
        ];
        let udp = [
            format!("{IMDS_V4}:80"),
            format!("{IMDS_V4}:53"),
            format!("{NTP_V4}:123"),
            format!("[{IMDS_V6}]:80"),
            // The neighbours, unprotected: controls for hand-built datagrams, DNS.
            format!("{DNS_V4}:80"),
            format!("{DNS_V4}:53"),
            format!("[{DNS_V6}]:80"),
        ];
        for a in tcp {
            let (accepted, hops) = (me.accepted.clone(), me.token_hops.clone());
            me.spawn(net, format!("tcp {a}"), move |stop, log| {
                serve_tcp(&a, stop, log, accepted, hops)
            })?;
        }
        for a in udp {
            me.spawn(net, format!("udp {a}"), move |stop, log| serve_udp(&a, stop, log))?;
        }
        me.spawn(net, "raw tcp".into(), serve_raw)?;
        Ok(me)
    }

    /// Run `serve` on a thread inside the imds netns; wait until it has bound its socket.
    fn spawn<F>(&mut self, net: &TestNet, what: String, serve: F) -> Result<()>
    where
        F: FnOnce(Arc<AtomicBool>, Arc<Log>) -> Result<Box<dyn FnOnce() + Send>> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let (stop, log, path) = (self.stop.clone(), self.log.clone(), net.imds_path());
        self.threads.push(std::thread::spawn(move || {
            let bound = enter_netns(&path).and_then(|()| serve(stop, log));
            match bound {
                Ok(run) => {
                    let _ = tx.send(Ok(()));
                    run();
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        }));
        rx.recv_timeout(Duration::from_secs(5))
            .map_err(|_| anyhow!("{what}: did not start"))?
            .with_context(|| what)
    }

    /// Send IMDSv2's token answers with this hop limit (IP TTL), as EC2 does with
    /// `HttpPutResponseHopLimit` (1 on a new instance: a container behind the node's
    /// forwarding never gets a token); 0 for the system default.
    pub fn set_token_hop_limit(&self, hops: u32) {
        self.token_hops.store(hops, Ordering::SeqCst);
    }

    /// HTTP connections accepted so far, on every address.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Whether a payload containing `token` has arrived.
    pub fn saw(&self, token: &str) -> bool {
        self.log.0.lock().is_ok_and(|v| v.iter().any(|l| l.contains(token)))
    }

    /// Every payload received that contains `token` (an HTTP request's head, a datagram, a
    /// segment seen by the raw socket), each prefixed with how it came (`tcp ADDR`, `udp ADDR`,
    /// `raw`).
    pub fn received(&self, token: &str) -> Vec<String> {
        self.log
            .0
            .lock()
            .map(|v| v.iter().filter(|l| l.contains(token)).cloned().collect())
            .unwrap_or_default()
    }

    /// The HTTP requests received that carry `token`: their heads, request line first.
    pub fn http_requests(&self, token: &str) -> Vec<String> {
        self.received(token)
            .into_iter()
            .filter_map(|l| {
                l.strip_prefix("tcp ").and_then(|r| r.split_once(' ')).map(|(_, h)| h.to_owned())
            })
            .collect()
    }

    /// Wait up to `timeout` for `token`.
    pub fn wait_for(&self, token: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.saw(token) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for FakeImds {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

type Serve = Result<Box<dyn FnOnce() + Send>>;

fn serve_tcp(
    addr: &str,
    stop: Arc<AtomicBool>,
    log: Arc<Log>,
    accepted: Arc<AtomicUsize>,
    token_hops: Arc<AtomicU32>,
) -> Serve {
    let sa: SocketAddr = addr.parse()?;
    let l = TcpListener::bind(sa).with_context(|| format!("bind {addr}"))?;
    l.set_nonblocking(true)?;
    let via = format!("tcp {addr}");
    Ok(Box::new(move || {
        let mut conns = Vec::new();
        while !stop.load(Ordering::Acquire) {
            match l.accept() {
                Ok((c, _)) => {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let (stop, log, via) = (stop.clone(), log.clone(), via.clone());
                    let hops = token_hops.load(Ordering::SeqCst);
                    conns.push(std::thread::spawn(move || handle_http(c, &stop, &log, &via, hops)));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        for c in conns {
            let _ = c.join();
        }
    }))
}

fn handle_http(mut c: TcpStream, stop: &AtomicBool, log: &Log, via: &str, token_hops: u32) {
    let _ = c.set_nonblocking(false);
    let _ = c.set_read_timeout(Some(TICK));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 2048];
    // Connections may sit idle for a long time (a hold probe opened before the agent).
    while !stop.load(Ordering::Acquire) {
        match c.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                // As the metadata services: an HTTP/1.1 connection is kept for the next
                // request unless the client says close (anything else is answered once).
                while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    // Recorded with whatever came with it, as sent.
                    log.record(via, &buf);
                    let head: Vec<u8> = buf.drain(..end + 4).collect();
                    let keep = keeps_connection(&head[..end]);
                    // For the rest of the connection: a retransmission at the default TTL
                    // would deliver the token after all.
                    if token_hops > 0 && head.starts_with(b"PUT /latest/api/token ") {
                        set_hop_limit(&c, token_hops);
                    }
                    let _ = c.write_all(&platforms::answer(&head[..end]).to_bytes(keep));
                    if !keep {
                        return;
                    }
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

/// The IPv4 TTL and IPv6 unicast hop limit of a connection's segments from now on.
fn set_hop_limit(c: &TcpStream, hops: u32) {
    let _ = c.set_ttl(hops);
    // An IPv4 socket refuses the option harmlessly.
    setsockopt(c, libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, &(hops as libc::c_int));
}

/// Whether a request head asks for its connection to be kept: HTTP/1.1 without
/// `Connection: close`.
fn keeps_connection(head: &[u8]) -> bool {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.split("\r\n");
    let http11 = lines.next().is_some_and(|l| l.ends_with(" HTTP/1.1"));
    let close = lines.any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("connection") && v.to_ascii_lowercase().contains("close")
        })
    });
    http11 && !close
}

fn serve_udp(addr: &str, stop: Arc<AtomicBool>, log: Arc<Log>) -> Serve {
    let s = UdpSocket::bind(addr).with_context(|| format!("bind udp {addr}"))?;
    s.set_read_timeout(Some(TICK))?;
    let via = format!("udp {addr}");
    Ok(Box::new(move || {
        let mut buf = [0u8; 2048];
        while !stop.load(Ordering::Acquire) {
            if let Ok((n, peer)) = s.recv_from(&mut buf) {
                log.record(&via, &buf[..n]);
                let _ = s.send_to(&buf[..n], peer);
            }
        }
    }))
}

fn serve_raw(stop: Arc<AtomicBool>, log: Arc<Log>) -> Serve {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP) };
    if fd < 0 {
        bail!("raw socket: {}", std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_rcvtimeo(&fd, TICK);
    Ok(Box::new(move || {
        let mut buf = [0u8; 4096];
        while !stop.load(Ordering::Acquire) {
            // SAFETY: buffer valid for its length.
            let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n > 0 {
                log.record("raw", &buf[..n as usize]);
            }
        }
    }))
}
