//! The bench's traffic: sinks inside the imds netns, and the `bench-probe` workload (see
//! `src/bin/bench-probe.rs`) run and driven in a world's cgroups.
use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    path::Path,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow, bail};
use integration_tests::{
    imds::{enter_netns, set_rcvtimeo},
    net::{DNS_V4, IMDS_V4, TestNet},
    probe::{Piped, workload},
};
use serde_json::Value;

use crate::Bins;

/// The unprotected destination of the rate scenarios (open in the AWS policy).
pub(crate) const DEST_V4: &str = DNS_V4;
/// TCP: accept and close at once (connect-rate).
pub(crate) const CONNECT_PORT: u16 = 9000;
/// TCP: read and discard (bulk).
pub(crate) const BULK_PORT: u16 = 9001;
/// UDP: bound, never read (the receive queue drops what does not fit).
pub(crate) const UDP_PORT: u16 = 9002;
/// TCP accept-and-close listener on the protected endpoint too (169.254.169.254:80), so
/// that a served connect() is possible when the policy allows it.
pub(crate) const IMDS_PORT: u16 = 80;

/// Listeners in the imds netns for the benchmark traffic; threads stop on drop.
pub(crate) struct Sink {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

const TICK: Duration = Duration::from_millis(100);

impl Sink {
    pub(crate) fn start(net: &TestNet) -> Result<Sink> {
        let mut sink = Sink { stop: Arc::new(AtomicBool::new(false)), threads: vec![] };
        sink.spawn(net, format!("{DEST_V4}:{CONNECT_PORT}"), Accepted::Close)?;
        sink.spawn(net, format!("{IMDS_V4}:{IMDS_PORT}"), Accepted::Answer)?;
        sink.spawn(net, format!("{DEST_V4}:{BULK_PORT}"), Accepted::Drain)?;
        let (tx, rx) = mpsc::channel::<Result<()>>();
        let (stop, path) = (sink.stop.clone(), net.imds_path());
        sink.threads.push(std::thread::spawn(move || {
            // Bound for as long as the sink runs (never read: once its queue is full the
            // datagrams are dropped on arrival, with no ICMP error for each).
            let udp = enter_netns(&path)
                .and_then(|()| Ok(UdpSocket::bind(format!("{DEST_V4}:{UDP_PORT}"))?));
            let bound = match udp {
                Ok(sock) => {
                    let _ = tx.send(Ok(()));
                    sock
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(TICK);
            }
            drop(bound);
        }));
        rx.recv_timeout(Duration::from_secs(5))
            .map_err(|_| anyhow!("udp sink did not start"))??;
        Ok(sink)
    }

    /// A thread in the imds netns accepting on `addr`, doing `with` each connection.
    fn spawn(&mut self, net: &TestNet, addr: String, with: Accepted) -> Result<()> {
        let (tx, rx) = mpsc::channel::<Result<()>>();
        let (stop, path) = (self.stop.clone(), net.imds_path());
        let what = addr.clone();
        self.threads.push(std::thread::spawn(move || {
            let bound = (|| -> Result<TcpListener> {
                enter_netns(&path)?;
                let l = TcpListener::bind(&addr).with_context(|| format!("bind {addr}"))?;
                // A deep accept queue: an overflow costs the client a 1 s SYN retransmit.
                // SAFETY: valid listening fd; listen(2) again only resizes the queue.
                unsafe { libc::listen(l.as_raw_fd(), 4096) };
                set_timeout(&l, TICK);
                Ok(l)
            })();
            let l = match bound {
                Ok(l) => {
                    let _ = tx.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let mut drains: Vec<JoinHandle<()>> = Vec::new();
            while !stop.load(Ordering::Acquire) {
                // Blocking accept with SO_RCVTIMEO: wakes at once, checks `stop` every tick.
                let Ok((c, _)) = l.accept() else { continue };
                match with {
                    Accepted::Close => {}
                    Accepted::Answer => answer(c),
                    Accepted::Drain => {
                        let stop = stop.clone();
                        drains.push(std::thread::spawn(move || drain(c, &stop)));
                        drains.retain(|d| !d.is_finished());
                    }
                }
            }
            for d in drains {
                let _ = d.join();
            }
        }));
        rx.recv_timeout(Duration::from_secs(5))
            .map_err(|_| anyhow!("sink {what} did not start"))?
            .with_context(|| what)
    }
}

/// What a sink does with a connection it accepted.
#[derive(Clone, Copy)]
enum Accepted {
    /// Closes it at once (connect rates).
    Close,
    /// Reads one request head and answers it as a metadata service does, then closes it (the
    /// proxy scenario's upstream; a connect that sends nothing is closed after a tick).
    Answer,
    /// Reads and discards everything, on a thread of its own (bulk).
    Drain,
}

/// What [`Accepted::Answer`] answers: an instance id, as IMDS does.
pub(crate) const ANSWER_BODY: &str = "i-0b22a22eec53b9321";

fn answer(mut c: TcpStream) {
    let _ = c.set_nonblocking(false);
    let _ = c.set_read_timeout(Some(TICK));
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match c.read(&mut chunk) {
            Ok(n) if n > 0 => head.extend_from_slice(&chunk[..n]),
            _ => return,
        }
    }
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{ANSWER_BODY}",
        ANSWER_BODY.len()
    );
    let _ = c.write_all(reply.as_bytes());
}

fn set_timeout(l: &TcpListener, t: Duration) {
    set_rcvtimeo(l, t);
}

fn drain(mut c: TcpStream, stop: &AtomicBool) {
    let _ = c.set_nonblocking(false);
    let _ = c.set_read_timeout(Some(TICK));
    let mut buf = vec![0u8; 256 * 1024];
    while !stop.load(Ordering::Acquire) {
        match c.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn command(bins: &Bins, net: &TestNet, cgroup: &Path, args: &[&str]) -> Command {
    workload(&bins.bench_probe, &net.node_path(), cgroup, args)
}

/// Run `bench-probe <args>` in `cgroup` and the node netns; its JSON result.
pub(crate) fn run(bins: &Bins, net: &TestNet, cgroup: &Path, args: &[&str]) -> Result<Value> {
    net.assert_routes()?;
    let out = command(bins, net, cgroup, args)
        .output()
        .with_context(|| format!("running {}", bins.bench_probe.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().ok_or_else(|| {
        anyhow!(
            "bench-probe {args:?} printed nothing; stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    serde_json::from_str(line).with_context(|| format!("bench-probe output {line:?}"))
}

/// A running `bench-probe … flip`: ready once it made its first attempt.
pub(crate) struct Flip {
    probe: Piped,
    /// Whether the first attempt was denied.
    pub(crate) first_refused: bool,
}

impl Flip {
    pub(crate) fn start(
        bins: &Bins,
        net: &TestNet,
        cgroup: &Path,
        dst: &str,
        port: u16,
        want: &str,
        timeout_ms: u64,
    ) -> Result<Flip> {
        net.assert_routes()?;
        let port = port.to_string();
        let timeout = timeout_ms.to_string();
        let command = command(bins, net, cgroup, &["flip", dst, &port, want, &timeout]);
        let mut probe = Piped::spawn(command, "bench-probe")?;
        let ready: Value = probe.read_json()?;
        if ready["stage"] != "ready" {
            bail!("flip probe did not start: {ready}");
        }
        let first_refused = ready["first_refused"].as_bool().unwrap_or(false);
        Ok(Flip { probe, first_refused })
    }

    /// Wait for the result: the CLOCK_MONOTONIC ns of the first wanted outcome, if any.
    pub(crate) fn finish(mut self) -> Result<Option<u64>> {
        let v: Value = self.probe.read_json()?;
        Ok(v["t_ns"].as_u64())
    }
}

/// A running `bench-probe … serve MODE`: one rate workload kept open in its cgroup and
/// netns, run a slice at a time, so that several variants can take turns every few
/// milliseconds.
pub(crate) struct Slicer(Piped);

impl Slicer {
    /// Start `mode` (`connect-rate`, `udp-rate`, `bulk`) to `dst`:`port`, on CPU `cpu`.
    pub(crate) fn start(
        bins: &Bins,
        net: &TestNet,
        cgroup: &Path,
        mode: &str,
        (dst, port): (&str, u16),
        cpu: usize,
    ) -> Result<Slicer> {
        net.assert_routes()?;
        let (port, cpu) = (port.to_string(), cpu.to_string());
        let args = ["serve", dst, &port, mode, "--cpu", &cpu];
        let mut probe = Piped::spawn(command(bins, net, cgroup, &args), "bench-probe")?;
        let ready: Value = probe.read_json()?;
        if ready["stage"] != "ready" {
            bail!("bench-probe serve {mode} did not start: {ready}");
        }
        Ok(Slicer(probe))
    }

    /// Run the workload for `ms` milliseconds; what it measured (`rate`, `ops` or `bytes`,
    /// `secs`, `cpu_s`).
    pub(crate) fn slice(&mut self, ms: f64) -> Result<Value> {
        self.0.send(&ms.to_string(), false)?;
        let v: Value = self.0.read_json()?;
        if v["ok"] != true {
            bail!("bench-probe slice: {v}");
        }
        Ok(v)
    }
}
