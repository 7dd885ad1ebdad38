//! /healthz, /readyz and /metrics.
use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use prometheus_client::registry::Registry;

#[derive(Clone)]
struct AppState {
    ready: Arc<AtomicBool>,
    registry: Arc<Registry>,
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    if s.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
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

/// Bind `addr` now (so a bad address fails the start) and serve in the background.
pub async fn serve(
    addr: SocketAddr,
    ready: Arc<AtomicBool>,
    registry: Registry,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(AppState { ready, registry: Arc::new(registry) });
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "http server stopped");
        }
    }))
}
