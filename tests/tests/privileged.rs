//! Privileged kernel tests: real sockets in real network namespaces and cgroups, against the
//! real gate-agent binary. Root only; run with `--test-threads=1` (`cargo xtask test` does):
//! every test loads programs into the kernel.
//!
//! Every refusal is paired with proof that the token never reached the fake metadata
//! service, and with a positive control where one makes sense, so no test passes vacuously.
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use integration_tests::{
    agent::{Agent, run_to_end},
    cgroups::CgroupTree,
    imds::{FakeImds, INSTANCE_ID},
    net::{DNS_V4, DNS_V6, IMDS_V4, IMDS_V6, NTP_V4, TestNet},
    probe::{self, Held, Outcome, token},
};

const EPERM: i32 = 1;

fn policy(mode: &str) -> String {
    format!(
        r#"platform: AWS
mode: {mode}
endpoints:
  - {{name: ec2-imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}}
  - {{name: ec2-imds-udp-test, cidr: 169.254.169.254/32, ports: [80], protocols: [UDP]}}
  - {{name: ec2-imds-v6, cidr: "fd00:ec2::254/128", ports: [80]}}
allow:
  - {{name: cloud-agent, cgroup: "cloud-agent"}}
"#
    )
}

/// One test's world. Field order is drop order: the agent goes first.
struct Env {
    agent: Option<Agent>,
    imds: FakeImds,
    net: TestNet,
    cg: CgroupTree,
    policy_file: PathBuf,
}

impl Env {
    /// Network, fake IMDS, cgroups `gated/{pod-a,cloud-agent/nested}` and `outside`; no agent.
    fn new(mode: &str) -> Env {
        let net = TestNet::new().expect("test network");
        let imds = FakeImds::start(&net).expect("fake IMDS");
        let cg = CgroupTree::new().expect("cgroup tree");
        for c in ["gated/pod-a", "gated/cloud-agent/nested"] {
            cg.create(c).expect("cgroup");
        }
        let policy_file = cg_policy_path(&cg);
        std::fs::write(&policy_file, policy(mode)).expect("policy file");
        Env { agent: None, imds, net, cg, policy_file }
    }

    fn with_agent(mode: &str) -> Env {
        let mut env = Env::new(mode);
        env.start_agent();
        env
    }

    fn start_agent(&mut self) {
        self.agent = Some(Agent::start(&self.policy_file, &self.cg.gated()).expect("agent ready"));
    }

    fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("agent started")
    }

    fn cgroup(&self, rel: &str) -> PathBuf {
        self.cg.base.join(rel)
    }

    fn probe(&self, cgroup: &str, args: &[&str]) -> Outcome {
        probe::run(&self.net, &self.cgroup(cgroup), args).expect("probe ran")
    }

    /// `cmd` to addr:port from `cgroup` is refused with EPERM at `stage`, at once, and the
    /// token never reaches the service.
    fn assert_refused(&self, cgroup: &str, cmd: &str, addr: &str, port: &str, stage: &str) {
        let t = token(cmd);
        let o = self.probe(cgroup, &[cmd, addr, port, &t]);
        assert!(!o.ok, "{cmd} {addr}:{port} from {cgroup} got through: {o:?}");
        assert_eq!(o.errno, Some(EPERM), "{cmd} {addr}:{port} from {cgroup}: {o:?}");
        assert_eq!(o.stage, stage, "{cmd} {addr}:{port} from {cgroup}: {o:?}");
        // EPERM comes from the hook itself; a drop would surface as a timeout after seconds.
        // This tells the two apart; it is not a speed assertion.
        assert!(o.elapsed_us < 500_000, "refusal took {} us: {o:?}", o.elapsed_us);
        assert!(!self.imds.wait_for(&t, Duration::from_millis(300)), "token {t} reached the IMDS");
    }

    /// `cmd` from `cgroup` is served and the token reaches the service.
    fn assert_served(&self, cgroup: &str, cmd: &str, addr: &str, port: &str) {
        let t = token(cmd);
        let o = self.probe(cgroup, &[cmd, addr, port, &t]);
        assert!(o.ok, "{cmd} {addr}:{port} from {cgroup} was not served: {o:?}");
        assert!(self.imds.wait_for(&t, Duration::from_secs(2)), "token {t} never reached the IMDS");
        if cmd == "tcp" {
            assert!(o.reply.as_deref().is_some_and(|r| r.contains(INSTANCE_ID)), "{o:?}");
        }
    }
}

fn cg_policy_path(cg: &CgroupTree) -> PathBuf {
    let name = cg.base.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    std::env::temp_dir().join(format!("{name}-policy.yaml"))
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.policy_file);
    }
}

macro_rules! privileged {
    ($name:ident) => {
        if !integration_tests::sys::require_privileges(stringify!($name)) {
            return;
        }
    };
}

#[path = "privileged/cluster.rs"]
mod cluster;
#[path = "privileged/lifecycle.rs"]
mod lifecycle;

#[test]
fn harness_without_agent_serves_everything() {
    privileged!(harness_without_agent_serves_everything);
    let env = Env::new("enforce");
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");
    env.assert_served("gated/pod-a", "tcp", IMDS_V6, "80");
    env.assert_served("gated/pod-a", "udp", IMDS_V4, "80");
    env.assert_served("gated/pod-a", "raw", IMDS_V4, "80");
    let (base, ns) = (env.cg.base.clone(), env.net.node.clone());
    drop(env);
    assert!(!base.exists(), "cgroup tree left behind");
    let list = integration_tests::sys::sh("ip", &["netns", "list"]).unwrap_or_default();
    assert!(!list.contains(&ns), "netns left behind");
}

#[test]
fn tcp_v4_refused_with_eperm_allowed_served() {
    privileged!(tcp_v4_refused_with_eperm_allowed_served);
    let env = Env::with_agent("enforce");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
}

#[test]
fn tcp_v6_refused_allowed_served() {
    privileged!(tcp_v6_refused_allowed_served);
    let env = Env::with_agent("enforce");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V6, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V6, "80");
}

#[test]
fn udp_sendto_and_connected_udp_refused() {
    privileged!(udp_sendto_and_connected_udp_refused);
    let env = Env::with_agent("enforce");
    env.assert_refused("gated/pod-a", "udp", IMDS_V4, "80", "send");
    env.assert_refused("gated/pod-a", "udp-connected", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "udp", IMDS_V4, "80");
    env.assert_served("gated/cloud-agent", "udp-connected", IMDS_V4, "80");
}

#[test]
fn ipv4_mapped_ipv6_refused() {
    privileged!(ipv4_mapped_ipv6_refused);
    let env = Env::with_agent("enforce");
    let mapped = format!("::ffff:{IMDS_V4}");
    env.assert_refused("gated/pod-a", "tcp", &mapped, "80", "connect");
    env.assert_refused("gated/pod-a", "udp", &mapped, "80", "send");
    env.assert_refused("gated/pod-a", "udp-connected", &mapped, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", &mapped, "80");
}

#[test]
fn raw_socket_never_reaches_the_service() {
    privileged!(raw_socket_never_reaches_the_service);
    let env = Env::with_agent("enforce");
    let t = token("raw");
    // The egress program drops it; sendto may report EPERM or succeed, either is fine.
    let o = env.probe("gated/pod-a", &["raw", IMDS_V4, "80", &t]);
    assert!(o.ok || o.errno == Some(EPERM), "{o:?}");
    assert!(!env.imds.wait_for(&t, Duration::from_secs(1)), "raw segment {t} reached the IMDS");
    env.assert_served("gated/cloud-agent", "raw", IMDS_V4, "80");
}

#[test]
fn connections_opened_before_the_agent_are_cut_off() {
    privileged!(connections_opened_before_the_agent_are_cut_off);
    let mut env = Env::new("enforce");
    let tcp = Held::start(&env.net, &env.cgroup("gated/pod-a"), &["hold-tcp", IMDS_V4, "80"])
        .expect("hold tcp");
    let udp = Held::start(&env.net, &env.cgroup("gated/pod-a"), &["hold-udp", IMDS_V4, "80"])
        .expect("hold udp");
    let allowed =
        Held::start(&env.net, &env.cgroup("gated/cloud-agent"), &["hold-tcp", IMDS_V4, "80"])
            .expect("hold allowed");
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

#[test]
fn ipv6_extension_headers_do_not_hide_the_port() {
    privileged!(ipv6_extension_headers_do_not_hide_the_port);
    let mut env = Env::new("enforce");
    // Opened before the agent, so only the egress program, which has to walk the hop-by-hop
    // header to find the UDP port, stands between it and the service.
    let args = ["hold-udp-hbh", IMDS_V6, "80"];
    let held = Held::start(&env.net, &env.cgroup("gated/pod-a"), &args).expect("hold hbh");
    let allowed = Held::start(&env.net, &env.cgroup("gated/cloud-agent"), &args).expect("hold hbh");
    // Not destroyed at start, so the egress program is what is tested.
    env.agent = Some(
        Agent::start_with(&env.policy_file, &env.cg.gated(), &["--terminate-established=false"])
            .expect("agent ready"),
    );
    let (t1, t2) = (token("hbh"), token("hbh-allowed"));
    let o = held.send(&t1).expect("held result");
    assert!(!o.ok, "datagram with a hop-by-hop header got through: {o:?}");
    assert!(!env.imds.wait_for(&t1, Duration::from_secs(1)), "token {t1} reached the IMDS");
    let o = allowed.send(&t2).expect("allowed result");
    assert!(o.ok && env.imds.wait_for(&t2, Duration::from_secs(1)), "control not served: {o:?}");
}

#[test]
fn protected_address_on_unprotected_port_stays_open() {
    privileged!(protected_address_on_unprotected_port_stays_open);
    let env = Env::with_agent("enforce");
    // GCP-style DNS on the metadata address.
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "53");
    env.assert_served("gated/pod-a", "udp", IMDS_V4, "53");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
}

#[test]
fn neighbouring_addresses_stay_open() {
    privileged!(neighbouring_addresses_stay_open);
    let env = Env::with_agent("enforce");
    env.assert_served("gated/pod-a", "tcp", DNS_V4, "80");
    env.assert_served("gated/pod-a", "udp", NTP_V4, "123");
    env.assert_served("gated/pod-a", "tcp", DNS_V6, "80");
}

#[test]
fn nested_and_late_cgroups_under_an_allowed_one_are_allowed() {
    privileged!(nested_and_late_cgroups_under_an_allowed_one_are_allowed);
    let env = Env::with_agent("enforce");
    env.assert_served("gated/cloud-agent/nested", "tcp", IMDS_V4, "80");
    // Created after the agent is ready: allowed from its first syscall by the ancestor walk.
    env.cg.create("gated/cloud-agent/late/deeper").expect("late cgroup");
    env.assert_served("gated/cloud-agent/late/deeper", "tcp", IMDS_V4, "80");
    // A sibling created late is still refused.
    env.cg.create("gated/pod-late").expect("late sibling");
    env.assert_refused("gated/pod-late", "tcp", IMDS_V4, "80", "connect");
}

#[test]
fn processes_outside_the_gated_root_are_not_affected() {
    privileged!(processes_outside_the_gated_root_are_not_affected);
    let env = Env::with_agent("enforce");
    env.assert_served("outside", "tcp", IMDS_V4, "80");
    env.assert_served("outside", "udp", IMDS_V4, "80");
}

#[test]
fn audit_mode_counts_and_logs_but_blocks_nothing() {
    privileged!(audit_mode_counts_and_logs_but_blocks_nothing);
    let env = Env::with_agent("audit");
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");
    let line = env
        .agent()
        .wait_log(|v| v["verdict"] == "audited" && v["cgroup"] == "pod-a", Duration::from_secs(5))
        .expect("audit log line");
    assert!(line["message"].as_str().is_some_and(|m| m.contains("blocked")), "{line}");
    let (code, metrics) = env.agent().http_get("/metrics").expect("metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.lines().any(|l| l.starts_with(
            "metadata_gate_endpoint_decisions_total{endpoint=\"ec2-imds\",verdict=\"audited\"}"
        ) && !l.ends_with(" 0")),
        "{metrics}"
    );
}

#[test]
fn each_denial_is_one_structured_log_event() {
    privileged!(each_denial_is_one_structured_log_event);
    let env = Env::with_agent("enforce");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    let line = env
        .agent()
        .wait_log(|v| v["verdict"] == "denied", Duration::from_secs(5))
        .expect("denial log line");
    assert!(line["message"].as_str().is_some_and(|m| m.contains("blocked")), "{line}");
    assert_eq!(line["cgroup"], "pod-a", "{line}");
    assert_eq!(line["dst"], IMDS_V4, "{line}");
    assert_eq!(line["port"], 80, "{line}");
    assert_eq!(line["proto"], "TCP", "{line}");
    assert_eq!(line["endpoint"], "ec2-imds", "{line}");
    assert_eq!(line["hook"], "connect4", "{line}");
    assert!(line["pid"].as_u64().is_some_and(|p| p > 0), "{line}");
    assert_eq!(line["comm"], "probe", "{line}");
    let denials =
        env.agent().logs().iter().filter(|l| l.contains("\"verdict\":\"denied\"")).count();
    assert_eq!(denials, 1, "one refused connect, one event");
}

#[test]
fn bad_policy_is_refused_and_attaches_nothing() {
    privileged!(bad_policy_is_refused_and_attaches_nothing);
    let env = Env::new("enforce");
    let bad = env.policy_file.with_extension("bad.yaml");
    std::fs::write(
        &bad,
        policy("enforce").replace("ports: [80], protocols: [TCP]", "ports: [70000]"),
    )
    .expect("bad policy");
    let pin_root = integration_tests::agent::new_pin_root().expect("pin root");
    let pin_dir = pin_root.join("gate");
    let (bad_s, root_s, pin_s) = (
        bad.to_string_lossy().into_owned(),
        env.cg.gated().to_string_lossy().into_owned(),
        pin_dir.to_string_lossy().into_owned(),
    );
    let out = run_to_end(
        &[
            "run",
            "--policy",
            &bad_s,
            "--cgroup-root",
            &root_s,
            "--pin-dir",
            &pin_s,
            "--listen",
            "127.0.0.1:0",
        ],
        Duration::from_secs(10),
    )
    .expect("agent exits");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "agent accepted a bad policy");
    assert!(stderr.contains("endpoints[0].ports"), "error does not name the field: {stderr}");
    assert!(!pin_dir.exists(), "a refused start left pins behind");
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");

    let out = run_to_end(&["check", &bad_s], Duration::from_secs(10)).expect("check exits");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("endpoints[0].ports"));
    let good = env.policy_file.to_string_lossy().into_owned();
    let out = run_to_end(&["check", &good], Duration::from_secs(10)).expect("check exits");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    integration_tests::agent::remove_pin_root(&pin_root);
    let _ = std::fs::remove_file(&bad);
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
    let out =
        run_to_end(&["cleanup", "--pin-dir", &pin], Duration::from_secs(10)).expect("cleanup");
    assert!(out.status.success());
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");
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
    let pod = env.cgroup("gated/pod-a");
    let mapped = format!("::ffff:{IMDS_V4}");
    let gated = [
        ("tcp-v4", vec!["hold-tcp", IMDS_V4, "80"]),
        ("tcp-v6", vec!["hold-tcp", IMDS_V6, "80"]),
        ("tcp-mapped", vec!["hold-tcp", mapped.as_str(), "80"]),
        ("udp-v4", vec!["hold-udp", IMDS_V4, "80"]),
        ("udp-v6", vec!["hold-udp", IMDS_V6, "80"]),
    ]
    .into_iter()
    .map(|(name, args)| (name, Held::start(&env.net, &pod, &args).expect(name)))
    .collect();
    let allowed = Held::start(
        &env.net,
        &env.cgroup("gated/cloud-agent/nested"),
        &["hold-tcp", IMDS_V4, "80"],
    )
    .expect("hold allowed");
    let unprotected =
        Held::start(&env.net, &pod, &["hold-tcp", IMDS_V4, "53"]).expect("hold unprotected");
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
    assert!(summary["netns"].as_u64().is_some_and(|n| n >= 2), "agent's and the node's: {summary}");
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
    let hbh = Held::start(&env.net, &env.cgroup("gated/pod-a"), &["hold-udp-hbh", IMDS_V6, "80"])
        .expect("hold hbh");
    env.agent = Some(
        Agent::start_with(&env.policy_file, &env.cg.gated(), &["--terminate-established=false"])
            .expect("agent ready"),
    );
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
    let held = Held::start(&env.net, &env.cgroup("gated/pod-a"), &["hold-tcp", IMDS_V4, "80"])
        .expect("hold tcp");
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
