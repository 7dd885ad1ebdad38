//! metadata-gate agent library: everything but the binary's entry point.
pub mod cgroup;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod events;
pub mod loader;
pub mod metrics;
pub mod netns;
pub mod policy;
pub mod ratelimit;
pub mod server;
pub mod standalone;
pub mod status;
pub mod terminate;
pub mod watch;
