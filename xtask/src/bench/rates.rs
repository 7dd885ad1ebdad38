//! Scenarios 1–3 and 7: connect()+close() rate, small UDP sendto() rate and bulk TCP
//! throughput from the gated workload to an unprotected address over the veth, per variant;
//! the agent's memory and CPU at idle and under the connect loop.
use std::{collections::BTreeMap, time::Duration};

use anyhow::{Result, bail};
use integration_tests::bench::{self, BULK_PORT, CONNECT_PORT, DEST_V4, UDP_PORT};
use serde_json::json;

use super::{
    Cfg, Report, agent_usage, median,
    policy::{self, Extra},
    report::si,
    variants::{self, Variant},
    world::World,
};

pub(super) const SCENARIOS: [(&str, &str, u16, &str); 3] = [
    ("connect", "connect-rate", CONNECT_PORT, "connect()+close()/s"),
    ("udp", "udp-rate", UDP_PORT, "sendto()/s"),
    ("bulk", "bulk", BULK_PORT, "bytes/s"),
];

pub(super) fn run(cfg: &Cfg, rep: &mut Report) -> Result<()> {
    let w = World::new()?;
    let policy =
        w.write_policy("policy.yaml", &policy::aws(&Extra { endpoints: vec![], allow: vec![] }))?;
    let vs = [Variant::None, Variant::Gate, Variant::Nft, Variant::Ipt];
    // results[(scenario, variant)][round]
    let mut results: BTreeMap<(&str, &str), Vec<f64>> = BTreeMap::new();
    let (mut rss_idle, mut cpu_idle, mut rss_load, mut cpu_load) = (vec![], vec![], vec![], vec![]);
    for round in 0..cfg.rounds {
        for i in 0..vs.len() {
            let v = vs[(i + round) % vs.len()];
            let active = variants::apply(v, &w, &policy, &cfg.bins)?;
            let pid = active.agent().and_then(|a| a.pid());
            if let Some(pid) = pid {
                let idle = Duration::from_secs(1);
                let before = agent_usage(pid);
                std::thread::sleep(idle);
                if let (Some((_, c0)), Some((rss, c1))) = (before, agent_usage(pid)) {
                    rss_idle.push(rss);
                    cpu_idle.push((c1 - c0) / idle.as_secs_f64() * 100.0);
                }
            }
            for (name, mode, port, _) in SCENARIOS {
                let before = pid.and_then(agent_usage);
                let t = std::time::Instant::now();
                let port = port.to_string();
                let r = bench::run(
                    &cfg.bins,
                    &w.net,
                    &w.workload,
                    &[mode, DEST_V4, &port, &cfg.secs_arg()],
                )?;
                let rate = r["rate"].as_f64().unwrap_or(0.0);
                if r["ok"] != true || rate <= 0.0 {
                    bail!("{name} under {}: {r}", v.label());
                }
                results.entry((name, v.key())).or_default().push(rate);
                if name == "connect"
                    && let (Some((_, c0)), Some((rss, c1))) = (before, pid.and_then(agent_usage))
                {
                    rss_load.push(rss);
                    cpu_load.push((c1 - c0) / t.elapsed().as_secs_f64() * 100.0);
                }
                let slowest =
                    r["max_us"].as_u64().map_or(String::new(), |m| format!(" (slowest {m} µs)"));
                eprintln!("   round {round} {:<16} {name:<8} {}/s{slowest}", v.label(), si(rate));
            }
        }
    }
    for (name, _, _, unit) in SCENARIOS {
        let none = results.get(&(name, "none")).cloned().unwrap_or_default();
        for v in vs {
            let rates = results.get(&(name, v.key())).cloned().unwrap_or_default();
            // Paired per round, then the median: slow drifts of the machine cancel out.
            let ratios: Vec<f64> = rates.iter().zip(&none).map(|(a, b)| a / b).collect();
            let ratio = median(&ratios);
            let key = match name {
                "connect" => format!("connect_rate_ratio_{}", v.key()),
                "udp" => format!("udp_rate_ratio_{}", v.key()),
                _ => format!("bulk_ratio_{}", v.key()),
            };
            if v != Variant::None {
                rep.set_num(&key, ratio);
            }
            rep.detail(&format!("{name}_{}", v.key()), json!({"rates": rates, "ratios": ratios}));
            let value = if name == "bulk" {
                format!("{:.2} Gbit/s", median(&rates) * 8.0 / 1e9)
            } else {
                format!("{} {unit}", si(median(&rates)))
            };
            let target = match (name, v) {
                (_, Variant::None) => "",
                ("bulk", Variant::Gate) => "≥ 0.99",
                (_, Variant::Gate) => "≥ 0.98 and ≥ nft",
                _ => "",
            };
            let scenario = match name {
                "connect" => "1. TCP connect rate",
                "udp" => "2. UDP sendto rate",
                _ => "3. bulk TCP over veth",
            };
            rep.row(scenario, v.label(), value, (v != Variant::None).then_some(ratio), target);
        }
    }
    let (ri, ci, rl, cl) =
        (median(&rss_idle), median(&cpu_idle), median(&rss_load), median(&cpu_load));
    rep.set_num("agent_rss_mib", ri);
    rep.set_num("agent_rss_mib_load", rl);
    rep.set_num("agent_cpu_pct_idle", ci);
    rep.set_num("agent_cpu_pct_load", cl);
    rep.row(
        "7. agent at idle",
        "metadata-gate",
        format!("{ri:.1} MiB RSS, {ci:.2} % CPU"),
        None,
        "RSS < 32 MiB",
    );
    rep.row(
        "7. agent under 1.",
        "metadata-gate",
        format!("{rl:.1} MiB RSS, {cl:.2} % CPU"),
        None,
        "RSS < 32 MiB",
    );
    Ok(())
}
