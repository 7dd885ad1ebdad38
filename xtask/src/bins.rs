//! The binaries the privileged tests, the demo and the bench run, built and located.
use std::{path::PathBuf, process::Command};

use anyhow::Result;
use integration_tests::bins::Bins;

use crate::util::{root, run};

/// `target/` of the workspace (`CARGO_TARGET_DIR` if set).
pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), Into::into)
}

/// The cargo profile binaries are built in (Cargo.toml).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Profile {
    /// Release speed with debug assertions and overflow checks: what tests run.
    Checked,
    /// Unoptimised, without debug info: the quickest to build from a fresh clone (the demo).
    Demo,
    /// What users run, and what the full benchmark measures.
    Release,
}

impl Profile {
    fn name(self) -> &'static str {
        match self {
            Profile::Checked => "checked",
            Profile::Demo => "demo",
            Profile::Release => "release",
        }
    }
}

/// Build gate-agent (with its eBPF object) and the `probe` workload in `profile`, and say
/// where they are.
pub(crate) fn build(profile: Profile) -> Result<Bins> {
    cargo_build(profile, &["gate-agent", "integration-tests"])?;
    Ok(Bins::in_dir(&profile_dir(profile)))
}

/// `cargo build --bins` of `packages` in `profile`.
pub(crate) fn cargo_build(profile: Profile, packages: &[&str]) -> Result<()> {
    let mut cmd = Command::new("cargo");
    cmd.args(["build", "-q", "--bins", "--profile", profile.name()]);
    for p in packages {
        cmd.args(["-p", p]);
    }
    run(&mut cmd)
}

/// Where `profile`'s binaries are: `target/<profile>`.
pub(crate) fn profile_dir(profile: Profile) -> PathBuf {
    target_dir().join(profile.name())
}
