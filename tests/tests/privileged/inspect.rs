//! Operating the gate: audit → report → suggest → enforce from evidence, and `explain`
//! against the live maps (standalone and, for a pod, cluster mode).
use std::time::Duration;

use integration_tests::net::IMDS_V4;

use super::{Env, TempDir, policy};

fn json(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn audit_then_report_then_suggest_then_enforce_from_evidence() {
    privileged!(audit_then_report_then_suggest_then_enforce_from_evidence);
    // Declared first, dropped last: after the agent, which writes to it.
    let state = TempDir::new("mg-state");
    let mut env = Env::new("audit");
    let state_arg = state.0.to_string_lossy().into_owned();
    env.start_agent_with(&["--state-dir", &state_arg]);
    // A workload the policy does not know uses the metadata service; an allowed one too.
    env.cg.create("gated/tools/agent").expect("cgroup");
    env.assert_served("gated/tools/agent", "tcp", IMDS_V4, "80");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    // The agent harvests once a second and keeps identities every ten.
    std::thread::sleep(Duration::from_millis(1500));
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    let records = env.report(&state_arg);
    let find = |w: &str| records.iter().find(|x| x["identity"]["workload"] == w).cloned();
    let tools = find("tools/agent").unwrap_or_else(|| panic!("tools/agent missing: {records:#?}"));
    assert_eq!(tools["endpoint"], "ec2-imds", "{tools}");
    assert!(tools["audited"].as_u64() >= Some(1) && tools["denied"] == 0, "{tools}");
    let cloud = find("cloud-agent").unwrap_or_else(|| panic!("cloud-agent missing: {records:#?}"));
    assert!(cloud["allowed"].as_u64() >= Some(1), "{cloud}");
    let table = env
        .gate_agent(
            &["report", "--pin-dir", &pin, "--state-dir", &state_arg],
            Duration::from_secs(10),
        )
        .expect("report table");
    assert!(String::from_utf8_lossy(&table.stdout).contains("tools/agent"));

    // suggest: an entry for the audited workload only.
    let suggested = env.suggest(&state_arg);
    assert!(suggested.contains("cgroup: \"tools/agent\""), "{suggested}");
    assert!(!suggested.contains("cloud-agent"), "already allowed: {suggested}");
    // Review, paste under allow:, enforce: `check` takes it, and the workload is served.
    env.enforce_suggested(&suggested, &state.0);
    env.assert_served("gated/tools/agent", "tcp", IMDS_V4, "80");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
}

#[test]
fn explain_decides_against_the_live_maps_and_says_why() {
    privileged!(explain_decides_against_the_live_maps_and_says_why);
    let env = Env::with_agent("enforce");
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    let explain = |args: &[&str]| {
        let mut a = vec!["explain", "--json", "--pin-dir", &pin];
        a.extend_from_slice(args);
        env.gate_agent(&a, Duration::from_secs(10)).expect("explain")
    };
    // Denied: exit 1, the endpoint and the reason named.
    let out = explain(&["--cgroup", "pod-a", "169.254.169.254:80"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let v = &json(&out)[0];
    assert_eq!(v["verdict"], "denied", "{v}");
    assert_eq!(v["endpoint"], "ec2-imds", "{v}");
    assert!(v["why"].as_str().is_some_and(|w| w.contains("no allow entry")), "{v}");
    // Allowed by the entry on an ancestor: exit 0.
    let out = explain(&["--cgroup", "cloud-agent/nested", "169.254.169.254:80/tcp"]);
    assert_eq!(out.status.code(), Some(0));
    let v = &json(&out)[0];
    assert_eq!(v["verdict"], "allowed", "{v}");
    assert!(v["path"][0]["allow_entry"].is_number(), "{v}");
    // Not protected: DNS's port.
    let out = explain(&["--cgroup", "pod-a", "169.254.169.254:53/udp"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(json(&out)[0]["verdict"], "unprotected");
    // No destination: every protected one of the live policy, the worst exit code.
    let out = explain(&["--cgroup", "pod-a"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(json(&out).as_array().is_some_and(|a| a.len() >= 3));
    // What the kernel does agrees.
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent/nested", "tcp", IMDS_V4, "80");
    // A cgroup outside the gated root: an error naming why, exit 4.
    let out =
        explain(&["--cgroup", &env.cgroup("outside").to_string_lossy(), "169.254.169.254:80"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not below the gated root"));
}

/// The must-gather script collects a running gate's `status --json` and `report --json` per
/// node and the cluster's objects. The cluster is the API double, read by the real kubectl;
/// `exec` into the agent pod is the one call a test wrapper answers, by running this build's
/// gate-agent on the gate the test installed.
#[test]
fn must_gather_collects_every_nodes_gate_and_the_clusters_objects() {
    use integration_tests::kubeapi::{self, KubeApi};
    use serde_json::json;
    privileged!(must_gather_collects_every_nodes_gate_and_the_clusters_objects);
    let dir = TempDir::new("mg-gather");
    let mut env = Env::new("enforce");
    std::fs::create_dir_all(dir.0.join("state")).expect("temp dir");
    let state = dir.0.join("state").to_string_lossy().into_owned();
    env.start_agent_with(&["--state-dir", &state]);
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    // The agent harvests the tally once a second.
    std::thread::sleep(Duration::from_millis(1500));

    let api = KubeApi::start(None).expect("API double");
    let ns = "metadata-gate";
    let agent_labels =
        json!({"app.kubernetes.io/name": "metadata-gate", "app.kubernetes.io/component": "agent"});
    api.put(
        kubeapi::DAEMONSETS,
        json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "metadata-gate-agent", "namespace": ns}, "spec": {}}),
    );
    let mut agent_pod =
        kubeapi::pod(ns, "metadata-gate-agent-x1", "u1", "node-1", agent_labels, true, "cri-o://0");
    agent_pod["spec"]["containers"] =
        json!([{"name": "agent", "image": "x"}, {"name": "kube-rbac-proxy", "image": "y"}]);
    api.put(kubeapi::PODS, agent_pod);
    let mut cm = kubeapi::configmap(ns, "metadata-gate-policy-aws", &policy("enforce"));
    cm["metadata"]["labels"] =
        json!({"app.kubernetes.io/name": "metadata-gate", "app.kubernetes.io/component": "policy"});
    api.put(kubeapi::CONFIGMAPS, cm);
    // A ConfigMap that is no policy stays out.
    api.put(kubeapi::CONFIGMAPS, kubeapi::configmap(ns, "unrelated", "x"));
    let mut tainted = kubeapi::node("node-1", "aws:///us-east-1a/i-1");
    tainted["spec"]["taints"] =
        json!([{"key": "metadata-gate.io/not-ready", "effect": "NoSchedule"}]);
    api.put(kubeapi::NODES, tainted);
    api.put(kubeapi::NODES, kubeapi::node("node-2", "aws:///us-east-1a/i-2"));
    api.put(kubeapi::INFRASTRUCTURES, kubeapi::infrastructure("AWS"));
    api.put(kubeapi::CORE_EVENTS, json!({"apiVersion": "v1", "kind": "Event",
        "metadata": {"name": "e1", "namespace": "team-a"}, "reason": "MetadataAccessBlocked",
        "message": "denied", "involvedObject": {"kind": "Pod", "name": "pod-a", "namespace": "team-a"}}));
    let agent_log = env.agent().logs().join("\n") + "\n";
    api.set_log(ns, "metadata-gate-agent-x1", "agent", &agent_log);
    let kubeconfig = api.kubeconfig(&dir.0.join("kubeconfig"), "t").expect("kubeconfig");

    // kubectl for everything but `exec … -- /gate-agent CMD …`, which runs CMD on this gate.
    let wrapper = dir.0.join("kubectl-wrapper");
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/bash\nargs=(\"$@\")\nfor i in \"${{!args[@]}}\"; do\n\
             \x20 if [ \"${{args[$i]}}\" = -- ]; then\n\
             \x20   exec {agent} \"${{args[@]:$((i+2))}}\" --pin-dir {pin} --state-dir {state}\n\
             \x20 fi\ndone\nexec kubectl --kubeconfig {kc} \"$@\"\n",
            agent = env.bins.agent.display(),
            kc = kubeconfig.display(),
        ),
    )
    .expect("wrapper");
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let out_dir = dir.0.join("must-gather");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/must-gather/gather");
    let run = std::process::Command::new("bash")
        .arg(script)
        .env("KUBECTL", &wrapper)
        .env("MUST_GATHER_DIR", &out_dir)
        .env("METADATA_GATE_VERSION", "0.1.0-test")
        .output()
        .expect("gather runs");
    let log = std::fs::read_to_string(out_dir.join("metadata-gate/gather.log")).unwrap_or_default();
    assert!(run.status.success(), "{}\n{log}", String::from_utf8_lossy(&run.stderr));
    let read = |rel: &str| {
        std::fs::read_to_string(out_dir.join(rel))
            .unwrap_or_else(|e| panic!("{rel}: {e}\ngather.log:\n{log}"))
    };
    assert_eq!(read("version"), "metadata-gate\n0.1.0-test\n");

    // Per node: the gate as status and report print it, from the node with an agent pod.
    let node = "metadata-gate/nodes/node-1";
    assert_eq!(read(&format!("{node}/pod")).trim(), "metadata-gate-agent-x1");
    let gathered: serde_json::Value =
        serde_json::from_str(&read(&format!("{node}/status.json"))).expect("status.json is JSON");
    let live = super::status(&env);
    assert_eq!(gathered["policy"]["hash"], live["policy"]["hash"], "{gathered:#}");
    assert!(gathered["policy"]["hash"].is_string(), "{gathered:#}");
    let report: serde_json::Value =
        serde_json::from_str(&read(&format!("{node}/report.json"))).expect("report.json is JSON");
    let pod_a =
        report.as_array().and_then(|r| r.iter().find(|x| x["identity"]["workload"] == "pod-a"));
    assert!(pod_a.is_some_and(|r| r["denied"].as_u64() >= Some(1)), "{report:#}");
    let err =
        std::fs::read_to_string(out_dir.join(format!("{node}/agent.log.err"))).unwrap_or_default();
    assert!(read(&format!("{node}/agent.log")).contains("\"ready\""), "{err}\n{log}");
    assert!(out_dir.join("metadata-gate/nodes/node-2/no-agent").exists(), "{log}");

    // Cluster-wide: what kubectl read from the API.
    let c = "metadata-gate/cluster";
    assert!(read(&format!("{c}/daemonset.yaml")).contains("name: metadata-gate-agent"), "{log}");
    let policies = read(&format!("{c}/policy-configmaps.yaml"));
    assert!(
        policies.contains("metadata-gate-policy-aws") && !policies.contains("unrelated"),
        "{policies}"
    );
    assert!(read(&format!("{c}/node-taints.txt")).contains("metadata-gate.io/not-ready"), "{log}");
    assert!(read(&format!("{c}/infrastructure.yaml")).contains("kind: Infrastructure"), "{log}");
    assert!(read(&format!("{c}/events-MetadataAccessBlocked.yaml")).contains("pod-a"), "{log}");
    for call in ["get daemonset", "get configmaps", "get nodes", "status --json", "report --json"] {
        assert!(log.lines().any(|l| l.starts_with("ok") && l.contains(call)), "{call}: {log}");
    }
    // What support gets, for the test's log.
    let tree = std::process::Command::new("find").arg(&out_dir).arg("-type").arg("f").output();
    eprintln!(
        "{}\n{log}",
        tree.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
    );
}
