//! `gate-agent run` without `--policy`: the DaemonSet mode.
//!
//! 1. Platform: `--platform`, else OpenShift's Infrastructure object, else the node's
//!    providerID ([`super::platform`]). The Infrastructure object is watched.
//! 2. Policy: the ConfigMap `<namespace>/metadata-gate-policy-<platform>` (key `policy.yaml`),
//!    watched and hot-reloaded through the same validate → compile → swap path as files. A bad
//!    one is rejected (log, metric, Kubernetes Event on the ConfigMap); the last good stays.
//! 3. Allow set: the pods on this node (field selector `spec.nodeName`), mapped to their
//!    cgroups ([`super::identity`]). A pod that is allowed is allowed from the moment it is
//!    seen (its pod-level cgroup), a deleted pod is removed.
//!
//! This module is the edge: it makes the one stream of [`Input`]s from the watches, the
//! denials, the repair timer and the signals, and does what the loop asks of the node and the
//! cluster ([`Live`]). The decisions are [`Control`]'s.
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use futures::{Stream, StreamExt as _, stream::BoxStream};
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, Pod};
use kube::runtime::{reflector::ObjectRef, watcher::Event};
use serde_json::Value;
use tokio::{
    signal::unix::{Signal, SignalKind, signal},
    sync::mpsc,
    time::Interval,
};

use super::{
    control::{ClusterOps, Control, Input, Setup, followed},
    identity::PodCgroups,
    kevents::Publisher,
    platform, taint, watches,
};
use crate::{
    cgroup::{GatedRoot, cgroup2_mount},
    config::{AgentConfig, ClusterConfig},
    engine::{AllowSource, Engine},
    events::{Blocked, CgroupNames, Namer},
    loader::Gate,
    policy::Policy,
};

/// The kubepods cgroup: `--cgroup-root`, else the first of the kubelet's usual places under
/// the cgroup2 mount.
fn kubepods_root(flag: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = flag {
        return Ok(p.to_path_buf());
    }
    let mount = cgroup2_mount()?;
    for rel in
        ["kubepods.slice", "kubepods", "kubelet.slice/kubelet-kubepods.slice", "kubelet/kubepods"]
    {
        let p = mount.join(rel);
        if p.is_dir() {
            return Ok(p);
        }
    }
    bail!(
        "no kubepods cgroup under {} (tried kubepods.slice, kubepods, kubelet.slice/kubelet-kubepods.slice); pass --cgroup-root",
        mount.display()
    )
}

/// What the loop tells the input side.
enum Steer {
    /// Watch this policy ConfigMap instead (the platform changed).
    Follow(ObjectRef<ConfigMap>),
    /// The engine runs: denials and repair ticks may come in.
    Started,
}

/// The sources of [`Input`].
struct Inputs {
    client: kube::Client,
    configmap: BoxStream<'static, Event<ConfigMap>>,
    pods: BoxStream<'static, Event<Pod>>,
    infrastructure: BoxStream<'static, Value>,
    denied: mpsc::UnboundedReceiver<Blocked>,
    tick: Interval,
    term: Signal,
    int: Signal,
    steer: mpsc::UnboundedReceiver<Steer>,
    running: bool,
}

impl Inputs {
    /// The next input; denials and ticks only once the engine runs. What the loop asked for
    /// while handling the last input is done first, so nothing of a ConfigMap it left comes in.
    async fn next(&mut self) -> Input {
        while let Ok(steer) = self.steer.try_recv() {
            match steer {
                Steer::Follow(cm) => {
                    let ns = cm.namespace.as_deref().unwrap_or_default();
                    self.configmap = watches::configmap(&self.client, ns, &cm.name);
                }
                Steer::Started => self.running = true,
            }
        }
        let running = self.running;
        tokio::select! {
            _ = self.term.recv() => Input::Stop,
            _ = self.int.recv() => Input::Stop,
            ev = self.configmap.next() => ev.map_or(Input::Ended("policy configmap"), |e| Input::Policy(Box::new(e))),
            ev = self.pods.next() => ev.map_or(Input::Ended("pods"), |e| Input::Pods(Box::new(e))),
            obj = self.infrastructure.next() => match obj {
                Some(obj) => Input::Infrastructure(Box::new(obj)),
                None => {
                    self.infrastructure = futures::stream::pending().boxed();
                    Input::Tick
                }
            },
            Some(d) = self.denied.recv(), if running => Input::Blocked(Box::new(d)),
            _ = self.tick.tick(), if running => Input::Tick,
        }
    }

    fn into_stream(self) -> impl Stream<Item = Input> {
        futures::stream::unfold(self, |mut inputs| async move {
            let input = inputs.next().await;
            Some((input, inputs))
        })
    }
}

/// The Infrastructure object as JSON, each time it is listed or changed.
fn infrastructure_objects(
    client: &kube::Client,
    origin: platform::Origin,
) -> BoxStream<'static, Value> {
    watches::infrastructure(client, origin)
        .filter_map(|ev| {
            futures::future::ready(match ev {
                Event::Apply(obj) | Event::InitApply(obj) => {
                    Some(serde_json::to_value(&obj).unwrap_or_default())
                }
                Event::Init | Event::InitDone | Event::Delete(_) => None,
            })
        })
        .boxed()
}

/// The node and the cluster as the loop sees them.
struct Live<'a> {
    cfg: &'a AgentConfig,
    client: kube::Client,
    node: String,
    root_path: PathBuf,
    /// Opened before the wait, so a missing root fails the start at once.
    root: Option<GatedRoot>,
    denied: mpsc::UnboundedSender<Blocked>,
    steer: mpsc::UnboundedSender<Steer>,
    events: Publisher,
}

impl ClusterOps for Live<'_> {
    type Gate = Gate;

    async fn start(
        &mut self,
        policy: Policy,
        allow: Box<dyn AllowSource>,
        namer: Namer,
    ) -> Result<Engine> {
        let root = self.root.take().context("the engine starts once")?;
        let names = CgroupNames::with_namer(GatedRoot::open(&self.root_path)?, namer);
        let engine =
            Engine::start(self.cfg, policy, root, allow, names, Some(self.denied.clone())).await?;
        let _ = self.steer.send(Steer::Started);
        Ok(engine)
    }

    fn gate_closed(&mut self) {
        tokio::spawn(taint::remove_not_ready(self.client.clone(), self.node.clone()));
    }

    fn follow(&mut self, configmap: &ObjectRef<ConfigMap>) {
        let _ = self.steer.send(Steer::Follow(configmap.clone()));
    }

    async fn publish(
        &mut self,
        object: ObjectReference,
        warning: bool,
        reason: super::kevents::Reason,
        note: String,
    ) {
        self.events.publish(object, warning, reason, note).await;
    }
}

/// Wait for the first good policy and the first full pod list, then start the engine and
/// keep policy, pods and platform current.
pub(crate) async fn run(cfg: &AgentConfig, args: &ClusterConfig) -> Result<()> {
    let node = args.node_name.clone();
    let client = watches::client(args.kubeconfig.as_deref()).await?;
    let detected = platform::detect(&client, &node, args.platform.as_deref()).await?;
    let (cm, _) = followed(&args.namespace, &detected, args.policy_configmap.as_ref());
    let cm_ns = cm.namespace.clone().unwrap_or_default();
    tracing::info!(
        node, platform = %detected.platform, from = ?detected.origin,
        configmap = format!("{cm_ns}/{}", cm.name), "cluster mode"
    );
    let root_path = kubepods_root(args.cgroup_root.as_deref())?;
    let root = GatedRoot::open(&root_path)?;
    let cgroups = PodCgroups::new(&root.path);
    tracing::info!(cgroup_root = %root.path.display(), driver = ?cgroups.driver, scope = args.scope.as_str(), "gated root");

    let (denied_tx, denied) = mpsc::unbounded_channel();
    let (steer_tx, steer) = mpsc::unbounded_channel();
    let inputs = Inputs {
        configmap: watches::configmap(&client, &cm_ns, &cm.name),
        pods: watches::pods(&client, &node),
        infrastructure: infrastructure_objects(&client, detected.origin),
        client: client.clone(),
        denied,
        tick: tokio::time::interval(cfg.rescan),
        term: signal(SignalKind::terminate())?,
        int: signal(SignalKind::interrupt())?,
        steer,
        running: false,
    };
    let live = Live {
        cfg,
        events: Publisher::new(client.clone(), &node),
        client,
        node,
        root_path,
        root: Some(root),
        denied: denied_tx,
        steer: steer_tx,
    };
    let setup = Setup {
        namespace: args.namespace.clone(),
        platform: detected,
        policy_configmap: args.policy_configmap.clone(),
        cgroups,
        scope: args.scope,
    };
    Control::new(live, setup).drive(inputs.into_stream()).await
}
