//! Shared between the metadata-gate kernel programs (`gate-ebpf`) and the agent.
//!
//! * [`abi`]: `#[repr(C)]` map keys and values, map and program names, limits. Changing any of
//!   these changes the pinned ABI ([`abi::ABI_VERSION`]).
//! * [`verdict`]: the pure decision functions the kernel programs call. They see the maps only
//!   through the [`verdict::Tables`] trait, so the host tests exercise the very code the kernel
//!   runs.
//! * [`packet`]: reading a frame or IP packet as it will be delivered, failing closed (the
//!   same code in the kernel and in the host tests).
//! * [`sockets`]: which sockets and socket options a gated workload is denied (the doors
//!   past tc, and reading the node's traffic), for the LSM and cgroup/setsockopt programs.
//! * [`compile`] (host only): turns a list of endpoints into the table entries that make
//!   [`verdict::match_endpoint`] agree with a plain reading of the policy.
//! * [`http`] (host only): what the metadata proxy may serve: path rules and request targets,
//!   read strictly, judged without I/O.
//! * [`metrics`] (host only): the catalog of the agent's metric families (names, help, labels).
//! * [`user`] (feature `user`): typed views of the ABI for user space: one vocabulary for
//!   hooks, verdicts, modes and attach points, the allow set, and `aya::Pod` glue.
#![cfg_attr(target_arch = "bpf", no_std)]

pub mod abi;
#[cfg(not(target_arch = "bpf"))]
pub mod compile;
#[cfg(not(target_arch = "bpf"))]
pub mod http;
#[cfg(not(target_arch = "bpf"))]
pub mod metrics;
pub mod packet;
pub mod sockets;
#[cfg(feature = "user")]
pub mod user;
pub mod verdict;

/// The toolchain that builds the kernel programs (gate-agent's build.rs, `cargo xtask lint`
/// and `setup`): the nightly proven with bpf-linker 0.10.1, which links with that
/// toolchain's own LLVM (22). A newer nightly may carry an LLVM it was not proven with.
/// `gate-ebpf/rust-toolchain.toml` names the same one for cargo run by hand in that
/// directory (a test holds the two together).
#[cfg(not(target_arch = "bpf"))]
pub const EBPF_TOOLCHAIN: &str = "nightly-2026-05-19";

#[cfg(all(test, not(target_arch = "bpf")))]
mod toolchain_tests {
    #[test]
    fn the_ebpf_crates_toolchain_file_names_the_pinned_nightly() {
        let file = include_str!("../../gate-ebpf/rust-toolchain.toml");
        let channel = file
            .lines()
            .find_map(|l| l.trim().strip_prefix("channel"))
            .and_then(|v| v.trim().strip_prefix('='))
            .map(|v| v.trim().trim_matches('"'));
        assert_eq!(channel, Some(super::EBPF_TOOLCHAIN));
    }
}
