//! The proxy's own session tokens and kept answers, against the stand-in service (which
//! answers every request with its instance id, so its "token" is that text too).
use super::*;
use crate::proxy::fake::BODY;

const TOKEN_HEADER: &str = "x-aws-ec2-metadata-token";

/// `PUT /latest/api/token` from workload `id` of the `token` entry, with `ttl` as sent.
async fn put_token(h: &Harness, id: u64, ttl: &str) -> Answer {
    let raw = format!(
        "PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\n\
         X-aws-ec2-metadata-token-ttl-seconds: {ttl}\r\n\r\n"
    );
    h.send(Some(h.caller(id, TOKEN)), raw.as_bytes()).await
}

/// `GET path` from workload `id` of the `token` entry, with `token` if any.
async fn get_with(h: &Harness, id: u64, path: &str, token: Option<&str>) -> Answer {
    let header = token.map(|t| format!("X-aws-ec2-metadata-token: {t}\r\n")).unwrap_or_default();
    let raw = format!("GET {path} HTTP/1.1\r\nHost: 169.254.169.254\r\n{header}\r\n");
    h.send(Some(h.caller(id, TOKEN)), raw.as_bytes()).await
}

/// The token header each request to the stand-in carried, in order.
fn tokens_seen(h: &Harness) -> Vec<Option<String>> {
    h.upstream
        .requests()
        .iter()
        .map(|r| {
            crate::proxy::fake::headers(r)
                .into_iter()
                .find(|(k, _)| k == TOKEN_HEADER)
                .map(|(_, v)| v)
        })
        .collect()
}

#[tokio::test]
async fn workloads_get_tokens_of_the_proxy_and_the_service_s_stays_in_the_agent() {
    let h = Harness::start().await;
    let put = put_token(&h, 7, "60").await;
    assert_eq!(put.status(), 200, "{put:?}");
    let token = put.body();
    assert_eq!(token.len(), 64, "{token}");
    assert_ne!(token, BODY, "the service's token is never handed out");
    assert_eq!(put.header("x-aws-ec2-metadata-token-ttl-seconds").as_deref(), Some("60"));
    assert_eq!(h.seen(), ["PUT /latest/api/token"], "the agent took one token of its own");

    let got = get_with(&h, 7, "/latest/meta-data/instance-id", Some(&token)).await;
    assert_eq!((got.status(), got.body()), (200, BODY.to_owned()));
    assert_eq!(tokens_seen(&h), [None, Some(BODY.to_owned())], "the service saw its own token");

    // A second token request is answered without asking the service again.
    assert_eq!(put_token(&h, 8, "21600").await.status(), 200);
    assert_eq!(h.seen().len(), 2);
}

#[tokio::test]
async fn a_token_not_issued_to_the_caller_is_refused_without_asking_the_service() {
    let h = Harness::start().await;
    let token = put_token(&h, 7, "60").await.body();
    for (id, t) in [(7, "forged"), (7, BODY), (8, token.as_str())] {
        let got = get_with(&h, id, "/latest/meta-data/instance-id", Some(t)).await;
        assert_eq!(got.status(), 401, "workload {id} with {t}: {got:?}");
        assert!(got.body().contains("not one this proxy issued"), "{}", got.body());
    }
    assert_eq!(h.seen(), ["PUT /latest/api/token"], "nothing else reached the service");
    for ttl in ["0", "21601", "x"] {
        assert_eq!(put_token(&h, 7, ttl).await.status(), 400, "ttl {ttl}");
    }
    assert_eq!(h.seen().len(), 1);
}

#[tokio::test]
async fn a_fixed_value_is_fetched_once_and_then_answered_by_the_proxy() {
    let h = Harness::start().await;
    let token = put_token(&h, 7, "60").await.body();
    let first = get_with(&h, 7, "/latest/meta-data/instance-id", Some(&token)).await;
    let second = get_with(&h, 7, "/latest/meta-data/instance-id", Some(&token)).await;
    assert_eq!(h.seen(), ["PUT /latest/api/token", "GET /latest/meta-data/instance-id"]);
    assert_eq!((second.status(), second.body()), (first.status(), first.body()));
    assert_eq!(second.header("content-type"), first.header("content-type"));
    assert_eq!(second.header("content-length"), first.header("content-length"));
    assert_eq!(h.metrics.cached_answers.get(), 1);
}

#[tokio::test]
async fn without_a_valid_token_no_kept_answer_is_given() {
    let h = Harness::start().await;
    let token = put_token(&h, 7, "60").await.body();
    let _ = get_with(&h, 7, "/latest/meta-data/instance-id", Some(&token)).await;
    // IMDSv1 (no token): the service decides, every time (it refuses where v2 is required).
    for _ in 0..2 {
        assert_eq!(get_with(&h, 7, "/latest/meta-data/instance-id", None).await.status(), 200);
    }
    assert_eq!(tokens_seen(&h), [None, Some(BODY.to_owned()), None, None]);
    // An expired token gets a 401, not the kept answer.
    let short = put_token(&h, 9, "1").await.body();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let late = get_with(&h, 9, "/latest/meta-data/instance-id", Some(&short)).await;
    assert_eq!(late.status(), 401, "{late:?}");
}

#[tokio::test]
async fn what_the_platform_does_not_mark_fixed_always_goes_to_the_service() {
    let h = Harness::start().await;
    let token = put_token(&h, 5, "60").await.body();
    // The csi entry's `/latest/meta-data/placement/` (a prefix) serves the availability
    // zone, which the AWS row lists as a prefix: never kept, even with a valid token.
    for _ in 0..2 {
        let raw = format!(
            "GET /latest/meta-data/placement/availability-zone HTTP/1.1\r\nHost: x\r\n\
             X-aws-ec2-metadata-token: {token}\r\n\r\n"
        );
        assert_eq!(h.send(Some(h.caller(5, CSI)), raw.as_bytes()).await.status(), 200);
    }
    assert_eq!(h.seen().len(), 3);
    assert_eq!(h.metrics.cached_answers.get(), 0);
}
