//! `cargo xtask cluster build`: the real Kubernetes the cluster tests run, built from the Go
//! modules in `tests/cluster` into `target/cluster/bin`: `k8s.io/kubernetes` with every staging
//! module replaced by its `v0.x.y` tag (the way the project is used as a dependency), and the
//! etcd it is tested with (`tests/cluster/etcd`). Each module is built again only when its pins
//! (`go.mod`, `go.sum`) change.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, ensure};

use super::{root, show, target_dir};

/// Run `cmd`, echoing it; fail on a non-zero exit.
fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("$ {}", show(cmd));
    let status = cmd.status().with_context(|| format!("starting {}", show(cmd)))?;
    anyhow::ensure!(status.success(), "{} failed: {status}", show(cmd));
    Ok(())
}

/// One Go module under `tests/cluster` and the commands built from it.
struct Module {
    /// Names its stamp, `.pins.<name>`.
    name: &'static str,
    /// Its directory, under `tests/cluster`.
    dir: &'static str,
    /// Each binary with its main package.
    bins: &'static [(&'static str, &'static str)],
    /// The linker flags that give the binaries their release's version, from the `go.mod`.
    ldflags: fn(&str) -> Result<String>,
    /// Extra environment for `go build`, as the project's own build sets it.
    env: &'static [(&'static str, &'static str)],
}

const MODULES: [Module; 2] = [
    Module {
        name: "kubernetes",
        dir: "",
        bins: &[
            ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
            ("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager"),
            ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
            ("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
            // The client of the same release, for the tests to drive the cluster with.
            ("kubectl", "k8s.io/kubernetes/cmd/kubectl"),
        ],
        ldflags: kubernetes_flags,
        env: &[],
    },
    Module {
        name: "etcd",
        dir: "etcd",
        // What etcd's scripts/build_lib.sh builds: the server's main package is the etcd binary.
        bins: &[("etcd", "go.etcd.io/etcd/server/v3"), ("etcdctl", "go.etcd.io/etcd/etcdctl/v3")],
        ldflags: etcd_flags,
        // Static, as etcd's release binaries are.
        env: &[("CGO_ENABLED", "0")],
    },
];

/// The etcd release `tests/cluster/etcd` pins and its tag's commit, as `git rev-parse --short`
/// gives it to etcd's build (`etcd --version` of the 3.6.5 release: `Git SHA: a061450`); a
/// module has no git tree to read it from. Tag v3.6.5 of github.com/etcd-io/etcd is
/// a0614505aff9b8ff469e9c59c2d979a5936d13f4.
const ETCD_RELEASE: (&str, &str) = ("v3.6.5", "a061450");

/// Where the binaries land, with the pins each module was built from (`.pins.<name>`).
fn out_dir() -> PathBuf {
    target_dir().join("cluster").join("bin")
}

/// Whether `module`'s binaries in `out` were built from `pins` and are all there.
fn up_to_date(out: &Path, module: &Module, pins: &[u8]) -> bool {
    fs::read(out.join(format!(".pins.{}", module.name))).is_ok_and(|s| s == pins)
        && module.bins.iter().all(|(bin, _)| out.join(bin).is_file())
}

/// The version of `path` the module requires (`vX.Y.Z`).
fn required<'a>(gomod: &'a str, path: &str) -> Option<&'a str> {
    gomod.lines().find_map(|l| {
        let l = l.trim();
        let mut words = l.strip_prefix("require ").unwrap_or(l).split_whitespace();
        (words.next() == Some(path)).then(|| words.next()).flatten()
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

fn kubernetes_flags(gomod: &str) -> Result<String> {
    let version = required(gomod, "k8s.io/kubernetes")
        .context("tests/cluster/go.mod requires no k8s.io/kubernetes")?;
    Ok(version_flags(version))
}

/// etcd's version is a constant of its `api/v3/version`; its build links in only the commit.
fn etcd_flags(gomod: &str) -> Result<String> {
    let version = required(gomod, "go.etcd.io/etcd/server/v3")
        .context("tests/cluster/etcd/go.mod requires no go.etcd.io/etcd/server/v3")?;
    let (release, sha) = ETCD_RELEASE;
    ensure!(
        version == release,
        "tests/cluster/etcd pins etcd {version}, ETCD_RELEASE in tests/src/cluster/build.rs names \
         {release}'s commit: give it {version}'s"
    );
    Ok(format!("-X go.etcd.io/etcd/api/v3/version.GitSHA={sha}"))
}

/// Build each module's binaries unless they are up to date; returns their directory.
pub fn build() -> Result<PathBuf> {
    let out = out_dir();
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    for module in &MODULES {
        let dir = root().join("tests").join("cluster").join(module.dir);
        let gomod = fs::read_to_string(dir.join("go.mod"))
            .with_context(|| format!("reading {}", dir.join("go.mod").display()))?;
        let mut pins = gomod.clone().into_bytes();
        pins.extend(
            fs::read(dir.join("go.sum"))
                .with_context(|| format!("reading {}", dir.join("go.sum").display()))?,
        );
        let names = module.bins.iter().map(|(bin, _)| *bin).collect::<Vec<_>>().join(", ");
        if up_to_date(&out, module, &pins) {
            println!("cluster: {names} up to date in {}", out.display());
            continue;
        }
        let flags = (module.ldflags)(&gomod)?;
        let stamp = out.join(format!(".pins.{}", module.name));
        // Not up to date until every binary is built again (a change of pins can be undone).
        let _ = fs::remove_file(&stamp);
        for (bin, package) in module.bins {
            // `-C`: `run` starts every command in the workspace root.
            let mut cmd = Command::new("go");
            cmd.arg("-C").arg(&dir).args(["build", "-trimpath", "-ldflags", &flags, "-o"]);
            cmd.arg(out.join(bin)).arg(package).envs(module.env.iter().copied());
            run(&mut cmd)
                .with_context(|| format!("building {bin} (needs Go and the Go module proxy)"))?;
        }
        fs::write(&stamp, &pins)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_releases_come_from_the_modules() {
        let gomod = "module x\n\ngo 1.24.0\n\nrequire k8s.io/kubernetes v1.34.4\n";
        assert_eq!(required(gomod, "k8s.io/kubernetes"), Some("v1.34.4"));
        let block = "require (\n\tk8s.io/kubernetes v1.35.0 // indirect\n)\n";
        assert_eq!(required(block, "k8s.io/kubernetes"), Some("v1.35.0"));
        assert_eq!(required("require k8s.io/kubernetes-x v1.0.0\n", "k8s.io/kubernetes"), None);
        assert_eq!(required("module x\n", "k8s.io/kubernetes"), None);
        let flags = kubernetes_flags(gomod).expect("flags");
        assert!(flags.contains("k8s.io/component-base/version.gitVersion=v1.34.4 "), "{flags}");
        assert!(flags.contains("k8s.io/client-go/pkg/version.gitMinor=34 "), "{flags}");
        let etcd = "require (\n\tgo.etcd.io/etcd/server/v3 v3.6.5 // indirect\n)\n";
        let flags = etcd_flags(etcd).expect("flags");
        assert_eq!(flags, "-X go.etcd.io/etcd/api/v3/version.GitSHA=a061450");
        let other = etcd_flags(&etcd.replace("v3.6.5", "v3.6.6")).expect_err("another release");
        assert!(other.to_string().contains("ETCD_RELEASE"), "{other}");
    }

    #[test]
    fn the_pinned_modules_name_the_releases_linked_in() {
        for module in &MODULES {
            let gomod = root().join("tests").join("cluster").join(module.dir).join("go.mod");
            let gomod = fs::read_to_string(&gomod).expect("go.mod");
            (module.ldflags)(&gomod).expect(module.name);
        }
    }

    #[test]
    fn binaries_are_rebuilt_when_the_pins_change_or_one_is_missing() {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = dir.path();
        let [kubernetes, etcd] = &MODULES;
        assert!(!up_to_date(out, kubernetes, b"a"), "nothing built yet");
        for (bin, _) in kubernetes.bins {
            fs::write(out.join(bin), b"").expect("binary");
        }
        fs::write(out.join(".pins.kubernetes"), b"a").expect("stamp");
        assert!(up_to_date(out, kubernetes, b"a"));
        assert!(!up_to_date(out, kubernetes, b"b"), "the pins changed");
        assert!(!up_to_date(out, etcd, b"a"), "each module has its own stamp");
        fs::remove_file(out.join("kubelet")).expect("remove");
        assert!(!up_to_date(out, kubernetes, b"a"), "a binary is missing");
    }
}
