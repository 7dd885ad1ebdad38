//! Allow evaluation: whether a pod allow entry [selects] a pod, which of its cgroups the
//! entries let through ([`allowed_cgroups`]), which the gate [`Scope`] leaves ungated
//! ([`ungated_cgroups`]), and the [`PodIndex`] of the node's pods that turns it all into the
//! desired allow set.
use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    path::{Path, PathBuf},
};

use super::{
    naming::{CgroupDriver, parse_cgroup},
    pod::{ContainerInfo, PodInfo},
};
use crate::policy::{AllowSelector, PodSelector, Policy};

/// The allow-entry index recorded for a cgroup that is on the allow set only because the
/// [`Scope`] does not gate it (`HostNetworkOnly` and a pod-network pod), not by an allow entry:
/// the largest index an ALLOWED value holds.
pub const UNGATED_ENTRY: u32 = gate_common::abi::ALLOW_ENTRY_MASK;

pub use crate::config::Scope;

impl Scope {
    /// The option's spelling (`all-pods` / `host-network-only`).
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::AllPods => "all-pods",
            Scope::HostNetworkOnly => "host-network-only",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a pod allow entry selects the pod: same namespace, labels satisfying
/// `podSelector`, and the service account and host networking as narrowed (if they are).
/// The entry's `containers` narrowing does not decide whether the pod is selected, only which
/// of its cgroups are allowed.
pub fn selects(selector: &PodSelector, pod: &PodInfo) -> bool {
    selector.namespace == pod.namespace
        && selector.matches_labels(&pod.labels)
        && selector.service_account.as_ref().is_none_or(|sa| *sa == pod.service_account)
        && selector.host_network.is_none_or(|h| h == pod.host_network)
}

/// The cgroups of `pod` that the policy's pod allow entries let through, each with the index of
/// the first entry (in `policy.allow`) that allows it, in entry order.
///
/// An entry that [selects] the pod and has no `containers` narrowing allows the
/// pod-level cgroup — so the pod is allowed before any container starts, and everything in it
/// (sandbox, every container and restart of it) is covered, as the kernel also checks a
/// socket's ancestors below the gated root. An entry with `containers` allows the cgroups of
/// the named containers that have an id; a named container not created yet adds nothing, and a
/// restarted container is covered once the pod is updated with its new id.
///
/// Every selecting entry contributes (not just the first), so a narrow entry listed before a
/// broad one for the same pod does not hide the broad one; a cgroup allowed by several entries
/// is listed once, with the first.
pub fn allowed_cgroups(
    policy: &Policy,
    pod: &PodInfo,
    driver: CgroupDriver,
) -> Vec<(PathBuf, u32)> {
    let mut out: Vec<(PathBuf, u32)> = Vec::new();
    let mut add = |path: PathBuf, entry: u32| {
        if !out.iter().any(|(p, _)| *p == path) {
            out.push((path, entry));
        }
    };
    for (i, entry) in policy.allow.iter().enumerate() {
        let AllowSelector::Pods(selector) = &entry.selector else { continue };
        let Ok(index) = u32::try_from(i) else { break };
        if !selects(selector, pod) {
            continue;
        }
        if selector.containers.is_empty() {
            add(pod.pod_cgroup(driver), index);
        } else {
            for c in pod.containers.iter().filter(|c| selector.containers.contains(&c.name)) {
                if let Some(path) = pod.container_cgroup(driver, c) {
                    add(path, index);
                }
            }
        }
    }
    out
}

/// The pod-level cgroup of a pod that the scope leaves ungated: with
/// [`Scope::HostNetworkOnly`], every pod that is not host-network; with [`Scope::AllPods`],
/// none. It goes on the allow set with [`UNGATED_ENTRY`].
pub fn ungated_cgroups(scope: Scope, pod: &PodInfo, driver: CgroupDriver) -> Option<PathBuf> {
    match scope {
        Scope::HostNetworkOnly if !pod.host_network => Some(pod.pod_cgroup(driver)),
        _ => None,
    }
}

// ---- the pod index -------------------------------------------------------------------------

/// The pods of the node, keyed by `metadata.uid`, also found by [cgroup
/// uid](PodInfo::cgroup_uid).
#[derive(Debug, Clone, Default)]
pub struct PodIndex {
    pods: BTreeMap<String, PodInfo>,
    /// cgroup uid → uid.
    by_cgroup_uid: HashMap<String, String>,
}

impl PodIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a pod, or replace the one with its uid (returned).
    pub fn insert(&mut self, pod: PodInfo) -> Option<PodInfo> {
        let previous = self.remove(&pod.uid);
        self.by_cgroup_uid.insert(pod.cgroup_uid.clone(), pod.uid.clone());
        self.pods.insert(pod.uid.clone(), pod);
        previous
    }

    /// Remove a pod by `metadata.uid` (a deleted pod), returning it.
    pub fn remove(&mut self, uid: &str) -> Option<PodInfo> {
        let pod = self.pods.remove(uid)?;
        if self.by_cgroup_uid.get(&pod.cgroup_uid).is_some_and(|u| *u == pod.uid) {
            self.by_cgroup_uid.remove(&pod.cgroup_uid);
        }
        Some(pod)
    }

    /// Replace the whole index (after a re-list).
    pub fn replace_all(&mut self, pods: impl IntoIterator<Item = PodInfo>) {
        self.pods.clear();
        self.by_cgroup_uid.clear();
        for pod in pods {
            self.insert(pod);
        }
    }

    /// The pod with this `metadata.uid`.
    pub fn get(&self, uid: &str) -> Option<&PodInfo> {
        self.pods.get(uid)
    }

    /// The pod whose cgroup is named by this uid.
    pub fn by_cgroup_uid(&self, cgroup_uid: &str) -> Option<&PodInfo> {
        self.pods.get(self.by_cgroup_uid.get(cgroup_uid)?)
    }

    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// The pods in uid order.
    pub fn iter(&self) -> impl Iterator<Item = &PodInfo> {
        self.pods.values()
    }

    /// The indexed pod owning a cgroup path (relative to the kubepods root) and, when the path
    /// is (below) the cgroup of one of its known containers, that container.
    pub fn owner(&self, rel: &Path) -> Option<(&PodInfo, Option<&ContainerInfo>)> {
        let owner = parse_cgroup(rel)?;
        let pod = self.by_cgroup_uid(&owner.pod_uid)?;
        Some((pod, owner.container_id.as_deref().and_then(|id| pod.container_by_id(id))))
    }

    /// `namespace/pod/container` for a container's cgroup (or one below it), `namespace/pod`
    /// for anything else in a pod's cgroup (the pod level, the sandbox, conmon, a container
    /// id the pod no longer reports); `None` when no indexed pod owns the path.
    pub fn owner_name(&self, rel: &Path) -> Option<String> {
        let (pod, container) = self.owner(rel)?;
        Some(match container {
            Some(c) => format!("{}/{}/{}", pod.namespace, pod.name, c.name),
            None => format!("{}/{}", pod.namespace, pod.name),
        })
    }

    /// Every cgroup that should be on the allow set, sorted by path: the [allowed
    /// cgroups](allowed_cgroups) of every pod, and the [ungated](ungated_cgroups) pod-level
    /// cgroups with [`UNGATED_ENTRY`] (unless an allow entry already lists that cgroup).
    pub fn desired_allow_set(
        &self,
        policy: &Policy,
        driver: CgroupDriver,
        scope: Scope,
    ) -> Vec<(PathBuf, u32)> {
        let mut set: BTreeMap<PathBuf, u32> = BTreeMap::new();
        for pod in self.pods.values() {
            for (path, entry) in allowed_cgroups(policy, pod, driver) {
                set.entry(path).or_insert(entry);
            }
            if let Some(path) = ungated_cgroups(scope, pod, driver) {
                set.entry(path).or_insert(UNGATED_ENTRY);
            }
        }
        set.into_iter().collect()
    }
}

#[cfg(test)]
mod tests;
