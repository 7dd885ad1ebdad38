//! Connections established before the gate came up: destroyed (`--terminate-established`,
//! the default), or left open with every packet dropped on egress.
use std::time::{Duration, Instant};

use integration_tests::{
    net::{IMDS_V4, IMDS_V6},
    probe::{Held, token},
};

use super::{EPERM, Env};

#[test]
fn connections_opened_before_the_agent_are_cut_off() {
    privileged!(connections_opened_before_the_agent_are_cut_off);
    let mut env = Env::new("enforce");
    let tcp = env.hold("gated/pod-a", &["hold-tcp", IMDS_V4, "80"]).expect("hold tcp");
    let udp = env.hold("gated/pod-a", &["hold-udp", IMDS_V4, "80"]).expect("hold udp");
    let allowed =
        env.hold("gated/cloud-agent", &["hold-tcp", IMDS_V4, "80"]).expect("hold allowed");
    env.start_agent();
    let (t1, t2, t3) = (token("held-tcp"), token("held-udp"), token("held-allowed"));
    let o = tcp.send(&t1).expect("held tcp result");
    assert!(!o.ok, "pre-existing TCP connection still served: {o:?}");
    let o = udp.send(&t2).expect("held udp result");
    assert!(!o.ok, "pre-existing UDP socket still served: {o:?}");
    assert!(!env.imds.wait_for(&t1, Duration::from_secs(1)), "held TCP token reached the IMDS");
    assert!(!env.imds.saw(&t2), "held UDP token reached the IMDS");
    let o = allowed.send(&t3).expect("held allowed result");
    assert!(o.ok, "allowed pre-existing connection was cut: {o:?}");
    assert!(env.imds.wait_for(&t3, Duration::from_secs(1)));
}

const ECONNABORTED: i32 = 103;
const EDESTADDRREQ: i32 = 89;

/// Held probes opened before the agent: gated ones to every protected TCP/UDP form, and
/// controls (allowed cgroup; gated but unprotected port).
struct HeldSet {
    gated: Vec<(&'static str, Held)>,
    allowed: Held,
    unprotected: Held,
}

fn hold_before_agent(env: &Env) -> HeldSet {
    let pod = "gated/pod-a";
    let mapped = format!("::ffff:{IMDS_V4}");
    let gated = [
        ("tcp-v4", vec!["hold-tcp", IMDS_V4, "80"]),
        ("tcp-v6", vec!["hold-tcp", IMDS_V6, "80"]),
        ("tcp-mapped", vec!["hold-tcp", mapped.as_str(), "80"]),
        ("udp-v4", vec!["hold-udp", IMDS_V4, "80"]),
        ("udp-v6", vec!["hold-udp", IMDS_V6, "80"]),
    ]
    .into_iter()
    .map(|(name, args)| (name, env.hold(pod, &args).expect(name)))
    .collect();
    let allowed =
        env.hold("gated/cloud-agent/nested", &["hold-tcp", IMDS_V4, "80"]).expect("hold allowed");
    let unprotected = env.hold(pod, &["hold-tcp", IMDS_V4, "53"]).expect("hold unprotected");
    HeldSet { gated, allowed, unprotected }
}

/// The controls still work after the agent came up.
fn assert_controls_served(env: &Env, held: HeldSet) {
    for (name, h) in [("allowed", held.allowed), ("unprotected port", held.unprotected)] {
        let t = token(name);
        let o = h.send(&t).expect("held control result");
        assert!(o.ok, "{name} pre-existing connection was cut: {o:?}");
        assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "{name} token never arrived");
    }
}

#[test]
fn established_connections_are_terminated_when_the_gate_comes_up() {
    privileged!(established_connections_are_terminated_when_the_gate_comes_up);
    let mut env = Env::new("enforce");
    let held = hold_before_agent(&env);
    env.start_agent();
    // Ready implies the scan is done: each gated socket was destroyed and logged.
    let agent = env.agent();
    let terminated: Vec<_> = agent
        .logs()
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "terminated established connection")
        .collect();
    assert_eq!(terminated.len(), 5, "one event per gated socket: {terminated:#?}");
    for v in &terminated {
        assert_eq!(v["cgroup"], "pod-a", "{v}");
        assert_eq!(v["port"], 80, "{v}");
        assert!(["TCP", "UDP"].contains(&v["proto"].as_str().unwrap_or("")), "{v}");
        assert!(v["src"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
    }
    let dsts: Vec<&str> = terminated.iter().filter_map(|v| v["dst"].as_str()).collect();
    assert!(dsts.contains(&IMDS_V4) && dsts.contains(&IMDS_V6), "{dsts:?}");
    assert!(dsts.contains(&format!("::ffff:{IMDS_V4}").as_str()), "{dsts:?}");
    let summary =
        agent.find(|v| v["message"] == "established connections checked").expect("summary event");
    assert_eq!(summary["destroyed"], 5, "{summary}");
    // The agent runs in the node's namespace (as a hostNetwork DaemonSet pod does).
    assert!(summary["netns"].as_u64().is_some_and(|n| n >= 1), "the node's: {summary}");
    // The resets of destroyed sockets carry nothing and pass: no denial is blamed on the agent.
    std::thread::sleep(Duration::from_millis(300));
    let agent_pid = u64::from(agent.pid().expect("agent runs"));
    assert!(
        agent.find(|v| v["verdict"] == "denied" && v["pid"] == agent_pid).is_none(),
        "a terminated socket's reset was reported as a denial"
    );
    let (_, st) = agent.status().expect("status");
    assert_eq!(st["terminate_established"], "on", "{st}");

    let HeldSet { gated, allowed, unprotected } = held;
    for (name, h) in gated {
        let t = token(name);
        // The probe's elapsed_us counts from its start; time the exchange here.
        let sent = Instant::now();
        let o = h.send(&t).expect("held result");
        let took = sent.elapsed();
        assert!(!o.ok, "{name}: pre-existing connection still served: {o:?}");
        let want = if name.starts_with("tcp") { ECONNABORTED } else { EDESTADDRREQ };
        assert_eq!(o.errno, Some(want), "{name}: not destroyed: {o:?}");
        assert_eq!(o.stage, "send", "{name}: {o:?}");
        // Destroyed sockets fail at once; a merely dropped one would time out after seconds.
        assert!(took < Duration::from_millis(500), "{name}: took {took:?}: {o:?}");
        assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "{name}: token reached IMDS");
    }
    assert_controls_served(&env, HeldSet { gated: vec![], allowed, unprotected });
}

#[test]
fn terminate_established_false_leaves_connections_open_but_dropped() {
    privileged!(terminate_established_false_leaves_connections_open_but_dropped);
    let mut env = Env::new("enforce");
    let held = hold_before_agent(&env);
    // With termination on, this socket would be destroyed: off, only the egress program, which
    // has to walk the hop-by-hop header to find the UDP port, keeps its datagram in.
    let hbh = env.hold("gated/pod-a", &["hold-udp-hbh", IMDS_V6, "80"]).expect("hold hbh");
    env.start_agent_with(&["--terminate-established=false"]);
    assert!(
        env.agent().find(|v| v["message"] == "terminated established connection").is_none(),
        "destroyed a socket with --terminate-established=false"
    );
    assert!(env.agent().find(|v| v["message"] == "established connections checked").is_none());
    let HeldSet { gated, allowed, unprotected } = held;
    for (name, h) in gated.into_iter().chain([("udp-hbh", hbh)]) {
        let t = token(name);
        let o = h.send(&t).expect("held result");
        assert!(!o.ok, "{name}: pre-existing connection served: {o:?}");
        // The socket is open: TCP accepts the send and its segments are dropped, so no reply
        // comes; a UDP datagram is dropped on egress, which send reports as EPERM. A destroyed
        // socket would fail the send with ECONNABORTED / EDESTADDRREQ instead.
        if name.starts_with("tcp") {
            assert_eq!(o.stage, "recv", "{name}: socket was destroyed: {o:?}");
        } else {
            assert_eq!((o.stage.as_str(), o.errno), ("send", Some(EPERM)), "{name}: {o:?}");
        }
        assert!(!env.imds.wait_for(&t, Duration::from_millis(500)), "{name}: token reached IMDS");
    }
    assert_controls_served(&env, HeldSet { gated: vec![], allowed, unprotected });
}

#[test]
fn audit_mode_terminates_nothing() {
    privileged!(audit_mode_terminates_nothing);
    let mut env = Env::new("audit");
    let held = env.hold("gated/pod-a", &["hold-tcp", IMDS_V4, "80"]).expect("hold tcp");
    env.start_agent();
    let line = env
        .agent()
        .find(|v| v["message"] == "established connection left open (audit mode)")
        .expect("audit event for the held connection");
    assert_eq!(line["cgroup"], "pod-a", "{line}");
    assert_eq!(line["dst"], IMDS_V4, "{line}");
    assert!(env.agent().find(|v| v["message"] == "terminated established connection").is_none());
    let t = token("audit-held");
    let o = held.send(&t).expect("held result");
    assert!(o.ok, "audit mode cut a connection: {o:?}");
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)));
}

/// As shipped (cluster mode, the agent sharing the node's pid namespace as the DaemonSet's
/// hostPID gives it): a pod-network pod's connection, in the pod's own network namespace,
/// is seen and destroyed, and status says what the scan could see.
#[test]
fn cluster_mode_sees_pod_network_namespaces() {
    privileged!(cluster_mode_sees_pod_network_namespaces);
    let mut c = super::cluster::cluster();
    let pod = integration_tests::net::PodNet::new(&c.env.net).expect("pod netns");
    let web = c.env.cgroup(&c.web);
    let held = Held::start_in(&c.env.bins, &pod.path(), &web, &["hold-tcp", IMDS_V4, "80"])
        .expect("the pod's connection, before the agent");
    c.start();
    let o = held.send(&token("pod-held")).expect("held result");
    assert!(!o.ok, "the pod's pre-existing connection survived: {o:?}");
    let summary =
        c.env.agent().find(|v| v["message"] == "established connections checked").expect("summary");
    assert!(summary["destroyed"].as_u64() >= Some(1), "{summary}");
    assert!(summary["netns"].as_u64() >= Some(2), "the node's and the pod's: {summary}");
    assert_eq!(summary["hidden"], 0, "{summary}");
    let s = super::status(&c.env);
    assert_eq!(s["terminate_established"], "on", "{s}");
    assert!(s["terminate_scan"]["netns"].as_u64() >= Some(2), "{s}");
}
