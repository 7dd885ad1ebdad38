//! The metric families the agent exports, as a scrape sees them: the one list the agent's
//! encoder takes names and help from (a test there holds it to the exposition), and which
//! `cargo xtask manifests` reads to check that every PrometheusRule shipped in deploy/ queries
//! only metrics and labels that exist. Here rather than in the agent so that xtask, which
//! builds before the agent's eBPF toolchain is installed, can depend on it.

/// Counter or gauge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Samples are named `<name>_total`.
    Counter,
    Gauge,
}

/// One metric family.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    /// The name as registered (a counter's samples add `_total`).
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    /// The labels of its samples, besides those the scrape adds (job, instance, ...).
    pub labels: &'static [&'static str],
}

impl Family {
    /// The name a query uses: a counter's with `_total`.
    pub fn sample_name(&self) -> String {
        match self.kind {
            Kind::Counter => format!("{}_total", self.name),
            Kind::Gauge => self.name.to_owned(),
        }
    }
}

pub const DECISIONS: Family = Family {
    name: "metadata_gate_decisions",
    kind: Kind::Counter,
    help: "Hook invocations by hook and verdict (unmatched: destination not protected)",
    labels: &["hook", "verdict"],
};
pub const ENDPOINT_DECISIONS: Family = Family {
    name: "metadata_gate_endpoint_decisions",
    kind: Kind::Counter,
    help: "Decisions on traffic that matched a protected endpoint (reset when a policy is applied)",
    labels: &["endpoint", "verdict"],
};
pub const WORKLOAD_DENIALS: Family = Family {
    name: "metadata_gate_workload_denials",
    kind: Kind::Counter,
    help: "Denial events by workload (cgroup below the gated root; at most 256 workloads, the rest as _other)",
    labels: &["workload"],
};
pub const WORKLOAD_ACCESSES: Family = Family {
    name: "metadata_gate_workload_accesses",
    kind: Kind::Counter,
    help: "Accesses to protected endpoints by workload and verdict, allowed ones included (at most 256 workloads per verdict, the rest as _other)",
    labels: &["workload", "verdict"],
};
pub const EVENTS_LOST: Family = Family {
    name: "metadata_gate_events_lost",
    kind: Kind::Counter,
    help: "Denial events dropped because the ring buffer was full",
    labels: &[],
};
pub const POLICY_GENERATION: Family = Family {
    name: "metadata_gate_policy_generation",
    kind: Kind::Gauge,
    help: "Policies applied over the life of the pinned gate",
    labels: &[],
};
pub const MAP_ENTRIES: Family = Family {
    name: "metadata_gate_map_entries",
    kind: Kind::Gauge,
    help: "Entries the live policy holds per map",
    labels: &["map"],
};
pub const MAP_CAPACITY: Family = Family {
    name: "metadata_gate_map_capacity",
    kind: Kind::Gauge,
    help: "Entries one policy may hold per map",
    labels: &["map"],
};
pub const POLICY_RELOADS: Family = Family {
    name: "metadata_gate_policy_reloads",
    kind: Kind::Counter,
    help: "Policy reloads by result (failure: rejected, the last good policy stays)",
    labels: &["result"],
};
pub const POLICY_REJECTED: Family = Family {
    name: "metadata_gate_policy_rejected",
    kind: Kind::Gauge,
    help: "1 while the newest policy offered (file or ConfigMap) was rejected and the last good one stays in force; 0 once the newest is in force",
    labels: &[],
};
pub const REPAIRS: Family = Family {
    name: "metadata_gate_repairs",
    kind: Kind::Counter,
    help: "Parts of the gate found missing and put back by the running agent, by what",
    labels: &["what"],
};
pub const PREGATE_PACKET_SOCKETS: Family = Family {
    name: "metadata_gate_pregate_packet_sockets",
    kind: Kind::Gauge,
    help: "AF_PACKET sockets that gated processes opened before the gate (found at start; one that set PACKET_QDISC_BYPASS skips tc: restart its pod)",
    labels: &[],
};
pub const LSM_ENFORCING: Family = Family {
    name: "metadata_gate_lsm_enforcing",
    kind: Kind::Gauge,
    help: "1 while the LSM programs enforce; 0 where the kernel does not run the BPF LSM: 32-bit compat and io_uring setsockopt and packet capture by gated workloads stay open (see status)",
    labels: &[],
};
pub const NODE_ATTACH_FAILURES: Family = Family {
    name: "metadata_gate_node_attach_failures",
    kind: Kind::Gauge,
    help: "Interface directions the node-level program should be on but is not, or is on only while this agent runs (its link could not be pinned), at the last check (see the agent's log)",
    labels: &[],
};
pub const BOOT_STEP_FAILED: Family = Family {
    name: "metadata_gate_boot_step_failed",
    kind: Kind::Gauge,
    help: "1 when the boot step recorded on this boot that it could not close the gate before the kubelet started (see `gate-agent status` and the boot unit's journal)",
    labels: &[],
};
pub const PROXY_REQUESTS: Family = Family {
    name: "metadata_gate_proxy_requests",
    kind: Kind::Counter,
    help: "Requests the metadata proxy decided, by verdict (served, refused: 403, audited: served in audit mode though the policy would refuse it, failed: 502 from the metadata service) and reason",
    labels: &["verdict", "reason"],
};
pub const PROXY_RATE_LIMITED: Family = Family {
    name: "metadata_gate_proxy_rate_limited",
    kind: Kind::Counter,
    help: "Requests the metadata proxy answered 429 because their workload was over its rate (the policy's rate, or served's default), by workload (at most 256 workloads, the rest as _other)",
    labels: &["workload"],
};
pub const PROXY_CONNECTIONS_REFUSED: Family = Family {
    name: "metadata_gate_proxy_connections_refused",
    kind: Kind::Counter,
    help: "Connections to the metadata proxy closed or answered 503 before a request was judged, by reason (no_record: the kernel recorded no caller; busy, busy_node: the pod's or the proxy's connection bound; busy_served: a served pod, and only the slots kept for allow entries left; no_table, generation: no policy, or not the kernel's; timeout; malformed)",
    labels: &["reason"],
};
pub const PROXY_RECORDS_LOST: Family = Family {
    name: "metadata_gate_proxy_records_lost",
    kind: Kind::Counter,
    help: "Connections sent to the metadata proxy whose caller record found no room in the kernel's table of handshakes in flight: the proxy refused them (no_record)",
    labels: &[],
};
pub const PROXY_HANDSHAKES_OVER_QUOTA: Family = Family {
    name: "metadata_gate_proxy_handshakes_over_quota",
    kind: Kind::Counter,
    help: "Connects to the metadata proxy denied (EPERM, or refused there without a record) because their workload (pod) had 64 handshakes in flight already: one workload cannot fill the kernel's table for the others",
    labels: &[],
};
pub const PROXY_DIVERTED_PACKETS: Family = Family {
    name: "metadata_gate_proxy_diverted_packets",
    kind: Kind::Counter,
    help: "Packets of connections the kernel sent to the metadata proxy that were leaving for another address or port (a DNAT or route after the redirect: a hostPort, a Service externalIP on the proxy's port): dropped",
    labels: &[],
};
pub const PROXY_PATHS_UNTRACKED: Family = Family {
    name: "metadata_gate_proxy_paths_untracked",
    kind: Kind::Counter,
    help: "Requests the metadata proxy decided but could not add to its per-workload path record for report and suggest (over 128 paths for the workload, or a path over 256 bytes)",
    labels: &[],
};
pub const PROXY_CACHED_ANSWERS: Family = Family {
    name: "metadata_gate_proxy_cached_answers",
    kind: Kind::Gauge,
    help: "Answers the metadata proxy keeps and gives itself: values the platform documents as fixed for the instance's life (the instance id, region, zone, type, project)",
    labels: &[],
};
pub const PROXY_RECORDS_EXPIRED: Family = Family {
    name: "metadata_gate_proxy_records_expired",
    kind: Kind::Counter,
    help: "Caller records removed from the kernel's table of handshakes in flight after 30 s without the proxy's side of the handshake (a client that never completed it)",
    labels: &[],
};
pub const LISTENER_CONNECTIONS_REFUSED: Family = Family {
    name: "metadata_gate_listener_connections_refused",
    kind: Kind::Counter,
    help: "Connections to the agent's probe and metrics listeners (--listen, --metrics-listen) closed unanswered, by listener (probes, metrics) and reason (busy_peer, busy: the peer address's or the listener's connection bound; timeout: no request within the header-read timeout, or the connection outlived its time limit)",
    labels: &["listener", "reason"],
};

/// Every family the agent exports.
pub const ALL: &[Family] = &[
    DECISIONS,
    ENDPOINT_DECISIONS,
    WORKLOAD_DENIALS,
    WORKLOAD_ACCESSES,
    EVENTS_LOST,
    POLICY_GENERATION,
    MAP_ENTRIES,
    MAP_CAPACITY,
    POLICY_RELOADS,
    POLICY_REJECTED,
    REPAIRS,
    PREGATE_PACKET_SOCKETS,
    LSM_ENFORCING,
    NODE_ATTACH_FAILURES,
    BOOT_STEP_FAILED,
    PROXY_REQUESTS,
    PROXY_RATE_LIMITED,
    PROXY_CONNECTIONS_REFUSED,
    PROXY_RECORDS_LOST,
    PROXY_HANDSHAKES_OVER_QUOTA,
    PROXY_DIVERTED_PACKETS,
    PROXY_RECORDS_EXPIRED,
    PROXY_PATHS_UNTRACKED,
    PROXY_CACHED_ANSWERS,
    LISTENER_CONNECTIONS_REFUSED,
];
