//! Scenario 4: how long a denied connect() takes to return to the workload: the gate
//! (EPERM from the connect hook), nftables reject (RST), nftables drop (the client's own
//! timeout), iptables REJECT. Samples of all rounds pooled; p50 and p99.
use std::collections::BTreeMap;

use anyhow::{Result, bail};
use integration_tests::net::IMDS_V4;
use serde_json::{Value, json};

use crate::{
    Cfg, Report, numbers, p50_p99,
    policy::{self, Extra},
    rotated, stats,
    variants::{self, Variant},
    workload,
    world::World,
};

pub(super) fn run(cfg: &Cfg, rep: &mut Report) -> Result<()> {
    let w = World::new()?;
    let policy = w.write_policy("policy.yaml", &policy::aws(&Extra::default()))?;
    let vs = [Variant::Gate, Variant::Nft, Variant::NftDrop, Variant::Ipt];
    let mut samples: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut errnos: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
    for round in 0..cfg.rounds {
        for (_, v) in rotated(&vs, round) {
            let _active = variants::apply(v, &w, &policy, &cfg.bins)?;
            let (n, timeout) = if v == Variant::NftDrop {
                (cfg.drop_n, cfg.drop_timeout_ms)
            } else {
                (cfg.deny_n, cfg.drop_timeout_ms.max(1000))
            };
            let r = workload::run(
                &cfg.bins,
                &w.net,
                &w.workload,
                &["deny", IMDS_V4, "80", &n.to_string(), &timeout.to_string()],
            )?;
            if r["ok"] != true {
                bail!("denied connect() under {}: a connect() was served: {r}", v.label());
            }
            samples.entry(v.key()).or_default().extend(numbers(&r["samples_us"]));
            errnos.entry(v.key()).or_default().push(r["errnos"].clone());
        }
    }
    for v in vs {
        let s = samples.get(v.key()).cloned().unwrap_or_default();
        let (p50, p99) = p50_p99(&s);
        let suffix = match v {
            Variant::Nft => "nft_reject".to_string(),
            _ => v.key().to_string(),
        };
        rep.set_num(&format!("deny_p50_us_{suffix}"), p50);
        rep.set_num(&format!("deny_p99_us_{suffix}"), p99);
        let errs = errnos.get(v.key()).cloned().unwrap_or_default();
        let how = errs
            .first()
            .and_then(Value::as_object)
            .map(|m| m.keys().cloned().collect::<Vec<_>>().join(", "))
            .unwrap_or_default();
        rep.detail(&format!("deny_{suffix}"), json!({"n": s.len(), "errnos": errs}));
        let value = if v == Variant::NftDrop {
            format!("p50 {:.0} ms, p99 {:.0} ms (timed out: {how})", p50 / 1000.0, p99 / 1000.0)
        } else {
            format!("p50 {p50:.1} µs, p99 {p99:.1} µs ({how})")
        };
        let met = stats::met(p99 < 50.0);
        if v == Variant::Gate {
            rep.verdict("deny_p99_under_50us", met);
        }
        let row = rep.row("4. denied connect() returns", v.label(), value);
        if v == Variant::Gate {
            row.target = format!("p99 < 50 µs: {met}");
        }
    }
    Ok(())
}
