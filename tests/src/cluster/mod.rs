//! A real Kubernetes for the cluster tests, as plain processes in namespaces of their own.
//! [`build`] makes it from the Go modules in `tests/cluster`; [`pki`] makes its certificates;
//! [`control_plane`] starts etcd, the API server and the controller manager in the node's
//! network namespace of a [`crate::net::TestNet`].
mod build;
pub mod control_plane;
pub mod images;
pub mod node;
mod pki;
mod procs;
pub mod scenario;

use std::path::PathBuf;

pub use build::build;
pub use control_plane::ControlPlane;
pub use node::Node;

/// A whole cluster: the control plane and its one node.
pub struct Cluster {
    /// Declared first: the node goes before the API server it talks to.
    pub node: Node,
    pub cp: ControlPlane,
}

impl Cluster {
    /// Build what is missing, start the control plane, then the node; ready once the node is.
    pub fn start() -> anyhow::Result<Cluster> {
        let cp = ControlPlane::start()?;
        let node = Node::start(&cp)?;
        Ok(Cluster { node, cp })
    }
}

/// The workspace's root (this crate is `tests/`).
fn root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// Cargo's target directory, where the cluster's binaries and run directories go.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), Into::into)
}

/// Where `cargo xtask cluster up` writes its pid while its cluster runs, for `down`.
pub fn up_pid_file() -> PathBuf {
    target_dir().join("cluster").join("up.pid")
}

/// A command line for messages.
fn show(cmd: &std::process::Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Block until SIGINT or SIGTERM (`cargo xtask cluster up` runs until then).
pub fn wait_for_signal() -> anyhow::Result<()> {
    // SAFETY: plain signal-set calls on a local set; blocking the two signals on this thread
    // (and threads it starts later) so that sigwait receives them.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        let mut sig = 0;
        if libc::sigwait(&set, &mut sig) != 0 {
            anyhow::bail!("sigwait: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}
