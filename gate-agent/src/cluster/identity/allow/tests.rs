//! Which cgroups the pod allow entries and the gate scope let through, and the pod index.
use std::path::PathBuf;

use proptest::prelude::*;

use super::*;
use crate::cluster::identity::{
    ContainerInfo, QosClass, Runtime, container_cgroup, pod_cgroup, test_fixtures::*,
};

fn policy(allow: &str) -> Policy {
    let text = format!(
        "platform: AWS\nendpoints:\n  - {{name: imds, cidr: 169.254.169.254/32}}\nallow:\n{allow}"
    );
    Policy::parse("test.yaml", &text).expect("valid policy")
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
        owner: None,
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

proptest! {
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

}
