//! `cargo xtask setup`: install what a fresh machine lacks (every other command runs it first).
use std::process::Command;

use anyhow::{Context as _, Result, bail};
use gate_common::EBPF_TOOLCHAIN;

use integration_tests::sys::is_root;

use crate::util::{output, run};

pub(crate) const BPF_LINKER_VERSION: &str = "0.10.1";
/// The virtme-ng that `cargo xtask test-kernels` was proven with.
const VIRTME_NG_VERSION: &str = "1.42";

/// Install what is missing; skip what is there (CI runs this on every clean clone).
pub(crate) fn ensure() -> Result<()> {
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        EBPF_TOOLCHAIN,
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
            EBPF_TOOLCHAIN,
            "--profile",
            "minimal",
            "--component",
            "rust-src,clippy,rustfmt",
        ]))?;
    } else if !missing.is_empty() {
        let mut cmd = Command::new("rustup");
        cmd.args(["component", "add", "--toolchain", EBPF_TOOLCHAIN]).args(&missing);
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

    // (command that answers, Debian package that provides it): the privileged tests' ip and
    // nsenter; the boot unit's check (`cargo xtask manifests`); the benchmark's comparison
    // variants; `cargo xtask test-kernels`' QEMU and the depmod virtme-ng builds its
    // initramfs with.
    const TOOLS: &[(&str, &str, &str)] = &[
        ("ip", "-V", "iproute2"),
        ("nsenter", "--version", "util-linux"),
        ("systemd-analyze", "--version", "systemd"),
        ("nft", "--version", "nftables"),
        ("iptables-nft-restore", "--version", "iptables"),
        ("qemu-system-x86_64", "--version", "qemu-system-x86"),
        ("depmod", "--version", "kmod"),
        // The cluster test's node (`cargo xtask cluster e2e`).
        ("containerd", "--version", "containerd"),
        ("runc", "--version", "runc"),
    ];
    let mut debs: Vec<&str> = TOOLS
        .iter()
        .filter(|(tool, arg, _)| output(Command::new(tool).arg(arg)).is_none())
        .map(|(_, _, deb)| *deb)
        .collect();
    // The benchmark chart's font, virtme-ng's (and the cluster's client image's) static
    // busybox, test-kernels' archive keyring.
    if !std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        debs.push("fonts-dejavu-core");
    }
    if !std::path::Path::new("/bin/busybox").exists() || !busybox_is_static() {
        debs.push("busybox-static");
    }
    // The cluster test's pod network (bridge, host-local, loopback, portmap).
    if !std::path::Path::new("/usr/lib/cni/bridge").exists() {
        debs.push("containernetworking-plugins");
    }
    if !std::path::Path::new("/usr/share/keyrings/debian-archive-keyring.gpg").exists() {
        debs.push("debian-archive-keyring");
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

    // virtme-ng (PyPI): boots the test kernels of `cargo xtask test-kernels`.
    if output(Command::new("vng").arg("--version")).is_none()
        && output(Command::new("python3").args(["-m", "pip", "show", "-q", "virtme-ng"])).is_none()
    {
        run(Command::new("python3").args([
            "-m",
            "pip",
            "install",
            "-q",
            "--root-user-action=ignore",
            &format!("virtme-ng=={VIRTME_NG_VERSION}"),
        ]))?;
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

/// Whether /bin/busybox is linked statically (virtme-ng's initramfs needs that; Debian's
/// `busybox` package is dynamic, `busybox-static` is not).
fn busybox_is_static() -> bool {
    output(Command::new("ldd").arg("/bin/busybox")).is_none()
}

/// The clouds' Python SDKs that the privileged test `proxy::sdk` runs as workloads: exactly the
/// pins of tests/python/requirements.txt, every dependency listed, installed from wheels with
/// pip into `target/python-sdk` (nothing system-wide), and again only when that file changes.
/// The directory keeps a copy of the file it was installed from; the test compares it with
/// its own. About 12 s and 52 MB the first time, nothing after.
pub(crate) fn ensure_python_sdk() -> Result<std::path::PathBuf> {
    use integration_tests::python::{REQUIREMENTS, STAMP};
    let dir = crate::bins::target_dir().join("python-sdk");
    if std::fs::read_to_string(dir.join(STAMP)).is_ok_and(|s| s == REQUIREMENTS) {
        return Ok(dir);
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let requirements = crate::util::root().join("tests/python/requirements.txt");
    run(Command::new("python3")
        .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
        .args(["--root-user-action=ignore", "--no-deps", "--only-binary", ":all:", "--no-compile"])
        .arg("--target")
        .arg(&dir)
        .arg("-r")
        .arg(&requirements))
    .context("installing the Python SDKs of the privileged test proxy::sdk")?;
    std::fs::write(dir.join(STAMP), REQUIREMENTS)?;
    Ok(dir)
}
