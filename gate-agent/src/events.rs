//! Denial events: ring buffer → one structured log event per denial.
use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use gate_common::{
    abi::DenyEvent,
    user::{Verdict, read_pod},
};
use tokio::io::unix::AsyncFd;

use crate::{
    cgroup::GatedRoot,
    ratelimit::{Admit, RateLimiter, WorkloadCounts},
};

/// Names a workload from its cgroup path relative to the gated root (cluster mode:
/// `namespace/pod/container`); `None` keeps the path.
pub type Namer = std::sync::Arc<dyn Fn(&std::path::Path) -> Option<String> + Send + Sync>;

/// Turns cgroup ids into workload names: the path relative to the gated root, or what the
/// mode's [`Namer`] makes of it. Paths are cached; names are not, so a pod seen after its
/// first denial is named from then on.
pub struct CgroupNames {
    root: GatedRoot,
    cache: HashMap<u64, PathBuf>,
    namer: Option<Namer>,
}

impl CgroupNames {
    pub fn new(root: GatedRoot) -> Self {
        Self { root, cache: HashMap::new(), namer: None }
    }

    pub fn with_namer(root: GatedRoot, namer: Namer) -> Self {
        Self { root, cache: HashMap::new(), namer: Some(namer) }
    }

    /// The cgroup's path relative to the gated root, if it still exists.
    pub fn path(&mut self, id: u64) -> Option<PathBuf> {
        if let Some(p) = self.cache.get(&id) {
            return Some(p.clone());
        }
        // Gone already (short-lived cgroup) or not under the root: None.
        let p = self.root.path_of(id)?;
        if self.cache.len() > 65_536 {
            self.cache.clear();
        }
        self.cache.insert(id, p.clone());
        Some(p)
    }

    pub fn name(&mut self, id: u64) -> String {
        match self.path(id) {
            Some(p) => {
                self.namer.as_ref().and_then(|n| n(&p)).unwrap_or_else(|| p.display().to_string())
            }
            None => format!("cgroup-id:{id}"),
        }
    }
}

/// A denial that was logged (so within the rate limit), for cluster mode's Kubernetes Events.
#[derive(Clone, Debug)]
pub struct Denied {
    /// cgroup path relative to the gated root, if it still exists.
    pub cgroup: Option<PathBuf>,
    pub workload: String,
    pub event: DenyEvent,
    pub endpoint: String,
}

/// Log one event. `endpoints` maps endpoint index to its policy name.
pub fn log_event(ev: &DenyEvent, cgroup: &str, endpoints: &[String]) {
    let endpoint = endpoints.get(ev.endpoint as usize).map(String::as_str).unwrap_or("?");
    let dst = ev.dst();
    let proto = ev.proto_name();
    let comm = ev.comm();
    let hook = ev.hook_name();
    if ev.verdict() == Verdict::Audited {
        tracing::info!(
            cgroup, %dst, port = ev.port, proto, pid = ev.pid, comm, endpoint, verdict = "audited", hook,
            "would be blocked (audit mode: allowed through)"
        );
    } else {
        tracing::warn!(
            cgroup, %dst, port = ev.port, proto, pid = ev.pid, comm, endpoint, verdict = "denied", hook,
            "blocked"
        );
    }
}

/// Log rate limit: this many events per workload per window, then one summary.
pub const LOG_BURST: u32 = 5;
pub const LOG_WINDOW: Duration = Duration::from_secs(10);
/// Distinct workload labels on the denial metric.
pub const WORKLOAD_LABELS: usize = 256;

/// What the event reader shares with the rest of the agent.
#[derive(Clone)]
pub struct EventSinks {
    /// Endpoint names of the live policy, by index.
    pub endpoints: Arc<RwLock<Vec<String>>>,
    /// Denials per workload, for /metrics.
    pub by_workload: Arc<Mutex<WorkloadCounts>>,
    /// Logged denials are also sent here (cluster mode raises Kubernetes Events).
    pub notify: Option<tokio::sync::mpsc::UnboundedSender<Denied>>,
}

impl EventSinks {
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints: Arc::new(RwLock::new(endpoints)),
            by_workload: Arc::new(Mutex::new(WorkloadCounts::new(WORKLOAD_LABELS))),
            notify: None,
        }
    }
}

/// Read events until the task is dropped: count each by workload, log it unless its
/// workload is over the rate limit, and log a summary of what was suppressed.
pub async fn run(
    ring: RingBuf<MapData>,
    sinks: EventSinks,
    mut names: CgroupNames,
) -> std::io::Result<()> {
    // SAFETY: the ring buffer owns its map fd, which stays open and unchanged for as long as
    // the AsyncFd owns the ring buffer.
    let mut fd = unsafe { AsyncFd::register(ring) }.map_err(std::io::Error::from)?;
    let mut limiter = RateLimiter::new(LOG_BURST, LOG_WINDOW, 4096);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            guard = fd.readable_mut() => {
                let mut guard = guard?;
                let ring = guard.get_inner_mut();
                let now = Instant::now();
                while let Some(item) = ring.next() {
                    let Some(ev) = read_pod::<DenyEvent>(&item) else { continue };
                    let cgroup = names.name(ev.cgroup_id);
                    if let Ok(mut c) = sinks.by_workload.lock() {
                        c.add(&cgroup);
                    }
                    if limiter.admit(&cgroup, now) == Admit::Log
                        && let Ok(eps) = sinks.endpoints.read()
                    {
                        log_event(&ev, &cgroup, &eps);
                        if let Some(tx) = &sinks.notify {
                            let endpoint =
                                eps.get(ev.endpoint as usize).cloned().unwrap_or_else(|| "?".into());
                            let _ = tx.send(Denied {
                                cgroup: names.path(ev.cgroup_id),
                                workload: cgroup.clone(),
                                event: ev,
                                endpoint,
                            });
                        }
                    }
                }
                guard.clear_ready();
            }
            _ = tick.tick() => {
                for (cgroup, suppressed) in limiter.flush(Instant::now()) {
                    tracing::warn!(
                        cgroup, suppressed, window_s = LOG_WINDOW.as_secs(),
                        "blocked more often than logged: suppressed denial events"
                    );
                }
            }
        }
    }
}
