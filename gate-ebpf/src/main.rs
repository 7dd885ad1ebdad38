//! metadata-gate kernel programs.
//!
//! Thin by design: read the destination from the context, ask gate-common's pure functions
//! for the verdict, count it, and report denials. All decisions live in
//! `gate_common::verdict`, which is unit- and property-tested on the host.
//!
//! * `cgroup/connect4|6`, `cgroup/sendmsg4|6`: refuse with EPERM at the syscall.
//! * `cgroup_skb/egress`: drops what the socket hooks cannot see: raw sockets, sockets
//!   connected before the gate existed, anything else that reaches the wire.
//! * `tc` (`gate_tc`, on interfaces the operator names): frames the cgroup hooks never see,
//!   such as AF_PACKET sends from a gated cgroup, and traffic forwarded from workload-facing
//!   interfaces (VM-based runtimes, pod veths).
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
    macros::{cgroup_skb, cgroup_sock_addr, classifier, map},
    maps::{Array, HashMap, LpmTrie, PerCpuArray, RingBuf, lpm_trie::Key},
    programs::{SkBuffContext, SockAddrContext, TcContext, sk_buff::SkBuff},
};
use gate_common::{
    abi::{
        AllowKey, CONFIG_ACTIVE_GEN, CONFIG_RECENT_CURSOR, DenyEvent, EVENTS_BYTES,
        EndpointCounters, EndpointName, EpNameKey, GEN_PREFIX_BITS, GateInfo, HOOK_CONNECT4,
        HOOK_CONNECT6, HOOK_EGRESS4, HOOK_EGRESS6, HOOK_SENDMSG4, HOOK_SENDMSG6, HOOK_TC4,
        HOOK_TC6, MAX_ALLOWED_CGROUPS, MAX_ENDPOINTS, MAX_PORT_RULES, MAX_WORKLOAD_IFACES,
        NUM_CONFIG, NUM_STATS, PORT_ANY, PROTO_TCP, PROTO_UDP, PolicyMeta, PortRuleKey, PrefixV4,
        PrefixV6, PrefixValue, RECENT_DENIALS, STAT_EVENTS_LOST, TcClsact, VERDICT_ALLOWED,
        VERDICT_AUDITED, VERDICT_DENIED, VERDICT_UNMATCHED, stat_slot,
    },
    verdict::{Addr, Dst, Tables, cgroup_allowed, decide, match_endpoint},
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
static TC_CLSACT: HashMap<u64, TcClsact> =
    HashMap::with_max_entries(MAX_WORKLOAD_IFACES, BPF_F_NO_PREALLOC);
#[map]
static WORKLOAD_IFACES: HashMap<u32, u32> =
    HashMap::with_max_entries(MAX_WORKLOAD_IFACES, BPF_F_NO_PREALLOC);

struct Maps;

impl Tables for Maps {
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
        let Some(meta) = POLICY_META.get(generation) else { return true };
        match addr {
            Addr::V4(a) => meta.prefilter.may(false, a[0]),
            Addr::V6(a) => meta.prefilter.may(true, a[0]),
        }
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
            VERDICT_AUDITED => &raw mut (*c).audited,
            _ => &raw mut (*c).denied,
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

#[inline(always)]
fn report(caller: &Caller, cgroup_id: u64, verdict: u32, endpoint: u32, dst: &Dst) {
    let (family, addr) = match dst.addr {
        Addr::V4(a) => (4u8, [a[0], a[1], a[2], a[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
        Addr::V6(a) => (6u8, a),
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
        port: dst.port,
        proto: dst.proto,
        family,
        verdict: verdict as u8,
        hook: caller.hook as u8,
        _pad: [0; 2],
        comm,
    };
    remember(&ev);
    match EVENTS.reserve::<DenyEvent>(0) {
        Some(mut entry) => {
            entry.write(ev);
            entry.submit(0);
        }
        None => bump(STAT_EVENTS_LOST),
    }
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

/// The live generation, if a protected prefix could contain `addr`: one array read and a bit
/// test. Packet programs call it on the destination alone, before parsing the rest.
#[inline(always)]
fn may_protect(addr: &Addr) -> Option<u32> {
    let generation = CONFIG.get(CONFIG_ACTIVE_GEN)? & 1;
    Maps.may_match(generation, addr).then_some(generation)
}

/// The whole decision for one destination. Returns whether the traffic may proceed.
/// `cgroup_id` and `ancestor` are called only for traffic to a protected endpoint.
#[inline(always)]
fn gate(
    caller: &Caller,
    dst: &Dst,
    cgroup_id: impl Fn() -> u64,
    ancestor: impl FnMut(u32) -> u64,
) -> bool {
    let Some(&active) = CONFIG.get(CONFIG_ACTIVE_GEN) else { return true };
    let generation = active & 1;
    // match_endpoint starts with the prefilter (Tables::may_match).
    let Some(endpoint) = match_endpoint(&Maps, generation, dst) else {
        count(caller.hook, VERDICT_UNMATCHED);
        return true;
    };
    // Only traffic to a protected endpoint needs the rest of the policy.
    let Some(meta) = POLICY_META.get(generation) else { return true };
    let allowed = cgroup_allowed(&Maps, generation, meta.root_level, ancestor).is_some();
    let verdict = decide(meta.mode, allowed);
    count(caller.hook, verdict);
    count_endpoint(endpoint, verdict);
    if verdict != VERDICT_ALLOWED {
        report(caller, cgroup_id(), verdict, endpoint, dst);
    }
    verdict != VERDICT_DENIED
}

// ---- socket hooks ----------------------------------------------------------------------------

#[inline(always)]
fn sock_addr(ctx: &SockAddrContext, hook: u32, v6: bool) -> i32 {
    // SAFETY: the context pointer is valid for the program's duration; fields are read-only.
    let sa = unsafe { &*ctx.sock_addr };
    let addr =
        if v6 { Addr::from_v6_words(sa.user_ip6) } else { Addr::V4(sa.user_ip4.to_ne_bytes()) };
    let dst = Dst { addr, port: u16::from_be(sa.user_port as u16), proto: sa.protocol as u8 };
    let caller = Caller { hook, task: true };
    // SAFETY: helper without pointer arguments.
    let cgroup_id = || unsafe { bpf_get_current_cgroup_id() };
    // SAFETY: helper without pointer arguments; returns 0 past the task's own level.
    let ancestor = |level: u32| unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
    i32::from(gate(&caller, &dst, cgroup_id, ancestor))
}

#[cgroup_sock_addr(connect4)]
pub fn gate_connect4(ctx: SockAddrContext) -> i32 {
    sock_addr(&ctx, HOOK_CONNECT4, false)
}

#[cgroup_sock_addr(connect6)]
pub fn gate_connect6(ctx: SockAddrContext) -> i32 {
    sock_addr(&ctx, HOOK_CONNECT6, true)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn gate_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock_addr(&ctx, HOOK_SENDMSG4, false)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn gate_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock_addr(&ctx, HOOK_SENDMSG6, true)
}

// ---- egress ----------------------------------------------------------------------------------

const ETH_P_IP: u32 = 0x0800;
const ETH_P_IPV6: u32 = 0x86dd;
const MAX_V6_EXT_HEADERS: usize = 6;

/// Destination port at `l4` for protocols that have one; PORT_ANY when unknown.
#[inline(always)]
fn l4_port(ctx: &SkBuff, proto: u8, l4: usize) -> u16 {
    if proto == PROTO_TCP || proto == PROTO_UDP {
        ctx.load::<u16>(l4 + 2).map(u16::from_be).unwrap_or(PORT_ANY)
    } else {
        PORT_ANY
    }
}

/// Whether the segment at `l4` is a TCP reset without payload (`end`: where the IP packet
/// ends). Such a reset conveys nothing to a metadata service, and it is what a socket
/// destroyed by `--terminate-established` sends: it passes, unreported, instead of showing up
/// as a denial by the agent itself.
#[inline(always)]
fn tcp_rst(ctx: &SkBuff, proto: u8, l4: usize, end: usize) -> bool {
    if proto != PROTO_TCP {
        return false;
    }
    let Ok(hdr) = ctx.load::<[u8; 2]>(l4 + 12) else { return false };
    let data_offset = usize::from(hdr[0] >> 4) * 4;
    hdr[1] & 0x04 != 0 && l4 + data_offset == end
}

/// A parsed packet: its destination, and whether it is a TCP reset.
struct Parsed {
    dst: Dst,
    rst: bool,
}

#[inline(always)]
fn parse_v4(ctx: &SkBuff, l3: usize) -> Option<Parsed> {
    let vihl: u8 = ctx.load(l3).ok()?;
    let frag: u16 = ctx.load::<u16>(l3 + 6).ok().map(u16::from_be)?;
    let proto: u8 = ctx.load(l3 + 9).ok()?;
    let daddr: [u8; 4] = ctx.load(l3 + 16).ok()?;
    // Non-first fragments carry no ports; the first fragment (which does) decides.
    let l4 = l3 + usize::from(vihl & 0x0f) * 4;
    let end = l3 + usize::from(ctx.load::<u16>(l3 + 2).ok().map(u16::from_be)?);
    let (port, rst) = if frag & 0x1fff != 0 {
        (PORT_ANY, false)
    } else {
        (l4_port(ctx, proto, l4), tcp_rst(ctx, proto, l4, end))
    };
    Some(Parsed { dst: Dst { addr: Addr::V4(daddr), port, proto }, rst })
}

#[inline(always)]
fn parse_v6(ctx: &SkBuff, l3: usize) -> Option<Parsed> {
    let mut next: u8 = ctx.load(l3 + 6).ok()?;
    let end = l3 + 40 + usize::from(ctx.load::<u16>(l3 + 4).ok().map(u16::from_be)?);
    let daddr: [u8; 16] = ctx.load(l3 + 24).ok()?;
    let mut off = l3 + 40;
    let mut fragmented = false;
    for _ in 0..MAX_V6_EXT_HEADERS {
        match next {
            // hop-by-hop, routing, destination options
            0 | 43 | 60 => {
                let hdr: [u8; 2] = ctx.load(off).ok()?;
                next = hdr[0];
                off += (usize::from(hdr[1]) + 1) * 8;
            }
            // fragment
            44 => {
                let hdr: [u8; 4] = ctx.load(off).ok()?;
                next = hdr[0];
                fragmented = u16::from_be_bytes([hdr[2], hdr[3]]) & 0xfff8 != 0;
                off += 8;
            }
            // authentication header
            51 => {
                let hdr: [u8; 2] = ctx.load(off).ok()?;
                next = hdr[0];
                off += (usize::from(hdr[1]) + 2) * 4;
            }
            _ => break,
        }
    }
    let (port, rst) = if fragmented {
        (PORT_ANY, false)
    } else {
        (l4_port(ctx, next, off), tcp_rst(ctx, next, off, end))
    };
    // IPv4-mapped destinations never reach the wire as IPv6, but normalise anyway.
    Some(Parsed { dst: Dst { addr: Addr::from_v6(daddr), port, proto: next }, rst })
}

/// `T` at `off` of the packet by direct packet access (no helper call), falling back to
/// bpf_skb_load_bytes where the bytes are not in the linear area.
#[inline(always)]
fn head<T: Copy>(ctx: &SkBuffContext, off: usize) -> Option<T> {
    // SAFETY: reads fields of the context.
    let (data, end) = unsafe { ((*ctx.skb.skb).data as usize, (*ctx.skb.skb).data_end as usize) };
    if data + off + size_of::<T>() <= end {
        // SAFETY: bounds checked against data_end just above (the verifier checks it too).
        Some(unsafe { core::ptr::read_unaligned((data + off) as *const T) })
    } else {
        ctx.load::<T>(off).ok()
    }
}

#[inline(always)]
fn egress(ctx: &SkBuffContext, task: bool) -> i32 {
    let skb = ctx.skb.skb;
    let proto = u32::from(u16::from_be(ctx.skb.protocol() as u16));
    // The destination address alone first: most packets end at the prefilter, before the
    // rest of the headers is read.
    let daddr = match proto {
        ETH_P_IP => head::<[u8; 4]>(ctx, 16).map(Addr::V4),
        ETH_P_IPV6 => head::<[u8; 16]>(ctx, 24).map(Addr::from_v6),
        _ => return 1,
    };
    if daddr.is_none_or(|a| may_protect(&a).is_none()) {
        return 1;
    }
    let (dst, hook) = match proto {
        ETH_P_IP => (parse_v4(&ctx.skb, 0), HOOK_EGRESS4),
        ETH_P_IPV6 => (parse_v6(&ctx.skb, 0), HOOK_EGRESS6),
        _ => return 1,
    };
    // A packet we cannot parse has no destination we could protect.
    let Some(Parsed { dst, rst }) = dst else { return 1 };
    if rst {
        return 1;
    }
    let caller = Caller { hook, task };
    // SAFETY: `skb` is the program's context pointer.
    let cgroup_id = || unsafe { bpf_skb_cgroup_id(skb) };
    // SAFETY: as above.
    let ancestor = |level: u32| unsafe { bpf_skb_ancestor_cgroup_id(skb, level as i32) };
    i32::from(gate(&caller, &dst, cgroup_id, ancestor))
}

/// Egress with the sending task's pid and comm in denial events (kernels that offer
/// bpf_get_current_pid_tgid/comm to cgroup_skb programs).
#[cgroup_skb(egress)]
pub fn gate_egress(ctx: SkBuffContext) -> i32 {
    egress(&ctx, true)
}

/// The same without task helpers, for older kernels (the loader falls back to it when the
/// verifier refuses `gate_egress`).
#[cgroup_skb(egress)]
pub fn gate_egress_notask(ctx: SkBuffContext) -> i32 {
    egress(&ctx, false)
}

// ---- tc ----------------------------------------------------------------------------------------

const TC_ACT_OK: i32 = 0;
const TC_ACT_SHOT: i32 = 2;
const ETH_HLEN: usize = 14;

/// tc on Ethernet devices, ingress or egress. A packet to a protected endpoint is dropped when
/// * its socket belongs to a gated, not allowed cgroup (AF_PACKET and other senders the cgroup
///   hooks do not see), or
/// * it entered the node on a workload-facing interface (WORKLOAD_IFACES) and does not come
///   from an allowed gated socket: forwarded traffic of pods or VMs.
///
/// Everything else passes: host processes outside the gated root, replies, other addresses.
#[classifier]
pub fn gate_tc(ctx: TcContext) -> i32 {
    let skb = ctx.skb.skb;
    let proto = u32::from(u16::from_be(ctx.skb.protocol() as u16));
    let daddr = match proto {
        ETH_P_IP => ctx.load::<[u8; 4]>(ETH_HLEN + 16).ok().map(Addr::V4),
        ETH_P_IPV6 => ctx.load::<[u8; 16]>(ETH_HLEN + 24).ok().map(Addr::from_v6),
        _ => return TC_ACT_OK,
    };
    let Some(generation) = daddr.and_then(|a| may_protect(&a)) else { return TC_ACT_OK };
    let (dst, hook) = match proto {
        ETH_P_IP => (parse_v4(&ctx.skb, ETH_HLEN), HOOK_TC4),
        ETH_P_IPV6 => (parse_v6(&ctx.skb, ETH_HLEN), HOOK_TC6),
        _ => return TC_ACT_OK,
    };
    let Some(Parsed { dst, rst }) = dst else { return TC_ACT_OK };
    if rst {
        return TC_ACT_OK;
    }
    let Some(endpoint) = match_endpoint(&Maps, generation, &dst) else {
        return TC_ACT_OK;
    };
    let Some(meta) = POLICY_META.get(generation) else { return TC_ACT_OK };
    // SAFETY: `skb` is the program's context pointer.
    let cgroup_id = unsafe { bpf_skb_cgroup_id(skb) };
    // SAFETY: as above.
    let ancestor = |level: u32| unsafe { bpf_skb_ancestor_cgroup_id(skb, level as i32) };
    // The socket (it survives a veth hop into this netns) is gated if it is at or below the
    // gated root.
    let gated_socket = cgroup_id != 0 && ancestor(meta.root_level) == meta.root_id;
    // SAFETY: reads a field of the context.
    let ifindex = unsafe { (*skb).ingress_ifindex };
    // SAFETY: the value is not read.
    let from_workload = ifindex != 0 && unsafe { WORKLOAD_IFACES.get(ifindex) }.is_some();
    if !gated_socket && !from_workload {
        return TC_ACT_OK; // a host process outside the gated root, or a reply
    }
    // From a workload-facing interface only a gated socket on the allow set may pass; VM
    // traffic and sockets outside the gated root never do.
    let allowed =
        gated_socket && cgroup_allowed(&Maps, generation, meta.root_level, ancestor).is_some();
    let verdict = decide(meta.mode, allowed);
    count(hook, verdict);
    count_endpoint(endpoint, verdict);
    if verdict != VERDICT_ALLOWED {
        report(&Caller { hook, task: false }, cgroup_id, verdict, endpoint, &dst);
    }
    if verdict == VERDICT_DENIED { TC_ACT_SHOT } else { TC_ACT_OK }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
