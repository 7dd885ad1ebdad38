//! Accepting connections: each one is asked its kernel record and given a slot before
//! anything is read from it; without either it is closed at once, without a byte.
use std::{future::Future, sync::Arc};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinSet,
};

use super::{
    Callers, Limits, ProxyError,
    conn::{Shared, serve_connection},
    forward::{Forwarder, TcpUpstream, Upstream},
    outcome::{ConnRefusal, DecisionLog},
    paths::PathLog,
    table::Table,
};
use crate::{
    bounds::{ACCEPT_BACKOFF, Full, Slots},
    metrics::ProxyMetrics,
};

/// The proxy: what its connections share, and their slots.
pub(crate) struct Proxy {
    shared: Arc<Shared>,
    slots: Arc<Slots>,
}

impl Proxy {
    pub(crate) fn new(
        callers: Arc<dyn Callers>,
        tables: watch::Receiver<Option<Arc<Table>>>,
        upstream: Arc<dyn Upstream>,
        limits: Limits,
        metrics: ProxyMetrics,
        paths: Arc<PathLog>,
    ) -> Proxy {
        let slots = Slots::new(limits.per_workload, limits.total, limits.reserve);
        let log = DecisionLog::default();
        Proxy {
            shared: Arc::new(Shared {
                tables,
                callers,
                forwarder: Forwarder::new(upstream, &limits),
                limits,
                metrics,
                log,
                paths,
                rates: std::sync::Mutex::new(crate::ratelimit::Buckets::new(
                    super::conn::RATE_KEYS,
                )),
                sessions: super::session::Sessions::default(),
                answers: super::answers::Answers::default(),
            }),
            slots,
        }
    }

    /// Serve on every listener until `shutdown` completes; then stop accepting and close the
    /// connections still open.
    pub(crate) async fn run(
        &self,
        listeners: Vec<TcpListener>,
        shutdown: impl Future<Output = ()>,
    ) {
        let loops = futures::future::join_all(listeners.iter().map(|l| self.accept_loop(l)));
        tokio::select! {
            _ = loops => {}
            () = shutdown => {}
        }
    }

    async fn accept_loop(&self, listener: &TcpListener) {
        // Dropped with the loop: its connections are aborted with it.
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => self.admit(stream, &mut conns),
                    Err(e) => {
                        tracing::warn!(error = %ProxyError::Accept(e), "metadata proxy");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    }

    /// Serve `stream` if the kernel recorded its caller and the caller has a slot; else close
    /// it (dropping it) without a byte.
    fn admit(&self, stream: TcpStream, conns: &mut JoinSet<()>) {
        let refuse = |why: ConnRefusal, cgroup_id: Option<u64>, detail: &str| {
            self.shared.metrics.connection_refused(why);
            self.shared.log.connection(cgroup_id, why, detail);
        };
        let caller = match self.shared.callers.caller(&stream) {
            Ok(Some(c)) => c,
            Ok(None) => return refuse(ConnRefusal::NoRecord, None, "no record"),
            Err(e) => return refuse(ConnRefusal::NoRecord, None, &e.to_string()),
        };
        let slot = match self.slots.acquire(caller.workload, caller.entry.is_some()) {
            Ok(s) => s,
            Err(Full::Caller) => {
                let detail =
                    format!("{} connections open for its pod", self.shared.limits.per_workload);
                return refuse(ConnRefusal::Busy, Some(caller.cgroup_id), &detail);
            }
            Err(Full::Reserved) => {
                let limits = &self.shared.limits;
                let detail = format!(
                    "{} connections open in all, the last {} kept for allow entries",
                    limits.total - limits.reserve,
                    limits.reserve
                );
                return refuse(ConnRefusal::BusyServed, Some(caller.cgroup_id), &detail);
            }
            Err(Full::Total) => {
                let detail = format!("{} connections open in all", self.shared.limits.total);
                return refuse(ConnRefusal::BusyNode, Some(caller.cgroup_id), &detail);
            }
        };
        let _ = stream.set_nodelay(true);
        let shared = Arc::clone(&self.shared);
        conns.spawn(async move {
            serve_connection(stream, caller, shared).await;
            drop(slot);
        });
    }

    #[cfg(test)]
    pub(crate) fn slots(&self) -> &Slots {
        &self.slots
    }
}

/// Serve the metadata proxy on `listeners` until `shutdown`: callers from `callers`, the policy
/// from `tables`, requests forwarded over TCP, the paths asked for recorded in `paths`.
pub(crate) async fn serve(
    listeners: Vec<TcpListener>,
    callers: Arc<dyn Callers>,
    tables: watch::Receiver<Option<Arc<Table>>>,
    metrics: ProxyMetrics,
    limits: Limits,
    paths: Arc<PathLog>,
    shutdown: impl Future<Output = ()>,
) {
    let proxy = Proxy::new(callers, tables, Arc::new(TcpUpstream), limits, metrics, paths);
    proxy.run(listeners, shutdown).await;
}
