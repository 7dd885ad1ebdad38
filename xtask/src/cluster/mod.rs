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

/// `cargo xtask cluster up`: the cluster until Ctrl-C or `cluster down`, then everything
/// removed.
pub(crate) fn up() -> anyhow::Result<()> {
    let pid_file = integration_tests::cluster::up_pid_file();
    if let Some(pid) = running_up(&pid_file) {
        anyhow::bail!("a cluster is up already (pid {pid}); `cargo xtask cluster down` first");
    }
    let cluster = integration_tests::cluster::Cluster::start()?;
    std::fs::write(&pid_file, std::process::id().to_string())
        .with_context(|| format!("writing {}", pid_file.display()))?;
    eprintln!(
        "cluster up: kubectl --kubeconfig {} (run it in the network namespace {}); Ctrl-C or \
         `cargo xtask cluster down` removes it",
        cluster.cp.kubeconfig().display(),
        cluster.cp.net.node
    );
    let signal = integration_tests::cluster::wait_for_signal();
    drop(cluster);
    let _ = std::fs::remove_file(&pid_file);
    signal?;
    eprintln!("cluster removed");
    Ok(())
}

/// `cargo xtask cluster down`: end the `cluster up` of this checkout (SIGTERM to its pid,
/// which removes everything as Ctrl-C does) and wait until it has.
pub(crate) fn down() -> anyhow::Result<()> {
    let pid_file = integration_tests::cluster::up_pid_file();
    let Some(pid) = running_up(&pid_file) else {
        let _ = std::fs::remove_file(&pid_file);
        eprintln!("no cluster up");
        return Ok(());
    };
    // SAFETY: kill(2) on the pid `running_up` found to be this checkout's `cluster up`.
    if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
        return Err(std::io::Error::last_os_error()).context(format!("signalling pid {pid}"));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        anyhow::ensure!(std::time::Instant::now() < deadline, "pid {pid} still runs after 120 s");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    eprintln!("cluster down (pid {pid} removed it)");
    Ok(())
}

/// The pid in `pid_file` if that process is a `cluster up` still running: a pid the file
/// names but another program now has is never signalled.
fn running_up(pid_file: &std::path::Path) -> Option<libc::pid_t> {
    let pid: libc::pid_t = std::fs::read_to_string(pid_file).ok()?.trim().parse().ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let is_up = args.windows(2).any(|w| w[0] == b"cluster" && w[1] == b"up");
    is_up.then_some(pid)
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
