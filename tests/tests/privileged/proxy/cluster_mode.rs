//! The proxy as the DaemonSet runs it: cluster mode, the agent in a pod's cgroup under
//! kubepods, the allow entry selecting a pod by namespace and labels, the pods' cgroups as
//! the kubelet lays them out. The doors of the standalone tests, once more in that shape: an
//! orphan-handshake flood and a pod of many containers lock no one out.
use std::{
    path::Path,
    time::{Duration, Instant},
};

use integration_tests::{
    agent::{Agent, metric},
    kubeapi::{self, CONFIGMAPS, PODS},
    net::{IMDS_V4, NODE_V4},
    probe::token,
    sys::slow,
};
use serde_json::json;

use super::{INSTANCE_ID, PROXY_PORT, PROXY_V6, count};
use crate::cluster::{self, Cluster, NODE, NS};

const ID: &str = "/latest/meta-data/instance-id";
const REGION: &str = "/latest/meta-data/placement/region";
const CSI_UID: &str = "0b6c0f5e-4444-4a2b-9c3d-000000000004";
const WIDE_UID: &str = "0b6c0f5e-5555-4a2b-9c3d-000000000005";
const AGENT_UID: &str = "0b6c0f5e-6666-4a2b-9c3d-000000000006";
const CONTAINERS: u8 = 64;

/// The cluster policy, with the CSI node plugin narrowed to its paths and every other gated
/// pod served the region.
fn policy() -> String {
    cluster::policy_with(
        "  - {name: ec2-imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}\n",
    ) + "  - name: aws-ebs-csi-driver-node\n    \
           namespace: openshift-cluster-csi-drivers\n    \
           podSelector: {matchLabels: {app: aws-ebs-csi-driver-node}}\n    \
           hostNetwork: true\n    \
           paths: [/latest/meta-data/instance-id, /latest/meta-data/placement/]\n\
         served: {paths: [/latest/meta-data/placement/region]}\n"
}

/// A host-network pod on the node with one container per id; returns the containers'
/// cgroups.
fn host_pod(c: &Cluster, ns: &str, name: &str, uid: &str, app: &str, ids: &[u8]) -> Vec<String> {
    let first = format!("cri-o://{}", cluster::cid(ids[0]));
    c.api.put(PODS, kubeapi::pod(ns, name, uid, NODE, json!({"app": app}), true, &first));
    ids.iter()
        .map(|id| {
            let cg = cluster::container_cgroup(uid, &cluster::cid(*id));
            c.env.cg.create(&cg).expect("container cgroup");
            cg
        })
        .collect()
}

fn fetch(c: &Cluster, cgroup: &str, path: &str) -> Option<String> {
    let o = c.env.probe(cgroup, &["http", IMDS_V4, "80", &token("http"), path]);
    o.reply
}

fn ok(reply: &Option<String>) -> bool {
    reply.as_deref().is_some_and(|r| r.contains(" 200 "))
}

/// Every container of `wide` holds 16 silent connections to the service; returns how many
/// connected, once released.
fn hold_wide(c: &Cluster, wide: &[String], during: impl FnOnce()) -> u64 {
    let held: Vec<_> = wide
        .iter()
        .map(|cg| c.env.hold(cg, &["hold-many", IMDS_V4, "80", "16"]).expect("hold-many"))
        .collect();
    during();
    held.into_iter()
        .map(|h| count(h.send("stop").expect("held").reply.as_deref().unwrap_or(""), "connected"))
        .sum()
}

#[test]
fn in_cluster_mode_the_proxy_serves_by_identity_and_no_pod_locks_it() {
    privileged!(in_cluster_mode_the_proxy_serves_by_identity_and_no_pod_locks_it);
    let mut c = cluster::cluster();
    let csi = host_pod(
        &c,
        "openshift-cluster-csi-drivers",
        "aws-ebs-csi-driver-node-x",
        CSI_UID,
        "aws-ebs-csi-driver-node",
        &[3],
    )
    .remove(0);
    let ids: Vec<u8> = (0..CONTAINERS).map(|i| 10 + i).collect();
    let wide = host_pod(&c, "default", "wide", WIDE_UID, "wide", &ids);
    c.api.put(CONFIGMAPS, kubeapi::configmap(NS, "metadata-gate-policy-aws", &policy()));
    let agent_cg = cluster::container_cgroup(AGENT_UID, &cluster::cid(99));
    c.env.cg.create(&agent_cg).expect("agent cgroup");

    // Without the agent: every path reaches the service.
    assert!(ok(&fetch(&c, &csi, ID)), "csi-node without the agent");
    assert!(ok(&fetch(&c, &c.web, ID)), "web without the agent");
    let connected = hold_wide(&c, &wide, || {});
    assert_eq!(connected, u64::from(CONTAINERS) * 16, "the wide pod without the agent");
    let flood = c.env.hold(&c.web, &["orphan-flood", IMDS_V4, "80"]).expect("flood");
    std::thread::sleep(Duration::from_millis(300));
    let o = flood.send("stop").expect("flood");
    assert!(count(o.reply.as_deref().unwrap_or(""), "connected") > 0, "{o:?}");

    // With the DaemonSet's shape: cluster mode, the proxy on, the agent under kubepods.
    let proxy =
        ["--proxy-address", NODE_V4, "--proxy-address", PROXY_V6, "--proxy-port", PROXY_PORT];
    let (flags, kubeconfig) = c.flags(&proxy);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let root = c.env.cgroup(&agent_cg);
    c.env.agent = Some(
        Agent::start_cluster_in_cgroup(
            &c.env.bins,
            &c.env.net.node_path(),
            &flags,
            Path::new(&root),
        )
        .expect("agent ready in cluster mode"),
    );
    let _ = std::fs::remove_file(kubeconfig);
    // By identity: the CSI plugin gets its paths and not the credentials; the others the
    // region only.
    let served = |cg: &str| {
        let r = fetch(&c, cg, ID);
        ok(&r) && r.as_deref().is_some_and(|r| r.contains(INSTANCE_ID))
    };
    let start = Instant::now();
    while !served(&csi) {
        assert!(start.elapsed() < slow(Duration::from_secs(10)), "csi-node never served its path");
        std::thread::sleep(Duration::from_millis(200));
    }
    let creds = fetch(&c, &csi, "/latest/meta-data/iam/security-credentials/");
    assert!(creds.as_deref().is_some_and(|r| r.contains(" 403 ")), "credentials: {creds:?}");
    assert!(ok(&fetch(&c, &c.web, REGION)), "web: the served region");
    let id = fetch(&c, &c.web, ID);
    assert!(id.as_deref().is_some_and(|r| r.contains(" 403 ")), "web: instance id {id:?}");
    // The refusal is an Event of its own on web's pod: the proxy refused a request, the
    // kernel denied nothing.
    let start = Instant::now();
    let ev = loop {
        let evs = c.api.objects(integration_tests::kubeapi::EVENTS);
        let web = |e: &&serde_json::Value| {
            e["reason"] == "MetadataRequestRefused" && e["regarding"]["name"] == "web"
        };
        if let Some(e) = evs.iter().find(web) {
            break e.clone();
        }
        assert!(start.elapsed() < slow(Duration::from_secs(5)), "no refusal Event: {evs:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        (ev["regarding"]["name"].as_str(), ev["action"].as_str()),
        (Some("web"), Some("Refuse")),
        "{ev}"
    );
    assert!(
        ev["note"].as_str().is_some_and(|n| n.contains("refused by the metadata proxy")),
        "{ev}"
    );

    // An orphan-handshake flood from web: csi-node is served throughout.
    let flood = c.env.hold(&c.web, &["orphan-flood", IMDS_V4, "80"]).expect("flood");
    let start = Instant::now();
    while start.elapsed() < slow(Duration::from_secs(4)) {
        assert!(served(&csi), "csi-node not served during the flood");
        std::thread::sleep(Duration::from_millis(100));
    }
    let o = flood.send("stop").expect("flood");
    eprintln!("cluster mode flood: {:?}", o.reply);
    assert!(count(o.reply.as_deref().unwrap_or(""), "connected") > 0, "{o:?}");

    // The wide pod holds its pod's 16 slots: web and csi-node are served beside it.
    let connected = hold_wide(&c, &wide, || {
        assert!(ok(&fetch(&c, &c.web, REGION)), "web not served beside the wide pod");
        assert!(served(&csi), "csi-node not served beside the wide pod");
    });
    let (_, m) = c.env.agent().http_get("/metrics").expect("metrics");
    let busy = metric(&m, "metadata_gate_proxy_connections_refused_total{reason=\"busy\"}");
    eprintln!("cluster mode: {CONTAINERS} containers, {connected} connects, refused busy {busy:?}");
    assert!(busy.unwrap_or(0.0) >= connected.saturating_sub(16) as f64, "{m}");
    let lost = metric(&m, "metadata_gate_proxy_records_lost_total");
    assert_eq!(lost, Some(0.0), "{m}");
}
