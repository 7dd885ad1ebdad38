//! The binaries the privileged tests, the demo and the benchmarks run, built and located.
use std::{path::PathBuf, process::Command};

use anyhow::Result;
use integration_tests::bins::Bins;

use crate::util::{root, run};

/// `target/` of the workspace (`CARGO_TARGET_DIR` if set).
pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), Into::into)
}

/// Build gate-agent (with its eBPF object) and the workloads (`probe`, `bench-probe`), in the
/// debug or the release profile, and say where they are.
pub(crate) fn build(release: bool) -> Result<Bins> {
    let mut cmd = Command::new("cargo");
    cmd.args(["build", "-q", "-p", "gate-agent", "-p", "integration-tests", "--bins"]);
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd)?;
    Ok(Bins::in_dir(&target_dir().join(if release { "release" } else { "debug" })))
}
