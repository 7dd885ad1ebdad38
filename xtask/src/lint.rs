//! `cargo xtask lint`: rustfmt check, clippy -D warnings on the host crates and on the eBPF
//! crate for its own target.
use std::process::Command;

use anyhow::Result;
use gate_common::EBPF_TOOLCHAIN;

use crate::util::{self, root};

pub(crate) fn run() -> Result<()> {
    let nightly = format!("+{EBPF_TOOLCHAIN}");
    util::run(Command::new("cargo").args([&nightly, "fmt", "--all", "--", "--check"]))?;
    // The eBPF crate needs nightly features and its own target: it is linted on its own below.
    util::run(Command::new("cargo").args([
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
    util::run(Command::new("cargo").current_dir(root().join("gate-ebpf")).args([
        &nightly,
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
