//! Scenario 8: what each program costs per run, by the kernel's own BPF statistics, in a
//! pass of its own: statistics on cost two clock reads per run, so the rates of scenarios
//! 1–3 are measured with them off. The gate as shipped runs each rate workload for the
//! measurement time; per program, the run count and run time it added (`gate-agent status`
//! reads both from the program's info) give the nanoseconds per run.
//!
//! Statistics are switched on with BPF_ENABLE_STATS, which holds them on for as long as its
//! file descriptor is open: they go back off when this pass ends, fails, panics or is
//! killed, and the `kernel.bpf_stats_enabled` sysctl is never written (every kernel the
//! project supports, 5.10 on, has the command: it came in 5.8).
//!
//! The fast path alone, without the statistics' clock reads: BPF_PROG_TEST_RUN runs the
//! attached egress and node-level programs a million times on one packet to the benchmark's
//! unprotected destination (the kernel reads the clock once for all of them), and an empty
//! program the same way, the floor of that loop. Both go through aya (`enable_stats`,
//! `TestRun`: see `integration_tests::testrun`).
use std::collections::BTreeMap;

use anyhow::{Context as _, Result, bail};
use aya::sys::{Stats, enable_stats};
use integration_tests::{
    agent::Agent,
    testrun::{Kind, SkbProgram, empty_tc},
};
use serde_json::{Value, json};

use crate::{
    Cfg, Report,
    policy::{self, Extra},
    rates::{SCENARIOS, measure},
    variants::{self, Variant},
    world::World,
};

/// The agent's attachments from `status --json`: (attach point, program id, run count, run
/// time ns), the node-level program's attach points (`tc-egress-<ifindex>`, …) all named `tc`.
fn attachments(agent: &Agent) -> Result<Vec<(String, u64, u64, u64)>> {
    let (_, status) = agent.status()?;
    let all = status["attachments"].as_array().into_iter().flatten();
    Ok(all
        .map(|a| {
            let hook = a["attach_point"].as_str().unwrap_or("?");
            let point = if hook.starts_with("tc-") { "tc" } else { hook }.to_owned();
            let n = |k: &str| a[k].as_u64().unwrap_or(0);
            (point, n("program_id"), n("run_count"), n("run_time_ns"))
        })
        .collect())
}

/// Per attach point (`connect4`, `egress`, `setsockopt`, `tc`): (run count, run time ns) of
/// its program (the node-level program, one program on lo and the uplink, counts once).
fn counters(agent: &Agent) -> Result<BTreeMap<String, (u64, u64)>> {
    let seen: BTreeMap<_, _> =
        attachments(agent)?.into_iter().map(|(p, id, n, t)| ((p, id), (n, t))).collect();
    let mut out: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for ((program, _), (n, t)) in seen {
        let e = out.entry(program).or_default();
        (e.0, e.1) = (e.0 + n, e.1 + t);
    }
    Ok(out)
}

/// Runs per BPF_PROG_TEST_RUN.
const TEST_RUNS: u32 = 1_000_000;

/// Mean nanoseconds per run of `prog` on `frame`, over [`TEST_RUNS`].
fn test_run(prog: &SkbProgram, frame: &[u8]) -> Result<f64> {
    Ok(prog.run(frame, TEST_RUNS)?.per_run.as_nanos() as f64)
}

/// The fast path's own cost, by BPF_PROG_TEST_RUN: (attach point, ns per run) of the
/// attached egress and node-level programs and of an empty program.
fn fast_path(agent: &Agent) -> Result<Vec<(String, f64)>> {
    let frame = integration_tests::frame::ethernet(
        [0x02, 0, 0, 0, 0, 0x02],
        integration_tests::frame::SRC_MAC,
        &[],
        integration_tests::frame::ETH_P_IP,
        &integration_tests::frame::udp4(
            integration_tests::net::NODE_V4.parse()?,
            crate::workload::DEST_V4.parse()?,
            crate::workload::UDP_PORT,
            &[0x5a; 16],
        ),
    );
    let mut out = Vec::new();
    let mut done = Vec::new();
    for (point, id, _, _) in attachments(agent)? {
        if !matches!(point.as_str(), "egress" | "tc") || done.contains(&id) {
            continue;
        }
        done.push(id);
        let kind = if point == "tc" { Kind::Tc } else { Kind::Egress };
        let prog = SkbProgram::by_id(id as u32, kind).with_context(|| point.clone())?;
        out.push((point, test_run(&prog, &frame)?));
    }
    let empty = empty_tc()?;
    out.push(("empty program".to_owned(), test_run(&empty, &frame)?));
    Ok(out)
}

pub(super) fn run(cfg: &Cfg, rep: &mut Report) -> Result<()> {
    let w = World::new()?;
    let policy = w.write_policy("policy.yaml", &policy::aws(&Extra::default()))?;
    let active = variants::apply(Variant::Gate, &w, &policy, &cfg.bins)?;
    let Some(agent) = active.agent() else { bail!("no agent") };
    // Statistics on while this descriptor is open: closing it switches them off.
    let stats = enable_stats(Stats::RunTime).context("switching on BPF statistics")?;
    let mut detail = serde_json::Map::new();
    for s in &SCENARIOS {
        let before = counters(agent)?;
        let (_, r) = measure(cfg, &w, s, cfg.secs)?;
        let after = counters(agent)?;
        // The workload's operations: calls, or for bulk 128 KiB writes.
        let (ops, op) = match r["ops"].as_f64() {
            Some(n) => (n, "call"),
            None => (r["bytes"].as_f64().unwrap_or(0.0) / (128.0 * 1024.0), "128 KiB write"),
        };
        let mut parts = Vec::new();
        let mut per = serde_json::Map::new();
        for (point, &(n1, t1)) in &after {
            let (n0, t0) = before.get(point).copied().unwrap_or_default();
            let (runs, ns) = (n1.saturating_sub(n0), t1.saturating_sub(t0));
            if runs == 0 {
                continue;
            }
            let per_run = ns as f64 / runs as f64;
            let short = point.as_str();
            rep.set_num(&format!("ns_per_run_{}_{short}", s.name), per_run);
            per.insert(point.clone(), json!({"runs": runs, "ns": ns, "ns_per_run": per_run}));
            // Runs per operation of the workload: how often the program is on the path.
            let per_op = runs as f64 / ops.max(1.0);
            rep.set_num(&format!("runs_per_op_{}_{short}", s.name), per_op);
            parts.push(format!("{short}: {per_run:.0} ns × {per_op:.2} per {op}"));
        }
        eprintln!("   {:<8} {}", s.name, parts.join(", "));
        detail.insert(s.name.into(), Value::Object(per));
        let variant = format!("metadata-gate, {}", s.name);
        rep.row("8. ns per program run (bpf_stats, separate pass)", &variant, parts.join("; "));
    }
    drop(stats);
    rep.detail("bpf_stats", Value::Object(detail));
    let fast = fast_path(agent)?;
    let text: Vec<String> = fast.iter().map(|(p, ns)| format!("{p}: {ns:.0} ns")).collect();
    eprintln!("   fast path, {TEST_RUNS} test runs: {}", text.join(", "));
    for (point, ns) in &fast {
        let key = point.replace(' ', "_");
        rep.set_num(&format!("ns_per_test_run_{key}"), *ns);
    }
    rep.row(
        "8. ns per run of the fast path (BPF_PROG_TEST_RUN, 1 M runs, no per-run clock)",
        "metadata-gate, UDP to the unprotected neighbour",
        text.join("; "),
    );
    Ok(())
}
