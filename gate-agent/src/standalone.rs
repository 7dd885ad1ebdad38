//! `gate-agent run --policy FILE --cgroup-root DIR`: no cluster needed.
use std::{
    collections::BTreeSet,
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result};
use gate_common::abi::{MODE_AUDIT, MODE_ENFORCE, PolicyMeta};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    cgroup::GatedRoot,
    cli::RunArgs,
    events::{self, CgroupNames},
    loader::{self, Gate},
    metrics,
    policy::{Mode, Policy},
    server, terminate,
};

fn allow_set(root: &GatedRoot, policy: &Policy) -> Vec<(u64, u32)> {
    root.resolve_allow(policy).into_iter().map(|a| (a.id, a.entry as u32)).collect()
}

fn meta(policy: &Policy, root: &GatedRoot) -> PolicyMeta {
    PolicyMeta {
        mode: if policy.mode == Mode::Audit { MODE_AUDIT } else { MODE_ENFORCE },
        root_level: root.level,
        endpoints: policy.endpoints.len() as u32,
        _pad: 0,
    }
}

/// Load, apply and attach. On failure after the pin dir was created, remove it again so a
/// failed start leaves nothing behind.
fn bring_up(
    args: &RunArgs,
    policy: &Policy,
    root: &GatedRoot,
    allow: &[(u64, u32)],
) -> Result<Gate> {
    let mut gate = Gate::load(&args.pin_dir).context("loading the eBPF programs")?;
    let result = (|| -> Result<()> {
        let compiled = policy.compile(gate.next_generation())?;
        gate.apply(&compiled, meta(policy, root), allow).context("writing the policy maps")?;
        gate.attach(root).with_context(|| format!("attaching to {}", root.path.display()))
    })();
    if let Err(e) = result {
        drop(gate);
        if let Err(c) = loader::cleanup(&args.pin_dir) {
            tracing::error!(error = %c, "removing the pin dir after a failed start");
        }
        return Err(e);
    }
    Ok(gate)
}

pub async fn run(args: RunArgs) -> Result<()> {
    let (Some(policy_path), Some(cgroup_root)) = (&args.policy, &args.cgroup_root) else {
        anyhow::bail!(
            "cluster mode is not available in this version: pass --policy FILE --cgroup-root DIR"
        );
    };
    let policy = Policy::load(policy_path)?;
    for entry in policy
        .allow
        .iter()
        .filter(|e| !matches!(e.selector, crate::policy::AllowSelector::Cgroup(_)))
    {
        tracing::warn!(entry = %entry.name, "allow entry selects pods: it applies in cluster mode only");
    }
    let root = GatedRoot::open(cgroup_root)?;

    let ready = Arc::new(AtomicBool::new(false));
    let endpoint_names =
        Arc::new(RwLock::new(policy.endpoints.iter().map(|e| e.name.clone()).collect::<Vec<_>>()));

    let allow = allow_set(&root, &policy);
    let mut gate = bring_up(&args, &policy, &root, &allow)?;
    let ring = gate.take_events();
    let pinned = gate.pin_dir().to_path_buf();
    let gate = Arc::new(Mutex::new(gate));
    let shared = metrics::Shared { gate: gate.clone(), endpoints: endpoint_names.clone() };
    let _server = server::serve(args.listen, ready.clone(), metrics::registry(shared))
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    if let Some(ring) = ring {
        let names = CgroupNames::new(GatedRoot::open(cgroup_root)?);
        let endpoints = endpoint_names.clone();
        tokio::spawn(async move {
            if let Err(e) = events::run(ring, endpoints, names).await {
                tracing::error!(error = %e, "event reader stopped");
            }
        });
    }

    let mut known: BTreeSet<u64> = allow.iter().map(|&(id, _)| id).collect();
    // The gate is attached: connections opened before it are cut before we report ready.
    if args.terminate_established {
        terminate::after_policy_change(&root, &policy).await;
    }
    ready.store(true, Ordering::Release);
    tracing::info!(
        policy = %policy_path.display(),
        policy_hash = %policy.hash(),
        cgroup_root = %root.path.display(),
        pin_dir = %pinned.display(),
        mode = ?policy.mode,
        endpoints = policy.endpoints.len(),
        allowed_cgroups = known.len(),
        "ready"
    );

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_millis(args.rescan_ms.max(50)));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = tick.tick() => {
                let fresh: Vec<_> = allow_set(&root, &policy)
                    .into_iter()
                    .filter(|(id, _)| !known.contains(id))
                    .collect();
                if fresh.is_empty() { continue; }
                let mut g = gate.lock().map_err(|_| anyhow::anyhow!("gate lock poisoned"))?;
                match g.allow_more(&fresh) {
                    Ok(()) => {
                        for (id, entry) in &fresh {
                            known.insert(*id);
                            tracing::info!(cgroup_id = id, entry = %policy.allow[*entry as usize].name, "allowed new cgroup");
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "adding allowed cgroups"),
                }
            }
        }
    }
    ready.store(false, Ordering::Release);
    tracing::info!(
        pin_dir = %pinned.display(),
        "stopping; the gate stays closed (pinned). `gate-agent cleanup` removes it"
    );
    Ok(())
}
