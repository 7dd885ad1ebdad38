//! Audit, report, suggest, enforce, per path: what a workload reads in audit mode is what
//! its suggested entry serves, and nothing more.
use std::time::Duration;

use integration_tests::{net::IMDS_V4, probe::Outcome};

use super::{Env, INSTANCE_ID, http, proxy_agent_with};
use crate::TempDir;

const ID: &str = "/latest/meta-data/instance-id";
const REGION: &str = "/latest/meta-data/placement/region";
const CREDENTIALS: &str = "/latest/meta-data/iam/security-credentials/";

fn served(env: &Env, path: &str) -> bool {
    let (t, o): (String, Outcome) = http(env, "gated/csi-node", IMDS_V4, path);
    let reply = o.reply.unwrap_or_default();
    if reply.contains(" 200 ") && reply.contains(INSTANCE_ID) {
        assert!(env.imds.wait_for(&t, Duration::from_secs(2)), "{path}: served, no token");
        return true;
    }
    assert!(reply.contains(" 403 "), "{path}: neither served nor refused: {reply}");
    assert!(!env.imds.wait_for(&t, Duration::from_millis(300)), "{path}: refused, yet reached");
    false
}

/// In audit mode every gated HTTP connect goes through the proxy, which serves every path
/// (the credentials too: the path is open) and records it; `report` lists the paths of the
/// workload, `suggest` narrows its entry to exactly them with the credentials commented out,
/// `explain --path` judges a request as the proxy does; pasted and enforced, the entry serves
/// the workload its paths and refuses the credentials it read in audit.
#[test]
fn audit_shows_every_path_then_suggest_narrows_it_and_enforce_serves_only_that() {
    privileged!(audit_shows_every_path_then_suggest_narrows_it_and_enforce_serves_only_that);
    // Declared first, dropped last: the agent writes its path record as it stops.
    let state = TempDir::new("mg-state");
    let mut env = Env::new("audit");
    for c in ["gated/csi-node", "gated/agent"] {
        env.cg.create(c).expect("cgroup");
    }
    let state_arg = state.0.to_string_lossy().into_owned();
    env.agent = Some(proxy_agent_with(&env, "gated/agent", &["--state-dir", &state_arg]));
    for path in [ID, REGION, CREDENTIALS] {
        assert!(served(&env, path), "audit mode refused {path}");
    }

    // The record reaches the state dir within ten seconds.
    let pin = env.agent().pin_dir.to_string_lossy().into_owned();
    let report =
        || env.report(&state_arg).into_iter().find(|x| x["identity"]["workload"] == "csi-node");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let csi = loop {
        match report() {
            Some(r) if r["paths"].as_array().is_some_and(|p| p.len() == 3) => break r,
            last if std::time::Instant::now() > deadline => panic!("no paths reported: {last:#?}"),
            _ => std::thread::sleep(Duration::from_millis(500)),
        }
    };
    assert!(csi["proxied"].as_u64() >= Some(3), "{csi:#}");
    for p in csi["paths"].as_array().expect("paths") {
        assert!(p["audited"].as_u64() == Some(1) || p["path"] == REGION, "{p}");
    }

    // explain: the connect goes through the proxy; audit serves the credentials, and says
    // that enforce would not.
    let explain = |path: &str| {
        env.gate_agent(
            &[
                "explain",
                "--json",
                "--pin-dir",
                &pin,
                "--state-dir",
                &state_arg,
                "--cgroup",
                "csi-node",
                "169.254.169.254:80",
                "--path",
                path,
            ],
            Duration::from_secs(10),
        )
        .expect("explain")
    };
    let out = explain(CREDENTIALS);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("explain is JSON");
    assert_eq!(
        (v[0]["verdict"].as_str(), v[0]["request"]["verdict"].as_str()),
        (Some("proxied"), Some("audited")),
        "{v:#}"
    );
    assert_eq!(out.status.code(), Some(2));

    let suggested = env.suggest(&state_arg);
    for p in [ID, REGION] {
        assert!(suggested.contains(&format!("    - \"{p}\"\n")), "{p}: {suggested}");
    }
    // The directory it asked for, exact (`=`): never a prefix of the tree below it.
    assert!(suggested.contains(&format!("    # - \"={CREDENTIALS}\"")), "{suggested}");

    // Enforce with the suggested entry: its paths, and nothing else.
    env.enforce_suggested(&suggested, &state.0);
    assert!(served(&env, ID) && served(&env, REGION));
    assert!(!served(&env, CREDENTIALS), "enforce served the credentials");
    let out = explain(CREDENTIALS);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(explain(ID).status.code(), Some(0));
}
