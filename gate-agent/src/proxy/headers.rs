//! Headers on the way through: what goes to the metadata service and what comes back. Pure.
//!
//! Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection and are dropped both ways,
//! with any header a `Connection` header names, except the platforms' own headers, which
//! pass untouched whatever a client's `Connection` says. `Host` is set to the address the
//! workload connected to. Nothing is added that says the request went through a proxy: the
//! metadata services reject such requests.
use std::net::SocketAddr;

use http::{HeaderMap, HeaderName, HeaderValue, header};

use super::request::FORWARDING;

/// Headers of one connection, never passed on.
pub(crate) const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The platforms' required headers (GCP's `Metadata-Flavor`, Azure's `Metadata`, IMDSv2's token
/// headers, OCI's `Authorization`): passed on as they are, never dropped by a `Connection`.
pub(crate) const PLATFORM: [&str; 5] = [
    "metadata-flavor",
    "metadata",
    "x-aws-ec2-metadata-token",
    "x-aws-ec2-metadata-token-ttl-seconds",
    "authorization",
];

/// The headers of a request to the metadata service at `dst`: the client's, minus hop-by-hop
/// and framing ones (the proxy frames its own request), with `Host` naming `dst`.
pub(crate) fn upstream(client: &HeaderMap, dst: SocketAddr) -> HeaderMap {
    let mut out = pass(client, &[header::HOST, header::CONTENT_LENGTH]);
    for h in FORWARDING {
        // Refused before this point; dropped here too, so that this alone never sends one.
        out.remove(h);
    }
    out.insert(header::HOST, host(dst));
    out
}

/// The headers of a response to the client: the metadata service's, minus hop-by-hop ones.
pub(crate) fn downstream(upstream: &HeaderMap) -> HeaderMap {
    pass(upstream, &[])
}

/// `headers` without hop-by-hop ones, those named by `Connection` (platform headers kept), and
/// `also`.
fn pass(headers: &HeaderMap, also: &[HeaderName]) -> HeaderMap {
    // Read in place for each header (a request has a handful): no list of names is built.
    let named = |n: &str| {
        headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|c| c.trim().eq_ignore_ascii_case(n))
    };
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let n = name.as_str();
        let dropped =
            HOP_BY_HOP.contains(&n) || also.contains(name) || (!PLATFORM.contains(&n) && named(n));
        if !dropped {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// `Host` for `dst`: the address, IPv6 in brackets, the port unless it is 80.
pub(crate) fn host(dst: SocketAddr) -> HeaderValue {
    let text = match (dst, dst.port()) {
        (SocketAddr::V4(a), 80) => a.ip().to_string(),
        (SocketAddr::V6(a), 80) => format!("[{}]", a.ip()),
        // SocketAddr's Display brackets IPv6 and drops the scope and flow info a Host has no
        // room for.
        (SocketAddr::V4(a), _) => a.to_string(),
        (SocketAddr::V6(a), port) => format!("[{}]:{port}", a.ip()),
    };
    // An address and a port are always a valid header value; an empty one (never produced)
    // would simply be rejected by the metadata service.
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).expect(k),
                HeaderValue::from_str(v).expect(v),
            );
        }
        h
    }

    fn names(h: &HeaderMap) -> Vec<String> {
        let mut n: Vec<String> =
            h.iter().map(|(k, v)| format!("{k}: {}", v.to_str().unwrap_or("?"))).collect();
        n.sort();
        n
    }

    #[test]
    fn host_names_the_destination() {
        let host = |s: &str| super::host(s.parse().expect(s));
        assert_eq!(host("169.254.169.254:80"), "169.254.169.254");
        assert_eq!(host("169.254.169.254:8080"), "169.254.169.254:8080");
        assert_eq!(host("[fd00:ec2::254]:80"), "[fd00:ec2::254]");
        assert_eq!(host("[fd00:ec2::254]:8775"), "[fd00:ec2::254]:8775");
        assert_eq!(host("[fe80::1%2]:80"), "[fe80::1]");
    }

    #[test]
    fn upstream_keeps_platform_headers_and_drops_hop_by_hop() {
        let client = map(&[
            ("Host", "evil.example"),
            ("Metadata-Flavor", "Google"),
            ("Metadata", "true"),
            ("X-aws-ec2-metadata-token", "AQAEA"),
            ("X-aws-ec2-metadata-token-ttl-seconds", "21600"),
            ("Authorization", "Bearer Oracle"),
            ("Connection", "keep-alive, X-Secret, Metadata-Flavor, Authorization"),
            ("Keep-Alive", "timeout=5"),
            ("Proxy-Connection", "keep-alive"),
            ("Proxy-Authorization", "Basic eA=="),
            ("TE", "trailers"),
            ("Trailer", "X"),
            ("X-Secret", "dropped: named by Connection"),
            ("Content-Length", "0"),
            ("Accept", "*/*"),
            ("X-Forwarded-For", "10.0.0.1"),
            ("Via", "1.1 x"),
        ]);
        let up = upstream(&client, "169.254.169.254:80".parse().expect("addr"));
        assert_eq!(
            names(&up),
            [
                "accept: */*",
                "authorization: Bearer Oracle",
                "host: 169.254.169.254",
                "metadata-flavor: Google",
                "metadata: true",
                "x-aws-ec2-metadata-token-ttl-seconds: 21600",
                "x-aws-ec2-metadata-token: AQAEA",
            ]
        );
    }

    #[test]
    fn downstream_drops_hop_by_hop_only() {
        let resp = map(&[
            ("Content-Type", "text/plain"),
            ("Content-Length", "19"),
            ("Connection", "close, X-Hop"),
            ("X-Hop", "1"),
            ("Transfer-Encoding", "chunked"),
            ("X-aws-ec2-metadata-token-ttl-seconds", "21600"),
            ("Server", "EC2ws"),
        ]);
        assert_eq!(
            names(&downstream(&resp)),
            [
                "content-length: 19",
                "content-type: text/plain",
                "server: EC2ws",
                "x-aws-ec2-metadata-token-ttl-seconds: 21600",
            ]
        );
        // GCE's answer to its detection probe: google-auth believes it runs on GCE only if
        // `Metadata-Flavor: Google` comes back, whatever a `Connection` names.
        let gce = map(&[
            ("Metadata-Flavor", "Google"),
            ("Connection", "close, Metadata-Flavor"),
            ("Content-Type", "application/text"),
        ]);
        assert_eq!(
            names(&downstream(&gce)),
            ["content-type: application/text", "metadata-flavor: Google"]
        );
    }

    proptest! {
        /// Whatever the client sends, the request to the metadata service has exactly one Host,
        /// the destination's, no hop-by-hop or forwarding header, and every platform header
        /// the client sent, unchanged.
        #[test]
        fn upstream_headers_hold_for_any_input(
            pairs in proptest::collection::vec((
                prop_oneof![
                    prop::sample::select(HOP_BY_HOP.to_vec()).prop_map(str::to_owned),
                    prop::sample::select(PLATFORM.to_vec()).prop_map(str::to_owned),
                    prop::sample::select(FORWARDING.to_vec()).prop_map(str::to_owned),
                    Just("host".to_owned()),
                    "[a-z][a-z-]{0,8}",
                ],
                "[ -~]{0,24}",
            ), 0..12),
            port in 1u16..,
        ) {
            let mut client = HeaderMap::new();
            for (k, v) in &pairs {
                if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_str(v)) {
                    client.append(k, v);
                }
            }
            let dst = SocketAddr::from(([169, 254, 169, 254], port));
            let up = upstream(&client, dst);
            let hosts: Vec<_> = up.get_all(header::HOST).iter().collect();
            prop_assert_eq!(hosts, [&host(dst)]);
            for h in HOP_BY_HOP.iter().chain(FORWARDING.iter()) {
                prop_assert!(!up.contains_key(*h), "{}", h);
            }
            for p in PLATFORM {
                let sent: Vec<_> = client.get_all(p).iter().collect();
                let passed: Vec<_> = up.get_all(p).iter().collect();
                prop_assert_eq!(sent, passed);
            }
        }
    }
}
