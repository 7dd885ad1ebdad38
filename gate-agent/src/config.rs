//! What `gate-agent run` was asked to do, free of the command line: [`crate::cli`] builds an
//! [`AgentConfig`] from the flags and nothing below `main` sees clap.
use std::{path::PathBuf, time::Duration};

use crate::{loader::EgressProgram, node::NodeConfig, server::Listen};

/// Everything `run` needs.
#[derive(Clone, Debug)]
pub(crate) struct AgentConfig {
    /// Where policies and the allow set come from.
    pub mode: RunMode,
    pub gate: GateConfig,
    /// Where /healthz, /readyz and /metrics are served.
    pub listen: Listen,
    /// How often allow globs are re-evaluated and the node-level attachments verified.
    pub rescan: Duration,
    /// Where the node keeps the last good policy, the allow set and the agent's binary for
    /// the boot step (`gate-agent boot`); none: nothing is kept.
    pub state_dir: Option<PathBuf>,
    /// Where the metadata proxy listens; none: no proxy, and workloads narrowed to served
    /// paths are denied the metadata service.
    pub proxy: Option<ProxyListen>,
}

/// The metadata proxy's addresses (the node's own, at most one per family) and port.
#[derive(Clone, Debug)]
pub(crate) struct ProxyListen {
    pub addresses: Vec<std::net::IpAddr>,
    pub port: u16,
}

/// Standalone (a policy file, cgroup globs) or cluster (a ConfigMap, pods).
#[derive(Clone, Debug)]
pub(crate) enum RunMode {
    Standalone { policy: PathBuf, cgroup_root: PathBuf },
    Cluster(ClusterConfig),
}

/// How the gate is loaded and kept.
#[derive(Clone, Debug)]
pub(crate) struct GateConfig {
    /// bpffs directory for pins (`<pin_dir>/v<ABI>/…`).
    pub pin_dir: PathBuf,
    /// Whether bpffs may be mounted on the pin dir's parent when it is missing: standalone
    /// only; in a pod the mount would vanish with the container.
    pub mount_bpffs: bool,
    pub egress: EgressProgram,
    /// Whether the BPF LSM programs are attached (`--lsm-programs`).
    pub lsm_programs: bool,
    /// The node-level program: where it goes and what it gates.
    pub node: NodeConfig,
    /// Destroy established connections the policy denies.
    pub terminate_established: bool,
}

/// Cluster mode: where the agent finds the API server, its node and its policy.
#[derive(Clone, Debug)]
pub(crate) struct ClusterConfig {
    pub kubeconfig: Option<PathBuf>,
    pub node_name: String,
    /// The agent's namespace, where the policy ConfigMaps live.
    pub namespace: String,
    /// `--platform`; else detected.
    pub platform: Option<String>,
    /// `--policy-configmap` as (namespace, name); else the platform's.
    pub policy_configmap: Option<(String, String)>,
    pub scope: Scope,
    /// `--cgroup-root`; else the kubepods cgroup.
    pub cgroup_root: Option<PathBuf>,
}

/// Which pods the gate applies to (the agent's scope option).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// Every pod is gated; only allow entries let pods through. The default.
    #[default]
    AllPods,
    /// Only host-network pods are gated: every pod-network pod's pod-level cgroup is put on the
    /// allow set (see [`crate::cluster::identity::ungated_cgroups`]), for clusters whose pod network already keeps pods
    /// from the metadata service.
    HostNetworkOnly,
}
