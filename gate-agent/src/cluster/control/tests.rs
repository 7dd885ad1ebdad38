//! Which policy is in force in cluster mode, decided over a scripted stream of inputs with a
//! fake gate and a fake cluster: start, offers, rejections before and after start, platform
//! changes, the allow set following the pods, repair triggers, and denials' Events.
use std::sync::{Arc, Mutex};

use futures::stream;
use gate_common::user::PolicyHash;
use k8s_openapi::api::core::v1::ConfigMap;
use serde_json::json;

use super::*;
use crate::{
    access::Identity,
    cgroup::CgroupError,
    cluster::pods::fixtures::{Tree, pod},
    engine::fake::{self, Fake, FakeState, GCP, GOOD, INVALID, OTHER, ids, policy},
    loader::{Repair, Start},
};

const NS: &str = "metadata-gate";
const AWS_CM: &str = "metadata-gate-policy-aws";
const GCP_CM: &str = "metadata-gate-policy-gcp";
/// GOOD with an allow entry for the pods of namespace `mon`.
const MON: &str = "platform: AWS\nendpoints:\n  - {name: imds, cidr: 169.254.169.254/32}\nallow:\n  - {name: mon, namespace: mon}\n";

/// What the loop asked of the cluster.
#[derive(Default)]
struct Seen {
    /// The policy of each engine start.
    started: Vec<PolicyHash>,
    /// The fake gate of the engine started.
    gate: Option<Arc<Mutex<FakeState>>>,
    /// How often the gate was reported closed (the taint removed).
    closed: usize,
    followed: Vec<String>,
    /// (object, reason, note) of each Event.
    published: Vec<(ObjectReference, String, String)>,
}

#[derive(Clone, Default)]
struct World(Arc<Mutex<Seen>>);

impl ClusterOps for World {
    type Gate = Fake;

    async fn start(
        &mut self,
        policy: Policy,
        allow: Box<dyn AllowSource>,
        _namer: Namer,
    ) -> Result<Engine<Fake>> {
        let mut s = self.0.lock().unwrap();
        s.started.push(policy.hash());
        let (engine, gate) = fake::started(
            fake::Fake::new(Start::Fresh),
            policy,
            allow,
            Box::new(|_: &std::path::Path| Ok::<_, CgroupError>(fake::root(7))),
            None,
        );
        s.gate = Some(gate);
        Ok(engine)
    }

    fn gate_closed(&mut self) {
        self.0.lock().unwrap().closed += 1;
    }

    fn follow(&mut self, configmap: &ObjectRef<ConfigMap>) {
        let ns = configmap.namespace.clone().unwrap_or_default();
        self.0.lock().unwrap().followed.push(format!("{ns}/{}", configmap.name));
    }

    async fn publish(
        &mut self,
        object: ObjectReference,
        warning: bool,
        reason: kevents::Reason,
        note: String,
    ) {
        assert!(warning, "every Event of the agent is a warning");
        self.0.lock().unwrap().published.push((object, reason.name().to_owned(), note));
    }
}

/// The loop on a fresh node of an AWS cluster (the platform from the Infrastructure object).
struct T {
    control: Control<World>,
    world: World,
    tree: Tree,
}

impl T {
    fn new() -> T {
        T::with(None)
    }

    fn with(policy_configmap: Option<(String, String)>) -> T {
        let tree = Tree::new();
        let world = World::default();
        let setup = Setup {
            namespace: NS.into(),
            platform: Detected { platform: "AWS".into(), origin: Origin::Infrastructure },
            policy_configmap,
            cgroups: tree.cgroups(),
            scope: Scope::AllPods,
        };
        T { control: Control::new(world.clone(), setup), world, tree }
    }

    async fn feed(&mut self, inputs: Vec<Input>) {
        self.control.drive(stream::iter(inputs)).await.expect("the loop goes on");
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.world.0.lock().unwrap()
    }

    /// The policy in force: the engine's, and what the fake gate enforces.
    fn enforced(&self) -> Option<PolicyHash> {
        let engine = self.control.engine()?;
        let on_gate = PolicyHash(engine.gate.lock().unwrap().info.policy_hash);
        assert_eq!(engine.policy.hash(), on_gate, "the engine and the gate agree");
        Some(on_gate)
    }

    fn gate(&self) -> Arc<Mutex<FakeState>> {
        self.seen().gate.clone().expect("the engine started")
    }

    /// How often the gate was checked and repaired.
    fn repairs(&self) -> usize {
        self.gate().lock().unwrap().calls.iter().filter(|c| **c == "repair").count()
    }

    /// The allow set last installed or synced.
    fn allowed(&self) -> Vec<u64> {
        let g = self.gate();
        let g = g.lock().unwrap();
        let last = g.allow_synced.last().or(g.installed.last().map(|i| &i.allow));
        let mut ids = last.map(ids).unwrap_or_default();
        ids.sort_unstable();
        ids
    }

    fn events(&self) -> Vec<(ObjectReference, String, String)> {
        self.seen().published.clone()
    }

    fn rejected(&self) -> i64 {
        self.control.engine().unwrap().metrics.policy_rejected.get()
    }
}

fn configmap(name: &str, text: Option<&str>) -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some(name.into());
    cm.metadata.namespace = Some(NS.into());
    cm.data = text.map(|t| [(POLICY_KEY.to_owned(), t.to_owned())].into());
    cm
}

/// The policy ConfigMap `name` applied with `text` (no text: without the key).
fn cm(name: &str, text: Option<&str>) -> Input {
    Input::Policy(Box::new(Event::Apply(configmap(name, text))))
}

fn aws(text: &str) -> Input {
    cm(AWS_CM, Some(text))
}

/// A full list of the node's pods.
fn listed(pods: &[Pod]) -> Vec<Input> {
    let mut out = vec![Input::Pods(Box::new(Event::Init))];
    out.extend(pods.iter().map(|p| Input::Pods(Box::new(Event::InitApply(p.clone())))));
    out.push(Input::Pods(Box::new(Event::InitDone)));
    out
}

fn applied(p: Pod) -> Input {
    Input::Pods(Box::new(Event::Apply(p)))
}

fn deleted(p: Pod) -> Input {
    Input::Pods(Box::new(Event::Delete(p)))
}

fn infrastructure(platform: &str) -> Input {
    Input::Infrastructure(Box::new(json!({"status": {"platformStatus": {"type": platform}}})))
}

fn denied(workload: Identity) -> Input {
    let mut b = kevents::notes::denied();
    if let crate::events::Block::Denied { endpoint, .. } = &mut b.how {
        *endpoint = "imds".into();
    }
    Input::Blocked(Box::new(crate::events::Blocked { workload, ..b }))
}

fn refused(workload: Identity) -> Input {
    Input::Blocked(Box::new(crate::events::Blocked { workload, ..kevents::notes::refused() }))
}

fn started(t: &T) -> Vec<PolicyHash> {
    t.seen().started.clone()
}

// ---- start ----------------------------------------------------------------------------------

#[tokio::test]
async fn the_engine_starts_once_a_good_policy_and_the_pod_list_are_in() {
    let mut t = T::new();
    let a = t.tree.add("a");
    t.tree.add("b");
    t.feed(vec![aws(MON), Input::Tick]).await;
    assert!(started(&t).is_empty(), "no pod list yet");
    let pods = [pod("a", "mon", "m", false), pod("b", "app", "w", false)];
    let mut list = listed(&pods);
    let done = list.pop().unwrap();
    t.feed(list).await;
    assert!(started(&t).is_empty(), "the list is not done");
    t.feed(vec![done]).await;
    assert_eq!(started(&t), [policy(MON).hash()]);
    assert_eq!(t.seen().closed, 1, "the taint goes once the gate is closed");
    assert_eq!(t.enforced(), Some(policy(MON).hash()));
    assert_eq!(t.allowed(), [a], "the pods listed are allowed from the start");
    // Later inputs do not start it again.
    t.feed(vec![aws(OTHER), Input::Tick]).await;
    assert_eq!((started(&t).len(), t.seen().closed), (1, 1));
}

#[tokio::test]
async fn with_the_pods_listed_first_the_policy_starts_the_engine() {
    let mut t = T::new();
    t.feed(listed(&[])).await;
    assert!(started(&t).is_empty(), "no policy yet");
    t.feed(vec![Input::Policy(Box::new(Event::InitApply(configmap(AWS_CM, Some(GOOD)))))]).await;
    assert_eq!(started(&t), [policy(GOOD).hash()]);
}

#[tokio::test]
async fn before_start_a_bad_policy_is_rejected_and_the_newest_good_one_starts() {
    let mut t = T::new();
    t.feed(vec![aws(INVALID), cm(AWS_CM, None)]).await;
    t.feed(listed(&[])).await;
    assert!(started(&t).is_empty(), "nothing good to start with");
    let events = t.events();
    assert_eq!(events.len(), 2, "{events:?}");
    for (object, reason, _) in &events {
        assert_eq!(object.kind.as_deref(), Some("ConfigMap"));
        assert_eq!((object.namespace.as_deref(), object.name.as_deref()), (Some(NS), Some(AWS_CM)));
        assert_eq!(reason, kevents::Reason::PolicyRejected.name());
    }
    assert!(events[0].2.contains("cidr"), "{}", events[0].2);
    assert!(events[1].2.ends_with("data.policy.yaml: missing"), "{}", events[1].2);
    // Before the list: a good one, then a bad one; the good one waits and starts.
    let mut t = T::new();
    t.feed(vec![aws(GOOD), aws(OTHER), aws(INVALID)]).await;
    t.feed(listed(&[])).await;
    assert_eq!(started(&t), [policy(OTHER).hash()], "the newest good one");
    assert_eq!(t.events().len(), 1);
}

// ---- after start ----------------------------------------------------------------------------

async fn running(text: &str) -> T {
    let mut t = T::new();
    t.feed(vec![aws(text)]).await;
    t.feed(listed(&[])).await;
    assert_eq!(t.enforced(), Some(policy(text).hash()));
    t
}

#[tokio::test]
async fn after_start_a_policy_is_offered_and_a_bad_one_rejected_the_last_good_kept() {
    let mut t = running(GOOD).await;
    t.feed(vec![aws(OTHER)]).await;
    assert_eq!(t.enforced(), Some(policy(OTHER).hash()));
    assert!(t.events().is_empty());
    t.feed(vec![aws(INVALID)]).await;
    assert_eq!(t.enforced(), Some(policy(OTHER).hash()), "the last good stays");
    assert_eq!(t.rejected(), 1);
    let events = t.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0.name.as_deref(), Some(AWS_CM));
    assert!(
        events[0].2.starts_with("metadata-gate rejected this policy, the last good one stays: ")
    );
    // Deleted: the last good stays, nothing is said on the (gone) ConfigMap.
    t.feed(vec![Input::Policy(Box::new(Event::Delete(configmap(AWS_CM, Some(OTHER)))))]).await;
    assert_eq!(t.enforced(), Some(policy(OTHER).hash()));
    // A ConfigMap without the key is rejected; a good one clears the rejection.
    t.feed(vec![cm(AWS_CM, None)]).await;
    assert_eq!((t.enforced(), t.events().len()), (Some(policy(OTHER).hash()), 2));
    t.feed(vec![aws(GOOD)]).await;
    assert_eq!((t.enforced(), t.rejected()), (Some(policy(GOOD).hash()), 0));
    assert_eq!(started(&t).len(), 1);
}

// ---- the platform ---------------------------------------------------------------------------

#[tokio::test]
async fn a_platform_change_takes_the_other_configmaps_policy() {
    let mut t = running(GOOD).await;
    t.feed(vec![infrastructure("AWS")]).await;
    assert!(t.seen().followed.is_empty(), "the same platform");
    t.feed(vec![Input::Infrastructure(Box::new(json!({"status": {}})))]).await;
    assert!(t.seen().followed.is_empty(), "an unreadable object changes nothing");
    t.feed(vec![infrastructure("GCP")]).await;
    assert_eq!(t.seen().followed, [format!("{NS}/{GCP_CM}")]);
    assert_eq!(t.control.configmap().name, GCP_CM);
    assert_eq!(t.enforced(), Some(policy(GOOD).hash()), "in force until the other one comes");
    // The ConfigMap left behind is no longer followed.
    t.feed(vec![aws(OTHER)]).await;
    assert_eq!(t.enforced(), Some(policy(GOOD).hash()));
    t.feed(vec![cm(GCP_CM, Some(GCP))]).await;
    assert_eq!(t.enforced(), Some(policy(GCP).hash()));
    let last = t.gate().lock().unwrap().installed.last().cloned().unwrap();
    assert_eq!(
        (last.platform.as_str(), last.endpoints.as_slice()),
        ("GCP", &["gce".to_owned()][..])
    );
    // A rejection now names the ConfigMap followed.
    t.feed(vec![cm(GCP_CM, Some(INVALID))]).await;
    assert_eq!(t.events().last().unwrap().0.name.as_deref(), Some(GCP_CM));
    assert_eq!(t.enforced(), Some(policy(GCP).hash()));
}

#[tokio::test]
async fn a_platform_change_before_start_drops_the_waiting_policy() {
    let mut t = T::new();
    t.feed(vec![aws(GOOD), infrastructure("GCP")]).await;
    t.feed(listed(&[])).await;
    assert!(started(&t).is_empty(), "the AWS policy does not start a GCP node");
    t.feed(vec![cm(GCP_CM, Some(GCP))]).await;
    assert_eq!(started(&t), [policy(GCP).hash()]);
}

#[tokio::test]
async fn a_named_policy_configmap_stays_whatever_the_platform() {
    let mut t = T::with(Some(("ops".into(), "gate-policy".into())));
    let mut named = configmap("gate-policy", Some(GOOD));
    named.metadata.namespace = Some("ops".into());
    t.feed(vec![Input::Policy(Box::new(Event::Apply(named)))]).await;
    t.feed(listed(&[])).await;
    assert_eq!(t.enforced(), Some(policy(GOOD).hash()));
    t.feed(vec![infrastructure("GCP")]).await;
    assert!(t.seen().followed.is_empty());
    assert_eq!(t.control.configmap().name, "gate-policy");
    t.feed(vec![cm(GCP_CM, Some(GCP))]).await;
    assert_eq!(t.enforced(), Some(policy(GOOD).hash()), "not the followed ConfigMap");
}

// ---- the allow set --------------------------------------------------------------------------

#[tokio::test]
async fn the_allow_set_follows_the_pods() {
    let mut t = T::new();
    let (a, c, d) = (t.tree.add("a"), t.tree.add("c"), t.tree.add("d"));
    t.feed(vec![aws(MON)]).await;
    t.feed(listed(&[pod("a", "mon", "m1", false), pod("b", "app", "w", false)])).await;
    assert_eq!(t.allowed(), [a]);
    t.feed(vec![applied(pod("c", "mon", "m2", false))]).await;
    let mut want = vec![a, c];
    want.sort_unstable();
    assert_eq!(t.allowed(), want, "allowed from the moment it is seen");
    t.feed(vec![deleted(pod("a", "mon", "m1", false))]).await;
    assert_eq!(t.allowed(), [c], "a deleted pod leaves");
    // A relist: nothing changes until it is done, then c (gone meanwhile) leaves and d comes.
    let syncs = t.gate().lock().unwrap().allow_synced.len();
    let mut relist = listed(&[pod("d", "mon", "m3", false), pod("b", "app", "w", false)]);
    let done = relist.pop().unwrap();
    t.feed(relist).await;
    assert_eq!(t.gate().lock().unwrap().allow_synced.len(), syncs, "no sync mid-relist");
    assert_eq!(t.allowed(), [c]);
    t.feed(vec![done]).await;
    assert_eq!(t.allowed(), [d]);
    // The policy decides too: without the entry, nothing is allowed.
    t.feed(vec![aws(GOOD)]).await;
    let g = t.gate();
    assert!(g.lock().unwrap().installed.last().unwrap().allow.is_empty());
}

// ---- repair ---------------------------------------------------------------------------------

#[tokio::test]
async fn ticks_and_pod_changes_check_and_repair_the_gate() {
    let mut t = T::new();
    t.feed(vec![Input::Tick, aws(GOOD)]).await;
    t.feed(listed(&[])).await;
    // Listing the pods and starting are not a repair.
    assert_eq!(t.repairs(), 0);
    t.feed(vec![Input::Tick, Input::Tick]).await;
    assert_eq!(t.repairs(), 2);
    t.feed(vec![deleted(pod("z", "ns", "z", false))]).await;
    assert_eq!(t.repairs(), 2, "a pod event that changes nothing");
    t.feed(vec![applied(pod("z", "ns", "z", false))]).await;
    assert_eq!(t.repairs(), 3);
    // What the check finds missing is put back and counted.
    t.gate().lock().unwrap().missing = vec![Repair::MapPin("policy")];
    t.feed(vec![Input::Tick]).await;
    let engine = t.control.engine().unwrap();
    let put_back = engine
        .metrics
        .repairs
        .get_or_create(&crate::metrics::RepairLabels { what: "map-pin" })
        .get();
    assert_eq!(put_back, 1);
    assert!(engine.ready.load(std::sync::atomic::Ordering::Acquire));
}

// ---- denials --------------------------------------------------------------------------------

/// Pod web-1 of namespace app, by identity.
fn web_1() -> Identity {
    Identity {
        workload: "app/web-1/c".into(),
        namespace: Some("app".into()),
        pod: Some("web-1".into()),
        pod_uid: Some("uid-1".into()),
        ..Identity::default()
    }
}

#[tokio::test]
async fn a_denial_is_one_event_on_its_pod() {
    let mut t = running(GOOD).await;
    let workload = Identity { container: Some("c".into()), ..web_1() };
    t.feed(vec![denied(workload), denied(Identity::cgroup("system.slice/x.service"))]).await;
    let events = t.events();
    assert_eq!(events.len(), 1, "a cgroup that is no pod gets none: {events:?}");
    let (object, reason, note) = &events[0];
    let want = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some("app".into()),
        name: Some("web-1".into()),
        uid: Some("uid-1".into()),
        ..Default::default()
    };
    assert_eq!(object, &want);
    assert_eq!(reason, kevents::Reason::Blocked.name());
    assert!(note.starts_with("container c: curl to 169.254.169.254:80/TCP (imds) "), "{note}");
}

/// A request the metadata proxy refused is an Event of its own reason and action, not a
/// kernel denial's.
#[tokio::test]
async fn a_proxy_refusal_is_an_event_of_its_own_reason() {
    let mut t = running(GOOD).await;
    t.feed(vec![refused(web_1())]).await;
    let events = t.events();
    assert_eq!(events.len(), 1, "{events:?}");
    let (_, reason, note) = &events[0];
    assert_eq!(reason, "MetadataRequestRefused");
    assert!(
        note.starts_with("GET /latest/meta-data/iam/info to 169.254.169.254:80 refused"),
        "{note}"
    );
}

// ---- the end --------------------------------------------------------------------------------

#[tokio::test]
async fn stop_ends_the_loop_and_the_gate_stays() {
    let mut t = running(GOOD).await;
    t.feed(vec![Input::Stop, aws(OTHER)]).await;
    let engine = t.control.engine().unwrap();
    assert!(!engine.ready.load(std::sync::atomic::Ordering::Acquire));
    assert_eq!(t.enforced(), Some(policy(GOOD).hash()), "nothing after Stop is read");
    assert!(!t.gate().lock().unwrap().discarded, "the gate stays pinned");
}

#[tokio::test]
async fn an_ended_watch_ends_the_loop_with_an_error() {
    let mut t = T::new();
    let err = t.control.drive(stream::iter([Input::Ended("pods")])).await.unwrap_err();
    assert_eq!(err.to_string(), "the pods watch ended");
}

// ---- one policy text ------------------------------------------------------------------------

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
async fn before_start_a_good_policy_waits_and_a_bad_one_is_rejected() {
    let mut pending = None;
    let why = offer_policy(idle(), &mut pending, CM, Ok(INVALID.into())).await;
    assert!(why.is_some_and(|w| w.contains("cidr")));
    assert!(pending.is_none(), "nothing to start with");
    assert!(offer_policy(idle(), &mut pending, CM, Ok(GOOD.into())).await.is_none());
    assert_eq!(pending.as_ref().map(Policy::hash), Some(policy(GOOD).hash()));
    // A bad one later leaves the good one waiting; a missing key is rejected too.
    for text in [Ok(INVALID.into()), Err("data.policy.yaml: missing".to_owned())] {
        assert!(offer_policy(idle(), &mut pending, CM, text).await.is_some());
        assert_eq!(pending.as_ref().map(Policy::hash), Some(policy(GOOD).hash()));
    }
    // The newest good one wins.
    assert!(offer_policy(idle(), &mut pending, CM, Ok(OTHER.into())).await.is_none());
    assert_eq!(pending.as_ref().map(Policy::hash), Some(policy(OTHER).hash()));
}

#[tokio::test]
async fn after_start_a_policy_is_offered_and_a_bad_one_rejected() {
    let mut rig = fake::Rig::start(Start::Fresh, GOOD);
    let mut pending = None;
    let got = offer_policy(Some(&mut rig.engine), &mut pending, CM, Ok(OTHER.into())).await;
    assert!(got.is_none());
    assert_eq!(rig.enforced(), policy(OTHER).hash());
    let got = offer_policy(Some(&mut rig.engine), &mut pending, CM, Ok(INVALID.into())).await;
    assert!(got.is_some_and(|w| w.contains("cidr")));
    assert_eq!(rig.enforced(), policy(OTHER).hash());
    // The live policy again clears the rejection; a ConfigMap without the key is rejected.
    assert!(
        offer_policy(Some(&mut rig.engine), &mut pending, CM, Ok(OTHER.into())).await.is_none()
    );
    assert_eq!(rig.rejected(), 0);
    let missing = Err("data.policy.yaml: missing".to_owned());
    let got = offer_policy(Some(&mut rig.engine), &mut pending, CM, missing).await;
    assert_eq!(got.as_deref(), Some("data.policy.yaml: missing"));
    assert_eq!((rig.rejected(), rig.enforced()), (1, policy(OTHER).hash()));
    assert!(pending.is_none(), "a running engine takes the policy itself");
}
