//! Prometheus metrics. Kernel counters are read from the maps at scrape time; agent-side
//! counters (reloads, denials by workload) are kept here. Names, help and labels come from
//! [`families`], the catalog that the shipped alerting rules are checked against.
use std::sync::{Arc, Mutex};

use gate_common::metrics as families;

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

use crate::{
    events::EventSinks,
    loader::{Gate, Stats},
};
use families::{
    BOOT_STEP_FAILED, DECISIONS, ENDPOINT_DECISIONS, EVENTS_LOST, Kind,
    LISTENER_CONNECTIONS_REFUSED, LSM_ENFORCING, MAP_CAPACITY, MAP_ENTRIES, NODE_ATTACH_FAILURES,
    POLICY_GENERATION, POLICY_REJECTED, POLICY_RELOADS, PREGATE_PACKET_SOCKETS,
    PROXY_CACHED_ANSWERS, PROXY_CONNECTIONS_REFUSED, PROXY_DIVERTED_PACKETS,
    PROXY_HANDSHAKES_OVER_QUOTA, PROXY_PATHS_UNTRACKED, PROXY_RATE_LIMITED, PROXY_RECORDS_EXPIRED,
    PROXY_RECORDS_LOST, PROXY_REQUESTS, REPAIRS, WORKLOAD_ACCESSES, WORKLOAD_DENIALS,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReloadLabels {
    /// `success`, `failure` or `unchanged`.
    pub result: &'static str,
}

/// Agent-side metrics the rest of the agent updates.
#[derive(Clone)]
pub(crate) struct AgentMetrics {
    pub reloads: Family<ReloadLabels, Counter>,
    pub repairs: Family<RepairLabels, Counter>,
    /// 1 while the newest policy offered was rejected (the last good one stays in force).
    pub policy_rejected: Gauge,
    /// AF_PACKET sockets held by gated processes since before the gate (found at start).
    pub pregate_packet_sockets: Gauge,
    /// 1 while the LSM programs enforce.
    pub lsm_enforcing: Gauge,
    /// Node-level attachments missing or not pinned at the last check.
    pub node_attach_failures: Gauge,
    /// 1 when the boot step's record of this boot says it could not close the gate.
    pub boot_step_failed: Gauge,
    /// The metadata proxy's counters.
    pub proxy: ProxyMetrics,
    /// The probe and metrics listeners' counters.
    pub listeners: ListenerMetrics,
}

/// Every `result` of a reload.
pub(crate) const RELOAD_RESULTS: [&str; 3] = ["success", "failure", "unchanged"];
/// Every part of the gate the agent repairs.
pub(crate) const REPAIRED: [&str; 5] = ["root", "link", "map-pin", "program-pin", "tc"];

impl Default for AgentMetrics {
    /// Every reload result and repaired part starts at 0, so that an alert on `increase()`
    /// sees the first one (a series that appears at 1 has not increased).
    fn default() -> Self {
        let m = AgentMetrics {
            reloads: Family::default(),
            repairs: Family::default(),
            policy_rejected: Gauge::default(),
            pregate_packet_sockets: Gauge::default(),
            lsm_enforcing: Gauge::default(),
            node_attach_failures: Gauge::default(),
            boot_step_failed: Gauge::default(),
            proxy: ProxyMetrics::default(),
            listeners: ListenerMetrics::default(),
        };
        for result in RELOAD_RESULTS {
            let _ = m.reloads.get_or_create(&ReloadLabels { result });
        }
        for what in REPAIRED {
            let _ = m.repairs.get_or_create(&RepairLabels { what });
        }
        m
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RepairLabels {
    /// `root`, `link`, `map-pin`, `program-pin` or `tc`.
    pub what: &'static str,
}

impl AgentMetrics {
    pub(crate) fn reload(&self, result: &'static str) {
        self.reloads.get_or_create(&ReloadLabels { result }).inc();
    }

    pub(crate) fn repaired(&self, what: &'static str) {
        self.repairs.get_or_create(&RepairLabels { what }).inc();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ProxyRequestLabels {
    /// `served`, `refused`, `audited` or `failed`.
    pub(crate) verdict: &'static str,
    /// One of `proxy::REQUEST_OUTCOMES`.
    pub(crate) reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WorkloadLabels {
    pub(crate) workload: String,
}

/// Workloads named in a per-workload family before the rest count as `_other`.
const WORKLOAD_LABELS: usize = 256;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ProxyRefusedLabels {
    /// One of `proxy::ConnRefusal`'s labels.
    pub(crate) reason: &'static str,
}

/// The metadata proxy's counters.
#[derive(Clone, Debug)]
pub(crate) struct ProxyMetrics {
    pub(crate) requests: Family<ProxyRequestLabels, Counter>,
    pub(crate) connections_refused: Family<ProxyRefusedLabels, Counter>,
    /// Records of handshakes in flight swept as stale.
    pub(crate) records_expired: Counter,
    /// Requests left out of the per-workload path record (see `proxy::PathLog`).
    pub(crate) paths_untracked: Counter,
    /// Answers the proxy keeps (see `proxy::Answers`).
    pub(crate) cached_answers: Gauge,
    /// Requests answered 429, by workload (at most [`WORKLOAD_LABELS`] names).
    pub(crate) rate_limited: Family<WorkloadLabels, Counter>,
    /// The names `rate_limited` has.
    rate_limited_names: Arc<Mutex<std::collections::HashSet<String>>>,
}

impl Default for ProxyMetrics {
    /// Every outcome starts at 0, as the reloads do.
    fn default() -> Self {
        let m = ProxyMetrics {
            requests: Family::default(),
            connections_refused: Family::default(),
            records_expired: Counter::default(),
            paths_untracked: Counter::default(),
            cached_answers: Gauge::default(),
            rate_limited: Family::default(),
            rate_limited_names: Arc::default(),
        };
        for (verdict, reason) in crate::proxy::REQUEST_OUTCOMES {
            let _ = m.requests.get_or_create(&ProxyRequestLabels { verdict, reason });
        }
        for why in crate::proxy::ConnRefusal::ALL {
            let _ =
                m.connections_refused.get_or_create(&ProxyRefusedLabels { reason: why.label() });
        }
        m
    }
}

impl ProxyMetrics {
    pub(crate) fn request(&self, verdict: &'static str, reason: &'static str) {
        self.requests.get_or_create(&ProxyRequestLabels { verdict, reason }).inc();
    }

    pub(crate) fn connection_refused(&self, why: crate::proxy::ConnRefusal) {
        self.connections_refused.get_or_create(&ProxyRefusedLabels { reason: why.label() }).inc();
    }

    /// A request of `workload` over its rate. Past [`WORKLOAD_LABELS`] names, new workloads
    /// count as `_other`, so that pods coming and going cannot grow the family.
    pub(crate) fn rate_limited(&self, workload: String) {
        let workload = {
            let mut names =
                self.rate_limited_names.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if names.contains(&workload) || names.len() < WORKLOAD_LABELS {
                names.insert(workload.clone());
                workload
            } else {
                crate::ratelimit::OTHER.to_owned()
            }
        };
        self.rate_limited.get_or_create(&WorkloadLabels { workload }).inc();
    }

    /// A workload's 429s.
    #[cfg(test)]
    pub(crate) fn rate_limited_of(&self, workload: &str) -> u64 {
        self.rate_limited.get_or_create(&WorkloadLabels { workload: workload.to_owned() }).get()
    }

    /// A request counter's value.
    #[cfg(test)]
    pub(crate) fn requests_of(&self, verdict: &'static str, reason: &'static str) -> u64 {
        self.requests.get_or_create(&ProxyRequestLabels { verdict, reason }).get()
    }

    /// A connection refusal counter's value.
    #[cfg(test)]
    pub(crate) fn refused_of(&self, why: crate::proxy::ConnRefusal) -> u64 {
        self.connections_refused.get_or_create(&ProxyRefusedLabels { reason: why.label() }).get()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ListenerRefusedLabels {
    /// One of [`crate::server::LISTENERS`].
    pub(crate) listener: &'static str,
    /// One of [`crate::server::Refusal`]'s labels.
    pub(crate) reason: &'static str,
}

/// The probe and metrics listeners' counters.
#[derive(Clone, Debug)]
pub(crate) struct ListenerMetrics {
    pub(crate) connections_refused: Family<ListenerRefusedLabels, Counter>,
}

impl Default for ListenerMetrics {
    /// Every listener and reason starts at 0, as the reloads do.
    fn default() -> Self {
        let m = ListenerMetrics { connections_refused: Family::default() };
        for listener in crate::server::LISTENERS {
            for why in crate::server::Refusal::ALL {
                let labels = ListenerRefusedLabels { listener, reason: why.label() };
                let _ = m.connections_refused.get_or_create(&labels);
            }
        }
        m
    }
}

impl ListenerMetrics {
    pub(crate) fn connection_refused(&self, listener: &'static str, why: crate::server::Refusal) {
        let labels = ListenerRefusedLabels { listener, reason: why.label() };
        self.connections_refused.get_or_create(&labels).inc();
    }

    /// A refusal counter's value.
    #[cfg(test)]
    pub(crate) fn refused_of(&self, listener: &'static str, why: crate::server::Refusal) -> u64 {
        let labels = ListenerRefusedLabels { listener, reason: why.label() };
        self.connections_refused.get_or_create(&labels).get()
    }
}

/// What the collector needs: the gate (for its maps) and the event reader's state.
#[derive(Clone)]
pub(crate) struct Shared {
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

/// What one scrape reads from the gate and the event reader.
#[derive(Clone, Debug, Default)]
struct Snapshot {
    /// Endpoint names of the live policy, by index.
    names: Vec<String>,
    stats: Stats,
    generation: u64,
    /// (map, entries used, capacity)
    usage: Vec<(&'static str, usize, u32)>,
    denials_by_workload: Vec<(String, u64)>,
    /// Per verdict (`Counts::VERDICTS` order): accesses by workload.
    accesses: Option<[Vec<(String, u64)>; 4]>,
}

impl GateCollector {
    fn snapshot(&self) -> Option<Snapshot> {
        let names = self.0.sinks.endpoints.read().map(|n| n.clone()).unwrap_or_default();
        let (stats, generation, usage) = match self.0.gate.lock() {
            Ok(g) => match g.stats(names.len() as u32) {
                Ok(s) => (s, g.info().policy_generation, g.usage().to_vec()),
                Err(e) => {
                    tracing::warn!(error = %e, "reading counters for /metrics");
                    return None;
                }
            },
            Err(_) => return None,
        };
        let denials_by_workload =
            self.0.sinks.by_workload.lock().map(|c| c.snapshot()).unwrap_or_default();
        let accesses =
            self.0.sinks.accesses.lock().ok().map(|c| c.each_ref().map(|w| w.snapshot()));
        Some(Snapshot { names, stats, generation, usage, denials_by_workload, accesses })
    }
}

impl Collector for GateCollector {
    fn encode(&self, enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        match self.snapshot() {
            Some(s) => encode_snapshot(&s, enc),
            None => Ok(()),
        }
    }
}

/// The descriptor of a family of the catalog.
fn describe<'a>(
    enc: &'a mut DescriptorEncoder,
    f: &families::Family,
) -> Result<prometheus_client::encoding::MetricEncoder<'a>, std::fmt::Error> {
    let kind = match f.kind {
        Kind::Counter => MetricType::Counter,
        Kind::Gauge => MetricType::Gauge,
    };
    enc.encode_descriptor(f.name, f.help, None, kind)
}

fn encode_snapshot(s: &Snapshot, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let mut fam = describe(&mut enc, &DECISIONS)?;
    for (&hook, row) in Hook::ALL.iter().zip(&s.stats.decisions) {
        for (&verdict, &v) in Verdict::ALL.iter().zip(row) {
            let labels = [("hook", hook.name()), ("verdict", verdict.name())];
            ConstCounter::new(v).encode(fam.encode_family(&labels)?)?;
        }
    }

    let mut fam = describe(&mut enc, &ENDPOINT_DECISIONS)?;
    for (i, c) in s.stats.endpoints.iter().enumerate() {
        let name = s.names.get(i).map(String::as_str).unwrap_or("?");
        for (verdict, v) in [
            (Verdict::Allowed, c.allowed),
            (Verdict::Denied, c.denied),
            (Verdict::Audited, c.audited),
            (Verdict::Proxied, c.proxied),
        ] {
            let labels = [("endpoint", name), ("verdict", verdict.name())];
            ConstCounter::new(v).encode(fam.encode_family(&labels)?)?;
        }
    }

    let mut fam = describe(&mut enc, &WORKLOAD_DENIALS)?;
    for (workload, v) in &s.denials_by_workload {
        let labels = [("workload", workload.as_str())];
        ConstCounter::new(*v).encode(fam.encode_family(&labels)?)?;
    }

    let mut fam = describe(&mut enc, &WORKLOAD_ACCESSES)?;
    if let Some(by_verdict) = &s.accesses {
        for (verdict, counts) in crate::access::Counts::VERDICTS.iter().zip(by_verdict) {
            for (workload, v) in counts {
                let labels = [("workload", workload.as_str()), ("verdict", verdict.name())];
                ConstCounter::new(*v).encode(fam.encode_family(&labels)?)?;
            }
        }
    }

    let fam = describe(&mut enc, &EVENTS_LOST)?;
    ConstCounter::new(s.stats.events_lost).encode(fam)?;

    let fam = describe(&mut enc, &PROXY_RECORDS_LOST)?;
    ConstCounter::new(s.stats.pending_lost).encode(fam)?;
    let fam = describe(&mut enc, &PROXY_HANDSHAKES_OVER_QUOTA)?;
    ConstCounter::new(s.stats.pending_capped).encode(fam)?;
    let fam = describe(&mut enc, &PROXY_DIVERTED_PACKETS)?;
    ConstCounter::new(s.stats.proxy_diverted).encode(fam)?;

    let fam = describe(&mut enc, &POLICY_GENERATION)?;
    ConstGauge::new(s.generation as i64).encode(fam)?;

    let mut fam = describe(&mut enc, &MAP_ENTRIES)?;
    for &(map, used, _) in &s.usage {
        ConstGauge::new(used as i64).encode(fam.encode_family(&[("map", map)])?)?;
    }
    let mut fam = describe(&mut enc, &MAP_CAPACITY)?;
    for &(map, _, cap) in &s.usage {
        ConstGauge::new(i64::from(cap)).encode(fam.encode_family(&[("map", map)])?)?;
    }
    Ok(())
}

pub(crate) fn registry(shared: Shared, agent: &AgentMetrics) -> Registry {
    let mut r = Registry::default();
    register_agent(&mut r, agent);
    r.register_collector(Box::new(GateCollector(shared)));
    r
}

/// The agent-side families.
fn register_agent(r: &mut Registry, agent: &AgentMetrics) {
    r.register(POLICY_RELOADS.name, POLICY_RELOADS.help, agent.reloads.clone());
    r.register(REPAIRS.name, REPAIRS.help, agent.repairs.clone());
    r.register(POLICY_REJECTED.name, POLICY_REJECTED.help, agent.policy_rejected.clone());
    r.register(
        PREGATE_PACKET_SOCKETS.name,
        PREGATE_PACKET_SOCKETS.help,
        agent.pregate_packet_sockets.clone(),
    );
    r.register(LSM_ENFORCING.name, LSM_ENFORCING.help, agent.lsm_enforcing.clone());
    r.register(
        NODE_ATTACH_FAILURES.name,
        NODE_ATTACH_FAILURES.help,
        agent.node_attach_failures.clone(),
    );
    r.register(BOOT_STEP_FAILED.name, BOOT_STEP_FAILED.help, agent.boot_step_failed.clone());
    r.register(PROXY_REQUESTS.name, PROXY_REQUESTS.help, agent.proxy.requests.clone());
    r.register(PROXY_RATE_LIMITED.name, PROXY_RATE_LIMITED.help, agent.proxy.rate_limited.clone());
    r.register(
        PROXY_CONNECTIONS_REFUSED.name,
        PROXY_CONNECTIONS_REFUSED.help,
        agent.proxy.connections_refused.clone(),
    );
    r.register(
        PROXY_RECORDS_EXPIRED.name,
        PROXY_RECORDS_EXPIRED.help,
        agent.proxy.records_expired.clone(),
    );
    r.register(
        PROXY_PATHS_UNTRACKED.name,
        PROXY_PATHS_UNTRACKED.help,
        agent.proxy.paths_untracked.clone(),
    );
    r.register(
        PROXY_CACHED_ANSWERS.name,
        PROXY_CACHED_ANSWERS.help,
        agent.proxy.cached_answers.clone(),
    );
    r.register(
        LISTENER_CONNECTIONS_REFUSED.name,
        LISTENER_CONNECTIONS_REFUSED.help,
        agent.listeners.connections_refused.clone(),
    );
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use gate_common::abi::EndpointCounters;

    use super::*;

    /// A collector that encodes a fixed snapshot, standing in for the gate.
    #[derive(Debug)]
    struct Fixed(Snapshot);

    impl Collector for Fixed {
        fn encode(&self, enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            encode_snapshot(&self.0, enc)
        }
    }

    /// A scrape with at least one sample of every family.
    fn exposition() -> String {
        let one = |w: &str| vec![(w.to_owned(), 1)];
        let snapshot = Snapshot {
            names: vec!["ec2-imds".into()],
            stats: Stats {
                decisions: vec![vec![1; Verdict::ALL.len()]; Hook::ALL.len()],
                events_lost: 0,
                pending_lost: 0,
                pending_capped: 0,
                proxy_diverted: 0,
                endpoints: vec![EndpointCounters::default()],
            },
            generation: 1,
            usage: vec![("allowed", 1, 8)],
            denials_by_workload: one("ns/pod/c"),
            accesses: Some([one("ns/a/c"), one("ns/pod/c"), one("ns/b/c"), one("ns/p/c")]),
        };
        let agent = AgentMetrics::default();
        agent.reload("failure");
        agent.repaired("link");
        agent.pregate_packet_sockets.set(1);
        agent.proxy.rate_limited("ns/pod".into());
        let mut r = Registry::default();
        register_agent(&mut r, &agent);
        r.register_collector(Box::new(Fixed(snapshot)));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).expect("encode");
        text
    }

    /// The exposition's families (name → type) and each sample name's label names.
    fn parse(text: &str) -> (BTreeMap<String, String>, BTreeMap<String, BTreeSet<String>>) {
        let (mut types, mut samples) = (BTreeMap::new(), BTreeMap::new());
        for line in text.lines() {
            if let Some(t) = line.strip_prefix("# TYPE ") {
                let (name, kind) = t.split_once(' ').expect("TYPE line");
                types.insert(name.to_owned(), kind.to_owned());
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let series = line.rsplit_once(' ').expect("sample line").0;
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, l.trim_end_matches('}')),
                None => (series, ""),
            };
            let keys: BTreeSet<String> = labels
                .split(',')
                .filter(|l| !l.is_empty())
                .map(|l| l.split_once('=').expect("label").0.to_owned())
                .collect();
            let prev = samples.insert(name.to_owned(), keys.clone());
            assert!(prev.is_none_or(|p| p == keys), "{name}: label names differ between samples");
        }
        (types, samples)
    }

    #[test]
    fn the_exposition_is_the_catalog() {
        let text = exposition();
        let (types, samples) = parse(&text);
        let catalog: BTreeMap<String, String> = families::ALL
            .iter()
            .map(|f| {
                let kind = match f.kind {
                    Kind::Counter => "counter",
                    Kind::Gauge => "gauge",
                };
                (f.name.to_owned(), kind.to_owned())
            })
            .collect();
        assert_eq!(types, catalog, "families and types in the scrape vs families::ALL\n{text}");
        let want: BTreeMap<String, BTreeSet<String>> = families::ALL
            .iter()
            .map(|f| (f.sample_name(), f.labels.iter().map(|l| (*l).to_owned()).collect()))
            .collect();
        assert_eq!(samples, want, "sample names and labels vs families::ALL\n{text}");
    }

    #[test]
    fn rate_limited_workloads_are_bounded() {
        let m = ProxyMetrics::default();
        for i in 0..WORKLOAD_LABELS + 5 {
            m.rate_limited(format!("ns/pod-{i}"));
        }
        m.rate_limited("ns/pod-0".into());
        assert_eq!(m.rate_limited_of("ns/pod-0"), 2, "a named workload keeps its name");
        assert_eq!(m.rate_limited_of(crate::ratelimit::OTHER), 5);
    }

    #[test]
    fn reload_and_repair_counters_start_at_zero() {
        let text = exposition();
        for result in RELOAD_RESULTS {
            let want = if result == "failure" { 1 } else { 0 };
            let line = format!("metadata_gate_policy_reloads_total{{result=\"{result}\"}} {want}");
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
        for what in REPAIRED {
            let want = if what == "link" { 1 } else { 0 };
            let line = format!("metadata_gate_repairs_total{{what=\"{what}\"}} {want}");
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
    }

    #[test]
    fn sample_names() {
        assert_eq!(REPAIRS.sample_name(), "metadata_gate_repairs_total");
        assert_eq!(PREGATE_PACKET_SOCKETS.sample_name(), "metadata_gate_pregate_packet_sockets");
    }
}
