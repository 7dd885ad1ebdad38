//! Project orchestration: `cargo xtask <command>`. Orchestration only; no product logic here.
//!
//! One module per command (`setup`, `lint`, `test`, `kernels`, `demo`, `policy_test`,
//! `new_provider`, `manifests`, `kind`, `cluster`, `bench`);
//! what several of them use lives in `bins` (building and locating the binaries) and `util`
//! (running commands).
mod bench;
mod bins;
mod cluster;
mod demo;
mod kernels;
mod kind;
mod lint;
mod manifests;
mod new_provider;
mod policy_test;
mod setup;
mod test;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "xtask",
    about = "metadata-gate project tasks: setup, lint, tests, kernel matrix, demo, policy test, new provider, manifest checks, kind e2e, benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what a fresh machine lacks: the pinned nightly (2026-05-19) with rust-src,
    /// bpf-linker 0.10.1, the Debian
    /// packages the tests, the bench and the kernel VMs use (iproute2, nftables, iptables,
    /// QEMU, a static busybox …), virtme-ng, and the pinned Python SDKs of the privileged test
    /// proxy::sdk (under target/)
    Setup,
    /// The whole test suite: format, clippy (host and eBPF), unit + property tests, and the
    /// privileged kernel tests (root; under CI=true they must run, never skip)
    Test {
        /// Skip rustfmt and clippy
        #[arg(long)]
        no_lint: bool,
        /// Only run privileged tests whose name contains this (names carry their area:
        /// `enforcement::`, `terminate::`, `tc::`, `lifecycle::`, `cluster::`)
        filter: Option<String>,
    },
    /// The privileged tests inside VMs (QEMU, no KVM needed) booted on Debian's 5.10, 6.1 and
    /// 6.12 kernels, as the table in xtask/src/kernels.rs selects them per kernel (root)
    TestKernels {
        /// 5.10, 6.1, 6.12 or all
        #[arg(long, default_value = "all")]
        kernel: String,
        /// Run every privileged test whose name contains this on the chosen kernels, instead of
        /// the table's selection
        filter: Option<String>,
    },
    /// Lint only: rustfmt check, clippy -D warnings on the host crates and on the eBPF crate
    Lint,
    /// Show the gate working: a throwaway netns with a fake metadata service, two workloads,
    /// one refused and one allow-listed (root)
    Demo,
    /// The packet test of one policy (root): its protected ports refuse a gated workload with
    /// EPERM and serve an allowed cgroup; the platform's neighbours (DNS, NTP, EKS Pod
    /// Identity) stay open. FILE is a policy or a policy ConfigMap (deploy/policies/*.yaml)
    PolicyTest {
        /// The platform, as `gate-agent check --platform` takes it (AWS, GCP, External/oci ...)
        #[arg(long)]
        platform: Option<String>,
        file: std::path::PathBuf,
    },
    /// docs/new-provider.md's checklist for platform NAME (as `--platform` names it:
    /// External/acme), checked: which steps are done and what the first missing one needs,
    /// naming the file and the row (endpoints, first-boot detection, providerID, policy and
    /// allow list, safe paths, docs); exit 1 until the platform is complete. No root needed
    NewProvider {
        /// The platform, as `gate-agent check --platform` takes it
        name: String,
    },
    /// Render every Kustomize target under deploy/ (kubectl kustomize) and check the decisions
    /// the objects encode (SCC, metrics, alerts and runbooks, the proxy's port, the boot
    /// unit); no cluster needed. Kinds, fields and schemas are the API server's to judge:
    /// `cluster manifests` (root)
    Manifests,
    /// End-to-end on kind: build the image, create a cluster, deploy overlays/kind, fake AWS's
    /// IMDS on the worker and check who gets through (needs docker, kind, kubectl)
    E2eKind {
        /// Keep the cluster afterwards (for debugging)
        #[arg(long)]
        keep: bool,
        /// Use this existing image instead of building one (must be named metadata-gate:dev)
        #[arg(long)]
        no_build: bool,
    },
    /// A real Kubernetes for the cluster tests: `build` makes kube-apiserver,
    /// kube-controller-manager, kube-scheduler, kubelet, kubectl, etcd and etcdctl from the Go
    /// modules pinned in tests/cluster (needs Go and the Go module proxy) into
    /// target/cluster/bin, each module again only when its pins change; `manifests` has a real
    /// API server judge every object of deploy/
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
    /// Benchmarks: the gate against no gate, nftables and iptables, side by side; writes
    /// target/bench/{report.json,report.md,chart.png} (root). Builds and runs the bench crate's
    /// gate-bench (bench/) with ARGS: `cargo xtask bench --help` lists its options
    // --help too goes to gate-bench: its options are its own.
    #[command(disable_help_flag = true)]
    Bench {
        /// gate-bench's arguments
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Build the Kubernetes components (cold: see docs/development.md)
    Build,
    /// Start etcd and kube-apiserver in network namespaces of their own and apply every
    /// object deploy/ ships with server-side dry run and strict validation (root)
    Manifests,
    /// Start a single-node cluster in namespaces of its own and keep it until Ctrl-C or
    /// `cluster down` (root)
    Up,
    /// End the running `cluster up` of this checkout: everything it started is removed
    Down,
    /// The DaemonSet on that cluster, from `kubectl apply -k` to packets, each path first
    /// shown open without the gate (root)
    E2e {
        /// Keep the cluster afterwards, passed or failed, until Ctrl-C
        #[arg(long)]
        keep: bool,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Setup => setup::ensure().and_then(|()| setup::ensure_python_sdk().map(drop)),
        Cmd::Lint => {
            setup::ensure()?;
            lint::run()
        }
        Cmd::Test { no_lint, filter } => {
            setup::ensure()?;
            if !no_lint {
                lint::run()?;
            }
            test::run(filter.as_deref())
        }
        Cmd::TestKernels { kernel, filter } => {
            setup::ensure()?;
            kernels::run(&kernels::Options { kernel: &kernel, filter: filter.as_deref() })
        }
        Cmd::Demo => {
            setup::ensure()?;
            demo::run()
        }
        Cmd::PolicyTest { platform, file } => {
            setup::ensure()?;
            policy_test::run(&file, platform.as_deref())
        }
        Cmd::NewProvider { name } => new_provider::run_check(&name),
        Cmd::Manifests => manifests::run(),
        Cmd::Cluster { cmd: ClusterCmd::Build } => cluster::build().map(drop),
        Cmd::Cluster { cmd: ClusterCmd::Manifests } => cluster::manifests(),
        Cmd::Cluster { cmd: ClusterCmd::Up } => cluster::up(),
        Cmd::Cluster { cmd: ClusterCmd::Down } => cluster::down(),
        Cmd::Cluster { cmd: ClusterCmd::E2e { keep } } => cluster::e2e(keep),
        Cmd::E2eKind { keep, no_build } => kind::e2e(kind::Options { keep, build: !no_build }),
        Cmd::Bench { args } => bench::run(&args),
    }
}
