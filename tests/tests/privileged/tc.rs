//! The tc layer: AF_PACKET frames (which no cgroup hook sees), traffic forwarded from a
//! workload-facing interface, and the clsact fallback for kernels without tcx.
use std::time::Duration;

use integration_tests::{
    net::{IMDS_V4, PodNet},
    probe::{self, token},
    sys::sh,
};

use super::{Env, assert_tc, metric, status};

#[test]
fn af_packet_frames_from_a_gated_cgroup_never_arrive() {
    privileged!(af_packet_frames_from_a_gated_cgroup_never_arrive);
    let mut env = Env::new("enforce");
    let netns = env.net.node_path();
    env.start_agent_with(&["--tc-interface", "vnode", "--tc-netns", &netns]);
    // Control: the same frame from the allowed cgroup arrives (the frame is well formed).
    let t = token("packet-allowed");
    let o = env.probe("gated/cloud-agent", &["packet", IMDS_V4, "80", &t, "vnode"]);
    assert!(o.ok, "{o:?}");
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "allowed AF_PACKET frame lost");
    // A gated cgroup's frame is dropped by tc before it leaves.
    let t = token("packet-gated");
    let o = env.probe("gated/pod-a", &["packet", IMDS_V4, "80", &t, "vnode"]);
    assert!(!env.imds.wait_for(&t, Duration::from_millis(500)), "AF_PACKET frame arrived: {o:?}");
    // Processes outside the gated root are not affected; unprotected ports pass.
    let t = token("packet-outside");
    env.probe("outside", &["packet", IMDS_V4, "80", &t, "vnode"]);
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "frame from outside the root lost");
    let t = token("packet-dns");
    env.probe("gated/pod-a", &["packet", IMDS_V4, "53", &t, "vnode"]);
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "frame to :53 lost");
    let st = status(&env);
    let tc =
        st["decisions"].as_array().and_then(|d| d.iter().find(|h| h["hook"] == "tc4")).cloned();
    assert!(tc.as_ref().is_some_and(|h| h["denied"] == 1), "{st}");
    assert_tc(&st, "egress", "vnode");
}

#[test]
fn forwarded_traffic_from_a_workload_interface_is_dropped() {
    privileged!(forwarded_traffic_from_a_workload_interface_is_dropped);
    let mut env = Env::new("enforce");
    let pod = PodNet::new(&env.net).expect("pod netns");
    let (outside, bins) = (env.cgroup("outside"), env.bins.clone());
    let send = |port: &str, t: &str| {
        probe::run_in(&bins, &pod.path(), &outside, &["udp", IMDS_V4, port, t]).expect("probe")
    };
    // Without the gate, forwarding works both ways.
    let t = token("fwd-before");
    send("80", &t);
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "forwarding does not work");

    let netns = env.net.node_path();
    env.start_agent_with(&["--tc-workload-interface", "vpod", "--tc-netns", &netns]);
    let t = token("fwd-gated");
    send("80", &t);
    assert!(!env.imds.wait_for(&t, Duration::from_millis(500)), "forwarded packet arrived");
    // Unprotected ports still pass.
    let t = token("fwd-dns");
    send("53", &t);
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "forwarded :53 lost");
    let (_, body) = env.agent().http_get("/metrics").expect("metrics");
    assert!(
        metric(&body, "metadata_gate_decisions_total{hook=\"tc4\",verdict=\"denied\"}")
            >= Some(1.0),
        "{body}"
    );
    drop(env.agent.take());
    drop(pod);
}

#[test]
fn clsact_fallback_outlives_the_agent_is_replaced_in_place_and_cleaned_up() {
    privileged!(clsact_fallback_outlives_the_agent_is_replaced_in_place_and_cleaned_up);
    let mut env = Env::new("enforce");
    let netns = env.net.node_path();
    let args = ["--tc-interface", "vnode", "--tc-netns", netns.as_str(), "--tc-mode", "clsact"];
    env.start_agent_with(&args);
    let frame_arrives = |env: &Env, tag: &str| {
        let t = token(tag);
        env.probe("gated/pod-a", &["packet", IMDS_V4, "80", &t, "vnode"]);
        env.imds.wait_for(&t, Duration::from_millis(700))
    };
    let filters = |env: &Env| {
        sh(
            "ip",
            &["netns", "exec", &env.net.node, "tc", "filter", "show", "dev", "vnode", "egress"],
        )
        .expect("tc filter show")
        .lines()
        .filter(|l| l.contains("gate_tc"))
        .count()
    };
    assert!(!frame_arrives(&env, "clsact-1"), "AF_PACKET frame passed the clsact filter");
    assert_eq!(filters(&env), 1);
    let st = status(&env);
    let vnode = format!("egress vnode {netns}");
    let clsact = st["tc_clsact"].as_array().expect("tc_clsact");
    assert!(clsact.iter().any(|c| c.as_str() == Some(vnode.as_str())), "{st}");

    env.agent.as_mut().expect("agent").kill();
    assert!(!frame_arrives(&env, "clsact-2"), "the filter went with the agent");
    env.agent.as_mut().expect("agent").restart_with(&args).expect("restart");
    assert!(!frame_arrives(&env, "clsact-3"), "frame passed after the restart");
    assert_eq!(filters(&env), 1, "the restart added a filter instead of replacing it");

    env.agent.as_mut().expect("agent").stop();
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    let out = env.cleanup(&pin);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(filters(&env), 0, "cleanup left the clsact filter");
    assert!(frame_arrives(&env, "clsact-4"), "frame still dropped after cleanup");
}

/// A clsact qdisc deleted under the gate (all a host-network pod with NET_ADMIN can do to the
/// node-level program on kernels without tcx) is put back on the tc event, not at the next
/// periodic check (an hour away here).
#[test]
fn a_deleted_clsact_qdisc_is_restored_on_the_event() {
    privileged!(a_deleted_clsact_qdisc_is_restored_on_the_event);
    let mut env = Env::new("enforce");
    env.start_agent_with(&["--tc-mode", "clsact", "--rescan-ms", "3600000"]);
    let frame_arrives = |env: &Env, tag: &str| {
        let t = token(tag);
        env.probe("gated/pod-a", &["packet", IMDS_V4, "80", &t, "vnode"]);
        env.imds.wait_for(&t, Duration::from_millis(700))
    };
    assert!(!frame_arrives(&env, "qdisc-1"), "AF_PACKET frame passed the clsact filter");
    let del = ["netns", "exec", &env.net.node, "tc", "qdisc", "del", "dev", "vnode", "clsact"];
    sh("ip", &del).expect("tc qdisc del");
    let restored = env.agent().wait_log(
        |v| v["message"] == "tc attachment was missing; restored" && v["interface"] == "vnode",
        Duration::from_secs(5),
    );
    assert!(restored.is_some(), "the deleted clsact qdisc was not restored on the event");
    assert!(!frame_arrives(&env, "qdisc-2"), "AF_PACKET frame passed after the restore");
}
