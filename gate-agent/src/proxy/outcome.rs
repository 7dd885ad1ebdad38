//! What happened to a connection or a request, named once for the metrics, the log and the
//! client: the label values (a fixed set, created at 0), the log line per decision (at most
//! a burst per workload and minute, so that a workload hammering the proxy cannot flood the
//! log; the metrics count every one), and the client's text shown safely.
use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::ratelimit::{Admit, RateLimiter};

use super::Caller;

/// Why a connection was closed before any request on it was judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConnRefusal {
    /// The kernel has no record of who opened it (or it could not be read).
    NoRecord,
    /// Its workload already has as many connections open as it may.
    Busy,
    /// The proxy already has as many connections open as it may.
    BusyNode,
    /// A `served` caller, and only the slots kept for allow entries are left.
    BusyServed,
    /// The request line and headers, or the whole connection, took too long.
    Timeout,
    /// hyper could not read the request (it answered 400, 414 or 431 itself).
    Malformed,
}

impl ConnRefusal {
    pub(crate) const ALL: [ConnRefusal; 6] = [
        ConnRefusal::NoRecord,
        ConnRefusal::Busy,
        ConnRefusal::BusyNode,
        ConnRefusal::BusyServed,
        ConnRefusal::Timeout,
        ConnRefusal::Malformed,
    ];

    /// The `reason` label of `metadata_gate_proxy_connections_refused`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            ConnRefusal::NoRecord => "no_record",
            ConnRefusal::Busy => "busy",
            ConnRefusal::BusyNode => "busy_node",
            ConnRefusal::BusyServed => "busy_served",
            ConnRefusal::Timeout => "timeout",
            ConnRefusal::Malformed => "malformed",
        }
    }
}

/// Every `(verdict, reason)` of `metadata_gate_proxy_requests`: a request served; refused
/// by its form ([`super::request`]), by the judge, or for want of an access block; served in
/// audit mode though the judge would refuse it; refused (429) over the workload's rate;
/// unavailable (503) while the proxy cannot decide under the kernel's policy; or failed at the
/// metadata service (502).
pub(crate) const REQUEST_OUTCOMES: [(&str, &str); 24] = [
    (SERVED, "ok"),
    // Answered by the proxy itself: a kept answer, a session token of its own.
    (SERVED, "cache"),
    (SERVED, "token"),
    // A session token the proxy did not issue to this workload, or expired; a token request
    // whose lifetime the service would refuse.
    (REFUSED, "token"),
    (REFUSED, "ttl"),
    (REFUSED, "form"),
    (REFUSED, "framing"),
    (REFUSED, "forwarded"),
    (REFUSED, "target"),
    (REFUSED, "method"),
    (REFUSED, "path"),
    (REFUSED, "parameter"),
    (REFUSED, "no_paths"),
    (REFUSED, "unknown_entry"),
    (REFUSED, "rate"),
    (UNAVAILABLE, "no_table"),
    (UNAVAILABLE, "generation"),
    (AUDITED, "method"),
    (AUDITED, "path"),
    (AUDITED, "parameter"),
    (AUDITED, "no_paths"),
    (FAILED, "upstream"),
    (FAILED, "timeout"),
    (FAILED, "too_large"),
];

pub(crate) const SERVED: &str = "served";
pub(crate) const REFUSED: &str = "refused";
pub(crate) const FAILED: &str = "failed";
/// Served in audit mode, though the policy would refuse it.
pub(crate) const AUDITED: &str = "audited";
/// Answered 503: no policy loaded, or the proxy's is not the kernel's (the client retries).
pub(crate) const UNAVAILABLE: &str = "unavailable";

/// Longest client text (method, target) repeated in a log line or a refusal.
const SHOWN: usize = 256;

/// Client text as it is safe to repeat: printable ASCII kept, any other byte as `\xNN`, cut
/// at [`SHOWN`] bytes; so that a request cannot forge a log line or a second body line.
pub(crate) fn shown(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(SHOWN) + 4);
    for &b in text.as_bytes() {
        if out.len() >= SHOWN {
            out.push('…');
            break;
        }
        if (0x20..0x7f).contains(&b) && b != b'\\' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// One decision, as the log line names it.
pub(crate) struct Line<'a> {
    pub(crate) verdict: &'static str,
    pub(crate) reason: &'a str,
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
    /// `entry NAME`, `served`, or `-` where no table was loaded.
    pub(crate) entry: &'a str,
}

/// The decision log: at most `BURST` lines per workload per `WINDOW`, then one line saying
/// how many were not logged.
pub(crate) struct DecisionLog {
    limiter: Mutex<(RateLimiter, Instant)>,
}

const BURST: u32 = 20;
const WINDOW: Duration = Duration::from_secs(60);
/// Workloads tracked apart; beyond them, they share one budget.
const KEYS: usize = 4096;

impl Default for DecisionLog {
    fn default() -> Self {
        DecisionLog { limiter: Mutex::new((RateLimiter::new(BURST, WINDOW, KEYS), Instant::now())) }
    }
}

impl DecisionLog {
    /// Whether a line about `cgroup_id` may be logged now; reports the windows that ended.
    fn admit(&self, cgroup_id: u64) -> bool {
        let now = Instant::now();
        let Ok(mut guard) = self.limiter.lock() else {
            return true;
        };
        let (limiter, flushed) = &mut *guard;
        if now.duration_since(*flushed) >= WINDOW {
            *flushed = now;
            for (cgroup, unlogged) in limiter.flush(now) {
                tracing::info!(cgroup_id = %cgroup, unlogged, "metadata proxy decisions not logged");
            }
        }
        limiter.admit(&cgroup_id.to_string(), now) == Admit::Log
    }

    /// Log a request's decision; whether it was logged (not over the workload's budget).
    pub(crate) fn request(&self, caller: &Caller, line: Line<'_>) -> bool {
        if !self.admit(caller.cgroup_id) {
            return false;
        }
        let Line { verdict, reason, method, path, entry } = line;
        let (method, path) = (shown(method), shown(path));
        tracing::info!(
            verdict, method, path, entry, cgroup_id = caller.cgroup_id, dst = %caller.dst, reason,
            "metadata proxy request"
        );
        true
    }

    /// Log a connection refused before any request was judged.
    pub(crate) fn connection(&self, cgroup_id: Option<u64>, why: ConnRefusal, detail: &str) {
        // Connections without a record share one budget: they name no workload.
        if !self.admit(cgroup_id.unwrap_or(0)) {
            return;
        }
        tracing::info!(
            verdict = REFUSED,
            reason = why.label(),
            cgroup_id,
            detail,
            "metadata proxy connection refused"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_text_is_one_printable_line() {
        assert_eq!(shown("/latest/meta-data/"), "/latest/meta-data/");
        assert_eq!(shown("/a\r\nX: y"), "/a\\x0d\\x0aX: y");
        assert_eq!(shown("/\u{e9}\\"), "/\\xc3\\xa9\\x5c");
        let long = shown(&"a".repeat(1000));
        assert!(long.len() < SHOWN + 8 && long.ends_with('…'), "{long}");
    }

    #[test]
    fn labels_are_distinct() {
        let mut conn: Vec<_> = ConnRefusal::ALL.iter().map(|r| r.label()).collect();
        conn.sort();
        conn.dedup();
        assert_eq!(conn.len(), ConnRefusal::ALL.len());
        let mut req = REQUEST_OUTCOMES.to_vec();
        req.sort();
        req.dedup();
        assert_eq!(req.len(), REQUEST_OUTCOMES.len());
    }

    #[test]
    fn the_log_keeps_a_burst_per_workload() {
        let log = DecisionLog::default();
        let kept = (0..100).filter(|_| log.admit(7)).count();
        assert_eq!(kept, BURST as usize);
        assert!(log.admit(8), "another workload has its own budget");
    }
}
