//! `cargo xtask setup`: install what a fresh machine lacks (every other command runs it first).
use std::process::Command;

use anyhow::{Context as _, Result, bail};

use integration_tests::sys::is_root;

use crate::util::{output, run};

pub(crate) const BPF_LINKER_VERSION: &str = "0.10.1";

/// Install what is missing; skip what is there (CI runs this on every clean clone).
pub(crate) fn ensure() -> Result<()> {
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
