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
