//! `gate-agent boot`: close the gate before the kubelet starts, on a node that rebooted.
//!
//! A reboot empties bpffs, so the pinned gate is gone until the DaemonSet's agent runs again
//! — and the kubelet restarts the node's pods before that. A systemd unit ordered before
//! the kubelet runs this step: it loads the programs, writes the last good policy and the
//! allow set the agent kept in its state dir (`--state-dir`), attaches them to the gated
//! root (creating the root if the kubelet has not yet) and exits. The gate is pinned, so
//! it holds; the agent adopts it when it comes up and adds what the boot step does not do:
//! the node-level programs, the allow set of pods that started since, live policy.
//!
//! An allow-listed pod whose cgroup did not exist at boot is refused until the agent has
//! resolved it (components retry); that is the price of no open window.
use std::path::Path;

use anyhow::{Context as _, Result};
use gate_common::user::AllowSet;

use crate::{
    cgroup::GatedRoot,
    engine::install,
    loader::{EgressProgram, Gate, Start},
    policy::Policy,
    state::StateDir,
};

pub(crate) fn run(state_dir: &Path, pin_dir: &Path, cgroup_root: &Path) -> Result<()> {
    let state = StateDir::new(state_dir);
    let text = state.load_policy().with_context(|| {
        format!(
            "{}: no policy kept (the agent has not run on this node yet); nothing to close",
            state_dir.display()
        )
    })?;
    let source = state_dir.join("policy.yaml").display().to_string();
    let policy = Policy::parse(&source, &text)?;
    if !cgroup_root.exists() {
        std::fs::create_dir_all(cgroup_root)
            .with_context(|| format!("creating the gated root {}", cgroup_root.display()))?;
        tracing::info!(cgroup_root = %cgroup_root.display(), "created the gated root");
    }
    let root = GatedRoot::open(cgroup_root)?;
    let mut gate = Gate::open(pin_dir, EgressProgram::Auto, true, true)
        .context("loading the eBPF programs")?;
    if gate.start() == Start::Adopted {
        gate.check_root(&root)?;
        tracing::info!(pin_dir = %pin_dir.display(), "a gate is pinned already; nothing to do");
        return Ok(());
    }
    let allow: AllowSet = state
        .load_allow()
        .with_context(|| format!("reading the allow set kept in {}", state_dir.display()))?
        .into_iter()
        .filter_map(|a| {
            let id = std::os::unix::fs::MetadataExt::ino(
                &std::fs::metadata(root.path.join(&a.path)).ok()?,
            );
            Some((id, a.value))
        })
        .collect();
    let names = policy.endpoint_names();
    gate.apply(&install(&policy, &names, &allow, 0), &root).context("writing the policy maps")?;
    gate.attach(&root).with_context(|| format!("attaching to {}", root.path.display()))?;
    tracing::info!(
        policy_hash = %policy.hash(),
        cgroup_root = %root.path.display(),
        pin_dir = %pin_dir.display(),
        allowed_cgroups = allow.len(),
        "the gate is closed (boot step); the agent adopts it when it starts"
    );
    Ok(())
}
