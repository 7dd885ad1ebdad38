//! The way to the proxy under attack by an ordinary pod: handshakes that never reach the
//! proxy's side must not lock other workloads out (each leaves a caller record waiting in
//! the kernel), and a DNAT of the proxy's address must not hand a redirected connection to
//! whoever listens behind it.
use std::time::{Duration, Instant};

use integration_tests::{
    agent::metric,
    net::{IMDS_V4, NODE_V4, PodNet, nft},
    probe::{Held, token},
    sys::slow,
};

use super::{Env, INSTANCE_ID, PROXY_PORT, count, http, proxy_agent, proxy_env};

const ID: &str = "/latest/meta-data/instance-id";

fn served(env: &Env, cgroup: &str) -> bool {
    let (_, o) = http(env, cgroup, IMDS_V4, ID);
    o.reply.as_deref().is_some_and(|r| r.contains(" 200 ") && r.contains(INSTANCE_ID))
}

fn metrics(env: &Env) -> String {
    env.agent().http_get("/metrics").expect("metrics").1
}

/// A flood of connects whose last ACK the client delays and whose socket it resets at once
/// (TCP_DEFER_ACCEPT, SO_LINGER {1, 0}; no capability): the proxy's side never completes
/// any of them. Each record leaves the kernel's table when its socket closes, so the table
/// never fills and the allow-listed csi-node is served throughout.
#[test]
fn an_orphan_handshake_flood_locks_no_other_workload_out() {
    privileged!(an_orphan_handshake_flood_locks_no_other_workload_out);
    let mut env = proxy_env(&[]);
    // Without the gate: the flood's connects reach the service, and csi-node is served.
    let flood = env.hold("gated/pod-a", &["orphan-flood", IMDS_V4, "80"]).expect("flood");
    std::thread::sleep(Duration::from_millis(300));
    let o = flood.send("stop").expect("flood result");
    assert!(count(o.reply.as_deref().unwrap_or(""), "connected") > 0, "{o:?}");
    assert!(served(&env, "gated/csi-node"));

    env.agent = Some(proxy_agent(&env, "gated/agent"));
    let flood = env.hold("gated/pod-a", &["orphan-flood", IMDS_V4, "80"]).expect("flood");
    // Long enough for the flood to outnumber the table (65 536 records) several times over
    // had its records stayed: natively it makes 10 000 to 40 000 a second.
    let start = Instant::now();
    let mut asked = 0;
    while start.elapsed() < slow(Duration::from_secs(8)) {
        assert!(served(&env, "gated/csi-node"), "csi-node not served during the flood");
        asked += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    let o = flood.send("stop").expect("flood result");
    let reply = o.reply.clone().unwrap_or_default();
    let connected = count(&reply, "connected");
    eprintln!("flood: {reply}; csi-node served {asked} of {asked}");
    assert!(connected > 0, "the flood reached nothing: {o:?}");
    let m = metrics(&env);
    // Every record left with its socket: none ever lacked room.
    assert_eq!(metric(&m, "metadata_gate_proxy_records_lost_total"), Some(0.0), "{m}");
}

/// A pod with NET_ADMIN in its own namespace drops its handshakes' last ACKs and keeps the
/// sockets: its records stay in the kernel's table. It gets 64 of them (the quota of a
/// workload), its further connects to the proxy fail at once with EPERM, and the
/// allow-listed csi-node is served meanwhile.
#[test]
fn a_pod_holding_handshakes_is_held_to_its_quota() {
    privileged!(a_pod_holding_handshakes_is_held_to_its_quota);
    let mut env = proxy_env(&[]);
    let pod = PodNet::new(&env.net).expect("pod netns");
    // The pod's own rule: the handshake's last ACK (every bare segment to the proxy's port
    // after the SYN) is dropped; its FIN goes, so that closing lets the proxy's side finish.
    nft(
        &pod.name,
        &format!(
            "table inet mg_ack {{
                chain out {{
                    type filter hook output priority 0; policy accept;
                    tcp dport {PROXY_PORT} tcp flags & (syn | fin | rst) == 0 drop
                }}
            }}"
        ),
    )
    .expect("nft in the pod");
    let hold = |env: &Env| {
        let cg = env.cgroup("gated/pod-a");
        Held::start_in(&env.bins, &pod.path(), &cg, &["hold-many", IMDS_V4, "80", "200"])
            .expect("hold-many")
    };
    // Without the gate: the pod holds 200 connections to the service.
    let o = hold(&env).send("stop").expect("held");
    assert_eq!(count(o.reply.as_deref().unwrap_or(""), "connected"), 200, "{o:?}");

    env.agent = Some(proxy_agent(&env, "gated/agent"));
    let held = hold(&env);
    assert!(served(&env, "gated/csi-node"), "csi-node not served while the pod holds its quota");
    let o = held.send("stop").expect("held");
    let reply = o.reply.clone().unwrap_or_default();
    eprintln!("hold-many behind the gate: {reply}");
    assert_eq!(count(&reply, "connected"), 64, "{o:?}");
    assert_eq!(count(&reply, "eperm"), 136, "{o:?}");
    let m = metrics(&env);
    assert!(
        metric(&m, "metadata_gate_proxy_handshakes_over_quota_total").unwrap_or(0.0) >= 136.0,
        "{m}"
    );
    // Its sockets closed (their FIN completes the proxy's side): the pod has its quota back.
    std::thread::sleep(slow(Duration::from_millis(500)));
    let again = hold(&env);
    let o = again.send("stop").expect("held");
    assert_eq!(count(o.reply.as_deref().unwrap_or(""), "connected"), 64, "{o:?}");
}

/// A DNAT of the proxy's address and port (here an nft rule in the node's namespace; a
/// hostPort's or a Service externalIP's works the same) sends connections to a listener that
/// answers with forged metadata. A connection the kernel redirected to the proxy is dropped
/// rather than delivered there: the served workload gets no answer, never a forged one.
#[test]
fn a_dnat_of_the_proxys_address_diverts_no_redirected_connection() {
    privileged!(a_dnat_of_the_proxys_address_diverts_no_redirected_connection);
    let mut env = proxy_env(&["ungated"]);
    nft(
        &env.net.node,
        &format!(
            "table ip mg_divert {{
                chain out {{
                    type nat hook output priority -100; policy accept;
                    tcp dport {PROXY_PORT} dnat to {NODE_V4}:9300
                }}
            }}"
        ),
    )
    .expect("nft dnat in the node");
    let marker = token("forged");
    let forge = |env: &Env| {
        env.hold("gated/pod-a", &["hold-forge", NODE_V4, "9300", &marker]).expect("forge")
    };
    // Without the gate: a connection to the proxy's address and port reaches the forger.
    let f = forge(&env);
    let o = env.probe("ungated", &["http", NODE_V4, PROXY_PORT, &token("t"), ID]);
    assert!(o.reply.as_deref().is_some_and(|r| r.contains(&marker)), "no diversion: {o:?}");
    f.send("stop").expect("forge result");

    env.agent = Some(proxy_agent(&env, "gated/agent"));
    let f = forge(&env);
    let (t, o) = http(&env, "gated/csi-node", IMDS_V4, ID);
    assert!(!o.reply.as_deref().is_some_and(|r| r.contains(&marker)), "forged answer: {o:?}");
    assert!(!o.ok, "answered: {o:?}");
    assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "reached the service direct");
    let o = f.send("stop").expect("forge result");
    assert_eq!(o.reply.as_deref(), Some("accepted=0"), "the forger got a connection: {o:?}");
    let m = metrics(&env);
    assert!(metric(&m, "metadata_gate_proxy_diverted_packets_total").unwrap_or(0.0) >= 1.0, "{m}");
}
