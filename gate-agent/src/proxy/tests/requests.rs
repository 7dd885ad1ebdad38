//! Requests: what is served, what is refused, and what the metadata service sees of either.
use super::*;
use crate::proxy::fake::{self, BODY};

#[tokio::test]
async fn a_served_path_reaches_the_service_as_the_service_expects() {
    let h = Harness::start().await;
    let raw = "GET /latest/meta-data/placement/region HTTP/1.1\r\nHost: evil.example\r\n\
               Connection: keep-alive, X-Secret\r\nX-Secret: s\r\nMetadata-Flavor: Google\r\n\
               Accept: */*\r\n\r\n";
    let answer = h.send(Some(h.caller(7, CSI)), raw.as_bytes()).await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    assert_eq!(answer.body(), BODY);
    assert_eq!(answer.header("content-type").as_deref(), Some("text/plain"));
    let seen = h.upstream.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(h.seen(), ["GET /latest/meta-data/placement/region"]);
    let headers = fake::headers(&seen[0]);
    let get = |n: &str| {
        headers.iter().filter(|(k, _)| k == n).map(|(_, v)| v.as_str()).collect::<Vec<_>>()
    };
    assert_eq!(get("host"), [h.upstream_addr.to_string().as_str()], "Host names the destination");
    assert_eq!(get("metadata-flavor"), ["Google"]);
    // IMDSv2's token header is the proxy's to replace (tests/answers.rs).
    assert_eq!(get("accept"), ["*/*"]);
    for never in
        ["x-forwarded-for", "x-forwarded-host", "forwarded", "via", "x-secret", "connection"]
    {
        assert!(get(never).is_empty(), "{never} forwarded: {headers:?}");
    }
    assert_eq!(h.metrics.requests_of("served", "ok"), 1);
}

#[tokio::test]
async fn a_refused_path_is_403_naming_entry_and_policy_and_never_forwarded() {
    let h = Harness::start().await;
    let answer = h.get(CSI, "/latest/meta-data/iam/info").await;
    assert_eq!(answer.status(), 403);
    assert_eq!(answer.header("content-type").as_deref(), Some("text/plain"));
    let hash = Policy::parse("test.yaml", POLICY).expect("policy").hash();
    assert_eq!(
        answer.body(),
        format!(
            "metadata-gate: GET /latest/meta-data/iam/info refused: path not allowed \
             (entry aws-ebs-csi-driver-node, policy {hash})\n"
        )
    );
    assert!(h.seen().is_empty());
    assert_eq!(h.metrics.requests_of("refused", "path"), 1);
}

#[tokio::test]
async fn prefixes_cover_whole_segments() {
    let h = Harness::start().await;
    assert_eq!(h.get(CSI, "/latest/meta-data/placementX").await.status(), 403);
    assert_eq!(h.get(CSI, "/latest/meta-data/placementX/region").await.status(), 403);
    assert_eq!(h.get(CSI, "/latest/meta-data/placement").await.status(), 200);
    assert_eq!(h.get(CSI, "/latest/meta-data/placement/availability-zone").await.status(), 200);
    assert_eq!(
        h.seen(),
        ["GET /latest/meta-data/placement", "GET /latest/meta-data/placement/availability-zone"]
    );
}

/// Targets that another parser could read as a path the entry does not list.
#[tokio::test]
async fn ambiguous_targets_are_refused_unforwarded() {
    let h = Harness::start().await;
    let targets = [
        ("/latest/meta-data/placement/%2f..%2fiam/info", "percent-encoding"),
        ("/latest/meta-data/placement%2F..%2Fiam", "percent-encoding"),
        ("/latest/meta-data/placement/./region", ". and .. segments"),
        ("/latest/meta-data/placement/../iam/info", ". and .. segments"),
        ("/latest//meta-data/placement/region", "empty segment"),
        ("/latest/meta-data/placement\\..\\iam", "backslash"),
    ];
    for (t, why) in targets {
        let answer = h.get(CSI, t).await;
        assert_eq!(answer.status(), 403, "{t}: {answer:?}");
        assert!(answer.body().contains(why), "{t}: {}", answer.body());
    }
    assert!(h.seen().is_empty(), "{:?}", h.seen());
    assert_eq!(h.metrics.requests_of("refused", "target"), targets.len() as u64);
}

/// The request's form: tunnels, foreign targets, bodies, forwarding headers.
#[tokio::test]
async fn request_forms_are_refused_unforwarded() {
    let h = Harness::start().await;
    let path = "/latest/meta-data/instance-id";
    let cases: Vec<(String, u16, &str)> = vec![
        (
            format!("GET http://evil.example{path} HTTP/1.1\r\nHost: evil.example\r\n\r\n"),
            403,
            "absolute-form",
        ),
        (format!("GET http://169.254.169.254{path} HTTP/1.1\r\n\r\n"), 403, "absolute-form"),
        (
            "CONNECT 169.254.169.254:80 HTTP/1.1\r\nHost: 169.254.169.254:80\r\n\r\n".into(),
            403,
            "CONNECT",
        ),
        ("OPTIONS * HTTP/1.1\r\n\r\n".into(), 403, "must start with /"),
        (
            format!(
                "GET {path} HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n"
            ),
            403,
            "Transfer-Encoding",
        ),
        (
            format!("GET {path} HTTP/1.1\r\nContent-Length: 4\r\nContent-Length: 4\r\n\r\nabcd"),
            403,
            "Content-Length",
        ),
        (format!("PUT {path} HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"), 403, "Content-Length"),
        (
            format!("GET {path} HTTP/1.1\r\nX-Forwarded-For: 10.0.0.1\r\n\r\n"),
            403,
            "X-Forwarded-For",
        ),
        (format!("GET {path} HTTP/1.1\r\nVia: 1.1 squid\r\n\r\n"), 403, "via"),
        (format!("GET {path} HTTP/1.1\r\nForwarded: for=10.0.0.1\r\n\r\n"), 403, "forwarded"),
        (format!("GET {path} HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"), 403, "Host"),
        (
            format!("GET {path} HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"),
            403,
            "Upgrade",
        ),
        // Lengths that disagree: hyper rejects them before the proxy sees the request.
        (
            format!("GET {path} HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 4\r\n\r\nabcd"),
            400,
            "",
        ),
        (format!("GET {path} HTTP/2.0\r\n\r\n"), 400, ""),
    ];
    for (raw, status, why) in &cases {
        let answer = h.send(Some(h.caller(7, CSI)), raw.as_bytes()).await;
        assert_eq!(answer.status(), *status, "{raw:?}: {answer:?}");
        assert!(
            answer.body().to_lowercase().contains(&why.to_lowercase()),
            "{raw:?}: {}",
            answer.body()
        );
    }
    assert!(h.seen().is_empty(), "{:?}", h.seen());
}

/// Headers larger than hyper's buffer: 431 from hyper, nothing forwarded.
#[tokio::test]
async fn oversized_headers_are_refused() {
    let h = Harness::start().await;
    let raw = format!(
        "GET /latest/meta-data/instance-id HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(17 * 1024)
    );
    let answer = h.send(Some(h.caller(7, CSI)), raw.as_bytes()).await;
    assert_eq!(answer.status(), 431, "{answer:?}");
    assert!(h.seen().is_empty());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.metrics.refused_of(super::super::ConnRefusal::Malformed), 1);
}

/// `PUT` only where the entry lists it; and then with the token headers as sent.
#[tokio::test]
async fn put_needs_an_entry_that_lists_it() {
    let h = Harness::start().await;
    let put = "PUT /latest/api/token HTTP/1.1\r\nX-aws-ec2-metadata-token-ttl-seconds: 21600\r\n\
               Content-Length: 0\r\n\r\n";
    let refused = h.send(Some(h.caller(7, CSI)), put.as_bytes()).await;
    assert_eq!(refused.status(), 403);
    assert!(refused.body().contains("method not allowed"), "{}", refused.body());
    assert!(h.seen().is_empty());
    let served = h.send(Some(h.caller(8, TOKEN)), put.as_bytes()).await;
    assert_eq!(served.status(), 200, "{served:?}");
    assert_eq!(h.seen(), ["PUT /latest/api/token"]);
    let headers = fake::headers(&h.upstream.requests()[0]);
    assert!(headers.contains(&("x-aws-ec2-metadata-token-ttl-seconds".into(), "21600".into())));
    // HEAD is not listed for this entry either.
    let head = "HEAD /latest/meta-data/instance-id HTTP/1.1\r\n\r\n";
    assert_eq!(h.send(Some(h.caller(8, TOKEN)), head.as_bytes()).await.status(), 403);
}

/// A workload no entry selects gets `served`'s paths, and only those.
#[tokio::test]
async fn served_callers_get_served_paths_only() {
    let h = Harness::start().await;
    let ok = h.get(SERVED, "/latest/meta-data/placement/region").await;
    assert_eq!(ok.status(), 200);
    let refused = h.get(SERVED, "/latest/meta-data/instance-id").await;
    assert_eq!(refused.status(), 403);
    assert!(refused.body().contains("(served, policy "), "{}", refused.body());
    assert_eq!(h.get(SERVED, "/latest/meta-data/placement/zone").await.status(), 403);
    assert_eq!(h.seen(), ["GET /latest/meta-data/placement/region"]);
}

/// An entry without paths is refused everything: the proxy serves only narrowed access.
#[tokio::test]
async fn entries_without_paths_are_refused() {
    let h = Harness::start().await;
    let answer = h.get(PLAIN, "/latest/meta-data/instance-id").await;
    assert_eq!(answer.status(), 403);
    assert!(answer.body().contains("no paths are served to it (entry plain"), "{}", answer.body());
    let unknown = h.get(Some(17), "/latest/meta-data/instance-id").await;
    assert_eq!(unknown.status(), 403);
    assert!(h.seen().is_empty());
    assert_eq!(h.metrics.requests_of("refused", "no_paths"), 1);
    assert_eq!(h.metrics.requests_of("refused", "unknown_entry"), 1);
}

/// A second request behind the first on the same connection is never read, let alone
/// forwarded: one request per connection.
#[tokio::test]
async fn a_pipelined_second_request_is_never_read() {
    let h = Harness::start().await;
    let raw = "GET /latest/meta-data/instance-id HTTP/1.1\r\n\r\n\
               GET /latest/meta-data/iam/info HTTP/1.1\r\n\r\n";
    let answer = h.send(Some(h.caller(7, CSI)), raw.as_bytes()).await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    assert_eq!(answer.header("connection").as_deref(), Some("close"));
    assert_eq!(String::from_utf8_lossy(&answer.raw).matches("HTTP/1.1").count(), 1);
    assert_eq!(h.seen(), ["GET /latest/meta-data/instance-id"]);
}

/// The path record: what each workload asked for, by verdict; a request refused for its
/// form is not recorded (its target is not a path anyone may list).
#[tokio::test]
async fn each_workload_s_paths_are_recorded_by_verdict() {
    let h = Harness::start().await;
    assert_eq!(h.get(CSI, "/latest/meta-data/instance-id").await.status(), 200);
    assert_eq!(h.get(CSI, "/latest/meta-data/iam/info").await.status(), 403);
    assert_eq!(h.get(CSI, "/latest/meta-data/placement/../iam/info").await.status(), 403);
    let r = h.paths.records();
    let got: Vec<_> =
        r.iter().map(|r| (r.key.path.as_str(), r.counts.served, r.counts.refused)).collect();
    assert_eq!(
        got,
        [("/latest/meta-data/iam/info", 0, 1), ("/latest/meta-data/instance-id", 1, 0)]
    );
    assert!(r.iter().all(|r| r.key.cgroup_id == 7 && r.key.endpoint == "imds"), "{r:?}");
}

/// Audit mode: every path the policy would refuse is served, counted as audited with the
/// reason, and recorded; what cannot be judged is still refused and never forwarded.
#[tokio::test]
async fn audit_mode_serves_every_path_and_records_what_it_would_refuse() {
    let h = Harness::start().await;
    let audit = Policy::parse("test.yaml", &format!("mode: audit\n{POLICY}")).expect("policy");
    h.tables.send_replace(Some(Arc::new(Table::new(&audit, GENERATION))));
    assert_eq!(h.get(CSI, "/latest/meta-data/iam/info").await.status(), 200);
    assert_eq!(h.get(CSI, "/latest/meta-data/instance-id").await.status(), 200);
    assert_eq!(h.get(PLAIN, "/latest/user-data").await.status(), 200);
    assert_eq!(h.get(CSI, "/latest/meta-data/placement/../iam/info").await.status(), 403);
    assert_eq!(
        h.seen(),
        [
            "GET /latest/meta-data/iam/info",
            "GET /latest/meta-data/instance-id",
            "GET /latest/user-data"
        ]
    );
    assert_eq!(h.metrics.requests_of("audited", "path"), 1);
    assert_eq!(h.metrics.requests_of("audited", "no_paths"), 1);
    assert_eq!(h.metrics.requests_of("served", "ok"), 1);
    let audited: Vec<_> = h
        .paths
        .records()
        .into_iter()
        .filter(|r| r.counts.audited > 0)
        .map(|r| r.key.path)
        .collect();
    assert_eq!(audited, ["/latest/meta-data/iam/info", "/latest/user-data"]);
}

/// A `served` workload past its burst is answered 429 with `Retry-After`, and nothing of it
/// reaches the service; another served workload has a bucket of its own, and the allow-listed
/// entry (no `rate`) is served throughout. The metrics and the path record count it for the
/// workload. Without the bucket the eleventh request would reach the service.
#[tokio::test]
async fn a_workload_over_its_rate_gets_429_and_the_others_are_served() {
    let h = Harness::start().await;
    let get = |id: u64, entry: Option<u32>| {
        let raw = "GET /latest/meta-data/placement/region HTTP/1.1\r\nHost: x\r\n\r\n";
        h.send(Some(h.caller(id, entry)), raw.as_bytes())
    };
    let burst = crate::policy::SERVED_RATE.burst;
    for i in 0..burst {
        assert_eq!(get(20, SERVED).await.status(), 200, "request {i} within the burst");
    }
    let over = get(20, SERVED).await;
    assert_eq!(over.status(), 429, "{over:?}");
    assert_eq!(over.header("retry-after").as_deref(), Some("1"));
    let want = "metadata-gate: GET /latest/meta-data/placement/region: over the rate of served \
                (1 per second, burst 10); retry in 1 s\n";
    assert_eq!(over.body(), want);
    assert_eq!(h.seen().len(), burst as usize, "the request over the rate reached the service");
    assert_eq!(get(21, SERVED).await.status(), 200, "another served workload");
    for _ in 0..3 * burst {
        assert_eq!(get(22, CSI).await.status(), 200, "the allow-listed entry is not limited");
    }
    assert_eq!(h.metrics.requests_of("refused", "rate"), 1);
    assert_eq!(h.metrics.rate_limited_of("cgroup-id:20"), 1);
    let record = h.paths.records().into_iter().find(|r| r.key.cgroup_id == 20).expect("record");
    assert_eq!((record.counts.served, record.counts.limited), (u64::from(burst), 1));
}
