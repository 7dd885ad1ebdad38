//! Session tokens of the proxy's own (IMDSv2 and its likes). A workload's `PUT` for a token
//! gets one the proxy made, valid at the proxy only, for that workload and that service, for
//! the time it asked; the service's token stays in the agent, which takes it once and renews
//! it before it runs out. A token that leaves a pod is worth nothing elsewhere: not at the
//! service should a direct path ever appear (so IMDSv2's hop limit keeps its meaning), not
//! to another pod.
use std::{
    collections::{HashMap, VecDeque},
    net::SocketAddr,
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};

use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header, uri::PathAndQuery};
use http_body_util::BodyExt as _;

use super::{
    Limits, ProxyError,
    forward::{Body, Forwarder, text},
};
use crate::policy::platform::SessionScheme;

/// Tokens issued and not yet expired, at most: past it, the ones nearest their end go first.
pub(crate) const MAX_ISSUED: usize = 16 * 1024;
/// Tokens one workload holds at most: past it, its own oldest goes, so that one pod asking in
/// a loop never pushes out the others' tokens.
pub(crate) const PER_WORKLOAD: usize = 32;

/// The lifetime the agent asks the service for (the longest IMDSv2 allows), and how long
/// before its end it takes a new one.
const SERVICE_TTL: u32 = 21600;
const RENEW_BEFORE: Duration = Duration::from_secs(300);

/// A token issued to a workload.
#[derive(Debug, Clone, Copy)]
struct Issued {
    workload: u64,
    dst: SocketAddr,
    expires: Instant,
}

/// The service's own token for one address.
#[derive(Debug, Clone)]
struct Theirs {
    value: HeaderValue,
    expires: Instant,
}

/// The tokens the proxy issued, and the service's.
#[derive(Default)]
pub(crate) struct Sessions {
    issued: Mutex<Issuance>,
    theirs: tokio::sync::Mutex<HashMap<SocketAddr, Theirs>>,
}

/// The tokens issued, and each workload's in the order it got them.
#[derive(Default)]
struct Issuance {
    tokens: HashMap<String, Issued>,
    by_workload: HashMap<u64, VecDeque<String>>,
}

/// What a token request's TTL header says, checked as the service checks it.
pub(crate) fn requested_ttl(scheme: &SessionScheme, headers: &HeaderMap) -> Option<u32> {
    let v = headers.get(scheme.ttl_header)?.to_str().ok()?.trim().parse::<u32>().ok()?;
    (1..=scheme.max_ttl).contains(&v).then_some(v)
}

impl Sessions {
    /// A new token for `workload` at `dst`, valid `ttl` seconds from `now`; `None` when the
    /// kernel gave no random bytes.
    pub(crate) fn issue(
        &self,
        workload: u64,
        dst: SocketAddr,
        ttl: u32,
        now: Instant,
    ) -> Option<String> {
        let token = new_token()?;
        let expires = now + Duration::from_secs(u64::from(ttl));
        let mut guard = self.issued.lock().unwrap_or_else(PoisonError::into_inner);
        let Issuance { tokens, by_workload } = &mut *guard;
        let mine = by_workload.entry(workload).or_default();
        mine.retain(|t| tokens.get(t).is_some_and(|i| i.expires > now));
        while mine.len() >= PER_WORKLOAD {
            if let Some(oldest) = mine.pop_front() {
                tokens.remove(&oldest);
            }
        }
        if tokens.len() >= MAX_ISSUED {
            tokens.retain(|_, i| i.expires > now);
        }
        if tokens.len() >= MAX_ISSUED {
            // Still full of live tokens: the one nearest its end goes (its holder asks again).
            if let Some(k) = tokens.iter().min_by_key(|(_, i)| i.expires).map(|(k, _)| k.clone()) {
                tokens.remove(&k);
            }
            // Only here can tokens leave without their workload's list knowing.
            by_workload.retain(|_, q| {
                q.retain(|t| tokens.contains_key(t));
                !q.is_empty()
            });
        }
        tokens.insert(token.clone(), Issued { workload, dst, expires });
        by_workload.entry(workload).or_default().push_back(token.clone());
        Some(token)
    }

    /// Whether `token` was issued to `workload` for `dst` and has not expired.
    pub(crate) fn valid(&self, token: &str, workload: u64, dst: SocketAddr, now: Instant) -> bool {
        let issued = self.issued.lock().unwrap_or_else(PoisonError::into_inner);
        let i = issued.tokens.get(token);
        i.is_some_and(|i| i.workload == workload && i.dst == dst && i.expires > now)
    }

    /// Tokens issued and not yet expired.
    #[cfg(test)]
    pub(crate) fn live(&self, now: Instant) -> usize {
        let issued = self.issued.lock().unwrap_or_else(PoisonError::into_inner);
        issued.tokens.values().filter(|i| i.expires > now).count()
    }

    /// Drop the service's token for `dst`: it answered 401 to it (revoked, or the service
    /// restarted), and the next request takes a new one.
    pub(crate) async fn forget_theirs(&self, dst: SocketAddr) {
        self.theirs.lock().await.remove(&dst);
    }

    /// The service's token for `dst`, taken (or renewed) from it when there is none with
    /// [`RENEW_BEFORE`] left. `Err(Ok(response))`: the service refused one, and its answer
    /// goes back to the workload as it is.
    pub(crate) async fn theirs(
        &self,
        forwarder: &Forwarder,
        limits: &Limits,
        scheme: &SessionScheme,
        dst: SocketAddr,
    ) -> Result<HeaderValue, Result<Response<Body>, ProxyError>> {
        // Held across the request: one renewal at a time per node, not one per caller.
        let mut theirs = self.theirs.lock().await;
        let now = Instant::now();
        if let Some(t) = theirs.get(&dst).filter(|t| t.expires > now + RENEW_BEFORE) {
            return Ok(t.value.clone());
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            http::HeaderName::from_static(scheme.ttl_header),
            HeaderValue::from(SERVICE_TTL),
        );
        let target = PathAndQuery::from_static(scheme.path);
        let resp =
            forwarder.forward(limits, dst, &Method::PUT, &target, &headers).await.map_err(Err)?;
        if resp.status() != StatusCode::OK {
            return Err(Ok(resp));
        }
        let body = resp.into_body().collect().await.map_err(|e| {
            Err(ProxyError::Connect {
                dst,
                source: std::io::Error::other(format!("reading the token: {e}")),
            })
        })?;
        let value = HeaderValue::from_bytes(body.to_bytes().trim_ascii()).map_err(|_| {
            Err(ProxyError::Connect {
                dst,
                source: std::io::Error::other("the service's token is not a header value"),
            })
        })?;
        let expires = now + Duration::from_secs(u64::from(SERVICE_TTL));
        theirs.insert(dst, Theirs { value: value.clone(), expires });
        Ok(value)
    }
}

/// The answer to a token request: the token, and its lifetime as the service says it.
pub(crate) fn answer(scheme: &SessionScheme, token: String, ttl: u32) -> Response<Body> {
    let mut resp = Response::new(text(token));
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    resp.headers_mut()
        .insert(http::HeaderName::from_static(scheme.ttl_header), HeaderValue::from(ttl));
    resp
}

/// 32 bytes from the kernel's generator, as text a header carries.
fn new_token() -> Option<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).ok()?;
    use std::fmt::Write as _;
    Some(bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCHEME: SessionScheme = SessionScheme {
        path: "/latest/api/token",
        token_header: "x-aws-ec2-metadata-token",
        ttl_header: "x-aws-ec2-metadata-token-ttl-seconds",
        max_ttl: 21600,
    };

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([169, 254, 169, 254], port))
    }

    #[test]
    fn a_token_is_good_for_its_workload_its_service_and_its_time_only() {
        let s = Sessions::default();
        let now = Instant::now();
        let t = s.issue(7, addr(80), 60, now).expect("a token");
        assert_eq!(t.len(), 64);
        assert!(s.valid(&t, 7, addr(80), now));
        assert!(!s.valid(&t, 8, addr(80), now), "another workload");
        assert!(!s.valid(&t, 7, addr(81), now), "another service");
        assert!(!s.valid(&t, 7, addr(80), now + Duration::from_secs(60)), "expired");
        assert!(!s.valid("forged", 7, addr(80), now));
        assert_ne!(Some(t), s.issue(7, addr(80), 60, now), "each token is new");
    }

    #[test]
    fn issued_tokens_are_bounded() {
        let s = Sessions::default();
        let now = Instant::now();
        let first = s.issue(1, addr(80), 1, now).expect("a token");
        for w in 0..(MAX_ISSUED / PER_WORKLOAD) as u64 {
            for i in 0..PER_WORKLOAD {
                s.issue(100 + w, addr(80), 600 + (i % 7) as u32, now);
            }
        }
        assert!(s.live(now) <= MAX_ISSUED);
        assert!(!s.valid(&first, 1, addr(80), now), "the one nearest its end went first");
    }

    #[test]
    fn one_workload_asking_in_a_loop_pushes_out_only_its_own_tokens() {
        let s = Sessions::default();
        let now = Instant::now();
        let other = s.issue(1, addr(80), 1, now).expect("a token");
        let first = s.issue(2, addr(80), 21600, now).expect("a token");
        let mut last = String::new();
        for _ in 0..MAX_ISSUED * 2 {
            last = s.issue(2, addr(80), 21600, now).expect("a token");
        }
        assert!(s.valid(&other, 1, addr(80), now), "another pod's token stays");
        assert!(!s.valid(&first, 2, addr(80), now), "its own oldest went");
        assert!(s.valid(&last, 2, addr(80), now));
        assert_eq!(s.live(now), PER_WORKLOAD + 1);
    }

    #[test]
    fn the_ttl_is_checked_as_the_service_checks_it() {
        let ask = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(SCHEME.ttl_header, HeaderValue::from_str(v).expect("value"));
            requested_ttl(&SCHEME, &h)
        };
        assert_eq!(ask("21600"), Some(21600));
        assert_eq!(ask("1"), Some(1));
        assert_eq!((ask("0"), ask("21601"), ask("-1"), ask("6h")), (None, None, None, None));
        assert_eq!(requested_ttl(&SCHEME, &HeaderMap::new()), None);
    }
}
