//! The pod store across lists, relists and watch events: nothing leaves or enters the index
//! in the middle of a relist, and what cannot be mapped to cgroups is never indexed.
use std::path::PathBuf;

use super::{fixtures::*, *};
use crate::cluster::identity::{CgroupDriver, QosClass, pod_cgroup};

fn uids(pods: &Pods) -> Vec<String> {
    pods.index().read().unwrap().iter().map(|p| p.uid.clone()).collect()
}

fn list(pods: &mut Pods, list: &[Pod]) -> bool {
    assert!(!pods.apply(&Event::Init));
    for p in list {
        assert!(!pods.apply(&Event::InitApply(p.clone())), "nothing changes mid-list");
    }
    pods.apply(&Event::InitDone)
}

#[test]
fn nothing_is_indexed_until_the_first_list_is_done() {
    let mut pods = Pods::new();
    assert!(!pods.apply(&Event::Init));
    assert!(!pods.apply(&Event::InitApply(pod("a", "ns", "a", false))));
    assert!(!pods.listed());
    assert!(uids(&pods).is_empty());
    assert!(pods.apply(&Event::InitDone));
    assert!(pods.listed());
    assert_eq!(uids(&pods), ["a"]);
}

#[test]
fn an_empty_node_is_listed_too() {
    let mut pods = Pods::new();
    assert!(list(&mut pods, &[]));
    assert!(pods.listed());
}

#[test]
fn a_relist_swaps_the_pods_in_whole_at_its_end() {
    let mut pods = Pods::new();
    list(&mut pods, &[pod("a", "ns", "a", false), pod("b", "ns", "b", false)]);
    // b went, c came while the watch was down: until the relist is done, a and b stay.
    assert!(!pods.apply(&Event::Init));
    assert!(!pods.apply(&Event::InitApply(pod("a", "ns", "a", false))));
    assert!(!pods.apply(&Event::InitApply(pod("c", "ns", "c", false))));
    assert_eq!(uids(&pods), ["a", "b"], "no pod dropped or added mid-relist");
    assert!(pods.listed(), "still listed");
    assert!(pods.apply(&Event::InitDone));
    assert_eq!(uids(&pods), ["a", "c"]);
}

#[test]
fn watch_events_update_the_index() {
    let mut pods = Pods::new();
    list(&mut pods, &[pod("a", "ns", "a", false)]);
    assert!(pods.apply(&Event::Apply(pod("b", "ns", "b", false))));
    let mut moved = pod("b", "ns", "b", true);
    moved.metadata.labels = None;
    assert!(pods.apply(&Event::Apply(moved)), "an update");
    assert!(pods.index().read().unwrap().get("b").unwrap().host_network);
    assert!(pods.apply(&Event::Delete(pod("a", "ns", "a", false))));
    assert!(!pods.apply(&Event::Delete(pod("z", "ns", "z", false))), "not indexed");
    assert_eq!(uids(&pods), ["b"]);
    assert_eq!(pods.store.state().len(), 1, "the store follows the watch too");
}

#[test]
fn a_pod_that_cannot_be_mapped_is_left_out() {
    let mut pods = Pods::new();
    list(&mut pods, &[pod("a", "ns", "a", false), unmappable("ns", "x")]);
    assert_eq!(uids(&pods), ["a"]);
    assert!(!pods.apply(&Event::Apply(unmappable("ns", "y"))));
    // An update that no longer maps keeps what the pod was last indexed as.
    let mut bad = pod("a", "ns", "a", true);
    bad.metadata.annotations =
        Some([(crate::cluster::identity::MIRROR_ANNOTATION.to_owned(), "x/y".to_owned())].into());
    assert!(!pods.apply(&Event::Apply(bad)));
    assert!(!pods.index().read().unwrap().get("a").unwrap().host_network);
}

#[test]
fn the_allow_source_and_the_namer_read_the_index() {
    let tree = Tree::new();
    let mut pods = Pods::new();
    list(&mut pods, &[pod("a", "mon", "m", true), pod("b", "app", "w", false)]);
    let (a, b) = (tree.add("a"), tree.add("b"));
    let policy = Policy::parse(
        "p.yaml",
        "platform: AWS\nendpoints:\n  - {name: imds, cidr: 169.254.169.254/32}\nallow:\n  - {name: mon, namespace: mon}\n",
    )
    .unwrap();
    let allowed = |scope| {
        let set = pods.allow(tree.cgroups(), scope).allow_set(&policy);
        set.iter().map(|(id, _)| id).collect::<Vec<_>>()
    };
    assert_eq!(allowed(Scope::AllPods), [a]);
    let mut both = vec![a, b];
    both.sort_unstable();
    let mut got = allowed(Scope::HostNetworkOnly);
    got.sort_unstable();
    assert_eq!(got, both, "a pod-network pod is ungated");
    let namer = pods.namer(tree.cgroups());
    let who = namer(&pod_cgroup(CgroupDriver::Cgroupfs, QosClass::BestEffort, "b")).unwrap();
    assert_eq!((who.workload.as_str(), who.pod_uid.as_deref()), ("app/w", Some("b")));
    assert!(namer(&PathBuf::from("besteffort/podz")).is_none());
}
