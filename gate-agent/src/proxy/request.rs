//! The form of a request, checked before the judge looks at its target: what a proxy in
//! front of a metadata service must never pass on, whatever the path. Pure.
//!
//! The proxy opens no tunnels and goes nowhere but where the workload connected, so
//! `CONNECT` and targets that name a host are refused rather than ignored. No served method
//! carries a body, so any body framing is refused: a request whose length two parsers could
//! read differently never reaches the metadata service. The metadata services reject
//! requests that look proxied (AWS, GCP, Azure check for forwarding headers), so a client's
//! own forwarding headers are refused here rather than passed on.
use std::fmt;

use http::{HeaderMap, Method, Uri, Version, header, uri::PathAndQuery};

/// Forwarding headers: a request that carries one is refused.
pub(crate) const FORWARDING: [&str; 4] =
    ["x-forwarded-for", "x-forwarded-host", "forwarded", "via"];

/// Why a request's form is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refused {
    /// `CONNECT`: the proxy opens no tunnels.
    Connect,
    /// `http://host/…`: the destination is the one the workload connected to, never one a
    /// request names.
    AbsoluteForm,
    /// `host:port` (or any target without a leading `/`, such as `*`).
    NotOriginForm,
    /// HTTP/0.9, HTTP/2 and later.
    Version(Version),
    /// More than one `Host`.
    Hosts,
    /// `Transfer-Encoding`: no served request has a body, chunked or otherwise.
    TransferEncoding,
    /// More than one `Content-Length`, or one that is not `0`.
    ContentLength,
    /// A body (whatever its framing said).
    Body,
    /// `Upgrade`: the proxy switches to no other protocol.
    Upgrade,
    /// A forwarding header (one of [`FORWARDING`]).
    Forwarded(&'static str),
}

impl Refused {
    /// The `reason` label of the request metric.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Refused::Connect | Refused::AbsoluteForm | Refused::NotOriginForm => "form",
            Refused::Version(_) => "form",
            Refused::Hosts
            | Refused::TransferEncoding
            | Refused::ContentLength
            | Refused::Body
            | Refused::Upgrade => "framing",
            Refused::Forwarded(_) => "forwarded",
        }
    }
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::Connect => f.write_str("CONNECT is refused: the proxy opens no tunnels"),
            Refused::AbsoluteForm => f.write_str(
                "absolute-form target refused: requests go to the address the workload connected to",
            ),
            Refused::NotOriginForm => f.write_str("request target must start with /"),
            Refused::Version(v) => write!(f, "{v:?} refused: HTTP/1.0 and HTTP/1.1 only"),
            Refused::Hosts => f.write_str("more than one Host header"),
            Refused::TransferEncoding => {
                f.write_str("Transfer-Encoding refused: no served request has a body")
            }
            Refused::ContentLength => {
                f.write_str("Content-Length other than one 0 refused: no served request has a body")
            }
            Refused::Body => f.write_str("a body refused: no served request has one"),
            Refused::Upgrade => f.write_str("Upgrade refused: the proxy switches no protocols"),
            Refused::Forwarded(h) => {
                write!(f, "{h} refused: the metadata service rejects forwarded requests")
            }
        }
    }
}

/// Check a request's form; on success, its target in origin form (path and query), exactly
/// what the judge is asked about and what the proxy would forward.
pub(crate) fn check<'a>(
    method: &Method,
    uri: &'a Uri,
    version: Version,
    headers: &HeaderMap,
) -> Result<&'a PathAndQuery, Refused> {
    if method == Method::CONNECT {
        return Err(Refused::Connect);
    }
    if uri.scheme().is_some() {
        return Err(Refused::AbsoluteForm);
    }
    // The target as received: `Uri::path()` would make "/" of an empty one.
    let target = match uri.path_and_query() {
        Some(pq) if uri.authority().is_none() && pq.as_str().starts_with('/') => pq,
        _ => return Err(Refused::NotOriginForm),
    };
    if version != Version::HTTP_10 && version != Version::HTTP_11 {
        return Err(Refused::Version(version));
    }
    if headers.get_all(header::HOST).iter().count() > 1 {
        return Err(Refused::Hosts);
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        return Err(Refused::TransferEncoding);
    }
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    match (lengths.next(), lengths.next()) {
        (None, _) => {}
        (Some(v), None) if v.as_bytes() == b"0" => {}
        _ => return Err(Refused::ContentLength),
    }
    if headers.contains_key(header::UPGRADE) {
        return Err(Refused::Upgrade);
    }
    if let Some(h) = FORWARDING.into_iter().find(|h| headers.contains_key(*h)) {
        return Err(Refused::Forwarded(h));
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;
    use proptest::prelude::*;

    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).expect(k),
                HeaderValue::from_str(v).expect(v),
            );
        }
        h
    }

    fn run(method: &str, target: &str, pairs: &[(&str, &str)]) -> Result<String, Refused> {
        let uri: Uri = target.parse().expect(target);
        let m = Method::from_bytes(method.as_bytes()).expect(method);
        check(&m, &uri, Version::HTTP_11, &headers(pairs)).map(|t| t.as_str().to_owned())
    }

    #[test]
    fn origin_form_requests_pass_with_their_target_as_sent() {
        let ok = [("Host", "169.254.169.254"), ("Metadata-Flavor", "Google")];
        assert_eq!(run("GET", "/latest/meta-data/", &ok), Ok("/latest/meta-data/".into()));
        assert_eq!(run("GET", "/a?b=c&d", &ok), Ok("/a?b=c&d".into()));
        // Judged later, not here: the judge refuses these.
        assert_eq!(run("GET", "/a/../b", &ok), Ok("/a/../b".into()));
        assert_eq!(run("POST", "/a", &ok), Ok("/a".into()));
        let put = [("Content-Length", "0"), ("X-aws-ec2-metadata-token-ttl-seconds", "21600")];
        assert_eq!(run("PUT", "/latest/api/token", &put), Ok("/latest/api/token".into()));
        let m = Method::GET;
        let uri: Uri = "/".parse().expect("uri");
        let t = check(&m, &uri, Version::HTTP_10, &HeaderMap::new()).map(PathAndQuery::as_str);
        assert_eq!(t, Ok("/"));
    }

    #[test]
    fn tunnels_and_foreign_targets_are_refused() {
        assert_eq!(run("CONNECT", "169.254.169.254:80", &[]), Err(Refused::Connect));
        assert_eq!(run("CONNECT", "/", &[]), Err(Refused::Connect));
        assert_eq!(run("GET", "http://evil/latest/meta-data/", &[]), Err(Refused::AbsoluteForm));
        assert_eq!(run("GET", "http://169.254.169.254/", &[]), Err(Refused::AbsoluteForm));
        assert_eq!(run("GET", "evil:80", &[]), Err(Refused::NotOriginForm));
        assert_eq!(run("OPTIONS", "*", &[]), Err(Refused::NotOriginForm));
        // http's parser drops a fragment before the proxy sees the target: what is judged is
        // what is forwarded, and the fragment goes nowhere.
        let fragment = run("GET", "/latest/meta-data/instance-id#/../iam/", &[]);
        assert_eq!(fragment, Ok("/latest/meta-data/instance-id".into()));
        let uri: Uri = "/".parse().expect("uri");
        for v in [Version::HTTP_09, Version::HTTP_2, Version::HTTP_3] {
            assert_eq!(check(&Method::GET, &uri, v, &HeaderMap::new()), Err(Refused::Version(v)));
        }
    }

    #[test]
    fn body_framing_and_forwarding_headers_are_refused() {
        let cases: [(&[(&str, &str)], Refused); 12] = [
            (&[("Host", "a"), ("Host", "a")], Refused::Hosts),
            (&[("Transfer-Encoding", "chunked")], Refused::TransferEncoding),
            (&[("Transfer-Encoding", "identity")], Refused::TransferEncoding),
            (
                &[("Transfer-Encoding", "chunked"), ("Content-Length", "0")],
                Refused::TransferEncoding,
            ),
            (&[("Content-Length", "5")], Refused::ContentLength),
            (&[("Content-Length", "0"), ("Content-Length", "0")], Refused::ContentLength),
            (&[("Content-Length", "00")], Refused::ContentLength),
            (&[("Content-Length", "0, 0")], Refused::ContentLength),
            (&[("Upgrade", "websocket"), ("Connection", "upgrade")], Refused::Upgrade),
            (&[("X-Forwarded-For", "10.0.0.1")], Refused::Forwarded("x-forwarded-for")),
            (&[("forwarded", "for=10.0.0.1")], Refused::Forwarded("forwarded")),
            (&[("Via", "1.1 proxy")], Refused::Forwarded("via")),
        ];
        for (pairs, want) in cases {
            assert_eq!(run("GET", "/latest/meta-data/", pairs), Err(want.clone()), "{pairs:?}");
        }
        let xfh = run("GET", "/", &[("X-Forwarded-Host", "evil")]);
        assert_eq!(xfh, Err(Refused::Forwarded("x-forwarded-host")));
    }

    #[test]
    fn every_refusal_says_why_in_one_line_and_has_a_label() {
        let all = [
            Refused::Connect,
            Refused::AbsoluteForm,
            Refused::NotOriginForm,
            Refused::Version(Version::HTTP_2),
            Refused::Hosts,
            Refused::TransferEncoding,
            Refused::ContentLength,
            Refused::Body,
            Refused::Upgrade,
            Refused::Forwarded("via"),
        ];
        for r in all {
            let text = r.to_string();
            assert!(!text.is_empty() && !text.contains('\n'), "{r:?}");
            assert!(["form", "framing", "forwarded"].contains(&r.label()), "{r:?}");
        }
    }

    fn header_name() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(vec![
                "host",
                "transfer-encoding",
                "content-length",
                "upgrade",
                "x-forwarded-for",
                "x-forwarded-host",
                "forwarded",
                "via",
                "metadata-flavor",
                "connection",
            ])
            .prop_map(str::to_owned),
            "[a-z][a-z0-9-]{0,12}",
        ]
    }

    proptest! {
        /// Whatever the headers, an accepted request has at most one Host, no body framing
        /// but a single `Content-Length: 0`, no Upgrade and no forwarding header; and its
        /// target is origin form.
        #[test]
        fn accepted_requests_carry_nothing_refused(
            pairs in proptest::collection::vec((header_name(), "[0-9a-z ,]{0,6}"), 0..8),
            target in prop_oneof!["/[ -~]{0,12}", "[a-z]{1,5}:[0-9]{1,3}", "http://[a-z]{1,5}/[a-z]{0,4}"],
        ) {
            let mut h = HeaderMap::new();
            for (k, v) in &pairs {
                if let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_str(v)) {
                    h.append(k, v);
                }
            }
            let Ok(uri) = target.parse::<Uri>() else { return Ok(()) };
            if let Ok(t) = check(&Method::GET, &uri, Version::HTTP_11, &h) {
                prop_assert!(t.as_str().starts_with('/'));
                prop_assert!(h.get_all(header::HOST).iter().count() <= 1);
                prop_assert!(!h.contains_key(header::TRANSFER_ENCODING));
                prop_assert!(!h.contains_key(header::UPGRADE));
                prop_assert!(FORWARDING.iter().all(|f| !h.contains_key(*f)));
                let cl: Vec<_> = h.get_all(header::CONTENT_LENGTH).iter().collect();
                prop_assert!(cl.is_empty() || cl == [HeaderValue::from_static("0")]);
            }
        }
    }
}
