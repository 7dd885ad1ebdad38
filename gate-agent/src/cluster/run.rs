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
//! The engine starts once a good policy and the first full pod list are in, so an allowed
//! component is never refused for want of a list. Until then a gate pinned by an earlier
//! agent keeps enforcing what it enforced.
use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use futures::{Stream, StreamExt as _, stream::BoxStream};
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, Pod};
use kube::{
    Api, Client,
    api::DynamicObject,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::watcher::{self, Event},
};
use tokio::signal::unix::{SignalKind, signal};

use super::{
    identity::{PodCgroups, PodIndex, PodInfo, Scope},
    kevents::{self, Publisher},
    platform::{self, Detected, Origin},
};
use crate::{
    cgroup::{GatedRoot, cgroup2_mount},
    cli::RunArgs,
    engine::{Engine, Offer},
    events::{CgroupNames, Denied, Namer},
    policy::Policy,
};

/// The key of the policy in its ConfigMap.
pub const POLICY_KEY: &str = "policy.yaml";

pub async fn client(kubeconfig: Option<&Path>) -> Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no in-cluster config and no kubeconfig")?,
    };
    Client::try_from(config).context("building the Kubernetes client")
}

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

/// The allow set of `policy` over the indexed pods: cgroup ids of the cgroups that exist.
fn allow_set(
    cgroups: &PodCgroups,
    scope: Scope,
    index: &PodIndex,
    policy: &Policy,
) -> Vec<(u64, u32)> {
    index
        .desired_allow_set(policy, cgroups.driver, scope)
        .into_iter()
        .filter_map(|(rel, entry)| {
            let path = cgroups.root.join(cgroups.localize(rel));
            std::fs::metadata(path).ok().map(|m| (m.ino(), entry))
        })
        .collect()
}

/// A ConfigMap's policy text, or why there is none.
fn policy_text(cm: &ConfigMap) -> Result<String, String> {
    cm.data
        .as_ref()
        .and_then(|d| d.get(POLICY_KEY))
        .cloned()
        .ok_or_else(|| format!("data.{POLICY_KEY}: missing"))
}

fn configmap_stream(
    client: &Client,
    ns: &str,
    name: &str,
) -> BoxStream<'static, watcher::Result<Event<ConfigMap>>> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    watcher::watcher(api, watcher::Config::default().fields(&format!("metadata.name={name}")))
        .boxed()
}

fn infrastructure_stream(
    client: &Client,
    origin: Origin,
) -> BoxStream<'static, watcher::Result<Event<DynamicObject>>> {
    if origin != Origin::Infrastructure {
        return futures::stream::pending().boxed();
    }
    let api: Api<DynamicObject> =
        Api::all_with(client.clone(), &platform::infrastructure_resource());
    watcher::watcher(api, watcher::Config::default().fields("metadata.name=cluster")).boxed()
}

fn pod_stream(
    client: &Client,
    node: &str,
) -> impl Stream<Item = watcher::Result<Event<Pod>>> + use<> {
    let api: Api<Pod> = Api::all(client.clone());
    watcher::watcher(api, watcher::Config::default().fields(&format!("spec.nodeName={node}")))
}

/// Everything the loop keeps between events.
struct State {
    client: Client,
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
    fn configmap_ref(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("ConfigMap".into()),
            namespace: Some(self.cm_ns.clone()),
            name: Some(self.cm_name.clone()),
            ..Default::default()
        }
    }

    fn source(&self) -> String {
        format!("configmap {}/{}", self.cm_ns, self.cm_name)
    }

    async fn rejected(&mut self, why: &str) {
        let note = format!("metadata-gate refused this policy, the last good one stays: {why}");
        let object = self.configmap_ref();
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

    /// A Kubernetes Event on the pod of a logged denial.
    async fn on_denied(&mut self, d: Denied) {
        let Some(rel) = d.cgroup.as_deref() else { return };
        let canonical = self.cgroups.canonical(rel);
        let (object, container) = {
            let Ok(idx) = self.index.read() else { return };
            let Some((pod, container)) = idx.owner(&canonical) else { return };
            (
                ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    namespace: Some(pod.namespace.clone()),
                    name: Some(pod.name.clone()),
                    uid: Some(pod.uid.clone()),
                    ..Default::default()
                },
                container.map(|c| c.name.clone()),
            )
        };
        let dst = crate::events::dst_addr(&d.event);
        let note = format!(
            "{}{} to {dst}:{}/{} ({}) refused: cloud instance metadata is not for workloads",
            container.map(|c| format!("container {c}: ")).unwrap_or_default(),
            crate::events::comm(&d.event),
            d.event.port,
            crate::events::proto_name(d.event.proto),
            d.endpoint,
        );
        self.events.publish(object, true, kevents::BLOCKED_REASON, note).await;
    }
}

/// Wait for the first good policy and the first full pod list, then start the engine.
pub async fn run(args: RunArgs) -> Result<()> {
    let node = args.node_name.clone().context("cluster mode needs --node-name (or NODE_NAME)")?;
    let client = client(args.kubeconfig.as_deref()).await?;
    let detected = platform::detect(&client, &node, args.platform.as_deref()).await?;
    let (cm_ns, cm_name, cm_follows_platform) = match &args.policy_configmap {
        Some(s) => {
            let (ns, name) = s
                .split_once('/')
                .filter(|(n, m)| !n.is_empty() && !m.is_empty())
                .with_context(|| format!("--policy-configmap {s:?}: expected NAMESPACE/NAME"))?;
            (ns.to_owned(), name.to_owned(), false)
        }
        None => (args.namespace.clone(), detected.configmap_name(), true),
    };
    tracing::info!(
        node, platform = %detected.platform, from = ?detected.origin,
        configmap = format!("{cm_ns}/{cm_name}"), "cluster mode"
    );
    let root_path = kubepods_root(args.cgroup_root.as_deref())?;
    let root = GatedRoot::open(&root_path)?;
    let cgroups = PodCgroups::new(&root.path);
    let scope = args.gate_scope;
    tracing::info!(cgroup_root = %root.path.display(), driver = ?cgroups.driver, scope = scope.as_str(), "gated root");

    let mut st = State {
        events: Publisher::new(client.clone(), &node),
        client: client.clone(),
        namespace: args.namespace.clone(),
        platform: detected.clone(),
        cm_ns,
        cm_name,
        cm_follows_platform,
        index: Arc::new(RwLock::new(PodIndex::new())),
        relist: None,
        pods_listed: false,
        cgroups,
    };
    let mut cms = configmap_stream(&client, &st.cm_ns, &st.cm_name);
    let mut infra = infrastructure_stream(&client, detected.origin);
    let mut pods = pod_stream(&client, &node).boxed();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;

    // Phase 1: a good policy and the pods.
    let mut policy: Option<Policy> = None;
    loop {
        if let (Some(_), true) = (&policy, st.pods_listed) {
            break;
        }
        tokio::select! {
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
            ev = cms.next() => match ev {
                Some(Ok(Event::Apply(cm) | Event::InitApply(cm))) => {
                    let parsed = policy_text(&cm).and_then(|t| Policy::parse(&st.source(), &t).map_err(|e| e.to_string()));
                    match parsed {
                        Ok(p) => policy = Some(p),
                        Err(why) => {
                            tracing::error!(configmap = %st.source(), error = %why, "policy rejected; waiting for a good one");
                            st.rejected(&why).await;
                        }
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => tracing::warn!(error = %e, configmap = %st.source(), "watching the policy ConfigMap (retrying)"),
                None => bail!("the ConfigMap watch ended"),
            },
            ev = pods.next() => match ev {
                Some(Ok(ev)) => { st.on_pod(ev); }
                Some(Err(e)) => tracing::warn!(error = %e, "watching pods (retrying)"),
                None => bail!("the pod watch ended"),
            },
        }
    }
    let Some(policy) = policy else { bail!("no policy") };

    let idx = st.index.clone();
    let cgroups = st.cgroups.clone();
    let allow = move |p: &Policy| -> Vec<(u64, u32)> {
        idx.read().map(|i| allow_set(&cgroups, scope, &i, p)).unwrap_or_default()
    };
    let idx = st.index.clone();
    let cgroups = st.cgroups.clone();
    let namer: Namer =
        Arc::new(move |rel: &Path| idx.read().ok()?.owner_name(&cgroups.canonical(rel)));
    let names = CgroupNames::with_namer(GatedRoot::open(&root_path)?, namer);
    let (tx, mut denied) = tokio::sync::mpsc::unbounded_channel();
    let mut engine = Engine::start(&args, policy, root, &allow, names, Some(tx)).await?;

    // Phase 2: keep policy, pods and platform current.
    let mut tick = tokio::time::interval(Duration::from_millis(args.rescan_ms.max(50)));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            ev = cms.next() => match ev {
                Some(Ok(Event::Apply(cm) | Event::InitApply(cm))) => {
                    let source = st.source();
                    let offer = match policy_text(&cm) {
                        Ok(text) => engine.offer(&source, &text, "configmap changed", &allow).await,
                        Err(why) => {
                            tracing::error!(configmap = %source, error = %why, "policy rejected; the last good policy stays in force");
                            engine.metrics.reload("failure");
                            Offer::Rejected(why)
                        }
                    };
                    if let Offer::Rejected(why) = offer {
                        st.rejected(&why).await;
                    }
                }
                Some(Ok(Event::Delete(_))) => tracing::warn!(configmap = %st.source(), "policy ConfigMap deleted; the last good policy stays in force"),
                Some(Ok(_)) => {}
                Some(Err(e)) => tracing::warn!(error = %e, configmap = %st.source(), "watching the policy ConfigMap (retrying)"),
                None => bail!("the ConfigMap watch ended"),
            },
            ev = pods.next() => match ev {
                Some(Ok(ev)) => if st.on_pod(ev) { engine.sync(&allow) },
                Some(Err(e)) => tracing::warn!(error = %e, "watching pods (retrying)"),
                None => bail!("the pod watch ended"),
            },
            ev = infra.next() => match ev {
                Some(Ok(Event::Apply(obj) | Event::InitApply(obj))) => {
                    let value = serde_json::to_value(&obj).unwrap_or_default();
                    match platform::from_infrastructure(&value) {
                        Ok(p) if p != st.platform.platform => {
                            tracing::warn!(from = %st.platform.platform, to = %p, "the Infrastructure object names another platform");
                            st.platform = Detected { platform: p, origin: Origin::Infrastructure };
                            if st.cm_follows_platform {
                                st.cm_ns = st.namespace.clone();
                                st.cm_name = st.platform.configmap_name();
                                tracing::info!(configmap = %st.source(), "following the platform's policy ConfigMap");
                                cms = configmap_stream(&st.client, &st.cm_ns, &st.cm_name);
                            }
                        }
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "reading the Infrastructure object"),
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => tracing::warn!(error = %e, "watching the Infrastructure object (retrying)"),
                None => infra = futures::stream::pending().boxed(),
            },
            Some(d) = denied.recv() => st.on_denied(d).await,
            _ = tick.tick() => engine.sync(&allow),
        }
    }
    engine.stop();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_text_needs_the_key() {
        let cm = ConfigMap::default();
        assert_eq!(policy_text(&cm).unwrap_err(), "data.policy.yaml: missing");
    }
}
