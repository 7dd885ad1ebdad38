//! Scenario 10: a served path through the metadata proxy against the same request direct.
//! One agent with its proxy on; a workload whose allow entry lists the path goes through the
//! proxy, the allow-listed cgroup (whole access) goes direct, to the same answering metadata
//! service. Each request is a connection of its own, as metadata clients make them. Rounds
//! alternate the two; samples are pooled: p50 and p99 per request, requests per second, and
//! the agent's RSS and CPU per thousand proxied requests.
use std::collections::BTreeMap;

use anyhow::{Result, bail};
use integration_tests::{
    agent::Agent,
    net::{IMDS_V4, NODE_V4},
};
use serde_json::json;

use crate::{
    Cfg, Report, agent_usage, numbers, p50_p99, percentile, policy, rotated,
    workload::{self, ANSWER_BODY},
    world::World,
};

const PATH: &str = "/latest/meta-data/instance-id";
const PROXY_PORT: &str = "9254";

pub(super) fn run(cfg: &Cfg, rep: &mut Report) -> Result<()> {
    let w = World::new()?;
    let text = policy::aws(&policy::Extra::default())
        + &format!("  - name: reader\n    cgroup: \"workload\"\n    paths: [{PATH}]\n");
    let file = w.write_policy("policy.yaml", &text)?;
    let agent_cgroup = w.cg.create("agent")?;
    let agent = Agent::start_in_cgroup(
        &cfg.bins.under_test,
        &w.net.node_path(),
        &file,
        &w.cg.gated(),
        &agent_cgroup,
        &["--proxy-address", NODE_V4, "--proxy-port", PROXY_PORT],
    )?;
    let pid = agent.pid();
    let n = if cfg.quick { 50 } else { 500 };
    let ways = [("direct", &w.allowed), ("proxied", &w.workload)];
    let mut samples: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut rps: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let (mut proxied_cpu_s, mut proxied_requests, mut rss_mib) = (0.0, 0usize, 0.0f64);
    for round in 0..cfg.rounds {
        for (_, (way, cgroup)) in rotated(&ways, round) {
            let before = pid.and_then(agent_usage);
            let r = workload::run(
                &cfg.bins,
                &w.net,
                cgroup,
                &["http", IMDS_V4, "80", PATH, &n.to_string()],
            )?;
            if r["ok"] != true {
                bail!("{way} GET {PATH}: not every request was served: {}", r["statuses"]);
            }
            if let (Some((_, c0)), Some((rss, c1)), "proxied") =
                (before, pid.and_then(agent_usage), way)
            {
                proxied_cpu_s += c1 - c0;
                proxied_requests += n;
                rss_mib = rss_mib.max(rss);
            }
            samples.entry(way).or_default().extend(numbers(&r["samples_us"]));
            rps.entry(way).or_default().push(r["rps"].as_f64().unwrap_or(f64::NAN));
        }
    }
    drop(agent);
    let stat = |way: &str| {
        let s = samples.get(way).cloned().unwrap_or_default();
        let r = rps.get(way).cloned().unwrap_or_default();
        let (p50, p99) = p50_p99(&s);
        (p50, p99, percentile(&r, 50.0))
    };
    let (d50, d99, drps) = stat("direct");
    let (p50, p99, prps) = stat("proxied");
    let cpu_per_1k = proxied_cpu_s * 1000.0 / proxied_requests.max(1) as f64 * 1000.0;
    for (key, v) in [
        ("proxy_p50_us_direct", d50),
        ("proxy_p99_us_direct", d99),
        ("proxy_p50_us_proxied", p50),
        ("proxy_p99_us_proxied", p99),
        ("proxy_added_p50_us", p50 - d50),
        ("proxy_added_p99_us", p99 - d99),
        ("proxy_rps_direct", drps),
        ("proxy_rps_proxied", prps),
        ("proxy_rps_ratio", prps / drps),
        ("proxy_agent_rss_mib", rss_mib),
        ("proxy_agent_cpu_ms_per_1k", cpu_per_1k),
    ] {
        rep.set_num(key, v);
    }
    rep.detail(
        "proxy",
        json!({"path": PATH, "requests_per_run": n, "rounds": cfg.rounds, "answer": ANSWER_BODY}),
    );
    let section = "10. a served path: GET through the proxy vs direct";
    let direct = format!("p50 {d50:.0} µs, p99 {d99:.0} µs, {drps:.0} req/s");
    rep.row(section, "direct (allowed)", direct);
    let (a50, a99, ratio) = (p50 - d50, p99 - d99, prps / drps);
    let proxied = format!(
        "p50 {p50:.0} µs (+{a50:.0}), p99 {p99:.0} µs (+{a99:.0}), {prps:.0} req/s ({ratio:.2} of direct)"
    );
    rep.row(section, "through the proxy", proxied);
    let agent = format!("{rss_mib:.1} MiB RSS, {cpu_per_1k:.0} ms CPU per 1 000 requests");
    rep.row(section, "agent, proxying", agent);
    Ok(())
}
