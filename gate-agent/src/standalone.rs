//! `gate-agent run --policy FILE --cgroup-root DIR`: no cluster needed.
//!
//! Start-up never opens the gate: a pinned gate is adopted (see [`crate::loader`]), and a
//! failed start of an adopted gate leaves it enforcing what it enforced. The policy file is
//! watched and reloaded on change and on SIGHUP; a bad edit is refused and the last good
//! policy stays. SIGTERM/SIGINT stop the agent and leave the gate closed.
use std::{path::Path, time::Duration};

use anyhow::{Context as _, Result};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    cgroup::GatedRoot,
    cli::RunArgs,
    engine::Engine,
    events::CgroupNames,
    policy::{AllowSelector, Policy},
    watch::PolicyWatch,
};

/// Standalone allow set: cgroups under the root that match the policy's globs.
fn allow_set(root: &GatedRoot, policy: &Policy) -> Vec<(u64, u32)> {
    root.resolve_allow(policy).into_iter().map(|a| (a.id, a.entry as u32)).collect()
}

pub async fn run(args: RunArgs, policy_path: &Path, cgroup_root: &Path) -> Result<()> {
    let policy = Policy::load(policy_path)?;
    for entry in policy.allow.iter().filter(|e| !matches!(e.selector, AllowSelector::Cgroup(_))) {
        tracing::warn!(entry = %entry.name, "allow entry selects pods: it applies in cluster mode only");
    }
    let root = GatedRoot::open(cgroup_root)?;
    let mut watch = PolicyWatch::new(policy_path)?;
    let names = CgroupNames::new(GatedRoot::open(cgroup_root)?);
    let scan_root = GatedRoot::open(cgroup_root)?;
    let allow = move |p: &Policy| allow_set(&scan_root, p);
    let mut engine = Engine::start(&args, policy, root, &allow, names, None).await?;

    let source = policy_path.display().to_string();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_millis(args.rescan_ms.max(50)));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            trigger = watch.next() => {
                let Some(trigger) = trigger else {
                    anyhow::bail!("the policy file watcher stopped");
                };
                match std::fs::read_to_string(policy_path)
                    .with_context(|| format!("reading {source}"))
                {
                    Ok(text) => {
                        engine.offer(&source, &text, trigger.as_str(), &allow).await;
                    }
                    Err(e) => {
                        tracing::error!(
                            trigger = trigger.as_str(), error = format!("{e:#}"),
                            "policy file unreadable; the last good policy stays in force"
                        );
                        engine.metrics.reload("failure");
                    }
                }
            }
            _ = tick.tick() => engine.sync(&allow),
        }
    }
    engine.stop();
    Ok(())
}
