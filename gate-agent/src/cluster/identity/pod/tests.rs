//! PodInfo::from_pod against API pods: every field, the defaults, mirror pods, and the errors
//! that name the pod and the field.
use std::path::PathBuf;

use serde_json::{Value, json};

use super::*;
use crate::cluster::identity::test_fixtures::*;

#[track_caller]
fn info_err(v: Value) -> IdentityError {
    match PodInfo::from_pod(&api_pod(v)) {
        Ok(p) => panic!("expected an error, got {p:?}"),
        Err(e) => e,
    }
}

fn remove(v: &mut Value, path: &[&str]) {
    let mut cur = v;
    for key in &path[..path.len() - 1] {
        cur = cur.get_mut(*key).unwrap();
    }
    cur.as_object_mut().unwrap().remove(path[path.len() - 1]);
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

#[test]
fn container_id_parser() {
    assert_eq!(
        parse_container_id(&format!("containerd://{}", cid('0'))),
        Ok((Runtime::Containerd, cid('0')))
    );
    assert!(parse_container_id("containerd:/x").unwrap_err().contains("<runtime>://<id>"));
}
