//! The agent's connection budgets under attack by an ordinary pod: idle connections to the
//! probe listener must not take the agent's descriptors (its kubelet probe, its proxy), a
//! host-network pod (on the node's address, as the kubelet is) must not take the kubelet's
//! slots, and a pod of many containers holding silent connections to the proxy gets one
//! pod's slots, not a slot per container.
use std::{net::TcpListener, time::Duration};

use integration_tests::{
    agent::{free_port, metric},
    net::{IMDS_V4, NODE_V4, PodNet},
    probe::Held,
    sys::in_netns,
};

use super::{Env, INSTANCE_ID, count, http, proxy_agent, proxy_agent_with, proxy_env};

const ID: &str = "/latest/meta-data/instance-id";
const REGION: &str = "/latest/meta-data/placement/region";

/// `cgroup`'s GET of `path` from the metadata service answered 200 (by the proxy or, without
/// the agent, by the service).
fn answered(env: &Env, cgroup: &str, path: &str) -> bool {
    let (_, o) = http(env, cgroup, IMDS_V4, path);
    o.reply.as_deref().is_some_and(|r| r.contains(" 200 "))
}

fn metrics(env: &Env) -> String {
    env.agent().http_get("/metrics").expect("metrics").1
}

/// Hold the agent to the open-file limit containerd gives a container, soft and hard (so
/// that raising the soft limit at start gains nothing): only the listeners' budget keeps
/// its descriptors.
fn limit_open_files(pid: u32, n: u64) {
    let limit = libc::rlimit { rlim_cur: n, rlim_max: n };
    // SAFETY: prlimit(2) on a process this test started, with a local struct.
    let rc = unsafe {
        libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NOFILE, &limit, std::ptr::null_mut())
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// A pod that reaches the node's address holds a thousand idle connections to the agent's
/// probe listener, which listens on every address as the DaemonSet's does, while the agent
/// may open 1 024 files in all. The listener keeps 8 from one peer and closes the rest at
/// once: the kubelet's probe on the node is answered and the proxy serves csi-node
/// throughout. Without the agent the pod's thousand connections reach whatever listens there.
#[test]
fn idle_connections_to_the_probe_listener_starve_neither_probe_nor_proxy() {
    privileged!(idle_connections_to_the_probe_listener_starve_neither_probe_nor_proxy);
    let mut env = proxy_env(&[]);
    let pod = PodNet::new(&env.net).expect("pod netns");
    let port = free_port().expect("port").to_string();
    let flood = |env: &Env| {
        let cg = env.cgroup("gated/pod-a");
        Held::start_in(&env.bins, &pod.path(), &cg, &["hold-many", NODE_V4, &port, "1000"])
            .expect("hold-many")
    };
    // Without the agent: a listener on that port with no budget (what the agent's was) takes
    // the pod's thousand connections, a descriptor each.
    let addr = format!("{NODE_V4}:{port}");
    let listener = in_netns(&env.net.node_path(), || Ok(TcpListener::bind(&addr)?)).expect("bind");
    let taker = std::thread::spawn(move || {
        let mut kept = Vec::new();
        while kept.len() < 1000 {
            match listener.accept() {
                Ok((s, _)) => kept.push(s),
                Err(_) => break,
            }
        }
        kept.len()
    });
    let o = flood(&env).send("stop").expect("flood");
    assert_eq!(count(o.reply.as_deref().unwrap_or(""), "connected"), 1000, "{o:?}");
    assert_eq!(taker.join().expect("listener thread"), 1000, "descriptors the listener took");

    let listen = format!("0.0.0.0:{port}");
    env.agent = Some(proxy_agent_with(&env, "gated/agent", &["--listen", &listen]));
    limit_open_files(env.agent().pid().expect("agent pid"), 1024);
    let held = flood(&env);
    for _ in 0..10 {
        let (code, _) = env.agent().http_get("/healthz").expect("the kubelet's probe");
        assert_eq!(code, 200, "healthz during the flood");
        assert!(answered(&env, "gated/csi-node", ID), "csi-node not served during the flood");
        std::thread::sleep(Duration::from_millis(200));
    }
    let o = held.send("stop").expect("flood");
    let reply = o.reply.clone().unwrap_or_default();
    eprintln!("probe listener flood: {reply}");
    assert_eq!(count(&reply, "connected"), 1000, "{o:?}");
    let m = metrics(&env);
    let refused = metric(
        &m,
        "metadata_gate_listener_connections_refused_total{listener=\"probes\",reason=\"busy_peer\"}",
    );
    assert!(refused.unwrap_or(0.0) >= 900.0, "busy_peer refusals: {refused:?}\n{m}");
}

/// A host-network pod of 32 containers holds 8 idle connections from each to the probe
/// listener: 256, from the node's address, where the kubelet's probes come from too. The
/// pod's containers get the 224 slots pods may hold; the kubelet's probe, from the same
/// address but a cgroup outside the gated root, is answered from the 32 kept for the node.
/// Given by address (as they were), the pod's first 8 connections would have taken every
/// slot of that address, and the kubelet's probe would fail until the kubelet restarted the
/// agent. Without the agent every connection reaches the port.
#[test]
fn a_host_network_pod_cannot_take_the_kubelets_probe_slots() {
    privileged!(a_host_network_pod_cannot_take_the_kubelets_probe_slots);
    const CONTAINERS: usize = 32;
    let mut env = Env::new("enforce");
    let containers: Vec<String> = (0..CONTAINERS).map(|i| format!("gated/pod-a/c{i}")).collect();
    for c in &containers {
        env.cg.create(c).expect("container cgroup");
    }
    let port = free_port().expect("port").to_string();
    // The node's network namespace: each container connects from the node's address.
    let hold_all = |env: &Env| -> Vec<Held> {
        std::thread::scope(|s| {
            let held: Vec<_> = containers
                .iter()
                .map(|c| s.spawn(|| env.hold(c, &["hold-many", NODE_V4, &port, "8"])))
                .collect();
            held.into_iter().map(|h| h.join().expect("holder").expect("hold-many")).collect()
        })
    };
    let release = |held: Vec<Held>| -> u64 {
        held.into_iter()
            .map(|h| {
                count(h.send("stop").expect("held").reply.as_deref().unwrap_or(""), "connected")
            })
            .sum()
    };
    let kubelet = format!("{NODE_V4}:{port}");

    // Without the agent: a listener there takes every connection, and the kubelet's.
    let listener =
        in_netns(&env.net.node_path(), || Ok(TcpListener::bind(&kubelet)?)).expect("bind");
    let taker = std::thread::spawn(move || {
        (0..=CONTAINERS * 8).take_while(|_| listener.accept().is_ok()).count()
    });
    let held = hold_all(&env);
    let o = in_netns(&env.net.node_path(), || Ok(std::net::TcpStream::connect(&kubelet)?));
    assert!(o.is_ok(), "the kubelet's connect without the agent: {o:?}");
    assert_eq!(taker.join().expect("listener thread"), CONTAINERS * 8 + 1);
    assert_eq!(release(held), (CONTAINERS * 8) as u64, "connections without the agent");

    let listen = format!("0.0.0.0:{port}");
    env.start_agent_with(&["--listen", &listen]);
    let held = hold_all(&env);
    // Within the header-read timeout (5 s), every slot the pod got is still held.
    for _ in 0..5 {
        let (code, _) = env.agent().http_get_at(&kubelet, "/healthz").expect("the kubelet's probe");
        assert_eq!(code, 200, "the kubelet's probe beside the host-network pod");
    }
    let m = metrics(&env);
    assert_eq!(release(held), (CONTAINERS * 8) as u64, "the pod's connects");
    let busy = metric(
        &m,
        "metadata_gate_listener_connections_refused_total{listener=\"probes\",reason=\"busy\"}",
    );
    eprintln!("host-network pod: {} connects, refused busy: {busy:?}", CONTAINERS * 8);
    assert!(busy.unwrap_or(0.0) >= 1.0, "the pod never filled the pods' share: {busy:?}\n{m}");
}

/// A `served` pod asks for its region 20 times in a row: the proxy serves its burst (10)
/// and perhaps a request a second after it, and answers the rest 429 with `Retry-After`,
/// without sending them on. The allow-listed csi-node beside it is served every time, and the
/// 429s are counted for the pod. Without the agent all 20 reach the service.
#[test]
fn a_pod_over_its_rate_gets_429_and_csi_node_is_served_beside_it() {
    privileged!(a_pod_over_its_rate_gets_429_and_csi_node_is_served_beside_it);
    const ASKED: usize = 20;
    let mut env = proxy_env(&["gated/pod-b"]);
    let ask = |env: &Env| -> Vec<String> {
        (0..ASKED)
            .map(|_| {
                let (_, o) = http(env, "gated/pod-b", IMDS_V4, REGION);
                let reply = o.reply.unwrap_or_default();
                let mut words = reply.split_whitespace().skip_while(|w| !w.starts_with("HTTP/"));
                words.nth(1).unwrap_or("none").to_owned()
            })
            .collect()
    };
    let direct = ask(&env);
    assert!(direct.iter().all(|s| s == "200"), "without the agent: {direct:?}");

    env.agent = Some(proxy_agent(&env, "gated/agent"));
    let started = std::time::Instant::now();
    let statuses = ask(&env);
    let elapsed = started.elapsed().as_secs();
    let served = statuses.iter().filter(|s| *s == "200").count();
    let limited = statuses.iter().filter(|s| *s == "429").count();
    eprintln!("{ASKED} asked in {elapsed} s: {served} served, {limited} answered 429");
    assert_eq!(served + limited, ASKED, "{statuses:?}");
    assert!(served >= 10, "the burst: {statuses:?}");
    // The burst, and one a second after it.
    assert!(served as u64 <= 10 + elapsed + 1, "{served} served in {elapsed} s: {statuses:?}");
    assert!(limited >= 1, "{statuses:?}");
    let (_, o) = http(&env, "gated/pod-b", IMDS_V4, REGION);
    let reply = o.reply.clone().unwrap_or_default();
    if reply.contains(" 429 ") {
        assert!(reply.to_ascii_lowercase().contains("retry-after: "), "{reply}");
        assert!(reply.contains("over the rate of served"), "{reply}");
    }
    for _ in 0..5 {
        assert!(answered(&env, "gated/csi-node", ID), "csi-node beside the limited pod");
    }
    let m = metrics(&env);
    let counted =
        metric(&m, "metadata_gate_proxy_requests_total{verdict=\"refused\",reason=\"rate\"}");
    assert!(counted.unwrap_or(0.0) >= limited as f64, "{counted:?}\n{m}");
    assert!(m.contains("metadata_gate_proxy_rate_limited_total{workload=\""), "{m}");
}

/// A pod of 64 containers, each holding 16 silent connections to the metadata service (the
/// kernel sends them to the proxy), holds 16 of the proxy's slots, its pod's: another served
/// pod and the allow-listed csi-node are served meanwhile, and the refusals are counted as
/// `busy` (the pod's own limit). Without the agent all 1 024 reach the service.
#[test]
fn a_pod_of_many_containers_holds_one_pods_proxy_slots() {
    privileged!(a_pod_of_many_containers_holds_one_pods_proxy_slots);
    const CONTAINERS: usize = 64;
    let mut env = proxy_env(&["gated/pod-b"]);
    let containers: Vec<String> = (0..CONTAINERS).map(|i| format!("gated/pod-a/c{i}")).collect();
    for c in &containers {
        env.cg.create(c).expect("container cgroup");
    }
    let hold_all = |env: &Env| -> Vec<Held> {
        containers
            .iter()
            .map(|c| env.hold(c, &["hold-many", IMDS_V4, "80", "16"]).expect("hold-many"))
            .collect()
    };
    let release = |held: Vec<Held>| -> u64 {
        held.into_iter()
            .map(|h| {
                let o = h.send("stop").expect("held");
                count(o.reply.as_deref().unwrap_or(""), "connected")
            })
            .sum()
    };
    // Without the agent: every container's connections reach the service, and pod-b is served.
    let held = hold_all(&env);
    assert!(answered(&env, "gated/pod-b", REGION), "pod-b without the agent");
    assert_eq!(release(held), (CONTAINERS * 16) as u64, "connections without the agent");

    env.agent = Some(proxy_agent(&env, "gated/agent"));
    let held = hold_all(&env);
    // Within the header-read timeout (5 s) every slot the pod holds stays held.
    assert!(answered(&env, "gated/pod-b", REGION), "pod-b not served beside the full pod");
    let (_, o) = http(&env, "gated/csi-node", IMDS_V4, ID);
    let reply = o.reply.clone().unwrap_or_default();
    assert!(reply.contains(" 200 ") && reply.contains(INSTANCE_ID), "csi-node: {o:?}");
    let m = metrics(&env);
    let busy = metric(&m, "metadata_gate_proxy_connections_refused_total{reason=\"busy\"}");
    let connected = release(held);
    eprintln!("{CONTAINERS} containers: {connected} connects; refused busy: {busy:?}");
    // Every connect the kernel let through beyond the pod's 16 slots was turned away as the
    // pod's, none as the node's.
    assert!(busy.unwrap_or(0.0) >= connected.saturating_sub(16) as f64, "{m}");
    for reason in ["busy_node", "busy_served"] {
        let name = format!("metadata_gate_proxy_connections_refused_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&m, &name), Some(0.0), "{reason}: {m}");
    }
}
