//! The metadata proxy: a workload narrowed to paths (and every workload, where the policy
//! has `served`) reaches exactly those paths, through the agent's proxy; every other path is
//! refused there and never reaches the service; the way to the proxy is the kernel's only.
use std::time::Duration;

use integration_tests::{
    agent::Agent,
    net::{IMDS_V4, IMDS_V6, NODE_V4, PodNet, sysctl},
    probe::{self, Outcome, token},
};

use super::{EPERM, Env, INSTANCE_ID, policy};

mod audit;
mod budgets;
mod cluster_mode;
mod handshake;
mod hooks;
mod sdk;

const PROXY_V6: &str = "fd00:ec2::1";
const PROXY_PORT: &str = "9254";
const ECONNREFUSED: i32 = 111;

/// csi-node reads its instance id and placement; every other gated workload (`served`) its
/// region; cloud-agent keeps the whole service.
fn proxy_policy() -> String {
    policy("enforce")
        + "  - {name: csi-node, cgroup: \"csi-node\", \
           paths: [/latest/meta-data/instance-id, /latest/meta-data/placement/]}\n\
           served: {paths: [/latest/meta-data/placement/region]}\n"
}

/// (cgroup, address, path, served with the gate, run in the kernel VMs too)
///
/// In the kernel VMs (emulated, ten times slower and more) a case per family and kind of
/// caller, served and refused: what depends on the kernel. The rest of the path matrix is
/// the proxy's own, proven natively and by its unit and property tests.
const CASES: &[(&str, &str, &str, bool, bool)] = &[
    ("gated/csi-node", IMDS_V4, "/latest/meta-data/instance-id", true, true),
    ("gated/csi-node", IMDS_V6, "/latest/meta-data/placement/region", true, true),
    ("gated/csi-node", IMDS_V4, "/latest/meta-data/placement", true, false),
    ("gated/csi-node", IMDS_V4, "/latest/meta-data/iam/security-credentials/", false, true),
    ("gated/csi-node", IMDS_V4, "/latest/meta-data/placementX", false, false),
    ("gated/csi-node", IMDS_V6, "/latest/meta-data/%2e%2e/user-data", false, false),
    ("gated/pod-a", IMDS_V4, "/latest/meta-data/placement/region", true, true),
    ("gated/pod-a", IMDS_V4, "/latest/meta-data/instance-id", false, true),
    ("gated/pod-a", IMDS_V4, "/latest/user-data", false, false),
    ("gated/cloud-agent", IMDS_V4, "/latest/meta-data/iam/security-credentials/", true, false),
];

/// The cases of this run (see [`CASES`]).
fn cases() -> impl Iterator<Item = (&'static str, &'static str, &'static str, bool)> {
    let vm = integration_tests::sys::slowdown() > 1;
    CASES
        .iter()
        .filter(move |c| !vm || c.4)
        .map(|&(cg, addr, path, served, _)| (cg, addr, path, served))
}

/// The agent with its metadata proxy on the node's test addresses, in the test cgroup
/// `cgroup` (relative to the tree's base; below `gated/` as the DaemonSet's pod is).
fn proxy_agent(env: &Env, cgroup: &str) -> Agent {
    proxy_agent_with(env, cgroup, &[])
}

/// [`proxy_agent`] with more `run` arguments.
fn proxy_agent_with(env: &Env, cgroup: &str, more: &[&str]) -> Agent {
    let mut extra =
        vec!["--proxy-address", NODE_V4, "--proxy-address", PROXY_V6, "--proxy-port", PROXY_PORT];
    extra.extend_from_slice(more);
    let agent = Agent::start_in_cgroup(
        &env.bins,
        &env.net.node_path(),
        &env.policy_file,
        &env.cg.gated(),
        &env.cgroup(cgroup),
        &extra,
    );
    agent.expect("agent ready")
}

/// A test world for the proxy: the cgroups `gated/csi-node` (allowed, narrowed to paths) and
/// `gated/agent` (where the agent runs), `more`, and [`proxy_policy`] in the policy file.
fn proxy_env(more: &[&str]) -> Env {
    let env = Env::new("enforce");
    for c in ["gated/csi-node", "gated/agent"].iter().chain(more) {
        env.cg.create(c).expect("cgroup");
    }
    std::fs::write(&env.policy_file, proxy_policy()).expect("policy file");
    env
}

/// The counter `name=N` of a probe's report.
fn count(reply: &str, name: &str) -> u64 {
    reply
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {reply:?}"))
}

fn http(env: &Env, cgroup: &str, addr: &str, path: &str) -> (String, Outcome) {
    let t = token("http");
    (t.clone(), env.probe(cgroup, &["http", addr, "80", &t, path]))
}

#[test]
fn served_paths_go_through_the_proxy_and_nothing_else_does() {
    privileged!(served_paths_go_through_the_proxy_and_nothing_else_does);
    let mut env = Env::new("enforce");
    // The agent inside the gated root, as the DaemonSet's pod is under kubepods: its own
    // connects to the service must pass, and never come back to its proxy.
    for c in ["gated/csi-node", "gated/agent", "ungated"] {
        env.cg.create(c).expect("cgroup");
    }
    std::fs::write(&env.policy_file, proxy_policy()).expect("policy file");
    // Without the gate every path reaches the service, from every workload.
    for (cgroup, addr, path, _) in cases() {
        let (t, o) = http(&env, cgroup, addr, path);
        assert!(o.reply.as_deref().is_some_and(|r| r.contains(INSTANCE_ID)), "{path}: {o:?}");
        assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "{cgroup} {path}: no token");
    }
    env.agent = Some(proxy_agent(&env, "gated/agent"));

    for (cgroup, addr, path, served) in cases() {
        let (t, o) = http(&env, cgroup, addr, path);
        let reply = o.reply.clone().unwrap_or_default();
        // The application sees the address it asked for, whichever way it went.
        let peer = if addr.contains(':') { format!("[{addr}]:80") } else { format!("{addr}:80") };
        assert!(reply.starts_with(&format!("peer={peer}\n")), "{cgroup} {path}: {o:?}");
        if served {
            assert!(reply.contains(" 200 ") && reply.contains(INSTANCE_ID), "{path}: {o:?}");
            assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "{cgroup} {path}: no token");
        } else {
            assert!(reply.contains(" 403 "), "{cgroup} {path} not refused: {o:?}");
            let entry = if cgroup == "gated/csi-node" { "csi-node" } else { "served" };
            assert!(reply.contains(entry), "the refusal names no entry: {o:?}");
            assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "{path} reached the IMDS");
        }
    }

    // A connection to the proxy that no kernel program sent there carries no record: closed
    // without a byte, whatever it asks.
    let t = token("norecord");
    let o =
        env.probe("ungated", &["http", NODE_V4, PROXY_PORT, &t, "/latest/meta-data/instance-id"]);
    assert!(!o.reply.as_deref().is_some_and(|r| r.contains("HTTP/")), "answered: {o:?}");
    assert!(
        !env.imds.wait_for(&t, Duration::from_millis(300)),
        "a connection without a record got through"
    );

    // The proxy's port is the agent's in the gated root, on every address.
    let o = env.probe("gated/pod-a", &["bind", "127.0.0.1", PROXY_PORT]);
    assert_eq!((o.ok, o.errno), (false, Some(EPERM)), "a gated workload took the port: {o:?}");
    let o = env.probe("gated/pod-a", &["bind", "127.0.0.1", "9255"]);
    assert!(o.ok, "another port: {o:?}");
    let o = env.probe("ungated", &["bind", "127.0.0.1", PROXY_PORT]);
    assert!(o.ok, "outside the gated root the port is free: {o:?}");

    // Proxy down: redirected connects fail at once and never reach the service directly.
    env.agent.as_mut().expect("agent").kill();
    let (t, o) = http(&env, "gated/csi-node", IMDS_V4, "/latest/meta-data/instance-id");
    assert_eq!((o.ok, o.errno, o.stage.as_str()), (false, Some(ECONNREFUSED), "connect"), "{o:?}");
    assert!(o.elapsed_us < 500_000, "took {} us: {o:?}", o.elapsed_us);
    assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "reached the IMDS direct");
    let o = env.probe("gated/pod-a", &["bind", "127.0.0.1", PROXY_PORT]);
    assert_eq!(o.errno, Some(EPERM), "the port is held while the agent is down: {o:?}");
}

/// The proxy keeps its connection to the metadata service for the next request, as the
/// service keeps it (HTTP/1.1 without `Connection: close`): sequential served requests, each a
/// connection of its own from the workload, reach the service over one.
#[test]
fn served_requests_reuse_one_connection_to_the_service() {
    privileged!(served_requests_reuse_one_connection_to_the_service);
    let mut env = proxy_env(&[]);
    env.agent = Some(proxy_agent(&env, "gated/agent"));
    let before = env.imds.accepted();
    for _ in 0..10 {
        let (t, o) = http(&env, "gated/csi-node", IMDS_V4, "/latest/meta-data/instance-id");
        let reply = o.reply.clone().unwrap_or_default();
        assert!(reply.contains(" 200 ") && reply.contains(INSTANCE_ID), "{o:?}");
        assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "no token");
    }
    assert_eq!(env.imds.accepted() - before, 1, "ten served requests, one connection");
}

/// A pod-network workload (its own namespace behind the node, which forwards and
/// masquerades its traffic) on an instance whose metadata service keeps hop limit 1: the
/// service's replies die at the node's forwarding, so the pod cannot reach it directly, with
/// or without the gate. Through the proxy, one hop from the service on the node, it is
/// served its paths (IPv4 and IPv6), and refused the rest. The agent runs outside the
/// gated root here (its sock_ops program on its own cgroup).
#[test]
fn a_pod_network_workload_is_served_its_paths_under_hop_limit_1() {
    privileged!(a_pod_network_workload_is_served_its_paths_under_hop_limit_1);
    let mut env = Env::new("enforce");
    env.cg.create("agent").expect("cgroup");
    std::fs::write(&env.policy_file, proxy_policy()).expect("policy file");
    let pod = PodNet::new(&env.net).expect("pod netns");
    let in_pod = |env: &Env, path: &str, addr: &str| {
        let t = token("hop");
        let cg = env.cgroup("gated/pod-a");
        let o = probe::run_in(&env.bins, &pod.path(), &cg, &["http", addr, "80", &t, path]);
        (t, o.expect("probe ran"))
    };
    // A control: before the hop limit, the pod reaches the service directly.
    let (t, o) = in_pod(&env, "/latest/meta-data/placement/region", IMDS_V4);
    assert!(o.reply.as_deref().is_some_and(|r| r.contains(INSTANCE_ID)), "{o:?}");
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)));
    sysctl(
        &env.net.imds,
        &[
            "net.ipv4.ip_default_ttl=1",
            "net.ipv6.conf.all.hop_limit=1",
            "net.ipv6.conf.vimds.hop_limit=1",
        ],
    )
    .expect("hop limit 1");
    // Hop limit 1, no gate: the request arrives, the reply never comes back.
    let (_, o) = in_pod(&env, "/latest/meta-data/placement/region", IMDS_V4);
    assert!(
        !o.reply.as_deref().is_some_and(|r| r.contains(INSTANCE_ID)),
        "hop limit 1 did not hold: {o:?}"
    );

    env.agent = Some(proxy_agent(&env, "agent"));
    for addr in [IMDS_V4, IMDS_V6] {
        let (t, o) = in_pod(&env, "/latest/meta-data/placement/region", addr);
        let reply = o.reply.clone().unwrap_or_default();
        assert!(reply.contains(" 200 ") && reply.contains(INSTANCE_ID), "{addr}: {o:?}");
        assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "{addr}: no token");
        let (t, o) = in_pod(&env, "/latest/meta-data/iam/security-credentials/", addr);
        assert!(o.reply.as_deref().is_some_and(|r| r.contains(" 403 ")), "{addr}: {o:?}");
        assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "{addr}: reached the IMDS");
    }
}
