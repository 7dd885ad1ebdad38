//! /healthz and /readyz for the kubelet's probes, and /metrics: on one address (`--listen`),
//! or /metrics on an address of its own (`--metrics-listen`). The DaemonSet splits them: the
//! probes on the node's addresses in plain HTTP, because the kubelet probes the pod's IP, and
//! /metrics on loopback only, where the kube-rbac-proxy sidecar alone reaches it and serves
//! it on with TLS, authentication and authorization.
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

fn spawn(
    listener: tokio::net::TcpListener,
    app: Router,
    what: &'static str,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, serving = what, "http server stopped");
        }
    })
}

/// Bind every address now (so that a bad one fails the start) and serve in the background.
pub(crate) async fn serve(
    listen: Listen,
    ready: Arc<AtomicBool>,
    registry: Registry,
) -> Result<Server, BindError> {
    let registry = Arc::new(registry);
    match listen.metrics {
        None => {
            let what = "/healthz, /readyz and /metrics";
            let listener = bind(listen.probes, what).await?;
            let probes = local_addr(&listener, listen.probes);
            let app = probe_routes(ready).merge(metrics_routes(registry));
            Ok(Server { probes, metrics: probes, _tasks: vec![spawn(listener, app, what)] })
        }
        Some(metrics_addr) => {
            let (p_what, m_what) = ("/healthz and /readyz", "/metrics");
            let p = bind(listen.probes, p_what).await?;
            let m = bind(metrics_addr, m_what).await?;
            let (probes, metrics) = (local_addr(&p, listen.probes), local_addr(&m, metrics_addr));
            let tasks = vec![
                spawn(p, probe_routes(ready), p_what),
                spawn(m, metrics_routes(registry), m_what),
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
    use prometheus_client::metrics::counter::Counter;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

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
        let s = serve(listen, ready.clone(), registry()).await.expect("serve");
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
        let s = serve(listen, ready, registry()).await.expect("serve");
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
        let e = serve(listen, Arc::new(AtomicBool::new(false)), registry())
            .await
            .expect_err("address in use");
        assert_eq!((e.addr, e.what), (addr, "/metrics"));
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
    }
}
