//! Answers the proxy keeps: the values a platform documents as fixed for the instance's life
//! (the instance id, its region, zone and type, the project), fetched once and then given by
//! the proxy itself, as the service gave them (status, the headers that describe the body,
//! the body). Nothing else is kept: never a path the platform's row does not mark fixed, so
//! never credentials, tokens or user data, whatever a policy lists.
//!
//! Only a `200` with a declared length within [`MAX_BODY`] is kept, at most [`MAX_ANSWERS`] of
//! them. The cache lives in the agent's memory, so a new boot (a stop and start, which is
//! where an instance's type or zone can change) starts empty; besides, an answer older than
//! [`FRESH`] is asked again, and one that changed drops every kept answer of that service:
//! the instance is not the one they were for.
use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};

use http::{HeaderMap, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;

use super::forward::Body;

/// Answers kept at most (a profile has a handful of fixed paths; Azure's differ by query).
pub(crate) const MAX_ANSWERS: usize = 256;
/// Largest body kept (the fixed values are ids and names).
pub(crate) const MAX_BODY: usize = 4096;
/// How long an answer is given before it is asked again.
pub(crate) const FRESH: Duration = Duration::from_secs(600);

/// Response headers kept with a body: those that say what the body is. The rest (`Date`,
/// `Server`, connection headers) are the exchange's, not the answer's.
const KEPT_HEADERS: [header::HeaderName; 4] =
    [header::CONTENT_TYPE, header::ETAG, header::LAST_MODIFIED, header::CACHE_CONTROL];
/// GCE's answers name the flavor; clients check it (google-auth's detection).
const METADATA_FLAVOR: &str = "metadata-flavor";

/// One kept answer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Kept {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    fetched: Instant,
}

/// The kept answers, by service address and request target.
#[derive(Default)]
pub(crate) struct Answers {
    kept: Mutex<HashMap<(SocketAddr, String), Kept>>,
}

impl Answers {
    /// The kept answer to `target` at `dst`, if fresh at `now`.
    pub(crate) fn get(
        &self,
        dst: SocketAddr,
        target: &str,
        now: Instant,
    ) -> Option<Response<Body>> {
        let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let k = kept.get(&(dst, target.to_owned()))?;
        if now.duration_since(k.fetched) >= FRESH {
            return None;
        }
        let mut resp = Response::new(full(k.body.clone()));
        *resp.status_mut() = k.status;
        *resp.headers_mut() = k.headers.clone();
        Some(resp)
    }

    /// Keep `resp` (the service's answer to `target` at `dst`) if it may be kept, and give it
    /// back to pass on. An answer that differs from the one kept drops every kept answer of
    /// `dst`.
    pub(crate) async fn keep(
        &self,
        dst: SocketAddr,
        target: &str,
        resp: Response<Body>,
        now: Instant,
    ) -> Response<Body> {
        let declared = resp
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<usize>().ok());
        if resp.status() != StatusCode::OK || declared.is_none_or(|n| n > MAX_BODY) {
            return resp;
        }
        let (parts, body) = resp.into_parts();
        // The forwarder has read the body whole already: this only takes it out of its box.
        let Ok(collected) = body.collect().await else {
            return error_response();
        };
        let body = collected.to_bytes();
        let mut headers = HeaderMap::new();
        for name in KEPT_HEADERS.iter().chain(std::iter::once(&header::CONTENT_LENGTH)) {
            for v in parts.headers.get_all(name) {
                headers.append(name.clone(), v.clone());
            }
        }
        for v in parts.headers.get_all(METADATA_FLAVOR) {
            headers.append(METADATA_FLAVOR, v.clone());
        }
        let new = Kept { status: parts.status, headers, body: body.clone(), fetched: now };
        {
            let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
            let key = (dst, target.to_owned());
            let changed = kept.get(&key).is_some_and(|old| old.body != new.body);
            if changed {
                kept.retain(|(d, _), _| *d != dst);
            }
            if kept.len() < MAX_ANSWERS || kept.contains_key(&key) {
                kept.insert(key, new);
            }
        }
        Response::from_parts(parts, full(body))
    }

    /// Answers kept.
    pub(crate) fn len(&self) -> usize {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

fn full(body: Bytes) -> Body {
    Full::new(body).map_err(|never| match never {}).boxed()
}

/// The body could not be taken out of its box (it was read whole, so this does not happen):
/// no answer rather than a wrong one.
fn error_response() -> Response<Body> {
    let mut resp = Response::new(super::forward::text(
        "metadata-gate: the service's answer could not be read\n".to_owned(),
    ));
    *resp.status_mut() = StatusCode::BAD_GATEWAY;
    resp
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn answer(status: u16, body: &str) -> Response<Body> {
        let mut r = Response::new(full(Bytes::from(body.to_owned())));
        *r.status_mut() = StatusCode::from_u16(status).expect("status");
        let h = r.headers_mut();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        h.insert(header::DATE, HeaderValue::from_static("Sun, 29 Nov 2026 08:00:00 GMT"));
        h.insert(METADATA_FLAVOR, HeaderValue::from_static("Google"));
        r
    }

    async fn body(r: Response<Body>) -> (StatusCode, HeaderMap, Bytes) {
        let (p, b) = r.into_parts();
        (p.status, p.headers, b.collect().await.expect("body").to_bytes())
    }

    const DST: SocketAddr =
        SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::new(169, 254, 169, 254)), 80);

    #[tokio::test]
    async fn a_kept_answer_is_the_service_s_status_headers_and_body() {
        let a = Answers::default();
        let now = Instant::now();
        let passed = body(a.keep(DST, "/id", answer(200, "i-1"), now).await).await;
        assert_eq!(passed.2, "i-1", "the first answer goes on as it came");
        let (status, headers, b) = body(a.get(DST, "/id", now).expect("kept")).await;
        assert_eq!((status, b), (StatusCode::OK, Bytes::from("i-1")));
        assert_eq!(headers.get(header::CONTENT_TYPE).expect("type"), "text/plain");
        assert_eq!(headers.get(header::CONTENT_LENGTH).expect("length"), "3");
        assert_eq!(headers.get(METADATA_FLAVOR).expect("flavor"), "Google");
        assert!(headers.get(header::DATE).is_none(), "the exchange's headers are not kept");
        assert!(a.get(DST, "/other", now).is_none());
        assert!(a.get(DST, "/id", now + FRESH).is_none(), "asked again once stale");
    }

    #[tokio::test]
    async fn only_whole_small_successes_are_kept() {
        let a = Answers::default();
        let now = Instant::now();
        for (status, body) in [(404, "no"), (500, "x"), (200, &"x".repeat(MAX_BODY + 1)[..])] {
            let _ = a.keep(DST, "/p", answer(status, body), now).await;
            assert!(a.get(DST, "/p", now).is_none(), "{status} {}", body.len());
        }
        let mut chunked = answer(200, "i-1");
        chunked.headers_mut().remove(header::CONTENT_LENGTH);
        let _ = a.keep(DST, "/p", chunked, now).await;
        assert!(a.get(DST, "/p", now).is_none(), "no declared length");
    }

    #[tokio::test]
    async fn a_changed_answer_drops_the_service_s_answers() {
        let a = Answers::default();
        let now = Instant::now();
        let other = SocketAddr::from(([168, 63, 129, 16], 80));
        let _ = a.keep(DST, "/id", answer(200, "i-1"), now).await;
        let _ = a.keep(DST, "/zone", answer(200, "z-1"), now).await;
        let _ = a.keep(other, "/id", answer(200, "vm-1"), now).await;
        let later = now + FRESH;
        let _ = a.keep(DST, "/id", answer(200, "i-2"), later).await;
        assert!(a.get(DST, "/zone", later).is_none(), "the instance changed");
        assert!(a.get(other, "/id", now).is_some(), "another service's answers stay");
        let (_, _, b) = body(a.get(DST, "/id", later).expect("the new one")).await;
        assert_eq!(b, "i-2");
    }

    #[tokio::test]
    async fn the_cache_is_bounded() {
        let a = Answers::default();
        let now = Instant::now();
        for i in 0..MAX_ANSWERS + 10 {
            let _ = a.keep(DST, &format!("/p{i}"), answer(200, "v"), now).await;
        }
        assert_eq!(a.len(), MAX_ANSWERS);
    }
}
