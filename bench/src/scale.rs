//! Scenario 5: the connect() rate of a gated workload relative to an ungated twin (same
//! depth, same netns, same moment) while the policy grows to 1, 100 and 10 000 allow
//! entries and endpoints, and the gated root to 1, 100 and 1 000 workload cgroups at
//! kubepods depth. The rate must not fall with size: the median ratio at 10 000 entries
//! (1 000 cgroups) within the 95 % interval of the ratio at 1 entry (1 cgroup).
//!
//! Each size runs its own agent (as shipped), so sizes are not interleaved; the ungated
//! twin, measured in the same cycle in alternating 25 ms slices, carries the machine's
//! drift.
use anyhow::{Result, bail};
use serde_json::json;

use crate::{
    Cfg, Report, agent_usage, median,
    policy::{self, Extra},
    rates::{significant, take_turns},
    report::si,
    stats::{self, Interval},
    variants::{self, Variant},
    workload::CONNECT_PORT,
    world::World,
};

fn pod(i: usize) -> String {
    let scope =
        if i % 2 == 1 { format!("crio-allowed-{i}.scope") } else { format!("crio-{i}.scope") };
    format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{i}.slice/{scope}")
}

pub(super) fn run(cfg: &Cfg, rep: &mut Report) -> Result<()> {
    // The sinks and the workloads share one CPU, as in 1–3.
    let w = World::on_cpu(cfg.cpu)?;
    // Two workloads per cycle where 1–3 have four: half the cycles take as long.
    let cycles = (cfg.cycles / 2).max(1);
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
    // The interval of the smallest size of each dimension, the reference of the larger.
    let mut base: [Option<Interval>; 2] = [None, None];
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
        // The twin and the gated workload take turns, as the variants of scenarios 1–3 do.
        let mut slicers = [
            w.slicer(cfg, &twin, "connect-rate", CONNECT_PORT)?,
            w.slicer(cfg, &gated0, "connect-rate", CONNECT_PORT)?,
        ];
        let labels = ["twin", "gated"].map(|l| format!("scale {dim} {entries}/{ncg}, {l}"));
        let mut rates = [vec![], vec![]];
        take_turns(
            cfg,
            &mut slicers,
            &labels,
            cycles,
            |_| (),
            |k, (), rate, _| rates[k].push(rate),
        )?;
        let [outside, gated] = rates;
        let ratios = stats::ratios(&gated, &outside);
        drop(active);
        let Some(iv) = stats::median_interval(&ratios) else { bail!("scale {dim}: no rounds") };
        let (label, key) = if dim == "entries" {
            let k = if entries == 10_000 { "10k".to_string() } else { entries.to_string() };
            (format!("{entries} endpoints + allow entries"), format!("connect_rate_ratio_gate_{k}"))
        } else {
            (
                format!("{ncg} gated cgroups, 4 levels deep"),
                format!("connect_rate_ratio_gate_cg{ncg}"),
            )
        };
        let d = usize::from(dim != "entries");
        let smallest = if d == 0 { entries == 1 } else { ncg == 1 };
        if smallest {
            base[d] = Some(iv);
        }
        eprintln!("   {label:<34} ratio {}, agent RSS {rss:.1} MiB", iv.text());
        rep.set_interval(&key, &iv);
        rep.detail(
            &format!("scale_{dim}_{entries}_{ncg}"),
            json!({"gated": significant(&gated), "outside": significant(&outside), "agent_rss_mib": rss}),
        );
        let largest = (d == 0 && entries == 10_000) || (d == 1 && ncg == 1000);
        let target = match (largest, &base[d]) {
            (true, Some(reference)) => {
                let t = stats::within(&iv, reference);
                let what = if d == 0 { "1 entry" } else { "1 cgroup" };
                rep.verdict(&format!("scale_{dim}_flat"), t.name());
                format!("median within the interval of {what}: {}", t.name())
            }
            _ => String::new(),
        };
        let value = format!("{} /s, agent {rss:.1} MiB", si(median(&gated)));
        let row = rep.row("5. scale: connect rate (gated / ungated twin)", &label, value);
        (row.ratio, row.target) = (Some(iv), target);
    }
    if let (Some(r10k), Some(b)) = (rep.get("connect_rate_ratio_gate_10k"), &base[0]) {
        rep.set_num("connect_rate_10k_vs_1_delta", r10k / b.median - 1.0);
    }
    Ok(())
}
