//! Who touches the protected endpoints: the kernel counts every allowed, denied and audited
//! access per cgroup and endpoint (the ACCESS map, with the last time); this module turns that
//! tally into increments for metrics and log summaries ([`Harvest`]), into per-workload
//! records with who the workload is ([`records`]), and into allow entries written from that
//! evidence ([`suggest`]) — the audit → report → suggest → enforce rollout.
//!
//! The agent keeps the identity of each cgroup it saw (namespace, pod, container, owner,
//! service account, labels) in its state dir, so that `gate-agent report` can name
//! workloads long gone from the node; without it, report names cgroups by path.
use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
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
}

impl Counts {
    fn of(s: &AccessStats) -> Counts {
        Counts { allowed: s.allowed, denied: s.denied, audited: s.audited }
    }

    fn add(&mut self, o: Counts) {
        self.allowed += o.allowed;
        self.denied += o.denied;
        self.audited += o.audited;
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
            let delta = if now.allowed >= before.allowed
                && now.denied >= before.denied
                && now.audited >= before.audited
            {
                Counts {
                    allowed: now.allowed - before.allowed,
                    denied: now.denied - before.denied,
                    audited: now.audited - before.audited,
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
        });
        r.counts.add(Counts::of(stats));
        r.last_seen_unix_ms = r.last_seen_unix_ms.max(last);
    }
    by.into_values().filter(|r| !r.counts.is_zero()).collect()
}

/// The records as a table.
pub(crate) fn render_table(records: &[AccessRecord], now_unix_ms: u64) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<48} {:<32} {:<16} {:>8} {:>8} {:>8}  LAST SEEN",
        "WORKLOAD", "OWNER", "ENDPOINT", "ALLOWED", "DENIED", "AUDITED"
    );
    for r in records {
        let owner = match (&r.identity.owner, &r.identity.service_account) {
            (Some(o), Some(sa)) => format!("{o} (sa {sa})"),
            (Some(o), None) => o.clone(),
            (None, Some(sa)) => format!("(sa {sa})"),
            (None, None) => "-".into(),
        };
        let ago = now_unix_ms.saturating_sub(r.last_seen_unix_ms) / 1000;
        let _ = writeln!(
            o,
            "{:<48} {:<32} {:<16} {:>8} {:>8} {:>8}  {ago}s ago",
            r.identity.workload,
            owner,
            r.endpoint,
            r.counts.allowed,
            r.counts.denied,
            r.counts.audited
        );
    }
    if records.is_empty() {
        let _ = writeln!(o, "(no workload has touched a protected endpoint)");
    }
    o
}

/// Labels a controller sets on the pods it makes; never part of an owner's selector.
const GENERATED_LABELS: &[&str] = &[
    "pod-template-hash",
    "controller-revision-hash",
    "pod-template-generation",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
    "batch.kubernetes.io/controller-uid",
    "controller-uid",
    "batch.kubernetes.io/job-name",
    "job-name",
];

/// Allow entries for the workloads that were denied or audited (those already allowed are
/// fine as they are): one per owner — namespace, the owner's pod labels without the ones
/// its controller generates, service account, hostNetwork and the containers that made the
/// accesses — or, for cgroups known by path only, one `cgroup:` entry each. A YAML list
/// to paste under `allow:`, each entry commented with its evidence.
pub(crate) fn suggest(records: &[AccessRecord]) -> String {
    struct Group<'a> {
        first: &'a Identity,
        containers: std::collections::BTreeSet<String>,
        endpoints: std::collections::BTreeSet<String>,
        counts: Counts,
    }
    let mut groups: BTreeMap<String, Group<'_>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.counts.denied + r.counts.audited > 0) {
        let id = &r.identity;
        let key = match (&id.namespace, &id.owner, &id.pod) {
            (Some(ns), Some(owner), _) => format!("{ns}/{owner}"),
            (Some(ns), None, Some(pod)) => format!("{ns}/Pod/{pod}"),
            _ => format!("cgroup:{}", id.cgroup.as_deref().unwrap_or(&id.workload)),
        };
        let g = groups.entry(key).or_insert_with(|| Group {
            first: id,
            containers: Default::default(),
            endpoints: Default::default(),
            counts: Counts::default(),
        });
        g.containers.extend(id.container.clone());
        g.endpoints.insert(r.endpoint.clone());
        g.counts.add(r.counts);
    }
    let mut o = String::new();
    for g in groups.values() {
        let id = g.first;
        let endpoints = g.endpoints.iter().cloned().collect::<Vec<_>>().join(", ");
        let _ = writeln!(
            o,
            "# {} refused {} times, audited {} times ({endpoints})",
            id.owner.as_deref().unwrap_or(&id.workload),
            g.counts.denied,
            g.counts.audited
        );
        let Some(ns) = &id.namespace else {
            let path = id.cgroup.as_deref().unwrap_or(&id.workload);
            let _ = writeln!(o, "- name: {}", entry_name(path));
            let _ = writeln!(o, "  cgroup: {}", yaml_str(path));
            continue;
        };
        let name = id.owner.as_deref().map_or(id.pod.as_deref().unwrap_or("pod"), |o| {
            o.split_once('/').map_or(o, |(_, n)| n)
        });
        let _ = writeln!(o, "- name: {}", entry_name(&format!("{ns}-{name}")));
        let _ = writeln!(o, "  namespace: {}", yaml_str(ns));
        let labels: Vec<_> =
            id.labels.iter().filter(|(k, _)| !GENERATED_LABELS.contains(&k.as_str())).collect();
        if !labels.is_empty() {
            let _ = writeln!(o, "  podSelector:\n    matchLabels:");
            for (k, v) in labels {
                let _ = writeln!(o, "      {}: {}", yaml_str(k), yaml_str(v));
            }
        }
        if let Some(sa) = &id.service_account {
            let _ = writeln!(o, "  serviceAccount: {}", yaml_str(sa));
        }
        match id.host_network {
            Some(true) => {
                let _ = writeln!(o, "  hostNetwork: true");
            }
            _ => {
                let _ = writeln!(
                    o,
                    "  # a pod-network pod: node-level enforcement refuses its forwarded traffic\n  \
                     # whatever this entry says; run it with hostNetwork: true, or gate host-network\n  \
                     # pods only (--gate-scope host-network-only)"
                );
            }
        }
        if !g.containers.is_empty() {
            let list: Vec<String> = g.containers.iter().map(|c| yaml_str(c)).collect();
            let _ = writeln!(o, "  containers: [{}]", list.join(", "));
        }
    }
    if o.is_empty() {
        o.push_str("# no workload was refused or audited: nothing to allow\n");
    }
    o
}

/// An allow entry name from free text: lower case, `[a-z0-9-]`, at most 63 characters.
fn entry_name(s: &str) -> String {
    let mut n: String = s
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .collect();
    n = n.trim_matches('-').to_owned();
    n.truncate(63);
    if n.is_empty() { "workload".into() } else { n }
}

/// A YAML scalar, quoted.
fn yaml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"))
}

#[cfg(test)]
mod tests;
