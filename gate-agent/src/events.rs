//! Denial events: ring buffer → one structured log event per denial (within a per-workload
//! rate limit), and the kernel's access tally → per-workload counters, log summaries and the
//! identities `gate-agent report` names workloads by.
use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use gate_common::{
    abi::{AccessKey, DenyEvent, ENDPOINT_NONE},
    user::{Verdict, read_pod},
};
use tokio::io::unix::AsyncFd;

use crate::{
    access::{Counts, Harvest, Identity, Known},
    cgroup::GatedRoot,
    loader::AccessMap,
    ratelimit::{Admit, RateLimiter, WorkloadCounts},
};

/// Identifies a workload from its cgroup path relative to the gated root (cluster mode: the
/// pod, its container and owner); `None` keeps the path.
pub(crate) type Namer = std::sync::Arc<dyn Fn(&std::path::Path) -> Option<Identity> + Send + Sync>;

/// Turns cgroup ids into workload names: the path relative to the gated root, or what the
/// mode's [`Namer`] makes of it. Paths are cached; names are not, so a pod seen after its
/// first denial is named from then on.
pub(crate) struct CgroupNames {
    root: GatedRoot,
    cache: std::collections::HashMap<u64, PathBuf>,
    namer: Option<Namer>,
    /// When the tree was last walked to index every cgroup (where ids cannot be opened by
    /// handle): at most one walk per [`WALK_EVERY`], however many new ids arrive.
    walked: Option<Instant>,
}

/// The least time between two walks of the cgroup tree for names.
const WALK_EVERY: Duration = Duration::from_millis(200);
/// Paths cached at most.
const NAME_CACHE: usize = 65_536;

impl CgroupNames {
    pub(crate) fn new(root: GatedRoot) -> Self {
        Self { root, cache: Default::default(), namer: None, walked: None }
    }

    pub(crate) fn with_namer(root: GatedRoot, namer: Namer) -> Self {
        Self { root, cache: Default::default(), namer: Some(namer), walked: None }
    }

    /// The cgroup's path relative to the gated root, if it still exists: from the cache, by
    /// file handle, or from a walk that indexes the whole tree at once (at most one per
    /// [`WALK_EVERY`], so a thousand new cgroups cost a walk, not a thousand).
    pub(crate) fn path(&mut self, id: u64) -> Option<PathBuf> {
        if id == 0 {
            return None;
        }
        if let Some(p) = self.cache.get(&id) {
            return Some(p.clone());
        }
        if self.cache.len() > NAME_CACHE {
            self.cache.clear();
        }
        match self.root.path_by_handle(id) {
            // Gone already (a short-lived cgroup) or not under the root.
            Ok(None) => return None,
            Ok(Some(p)) => {
                self.cache.insert(id, p.clone());
                return Some(p);
            }
            Err(_) => {}
        }
        if self.walked.is_none_or(|t| t.elapsed() >= WALK_EVERY) {
            self.walked = Some(Instant::now());
            self.cache.extend(self.root.walk().into_iter().map(|(rel, id)| (id, rel)));
        }
        self.cache.get(&id).cloned()
    }

    /// Who the cgroup belongs to.
    pub(crate) fn identity(&mut self, id: u64) -> Identity {
        match self.path(id) {
            Some(p) => self.identity_at(&p),
            None if id == 0 => Identity { workload: "(no socket)".into(), ..Identity::default() },
            None => Identity { workload: format!("cgroup-id:{id}"), ..Identity::default() },
        }
    }

    /// Who the cgroup at `rel` (relative to the gated root) belongs to.
    fn identity_at(&self, rel: &Path) -> Identity {
        self.namer
            .as_ref()
            .and_then(|n| n(rel))
            .map(|mut i| {
                i.cgroup = Some(rel.display().to_string());
                i
            })
            .unwrap_or_else(|| Identity::cgroup(&rel.display().to_string()))
    }

    /// Who the cgroup belongs to, if it still exists under the gated root: for the metadata
    /// proxy's refusals (a cgroup gone names no pod). Found as [`Self::path`] finds it: by file
    /// handle, or from a walk where the agent may not use handles (the DaemonSet).
    pub(crate) fn live_identity(&mut self, id: u64) -> Option<Identity> {
        let rel = self.path(id)?;
        Some(self.identity_at(&rel))
    }

    /// Another namer of the same tree, with a cache of its own.
    pub(crate) fn again(&self) -> CgroupNames {
        CgroupNames {
            root: self.root.clone(),
            cache: Default::default(),
            namer: self.namer.clone(),
            walked: None,
        }
    }
}

/// A workload stopped, as logged (so within the rate limit), for cluster mode's Kubernetes
/// Events: who (named once, when it was logged: the pod and container; no pod, no Event), and
/// how.
#[derive(Clone, Debug)]
pub(crate) struct Blocked {
    pub workload: Identity,
    pub how: Block,
}

/// How a workload was stopped: by the kernel, or by the metadata proxy.
#[derive(Clone, Debug)]
pub(crate) enum Block {
    /// The kernel denied a connect, a datagram, a frame or a socket option; `endpoint` names
    /// the policy's endpoint (or what stands for none).
    Denied { event: DenyEvent, endpoint: String },
    /// The metadata proxy refused a request to `dst`: its method and path, and why (with the
    /// entry).
    Refused { dst: std::net::SocketAddr, request: String, why: String },
}

/// The name of the endpoint an event names: the policy's, or what stands for none.
pub(crate) fn endpoint_name(ev: &DenyEvent, endpoints: &[String]) -> String {
    if ev.endpoint == ENDPOINT_NONE {
        return if ev.sockopt().is_some() {
            "(side door)"
        } else if matches!(ev.family, 4 | 6) {
            // A readable destination judged as if protected: a source route named others.
            "(source-routed)"
        } else {
            "(unreadable frame)"
        }
        .into();
    }
    endpoints.get(ev.endpoint as usize).cloned().unwrap_or_else(|| "?".into())
}

/// Log one event. `endpoints` maps endpoint index to its policy name.
pub(crate) fn log_event(ev: &DenyEvent, cgroup: &str, endpoints: &[String]) {
    let endpoint = endpoint_name(ev, endpoints);
    let dst = ev.dst_text();
    let proto = ev.proto_name();
    let comm = ev.comm();
    let hook = ev.hook_name();
    let sockopt = ev.sockopt();
    if ev.verdict() == Verdict::Audited {
        tracing::info!(
            cgroup, %dst, port = ev.port, proto, pid = ev.pid, comm, endpoint, sockopt, verdict = "audited", hook,
            "would be denied (audit mode: allowed through)"
        );
    } else {
        tracing::warn!(
            cgroup, %dst, port = ev.port, proto, pid = ev.pid, comm, endpoint, sockopt, verdict = "denied", hook,
            "denied"
        );
    }
}

/// Log rate limit: this many events per workload per window, then one summary.
pub(crate) const LOG_BURST: u32 = 5;
pub(crate) const LOG_WINDOW: Duration = Duration::from_secs(10);
/// Distinct workload labels on the denial metric.
pub(crate) const WORKLOAD_LABELS: usize = 256;

/// What the event reader shares with the rest of the agent.
#[derive(Clone)]
pub(crate) struct EventSinks {
    /// Endpoint names of the live policy, by index.
    pub endpoints: Arc<RwLock<Vec<String>>>,
    /// Denials per workload, for /metrics.
    pub by_workload: Arc<Mutex<WorkloadCounts>>,
    /// Accesses per workload and verdict (`Counts::VERDICTS` order), for /metrics.
    pub accesses: Arc<Mutex<[WorkloadCounts; 4]>>,
    /// Where the identities of the cgroups seen are kept for `report`, if anywhere.
    pub state_dir: Option<PathBuf>,
    /// Logged denials are also sent here (cluster mode raises Kubernetes Events).
    pub notify: Option<tokio::sync::mpsc::UnboundedSender<Blocked>>,
}

impl EventSinks {
    pub(crate) fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints: Arc::new(RwLock::new(endpoints)),
            by_workload: Arc::new(Mutex::new(WorkloadCounts::new(WORKLOAD_LABELS))),
            accesses: Arc::new(Mutex::new(std::array::from_fn(|_| {
                WorkloadCounts::new(WORKLOAD_LABELS)
            }))),
            state_dir: None,
            notify: None,
        }
    }
}

/// Read events until the task is dropped: log each unless its workload is over the log
/// rate limit, and every second harvest the kernel's access tally (ACCESS) into the
/// per-workload counters and the limiter, so that counters miss nothing and the summaries
/// report every denial that was not logged — also those the kernel counted without sending
/// an event (it sends at most EVENT_BURST per cgroup, endpoint and second, so that a
/// hammering workload cannot crowd a quiet one out of the ring buffer).
///
/// The tally is read on a thread of its own: walking a full map takes two syscalls per
/// entry (tens of thousands of entries under abuse), which must never keep the ring buffer
/// from being drained nor the runtime from answering `/readyz`. It sends what changed.
/// Read the kernel's access tally every second on a thread of its own; send the entries that
/// changed (a new entry counts as changed), until the receiver is gone.
fn spawn_harvest(
    tally: AccessMap,
) -> std::io::Result<tokio::sync::mpsc::Receiver<Vec<(AccessKey, Counts)>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    std::thread::Builder::new().name("access-tally".into()).spawn(move || {
        let mut harvest = Harvest::default();
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let changed: Vec<_> = harvest
                .read(&tally)
                .into_iter()
                .filter(|(_, _, delta)| !delta.is_zero())
                .map(|(key, _, delta)| (key, delta))
                .collect();
            if tx.blocking_send(changed).is_err() {
                return;
            }
        }
    })?;
    Ok(rx)
}

pub(crate) async fn run(
    ring: RingBuf<MapData>,
    tally: AccessMap,
    sinks: EventSinks,
    mut names: CgroupNames,
) -> std::io::Result<()> {
    // SAFETY: the ring buffer owns its map fd, which stays open and unchanged for as long as
    // the AsyncFd owns the ring buffer.
    let mut fd = unsafe { AsyncFd::register(ring) }.map_err(std::io::Error::from)?;
    let mut limiter = RateLimiter::new(LOG_BURST, LOG_WINDOW, 4096);
    let mut deltas = spawn_harvest(tally)?;
    let mut known =
        sinks.state_dir.as_deref().and_then(|d| Known::load(d).ok()).unwrap_or_default();
    let mut known_changed = false;
    let mut ticks: u64 = 0;
    loop {
        tokio::select! {
            guard = fd.readable_mut() => {
                let mut guard = guard?;
                let ring = guard.get_inner_mut();
                let now = Instant::now();
                while let Some(item) = ring.next() {
                    let Some(ev) = read_pod::<DenyEvent>(&item) else { continue };
                    let identity = names.identity(ev.cgroup_id);
                    let cgroup = identity.workload.clone();
                    if limiter.admit(&cgroup, now) == Admit::Log
                        && let Ok(eps) = sinks.endpoints.read()
                    {
                        log_event(&ev, &cgroup, &eps);
                        if let Some(tx) = &sinks.notify {
                            let endpoint = endpoint_name(&ev, &eps);
                            let how = Block::Denied { event: ev, endpoint };
                            let _ = tx.send(Blocked { workload: identity, how });
                        }
                    }
                }
                guard.clear_ready();
            }
            changed = deltas.recv() => {
                let Some(changed) = changed else {
                    return Err(std::io::Error::other("the access tally reader stopped"));
                };
                let now = Instant::now();
                ticks += 1;
                for (key, delta) in changed {
                    let identity = names.identity(key.cgroup_id);
                    let workload = identity.workload.clone();
                    if sinks.state_dir.is_some() && identity.cgroup.is_some() {
                        known.learn(key.cgroup_id, identity);
                        known_changed = true;
                    }
                    let denials = delta.denied + delta.audited;
                    if let Ok(mut c) = sinks.accesses.lock() {
                        for (i, n) in delta.by_verdict().into_iter().enumerate() {
                            if n > 0 {
                                c[i].add_n(&workload, n);
                            }
                        }
                    }
                    if denials > 0 {
                        if let Ok(mut c) = sinks.by_workload.lock() {
                            c.add_n(&workload, denials);
                        }
                        limiter.tally(&workload, denials, now);
                    }
                }
                for (cgroup, suppressed) in limiter.flush(now) {
                    tracing::warn!(
                        cgroup, suppressed, window_s = LOG_WINDOW.as_secs(),
                        "denied more often than logged: suppressed denial events"
                    );
                }
                if known_changed && ticks.is_multiple_of(10) && let Some(dir) = &sinks.state_dir {
                    if let Err(e) = known.save(dir) {
                        tracing::warn!(error = %e, "keeping workload identities for `report`");
                    }
                    known_changed = false;
                }
            }
        }
    }
}

#[cfg(test)]
mod names_tests {
    use std::os::unix::fs::MetadataExt as _;

    use super::*;

    /// Where file handles cannot be used (here a plain directory; in the DaemonSet, no
    /// CAP_DAC_READ_SEARCH), a live cgroup is still named, from a walk, and a gone one is not:
    /// the metadata proxy's refusals reach the pod's Event either way.
    #[test]
    fn a_live_cgroup_is_named_without_file_handles() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("kubepods/pod-a/c1")).unwrap();
        let path = dir.path().join("kubepods");
        let root = GatedRoot {
            id: std::fs::metadata(&path).unwrap().ino(),
            mount: dir.path().to_path_buf(),
            path,
            level: 1,
        };
        let c1 = std::fs::metadata(root.path.join("pod-a/c1")).unwrap().ino();
        let mut names = CgroupNames::new(root);
        let named = names.live_identity(c1).expect("a live cgroup");
        assert_eq!(named.workload, "pod-a/c1");
        assert!(names.live_identity(u64::MAX).is_none(), "no such cgroup");
    }
}
