//! The metadata proxy in the running agent: its cgroup, what the kernel programs are told
//! about it, its listeners, and the table it judges by, kept in step with the policy in
//! force (`crate::proxy` serves; `loader` holds the kernel's side).
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use gate_common::abi::{ENTRY_SERVED, PROXY_V4, PROXY_V6, ProxyConfig, ProxyRecord};
use tokio::sync::watch;

use crate::{
    cgroup::{self, GatedRoot},
    config::ProxyListen,
    loader::{Gate, RecordReader},
    metrics::AgentMetrics,
    policy::Policy,
    proxy::{self, Caller, Callers, Limits, ProxyError, Table},
};

/// The running proxy: dropping it stops it (the kernel keeps redirecting; connections are
/// refused until an agent listens again).
pub(crate) struct ProxyHandle {
    tables: watch::Sender<Option<Arc<Table>>>,
    reader: Arc<RecordReader>,
    task: tokio::task::JoinHandle<()>,
    sweeper: tokio::task::JoinHandle<()>,
}

impl ProxyHandle {
    /// Judge by `policy` from now on: call it once the policy is in force. A generation
    /// that cannot be read leaves the proxy without a table, refusing everything.
    pub(crate) fn follow(&self, policy: &Policy) {
        let table = self.reader.live_slot().ok().map(|g| Arc::new(Table::new(policy, g)));
        self.tables.send_replace(table);
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        self.task.abort();
        self.sweeper.abort();
    }
}

/// The cgroup this process runs in (`/proc/self/cgroup`, cgroup v2), which must not be the
/// hierarchy's root: the proxy's sock_ops program goes there.
fn own_cgroup() -> Result<GatedRoot> {
    let text = std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .context("/proc/self/cgroup has no cgroup v2 line")?;
    let dir = PathBuf::from(cgroup::cgroup2_mount()?).join(rel.trim_start_matches('/'));
    GatedRoot::open(&dir).with_context(|| {
        format!("the metadata proxy needs a cgroup of its own; the agent runs in {rel}")
    })
}

/// What the kernel programs are told: where to send connects, and whose the port is.
fn kernel_config(listen: &ProxyListen, cgroup_id: u64) -> ProxyConfig {
    let mut cfg = ProxyConfig { port: listen.port, cgroup_id, ..ProxyConfig::default() };
    for a in &listen.addresses {
        match a {
            IpAddr::V4(v4) => {
                cfg.addr_v4 = v4.octets();
                cfg.families |= PROXY_V4;
            }
            IpAddr::V6(v6) => {
                cfg.addr_v6 = v6.octets();
                cfg.families |= PROXY_V6;
            }
        }
    }
    cfg
}

/// Tell the kernel where the proxy is (or, with `listen` none, that there is none: the
/// connects it would take are refused), then listen and serve.
pub(crate) fn start(
    listen: Option<&ProxyListen>,
    gate: &Arc<Mutex<Gate>>,
    root: &GatedRoot,
    policy: &Policy,
    metrics: &AgentMetrics,
) -> Result<Option<ProxyHandle>> {
    let mut g = gate.lock().map_err(|_| anyhow::anyhow!("gate lock poisoned"))?;
    let Some(listen) = listen else {
        g.set_proxy(ProxyConfig::default())?;
        return Ok(None);
    };
    let own = own_cgroup()?;
    // The port is the agent's before it binds it: the bind programs let only this cgroup
    // take it (a restarted agent has a new one).
    g.attach_proxy(&own, root)?;
    g.set_proxy(kernel_config(listen, own.id))?;
    let reader = g.record_reader()?;
    let sweeper = tokio::spawn(sweep(g.record_reader()?, metrics.proxy.records_expired.clone()));
    let generation = g.info().policy_generation;
    drop(g);
    let mut listeners = Vec::new();
    for a in &listen.addresses {
        let addr = SocketAddr::new(*a, listen.port);
        let l = std::net::TcpListener::bind(addr)
            .with_context(|| format!("metadata proxy: binding {addr}"))?;
        l.set_nonblocking(true)?;
        listeners.push(tokio::net::TcpListener::from_std(l)?);
    }
    if listeners.is_empty() {
        bail!("metadata proxy: no address");
    }
    let reader = Arc::new(reader);
    let slot = reader.live_slot()?;
    let (tables, rx) = watch::channel(Some(Arc::new(Table::new(policy, slot))));
    let callers: Arc<dyn Callers> = Arc::new(KernelCallers(reader.clone()));
    let task = tokio::spawn(proxy::serve(
        listeners,
        callers,
        rx,
        metrics.proxy.clone(),
        Limits::default(),
        std::future::pending(),
    ));
    tracing::info!(
        addresses = ?listen.addresses,
        port = listen.port,
        cgroup = %own.path.display(),
        generation,
        "metadata proxy listening"
    );
    Ok(Some(ProxyHandle { tables, reader, task, sweeper }))
}

/// How long a record may wait for the proxy's side of its handshake (which comes within a
/// round trip of the client's): past it, the client never completed the handshake.
const PENDING_MAX_AGE: Duration = Duration::from_secs(30);

/// Every few seconds, remove the records whose handshake never reached the proxy, so that
/// the table of handshakes in flight does not fill with them.
async fn sweep(mut reader: RecordReader, expired: prometheus_client::metrics::counter::Counter) {
    let mut tick = tokio::time::interval(PENDING_MAX_AGE / 3);
    loop {
        tick.tick().await;
        let now = crate::status::monotonic_now_ns();
        let (removed, left) = reader.sweep(now, PENDING_MAX_AGE.as_nanos() as u64);
        if removed > 0 {
            expired.inc_by(removed as u64);
            tracing::info!(removed, left, "metadata proxy: stale handshake records removed");
        }
    }
}

/// The kernel's records, as the proxy asks for them.
struct KernelCallers(Arc<RecordReader>);

impl Callers for KernelCallers {
    fn caller(&self, stream: &tokio::net::TcpStream) -> Result<Option<Caller>, ProxyError> {
        let record = self.0.record(stream).map_err(|e| ProxyError::Record(Box::new(e)))?;
        Ok(record.map(caller))
    }

    fn live_generation(&self) -> Option<u32> {
        self.0.live_slot().ok()
    }
}

/// A kernel record as the proxy's caller.
fn caller(r: ProxyRecord) -> Caller {
    let ip = if r.v6 != 0 {
        IpAddr::from(r.addr)
    } else {
        IpAddr::from([r.addr[0], r.addr[1], r.addr[2], r.addr[3]])
    };
    Caller {
        cgroup_id: r.cgroup_id,
        generation: r.generation,
        entry: (r.entry != ENTRY_SERVED).then_some(r.entry),
        dst: SocketAddr::new(ip, r.port),
    }
}
