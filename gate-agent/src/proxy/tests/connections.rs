//! Connections: who may open one, how many, for how long, under which policy; and what the
//! proxy answers when the metadata service fails.
use std::time::Instant;

use super::*;
use crate::proxy::{ConnRefusal, fake::Recorder};

const INSTANCE_ID: &str = "GET /latest/meta-data/instance-id HTTP/1.1\r\n\r\n";

/// Polls `cond` for up to 5 s.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(5), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn no_record_closes_without_a_byte() {
    let h = Harness::start().await;
    let answer = h.send(None, INSTANCE_ID.as_bytes()).await;
    assert!(answer.raw.is_empty(), "{answer:?}");
    assert!(h.seen().is_empty());
    assert_eq!(h.metrics.refused_of(ConnRefusal::NoRecord), 1);
}

#[tokio::test]
async fn a_generation_mismatch_is_503() {
    let h = Harness::start().await;
    // The connection was decided under another generation: its entry index may mean another
    // entry.
    let mut old = h.caller(7, CSI);
    old.generation = GENERATION + 1;
    let answer = h.send(Some(old), INSTANCE_ID.as_bytes()).await;
    assert_eq!(answer.status(), 503, "{answer:?}");
    assert!(answer.body().contains("policy changing"), "{}", answer.body());
    assert_eq!(answer.header("retry-after").as_deref(), Some("1"));
    // The kernel has moved on (or cannot be read) while the proxy's table has not.
    for live in [Some(GENERATION + 1), None] {
        h.kernel.set_live(live);
        assert_eq!(h.send(Some(h.caller(7, CSI)), INSTANCE_ID.as_bytes()).await.status(), 503);
    }
    h.kernel.set_live(Some(GENERATION));
    // No table at all.
    h.tables.send_replace(None);
    let answer = h.send(Some(h.caller(7, CSI)), INSTANCE_ID.as_bytes()).await;
    assert_eq!(answer.status(), 503);
    assert!(answer.body().contains("no policy loaded"), "{}", answer.body());
    assert!(h.seen().is_empty());
    // Counted as the requests they are, not as connections refused.
    assert_eq!(h.metrics.requests_of("unavailable", "generation"), 3);
    assert_eq!(h.metrics.requests_of("unavailable", "no_table"), 1);
    // A new table under the kernel's generation serves again.
    let policy = Policy::parse("test.yaml", POLICY).expect("policy");
    h.tables.send_replace(Some(Arc::new(Table::new(&policy, GENERATION))));
    assert_eq!(h.send(Some(h.caller(7, CSI)), INSTANCE_ID.as_bytes()).await.status(), 200);
}

#[tokio::test]
async fn a_slow_client_is_cut_off() {
    let h = Harness::start().await;
    let mut stream = h.connect(Some(h.caller(7, CSI))).await;
    let start = Instant::now();
    stream.write_all(b"GET /latest/meta-data/inst").await.expect("write");
    let answer = read_all(&mut stream).await;
    let took = start.elapsed();
    assert!(answer.raw.is_empty(), "{answer:?}");
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "{took:?}");
    assert!(h.seen().is_empty());
    eventually("the timeout counted", || h.metrics.refused_of(ConnRefusal::Timeout) == 1).await;
}

/// A client that trickles a byte at a time still cannot hold the header read open.
#[tokio::test]
async fn a_trickling_client_is_cut_off_too() {
    let h = Harness::start().await;
    let mut stream = h.connect(Some(h.caller(7, CSI))).await;
    let start = Instant::now();
    for b in b"GET /latest/meta-data/instance-id HTTP/1.1\r\nX: ".iter().cycle() {
        if stream.write_all(&[*b]).await.is_err() || start.elapsed() > Duration::from_secs(3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(start.elapsed() < Duration::from_secs(3), "still open after 3 s");
    assert!(h.seen().is_empty());
}

#[tokio::test]
async fn each_workload_has_its_own_bound() {
    let limits = Limits { per_workload: 2, ..test_limits() };
    let h = Harness::with(
        Limits { header_read: Duration::from_secs(5), ..limits },
        Recorder::default(),
    )
    .await;
    // Two connections of workload 1 held open, half a request each.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = h.connect(Some(h.caller(1, CSI))).await;
        s.write_all(b"GET /latest").await.expect("write");
        held.push(s);
    }
    eventually("two slots taken", || h.proxy.slots().open(1).0 == 2).await;
    // Its third is closed at once, without a byte, and counted.
    let start = Instant::now();
    let third = h.send(Some(h.caller(1, CSI)), INSTANCE_ID.as_bytes()).await;
    assert!(third.raw.is_empty(), "{third:?}");
    assert!(start.elapsed() < Duration::from_secs(1));
    assert_eq!(h.metrics.refused_of(ConnRefusal::Busy), 1);
    // Another workload is served meanwhile.
    assert_eq!(h.send(Some(h.caller(2, CSI)), INSTANCE_ID.as_bytes()).await.status(), 200);
    // Once workload 1 lets go, it is served again.
    drop(held);
    eventually("the slots given back", || h.proxy.slots().open(1).0 == 0).await;
    assert_eq!(h.send(Some(h.caller(1, CSI)), INSTANCE_ID.as_bytes()).await.status(), 200);
    assert_eq!(h.seen().len(), 2);
}

#[tokio::test]
async fn a_pods_containers_share_its_bound() {
    let limits = Limits { per_workload: 2, header_read: Duration::from_secs(5), ..test_limits() };
    let h = Harness::with(limits, Recorder::default()).await;
    // Two containers (cgroups 11 and 12) of one pod (workload 10), one connection each.
    let in_pod = |cgroup| Caller { workload: 10, ..h.caller(cgroup, CSI) };
    let mut held = Vec::new();
    for cgroup in [11, 12] {
        let mut s = h.connect(Some(in_pod(cgroup))).await;
        s.write_all(b"GET /latest").await.expect("write");
        held.push(s);
    }
    eventually("the pod's two slots taken", || h.proxy.slots().open(10).0 == 2).await;
    // A third container of the pod gets none: the bound is the pod's, not each container's.
    assert!(h.send(Some(in_pod(13)), INSTANCE_ID.as_bytes()).await.raw.is_empty());
    assert_eq!(h.metrics.refused_of(ConnRefusal::Busy), 1);
    // Another pod is served meanwhile.
    assert_eq!(h.send(Some(h.caller(20, CSI)), INSTANCE_ID.as_bytes()).await.status(), 200);
}

#[tokio::test]
async fn served_pods_leave_the_reserve_to_allow_entries() {
    let limits = Limits {
        per_workload: 4,
        total: 3,
        reserve: 1,
        header_read: Duration::from_secs(5),
        ..test_limits()
    };
    let h = Harness::with(limits, Recorder::default()).await;
    // Two served pods (no allow entry) hold what is not the reserve.
    let mut held = Vec::new();
    for cgroup in [1, 2] {
        let mut s = h.connect(Some(h.caller(cgroup, None))).await;
        s.write_all(b"GET /latest").await.expect("write");
        held.push(s);
    }
    eventually("two slots taken", || h.proxy.slots().open(1).1 == 2).await;
    // A third served pod is turned away, and counted as such.
    assert!(h.send(Some(h.caller(3, None)), INSTANCE_ID.as_bytes()).await.raw.is_empty());
    assert_eq!(h.metrics.refused_of(ConnRefusal::BusyServed), 1);
    // The allow-listed component is still served, from the reserve.
    assert_eq!(h.send(Some(h.caller(4, CSI)), INSTANCE_ID.as_bytes()).await.status(), 200);
}

#[tokio::test]
async fn the_node_bound_holds_across_workloads() {
    let limits =
        Limits { per_workload: 4, total: 2, header_read: Duration::from_secs(5), ..test_limits() };
    let h = Harness::with(limits, Recorder::default()).await;
    let mut held = Vec::new();
    for cgroup in [1, 2] {
        let mut s = h.connect(Some(h.caller(cgroup, CSI))).await;
        s.write_all(b"GET /latest").await.expect("write");
        held.push(s);
    }
    eventually("two slots taken", || h.proxy.slots().open(1).1 == 2).await;
    assert!(h.send(Some(h.caller(3, CSI)), INSTANCE_ID.as_bytes()).await.raw.is_empty());
    assert_eq!(h.metrics.refused_of(ConnRefusal::BusyNode), 1);
    assert_eq!(h.kernel.asked(), 3);
}

/// The metadata service fails: 502, and the failure counted.
#[tokio::test]
async fn upstream_failures_are_502() {
    // Nothing listens: refused at once.
    let h = Harness::start().await;
    let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let mut nowhere = h.caller(7, CSI);
    nowhere.dst = closed.local_addr().expect("addr");
    drop(closed);
    let answer = h.send(Some(nowhere), INSTANCE_ID.as_bytes()).await;
    assert_eq!(answer.status(), 502, "{answer:?}");
    assert_eq!(h.metrics.requests_of("failed", "upstream"), 1);

    // Accepts and never answers: the upstream timeout.
    let silent = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let mut slow = h.caller(7, CSI);
    slow.dst = silent.local_addr().expect("addr");
    let start = Instant::now();
    let answer = h.send(Some(slow), INSTANCE_ID.as_bytes()).await;
    assert_eq!(answer.status(), 502, "{answer:?}");
    assert!(start.elapsed() >= Duration::from_millis(700), "{:?}", start.elapsed());
    assert_eq!(h.metrics.requests_of("failed", "timeout"), 1);
    drop(silent);
}

/// A response body over the limit is a 502, whether it says its length or not.
#[tokio::test]
async fn oversized_responses_are_502() {
    let limits = Limits { max_response: 1024, ..test_limits() };
    let big = "x".repeat(2048);
    for answer in [
        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{big}", big.len()),
        format!("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{big}"),
        format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n{big}\r\n0\r\n\r\n"),
    ] {
        let h = Harness::with(limits, Recorder::answering(answer.clone().into_bytes())).await;
        let got = h.send(Some(h.caller(7, CSI)), INSTANCE_ID.as_bytes()).await;
        assert_eq!(got.status(), 502, "{answer:.60}: {got:?}");
        assert!(got.body().contains("longer than 1024 bytes"), "{}", got.body());
        assert_eq!(h.metrics.requests_of("failed", "too_large"), 1);
    }
    // Within the limit, without a length: passed on whole.
    let small = "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nsmall".to_owned();
    let h = Harness::with(limits, Recorder::answering(small.into_bytes())).await;
    let got = h.send(Some(h.caller(7, CSI)), INSTANCE_ID.as_bytes()).await;
    assert_eq!((got.status(), got.body().as_str()), (200, "small"));
}

/// `serve`, the engine's entry point: serves until shutdown, then accepts no more.
#[tokio::test]
async fn serve_stops_at_shutdown() {
    let upstream = Recorder::default();
    let upstream_addr = upstream.listen().await;
    let policy = Policy::parse("test.yaml", POLICY).expect("policy");
    let (_tables, rx) = watch::channel(Some(Arc::new(Table::new(&policy, GENERATION))));
    let kernel = Arc::new(Kernel::default());
    kernel.set_live(Some(GENERATION));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let metrics = ProxyMetrics::default();
    let callers: Arc<dyn Callers> = kernel.clone();
    let task = tokio::spawn(crate::proxy::serve(
        vec![listener],
        callers,
        rx,
        metrics.clone(),
        test_limits(),
        Arc::new(PathLog::default()),
        async move {
            let _ = stopped.await;
        },
    ));
    let socket = TcpSocket::new_v4().expect("socket");
    socket.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
    let port = socket.local_addr().expect("local").port();
    let caller = Caller {
        cgroup_id: 1,
        workload: 1,
        generation: GENERATION,
        entry: CSI,
        endpoint: 0,
        dst: upstream_addr,
    };
    kernel.by_port.lock().expect("lock").insert(port, caller);
    let mut stream = socket.connect(addr).await.expect("connect");
    stream.write_all(INSTANCE_ID.as_bytes()).await.expect("write");
    assert_eq!(read_all(&mut stream).await.status(), 200);
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("serve returned")
        .expect("no panic");
    assert!(TcpStream::connect(addr).await.is_err(), "still listening after shutdown");
    assert_eq!(metrics.requests_of("served", "ok"), 1);
}
