//! Command line (stable: scripts depend on it). The only module that knows clap: `run`'s
//! flags become an [`AgentConfig`] here.
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use clap::{Parser, Subcommand, ValueEnum};

use crate::{
    config::{AgentConfig, ClusterConfig, GateConfig, ProxyListen, RunMode, Scope},
    loader::{EgressProgram, TcMode},
    node::NodeConfig,
    server::Listen,
};

/// Flags that do not fit together, or a value that does not parse.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfigError {
    #[error("--policy needs --cgroup-root")]
    PolicyWithoutRoot,
    #[error("cluster mode needs --node-name (or NODE_NAME)")]
    NoNodeName,
    #[error("--policy-configmap {0:?}: expected NAMESPACE/NAME")]
    ConfigMapRef(String),
    #[error(
        "--metrics-listen {0} is the --listen address: leave it out to serve /metrics there too"
    )]
    SameListen(SocketAddr),
    #[error(
        "--proxy-address {0}: at most one IPv4 and one IPv6 address, each a unicast address \
         of the node that workloads can reach (not loopback, unspecified or multicast)"
    )]
    ProxyAddress(IpAddr),
    #[error("--proxy-port 0: the metadata proxy needs a port")]
    ProxyPort,
}

/// `--proxy-address` and `--proxy-port`: at most one unicast address per family that
/// workloads can reach (loopback is their own namespace's).
fn proxy_listen(addresses: Vec<IpAddr>, port: u16) -> Result<Option<ProxyListen>, ConfigError> {
    if addresses.is_empty() {
        return Ok(None);
    }
    if port == 0 {
        return Err(ConfigError::ProxyPort);
    }
    for (i, a) in addresses.iter().enumerate() {
        let twice = addresses[..i].iter().any(|b| b.is_ipv4() == a.is_ipv4());
        if a.is_loopback() || a.is_unspecified() || a.is_multicast() || twice {
            return Err(ConfigError::ProxyAddress(*a));
        }
    }
    Ok(Some(ProxyListen { addresses, port }))
}

impl RunArgs {
    /// The run configuration these flags ask for.
    pub(crate) fn into_config(self) -> Result<AgentConfig, ConfigError> {
        if self.metrics_listen == Some(self.listen) {
            return Err(ConfigError::SameListen(self.listen));
        }
        let mode = match (self.policy, self.cgroup_root.clone()) {
            (Some(policy), Some(cgroup_root)) => RunMode::Standalone { policy, cgroup_root },
            (Some(_), None) => return Err(ConfigError::PolicyWithoutRoot),
            (None, cgroup_root) => {
                let policy_configmap = match self.policy_configmap {
                    Some(s) => Some(
                        s.split_once('/')
                            .filter(|(n, m)| !n.is_empty() && !m.is_empty())
                            .map(|(n, m)| (n.to_owned(), m.to_owned()))
                            .ok_or(ConfigError::ConfigMapRef(s))?,
                    ),
                    None => None,
                };
                RunMode::Cluster(ClusterConfig {
                    kubeconfig: self.kubeconfig,
                    node_name: self.node_name.ok_or(ConfigError::NoNodeName)?,
                    namespace: self.namespace,
                    platform: self.platform,
                    policy_configmap,
                    scope: self.gate_scope.into(),
                    cgroup_root,
                })
            }
        };
        let standalone = matches!(mode, RunMode::Standalone { .. });
        let scope = self.gate_scope.into();
        Ok(AgentConfig {
            mode,
            gate: self.gate.into_config(standalone, scope, standalone, self.terminate_established),
            listen: Listen { probes: self.listen, metrics: self.metrics_listen },
            rescan: Duration::from_millis(self.rescan_ms.max(50)),
            state_dir: self.state_dir,
            proxy: proxy_listen(self.proxy_address, self.proxy_port)?,
        })
    }
}

pub(crate) const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/metadata-gate";
pub(crate) const DEFAULT_STATE_DIR: &str = "/var/lib/metadata-gate";

#[derive(Debug, Parser)]
#[command(
    name = "gate-agent",
    version,
    about = "Keeps workloads away from cloud instance-metadata services (169.254.169.254 and friends)",
    long_about = "Keeps workloads away from cloud instance-metadata services.\n\n\
        eBPF programs attached to a gated cgroup deny connect() and UDP sendto() to \
        protected endpoints with EPERM and drop any other packet to them on egress, unless the \
        process's cgroup (or an ancestor below the gated root) is allow-listed. A tc program on \
        every interface denies the frames no cgroup hook judged (AF_PACKET, rewritten and \
        forwarded packets), and BPF LSM programs, where the kernel runs them, close the side \
        doors (qdisc bypass, AF_XDP, packet capture). Workloads allowed only some paths are \
        sent to the agent's metadata proxy, which serves those paths and refuses the rest. \
        Processes outside the gated cgroup are not affected.\n\n\
        Lifecycle: `run` pins its programs, links and maps under --pin-dir/v<ABI>, so the gate \
        stays closed when the agent stops, crashes or is upgraded. A new `run` adopts the \
        pinned gate without opening it: the policy is swapped in atomically and each program \
        is replaced in place (bpf_link update). `status` shows the pinned gate, with or \
        without an agent; `cleanup` is the only way to open the gate."
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Load the gate, apply a policy, keep the allow list current. Standalone with --policy
    /// and --cgroup-root; cluster mode (the DaemonSet) without --policy
    Run(Box<RunArgs>),
    /// Validate policy files; exit 1 with the field and reason of every problem. Also warn (on
    /// stderr, exit status unchanged) about a valid policy that protects nothing, protects a
    /// service its platform's workloads need (DNS, NTP, the EKS Pod Identity agent), leaves
    /// part of the metadata service open, allows a namespace wholesale, or lists served paths
    /// that reach credentials, tokens, user data or keys
    Check {
        /// The platform to check against, as `run --platform` names it (AWS, GCP, Azure,
        /// External/oci, ...); default: the ConfigMap's name, else the policy's `platform`
        #[arg(long, value_name = "PLATFORM")]
        platform: Option<String>,
        /// Print one JSON array instead (per file: the checked policy, what is known about its
        /// platform, the warnings; or the error); the exit status is the same
        #[arg(long)]
        json: bool,
        /// Policy files (YAML, the schema of docs/policy.md), or policy ConfigMap manifests
        /// (data key policy.yaml, as in deploy/policies/)
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
    },
    /// The platforms this agent knows: for each, its policy ConfigMap, how a node names it on
    /// its first boot (ignition.platform.id, DMI) and in the cluster (providerID), what its
    /// policy protects and leaves open, its served-path profiles
    Platforms {
        /// Print one JSON array instead: every field of each platform's row
        #[arg(long)]
        json: bool,
    },
    /// Show the pinned gate: attachments, policy generation and hash, counters, last denials (works while no agent runs)
    Status {
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// The agent's state dir, where the boot step records what it did
        #[arg(long, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// Print JSON instead of text
        #[arg(long)]
        json: bool,
    },
    /// Who touched the protected endpoints: every workload with its counts of allowed,
    /// denied, audited and proxied accesses per endpoint, the last time, and the paths it
    /// asked the metadata proxy for (audit, then report, then enforce). Reads the pinned
    /// gate, and the agent's state dir for pod names, owners and paths
    Report {
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Where the agent kept workload identities (`run --state-dir`); without it,
        /// workloads are named by cgroup path
        #[arg(long, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Allow entries for the workloads that were denied, refused or audited (`report`), to
    /// review and paste under `allow:`: namespace, the owner's labels, service account,
    /// containers, and for a workload seen through the metadata proxy the smallest `paths`
    /// that serve what it asked for
    Suggest {
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        #[arg(long, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
    },
    /// The verdict for a workload and destination, and why, decided against the live maps;
    /// for a connect that goes through the metadata proxy, the proxy's decision on a request
    /// (--path). Exit 0 passes (unprotected, allowed, or a request the proxy serves), 1 denied
    /// (or a request it refuses), 2 audited, 3 through the proxy with no --path given
    Explain {
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Where the agent keeps the policy in force (`run --state-dir`): --path is judged by it
        #[arg(long, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// A request target (`/latest/meta-data/placement/region`, `/metadata/instance?api-version=2021-02-01`):
        /// where the connect goes through the metadata proxy, whether the proxy serves it
        #[arg(long, value_name = "TARGET")]
        path: Option<String>,
        /// The request's method, for --path
        #[arg(long, value_name = "METHOD", default_value = "GET", requires = "path")]
        method: String,
        /// The workload's cgroup: absolute, or relative to the gated root
        #[arg(long, value_name = "PATH", conflicts_with = "pod", required_unless_present = "pod")]
        cgroup: Option<PathBuf>,
        /// Cluster mode: the pod, as NAMESPACE/POD[/CONTAINER] (asks the API server; run it on
        /// the pod's node, e.g. `kubectl exec` into that node's agent)
        #[arg(long, value_name = "NS/POD[/CONTAINER]")]
        pod: Option<String>,
        /// Kubeconfig for --pod (default: in-cluster, else KUBECONFIG / ~/.kube/config)
        #[arg(long, value_name = "FILE")]
        kubeconfig: Option<PathBuf>,
        /// ADDR[:PORT][/PROTO] (port 80 and TCP when left out); default: every protected
        /// destination of the live policy
        #[arg(value_name = "DST")]
        dst: Option<String>,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Close the gate before the kubelet starts, on every boot (run by a systemd unit ordered
    /// before kubelet-dependencies.target): the cgroup hooks, the node-level programs and the
    /// LSM programs, with the last good policy and allow set the agent kept in --state-dir,
    /// or else (first boot, lost or corrupt state) the installed policy (--policy, or the
    /// shipped policy of --platform) with nothing allowed. Pinned: the agent adopts the gate
    /// when it comes up. Exits non-zero when it could not close the gate
    Boot(Box<BootArgs>),
    /// Detach and unpin everything under the pin dir: this opens the gate. Fails while an
    /// agent runs on the pin dir (stop it first: a running agent repairs what it finds
    /// missing)
    Cleanup {
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Clean up even while an agent holds the pin dir (it will put back what it can)
        #[arg(long)]
        force: bool,
    },
}

/// `gate-agent boot`.
#[derive(Debug, clap::Args)]
pub(crate) struct BootArgs {
    /// Where the agent kept its state (`run --state-dir`); the boot step records its outcome
    /// here too (`boot.json`, read by the agent and `status`)
    #[arg(long, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// The installed policy: used when the state dir holds no readable, valid policy (a
    /// node's first boot, state lost or corrupt)
    #[arg(long, value_name = "FILE", conflicts_with = "platform")]
    pub policy: Option<PathBuf>,
    /// Else the policy shipped for this platform (OpenShift PlatformType, as `run
    /// --platform`), or `auto`: the platform the node names, by the kernel command line's
    /// ignition.platform.id (RHCOS, Fedora CoreOS), else by its firmware's DMI strings (AWS,
    /// GCP, Azure, Alibaba Cloud, OCI, OpenStack)
    #[arg(long, value_name = "PLATFORM")]
    pub platform: Option<String>,
    /// The gated cgroup (created if the kubelet has not yet), e.g.
    /// /sys/fs/cgroup/kubepods.slice
    #[arg(long, value_name = "DIR")]
    pub cgroup_root: PathBuf,
    /// As the agent's `run --gate-scope` (what the node-level program judges until the agent
    /// adopts the gate)
    #[arg(long, value_enum, value_name = "SCOPE", default_value_t = ScopeArg::AllPods)]
    pub gate_scope: ScopeArg,
    #[command(flatten)]
    pub gate: GateArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// Policy file: standalone mode (needs --cgroup-root). Without it, `run` is in cluster
    /// mode: the policy comes from the platform's ConfigMap
    #[arg(long, value_name = "FILE", requires = "cgroup_root")]
    pub policy: Option<PathBuf>,
    /// Gated cgroup v2 directory: processes at or below it are gated. Cluster mode default:
    /// the kubepods cgroup under the cgroup2 mount
    #[arg(long, value_name = "DIR")]
    pub cgroup_root: Option<PathBuf>,
    /// Cluster mode: kubeconfig file (default: in-cluster service account, else KUBECONFIG /
    /// ~/.kube/config)
    #[arg(long, value_name = "FILE", conflicts_with = "policy")]
    pub kubeconfig: Option<PathBuf>,
    /// Cluster mode: this node's name (pods are watched on this node only)
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
    /// Cluster mode: the agent's namespace, where the policy ConfigMaps live
    #[arg(long, env = "POD_NAMESPACE", value_name = "NS", default_value = "metadata-gate")]
    pub namespace: String,
    /// Cluster mode: the platform (OpenShift PlatformType, e.g. AWS, GCP, Azure,
    /// External/oci); default: from the Infrastructure object, else the node's providerID
    #[arg(long, value_name = "PLATFORM")]
    pub platform: Option<String>,
    /// Cluster mode: the policy ConfigMap as NAMESPACE/NAME (default:
    /// <namespace>/metadata-gate-policy-<platform lowercase>)
    #[arg(long, value_name = "NS/NAME")]
    pub policy_configmap: Option<String>,
    /// Cluster mode: which pods are gated: all pods, or only host-network pods (pod-network
    /// pods are then left to the SDN's own rules)
    #[arg(long, value_enum, value_name = "SCOPE", default_value_t = ScopeArg::AllPods)]
    pub gate_scope: ScopeArg,
    #[command(flatten)]
    pub gate: GateArgs,
    /// Address for /healthz and /readyz, and for /metrics unless --metrics-listen is given
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9750")]
    pub listen: SocketAddr,
    /// Serve /metrics on this address instead, and only /healthz and /readyz on --listen (the
    /// DaemonSet: the probes on the node's addresses for the kubelet, /metrics on loopback for
    /// the kube-rbac-proxy sidecar, which serves it on with TLS and RBAC)
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Keep the last good policy, the allow set and a copy of this binary here, for the
    /// boot step that closes the gate before the kubelet starts (`gate-agent boot`); the
    /// DaemonSet uses /var/lib/metadata-gate on the host
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Serve the paths of allow entries narrowed to `paths` (and `served`) through the
    /// agent's metadata proxy, listening on this address of the node (repeatable: one IPv4,
    /// one IPv6; the DaemonSet passes status.podIPs, which are the node's). The workloads' HTTP connects to a
    /// protected endpoint are sent there by the kernel, with a record of who asked; the
    /// proxy serves the listed paths and answers 403 to the rest. Without it, those
    /// workloads are denied the metadata service (EPERM)
    #[arg(long, value_name = "IP", env = "PROXY_ADDRESSES", value_delimiter = ',')]
    pub proxy_address: Vec<IpAddr>,
    /// The metadata proxy's port on --proxy-address. Only the agent may bind it in the gated
    /// root; keep it outside the NodePort range and off every hostPort
    #[arg(long, value_name = "PORT", default_value_t = 9254)]
    pub proxy_port: u16,
    /// Log format
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// How often cgroup globs of the allow list are re-evaluated and the node-level
    /// attachments verified (and restored if removed), in milliseconds
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub rescan_ms: u64,
    /// Destroy established connections from gated cgroups to protected endpoints when the
    /// gate or a policy change takes effect, where the kernel supports it (sock_diag
    /// SOCK_DESTROY, as `ss -K`). Their packets are dropped either way; destroying them makes
    /// the owner see ECONNABORTED at once instead of a stalled connection.
    /// `--terminate-established=false` leaves them open.
    #[arg(
        long,
        value_name = "BOOL",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub terminate_established: bool,
}

/// How the gate is loaded and where the node-level program goes: `run` and `boot` alike, so
/// that the boot step closes what the agent will.
#[derive(Debug, clap::Args)]
pub(crate) struct GateArgs {
    /// bpffs directory for pinned programs and maps (bpffs is mounted on its parent if missing)
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
    pub pin_dir: PathBuf,
    /// Which cgroup_skb egress program to load (auto: with pid/comm in events where the
    /// kernel allows it)
    #[arg(long, value_enum, value_name = "VARIANT", default_value_t = EgressArg::Auto)]
    pub egress_program: EgressArg,
    /// Attach the node-wide LSM programs (as BPF LSM programs where the kernel runs the BPF
    /// LSM, else as fmod_ret programs on security_socket_*, 5.14+): they deny
    /// PACKET_QDISC_BYPASS and AF_XDP setup through every syscall ABI (32-bit compat and
    /// io_uring included) and sockets that would read the node's IP traffic to gated
    /// workloads. `--lsm-programs=false` leaves those doors to the cgroup hooks (native
    /// setsockopt denied; 32-bit compat, io_uring and capture open)
    #[arg(
        long,
        value_name = "BOOL",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub lsm_programs: bool,
    /// Node-level enforcement (default on): a tc program on every interface's egress and on
    /// every interface's ingress but loopback's (routes decide nothing), attached as
    /// interfaces appear, read as Ethernet frames or, on other link types (tun, WireGuard,
    /// ipip, gre, IPoIB …), at the network header, for traffic no cgroup hook judged:
    /// AF_PACKET frames, packets rewritten after the socket hooks, traffic forwarded from
    /// pods, VMs and tunnels. `--node-enforcement=false` leaves
    /// only the cgroup hooks (and the --tc-* interfaces), and those paths open
    #[arg(
        long,
        value_name = "BOOL",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub node_enforcement: bool,
    /// Guard the egress of these interfaces (glob, repeatable); node-level enforcement
    /// already guards every interface's egress, so this matters with
    /// --node-enforcement=false
    #[arg(long, value_name = "GLOB")]
    pub tc_interface: Vec<String>,
    /// More workload-facing interfaces (glob, repeatable): the node-level program on their
    /// ingress, also where pod-network traffic is otherwise left to the SDN
    #[arg(long, value_name = "GLOB")]
    pub tc_workload_interface: Vec<String>,
    /// Trusted interfaces (glob, repeatable): what enters by them may reach a protected
    /// endpoint through the node (no ingress program, and their forwarded traffic passes
    /// where it leaves). For traffic the gate is not meant to judge, such as a VM host's own
    /// guests that must reach the metadata service; every other forwarded packet bound for
    /// a protected endpoint is denied where it leaves the node
    #[arg(long, value_name = "GLOB")]
    pub tc_trusted_interface: Vec<String>,
    /// Network namespace of the node-level interfaces (e.g. /run/netns/NAME); default: the
    /// agent's own (in a DaemonSet with hostNetwork: the node's)
    #[arg(long, value_name = "PATH")]
    pub tc_netns: Option<PathBuf>,
    /// How tc programs attach: tcx links (6.6+) or clsact filters (older kernels)
    #[arg(long, value_enum, value_name = "MODE", default_value_t = TcModeArg::Auto)]
    pub tc_mode: TcModeArg,
}

impl GateArgs {
    /// The gate this asks for. `standalone`: forwarded traffic and the workload-facing
    /// interfaces are judged as in standalone mode; else as `scope` says.
    pub(crate) fn into_config(
        self,
        standalone: bool,
        scope: Scope,
        mount_bpffs: bool,
        terminate_established: bool,
    ) -> GateConfig {
        // Forwarded traffic without a socket is denied at the uplinks unless it entered by a
        // trusted interface, so that an interface that lost its ingress program (an attacker's
        // route made it look like an uplink, it is brand new) is no way out. Where every pod
        // is gated, the workload-facing interfaces are strict too; standalone lets sockets
        // outside the gated root through them. Only where pod-network traffic is left to the
        // SDN (`--gate-scope host-network-only`) is neither the gate's.
        let all = scope == Scope::AllPods;
        let (workload_ingress, gate_forwarded, strict_found) =
            if standalone { (true, true, false) } else { (all, all, all) };
        GateConfig {
            pin_dir: self.pin_dir,
            mount_bpffs,
            egress: self.egress_program.into(),
            lsm_programs: self.lsm_programs,
            node: NodeConfig {
                enabled: self.node_enforcement,
                workload_ingress,
                gate_forwarded,
                strict_found,
                uplinks: self.tc_interface,
                workloads: self.tc_workload_interface,
                trusted: self.tc_trusted_interface,
                netns: self.tc_netns,
                mode: self.tc_mode.into(),
            },
            terminate_established,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

/// `--gate-scope`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScopeArg {
    /// Every pod on the node is gated.
    AllPods,
    /// Only host-network pods are gated; pod-network pods are left to the SDN's own rules.
    HostNetworkOnly,
}

impl From<ScopeArg> for Scope {
    fn from(a: ScopeArg) -> Scope {
        match a {
            ScopeArg::AllPods => Scope::AllPods,
            ScopeArg::HostNetworkOnly => Scope::HostNetworkOnly,
        }
    }
}

/// `--egress-program`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum EgressArg {
    /// With pid/comm in events where the kernel allows, else without.
    Auto,
    /// With pid/comm (fails where the kernel rejects the helpers).
    Task,
    /// Without pid/comm.
    Notask,
}

impl From<EgressArg> for EgressProgram {
    fn from(a: EgressArg) -> EgressProgram {
        match a {
            EgressArg::Auto => EgressProgram::Auto,
            EgressArg::Task => EgressProgram::Task,
            EgressArg::Notask => EgressProgram::Notask,
        }
    }
}

/// `--tc-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum TcModeArg {
    /// tcx where the kernel has it (6.6+), else clsact.
    Auto,
    Tcx,
    Clsact,
}

impl From<TcModeArg> for TcMode {
    fn from(a: TcModeArg) -> TcMode {
        match a {
            TcModeArg::Auto => TcMode::Auto,
            TcModeArg::Tcx => TcMode::Tcx,
            TcModeArg::Clsact => TcMode::Clsact,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &[&str]) -> Result<AgentConfig, ConfigError> {
        let args = ["gate-agent", "run", "--policy", "p", "--cgroup-root", "c"];
        match Cli::try_parse_from(args.iter().chain(extra)).expect("flags parse").command {
            Command::Run(r) => r.into_config(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn metrics_share_the_listen_address_unless_given_their_own() {
        let cfg = config(&[]).expect("config");
        let probes: SocketAddr = "127.0.0.1:9750".parse().expect("addr");
        assert_eq!(cfg.listen, Listen { probes, metrics: None });

        let cfg = config(&["--listen", "0.0.0.0:9750", "--metrics-listen", "127.0.0.1:9751"])
            .expect("config");
        assert_eq!(cfg.listen.probes, "0.0.0.0:9750".parse().expect("addr"));
        assert_eq!(cfg.listen.metrics, Some("127.0.0.1:9751".parse().expect("addr")));
    }

    #[test]
    fn metrics_apart_on_the_listen_address_is_refused() {
        let e = config(&["--metrics-listen", "127.0.0.1:9750"]).expect_err("same address");
        assert!(matches!(e, ConfigError::SameListen(_)), "{e}");
    }
}
