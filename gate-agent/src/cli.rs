//! Command line (stable: scripts depend on it; see shared/DESIGN.md).
use std::{net::SocketAddr, path::PathBuf};

use clap::{Parser, Subcommand, ValueEnum};

pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/metadata-gate";

#[derive(Debug, Parser)]
#[command(
    name = "gate-agent",
    version,
    about = "Keeps workloads away from cloud instance-metadata services (169.254.169.254 and friends)",
    long_about = "Keeps workloads away from cloud instance-metadata services.\n\n\
        eBPF programs attached to a gated cgroup refuse connect()/sendmsg() to protected \
        endpoints with EPERM and drop any other packet to them on egress, unless the \
        process's cgroup (or an ancestor below the gated root) is allow-listed. Processes \
        outside the gated cgroup are not affected.\n\n\
        Lifecycle: `run` pins its programs and maps under --pin-dir, so the gate stays closed \
        when the agent stops or crashes; `cleanup` is the only way to open it."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Load the gate, apply a policy, keep the cgroup allow list current (standalone: --policy + --cgroup-root)
    Run(RunArgs),
    /// Validate policy files; exit 1 with the field and reason of every problem
    Check {
        /// Policy files (YAML, the schema of DESIGN.md)
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
    },
    /// Detach and unpin everything under the pin dir: this opens the gate
    Cleanup {
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
    },
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Policy file (standalone mode)
    #[arg(long, value_name = "FILE", requires = "cgroup_root")]
    pub policy: Option<PathBuf>,
    /// Gated cgroup v2 directory: processes at or below it are gated (standalone mode)
    #[arg(long, value_name = "DIR", requires = "policy")]
    pub cgroup_root: Option<PathBuf>,
    /// bpffs directory for pinned programs and maps (bpffs is mounted on its parent if missing)
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
    pub pin_dir: PathBuf,
    /// Address for /healthz, /readyz and /metrics
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9750")]
    pub listen: SocketAddr,
    /// Log format
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// How often cgroup globs of the allow list are re-evaluated, in milliseconds
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}
