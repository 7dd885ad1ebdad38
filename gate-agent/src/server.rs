//! /healthz and /readyz for the kubelet's probes, and /metrics: on one address (`--listen`),
//! or /metrics on an address of its own (`--metrics-listen`). The DaemonSet splits them: the
//! probes on the node's addresses in plain HTTP, because the kubelet probes the pod's IP, and
//! /metrics on loopback only, where the kube-rbac-proxy sidecar alone reaches it and serves
//! it on with TLS, authentication and authorization.
//!
//! Each listener holds few connections and briefly ([`accept`]): any pod may reach the
//! node's addresses, and a connection held is a file descriptor of the agent's.
mod accept;
mod peer;

use std::{
    io,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use prometheus_client::registry::Registry;

pub(crate) use accept::{LISTENERS, Limits, Refusal};
pub(crate) use peer::{HostKernel, Peers, SharedPeers};

use crate::metrics::ListenerMetrics;

/// Where each endpoint is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Listen {
    /// /healthz and /readyz, and /metrics unless `metrics` is set.
    pub probes: SocketAddr,
    /// /metrics alone, if apart from the probes.
    pub metrics: Option<SocketAddr>,
}

/// An address that could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("listening on {addr} for {what}")]
pub(crate) struct BindError {
    pub addr: SocketAddr,
    /// `/healthz, /readyz and /metrics`, `/healthz and /readyz` or `/metrics`.
    pub what: &'static str,
    #[source]
    pub source: io::Error,
}

/// The running listeners, with the addresses they got (a port 0 asked for any).
#[derive(Debug)]
pub(crate) struct Server {
    /// Where /healthz and /readyz answer.
    pub probes: SocketAddr,
    /// Where /metrics answers (the probes' address when not apart).
    pub metrics: SocketAddr,
    _tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(ready): State<Arc<AtomicBool>>) -> impl IntoResponse {
    if ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn metrics(State(registry): State<Arc<Registry>>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &registry) {
        Ok(()) => (
            StatusCode::OK,
            [("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            body,
        ),
        Err(_) => {
            (StatusCode::INTERNAL_SERVER_ERROR, [("content-type", "text/plain")], String::new())
        }
    }
}

fn probe_routes(ready: Arc<AtomicBool>) -> Router {
    Router::new().route("/healthz", get(healthz)).route("/readyz", get(readyz)).with_state(ready)
}

fn metrics_routes(registry: Arc<Registry>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(registry)
}

async fn bind(addr: SocketAddr, what: &'static str) -> Result<tokio::net::TcpListener, BindError> {
    tokio::net::TcpListener::bind(addr).await.map_err(|source| BindError { addr, what, source })
}

/// Bind every address now (so that a bad one fails the start) and serve in the background,
/// each listener within `limits`, its callers told apart by `peers`, its refusals counted in
/// `counters`.
pub(crate) async fn serve(
    listen: Listen,
    ready: Arc<AtomicBool>,
    registry: Registry,
    limits: Limits,
    peers: SharedPeers,
    counters: ListenerMetrics,
) -> Result<Server, BindError> {
    let registry = Arc::new(registry);
    let spawn = |listener, app, label, what| {
        let metrics = counters.clone();
        let peers = peers.clone();
        let l = accept::Listener { listener, app, limits, metrics, label, what, peers };
        tokio::spawn(l.run())
    };
    match listen.metrics {
        None => {
            let what = "/healthz, /readyz and /metrics";
            let listener = bind(listen.probes, what).await?;
            let probes = local_addr(&listener, listen.probes);
            let app = probe_routes(ready).merge(metrics_routes(registry));
            let tasks = vec![spawn(listener, app, accept::PROBES, what)];
            Ok(Server { probes, metrics: probes, _tasks: tasks })
        }
        Some(metrics_addr) => {
            let (p_what, m_what) = ("/healthz and /readyz", "/metrics");
            let p = bind(listen.probes, p_what).await?;
            let m = bind(metrics_addr, m_what).await?;
            let (probes, metrics) = (local_addr(&p, listen.probes), local_addr(&m, metrics_addr));
            let tasks = vec![
                spawn(p, probe_routes(ready), accept::PROBES, p_what),
                spawn(m, metrics_routes(registry), accept::METRICS, m_what),
            ];
            Ok(Server { probes, metrics, _tasks: tasks })
        }
    }
}

fn local_addr(l: &tokio::net::TcpListener, asked: SocketAddr) -> SocketAddr {
    l.local_addr().unwrap_or(asked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::Place;
    use prometheus_client::metrics::counter::Counter;
    use std::time::Duration;
    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        net::TcpStream,
        time::timeout,
    };

    const ANY: &str = "127.0.0.1:0";

    /// Status code and body of `GET path` on `addr`.
    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let req = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        let code = out.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("status line");
        let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
        (code, body)
    }

    fn counters() -> ListenerMetrics {
        ListenerMetrics::default()
    }

    /// Callers on the node as one cgroup at `place`.
    fn peers(place: Place) -> SharedPeers {
        Peers::new(Box::new(peer::OneCgroup(place)))
    }

    /// The probe listener alone, its callers on the node the node's own processes.
    async fn bounded(limits: Limits) -> (SocketAddr, ListenerMetrics) {
        bounded_at(limits, Place::Outside).await
    }

    fn registry() -> Registry {
        let mut r = Registry::default();
        let c = Counter::<u64>::default();
        c.inc();
        r.register("test_things", "Things", c);
        r
    }

    #[tokio::test]
    async fn metrics_apart_are_served_only_on_their_own_address() {
        let ready = Arc::new(AtomicBool::new(false));
        let listen = Listen { probes: ANY.parse().unwrap(), metrics: Some(ANY.parse().unwrap()) };
        let peers = peers(Place::Outside);
        let s = serve(listen, ready.clone(), registry(), Limits::default(), peers, counters())
            .await
            .expect("serve");
        assert_ne!(s.probes, s.metrics);

        assert_eq!(get(s.probes, "/healthz").await.0, 200);
        assert_eq!(get(s.probes, "/readyz").await.0, 503);
        ready.store(true, Ordering::Release);
        assert_eq!(get(s.probes, "/readyz").await, (200, "ready\n".into()));
        assert_eq!(get(s.probes, "/metrics").await.0, 404, "/metrics on the probe address");

        let (code, body) = get(s.metrics, "/metrics").await;
        assert_eq!(code, 200);
        assert!(body.contains("test_things_total 1"), "{body}");
        assert_eq!(get(s.metrics, "/readyz").await.0, 404, "probes on the metrics address");
        assert_eq!(get(s.metrics, "/healthz").await.0, 404, "probes on the metrics address");
    }

    #[tokio::test]
    async fn metrics_share_the_probe_address_by_default() {
        let ready = Arc::new(AtomicBool::new(true));
        let listen = Listen { probes: ANY.parse().unwrap(), metrics: None };
        let peers = peers(Place::Outside);
        let s = serve(listen, ready, registry(), Limits::default(), peers, counters())
            .await
            .expect("serve");
        assert_eq!(s.probes, s.metrics);
        assert_eq!(get(s.probes, "/readyz").await.0, 200);
        let (code, body) = get(s.probes, "/metrics").await;
        assert_eq!(code, 200);
        assert!(body.contains("test_things_total 1"), "{body}");
    }

    #[tokio::test]
    async fn a_taken_address_names_what_it_was_for() {
        let taken = std::net::TcpListener::bind(ANY).expect("bind");
        let addr = taken.local_addr().expect("addr");
        let listen = Listen { probes: ANY.parse().unwrap(), metrics: Some(addr) };
        let e = serve(
            listen,
            Arc::new(AtomicBool::new(false)),
            registry(),
            Limits::default(),
            peers(Place::Outside),
            counters(),
        )
        .await
        .expect_err("address in use");
        assert_eq!((e.addr, e.what), (addr, "/metrics"));
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
    }

    /// Long enough that no connection of a test is closed by a timer it does not test.
    const LONG: Duration = Duration::from_secs(60);
    /// Far more than any answer or close takes, short enough to fail a test soon.
    const WAIT: Duration = Duration::from_secs(5);

    /// The probe listener alone (/metrics on it), within `limits`; every caller on the node
    /// is one cgroup, at `place`.
    async fn bounded_at(limits: Limits, place: Place) -> (SocketAddr, ListenerMetrics) {
        let counters = counters();
        let listen = Listen { probes: ANY.parse().unwrap(), metrics: None };
        let ready = Arc::new(AtomicBool::new(true));
        let s = serve(listen, ready, registry(), limits, peers(place), counters.clone())
            .await
            .expect("serve");
        // The listener task lives on without the handle.
        (s.probes, counters)
    }

    /// A connection to `addr` from `from` (any port), or from the system's choice.
    async fn connect(addr: SocketAddr, from: Option<&str>) -> TcpStream {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        if let Some(ip) = from {
            let local: SocketAddr = format!("{ip}:0").parse().expect("address");
            sock.bind(local).expect("bind the client to its address");
        }
        sock.connect(addr).await.expect("connect")
    }

    /// `GET /healthz` on `s`: the status code, or `None` if the connection was closed (or
    /// reset) without an answer.
    async fn healthz_on(mut s: TcpStream) -> Option<u16> {
        let req = "GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n";
        // A write to a connection closed already may fail: no answer, then.
        let _ = s.write_all(req.as_bytes()).await;
        let mut out = Vec::new();
        match timeout(WAIT, s.read_to_end(&mut out)).await.expect("no answer and no close") {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("reading: {e}"),
        }
        let out = String::from_utf8_lossy(&out);
        out.split(' ').nth(1).and_then(|c| c.parse().ok())
    }

    /// Whether `s` is still open: nothing to read and no close within a short while.
    async fn still_open(s: &mut TcpStream) -> bool {
        let mut byte = [0u8; 1];
        timeout(Duration::from_millis(200), s.read(&mut byte)).await.is_err()
    }

    /// Connections past the listener's budget are closed unanswered; one given back (here:
    /// closed by its client) makes room again. Without the budget the extra connection would
    /// be answered, and ~1000 idle ones would take every descriptor of the agent.
    #[tokio::test]
    async fn connections_past_the_budget_are_closed_unanswered() {
        let limits =
            Limits { per_peer: 100, total: 3, reserve: 0, header_read: LONG, connection: LONG };
        let (addr, counters) = bounded(limits).await;
        let mut idle = Vec::new();
        for _ in 0..3 {
            idle.push(connect(addr, None).await);
        }
        assert_eq!(healthz_on(connect(addr, None).await).await, None, "over the budget");
        assert_eq!(counters.refused_of(accept::PROBES, Refusal::Busy), 1);
        for s in &mut idle {
            assert!(still_open(s).await, "a connection within the budget is held");
        }

        drop(idle.pop());
        // The slot is given back once the server has seen the close: until then, refused.
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match healthz_on(connect(addr, None).await).await {
                Some(code) => break assert_eq!(code, 200),
                None => assert!(tokio::time::Instant::now() < deadline, "no slot given back"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A connection that sends no request (or half of one) is closed after the header-read
    /// timeout, which frees its slot.
    #[tokio::test]
    async fn a_silent_connection_is_closed_after_the_header_timeout() {
        let header_read = Duration::from_millis(300);
        let limits = Limits { per_peer: 100, total: 2, reserve: 0, header_read, connection: LONG };
        let (addr, counters) = bounded(limits).await;
        let started = tokio::time::Instant::now();
        let mut silent = connect(addr, None).await;
        let mut slow = connect(addr, None).await;
        slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: te").await.expect("write");
        for s in [&mut silent, &mut slow] {
            let mut out = Vec::new();
            let read = timeout(WAIT, s.read_to_end(&mut out)).await.expect("not closed");
            assert!(started.elapsed() >= header_read, "closed before the timeout");
            match read {
                Ok(_) => assert!(out.is_empty(), "an answer: {:?}", String::from_utf8_lossy(&out)),
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
            }
        }
        assert_eq!(counters.refused_of(accept::PROBES, Refusal::Timeout), 2);
        assert_eq!(healthz_on(connect(addr, None).await).await, Some(200), "the slots are free");
    }

    /// One peer address fills its own budget only: another (here 127.0.0.2, as the kubelet
    /// is to a pod) is still served.
    #[tokio::test]
    async fn one_peer_cannot_take_the_slots_of_another() {
        let limits =
            Limits { per_peer: 2, total: 100, reserve: 0, header_read: LONG, connection: LONG };
        let (addr, counters) = bounded(limits).await;
        let _idle =
            [connect(addr, Some("127.0.0.1")).await, connect(addr, Some("127.0.0.1")).await];
        let third = connect(addr, Some("127.0.0.1")).await;
        assert_eq!(healthz_on(third).await, None, "over the peer's budget");
        assert_eq!(counters.refused_of(accept::PROBES, Refusal::BusyPeer), 1);
        let other = connect(addr, Some("127.0.0.2")).await;
        assert_eq!(healthz_on(other).await, Some(200), "another peer is served");
    }

    /// Peers from elsewhere fill what is not the reserve: a caller on the node (here: from
    /// the very address it connects to, as the kubelet does to a hostNetwork pod) is still
    /// served, from the reserve.
    #[tokio::test]
    async fn the_last_slots_are_kept_for_callers_on_the_node() {
        let limits =
            Limits { per_peer: 4, total: 3, reserve: 1, header_read: LONG, connection: LONG };
        let (addr, counters) = bounded(limits).await;
        let _idle =
            [connect(addr, Some("127.0.0.2")).await, connect(addr, Some("127.0.0.3")).await];
        let third = connect(addr, Some("127.0.0.4")).await;
        assert_eq!(healthz_on(third).await, None, "a peer from elsewhere took the reserve");
        assert_eq!(counters.refused_of(accept::PROBES, Refusal::Busy), 1);
        let on_node = connect(addr, Some("127.0.0.1")).await;
        assert_eq!(healthz_on(on_node).await, Some(200), "the node's caller is served");
    }

    /// A caller on the node whose cgroup is below the gated root (a host-network pod) shares
    /// the node's address yet is not the node: it gets no reserve. Were the reserve given by
    /// address, it would be served here, and its idle connections could starve the kubelet.
    #[tokio::test]
    async fn a_pod_on_the_node_does_not_get_the_reserve() {
        let limits =
            Limits { per_peer: 4, total: 3, reserve: 1, header_read: LONG, connection: LONG };
        let (addr, counters) = bounded_at(limits, Place::Below).await;
        let _idle =
            [connect(addr, Some("127.0.0.2")).await, connect(addr, Some("127.0.0.3")).await];
        let pod = connect(addr, Some("127.0.0.1")).await;
        assert_eq!(healthz_on(pod).await, None, "a pod on the node took the reserve");
        assert_eq!(counters.refused_of(accept::PROBES, Refusal::Busy), 1);
    }
}
