//! `cargo xtask cluster`: a real Kubernetes for the cluster tests, from the harness in
//! `integration_tests::cluster`. [`dry_run`] has its API server judge every manifest deploy/
//! ships, with the CRDs of [`crds`].
mod crds;
mod dry_run;

use anyhow::Context as _;

pub(crate) use dry_run::run as manifests;
pub(crate) use integration_tests::cluster::build;

/// The vendored CRDs (xtask/schemas/) as CustomResourceDefinition objects: what a test
/// cluster must serve before it can take deploy/'s custom resources.
fn custom_resource_definitions() -> anyhow::Result<Vec<serde_json::Value>> {
    crds::definitions().context("a vendored CRD schema is not JSON")
}

/// `cargo xtask cluster up`: the cluster until Ctrl-C, then everything removed.
pub(crate) fn up() -> anyhow::Result<()> {
    let cluster = integration_tests::cluster::Cluster::start()?;
    eprintln!(
        "cluster up: kubectl --kubeconfig {} (run it in the network namespace {}); Ctrl-C \
         removes it",
        cluster.cp.kubeconfig().display(),
        cluster.cp.net.node
    );
    integration_tests::cluster::wait_for_signal()?;
    drop(cluster);
    eprintln!("cluster removed");
    Ok(())
}

/// `cargo xtask cluster e2e`: this build's agent (the checked profile the kernel tests run)
/// as a DaemonSet on the cluster, with the scenario of `integration_tests::cluster::scenario`.
pub(crate) fn e2e(keep: bool) -> anyhow::Result<()> {
    crate::setup::ensure()?;
    let bins = crate::bins::build(crate::bins::Profile::Checked)?;
    let crds = custom_resource_definitions()?;
    let report =
        integration_tests::cluster::scenario::run(&integration_tests::cluster::scenario::Inputs {
            bins,
            crds,
            keep,
        })?;
    eprintln!("cluster e2e passed:\n{report}");
    Ok(())
}
