//! Pod identity in cluster mode: which cgroups belong to which pod, and which of them a policy
//! lets through.
//!
//! The agent watches the pods of its own node (a field selector on `spec.nodeName`), turns each
//! into a [`PodInfo`] with [`PodInfo::from_pod`], keeps them in a [`PodIndex`], and asks it for
//! the [desired allow set](PodIndex::desired_allow_set): cgroup paths relative to the kubepods
//! root (the gated root) with the index of the allow entry that put each there. The caller
//! resolves the paths to cgroup ids; a path whose cgroup does not exist yet (a pod whose sandbox
//! is still being created) is resolved again when it appears.
//!
//! Everything here is pure except [`detect_driver`], which reads one directory.
//!
//! # cgroup naming (cgroup v2)
//!
//! The kubelet names a pod's cgroup `{"kubepods", <qos>, "pod" + uid}` (QoS level omitted for
//! Guaranteed pods; `burstable` and `besteffort` are the lower-cased class names), see
//! `GetPodContainerName` in kubernetes `pkg/kubelet/cm/pod_container_manager_linux.go` and the
//! QoS cgroups in `pkg/kubelet/cm/qos_container_manager_linux.go`. With the cgroupfs driver that
//! name is the path; with the systemd driver `CgroupName.ToSystemd` in
//! `pkg/kubelet/cm/cgroup_manager_linux.go` escapes `-` to `_` in each part, joins the parts with
//! `-` into one slice name and expands it into its parent slices, e.g.
//! `{"kubepods", "burstable", "pod1234-abcd"}` →
//! `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_abcd.slice`.
//!
//! | driver   | QoS        | pod cgroup below the kubepods root                         |
//! |----------|------------|------------------------------------------------------------|
//! | systemd  | Guaranteed | `kubepods-pod<uid_>.slice`                                 |
//! | systemd  | Burstable  | `kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice` |
//! | systemd  | BestEffort | `kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice` |
//! | cgroupfs | Guaranteed | `pod<uid>`                                                 |
//! | cgroupfs | Burstable  | `burstable/pod<uid>`                                       |
//! | cgroupfs | BestEffort | `besteffort/pod<uid>`                                      |
//!
//! (`<uid_>` is the uid with `-` replaced by `_`.) Each container, and the pod's sandbox, gets a
//! cgroup inside the pod's, named by the runtime:
//!
//! | runtime    | systemd driver              | cgroupfs driver | source |
//! |------------|-----------------------------|-----------------|--------|
//! | CRI-O      | `crio-<id>.scope`           | `crio-<id>`     | cri-o `internal/config/cgmgr`: `containerCgroupPath` = `CrioPrefix + "-" + id`; the systemd manager passes `slice:crio:<id>` |
//! | containerd | `cri-containerd-<id>.scope` | `<id>`          | containerd CRI `getCgroupsPath`: `<slice>:cri-containerd:<id>` under systemd, `parent/<id>` otherwise |
//! | docker     | `docker-<id>.scope`         | `<id>`          | moby `newCgroupParent` (`<slice>:docker:`) and runc's systemd naming `<prefix>-<name>.scope` |
//!
//! CRI-O also puts each container's monitor in `crio-conmon-<id>[.scope]` inside the pod's
//! cgroup; that is not the container, so [`parse_cgroup`] names it as the pod. Runtimes may
//! nest further cgroups below a container's (crun's `container` sub-cgroup); they belong to
//! the same container.
//!
//! Static pods: the kubelet gives a static pod its own uid (a hash of the manifest, also in the
//! `kubernetes.io/config.hash` annotation) and names its cgroup by it; the mirror pod in the API
//! has another uid and carries the kubelet's in the `kubernetes.io/config.mirror` annotation
//! (kubernetes `pkg/kubelet/config/common.go`, `pkg/kubelet/pod/mirror_client.go`). So
//! [`PodInfo::cgroup_uid`] is that annotation for a mirror pod and `metadata.uid` otherwise.
//!
//! Limitation: the generated names assume the kubelet's default cgroup root, i.e. a kubepods
//! root named `kubepods.slice` or `kubepods`. A kubelet run with `--cgroup-root` (kind:
//! `kubelet.slice/kubelet-kubepods.slice`) prefixes the systemd slice names; [`parse_cgroup`]
//! accepts any prefix, but [`pod_cgroup`] / [`container_cgroup`] do not generate it.
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Component, Path, PathBuf};

use k8s_openapi::api::core::v1::{Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::policy::{AllowSelector, PodSelector, Policy};

/// Annotation of a mirror pod holding the uid the kubelet gave the static pod.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// The allow-entry index recorded for a cgroup that is on the allow set only because the
/// [`Scope`] does not gate it (`HostNetworkOnly` and a pod-network pod), not by an allow entry.
pub const UNGATED_ENTRY: u32 = u32::MAX;

/// Length of a container id (CRI-O, containerd and docker ids are 64 lower-case hex digits).
const CONTAINER_ID_LEN: usize = 64;

/// The kubelet's cgroup driver (`cgroupDriver` in its configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CgroupDriver {
    /// systemd slices and scopes: `kubepods.slice/...`.
    Systemd,
    /// Plain directories: `kubepods/...`.
    Cgroupfs,
}

impl CgroupDriver {
    /// The kubelet's spelling (`systemd` / `cgroupfs`).
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupDriver::Systemd => "systemd",
            CgroupDriver::Cgroupfs => "cgroupfs",
        }
    }

    /// Name of the kubepods root cgroup with the kubelet's default cgroup root.
    pub fn root_name(self) -> &'static str {
        match self {
            CgroupDriver::Systemd => "kubepods.slice",
            CgroupDriver::Cgroupfs => "kubepods",
        }
    }
}

impl fmt::Display for CgroupDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A container runtime, as named by the scheme of a `containerID` (`<scheme>://<id>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Runtime {
    /// `cri-o://`
    CriO,
    /// `containerd://`
    Containerd,
    /// `docker://` (dockershim, cri-dockerd)
    Docker,
}

impl Runtime {
    /// Every runtime, for iteration.
    pub const ALL: [Runtime; 3] = [Runtime::CriO, Runtime::Containerd, Runtime::Docker];

    /// The `containerID` scheme the kubelet reports for this runtime.
    pub fn scheme(self) -> &'static str {
        match self {
            Runtime::CriO => "cri-o",
            Runtime::Containerd => "containerd",
            Runtime::Docker => "docker",
        }
    }

    /// The runtime of a `containerID` scheme.
    pub fn from_scheme(scheme: &str) -> Option<Runtime> {
        Runtime::ALL.into_iter().find(|r| r.scheme() == scheme)
    }

    /// Prefix of the container's systemd scope (`<prefix>-<id>.scope`).
    fn systemd_prefix(self) -> &'static str {
        match self {
            Runtime::CriO => "crio",
            Runtime::Containerd => "cri-containerd",
            Runtime::Docker => "docker",
        }
    }
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.scheme())
    }
}

/// A pod's quality-of-service class, which decides the level of its cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QosClass {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl QosClass {
    /// Every class, for iteration.
    pub const ALL: [QosClass; 3] =
        [QosClass::Guaranteed, QosClass::Burstable, QosClass::BestEffort];

    /// The spelling of `status.qosClass`.
    pub fn as_str(self) -> &'static str {
        match self {
            QosClass::Guaranteed => "Guaranteed",
            QosClass::Burstable => "Burstable",
            QosClass::BestEffort => "BestEffort",
        }
    }

    /// Parse a `status.qosClass` value.
    pub fn from_api(s: &str) -> Option<QosClass> {
        QosClass::ALL.into_iter().find(|q| q.as_str() == s)
    }

    /// The QoS-level cgroup name part (the class lower-cased), `None` for Guaranteed pods,
    /// which sit directly below the kubepods root.
    fn level(self) -> Option<&'static str> {
        match self {
            QosClass::Guaranteed => None,
            QosClass::Burstable => Some("burstable"),
            QosClass::BestEffort => Some("besteffort"),
        }
    }
}

impl fmt::Display for QosClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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
    /// `metadata.uid`: the key of the pod in the API (and in [`PodIndex`]).
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
fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

/// A uid must be usable as a part of a cgroup name and survive the systemd escaping of `-` to
/// `_` both ways: ASCII letters, digits and `-` only (API uids are RFC 4122 UUIDs, static pod
/// uids hex digests).
fn check_uid(uid: &str) -> Result<(), String> {
    if uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        Ok(())
    } else {
        Err(format!(
            "{uid:?} cannot name a cgroup (only ASCII letters, digits and '-' are expected)"
        ))
    }
}

/// Whether `s` is a container id: 64 lower-case hex digits.
fn is_container_id(s: &str) -> bool {
    s.len() == CONTAINER_ID_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
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

// ---- QoS computation -----------------------------------------------------------------------

/// The QoS class computed from the pod's resources, for a pod whose status has none yet.
///
/// Follows `ComputePodQOS` in kubernetes `pkg/apis/core/helper/qos/qos.go`: pod-level
/// `spec.resources`, when set, decide alone; otherwise each init and regular container is
/// classified (ephemeral containers cannot have resources) and the pod is Burstable unless
/// all containers have the same class. A container (or the pod level) is BestEffort with
/// neither requests nor limits for cpu and memory, Guaranteed when both cpu and memory have
/// equal non-zero requests and limits, and Burstable otherwise.
///
/// The error is (field, reason) for a quantity that cannot be parsed.
fn compute_qos(spec: &PodSpec) -> Result<QosClass, (String, String)> {
    if let Some(r) = &spec.resources {
        return requirements_qos(r, "spec.resources");
    }
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, c)| (format!("spec.initContainers[{i}].resources"), c))
        .chain(
            spec.containers
                .iter()
                .enumerate()
                .map(|(i, c)| (format!("spec.containers[{i}].resources"), c)),
        );
    let mut pod_qos = None;
    for (field, c) in containers {
        let qos = match &c.resources {
            Some(r) => requirements_qos(r, &field)?,
            None => QosClass::BestEffort,
        };
        match pod_qos {
            _ if qos == QosClass::Burstable => return Ok(QosClass::Burstable),
            None => pod_qos = Some(qos),
            Some(p) if p != qos => return Ok(QosClass::Burstable),
            Some(_) => {}
        }
    }
    Ok(pod_qos.unwrap_or(QosClass::BestEffort))
}

/// The class of one set of requirements (`resourceQOS` in the same file).
fn requirements_qos(r: &ResourceRequirements, field: &str) -> Result<QosClass, (String, String)> {
    let (requests, limits) = (r.requests.as_ref(), r.limits.as_ref());
    if requests.is_none_or(|m| m.is_empty()) && limits.is_none_or(|m| m.is_empty()) {
        return Ok(QosClass::BestEffort);
    }
    let mut class = None;
    for resource in ["cpu", "memory"] {
        let req = quantity_of(requests, resource, &format!("{field}.requests.{resource}"))?;
        let lim = quantity_of(limits, resource, &format!("{field}.limits.{resource}"))?;
        if req != lim {
            return Ok(QosClass::Burstable);
        }
        let this = if req == 0 { QosClass::BestEffort } else { QosClass::Guaranteed };
        match class {
            None => class = Some(this),
            Some(c) if c != this => return Ok(QosClass::Burstable),
            Some(_) => {}
        }
    }
    Ok(class.unwrap_or(QosClass::BestEffort))
}

/// A resource's quantity in a list, in nano-units (0 when absent).
fn quantity_of(
    list: Option<&BTreeMap<String, Quantity>>,
    resource: &str,
    field: &str,
) -> Result<i128, (String, String)> {
    match list.and_then(|m| m.get(resource)) {
        None => Ok(0),
        Some(Quantity(q)) => parse_quantity(q)
            .ok_or_else(|| (field.to_owned(), format!("cannot parse quantity {q:?}"))),
    }
}

/// Parse a Kubernetes resource quantity (`<sign><digits>[.<digits>]<suffix>`, suffix one of
/// `n u m "" k M G T P E`, `Ki Mi Gi Ti Pi Ei` or `e<exponent>`/`E<exponent>`) into nano-units,
/// rounding up below one nano as the apimachinery `resource.Quantity` does. `None` for text
/// that is not a quantity or a value too large to represent.
fn parse_quantity(s: &str) -> Option<i128> {
    let (negative, rest) = match s.as_bytes().first()? {
        b'+' => (false, &s[1..]),
        b'-' => (true, &s[1..]),
        _ => (false, s),
    };
    let num_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(num_end);
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if (int_part.is_empty() && frac_part.is_empty()) || frac_part.contains('.') {
        return None;
    }
    let digits = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    let mantissa: i128 = if digits.is_empty() { 0 } else { digits.parse().ok()? };
    let mut exp10 = -i32::try_from(frac_part.len()).ok()?;
    let mut pow1024 = 0u32;
    match suffix {
        "" => {}
        "n" => exp10 -= 9,
        "u" => exp10 -= 6,
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        "Ki" => pow1024 = 1,
        "Mi" => pow1024 = 2,
        "Gi" => pow1024 = 3,
        "Ti" => pow1024 = 4,
        "Pi" => pow1024 = 5,
        "Ei" => pow1024 = 6,
        _ => {
            let exp = suffix.strip_prefix(['e', 'E'])?;
            let unsigned = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            exp10 = exp10.checked_add(exp.parse::<i32>().ok()?)?;
        }
    }
    let mut value = mantissa.checked_mul(1024i128.checked_pow(pow1024)?)?;
    let scale = exp10.checked_add(9)?;
    if scale >= 0 {
        value = value.checked_mul(10i128.checked_pow(scale.unsigned_abs())?)?;
    } else if value != 0 {
        // Below one nano: round up, as apimachinery does.
        value = match 10i128.checked_pow(scale.unsigned_abs()) {
            Some(d) => value / d + i128::from(value % d != 0),
            None => 1,
        };
    }
    Some(if negative { -value } else { value })
}

// ---- cgroup naming -------------------------------------------------------------------------

/// The pod-level cgroup of a pod, relative to the kubepods root (see the module docs for the
/// names and their sources). `uid` is a [`PodInfo::cgroup_uid`].
pub fn pod_cgroup(driver: CgroupDriver, qos: QosClass, uid: &str) -> PathBuf {
    match driver {
        CgroupDriver::Systemd => {
            let escaped = uid.replace('-', "_");
            match qos.level() {
                None => PathBuf::from(format!("kubepods-pod{escaped}.slice")),
                Some(level) => PathBuf::from(format!("kubepods-{level}.slice"))
                    .join(format!("kubepods-{level}-pod{escaped}.slice")),
            }
        }
        CgroupDriver::Cgroupfs => match qos.level() {
            None => PathBuf::from(format!("pod{uid}")),
            Some(level) => Path::new(level).join(format!("pod{uid}")),
        },
    }
}

/// The cgroup of a container (by its runtime id), relative to the kubepods root: inside the
/// [pod's](pod_cgroup), named by the runtime (see the module docs).
pub fn container_cgroup(
    driver: CgroupDriver,
    qos: QosClass,
    uid: &str,
    runtime: Runtime,
    id: &str,
) -> PathBuf {
    let leaf = match (driver, runtime) {
        (CgroupDriver::Systemd, r) => format!("{}-{id}.scope", r.systemd_prefix()),
        (CgroupDriver::Cgroupfs, Runtime::CriO) => format!("crio-{id}"),
        (CgroupDriver::Cgroupfs, Runtime::Containerd | Runtime::Docker) => id.to_owned(),
    };
    pod_cgroup(driver, qos, uid).join(leaf)
}

/// The driver the kubelet uses, judged by the kubepods root: a `*.slice` root is systemd's,
/// a root named `kubepods` cgroupfs'. Any other name is judged by the children: `*.slice`
/// children mean systemd, `pod*`, `burstable` or `besteffort` children cgroupfs. `None` if
/// nothing tells (or the directory cannot be read). The only function here that does I/O.
pub fn detect_driver(kubepods_root: &Path) -> Option<CgroupDriver> {
    match kubepods_root.file_name().and_then(|n| n.to_str()) {
        Some(n) if n.ends_with(".slice") => return Some(CgroupDriver::Systemd),
        Some("kubepods") => return Some(CgroupDriver::Cgroupfs),
        _ => {}
    }
    let mut names: Vec<String> = std::fs::read_dir(kubepods_root)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort_unstable();
    names.iter().find_map(|n| {
        if n.ends_with(".slice") {
            Some(CgroupDriver::Systemd)
        } else if n == "burstable" || n == "besteffort" || n.starts_with("pod") {
            Some(CgroupDriver::Cgroupfs)
        } else {
            None
        }
    })
}

/// Whose a cgroup is: the pod (by [cgroup uid](PodInfo::cgroup_uid)) and, for a container's
/// cgroup or one nested below it, the container's runtime id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupOwner {
    pub pod_uid: String,
    /// `None` for the pod-level cgroup, CRI-O's conmon cgroups and anything else in the pod's
    /// cgroup that is not named like a container. A pod sandbox's cgroup is named like a
    /// container, by the sandbox id, which no container status has.
    pub container_id: Option<String>,
}

/// The inverse of [`pod_cgroup`] / [`container_cgroup`]: the owner of a cgroup path relative to
/// the kubepods root, for naming denials. Either driver's names are recognised, whatever the
/// slice prefix (`kubelet-kubepods-besteffort.slice/...` too); cgroups below a container's are
/// the container's. `None` for the root, the QoS-level cgroups and paths not below a pod.
pub fn parse_cgroup(rel: &Path) -> Option<CgroupOwner> {
    let mut parts = Vec::new();
    for c in rel.components() {
        match c {
            Component::CurDir => {}
            Component::Normal(s) => parts.push(s.to_str()?),
            Component::RootDir | Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    let first = *parts.first()?;
    let systemd = first.ends_with(".slice");
    let pod_part = |s: &str| if systemd { systemd_pod_uid(s) } else { cgroupfs_pod_uid(s) };
    let (pod_uid, rest) = match pod_part(first) {
        Some(uid) => (uid, &parts[1..]),
        None => {
            let second = *parts.get(1)?;
            let is_qos_level = if systemd {
                ["burstable", "besteffort"].iter().any(|l| {
                    first
                        .strip_suffix(".slice")
                        .and_then(|f| f.strip_suffix(l))
                        .is_some_and(|prefix| prefix.is_empty() || prefix.ends_with('-'))
                }) && second.starts_with(first.trim_end_matches(".slice"))
            } else {
                first == "burstable" || first == "besteffort"
            };
            if !is_qos_level {
                return None;
            }
            (pod_part(second)?, &parts[2..])
        }
    };
    let container_id = rest.first().and_then(|leaf| container_leaf_id(leaf, systemd));
    Some(CgroupOwner { pod_uid, container_id })
}

/// The uid of a systemd pod slice `<prefix>-pod<uid_>.slice`, unescaped.
fn systemd_pod_uid(part: &str) -> Option<String> {
    let name = part.strip_suffix(".slice")?;
    let last = name.rsplit('-').next()?;
    let escaped = last.strip_prefix("pod")?;
    if escaped.is_empty() || !escaped.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return None;
    }
    Some(escaped.replace('_', "-"))
}

/// The uid of a cgroupfs pod directory `pod<uid>`.
fn cgroupfs_pod_uid(part: &str) -> Option<String> {
    let uid = part.strip_prefix("pod")?;
    (!uid.is_empty() && check_uid(uid).is_ok()).then(|| uid.to_owned())
}

/// The container id in the name of a container's cgroup, `None` for conmon's and others.
fn container_leaf_id(leaf: &str, systemd: bool) -> Option<String> {
    let name = if systemd { leaf.strip_suffix(".scope")? } else { leaf };
    if name.starts_with("crio-conmon-") {
        return None;
    }
    let id = if systemd {
        Runtime::ALL
            .iter()
            .find_map(|r| name.strip_prefix(r.systemd_prefix())?.strip_prefix('-'))?
    } else {
        name.strip_prefix("crio-").unwrap_or(name)
    };
    is_container_id(id).then(|| id.to_owned())
}

// ---- allow evaluation ----------------------------------------------------------------------

/// Which pods the gate applies to (the agent's scope option).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// Every pod is gated; only allow entries let pods through. The default.
    #[default]
    AllPods,
    /// Only host-network pods are gated: every pod-network pod's pod-level cgroup is put on the
    /// allow set (see [`ungated_cgroups`]), for clusters whose pod network already keeps pods
    /// from the metadata service.
    HostNetworkOnly,
}

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
