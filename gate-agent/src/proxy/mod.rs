//! The metadata proxy's HTTP side: it serves a workload whose access is narrowed to paths
//! (an allow entry with `paths`, or `served`) the paths it may read, and refuses the rest.
//!
//! The kernel redirects such a workload's connections to the proxy and records, per
//! connection, who opened it ([`Caller`]); the proxy learns the caller from that record only
//! ([`Callers`]), never from the request. Per request it checks the form
//! ([`request`]), judges the target with the caller's [`Access`](gate_common::http::Access)
//! (`gate_common::http`) and, if served, forwards it to the address the workload asked for.
//!
//! Everything fails closed: no record, a busy workload, a table older or newer than the
//! kernel's, a request that could mean two things, an upstream that misbehaves: the request
//! is not forwarded. One request per connection, so that no decision outlives the request it
//! was made for.
//!
//! Parts: [`listen`] accepts and bounds connections, [`conn`] serves one, [`decide`] judges a
//! request, [`request`] checks its form, [`headers`] rewrites headers both ways, [`forward`]
//! talks to the metadata service, [`table`] holds the policy's access blocks, [`outcome`]
//! names what happened for logs and metrics, [`paths`] records which paths each workload
//! asked for (for `report` and `suggest`), [`session`] issues the proxy's own session tokens
//! (IMDSv2's), [`answers`] keeps the answers that never change.
use std::{net::SocketAddr, time::Duration};

mod answers;
mod conn;
mod decide;
mod forward;
mod headers;
mod listen;
mod outcome;
mod paths;
mod request;
mod session;
mod table;

#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod fake;
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod fuzzing;
#[cfg(test)]
mod tests;

// What the engine needs to run the proxy.
pub(crate) use decide::judge_request;
pub(crate) use listen::serve;
pub(crate) use outcome::{ConnRefusal, REQUEST_OUTCOMES};
pub(crate) use paths::{PathCounts, PathLog, PathRecord, read as read_paths};
pub(crate) use table::Table;
// What the tests and the fuzz target build a proxy from.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use forward::{Upstream, UpstreamIo};
#[cfg(test)]
pub(crate) use {forward::TcpUpstream, listen::Proxy, paths::PathKey};

/// Who opened a connection to the proxy, as a kernel program recorded it at `connect()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Caller {
    /// The gated workload's cgroup.
    pub(crate) cgroup_id: u64,
    /// The workload (pod) it belongs to, as the kernel found it: the unit of the proxy's
    /// connection bound.
    pub(crate) workload: u64,
    /// The policy generation the kernel decided under.
    pub(crate) generation: u32,
    /// The allow entry's index in the policy; `None`: `served` (no entry selects the workload).
    pub(crate) entry: Option<u32>,
    /// The protected endpoint's index in the policy (for the path record's names).
    pub(crate) endpoint: u32,
    /// The address and port the workload asked for (the metadata service): where a served
    /// request goes, whatever the request's `Host` says.
    pub(crate) dst: SocketAddr,
}

/// Where the proxy learns who is calling: from the kernel, never from the wire.
pub(crate) trait Callers: Send + Sync + 'static {
    /// The record of an accepted connection; `Ok(None)`: no record (the connection is refused).
    fn caller(&self, stream: &tokio::net::TcpStream) -> Result<Option<Caller>, ProxyError>;
    /// The policy generation the kernel decides under now; `None`: unreadable (refused).
    fn live_generation(&self) -> Option<u32>;
    /// A request of `caller` was refused (`request`: method and path; `why`: the reason and
    /// the entry), within the log's budget: where the node reports refusals beyond the log
    /// (cluster mode's Kubernetes Events).
    fn refused(&self, _caller: &Caller, _request: &str, _why: &str) {}
    /// The name of `caller`'s workload, for the per-workload metrics.
    fn workload_name(&self, caller: &Caller) -> String {
        format!("cgroup-id:{}", caller.cgroup_id)
    }
}

/// Bounds and timeouts. [`Limits::default`] holds the production values; tests shrink them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Connections open at once per workload (a pod, all its containers together): one
    /// workload cannot take them all.
    pub(crate) per_workload: usize,
    /// Connections open at once in all.
    pub(crate) total: usize,
    /// Of `total`, the connections only callers under an allow entry may hold: the `served`
    /// pods together cannot take the proxy from the components the policy names.
    pub(crate) reserve: usize,
    /// hyper's read buffer, which bounds the request line and headers (at least 8 KiB, hyper's
    /// minimum; less is raised to it).
    pub(crate) max_buf: usize,
    /// Largest response body forwarded.
    pub(crate) max_response: u64,
    /// Time for the request line and headers to arrive.
    pub(crate) header_read: Duration,
    /// Time for a whole connection, response body included.
    pub(crate) connection: Duration,
    /// Time to connect to the metadata service.
    pub(crate) connect: Duration,
    /// Time from asking the metadata service (connecting included) to the end of its
    /// response.
    pub(crate) upstream: Duration,
    /// How long a connection to the metadata service is kept idle for the next request.
    pub(crate) upstream_idle: Duration,
    /// Idle connections kept per metadata service address.
    pub(crate) idle_per_upstream: usize,
}

/// hyper rejects a smaller read buffer (it asserts).
pub(crate) const MIN_BUF: usize = 8 * 1024;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            per_workload: 16,
            total: 1024,
            reserve: 256,
            max_buf: 16 * 1024,
            max_response: 1024 * 1024,
            header_read: Duration::from_secs(5),
            connection: Duration::from_secs(30),
            connect: Duration::from_secs(2),
            upstream: Duration::from_secs(5),
            // Below the keep-alive of the common HTTP servers (5 s and up), so that the
            // service seldom closes one as the proxy picks it up.
            upstream_idle: Duration::from_secs(4),
            idle_per_upstream: 4,
        }
    }
}

/// What can go wrong in the proxy. None of these reaches the metadata service: each one ends
/// a connection or answers a request with an error status.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    /// The kernel's record of a connection could not be read (the connection is refused).
    #[error("reading the kernel's record of a connection: {0}")]
    Record(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A listener's `accept()` failed.
    #[error("accepting a connection: {0}")]
    Accept(#[source] std::io::Error),
    /// The metadata service could not be reached.
    #[error("connecting to {dst}: {source}")]
    Connect { dst: SocketAddr, source: std::io::Error },
    /// The metadata service did not answer within [`Limits::upstream`] (or did not accept the
    /// connection within [`Limits::connect`]).
    #[error("{dst} did not answer within {after:?}")]
    UpstreamTimeout { dst: SocketAddr, after: Duration },
    /// The exchange with the metadata service failed (handshake, request, response head).
    #[error("talking to {dst}: {source}")]
    Upstream { dst: SocketAddr, source: hyper::Error },
    /// The same, as the pool of connections reports it.
    #[error("talking to {dst}: {source}")]
    Exchange { dst: SocketAddr, source: hyper_util::client::legacy::Error },
    /// The metadata service answered with something the proxy does not pass on.
    #[error("{dst} answered {status}, which the proxy does not pass on")]
    UpstreamStatus { dst: SocketAddr, status: http::StatusCode },
    /// The response body is longer than [`Limits::max_response`].
    #[error("the response of {dst} is longer than {limit} bytes")]
    TooLarge { dst: SocketAddr, limit: u64 },
    /// Serving a connection failed (the client went away, sent what hyper could not parse, or
    /// was too slow).
    #[error("serving a connection: {0}")]
    Serve(#[source] hyper::Error),
    /// A connection was still open after [`Limits::connection`].
    #[error("connection still open after {0:?}")]
    Timeout(Duration),
}
