//! The gate's lifecycle: it outlives the agent, a restarted or upgraded agent adopts it
//! without an open moment, the policy file is live, denial logs are rate-limited, `cleanup`
//! is the only way to open it, and `status` shows it all.
use std::time::Duration;

use integration_tests::{
    agent::Agent,
    net::{IMDS_V4, NTP_V4},
    probe::token,
};

use super::{EPERM, Env, assert_tc, kernel_has_tcx, metric, policy, status};

fn prog_ids(status: &serde_json::Value) -> Vec<(String, u64, u64)> {
    let mut v: Vec<_> = status["attachments"]
        .as_array()
        .expect("attachments")
        .iter()
        .map(|a| {
            (
                a["attach_point"].as_str().unwrap_or_default().to_owned(),
                a["link_id"].as_u64().unwrap_or(0),
                a["program_id"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn sigkill_keeps_the_gate_closed_and_a_restart_adopts_it() {
    privileged!(sigkill_keeps_the_gate_closed_and_a_restart_adopts_it);
    let mut env = Env::with_agent("enforce");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    let before = status(&env);
    assert_eq!(before["policy"]["generation"], 1, "{before}");

    env.agent.as_mut().expect("agent").kill();
    // No agent: the pinned programs still deny, the allow list still holds.
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    let down = status(&env);
    assert_eq!(down["installed"], true, "{down}");
    let hooks: Vec<&str> = down["attachments"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x["attach_point"].as_str()).collect())
        .unwrap_or_default();
    // The node-level programs of lo (egress) and the uplink (egress and ingress): tcx links on
    // 6.6+, clsact filters before; the LSM programs where the kernel runs them. No proxy: none
    // of its programs (getpeername, sock_ops, bind).
    let mut want = vec!["connect4", "connect6", "egress", "setsockopt"];
    if down["lsm"].as_str().is_some_and(|l| l.starts_with("enforcing")) {
        want.extend(["lsm-bind", "lsm-setsockopt", "lsm-socket"]);
    }
    if kernel_has_tcx() {
        want.extend(["tc-egress-lo", "tc-egress-vnode", "tc-ingress-vnode"]);
    } else {
        assert_tc(&down, "egress", "lo");
        assert_tc(&down, "egress", "vnode");
        assert_tc(&down, "ingress", "vnode");
    }
    want.sort_unstable();
    assert_eq!(
        hooks, want,
        "the cgroup hooks and the node-level links of lo and the uplink: {down}"
    );
    assert_eq!(prog_ids(&down), prog_ids(&before), "programs changed while no agent ran");
    let eps = &down["policy"]["endpoints"];
    assert_eq!(eps[0]["name"], "ec2-imds", "{down}");
    assert!(eps[0]["denied"].as_u64().is_some_and(|n| n >= 2), "{down}");
    assert_eq!(down["policy"]["allowed_cgroups"], 1, "{down}");
    let last = &down["recent_denials"][0];
    assert_eq!(last["dst"], IMDS_V4, "{down}");
    assert_eq!(last["comm"], "probe", "{down}");
    assert_eq!(last["endpoint"], "ec2-imds", "{down}");

    // A new agent adopts the pinned gate: same links, new programs, policy generation 2. (An
    // LSM link cannot swap its program: the new agent attaches a new one first, then moves
    // the pin over the old.)
    env.agent.as_mut().expect("agent").restart_with(&[]).expect("restart");
    let ready = env.agent().find(|v| v["message"] == "ready").expect("ready line");
    assert_eq!(ready["start"], "Adopted", "{ready}");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    let after = status(&env);
    assert_eq!(after["policy"]["generation"], 2, "{after}");
    for ((hook, link_before, prog_before), (_, link_after, prog_after)) in
        prog_ids(&before).into_iter().zip(prog_ids(&after))
    {
        if hook.starts_with("lsm-") {
            assert_ne!(link_before, link_after, "{hook}: the new agent's link is not pinned");
        } else {
            assert_eq!(link_before, link_after, "{hook}: the link was replaced, not updated");
        }
        assert_ne!(prog_before, prog_after, "{hook}: program not replaced");
    }
}

#[test]
fn upgrade_swaps_programs_without_an_open_window() {
    privileged!(upgrade_swaps_programs_without_an_open_window);
    let mut env = Env::new("enforce");
    // The old agent runs the egress program with pid/comm where the kernel allows it. Where
    // the verifier rejects bpf_get_current_pid_tgid in cgroup_skb, `task` is rejected before
    // anything is attached and `auto` (the default) falls back to `notask`, as documented.
    let task = ["--egress-program", "task"];
    let netns = env.net.node_path();
    let first = match Agent::start_with(&env.bins, &netns, &env.policy_file, &env.cg.gated(), &task)
    {
        Ok(agent) => {
            env.agent = Some(agent);
            "gate_egress"
        }
        Err(rejected) => {
            let why = format!("{rejected:#}");
            assert!(why.contains("program gate_egress:"), "not a rejection of the program: {why}");
            env.start_agent();
            let warned = env
                .agent()
                .find(|v| v["message"] == "egress denials will carry no pid/comm on this kernel");
            assert!(warned.is_some(), "auto fell back without saying so");
            "gate_egress_notask"
        }
    };
    let before = status(&env);
    let t = token("hammer");
    let hammer = env.hold("gated/pod-a", &["hammer-tcp", IMDS_V4, "80", &t]).expect("hammer");
    std::thread::sleep(Duration::from_millis(200));
    // The rolling upgrade: the old agent stops, the new one (a different egress program)
    // starts and swaps every program while the workload keeps trying.
    env.agent
        .as_mut()
        .expect("agent")
        .restart_with(&["--egress-program", "notask"])
        .expect("upgrade");
    std::thread::sleep(Duration::from_millis(200));
    let o = hammer.send("stop").expect("hammer result");
    let counts = o.reply.clone().unwrap_or_default();
    assert!(o.ok, "a connect() got through during the upgrade: {counts}");
    let field = |k: &str| -> u64 {
        counts
            .split(' ')
            .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
            .unwrap_or(0)
    };
    assert!(field("attempts") >= 100, "too few attempts to cover the swap: {counts}");
    assert_eq!(field("eperm"), field("attempts"), "every attempt denied with EPERM: {counts}");
    assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "hammer token reached the IMDS");

    let after = status(&env);
    let egress = |s: &serde_json::Value| {
        s["attachments"].as_array().and_then(|a| {
            a.iter()
                .find(|x| x["attach_point"] == "egress")
                .map(|x| x["program"].as_str().unwrap_or("").to_owned())
        })
    };
    assert_eq!(egress(&before).as_deref(), Some(first), "{before}");
    assert_eq!(egress(&after).as_deref(), Some("gate_egress_notask"), "{after}");
    assert_ne!(prog_ids(&before), prog_ids(&after), "programs not replaced");
    assert_eq!(
        env.agent().logs().iter().filter(|l| l.contains("replaced program in place")).count(),
        // The gate's cgroup hooks: connect4/6, egress, setsockopt (no proxy: none of its).
        4,
        "every cgroup hook updated in place"
    );
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
}

#[test]
fn policy_file_edits_are_live_and_a_bad_edit_keeps_the_last_good() {
    privileged!(policy_file_edits_are_live_and_a_bad_edit_keeps_the_last_good);
    let env = Env::with_agent("enforce");
    env.assert_served("gated/pod-a", "udp", NTP_V4, "123");

    // Protect NTP too.
    let extra = "  - {name: ntp-test, cidr: 169.254.169.123/32, ports: [123], protocols: [UDP]}\n";
    let with_ntp = policy("enforce").replace("allow:\n", &format!("{extra}allow:\n"));
    env.replace_policy(&with_ntp);
    env.agent()
        .wait_log(
            |v| v["message"] == "policy applied" && v["generation"] == 2,
            Duration::from_secs(5),
        )
        .expect("policy applied");
    env.assert_refused("gated/pod-a", "udp", NTP_V4, "123", "send");
    env.assert_served("gated/cloud-agent", "udp", NTP_V4, "123");

    // A bad edit is rejected, named, counted; the last good policy stays in force.
    env.replace_policy(&with_ntp.replace("ports: [123]", "ports: [70000]"));
    let rejected = env
        .agent()
        .wait_log(
            |v| v["message"].as_str().is_some_and(|m| m.starts_with("policy rejected")),
            Duration::from_secs(5),
        )
        .expect("rejection logged");
    assert!(
        rejected["error"].as_str().is_some_and(|e| e.contains("endpoints[3].ports")),
        "{rejected}"
    );
    env.assert_refused("gated/pod-a", "udp", NTP_V4, "123", "send");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    let (_, body) = env.agent().http_get("/metrics").expect("metrics");
    assert_eq!(
        metric(&body, "metadata_gate_policy_reloads_total{result=\"success\"}"),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        metric(&body, "metadata_gate_policy_reloads_total{result=\"failure\"}"),
        Some(1.0),
        "{body}"
    );
    assert_eq!(metric(&body, "metadata_gate_policy_generation"), Some(2.0), "{body}");
    assert_eq!(metric(&body, "metadata_gate_policy_rejected"), Some(1.0), "{body}");
    assert_eq!(status(&env)["policy"]["generation"], 2);

    // An in-place rewrite back to the original opens NTP again; SIGHUP with no change is a no-op.
    std::fs::write(&env.policy_file, policy("enforce")).expect("rewrite");
    env.agent()
        .wait_log(
            |v| v["message"] == "policy applied" && v["generation"] == 3,
            Duration::from_secs(5),
        )
        .unwrap_or_else(|| panic!("policy not applied: {:#?}", env.agent().logs()));
    env.assert_served("gated/pod-a", "udp", NTP_V4, "123");
    let (_, body) = env.agent().http_get("/metrics").expect("metrics");
    assert_eq!(metric(&body, "metadata_gate_policy_rejected"), Some(0.0), "{body}");
    env.agent().signal(libc::SIGHUP);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (_, body) = env.agent().http_get("/metrics").expect("metrics");
        if metric(&body, "metadata_gate_policy_reloads_total{result=\"unchanged\"}") >= Some(1.0) {
            assert_eq!(metric(&body, "metadata_gate_policy_generation"), Some(3.0), "{body}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "SIGHUP not handled: {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn denial_logs_are_rate_limited_per_workload_and_metrics_count_all() {
    privileged!(denial_logs_are_rate_limited_per_workload_and_metrics_count_all);
    let env = Env::with_agent("enforce");
    let flood = std::time::Instant::now();
    for _ in 0..20 {
        let o = env.probe("gated/pod-a", &["tcp", IMDS_V4, "80", &token("flood")]);
        assert_eq!(o.errno, Some(EPERM), "{o:?}");
    }
    let flood = flood.elapsed();
    // Every denial is either logged or counted in a window's `suppressed` summary. How many
    // windows 20 denials span depends on the machine's speed (a slow VM can straddle the 10 s
    // window), so wait until all 20 are accounted for, and check the limit in each window.
    let account = || {
        let logs = env.agent().logs();
        let logged = logs.iter().filter(|l| l.contains("\"message\":\"denied\"")).count();
        let summaries: Vec<serde_json::Value> = logs
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["suppressed"].as_u64().is_some())
            .collect();
        (logged, summaries)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (logged, summaries) = loop {
        let (logged, summaries) = account();
        let suppressed: u64 = summaries.iter().filter_map(|v| v["suppressed"].as_u64()).sum();
        if logged as u64 + suppressed >= 20 || std::time::Instant::now() > deadline {
            assert_eq!(logged as u64 + suppressed, 20, "logged + suppressed: {summaries:?}");
            break (logged, summaries);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!summaries.is_empty(), "no suppression summary ({logged} logged)");
    for s in &summaries {
        assert_eq!(s["cgroup"], "pod-a", "{s}");
    }
    // A window logs its first 5 and suppresses the rest; a window with nothing suppressed
    // writes no summary (the last one may): 5 per summary, and at most 5 more.
    let windows = summaries.len();
    assert!((5 * windows..=5 * (windows + 1)).contains(&logged), "{logged}: {summaries:?}");
    if flood < Duration::from_secs(5) {
        // All within one window, with margin: exactly one burst and one summary.
        assert_eq!(logged, 5, "log burst per workload and window");
        assert_eq!(summaries.len(), 1, "{summaries:?}");
        assert_eq!(summaries[0]["suppressed"], 15, "{summaries:?}");
    }
    let (_, body) = env.agent().http_get("/metrics").expect("metrics");
    assert_eq!(
        metric(&body, "metadata_gate_workload_denials_total{workload=\"pod-a\"}"),
        Some(20.0),
        "{body}"
    );
    assert_eq!(
        metric(&body, "metadata_gate_decisions_total{hook=\"connect4\",verdict=\"denied\"}"),
        Some(20.0),
        "{body}"
    );
    assert_eq!(metric(&body, "metadata_gate_map_entries{map=\"ALLOWED\"}"), Some(1.0), "{body}");
    assert!(
        metric(&body, "metadata_gate_map_capacity{map=\"ALLOWED\"}").is_some_and(|c| c >= 1.0),
        "{body}"
    );
}

#[test]
fn gate_stays_closed_after_the_agent_stops_until_cleanup() {
    privileged!(gate_stays_closed_after_the_agent_stops_until_cleanup);
    let mut env = Env::with_agent("enforce");
    let mut agent = env.agent.take().expect("agent");
    agent.stop();
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    let pin = agent.pin_dir.to_string_lossy().into_owned();
    let out = env.cleanup(&pin);
    assert!(out.status.success());
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");
}

#[test]
fn cleanup_opens_the_gate_and_status_says_so() {
    privileged!(cleanup_opens_the_gate_and_status_says_so);
    let mut env = Env::with_agent("enforce");
    let agent = env.agent.as_mut().expect("agent");
    agent.stop();
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    let out = env.cleanup(&pin);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");
    let (code, v) = env.agent().status().expect("status");
    assert_eq!(code, 3, "status without a gate: {v}");
    assert_eq!(v["installed"], false, "{v}");
    assert!(!env.agent().pin_dir.join("v2").exists(), "pins left behind");
}

#[test]
fn an_abi_change_hands_over_to_a_new_pin_dir_without_an_open_window() {
    privileged!(an_abi_change_hands_over_to_a_new_pin_dir_without_an_open_window);
    let mut env = Env::with_agent("enforce");
    let abi = status(&env)["abi"].as_u64().expect("abi");
    let agent = env.agent.as_mut().expect("agent");
    agent.stop();
    // Stand-in for a gate pinned by an agent of an older ABI: the live gate, renamed to v0.
    let current = agent.pin_dir.join(format!("v{abi}"));
    let older = agent.pin_dir.join("v0");
    std::fs::rename(&current, &older).expect("rename on bpffs");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");

    let t = token("handover");
    let hammer = env.hold("gated/pod-a", &["hammer-tcp", IMDS_V4, "80", &t]).expect("hammer");
    std::thread::sleep(Duration::from_millis(200));
    env.agent.as_mut().expect("agent").restart_with(&[]).expect("new ABI agent");
    let retired = env
        .agent()
        .wait_log(
            |v| v["message"] == "retired the gate of another ABI version",
            Duration::from_secs(5),
        )
        .expect("hand-over logged");
    assert_eq!(retired["abi"], 0, "{retired}");
    std::thread::sleep(Duration::from_millis(200));
    let o = hammer.send("stop").expect("hammer result");
    assert!(o.ok, "a connect() got through during the hand-over: {:?}", o.reply);
    assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "hammer token reached the IMDS");
    let ready = env.agent().find(|v| v["message"] == "ready").expect("ready");
    assert_eq!(ready["start"], "Fresh", "{ready}");
    assert!(!older.exists(), "the old ABI's pins are still there");
    let st = status(&env);
    assert_eq!(st["other_versions"].as_array().map(Vec::len), Some(0), "{st}");

    // Nothing of the old gate is left attached: once ours is removed, traffic flows.
    env.agent.as_mut().expect("agent").stop();
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    env.cleanup(&pin);
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");
}

/// As the DaemonSet runs it: /healthz and /readyz on --listen, /metrics on --metrics-listen
/// alone (where kube-rbac-proxy reads it), and neither on the other's address.
#[test]
fn metrics_apart_from_the_probes() {
    privileged!(metrics_apart_from_the_probes);
    const METRICS: &str = "127.0.0.1:19751";
    let mut env = Env::new("enforce");
    env.start_agent_with(&["--metrics-listen", METRICS]);
    let agent = env.agent();
    assert_eq!(agent.http_get("/readyz").expect("readyz").0, 200);
    assert_eq!(agent.http_get("/healthz").expect("healthz").0, 200);
    assert_eq!(agent.http_get("/metrics").expect("the probe address").0, 404);
    let (code, body) = agent.http_get_at(METRICS, "/metrics").expect("metrics");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("metadata_gate_policy_generation "), "{body}");
    assert_eq!(agent.http_get_at(METRICS, "/readyz").expect("the metrics address").0, 404);
    let ready = agent.find(|v| v["message"] == "ready").expect("ready logged");
    assert_eq!(ready["metrics"], METRICS, "{ready}");
}
