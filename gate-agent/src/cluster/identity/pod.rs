//! A pod as the agent sees it: [`PodInfo`] and its [`ContainerInfo`]s, extracted from the API
//! Pod; the parsing of container ids; [`IdentityError`] for a pod that cannot be mapped to its
//! cgroups.
use std::{collections::BTreeMap, path::PathBuf};

use k8s_openapi::api::core::v1::Pod;

use super::{
    naming::{
        CONTAINER_ID_LEN, CgroupDriver, Runtime, check_uid, container_cgroup, is_container_id,
        pod_cgroup,
    },
    qos::{QosClass, compute_qos},
};

/// Annotation of a mirror pod holding the uid the kubelet gave the static pod.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// A pod that cannot be mapped to its cgroups.
///
/// Displays as `pod {namespace/name}: {field}: {reason}`, e.g.
/// `pod ns/p: status.containerStatuses[1].containerID: unknown runtime "rkt" ...`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// A required field is absent or empty.
    #[error("pod {pod}: {field}: missing")]
    Missing {
        /// `namespace/name` as far as known.
        pod: String,
        /// Path of the field (`metadata.uid`).
        field: String,
    },
    /// A field has a value that cannot be used.
    #[error("pod {pod}: {field}: {reason}")]
    Invalid {
        /// `namespace/name` as far as known.
        pod: String,
        /// Path of the field (`status.containerStatuses[0].containerID`).
        field: String,
        /// What is wrong, quoting the value.
        reason: String,
    },
}

impl IdentityError {
    /// Path of the offending field.
    pub fn field(&self) -> &str {
        match self {
            IdentityError::Missing { field, .. } | IdentityError::Invalid { field, .. } => field,
        }
    }
}

/// One container of a pod (init, regular or ephemeral).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerInfo {
    /// The container's name (unique within the pod across all kinds).
    pub name: String,
    /// Runtime and id of its current instance, once the kubelet reported one
    /// (`status.*ContainerStatuses[].containerID`); `None` before it was created.
    pub id: Option<(Runtime, String)>,
}

/// What the agent needs to know about a pod of its node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    /// `metadata.uid`: the key of the pod in the API (and in [`PodIndex`](super::PodIndex)).
    pub uid: String,
    /// The uid the pod's cgroup is named by: the `kubernetes.io/config.mirror` annotation for a
    /// mirror pod (static pod), `metadata.uid` otherwise.
    pub cgroup_uid: String,
    pub namespace: String,
    pub name: String,
    /// `spec.nodeName` (`None` while unscheduled).
    pub node_name: Option<String>,
    /// `status.qosClass`, or computed from the resources when the status lacks it.
    pub qos: QosClass,
    /// `spec.hostNetwork`.
    pub host_network: bool,
    /// `spec.serviceAccountName` (or the deprecated `spec.serviceAccount`); `default` when
    /// neither is set, as the ServiceAccount admission plugin would.
    pub service_account: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// Init containers, then regular containers, then ephemeral containers (spec order), with
    /// the ids from their statuses; a status naming no container of the spec is appended.
    pub containers: Vec<ContainerInfo>,
    /// What runs the pod: (kind, name) of its controller — a ReplicaSet's pods are named by
    /// their Deployment (the pod-template-hash cut off), a mirror pod is a `StaticPod` named
    /// by itself; `None` for a bare pod.
    pub owner: Option<(String, String)>,
}

impl PodInfo {
    /// Extract the identity of an API pod.
    ///
    /// Fails, naming the field, when `metadata.uid`, `metadata.namespace`, `metadata.name` or
    /// `spec` is missing, when a uid has characters that cannot be part of a cgroup name,
    /// when `status.qosClass` is not a known class (or, absent, a resource quantity cannot be
    /// parsed to compute it), or when a `containerID` is not `<runtime>://<64 hex digits>` with
    /// a known runtime. An empty `containerID` (container not created yet) is no error.
    pub fn from_pod(pod: &Pod) -> Result<PodInfo, IdentityError> {
        let meta = &pod.metadata;
        let who = match (non_empty(&meta.namespace), non_empty(&meta.name)) {
            (Some(ns), Some(name)) => format!("{ns}/{name}"),
            (None, Some(name)) => name.to_owned(),
            _ => {
                non_empty(&meta.uid).map_or_else(|| "(unnamed)".to_owned(), |u| format!("uid {u}"))
            }
        };
        let missing =
            |field: &str| IdentityError::Missing { pod: who.clone(), field: field.into() };
        let invalid = |field: String, reason: String| IdentityError::Invalid {
            pod: who.clone(),
            field,
            reason,
        };

        let uid = non_empty(&meta.uid).ok_or_else(|| missing("metadata.uid"))?;
        check_uid(uid).map_err(|r| invalid("metadata.uid".into(), r))?;
        let namespace = non_empty(&meta.namespace).ok_or_else(|| missing("metadata.namespace"))?;
        let name = non_empty(&meta.name).ok_or_else(|| missing("metadata.name"))?;
        let cgroup_uid = match meta.annotations.as_ref().and_then(|a| a.get(MIRROR_ANNOTATION)) {
            Some(hash) => {
                let field = format!("metadata.annotations[{MIRROR_ANNOTATION:?}]");
                if hash.is_empty() {
                    return Err(missing(&field));
                }
                check_uid(hash).map_err(|r| invalid(field, r))?;
                hash.clone()
            }
            None => uid.to_owned(),
        };
        let spec = pod.spec.as_ref().ok_or_else(|| missing("spec"))?;
        let status = pod.status.as_ref();

        let qos = match status.and_then(|s| non_empty(&s.qos_class)) {
            Some(q) => QosClass::from_api(q).ok_or_else(|| {
                invalid(
                    "status.qosClass".into(),
                    format!(
                        "unknown QoS class {q:?} (expected Guaranteed, Burstable or BestEffort)"
                    ),
                )
            })?,
            None => compute_qos(spec).map_err(|(field, reason)| invalid(field, reason))?,
        };

        let service_account = non_empty(&spec.service_account_name)
            .or_else(|| non_empty(&spec.service_account))
            .unwrap_or("default")
            .to_owned();

        let mut containers: Vec<ContainerInfo> = spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| c.name.clone())
            .chain(spec.containers.iter().map(|c| c.name.clone()))
            .chain(spec.ephemeral_containers.iter().flatten().map(|c| c.name.clone()))
            .map(|name| ContainerInfo { name, id: None })
            .collect();
        if let Some(status) = status {
            let lists = [
                ("status.initContainerStatuses", &status.init_container_statuses),
                ("status.containerStatuses", &status.container_statuses),
                ("status.ephemeralContainerStatuses", &status.ephemeral_container_statuses),
            ];
            for (list, statuses) in lists {
                for (i, st) in statuses.iter().flatten().enumerate() {
                    let id = match st.container_id.as_deref() {
                        None | Some("") => None,
                        Some(s) => Some(
                            parse_container_id(s)
                                .map_err(|r| invalid(format!("{list}[{i}].containerID"), r))?,
                        ),
                    };
                    match containers.iter_mut().find(|c| c.name == st.name) {
                        Some(c) => c.id = id,
                        None => containers.push(ContainerInfo { name: st.name.clone(), id }),
                    }
                }
            }
        }

        Ok(PodInfo {
            uid: uid.to_owned(),
            cgroup_uid,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            node_name: non_empty(&spec.node_name).map(str::to_owned),
            qos,
            host_network: spec.host_network.unwrap_or(false),
            service_account,
            labels: meta.labels.clone().unwrap_or_default(),
            containers,
            owner: owner_of(pod),
        })
    }

    /// The container whose current instance has this id.
    pub fn container_by_id(&self, id: &str) -> Option<&ContainerInfo> {
        self.containers.iter().find(|c| c.id.as_ref().is_some_and(|(_, cid)| cid == id))
    }

    /// The pod-level cgroup (relative to the kubepods root).
    pub fn pod_cgroup(&self, driver: CgroupDriver) -> PathBuf {
        pod_cgroup(driver, self.qos, &self.cgroup_uid)
    }

    /// The cgroup of a container (relative to the kubepods root), if it has an id.
    pub fn container_cgroup(&self, driver: CgroupDriver, c: &ContainerInfo) -> Option<PathBuf> {
        let (runtime, id) = c.id.as_ref()?;
        Some(container_cgroup(driver, self.qos, &self.cgroup_uid, *runtime, id))
    }
}

/// `Some(s)` for a present, non-empty string.
/// The controller that runs `pod` (see [`PodInfo::owner`]).
fn owner_of(pod: &Pod) -> Option<(String, String)> {
    let meta = &pod.metadata;
    if meta.annotations.as_ref().is_some_and(|a| a.contains_key(MIRROR_ANNOTATION)) {
        return Some(("StaticPod".into(), meta.name.clone().unwrap_or_default()));
    }
    let r = meta.owner_references.as_ref()?.iter().find(|r| r.controller == Some(true))?;
    let hash = meta.labels.as_ref().and_then(|l| l.get("pod-template-hash"));
    match (r.kind.as_str(), hash) {
        ("ReplicaSet", Some(h)) => match r.name.strip_suffix(&format!("-{h}")) {
            Some(deployment) => Some(("Deployment".into(), deployment.to_owned())),
            None => Some((r.kind.clone(), r.name.clone())),
        },
        _ => Some((r.kind.clone(), r.name.clone())),
    }
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

/// Parse a `containerID` of a container status: `<runtime>://<64 hex digits>`.
pub fn parse_container_id(s: &str) -> Result<(Runtime, String), String> {
    let Some((scheme, id)) = s.split_once("://") else {
        return Err(format!("{s:?} is not of the form <runtime>://<id>"));
    };
    let runtime = Runtime::from_scheme(scheme).ok_or_else(|| {
        format!("unknown runtime {scheme:?} in {s:?} (expected cri-o, containerd or docker)")
    })?;
    if !is_container_id(id) {
        return Err(format!("{s:?}: the id is not {CONTAINER_ID_LEN} lower-case hex digits"));
    }
    Ok((runtime, id.to_owned()))
}

#[cfg(test)]
mod tests;
