//! `gate-agent run` without `--policy`: the DaemonSet mode.
//!
//! 1. Platform: `--platform`, else OpenShift's Infrastructure object, else the node's
//!    providerID ([`super::platform`]). The Infrastructure object is watched.
//! 2. Policy: the ConfigMap `<namespace>/metadata-gate-policy-<platform>` (key `policy.yaml`),
//!    watched and hot-reloaded through the same validate → compile → swap path as files. A bad
//!    one is refused (log, metric, Kubernetes Event on the ConfigMap); the last good stays.
//! 3. Allow set: the pods on this node (field selector `spec.nodeName`), mapped to their
//!    cgroups ([`super::identity`]). A pod that is allowed is allowed from the moment it is
//!    seen (its pod-level cgroup), a deleted pod is removed.
//!
//! Everything the loop reacts to arrives as one [`Input`]. The engine starts once a good
//! policy and the first full pod list are in, so an allowed component is never refused for
//! want of a list. Until then a gate pinned by an earlier agent keeps enforcing what it
//! enforced.
use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
};

use anyhow::{Result, bail};
use futures::{StreamExt as _, stream::BoxStream};
use gate_common::{
    abi::{GRANTS_ALL, allow_value},
    user::AllowSet,
};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::{
    api::DynamicObject,
    runtime::{reflector::ObjectRef, watcher::Event},
};
use tokio::{
    signal::unix::{Signal, SignalKind, signal},
    sync::mpsc,
    time::Interval,
};

use super::{
    identity::{ContainerInfo, PodCgroups, PodIndex, PodInfo, Scope, UNGATED_ENTRY},
    kevents::{self, Publisher},
    platform::{self, Detected, Origin},
    watches,
};
use crate::{
    access::Identity,
    cgroup::{GatedRoot, cgroup2_mount},
    config::{AgentConfig, ClusterConfig},
    engine::{AllowSource, Engine, GateOps, Offer},
    events::{CgroupNames, Denied, Namer},
    policy::Policy,
};

/// The key of the policy in its ConfigMap.
pub(crate) const POLICY_KEY: &str = "policy.yaml";

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

/// Cluster allow set: the cgroups of the indexed pods that the policy selects (and, with
/// `host-network-only`, every pod-network pod), those that exist.
struct PodAllow {
    index: Arc<RwLock<PodIndex>>,
    cgroups: PodCgroups,
    scope: Scope,
}

impl AllowSource for PodAllow {
    fn allow_set(&self, policy: &Policy) -> AllowSet {
        let Ok(index) = self.index.read() else { return AllowSet::new() };
        index
            .desired_allow_set(policy, self.cgroups.driver, self.scope)
            .into_iter()
            .filter_map(|(rel, entry)| {
                let path = self.cgroups.root.join(self.cgroups.localize(rel));
                std::fs::metadata(path).ok().map(|m| (m.ino(), value(policy, entry)))
            })
            .collect()
    }
}

/// The ALLOWED value of an entry index: a pod the scope leaves ungated has every grant.
fn value(policy: &Policy, entry: u32) -> u32 {
    if entry == UNGATED_ENTRY {
        allow_value(UNGATED_ENTRY, GRANTS_ALL)
    } else {
        policy.allow_value(entry as usize)
    }
}

/// Who a pod's cgroup belongs to, for logs, metrics and `report`.
fn identity(pod: &PodInfo, container: Option<&ContainerInfo>) -> Identity {
    Identity {
        workload: match container {
            Some(c) => format!("{}/{}/{}", pod.namespace, pod.name, c.name),
            None => format!("{}/{}", pod.namespace, pod.name),
        },
        cgroup: None,
        namespace: Some(pod.namespace.clone()),
        pod: Some(pod.name.clone()),
        container: container.map(|c| c.name.clone()),
        owner: pod.owner.as_ref().map(|(kind, name)| format!("{kind}/{name}")),
        service_account: Some(pod.service_account.clone()),
        host_network: Some(pod.host_network),
        labels: pod.labels.clone(),
        pod_uid: Some(pod.uid.clone()),
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

/// One thing the loop reacts to.
enum Input {
    /// SIGTERM or SIGINT.
    Stop,
    Policy(Box<Event<ConfigMap>>),
    Pods(Box<Event<Pod>>),
    Infrastructure(Box<Event<DynamicObject>>),
    /// A denial that was logged: a Kubernetes Event on its pod.
    Denied(Box<Denied>),
    /// Time to re-resolve the allow set and interfaces.
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
            Input::Denied(_) => "denied",
            Input::Tick => "tick",
            Input::Ended(_) => "ended",
        }
    }
}

/// The sources of [`Input`].
struct Inputs {
    configmap: BoxStream<'static, Event<ConfigMap>>,
    pods: BoxStream<'static, Event<Pod>>,
    infrastructure: BoxStream<'static, Event<DynamicObject>>,
    denied: mpsc::UnboundedReceiver<Denied>,
    tick: Interval,
    term: Signal,
    int: Signal,
}

impl Inputs {
    /// The next input; denials and ticks only once the engine runs.
    async fn next(&mut self, running: bool) -> Input {
        tokio::select! {
            _ = self.term.recv() => Input::Stop,
            _ = self.int.recv() => Input::Stop,
            ev = self.configmap.next() => ev.map_or(Input::Ended("policy configmap"), |e| Input::Policy(Box::new(e))),
            ev = self.pods.next() => ev.map_or(Input::Ended("pods"), |e| Input::Pods(Box::new(e))),
            ev = self.infrastructure.next() => match ev {
                Some(ev) => Input::Infrastructure(Box::new(ev)),
                None => {
                    self.infrastructure = futures::stream::pending().boxed();
                    Input::Tick
                }
            },
            Some(d) = self.denied.recv(), if running => Input::Denied(Box::new(d)),
            _ = self.tick.tick(), if running => Input::Tick,
        }
    }
}

/// Everything the loop keeps between inputs.
struct State {
    client: kube::Client,
    namespace: String,
    platform: Detected,
    cm_ns: String,
    cm_name: String,
    /// Whether the ConfigMap name follows the platform (no --policy-configmap).
    cm_follows_platform: bool,
    index: Arc<RwLock<PodIndex>>,
    /// Pods listed during a (re)list, swapped in at InitDone.
    relist: Option<Vec<PodInfo>>,
    pods_listed: bool,
    cgroups: PodCgroups,
    events: Publisher,
}

impl State {
    fn configmap_ref(&self) -> ObjectRef<ConfigMap> {
        ObjectRef::new(&self.cm_name).within(&self.cm_ns)
    }

    fn source(&self) -> String {
        format!("configmap {}/{}", self.cm_ns, self.cm_name)
    }

    async fn rejected(&mut self, why: &str) {
        let note = format!("metadata-gate refused this policy, the last good one stays: {why}");
        let object = self.configmap_ref().into();
        self.events.publish(object, true, kevents::REJECTED_REASON, note).await;
    }

    /// A pod event; returns whether the pod set changed.
    fn on_pod(&mut self, ev: Event<Pod>) -> bool {
        let parse = |pod: &Pod| match PodInfo::from_pod(pod) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(error = %e, "ignoring a pod the agent cannot map to cgroups");
                None
            }
        };
        match ev {
            Event::Init => {
                self.relist = Some(Vec::new());
                false
            }
            Event::InitApply(pod) => {
                if let (Some(list), Some(p)) = (self.relist.as_mut(), parse(&pod)) {
                    list.push(p);
                }
                false
            }
            Event::InitDone => {
                let pods = self.relist.take().unwrap_or_default();
                let n = pods.len();
                if let Ok(mut idx) = self.index.write() {
                    idx.replace_all(pods);
                }
                if !self.pods_listed {
                    tracing::info!(pods = n, "pods on this node listed");
                }
                self.pods_listed = true;
                true
            }
            Event::Apply(pod) => match (parse(&pod), self.index.write()) {
                (Some(p), Ok(mut idx)) => {
                    idx.insert(p);
                    true
                }
                _ => false,
            },
            Event::Delete(pod) => match (pod.metadata.uid.as_deref(), self.index.write()) {
                (Some(uid), Ok(mut idx)) => idx.remove(uid).is_some(),
                _ => false,
            },
        }
    }

    /// The Infrastructure object changed: follow a new platform's policy ConfigMap.
    fn on_infrastructure(&mut self, ev: Event<DynamicObject>, inputs: &mut Inputs) {
        let (Event::Apply(obj) | Event::InitApply(obj)) = ev else { return };
        let value = serde_json::to_value(&obj).unwrap_or_default();
        match platform::from_infrastructure(&value) {
            Ok(p) if p != self.platform.platform => {
                tracing::warn!(from = %self.platform.platform, to = %p, "the Infrastructure object names another platform");
                self.platform = Detected { platform: p, origin: Origin::Infrastructure };
                if self.cm_follows_platform {
                    self.cm_ns = self.namespace.clone();
                    self.cm_name = self.platform.configmap_name();
                    tracing::info!(configmap = %self.source(), "following the platform's policy ConfigMap");
                    inputs.configmap = watches::configmap(&self.client, &self.cm_ns, &self.cm_name);
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "reading the Infrastructure object"),
        }
    }

    /// A Kubernetes Event on the pod of a logged denial (named once, when it was logged).
    async fn on_denied(&mut self, d: Denied) {
        let Some(object) = pod_ref(&d.workload) else { return };
        let note = denial_note(&d, d.workload.container.as_deref());
        self.events.publish(object.into(), true, kevents::BLOCKED_REASON, note).await;
    }
}

/// The pod a workload runs in, if it is one.
fn pod_ref(w: &Identity) -> Option<ObjectRef<Pod>> {
    let (Some(namespace), Some(name)) = (w.namespace.as_deref(), w.pod.as_deref()) else {
        return None;
    };
    let mut pod = ObjectRef::new(name).within(namespace);
    pod.extra.uid.clone_from(&w.pod_uid);
    Some(pod)
}

/// The note of a denial's Event: the kernel's (who, to where), or the metadata proxy's (which
/// request, and why).
fn denial_note(d: &Denied, container: Option<&str>) -> String {
    let who = container.map(|c| format!("container {c}: ")).unwrap_or_default();
    let (dst, port) = (d.event.dst_text(), d.event.port);
    match &d.request {
        Some((request, why)) => format!(
            "{who}{request} to {dst}:{port} refused by the metadata proxy: {why}; only the \
             listed paths are served"
        ),
        None => format!(
            "{who}{} to {dst}:{port}/{} ({}) refused: cloud instance metadata is not for \
             workloads",
            d.event.comm(),
            d.event.proto_name(),
            d.endpoint,
        ),
    }
}

/// A policy ConfigMap's text: before the engine runs, a good policy waits for the pod list
/// (the newest good one wins, a bad one leaves it waiting); once the engine runs, it is
/// offered. Returns why it was refused, for the Event on the ConfigMap.
async fn on_policy<G: GateOps>(
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
                    engine.refuse(source, "configmap changed", &why);
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

/// Wait for the first good policy and the first full pod list, then start the engine and
/// keep policy, pods and platform current.
pub(crate) async fn run(cfg: &AgentConfig, args: &ClusterConfig) -> Result<()> {
    let node = args.node_name.clone();
    let client = watches::client(args.kubeconfig.as_deref()).await?;
    let detected = platform::detect(&client, &node, args.platform.as_deref()).await?;
    let (cm_ns, cm_name, cm_follows_platform) = match &args.policy_configmap {
        Some((ns, name)) => (ns.clone(), name.clone(), false),
        None => (args.namespace.clone(), detected.configmap_name(), true),
    };
    tracing::info!(
        node, platform = %detected.platform, from = ?detected.origin,
        configmap = format!("{cm_ns}/{cm_name}"), "cluster mode"
    );
    let root_path = kubepods_root(args.cgroup_root.as_deref())?;
    let root = GatedRoot::open(&root_path)?;
    let cgroups = PodCgroups::new(&root.path);
    tracing::info!(cgroup_root = %root.path.display(), driver = ?cgroups.driver, scope = args.scope.as_str(), "gated root");

    let (denied_tx, denied) = mpsc::unbounded_channel();
    let mut inputs = Inputs {
        configmap: watches::configmap(&client, &cm_ns, &cm_name),
        pods: watches::pods(&client, &node),
        infrastructure: watches::infrastructure(&client, detected.origin),
        denied,
        tick: tokio::time::interval(cfg.rescan),
        term: signal(SignalKind::terminate())?,
        int: signal(SignalKind::interrupt())?,
    };
    let mut st = State {
        events: Publisher::new(client.clone(), &node),
        client,
        namespace: args.namespace.clone(),
        platform: detected,
        cm_ns,
        cm_name,
        cm_follows_platform,
        index: Arc::new(RwLock::new(PodIndex::new())),
        relist: None,
        pods_listed: false,
        cgroups,
    };

    let mut engine: Option<Engine> = None;
    // Before the engine runs: the first good policy, waiting for the pod list.
    let mut pending: Option<Policy> = None;
    let mut root = Some(root);
    loop {
        // Both taken only once both are there (a `take` in a failed match would lose them).
        if engine.is_none()
            && st.pods_listed
            && pending.is_some()
            && let (Some(policy), Some(root)) = (pending.take(), root.take())
        {
            let allow = Box::new(PodAllow {
                index: st.index.clone(),
                cgroups: st.cgroups.clone(),
                scope: args.scope,
            });
            let (idx, cgroups) = (st.index.clone(), st.cgroups.clone());
            let namer: Namer = Arc::new(move |rel: &Path| {
                let idx = idx.read().ok()?;
                let (pod, container) = idx.owner(&cgroups.canonical(rel))?;
                Some(identity(pod, container))
            });
            let names = CgroupNames::with_namer(GatedRoot::open(&root_path)?, namer);
            engine = Some(
                Engine::start(cfg, policy, root, allow, names, Some(denied_tx.clone())).await?,
            );
            // The gate is closed on this node: it may take any pod now.
            tokio::spawn(super::taint::remove_not_ready(st.client.clone(), node.clone()));
        }
        let input = inputs.next(engine.is_some()).await;
        tracing::debug!(input = input.name(), "input");
        match input {
            Input::Stop => break,
            Input::Ended(what) => bail!("the {what} watch ended"),
            Input::Policy(ev) => match *ev {
                Event::Apply(cm) | Event::InitApply(cm) => {
                    let source = st.source();
                    let text = policy_text(&cm);
                    if let Some(why) = on_policy(engine.as_mut(), &mut pending, &source, text).await
                    {
                        st.rejected(&why).await;
                    }
                }
                Event::Delete(_) => {
                    tracing::warn!(configmap = %st.source(), "policy ConfigMap deleted; the last good policy stays in force")
                }
                _ => {}
            },
            Input::Pods(ev) => {
                if st.on_pod(*ev)
                    && let Some(engine) = &mut engine
                {
                    engine.sync().await;
                }
            }
            Input::Infrastructure(ev) => st.on_infrastructure(*ev, &mut inputs),
            Input::Denied(d) => st.on_denied(*d).await,
            Input::Tick => {
                if let Some(engine) = &mut engine {
                    engine.sync().await;
                }
            }
        }
    }
    if let Some(engine) = &engine {
        engine.stop();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        engine::fake::{Fake, GOOD, INVALID, OTHER, Rig, policy},
        loader::Start,
    };

    #[test]
    fn policy_text_needs_the_key() {
        let cm = ConfigMap::default();
        assert_eq!(policy_text(&cm).unwrap_err(), "data.policy.yaml: missing");
    }

    const CM: &str = "configmap ns/metadata-gate-policy-aws";

    /// No engine yet.
    fn idle() -> Option<&'static mut Engine<Fake>> {
        None
    }

    #[tokio::test]
    async fn before_start_a_good_policy_waits_and_a_bad_one_is_refused() {
        let mut pending = None;
        let why = on_policy(idle(), &mut pending, CM, Ok(INVALID.into())).await;
        assert!(why.is_some_and(|w| w.contains("cidr")));
        assert!(pending.is_none(), "nothing to start with");
        assert!(on_policy(idle(), &mut pending, CM, Ok(GOOD.into())).await.is_none());
        assert_eq!(pending.as_ref().map(Policy::hash), Some(policy(GOOD).hash()));
        // A bad one later leaves the good one waiting; a missing key is refused too.
        for text in [Ok(INVALID.into()), Err("data.policy.yaml: missing".to_owned())] {
            assert!(on_policy(idle(), &mut pending, CM, text).await.is_some());
            assert_eq!(pending.as_ref().map(Policy::hash), Some(policy(GOOD).hash()));
        }
        // The newest good one wins.
        assert!(on_policy(idle(), &mut pending, CM, Ok(OTHER.into())).await.is_none());
        assert_eq!(pending.as_ref().map(Policy::hash), Some(policy(OTHER).hash()));
    }

    #[tokio::test]
    async fn after_start_a_policy_is_offered_and_a_bad_one_refused() {
        let mut rig = Rig::start(Start::Fresh, GOOD);
        let mut pending = None;
        let got = on_policy(Some(&mut rig.engine), &mut pending, CM, Ok(OTHER.into())).await;
        assert!(got.is_none());
        assert_eq!(rig.enforced(), policy(OTHER).hash());
        let got = on_policy(Some(&mut rig.engine), &mut pending, CM, Ok(INVALID.into())).await;
        assert!(got.is_some_and(|w| w.contains("cidr")));
        assert_eq!(rig.enforced(), policy(OTHER).hash());
        // The live policy again clears the refusal; a ConfigMap without the key is refused.
        assert!(
            on_policy(Some(&mut rig.engine), &mut pending, CM, Ok(OTHER.into())).await.is_none()
        );
        assert_eq!(rig.rejected(), 0);
        let missing = Err("data.policy.yaml: missing".to_owned());
        let got = on_policy(Some(&mut rig.engine), &mut pending, CM, missing).await;
        assert_eq!(got.as_deref(), Some("data.policy.yaml: missing"));
        assert_eq!((rig.rejected(), rig.enforced()), (1, policy(OTHER).hash()));
        assert!(pending.is_none(), "a running engine takes the policy itself");
    }
}

#[cfg(test)]
mod notes {
    use gate_common::abi::{DenyEvent, PROTO_TCP};

    use super::{Denied, denial_note};

    fn denied(request: Option<(String, String)>) -> Denied {
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(&[169, 254, 169, 254]);
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(b"curl");
        let event = DenyEvent {
            cgroup_id: 1,
            ts_ns: 0,
            addr,
            pid: 0,
            endpoint: 0,
            port: 80,
            proto: PROTO_TCP,
            family: 4,
            verdict: 2,
            hook: 0,
            _pad: [0; 2],
            comm,
        };
        Denied { workload: Default::default(), event, endpoint: "ec2-imds".into(), request }
    }

    #[test]
    fn an_event_says_which_request_the_proxy_refused() {
        let kernel = denial_note(&denied(None), Some("app"));
        assert_eq!(
            kernel,
            "container app: curl to 169.254.169.254:80/TCP (ec2-imds) refused: cloud instance \
             metadata is not for workloads"
        );
        let request =
            ("GET /latest/meta-data/iam/info".into(), "path not allowed (entry csi)".into());
        let proxy = denial_note(&denied(Some(request)), None);
        assert_eq!(
            proxy,
            "GET /latest/meta-data/iam/info to 169.254.169.254:80 refused by the metadata proxy: \
             path not allowed (entry csi); only the listed paths are served"
        );
    }
}

#[cfg(test)]
mod refs {
    use k8s_openapi::api::core::v1::ObjectReference;

    use super::*;

    #[test]
    fn a_denial_names_its_pod_by_uid_and_nothing_else_is_a_pod() {
        let w = Identity {
            workload: "ns/p/c".into(),
            namespace: Some("ns".into()),
            pod: Some("p".into()),
            container: Some("c".into()),
            pod_uid: Some("u-1".into()),
            ..Identity::default()
        };
        let object: ObjectReference = pod_ref(&w).map(Into::into).unwrap();
        let want = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some("ns".into()),
            name: Some("p".into()),
            uid: Some("u-1".into()),
            ..Default::default()
        };
        assert_eq!(object, want);
        assert!(pod_ref(&Identity::cgroup("system.slice/x")).is_none());
    }
}
