//! What the engine asks of the loader, as a trait: the loaded [`Gate`] answers in the agent,
//! and the fast tests put in a fake that records what it was told to install (`engine::tests`).
//! The trait lives here, above the loader, so that the loader knows nothing of the engine.
use std::path::Path;

use gate_common::{
    abi::GateInfo,
    user::{AllowSet, AttachPoint, TerminateState},
};

use crate::{
    cgroup::GatedRoot,
    loader::{
        self, Gate, HookChange, Install, LoaderError, ProxySide, Repair, Start, TcPlan, TcReport,
    },
};

/// The operations the engine performs on a loaded gate.
pub(crate) trait GateOps: Send + 'static {
    /// Whether the gate was created now or adopted from pins.
    fn start(&self) -> Start;
    /// What was last applied (for an adopted gate: by the previous agent).
    fn info(&self) -> &GateInfo;
    /// Never adopt a gate that protects another cgroup.
    fn check_root(&self, root: &GatedRoot) -> Result<(), LoaderError>;
    /// Write a policy into the inactive generation and flip to it.
    fn apply(&mut self, install: &Install<'_>, root: &GatedRoot) -> Result<(), LoaderError>;
    /// Attach (or swap in place) the gate's cgroup programs on `root`.
    fn attach(&mut self, root: &GatedRoot) -> Result<Vec<HookChange>, LoaderError>;
    /// Put the metadata proxy's programs in (or swap them in place), then tell the kernel
    /// where the proxy is.
    fn proxy_on(
        &mut self,
        root: &GatedRoot,
        side: &ProxySide,
    ) -> Result<Vec<HookChange>, LoaderError>;
    /// Tell the kernel there is no proxy, then take the proxy's programs out; the attach
    /// points whose links were there.
    fn proxy_off(&mut self) -> Result<Vec<AttachPoint>, LoaderError>;
    /// Whether the metadata proxy's programs are in.
    fn proxy_in(&self) -> bool;
    /// Make the node-level attachments match `plan`.
    fn sync_tc(&mut self, plan: &TcPlan, update: bool) -> Result<TcReport, LoaderError>;
    /// Make the live allow set equal `want`; (added, removed).
    fn sync_allow(&mut self, want: &AllowSet) -> Result<(usize, usize), LoaderError>;
    /// The live allow set.
    fn allowed(&self) -> &AllowSet;
    /// Put back links and pins that went missing.
    fn repair(&mut self, root: &GatedRoot) -> Result<Vec<Repair>, LoaderError>;
    /// Record the terminate-established state for `status`.
    fn set_terminate(
        &mut self,
        state: TerminateState,
        netns: usize,
        hidden: usize,
    ) -> Result<(), LoaderError>;
    fn pin_dir(&self) -> &Path;
    /// Close the gate's maps and remove what a failed fresh start pinned.
    fn discard(self);
}

impl GateOps for Gate {
    fn start(&self) -> Start {
        Gate::start(self)
    }
    fn info(&self) -> &GateInfo {
        Gate::info(self)
    }
    fn check_root(&self, root: &GatedRoot) -> Result<(), LoaderError> {
        Gate::check_root(self, root)
    }
    fn apply(&mut self, install: &Install<'_>, root: &GatedRoot) -> Result<(), LoaderError> {
        Gate::apply(self, install, root)
    }
    fn attach(&mut self, root: &GatedRoot) -> Result<Vec<HookChange>, LoaderError> {
        Gate::attach(self, root)
    }
    fn proxy_on(
        &mut self,
        root: &GatedRoot,
        side: &ProxySide,
    ) -> Result<Vec<HookChange>, LoaderError> {
        Gate::proxy_on(self, root, side)
    }
    fn proxy_off(&mut self) -> Result<Vec<AttachPoint>, LoaderError> {
        Gate::proxy_off(self)
    }
    fn proxy_in(&self) -> bool {
        Gate::proxy_in(self)
    }
    fn sync_tc(&mut self, plan: &TcPlan, update: bool) -> Result<TcReport, LoaderError> {
        Gate::sync_tc(self, plan, update)
    }
    fn sync_allow(&mut self, want: &AllowSet) -> Result<(usize, usize), LoaderError> {
        Gate::sync_allow(self, want)
    }
    fn allowed(&self) -> &AllowSet {
        Gate::allowed(self)
    }
    fn repair(&mut self, root: &GatedRoot) -> Result<Vec<Repair>, LoaderError> {
        Gate::repair(self, root)
    }
    fn set_terminate(
        &mut self,
        state: TerminateState,
        netns: usize,
        hidden: usize,
    ) -> Result<(), LoaderError> {
        Gate::set_terminate(self, state, netns, hidden)
    }
    fn pin_dir(&self) -> &Path {
        Gate::pin_dir(self)
    }
    fn discard(self) {
        let dir = self.pin_dir().to_path_buf();
        // The maps close with the gate: only then can their pins go.
        drop(self);
        if let Err(c) = loader::pins::remove_version(&dir) {
            tracing::error!(error = %c, "removing the pin dir after a failed start");
        }
    }
}
