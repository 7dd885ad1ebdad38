//! `cargo xtask cluster build`: the real Kubernetes the cluster tests run, built from the Go
//! module in `tests/cluster` (`k8s.io/kubernetes` with every staging module replaced by its
//! `v0.x.y` tag, the way the project is used as a dependency) into `target/cluster/bin`, and
//! built again only when that module's pins (`go.mod`, `go.sum`) change.
use std::{fs, path::PathBuf, process::Command};

use anyhow::{Context as _, Result};

use crate::{
    bins::target_dir,
    util::{root, run},
};

/// The commands built, each `k8s.io/kubernetes/cmd/<name>`.
pub(crate) const COMPONENTS: [&str; 4] =
    ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet"];

/// Where the binaries land, with the pins they were built from (`.pins`).
fn out_dir() -> PathBuf {
    target_dir().join("cluster").join("bin")
}

/// Whether the binaries in `out` were built from `sum` and are all there.
fn up_to_date(out: &std::path::Path, sum: &[u8]) -> bool {
    fs::read(out.join(".pins")).is_ok_and(|s| s == sum)
        && COMPONENTS.iter().all(|c| out.join(c).is_file())
}

/// The Kubernetes release the module pins (`vX.Y.Z`).
fn release(gomod: &str) -> Option<&str> {
    gomod.lines().find_map(|l| {
        let l = l.trim();
        l.strip_prefix("require ").unwrap_or(l).strip_prefix("k8s.io/kubernetes ").map(str::trim)
    })
}

/// The linker flags that give the binaries their release's version, as upstream's
/// `hack/lib/version.sh` sets it (a module build has no git tree to read it from, and says
/// `v0.0.0-master` otherwise, which the components compare across the cluster).
fn version_flags(version: &str) -> String {
    let mut parts = version.trim_start_matches('v').split('.');
    let (major, minor) = (parts.next().unwrap_or("0"), parts.next().unwrap_or("0"));
    ["k8s.io/component-base/version", "k8s.io/client-go/pkg/version"]
        .iter()
        .map(|p| {
            format!(
                "-X {p}.gitVersion={version} -X {p}.gitMajor={major} -X {p}.gitMinor={minor} \
                 -X {p}.gitTreeState=clean"
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Build the components unless they are up to date; returns their directory.
pub(crate) fn build() -> Result<PathBuf> {
    let module = root().join("tests").join("cluster");
    let mut sum = Vec::new();
    for file in ["go.mod", "go.sum"] {
        sum.extend(
            fs::read(module.join(file)).with_context(|| format!("reading tests/cluster/{file}"))?,
        );
    }
    let out = out_dir();
    if up_to_date(&out, &sum) {
        println!("cluster: {} up to date in {}", COMPONENTS.join(", "), out.display());
        return Ok(out);
    }
    let gomod = fs::read_to_string(module.join("go.mod"))?;
    let version = release(&gomod).context("tests/cluster/go.mod requires no k8s.io/kubernetes")?;
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // `-C`: `run` starts every command in the workspace root.
    let mut cmd = Command::new("go");
    cmd.arg("-C").arg(&module).args(["build", "-trimpath", "-ldflags", &version_flags(version)]);
    cmd.arg("-o").arg(format!("{}/", out.display()));
    cmd.args(COMPONENTS.map(|c| format!("k8s.io/kubernetes/cmd/{c}")));
    run(&mut cmd).context("building Kubernetes (needs Go and the Go module proxy)")?;
    fs::write(out.join(".pins"), &sum)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_comes_from_the_module_and_names_the_binaries() {
        let gomod = "module x\n\ngo 1.24.0\n\nrequire k8s.io/kubernetes v1.34.4\n";
        assert_eq!(release(gomod), Some("v1.34.4"));
        assert_eq!(release("require (\n\tk8s.io/kubernetes v1.35.0\n)\n"), Some("v1.35.0"));
        assert_eq!(release("module x\n"), None);
        let flags = version_flags("v1.34.4");
        assert!(flags.contains("k8s.io/component-base/version.gitVersion=v1.34.4 "), "{flags}");
        assert!(flags.contains("k8s.io/client-go/pkg/version.gitMinor=34 "), "{flags}");
    }

    #[test]
    fn binaries_are_rebuilt_when_the_pins_change_or_one_is_missing() {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = dir.path();
        assert!(!up_to_date(out, b"a"), "nothing built yet");
        for c in COMPONENTS {
            fs::write(out.join(c), b"").expect("binary");
        }
        fs::write(out.join(".pins"), b"a").expect("stamp");
        assert!(up_to_date(out, b"a"));
        assert!(!up_to_date(out, b"b"), "the pins changed");
        fs::remove_file(out.join("kubelet")).expect("remove");
        assert!(!up_to_date(out, b"a"), "a binary is missing");
    }
}
