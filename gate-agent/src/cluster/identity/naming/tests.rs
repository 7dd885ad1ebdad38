//! cgroup names both ways for every driver, QoS class and runtime, driver detection on scratch
//! directory trees, and the kubelet `--cgroup-root` slice prefix.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use proptest::prelude::*;

use super::*;
use crate::cluster::identity::test_fixtures::*;

// ---- naming --------------------------------------------------------------------------------

#[test]
fn systemd_names() {
    use CgroupDriver::Systemd;
    assert_eq!(
        pod_cgroup(Systemd, QosClass::Guaranteed, UID),
        PathBuf::from(format!("kubepods-pod{UID_}.slice"))
    );
    assert_eq!(
        pod_cgroup(Systemd, QosClass::Burstable, UID),
        PathBuf::from(format!("kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"))
    );
    assert_eq!(
        pod_cgroup(Systemd, QosClass::BestEffort, UID),
        PathBuf::from(format!("kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"))
    );
    let id = cid('e');
    for (runtime, leaf) in [
        (Runtime::CriO, format!("crio-{id}.scope")),
        (Runtime::Containerd, format!("cri-containerd-{id}.scope")),
        (Runtime::Docker, format!("docker-{id}.scope")),
    ] {
        assert_eq!(
            container_cgroup(Systemd, QosClass::Guaranteed, UID, runtime, &id),
            PathBuf::from(format!("kubepods-pod{UID_}.slice/{leaf}"))
        );
    }
}

#[test]
fn cgroupfs_names() {
    use CgroupDriver::Cgroupfs;
    assert_eq!(pod_cgroup(Cgroupfs, QosClass::Guaranteed, UID), PathBuf::from(format!("pod{UID}")));
    assert_eq!(
        pod_cgroup(Cgroupfs, QosClass::Burstable, UID),
        PathBuf::from(format!("burstable/pod{UID}"))
    );
    assert_eq!(
        pod_cgroup(Cgroupfs, QosClass::BestEffort, UID),
        PathBuf::from(format!("besteffort/pod{UID}"))
    );
    let id = cid('e');
    for (runtime, leaf) in [
        (Runtime::CriO, format!("crio-{id}")),
        (Runtime::Containerd, id.clone()),
        (Runtime::Docker, id.clone()),
    ] {
        assert_eq!(
            container_cgroup(Cgroupfs, QosClass::BestEffort, UID, runtime, &id),
            PathBuf::from(format!("besteffort/pod{UID}/{leaf}"))
        );
    }
}

fn owner(uid: &str, id: Option<String>) -> Option<CgroupOwner> {
    Some(CgroupOwner { pod_uid: uid.to_owned(), container_id: id })
}

#[test]
fn parse_known_layouts() {
    let id = cid('d');
    for (path, want) in [
        (format!("kubepods-pod{UID_}.slice"), owner(UID, None)),
        (format!("./kubepods-pod{UID_}.slice/crio-{id}.scope"), owner(UID, Some(id.clone()))),
        (
            format!(
                "kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{id}.scope/container"
            ),
            owner(UID, Some(id.clone())),
        ),
        (
            format!(
                "kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{id}.scope"
            ),
            owner(UID, Some(id.clone())),
        ),
        (format!("kubepods-pod{UID_}.slice/docker-{id}.scope"), owner(UID, Some(id.clone()))),
        // CRI-O's conmon and other things in the pod's cgroup are the pod's.
        (format!("kubepods-pod{UID_}.slice/crio-conmon-{id}.scope"), owner(UID, None)),
        (format!("kubepods-pod{UID_}.slice/crio-{}.scope", &id[1..]), owner(UID, None)),
        (format!("kubepods-pod{UID_}.slice/rkt-{id}.scope"), owner(UID, None)),
        (format!("kubepods-pod{UID_}.slice/crio-{id}"), owner(UID, None)),
        // kind / --cgroup-root: any slice prefix.
        (
            format!(
                "kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{id}.scope"
            ),
            owner(UID, Some(id.clone())),
        ),
        (format!("kubelet-kubepods-pod{UID_}.slice"), owner(UID, None)),
        // cgroupfs
        (format!("pod{UID}"), owner(UID, None)),
        (format!("pod{UID}/{id}"), owner(UID, Some(id.clone()))),
        (format!("burstable/pod{UID}/crio-{id}"), owner(UID, Some(id.clone()))),
        (format!("besteffort/pod{UID}/{id}/nested/deeper"), owner(UID, Some(id.clone()))),
        (format!("burstable/pod{UID}/crio-conmon-{id}"), owner(UID, None)),
        (format!("burstable/pod{UID}/{id}.scope"), owner(UID, None)),
        // static pod uid (hex digest)
        ("podabcdef0123".into(), owner("abcdef0123", None)),
    ] {
        assert_eq!(parse_cgroup(Path::new(&path)), want, "{path}");
    }
}

#[test]
fn parse_rejects_non_pod_paths() {
    let id = cid('d');
    for path in [
        String::new(),
        ".".into(),
        "kubepods-burstable.slice".into(),
        "kubepods-besteffort.slice/".into(),
        "burstable".into(),
        "besteffort/other".into(),
        "guaranteed/pod1".into(),
        "system.slice/crio.service".into(),
        format!("kubepods-burstable.slice/kubepods-besteffort-pod{UID_}.slice"),
        format!("kubepods-guaranteed.slice/kubepods-guaranteed-pod{UID_}.slice"),
        format!("kubepods-pod.slice/crio-{id}.scope"),
        format!("kubepods-pod{UID}.slice"), // '-' inside the uid: not a systemd pod slice
        "pod".into(),
        format!("pod{UID_}"),
        format!("/kubepods-pod{UID_}.slice"),
        format!("../kubepods-pod{UID_}.slice"),
        format!("burstable/../pod{UID}"),
        id.clone(),
    ] {
        assert_eq!(parse_cgroup(Path::new(&path)), None, "{path:?}");
    }
}

// ---- driver detection ----------------------------------------------------------------------

/// A scratch directory tree, removed on drop.
struct TempTree(PathBuf);

impl TempTree {
    fn new(root: &str, dirs: &[&str]) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let base = std::env::temp_dir().join(format!(
            "gate-agent-identity-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join(root)).unwrap();
        for d in dirs {
            std::fs::create_dir_all(base.join(root).join(d)).unwrap();
        }
        std::fs::write(base.join(root).join("cgroup.procs"), "").unwrap();
        TempTree(base)
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
}

impl Drop for TempTree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn driver_by_root_name() {
    let t = TempTree::new("kubepods.slice", &[]);
    assert_eq!(detect_driver(&t.path("kubepods.slice")), Some(CgroupDriver::Systemd));
    let t = TempTree::new("kubepods", &[]);
    assert_eq!(detect_driver(&t.path("kubepods")), Some(CgroupDriver::Cgroupfs));
    let t = TempTree::new("kubelet.slice/kubelet-kubepods.slice", &[]);
    assert_eq!(
        detect_driver(&t.path("kubelet.slice/kubelet-kubepods.slice")),
        Some(CgroupDriver::Systemd)
    );
    // Names alone decide; the directory need not exist.
    assert_eq!(detect_driver(Path::new("/nonexistent/kubepods")), Some(CgroupDriver::Cgroupfs));
}

#[test]
fn driver_by_children() {
    let t = TempTree::new("pods", &["kubepods-besteffort.slice", "x"]);
    assert_eq!(detect_driver(&t.path("pods")), Some(CgroupDriver::Systemd));
    let t = TempTree::new("pods", &["burstable"]);
    assert_eq!(detect_driver(&t.path("pods")), Some(CgroupDriver::Cgroupfs));
    let t = TempTree::new("pods", &[&format!("pod{UID}")]);
    assert_eq!(detect_driver(&t.path("pods")), Some(CgroupDriver::Cgroupfs));
    let t = TempTree::new("pods", &["x", "y"]);
    assert_eq!(detect_driver(&t.path("pods")), None);
    assert_eq!(detect_driver(Path::new("/nonexistent/pods")), None);
}

// ---- kubelet --cgroup-root ----------------------------------------------------------------

#[test]
fn kubelet_cgroup_root_prefix() {
    let l = PodCgroups {
        root: "/sys/fs/cgroup/kubelet.slice/kubelet-kubepods.slice".into(),
        driver: CgroupDriver::Systemd,
        slice_prefix: Some("kubelet-kubepods".into()),
    };
    let rel =
        PathBuf::from("kubepods-burstable.slice/kubepods-burstable-podab_cd.slice/crio-1.scope");
    let local = l.localize(rel.clone());
    assert_eq!(
        local,
        PathBuf::from(
            "kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-podab_cd.slice/crio-1.scope"
        )
    );
    assert_eq!(l.canonical(&local), rel);
}

// ---- properties ----------------------------------------------------------------------------

proptest! {
    #[test]
    fn pod_cgroups_round_trip(driver in any_driver(), qos in any_qos(), uid in any_uid()) {
        let path = pod_cgroup(driver, qos, &uid);
        prop_assert_eq!(parse_cgroup(&path), owner(&uid, None), "{}", path.display());
    }

    #[test]
    fn container_cgroups_round_trip(
        driver in any_driver(),
        qos in any_qos(),
        uid in any_uid(),
        runtime in any_runtime(),
        id in "[0-9a-f]{64}",
        nested in prop::collection::vec("[a-z0-9][a-z0-9._-]{0,11}", 0..3),
    ) {
        let path = container_cgroup(driver, qos, &uid, runtime, &id);
        prop_assert_eq!(parse_cgroup(&path), owner(&uid, Some(id.clone())), "{}", path.display());
        let deeper = nested.iter().fold(path, |p, n| p.join(n));
        prop_assert_eq!(parse_cgroup(&deeper), owner(&uid, Some(id.clone())), "{}", deeper.display());
    }


    #[test]
    fn parse_never_panics(parts in prop::collection::vec("[a-z0-9_.-]{0,70}", 0..5)) {
        let path: PathBuf = parts.iter().collect();
        let _ = parse_cgroup(&path);
    }

}
