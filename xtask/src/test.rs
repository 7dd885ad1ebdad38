//! `cargo xtask test`: unit and property tests (the xtask's own among them: those of the
//! manifest checks; and the bench's statistics), the manifests' decision checks (their shape
//! is judged by a real API server in `cargo xtask cluster manifests`, which `.ci/run` runs
//! next), the privileged kernel tests (root; under CI=true they must run, never skip) and a
//! smoke run of the benchmarks.
use std::process::Command;

use anyhow::{Result, bail};
use integration_tests::sys::{in_ci, is_root};

use crate::util;

pub(crate) fn run(filter: Option<&str>) -> Result<()> {
    util::run(Command::new("cargo").args([
        "test",
        "-p",
        "gate-common",
        "-p",
        "gate-agent",
        "-p",
        "xtask",
        "-p",
        crate::bench::PACKAGE,
    ]))?;
    util::run(Command::new("cargo").args(["test", "-p", "integration-tests", "--lib"]))?;
    crate::manifests::run()?;
    let bins = crate::bins::build(crate::bins::Profile::Checked)?;
    if !is_root() {
        if in_ci() {
            bail!("the privileged kernel tests need root, and CI=true forbids skipping them");
        }
        eprintln!(
            "\n*** privileged kernel tests SKIPPED: they need root (run `sudo cargo xtask test`) ***"
        );
        return Ok(());
    }
    // The clouds' SDKs that proxy::sdk runs (HOST only: the kernel VMs have no Python).
    let python_sdk = crate::setup::ensure_python_sdk()?;
    let mut cmd = Command::new("cargo");
    cmd.args(["test", "-p", "integration-tests", "--test", "privileged", "--"]);
    if let Some(f) = filter {
        cmd.arg(f);
    }
    // The test process finds the binaries just built through these variables of its own.
    cmd.arg("--test-threads=1").envs(bins.env());
    cmd.env(integration_tests::python::DIR_VAR, &python_sdk);
    util::run(&mut cmd)?;
    if filter.is_none() {
        // Smoke run of the benchmarks: every variant must enforce the policy (each is
        // checked as it is put in force), every scenario must run and the report must be
        // complete; no timing is asserted (numbers from a shared CI machine mean nothing).
        crate::bench::run(&["--quick".into()])?;
    }
    Ok(())
}
