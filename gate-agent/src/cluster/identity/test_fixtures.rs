//! Fixtures shared by the identity tests: an API pod with every field, container ids, editing
//! its JSON, and the proptest strategies.
use k8s_openapi::api::core::v1::Pod;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::{CgroupDriver, IdentityError, PodInfo, QosClass, Runtime};

pub(super) const UID: &str = "5f3c2a1e-9b7d-4c2e-8a1f-0123456789ab";
pub(super) const UID_: &str = "5f3c2a1e_9b7d_4c2e_8a1f_0123456789ab";

/// A container id: 64 hex digits made of `c`.
pub(super) fn cid(c: char) -> String {
    std::iter::repeat_n(c, 64).collect()
}

/// A pod from API JSON.
pub(super) fn api_pod(v: Value) -> Pod {
    serde_json::from_value(v).expect("valid Pod JSON")
}

/// A running burstable pod on node-1 with an init container, two containers (one not created
/// yet) and an ephemeral container.
pub(super) fn full_pod() -> Value {
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

pub(super) fn info(v: Value) -> PodInfo {
    PodInfo::from_pod(&api_pod(v)).expect("pod converts")
}

/// Set `v[path...] = value`, creating objects on the way.
pub(super) fn set(v: &mut Value, path: &[&str], value: Value) {
    let mut cur = v;
    for key in &path[..path.len() - 1] {
        cur = cur.as_object_mut().unwrap().entry(*key).or_insert_with(|| json!({}));
    }
    cur.as_object_mut().unwrap().insert(path[path.len() - 1].to_owned(), value);
}

#[track_caller]
pub(super) fn assert_invalid(e: &IdentityError, field: &str, phrase: &str) {
    let IdentityError::Invalid { field: f, reason, .. } = e else { panic!("not Invalid: {e:?}") };
    assert_eq!(f, field, "{e}");
    assert!(reason.contains(phrase), "{reason:?} lacks {phrase:?}");
}

pub(super) fn any_uid() -> impl Strategy<Value = String> {
    prop_oneof![
        // RFC 4122 form (API uids)
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        // hex digest (static pods)
        "[0-9a-f]{32}",
        // anything check_uid accepts
        "[A-Za-z0-9][A-Za-z0-9-]{0,40}",
    ]
}

pub(super) fn any_driver() -> impl Strategy<Value = CgroupDriver> {
    prop_oneof![Just(CgroupDriver::Systemd), Just(CgroupDriver::Cgroupfs)]
}

pub(super) fn any_qos() -> impl Strategy<Value = QosClass> {
    prop::sample::select(QosClass::ALL.to_vec())
}

pub(super) fn any_runtime() -> impl Strategy<Value = Runtime> {
    prop::sample::select(Runtime::ALL.to_vec())
}
