//! What both modes share: bring the gate up (fresh or adopted), judge and apply policies
//! through one validate → compile → swap path, keep the allow set and tc attachments current,
//! and serve health and metrics. The modes differ only in where a policy text comes from (a
//! file or a ConfigMap) and in their [`AllowSource`] (cgroup globs or pods).
//!
//! A policy flows downhill: the engine parses it ([`Policy`], compiled once into its image),
//! turns it into a loader [`Install`] with the mode's allow set, and the loader writes it.
//!
//! Parts: this module brings the gate up and applies policies; `heal` retries failed applies
//! and repairs what went missing.
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use anyhow::{Context as _, Result};
use gate_common::user::{AllowSet, TerminateState};

#[cfg(test)]
pub(crate) mod fake;
mod gate;
mod heal;
mod proxy;
#[cfg(test)]
mod tests;

use crate::{
    cgroup::GatedRoot,
    config::{AgentConfig, GateConfig},
    events::{self, CgroupNames, EventSinks},
    loader::{Gate, HookChange, Install, LsmState, ProxySide, Start},
    metrics::{self, AgentMetrics},
    node::{self, NodeLevel},
    policy::Policy,
    server,
    state::{AllowedPath, StateDir},
    terminate,
};
pub(crate) use gate::GateOps;
use heal::Retry;

/// How a mode finds the allow set of a policy.
pub(crate) trait AllowSource: Send {
    /// The cgroups the policy's allow entries select now.
    fn allow_set(&self, policy: &Policy) -> AllowSet;
}

/// What the loader installs for `policy` with `allow`.
pub(crate) fn install<'a>(
    policy: &'a Policy,
    names: &'a [String],
    allow: &'a AllowSet,
    node_flags: u32,
) -> Install<'a> {
    Install {
        image: policy.image(),
        mode: policy.mode,
        endpoint_names: names,
        hash: policy.hash(),
        platform: &policy.platform,
        allow,
        node_flags,
        served: policy.served.is_some(),
    }
}

/// Load (or adopt), apply and attach. A failed fresh start removes its own pins; a failed
/// adoption leaves the pinned gate as it was, still enforcing. `proxy`: the metadata proxy
/// (`--proxy-address`), whose programs go in if `policy` sends connects to it, and come out
/// otherwise (an adopted gate's included).
pub(crate) fn bring_up(
    cfg: &GateConfig,
    node: &NodeLevel,
    policy: &Policy,
    root: &GatedRoot,
    allow: &AllowSet,
    proxy: Option<&ProxySide>,
) -> Result<Gate> {
    let gate = Gate::open(&cfg.pin_dir, cfg.egress, cfg.lsm_programs, cfg.mount_bpffs)
        .context("loading the eBPF programs")?;
    bring_up_gate(gate, cfg, node, policy, root, allow, proxy)
}

/// The metadata proxy whose programs belong in the kernel under `policy`: the configured one
/// (`configured`), if the policy sends connects to it. `None`: they stay out, and no TCP
/// connection below the gated root pays for them.
pub(crate) fn proxy_for<'a>(
    configured: Option<&'a ProxySide>,
    policy: &Policy,
) -> Option<&'a ProxySide> {
    configured.filter(|_| policy.needs_proxy())
}

/// Put the metadata proxy's programs in (`Some`: in place of a predecessor's, or new) or take
/// them out (`None`: a predecessor's too); what changed is logged.
fn place_proxy<G: GateOps>(
    gate: &mut G,
    root: &GatedRoot,
    to: Option<&ProxySide>,
) -> Result<(), crate::loader::LoaderError> {
    match to {
        Some(side) => {
            log_changes(&gate.proxy_on(root, side)?);
            tracing::info!(
                cgroup = %side.own.path.display(),
                port = side.config.port,
                "the metadata proxy's programs are in"
            );
        }
        None => {
            let removed = gate.proxy_off()?;
            if !removed.is_empty() {
                let removed: Vec<&str> = removed.iter().map(|p| p.pin_name()).collect();
                tracing::info!(
                    removed = removed.join(" "),
                    "the metadata proxy's programs are out: no proxy serves under this policy"
                );
            }
        }
    }
    Ok(())
}

/// Log what an attach did to each attach point.
fn log_changes(changes: &[HookChange]) {
    for c in changes {
        match c.old_prog_id {
            Some(old) => tracing::info!(
                hook = c.point.pin_name(),
                program = c.program.name(),
                old_prog_id = old,
                new_prog_id = c.new_prog_id,
                "replaced program in place (link update)"
            ),
            None => tracing::info!(
                hook = c.point.pin_name(),
                program = c.program.name(),
                prog_id = c.new_prog_id,
                "attached"
            ),
        }
    }
}

/// [`bring_up`] once the gate is loaded.
fn bring_up_gate<G: GateOps>(
    mut gate: G,
    cfg: &GateConfig,
    node: &NodeLevel,
    policy: &Policy,
    root: &GatedRoot,
    allow: &AllowSet,
    proxy: Option<&ProxySide>,
) -> Result<G> {
    let start = gate.start();
    if start == Start::Adopted {
        let info = gate.info();
        tracing::info!(
            generation = info.policy_generation,
            policy_hash = %gate_common::user::PolicyHash(info.policy_hash),
            previous_pid = info.agent_pid,
            "adopting the pinned gate (it kept enforcing while no agent ran)"
        );
    }
    let result = (|| -> Result<()> {
        gate.check_root(root)?;
        let names = policy.endpoint_names();
        gate.apply(&install(policy, &names, allow, node.node_flags()), root)
            .context("writing the policy maps")?;
        let changes =
            gate.attach(root).with_context(|| format!("attaching to {}", root.path.display()))?;
        log_changes(&changes);
        // After the policy: a predecessor's programs go only once no policy sends connects
        // to them; new ones are in before the kernel is told where the proxy is.
        place_proxy(&mut gate, root, proxy_for(proxy, policy))
            .context("placing the metadata proxy's programs")?;
        let plan = node.plan().context("planning the node level")?;
        let report = gate.sync_tc(&plan, true).context("attaching the node-level program")?;
        tracing::info!(
            attachments = plan.targets.len(),
            attached = report.attached.len(),
            replaced_in_place = report.replaced,
            failed = report.failed.len(),
            "node level"
        );
        for (t, why) in &report.failed {
            tracing::error!(interface = %t.name, direction = t.direction.name(), error = %why, "attaching the node-level program");
        }
        Ok(())
    })();
    if let Err(e) = result {
        if start == Start::Fresh {
            gate.discard();
            let _ = std::fs::remove_dir(&cfg.pin_dir);
        } else {
            tracing::error!("adoption failed: the pinned gate keeps enforcing its previous policy");
        }
        return Err(e);
    }
    Ok(gate)
}

/// Say what the boot step did on this boot: a failure is an error and a gauge (its alert),
/// problems with the kept state are warnings.
fn report_boot_step(state: &StateDir, metrics: &AgentMetrics) {
    match state.this_boot() {
        Some(b) if b.closed => {
            tracing::info!(
                policy = b.policy.as_deref(),
                allowed = b.allowed,
                "the boot step closed the gate on this boot"
            );
            for p in &b.problems {
                tracing::warn!(problem = %p, "the boot step found the kept state unusable");
            }
        }
        Some(b) => {
            metrics.boot_step_failed.set(1);
            tracing::error!(problems = ?b.problems, "the boot step could not close the gate on this boot: the node was open until now");
        }
        None => tracing::info!(
            state_dir = %state.dir().display(),
            "no boot step record for this boot (the boot unit is not installed, or could not start)"
        ),
    }
}

/// The outcome of offering a policy text.
#[derive(Debug)]
pub(crate) enum Offer {
    /// Written to the maps and in force.
    Applied,
    /// The same text as last time (applied or rejected): nothing to do.
    Unchanged,
    /// Rejected; the last good policy stays. The message names the field and reason.
    Rejected(String),
}

/// Opens the gated root again, to see whether it was recreated.
type Reopen = Box<dyn Fn(&std::path::Path) -> Result<GatedRoot, crate::cgroup::CgroupError> + Send>;

/// The running gate and the policy in force. `G` is the loaded gate; the fast tests put a
/// fake in its place.
pub(crate) struct Engine<G: GateOps = Gate> {
    pub policy: Policy,
    pub root: GatedRoot,
    pub gate: Arc<Mutex<G>>,
    pub sinks: EventSinks,
    pub metrics: AgentMetrics,
    pub ready: Arc<AtomicBool>,
    cfg: GateConfig,
    /// The node's state for the boot step, if kept.
    state: Option<StateDir>,
    allow: Box<dyn AllowSource>,
    node: Arc<NodeLevel>,
    /// Keeps the node level current while the engine lives (none in the fast tests).
    _node_links: Option<AbortOnDrop>,
    /// [`GatedRoot::open`]: the repair check looks whether the root was recreated.
    reopen: Reopen,
    /// The policy text last judged for good: applied, or rejected as invalid. One change is
    /// judged once; a text that failed to *apply* is not recorded here but retried.
    last_text: Option<String>,
    /// Whether `last_text` was rejected (so the policy in force is not the newest one).
    last_rejected: bool,
    /// A valid policy whose apply failed: retried with backoff by [`Engine::sync`].
    retry: Option<Retry>,
    /// The health and metrics server (none in the fast tests).
    _server: Option<server::Server>,
    /// The metadata proxy, where `--proxy-address` asks for one.
    proxy: Option<proxy::ProxyHandle>,
    /// The same proxy as the kernel programs are told of it (whether its programs are in
    /// follows the policy: [`proxy_for`]).
    proxy_side: Option<ProxySide>,
}

impl Engine<Gate> {
    /// Bring the gate up with `policy`, start the event reader and the health/metrics server,
    /// and report ready. `names` turns cgroup ids into workload names for denial events.
    pub(crate) async fn start(
        cfg: &AgentConfig,
        policy: Policy,
        root: GatedRoot,
        allow: Box<dyn AllowSource>,
        names: CgroupNames,
        notify: Option<tokio::sync::mpsc::UnboundedSender<events::Blocked>>,
    ) -> Result<Engine> {
        let started_ns = crate::status::monotonic_now_ns();
        let allow_set = allow.allow_set(&policy);
        let node = Arc::new(NodeLevel::new(cfg.gate.node.clone())?);
        let proxy_side = cfg.proxy.as_ref().map(|l| proxy::side(l, &root)).transpose()?;
        // The proxy's port is taken before the kernel is told of the proxy, so that nothing
        // is ever redirected to whoever else holds it. Only a predecessor's bind programs,
        // which hold it for the proxy's cgroup as they know it, make this wait until the
        // kernel knows this agent's (after the bring-up).
        let early = match &cfg.proxy {
            Some(listen) => match proxy::bind(listen) {
                Ok(listeners) => Some(listeners),
                Err(e) if e.held_for_the_proxy() => None,
                Err(e) => return Err(e.into()),
            },
            None => None,
        };
        let mut gate = bring_up(&cfg.gate, &node, &policy, &root, &allow_set, proxy_side.as_ref())?;
        let ring = gate.take_events();
        let gate_lsm = gate.lsm().clone();
        let (pinned, start, generation, egress) = (
            gate.pin_dir().to_path_buf(),
            gate.start(),
            gate.info().policy_generation,
            gate.egress_program(),
        );
        let gate = Arc::new(Mutex::new(gate));
        let mut sinks = EventSinks::new(policy.endpoint_names());
        sinks.notify = notify;
        sinks.state_dir = cfg.state_dir.clone();
        let agent_metrics = AgentMetrics::default();
        let ready = Arc::new(AtomicBool::new(false));
        let shared = metrics::Shared { gate: gate.clone(), sinks: sinks.clone() };
        let server = server::serve(
            cfg.listen,
            ready.clone(),
            metrics::registry(shared, &agent_metrics),
            server::Limits::default(),
            server::Peers::new(Box::new(server::HostKernel::new(root.clone()))),
            agent_metrics.listeners.clone(),
        )
        .await?;
        // The proxy names the workloads it refuses as the event reader does.
        let proxy_names = names.again();
        if let Some((ring, tally)) = ring {
            let sinks = sinks.clone();
            tokio::spawn(async move {
                if let Err(e) = events::run(ring, tally, sinks, names).await {
                    tracing::error!(error = %e, "event reader stopped");
                }
            });
        }
        let proxy = match (&cfg.proxy, &proxy_side) {
            (Some(listen), Some(side)) => {
                let started = early
                    .map_or_else(|| proxy::bind(listen), Ok)
                    .map_err(anyhow::Error::from)
                    .and_then(|listeners| {
                        proxy::start(
                            listen,
                            listeners,
                            side,
                            started_ns,
                            cfg.state_dir.as_deref(),
                            &gate,
                            &policy,
                            &agent_metrics,
                            proxy_names,
                            sinks.notify.clone(),
                        )
                    });
                match started {
                    Ok(handle) => Some(handle),
                    Err(e) => {
                        // No connect may go to a proxy that does not serve.
                        if let Ok(mut g) = gate.lock()
                            && let Err(off) = g.proxy_off()
                        {
                            tracing::error!(error = %off, "taking the metadata proxy's programs out");
                        }
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        let node_links = AbortOnDrop(tokio::spawn(node::follow_links(
            node.clone(),
            gate.clone(),
            cfg.rescan,
            agent_metrics.clone(),
        )));
        let mut engine = Engine {
            policy,
            root,
            gate,
            sinks,
            metrics: agent_metrics,
            ready,
            cfg: cfg.gate.clone(),
            state: cfg.state_dir.as_deref().map(StateDir::new),
            allow,
            node,
            _node_links: Some(node_links),
            reopen: Box::new(GatedRoot::open),
            last_text: None,
            last_rejected: false,
            retry: None,
            _server: None,
            proxy,
            proxy_side,
        };
        // The gate is attached: connections opened before it are cut before we report ready.
        engine.terminate_established(allow_set.clone()).await;
        if let Some(n) =
            terminate::count_pregate_sockets(&engine.root, &engine.policy, allow_set.clone()).await
        {
            engine.metrics.pregate_packet_sockets.set(n as i64);
        }
        match gate_lsm {
            LsmState::Active | LsmState::FmodRet => {
                engine.metrics.lsm_enforcing.set(1);
            }
            LsmState::Inactive(why) => tracing::warn!(
                why,
                "LSM programs not attached: 32-bit compat and io_uring setsockopt and packet \
                 capture stay open to gated workloads (see docs/kernels.md)"
            ),
        }
        if let Some(state) = &engine.state {
            report_boot_step(state, &engine.metrics);
        }
        engine.keep_state(true);
        let (policy, root, http) = (&engine.policy, &engine.root, &server);
        engine.ready.store(true, Ordering::Release);
        tracing::info!(
            policy = %policy.source,
            policy_hash = %policy.hash(),
            generation,
            cgroup_root = %root.path.display(),
            pin_dir = %pinned.display(),
            start = ?start,
            egress = egress.name(),
            mode = %policy.mode,
            endpoints = policy.endpoints.len(),
            allowed_cgroups = allow_set.len(),
            probes = %http.probes,
            metrics = %http.metrics,
            "ready"
        );
        warn_paths_not_served(policy, engine.proxy.is_some());
        if let Ok(g) = engine.gate.lock() {
            g.retire_other_versions();
        }
        engine._server = Some(server);
        Ok(engine)
    }
}

impl<G: GateOps> Engine<G> {
    /// Destroy established connections the live policy denies (`--terminate-established`)
    /// and record in the pinned gate whether the kernel can.
    async fn terminate_established(&mut self, allow: AllowSet) {
        let (state, netns, hidden) = if !self.cfg.terminate_established {
            (TerminateState::Off, 0, 0)
        } else {
            match terminate::after_policy_change(&self.root, &self.policy, allow).await {
                Some(r) if r.unsupported.is_some() => {
                    (TerminateState::Unsupported, r.netns, r.hidden)
                }
                Some(r) => (TerminateState::On, r.netns, r.hidden),
                None => (TerminateState::Unknown, 0, 0),
            }
        };
        if let Ok(mut g) = self.gate.lock()
            && let Err(e) = g.set_terminate(state, netns, hidden)
        {
            tracing::warn!(error = %e, "recording the terminate-established state");
        }
    }

    /// Save the live policy and allow set for the boot step (and, at start, the binary).
    /// Failures are logged: the gate does not depend on them.
    fn keep_state(&self, starting: bool) {
        let Some(state) = &self.state else { return };
        let allowed: Vec<AllowedPath> = match self.gate.lock() {
            Ok(g) => {
                let ids = g.allowed();
                self.root
                    .walk()
                    .into_iter()
                    .filter_map(|(path, id)| Some(AllowedPath { path, value: ids.get(id)? }))
                    .collect()
            }
            Err(_) => return,
        };
        let result = state
            .save_policy(self.policy.text())
            .and_then(|()| state.save_allow(&allowed))
            .and_then(|()| if starting { state.install_binary().map(drop) } else { Ok(()) });
        if let Err(e) = result {
            tracing::warn!(dir = %state.dir().display(), error = %e, "keeping the node's state for the boot step");
        }
    }

    /// Log and count a policy that was rejected: the one place both modes report it. Until a
    /// policy is applied (or the newest text turns out to be the live policy),
    /// `metadata_gate_policy_rejected` stays 1.
    pub(crate) fn reject(&self, source: &str, trigger: &str, why: &str) {
        tracing::error!(
            trigger, policy = %source, error = %why, live_policy_hash = %self.policy.hash(),
            "policy rejected; the last good policy stays in force"
        );
        self.metrics.reload("failure");
        self.metrics.policy_rejected.set(1);
    }

    /// Judge a policy text from `source` and, if it is good and new, swap it in atomically.
    /// The text counts as judged only once it is in force or rejected as invalid: an apply
    /// that fails (a map the kernel would not write) leaves the last good policy in force and
    /// is retried with backoff.
    pub(crate) async fn offer(&mut self, source: &str, text: &str, trigger: &str) -> Offer {
        let started = Instant::now();
        let started_ns = crate::status::monotonic_now_ns();
        if self.last_text.as_deref() == Some(text) {
            tracing::debug!(trigger, "policy unchanged");
            self.metrics.reload("unchanged");
            self.metrics.policy_rejected.set(i64::from(self.last_rejected));
            return Offer::Unchanged;
        }
        let candidate = match Policy::parse(source, text) {
            Ok(c) => c,
            Err(e) => {
                self.last_text = Some(text.to_owned());
                self.last_rejected = true;
                self.retry = None;
                let msg = e.to_string();
                self.reject(source, trigger, &msg);
                return Offer::Rejected(msg);
            }
        };
        if candidate.hash() == self.policy.hash() {
            self.last_text = Some(text.to_owned());
            self.last_rejected = false;
            self.retry = None;
            self.metrics.reload("unchanged");
            self.metrics.policy_rejected.set(0);
            return Offer::Unchanged;
        }
        let allow_set = self.allow.allow_set(&candidate);
        let names = candidate.endpoint_names();
        // The proxy's programs go in before a policy that sends connects to the proxy, and
        // out only after one that sends none (below): never a redirect they would not see.
        // If they cannot go in, the kernel is not told of the proxy, and the paths the policy
        // serves are denied until the repair tick puts them in.
        let proxy = proxy_for(self.proxy_side.as_ref(), &candidate).cloned();
        if proxy.is_some() {
            self.sync_proxy(proxy.as_ref());
        }
        let applied = self.gate.lock().map_err(|_| anyhow::anyhow!("gate lock poisoned")).and_then(
            |mut g| {
                g.apply(
                    &install(&candidate, &names, &allow_set, self.node.node_flags()),
                    &self.root,
                )
                .context("writing the policy maps")?;
                Ok(g.info().policy_generation)
            },
        );
        let generation = match applied {
            Ok(g) => g,
            Err(e) => {
                let msg = format!("{e:#}");
                self.reject(source, trigger, &msg);
                let backoff = self.retry.as_ref().map_or(Retry::FIRST, |r| r.backoff * 2);
                let backoff = backoff.min(Retry::MAX);
                tracing::warn!(
                    retry_in_ms = backoff.as_millis() as u64,
                    "will retry applying this policy"
                );
                self.retry = Some(Retry {
                    source: source.to_owned(),
                    text: text.to_owned(),
                    at: Instant::now() + backoff,
                    backoff,
                });
                return Offer::Rejected(msg);
            }
        };
        self.last_text = Some(text.to_owned());
        self.last_rejected = false;
        self.retry = None;
        self.metrics.policy_rejected.set(0);
        if let Ok(mut n) = self.sinks.endpoints.write() {
            *n = names;
        }
        tracing::info!(
            trigger,
            generation,
            policy = %source,
            policy_hash = %candidate.hash(),
            mode = %candidate.mode,
            endpoints = candidate.endpoints.len(),
            allowed_cgroups = allow_set.len(),
            took_us = started.elapsed().as_micros() as u64,
            "policy applied"
        );
        if proxy.is_none() {
            self.sync_proxy(None);
        }
        if let Some(p) = &self.proxy {
            p.follow(&candidate, started_ns);
        }
        warn_paths_not_served(&candidate, self.proxy.is_some());
        self.policy = candidate;
        self.metrics.reload("success");
        self.keep_state(false);
        if self.cfg.terminate_established {
            self.terminate_established(allow_set).await;
        }
        Offer::Applied
    }

    /// Bring the allow set up to date (new or vanished cgroups, pods) and retry a failed
    /// apply whose time has come. The node level keeps itself current (see [`node::follow_links`]).
    pub(crate) async fn sync(&mut self) {
        self.retry_due().await;
        self.verify();
        let want = self.allow.allow_set(&self.policy);
        let Ok(mut g) = self.gate.lock() else { return };
        match g.sync_allow(&want) {
            Ok((0, 0)) => {}
            Ok((added, removed)) => {
                tracing::info!(added, removed, allowed_cgroups = want.len(), "allow set updated");
                drop(g);
                self.keep_state(false);
            }
            Err(e) => tracing::error!(error = %e, "updating the allow set"),
        }
    }

    /// Make the metadata proxy's programs in (`Some`) or out (`None`), unless they are
    /// already. Returns whether they are as asked.
    fn sync_proxy(&self, to: Option<&ProxySide>) -> bool {
        let Ok(mut g) = self.gate.lock() else { return false };
        if g.proxy_in() == to.is_some() {
            return true;
        }
        match place_proxy(&mut *g, &self.root, to) {
            Ok(()) => true,
            Err(e) => {
                let to = if to.is_some() { "in" } else { "out" };
                tracing::error!(error = %e, to, "placing the metadata proxy's programs");
                false
            }
        }
    }

    /// Stop serving ready; the gate stays pinned.
    pub(crate) fn stop(&self) {
        self.ready.store(false, Ordering::Release);
        if let Ok(g) = self.gate.lock() {
            tracing::info!(
                pin_dir = %g.pin_dir().display(),
                "stopping; the gate stays closed (pinned). `gate-agent cleanup` removes it"
            );
        }
    }
}

/// A background task that ends with its owner.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Fail closed, and say so: without the metadata proxy (`--proxy-address`), an entry
/// narrowed to paths (and `served`) is denied the metadata service; one warning per such
/// entry, at start and at every policy change.
fn warn_paths_not_served(policy: &crate::policy::Policy, proxy: bool) {
    if proxy {
        return;
    }
    for name in policy.paths_not_served() {
        tracing::warn!(
            policy = %policy.source,
            entry = %name,
            "served paths are not served: the metadata proxy is off (no --proxy-address), \
             so the workloads of this entry are denied the metadata service"
        );
    }
}
