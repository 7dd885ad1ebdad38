//! New nodes and reboots: the boot step (deploy/boot/metadata-gate-boot.sh, as systemd runs it
//! before the kubelet) closes every path the agent closes before any agent runs. Each case
//! runs without a gate first, where it must reach the metadata service.
use integration_tests::{
    agent::{BootSettings, BootStep},
    frame::ETH_P_IP,
    net::{IMDS_V4, NODE_V4, POD_V4},
};

use super::{Attempt, ENDPOINTS, Gate, IDS_ENTRY, To, World, daemonset_run_args, eth, udp80};
use crate::{TempDir, cluster};

/// A host-network DaemonSet that tolerates every taint (node exporters, log shippers, the EBS
/// CSI node plugin): scheduled on a new node before the agent, whatever its taints.
const TOLERATE_ALL: &str = "kubepods.slice/kubepods-pod0b6c0f5e_5555.slice/crio-tolerate-all.scope";

/// A NET_RAW host-network pod's AF_PACKET frame on the uplink, and a pod-network pod's frame
/// the node forwards: the paths no cgroup hook sees.
fn packet_paths(w: &World, gate: Gate) {
    let host = |t: &str, to: To| {
        w.frames(&w.node, &w.rogue, "vnode", ETH_P_IP, &[eth(w.imds_mac, &udp80(NODE_V4, to, t))]);
    };
    let pod = |t: &str, to: To| {
        w.frames(&w.pod_ns, &w.c.web, "eth0", ETH_P_IP, &[eth(w.gw, &udp80(POD_V4, to, t))]);
    };
    let list: [Attempt<'_>; 2] = [
        ("host network: AF_PACKET UDP on the uplink", &host),
        ("pod network: AF_PACKET frame the node forwards", &pod),
    ];
    w.attempts(gate, true, &list);
}

/// A new node's first boot, then a reboot: each time the boot step closes every path before
/// the agent runs, for a tolerate-all host-network DaemonSet, a NET_RAW host-network pod and
/// a NET_RAW pod-network pod.
#[test]
fn a_first_boot_is_closed_before_the_agent_runs() {
    privileged!(a_first_boot_is_closed_before_the_agent_runs);
    let mut w = World::new();
    let env = &w.c.env;
    // Without a gate, every path is open: the case is real.
    env.cg.create(TOLERATE_ALL).expect("cgroup");
    env.assert_served(TOLERATE_ALL, "tcp", IMDS_V4, "80");
    env.assert_served(&w.rogue, "tcp", IMDS_V4, "80");
    packet_paths(&w, Gate::None);
    std::fs::remove_dir(env.cgroup(TOLERATE_ALL)).expect("remove the cgroup: the node boots");

    // A new node: no state kept, the policy installed with the node (a MachineConfig file),
    // no binary on the host: the script runs the agent's image.
    let installed = w.file("installed-policy.yaml", &(cluster::policy_with(ENDPOINTS) + IDS_ENTRY));
    let state = TempDir::new("mg-state");
    let root = w.c.kubepods();
    let settings = BootSettings {
        state_dir: &state.0,
        cgroup_root: &root,
        policy: Some(&installed),
        platform: None,
        fail_open: false,
    };
    let boot = BootStep::run(&w.c.env.bins, &w.node, &settings).expect("boot step ran");
    let stderr = String::from_utf8_lossy(&boot.output.stderr).into_owned();
    assert!(boot.output.status.success(), "boot step: {stderr}");
    let podman = boot.podman_args.clone().expect("a first boot runs the image");
    for arg in ["--privileged", "--net=host", "--pid=host", "/sys/fs/bpf:/sys/fs/bpf", "boot"] {
        assert!(podman.contains(arg), "podman {podman}: {arg} missing");
    }
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.0.join("boot.json")).expect("boot record"))
            .expect("boot record JSON");
    assert_eq!(record["closed"], true, "{record}");
    assert!(record["policy"].as_str().is_some_and(|p| p.starts_with("installed")), "{record}");

    // The kubelet starts pods: the tolerate-all DaemonSet's cgroup appears now, before any
    // agent, and its very first connect() is denied; so is the gated host-network pod's.
    let env = &w.c.env;
    env.cg.create(TOLERATE_ALL).expect("cgroup");
    env.assert_refused(TOLERATE_ALL, "tcp", IMDS_V4, "80", "connect");
    env.assert_refused(&w.rogue, "tcp", IMDS_V4, "80", "connect");
    // No allow set on a first boot: the allowed CCM is denied until the agent resolves it.
    env.assert_refused(&w.c.ccm, "tcp", IMDS_V4, "80", "connect");
    packet_paths(&w, Gate::Boot);

    // The agent comes up with the DaemonSet's arguments and adopts the gate.
    let state_arg = state.0.to_string_lossy().into_owned();
    let mut extra = daemonset_run_args();
    extra.extend(["--state-dir".to_owned(), state_arg]);
    let (flags, kubeconfig) = w.c.flags(&extra.iter().map(String::as_str).collect::<Vec<_>>());
    let agent = boot.into_agent(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    let _ = std::fs::remove_file(kubeconfig);
    let agent = agent.expect("agent adopts the boot step's gate");
    let ready = agent.find(|v| v["message"] == "ready").expect("ready");
    assert_eq!(ready["start"], "Adopted", "{ready}");
    assert!(
        agent.find(|v| v["message"] == "the boot step closed the gate on this boot").is_some(),
        "the agent did not report the boot step"
    );
    w.c.env.agent = Some(agent);
    let env = &w.c.env;
    env.assert_served(&w.c.ccm, "tcp", IMDS_V4, "80");
    env.assert_refused(TOLERATE_ALL, "tcp", IMDS_V4, "80", "connect");
    packet_paths(&w, Gate::Cluster);

    // The node reboots: bpffs is emptied (the agent stops, its pins go), the state dir stays.
    let pin = w.c.env.agent().pin_dir.to_string_lossy().into_owned();
    w.c.env.agent.as_mut().expect("agent").stop();
    let out = w.c.env.cleanup(&pin);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    w.c.env.agent = None;
    packet_paths(&w, Gate::None);
    // The boot step now runs the binary the agent kept, with the policy and allow set it kept:
    // the allowed CCM is served at once, every other path is closed, the frames included.
    let boot = BootStep::run(&w.c.env.bins, &w.node, &settings).expect("boot step ran");
    let stderr = String::from_utf8_lossy(&boot.output.stderr).into_owned();
    assert!(boot.output.status.success(), "boot step: {stderr}");
    assert!(boot.podman_args.is_none(), "a reboot runs the kept binary: {stderr}");
    let env = &w.c.env;
    env.assert_served(&w.c.ccm, "tcp", IMDS_V4, "80");
    env.assert_refused(TOLERATE_ALL, "tcp", IMDS_V4, "80", "connect");
    env.assert_refused(&w.rogue, "tcp", IMDS_V4, "80", "connect");
    packet_paths(&w, Gate::Boot);
}
