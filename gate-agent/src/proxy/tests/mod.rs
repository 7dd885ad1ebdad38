//! The proxy end to end on loopback: a stand-in metadata service that records what it gets,
//! a stand-in kernel that maps a client's port to its caller, and the proxy between them.
//! Every case asserts what the metadata service saw, or that it saw nothing.
use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket, TcpStream},
    sync::watch,
    task::JoinHandle,
};

use super::{
    Caller, Callers, Limits, PathLog, Proxy, ProxyError, Table, TcpUpstream, fake::Recorder,
};
use crate::{metrics::ProxyMetrics, policy::Policy};

mod answers;
mod connections;
mod pool;
mod props;
mod requests;

/// The policy of these tests: an entry without paths, a narrowed one, one with IMDSv2's token
/// `PUT`, and `served`.
const POLICY: &str = "platform: AWS
endpoints:
  - {name: imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}
allow:
  - {name: plain, cgroup: plain}
  - name: aws-ebs-csi-driver-node
    cgroup: csi
    paths: [/latest/meta-data/instance-id, /latest/meta-data/placement/]
  - name: token
    cgroup: token
    paths: [/latest/api/token, /latest/meta-data/instance-id]
    methods: [GET, PUT]
served:
  paths: [/latest/meta-data/placement/region]
";

pub(super) const PLAIN: Option<u32> = Some(0);
pub(super) const CSI: Option<u32> = Some(1);
pub(super) const TOKEN: Option<u32> = Some(2);
pub(super) const SERVED: Option<u32> = None;
pub(super) const GENERATION: u32 = 1;

/// The kernel's side: callers by the client's port, the generation it decides under, and
/// how many connections it was asked about.
#[derive(Default)]
pub(super) struct Kernel {
    by_port: Mutex<HashMap<u16, Caller>>,
    live: Mutex<Option<u32>>,
    asked: AtomicUsize,
}

impl Callers for Kernel {
    fn caller(&self, stream: &TcpStream) -> Result<Option<Caller>, ProxyError> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        let port = stream.peer_addr().map_err(|e| ProxyError::Record(Box::new(e)))?.port();
        Ok(self.by_port.lock().expect("lock").get(&port).copied())
    }
    fn live_generation(&self) -> Option<u32> {
        *self.live.lock().expect("lock")
    }
}

impl Kernel {
    pub(super) fn set_live(&self, generation: Option<u32>) {
        *self.live.lock().expect("lock") = generation;
    }

    pub(super) fn asked(&self) -> usize {
        self.asked.load(Ordering::SeqCst)
    }
}

pub(super) struct Harness {
    pub(super) addr: SocketAddr,
    pub(super) upstream: Recorder,
    pub(super) upstream_addr: SocketAddr,
    pub(super) kernel: Arc<Kernel>,
    pub(super) tables: watch::Sender<Option<Arc<Table>>>,
    pub(super) metrics: ProxyMetrics,
    pub(super) paths: Arc<PathLog>,
    pub(super) proxy: Arc<Proxy>,
    task: JoinHandle<()>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the proxy answered: status (0 for none) and body.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) raw: Vec<u8>,
}

impl Answer {
    pub(super) fn status(&self) -> u16 {
        let text = String::from_utf8_lossy(&self.raw);
        text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
    }

    pub(super) fn body(&self) -> String {
        let text = String::from_utf8_lossy(&self.raw);
        text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()
    }

    pub(super) fn header(&self, name: &str) -> Option<String> {
        super::fake::headers(&self.raw).into_iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }
}

/// Short limits, so that the timeouts' cases run in a moment.
pub(super) fn test_limits() -> Limits {
    Limits {
        header_read: Duration::from_millis(300),
        connection: Duration::from_secs(5),
        connect: Duration::from_millis(500),
        upstream: Duration::from_millis(800),
        ..Limits::default()
    }
}

impl Harness {
    pub(super) async fn start() -> Harness {
        Harness::with(test_limits(), Recorder::default()).await
    }

    pub(super) async fn with(limits: Limits, upstream: Recorder) -> Harness {
        let upstream_addr = upstream.listen().await;
        let policy = Policy::parse("test.yaml", POLICY).expect("policy");
        let (tables, rx) = watch::channel(Some(Arc::new(Table::new(&policy, GENERATION))));
        let kernel = Arc::new(Kernel::default());
        kernel.set_live(Some(GENERATION));
        let metrics = ProxyMetrics::default();
        let callers: Arc<dyn Callers> = kernel.clone();
        let paths = Arc::new(PathLog::default());
        let proxy = Arc::new(Proxy::new(
            callers,
            rx,
            Arc::new(TcpUpstream),
            limits,
            metrics.clone(),
            paths.clone(),
        ));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().expect("its address");
        let runner = Arc::clone(&proxy);
        let task = tokio::spawn(async move {
            runner.run(vec![listener], std::future::pending()).await;
        });
        Harness { addr, upstream, upstream_addr, kernel, tables, metrics, paths, proxy, task }
    }

    /// The record of a connection of `cgroup_id` through `entry`, to the stand-in.
    pub(super) fn caller(&self, cgroup_id: u64, entry: Option<u32>) -> Caller {
        Caller {
            cgroup_id,
            workload: cgroup_id,
            generation: GENERATION,
            entry,
            endpoint: 0,
            dst: self.upstream_addr,
        }
    }

    /// A connection to the proxy, recorded as `caller`'s before it is opened (`None`: no
    /// record).
    pub(super) async fn connect(&self, caller: Option<Caller>) -> TcpStream {
        let socket = TcpSocket::new_v4().expect("socket");
        socket.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let port = socket.local_addr().expect("local").port();
        if let Some(c) = caller {
            self.kernel.by_port.lock().expect("lock").insert(port, c);
        }
        socket.connect(self.addr).await.expect("connect to the proxy")
    }

    /// Send `raw` as `caller` and read the answer to the end.
    pub(super) async fn send(&self, caller: Option<Caller>, raw: &[u8]) -> Answer {
        let mut stream = self.connect(caller).await;
        // A refused request may be closed before it is all written.
        let _ = stream.write_all(raw).await;
        read_all(&mut stream).await
    }

    /// `GET path` from a workload of `entry`.
    pub(super) async fn get(&self, entry: Option<u32>, path: &str) -> Answer {
        let raw = format!("GET {path} HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n");
        self.send(Some(self.caller(7, entry)), raw.as_bytes()).await
    }

    /// The request lines the stand-in got.
    pub(super) fn seen(&self) -> Vec<String> {
        self.upstream
            .requests()
            .iter()
            .filter_map(|r| super::fake::request_line(r))
            .map(|(m, t)| format!("{m} {t}"))
            .collect()
    }
}

/// Everything until the peer closes (a reset counts as a close), within 5 s.
pub(super) async fn read_all(stream: &mut TcpStream) -> Answer {
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut raw)).await;
    assert!(
        read.is_ok(),
        "the proxy did not close the connection: {:?}",
        String::from_utf8_lossy(&raw)
    );
    Answer { raw }
}
