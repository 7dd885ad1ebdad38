//! metadata-gate agent library: everything but the binary's entry point. Public: the
//! commands (for `main`), and the policy and cluster identity modules the integration tests
//! of this crate drive directly; everything else is private to the crate.
mod access;
mod boot;
mod bounds;
mod cgroup;
mod cli;
pub mod cluster;
pub mod commands;
mod config;
mod engine;
mod events;
mod inspect;
mod loader;
mod metrics;
mod netlink;
mod netns;
mod node;
pub mod policy;
mod policy_file;
mod proxy;
mod ratelimit;
mod rlimits;
mod server;
mod sockdiag;
mod standalone;
mod state;
mod status;
mod terminate;

/// The metadata proxy's fuzz target (fuzz/): one connection's bytes, the first choosing the
/// caller. Built only with the `fuzzing` feature.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub fn fuzz_proxy_connection(data: &[u8]) {
    proxy::fuzzing::one_connection(data);
}
