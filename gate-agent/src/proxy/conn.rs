//! One connection, served: hyper reads one request (within the size and time limits),
//! [`decide`] judges it, [`forward`] serves it, and every outcome is logged, counted and
//! answered. Works on any byte stream, so that the fuzz target drives it in memory.
use std::{
    borrow::Cow,
    convert::Infallible,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use http::{Request, Response, StatusCode, header};
use hyper::{body::Incoming, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::watch,
    time::timeout,
};

use super::{
    Caller, Callers, Limits, MIN_BUF, ProxyError,
    answers::Answers,
    decide::{Decision, decide},
    forward::{Body, Forwarder, text},
    outcome::{AUDITED, ConnRefusal, DecisionLog, FAILED, Line, REFUSED, SERVED, UNAVAILABLE},
    paths::{PathLog, Seen},
    session::{self, Sessions},
    table::Table,
};
use crate::{
    metrics::ProxyMetrics,
    ratelimit::{Buckets, Rate},
};

/// What every connection shares.
pub(crate) struct Shared {
    /// The table of the policy in force; `None` until one is loaded.
    pub(crate) tables: watch::Receiver<Option<Arc<Table>>>,
    /// Asked for the kernel's generation at every request.
    pub(crate) callers: Arc<dyn Callers>,
    /// The way to the metadata services, with its pool of connections.
    pub(crate) forwarder: Forwarder,
    pub(crate) limits: Limits,
    pub(crate) metrics: ProxyMetrics,
    pub(crate) log: DecisionLog,
    /// Which paths each workload asked for.
    pub(crate) paths: Arc<PathLog>,
    /// Each workload's served requests against its rate.
    pub(crate) rates: Mutex<Buckets>,
    /// Session tokens issued to workloads, and the service's own.
    pub(crate) sessions: Sessions,
    /// The answers that never change, kept.
    pub(crate) answers: Answers,
}

/// Workloads whose rate is tracked at once; a node runs a few hundred pods.
pub(crate) const RATE_KEYS: usize = 4096;

impl Shared {
    /// A token of `workload`'s bucket, or how long until one comes.
    fn take(&self, workload: u64, rate: Rate) -> Result<(), Duration> {
        let mut rates = self.rates.lock().unwrap_or_else(PoisonError::into_inner);
        rates.take(workload, rate, Instant::now())
    }
}

/// Serve one connection from `caller` on `io`: at most one request, within
/// [`Limits::connection`].
pub(crate) async fn serve_connection<IO>(io: IO, caller: Caller, shared: Arc<Shared>)
where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let limits = shared.limits;
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        // One request per connection: the decision is never reused for a second one.
        .keep_alive(false)
        // A client that shuts its side down after the request (`nc -N`) still gets the answer.
        .half_close(true)
        .max_buf_size(limits.max_buf.max(MIN_BUF))
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    let svc_shared = Arc::clone(&shared);
    let svc = service_fn(move |req| {
        let shared = Arc::clone(&svc_shared);
        async move { Ok::<_, Infallible>(respond(req, caller, &shared).await) }
    });
    let served = builder.serve_connection(TokioIo::new(io), svc);
    let refusal = match timeout(limits.connection, served).await {
        Ok(Ok(())) => None,
        Err(_) => Some((ConnRefusal::Timeout, ProxyError::Timeout(limits.connection))),
        Ok(Err(e)) if e.is_timeout() => Some((ConnRefusal::Timeout, ProxyError::Serve(e))),
        Ok(Err(e)) if e.is_parse() || e.is_parse_too_large() => {
            Some((ConnRefusal::Malformed, ProxyError::Serve(e)))
        }
        Ok(Err(e)) => {
            // The client went away, or a response body was cut (longer than it said).
            tracing::debug!(error = %e, cgroup_id = caller.cgroup_id, "metadata proxy connection");
            None
        }
    };
    if let Some((why, e)) = refusal {
        shared.metrics.connection_refused(why);
        shared.log.connection(Some(caller.cgroup_id), why, &e.to_string());
    }
}

/// The answer to one request.
async fn respond(req: Request<Incoming>, caller: Caller, shared: &Shared) -> Response<Body> {
    let table = shared.tables.borrow().clone();
    let live = shared.callers.live_generation();
    let (head, body) = req.into_parts();
    let body_empty = hyper::body::Body::is_end_stream(&body);
    // Never read: no served request has a body, and hyper closes the connection after the
    // response (keep-alive is off), so whatever follows is dropped unread.
    drop(body);
    let method = head.method.as_str();
    let path = head.uri.path_and_query().map_or("", |pq| pq.as_str());
    let decision = decide(&caller, table.as_deref(), live, &head, body_empty);
    // Over its rate, a served request is not served: the node's quota at the metadata
    // service is every workload's.
    let limited = match &decision {
        Decision::Serve { rate: Some(rate), .. } => {
            shared.take(caller.workload, *rate).err().map(|wait| (*rate, wait))
        }
        _ => None,
    };
    if let Some(t) = &table {
        note_path(shared, &caller, t, &decision, limited.is_some(), method, path);
    }
    if let (Some((rate, wait)), Decision::Serve { who, .. }) = (limited, &decision) {
        shared.metrics.request(REFUSED, "rate");
        shared.metrics.rate_limited(shared.callers.workload_name(&caller));
        let (who, secs) = (who.to_string(), wait.as_secs_f64().ceil().max(1.0) as u64);
        let reason = format!("over the rate of {who} ({rate}); retry in {secs} s");
        let _ = shared.log.request(
            &caller,
            Line { verdict: REFUSED, reason: &reason, method, path, entry: &who },
        );
        let (m, p) = (super::outcome::shown(method), super::outcome::shown(path));
        let mut resp =
            plain(StatusCode::TOO_MANY_REQUESTS, format!("metadata-gate: {m} {p}: {reason}\n"));
        resp.headers_mut().insert(header::RETRY_AFTER, http::HeaderValue::from(secs));
        return resp;
    }
    match decision {
        Decision::Unavailable(u) => {
            shared.metrics.request(UNAVAILABLE, u.label());
            let reason = u.to_string();
            let _ = shared.log.request(
                &caller,
                Line { verdict: UNAVAILABLE, reason: &reason, method, path, entry: "-" },
            );
            let mut resp =
                plain(StatusCode::SERVICE_UNAVAILABLE, format!("metadata-gate: {u}; retry\n"));
            resp.headers_mut().insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
            resp
        }
        Decision::Refused { who, why } => {
            shared.metrics.request(REFUSED, why.label());
            let (who, reason) = (who.to_string(), why.to_string());
            let logged = shared.log.request(
                &caller,
                Line { verdict: REFUSED, reason: &reason, method, path, entry: &who },
            );
            let (m, p) = (super::outcome::shown(method), super::outcome::shown(path));
            if logged {
                shared.callers.refused(&caller, &format!("{m} {p}"), &format!("{reason} ({who})"));
            }
            let hash = table.as_ref().map(|t| t.hash().to_string()).unwrap_or_default();
            let text = format!("metadata-gate: {m} {p} refused: {reason} ({who}, policy {hash})\n");
            plain(StatusCode::FORBIDDEN, text)
        }
        Decision::Serve { who, target, audited, .. } => {
            let who = who.to_string();
            // A served request's reason is a constant: nothing to build.
            let (verdict, reason) = match &audited {
                Some(why) => {
                    shared.metrics.request(AUDITED, why.label());
                    (AUDITED, Cow::Owned(format!("audit mode; the policy would refuse it: {why}")))
                }
                None => (SERVED, Cow::Borrowed("ok")),
            };
            let Some(table) = table.as_deref() else {
                // A decision to serve is made on a table; without one nothing is served.
                return plain(StatusCode::SERVICE_UNAVAILABLE, "metadata-gate: no policy\n".into());
            };
            match serve(shared, &caller, table, &head, target).await {
                Ok((resp, how)) => {
                    match (how, &audited) {
                        (How::Own(refusal), _) => {
                            shared.metrics.request(REFUSED, refusal.label());
                            let reason = refusal.reason();
                            let line = Line { verdict: REFUSED, reason, method, path, entry: &who };
                            let _ = shared.log.request(&caller, line);
                            return resp;
                        }
                        (How::Forwarded, None) => shared.metrics.request(SERVED, "ok"),
                        (How::Kept, None) => shared.metrics.request(SERVED, "cache"),
                        (How::Token, None) => shared.metrics.request(SERVED, "token"),
                        (_, Some(_)) => {}
                    }
                    let line = Line { verdict, reason: &reason, method, path, entry: &who };
                    let _ = shared.log.request(&caller, line);
                    resp
                }
                Err(e) => {
                    let label = match e {
                        ProxyError::UpstreamTimeout { .. } => "timeout",
                        ProxyError::TooLarge { .. } => "too_large",
                        _ => "upstream",
                    };
                    shared.metrics.request(FAILED, label);
                    let reason = e.to_string();
                    let line = Line { verdict: FAILED, reason: &reason, method, path, entry: &who };
                    let _ = shared.log.request(&caller, line);
                    let (m, p) = (super::outcome::shown(method), super::outcome::shown(path));
                    plain(StatusCode::BAD_GATEWAY, format!("metadata-gate: {m} {p}: {reason}\n"))
                }
            }
        }
    }
}

/// How a served request was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// By the service.
    Forwarded,
    /// From the kept answers.
    Kept,
    /// With a session token of the proxy's own.
    Token,
    /// Refused by the proxy as the service would refuse it.
    Own(OwnRefusal),
}

/// Why the proxy answered a served request's token (or token request) itself with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnRefusal {
    /// A token it did not issue to this workload, or expired (or none could be made).
    Token,
    /// A token request whose lifetime the service would refuse.
    Ttl,
}

impl OwnRefusal {
    /// The outcome's reason label (`REQUEST_OUTCOMES`).
    fn label(self) -> &'static str {
        match self {
            OwnRefusal::Token => "token",
            OwnRefusal::Ttl => "ttl",
        }
    }

    fn reason(self) -> &'static str {
        match self {
            OwnRefusal::Token => {
                "the session token is not one this proxy issued to this workload, or it expired"
            }
            OwnRefusal::Ttl => "the token's lifetime is missing or out of range",
        }
    }
}

/// A served request's answer: a session token of the proxy's own for a token request; for a
/// request carrying one, the service's token in its place; a kept answer where the platform
/// documents the value as fixed and the request carries what the service requires; else the
/// service's answer.
async fn serve(
    shared: &Shared,
    caller: &Caller,
    table: &Table,
    head: &http::request::Parts,
    target: &http::uri::PathAndQuery,
) -> Result<(Response<Body>, How), ProxyError> {
    use crate::policy::platform::AnswerGate;

    let now = Instant::now();
    let (fwd, limits, dst) = (&shared.forwarder, &shared.limits, caller.dst);
    let mut headers = Cow::Borrowed(&head.headers);
    let mut session_ok = false;
    if let Some(scheme) = table.session() {
        if head.method == http::Method::PUT && target.path() == scheme.path {
            let Some(ttl) = session::requested_ttl(scheme, &head.headers) else {
                let text = format!(
                    "metadata-gate: PUT {}: {} must be 1 to {} seconds\n",
                    scheme.path, scheme.ttl_header, scheme.max_ttl
                );
                return Ok((plain(StatusCode::BAD_REQUEST, text), How::Own(OwnRefusal::Ttl)));
            };
            // Only where the service gives tokens (IMDSv2 may be off): its refusal goes back.
            if let Err(refused) = shared.sessions.theirs(fwd, limits, scheme, dst).await {
                return refused.map(|resp| (resp, How::Forwarded));
            }
            let Some(token) = shared.sessions.issue(caller.workload, dst, ttl, now) else {
                let text = "metadata-gate: no random bytes for a token; retry\n".to_owned();
                return Ok((
                    plain(StatusCode::SERVICE_UNAVAILABLE, text),
                    How::Own(OwnRefusal::Token),
                ));
            };
            return Ok((session::answer(scheme, token, ttl), How::Token));
        }
        if let Some(given) = head.headers.get(scheme.token_header) {
            let valid =
                given.to_str().is_ok_and(|t| shared.sessions.valid(t, caller.workload, dst, now));
            if !valid {
                let text = format!(
                    "metadata-gate: {} {}: {}; ask PUT {} for a new one\n",
                    super::outcome::shown(head.method.as_str()),
                    super::outcome::shown(target.as_str()),
                    OwnRefusal::Token.reason(),
                    scheme.path
                );
                return Ok((plain(StatusCode::UNAUTHORIZED, text), How::Own(OwnRefusal::Token)));
            }
            let theirs = match shared.sessions.theirs(fwd, limits, scheme, dst).await {
                Ok(v) => v,
                Err(refused) => return refused.map(|resp| (resp, How::Forwarded)),
            };
            headers.to_mut().insert(http::HeaderName::from_static(scheme.token_header), theirs);
            session_ok = true;
        }
    }
    let keep = head.method == http::Method::GET
        && table.is_fixed(target.path())
        && match table.answers_need() {
            AnswerGate::Never => false,
            AnswerGate::Session => session_ok,
            AnswerGate::Header { name, value } => {
                let mut given = head.headers.get_all(name).iter();
                given.next().is_some_and(|v| v == value) && given.next().is_none()
            }
        };
    if keep && let Some(resp) = shared.answers.get(dst, target.as_str(), now) {
        return Ok((resp, How::Kept));
    }
    let resp = fwd.forward(limits, dst, &head.method, target, &headers).await?;
    if session_ok && resp.status() == StatusCode::UNAUTHORIZED {
        // The service no longer takes its token (revoked, restarted): the next request takes
        // a new one rather than every request failing until it would have run out.
        shared.sessions.forget_theirs(dst).await;
    }
    if !keep {
        return Ok((resp, How::Forwarded));
    }
    let resp = shared.answers.keep(dst, target.as_str(), resp, now).await;
    shared.metrics.cached_answers.set(i64::try_from(shared.answers.len()).unwrap_or(i64::MAX));
    Ok((resp, How::Forwarded))
}

/// Add a judged request to the path record: served, audited, or refused by the judge (whose
/// target read strictly); a request refused for its form is not a path anyone asked for.
fn note_path(
    shared: &Shared,
    caller: &Caller,
    table: &Table,
    decision: &Decision<'_>,
    limited: bool,
    method: &str,
    path: &str,
) {
    let seen = match decision {
        Decision::Serve { .. } if limited => Seen::Limited,
        Decision::Serve { audited: None, .. } => Seen::Served,
        Decision::Serve { audited: Some(_), .. } => Seen::Audited,
        Decision::Refused { why, .. } if why.auditable() => Seen::Refused,
        Decision::Refused { .. } | Decision::Unavailable(_) => return,
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let endpoint = table.endpoint(caller.endpoint);
    if !shared.paths.note(caller.cgroup_id, endpoint, method, path, seen, now) {
        shared.metrics.paths_untracked.inc();
    }
}

/// A one-line text answer of the proxy's own.
fn plain(status: StatusCode, body: String) -> Response<Body> {
    let mut resp = Response::new(text(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static("text/plain"));
    resp
}
