//! A gate without a kernel, for the fast tests: it records what the engine told it to
//! install and fails when told to; and an engine started on it, as `Engine::start` leaves it.
use std::{
    path::Path,
    sync::{Arc, Mutex, atomic::AtomicBool},
    time::Instant,
};

use gate_common::{
    abi::{GateInfo, ProxyConfig},
    user::{AllowSet, AttachPoint, PolicyHash, TerminateState},
};

use super::{AllowSource, Engine, GateOps, bring_up_gate};
use crate::{
    cgroup::{CgroupError, GatedRoot},
    config::GateConfig,
    events::EventSinks,
    loader::{HookChange, Install, LoaderError, ProxySide, Repair, Start, TcPlan, TcReport},
    metrics::{AgentMetrics, ReloadLabels, RepairLabels},
    node::{NodeConfig, NodeLevel},
    policy::{Mode, Policy},
};

pub(crate) const GOOD: &str =
    "platform: AWS\nendpoints:\n  - {name: imds, cidr: 169.254.169.254/32}\n";
pub(crate) const OTHER: &str = "platform: AWS\nmode: audit\nendpoints:\n  - {name: imds, cidr: 169.254.169.254/32}\n  - {name: imds-v6, cidr: fd00:ec2::254/128}\n";
pub(crate) const GCP: &str =
    "platform: GCP\nendpoints:\n  - {name: gce, cidr: 169.254.169.254/32}\n";
pub(crate) const INVALID: &str = "platform: AWS\nendpoints:\n  - {name: imds, cidr: not-a-cidr}\n";
const ROOT: &str = "/sys/fs/cgroup/gated";

/// What one apply wrote.
#[derive(Clone, Debug)]
pub(crate) struct Installed {
    pub(crate) hash: PolicyHash,
    pub(crate) mode: Mode,
    pub(crate) platform: String,
    pub(crate) endpoints: Vec<String>,
    pub(crate) allow: AllowSet,
    pub(crate) root_id: u64,
}

/// What the fake was told, and what it is told to fail.
#[derive(Default)]
pub(crate) struct FakeState {
    pub(crate) calls: Vec<&'static str>,
    pub(crate) installed: Vec<Installed>,
    pub(crate) allow_synced: Vec<AllowSet>,
    pub(crate) discarded: bool,
    pub(crate) fail_check_root: bool,
    pub(crate) fail_apply: bool,
    pub(crate) fail_attach: bool,
    pub(crate) fail_repair: bool,
    pub(crate) fail_proxy_on: bool,
    /// What the next repair finds missing and puts back.
    pub(crate) missing: Vec<Repair>,
    /// The proxy the kernel is told of: its programs are in.
    pub(crate) proxy: Option<ProxySide>,
    /// The proxy's programs an earlier agent left pinned (an adopted gate's).
    pub(crate) proxy_pinned: bool,
}

pub(crate) struct Fake {
    pub(crate) start: Start,
    pub(crate) info: GateInfo,
    pub(crate) allowed: AllowSet,
    pub(crate) state: Arc<Mutex<FakeState>>,
}

fn told(why: &str) -> LoaderError {
    LoaderError::Tc(format!("told to fail: {why}"))
}

impl Fake {
    pub(crate) fn new(start: Start) -> (Fake, Arc<Mutex<FakeState>>) {
        let state = Arc::new(Mutex::new(FakeState::default()));
        let mut info = GateInfo::default();
        if start == Start::Adopted {
            info.policy_generation = 41;
            info.policy_hash = 0xfeed;
        }
        (Fake { start, info, allowed: AllowSet::new(), state: state.clone() }, state)
    }

    pub(crate) fn s(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state.lock().unwrap()
    }
}

impl GateOps for Fake {
    fn start(&self) -> Start {
        self.start
    }
    fn info(&self) -> &GateInfo {
        &self.info
    }
    fn check_root(&self, _root: &GatedRoot) -> Result<(), LoaderError> {
        let mut s = self.s();
        s.calls.push("check_root");
        if s.fail_check_root { Err(told("check_root")) } else { Ok(()) }
    }
    fn apply(&mut self, install: &Install<'_>, root: &GatedRoot) -> Result<(), LoaderError> {
        let mut s = self.state.lock().unwrap();
        s.calls.push("apply");
        if s.fail_apply {
            return Err(told("apply"));
        }
        s.installed.push(Installed {
            hash: install.hash,
            mode: install.mode,
            platform: install.platform.to_owned(),
            endpoints: install.endpoint_names.to_vec(),
            allow: install.allow.clone(),
            root_id: root.id,
        });
        self.info.policy_generation += 1;
        self.info.policy_hash = install.hash.0;
        self.allowed = install.allow.clone();
        Ok(())
    }
    fn attach(&mut self, _root: &GatedRoot) -> Result<Vec<HookChange>, LoaderError> {
        let mut s = self.s();
        s.calls.push("attach");
        if s.fail_attach { Err(told("attach")) } else { Ok(Vec::new()) }
    }
    fn proxy_on(
        &mut self,
        _root: &GatedRoot,
        side: &ProxySide,
    ) -> Result<Vec<HookChange>, LoaderError> {
        let mut s = self.s();
        s.calls.push("proxy_on");
        if s.fail_proxy_on {
            // As the loader: PROXY is written last, so a failure tells the kernel nothing.
            return Err(told("proxy_on"));
        }
        s.proxy = Some(side.clone());
        s.proxy_pinned = true;
        Ok(Vec::new())
    }
    fn proxy_off(&mut self) -> Result<Vec<AttachPoint>, LoaderError> {
        let mut s = self.s();
        s.calls.push("proxy_off");
        s.proxy = None;
        let was = std::mem::take(&mut s.proxy_pinned);
        Ok(if was { AttachPoint::PROXY.to_vec() } else { Vec::new() })
    }
    fn proxy_in(&self) -> bool {
        self.s().proxy.is_some()
    }
    fn sync_tc(&mut self, _plan: &TcPlan, _update: bool) -> Result<TcReport, LoaderError> {
        self.s().calls.push("sync_tc");
        Ok(TcReport::default())
    }
    fn sync_allow(&mut self, want: &AllowSet) -> Result<(usize, usize), LoaderError> {
        let added = want.iter().filter(|(id, _)| self.allowed.get(*id).is_none()).count();
        let removed = self.allowed.iter().filter(|(id, _)| want.get(*id).is_none()).count();
        self.allowed = want.clone();
        self.s().allow_synced.push(want.clone());
        Ok((added, removed))
    }
    fn allowed(&self) -> &AllowSet {
        &self.allowed
    }
    fn repair(&mut self, _root: &GatedRoot) -> Result<Vec<Repair>, LoaderError> {
        let mut s = self.s();
        s.calls.push("repair");
        if s.fail_repair { Err(told("repair")) } else { Ok(std::mem::take(&mut s.missing)) }
    }
    fn set_terminate(&mut self, _: TerminateState, _: usize, _: usize) -> Result<(), LoaderError> {
        Ok(())
    }
    fn pin_dir(&self) -> &Path {
        Path::new("/nonexistent/metadata-gate-test/v1")
    }
    fn discard(self) {
        self.s().discarded = true;
    }
}

/// An allow set the test changes, as pods come and go.
#[derive(Clone, Default)]
pub(crate) struct Allow(pub(crate) Arc<Mutex<AllowSet>>);

impl Allow {
    pub(crate) fn set(&self, ids: &[u64]) {
        let mut a = AllowSet::new();
        for &id in ids {
            a.insert(id, 1);
        }
        *self.0.lock().unwrap() = a;
    }
    pub(crate) fn now(&self) -> AllowSet {
        self.0.lock().unwrap().clone()
    }
}

impl AllowSource for Allow {
    fn allow_set(&self, _policy: &Policy) -> AllowSet {
        self.now()
    }
}

pub(crate) fn root(id: u64) -> GatedRoot {
    GatedRoot { path: ROOT.into(), mount: "/sys/fs/cgroup".into(), id, level: 1 }
}

pub(crate) fn cfg() -> GateConfig {
    GateConfig {
        pin_dir: "/nonexistent/metadata-gate-test".into(),
        mount_bpffs: false,
        egress: Default::default(),
        lsm_programs: false,
        node: NodeConfig::default(),
        terminate_established: false,
    }
}

pub(crate) fn node() -> NodeLevel {
    NodeLevel::new(NodeConfig::default()).unwrap()
}

pub(crate) fn policy(text: &str) -> Policy {
    Policy::parse("policy.yaml", text).unwrap()
}

/// The gated root as the repair check sees it: its cgroup id, or gone (0).
#[derive(Clone)]
pub(crate) struct Root(pub(crate) Arc<Mutex<u64>>);

impl Root {
    pub(crate) fn set(&self, id: u64) {
        *self.0.lock().unwrap() = id;
    }
}

/// An engine started with `text` on a fake gate, as `Engine::start` leaves it.
pub(crate) struct Rig {
    pub(crate) engine: Engine<Fake>,
    pub(crate) gate: Arc<Mutex<FakeState>>,
    pub(crate) allow: Allow,
    pub(crate) root: Root,
}

/// A metadata proxy in the cgroup `agent` below the gated root, as the DaemonSet's.
pub(crate) fn proxy_side() -> ProxySide {
    let own = GatedRoot {
        path: format!("{ROOT}/agent").into(),
        mount: "/sys/fs/cgroup".into(),
        id: 9,
        level: 2,
    };
    let config = ProxyConfig { port: 9254, cgroup_id: 9, ..ProxyConfig::default() };
    ProxySide { own, config }
}

/// An engine started with `policy` on a fake gate, as `Engine::start` leaves it; `reopen` is
/// what the repair check finds at the gated root; `proxy`: the metadata proxy configured.
pub(crate) fn started(
    fake: (Fake, Arc<Mutex<FakeState>>),
    policy: Policy,
    allow: Box<dyn AllowSource>,
    reopen: super::Reopen,
    proxy: Option<ProxySide>,
) -> (Engine<Fake>, Arc<Mutex<FakeState>>) {
    let (fake, gate) = fake;
    let allowed = allow.allow_set(&policy);
    let fake =
        bring_up_gate(fake, &cfg(), &node(), &policy, &root(7), &allowed, proxy.as_ref()).unwrap();
    let engine = Engine {
        sinks: EventSinks::new(policy.endpoint_names()),
        policy,
        root: root(7),
        gate: Arc::new(Mutex::new(fake)),
        metrics: AgentMetrics::default(),
        ready: Arc::new(AtomicBool::new(true)),
        cfg: cfg(),
        state: None,
        allow,
        node: Arc::new(node()),
        _node_links: None,
        reopen,
        last_text: None,
        last_rejected: false,
        retry: None,
        _server: None,
        proxy: None,
        proxy_side: proxy,
    };
    (engine, gate)
}

impl Rig {
    pub(crate) fn start(start: Start, text: &str) -> Rig {
        Self::with_proxy(Fake::new(start), text, None)
    }

    /// [`Rig::start`] on `fake` (as the test set it up), with the metadata proxy `proxy`.
    pub(crate) fn with_proxy(
        fake: (Fake, Arc<Mutex<FakeState>>),
        text: &str,
        proxy: Option<ProxySide>,
    ) -> Rig {
        let allow = Allow::default();
        allow.set(&[100]);
        let seen = Root(Arc::new(Mutex::new(7)));
        let reopen = {
            let seen = seen.clone();
            move |path: &Path| match *seen.0.lock().unwrap() {
                0 => Err(CgroupError::NotFound { path: path.to_path_buf() }),
                id => Ok(root(id)),
            }
        };
        let (engine, gate) =
            started(fake, policy(text), Box::new(allow.clone()), Box::new(reopen), proxy);
        Rig { engine, gate, allow, root: seen }
    }

    pub(crate) fn installed(&self) -> Vec<Installed> {
        self.gate.lock().unwrap().installed.clone()
    }

    /// The hash the fake gate enforces now.
    pub(crate) fn enforced(&self) -> PolicyHash {
        PolicyHash(self.engine.gate.lock().unwrap().info.policy_hash)
    }

    pub(crate) fn fail_apply(&self, fail: bool) {
        self.gate.lock().unwrap().fail_apply = fail;
    }

    pub(crate) fn rejected(&self) -> i64 {
        self.engine.metrics.policy_rejected.get()
    }

    pub(crate) fn reloads(&self, result: &'static str) -> u64 {
        self.engine.metrics.reloads.get_or_create(&ReloadLabels { result }).get()
    }

    pub(crate) fn repairs(&self, what: &'static str) -> u64 {
        self.engine.metrics.repairs.get_or_create(&RepairLabels { what }).get()
    }

    pub(crate) fn ready(&self) -> bool {
        self.engine.ready.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Make a scheduled retry due now.
    pub(crate) fn retry_now(&mut self) {
        if let Some(r) = self.engine.retry.as_mut() {
            r.at = Instant::now();
        }
    }
}

pub(crate) fn ids(a: &AllowSet) -> Vec<u64> {
    a.iter().map(|(id, _)| id).collect()
}
