//! The maps, two generations each (see gate_common::abi), and the policy maps as
//! gate-common's [`Tables`].
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::SkStorage,
    macros::{btf_map, map},
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf, lpm_trie::Key},
};
use gate_common::{
    abi::{
        AccessKey, AccessStats, AllowKey, DenyEvent, EVENTS_BYTES, EndpointCounters, EndpointName,
        EpNameKey, GEN_PREFIX_BITS, GateInfo, HandshakeKey, MAX_ACCESS_KEYS, MAX_ALLOWED_CGROUPS,
        MAX_ENDPOINTS, MAX_INFLIGHT_WORKLOADS, MAX_PENDING, MAX_PORT_RULES, MAX_TC_ATTACHMENTS,
        NUM_CONFIG, NUM_STATS, PolicyMeta, PortRuleKey, Prefilter, PrefixV4, PrefixV6, PrefixValue,
        ProxyConfig, ProxyRecord, RECENT_DENIALS, TcClsact,
    },
    verdict::{Addr, Tables, surely_unprotected},
};

#[map]
pub(crate) static CONFIG: Array<u32> = Array::with_max_entries(NUM_CONFIG, 0);
#[map]
pub(crate) static POLICY_META: Array<PolicyMeta> = Array::with_max_entries(2, 0);
#[map]
pub(crate) static PREFIX_V4: LpmTrie<PrefixV4, PrefixValue> =
    LpmTrie::with_max_entries(2 * MAX_ENDPOINTS, BPF_F_NO_PREALLOC);
#[map]
pub(crate) static PREFIX_V6: LpmTrie<PrefixV6, PrefixValue> =
    LpmTrie::with_max_entries(2 * MAX_ENDPOINTS, BPF_F_NO_PREALLOC);
#[map]
pub(crate) static PORT_RULES: HashMap<PortRuleKey, u32> =
    HashMap::with_max_entries(2 * MAX_PORT_RULES, BPF_F_NO_PREALLOC);
#[map]
pub(crate) static ALLOWED: HashMap<AllowKey, u32> =
    HashMap::with_max_entries(2 * MAX_ALLOWED_CGROUPS, BPF_F_NO_PREALLOC);
#[map]
pub(crate) static EP_COUNTERS: Array<EndpointCounters> = Array::with_max_entries(MAX_ENDPOINTS, 0);
#[map]
pub(crate) static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(NUM_STATS, 0);
#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);
#[map]
pub(crate) static RECENT: Array<DenyEvent> = Array::with_max_entries(RECENT_DENIALS, 0);
// Written and read by user space only; part of the object so that they are pinned with the
// rest and share its lifetime.
#[map]
pub(crate) static GATE_INFO: Array<GateInfo> = Array::with_max_entries(1, 0);
#[map]
pub(crate) static EP_NAMES: HashMap<EpNameKey, EndpointName> =
    HashMap::with_max_entries(2 * MAX_ENDPOINTS, BPF_F_NO_PREALLOC);
#[map]
pub(crate) static ACCESS: LruHashMap<AccessKey, AccessStats> =
    LruHashMap::with_max_entries(MAX_ACCESS_KEYS, 0);
#[map]
pub(crate) static STRICT_IFACES: HashMap<u32, u32> =
    HashMap::with_max_entries(MAX_TC_ATTACHMENTS, BPF_F_NO_PREALLOC);
/// Interfaces (ifindex) whose forwarded traffic the uplinks let through (`--tc-trusted-interface`).
#[map]
pub(crate) static TRUSTED_IFACES: HashMap<u32, u32> =
    HashMap::with_max_entries(MAX_TC_ATTACHMENTS, BPF_F_NO_PREALLOC);
#[map]
pub(crate) static TC_CLSACT: HashMap<u64, TcClsact> =
    HashMap::with_max_entries(MAX_TC_ATTACHMENTS, BPF_F_NO_PREALLOC);
/// The fast path's filter, generation-free: a superset of the live generation's at every
/// moment (see `Prefilter::union`).
#[map]
pub(crate) static PREFILTER: Array<Prefilter> = Array::with_max_entries(1, 0);

#[map]
pub(crate) static PROXY: Array<ProxyConfig> = Array::with_max_entries(1, 0);
/// Socket storage needs BTF for its value type: the one BTF-defined map of the object.
#[btf_map]
pub(crate) static SK_RECORDS: SkStorage<ProxyRecord> = SkStorage::new();
#[map]
pub(crate) static PENDING: HashMap<HandshakeKey, ProxyRecord> =
    HashMap::with_max_entries(MAX_PENDING, BPF_F_NO_PREALLOC);
/// Records each workload has in PENDING (see `gate_common::verdict::may_start_handshake`).
#[map]
pub(crate) static INFLIGHT: LruHashMap<u64, u32> =
    LruHashMap::with_max_entries(MAX_INFLIGHT_WORKLOADS, 0);

/// The policy maps as gate-common's [`Tables`].
pub(crate) struct KernelTables;

impl Tables for KernelTables {
    #[inline(always)]
    fn prefix_v4(&self, generation: u32, addr: [u8; 4]) -> Option<PrefixValue> {
        let key = Key::new(GEN_PREFIX_BITS + 32, PrefixV4::new(generation, addr));
        PREFIX_V4.get(&key).copied()
    }
    #[inline(always)]
    fn prefix_v6(&self, generation: u32, addr: [u8; 16]) -> Option<PrefixValue> {
        let key = Key::new(GEN_PREFIX_BITS + 128, PrefixV6::new(generation, addr));
        PREFIX_V6.get(&key).copied()
    }
    #[inline(always)]
    fn port_rule(&self, key: &PortRuleKey) -> Option<u32> {
        // SAFETY: the value is a plain u32 copied out at once.
        unsafe { PORT_RULES.get(key).copied() }
    }
    #[inline(always)]
    fn allowed(&self, key: &AllowKey) -> Option<u32> {
        // SAFETY: as above.
        unsafe { ALLOWED.get(key).copied() }
    }
    #[inline(always)]
    fn may_match(&self, generation: u32, addr: &Addr) -> bool {
        // Unreadable: it may (fail closed).
        let Some(meta) = POLICY_META.get(generation) else { return true };
        !surely_unprotected(&meta.prefilter, addr)
    }
}

/// Count one in statistics slot `slot` (`gate_common::abi`'s `STAT_*`).
#[inline(always)]
pub(crate) fn bump(slot: u32) {
    if let Some(p) = STATS.get_ptr_mut(slot) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *p += 1 }
    }
}
