//! Which policy is in force, decided without a kernel: the engine drives a fake gate that
//! records what it was told to install and fails when told to.
use gate_common::user::{AllowSet, AttachPoint};

use super::{
    GateOps, Offer, bring_up_gate,
    fake::{
        Fake, FakeState, GCP, GOOD, INVALID, OTHER, Rig, cfg, ids, node, policy, proxy_side, root,
    },
    heal::Retry,
    proxy_for,
};
use crate::{
    loader::{Repair, Start},
    policy::Mode,
};

// ---- start --------------------------------------------------------------------------------

#[test]
fn a_fresh_start_checks_the_root_then_installs_then_attaches() {
    let rig = Rig::start(Start::Fresh, GOOD);
    let s = rig.gate.lock().unwrap();
    assert_eq!(s.calls, ["check_root", "apply", "attach", "proxy_off", "sync_tc"]);
    assert_eq!(s.installed.len(), 1);
    assert_eq!(s.installed[0].hash, policy(GOOD).hash());
    assert_eq!(ids(&s.installed[0].allow), [100]);
    assert_eq!(s.installed[0].root_id, 7);
    assert_eq!(s.installed[0].endpoints, ["imds"]);
    assert!(!s.discarded);
}

#[test]
fn an_adopted_gate_is_given_the_new_policy() {
    let rig = Rig::start(Start::Adopted, GOOD);
    assert_eq!(rig.enforced(), policy(GOOD).hash());
    assert_eq!(rig.engine.gate.lock().unwrap().info.policy_generation, 42);
    assert!(!rig.gate.lock().unwrap().discarded);
}

/// Start the fake with `fail` set; what the fake was told.
fn failed_start(start: Start, fail: impl FnOnce(&mut FakeState)) -> FakeState {
    let (fake, state) = Fake::new(start);
    fail(&mut state.lock().unwrap());
    let r = bring_up_gate(fake, &cfg(), &node(), &policy(GOOD), &root(7), &AllowSet::new(), None);
    assert!(r.is_err(), "the start should fail");
    std::mem::take(&mut *state.lock().unwrap())
}

#[test]
fn a_failed_fresh_start_removes_its_pins() {
    for fail in [
        (|s: &mut FakeState| s.fail_apply = true) as fn(&mut FakeState),
        |s| s.fail_attach = true,
        |s| s.fail_check_root = true,
    ] {
        let s = failed_start(Start::Fresh, fail);
        assert!(s.discarded, "calls {:?}", s.calls);
    }
}

#[test]
fn a_failed_adoption_leaves_the_pinned_gate_enforcing() {
    let s = failed_start(Start::Adopted, |s| s.fail_apply = true);
    assert!(!s.discarded, "calls {:?}", s.calls);
    assert!(s.installed.is_empty());
    assert_eq!(s.calls, ["check_root", "apply"], "nothing attached after a failed apply");
    // Written but not attached: the pins stay (the adopted links keep enforcing).
    let s = failed_start(Start::Adopted, |s| s.fail_attach = true);
    assert!(!s.discarded, "calls {:?}", s.calls);
}

#[test]
fn an_adopted_gate_of_another_root_is_not_written() {
    let s = failed_start(Start::Adopted, |s| s.fail_check_root = true);
    assert_eq!(s.calls, ["check_root"], "nothing is written before the root is checked");
    assert!(!s.discarded);
}

// ---- a policy offered ---------------------------------------------------------------------

#[tokio::test]
async fn a_valid_new_policy_is_installed_and_in_force() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    let got = rig.engine.offer("cm", OTHER, "test").await;
    assert!(matches!(got, Offer::Applied), "{got:?}");
    let last = rig.installed().pop().unwrap();
    assert_eq!(last.hash, policy(OTHER).hash());
    assert_eq!(last.mode, Mode::Audit);
    assert_eq!(last.endpoints, ["imds", "imds-v6"]);
    assert_eq!(rig.engine.policy.hash(), policy(OTHER).hash());
    assert_eq!(rig.enforced(), policy(OTHER).hash());
    assert_eq!(*rig.engine.sinks.endpoints.read().unwrap(), ["imds", "imds-v6"]);
    assert_eq!((rig.reloads("success"), rig.rejected()), (1, 0));
}

#[tokio::test]
async fn the_same_text_again_is_not_installed_again() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.engine.offer("cm", OTHER, "test").await;
    let got = rig.engine.offer("cm", OTHER, "test").await;
    assert!(matches!(got, Offer::Unchanged), "{got:?}");
    // The policy in force offered again (another text, same policy): nothing written.
    let got = rig.engine.offer("cm", &format!("# comment\n{OTHER}"), "test").await;
    assert!(matches!(got, Offer::Unchanged), "{got:?}");
    assert_eq!(rig.installed().len(), 2);
    assert_eq!(rig.reloads("unchanged"), 2);
}

#[tokio::test]
async fn an_invalid_policy_is_rejected_and_the_last_good_one_stays() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    let got = rig.engine.offer("cm", INVALID, "test").await;
    let Offer::Rejected(why) = got else { panic!("{got:?}") };
    assert!(why.contains("cidr"), "{why}");
    assert_eq!(rig.installed().len(), 1, "nothing written");
    assert_eq!(rig.engine.policy.hash(), policy(GOOD).hash());
    assert_eq!(rig.enforced(), policy(GOOD).hash());
    assert_eq!((rig.reloads("failure"), rig.rejected()), (1, 1));
    // The same bad text again is judged once; the rejection stands.
    assert!(matches!(rig.engine.offer("cm", INVALID, "test").await, Offer::Unchanged));
    assert_eq!((rig.reloads("failure"), rig.rejected()), (1, 1));
    // The policy in force offered again: the newest text is the live policy, no rejection.
    assert!(matches!(rig.engine.offer("cm", GOOD, "test").await, Offer::Unchanged));
    assert_eq!(rig.rejected(), 0);
    assert_eq!(rig.installed().len(), 1);
}

#[tokio::test]
async fn a_good_policy_after_a_rejected_one_is_installed() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.engine.offer("cm", INVALID, "test").await;
    assert!(matches!(rig.engine.offer("cm", OTHER, "test").await, Offer::Applied));
    assert_eq!(rig.enforced(), policy(OTHER).hash());
    assert_eq!(rig.rejected(), 0);
}

#[tokio::test]
async fn a_platform_change_installs_the_other_platforms_policy() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    assert!(matches!(rig.engine.offer("gcp-cm", GCP, "platform changed").await, Offer::Applied));
    let last = rig.installed().pop().unwrap();
    assert_eq!(
        (last.platform.as_str(), last.endpoints.as_slice()),
        ("GCP", &["gce".to_owned()][..])
    );
    assert_eq!(rig.engine.policy.platform, "GCP");
}

// ---- allow set ----------------------------------------------------------------------------

#[tokio::test]
async fn the_allow_set_follows_its_source() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.allow.set(&[100, 200]);
    rig.engine.sync().await;
    assert_eq!(ids(rig.engine.gate.lock().unwrap().allowed()), [100, 200]);
    rig.allow.set(&[200]);
    rig.engine.sync().await;
    assert_eq!(ids(rig.engine.gate.lock().unwrap().allowed()), [200]);
    let synced = rig.gate.lock().unwrap().allow_synced.clone();
    assert_eq!(synced.iter().map(ids).collect::<Vec<_>>(), [vec![100, 200], vec![200]]);
    // A new policy is installed with the allow set of now.
    rig.allow.set(&[300]);
    rig.engine.offer("cm", OTHER, "test").await;
    assert_eq!(ids(&rig.installed().pop().unwrap().allow), [300]);
}

// ---- retry and repair ---------------------------------------------------------------------

#[tokio::test]
async fn a_failed_apply_keeps_the_last_good_policy_and_is_retried() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.fail_apply(true);
    let got = rig.engine.offer("cm", OTHER, "test").await;
    assert!(matches!(got, Offer::Rejected(_)), "{got:?}");
    assert_eq!(rig.engine.policy.hash(), policy(GOOD).hash());
    assert_eq!(rig.enforced(), policy(GOOD).hash());
    assert_eq!(rig.rejected(), 1);
    assert_eq!(rig.engine.retry.as_ref().map(|r| r.backoff), Some(Retry::FIRST));
    // Not due yet: no attempt.
    let before = rig.gate.lock().unwrap().calls.len();
    rig.engine.retry_due().await;
    assert_eq!(rig.gate.lock().unwrap().calls.len(), before);
    // Due and failing again: the backoff doubles, up to its cap.
    for want in [Retry::FIRST * 2, Retry::FIRST * 4] {
        rig.retry_now();
        rig.engine.sync().await;
        assert_eq!(rig.engine.retry.as_ref().map(|r| r.backoff), Some(want));
    }
    for _ in 0..10 {
        rig.retry_now();
        rig.engine.retry_due().await;
    }
    assert_eq!(rig.engine.retry.as_ref().map(|r| r.backoff), Some(Retry::MAX));
    // The same text offered again is tried again (an apply failure is not a verdict).
    rig.fail_apply(false);
    rig.retry_now();
    rig.engine.sync().await;
    assert!(rig.engine.retry.is_none());
    assert_eq!(rig.enforced(), policy(OTHER).hash());
    assert_eq!(rig.engine.policy.hash(), policy(OTHER).hash());
    assert_eq!(rig.rejected(), 0);
}

#[tokio::test]
async fn a_failed_apply_is_retried_when_the_text_comes_again() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.fail_apply(true);
    rig.engine.offer("cm", OTHER, "test").await;
    rig.fail_apply(false);
    assert!(matches!(rig.engine.offer("cm", OTHER, "test").await, Offer::Applied));
    assert!(rig.engine.retry.is_none());
}

#[tokio::test]
async fn a_rejection_cancels_a_pending_retry() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.fail_apply(true);
    rig.engine.offer("cm", OTHER, "test").await;
    rig.engine.offer("cm", INVALID, "test").await;
    assert!(rig.engine.retry.is_none());
}

#[tokio::test]
async fn missing_links_and_pins_are_put_back_and_counted() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.gate.lock().unwrap().missing = vec![
        Repair::Link(AttachPoint::CGROUP[0]),
        Repair::MapPin("GATE_INFO"),
        Repair::ProgramPin(AttachPoint::CGROUP[0]),
    ];
    rig.engine.sync().await;
    assert_eq!(
        (rig.repairs("link"), rig.repairs("map-pin"), rig.repairs("program-pin")),
        (1, 1, 1)
    );
    assert!(rig.ready());
}

#[tokio::test]
async fn a_gate_that_cannot_be_repaired_is_not_ready_until_it_can() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.gate.lock().unwrap().fail_repair = true;
    rig.engine.sync().await;
    assert!(!rig.ready());
    rig.gate.lock().unwrap().fail_repair = false;
    rig.engine.sync().await;
    assert!(rig.ready());
}

#[tokio::test]
async fn a_recreated_root_is_given_the_policy_in_force() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.engine.offer("cm", OTHER, "test").await;
    rig.root.set(8);
    rig.engine.sync().await;
    let last = rig.installed().pop().unwrap();
    assert_eq!((last.root_id, last.hash), (8, policy(OTHER).hash()));
    assert_eq!(rig.engine.root.id, 8);
    assert_eq!(rig.repairs("root"), 1);
    assert!(rig.ready());
}

#[tokio::test]
async fn a_recreated_root_that_cannot_be_written_is_not_ready() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.root.set(8);
    rig.fail_apply(true);
    rig.engine.sync().await;
    assert!(!rig.ready());
    assert_eq!(rig.engine.root.id, 7, "kept until the policy is on the new root");
    assert_eq!(rig.repairs("root"), 0);
    rig.fail_apply(false);
    rig.engine.sync().await;
    assert!(rig.ready());
    assert_eq!(rig.engine.root.id, 8);
}

#[tokio::test]
async fn a_vanished_root_is_not_ready_and_not_repaired() {
    let mut rig = Rig::start(Start::Fresh, GOOD);
    rig.root.set(0);
    let before = rig.gate.lock().unwrap().calls.len();
    rig.engine.sync().await;
    assert!(!rig.ready());
    assert_eq!(rig.gate.lock().unwrap().calls.len(), before, "no repair without the root");
    rig.root.set(7);
    rig.engine.sync().await;
    assert!(rig.ready());
}

// ---- the metadata proxy's programs --------------------------------------------------------

/// An allow entry narrowed to paths: its connects go to the proxy.
const PATHS: &str = "platform: AWS\nendpoints:\n  - {name: imds, cidr: 169.254.169.254/32}\n\
                     allow:\n  - {name: csi, cgroup: \"csi\", paths: [/latest/meta-data/instance-id]}\n";

fn served() -> String {
    format!("{GOOD}served: {{paths: [/latest/meta-data/placement/region]}}\n")
}

/// What the fake was told since the last look, and nothing else of it.
fn calls_since(rig: &Rig) -> Vec<&'static str> {
    std::mem::take(&mut rig.gate.lock().unwrap().calls)
}

fn proxy_told(rig: &Rig) -> bool {
    rig.gate.lock().unwrap().proxy.is_some()
}

#[test]
fn the_proxys_programs_are_wanted_only_with_a_proxy_and_a_policy_that_sends_to_it() {
    let side = proxy_side();
    let want = |text: &str| proxy_for(Some(&side), &policy(text)).is_some();
    assert!(!want(GOOD), "every workload allowed or denied whole: nothing goes to the proxy");
    assert!(want(PATHS), "an entry narrowed to paths");
    assert!(want(&served()), "served");
    assert!(want(OTHER), "audit mode sends every HTTP connect to the proxy, to record its path");
    assert_eq!(proxy_for(None, &policy(PATHS)), None, "no --proxy-address: never");
}

#[test]
fn without_a_proxy_its_programs_are_taken_out_after_the_policy_is_in() {
    // A fresh start, and an adopted gate whose predecessor had a proxy: out, after the apply
    // (the predecessor's redirects stay in its programs' hands until the new policy is in).
    for start in [Start::Fresh, Start::Adopted] {
        let (fake, state) = Fake::new(start);
        state.lock().unwrap().proxy_pinned = start == Start::Adopted;
        let rig = Rig::with_proxy((fake, state), PATHS, None);
        let s = rig.gate.lock().unwrap();
        assert_eq!(s.calls, ["check_root", "apply", "attach", "proxy_off", "sync_tc"], "{start:?}");
        assert!(s.proxy.is_none() && !s.proxy_pinned, "{start:?}");
    }
    // A proxy, and a policy that sends nothing to it: out as well.
    let rig = Rig::with_proxy(Fake::new(Start::Fresh), GOOD, Some(proxy_side()));
    assert!(calls_since(&rig).contains(&"proxy_off"));
    assert!(!proxy_told(&rig));
}

#[test]
fn a_proxy_that_serves_the_policy_has_its_programs_in_at_start() {
    let rig = Rig::with_proxy(Fake::new(Start::Adopted), PATHS, Some(proxy_side()));
    let s = rig.gate.lock().unwrap();
    assert_eq!(s.calls, ["check_root", "apply", "attach", "proxy_on", "sync_tc"]);
    assert_eq!(s.proxy, Some(proxy_side()), "the kernel is told where the proxy is");
}

#[tokio::test]
async fn the_programs_go_in_before_a_policy_that_needs_them_and_out_after_the_last() {
    let mut rig = Rig::with_proxy(Fake::new(Start::Fresh), GOOD, Some(proxy_side()));
    calls_since(&rig);
    assert!(matches!(rig.engine.offer("f", PATHS, "test").await, Offer::Applied));
    assert_eq!(calls_since(&rig), ["proxy_on", "apply"], "in before the policy that sends there");
    assert!(proxy_told(&rig));
    // Needed still (served, then audit): nothing changes.
    for text in [served().as_str(), OTHER] {
        assert!(matches!(rig.engine.offer("f", text, "test").await, Offer::Applied));
        assert_eq!(calls_since(&rig), ["apply"]);
    }
    assert!(matches!(rig.engine.offer("f", GOOD, "test").await, Offer::Applied));
    assert_eq!(calls_since(&rig), ["apply", "proxy_off"], "out once no policy sends there");
    assert!(!proxy_told(&rig));
    // The tick finds them as the policy in force needs them: nothing to do.
    rig.engine.sync().await;
    assert_eq!(calls_since(&rig), ["repair"]);
}

#[tokio::test]
async fn programs_that_cannot_go_in_leave_the_proxy_untold_and_the_gate_not_ready() {
    let mut rig = Rig::with_proxy(Fake::new(Start::Fresh), GOOD, Some(proxy_side()));
    rig.gate.lock().unwrap().fail_proxy_on = true;
    // The policy is applied all the same (it may protect more than the last one); its paths
    // are denied until the programs are in, since the kernel is not told of the proxy.
    assert!(matches!(rig.engine.offer("f", PATHS, "test").await, Offer::Applied));
    assert_eq!(rig.enforced(), policy(PATHS).hash());
    assert!(!proxy_told(&rig));
    rig.engine.sync().await;
    assert!(!rig.ready(), "not whole while the proxy's programs are missing");
    rig.gate.lock().unwrap().fail_proxy_on = false;
    rig.engine.sync().await;
    assert!(rig.ready());
    assert!(proxy_told(&rig), "put in by the tick");
}

#[tokio::test]
async fn a_failed_apply_leaves_the_programs_as_the_policy_in_force_needs_them() {
    // In for a policy that was then not applied: the tick takes them out again, and the
    // retry puts them in before it applies.
    let mut rig = Rig::with_proxy(Fake::new(Start::Fresh), GOOD, Some(proxy_side()));
    calls_since(&rig);
    rig.fail_apply(true);
    assert!(matches!(rig.engine.offer("f", PATHS, "test").await, Offer::Rejected(_)));
    assert_eq!(calls_since(&rig), ["proxy_on", "apply"]);
    rig.engine.sync().await;
    assert_eq!(calls_since(&rig), ["repair", "proxy_off"]);
    rig.fail_apply(false);
    rig.retry_now();
    rig.engine.sync().await;
    assert_eq!(calls_since(&rig), ["proxy_on", "apply", "repair"]);
    assert!(proxy_told(&rig));
    // Out for a policy that was then not applied: they stay, the policy in force needs them.
    rig.fail_apply(true);
    assert!(matches!(rig.engine.offer("f", GOOD, "test").await, Offer::Rejected(_)));
    assert_eq!(calls_since(&rig), ["apply"]);
    assert!(proxy_told(&rig));
}
