//! Prometheus metrics, read from the kernel counters at scrape time.
use std::sync::{Arc, Mutex, RwLock};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};

use crate::{events::hook_name, loader::Gate};

const VERDICTS: [&str; 4] = ["unmatched", "allowed", "denied", "audited"];

/// What the collector needs: the gate (for its maps) and the live policy's endpoint names.
#[derive(Clone)]
pub struct Shared {
    pub gate: Arc<Mutex<Gate>>,
    pub endpoints: Arc<RwLock<Vec<String>>>,
}

#[derive(Clone)]
struct GateCollector(Shared);

impl std::fmt::Debug for GateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GateCollector")
    }
}

impl Collector for GateCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let names = self.0.endpoints.read().map(|n| n.clone()).unwrap_or_default();
        let (stats, generation) = match self.0.gate.lock() {
            Ok(g) => match g.stats(names.len() as u32) {
                Ok(s) => (s, g.generation),
                Err(e) => {
                    tracing::warn!(error = %e, "reading counters for /metrics");
                    return Ok(());
                }
            },
            Err(_) => return Ok(()),
        };

        let mut fam = enc.encode_descriptor(
            "metadata_gate_decisions",
            "Hook invocations by hook and verdict (unmatched: destination not protected)",
            None,
            MetricType::Counter,
        )?;
        for (hook, row) in stats.decisions.iter().enumerate() {
            for (verdict, &v) in row.iter().enumerate() {
                let labels = [("hook", hook_name(hook as u8)), ("verdict", VERDICTS[verdict])];
                ConstCounter::new(v).encode(fam.encode_family(&labels)?)?;
            }
        }

        let mut fam = enc.encode_descriptor(
            "metadata_gate_endpoint_decisions",
            "Decisions on traffic that matched a protected endpoint",
            None,
            MetricType::Counter,
        )?;
        for (i, c) in stats.endpoints.iter().enumerate() {
            let name = names.get(i).map(String::as_str).unwrap_or("?");
            for (verdict, v) in
                [("allowed", c.allowed), ("denied", c.denied), ("audited", c.audited)]
            {
                let labels = [("endpoint", name), ("verdict", verdict)];
                ConstCounter::new(v).encode(fam.encode_family(&labels)?)?;
            }
        }

        let fam = enc.encode_descriptor(
            "metadata_gate_events_lost",
            "Denial events dropped because the ring buffer was full",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(stats.events_lost).encode(fam)?;

        let fam = enc.encode_descriptor(
            "metadata_gate_policy_generation",
            "Policies applied since the agent started",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(generation as i64).encode(fam)?;
        Ok(())
    }
}

pub fn registry(shared: Shared) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(GateCollector(shared)));
    r
}
