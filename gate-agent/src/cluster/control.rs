//! The decisions of cluster mode, made over a stream of [`Input`]s: which policy is in force,
//! which pods are allowed, which platform's ConfigMap is followed, and which Events are
//! published. It acts only through the engine and [`ClusterOps`], so the fast tests drive it
//! with a scripted stream, a fake gate and a fake cluster (`control/tests.rs`); the watches,
//! signals and timers that make the real stream are in [`super::run`].
//!
//! The engine starts once a good policy and the first full pod list are in, so an allowed
//! component is never denied for want of a list. Until then a gate pinned by an earlier
//! agent keeps enforcing what it enforced.
use anyhow::{Result, bail};
use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, Pod};
use kube::runtime::{reflector::ObjectRef, watcher::Event};
use serde_json::Value;

use super::{
    identity::{PodCgroups, Scope},
    kevents,
    platform::{self, Detected, Origin},
    pods::Pods,
};
use crate::{
    engine::{AllowSource, Engine, GateOps, Offer},
    events::{Blocked, Namer},
    policy::Policy,
};

/// The key of the policy in its ConfigMap.
pub(crate) const POLICY_KEY: &str = "policy.yaml";

/// One thing the loop reacts to.
pub(crate) enum Input {
    /// SIGTERM or SIGINT.
    Stop,
    /// The followed policy ConfigMap.
    Policy(Box<Event<ConfigMap>>),
    /// The pods of this node.
    Pods(Box<Event<Pod>>),
    /// OpenShift's Infrastructure object, as listed or changed.
    Infrastructure(Box<Value>),
    /// A denial that was logged: a Kubernetes Event on its pod.
    Blocked(Box<Blocked>),
    /// Time to re-resolve the allow set and repair what went missing.
    Tick,
    /// A watch ended, which a watch never does on its own.
    Ended(&'static str),
}

impl Input {
    fn name(&self) -> &'static str {
        match self {
            Input::Stop => "stop",
            Input::Policy(e) => match **e {
                Event::Apply(_) => "policy apply",
                Event::InitApply(_) => "policy init-apply",
                Event::Delete(_) => "policy delete",
                Event::Init => "policy init",
                Event::InitDone => "policy init-done",
            },
            Input::Pods(_) => "pods",
            Input::Infrastructure(_) => "infrastructure",
            Input::Blocked(_) => "blocked",
            Input::Tick => "tick",
            Input::Ended(_) => "ended",
        }
    }
}

/// What the loop asks of the node and the cluster besides the engine: the agent's own
/// implementation loads the gate and talks to the API server (`run.rs`); the fast tests'
/// records what it was asked.
pub(crate) trait ClusterOps {
    type Gate: GateOps;
    /// Start the engine with the first good policy.
    async fn start(
        &mut self,
        policy: Policy,
        allow: Box<dyn AllowSource>,
        namer: Namer,
    ) -> Result<Engine<Self::Gate>>;
    /// The gate is closed on this node: it may take any pod now (the not-ready taint goes).
    fn gate_closed(&mut self);
    /// Follow another policy ConfigMap from the next input on.
    fn follow(&mut self, configmap: &ObjectRef<ConfigMap>);
    /// Publish a Kubernetes Event on `object` (rate-limited; failures are logged).
    async fn publish(
        &mut self,
        object: ObjectReference,
        warning: bool,
        reason: kevents::Reason,
        note: String,
    );
}

/// Where the loop starts from.
pub(crate) struct Setup {
    /// The agent's namespace, where the per-platform policy ConfigMaps are.
    pub namespace: String,
    pub platform: Detected,
    /// `--policy-configmap`: this one, whatever the platform.
    pub policy_configmap: Option<(String, String)>,
    pub cgroups: PodCgroups,
    pub scope: Scope,
}

/// The policy ConfigMap to follow first, and whether it follows the platform: the one
/// `--policy-configmap` names, else the platform's in the agent's namespace.
pub(crate) fn followed(
    namespace: &str,
    platform: &Detected,
    flag: Option<&(String, String)>,
) -> (ObjectRef<ConfigMap>, bool) {
    match flag {
        Some((ns, name)) => (ObjectRef::new(name).within(ns), false),
        None => (ObjectRef::new(&platform.configmap_name()).within(namespace), true),
    }
}

/// Everything the loop keeps between inputs.
pub(crate) struct Control<C: ClusterOps> {
    ops: C,
    namespace: String,
    platform: Detected,
    configmap: ObjectRef<ConfigMap>,
    /// Whether the ConfigMap name follows the platform (no --policy-configmap).
    follows_platform: bool,
    pods: Pods,
    cgroups: PodCgroups,
    scope: Scope,
    engine: Option<Engine<C::Gate>>,
    /// Before the engine runs: the first good policy, waiting for the pod list.
    pending: Option<Policy>,
}

impl<C: ClusterOps> Control<C> {
    pub(crate) fn new(ops: C, setup: Setup) -> Self {
        let (configmap, follows_platform) =
            followed(&setup.namespace, &setup.platform, setup.policy_configmap.as_ref());
        Control {
            ops,
            namespace: setup.namespace,
            platform: setup.platform,
            configmap,
            follows_platform,
            pods: Pods::new(),
            cgroups: setup.cgroups,
            scope: setup.scope,
            engine: None,
            pending: None,
        }
    }

    /// The policy ConfigMap followed now.
    #[cfg(test)]
    pub(crate) fn configmap(&self) -> &ObjectRef<ConfigMap> {
        &self.configmap
    }

    /// The running engine, if it started.
    #[cfg(test)]
    pub(crate) fn engine(&self) -> Option<&Engine<C::Gate>> {
        self.engine.as_ref()
    }

    fn source(&self) -> String {
        format!(
            "configmap {}/{}",
            self.configmap.namespace.as_deref().unwrap_or_default(),
            self.configmap.name
        )
    }

    /// React to each input until the inputs say Stop (the engine stops serving ready; the
    /// gate stays pinned) or run dry (the engine keeps running: the tests go on).
    pub(crate) async fn drive(&mut self, inputs: impl Stream<Item = Input>) -> Result<()> {
        let mut inputs = std::pin::pin!(inputs);
        while let Some(input) = inputs.next().await {
            tracing::debug!(input = input.name(), "input");
            match input {
                Input::Stop => {
                    if let Some(engine) = &self.engine {
                        engine.stop();
                    }
                    return Ok(());
                }
                Input::Ended(what) => bail!("the {what} watch ended"),
                Input::Policy(ev) => self.on_policy(*ev).await,
                Input::Pods(ev) => {
                    if self.pods.apply(&ev) {
                        self.sync().await;
                    }
                }
                Input::Infrastructure(obj) => self.on_infrastructure(&obj),
                Input::Blocked(b) => self.on_blocked(*b).await,
                Input::Tick => self.sync().await,
            }
            self.start_when_ready().await?;
        }
        Ok(())
    }

    /// Start the engine once both a good policy and the first full pod list are in.
    async fn start_when_ready(&mut self) -> Result<()> {
        if self.engine.is_some() || !self.pods.listed() {
            return Ok(());
        }
        let Some(policy) = self.pending.take() else { return Ok(()) };
        let allow = Box::new(self.pods.allow(self.cgroups.clone(), self.scope));
        let namer = self.pods.namer(self.cgroups.clone());
        self.engine = Some(self.ops.start(policy, allow, namer).await?);
        self.ops.gate_closed();
        Ok(())
    }

    /// Bring the allow set up to date and repair the gate, once the engine runs.
    async fn sync(&mut self) {
        if let Some(engine) = &mut self.engine {
            engine.sync().await;
        }
    }

    /// Whether `cm` is the ConfigMap followed now (not one of a platform left behind).
    fn follows(&self, cm: &ConfigMap) -> bool {
        cm.metadata.name.as_deref() == Some(self.configmap.name.as_str())
            && cm
                .metadata
                .namespace
                .as_ref()
                .is_none_or(|ns| self.configmap.namespace.as_ref() == Some(ns))
    }

    async fn on_policy(&mut self, ev: Event<ConfigMap>) {
        match ev {
            Event::Apply(cm) | Event::InitApply(cm) if self.follows(&cm) => {
                let source = self.source();
                let text = policy_text(&cm);
                if let Some(why) =
                    offer_policy(self.engine.as_mut(), &mut self.pending, &source, text).await
                {
                    let note = format!(
                        "metadata-gate rejected this policy, the last good one stays: {why}"
                    );
                    let object = self.configmap.clone().into();
                    self.ops.publish(object, true, kevents::Reason::PolicyRejected, note).await;
                }
            }
            Event::Delete(cm) if self.follows(&cm) => {
                tracing::warn!(configmap = %self.source(), "policy ConfigMap deleted; the last good policy stays in force")
            }
            Event::Apply(cm) | Event::InitApply(cm) | Event::Delete(cm) => tracing::debug!(
                configmap = cm.metadata.name,
                "not the policy ConfigMap followed now; ignored"
            ),
            Event::Init | Event::InitDone => {}
        }
    }

    /// The Infrastructure object changed: follow a new platform's policy ConfigMap.
    fn on_infrastructure(&mut self, obj: &Value) {
        match platform::from_infrastructure(obj) {
            Ok(p) if p != self.platform.platform => {
                tracing::warn!(from = %self.platform.platform, to = %p, "the Infrastructure object names another platform");
                self.platform = Detected { platform: p, origin: Origin::Infrastructure };
                if self.follows_platform {
                    self.configmap =
                        ObjectRef::new(&self.platform.configmap_name()).within(&self.namespace);
                    tracing::info!(configmap = %self.source(), "following the platform's policy ConfigMap");
                    // A policy still waiting came from the ConfigMap left behind: the engine
                    // starts on the new platform's own.
                    self.pending = None;
                    self.ops.follow(&self.configmap);
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "reading the Infrastructure object"),
        }
    }

    /// A Kubernetes Event on the pod of a logged denial or refusal (named once, when it was
    /// logged), its reason and action by which it was.
    async fn on_blocked(&mut self, b: Blocked) {
        let Some(object) = kevents::pod_ref(&b.workload) else { return };
        let note = kevents::blocked_note(&b, b.workload.container.as_deref());
        self.ops.publish(object.into(), true, kevents::Reason::of(&b.how), note).await;
    }
}

/// A ConfigMap's policy text, or why there is none.
fn policy_text(cm: &ConfigMap) -> Result<String, String> {
    cm.data
        .as_ref()
        .and_then(|d| d.get(POLICY_KEY))
        .cloned()
        .ok_or_else(|| format!("data.{POLICY_KEY}: missing"))
}

/// A policy ConfigMap's text: before the engine runs, a good policy waits for the pod list
/// (the newest good one wins, a bad one leaves it waiting); once the engine runs, it is
/// offered. Returns why it was rejected, for the Event on the ConfigMap.
async fn offer_policy<G: GateOps>(
    engine: Option<&mut Engine<G>>,
    pending: &mut Option<Policy>,
    source: &str,
    text: Result<String, String>,
) -> Option<String> {
    match engine {
        Some(engine) => {
            let offer = match text {
                Ok(text) => engine.offer(source, &text, "configmap changed").await,
                Err(why) => {
                    engine.reject(source, "configmap changed", &why);
                    Offer::Rejected(why)
                }
            };
            match offer {
                Offer::Rejected(why) => Some(why),
                Offer::Applied | Offer::Unchanged => None,
            }
        }
        None => match text.and_then(|t| Policy::parse(source, &t).map_err(|e| e.to_string())) {
            Ok(p) => {
                *pending = Some(p);
                None
            }
            Err(why) => {
                tracing::error!(configmap = %source, error = %why, "policy rejected; waiting for a good one");
                Some(why)
            }
        },
    }
}

#[cfg(test)]
mod tests;
