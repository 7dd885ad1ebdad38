//! Prerequisites, lint and test orchestration.
use std::process::Command;

use anyhow::{Context as _, Result, bail};

use crate::util::{in_ci, is_root, output, root, run};

pub const BPF_LINKER_VERSION: &str = "0.10.1";

/// Install what is missing; skip what is there (CI runs this on every clean clone).
pub fn ensure() -> Result<()> {
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        "nightly",
    ]))
    .unwrap_or_default();
    let missing: Vec<&str> = ["rust-src", "clippy", "rustfmt"]
        .into_iter()
        .filter(|c| !installed.lines().any(|l| l.starts_with(&format!("{c}-")) || l == *c))
        .collect();
    if installed.is_empty() {
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
            "--component",
            "rust-src,clippy,rustfmt",
        ]))?;
    } else if !missing.is_empty() {
        let mut cmd = Command::new("rustup");
        cmd.args(["component", "add", "--toolchain", "nightly"]).args(&missing);
        run(&mut cmd)?;
    }

    let linker = output(Command::new("bpf-linker").arg("--version")).unwrap_or_default();
    if !linker.contains(BPF_LINKER_VERSION) {
        // 0.10.x links with the Rust toolchain's own LLVM; newer ones need a system LLVM.
        run(Command::new("cargo").args([
            "install",
            &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            "--locked",
            "--force",
        ]))?;
    }

    let mut debs = Vec::new();
    if output(Command::new("ip").arg("-V")).is_none() {
        debs.push("iproute2");
    }
    if output(Command::new("nsenter").arg("--version")).is_none() {
        debs.push("util-linux");
    }
    // The benchmark's comparison variants and its chart's font.
    if output(Command::new("nft").arg("--version")).is_none() {
        debs.push("nftables");
    }
    if output(Command::new("iptables-nft-restore").arg("--version")).is_none() {
        debs.push("iptables");
    }
    if !std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        debs.push("fonts-dejavu-core");
    }
    if !debs.is_empty() {
        if !is_root() {
            bail!("missing Debian packages {debs:?}; install them as root");
        }
        run(Command::new("apt-get").arg("update").arg("-qq"))?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&debs))?;
    }

    // `cargo xtask manifests` renders deploy/ with `kubectl kustomize` (kustomize v5). The
    // machines' image has the Debian package kubectl; it is installed apart from the others
    // so that a Debian without it says so plainly.
    if output(Command::new("kubectl").args(["version", "--client"])).is_none() {
        if !is_root() {
            bail!("kubectl is missing (Debian package kubectl); install it as root");
        }
        if debs.is_empty() {
            run(Command::new("apt-get").arg("update").arg("-qq"))?;
        }
        let mut cmd = Command::new("apt-get");
        cmd.args(["install", "-y", "-qq", "--no-install-recommends", "kubectl"]);
        run(&mut cmd).context(
            "installing kubectl (needed by `cargo xtask manifests`): if no apt source provides \
             the package kubectl, install kubectl 1.27+ (kustomize v5) by other means",
        )?;
    }
    Ok(())
}

pub fn lint() -> Result<()> {
    run(Command::new("cargo").args(["+nightly", "fmt", "--all", "--", "--check"]))?;
    // The eBPF crate needs nightly features and its own target: it is linted on its own below.
    run(Command::new("cargo").args([
        "clippy",
        "--workspace",
        "--exclude",
        "gate-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    // The eBPF crate on its own, for its real target.
    run(Command::new("cargo").current_dir(root().join("gate-ebpf")).args([
        "+nightly",
        "clippy",
        "-p",
        "gate-ebpf",
        "--bins",
        "--release",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--",
        "-D",
        "warnings",
    ]))?;
    Ok(())
}

/// The binaries the privileged tests, the demo and the benchmarks run: gate-agent (with its
/// eBPF object) and the workloads.
pub fn build_bins(release: bool) -> Result<()> {
    let mut cmd = Command::new("cargo");
    cmd.args(["build", "-q", "-p", "gate-agent", "-p", "integration-tests", "--bins"]);
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd)
}

pub fn test(filter: Option<&str>) -> Result<()> {
    run(Command::new("cargo").args(["test", "-p", "gate-common", "-p", "gate-agent"]))?;
    run(Command::new("cargo").args(["test", "-p", "integration-tests", "--lib"]))?;
    crate::manifests::run()?;
    build_bins(false)?;
    if !is_root() {
        if in_ci() {
            bail!("the privileged kernel tests need root, and CI=true forbids skipping them");
        }
        eprintln!(
            "\n*** privileged kernel tests SKIPPED: they need root (run `sudo cargo xtask test`) ***"
        );
        return Ok(());
    }
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), Into::into);
    let agent = target.join("debug/gate-agent");
    let mut cmd = Command::new("cargo");
    cmd.args(["test", "-p", "integration-tests", "--test", "privileged", "--"]);
    if let Some(f) = filter {
        cmd.arg(f);
    }
    cmd.arg("--test-threads=1").env("GATE_AGENT_BIN", agent);
    run(&mut cmd)?;
    if filter.is_none() {
        // Smoke run of the benchmarks: every scenario and variant must run; no timing is
        // asserted (numbers from a shared CI machine mean nothing).
        crate::bench::run_bench(true)?;
    }
    Ok(())
}
