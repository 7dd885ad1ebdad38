//! The proxy's programs cost nothing where no proxy serves: getpeername, sock_ops and bind are
//! attached to the gated root only while a proxy is configured (`--proxy-address`) and the
//! policy sends connects to it. They come and go with either (a policy edit, an agent
//! restarted with or without the flag, which adopts its predecessor's gate) without an open
//! moment: a served workload hammering the service throughout never reaches it directly.
use std::time::Duration;

use integration_tests::{
    agent::Agent,
    cgquery::{CgroupHook, attached},
    net::{IMDS_V4, NODE_V4},
    probe::{Held, token},
};

use super::{
    EPERM, Env, INSTANCE_ID, PROXY_PORT, PROXY_V6, count, http, policy, proxy_agent, proxy_env,
    proxy_policy,
};

const ID: &str = "/latest/meta-data/instance-id";
const REGION: &str = "/latest/meta-data/placement/region";
/// Where the hammer runs.
const HAMMER: &str = "gated/hammer";

/// [`proxy_policy`] with the hammer's entry.
fn served_policy() -> String {
    proxy_policy().replace(
        "served:",
        "  - {name: hammer, cgroup: \"hammer\", paths: [/latest/meta-data/instance-id]}\nserved:",
    )
}

/// The metadata proxy's programs attached to the gated root, as the kernel lists them.
fn proxy_programs(env: &Env) -> Vec<String> {
    let hooks = [
        CgroupHook::SockOps,
        CgroupHook::Bind4,
        CgroupHook::Bind6,
        CgroupHook::GetPeerName4,
        CgroupHook::GetPeerName6,
    ];
    hooks
        .into_iter()
        .flat_map(|h| attached(&env.cg.gated(), h).expect("query the gated root"))
        .collect()
}

/// All of them, one each.
fn all_proxy_programs() -> Vec<String> {
    ["gate_sock_ops", "gate_bind4", "gate_bind6", "gate_peername4", "gate_peername6"]
        .map(String::from)
        .to_vec()
}

/// `cgroup` is served `path` through the proxy: 200 with the service's body.
fn assert_served(env: &Env, cgroup: &str, path: &str) {
    let (t, o) = http(env, cgroup, IMDS_V4, path);
    let reply = o.reply.clone().unwrap_or_default();
    assert!(reply.contains(" 200 ") && reply.contains(INSTANCE_ID), "{cgroup} {path}: {o:?}");
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "{cgroup} {path}: no token");
}

/// `cgroup`'s connect is denied (EPERM): no proxy serves it, and it never reaches the service.
fn assert_denied(env: &Env, cgroup: &str, path: &str) {
    let (t, o) = http(env, cgroup, IMDS_V4, path);
    assert_eq!((o.ok, o.errno, o.stage.as_str()), (false, Some(EPERM), "connect"), "{o:?}");
    assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "{cgroup} reached the IMDS");
}

/// A served workload connecting to the service in a loop, each connect sending a request the
/// proxy never serves (a query parameter no entry lists): only a connect that went around the
/// gate brings its token to the service. A pod of its own, narrowed to paths as csi-node is,
/// so that its connections take none of csi-node's slots at the proxy.
struct Hammer {
    held: Held,
    token: String,
}

impl Hammer {
    fn start(env: &Env, cgroup: &str) -> Hammer {
        let token = token("hammer");
        let held =
            env.hold(cgroup, &["hammer-tcp", IMDS_V4, "80", &token]).expect("hammer started");
        std::thread::sleep(Duration::from_millis(200));
        Hammer { held, token }
    }

    /// Stop it and prove that no connect reached the service directly: (connects that went to
    /// the proxy, connects denied).
    fn stop(self, env: &Env) -> (u64, u64) {
        let o = self.held.send("stop").expect("hammer result");
        let reply = o.reply.clone().unwrap_or_default();
        eprintln!("hammer: {reply}");
        // `other`: refused at once while no proxy listens (an agent restarting), or a
        // connect that timed out: closed either way.
        assert!(count(&reply, "attempts") >= 100, "too few attempts to cover the swaps: {reply}");
        assert!(
            !env.imds.wait_for(&self.token, Duration::from_millis(300)),
            "a connect reached the service directly while the proxy's programs changed: {reply}"
        );
        (count(&reply, "successes"), count(&reply, "eperm"))
    }
}

/// The control for every "denied" and "never reached" below: without the gate, the served
/// workload reaches the service directly, the hammer's connects included.
fn open_without_the_gate(env: &Env) {
    let (t, o) = http(env, "gated/csi-node", IMDS_V4, ID);
    assert!(o.reply.as_deref().is_some_and(|r| r.contains(INSTANCE_ID)), "{o:?}");
    assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "no token without the gate");
    let hammer = Hammer::start(env, HAMMER);
    let o = hammer.held.send("stop").expect("hammer result");
    assert!(o.reply.as_deref().is_some_and(|r| !r.contains("successes=0")), "{o:?}");
    assert!(
        env.imds.wait_for(&hammer.token, Duration::from_secs(2)),
        "the hammer does not reach the service even without the gate: {o:?}"
    );
}

/// Replace the policy file and wait until the agent applied generation `generation`.
fn apply(env: &Env, text: &str, generation: u64) {
    env.replace_policy(text);
    env.agent()
        .wait_log(
            |v| v["message"] == "policy applied" && v["generation"] == generation,
            Duration::from_secs(10),
        )
        .unwrap_or_else(|| panic!("policy generation {generation} not applied"));
}

#[test]
fn the_proxys_programs_come_and_go_with_the_policys_need_for_a_proxy() {
    privileged!(the_proxys_programs_come_and_go_with_the_policys_need_for_a_proxy);
    let mut env = proxy_env(&[HAMMER]);
    // Every workload allowed or denied whole: nothing goes to a proxy.
    let whole = policy("enforce");
    std::fs::write(&env.policy_file, &whole).expect("policy file");
    open_without_the_gate(&env);

    env.agent = Some(proxy_agent(&env, "gated/agent"));
    assert_eq!(proxy_programs(&env), Vec::<String>::new(), "a proxy, but no policy needs it");
    assert_denied(&env, "gated/csi-node", ID);
    let hammer = Hammer::start(&env, HAMMER);

    apply(&env, &served_policy(), 2);
    assert_eq!(proxy_programs(&env), all_proxy_programs(), "in for the policy that needs them");
    assert_served(&env, "gated/csi-node", ID);
    assert_served(&env, "gated/pod-a", REGION);
    // The port is the proxy's again.
    let o = env.probe("gated/pod-a", &["bind", "127.0.0.1", PROXY_PORT]);
    assert_eq!((o.ok, o.errno), (false, Some(EPERM)), "a gated workload took the port: {o:?}");

    apply(&env, &whole, 3);
    assert_eq!(proxy_programs(&env), Vec::<String>::new(), "out once no policy needs them");
    assert_denied(&env, "gated/csi-node", ID);
    assert_denied(&env, "gated/pod-a", REGION);

    let (proxied, denied) = hammer.stop(&env);
    assert!(proxied > 0 && denied > 0, "the hammer did not see both: {proxied} {denied}");
}

#[test]
fn the_proxys_programs_follow_proxy_address_across_restarts() {
    privileged!(the_proxys_programs_follow_proxy_address_across_restarts);
    let mut env = proxy_env(&[HAMMER]);
    std::fs::write(&env.policy_file, served_policy()).expect("policy file");
    open_without_the_gate(&env);

    // No --proxy-address: the policy's paths are denied, and nothing of the proxy's is in.
    let netns = env.net.node_path();
    let agent = Agent::start_in_cgroup(
        &env.bins,
        &netns,
        &env.policy_file,
        &env.cg.gated(),
        &env.cgroup("gated/agent"),
        &[],
    );
    env.agent = Some(agent.expect("agent ready"));
    assert_eq!(proxy_programs(&env), Vec::<String>::new(), "no proxy configured");
    assert_denied(&env, "gated/csi-node", ID);
    let hammer = Hammer::start(&env, HAMMER);

    // Restarted with a proxy: it adopts the gate and puts the proxy's programs in.
    let with_proxy =
        ["--proxy-address", NODE_V4, "--proxy-address", PROXY_V6, "--proxy-port", PROXY_PORT];
    let agent = env.agent.as_mut().expect("agent");
    agent.restart_with(&with_proxy).expect("restart with a proxy");
    let ready = env.agent().find(|v| v["message"] == "ready").expect("ready line");
    assert_eq!(ready["start"], "Adopted", "{ready}");
    assert_eq!(proxy_programs(&env), all_proxy_programs());
    assert_served(&env, "gated/csi-node", ID);
    let sock_ops = |env: &Env| {
        let (_, st) = env.agent().status().expect("status");
        let a = st["attachments"].as_array().cloned().unwrap_or_default();
        let a = a.into_iter().find(|a| a["attach_point"] == "sock-ops").expect("sock-ops link");
        (a["link_id"].as_u64(), a["program_id"].as_u64())
    };
    let before = sock_ops(&env);

    // Restarted with a proxy again: the same links, their programs swapped in place.
    let agent = env.agent.as_mut().expect("agent");
    agent.restart_with(&with_proxy).expect("restart with a proxy again");
    let after = sock_ops(&env);
    assert_eq!(before.0, after.0, "the sock-ops link was replaced, not updated");
    assert_ne!(before.1, after.1, "the sock-ops program was not replaced");
    assert_served(&env, "gated/csi-node", ID);

    // Restarted without: out again, and the paths denied.
    let agent = env.agent.as_mut().expect("agent");
    agent.restart_with(&[]).expect("restart without a proxy");
    assert_eq!(proxy_programs(&env), Vec::<String>::new(), "out with the proxy");
    assert_denied(&env, "gated/csi-node", ID);

    let (proxied, denied) = hammer.stop(&env);
    assert!(proxied > 0 && denied > 0, "the hammer did not see both: {proxied} {denied}");
}
