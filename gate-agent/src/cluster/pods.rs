//! The pods of this node: kube's reflector [`Store`] holds them as the API has them (a relist
//! is buffered there and swapped in whole at its end), and a [`PodIndex`] derived from it
//! answers what the agent asks: which cgroups are allowed, and whose a cgroup is.
use std::{
    os::unix::fs::MetadataExt as _,
    path::Path,
    sync::{Arc, RwLock},
};

use gate_common::{
    abi::{GRANTS_ALL, allow_value},
    user::AllowSet,
};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{
    reflector::store::{Store, Writer},
    watcher::Event,
};

use super::identity::{ContainerInfo, PodCgroups, PodIndex, PodInfo, Scope, UNGATED_ENTRY};
use crate::{access::Identity, engine::AllowSource, events::Namer, policy::Policy};

/// The node's pods: the reflector's store and the index derived from it.
pub(crate) struct Pods {
    writer: Writer<Pod>,
    store: Store<Pod>,
    /// The identities of the pods in the store that the agent can map to cgroups. Kept in
    /// step with the store: rebuilt from it when a (re)list is done, updated per watch event.
    index: Arc<RwLock<PodIndex>>,
    /// Whether the first full list is in.
    listed: bool,
}

/// A pod the agent cannot map to cgroups is left out of the index (and so never allowed).
fn parse(pod: &Pod) -> Option<PodInfo> {
    match PodInfo::from_pod(pod) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(error = %e, "ignoring a pod the agent cannot map to cgroups");
            None
        }
    }
}

impl Pods {
    pub(crate) fn new() -> Self {
        let writer = Writer::default();
        Pods { store: writer.as_reader(), writer, index: Default::default(), listed: false }
    }

    /// Whether the first full list is in.
    pub(crate) fn listed(&self) -> bool {
        self.listed
    }

    /// The derived index, shared with the allow source and the namer.
    pub(crate) fn index(&self) -> Arc<RwLock<PodIndex>> {
        self.index.clone()
    }

    /// Apply a watch event; returns whether the indexed pods changed. During a relist (Init …
    /// InitDone) nothing changes: the store buffers the list and the index keeps the pods of
    /// the last list and watch events until the whole new list is in.
    pub(crate) fn apply(&mut self, ev: &Event<Pod>) -> bool {
        self.writer.apply_watcher_event(ev);
        match ev {
            Event::Init | Event::InitApply(_) => false,
            Event::InitDone => {
                let pods: Vec<PodInfo> =
                    self.store.state().iter().filter_map(|p| parse(p)).collect();
                let n = pods.len();
                if let Ok(mut idx) = self.index.write() {
                    idx.replace_all(pods);
                }
                if !self.listed {
                    tracing::info!(pods = n, "pods on this node listed");
                }
                self.listed = true;
                true
            }
            // A pod that no longer parses keeps what it was last indexed as.
            Event::Apply(pod) => match (parse(pod), self.index.write()) {
                (Some(p), Ok(mut idx)) => {
                    idx.insert(p);
                    true
                }
                _ => false,
            },
            Event::Delete(pod) => match (pod.metadata.uid.as_deref(), self.index.write()) {
                (Some(uid), Ok(mut idx)) => idx.remove(uid).is_some(),
                _ => false,
            },
        }
    }

    /// The engine's allow source over these pods.
    pub(crate) fn allow(&self, cgroups: PodCgroups, scope: Scope) -> PodAllow {
        PodAllow { index: self.index(), cgroups, scope }
    }

    /// Names a cgroup (relative to the gated root) by the pod and container that own it.
    pub(crate) fn namer(&self, cgroups: PodCgroups) -> Namer {
        let idx = self.index();
        Arc::new(move |rel: &Path| {
            let idx = idx.read().ok()?;
            let (pod, container) = idx.owner(&cgroups.canonical(rel))?;
            Some(identity(pod, container))
        })
    }
}

/// Cluster allow set: the cgroups of the indexed pods that the policy selects (and, with
/// `host-network-only`, every pod-network pod), those that exist.
pub(crate) struct PodAllow {
    index: Arc<RwLock<PodIndex>>,
    cgroups: PodCgroups,
    scope: Scope,
}

impl AllowSource for PodAllow {
    fn allow_set(&self, policy: &Policy) -> AllowSet {
        let Ok(index) = self.index.read() else { return AllowSet::new() };
        index
            .desired_allow_set(policy, self.cgroups.driver, self.scope)
            .into_iter()
            .filter_map(|(rel, entry)| {
                let path = self.cgroups.root.join(self.cgroups.localize(rel));
                std::fs::metadata(path).ok().map(|m| (m.ino(), value(policy, entry)))
            })
            .collect()
    }
}

/// The ALLOWED value of an entry index: a pod the scope leaves ungated has every grant.
fn value(policy: &Policy, entry: u32) -> u32 {
    if entry == UNGATED_ENTRY {
        allow_value(UNGATED_ENTRY, GRANTS_ALL)
    } else {
        policy.allow_value(entry as usize)
    }
}

/// Who a pod's cgroup belongs to, for logs, metrics and `report`.
fn identity(pod: &PodInfo, container: Option<&ContainerInfo>) -> Identity {
    Identity {
        workload: match container {
            Some(c) => format!("{}/{}/{}", pod.namespace, pod.name, c.name),
            None => format!("{}/{}", pod.namespace, pod.name),
        },
        cgroup: None,
        namespace: Some(pod.namespace.clone()),
        pod: Some(pod.name.clone()),
        container: container.map(|c| c.name.clone()),
        owner: pod.owner.as_ref().map(|(kind, name)| format!("{kind}/{name}")),
        service_account: Some(pod.service_account.clone()),
        host_network: Some(pod.host_network),
        labels: pod.labels.clone(),
        pod_uid: Some(pod.uid.clone()),
    }
}

#[cfg(test)]
mod tests;

/// Pods and a kubepods tree for the cluster tests.
#[cfg(test)]
pub(crate) mod fixtures {
    use std::path::PathBuf;

    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    use crate::cluster::identity::PodCgroups;

    /// A BestEffort pod of this node (cgroup `besteffort/pod<uid>` under the cgroupfs driver).
    pub(crate) fn pod(uid: &str, ns: &str, name: &str, host_network: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"uid": uid, "namespace": ns, "name": name, "labels": {"app": name}},
            "spec": {"nodeName": "node-1", "hostNetwork": host_network, "containers": [{"name": "c"}]},
        }))
        .expect("valid Pod JSON")
    }

    /// A pod the agent cannot map to cgroups (its uid cannot name one).
    pub(crate) fn unmappable(ns: &str, name: &str) -> Pod {
        pod("a_b", ns, name, false)
    }

    /// A kubepods tree (cgroupfs names) in a temporary directory; the pods' cgroups are
    /// directories whose inode numbers stand for cgroup ids.
    pub(crate) struct Tree {
        _dir: tempfile::TempDir,
        pub(crate) root: PathBuf,
    }

    impl Tree {
        pub(crate) fn new() -> Tree {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let root = dir.path().join("kubepods");
            std::fs::create_dir_all(root.join("besteffort")).expect("mkdir");
            Tree { _dir: dir, root }
        }

        pub(crate) fn cgroups(&self) -> PodCgroups {
            PodCgroups::new(&self.root)
        }

        /// Create the pod-level cgroup of `uid`; its id.
        pub(crate) fn add(&self, uid: &str) -> u64 {
            use std::os::unix::fs::MetadataExt as _;
            let path = self.root.join(format!("besteffort/pod{uid}"));
            std::fs::create_dir_all(&path).expect("mkdir");
            std::fs::metadata(&path).expect("stat").ino()
        }
    }
}
