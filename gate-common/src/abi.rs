//! Map layouts shared by kernel and user space.
//!
//! One file by intent, longer than the others: the whole kernel/user boundary in one place,
//! so that a change to it is seen whole and bumps [`ABI_VERSION`] once.
//!
//! Every type here is `#[repr(C)]` with explicit padding and a size assertion: the kernel sees
//! raw bytes, and a silent layout change would corrupt lookups. No `bool`, `enum` or `Option`
//! crosses this boundary; enumerations are `u8`/`u32` constants.
//!
//! Policy tables are *generational*: every key carries the generation (0 or 1) it belongs to,
//! and [`CONFIG`](names::CONFIG) slot [`CONFIG_ACTIVE_GEN`] names the live one. A program reads
//! the generation once per invocation, so it sees one complete policy, never half of two.

/// Bumped whenever a type, map or program below changes incompatibly; the agent pins under
/// `<pin-dir>/v<ABI_VERSION>/`.
pub const ABI_VERSION: u32 = 10;

/// Map names as they appear in the eBPF object (and under the pin dir).
pub mod names {
    pub const CONFIG: &str = "CONFIG";
    pub const POLICY_META: &str = "POLICY_META";
    pub const PREFIX_V4: &str = "PREFIX_V4";
    pub const PREFIX_V6: &str = "PREFIX_V6";
    pub const PORT_RULES: &str = "PORT_RULES";
    pub const ALLOWED: &str = "ALLOWED";
    pub const EP_COUNTERS: &str = "EP_COUNTERS";
    pub const STATS: &str = "STATS";
    pub const EVENTS: &str = "EVENTS";
    /// User space only: what was applied, for `status` while the agent is down.
    pub const GATE_INFO: &str = "GATE_INFO";
    /// User space only: endpoint names of each generation, for `status` and metrics.
    pub const EP_NAMES: &str = "EP_NAMES";
    /// The last [`RECENT_DENIALS`](super::RECENT_DENIALS) denials, a ring indexed by
    /// CONFIG[[`CONFIG_RECENT_CURSOR`](super::CONFIG_RECENT_CURSOR)], readable without the agent.
    pub const RECENT: &str = "RECENT";
    /// Who touched which protected endpoint ([`AccessKey`] → [`AccessStats`]): every
    /// allowed, denied and audited access counted with its last time (the audit report),
    /// and denial events to the ring buffer capped per key, so one hammering workload cannot
    /// crowd out another's.
    pub const ACCESS: &str = "ACCESS";
    /// Workload-facing interfaces (ifindex) where only an allowed gated socket passes to a
    /// protected endpoint; elsewhere a socket outside the gated root passes too.
    pub const STRICT_IFACES: &str = "STRICT_IFACES";
    pub const TRUSTED_IFACES: &str = "TRUSTED_IFACES";
    /// User space only: tc programs attached the clsact (netlink) way on kernels without tcx.
    /// Unlike tcx links they are not pinned files, so `cleanup` finds them here.
    pub const TC_CLSACT: &str = "TC_CLSACT";
    /// PREFILTER[0]: the packet programs' first and, for most traffic, only look at the
    /// policy ([`Prefilter`](super::Prefilter)): a superset of the live generation's
    /// first bytes, generation-free (see [`Prefilter::union`](super::Prefilter::union)).
    pub const PREFILTER: &str = "PREFILTER";
    /// PROXY[0]: where the agent's metadata proxy listens, and its cgroup
    /// ([`ProxyConfig`](super::ProxyConfig)). Zero: no proxy; a connection that would go
    /// through it is denied.
    pub const PROXY: &str = "PROXY";
    /// Socket storage: on a gated client's socket, which workload asked for which address
    /// ([`ProxyRecord`](super::ProxyRecord)) when its connect went to the proxy; moved to the
    /// proxy's accepted socket, where the proxy reads it.
    pub const SK_RECORDS: &str = "SK_RECORDS";
    /// Records between the client's handshake and the proxy's, keyed by the handshake's two
    /// initial sequence numbers ([`HandshakeKey`](super::HandshakeKey)). A plain hash, never
    /// an LRU: one workload's flood cannot evict another's record.
    pub const PENDING: &str = "PENDING";
    /// Records each workload has in PENDING (an LRU: a count lost to eviction only lets a
    /// workload have more, never denies one), so that one workload cannot fill it.
    pub const INFLIGHT: &str = "INFLIGHT";

    /// Every map of the object, in pin order.
    pub const ALL: [&str; 21] = [
        CONFIG,
        POLICY_META,
        PREFIX_V4,
        PREFIX_V6,
        PORT_RULES,
        ALLOWED,
        EP_COUNTERS,
        STATS,
        EVENTS,
        GATE_INFO,
        EP_NAMES,
        RECENT,
        ACCESS,
        STRICT_IFACES,
        TRUSTED_IFACES,
        TC_CLSACT,
        PREFILTER,
        PROXY,
        SK_RECORDS,
        PENDING,
        INFLIGHT,
    ];
}

// ---- limits --------------------------------------------------------------------------------

/// Endpoints in one policy (per generation; the maps hold two generations).
pub const MAX_ENDPOINTS: u32 = 16_384;
/// (prefix, port, protocol) rules one policy compiles to.
pub const MAX_PORT_RULES: u32 = 65_536;
/// Cgroups on the allow set of one generation.
pub const MAX_ALLOWED_CGROUPS: u32 = 65_536;
/// Levels below the gated root that the allow check walks. kubepods nests 3-4 deep.
pub const MAX_CGROUP_DEPTH: u32 = 32;
/// Ring buffer for denial events, bytes (power of two, multiple of the page size).
pub const EVENTS_BYTES: u32 = 256 * 1024;
/// clsact attachments recorded in TC_CLSACT (interfaces × directions).
pub const MAX_TC_ATTACHMENTS: u32 = 16_384;
/// (cgroup, endpoint) pairs ACCESS tracks (LRU: the least recently seen go first).
pub const MAX_ACCESS_KEYS: u32 = 65_536;
/// Events one cgroup may put on the ring buffer per endpoint and [`EVENT_WINDOW_NS`]; its
/// further denials are counted in ACCESS, not sent.
pub const EVENT_BURST: u32 = 16;
pub const EVENT_WINDOW_NS: u64 = 1_000_000_000;
/// Denials kept in the RECENT map (power of two).
pub const RECENT_DENIALS: u32 = 16;
/// Bytes of an endpoint name kept in EP_NAMES (longer names are cut).
pub const ENDPOINT_NAME_BYTES: usize = 64;

// ---- enumerations --------------------------------------------------------------------------

/// PolicyMeta.node_flags: forwarded traffic (it entered the node on an interface and carries
/// no socket by the time it leaves) bound for a protected endpoint is denied. Set in cluster
/// mode with every pod gated; clear where pod-network traffic is left to the SDN.
pub const NODE_GATE_FORWARDED: u32 = 1;

pub const MODE_ENFORCE: u32 = 0;
pub const MODE_AUDIT: u32 = 1;

/// Port 0 in a rule key: any port. Also what a packet without ports (ICMP, non-first
/// fragment) is looked up with, so only any-port rules match it.
pub const PORT_ANY: u16 = 0;
/// Protocol 0 in a rule key: any IP protocol.
pub const PROTO_ANY: u8 = 0;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// Endpoint index of a denial that names no endpoint: a frame whose network header could not
/// be read at all (decided as if it were bound for a protected address: fail closed), or a
/// denied side door (setsockopt).
pub const ENDPOINT_NONE: u32 = u32::MAX;

pub const VERDICT_UNMATCHED: u32 = 0;
pub const VERDICT_ALLOWED: u32 = 1;
pub const VERDICT_DENIED: u32 = 2;
pub const VERDICT_AUDITED: u32 = 3;
/// A connect sent to the agent's metadata proxy, which serves the paths the workload may
/// read and refuses the rest.
pub const VERDICT_PROXIED: u32 = 4;
pub const NUM_VERDICTS: u32 = 5;

pub const HOOK_CONNECT4: u32 = 0;
pub const HOOK_CONNECT6: u32 = 1;
/// cgroup_skb egress, IPv4 and IPv6: also where an unconnected UDP `sendto()` is judged
/// (ABI 4 dropped the sendmsg4/6 hooks: a denied datagram fails the call with EPERM here).
pub const HOOK_EGRESS4: u32 = 2;
pub const HOOK_EGRESS6: u32 = 3;
pub const HOOK_TC4: u32 = 4;
pub const HOOK_TC6: u32 = 5;
/// A side door around tc (PACKET_QDISC_BYPASS, AF_XDP) denied: by cgroup/setsockopt, or by
/// the LSM program that sees every syscall ABI (32-bit compat and io_uring included).
pub const HOOK_SETSOCKOPT: u32 = 6;
/// A socket that would read the node's IP traffic (AF_PACKET of an IP EtherType, raw IP of a
/// transport protocol) denied at `socket()` or `bind()` (LSM).
pub const HOOK_SOCKET: u32 = 7;
pub const NUM_HOOKS: u32 = 8;

/// STATS slot of a (hook, verdict) pair.
pub const fn stat_slot(hook: u32, verdict: u32) -> u32 {
    hook * NUM_VERDICTS + verdict
}
/// STATS slot counting events the ring buffer had no room for.
pub const STAT_EVENTS_LOST: u32 = NUM_HOOKS * NUM_VERDICTS;
/// STATS slot counting proxied handshakes whose record found no room in PENDING (the proxy
/// refuses those connections: no record).
pub const STAT_PENDING_LOST: u32 = STAT_EVENTS_LOST + 1;
/// STATS slot counting connects to the proxy denied because their workload had
/// [`MAX_PENDING_PER_WORKLOAD`] handshakes in flight already.
pub const STAT_PENDING_CAPPED: u32 = STAT_PENDING_LOST + 1;
/// STATS slot counting packets of connections sent to the proxy that were leaving for another
/// address or port (a DNAT or route after the redirect): dropped.
pub const STAT_PROXY_DIVERTED: u32 = STAT_PENDING_CAPPED + 1;
pub const NUM_STATS: u32 = STAT_PROXY_DIVERTED + 1;

pub const CONFIG_ACTIVE_GEN: u32 = 0;
/// Next RECENT slot to write (wraps; the slot is `cursor % RECENT_DENIALS`).
pub const CONFIG_RECENT_CURSOR: u32 = 1;
pub const NUM_CONFIG: u32 = 2;

// ---- PrefixValue.kinds bits: which rule-key shapes exist for a prefix ------------------------

pub const KIND_PORT_PROTO: u32 = 1;
pub const KIND_ANYPORT_PROTO: u32 = 1 << 1;
pub const KIND_PORT_ANYPROTO: u32 = 1 << 2;
pub const KIND_ANYPORT_ANYPROTO: u32 = 1 << 3;

// ---- map types -----------------------------------------------------------------------------

/// POLICY_META[generation]: settings that flip with the generation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyMeta {
    /// MODE_ENFORCE or MODE_AUDIT; any other value enforces.
    pub mode: u32,
    /// cgroup v2 level of the gated root (the cgroup the programs are attached to).
    pub root_level: u32,
    /// Number of endpoints, for status.
    pub endpoints: u32,
    /// NODE_* bits: how the node-level (tc) programs treat traffic without a socket.
    pub node_flags: u32,
    /// Non-zero: the policy serves paths to every gated workload no entry selects
    /// (`served`): their HTTP connects go to the proxy instead of being denied.
    pub served: u32,
    pub _pad: u32,
    /// cgroup v2 id of the gated root: tc programs, which see every packet of an interface,
    /// gate only sockets whose ancestor at `root_level` is this cgroup.
    pub root_id: u64,
    /// First bytes of the protected prefixes: most traffic is to no protected address at all
    /// and is let through on this bit test, without the LPM trie lookup.
    pub prefilter: Prefilter,
}

/// Per address family, a set of 65 536 (first byte, last byte) pairs: for every protected
/// prefix, each first byte it covers (all those a prefix shorter than /8 covers) paired
/// with each last byte it covers (every byte unless the prefix fixes bits of the last one:
/// a /32 or /128 fixes it whole). An address whose pair is not in the set is under no
/// protected prefix: 169.254.169.253, the metadata service's DNS neighbour, ends on the fast
/// path as surely as 10.0.0.1, and stays there when other prefixes bring other first or
/// last bytes (10.0.0.253/32 adds (10, 253), not (169, 253)).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefilter {
    pub v4: [u32; PREFILTER_WORDS],
    pub v6: [u32; PREFILTER_WORDS],
}

/// 65 536 bits per family.
pub const PREFILTER_WORDS: usize = 2048;

impl Default for Prefilter {
    fn default() -> Self {
        Prefilter { v4: [0; PREFILTER_WORDS], v6: [0; PREFILTER_WORDS] }
    }
}

/// The bytes whose top `keep` bits are those of `byte`: a contiguous range.
fn byte_range(byte: u8, keep: u32) -> core::ops::RangeInclusive<u8> {
    let mask: u8 = if keep == 0 { 0 } else { 0xff << (8 - keep.min(8)) };
    (byte & mask)..=(byte | !mask)
}

/// The bit of the pair (first, last): word and bit within it.
#[inline(always)]
fn pair_bit(first: u8, last: u8) -> (usize, u32) {
    let i = (usize::from(first) << 8) | usize::from(last);
    // `& (WORDS - 1)` is a no-op that shows the verifier the bound.
    ((i >> 5) & (PREFILTER_WORDS - 1), (i & 31) as u32)
}

impl Prefilter {
    /// Add a prefix: its address bytes (4 or 16, host bits clear or not) and length in bits.
    pub fn add(&mut self, v6: bool, addr: &[u8], len: u32) {
        let (first, last) = (addr.first().copied().unwrap_or(0), addr.last().copied().unwrap_or(0));
        let bits = addr.len() as u32 * 8;
        let set = if v6 { &mut self.v6 } else { &mut self.v4 };
        for f in byte_range(first, len.min(8)) {
            for l in byte_range(last, len.saturating_sub(bits.saturating_sub(8))) {
                let (w, b) = pair_bit(f, l);
                set[w] |= 1 << b;
            }
        }
    }

    /// Whether an address with this first and last byte may fall under a protected prefix.
    #[inline(always)]
    pub fn may(&self, v6: bool, first: u8, last: u8) -> bool {
        let set = if v6 { &self.v6 } else { &self.v4 };
        let (w, b) = pair_bit(first, last);
        set[w] & (1 << b) != 0
    }

    /// The filter that lets through only what both let through: what PREFILTER holds while a
    /// generation flips. The agent writes `live ∪ next` before the flip and `next` after it,
    /// so PREFILTER is at every moment a superset of the live generation's filter, whichever
    /// generation a program goes on to read (a torn read of a word mixes two supersets, bit
    /// for bit, and is one too).
    pub fn union(&self, other: &Prefilter) -> Prefilter {
        let mut out = *self;
        for (a, b) in [(&mut out.v4, &other.v4), (&mut out.v6, &other.v6)] {
            for (x, y) in a.iter_mut().zip(b) {
                *x |= y;
            }
        }
        out
    }
}

/// LPM trie data for IPv4: generation (big endian) then the address, so a lookup with
/// `prefix_len = 32 + 32` only ever matches entries of its own generation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PrefixV4 {
    pub generation: [u8; 4],
    pub addr: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PrefixV6 {
    pub generation: [u8; 4],
    pub addr: [u8; 16],
}

/// Bits of the generation field that precede the address in an LPM key.
pub const GEN_PREFIX_BITS: u32 = 32;

impl PrefixV4 {
    pub const fn new(generation: u32, addr: [u8; 4]) -> Self {
        Self { generation: generation.to_be_bytes(), addr }
    }
}

impl PrefixV6 {
    pub const fn new(generation: u32, addr: [u8; 16]) -> Self {
        Self { generation: generation.to_be_bytes(), addr }
    }
}

/// Value of both LPM tries.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixValue {
    /// Rule set of this prefix (key space of [`PortRuleKey::set_id`]).
    pub set_id: u32,
    /// KIND_* bits: which key shapes exist in the set, so lookups that cannot hit are skipped.
    pub kinds: u32,
    /// The lowest-indexed endpoint whose CIDR covers this prefix: what a packet whose
    /// transport cannot be read is judged against (address alone).
    pub endpoint: u32,
}

/// PORT_RULES key. `port == PORT_ANY` / `proto == PROTO_ANY` are wildcards.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRuleKey {
    pub generation: u32,
    pub set_id: u32,
    /// Host byte order.
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}

impl PortRuleKey {
    pub const fn new(generation: u32, set_id: u32, port: u16, proto: u8) -> Self {
        Self { generation, set_id, port, proto, _pad: 0 }
    }
}

/// ALLOWED key: a cgroup v2 id on the allow set of a generation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AllowKey {
    pub generation: u32,
    pub _pad: u32,
    pub cgroup_id: u64,
}

impl AllowKey {
    pub const fn new(generation: u32, cgroup_id: u64) -> Self {
        Self { generation, _pad: 0, cgroup_id }
    }
}

/// ALLOWED value: the allow entry that put the cgroup there (its index, low 24 bits) and
/// what the cgroup's entries grant (`GRANT_*`, high bits).
pub const ALLOW_ENTRY_MASK: u32 = (1 << 24) - 1;
/// Reach the protected endpoints (and keep the side doors around tc: PACKET_QDISC_BYPASS,
/// AF_XDP).
pub const GRANT_METADATA: u32 = 1 << 24;
/// Open sockets that read the node's IP traffic (an IDS): AF_PACKET of an IP EtherType, raw
/// IP of a transport protocol.
pub const GRANT_CAPTURE: u32 = 1 << 25;
pub const GRANTS_ALL: u32 = GRANT_METADATA | GRANT_CAPTURE;
/// Reach the protected endpoints' HTTP port through the agent's metadata proxy only, which
/// serves the entry's paths (an entry narrowed to `paths`).
pub const GRANT_PROXY: u32 = 1 << 26;

/// The ALLOWED value of allow entry `entry` granting `grants`.
#[inline(always)]
pub const fn allow_value(entry: u32, grants: u32) -> u32 {
    (entry & ALLOW_ENTRY_MASK) | (grants & !ALLOW_ENTRY_MASK)
}

/// The allow entry of an ALLOWED value.
#[inline(always)]
pub const fn allow_entry(value: u32) -> u32 {
    value & ALLOW_ENTRY_MASK
}

/// What a hook's decision needs an allow entry to grant: the sockets that read traffic need
/// [`GRANT_CAPTURE`], everything else [`GRANT_METADATA`].
#[inline(always)]
pub const fn grant_needed(hook: u32) -> u32 {
    if hook == HOOK_SOCKET { GRANT_CAPTURE } else { GRANT_METADATA }
}

/// EP_COUNTERS[endpoint]: decisions on traffic that matched the endpoint.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointCounters {
    pub allowed: u64,
    pub denied: u64,
    pub audited: u64,
    pub proxied: u64,
}

/// A denied (or, in audit mode, would-be denied) access, sent on EVENTS.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenyEvent {
    /// cgroup v2 id of the socket's (sock hooks: the calling task's) cgroup.
    pub cgroup_id: u64,
    /// CLOCK_MONOTONIC nanoseconds (bpf_ktime_get_ns) of the decision.
    pub ts_ns: u64,
    /// Destination; IPv4 in the first 4 bytes (network order).
    pub addr: [u8; 16],
    /// Thread group id; 0 where the kernel offers none (softirq egress).
    pub pid: u32,
    /// Index of the matched endpoint in the policy.
    pub endpoint: u32,
    /// Host byte order; 0 when the packet has no port.
    pub port: u16,
    pub proto: u8,
    /// 4 or 6.
    pub family: u8,
    /// VERDICT_DENIED or VERDICT_AUDITED.
    pub verdict: u8,
    /// HOOK_*.
    pub hook: u8,
    pub _pad: [u8; 2],
    pub comm: [u8; 16],
}

/// ACCESS key: a cgroup and the endpoint (index in the live policy, or [`ENDPOINT_NONE`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AccessKey {
    pub cgroup_id: u64,
    pub endpoint: u32,
    pub _pad: u32,
}

/// ACCESS value: the accesses of one cgroup to one endpoint since it was first seen.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AccessStats {
    /// Counts by verdict (atomic adds).
    pub allowed: u64,
    pub denied: u64,
    pub audited: u64,
    /// Connects sent to the metadata proxy (which counts their requests by path).
    pub proxied: u64,
    /// bpf_ktime_get_ns of the last access.
    pub last_ns: u64,
    /// Start of the current event window.
    pub window_start_ns: u64,
    /// Denial events sent in the current window.
    pub sent: u32,
    pub _pad: u32,
}

/// TERMINATE_* values of [`GateInfo::terminate`].
pub const TERMINATE_UNKNOWN: u32 = 0;
/// Established connections to protected endpoints are destroyed when a policy takes effect.
pub const TERMINATE_ON: u32 = 1;
/// Disabled by `--terminate-established=false`.
pub const TERMINATE_OFF: u32 = 2;
/// The kernel rejects socket destruction (no CONFIG_INET_DIAG_DESTROY).
pub const TERMINATE_UNSUPPORTED: u32 = 3;

/// GATE_INFO[0]: what the agent last applied. Written by user space only (after the flip),
/// read by `gate-agent status`, also while no agent runs, and by a restarted agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateInfo {
    /// Policies applied over the gate's life (survives agent restarts).
    pub policy_generation: u64,
    /// `Policy::hash()` of the live policy.
    pub policy_hash: u64,
    /// cgroup v2 id of the gated root the programs are attached to.
    pub root_cgroup_id: u64,
    /// Wall clock (ms since the Unix epoch) of the last apply.
    pub applied_at_ms: u64,
    /// Agent pid that applied it.
    pub agent_pid: u32,
    /// TERMINATE_*.
    pub terminate: u32,
    /// The last terminate-established scan: network namespaces scanned, and gated processes
    /// whose namespace the agent could not open (see `status`).
    pub terminate_netns: u32,
    pub terminate_hidden: u32,
    /// NUL-padded platform name of the policy.
    pub platform: [u8; 32],
    /// NUL-padded absolute path of the gated root (cut at 255 bytes).
    pub root_path: [u8; 256],
}

impl Default for GateInfo {
    fn default() -> Self {
        Self {
            policy_generation: 0,
            policy_hash: 0,
            root_cgroup_id: 0,
            applied_at_ms: 0,
            agent_pid: 0,
            terminate: TERMINATE_UNKNOWN,
            terminate_netns: 0,
            terminate_hidden: 0,
            platform: [0; 32],
            root_path: [0; 256],
        }
    }
}

/// The TCP port of a protected endpoint whose connects may go through the metadata proxy:
/// the metadata services' plain HTTP port. Other ports (DNS on 53, TLS endpoints) keep the
/// allow-or-deny verdicts.
pub const HTTP_PORT: u16 = 80;
/// [`ProxyRecord::entry`] of a workload no allow entry selects, served the policy's `served`
/// paths.
pub const ENTRY_SERVED: u32 = ALLOW_ENTRY_MASK;
/// Records in flight between a client's handshake and the proxy's (PENDING).
pub const MAX_PENDING: u32 = 65_536;
/// Records one workload (a pod: the parent of a container's cgroup, see
/// [`workload_of`](crate::verdict::workload_of)) may have in PENDING at once: a record
/// lives one round trip on the node, so a client needs only a few; above it the workload's
/// connects to the proxy are denied. PENDING fills only with a thousand workloads at it.
pub const MAX_PENDING_PER_WORKLOAD: u32 = 64;
/// Workloads INFLIGHT counts at once.
pub const MAX_INFLIGHT_WORKLOADS: u32 = 16_384;

/// [`ProxyConfig::families`] bits.
pub const PROXY_V4: u16 = 1;
pub const PROXY_V6: u16 = 2;

/// PROXY[0]: the metadata proxy's address and port, and its cgroup. Written by the agent once
/// the proxy's programs are in, cleared before they go out (port 0: no proxy, the connects it
/// would take are denied); left in place while the agent is down, so redirected connections
/// find a closed port (refused at once) rather than the endpoint.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyConfig {
    /// IPv4 address (network order bytes), valid with [`PROXY_V4`].
    pub addr_v4: [u8; 4],
    /// Host order; 0: no proxy.
    pub port: u16,
    /// PROXY_V4 | PROXY_V6: which addresses are set. An IPv6 connect without an IPv6
    /// address goes to the IPv4-mapped one.
    pub families: u16,
    pub addr_v6: [u8; 16],
    /// cgroup v2 id of the proxy (the agent's cgroup): the only one that may bind the
    /// port in the gated root.
    pub cgroup_id: u64,
}

/// SK_RECORDS and PENDING value: which gated workload opened a connection that went to the
/// proxy, under which decision, and what it asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyRecord {
    /// cgroup v2 id of the task that called connect().
    pub cgroup_id: u64,
    /// The address it asked for; IPv4 in the first 4 bytes (network order).
    pub addr: [u8; 16],
    /// Host order.
    pub port: u16,
    /// 1: `addr` is IPv6.
    pub v6: u8,
    /// 1: the connect was an IPv6 one (an IPv4-mapped address: getpeername gives it back
    /// mapped).
    pub via_v6: u8,
    /// The policy generation the decision was made under.
    pub generation: u32,
    /// The allow entry whose paths apply, or [`ENTRY_SERVED`].
    pub entry: u32,
    /// The endpoint matched.
    pub endpoint: u32,
    /// bpf_ktime_get_ns when recorded (stale PENDING entries are swept).
    pub ts_ns: u64,
    /// The workload (pod) the caller belongs to ([`workload_of`](crate::verdict::workload_of)):
    /// the unit of INFLIGHT's quota and of the proxy's connection slots.
    pub workload: u64,
    /// Client side: the key its record went into PENDING under, while `pending` is 1, so
    /// that the record leaves PENDING when the client's socket closes before the proxy's side
    /// of the handshake took it.
    pub handshake: HandshakeKey,
    pub pending: u32,
    pub _pad: u32,
}

/// PENDING key: a handshake's initial sequence numbers, as both ends see them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HandshakeKey {
    pub client_isn: u32,
    pub server_isn: u32,
}

/// TC_CLSACT key: `ifindex << 8 | direction` (0 ingress, 1 egress).
pub const fn tc_clsact_key(ifindex: u32, egress: bool) -> u64 {
    ((ifindex as u64) << 8) | egress as u64
}

/// TC_CLSACT value: where a clsact filter of ours lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcClsact {
    /// NUL-padded interface name.
    pub ifname: [u8; 16],
    /// NUL-padded network namespace path; empty: the agent's own.
    pub netns: [u8; 240],
}

/// EP_NAMES key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EpNameKey {
    pub generation: u32,
    pub index: u32,
}

/// EP_NAMES value: NUL-padded endpoint name.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointName {
    pub name: [u8; ENDPOINT_NAME_BYTES],
}

/// Copy `s` into a NUL-padded fixed buffer, cut at a char boundary so it stays UTF-8.
pub fn fixed_str<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    let mut end = s.len().min(N.saturating_sub(1));
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out[..end].copy_from_slice(&s.as_bytes()[..end]);
    out
}

/// The text of a NUL-padded fixed buffer.
pub fn fixed_str_value(b: &[u8]) -> &str {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    core::str::from_utf8(&b[..end]).unwrap_or("?")
}

const _: () = {
    use core::mem::size_of;
    assert!(size_of::<GateInfo>() == 336);
    assert!(size_of::<EpNameKey>() == 8);
    assert!(size_of::<TcClsact>() == 256);
    assert!(size_of::<EndpointName>() == ENDPOINT_NAME_BYTES);
    assert!(RECENT_DENIALS.is_power_of_two());
    assert!(size_of::<PolicyMeta>() == 16416);
    assert!(size_of::<ProxyConfig>() == 32);
    assert!(size_of::<ProxyRecord>() == 72);
    assert!(size_of::<HandshakeKey>() == 8);
    assert!(size_of::<Prefilter>() == 16384);
    assert!(size_of::<PrefixV4>() == 8);
    assert!(size_of::<PrefixV6>() == 20);
    assert!(size_of::<PrefixValue>() == 12);
    assert!(size_of::<PortRuleKey>() == 12);
    assert!(size_of::<AllowKey>() == 16);
    assert!(size_of::<EndpointCounters>() == 32);
    assert!(size_of::<DenyEvent>() == 64);
    assert!(size_of::<AccessKey>() == 16);
    assert!(size_of::<AccessStats>() == 56);
    assert!(EVENTS_BYTES.is_power_of_two());
};

#[cfg(test)]
mod prefilter_tests {
    use super::Prefilter;

    #[test]
    fn first_and_last_bytes_of_prefixes() {
        let mut p = Prefilter::default();
        p.add(false, &[169, 254, 169, 254], 32);
        assert!(p.may(false, 169, 254));
        // The DNS neighbour: same first byte, another last one.
        assert!(!p.may(false, 169, 253));
        assert!(!p.may(false, 168, 254) && !p.may(false, 10, 1) && !p.may(true, 169, 254));
        // A /30 fixes the top six bits of the last byte: 252..=255.
        p.add(false, &[100, 100, 100, 200], 30);
        assert!(p.may(false, 100, 200) && p.may(false, 100, 203) && !p.may(false, 100, 204));
        // A /4 (IPv6) covers 16 first bytes and every last one.
        let mut a = [0u8; 16];
        a[0] = 0x60;
        p.add(true, &a, 4);
        assert_eq!((0..=255u8).filter(|&b| p.may(true, b, 7)).count(), 16);
        assert!(p.may(true, 0x6f, 0) && !p.may(true, 0x70, 0));
        assert!((0..=255u8).all(|b| p.may(true, 0x60, b)));
        // Pairs, not two sets: 10.0.0.253/32 brings (10, 253), not (169, 253).
        p.add(false, &[10, 0, 0, 253], 32);
        assert!(p.may(false, 10, 253) && !p.may(false, 169, 253) && !p.may(false, 10, 254));
        // /0 covers everything.
        p.add(false, &[0; 4], 0);
        assert!((0..=255u8).all(|b| p.may(false, b, b ^ 0x5a)));
    }

    #[test]
    fn union_lets_through_only_what_both_do() {
        let (mut a, mut b) = (Prefilter::default(), Prefilter::default());
        a.add(false, &[169, 254, 169, 254], 32);
        b.add(false, &[100, 100, 100, 200], 32);
        let mut v6 = [0u8; 16];
        v6[0] = 0xfd;
        v6[15] = 0x54;
        b.add(true, &v6, 128);
        let u = a.union(&b);
        for v6 in [false, true] {
            for first in [0u8, 100, 169, 0xfd] {
                for last in [0u8, 0x54, 200, 254] {
                    let either = a.may(v6, first, last) || b.may(v6, first, last);
                    assert!(!either || u.may(v6, first, last), "{v6} {first} {last}");
                }
            }
        }
        // What neither filter holds stays out, mixed pairs included.
        assert!(!u.may(false, 10, 1));
        assert!(!u.may(false, 169, 200) && !u.may(false, 100, 254));
        assert_eq!(a.union(&a), a);
    }
}
