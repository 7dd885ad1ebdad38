//! Builds the kernel programs (gate-ebpf, for bpfel-unknown-none with the nightly toolchain
//! and bpf-linker) into OUT_DIR, where `loader` embeds them.
use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?;
    let workspace = std::path::Path::new(&manifest_dir)
        .parent()
        .ok_or_else(|| anyhow!("gate-agent has no parent directory"))?;
    let root_dir = workspace.join("gate-ebpf");
    let root_dir = root_dir.to_str().ok_or_else(|| anyhow!("non-UTF-8 path {root_dir:?}"))?;
    println!("cargo:rerun-if-changed={}", workspace.join("gate-common").display());
    aya_build::build_ebpf(
        [Package { name: "gate-ebpf", root_dir, ..Default::default() }],
        Toolchain::Custom(gate_common::EBPF_TOOLCHAIN),
    )
}
