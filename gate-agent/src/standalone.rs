//! `gate-agent run --policy FILE --cgroup-root DIR`: no cluster needed.
//!
//! Start-up never opens the gate: a pinned gate is adopted (see [`crate::loader`]), and a
//! failed start of an adopted gate leaves it enforcing what it enforced. The policy file is
//! watched and reloaded on change and on SIGHUP; a bad edit is refused and the last good
//! policy stays. SIGTERM/SIGINT stop the agent and leave the gate closed.
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use gate_common::abi::{MODE_AUDIT, MODE_ENFORCE, PolicyMeta, TERMINATE_UNKNOWN};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    cgroup::GatedRoot,
    cli::RunArgs,
    events::{self, CgroupNames, EventSinks},
    loader::{self, Gate, PolicyInfo, Start},
    metrics::{self, AgentMetrics},
    policy::{AllowSelector, Mode, Policy},
    server,
    watch::{PolicyWatch, Trigger},
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
        root_id: root.id,
    }
}

fn policy_info(policy: &Policy) -> PolicyInfo {
    PolicyInfo {
        hash: u64::from_str_radix(&policy.hash(), 16).unwrap_or(0),
        platform: policy.platform.clone(),
        endpoint_names: policy.endpoints.iter().map(|e| e.name.clone()).collect(),
        terminate: TERMINATE_UNKNOWN,
    }
}

/// Validate-compile-swap: the one way a policy reaches the kernel.
fn apply(gate: &mut Gate, policy: &Policy, root: &GatedRoot) -> Result<usize> {
    let allow = allow_set(root, policy);
    let compiled = policy.compile(gate.next_generation())?;
    gate.apply(&compiled, meta(policy, root), &allow, root, &policy_info(policy))
        .context("writing the policy maps")?;
    Ok(allow.len())
}

/// Load (or adopt), apply and attach. A failed fresh start removes its own pins; a failed
/// adoption leaves the pinned gate as it was, still enforcing.
fn bring_up(args: &RunArgs, policy: &Policy, root: &GatedRoot) -> Result<Gate> {
    let mut gate =
        Gate::open(&args.pin_dir, args.egress_program).context("loading the eBPF programs")?;
    let start = gate.start();
    if start == Start::Adopted {
        let info = gate.info();
        tracing::info!(
            generation = info.policy_generation,
            policy_hash = format!("{:016x}", info.policy_hash),
            previous_pid = info.agent_pid,
            "adopting the pinned gate (it kept enforcing while no agent ran)"
        );
    }
    let result = (|| -> Result<()> {
        gate.check_root(root)?;
        apply(&mut gate, policy, root)?;
        for c in
            gate.attach(root).with_context(|| format!("attaching to {}", root.path.display()))?
        {
            match c.old_prog_id {
                Some(old) => tracing::info!(
                    hook = c.hook,
                    program = c.program,
                    old_prog_id = old,
                    new_prog_id = c.new_prog_id,
                    "replaced program in place (link update)"
                ),
                None => tracing::info!(
                    hook = c.hook,
                    program = c.program,
                    prog_id = c.new_prog_id,
                    "attached"
                ),
            }
        }
        Ok(())
    })();
    if let Err(e) = result {
        if start == Start::Fresh {
            let dir = gate.pin_dir().to_path_buf();
            drop(gate);
            if let Err(c) = loader::pins::remove_version(&dir) {
                tracing::error!(error = %c, "removing the pin dir after a failed start");
            }
            let _ = std::fs::remove_dir(&args.pin_dir);
        } else {
            tracing::error!("adoption failed: the pinned gate keeps enforcing its previous policy");
        }
        return Err(e);
    }
    Ok(gate)
}

/// The agent's view of the live policy.
struct Live {
    policy: Policy,
    root: GatedRoot,
    gate: Arc<Mutex<Gate>>,
    sinks: EventSinks,
    metrics: AgentMetrics,
    /// The policy file's text as last judged (applied or refused), so one write is judged once.
    last_text: Option<String>,
    tc: crate::loader::TcConfig,
}

impl Live {
    fn reload(&mut self, trigger: Trigger) {
        let path = self.policy.source.clone();
        let started = Instant::now();
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(
                    trigger = trigger.as_str(), policy = %path, error = %e,
                    "policy file unreadable; the last good policy stays in force"
                );
                self.metrics.reload("failure");
                return;
            }
        };
        // One write can raise several file events: the same bytes are judged once.
        if self.last_text.as_deref() == Some(text.as_str()) {
            tracing::debug!(trigger = trigger.as_str(), "policy file unchanged");
            self.metrics.reload("unchanged");
            return;
        }
        self.last_text = Some(text.clone());
        let candidate = match Policy::parse(&path, &text) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(
                    trigger = trigger.as_str(), error = %e, live_policy_hash = %self.policy.hash(),
                    "policy rejected; the last good policy stays in force"
                );
                self.metrics.reload("failure");
                return;
            }
        };
        if candidate.hash() == self.policy.hash() {
            tracing::debug!(trigger = trigger.as_str(), "policy unchanged");
            self.metrics.reload("unchanged");
            return;
        }
        let result = match self.gate.lock() {
            Ok(mut g) => {
                apply(&mut g, &candidate, &self.root).map(|n| (n, g.info().policy_generation))
            }
            Err(_) => Err(anyhow::anyhow!("gate lock poisoned")),
        };
        match result {
            Ok((allowed, generation)) => {
                if let Ok(mut names) = self.sinks.endpoints.write() {
                    *names = candidate.endpoints.iter().map(|e| e.name.clone()).collect();
                }
                tracing::info!(
                    trigger = trigger.as_str(),
                    generation,
                    policy_hash = %candidate.hash(),
                    mode = ?candidate.mode,
                    endpoints = candidate.endpoints.len(),
                    allowed_cgroups = allowed,
                    took_us = started.elapsed().as_micros() as u64,
                    "policy applied"
                );
                self.policy = candidate;
                self.metrics.reload("success");
            }
            Err(e) => {
                tracing::error!(
                    trigger = trigger.as_str(),
                    error = format!("{e:#}"),
                    "policy rejected; the last good policy stays in force"
                );
                self.metrics.reload("failure");
            }
        }
    }

    /// Re-evaluate the cgroup globs: allow cgroups that appeared, forget those that vanished.
    fn rescan(&mut self) {
        let want = allow_set(&self.root, &self.policy);
        let Ok(mut g) = self.gate.lock() else { return };
        match g.sync_allow(&want) {
            Ok((0, 0)) => {}
            Ok((added, removed)) => {
                tracing::info!(added, removed, allowed_cgroups = want.len(), "allow set updated")
            }
            Err(e) => tracing::error!(error = %e, "updating the allow set"),
        }
        if let Err(e) = g.sync_tc(&self.tc, false) {
            tracing::error!(error = %e, "updating the tc attachments");
        }
    }
}

pub async fn run(args: RunArgs) -> Result<()> {
    let (Some(policy_path), Some(cgroup_root)) = (&args.policy, &args.cgroup_root) else {
        anyhow::bail!(
            "cluster mode is not available in this version: pass --policy FILE --cgroup-root DIR"
        );
    };
    let policy = Policy::load(policy_path)?;
    for entry in policy.allow.iter().filter(|e| !matches!(e.selector, AllowSelector::Cgroup(_))) {
        tracing::warn!(entry = %entry.name, "allow entry selects pods: it applies in cluster mode only");
    }
    let root = GatedRoot::open(cgroup_root)?;
    let mut watch = PolicyWatch::new(policy_path)?;

    let ready = Arc::new(AtomicBool::new(false));
    let mut gate = bring_up(&args, &policy, &root)?;
    let ring = gate.take_events();
    let pinned = gate.pin_dir().to_path_buf();
    let start = gate.start();
    let allowed = gate.allowed_ids().count();
    let generation = gate.info().policy_generation;
    let egress = gate.egress_program();
    let gate = Arc::new(Mutex::new(gate));
    let sinks = EventSinks::new(policy.endpoints.iter().map(|e| e.name.clone()).collect());
    let agent_metrics = AgentMetrics::default();
    let shared = metrics::Shared { gate: gate.clone(), sinks: sinks.clone() };
    let _server =
        server::serve(args.listen, ready.clone(), metrics::registry(shared, &agent_metrics))
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
    if let Some(ring) = ring {
        let names = CgroupNames::new(GatedRoot::open(cgroup_root)?);
        let sinks = sinks.clone();
        tokio::spawn(async move {
            if let Err(e) = events::run(ring, sinks, names).await {
                tracing::error!(error = %e, "event reader stopped");
            }
        });
    }

    ready.store(true, Ordering::Release);
    tracing::info!(
        policy = %policy_path.display(),
        policy_hash = %policy.hash(),
        generation,
        cgroup_root = %root.path.display(),
        pin_dir = %pinned.display(),
        start = ?start,
        egress,
        mode = ?policy.mode,
        endpoints = policy.endpoints.len(),
        allowed_cgroups = allowed,
        "ready"
    );
    if let Ok(g) = gate.lock() {
        g.retire_other_versions();
    }

    let tc = args.tc();
    let mut live = Live { policy, root, gate, sinks, metrics: agent_metrics, last_text: None, tc };
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_millis(args.rescan_ms.max(50)));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            trigger = watch.next() => match trigger {
                Some(t) => live.reload(t),
                None => anyhow::bail!("the policy file watcher stopped"),
            },
            _ = tick.tick() => live.rescan(),
        }
    }
    ready.store(false, Ordering::Release);
    tracing::info!(
        pin_dir = %pinned.display(),
        "stopping; the gate stays closed (pinned). `gate-agent cleanup` removes it"
    );
    Ok(())
}
