//! Prometheus metrics. Kernel counters are read from the maps at scrape time; agent-side
//! counters (reloads, denials by workload) are kept here.
use std::sync::{Arc, Mutex};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        MetricType, counter::ConstCounter, counter::Counter, family::Family, gauge::ConstGauge,
        gauge::Gauge,
    },
    registry::Registry,
};

use gate_common::user::{Hook, Verdict};

use crate::{events::EventSinks, loader::Gate};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    /// `success`, `failure` or `unchanged`.
    pub result: &'static str,
}

/// Agent-side metrics the rest of the agent updates.
#[derive(Clone, Default)]
pub struct AgentMetrics {
    pub reloads: Family<ReloadLabels, Counter>,
    pub repairs: Family<RepairLabels, Counter>,
    /// AF_PACKET sockets held by gated processes since before the gate (found at start).
    pub pregate_packet_sockets: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RepairLabels {
    /// `root`, `link`, `map-pin`, `program-pin` or `tc`.
    pub what: &'static str,
}

impl AgentMetrics {
    pub fn reload(&self, result: &'static str) {
        self.reloads.get_or_create(&ReloadLabels { result }).inc();
    }

    pub fn repaired(&self, what: &'static str) {
        self.repairs.get_or_create(&RepairLabels { what }).inc();
    }
}

/// What the collector needs: the gate (for its maps) and the event reader's state.
#[derive(Clone)]
pub struct Shared {
    pub gate: Arc<Mutex<Gate>>,
    pub sinks: EventSinks,
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
        let names = self.0.sinks.endpoints.read().map(|n| n.clone()).unwrap_or_default();
        let (stats, generation, usage) = match self.0.gate.lock() {
            Ok(g) => match g.stats(names.len() as u32) {
                Ok(s) => (s, g.info().policy_generation, g.usage()),
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
        for (&hook, row) in Hook::ALL.iter().zip(&stats.decisions) {
            for (&verdict, &v) in Verdict::ALL.iter().zip(row) {
                let labels = [("hook", hook.name()), ("verdict", verdict.name())];
                ConstCounter::new(v).encode(fam.encode_family(&labels)?)?;
            }
        }

        let mut fam = enc.encode_descriptor(
            "metadata_gate_endpoint_decisions",
            "Decisions on traffic that matched a protected endpoint (reset when a policy is applied)",
            None,
            MetricType::Counter,
        )?;
        for (i, c) in stats.endpoints.iter().enumerate() {
            let name = names.get(i).map(String::as_str).unwrap_or("?");
            for (verdict, v) in [
                (Verdict::Allowed, c.allowed),
                (Verdict::Denied, c.denied),
                (Verdict::Audited, c.audited),
            ] {
                let labels = [("endpoint", name), ("verdict", verdict.name())];
                ConstCounter::new(v).encode(fam.encode_family(&labels)?)?;
            }
        }

        let by_workload = self.0.sinks.by_workload.lock().map(|c| c.snapshot()).unwrap_or_default();
        let mut fam = enc.encode_descriptor(
            "metadata_gate_workload_denials",
            "Denial events by workload (cgroup below the gated root; at most 256 workloads, the rest as _other)",
            None,
            MetricType::Counter,
        )?;
        for (workload, v) in &by_workload {
            let labels = [("workload", workload.as_str())];
            ConstCounter::new(*v).encode(fam.encode_family(&labels)?)?;
        }

        let accesses = self.0.sinks.accesses.lock().map(|c| c.each_ref().map(|w| w.snapshot()));
        let mut fam = enc.encode_descriptor(
            "metadata_gate_workload_accesses",
            "Accesses to protected endpoints by workload and verdict, allowed ones included (at most 256 workloads per verdict, the rest as _other)",
            None,
            MetricType::Counter,
        )?;
        if let Ok(by_verdict) = accesses {
            let verdicts = [Verdict::Allowed, Verdict::Denied, Verdict::Audited];
            for (verdict, counts) in verdicts.iter().zip(by_verdict) {
                for (workload, v) in &counts {
                    let labels = [("workload", workload.as_str()), ("verdict", verdict.name())];
                    ConstCounter::new(*v).encode(fam.encode_family(&labels)?)?;
                }
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
            "Policies applied over the life of the pinned gate",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(generation as i64).encode(fam)?;

        let mut fam = enc.encode_descriptor(
            "metadata_gate_map_entries",
            "Entries the live policy holds per map",
            None,
            MetricType::Gauge,
        )?;
        for (map, used, _) in usage {
            ConstGauge::new(used as i64).encode(fam.encode_family(&[("map", map)])?)?;
        }
        let mut fam = enc.encode_descriptor(
            "metadata_gate_map_capacity",
            "Entries one policy may hold per map",
            None,
            MetricType::Gauge,
        )?;
        for (map, _, cap) in usage {
            ConstGauge::new(i64::from(cap)).encode(fam.encode_family(&[("map", map)])?)?;
        }
        Ok(())
    }
}

pub fn registry(shared: Shared, agent: &AgentMetrics) -> Registry {
    let mut r = Registry::default();
    r.register(
        "metadata_gate_policy_reloads",
        "Policy reloads by result (failure: refused, the last good policy stays)",
        agent.reloads.clone(),
    );
    r.register(
        "metadata_gate_repairs",
        "Parts of the gate found missing and put back by the running agent, by what",
        agent.repairs.clone(),
    );
    r.register(
        "metadata_gate_pregate_packet_sockets",
        "AF_PACKET sockets that gated processes opened before the gate (found at start; one that set PACKET_QDISC_BYPASS skips tc: restart its pod)",
        agent.pregate_packet_sockets.clone(),
    );
    r.register_collector(Box::new(GateCollector(shared)));
    r
}
