//! Serving one probe or metrics listener within bounds: each connection gets a slot (per
//! caller and in all) before anything is read from it, or is closed at once without a byte;
//! a served one has a time limit for its request head and one for the whole connection, and
//! carries one request. Whoever reaches the port (any pod, on the node's addresses) can hold
//! only a few of the agent's file descriptors, and never the last slots, which are kept for
//! the node's own processes: the kubelet, whose probes come from the node's address (the
//! pod's, for this hostNetwork pod), told apart from host-network pods by cgroup ([`peer`]).
use std::{net::SocketAddr, time::Duration};

use axum::Router;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::{
    net::{TcpListener, TcpStream},
    task::JoinSet,
    time::timeout,
};

use super::peer::{self, Caller, SharedPeers};
use crate::{
    bounds::{ACCEPT_BACKOFF, Full, Slots},
    metrics::ListenerMetrics,
};

/// Bounds and timeouts of a probe or metrics listener. [`Limits::default`] holds the
/// production values; tests shrink them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Connections open at once from one caller (a peer address elsewhere, a cgroup on the
    /// node): one pod cannot take them all.
    pub(crate) per_peer: usize,
    /// Connections open at once in all.
    pub(crate) total: usize,
    /// Of `total`, the connections only the node's own processes may hold: those that
    /// connect from the address they connect to, from a cgroup outside the gated root.
    pub(crate) reserve: usize,
    /// Time for the request line and headers to arrive.
    pub(crate) header_read: Duration,
    /// Time for a whole connection, response included.
    pub(crate) connection: Duration,
}

impl Default for Limits {
    /// 256 idle connections cost a few MiB and 256 descriptors; filling the 224 that pods may
    /// take needs 28 peer addresses (or host-network containers) each reconnecting every 5 s,
    /// and leaves the kubelet's probes (which answer in milliseconds) their 32.
    fn default() -> Self {
        Limits {
            per_peer: 8,
            total: 256,
            reserve: 32,
            header_read: Duration::from_secs(5),
            connection: Duration::from_secs(10),
        }
    }
}

/// The `listener` label of the refusal counter: the probe address (which also serves
/// /metrics unless it is apart), and the metrics address.
pub(crate) const LISTENERS: [&str; 2] = [PROBES, METRICS];
pub(crate) const PROBES: &str = "probes";
pub(crate) const METRICS: &str = "metrics";

/// Why a connection was closed unanswered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Its caller held [`Limits::per_peer`] connections already.
    BusyPeer,
    /// The listener held [`Limits::total`] connections already.
    Busy,
    /// No request head within [`Limits::header_read`], or the connection outlived
    /// [`Limits::connection`].
    Timeout,
}

impl Refusal {
    pub(crate) const ALL: [Refusal; 3] = [Refusal::BusyPeer, Refusal::Busy, Refusal::Timeout];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Refusal::BusyPeer => "busy_peer",
            Refusal::Busy => "busy",
            Refusal::Timeout => "timeout",
        }
    }
}

/// One listener's accept loop: what it serves, its bounds, and where it counts refusals.
pub(super) struct Listener {
    pub(super) listener: TcpListener,
    pub(super) app: Router,
    pub(super) limits: Limits,
    pub(super) metrics: ListenerMetrics,
    /// [`PROBES`] or [`METRICS`].
    pub(super) label: &'static str,
    /// Who connects, for the slots.
    pub(super) peers: SharedPeers,
    /// What it serves, for the log.
    pub(super) what: &'static str,
}

impl Listener {
    /// Accept and serve until the task is aborted; the connections go with it.
    pub(super) async fn run(self) {
        let slots =
            Slots::<Caller>::new(self.limits.per_peer, self.limits.total, self.limits.reserve);
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        // Without its own address, a connection is only its peer's.
                        let local = stream.local_addr().unwrap_or(SocketAddr::new(
                            std::net::Ipv6Addr::UNSPECIFIED.into(),
                            0,
                        ));
                        // One at a time: a flood of connections waits in the backlog, not
                        // on blocking threads.
                        let who = peer::who(&self.peers, peer, local).await;
                        match slots.acquire(who.caller, who.node) {
                            Ok(slot) => {
                                let serving = self.serve(stream);
                                conns.spawn(async move {
                                    serving.await;
                                    drop(slot);
                                });
                            }
                            // Dropping the stream closes it, unread.
                            Err(full) => self.refuse(peer, full),
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, serving = self.what, "accepting a connection");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    }

    fn refuse(&self, peer: SocketAddr, full: Full) {
        let why = match full {
            Full::Caller => Refusal::BusyPeer,
            Full::Total | Full::Reserved => Refusal::Busy,
        };
        self.metrics.connection_refused(self.label, why);
        tracing::debug!(%peer, reason = why.label(), serving = self.what, "connection refused");
    }

    /// Serve one request on `stream`, within the time limits.
    fn serve(&self, stream: TcpStream) -> impl Future<Output = ()> + Send + 'static {
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            // One request per connection: an idle keep-alive connection would hold a slot.
            .keep_alive(false)
            .timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_read);
        let svc = TowerToHyperService::new(self.app.clone());
        let (limits, metrics, label, what) =
            (self.limits, self.metrics.clone(), self.label, self.what);
        async move {
            let served = builder.serve_connection(TokioIo::new(stream), svc);
            let timed_out = match timeout(limits.connection, served).await {
                Ok(Ok(())) => false,
                Ok(Err(e)) if e.is_timeout() => true,
                Ok(Err(e)) => {
                    // The client went away, or sent what hyper could not parse (answered 400).
                    tracing::debug!(error = %e, serving = what, "connection");
                    false
                }
                Err(_) => true,
            };
            if timed_out {
                metrics.connection_refused(label, Refusal::Timeout);
            }
        }
    }
}
