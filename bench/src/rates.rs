//! Scenarios 1–3 and 7: connect()+close() rate, small UDP sendto() rate and bulk TCP
//! throughput from the gated workload to an unprotected address over the veth, per variant;
//! the agent's memory and CPU at idle and under the connect loop.
//!
//! Each rate becomes a ratio to the no-gate rate of the same cycle ([`take_turns`]); the
//! gate is compared with nftables and iptables by the per-cycle differences of their ratios
//! ([`crate::stats`]).
use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{
    Cfg, Report, agent_usage, median,
    policy::{self, Extra},
    report::si,
    rotated,
    stats::{self, Comparison},
    variants::{self, Variant},
    workload::{self, BULK_PORT, CONNECT_PORT, DEST_V4, Slicer, UDP_PORT},
    world::World,
};

/// A rate scenario: its short name (the prefix of its verdicts and details), the prefix of
/// its report keys (`connect_rate_ratio_gate`, …), bench-probe's mode and port, the unit of
/// its rate, its title, and the gate's own target for its ratio, if any (bulk: ≥ 0.99).
pub(super) struct Scenario {
    pub name: &'static str,
    pub key: &'static str,
    pub mode: &'static str,
    pub port: u16,
    unit: &'static str,
    title: &'static str,
    floor: Option<f64>,
}

const fn scenario(
    name: &'static str,
    key: &'static str,
    mode: &'static str,
    port: u16,
) -> Scenario {
    Scenario { name, key, mode, port, unit: "", title: "", floor: None }
}

pub(super) const SCENARIOS: [Scenario; 3] = [
    Scenario {
        unit: "connect()+close()/s",
        title: "1. TCP connect rate",
        ..scenario("connect", "connect_rate_ratio", "connect-rate", CONNECT_PORT)
    },
    Scenario {
        unit: "sendto()/s",
        title: "2. UDP sendto rate",
        ..scenario("udp", "udp_rate_ratio", "udp-rate", UDP_PORT)
    },
    Scenario {
        title: "3. bulk TCP over veth",
        floor: Some(0.99),
        ..scenario("bulk", "bulk_ratio", "bulk", BULK_PORT)
    },
];

/// The variants of scenarios 1–3, in their first round's order.
pub(super) const VARIANTS: [Variant; 4] =
    [Variant::None, Variant::Gate, Variant::Nft, Variant::Ipt];

/// Run one rate measurement of `s` from the workload; the rate.
pub(super) fn measure(
    cfg: &Cfg,
    w: &World,
    s: &Scenario,
    secs: f64,
) -> Result<(f64, serde_json::Value)> {
    let port = s.port.to_string();
    let r = workload::run(
        &cfg.bins,
        &w.net,
        &w.workload,
        &[s.mode, DEST_V4, &port, &secs.to_string()],
    )?;
    let rate = r["rate"].as_f64().unwrap_or(0.0);
    if r["ok"] != true || rate <= 0.0 {
        bail!("{}: {r}", s.name);
    }
    Ok((rate, r))
}

/// The agent's memory and CPU, at idle and while its workload runs.
#[derive(Default)]
struct AgentLoad {
    rss_idle: Vec<f64>,
    cpu_idle: Vec<f64>,
    rss_load: Vec<f64>,
    /// CPU seconds the agent used during the gate's connect slices, and their length.
    cpu_s: f64,
    secs: f64,
}

/// What a run collects: per (scenario, variant), one value per cycle, cycles in order.
#[derive(Default)]
struct Samples<'a> {
    rate: BTreeMap<(&'a str, &'a str), Vec<f64>>,
    /// Work (operations or bytes) per CPU second of the workload.
    per_cpu: BTreeMap<(&'a str, &'a str), Vec<f64>>,
    agent: AgentLoad,
}

pub(super) fn run(cfg: &Cfg, rep: &mut Report) -> Result<()> {
    // One world per variant, all in force at once, their workloads taking turns slice by
    // slice (the machine's speed wanders within a second by more than what is measured);
    // from block to block every variant moves to the next world, so that the worlds' own
    // small differences weigh on every variant alike. Why, at length: docs/benchmarks.md,
    // "Worlds, slices, cycles" and "Blocks". The workloads and their sinks share one CPU.
    let mut worlds = Vec::new();
    for _ in VARIANTS {
        let w = World::on_cpu(cfg.cpu)?;
        let policy = w.write_policy("policy.yaml", &policy::aws(&Extra::default()))?;
        worlds.push((w, policy));
    }
    let mut samples = Samples::default();
    let blocks = VARIANTS.len();
    for block in 0..blocks {
        // Variant i in world (i + block) mod n; cycles shared out among the blocks.
        let placed: Vec<(Variant, &(World, PathBuf))> =
            VARIANTS.iter().enumerate().map(|(i, v)| (*v, &worlds[(i + block) % blocks])).collect();
        let cycles = cfg.cycles / blocks + usize::from(block < cfg.cycles % blocks);
        run_block(cfg, &placed, block, cycles, &mut samples)?;
    }
    let Samples { rate: results, per_cpu, agent: load } = samples;
    for s in &SCENARIOS {
        report_scenario(rep, s, &results);
    }
    // The work per CPU second of the workload, raw: on this VM it wanders as much as the rate
    // (the noise is the host's other tenants slowing the same CPU, not steal time the guest
    // could subtract), so it is kept for reading, not judged on.
    let per_cpu: serde_json::Map<String, serde_json::Value> = per_cpu
        .into_iter()
        .map(|((s, v), x)| (format!("{s}_{v}"), json!(significant(&x))))
        .collect();
    rep.detail("work_per_cpu_second", serde_json::Value::Object(per_cpu));
    let idle = (median(&load.rss_idle), median(&load.cpu_idle));
    let busy = (median(&load.rss_load), load.cpu_s / load.secs * 100.0);
    for (title, (rss, cpu), key) in [("at idle", idle, ""), ("under 1.", busy, "_load")] {
        rep.set_num(&format!("agent_rss_mib{key}"), rss);
        rep.set_num(
            &format!("agent_cpu_pct_{}", if key.is_empty() { "idle" } else { "load" }),
            cpu,
        );
        let value = format!("{rss:.1} MiB RSS, {cpu:.2} % CPU");
        rep.row(&format!("7. agent {title}"), "metadata-gate", value).target =
            format!("RSS < 32 MiB: {}", stats::met(rss < 32.0));
    }
    Ok(())
}

/// One block: the variants put in force in their worlds (`placed`), each scenario run for
/// `cycles` cycles, every variant checked to still enforce, then removed.
fn run_block(
    cfg: &Cfg,
    placed: &[(Variant, &(World, PathBuf))],
    block: usize,
    cycles: usize,
    samples: &mut Samples<'_>,
) -> Result<()> {
    let mut actives = Vec::new();
    for (v, (w, policy)) in placed {
        let v = if cfg.calibrate { Variant::None } else { *v };
        actives.push(variants::apply(v, w, policy, &cfg.bins)?);
    }
    let pid = actives.iter().find_map(|a| a.agent()).and_then(|a| a.pid());
    if let Some(pid) = pid {
        let idle = Duration::from_secs(1);
        let before = agent_usage(pid);
        std::thread::sleep(idle);
        if let (Some((_, c0)), Some((rss, c1))) = (before, agent_usage(pid)) {
            samples.agent.rss_idle.push(rss);
            samples.agent.cpu_idle.push((c1 - c0) / idle.as_secs_f64() * 100.0);
        }
    }
    for s in &SCENARIOS {
        // One workload per world, kept open; they take turns.
        let labels: Vec<String> =
            placed.iter().map(|p| format!("{} under {}", s.name, p.0.label())).collect();
        let slicers: Result<Vec<_>> =
            placed.iter().map(|(_, (w, _))| w.slicer(cfg, &w.workload, s.mode, s.port)).collect();
        let gate_connect = |k: usize| s.name == "connect" && placed[k].0 == Variant::Gate;
        // The agent's usage around each of the gate's connect slices.
        let before =
            |k: usize| (pid.filter(|_| gate_connect(k)).and_then(agent_usage), Instant::now());
        take_turns(cfg, &mut slicers?, &labels, cycles, before, |k, (before, t), rate, r| {
            let v = placed[k].0.key();
            samples.rate.entry((s.name, v)).or_default().push(rate);
            let cpu = r["cpu_s"].as_f64().unwrap_or(f64::NAN);
            let work = r["ops"].as_f64().or(r["bytes"].as_f64()).unwrap_or(f64::NAN);
            samples.per_cpu.entry((s.name, v)).or_default().push(work / cpu);
            if let (Some((_, c0)), Some((rss, c1))) = (before, pid.and_then(agent_usage)) {
                samples.agent.rss_load.push(rss);
                samples.agent.cpu_s += c1 - c0;
                samples.agent.secs += t.elapsed().as_secs_f64();
            }
        })?;
        eprintln!("   block {}/{} {:<8} {cycles} cycles", block + 1, VARIANTS.len(), s.name);
    }
    // Every variant still enforces after its block (an agent that died on the way would
    // otherwise have been measured as a gate).
    if !cfg.calibrate {
        for (v, (w, _)) in placed {
            variants::verify(*v, w, &cfg.bins)?;
        }
    }
    Ok(())
}

/// The method's core: `cycles` cycles, in each of which every workload runs one slice, in an
/// order that rotates from cycle to cycle. `before(k)` runs right before workload k's slice,
/// `after(k, before's value, rate, answer)` right after it; a slice with nothing done fails
/// the run, named by `labels[k]`.
pub(super) fn take_turns<T>(
    cfg: &Cfg,
    slicers: &mut [Slicer],
    labels: &[String],
    cycles: usize,
    mut before: impl FnMut(usize) -> T,
    mut after: impl FnMut(usize, T, f64, &Value),
) -> Result<()> {
    let order: Vec<usize> = (0..slicers.len()).collect();
    for cycle in 0..cycles {
        for (k, _) in rotated(&order, cycle) {
            let b = before(k);
            let r = slicers[k].slice(cfg.slice_ms).with_context(|| labels[k].clone())?;
            let rate = r["rate"].as_f64().unwrap_or(0.0);
            if rate <= 0.0 {
                bail!("{}: nothing done in a slice: {r}", labels[k]);
            }
            after(k, b, rate, &r);
        }
    }
    Ok(())
}

/// `v` to six significant digits (a run keeps thousands of raw samples in report.json).
pub(super) fn significant(v: &[f64]) -> Vec<f64> {
    v.iter()
        .map(|x| {
            if !x.is_finite() || *x == 0.0 {
                return *x;
            }
            let scale = 10f64.powi(5 - x.abs().log10().floor() as i32);
            (x * scale).round() / scale
        })
        .collect()
}

/// The rows, keys and verdicts of one scenario from its per-cycle rates.
fn report_scenario(rep: &mut Report, s: &Scenario, results: &BTreeMap<(&str, &str), Vec<f64>>) {
    let values = |v: Variant| results.get(&(s.name, v.key())).cloned().unwrap_or_default();
    let ratios = |v: Variant| stats::ratios(&values(v), &values(Variant::None));
    // The gate against each competitor: paired differences of the ratios, per cycle.
    let mut versus = Vec::new();
    let mut against_nft = Comparison::Undecided;
    for (other, label) in [(Variant::Nft, "nftables"), (Variant::Ipt, "iptables")] {
        let diff = stats::differences(&ratios(Variant::Gate), &ratios(other));
        let Some(iv) = stats::median_interval(&diff) else { continue };
        let verdict = stats::compare(&iv);
        let key = format!("{}_gate_minus_{}", s.key, other.key());
        rep.set_interval(&key, &iv);
        rep.verdict(&format!("{}_gate_vs_{}", s.name, other.key()), verdict.name());
        rep.detail(&key, json!({"interval": iv.to_json()}));
        let (name, (m, lo, hi)) = (verdict.name(), (iv.median, iv.lo, iv.hi));
        versus.push(format!("{label}: **{name}**, {m:+.3} [{lo:+.3}, {hi:+.3}]"));
        if other == Variant::Nft {
            against_nft = verdict;
        }
    }
    for v in VARIANTS {
        let iv = stats::median_interval(&ratios(v)).filter(|_| v != Variant::None);
        let all = values(v);
        // The raw rates, cycle by cycle (cycle i's ratio is values[i] / no gate's values[i]).
        rep.detail(&format!("{}_{}", s.name, v.key()), json!({"values": significant(&all)}));
        if let Some(iv) = &iv {
            rep.set_interval(&format!("{}_{}", s.key, v.key()), iv);
        }
        let mut target = String::new();
        if v == Variant::Gate {
            let at_least_nft = against_nft.as_target().name();
            rep.verdict(&format!("{}_gate_at_least_nft", s.name), at_least_nft);
            target = format!("≥ nftables: {at_least_nft}");
            if let (Some(floor), Some(iv)) = (s.floor, &iv) {
                let t = stats::at_least(iv, floor).name();
                rep.verdict(&format!("{}_gate_at_least_{floor}", s.name), t);
                target.push_str(&format!("; ≥ {floor}: {t}"));
            }
        }
        let value = if s.name == "bulk" {
            format!("{:.2} Gbit/s", median(&all) * 8.0 / 1e9)
        } else {
            format!("{} {}", si(median(&all)), s.unit)
        };
        let row = rep.row(s.title, v.label(), value);
        (row.ratio, row.target) = (iv, target);
        if v == Variant::Gate {
            row.versus = versus.join("; ");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::significant;

    #[test]
    fn six_significant_digits() {
        let v = significant(&[123_456_789.0, 0.012_345_678_9, -2.5, 0.0, f64::INFINITY]);
        assert_eq!(&v[..4], &[123_457_000.0, 0.012_345_7, -2.5, 0.0]);
        assert!(v[4].is_infinite());
        assert!(significant(&[f64::NAN])[0].is_nan());
    }
}
