//! Operating the gate: audit → report → suggest → enforce from evidence, and `explain`
//! against the live maps (standalone and, for a pod, cluster mode).
use std::time::Duration;

use integration_tests::net::IMDS_V4;

use super::{Env, policy};

/// A directory removed on drop.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn json(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn audit_then_report_then_suggest_then_enforce_from_evidence() {
    privileged!(audit_then_report_then_suggest_then_enforce_from_evidence);
    let mut env = Env::new("audit");
    let state = TempDir(std::env::temp_dir().join(integration_tests::sys::unique("mg-state")));
    let state_arg = state.0.to_string_lossy().into_owned();
    env.start_agent_with(&["--state-dir", &state_arg]);
    // A workload the policy does not know uses the metadata service; an allowed one too.
    env.cg.create("gated/tools/agent").expect("cgroup");
    env.assert_served("gated/tools/agent", "tcp", IMDS_V4, "80");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    // The agent harvests once a second and keeps identities every ten.
    std::thread::sleep(Duration::from_millis(1500));
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    let out = env
        .gate_agent(
            &["report", "--json", "--pin-dir", &pin, "--state-dir", &state_arg],
            Duration::from_secs(10),
        )
        .expect("report");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let records = json(&out);
    let find = |w: &str| {
        records.as_array().and_then(|r| r.iter().find(|x| x["identity"]["workload"] == w)).cloned()
    };
    let tools = find("tools/agent").unwrap_or_else(|| panic!("tools/agent missing: {records:#}"));
    assert_eq!(tools["endpoint"], "ec2-imds", "{tools}");
    assert!(tools["audited"].as_u64() >= Some(1) && tools["denied"] == 0, "{tools}");
    let cloud = find("cloud-agent").unwrap_or_else(|| panic!("cloud-agent missing: {records:#}"));
    assert!(cloud["allowed"].as_u64() >= Some(1), "{cloud}");
    let table = env
        .gate_agent(
            &["report", "--pin-dir", &pin, "--state-dir", &state_arg],
            Duration::from_secs(10),
        )
        .expect("report table");
    assert!(String::from_utf8_lossy(&table.stdout).contains("tools/agent"));

    // suggest: an entry for the audited workload only.
    let out = env
        .gate_agent(
            &["suggest", "--pin-dir", &pin, "--state-dir", &state_arg],
            Duration::from_secs(10),
        )
        .expect("suggest");
    let suggested = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(suggested.contains("cgroup: \"tools/agent\""), "{suggested}");
    assert!(!suggested.contains("cloud-agent"), "already allowed: {suggested}");
    // Review, paste under allow:, enforce: `check` takes it, and the workload is served.
    let indented: String = suggested.lines().map(|l| format!("  {l}\n")).collect();
    let enforced = policy("enforce").replace("allow:\n", &format!("allow:\n{indented}"));
    let file = state.0.join("enforced.yaml");
    std::fs::write(&file, &enforced).expect("write");
    let out = env
        .gate_agent(&["check", &file.to_string_lossy()], Duration::from_secs(10))
        .expect("check");
    assert!(out.status.success(), "{}\n{enforced}", String::from_utf8_lossy(&out.stderr));
    let tmp = env.policy_file.with_extension("tmp");
    std::fs::write(&tmp, &enforced).expect("write");
    std::fs::rename(&tmp, &env.policy_file).expect("rename");
    env.agent()
        .wait_log(|v| v["message"] == "policy applied", Duration::from_secs(5))
        .expect("applied");
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
    // Refused: exit 1, the endpoint and the reason named.
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
