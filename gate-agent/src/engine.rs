//! What both modes share: bring the gate up (fresh or adopted), judge and apply policies
//! through one validate → compile → swap path, keep the allow set and tc attachments current,
//! and serve health and metrics. The modes differ only in where a policy comes from (a file
//! or a ConfigMap) and how the allow set is found (cgroup globs or pods).
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use anyhow::{Context as _, Result};
use gate_common::abi::{
    MODE_AUDIT, MODE_ENFORCE, PolicyMeta, TERMINATE_OFF, TERMINATE_ON, TERMINATE_UNKNOWN,
    TERMINATE_UNSUPPORTED,
};

use crate::{
    cgroup::GatedRoot,
    cli::RunArgs,
    events::{self, CgroupNames, EventSinks},
    loader::{self, Gate, PolicyInfo, Start, TcConfig},
    metrics::{self, AgentMetrics},
    policy::{Mode, Policy},
    server, terminate,
};

/// How a mode finds the allow set of a policy: (cgroup id, allow entry index) pairs.
pub type AllowFn<'a> = &'a dyn Fn(&Policy) -> Vec<(u64, u32)>;

fn meta(policy: &Policy, root: &GatedRoot) -> PolicyMeta {
    PolicyMeta {
        mode: if policy.mode == Mode::Audit { MODE_AUDIT } else { MODE_ENFORCE },
        root_level: root.level,
        endpoints: policy.endpoints.len() as u32,
        _pad: 0,
        root_id: root.id,
        prefilter: Default::default(),
    }
}

fn policy_info(policy: &Policy, terminate: u32) -> PolicyInfo {
    PolicyInfo {
        hash: u64::from_str_radix(&policy.hash(), 16).unwrap_or(0),
        platform: policy.platform.clone(),
        endpoint_names: policy.endpoints.iter().map(|e| e.name.clone()).collect(),
        terminate,
    }
}

/// Validate-compile-swap: the one way a policy reaches the kernel. Returns the allow count.
fn apply(
    gate: &mut Gate,
    policy: &Policy,
    root: &GatedRoot,
    allow: &[(u64, u32)],
    terminate: u32,
) -> Result<()> {
    let compiled = policy.compile(gate.next_generation())?;
    let meta = PolicyMeta { prefilter: compiled.prefilter, ..meta(policy, root) };
    gate.apply(&compiled, meta, allow, root, &policy_info(policy, terminate))
        .context("writing the policy maps")
}

/// Load (or adopt), apply and attach. A failed fresh start removes its own pins; a failed
/// adoption leaves the pinned gate as it was, still enforcing.
fn bring_up(
    args: &RunArgs,
    policy: &Policy,
    root: &GatedRoot,
    allow: &[(u64, u32)],
) -> Result<Gate> {
    // Standalone may mount bpffs; in a pod the host's must be mounted in.
    let may_mount = args.policy.is_some();
    let mut gate = Gate::open(&args.pin_dir, args.egress_program, may_mount)
        .context("loading the eBPF programs")?;
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
        apply(&mut gate, policy, root, allow, TERMINATE_UNKNOWN)?;
        let changes =
            gate.attach(root).with_context(|| format!("attaching to {}", root.path.display()))?;
        for c in changes {
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
        gate.sync_tc(&args.tc(), true).context("attaching the tc programs")?;
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

/// The outcome of offering a policy text.
#[derive(Debug)]
pub enum Offer {
    Applied {
        generation: u64,
    },
    /// The same text as last time (applied or refused): nothing to do.
    Unchanged,
    /// Refused; the last good policy stays. The message names the field and reason.
    Rejected(String),
}

/// The running gate and the policy in force.
pub struct Engine {
    pub policy: Policy,
    pub root: GatedRoot,
    pub gate: Arc<Mutex<Gate>>,
    pub sinks: EventSinks,
    pub metrics: AgentMetrics,
    pub ready: Arc<AtomicBool>,
    tc: TcConfig,
    terminate: bool,
    /// The policy text as last judged (applied or refused), so one change is judged once.
    last_text: Option<String>,
    _server: tokio::task::JoinHandle<()>,
}

impl Engine {
    /// Bring the gate up with `policy`, start the event reader and the health/metrics server,
    /// and report ready. `names` turns cgroup ids into workload names for denial events.
    pub async fn start(
        args: &RunArgs,
        policy: Policy,
        root: GatedRoot,
        allow: AllowFn<'_>,
        names: CgroupNames,
        notify: Option<tokio::sync::mpsc::UnboundedSender<events::Denied>>,
    ) -> Result<Engine> {
        let allow_set = allow(&policy);
        let mut gate = bring_up(args, &policy, &root, &allow_set)?;
        let ring = gate.take_events();
        let (pinned, start, generation, egress) = (
            gate.pin_dir().to_path_buf(),
            gate.start(),
            gate.info().policy_generation,
            gate.egress_program(),
        );
        let gate = Arc::new(Mutex::new(gate));
        let mut sinks = EventSinks::new(policy.endpoints.iter().map(|e| e.name.clone()).collect());
        sinks.notify = notify;
        let agent_metrics = AgentMetrics::default();
        let ready = Arc::new(AtomicBool::new(false));
        let shared = metrics::Shared { gate: gate.clone(), sinks: sinks.clone() };
        let server =
            server::serve(args.listen, ready.clone(), metrics::registry(shared, &agent_metrics))
                .await
                .with_context(|| format!("listening on {}", args.listen))?;
        if let Some(ring) = ring {
            let sinks = sinks.clone();
            tokio::spawn(async move {
                if let Err(e) = events::run(ring, sinks, names).await {
                    tracing::error!(error = %e, "event reader stopped");
                }
            });
        }
        let mut engine = Engine {
            policy,
            root,
            gate,
            sinks,
            metrics: agent_metrics,
            ready,
            tc: args.tc(),
            terminate: args.terminate_established,
            last_text: None,
            _server: server,
        };
        // The gate is attached: connections opened before it are cut before we report ready.
        engine.terminate_established(allow_set.clone()).await;
        let (policy, root) = (&engine.policy, &engine.root);
        engine.ready.store(true, Ordering::Release);
        tracing::info!(
            policy = %policy.source,
            policy_hash = %policy.hash(),
            generation,
            cgroup_root = %root.path.display(),
            pin_dir = %pinned.display(),
            start = ?start,
            egress,
            mode = ?policy.mode,
            endpoints = policy.endpoints.len(),
            allowed_cgroups = allow_set.len(),
            "ready"
        );
        if let Ok(g) = engine.gate.lock() {
            g.retire_other_versions();
        }
        Ok(engine)
    }

    /// Destroy established connections the live policy denies (`--terminate-established`)
    /// and record in the pinned gate whether the kernel can.
    async fn terminate_established(&mut self, allow: Vec<(u64, u32)>) {
        let state = if !self.terminate {
            TERMINATE_OFF
        } else {
            match terminate::after_policy_change(&self.root, &self.policy, allow).await {
                Some(r) if r.unsupported.is_some() => TERMINATE_UNSUPPORTED,
                Some(_) => TERMINATE_ON,
                None => TERMINATE_UNKNOWN,
            }
        };
        if let Ok(mut g) = self.gate.lock()
            && let Err(e) = g.set_terminate(state)
        {
            tracing::warn!(error = %e, "recording the terminate-established state");
        }
    }

    /// Judge a policy text from `source` and, if it is good and new, swap it in atomically.
    pub async fn offer(
        &mut self,
        source: &str,
        text: &str,
        trigger: &str,
        allow: AllowFn<'_>,
    ) -> Offer {
        let started = Instant::now();
        if self.last_text.as_deref() == Some(text) {
            tracing::debug!(trigger, "policy unchanged");
            self.metrics.reload("unchanged");
            return Offer::Unchanged;
        }
        self.last_text = Some(text.to_owned());
        let result =
            Policy::parse(source, text).map_err(anyhow::Error::from).and_then(|candidate| {
                if candidate.hash() == self.policy.hash() {
                    return Ok(None);
                }
                let allow_set = allow(&candidate);
                let mut g = self.gate.lock().map_err(|_| anyhow::anyhow!("gate lock poisoned"))?;
                apply(&mut g, &candidate, &self.root, &allow_set, TERMINATE_UNKNOWN)?;
                Ok(Some((candidate, allow_set, g.info().policy_generation)))
            });
        match result {
            Ok(None) => {
                self.metrics.reload("unchanged");
                Offer::Unchanged
            }
            Ok(Some((candidate, allow_set, generation))) => {
                let allowed = allow_set.len();
                if let Ok(mut names) = self.sinks.endpoints.write() {
                    *names = candidate.endpoints.iter().map(|e| e.name.clone()).collect();
                }
                tracing::info!(
                    trigger,
                    generation,
                    policy = %source,
                    policy_hash = %candidate.hash(),
                    mode = ?candidate.mode,
                    endpoints = candidate.endpoints.len(),
                    allowed_cgroups = allowed,
                    took_us = started.elapsed().as_micros() as u64,
                    "policy applied"
                );
                self.policy = candidate;
                self.metrics.reload("success");
                if self.terminate {
                    self.terminate_established(allow_set).await;
                }
                Offer::Applied { generation }
            }
            Err(e) => {
                let msg = format!("{e:#}");
                tracing::error!(
                    trigger, policy = %source, error = %msg, live_policy_hash = %self.policy.hash(),
                    "policy rejected; the last good policy stays in force"
                );
                self.metrics.reload("failure");
                Offer::Rejected(msg)
            }
        }
    }

    /// Bring the allow set and tc attachments up to date (new or vanished cgroups, pods,
    /// interfaces).
    pub fn sync(&mut self, allow: AllowFn<'_>) {
        let want = allow(&self.policy);
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

    /// Stop serving ready; the gate stays pinned.
    pub fn stop(&self) {
        self.ready.store(false, Ordering::Release);
        if let Ok(g) = self.gate.lock() {
            tracing::info!(
                pin_dir = %g.pin_dir().display(),
                "stopping; the gate stays closed (pinned). `gate-agent cleanup` removes it"
            );
        }
    }
}
