//! Scenario 6: a policy change to its enforcement, and a new allow-listed cgroup to its first
//! allowed connect(). Times run from the file rename (or mkdir) to the first connect() of a
//! looping workload with the new outcome (CLOCK_MONOTONIC in both processes).
use anyhow::Result;
use integration_tests::{agent::Agent, net::IMDS_V4};
use serde_json::json;

use crate::{
    Cfg, Report,
    clock::monotonic_ns,
    p50_p99,
    policy::{self, Extra},
    stats,
    variants::{self, Variant},
    workload::{CONNECT_PORT, DEST_V4, Flip, IMDS_PORT},
    world::World,
};

/// The agent harness's `--rescan-ms` (this scenario runs the agent with the harness's
/// flags: the new-cgroup latency is one rescan period, 1000 ms by default).
const RESCAN_MS: u64 = 200;
const FLIP_TIMEOUT_MS: u64 = 3000;

/// The bench policy, with or without an endpoint for the address the workload connects to.
pub(super) fn toggled(with: bool) -> String {
    let endpoints = if with {
        vec![("bench-toggle".to_string(), format!("{DEST_V4}/32"), CONNECT_PORT.to_string())]
    } else {
        vec![]
    };
    policy::aws(&Extra { endpoints, allow: vec![("bench-new".into(), "allowed-*".into())] })
}

fn ms(ns: Vec<f64>) -> Vec<f64> {
    ns.into_iter().map(|n| n / 1e6).collect()
}

pub(super) fn run(cfg: &Cfg, rep: &mut Report) -> Result<()> {
    let w = World::new()?;
    let policy = w.write_policy("policy.yaml", &toggled(false))?;
    let _agent = Agent::start(&cfg.bins.under_test, &w.net.node_path(), &policy, &w.cg.gated())?;
    variants::verify(Variant::Gate, &w, &cfg.bins)?;
    let port = CONNECT_PORT;

    // Policy change: add an endpoint for an address the workload is using, then remove it.
    let (mut close, mut open) = (vec![], vec![]);
    let mut supported = true;
    'changes: for i in 0..cfg.changes {
        for add in [true, false] {
            let want = if add { "refused" } else { "served" };
            let flip =
                Flip::start(&cfg.bins, &w.net, &w.workload, DEST_V4, port, want, FLIP_TIMEOUT_MS)?;
            if flip.first_refused == add {
                eprintln!("   change {i}: the workload was already {want} before the change");
                continue;
            }
            let t0 = monotonic_ns();
            w.write_policy("policy.yaml", &toggled(add))?;
            match flip.finish()? {
                Some(t) => {
                    (if add { &mut close } else { &mut open }).push(t.saturating_sub(t0) as f64)
                }
                None if i == 0 && add => {
                    eprintln!(
                        "   the agent did not apply a changed policy file: live reload unsupported"
                    );
                    supported = false;
                    break 'changes;
                }
                None => eprintln!("   change {i}: not enforced within {FLIP_TIMEOUT_MS} ms"),
            }
        }
    }
    let (close, open) = (ms(close), ms(open));
    let ((c50, c99), (o50, o99)) = (p50_p99(&close), p50_p99(&open));
    for (key, v) in [("apply_p50", c50), ("apply_p99", c99), ("open_p50", o50), ("open_p99", o99)] {
        rep.set_num(&format!("policy_{key}_ms"), if supported { v } else { f64::NAN });
    }
    rep.detail("policy_apply_ms", json!({"supported": supported, "close": close, "open": open}));
    let value = if supported {
        format!(
            "endpoint added → denied: p50 {c50:.1} ms, p99 {c99:.1} ms; removed → served: p50 {o50:.1} ms, p99 {o99:.1} ms"
        )
    } else {
        "live reload unsupported".into()
    };
    let met = stats::met(supported && c99 < 100.0 && o99 < 100.0);
    rep.verdict("policy_apply_p99_under_100ms", met);
    rep.row("6. policy file change → enforced", "metadata-gate", value).target =
        format!("p99 < 100 ms: {met}");

    // A new cgroup matching an allow glob: mkdir → its first served connect().
    let mut newcg = vec![];
    for i in 0..cfg.changes {
        // Start at a varying phase of the agent's rescan tick, not right after the last
        // one (spread over the period in 37 ms steps).
        let phase_ms = (i as u64 * 37 + 11) % RESCAN_MS;
        std::thread::sleep(std::time::Duration::from_millis(phase_ms));
        let t0 = monotonic_ns();
        let cg = w.cg.create(&format!("gated/allowed-{i}"))?;
        let flip =
            Flip::start(&cfg.bins, &w.net, &cg, IMDS_V4, IMDS_PORT, "served", FLIP_TIMEOUT_MS)?;
        match flip.finish()? {
            Some(t) => newcg.push(t.saturating_sub(t0) as f64),
            None => eprintln!("   new cgroup {i}: not allowed within {FLIP_TIMEOUT_MS} ms"),
        }
    }
    let newcg = ms(newcg);
    let (n50, n99) = p50_p99(&newcg);
    rep.set_num("new_cgroup_allowed_p50_ms", n50);
    rep.set_num("new_cgroup_allowed_p99_ms", n99);
    rep.set_num("rescan_ms", RESCAN_MS as f64);
    rep.detail("new_cgroup_allowed_ms", json!(newcg));
    let value = format!("p50 {n50:.1} ms, p99 {n99:.1} ms (--rescan-ms {RESCAN_MS})");
    rep.row("6. new allowed cgroup → first allowed connect()", "metadata-gate", value);
    Ok(())
}
