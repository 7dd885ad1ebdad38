//! Reading a pinned gate for people: `report` and `suggest` (who touched the protected
//! endpoints, and allow entries written from that evidence) and `explain` (the verdict for
//! one workload and destination, and why). They read bpffs, and the agent's state dir where
//! it names workloads; they work with or without a running agent.
pub(crate) mod explain;
pub(crate) mod report;
pub(crate) mod suggest;

use std::{
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use gate_common::abi::{ENDPOINT_NONE, fixed_str_value};

use crate::{
    access::{self, AccessRecord, Identity, Known},
    cgroup::GatedRoot,
    loader::{Layout, LoaderError, Maps},
};

/// What keeps `report` and `explain` from reading a gate.
#[derive(Debug, thiserror::Error)]
pub(crate) enum InspectError {
    #[error("no gate is pinned under {0}")]
    NotInstalled(PathBuf),
    #[error(transparent)]
    Loader(#[from] LoaderError),
    #[error("{what}: {reason}")]
    Target { what: String, reason: String },
    #[error("the Kubernetes API: {0}")]
    Kube(String),
}

/// The pinned gate's maps, opened.
pub(crate) struct Pinned {
    pub maps: Maps,
    pub generation: u32,
    /// Endpoint names of the live policy, by index.
    pub endpoints: Vec<String>,
    /// The gated root the gate protects (if it still exists).
    pub root: Option<GatedRoot>,
    pub root_path: String,
    /// The platform of the live policy (as `--platform` names it).
    pub platform: String,
    /// Hash of the live policy.
    pub policy_hash: u64,
}

impl Pinned {
    pub(crate) fn open(pin_dir: &Path) -> Result<Pinned, InspectError> {
        let layout = Layout::new(pin_dir);
        if !layout.dir.join("maps").exists() {
            return Err(InspectError::NotInstalled(pin_dir.to_path_buf()));
        }
        let maps = Maps::from_pins(&layout)?;
        let generation = maps.active()?;
        let meta = maps.policy_meta(generation)?;
        let endpoints = maps.endpoint_names(generation, meta.endpoints);
        let info = maps.info()?;
        let root_path = fixed_str_value(&info.root_path).to_owned();
        let platform = fixed_str_value(&info.platform).to_owned();
        let root = GatedRoot::open(Path::new(&root_path)).ok();
        Ok(Pinned {
            maps,
            generation,
            endpoints,
            root,
            root_path,
            platform,
            policy_hash: info.policy_hash,
        })
    }

    fn endpoint(&self, index: u32) -> String {
        if index == ENDPOINT_NONE {
            return "(none)".into();
        }
        self.endpoints.get(index as usize).cloned().unwrap_or_else(|| format!("#{index}"))
    }
}

/// Monotonic and wall clock now: (ns, ms since the Unix epoch).
fn clocks() -> (u64, u64) {
    let mono = crate::status::monotonic_now_ns();
    let unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    (mono, unix)
}

/// What `report` found, and the platform `suggest` judges paths by.
pub(crate) struct Evidence {
    pub records: Vec<AccessRecord>,
    pub platform: String,
}

/// Every workload that touched a protected endpoint, with counts by verdict and the last
/// time, and the paths it asked the metadata proxy for: from the pinned ACCESS tally and the
/// proxy's path record, named by the identities the agent kept in `state_dir` (pods,
/// owners) or else by cgroup path.
pub(crate) fn report(pin_dir: &Path, state_dir: Option<&Path>) -> Result<Evidence, InspectError> {
    let pinned = Pinned::open(pin_dir)?;
    let known = state_dir.and_then(|d| Known::load(d).ok()).unwrap_or_default();
    let paths = state_dir.and_then(|d| crate::proxy::read_paths(d).ok()).unwrap_or_default();
    let entries: Vec<_> = pinned.maps.access.iter().flatten().collect();
    let identify = |id: u64| {
        if let Some(i) = known.0.get(&id) {
            return i.clone();
        }
        match pinned.root.as_ref().and_then(|r| r.path_of(id)) {
            Some(p) => Identity::cgroup(&p.display().to_string()),
            None => Identity { workload: format!("cgroup-id:{id} (gone)"), ..Identity::default() },
        }
    };
    let (mono, unix) = clocks();
    let mut records = access::records(&entries, identify, |i| pinned.endpoint(i), mono, unix);
    access::add_paths(&mut records, &paths, identify);
    Ok(Evidence { records, platform: pinned.platform.clone() })
}

/// Now, in ms since the Unix epoch (for rendering ages).
pub(crate) fn now_unix_ms() -> u64 {
    clocks().1
}
