//! Cluster mode end to end, without a cluster: the agent talks to a Kubernetes API double
//! (real wire format) and gates a kubepods-shaped cgroup tree built by the test.
use std::{path::PathBuf, time::Duration};

use integration_tests::{
    agent::Agent,
    kubeapi::{self, CONFIGMAPS, EVENTS, INFRASTRUCTURES, KubeApi, NODES, PODS},
    net::{IMDS_V4, NTP_V4},
};
use serde_json::json;

use super::Env;

pub(super) const NODE: &str = "node-1";
pub(super) const NS: &str = "metadata-gate";
const CCM_UID: &str = "0b6c0f5e-1111-4a2b-9c3d-000000000001";
const WEB_UID: &str = "0b6c0f5e-2222-4a2b-9c3d-000000000002";

pub(super) fn cid(n: u8) -> String {
    format!("{:064x}", u128::from(n) * 0x1000_0000_0000_0001)
}

fn policy(extra_endpoint: &str) -> String {
    policy_with(&format!(
        "  - {{name: ec2-imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}}\n{extra_endpoint}"
    ))
}

/// A policy with these `endpoints` entries (YAML list items) that allows the CCM pod.
pub(super) fn policy_with(endpoints: &str) -> String {
    format!(
        r#"platform: AWS
mode: enforce
endpoints:
{endpoints}allow:
  - name: aws-cloud-controller-manager
    namespace: openshift-cloud-controller-manager
    podSelector: {{matchLabels: {{k8s-app: aws-cloud-controller-manager}}}}
    hostNetwork: true
"#
    )
}

/// `kubepods.slice/…/kubepods-besteffort-pod<uid>.slice/crio-<id>.scope`, relative to the
/// test's cgroup base.
pub(super) fn container_cgroup(uid: &str, id: &str) -> String {
    format!(
        "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/crio-{id}.scope",
        uid.replace('-', "_")
    )
}

pub(super) struct Cluster {
    pub(super) env: Env,
    pub(super) api: KubeApi,
    /// The allowed host-network pod's container cgroup (relative to the tree's base).
    pub(super) ccm: String,
    /// A pod-network pod's.
    pub(super) web: String,
    dir: PathBuf,
}

pub(super) fn cluster() -> Cluster {
    let env = Env::new("enforce");
    let api = KubeApi::start_in(&env.net.node_path(), Some("s3cret")).expect("API double");
    api.put(INFRASTRUCTURES, kubeapi::infrastructure("AWS"));
    api.put(NODES, kubeapi::node(NODE, "aws:///us-east-1a/i-0123"));
    api.put(CONFIGMAPS, kubeapi::configmap(NS, "metadata-gate-policy-aws", &policy("")));
    let ccm_labels = json!({"k8s-app": "aws-cloud-controller-manager"});
    api.put(
        PODS,
        kubeapi::pod(
            "openshift-cloud-controller-manager",
            "aws-ccm-1",
            CCM_UID,
            NODE,
            ccm_labels,
            true,
            &format!("cri-o://{}", cid(1)),
        ),
    );
    api.put(
        PODS,
        kubeapi::pod(
            "default",
            "web",
            WEB_UID,
            NODE,
            json!({"app": "web"}),
            false,
            &format!("cri-o://{}", cid(2)),
        ),
    );
    // A pod on another node must not matter.
    api.put(PODS, kubeapi::pod("default", "elsewhere", "uid-else", "node-2", json!({}), false, ""));
    let ccm = container_cgroup(CCM_UID, &cid(1));
    let web = container_cgroup(WEB_UID, &cid(2));
    env.cg.create(&ccm).expect("ccm cgroup");
    env.cg.create(&web).expect("web cgroup");
    let dir = env.cg.base.clone();
    Cluster { env, api, ccm, web, dir }
}

impl Cluster {
    /// Add a host-network pod that no allow entry selects (right namespace, wrong labels);
    /// returns its container cgroup.
    pub(super) fn rogue(&self) -> String {
        const ROGUE_UID: &str = "0b6c0f5e-3333-4a2b-9c3d-000000000003";
        let labels = json!({"k8s-app": "something-else"});
        self.host_network_pod("openshift-cloud-controller-manager", "rogue", ROGUE_UID, labels, 3)
    }

    /// A gated host-network pod `namespace/name` on the node with `labels`, its container
    /// `cid(n)`: created in the API double and as a cgroup; returns the container's cgroup.
    pub(super) fn host_network_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        labels: serde_json::Value,
        n: u8,
    ) -> String {
        let id = cid(n);
        self.api.put(
            PODS,
            kubeapi::pod(namespace, name, uid, NODE, labels, true, &format!("cri-o://{id}")),
        );
        let cgroup = container_cgroup(uid, &id);
        self.env.cg.create(&cgroup).expect("pod cgroup");
        cgroup
    }

    /// The gated root: the kubepods cgroup of the tree.
    pub(super) fn kubepods(&self) -> PathBuf {
        self.dir.join("kubepods.slice")
    }

    fn kubeconfig(&self, token: &str) -> PathBuf {
        let name =
            self.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let path = std::env::temp_dir().join(format!("{name}-{token}-kubeconfig.yaml"));
        self.api.kubeconfig(&path, token).expect("kubeconfig")
    }

    pub(super) fn start(&mut self) {
        self.start_with(&[]);
    }

    /// Start the agent in cluster mode against the double, with `extra` flags.
    pub(super) fn start_with(&mut self, extra: &[&str]) {
        let (flags, kubeconfig) = self.flags(extra);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        self.env.agent = Some(
            Agent::start_cluster(&self.env.bins, &self.env.net.node_path(), &flags)
                .expect("agent ready in cluster mode"),
        );
        let _ = std::fs::remove_file(kubeconfig);
    }

    /// The cluster-mode flags against the double, with `extra`, and the kubeconfig written
    /// for them (remove it once the agent is up).
    pub(super) fn flags(&self, extra: &[&str]) -> (Vec<String>, PathBuf) {
        let kubeconfig = self.kubeconfig("s3cret");
        let root = self.kubepods().to_string_lossy().into_owned();
        let kc = kubeconfig.to_string_lossy().into_owned();
        let mut flags: Vec<String> =
            ["--kubeconfig", &kc, "--node-name", NODE, "--namespace", NS, "--cgroup-root", &root]
                .map(str::to_owned)
                .into();
        flags.extend(extra.iter().map(|s| s.to_string()));
        (flags, kubeconfig)
    }

    fn refused(&self, cgroup: &str, cmd: &str, addr: &str, port: &str) {
        self.env.assert_refused(
            cgroup,
            cmd,
            addr,
            port,
            if cmd == "tcp" { "connect" } else { "send" },
        );
    }
}

#[test]
fn cluster_mode_gates_pods_by_identity_and_follows_the_api() {
    privileged!(cluster_mode_gates_pods_by_identity_and_follows_the_api);
    let mut c = cluster();
    c.start();
    let agent = c.env.agent();
    let ready = agent.find(|v| v["message"] == "cluster mode").expect("cluster mode line");
    assert_eq!(ready["platform"], "AWS", "{ready}");
    assert_eq!(ready["from"], "Infrastructure", "{ready}");
    assert_eq!(ready["configmap"], format!("{NS}/metadata-gate-policy-aws"), "{ready}");

    // The allowed host-network pod is served; another pod is denied, named by identity.
    c.env.assert_served(&c.ccm, "tcp", IMDS_V4, "80");
    c.refused(&c.web, "tcp", IMDS_V4, "80");
    let line = agent
        .wait_log(|v| v["message"] == "denied", Duration::from_secs(5))
        .expect("denial logged");
    assert_eq!(line["cgroup"], "default/web/main", "{line}");
    // …and a Kubernetes Event on the pod.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let ev = loop {
        let evs = c.api.objects(EVENTS);
        if let Some(e) = evs.iter().find(|e| e["reason"] == "MetadataAccessBlocked") {
            break e.clone();
        }
        assert!(std::time::Instant::now() < deadline, "no MetadataAccessBlocked event: {evs:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(ev["regarding"]["name"], "web", "{ev}");
    assert_eq!(ev["regarding"]["namespace"], "default", "{ev}");
    assert_eq!(ev["type"], "Warning", "{ev}");

    // A ConfigMap edit takes effect, also across a compacted history (410 Gone → re-list).
    c.env.assert_served(&c.web, "udp", NTP_V4, "123");
    c.api.compact();
    let ntp = "  - {name: ntp-test, cidr: 169.254.169.123/32, ports: [123], protocols: [UDP]}\n";
    c.api.put(CONFIGMAPS, kubeapi::configmap(NS, "metadata-gate-policy-aws", &policy(ntp)));
    agent
        .wait_log(
            |v| v["message"] == "policy applied" && v["generation"] == 2,
            Duration::from_secs(10),
        )
        .expect("ConfigMap edit applied");
    c.refused(&c.web, "udp", NTP_V4, "123");
    c.env.assert_served(&c.ccm, "udp", NTP_V4, "123");

    // A bad ConfigMap is rejected with an Event on it; the last good policy stays.
    c.api.put(
        CONFIGMAPS,
        kubeapi::configmap(
            NS,
            "metadata-gate-policy-aws",
            &policy(ntp).replace("[123]", "[70000]"),
        ),
    );
    agent
        .wait_log(
            |v| v["message"].as_str().is_some_and(|m| m.starts_with("policy rejected")),
            Duration::from_secs(10),
        )
        .expect("rejection logged");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let evs = c.api.objects(EVENTS);
        if let Some(e) = evs.iter().find(|e| e["reason"] == "PolicyRejected") {
            assert_eq!(e["regarding"]["name"], "metadata-gate-policy-aws", "{e}");
            assert!(e["note"].as_str().is_some_and(|n| n.contains("ports")), "{e}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no PolicyRejected event: {evs:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    c.refused(&c.web, "udp", NTP_V4, "123");
    c.env.assert_served(&c.ccm, "tcp", IMDS_V4, "80");

    // Deleting the allowed pod revokes its access.
    c.api.delete(PODS, "openshift-cloud-controller-manager", "aws-ccm-1");
    agent
        .wait_log(
            |v| v["message"] == "allow set updated" && v["removed"].as_u64() >= Some(1),
            Duration::from_secs(10),
        )
        .expect("allow set shrank");
    c.refused(&c.ccm, "tcp", IMDS_V4, "80");
    // Only this node's pods were asked for.
    assert!(
        c.api
            .requests()
            .iter()
            .any(|r| r.contains("/api/v1/pods?") && r.contains("spec.nodeName%3Dnode-1")),
        "{:?}",
        c.api.requests()
    );
}

#[test]
fn cluster_mode_without_the_crd_uses_the_provider_id_and_a_bad_token_is_named() {
    privileged!(cluster_mode_without_the_crd_uses_the_provider_id_and_a_bad_token_is_named);
    let mut c = cluster();
    c.api.remove_resource(INFRASTRUCTURES);
    c.start();
    let line = c.env.agent().find(|v| v["message"] == "cluster mode").expect("cluster mode line");
    assert_eq!(line["platform"], "AWS", "{line}");
    assert_eq!(line["from"], "ProviderId", "{line}");
    c.refused(&c.web, "tcp", IMDS_V4, "80");

    // Wrong credentials: `run` exits and says why.
    let bad = c.kubeconfig("wrong");
    let root = c.kubepods().to_string_lossy().into_owned();
    let out = c
        .env
        .gate_agent(
            &[
                "run",
                "--kubeconfig",
                &bad.to_string_lossy(),
                "--node-name",
                NODE,
                "--cgroup-root",
                &root,
                "--listen",
                "127.0.0.1:0",
            ],
            Duration::from_secs(20),
        )
        .expect("agent exits");
    let _ = std::fs::remove_file(&bad);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("401") || stderr.contains("Unauthorized"), "{stderr}");
}

#[test]
fn host_network_only_scope_gates_only_host_network_pods() {
    privileged!(host_network_only_scope_gates_only_host_network_pods);
    let mut c = cluster();
    let rogue = c.rogue();
    c.start_with(&["--gate-scope", "host-network-only"]);
    // The pod-network pod is left to the SDN's rules; the host-network ones are gated.
    c.env.assert_served(&c.web, "tcp", IMDS_V4, "80");
    c.refused(&rogue, "tcp", IMDS_V4, "80");
    c.env.assert_served(&c.ccm, "tcp", IMDS_V4, "80");
}

/// New nodes carry `metadata-gate.io/not-ready` (`NoSchedule`, or `NoExecute` where it is
/// applied after the Node joined) until the gate is closed on them: the agent removes it, in
/// either effect, from its own Node once ready, and only it.
#[test]
fn a_new_nodes_not_ready_taint_is_removed_once_the_gate_is_closed() {
    privileged!(a_new_nodes_not_ready_taint_is_removed_once_the_gate_is_closed);
    let mut c = cluster();
    let mut node = kubeapi::node(NODE, "aws:///us-east-1a/i-0123");
    node["spec"]["taints"] = json!([
        {"key": "metadata-gate.io/not-ready", "effect": "NoSchedule"},
        {"key": "example.com/other", "value": "x", "effect": "NoSchedule"},
        {"key": "metadata-gate.io/not-ready", "effect": "NoExecute"},
    ]);
    c.api.put(NODES, node);
    c.start();
    c.refused(&c.web, "tcp", IMDS_V4, "80");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let taints = loop {
        let n = c.api.objects(NODES).into_iter().find(|n| n["metadata"]["name"] == NODE);
        let taints = n.map(|n| n["spec"]["taints"].clone()).unwrap_or_default();
        if !taints.to_string().contains("metadata-gate.io/not-ready")
            || std::time::Instant::now() > deadline
        {
            break taints;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(taints, json!([{"key": "example.com/other", "value": "x", "effect": "NoSchedule"}]));
    assert!(
        c.env
            .agent()
            .find(|v| v["message"].as_str().is_some_and(|m| m.contains("not-ready taint")))
            .is_some(),
        "{:#?}",
        c.env.agent().logs()
    );
}
