//! metadata-gate kernel programs.
//!
//! Thin by design: read the destination from the context, ask gate-common's pure functions
//! (`verdict`, `packet`) for the verdict, count it, and report denials. All decisions live in
//! gate-common, which is unit- and property-tested on the host.
//!
//! * `cgroup/connect4|6`: refuse a TCP or UDP `connect()` with EPERM at the syscall, judged
//!   on the address the application named (before any NAT).
//! * `cgroup_skb/egress`: judges every packet of a gated socket as it leaves, after NAT: an
//!   unconnected UDP `sendto()` (refused here: the kernel hands the program's verdict back
//!   as EPERM from the very call), raw sockets, sockets connected before the gate existed.
//!   No sendmsg4/6 hooks: a datagram is judged once, not twice with the socket lock taken
//!   in between.
//! * `cgroup/setsockopt`: refuses the side doors around tc (PACKET_QDISC_BYPASS, AF_XDP).
//! * `tc` (`gate_tc`, node level): on the uplinks' egress and the workload-facing interfaces'
//!   ingress, refuses frames the cgroup hooks never judged: AF_PACKET sends, packets
//!   rewritten after the socket hooks, traffic forwarded from pods and VMs.
//!
//! Every path fails closed: a frame that cannot be read, or a map that cannot be, is decided
//! as if it were bound for a protected endpoint.
#![no_std]
#![no_main]
// The BPF target has no compare-and-swap, so `AtomicU64::fetch_add` is unavailable; the
// intrinsic lowers to the BPF atomic add instruction.
#![allow(internal_features)]
#![feature(core_intrinsics)]

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_comm, bpf_get_current_pid_tgid,
        bpf_ktime_get_ns,
        generated::{
            bpf_get_current_ancestor_cgroup_id, bpf_skb_ancestor_cgroup_id, bpf_skb_cgroup_id,
        },
    },
    macros::{cgroup_skb, cgroup_sock_addr, cgroup_sockopt, classifier, map},
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf, lpm_trie::Key},
    programs::{SkBuffContext, SockAddrContext, SockoptContext, TcContext, sk_buff::SkBuff},
};
use gate_common::{
    abi::{
        AccessKey, AccessStats, AllowKey, CONFIG_ACTIVE_GEN, CONFIG_RECENT_CURSOR, DenyEvent,
        ENDPOINT_NONE, EVENT_BURST, EVENT_WINDOW_NS, EVENTS_BYTES, EndpointCounters, EndpointName,
        EpNameKey, GEN_PREFIX_BITS, GateInfo, HOOK_CONNECT4, HOOK_CONNECT6, HOOK_EGRESS4,
        HOOK_EGRESS6, HOOK_SETSOCKOPT, HOOK_TC4, HOOK_TC6, MAX_ACCESS_KEYS, MAX_ALLOWED_CGROUPS,
        MAX_ENDPOINTS, MAX_PORT_RULES, MAX_TC_ATTACHMENTS, NODE_GATE_FORWARDED, NUM_CONFIG,
        NUM_STATS, PolicyMeta, PortRuleKey, Prefilter, PrefixV4, PrefixV6, PrefixValue,
        RECENT_DENIALS, STAT_EVENTS_LOST, TcClsact, VERDICT_ALLOWED, VERDICT_DENIED,
        VERDICT_UNMATCHED, stat_slot,
    },
    packet::{
        self, CARRIES_IPV4, CARRIES_IPV6, CARRIES_OTHER, ETH_P_IP, ETH_P_IPV6, Packet, Parsed,
        parse_ip, parse_ipv4, parse_ipv6, passes_fast_v4, passes_fast_v6,
    },
    verdict::{Addr, Dst, Tables, cgroup_allowed, decide, packet_subject, surely_unprotected},
};

// ---- maps (two generations each: see gate_common::abi) ---------------------------------------

#[map]
static CONFIG: Array<u32> = Array::with_max_entries(NUM_CONFIG, 0);
#[map]
static POLICY_META: Array<PolicyMeta> = Array::with_max_entries(2, 0);
#[map]
static PREFIX_V4: LpmTrie<PrefixV4, PrefixValue> =
    LpmTrie::with_max_entries(2 * MAX_ENDPOINTS, BPF_F_NO_PREALLOC);
#[map]
static PREFIX_V6: LpmTrie<PrefixV6, PrefixValue> =
    LpmTrie::with_max_entries(2 * MAX_ENDPOINTS, BPF_F_NO_PREALLOC);
#[map]
static PORT_RULES: HashMap<PortRuleKey, u32> =
    HashMap::with_max_entries(2 * MAX_PORT_RULES, BPF_F_NO_PREALLOC);
#[map]
static ALLOWED: HashMap<AllowKey, u32> =
    HashMap::with_max_entries(2 * MAX_ALLOWED_CGROUPS, BPF_F_NO_PREALLOC);
#[map]
static EP_COUNTERS: Array<EndpointCounters> = Array::with_max_entries(MAX_ENDPOINTS, 0);
#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(NUM_STATS, 0);
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);
#[map]
static RECENT: Array<DenyEvent> = Array::with_max_entries(RECENT_DENIALS, 0);
// Written and read by user space only; part of the object so that they are pinned with the
// rest and share its lifetime.
#[map]
static GATE_INFO: Array<GateInfo> = Array::with_max_entries(1, 0);
#[map]
static EP_NAMES: HashMap<EpNameKey, EndpointName> =
    HashMap::with_max_entries(2 * MAX_ENDPOINTS, BPF_F_NO_PREALLOC);
#[map]
static ACCESS: LruHashMap<AccessKey, AccessStats> =
    LruHashMap::with_max_entries(MAX_ACCESS_KEYS, 0);
#[map]
static STRICT_IFACES: HashMap<u32, u32> =
    HashMap::with_max_entries(MAX_TC_ATTACHMENTS, BPF_F_NO_PREALLOC);
#[map]
static TC_CLSACT: HashMap<u64, TcClsact> =
    HashMap::with_max_entries(MAX_TC_ATTACHMENTS, BPF_F_NO_PREALLOC);
/// The fast path's filter, generation-free: a superset of the live generation's at every
/// moment (see `Prefilter::union`).
#[map]
static PREFILTER: Array<Prefilter> = Array::with_max_entries(1, 0);

/// The policy maps as gate-common's [`Tables`].
struct KernelTables;

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
        let (first, last) = addr.first_last();
        meta.prefilter.may(addr.is_v6(), first, last)
    }
}

/// The packet of an sk_buff, for gate-common's parsers.
struct Skb<'a>(&'a SkBuff);

impl Packet for Skb<'_> {
    #[inline(always)]
    fn bytes<const N: usize>(&self, off: usize) -> Option<[u8; N]> {
        self.0.load::<[u8; N]>(off).ok()
    }
}

// ---- bookkeeping -----------------------------------------------------------------------------

#[inline(always)]
fn bump(slot: u32) {
    if let Some(p) = STATS.get_ptr_mut(slot) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *p += 1 }
    }
}

#[inline(always)]
fn count(hook: u32, verdict: u32) {
    bump(stat_slot(hook, verdict));
}

#[inline(always)]
fn count_endpoint(endpoint: u32, verdict: u32) {
    let Some(c) = EP_COUNTERS.get_ptr_mut(endpoint) else { return };
    // SAFETY: `c` points into the array map's value; counters are updated atomically because
    // the array is shared by all CPUs.
    unsafe {
        let field = match verdict {
            VERDICT_ALLOWED => &raw mut (*c).allowed,
            VERDICT_DENIED => &raw mut (*c).denied,
            _ => &raw mut (*c).audited,
        };
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(field, 1);
    }
}

/// Where the destination and the caller's identity come from.
struct Caller {
    hook: u32,
    /// Whether the current task is meaningful (process context).
    task: bool,
}

/// What a denial event records as its destination: the parsed one, none (an unreadable
/// frame), or the socket option a side door asked for.
enum Reported<'a> {
    Dst(&'a Dst),
    Unparsed,
    Sockopt { level: i32, optname: i32 },
}

#[inline(always)]
fn report(caller: &Caller, cgroup_id: u64, verdict: u32, endpoint: u32, what: Reported<'_>) {
    let mut addr = [0u8; 16];
    let (family, port, proto) = match what {
        Reported::Dst(dst) => {
            addr = *dst.addr.bytes();
            (if dst.addr.is_v6() { 6u8 } else { 4u8 }, dst.port, dst.proto)
        }
        Reported::Unparsed => (0, 0, 0),
        // The option level in the address field, the option name in the port.
        Reported::Sockopt { level, optname } => {
            addr[..4].copy_from_slice(&level.to_ne_bytes());
            (0, optname as u16, 0)
        }
    };
    let (pid, comm) = if caller.task {
        ((bpf_get_current_pid_tgid() >> 32) as u32, bpf_get_current_comm().unwrap_or([0; 16]))
    } else {
        (0, [0; 16])
    };
    let ev = DenyEvent {
        cgroup_id,
        // SAFETY: helper without arguments.
        ts_ns: unsafe { bpf_ktime_get_ns() },
        addr,
        pid,
        endpoint,
        port,
        proto,
        family,
        verdict: verdict as u8,
        hook: caller.hook as u8,
        _pad: [0; 2],
        comm,
    };
    remember(&ev);
    if !account(cgroup_id, endpoint, verdict, ev.ts_ns) {
        return;
    }
    match EVENTS.reserve::<DenyEvent>(0) {
        Some(mut entry) => {
            entry.write(ev);
            entry.submit(0);
        }
        None => bump(STAT_EVENTS_LOST),
    }
}

/// Count an access of `cgroup_id` to `endpoint` under its verdict, and say whether a denial
/// event may go on the ring buffer: at most EVENT_BURST per key and window. The counts are
/// exact (atomic); the window bookkeeping races harmlessly between CPUs (a few events more
/// or fewer in a window).
#[inline(always)]
fn account(cgroup_id: u64, endpoint: u32, verdict: u32, now: u64) -> bool {
    let key = AccessKey { cgroup_id, endpoint, _pad: 0 };
    let Some(st) = ACCESS.get_ptr_mut(key) else {
        let mut fresh =
            AccessStats { last_ns: now, window_start_ns: now, ..AccessStats::default() };
        match verdict {
            VERDICT_ALLOWED => fresh.allowed = 1,
            VERDICT_DENIED => fresh.denied = 1,
            _ => fresh.audited = 1,
        }
        fresh.sent = u32::from(verdict != VERDICT_ALLOWED);
        // A full LRU map evicts its least recently used entry; an insert that still fails
        // loses the count, not the event.
        let _ = ACCESS.insert(key, fresh, 0);
        return true;
    };
    // SAFETY: `st` points into the map's value; the counters are shared by all CPUs, hence
    // the atomic adds; the window fields are plain stores (see above).
    unsafe {
        let field = match verdict {
            VERDICT_ALLOWED => &raw mut (*st).allowed,
            VERDICT_DENIED => &raw mut (*st).denied,
            _ => &raw mut (*st).audited,
        };
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(field, 1);
        (*st).last_ns = now;
        if verdict == VERDICT_ALLOWED {
            return false;
        }
        if now.wrapping_sub((*st).window_start_ns) >= EVENT_WINDOW_NS {
            (*st).window_start_ns = now;
            (*st).sent = 0;
        }
        if (*st).sent >= EVENT_BURST {
            return false;
        }
        (*st).sent += 1;
    }
    true
}

/// Keep the event in the RECENT ring, which `gate-agent status` reads without the agent.
/// The cursor is bumped without an atomic fetch (which needs BPF cpu v3, newer than the
/// kernels we target): CPUs racing on a denial may overwrite one record, a diagnostic loss.
#[inline(always)]
fn remember(ev: &DenyEvent) {
    let Some(cursor) = CONFIG.get_ptr_mut(CONFIG_RECENT_CURSOR) else { return };
    // SAFETY: `cursor` points into the CONFIG array's value.
    let n = unsafe {
        let n = *cursor;
        *cursor = n.wrapping_add(1);
        n
    };
    if let Some(slot) = RECENT.get_ptr_mut(n & (RECENT_DENIALS - 1)) {
        // SAFETY: `slot` points into the RECENT array's value.
        unsafe { *slot = *ev }
    }
}

/// The live generation, or `None` when CONFIG cannot be read.
#[inline(always)]
fn live_generation() -> Option<u32> {
    CONFIG.get(CONFIG_ACTIVE_GEN).map(|g| *g & 1)
}

/// The connect hooks' fast path: whether traffic to `addr` surely concerns no protected
/// endpoint, by PREFILTER's bits for its first and last byte. One array read (inlined by the
/// verifier) and two bit tests, no generation. Unreadable: it may (fail closed).
#[inline(always)]
fn passes_fast(addr: &Addr) -> bool {
    PREFILTER.get(0).is_some_and(|f| surely_unprotected(f, addr))
}

/// The decision for traffic that is (or, unparsed, is taken to be) bound for `endpoint`.
/// Returns the verdict; counts it and reports anything not allowed.
#[inline(always)]
fn judge(
    caller: &Caller,
    generation: Option<u32>,
    endpoint: u32,
    what: Reported<'_>,
    cgroup_id: impl Fn() -> u64,
    ancestor: impl FnMut(u32) -> u64,
) -> u32 {
    // Without the generation or the policy's settings nothing can be allowed: deny.
    let meta = generation.and_then(|g| POLICY_META.get(g).map(|m| (g, m)));
    let verdict = match meta {
        Some((g, meta)) => {
            let allowed = cgroup_allowed(&KernelTables, g, meta.root_level, ancestor).is_some();
            decide(meta.mode, allowed)
        }
        None => VERDICT_DENIED,
    };
    count(caller.hook, verdict);
    count_endpoint(endpoint, verdict);
    if verdict == VERDICT_ALLOWED {
        // SAFETY: helper without arguments.
        account(cgroup_id(), endpoint, verdict, unsafe { bpf_ktime_get_ns() });
    } else {
        report(caller, cgroup_id(), verdict, endpoint, what);
    }
    verdict
}

/// The whole decision for one destination of a gated socket. Returns whether the traffic
/// may proceed. A packet whose destination cannot be known (unreadable, source-routed) is
/// decided as if bound for a protected endpoint.
#[inline(always)]
fn gate(
    caller: &Caller,
    p: &Parsed,
    cgroup_id: impl Fn() -> u64,
    ancestor: impl FnMut(u32) -> u64,
) -> bool {
    let generation = live_generation();
    let Some(endpoint) = packet_subject(&KernelTables, generation, p) else {
        count(caller.hook, VERDICT_UNMATCHED);
        return true;
    };
    let what = if p.readable { Reported::Dst(&p.dst) } else { Reported::Unparsed };
    judge(caller, generation, endpoint, what, cgroup_id, ancestor) != VERDICT_DENIED
}

// ---- socket hooks ----------------------------------------------------------------------------

#[inline(always)]
fn sock_addr(ctx: &SockAddrContext, hook: u32, v6: bool) -> i32 {
    // SAFETY: the context pointer is valid for the program's duration; fields are read-only.
    let sa = unsafe { &*ctx.sock_addr };
    let addr =
        if v6 { Addr::from_v6_words(sa.user_ip6) } else { Addr::v4(sa.user_ip4.to_ne_bytes()) };
    if passes_fast(&addr) {
        count(hook, VERDICT_UNMATCHED);
        return 1;
    }
    let dst = Dst { addr, port: u16::from_be(sa.user_port as u16), proto: sa.protocol as u8 };
    let parsed = Parsed::complete(dst);
    let caller = Caller { hook, task: true };
    // SAFETY: helper without pointer arguments.
    let cgroup_id = || unsafe { bpf_get_current_cgroup_id() };
    // SAFETY: helper without pointer arguments; returns 0 past the task's own level.
    let ancestor = |level: u32| unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
    i32::from(gate(&caller, &parsed, cgroup_id, ancestor))
}

#[cgroup_sock_addr(connect4)]
fn gate_connect4(ctx: SockAddrContext) -> i32 {
    sock_addr(&ctx, HOOK_CONNECT4, false)
}

#[cgroup_sock_addr(connect6)]
fn gate_connect6(ctx: SockAddrContext) -> i32 {
    sock_addr(&ctx, HOOK_CONNECT6, true)
}

// ---- setsockopt: side doors around tc ----------------------------------------------------------

const SOL_PACKET: i32 = 263;
const PACKET_QDISC_BYPASS: i32 = 20;
const SOL_XDP: i32 = 283;
/// XDP_RX_RING (2) … XDP_UMEM_COMPLETION_RING (6): what an AF_XDP socket needs before bind.
const XDP_FIRST_SETUP_OPT: i32 = 2;
const XDP_LAST_SETUP_OPT: i32 = 6;

/// Refuses, for gated cgroups not on the allow set, the socket options that let frames skip
/// tc egress: PACKET_QDISC_BYPASS (AF_PACKET straight to the driver) and the rings and UMEM
/// of AF_XDP. Everything else passes untouched.
#[cgroup_sockopt(setsockopt)]
fn gate_setsockopt(ctx: SockoptContext) -> i32 {
    // SAFETY: helper without pointer arguments; returns 0 past the task's own level.
    sockopt(&ctx, true, |level| unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) })
}

/// The same for kernels that offer cgroup/setsockopt programs neither the current task's
/// ancestors nor its pid (5.10 and the kernels of its time): the allow set cannot be
/// consulted, so the options are refused to every gated cgroup, allowed ones included (fail
/// closed; no metadata client needs them).
#[cgroup_sockopt(setsockopt)]
fn gate_sockopt_noallow(ctx: SockoptContext) -> i32 {
    sockopt(&ctx, false, |_| 0)
}

#[inline(always)]
fn sockopt(ctx: &SockoptContext, task: bool, ancestor: impl FnMut(u32) -> u64) -> i32 {
    // SAFETY: the context pointer is valid for the program's duration.
    let so = unsafe { &mut *ctx.sockopt };
    let (level, optname) = (so.level, so.optname);
    let side_door = (level == SOL_PACKET && optname == PACKET_QDISC_BYPASS)
        || (level == SOL_XDP && (XDP_FIRST_SETUP_OPT..=XDP_LAST_SETUP_OPT).contains(&optname));
    // optlen 0: the kernel uses the caller's own buffer, untouched; this also keeps options
    // longer than a page working on kernels that would otherwise refuse them.
    so.optlen = 0;
    if !side_door {
        return 1;
    }
    let caller = Caller { hook: HOOK_SETSOCKOPT, task };
    // SAFETY: helper without pointer arguments.
    let cgroup_id = || unsafe { bpf_get_current_cgroup_id() };
    let what = Reported::Sockopt { level, optname };
    let verdict = judge(&caller, live_generation(), ENDPOINT_NONE, what, cgroup_id, ancestor);
    i32::from(verdict != VERDICT_DENIED)
}

// ---- egress ----------------------------------------------------------------------------------

/// The packet's bytes `[off, off + N)` where they lie in the linear area, after one bounds
/// check: the fast paths read the few bytes they need in place, copying nothing.
#[inline(always)]
fn linear<const N: usize>(skb: &SkBuff, off: usize) -> Option<&[u8; N]> {
    // SAFETY: reads fields of the context.
    let (data, end) = unsafe { ((*skb.skb).data as usize, (*skb.skb).data_end as usize) };
    if data + off + N <= end {
        // SAFETY: bounds checked against data_end just above (the verifier checks it too);
        // a byte array has no alignment.
        Some(unsafe { &*((data + off) as *const [u8; N]) })
    } else {
        None
    }
}

/// The packet programs' fast path on the IP header at `l3` (IPv6 when `v6`): one bounds
/// check, four byte loads, one PREFILTER read and two bit tests (gate-common's
/// `passes_fast_v4`/`_v6`). True: the packet passes without another look.
#[inline(always)]
fn passes_fast_ip(skb: &SkBuff, l3: usize, v6: bool) -> bool {
    if v6 {
        let Some(h) = linear::<40>(skb, l3) else { return false };
        let Some(f) = PREFILTER.get(0) else { return false };
        passes_fast_v6(f, h[0], h[6], h[24], h[39])
    } else {
        let Some(h) = linear::<20>(skb, l3) else { return false };
        let Some(f) = PREFILTER.get(0) else { return false };
        passes_fast_v4(f, h[0], h[16], h[19])
    }
}

#[inline(always)]
fn egress(ctx: &SkBuffContext, task: bool) -> i32 {
    let skb = ctx.skb.skb;
    // The version nibble says which header; what is not IPv4 is taken for IPv6, whose fast
    // path checks the version itself (and the full parse fails closed on either).
    let v6 = linear::<20>(&ctx.skb, 0).is_some_and(|h| h[0] >> 4 == 6);
    if passes_fast_ip(&ctx.skb, 0, v6) {
        return 1;
    }
    let parsed = parse_ip(&Skb(&ctx.skb), 0);
    // A TCP reset without payload conveys nothing, and is what a socket destroyed by
    // --terminate-established sends: it passes unreported.
    if parsed.complete && parsed.rst {
        return 1;
    }
    let hook = if v6 { HOOK_EGRESS6 } else { HOOK_EGRESS4 };
    let caller = Caller { hook, task };
    // SAFETY: `skb` is the program's context pointer.
    let cgroup_id = || unsafe { bpf_skb_cgroup_id(skb) };
    // SAFETY: as above.
    let ancestor = |level: u32| unsafe { bpf_skb_ancestor_cgroup_id(skb, level as i32) };
    i32::from(gate(&caller, &parsed, cgroup_id, ancestor))
}

/// Egress with the sending task's pid and comm in denial events (kernels that offer
/// bpf_get_current_pid_tgid/comm to cgroup_skb programs).
#[cgroup_skb(egress)]
fn gate_egress(ctx: SkBuffContext) -> i32 {
    egress(&ctx, true)
}

/// The same without task helpers, for older kernels (the loader falls back to it when the
/// verifier refuses `gate_egress`).
#[cgroup_skb(egress)]
fn gate_egress_notask(ctx: SkBuffContext) -> i32 {
    egress(&ctx, false)
}

// ---- tc: the node level ------------------------------------------------------------------------

/// Pass on to whatever else is attached (TCX_NEXT; TC_ACT_UNSPEC for clsact: the same -1).
const TC_NEXT: i32 = -1;
const TC_ACT_SHOT: i32 = 2;

/// The node-level program, on the uplinks' egress and the workload-facing interfaces'
/// ingress. A frame bound for a protected endpoint (or that cannot be read) is refused when
/// * its socket belongs to a gated cgroup that is not allowed (AF_PACKET and other senders
///   the cgroup hooks do not see; the socket survives a veth hop), or
/// * it enters on a workload-facing interface without a socket (a VM, a forwarding loop
///   inside a pod's namespace, a decapsulated tunnel), or with a socket outside the gated
///   root where the interface is strict (STRICT_IFACES), or
/// * it leaves by an uplink, forwarded and without a socket, where the policy gates such
///   traffic (NODE_GATE_FORWARDED: pod-network traffic, Service DNAT after our ingress), or
/// * it was made on this node without a socket and carries more than a bare TCP segment
///   (a copy a netfilter rule made of a gated socket's packet).
///
/// Everything else goes on to the next program: host processes outside the gated root
/// (kubelet, CRI-O, the kernel's own sockets), replies, other addresses.
#[classifier]
fn gate_tc(ctx: TcContext) -> i32 {
    let skb = ctx.skb.skb;
    // Fast path: the Ethernet type and four bytes of the IP header.
    let ethertype = linear::<14>(&ctx.skb, 0).map(|e| u16::from_be_bytes([e[12], e[13]]));
    let fast = match ethertype {
        Some(ETH_P_IP) => passes_fast_ip(&ctx.skb, packet::ETH_HLEN, false),
        Some(ETH_P_IPV6) => passes_fast_ip(&ctx.skb, packet::ETH_HLEN, true),
        _ => false,
    };
    if fast {
        return TC_NEXT;
    }
    let pkt = Skb(&ctx.skb);
    let net = packet::network_of_frame(&pkt);
    let (parsed, hook) = match net.carries {
        CARRIES_OTHER => return TC_NEXT,
        CARRIES_IPV4 => (parse_ipv4(&pkt, net.l3 as usize), HOOK_TC4),
        CARRIES_IPV6 => (parse_ipv6(&pkt, net.l3 as usize), HOOK_TC6),
        _ => (Parsed::UNREADABLE, HOOK_TC4),
    };
    if parsed.complete && parsed.rst {
        return TC_NEXT;
    }
    let generation = live_generation();
    let Some(endpoint) = packet_subject(&KernelTables, generation, &parsed) else {
        return TC_NEXT;
    };
    let meta = generation.and_then(|g| POLICY_META.get(g));
    // SAFETY: `skb` is the program's context pointer.
    let cgroup_id = unsafe { bpf_skb_cgroup_id(skb) };
    // SAFETY: as above.
    let ancestor = |level: u32| unsafe { bpf_skb_ancestor_cgroup_id(skb, level as i32) };
    // SAFETY: reads fields of the context.
    let (ifindex, ingress_ifindex) = unsafe { ((*skb).ifindex, (*skb).ingress_ifindex) };
    // On ingress the frame is being received by this very interface.
    let on_ingress = ingress_ifindex != 0 && ingress_ifindex == ifindex;
    if cgroup_id != 0 {
        // A socket. Outside the gated root (a host process, the kernel's own): not ours,
        // unless it enters a strict workload-facing interface.
        let gated = match meta {
            Some(m) => ancestor(m.root_level) == m.root_id,
            None => true,
        };
        // SAFETY: the value is not read.
        let strict = on_ingress && unsafe { STRICT_IFACES.get(ifindex) }.is_some();
        if !gated && !strict {
            return TC_NEXT;
        }
    } else if ingress_ifindex == 0 {
        // Made on this node without a socket: the kernel's own replies carry no request (a
        // bare TCP segment: a timewait ACK); anything else is a copy a rule made of some
        // socket's packet (nft `dup`), which no cgroup hook judged.
        if parsed.complete && parsed.bare {
            return TC_NEXT;
        }
    } else if !on_ingress {
        // Forwarded: refused where the policy gates such traffic, else left to the pod
        // network.
        if meta.is_some_and(|m| m.node_flags & NODE_GATE_FORWARDED == 0) {
            return TC_NEXT;
        }
    }
    let caller = Caller { hook, task: false };
    let what = if parsed.readable { Reported::Dst(&parsed.dst) } else { Reported::Unparsed };
    // A frame without a socket has no cgroup to allow: the walk finds nothing.
    let no_socket = cgroup_id == 0;
    let ancestor = |level: u32| if no_socket { 0 } else { ancestor(level) };
    let verdict = judge(&caller, generation, endpoint, what, || cgroup_id, ancestor);
    if verdict == VERDICT_DENIED { TC_ACT_SHOT } else { TC_NEXT }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
