//! What the gate denies and what it leaves open, from the moment the agent is ready.
use std::time::Duration;

use integration_tests::{
    net::{DNS_V4, DNS_V6, IMDS_V4, IMDS_V6, NTP_V4},
    probe::token,
};

use super::{EPERM, Env, policy};

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

// The socket paths every kernel must close, one case each: a test per case natively, and
// all of them on one agent in the kernel VMs (`socket_paths_are_denied_on_one_agent`), where
// starting an agent costs 20 to 40 s under emulation.

fn tcp_v4(env: &Env) {
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
}

fn tcp_v6(env: &Env) {
    env.assert_refused("gated/pod-a", "tcp", IMDS_V6, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V6, "80");
}

fn udp(env: &Env) {
    env.assert_refused("gated/pod-a", "udp", IMDS_V4, "80", "send");
    env.assert_refused("gated/pod-a", "udp-connected", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "udp", IMDS_V4, "80");
    env.assert_served("gated/cloud-agent", "udp-connected", IMDS_V4, "80");
}

fn ipv4_mapped(env: &Env) {
    let mapped = format!("::ffff:{IMDS_V4}");
    env.assert_refused("gated/pod-a", "tcp", &mapped, "80", "connect");
    env.assert_refused("gated/pod-a", "udp", &mapped, "80", "send");
    env.assert_refused("gated/pod-a", "udp-connected", &mapped, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", &mapped, "80");
}

fn raw(env: &Env) {
    let t = token("raw");
    // The egress program drops it; sendto may report EPERM or succeed, either is fine.
    let o = env.probe("gated/pod-a", &["raw", IMDS_V4, "80", &t]);
    assert!(o.ok || o.errno == Some(EPERM), "{o:?}");
    assert!(!env.imds.wait_for(&t, Duration::from_secs(1)), "raw segment {t} reached the IMDS");
    env.assert_served("gated/cloud-agent", "raw", IMDS_V4, "80");
}

#[test]
fn tcp_v4_denied_with_eperm_allowed_served() {
    privileged!(tcp_v4_denied_with_eperm_allowed_served);
    tcp_v4(&Env::with_agent("enforce"));
}

#[test]
fn tcp_v6_denied_allowed_served() {
    privileged!(tcp_v6_denied_allowed_served);
    tcp_v6(&Env::with_agent("enforce"));
}

#[test]
fn udp_sendto_and_connected_udp_denied() {
    privileged!(udp_sendto_and_connected_udp_denied);
    udp(&Env::with_agent("enforce"));
}

#[test]
fn ipv4_mapped_ipv6_denied() {
    privileged!(ipv4_mapped_ipv6_denied);
    ipv4_mapped(&Env::with_agent("enforce"));
}

#[test]
fn raw_socket_never_reaches_the_service() {
    privileged!(raw_socket_never_reaches_the_service);
    raw(&Env::with_agent("enforce"));
}

/// The five cases above, one after another on one agent.
#[test]
fn socket_paths_are_denied_on_one_agent() {
    privileged!(socket_paths_are_denied_on_one_agent);
    let env = Env::with_agent("enforce");
    for case in [tcp_v4, tcp_v6, udp, ipv4_mapped, raw] {
        case(&env);
    }
}

/// A datagram is judged once, on egress, and its denial is the sendto()'s EPERM; the
/// denial is one event, with the sender's pid and comm where the kernel gives the egress
/// program the current task.
#[test]
fn udp_denial_is_one_event_from_egress() {
    privileged!(udp_denial_is_one_event_from_egress);
    let env = Env::with_agent("enforce");
    env.assert_refused("gated/pod-a", "udp", IMDS_V4, "80", "send");
    let line = env
        .agent()
        .wait_log(|v| v["verdict"] == "denied", Duration::from_secs(5))
        .expect("denial log line");
    assert_eq!(line["hook"], "egress4", "{line}");
    assert_eq!((line["proto"].as_str(), line["port"].as_u64()), (Some("UDP"), Some(80)), "{line}");
    assert_eq!(line["endpoint"], "ec2-imds-udp-test", "{line}");
    let (_, st) = env.agent().status().expect("status");
    let task = st["attachments"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["attach_point"] == "egress"))
        .is_some_and(|x| x["program"] == "gate_egress");
    if task {
        assert!(line["pid"].as_u64().is_some_and(|p| p > 0), "{line}");
        assert_eq!(line["comm"], "probe", "{line}");
    }
    std::thread::sleep(Duration::from_millis(200));
    let denials =
        env.agent().logs().iter().filter(|l| l.contains("\"verdict\":\"denied\"")).count();
    assert_eq!(denials, 1, "one denied datagram, one event");
}

/// A source-routed datagram names its real destination in its options, not its header: the
/// receiving host hands it on (here the metadata service's own host, with source routes
/// accepted). Without a gate the path is real; with one, the datagram is denied with EPERM
/// whatever its header's destination, and the allow-listed cgroup is still served.
#[test]
fn source_routed_udp_denied() {
    privileged!(source_routed_udp_denied);
    let mut env = Env::new("enforce");
    integration_tests::net::sysctl(
        &env.net.imds,
        &["net.ipv4.conf.all.accept_source_route=1", "net.ipv4.conf.vimds.accept_source_route=1"],
    )
    .expect("accept source routes in the imds netns");
    let lsrr = |env: &Env, cgroup: &str, t: &str| {
        env.probe(cgroup, &["udp-lsrr", DNS_V4, IMDS_V4, "80", t])
    };
    let t = token("lsrr");
    let o = lsrr(&env, "gated/pod-a", &t);
    assert!(o.ok, "without a gate: {o:?}");
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "the path is not real: {o:?}");
    env.start_agent();
    let t = token("lsrr");
    let o = lsrr(&env, "gated/pod-a", &t);
    assert_eq!((o.ok, o.errno, o.stage.as_str()), (false, Some(EPERM), "send"), "{o:?}");
    assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "token {t} reached the IMDS");
    let line = env
        .agent()
        .wait_log(|v| v["verdict"] == "denied", Duration::from_secs(5))
        .expect("denial log line");
    assert_eq!(
        (line["hook"].as_str(), line["endpoint"].as_str()),
        (Some("egress4"), Some("(source-routed)")),
        "{line}"
    );
    let t = token("lsrr");
    let o = lsrr(&env, "gated/cloud-agent", &t);
    assert!(o.ok && env.imds.wait_for(&t, Duration::from_secs(2)), "allowed: {o:?}");
}

#[test]
fn ipv6_extension_headers_do_not_hide_the_port() {
    privileged!(ipv6_extension_headers_do_not_hide_the_port);
    let mut env = Env::new("enforce");
    // Opened before the agent, so only the egress program, which has to walk the hop-by-hop
    // header to find the UDP port, stands between it and the service.
    let args = ["hold-udp-hbh", IMDS_V6, "80"];
    let held = env.hold("gated/pod-a", &args).expect("hold hbh");
    let allowed = env.hold("gated/cloud-agent", &args).expect("hold hbh");
    // Not destroyed at start, so the egress program is what is tested.
    env.start_agent_with(&["--terminate-established=false"]);
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
    // A sibling created late is still denied.
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
    assert!(line["message"].as_str().is_some_and(|m| m.contains("denied")), "{line}");
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
    assert!(line["message"].as_str().is_some_and(|m| m.contains("denied")), "{line}");
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
    assert_eq!(denials, 1, "one denied connect, one event");
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
    let out = env
        .gate_agent(
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
    assert!(!pin_dir.exists(), "a rejected start left pins behind");
    env.assert_served("gated/pod-a", "tcp", IMDS_V4, "80");

    let out = env.gate_agent(&["check", &bad_s], Duration::from_secs(10)).expect("check exits");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("endpoints[0].ports"));
    let good = env.policy_file.to_string_lossy().into_owned();
    let out = env.gate_agent(&["check", &good], Duration::from_secs(10)).expect("check exits");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    integration_tests::agent::remove_pin_root(&pin_root);
    let _ = std::fs::remove_file(&bad);
}

/// An entry narrowed to served paths, and `served` itself, open nothing while no metadata
/// proxy serves them (no --proxy-address): the narrowed workload is denied as if it had no
/// entry, an ordinary entry beside it is still served, and the agent names the entries
/// whose workloads it denies.
#[test]
fn an_entry_narrowed_to_paths_is_denied_until_a_proxy_serves_them() {
    privileged!(an_entry_narrowed_to_paths_is_denied_until_a_proxy_serves_them);
    let mut env = Env::new("enforce");
    env.cg.create("gated/csi-node").expect("cgroup");
    // Without the gate both reach the service: the denial below is the gate's.
    env.assert_served("gated/csi-node", "tcp", IMDS_V4, "80");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    let narrowed = policy("enforce")
        + "  - {name: csi-node, cgroup: \"csi-node\", profile: safe, paths: [/latest/meta-data/instance-id]}\n\
           served: {profile: safe}\n";
    std::fs::write(&env.policy_file, narrowed).expect("policy file");
    env.start_agent();
    env.assert_refused("gated/csi-node", "tcp", IMDS_V4, "80", "connect");
    env.assert_refused("gated/csi-node", "tcp", IMDS_V6, "80", "connect");
    env.assert_refused("gated/pod-a", "tcp", IMDS_V4, "80", "connect");
    env.assert_served("gated/cloud-agent", "tcp", IMDS_V4, "80");
    for entry in ["csi-node", "served"] {
        let said = env.agent().find(|v| {
            v["entry"] == entry
                && v["message"].as_str().is_some_and(|m| m.contains("the metadata proxy is off"))
        });
        assert!(said.is_some(), "no warning for {entry}: {:#?}", env.agent().logs());
    }
}
