//! cgroup naming both ways: the kubelet's names of pod and container cgroups
//! ([`pod_cgroup`], [`container_cgroup`]) and their owner from a name ([`parse_cgroup`]); the
//! cgroup driver ([`detect_driver`]); and the slice prefix of a kubelet `--cgroup-root`
//! ([`PodCgroups`]). The names and their sources are in the [module docs](super).
use std::{
    fmt,
    path::{Component, Path, PathBuf},
};

use super::qos::QosClass;

/// Length of a container id (CRI-O, containerd and docker ids are 64 lower-case hex digits).
pub(super) const CONTAINER_ID_LEN: usize = 64;

/// A uid must be usable as a part of a cgroup name and survive the systemd escaping of `-` to
/// `_` both ways: ASCII letters, digits and `-` only (API uids are RFC 4122 UUIDs, static pod
/// uids hex digests).
pub(super) fn check_uid(uid: &str) -> Result<(), String> {
    if uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        Ok(())
    } else {
        Err(format!(
            "{uid:?} cannot name a cgroup (only ASCII letters, digits and '-' are expected)"
        ))
    }
}

/// Whether `s` is a container id: 64 lower-case hex digits.
pub(super) fn is_container_id(s: &str) -> bool {
    s.len() == CONTAINER_ID_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

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

/// The pod-level cgroup of a pod, relative to the kubepods root (see the module docs for the
/// names and their sources). `uid` is a [`PodInfo::cgroup_uid`](super::PodInfo::cgroup_uid).
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

/// Whose a cgroup is: the pod (by [cgroup uid](super::PodInfo::cgroup_uid)) and, for a container's
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

/// How pod cgroups are named below one gated (kubepods) root: the kubelet's driver, and the
/// slice prefix of a kubelet `--cgroup-root`. [`pod_cgroup`] and [`container_cgroup`] name the
/// cgroups as under the kubelet's default cgroup root (`kubepods-…`);
/// [`localize`](Self::localize) gives the names below this root.
#[derive(Debug, Clone)]
pub struct PodCgroups {
    /// The gated root: the kubepods cgroup.
    pub root: PathBuf,
    pub driver: CgroupDriver,
    /// systemd slices under a kubelet `--cgroup-root` carry its prefix (`kubelet-kubepods-…`
    /// instead of `kubepods-…`).
    pub slice_prefix: Option<String>,
}

impl PodCgroups {
    /// The naming below `root`: the [detected](detect_driver) driver (systemd if nothing
    /// tells), and the slice prefix of a root named `<prefix>-kubepods.slice`.
    pub fn new(root: &Path) -> PodCgroups {
        let driver = detect_driver(root).unwrap_or(CgroupDriver::Systemd);
        let name = root.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let slice_prefix = name
            .strip_suffix(".slice")
            .filter(|n| *n != "kubepods" && n.ends_with("kubepods"))
            .map(str::to_owned);
        PodCgroups { root: root.to_path_buf(), driver, slice_prefix }
    }

    /// A path relative to the kubepods root as [`pod_cgroup`] / [`container_cgroup`] name it,
    /// with this root's slice prefix.
    pub fn localize(&self, rel: PathBuf) -> PathBuf {
        let Some(prefix) = &self.slice_prefix else { return rel };
        rel.components()
            .map(|c| {
                let s = c.as_os_str().to_string_lossy();
                match s.strip_prefix("kubepods") {
                    Some(rest) => PathBuf::from(format!("{prefix}{rest}")),
                    None => PathBuf::from(s.as_ref()),
                }
            })
            .collect()
    }

    /// Undo [`localize`](Self::localize) for naming.
    pub fn canonical(&self, rel: &Path) -> PathBuf {
        let Some(prefix) = &self.slice_prefix else { return rel.to_path_buf() };
        rel.components()
            .map(|c| {
                let s = c.as_os_str().to_string_lossy();
                match s.strip_prefix(prefix.as_str()) {
                    Some(rest) => PathBuf::from(format!("kubepods{rest}")),
                    None => PathBuf::from(s.as_ref()),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
