//! `gate-agent run --policy FILE --cgroup-root DIR`: no cluster needed.
//!
//! Start-up never opens the gate: a pinned gate is adopted (see [`crate::loader`]), and a
//! failed start of an adopted gate leaves it enforcing what it enforced. The policy file is
//! followed (inotify) and reloaded on change and on SIGHUP; a bad edit is rejected and the last good
//! policy stays. SIGTERM/SIGINT stop the agent and leave the gate closed.
use std::path::Path;

use anyhow::{Context as _, Result};
use gate_common::user::AllowSet;
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    cgroup::GatedRoot,
    config::AgentConfig,
    engine::{AllowSource, Engine},
    events::CgroupNames,
    policy::{AllowSelector, Policy},
    policy_file::PolicyFileEvents,
};

/// Standalone allow set: cgroups under the root that match the policy's globs.
struct CgroupGlobs(GatedRoot);

impl AllowSource for CgroupGlobs {
    fn allow_set(&self, policy: &Policy) -> AllowSet {
        self.0
            .resolve_allow(policy)
            .into_iter()
            .map(|a| (a.id, policy.allow_value(a.entry)))
            .collect()
    }
}

pub(crate) async fn run(cfg: &AgentConfig, policy_path: &Path, cgroup_root: &Path) -> Result<()> {
    let policy = Policy::load(policy_path)?;
    for entry in policy.allow.iter().filter(|e| !matches!(e.selector, AllowSelector::Cgroup(_))) {
        tracing::warn!(entry = %entry.name, "allow entry selects pods: it applies in cluster mode only");
    }
    let root = GatedRoot::open(cgroup_root)?;
    let mut file_events = PolicyFileEvents::new(policy_path)?;
    let names = CgroupNames::new(root.clone());
    let allow = Box::new(CgroupGlobs(root.clone()));
    let mut engine = Engine::start(cfg, policy, root, allow, names, None).await?;

    let source = policy_path.display().to_string();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(cfg.rescan);
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            trigger = file_events.next() => {
                let Some(trigger) = trigger else {
                    anyhow::bail!("the policy file's inotify watcher stopped");
                };
                match std::fs::read_to_string(policy_path)
                    .with_context(|| format!("reading {source}"))
                {
                    Ok(text) => {
                        engine.offer(&source, &text, trigger.as_str()).await;
                    }
                    Err(e) => engine.reject(&source, trigger.as_str(), &format!("{e:#}")),
                }
            }
            _ = tick.tick() => engine.sync().await,
        }
    }
    engine.stop();
    Ok(())
}
