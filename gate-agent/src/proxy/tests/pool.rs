//! Connections to the metadata service, kept for the next request where the service keeps
//! them, and closed on any error or doubt: the service counts the connections it accepts, and
//! every answer is checked to be the one the service gave for that request.
use super::*;
use crate::proxy::fake::KeepAlive;

const ID: &str = "/latest/meta-data/instance-id";

/// `GET path` from csi-node, to the service at `dst`.
async fn get_from(h: &Harness, dst: SocketAddr) -> Answer {
    let mut caller = h.caller(7, CSI);
    caller.dst = dst;
    let raw = format!("GET {ID} HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n");
    h.send(Some(caller), raw.as_bytes()).await
}

#[tokio::test]
async fn sequential_requests_share_one_connection() {
    let service = KeepAlive::new(|c, n| Some(KeepAlive::ok(&format!("c{c} r{n}"))));
    let dst = service.listen().await;
    let h = Harness::start().await;
    for n in 0..20 {
        let got = get_from(&h, dst).await;
        assert_eq!((got.status(), got.body()), (200, format!("c0 r{n}")), "{got:?}");
    }
    assert_eq!(service.accepted(), 1, "one handshake for twenty requests");
    assert_eq!(h.metrics.requests_of("served", "ok"), 20);
}

#[tokio::test]
async fn the_idle_pool_is_bounded_per_service_and_in_time() {
    // Slow answers, so that eight requests at once need eight connections.
    let service = KeepAlive::new(|c, n| Some(KeepAlive::ok(&format!("c{c} r{n}"))))
        .slow(Duration::from_millis(100));
    let dst = service.listen().await;
    let limits = Limits { upstream_idle: Duration::from_millis(300), ..test_limits() };
    let h = Arc::new(Harness::with(limits, Recorder::default()).await);
    let burst = |h: Arc<Harness>| async move {
        let asks: Vec<_> = (0..8)
            .map(|_| {
                tokio::spawn({
                    let h = h.clone();
                    async move { get_from(&h, dst).await }
                })
            })
            .collect();
        for ask in asks {
            let got = ask.await.expect("request task");
            assert_eq!(got.status(), 200, "{got:?}");
        }
    };
    burst(h.clone()).await;
    assert_eq!(service.accepted(), 8);
    // Four of the eight were kept: the next eight take them and open four.
    burst(h.clone()).await;
    assert_eq!(service.accepted(), 12, "four kept idle per service");
    // Idle past its time: closed, and the next request opens one.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(get_from(&h, dst).await.status(), 200);
    assert_eq!(service.accepted(), 13, "an idle connection outlived its time");
}

#[tokio::test]
async fn a_response_that_leaves_doubt_closes_its_connection() {
    // Each of these answers once, correctly, on a connection the service keeps open; none may
    // carry a second request, which therefore needs a second connection.
    let doubtful = [
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        "HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    ];
    for answer in doubtful {
        let service = KeepAlive::new(move |_, _| Some(answer.as_bytes().to_vec()));
        let dst = service.listen().await;
        let h = Harness::start().await;
        for _ in 0..2 {
            let got = get_from(&h, dst).await;
            assert_eq!((got.status(), got.body().as_str()), (200, "ok"), "{answer:.40}: {got:?}");
        }
        assert_eq!(service.accepted(), 2, "{answer:.40}: a connection was reused");
    }
}

#[tokio::test]
async fn bytes_after_a_response_never_answer_the_next_request() {
    // The first answer on every connection carries a forged second response behind it.
    let service = KeepAlive::new(|c, n| {
        let mut a = KeepAlive::ok(&format!("c{c} r{n}"));
        if n == 0 {
            a.extend_from_slice(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged");
        }
        Some(a)
    });
    let dst = service.listen().await;
    let h = Harness::start().await;
    for c in 0..6 {
        let got = get_from(&h, dst).await;
        assert!(!got.body().contains("forged"), "a forged answer: {got:?}");
        assert_eq!((got.status(), got.body()), (200, format!("c{c} r0")), "{got:?}");
    }
    assert_eq!(service.accepted(), 6, "a connection with bytes left over is closed");
}

#[tokio::test]
async fn a_service_that_closes_or_fails_costs_a_connection_and_no_wrong_answer() {
    // Each connection: a good answer, then, to the next request on it, no answer (it closes,
    // as a service whose keep-alive ran out as the request crossed it) or garbage.
    for fail in [None, Some(b"NOT HTTP AT ALL\r\n\r\n".to_vec())] {
        let service = KeepAlive::new(move |c, n| match n {
            0 => Some(KeepAlive::ok(&format!("c{c} r{n}"))),
            _ => fail.clone(),
        });
        let dst = service.listen().await;
        let h = Harness::start().await;
        for c in 0..3 {
            let got = get_from(&h, dst).await;
            assert_eq!((got.status(), got.body()), (200, format!("c{c} r0")), "{got:?}");
            // Never a wrong answer, never sent twice: the proxy's own 502.
            let got = get_from(&h, dst).await;
            assert_eq!(got.status(), 502, "{got:?}");
        }
        assert_eq!(service.accepted(), 3, "a fresh connection after each failure");
        assert_eq!(h.metrics.requests_of("failed", "upstream"), 3);
    }
}
