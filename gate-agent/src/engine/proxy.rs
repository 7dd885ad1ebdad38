//! The metadata proxy in the running agent: its cgroup, what the kernel programs are told
//! about it ([`side`]; the engine puts its programs in while the policy sends connects to
//! it), its listeners, and the table it judges by, kept in step with the policy in force
//! (`crate::proxy` serves; `loader` holds the kernel's side).
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use gate_common::abi::{ENTRY_SERVED, PROXY_V4, PROXY_V6, ProxyConfig, ProxyRecord};
use tokio::sync::{mpsc::UnboundedSender, watch};

use crate::{
    access::Identity,
    cgroup::{self, GatedRoot},
    config::ProxyListen,
    events::{Block, Blocked, CgroupNames},
    loader::{Gate, ProxySide, RecordReader},
    metrics::AgentMetrics,
    policy::Policy,
    proxy::{self, Caller, Callers, Limits, PathLog, ProxyError, Table},
};

/// The running proxy: dropping it stops it (the kernel keeps redirecting; connections are
/// refused until an agent listens again).
pub(crate) struct ProxyHandle {
    tables: watch::Sender<Option<Arc<Table>>>,
    /// When the policy of the current table began to be applied (CLOCK_MONOTONIC ns).
    since: Arc<AtomicU64>,
    reader: Arc<RecordReader>,
    task: tokio::task::JoinHandle<()>,
    sweeper: tokio::task::JoinHandle<()>,
    /// The paths asked for, and the state dir they are kept in for `report`.
    paths: Arc<PathLog>,
    state_dir: Option<PathBuf>,
    keeper: Option<tokio::task::JoinHandle<()>>,
}

impl ProxyHandle {
    /// Judge by `policy` from now on: call it once the policy is in force; `since_ns`:
    /// when its apply began. A generation that cannot be read leaves the proxy without a
    /// table, refusing everything.
    pub(crate) fn follow(&self, policy: &Policy, since_ns: u64) {
        let table = self.reader.live_slot().ok().map(|g| Arc::new(Table::new(policy, g)));
        self.since.store(since_ns, Ordering::Release);
        self.tables.send_replace(table);
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        self.task.abort();
        self.sweeper.abort();
        if let Some(k) = &self.keeper {
            k.abort();
        }
        if let Some(dir) = &self.state_dir {
            keep_paths(&self.paths, dir);
        }
    }
}

/// Whether `dir`'s `cgroup.procs` lists this process.
fn holds_me(dir: &std::path::Path) -> bool {
    let me = std::process::id().to_string();
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .is_ok_and(|procs| procs.lines().any(|p| p.trim() == me))
}

/// The cgroup this process runs in, which must not be the hierarchy's root: the proxy's
/// sock_ops program goes there. `/proc/self/cgroup` names it, unless the agent runs in a
/// cgroup namespace of its own (a container), where it says `/`: then it is found under
/// the gated root by its `cgroup.procs` (the DaemonSet shares the node's pid namespace).
fn own_cgroup(root: &GatedRoot) -> Result<GatedRoot> {
    let text = std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .context("/proc/self/cgroup has no cgroup v2 line")?;
    let named = cgroup::cgroup2_mount()?.join(rel.trim_start_matches('/'));
    let dir = if rel != "/" && holds_me(&named) {
        named
    } else {
        root.walk().into_iter().map(|(p, _)| root.path.join(p)).find(|p| holds_me(p)).with_context(
            || {
                format!(
                    "the metadata proxy needs a cgroup of its own: the agent (pid {}) is in {rel}, \
                     and in no cgroup under {}",
                    std::process::id(),
                    root.path.display()
                )
            },
        )?
    };
    GatedRoot::open(&dir).with_context(|| format!("the metadata proxy's cgroup {}", dir.display()))
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

/// The proxy listening at `listen` as the kernel programs are told of it: this agent's cgroup
/// (found under `root` inside a container) and its addresses and port.
pub(crate) fn side(listen: &ProxyListen, root: &GatedRoot) -> Result<ProxySide> {
    let own = own_cgroup(root)?;
    let config = kernel_config(listen, own.id);
    Ok(ProxySide { own, config })
}

/// The proxy's port on each of its addresses. The bind programs of a gate that names another
/// agent's cgroup as the proxy's deny it (`EPERM`) until the kernel is told of this one.
pub(crate) fn bind(listen: &ProxyListen) -> Result<Vec<std::net::TcpListener>, Bind> {
    listen
        .addresses
        .iter()
        .map(|a| {
            let addr = SocketAddr::new(*a, listen.port);
            std::net::TcpListener::bind(addr).map_err(|source| Bind { addr, source })
        })
        .collect()
}

/// The proxy's port could not be bound on `addr`.
#[derive(Debug, thiserror::Error)]
#[error("metadata proxy: binding {addr}: {source}")]
pub(crate) struct Bind {
    addr: SocketAddr,
    source: std::io::Error,
}

impl Bind {
    /// Denied by the bind programs: held for the proxy, whose cgroup the kernel knows as
    /// another's (a predecessor's, until this agent's is written).
    pub(crate) fn held_for_the_proxy(&self) -> bool {
        self.source.raw_os_error() == Some(libc::EPERM)
    }
}

/// Serve on `listeners` (see [`bind`]). `since_ns`: when the apply of `policy` began (see
/// [`ProxyHandle::follow`]); `state_dir`: where the record of paths asked for is kept (see
/// [`PathLog`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn start(
    listen: &ProxyListen,
    listeners: Vec<std::net::TcpListener>,
    side: &ProxySide,
    since_ns: u64,
    state_dir: Option<&std::path::Path>,
    gate: &Arc<Mutex<Gate>>,
    policy: &Policy,
    metrics: &AgentMetrics,
    names: CgroupNames,
    notify: Option<UnboundedSender<Blocked>>,
) -> Result<ProxyHandle> {
    let g = gate.lock().map_err(|_| anyhow::anyhow!("gate lock poisoned"))?;
    let reader = g.record_reader()?;
    let sweeper = tokio::spawn(sweep(g.record_reader()?, metrics.proxy.records_expired.clone()));
    let generation = g.info().policy_generation;
    drop(g);
    let listeners = listeners
        .into_iter()
        .map(|l| {
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    if listeners.is_empty() {
        bail!("metadata proxy: no address");
    }
    let reader = Arc::new(reader);
    let slot = reader.live_slot()?;
    let (tables, rx) = watch::channel(Some(Arc::new(Table::new(policy, slot))));
    let since = Arc::new(AtomicU64::new(since_ns));
    let callers: Arc<dyn Callers> = Arc::new(KernelCallers {
        reader: reader.clone(),
        since: since.clone(),
        names: std::sync::Mutex::new(names),
        notify,
    });
    let paths = Arc::new(state_dir.map_or_else(PathLog::default, PathLog::load));
    let task = tokio::spawn(proxy::serve(
        listeners,
        callers,
        rx,
        metrics.proxy.clone(),
        Limits::default(),
        paths.clone(),
        std::future::pending(),
    ));
    let keeper = state_dir.map(|dir| tokio::spawn(keep(paths.clone(), dir.to_path_buf())));
    tracing::info!(
        addresses = ?listen.addresses,
        port = listen.port,
        cgroup = %side.own.path.display(),
        generation,
        "metadata proxy listening"
    );
    let state_dir = state_dir.map(std::path::Path::to_path_buf);
    Ok(ProxyHandle { tables, since, reader, task, sweeper, paths, state_dir, keeper })
}

/// How often the record of paths is written to the state dir (when it changed).
const KEEP_EVERY: Duration = Duration::from_secs(10);

/// Write the record of paths to `dir` every [`KEEP_EVERY`], where `report` reads it.
async fn keep(paths: Arc<PathLog>, dir: PathBuf) {
    let mut tick = tokio::time::interval(KEEP_EVERY);
    loop {
        tick.tick().await;
        let (paths, dir) = (paths.clone(), dir.clone());
        let _ = tokio::task::spawn_blocking(move || keep_paths(&paths, &dir)).await;
    }
}

fn keep_paths(paths: &PathLog, dir: &std::path::Path) {
    if let Err(e) = paths.save(dir) {
        tracing::warn!(error = %e, dir = %dir.display(), "keeping the metadata proxy's path record");
    }
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
struct KernelCallers {
    reader: Arc<RecordReader>,
    /// See [`ProxyHandle::follow`].
    since: Arc<AtomicU64>,
    /// Who names the callers' cgroups.
    names: std::sync::Mutex<CgroupNames>,
    /// Where refusals go as Kubernetes Events (cluster mode).
    notify: Option<UnboundedSender<Blocked>>,
}

impl Callers for KernelCallers {
    fn caller(&self, stream: &tokio::net::TcpStream) -> Result<Option<Caller>, ProxyError> {
        let record = self.reader.record(stream).map_err(|e| ProxyError::Record(Box::new(e)))?;
        Ok(record.map(|r| caller(r, self.since.load(Ordering::Acquire))))
    }

    fn live_generation(&self) -> Option<u32> {
        self.reader.live_slot().ok()
    }

    fn refused(&self, caller: &Caller, request: &str, why: &str) {
        let Some(tx) = &self.notify else { return };
        // A cgroup gone already names no pod: no Event, as for the kernel's denials.
        let mut names = self.names.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(workload) = names.live_identity(caller.cgroup_id) else { return };
        let _ = tx.send(refusal(caller, workload, request, why));
    }

    fn workload_name(&self, caller: &Caller) -> String {
        // The pod's name in cluster mode, the cgroup's path standalone (a cached walk where
        // file handles are not permitted, as for the denial events).
        let mut names = self.names.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        names.identity(caller.cgroup_id).workload
    }
}

/// A request the proxy refused, for the Kubernetes Event on its pod.
fn refusal(caller: &Caller, workload: Identity, request: &str, why: &str) -> Blocked {
    let how = Block::Refused { dst: caller.dst, request: request.to_owned(), why: why.to_owned() };
    Blocked { workload, how }
}

/// A generation no table has: the proxy answers 503.
const STALE: u32 = u32::MAX;

/// A kernel record as the proxy's caller. The kernel has two generations, used in turn: a
/// record made before the current policy's apply began, under the same one, was decided
/// two policies ago (its entry index may name another entry now), and is stale.
fn caller(r: ProxyRecord, since_ns: u64) -> Caller {
    let ip = if r.v6 != 0 {
        IpAddr::from(r.addr)
    } else {
        IpAddr::from([r.addr[0], r.addr[1], r.addr[2], r.addr[3]])
    };
    Caller {
        cgroup_id: r.cgroup_id,
        // A record without one (never from this ABI's programs) is its own workload.
        workload: if r.workload == 0 { r.cgroup_id } else { r.workload },
        generation: if r.ts_ns < since_ns { STALE } else { r.generation },
        entry: (r.entry != ENTRY_SERVED).then_some(r.entry),
        endpoint: r.endpoint,
        dst: SocketAddr::new(ip, r.port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(v6: bool, entry: u32, ts_ns: u64) -> ProxyRecord {
        let mut addr = [0u8; 16];
        if v6 {
            addr = "fd00:ec2::254".parse::<std::net::Ipv6Addr>().expect("v6").octets();
        } else {
            addr[..4].copy_from_slice(&[169, 254, 169, 254]);
        }
        ProxyRecord {
            cgroup_id: 7,
            addr,
            port: 80,
            v6: u8::from(v6),
            generation: 1,
            entry,
            ts_ns,
            ..ProxyRecord::default()
        }
    }

    #[test]
    fn a_record_is_the_caller_the_kernel_saw() {
        let c = caller(record(false, 3, 100), 50);
        assert_eq!(c.dst, "169.254.169.254:80".parse().expect("addr"));
        assert_eq!((c.cgroup_id, c.generation, c.entry), (7, 1, Some(3)));
        assert_eq!(c.workload, 7, "a record without a workload is its own");
        let c = caller(ProxyRecord { workload: 5, ..record(false, 3, 100) }, 50);
        assert_eq!(c.workload, 5, "the pod the kernel found");
        let c = caller(record(true, ENTRY_SERVED, 100), 50);
        assert_eq!(c.dst, "[fd00:ec2::254]:80".parse().expect("addr"));
        assert_eq!(c.entry, None, "no entry: served");
        // Made before the current policy's apply began: two policies old, never judged.
        assert_eq!(caller(record(false, 3, 49), 50).generation, STALE);
    }

    #[test]
    fn the_kernel_is_told_each_family_once() {
        let listen = ProxyListen {
            addresses: vec!["10.0.0.5".parse().expect("v4"), "fd00::5".parse().expect("v6")],
            port: 9254,
        };
        let cfg = kernel_config(&listen, 42);
        assert_eq!((cfg.addr_v4, cfg.port, cfg.cgroup_id), ([10, 0, 0, 5], 9254, 42));
        assert_eq!(cfg.families, PROXY_V4 | PROXY_V6);
        assert_eq!(cfg.addr_v6[15], 5);
        let v4_only = ProxyListen { addresses: vec!["10.0.0.5".parse().expect("v4")], port: 1 };
        assert_eq!(kernel_config(&v4_only, 1).families, PROXY_V4);
    }
}
