//! `cargo xtask cluster`: a real Kubernetes for the cluster tests. [`build`] makes it from the
//! Go modules in tests/cluster; [`pki`] makes its certificates; [`control_plane`] starts etcd
//! and the API server in network namespaces of their own; [`dry_run`] has that API server
//! judge every manifest deploy/ ships.
mod build;
mod control_plane;
mod dry_run;
mod pki;

pub(crate) use build::build;
pub(crate) use dry_run::run as manifests;
