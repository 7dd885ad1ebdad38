//! Node-level enforcement: the tc program on every interface's egress (where traffic leaves
//! the node) and on every interface's ingress but loopback's (where it enters the node from
//! pods, VMs and tunnels) — what no cgroup hook judged. On by default.
//!
//! [`rtnl`] reads the namespace's interfaces; [`classify`] decides, purely, where the program
//! belongs and which of its two variants (by what the interface's packets start with);
//! [`NodeLevel::plan`] turns that into a loader [`TcPlan`]; [`follow_links`] keeps the kernel in
//! step: on every link change (rtnetlink events, so a pod's interface is guarded as it
//! appears, not at the next rescan) and every verify period, which also restores an
//! attachment someone removed. Routes decide nothing: a route anyone can add never removes a
//! program. A listing that fails changes nothing: what is attached stays attached.
pub(crate) mod classify;
pub(crate) mod rtnl;

use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use gate_common::abi::NODE_GATE_FORWARDED;
use tokio::io::unix::AsyncFd;

use crate::{
    loader::{Gate, LoaderError, TcMode, TcPlan, TcReport},
    netlink::{NetlinkError, NlSocket},
    netns::{self, Netns, NetnsError},
};

/// How the node level is set up.
#[derive(Clone, Debug, Default)]
pub(crate) struct NodeConfig {
    /// `--node-enforcement`: off leaves only the cgroup hooks and what the flags below name
    /// (and opens the paths the cgroup hooks cannot see).
    pub enabled: bool,
    /// Guard every interface but loopback (and the trusted ones) on ingress.
    pub workload_ingress: bool,
    /// Deny forwarded traffic without a socket at the uplinks (pod-network traffic, Service
    /// DNAT, decapsulated tunnels, and frames that entered by an interface whose ingress
    /// program is missing), unless it entered by a trusted interface. Off only where
    /// pod-network traffic is left to the SDN (`--gate-scope host-network-only`).
    pub gate_forwarded: bool,
    /// Let only allowed gated sockets through the workload-facing interfaces found (cluster
    /// mode, every pod gated). Standalone lets sockets outside the gated root through them.
    pub strict_found: bool,
    /// `--tc-interface`: more uplinks.
    pub uplinks: Vec<String>,
    /// `--tc-workload-interface`: more workload-facing interfaces.
    pub workloads: Vec<String>,
    /// `--tc-trusted-interface`: interfaces whose forwarded traffic is not the gate's.
    pub trusted: Vec<String>,
    /// `--tc-netns`: the namespace of the interfaces; default the agent's own.
    pub netns: Option<PathBuf>,
    pub mode: TcMode,
}

/// What keeps the node level from being planned.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NodeError {
    #[error(transparent)]
    Glob(#[from] classify::GlobError),
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("listing interfaces: {0}")]
    Rtnl(#[from] NetlinkError),
    #[error(transparent)]
    Loader(#[from] LoaderError),
}

/// The node level's configuration, compiled.
#[derive(Debug)]
pub(crate) struct NodeLevel {
    cfg: NodeConfig,
    rules: classify::Rules,
}

impl NodeLevel {
    pub(crate) fn new(cfg: NodeConfig) -> Result<NodeLevel, NodeError> {
        let rules = classify::Rules::new(
            cfg.enabled,
            cfg.workload_ingress,
            cfg.strict_found,
            &cfg.uplinks,
            &cfg.workloads,
            &cfg.trusted,
        )?;
        Ok(NodeLevel { cfg, rules })
    }

    /// The `NODE_*` bits the policy maps carry for the program.
    pub(crate) fn node_flags(&self) -> u32 {
        if self.cfg.gate_forwarded { NODE_GATE_FORWARDED } else { 0 }
    }

    fn netns(&self) -> Netns<'_> {
        self.cfg.netns.as_deref().map_or(Netns::Current, Netns::Path)
    }

    /// Where the program belongs now. An error means the namespace could not be listed:
    /// then nothing may be detached.
    pub(crate) fn plan(&self) -> Result<TcPlan, NodeError> {
        let mut plan = TcPlan {
            targets: Default::default(),
            strict: Default::default(),
            trusted: Default::default(),
            netns: self.cfg.netns.clone(),
            mode: self.cfg.mode,
        };
        if !self.cfg.enabled && self.cfg.uplinks.is_empty() && self.cfg.workloads.is_empty() {
            return Ok(plan);
        }
        let links = netns::run_in(self.netns(), "mg-rtnl", || {
            rtnl::links(&mut rtnl::open().map_err(NetlinkError::Io)?)
        })??;
        let c = classify::classify(&links, &self.rules);
        (plan.targets, plan.strict, plan.trusted) = (c.targets, c.strict, c.trusted);
        Ok(plan)
    }

    /// Plan and make the kernel match; `update` swaps the program of existing attachments
    /// (agent start). Logs what changed.
    pub(crate) fn sync(&self, gate: &Mutex<Gate>, update: bool) -> Result<TcReport, NodeError> {
        let plan = self.plan()?;
        let mut g = gate.lock().map_err(|_| LoaderError::Tc("gate lock poisoned".into()))?;
        let report = g.sync_tc(&plan, update)?;
        log(&report);
        Ok(report)
    }

    /// A socket on the namespace's link and tc events (a clsact qdisc or filter someone
    /// deleted is put back at once, not at the next tick).
    fn events(&self) -> Result<NlSocket, NodeError> {
        let groups = rtnl::RTMGRP_LINK | rtnl::RTMGRP_TC;
        let sock = netns::run_in(self.netns(), "mg-rtnl", || {
            NlSocket::subscribe(libc::NETLINK_ROUTE as isize, groups)
        })?;
        Ok(sock.map_err(NetlinkError::Io)?)
    }
}

fn log(r: &TcReport) {
    for t in &r.repaired {
        tracing::warn!(interface = %t.name, direction = t.direction.name(), "tc attachment was missing; restored");
    }
    for t in r.attached.iter().filter(|t| !r.repaired.contains(t)) {
        tracing::info!(interface = %t.name, direction = t.direction.name(), "node-level program attached");
    }
    for removed in &r.removed {
        tracing::info!(attachment = %removed, "node-level program detached (interface gone or no longer guarded)");
    }
    for (t, why) in &r.failed {
        tracing::error!(interface = %t.name, direction = t.direction.name(), error = %why, "attaching the node-level program");
    }
    if r.held > 0 {
        tracing::error!(
            links = r.held,
            "node-level links held open by this agent only (not pinned): they go with it"
        );
    }
}

struct EventFd(NlSocket);

impl std::os::fd::AsRawFd for EventFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.fd().as_raw_fd()
    }
}

/// Keep the attachments in step with the namespace until the task is dropped: on link and tc
/// events (debounced by `settle`), and every `verify`.
pub(crate) async fn follow_links(
    node: Arc<NodeLevel>,
    gate: Arc<Mutex<Gate>>,
    verify: Duration,
    metrics: crate::metrics::AgentMetrics,
) {
    if !node.cfg.enabled && node.cfg.uplinks.is_empty() && node.cfg.workloads.is_empty() {
        return;
    }
    let registered = node.events().and_then(|s| {
        // SAFETY: the socket owns its fd, which stays open and unchanged for as long as the
        // AsyncFd owns the socket.
        unsafe { AsyncFd::register(EventFd(s)) }
            .map_err(|e| NodeError::Rtnl(NetlinkError::Io(std::io::Error::from(e))))
    });
    let events = match registered {
        Ok(fd) => Some(fd),
        Err(e) => {
            tracing::error!(error = %e, "listening for link and tc events failed; relying on the periodic check");
            None
        }
    };
    let mut tick = tokio::time::interval(verify);
    let settle = Duration::from_millis(5);
    loop {
        tokio::select! {
            ready = async {
                match &events {
                    Some(fd) => fd.readable().await.map(Some),
                    None => std::future::pending().await,
                }
            } => {
                if let Ok(Some(mut guard)) = ready {
                    // Drain what is queued; a burst of events is one sync.
                    let _ = guard.try_io(|fd| drain(&fd.get_ref().0));
                    guard.clear_ready();
                    tokio::time::sleep(settle).await;
                }
            }
            _ = tick.tick() => {}
        }
        let (node, gate) = (node.clone(), gate.clone());
        let r = tokio::task::spawn_blocking(move || node.sync(&gate, false)).await;
        match r {
            Ok(Ok(report)) => {
                for _ in &report.repaired {
                    metrics.repaired("tc");
                }
                metrics.node_attach_failures.set(report.failed.len() as i64);
            }
            Ok(Err(e)) => tracing::error!(error = %e, "node level: nothing detached, will retry"),
            Err(e) => tracing::error!(error = %e, "node level sync task failed"),
        }
    }
}

/// Read and discard every queued event datagram (the sync re-reads the state).
fn drain(sock: &NlSocket) -> std::io::Result<()> {
    loop {
        if let Err(e) = sock.discard() {
            match e.raw_os_error() {
                // Events were lost (queue overflow): nothing to do, the sync re-reads all.
                Some(libc::ENOBUFS) | Some(libc::EINTR) => continue,
                _ if e.kind() == std::io::ErrorKind::WouldBlock => return Err(e),
                _ => return Ok(()),
            }
        }
    }
}
