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
//! Everything here is pure except [`detect_driver`] (and [`PodCgroups::new`], which calls it),
//! which reads one directory.
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
//! The generated names assume the kubelet's default cgroup root, i.e. a kubepods root named
//! `kubepods.slice` or `kubepods`. A kubelet run with `--cgroup-root` (kind:
//! `kubelet.slice/kubelet-kubepods.slice`) prefixes the systemd slice names; [`parse_cgroup`]
//! accepts any prefix, but [`pod_cgroup`] / [`container_cgroup`] do not generate it:
//! [`PodCgroups`] puts the prefix in ([`localize`](PodCgroups::localize)) and takes it out
//! ([`canonical`](PodCgroups::canonical)).
//!
//! # Modules
//!
//! - `pod`: [`PodInfo`] / [`ContainerInfo`] from the API Pod, container ids, [`IdentityError`];
//! - `qos`: the [`QosClass`], computed from the resources when the status has none;
//! - `naming`: the cgroup names above, both ways, and the cgroup driver;
//! - `allow`: which cgroups the allow entries and the gate [`Scope`] let through, and the
//!   [`PodIndex`] of the node's pods.
mod allow;
mod naming;
mod pod;
mod qos;
#[cfg(test)]
mod test_fixtures;

pub use allow::{PodIndex, Scope, UNGATED_ENTRY, allowed_cgroups, selects, ungated_cgroups};
pub use naming::{
    CgroupDriver, CgroupOwner, PodCgroups, Runtime, container_cgroup, detect_driver, parse_cgroup,
    pod_cgroup,
};
pub use pod::{ContainerInfo, IdentityError, MIRROR_ANNOTATION, PodInfo, parse_container_id};
pub use qos::QosClass;
