//! Harness for metadata-gate's privileged tests and demo.
//!
//! Everything it creates has a unique name (`mg-<pid>-<n>…`) and is removed by a guard on
//! drop, also when a test panics: network namespaces ([`net::TestNet`]), cgroups
//! ([`cgroups::CgroupTree`]), the fake metadata service's threads ([`imds::FakeImds`]), the
//! agent process with its bpffs pin dir ([`agent::Agent`]), a VM's tap ([`tap::Tap`], gone
//! with its file descriptor). Leftovers of killed test runs (dead pids) are swept at start
//! ([`sys::sweep_stale`]).
//!
//! The binaries it runs (gate-agent, `probe`) are passed in as a [`bins::Bins`]. The bench
//! (bench/) builds its worlds from the same pieces and drives its own workload, `bench-probe`.
//!
//! Hand-built packets and frames (checksums, VLAN tags, IPv6 extension chains, fragments)
//! come from [`frame`]; [`testrun`] runs the gate's packet programs on them
//! (BPF_PROG_TEST_RUN).
//!
//! Safety rules: the fake metadata service lives at 169.254.169.254 inside a test netns;
//! workloads ([`probe`]) run inside the other test netns and assert the route first; nothing
//! is attached to the root cgroup or to a host interface.
pub mod agent;
pub mod bins;
pub mod bpfmap;
pub mod cgquery;
pub mod cgroups;
pub mod cluster;
pub mod frame;
pub mod imds;
pub mod kubeapi;
pub mod net;
pub mod probe;
pub mod python;
pub mod sys;
pub mod tap;
pub mod testrun;
