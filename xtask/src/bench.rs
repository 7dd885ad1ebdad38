//! `cargo xtask bench [ARGS]`: build the bench (bench/: `gate-bench` and its workload
//! `bench-probe`) together with the gate-agent it measures, and run it with ARGS.
use std::process::Command;

use anyhow::Result;
use integration_tests::bins::Bins;

use crate::bins::{Profile, cargo_build, profile_dir};

/// The bench's package and binary (bench/Cargo.toml).
pub(crate) const PACKAGE: &str = "metadata-gate-bench";
const BIN: &str = "gate-bench";

/// Build and run `gate-bench ARGS`. Of ARGS only what decides the build is read here; every
/// option, `--help` among them, is gate-bench's.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let measures = !["--help", "-h", "--redraw"].into_iter().any(has);
    // Only a full run's numbers are judged: a smoke run, a redraw or the help take the build
    // the tests already made.
    let profile = if measures && !has("--quick") { Profile::Release } else { Profile::Checked };
    let dir = profile_dir(profile);
    let mut cmd = Command::new(dir.join(BIN));
    if measures {
        crate::setup::ensure()?;
        cargo_build(profile, &["gate-agent", PACKAGE])?;
        // The build just made, whatever the caller's environment names.
        cmd.envs(Bins::in_dir(&dir).env()).env("BENCH_PROBE_BIN", dir.join("bench-probe"));
    } else {
        // Nothing is measured: no root, no agent, no setup.
        cargo_build(profile, &[PACKAGE])?;
    }
    crate::util::run(cmd.args(args))
}
