//! The gate never opens silently: one agent per gate, a gate someone tore down or whose root
//! was recreated is put back within a tick, a policy that could not be written is retried
//! (never taken for applied), and policy flips under load never let a connect() through.
use std::time::{Duration, Instant};

use integration_tests::{
    agent::{BootSettings, BootStep},
    bpfmap::JunkV4,
    cgroups::remove_tree,
    net::IMDS_V4,
    probe::token,
};

use super::{Env, TempDir, metric, policy, status};

/// Wait up to `timeout` for `pred`, polling.
fn eventually(timeout: Duration, mut pred: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if pred() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn one_agent_per_gate_and_cleanup_refuses_under_a_running_agent() {
    privileged!(one_agent_per_gate_and_cleanup_refuses_under_a_running_agent);
    let env = Env::with_agent("enforce");
    let pid = env.agent().pid().expect("agent runs").to_string();
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    let policy = env.policy_file.to_string_lossy().into_owned();
    let root = env.cg.gated().to_string_lossy().into_owned();
    // A second `run` on the same pin dir fails and names the first.
    let out = env
        .gate_agent(
            &[
                "run",
                "--policy",
                &policy,
                "--cgroup-root",
                &root,
                "--pin-dir",
                &pin,
                "--listen",
                "127.0.0.1:0",
            ],
            Duration::from_secs(20),
        )
        .expect("second agent exits");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second agent ran: {stderr}");
    assert!(
        stderr.contains(&format!("pid {pid}")) && stderr.contains("one agent per gate"),
        "{stderr}"
    );
    // The first is untouched.
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    // cleanup fails while it runs, and says why.
    let out =
        env.gate_agent(&["cleanup", "--pin-dir", &pin], Duration::from_secs(10)).expect("cleanup");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains(&format!("pid {pid}")), "{stderr}");
    assert_eq!(status(&env)["installed"], true);
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
}

#[test]
fn a_torn_down_gate_is_repaired_within_a_tick() {
    privileged!(a_torn_down_gate_is_repaired_within_a_tick);
    let env = Env::with_agent("enforce");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    let pins_before = pin_tree(&env.agent().pin_dir);
    // Forced removal: every pin goes, the links detach — the gate is open at that moment
    // (a cleanup without an agent leaves it open: lifecycle::cleanup_opens_the_gate…).
    let out = env
        .gate_agent(&["cleanup", "--force", "--pin-dir", &pin], Duration::from_secs(10))
        .expect("cleanup --force");
    // Under emulation repair ticks can land inside the removal and pin again until it gives
    // up with "Directory not empty": then part of the tree (the maps, say) was never removed.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let removed_all = out.status.success();
    assert!(removed_all || stderr.contains("Directory not empty"), "{stderr}");
    // What the repair lines say together: a tick that ran while the removal was under way
    // repaired what was gone by then, the next one the rest.
    let repaired = || {
        let lines = env.agent().logs();
        let what: Vec<String> = lines
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["message"] == "gate repaired")
            .map(|v| v["what"].as_str().unwrap_or_default().to_owned())
            .collect();
        what.join(", ")
    };
    // Whole: every pin is back, and a removal that went through is named in the repair log.
    let whole = |w: &str| {
        !w.is_empty()
            && (!removed_all || (w.contains("link connect4") && w.contains("map pin CONFIG")))
            && pin_tree(&env.agent().pin_dir) == pins_before
    };
    let deadline = Instant::now() + integration_tests::sys::slow(Duration::from_secs(3));
    while !whole(&repaired()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let what = repaired();
    assert!(
        whole(&what),
        "the agent repairs the gate: {what:?}; pins {:?}, were {pins_before:?}",
        pin_tree(&env.agent().pin_dir)
    );
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    let s = status(&env);
    assert_eq!(s["installed"], true, "{s}");
    // connect4/6, egress, setsockopt, and the node-level program on lo and the uplink (tcx
    // links on 6.6+, clsact filters before: listed apart).
    let len = |k: &str| s[k].as_array().map_or(0, Vec::len);
    assert!(len("attachments") + len("tc_clsact") >= 6, "{s}");
    let (code, _) = env.agent().http_get("/readyz").expect("readyz");
    assert_eq!(code, 200);
    let (_, body) = env.agent().http_get("/metrics").expect("metrics");
    // Every cgroup link: connect4/6, egress, setsockopt.
    assert!(metric(&body, "metadata_gate_repairs_total{what=\"link\"}") >= Some(4.0), "{body}");
}

/// Every path under `dir`, relative to it, sorted.
fn pin_tree(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    fn walk(base: &std::path::Path, dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            out.push(path.strip_prefix(base).unwrap_or(&path).to_path_buf());
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                walk(base, &path, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Remove the gated root and its children, then make the same tree again: new cgroup ids.
fn recreate_root(env: &Env) {
    remove_tree(&env.cg.gated());
    for c in ["gated/pod-a", "gated/cloud-agent/nested"] {
        env.cg.create(c).expect("cgroup");
    }
}

#[test]
fn a_recreated_root_is_taken_over_live_and_by_a_restart() {
    privileged!(a_recreated_root_is_taken_over_live_and_by_a_restart);
    let mut env = Env::with_agent("enforce");
    let before = status(&env)["cgroup_root_id"].as_u64();
    recreate_root(&env);
    env.agent()
        .wait_log(
            |v| {
                v["message"] == "gate repaired"
                    && v["what"].as_str().is_some_and(|w| w.contains("root"))
            },
            Duration::from_secs(3),
        )
        .expect("the agent takes over the recreated root");
    assert_ne!(status(&env)["cgroup_root_id"].as_u64(), before);
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent/nested", "tcp", IMDS_V4, "80");
    // With no agent running, the root is recreated once more: a restart takes the pinned
    // gate over instead of rejecting it (and crash-looping with the node open).
    env.agent.as_mut().expect("agent").kill();
    recreate_root(&env);
    env.agent.as_mut().expect("agent").restart_with(&[]).expect("restart adopts");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
}

#[test]
fn a_policy_that_cannot_be_written_is_retried_and_never_taken_for_applied() {
    privileged!(a_policy_that_cannot_be_written_is_retried_and_never_taken_for_applied);
    let env = Env::with_agent("enforce");
    // The neighbouring address is open under the first policy.
    let other = integration_tests::net::DNS_V4;
    env.assert_served("gated/pod-a", "tcp", other, "80");
    let hash_before = status(&env)["policy"]["hash"].clone();
    // The pinned gate of this build's ABI: the one `v<N>` dir under the pin dir.
    let versioned = std::fs::read_dir(&env.agent().pin_dir)
        .expect("pin dir")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('v')))
        .expect("a v<ABI> dir");
    let junk = JunkV4::fill(&versioned.join("maps/PREFIX_V4")).expect("fill");
    assert!(junk.len() > 1000, "filled {}", junk.len());
    let with_other = policy("enforce")
        .replace("allow:", &format!("  - {{name: other, cidr: {other}/32, ports: [80]}}\nallow:"));
    env.replace_policy(&with_other);
    env.agent()
        .wait_log(|v| v["message"] == "will retry applying this policy", Duration::from_secs(3))
        .expect("the failed apply is scheduled for a retry");
    // Still the old policy, in the kernel and in the agent's eyes.
    assert_eq!(status(&env)["policy"]["hash"], hash_before);
    env.assert_served("gated/pod-a", "tcp", other, "80");
    drop(junk);
    env.agent()
        .wait_log(
            |v| v["message"] == "policy applied" && v["trigger"] == "retry",
            Duration::from_secs(10),
        )
        .expect("the retry applies it once the map has room");
    assert_ne!(status(&env)["policy"]["hash"], hash_before);
    env.assert_refused("gated/pod-a", "tcp", other, "80", "connect");
}

#[test]
fn policy_flips_under_a_connect_hammer_never_open_the_gate() {
    privileged!(policy_flips_under_a_connect_hammer_never_open_the_gate);
    let mut env = Env::new("enforce");
    // Connections are denied from the start; nothing to terminate after each flip.
    env.start_agent_with(&["--terminate-established=false"]);
    // Two policies that both protect the endpoint; every flip writes one generation and
    // clears the other.
    let a = policy("enforce");
    let b = a.replace("allow:", "  - {name: decoy, cidr: 192.0.2.1/32}\nallow:");
    let t = token("flip-hammer");
    let hammers: Vec<_> = (0..3)
        .map(|_| env.hold("gated/pod-a", &["hammer-tcp", IMDS_V4, "80", &t]).expect("hammer"))
        .collect();
    // As many flips as fit in the time budget (thousands on a quiet machine; at least 100).
    const MAX_FLIPS: usize = 5000;
    const BUDGET: Duration = Duration::from_secs(20);
    let started = Instant::now();
    let applied =
        |env: &Env| env.agent().logs().iter().filter(|l| l.contains("\"policy applied\"")).count();
    let mut flips = 0;
    for i in 0..MAX_FLIPS {
        if i >= 100 && started.elapsed() > BUDGET {
            break;
        }
        flips += 1;
        let text = if i % 2 == 0 { &b } else { &a };
        env.replace_policy(text);
        env.agent().signal(libc::SIGHUP);
        assert!(
            eventually(Duration::from_secs(5), || applied(&env) > i),
            "flip {i} was not applied"
        );
    }
    let took = started.elapsed();
    for h in hammers {
        let o = h.send("stop").expect("hammer result");
        let counts = o.reply.clone().unwrap_or_default();
        assert!(o.ok, "a connect() got through during the flips: {counts}");
        assert!(counts.contains("attempts="), "{counts}");
    }
    assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "hammer token reached the IMDS");
    eprintln!("{flips} policy flips under 3 connect() hammers in {took:?}: none got through");
}

#[test]
fn after_a_reboot_the_boot_step_closes_the_gate_before_the_agent_runs() {
    privileged!(after_a_reboot_the_boot_step_closes_the_gate_before_the_agent_runs);
    let mut env = Env::new("enforce");
    let state = TempDir(std::env::temp_dir().join(integration_tests::sys::unique("mg-state")));
    let state_arg = state.0.to_string_lossy().into_owned();
    env.start_agent_with(&["--state-dir", &state_arg]);
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    assert!(state.0.join("policy.yaml").exists() && state.0.join("allow.json").exists());
    // The node reboots: bpffs is emptied, the state dir on disk is not. Until something
    // closes the gate, the path is open.
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    env.agent.as_mut().expect("agent").stop();
    let out = env.cleanup(&pin);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");
    // The boot step, before any agent: the workload's cgroup already exists, and its very
    // next connect() is denied.
    let root = env.cg.gated().to_string_lossy().into_owned();
    let out = env
        .gate_agent(
            &["boot", "--state-dir", &state_arg, "--pin-dir", &pin, "--cgroup-root", &root],
            Duration::from_secs(30),
        )
        .expect("boot step");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    // The agent adopts it.
    env.agent.as_mut().expect("agent").restart_with(&["--state-dir", &state_arg]).expect("agent");
    let ready = env.agent().find(|v| v["message"] == "ready").expect("ready");
    assert_eq!(ready["start"], "Adopted", "{ready}");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
}

/// Many workloads hammer the metadata service; a quiet one tries once. Its one denial still
/// reaches the log, no event is lost, every denial is counted, and the agent stays ready.
/// (The kernel passes at most EVENT_BURST events per workload, endpoint and second to the
/// ring buffer; without that, the hammers fill it and the quiet denial can be lost.)
#[test]
fn a_quiet_workloads_denial_is_logged_while_others_hammer() {
    privileged!(a_quiet_workloads_denial_is_logged_while_others_hammer);
    const HAMMERS: usize = 16;
    let mut env = Env::new("enforce");
    for i in 0..HAMMERS {
        env.cg.create(&format!("gated/hammer-{i}")).expect("hammer cgroup");
    }
    env.cg.create("gated/quiet").expect("quiet cgroup");
    env.start_agent_with(&["--terminate-established=false"]);
    let t = token("hammer");
    let hammers: Vec<_> = (0..HAMMERS)
        .map(|i| {
            let cg = format!("gated/hammer-{i}");
            env.hold(&cg, &["hammer-tcp", IMDS_V4, "80", &t]).expect("hammer")
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let (code, _) = env.agent().http_get("/readyz").expect("readyz under the hammer");
    assert_eq!(code, 200, "the agent stopped being ready under the hammer");
    env.assert_refused("gated/quiet", "tcp", IMDS_V4, "80", "connect");
    let quiet = env.agent().wait_log(
        |v| v["message"] == "denied" && v["cgroup"].as_str().is_some_and(|c| c.ends_with("quiet")),
        Duration::from_secs(10),
    );
    assert!(quiet.is_some(), "the quiet workload's denial never reached the log");
    std::thread::sleep(Duration::from_secs(1));
    let mut denied = 0.0;
    for h in hammers {
        let o = h.send("stop").expect("hammer result");
        let counts = o.reply.clone().unwrap_or_default();
        assert!(o.ok, "a hammer connect() got through: {counts}");
        let eperm = counts.split_whitespace().find_map(|w| w.strip_prefix("eperm="));
        denied += eperm.and_then(|n| n.parse::<f64>().ok()).expect("eperm count");
    }
    assert!(denied > 0.0, "the hammers never ran");
    let (_, body) = env.agent().http_get("/metrics").expect("metrics");
    let lost = metric(&body, "metadata_gate_events_lost_total").expect("events lost");
    assert_eq!(lost, 0.0, "events lost while {HAMMERS} workloads hammered");
    let counted =
        metric(&body, "metadata_gate_decisions_total{hook=\"connect4\",verdict=\"denied\"}")
            .expect("connect4 denials");
    // Every denied connect() is counted, the quiet one included.
    assert!(counted >= denied + 1.0, "{counted} denials counted, {denied} + 1 denied");
    eprintln!("{HAMMERS} hammers: {denied} connect()s denied, {counted} counted, 0 events lost");
}

/// After a reboot whose power loss tore the kept state (a truncated policy, a corrupt allow
/// set), the boot step closes the gate with the installed policy (here the one shipped for
/// AWS), not with nothing: every gated workload, the allowed one included, is denied until
/// the agent runs; the agent reports what the boot step found.
#[test]
fn a_torn_kept_state_falls_back_to_the_installed_policy() {
    privileged!(a_torn_kept_state_falls_back_to_the_installed_policy);
    let mut env = Env::new("enforce");
    let state = TempDir::new("mg-state");
    let state_arg = state.0.to_string_lossy().into_owned();
    env.start_agent_with(&["--state-dir", &state_arg]);
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    env.agent.as_mut().expect("agent").stop();
    let out = env.cleanup(&pin);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Without a gate the path is open.
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");
    let kept = std::fs::read(state.0.join("policy.yaml")).expect("kept policy");
    std::fs::write(state.0.join("policy.yaml"), &kept[..kept.len() / 2]).expect("tear it");
    std::fs::write(state.0.join("allow.json"), b"[{\"path\": \"gated/cloud").expect("tear it");
    let root = env.cg.gated();
    let settings = BootSettings {
        state_dir: &state.0,
        cgroup_root: &root,
        policy: None,
        platform: Some("AWS"),
        fail_open: false,
    };
    let boot = BootStep::run(&env.bins, &env.net.node_path(), &settings).expect("boot step ran");
    let stderr = String::from_utf8_lossy(&boot.output.stderr).into_owned();
    assert!(boot.output.status.success(), "{stderr}");
    assert!(boot.podman_args.is_none(), "the kept binary ran, not the image: {stderr}");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_refused("gated/cloud-agent", "tcp", IMDS_V4, "80", "connect");
    let st = boot_status(&env, &boot.pin_dir.to_string_lossy(), &state_arg);
    assert_eq!(st["boot"]["closed"], true, "{st}");
    assert!(st["boot"]["policy"].as_str().is_some_and(|p| p.contains("shipped for AWS")), "{st}");
    let problems = st["boot"]["problems"].to_string();
    assert!(problems.contains("kept policy"), "the torn policy is reported: {problems}");
}

/// A boot step that cannot close the gate (no kept state, no installed policy, a platform
/// nothing is shipped for) fails, which holds the kubelet; the operator's explicit opt-out
/// lets it start anyway. Either way the agent, when it runs, says so: log, status and
/// `metadata_gate_boot_step_failed` (the alert).
#[test]
fn a_boot_step_that_cannot_close_fails_visibly() {
    privileged!(a_boot_step_that_cannot_close_fails_visibly);
    let mut env = Env::new("enforce");
    let state = TempDir::new("mg-state");
    let root = env.cg.gated();
    for fail_open in [false, true] {
        let settings = BootSettings {
            state_dir: &state.0,
            cgroup_root: &root,
            policy: None,
            platform: Some("Mars"),
            fail_open,
        };
        let boot = BootStep::run(&env.bins, &env.net.node_path(), &settings).expect("ran");
        let stderr = String::from_utf8_lossy(&boot.output.stderr).into_owned();
        assert_eq!(boot.output.status.success(), fail_open, "fail_open={fail_open}: {stderr}");
        assert!(stderr.contains("no policy is shipped for platform \"Mars\""), "{stderr}");
        assert!(stderr.contains("NOT closed"), "{stderr}");
        // No gate: the path is open, as the failure says.
        env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");
    }
    let state_arg = state.0.to_string_lossy().into_owned();
    env.start_agent_with(&["--state-dir", &state_arg]);
    let (_, body) = env.agent().http_get("/metrics").expect("metrics");
    assert_eq!(metric(&body, "metadata_gate_boot_step_failed"), Some(1.0), "{body}");
    assert!(
        env.agent()
            .find(|v| v["message"]
                .as_str()
                .is_some_and(|m| m.contains("could not close the gate on this boot")))
            .is_some(),
        "the agent did not log the failed boot step"
    );
    let st = boot_status(&env, &env.agent().pin_dir.to_string_lossy(), &state_arg);
    assert_eq!(st["boot"]["closed"], false, "{st}");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
}

/// `gate-agent status --json` with the state dir where the boot step records its outcome.
fn boot_status(env: &Env, pin: &str, state: &str) -> serde_json::Value {
    let args = ["status", "--json", "--pin-dir", pin, "--state-dir", state];
    let out = env.gate_agent(&args, Duration::from_secs(10)).expect("status");
    serde_json::from_slice(&out.stdout).expect("status JSON")
}
