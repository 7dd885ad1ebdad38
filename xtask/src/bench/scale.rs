//! Scenario 5: the connect() rate of a gated workload relative to an ungated twin (same
//! depth, same netns, same moment) while the policy grows to 1, 100 and 10 000 allow
//! entries and endpoints, and the gated root to 1, 100 and 1 000 workload cgroups at
//! kubepods depth. The rate must not fall with size.
use anyhow::{Result, bail};
use integration_tests::bench::{self, CONNECT_PORT, DEST_V4};
use serde_json::json;

use super::{
    Cfg, Report, agent_usage, median,
    policy::{self, Extra},
    report::si,
    variants::{self, Variant},
    world::World,
};

fn pod(i: usize) -> String {
    let scope =
        if i % 2 == 1 { format!("crio-allowed-{i}.scope") } else { format!("crio-{i}.scope") };
    format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{i}.slice/{scope}")
}

pub(super) fn run(cfg: &Cfg, rep: &mut Report) -> Result<()> {
    let w = World::new()?;
    let port = CONNECT_PORT.to_string();
    let secs = cfg.secs_arg();
    let twin = w.cg.create(&format!("outside/{}", pod(0)))?;
    let gated0 = w.cg.create(&format!("gated/{}", pod(0)))?;
    let mut cgroups = 1;
    let sizes: [(&str, usize, usize); 6] = [
        ("entries", 1, 1),
        ("entries", 100, 1),
        ("entries", 10_000, 1),
        ("cgroups", 1, 1),
        ("cgroups", 1, 100),
        ("cgroups", 1, 1000),
    ];
    let mut base_entries = f64::NAN;
    for (dim, entries, ncg) in sizes {
        let text = if dim == "entries" {
            policy::scaled(entries)
        } else {
            policy::aws(&Extra {
                endpoints: vec![],
                allow: vec![(
                    "kubepods-allowed".into(),
                    "kubepods.slice/*/*/crio-allowed-*".into(),
                )],
            })
        };
        let policy = w.write_policy(&format!("scale-{dim}-{entries}-{ncg}.yaml"), &text)?;
        while cgroups < ncg {
            w.cg.create(&format!("gated/{}", pod(cgroups)))?;
            cgroups += 1;
        }
        let active = variants::apply(Variant::Gate, &w, &policy, &cfg.bins)?;
        let rss =
            active.agent().and_then(|a| a.pid()).and_then(agent_usage).map_or(f64::NAN, |u| u.0);
        let (mut gated, mut outside, mut ratios) = (vec![], vec![], vec![]);
        for round in 0..cfg.rounds {
            let mut pair = [0.0; 2];
            for k in 0..2 {
                let which = (k + round) % 2;
                let cg = if which == 0 { &twin } else { &gated0 };
                let r =
                    bench::run(&cfg.bins, &w.net, cg, &["connect-rate", DEST_V4, &port, &secs])?;
                let rate = r["rate"].as_f64().unwrap_or(0.0);
                if r["ok"] != true || rate <= 0.0 {
                    bail!("scale {dim} {entries}/{ncg}: {r}");
                }
                pair[which] = rate;
            }
            outside.push(pair[0]);
            gated.push(pair[1]);
            ratios.push(pair[1] / pair[0]);
        }
        drop(active);
        let ratio = median(&ratios);
        let (label, key) = if dim == "entries" {
            let k = if entries == 10_000 { "10k".to_string() } else { entries.to_string() };
            (format!("{entries} endpoints + allow entries"), format!("connect_rate_ratio_gate_{k}"))
        } else {
            (
                format!("{ncg} gated cgroups, 4 levels deep"),
                format!("connect_rate_ratio_gate_cg{ncg}"),
            )
        };
        if dim == "entries" && entries == 1 {
            base_entries = ratio;
        }
        eprintln!("   {label:<34} ratio {ratio:.3}, agent RSS {rss:.1} MiB");
        rep.set_num(&key, ratio);
        rep.detail(
            &format!("scale_{dim}_{entries}_{ncg}"),
            json!({"gated": gated, "outside": outside, "ratios": ratios, "agent_rss_mib": rss}),
        );
        let target =
            if dim == "entries" && entries == 10_000 { "within 1 % of 1 entry" } else { "" };
        rep.row(
            "5. scale: connect rate",
            &label,
            format!("{} /s, agent {rss:.1} MiB", si(median(&gated))),
            Some(ratio),
            target,
        );
    }
    if let Some(r10k) = rep.get("connect_rate_ratio_gate_10k") {
        rep.set_num("connect_rate_10k_vs_1_delta", r10k / base_entries - 1.0);
    }
    Ok(())
}
