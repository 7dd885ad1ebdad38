use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

const UID: &str = "5f3c2a1e-9b7d-4c2e-8a1f-0123456789ab";
const UID_: &str = "5f3c2a1e_9b7d_4c2e_8a1f_0123456789ab";

/// A container id: 64 hex digits made of `c`.
fn cid(c: char) -> String {
    std::iter::repeat_n(c, 64).collect()
}

/// A pod from API JSON.
fn api_pod(v: Value) -> Pod {
    serde_json::from_value(v).expect("valid Pod JSON")
}

/// A running burstable pod on node-1 with an init container, two containers (one not created
/// yet) and an ephemeral container.
fn full_pod() -> Value {
    json!({
        "metadata": {
            "uid": UID,
            "namespace": "openshift-monitoring",
            "name": "node-exporter-abcde",
            "labels": {"app": "node-exporter", "tier": "infra"},
        },
        "spec": {
            "nodeName": "node-1",
            "hostNetwork": true,
            "serviceAccountName": "node-exporter",
            "initContainers": [{"name": "init-textfile"}],
            "containers": [{"name": "node-exporter"}, {"name": "kube-rbac-proxy"}],
            "ephemeralContainers": [{"name": "debugger"}],
        },
        "status": {
            "qosClass": "Burstable",
            "initContainerStatuses": [{
                "name": "init-textfile", "containerID": format!("cri-o://{}", cid('1')),
                "image": "i", "imageID": "i", "ready": false, "restartCount": 0,
            }],
            "containerStatuses": [
                {"name": "node-exporter", "containerID": format!("cri-o://{}", cid('2')),
                 "image": "i", "imageID": "i", "ready": true, "restartCount": 0},
                {"name": "kube-rbac-proxy", "containerID": "",
                 "image": "i", "imageID": "i", "ready": false, "restartCount": 0},
            ],
            "ephemeralContainerStatuses": [{
                "name": "debugger", "containerID": format!("cri-o://{}", cid('3')),
                "image": "i", "imageID": "i", "ready": false, "restartCount": 0,
            }],
        },
    })
}

fn info(v: Value) -> PodInfo {
    PodInfo::from_pod(&api_pod(v)).expect("pod converts")
}

#[track_caller]
fn info_err(v: Value) -> IdentityError {
    match PodInfo::from_pod(&api_pod(v)) {
        Ok(p) => panic!("expected an error, got {p:?}"),
        Err(e) => e,
    }
}

/// Set `v[path...] = value`, creating objects on the way.
fn set(v: &mut Value, path: &[&str], value: Value) {
    let mut cur = v;
    for key in &path[..path.len() - 1] {
        cur = cur.as_object_mut().unwrap().entry(*key).or_insert_with(|| json!({}));
    }
    cur.as_object_mut().unwrap().insert(path[path.len() - 1].to_owned(), value);
}

fn remove(v: &mut Value, path: &[&str]) {
    let mut cur = v;
    for key in &path[..path.len() - 1] {
        cur = cur.get_mut(*key).unwrap();
    }
    cur.as_object_mut().unwrap().remove(path[path.len() - 1]);
}

fn policy(allow: &str) -> Policy {
    let text = format!(
        "platform: AWS\nendpoints:\n  - {{name: imds, cidr: 169.254.169.254/32}}\nallow:\n{allow}"
    );
    Policy::parse("test.yaml", &text).expect("valid policy")
}

// ---- PodInfo::from_pod ---------------------------------------------------------------------

#[test]
fn from_pod_reads_every_field() {
    let p = info(full_pod());
    assert_eq!(p.uid, UID);
    assert_eq!(p.cgroup_uid, UID);
    assert_eq!(p.namespace, "openshift-monitoring");
    assert_eq!(p.name, "node-exporter-abcde");
    assert_eq!(p.node_name.as_deref(), Some("node-1"));
    assert_eq!(p.qos, QosClass::Burstable);
    assert!(p.host_network);
    assert_eq!(p.service_account, "node-exporter");
    assert_eq!(p.labels.get("app").map(String::as_str), Some("node-exporter"));
    assert_eq!(
        p.containers,
        vec![
            ContainerInfo { name: "init-textfile".into(), id: Some((Runtime::CriO, cid('1'))) },
            ContainerInfo { name: "node-exporter".into(), id: Some((Runtime::CriO, cid('2'))) },
            ContainerInfo { name: "kube-rbac-proxy".into(), id: None },
            ContainerInfo { name: "debugger".into(), id: Some((Runtime::CriO, cid('3'))) },
        ]
    );
    assert_eq!(p.container_by_id(&cid('2')).map(|c| c.name.as_str()), Some("node-exporter"));
    assert!(p.container_by_id(&cid('9')).is_none());
}

#[test]
fn from_pod_defaults() {
    let p = info(json!({
        "metadata": {"uid": UID, "namespace": "ns", "name": "p"},
        "spec": {"containers": [{"name": "c"}]},
    }));
    assert_eq!(p.node_name, None);
    assert!(!p.host_network);
    assert_eq!(p.service_account, "default");
    assert!(p.labels.is_empty());
    assert_eq!(p.qos, QosClass::BestEffort, "computed: no resources");
    assert_eq!(p.containers, vec![ContainerInfo { name: "c".into(), id: None }]);
}

#[test]
fn deprecated_service_account_field_is_a_fallback() {
    let mut v = full_pod();
    remove(&mut v, &["spec", "serviceAccountName"]);
    set(&mut v, &["spec", "serviceAccount"], json!("legacy"));
    assert_eq!(info(v).service_account, "legacy");
}

#[test]
fn every_runtime_scheme() {
    for (scheme, runtime) in
        [("cri-o", Runtime::CriO), ("containerd", Runtime::Containerd), ("docker", Runtime::Docker)]
    {
        let mut v = full_pod();
        set(
            &mut v,
            &["status", "containerStatuses"],
            json!([{"name": "node-exporter", "containerID": format!("{scheme}://{}", cid('a')),
                    "image": "i", "imageID": "i", "ready": true, "restartCount": 0}]),
        );
        let p = info(v);
        assert_eq!(p.containers[1].id, Some((runtime, cid('a'))), "{scheme}");
        assert_eq!(runtime.to_string(), scheme);
    }
}

#[test]
fn a_status_without_a_spec_container_is_kept() {
    let mut v = full_pod();
    set(
        &mut v,
        &["status", "containerStatuses"],
        json!([{"name": "ghost", "containerID": format!("docker://{}", cid('f')),
                "image": "i", "imageID": "i", "ready": true, "restartCount": 0}]),
    );
    let p = info(v);
    assert_eq!(
        p.containers.last(),
        Some(&ContainerInfo { name: "ghost".into(), id: Some((Runtime::Docker, cid('f'))) })
    );
}

#[test]
fn mirror_pods_use_the_kubelets_uid_for_cgroups() {
    let mut v = full_pod();
    set(
        &mut v,
        &["metadata", "annotations"],
        json!({MIRROR_ANNOTATION: "0123456789abcdef0123456789abcdef"}),
    );
    let p = info(v);
    assert_eq!(p.uid, UID);
    assert_eq!(p.cgroup_uid, "0123456789abcdef0123456789abcdef");
    assert_eq!(
        p.pod_cgroup(CgroupDriver::Systemd),
        PathBuf::from(
            "kubepods-burstable.slice/kubepods-burstable-pod0123456789abcdef0123456789abcdef.slice"
        )
    );
}

#[track_caller]
fn assert_invalid(e: &IdentityError, field: &str, phrase: &str) {
    let IdentityError::Invalid { field: f, reason, .. } = e else { panic!("not Invalid: {e:?}") };
    assert_eq!(f, field, "{e}");
    assert!(reason.contains(phrase), "{reason:?} lacks {phrase:?}");
}

#[test]
fn missing_fields_are_named() {
    for (path, field) in [
        (&["metadata", "uid"][..], "metadata.uid"),
        (&["metadata", "namespace"][..], "metadata.namespace"),
        (&["metadata", "name"][..], "metadata.name"),
        (&["spec"][..], "spec"),
    ] {
        let mut v = full_pod();
        remove(&mut v, path);
        let e = info_err(v);
        assert!(matches!(&e, IdentityError::Missing { .. }), "{e:?}");
        assert_eq!(e.field(), field);
        assert!(e.to_string().ends_with(&format!("{field}: missing")), "{e}");
    }
    let mut v = full_pod();
    set(&mut v, &["metadata", "uid"], json!(""));
    assert_eq!(info_err(v).field(), "metadata.uid", "empty = missing");
}

#[test]
fn errors_name_the_pod() {
    let mut v = full_pod();
    set(&mut v, &["status", "qosClass"], json!("Platinum"));
    assert_eq!(
        info_err(v).to_string(),
        "pod openshift-monitoring/node-exporter-abcde: status.qosClass: unknown QoS class \
         \"Platinum\" (expected Guaranteed, Burstable or BestEffort)"
    );
    let mut v = full_pod();
    remove(&mut v, &["metadata", "name"]);
    assert!(info_err(v).to_string().starts_with(&format!("pod uid {UID}: ")));
}

#[test]
fn bad_container_ids_are_named() {
    let bad = |id: &str, list: &str| {
        let mut v = full_pod();
        let key = list.strip_prefix("status.").unwrap();
        set(
            &mut v,
            &["status", key],
            json!([
                {"name": "a", "containerID": format!("cri-o://{}", cid('0')),
                 "image": "i", "imageID": "i", "ready": true, "restartCount": 0},
                {"name": "b", "containerID": id,
                 "image": "i", "imageID": "i", "ready": true, "restartCount": 0},
            ]),
        );
        info_err(v)
    };
    let l = "status.containerStatuses";
    assert_invalid(
        &bad(&format!("rkt://{}", cid('0')), l),
        "status.containerStatuses[1].containerID",
        "unknown runtime \"rkt\"",
    );
    assert_invalid(&bad(&cid('0'), l), "status.containerStatuses[1].containerID", "<runtime>://");
    assert_invalid(&bad("containerd://abc", l), "status.containerStatuses[1].containerID", "64");
    assert_invalid(
        &bad(&format!("containerd://{}", cid('A')), l),
        "status.containerStatuses[1].containerID",
        "lower-case hex",
    );
    assert_invalid(
        &bad(&format!("containerd://../{}", &cid('0')[3..]), l),
        "status.containerStatuses[1].containerID",
        "hex",
    );
    for l in ["status.initContainerStatuses", "status.ephemeralContainerStatuses"] {
        let e = bad("foo://x", l);
        assert_eq!(e.field(), format!("{l}[1].containerID"));
    }
}

#[test]
fn uids_that_cannot_name_a_cgroup_are_refused() {
    for uid in ["../x", "a/b", "a_b", "a b", "ü"] {
        let mut v = full_pod();
        set(&mut v, &["metadata", "uid"], json!(uid));
        assert_invalid(&info_err(v), "metadata.uid", "cannot name a cgroup");
    }
    let mut v = full_pod();
    set(&mut v, &["metadata", "annotations"], json!({MIRROR_ANNOTATION: "x/../y"}));
    assert_invalid(
        &info_err(v),
        "metadata.annotations[\"kubernetes.io/config.mirror\"]",
        "cannot name a cgroup",
    );
    let mut v = full_pod();
    set(&mut v, &["metadata", "annotations"], json!({MIRROR_ANNOTATION: ""}));
    assert_eq!(info_err(v).field(), "metadata.annotations[\"kubernetes.io/config.mirror\"]");
}

// ---- QoS -----------------------------------------------------------------------------------

/// The computed QoS of a pod (no status) with these containers and init containers.
fn qos_of(containers: Value, init: Value) -> Result<QosClass, IdentityError> {
    PodInfo::from_pod(&api_pod(json!({
        "metadata": {"uid": UID, "namespace": "ns", "name": "p"},
        "spec": {"containers": containers, "initContainers": init},
    })))
    .map(|p| p.qos)
}

fn res(requests: Value, limits: Value) -> Value {
    json!({"name": "c", "resources": {"requests": requests, "limits": limits}})
}

#[test]
fn status_qos_class_wins() {
    for q in QosClass::ALL {
        let mut v = full_pod();
        set(&mut v, &["status", "qosClass"], json!(q.as_str()));
        assert_eq!(info(v).qos, q);
    }
}

#[test]
fn qos_is_computed_without_a_status() {
    use QosClass::*;
    let none = json!([]);
    let g = res(json!({"cpu": "1", "memory": "1Gi"}), json!({"cpu": "1000m", "memory": "1024Mi"}));
    assert_eq!(qos_of(json!([g.clone()]), none.clone()).unwrap(), Guaranteed, "equal quantities");
    assert_eq!(qos_of(json!([g.clone(), g.clone()]), json!([g.clone()])).unwrap(), Guaranteed);
    let be = json!({"name": "c"});
    assert_eq!(qos_of(json!([be.clone()]), none.clone()).unwrap(), BestEffort);
    assert_eq!(
        qos_of(json!([res(json!({"ephemeral-storage": "1Gi"}), json!({}))]), none.clone()).unwrap(),
        BestEffort,
        "only cpu and memory count"
    );
    assert_eq!(qos_of(json!([g.clone(), be.clone()]), none.clone()).unwrap(), Burstable, "mixed");
    assert_eq!(qos_of(json!([g.clone()]), json!([be.clone()])).unwrap(), Burstable, "init counts");
    assert_eq!(
        qos_of(json!([res(json!({"cpu": "1"}), json!({"cpu": "1"}))]), none.clone()).unwrap(),
        Burstable,
        "memory unset"
    );
    assert_eq!(
        qos_of(
            json!([res(
                json!({"cpu": "500m", "memory": "1Gi"}),
                json!({"cpu": "1", "memory": "1Gi"})
            )]),
            none.clone()
        )
        .unwrap(),
        Burstable,
        "request below limit"
    );
    assert_eq!(
        qos_of(json!([res(json!({"cpu": "0", "memory": "0"}), json!({}))]), none.clone()).unwrap(),
        BestEffort,
        "zero requests"
    );
    // Pod-level resources decide alone.
    let p = PodInfo::from_pod(&api_pod(json!({
        "metadata": {"uid": UID, "namespace": "ns", "name": "p"},
        "spec": {
            "containers": [be],
            "resources": {"requests": {"cpu": "2", "memory": "2G"},
                          "limits": {"cpu": "2", "memory": "2000M"}},
        },
    })))
    .unwrap();
    assert_eq!(p.qos, Guaranteed);
}

#[test]
fn unparseable_quantities_are_named() {
    let e =
        qos_of(json!([{"name": "a"}, res(json!({"cpu": "lots"}), json!({"cpu": "1"}))]), json!([]))
            .unwrap_err();
    assert_invalid(&e, "spec.containers[1].resources.requests.cpu", "\"lots\"");
    let e = qos_of(json!([]), json!([res(json!({}), json!({"memory": "1Qi"}))])).unwrap_err();
    assert_invalid(&e, "spec.initContainers[0].resources.limits.memory", "\"1Qi\"");
}

#[test]
fn quantities() {
    const N: i128 = 1_000_000_000;
    for (q, nanos) in [
        ("0", 0),
        ("1", N),
        ("+1", N),
        ("-1", -N),
        ("100m", N / 10),
        ("0.1", N / 10),
        (".5", N / 2),
        ("5.", 5 * N),
        ("1n", 1),
        ("1u", 1000),
        ("1k", 1000 * N),
        ("1M", 1_000_000 * N),
        ("1G", 1_000_000_000 * N),
        ("2T", 2_000_000_000_000 * N),
        ("1P", 10i128.pow(15) * N),
        ("1E", 10i128.pow(18) * N),
        ("1Ki", 1024 * N),
        ("1Mi", 1024 * 1024 * N),
        ("1.5Gi", 3 * 512 * 1024 * 1024 * N),
        ("1Ti", 1024i128.pow(4) * N),
        ("1Pi", 1024i128.pow(5) * N),
        ("1Ei", 1024i128.pow(6) * N),
        ("1e3", 1000 * N),
        ("1E3", 1000 * N),
        ("1e+3", 1000 * N),
        ("25e-2", N / 4),
        ("0.1n", 1),
        ("1e-30", 1),
        ("0e-30", 0),
        ("007", 7 * N),
    ] {
        assert_eq!(parse_quantity(q), Some(nanos), "{q}");
    }
    for q in
        ["", "+", ".", "1..2", "1.2.3", "1x", "1e", "1e+", "1ee3", "m", "1 ", " 1", "1kk", "1e99"]
    {
        assert_eq!(parse_quantity(q), None, "{q:?}");
    }
}

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

#[test]
fn container_id_parser() {
    assert_eq!(
        parse_container_id(&format!("containerd://{}", cid('0'))),
        Ok((Runtime::Containerd, cid('0')))
    );
    assert!(parse_container_id("containerd:/x").unwrap_err().contains("<runtime>://<id>"));
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

// ---- allow evaluation ----------------------------------------------------------------------

/// `full_pod()` with the given QoS and host networking.
fn pod_with(qos: QosClass, host_network: bool) -> PodInfo {
    let mut p = info(full_pod());
    p.qos = qos;
    p.host_network = host_network;
    p
}

#[test]
fn whole_pod_entries_allow_the_pod_level_cgroup() {
    let pol = policy(
        "  - {name: other-ns, namespace: default}\n  - {name: ne, namespace: openshift-monitoring}\n",
    );
    let p = pod_with(QosClass::Burstable, true);
    assert_eq!(
        allowed_cgroups(&pol, &p, CgroupDriver::Systemd),
        vec![(
            PathBuf::from(format!("kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice")),
            1
        )]
    );
    assert_eq!(
        allowed_cgroups(&pol, &p, CgroupDriver::Cgroupfs),
        vec![(PathBuf::from(format!("burstable/pod{UID}")), 1)]
    );
    // Before any container exists: still the pod level.
    let mut p = p;
    for c in &mut p.containers {
        c.id = None;
    }
    assert_eq!(allowed_cgroups(&pol, &p, CgroupDriver::Cgroupfs).len(), 1);
}

#[test]
fn container_entries_allow_named_containers_with_ids() {
    let pol = policy(
        "  - name: ne\n    namespace: openshift-monitoring\n    containers: [node-exporter, kube-rbac-proxy, debugger, absent]\n",
    );
    let p = pod_with(QosClass::Guaranteed, true);
    assert_eq!(
        allowed_cgroups(&pol, &p, CgroupDriver::Systemd),
        vec![
            (PathBuf::from(format!("kubepods-pod{UID_}.slice/crio-{}.scope", cid('2'))), 0),
            (PathBuf::from(format!("kubepods-pod{UID_}.slice/crio-{}.scope", cid('3'))), 0),
        ],
        "kube-rbac-proxy has no id yet; absent does not exist"
    );
}

#[test]
fn selector_narrowing() {
    let p = pod_with(QosClass::BestEffort, true);
    let allowed =
        |allow: &str| !allowed_cgroups(&policy(allow), &p, CgroupDriver::Systemd).is_empty();
    let ns = "namespace: openshift-monitoring";
    assert!(allowed(&format!("  - {{name: a, {ns}}}\n")));
    assert!(!allowed("  - {name: a, namespace: openshift-monitoring-x}\n"));
    assert!(allowed(&format!(
        "  - {{name: a, {ns}, podSelector: {{matchLabels: {{app: node-exporter}}}}}}\n"
    )));
    assert!(!allowed(&format!(
        "  - {{name: a, {ns}, podSelector: {{matchLabels: {{app: other}}}}}}\n"
    )));
    assert!(allowed(&format!(
        "  - {{name: a, {ns}, podSelector: {{matchExpressions: [{{key: tier, operator: In, values: [infra]}}]}}}}\n"
    )));
    assert!(!allowed(&format!(
        "  - {{name: a, {ns}, podSelector: {{matchExpressions: [{{key: tier, operator: DoesNotExist}}]}}}}\n"
    )));
    assert!(allowed(&format!("  - {{name: a, {ns}, serviceAccount: node-exporter}}\n")));
    assert!(!allowed(&format!("  - {{name: a, {ns}, serviceAccount: default}}\n")));
    assert!(allowed(&format!("  - {{name: a, {ns}, hostNetwork: true}}\n")));
    assert!(!allowed(&format!("  - {{name: a, {ns}, hostNetwork: false}}\n")));
    assert!(!allowed("  - {name: a, cgroup: \"**\"}\n"), "cgroup globs are standalone-only");
}

#[test]
fn every_selecting_entry_contributes_first_index_wins() {
    let pol = policy(
        "  - {name: narrow, namespace: openshift-monitoring, containers: [node-exporter]}\n  - {name: broad, namespace: openshift-monitoring}\n  - {name: again, namespace: openshift-monitoring}\n",
    );
    let p = pod_with(QosClass::Guaranteed, false);
    assert_eq!(
        allowed_cgroups(&pol, &p, CgroupDriver::Cgroupfs),
        vec![
            (PathBuf::from(format!("pod{UID}/crio-{}", cid('2'))), 0),
            (PathBuf::from(format!("pod{UID}")), 1),
        ]
    );
}

#[test]
fn scope_ungates_pod_network_pods_only() {
    let pod_net = pod_with(QosClass::Burstable, false);
    let host_net = pod_with(QosClass::Burstable, true);
    let d = CgroupDriver::Cgroupfs;
    assert_eq!(ungated_cgroups(Scope::AllPods, &pod_net, d), None);
    assert_eq!(ungated_cgroups(Scope::AllPods, &host_net, d), None);
    assert_eq!(ungated_cgroups(Scope::HostNetworkOnly, &host_net, d), None);
    assert_eq!(
        ungated_cgroups(Scope::HostNetworkOnly, &pod_net, d),
        Some(PathBuf::from(format!("burstable/pod{UID}")))
    );
    assert_eq!(Scope::default(), Scope::AllPods);
    assert_eq!(Scope::HostNetworkOnly.to_string(), "host-network-only");
}

// ---- the pod index -------------------------------------------------------------------------

fn simple_pod(
    uid: &str,
    ns: &str,
    name: &str,
    host_network: bool,
    ids: &[(&str, char)],
) -> PodInfo {
    PodInfo {
        uid: uid.into(),
        cgroup_uid: uid.into(),
        namespace: ns.into(),
        name: name.into(),
        node_name: Some("node-1".into()),
        qos: QosClass::BestEffort,
        host_network,
        service_account: "default".into(),
        labels: BTreeMap::new(),
        containers: ids
            .iter()
            .map(|(n, c)| ContainerInfo {
                name: (*n).into(),
                id: Some((Runtime::Containerd, cid(*c))),
            })
            .collect(),
    }
}

#[test]
fn index_insert_update_remove() {
    let mut idx = PodIndex::new();
    assert!(idx.is_empty());
    assert_eq!(idx.insert(simple_pod("u1", "ns", "a", false, &[("c", '1')])), None);
    assert_eq!(idx.insert(simple_pod("u2", "ns", "b", false, &[])), None);
    assert_eq!(idx.len(), 2);
    let old = idx.insert(simple_pod("u1", "ns", "a", false, &[("c", '2')])).unwrap();
    assert_eq!(old.containers[0].id, Some((Runtime::Containerd, cid('1'))));
    assert_eq!(idx.get("u1").unwrap().containers[0].id, Some((Runtime::Containerd, cid('2'))));
    assert_eq!(idx.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(idx.remove("u1").map(|p| p.name), Some("a".into()));
    assert_eq!(idx.remove("u1"), None);
    assert!(idx.by_cgroup_uid("u1").is_none());
    assert_eq!(idx.len(), 1);
    idx.replace_all([simple_pod("u3", "ns", "c", false, &[])]);
    assert_eq!(idx.iter().map(|p| p.uid.as_str()).collect::<Vec<_>>(), ["u3"]);
    assert!(idx.by_cgroup_uid("u2").is_none());
    assert!(idx.by_cgroup_uid("u3").is_some());
}

#[test]
fn index_names_owners() {
    let mut idx = PodIndex::new();
    idx.insert(simple_pod("u1", "ns", "a", false, &[("web", '1'), ("side", '2')]));
    let mut mirror = simple_pod("api-uid", "kube-system", "etcd-node-1", true, &[("etcd", '3')]);
    mirror.cgroup_uid = "0123abcd".into();
    idx.insert(mirror);
    let d = CgroupDriver::Systemd;
    let q = QosClass::BestEffort;
    let name = |p: PathBuf| idx.owner_name(&p);
    assert_eq!(
        name(container_cgroup(d, q, "u1", Runtime::Containerd, &cid('1'))).as_deref(),
        Some("ns/a/web")
    );
    assert_eq!(
        name(container_cgroup(d, q, "u1", Runtime::Containerd, &cid('2')).join("sub")).as_deref(),
        Some("ns/a/side")
    );
    assert_eq!(name(pod_cgroup(d, q, "u1")).as_deref(), Some("ns/a"));
    assert_eq!(
        name(container_cgroup(d, q, "u1", Runtime::Containerd, &cid('9'))).as_deref(),
        Some("ns/a"),
        "sandbox or unknown container"
    );
    assert_eq!(
        name(container_cgroup(d, q, "0123abcd", Runtime::Containerd, &cid('3'))).as_deref(),
        Some("kube-system/etcd-node-1/etcd"),
        "mirror pod found by its cgroup uid"
    );
    assert_eq!(name(pod_cgroup(d, q, "api-uid")), None, "not by its API uid");
    assert_eq!(name(pod_cgroup(d, q, "u9")), None);
    assert_eq!(name(PathBuf::from("kubepods-besteffort.slice")), None);
    let (pod, c) = idx.owner(&pod_cgroup(d, q, "0123abcd")).unwrap();
    assert_eq!((pod.uid.as_str(), c), ("api-uid", None));
}

#[test]
fn desired_allow_set_over_the_index() {
    let pol = policy(
        "  - {name: mon, namespace: mon}\n  - {name: side, namespace: app, containers: [side]}\n",
    );
    let mut idx = PodIndex::new();
    idx.insert(simple_pod("u1", "mon", "m", true, &[("c", '1')]));
    idx.insert(simple_pod("u2", "app", "a", false, &[("web", '2'), ("side", '3')]));
    idx.insert(simple_pod("u3", "other", "o", true, &[("c", '4')]));
    idx.insert(simple_pod("u4", "other", "p", false, &[]));
    let d = CgroupDriver::Cgroupfs;
    assert_eq!(
        idx.desired_allow_set(&pol, d, Scope::AllPods),
        vec![
            (PathBuf::from("besteffort/podu1"), 0),
            (PathBuf::from(format!("besteffort/podu2/{}", cid('3'))), 1),
        ]
    );
    assert_eq!(
        idx.desired_allow_set(&pol, d, Scope::HostNetworkOnly),
        vec![
            (PathBuf::from("besteffort/podu1"), 0),
            (PathBuf::from("besteffort/podu2"), UNGATED_ENTRY),
            (PathBuf::from(format!("besteffort/podu2/{}", cid('3'))), 1),
            (PathBuf::from("besteffort/podu4"), UNGATED_ENTRY),
        ]
    );
    // A deleted pod leaves the set.
    idx.remove("u1");
    assert_eq!(idx.desired_allow_set(&pol, d, Scope::AllPods).len(), 1);
    // An ungated pod that an entry also allows keeps the entry's index.
    let mut idx = PodIndex::new();
    idx.insert(simple_pod("u5", "mon", "m", false, &[]));
    assert_eq!(
        idx.desired_allow_set(&pol, d, Scope::HostNetworkOnly),
        vec![(PathBuf::from("besteffort/podu5"), 0)]
    );
}

// ---- properties ----------------------------------------------------------------------------

fn any_uid() -> impl Strategy<Value = String> {
    prop_oneof![
        // RFC 4122 form (API uids)
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        // hex digest (static pods)
        "[0-9a-f]{32}",
        // anything check_uid accepts
        "[A-Za-z0-9][A-Za-z0-9-]{0,40}",
    ]
}

fn any_driver() -> impl Strategy<Value = CgroupDriver> {
    prop_oneof![Just(CgroupDriver::Systemd), Just(CgroupDriver::Cgroupfs)]
}

fn any_qos() -> impl Strategy<Value = QosClass> {
    prop::sample::select(QosClass::ALL.to_vec())
}

fn any_runtime() -> impl Strategy<Value = Runtime> {
    prop::sample::select(Runtime::ALL.to_vec())
}

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
    fn the_index_names_what_it_allows(
        driver in any_driver(),
        qos in any_qos(),
        uid in any_uid(),
        runtime in any_runtime(),
        id in "[0-9a-f]{64}",
    ) {
        let mut pod = simple_pod(&uid, "ns", "p", false, &[]);
        pod.qos = qos;
        pod.containers = vec![ContainerInfo { name: "c".into(), id: Some((runtime, id)) }];
        let pol = policy("  - {name: a, namespace: ns}\n  - {name: b, namespace: ns, containers: [c]}\n");
        let allowed = allowed_cgroups(&pol, &pod, driver);
        prop_assert_eq!(allowed.len(), 2);
        let mut idx = PodIndex::new();
        idx.insert(pod);
        prop_assert_eq!(idx.owner_name(&allowed[0].0), Some("ns/p".to_owned()));
        prop_assert_eq!(idx.owner_name(&allowed[1].0), Some("ns/p/c".to_owned()));
    }

    #[test]
    fn parse_never_panics(parts in prop::collection::vec("[a-z0-9_.-]{0,70}", 0..5)) {
        let path: PathBuf = parts.iter().collect();
        let _ = parse_cgroup(&path);
    }

    #[test]
    fn quantity_parser_never_panics(s in "[-+0-9.eEkKMGTPiunm]{0,24}") {
        let _ = parse_quantity(&s);
    }
}
