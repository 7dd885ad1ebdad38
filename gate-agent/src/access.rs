//! Who touches the protected endpoints: the kernel counts every allowed, denied and audited
//! access per cgroup and endpoint (the ACCESS map, with the last time); this module turns that
//! tally into increments for metrics and log summaries ([`Harvest`]) and into per-workload
//! records with who the workload is ([`records`]), which `report` shows and `suggest` turns
//! into allow entries (`inspect`) — the audit → report → suggest → enforce rollout.
//!
//! The agent keeps the identity of each cgroup it saw (namespace, pod, container, owner,
//! service account, labels) in its state dir, so that `gate-agent report` can name
//! workloads long gone from the node; without it, report names cgroups by path.
use std::{
    collections::{BTreeMap, HashMap},
    io,
    path::Path,
};

use aya::maps::{HashMap as BpfHashMap, MapData};
use gate_common::abi::{AccessKey, AccessStats};
use serde::{Deserialize, Serialize};

/// Who a cgroup belongs to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Identity {
    /// What logs and metrics call it: `namespace/pod/container`, or the cgroup path.
    pub workload: String,
    /// Path relative to the gated root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// `Kind/name` of the pod's controller (`Deployment/x`, `DaemonSet/y`, `StaticPod/z`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// The pod's uid, for the Kubernetes Event on it; not kept for `report` (a pod of the
    /// same name later is another object).
    #[serde(skip)]
    pub pod_uid: Option<String>,
}

impl Identity {
    /// A cgroup known by its path only (standalone, or a pod the agent no longer knows).
    pub(crate) fn cgroup(path: &str) -> Identity {
        Identity { workload: path.to_owned(), cgroup: Some(path.to_owned()), ..Identity::default() }
    }
}

/// Accesses by verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Counts {
    pub allowed: u64,
    pub denied: u64,
    pub audited: u64,
    /// Connects sent to the metadata proxy (its requests are in [`crate::proxy::PathLog`]).
    #[serde(default)]
    pub proxied: u64,
}

impl Counts {
    fn of(s: &AccessStats) -> Counts {
        Counts { allowed: s.allowed, denied: s.denied, audited: s.audited, proxied: s.proxied }
    }

    /// The counts in [`Counts::VERDICTS`] order.
    pub(crate) fn by_verdict(&self) -> [u64; 4] {
        [self.allowed, self.denied, self.audited, self.proxied]
    }

    /// The verdicts of [`Counts::by_verdict`], in its order.
    pub(crate) const VERDICTS: [gate_common::user::Verdict; 4] = [
        gate_common::user::Verdict::Allowed,
        gate_common::user::Verdict::Denied,
        gate_common::user::Verdict::Audited,
        gate_common::user::Verdict::Proxied,
    ];

    pub(crate) fn add(&mut self, o: Counts) {
        self.allowed += o.allowed;
        self.denied += o.denied;
        self.audited += o.audited;
        self.proxied += o.proxied;
    }

    pub(crate) fn is_zero(&self) -> bool {
        *self == Counts::default()
    }
}

/// One workload's accesses to one endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AccessRecord {
    pub identity: Identity,
    pub endpoint: String,
    #[serde(flatten)]
    pub counts: Counts,
    /// Wall clock (ms since the Unix epoch) of the last access.
    pub last_seen_unix_ms: u64,
    /// What it asked the metadata proxy for, by path (`proxied` connects).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<PathUse>,
}

/// Requests of one workload for one method and path through the metadata proxy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PathUse {
    pub method: String,
    pub path: String,
    /// Query parameter names sent with it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub query: Vec<String>,
    #[serde(flatten)]
    pub counts: crate::proxy::PathCounts,
}

/// The kernel's tally as last read, to turn it into increments.
#[derive(Default)]
pub(crate) struct Harvest {
    last: HashMap<AccessKey, Counts>,
}

impl Harvest {
    /// Every entry of the tally with what it gained since the last read (an entry whose
    /// counts went down was evicted and counted afresh). Entries gone from the map are
    /// forgotten.
    pub(crate) fn read(
        &mut self,
        map: &BpfHashMap<MapData, AccessKey, AccessStats>,
    ) -> Vec<(AccessKey, AccessStats, Counts)> {
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (key, stats) in map.iter().flatten() {
            seen.insert(key);
            let now = Counts::of(&stats);
            let before = self.last.insert(key, now).unwrap_or_default();
            let grew = now.by_verdict().into_iter().zip(before.by_verdict()).all(|(n, b)| n >= b);
            let delta = if grew {
                Counts {
                    allowed: now.allowed - before.allowed,
                    denied: now.denied - before.denied,
                    audited: now.audited - before.audited,
                    proxied: now.proxied - before.proxied,
                }
            } else {
                now
            };
            out.push((key, stats, delta));
        }
        self.last.retain(|k, _| seen.contains(k));
        out
    }
}

/// The identities of cgroups, by id, as the agent saw them: kept in the state dir for
/// `report`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Known(pub BTreeMap<u64, Identity>);

/// File of [`Known`] in the state dir.
pub(crate) const KNOWN_FILE: &str = "access.json";
/// Identities kept at most (the oldest ids go first).
const KNOWN_MAX: usize = 65_536;

impl Known {
    pub(crate) fn load(state_dir: &Path) -> io::Result<Known> {
        match std::fs::read(state_dir.join(KNOWN_FILE)) {
            Ok(b) => serde_json::from_slice(&b).map_err(io::Error::other),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Known::default()),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn save(&self, state_dir: &Path) -> io::Result<()> {
        let json = serde_json::to_vec(self).map_err(io::Error::other)?;
        std::fs::create_dir_all(state_dir)?;
        let tmp = state_dir.join(format!("{KNOWN_FILE}.tmp"));
        std::fs::write(&tmp, json)?;
        std::fs::rename(tmp, state_dir.join(KNOWN_FILE))
    }

    /// Remember an identity (a pod's beats a bare path).
    pub(crate) fn learn(&mut self, id: u64, identity: Identity) {
        match self.0.get(&id) {
            Some(old) if old.namespace.is_some() && identity.namespace.is_none() => {}
            _ => {
                if self.0.len() >= KNOWN_MAX
                    && let Some(first) = self.0.keys().next().copied()
                {
                    self.0.remove(&first);
                }
                self.0.insert(id, identity);
            }
        }
    }
}

/// Per-workload records of the tally's entries: `identify` names a cgroup id, `endpoint`
/// an endpoint index; times are turned from the kernel's monotonic clock to wall clock.
pub(crate) fn records(
    entries: &[(AccessKey, AccessStats)],
    mut identify: impl FnMut(u64) -> Identity,
    endpoint: impl Fn(u32) -> String,
    now_mono_ns: u64,
    now_unix_ms: u64,
) -> Vec<AccessRecord> {
    let mut by: BTreeMap<(String, String), AccessRecord> = BTreeMap::new();
    for (key, stats) in entries {
        let identity = identify(key.cgroup_id);
        let ep = endpoint(key.endpoint);
        let age_ms = now_mono_ns.saturating_sub(stats.last_ns) / 1_000_000;
        let last = now_unix_ms.saturating_sub(age_ms);
        let r = by.entry((identity.workload.clone(), ep.clone())).or_insert_with(|| AccessRecord {
            identity,
            endpoint: ep,
            counts: Counts::default(),
            last_seen_unix_ms: 0,
            paths: Vec::new(),
        });
        r.counts.add(Counts::of(stats));
        r.last_seen_unix_ms = r.last_seen_unix_ms.max(last);
    }
    by.into_values().filter(|r| !r.counts.is_zero()).collect()
}

/// Add the metadata proxy's path record to `records`, by workload and endpoint
/// (`identify` names a cgroup id as for [`records`]); a workload the kernel's tally no
/// longer holds gets a record of its own.
pub(crate) fn add_paths(
    records: &mut Vec<AccessRecord>,
    paths: &[crate::proxy::PathRecord],
    mut identify: impl FnMut(u64) -> Identity,
) {
    let mut by: BTreeMap<(String, String, String, String, Vec<String>), PathUse> = BTreeMap::new();
    let mut who: BTreeMap<(String, String), Identity> = BTreeMap::new();
    for p in paths {
        let identity = identify(p.key.cgroup_id);
        let (workload, endpoint) = (identity.workload.clone(), p.key.endpoint.clone());
        who.entry((workload.clone(), endpoint.clone())).or_insert(identity);
        let k = &p.key;
        by.entry((workload, endpoint, k.path.clone(), k.method.clone(), k.query.clone()))
            .or_insert_with(|| PathUse {
                method: k.method.clone(),
                path: k.path.clone(),
                query: k.query.clone(),
                counts: crate::proxy::PathCounts::default(),
            })
            .counts
            .add(&p.counts);
    }
    for ((workload, endpoint, ..), usage) in by {
        let at = match records
            .iter()
            .position(|r| r.identity.workload == workload && r.endpoint == endpoint)
        {
            Some(i) => i,
            None => {
                let identity = who.remove(&(workload, endpoint.clone())).unwrap_or_default();
                records.push(AccessRecord {
                    identity,
                    endpoint,
                    counts: Counts::default(),
                    last_seen_unix_ms: 0,
                    paths: Vec::new(),
                });
                records.len() - 1
            }
        };
        let r = &mut records[at];
        r.last_seen_unix_ms = r.last_seen_unix_ms.max(usage.counts.last_seen_unix_ms);
        r.paths.push(usage);
    }
    records.sort_by(|a, b| {
        (&a.identity.workload, &a.endpoint).cmp(&(&b.identity.workload, &b.endpoint))
    });
}

#[cfg(test)]
mod tests;
