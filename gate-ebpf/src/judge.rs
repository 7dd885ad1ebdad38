//! Deciding, counting and reporting: what every program does once it knows the destination.
use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns};
use gate_common::{
    abi::{
        AccessKey, AccessStats, CONFIG_ACTIVE_GEN, CONFIG_RECENT_CURSOR, DenyEvent, EVENT_BURST,
        EVENT_WINDOW_NS, GRANT_METADATA, GRANT_PROXY, RECENT_DENIALS, STAT_EVENTS_LOST,
        VERDICT_ALLOWED, VERDICT_DENIED, VERDICT_PROXIED, VERDICT_UNMATCHED, grant_needed,
        stat_slot,
    },
    packet::{self, Parsed},
    sockets::AF_PACKET,
    verdict::{Addr, Dst, cgroup_allowed, decide, proxy_route, surely_unprotected},
};

use crate::maps::{
    ACCESS, CONFIG, EP_COUNTERS, EVENTS, KernelTables, POLICY_META, PREFILTER, RECENT, bump,
};

#[inline(always)]
pub(crate) fn count(hook: u32, verdict: u32) {
    bump(stat_slot(hook, verdict));
}

#[inline(always)]
pub(crate) fn count_endpoint(endpoint: u32, verdict: u32) {
    let Some(c) = EP_COUNTERS.get_ptr_mut(endpoint) else { return };
    // SAFETY: `c` points into the array map's value; counters are updated atomically because
    // the array is shared by all CPUs.
    unsafe {
        let field = match verdict {
            VERDICT_ALLOWED => &raw mut (*c).allowed,
            VERDICT_DENIED => &raw mut (*c).denied,
            VERDICT_PROXIED => &raw mut (*c).proxied,
            _ => &raw mut (*c).audited,
        };
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(field, 1);
    }
}

/// Where the destination and the caller's identity come from.
pub(crate) struct Caller {
    pub(crate) hook: u32,
    /// Whether the current task is meaningful (process context).
    pub(crate) task: bool,
}

/// What a denial event records as its destination: the parsed one, none (an unreadable
/// frame), the socket option a side door asked for, or the socket that would have read the
/// node's traffic (`protocol` as `socket()` takes it: for AF_PACKET, in network order).
pub(crate) enum Reported<'a> {
    Dst(&'a Dst),
    Unparsed,
    Sockopt { level: i32, optname: i32 },
    Socket { family: i32, protocol: i32 },
}

#[inline(always)]
pub(crate) fn report(
    caller: &Caller,
    cgroup_id: u64,
    verdict: u32,
    endpoint: u32,
    what: Reported<'_>,
) {
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
        // The family in the address field, the protocol (host order) in the port.
        Reported::Socket { family, protocol } => {
            addr[..4].copy_from_slice(&family.to_ne_bytes());
            let p =
                if family == AF_PACKET { u16::from_be(protocol as u16) } else { protocol as u16 };
            (0, p, 0)
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
pub(crate) fn account(cgroup_id: u64, endpoint: u32, verdict: u32, now: u64) -> bool {
    let key = AccessKey { cgroup_id, endpoint, _pad: 0 };
    let Some(st) = ACCESS.get_ptr_mut(key) else {
        let mut fresh =
            AccessStats { last_ns: now, window_start_ns: now, ..AccessStats::default() };
        match verdict {
            VERDICT_ALLOWED => fresh.allowed = 1,
            VERDICT_DENIED => fresh.denied = 1,
            VERDICT_PROXIED => fresh.proxied = 1,
            _ => fresh.audited = 1,
        }
        let quiet = verdict == VERDICT_ALLOWED || verdict == VERDICT_PROXIED;
        fresh.sent = u32::from(!quiet);
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
            VERDICT_PROXIED => &raw mut (*st).proxied,
            _ => &raw mut (*st).audited,
        };
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(field, 1);
        (*st).last_ns = now;
        // Allowed and proxied connects send no denial event (the proxy reports its refusals).
        if verdict == VERDICT_ALLOWED || verdict == VERDICT_PROXIED {
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
pub(crate) fn remember(ev: &DenyEvent) {
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
pub(crate) fn live_generation() -> Option<u32> {
    CONFIG.get(CONFIG_ACTIVE_GEN).map(|g| *g & 1)
}

/// The connect hooks' fast path: whether traffic to `addr` surely concerns no protected
/// endpoint, by PREFILTER's bit for the pair of its first and last byte. One array read
/// (inlined by the verifier) and one bit test, no generation. Unreadable: it may (fail closed).
#[inline(always)]
pub(crate) fn passes_fast(addr: &Addr) -> bool {
    PREFILTER.get(0).is_some_and(|f| surely_unprotected(f, addr))
}

/// The decision for traffic that is (or, unparsed, is taken to be) bound for `endpoint`.
/// Returns the verdict; counts it and reports anything not allowed.
#[inline(always)]
pub(crate) fn judge(
    caller: &Caller,
    generation: Option<u32>,
    endpoint: u32,
    what: Reported<'_>,
    cgroup_id: impl Fn() -> u64,
    ancestor: impl FnMut(u32) -> u64,
) -> u32 {
    settle(caller, generation, endpoint, what, None, cgroup_id, ancestor).0
}

/// [`judge`], where a connect that would be denied may go to the metadata proxy instead
/// (`http`: the destination, for [`proxy_route`]). Returns the verdict and, for
/// VERDICT_PROXIED, the allow entry whose paths apply (or ENTRY_SERVED).
#[inline(always)]
pub(crate) fn settle(
    caller: &Caller,
    generation: Option<u32>,
    endpoint: u32,
    what: Reported<'_>,
    http: Option<&Dst>,
    cgroup_id: impl Fn() -> u64,
    mut ancestor: impl FnMut(u32) -> u64,
) -> (u32, u32) {
    // Without the generation or the policy's settings nothing can be allowed: deny.
    let meta = generation.and_then(|g| POLICY_META.get(g).map(|m| (g, m)));
    let (verdict, entry) = match meta {
        Some((g, meta)) => {
            let need = grant_needed(caller.hook);
            let (root, tables) = (meta.root_level, &KernelTables);
            // The metadata proxy itself (the agent's cgroup, which in a cluster is below the
            // gated root) forwards served requests to the endpoint: never denied, never
            // redirected to itself. It gets no capture grant this way.
            let proxy = need == GRANT_METADATA && crate::proxy::is_proxy(cgroup_id());
            let allowed = proxy || cgroup_allowed(tables, g, root, need, &mut ancestor).is_some();
            let proxied = match http {
                Some(dst) if !allowed => proxy_route(meta.mode, meta.served, dst, || {
                    cgroup_allowed(tables, g, root, GRANT_PROXY, &mut ancestor)
                }),
                _ => None,
            };
            match proxied {
                Some(entry) => (VERDICT_PROXIED, entry),
                None => (decide(meta.mode, allowed), 0),
            }
        }
        None => (VERDICT_DENIED, 0),
    };
    count(caller.hook, verdict);
    count_endpoint(endpoint, verdict);
    if verdict == VERDICT_ALLOWED || verdict == VERDICT_PROXIED {
        // Counted for `report`; a proxied connect's requests are reported by the proxy.
        // SAFETY: helper without arguments.
        account(cgroup_id(), endpoint, verdict, unsafe { bpf_ktime_get_ns() });
    } else {
        report(caller, cgroup_id(), verdict, endpoint, what);
    }
    (verdict, entry)
}

/// The whole decision for one destination of a gated socket. Returns whether the traffic
/// may proceed. A packet whose destination cannot be known (unreadable, source-routed) is
/// decided as if bound for a protected endpoint.
#[inline(always)]
pub(crate) fn gate(
    caller: &Caller,
    p: &Parsed,
    cgroup_id: impl Fn() -> u64,
    ancestor: impl FnMut(u32) -> u64,
) -> bool {
    let generation = live_generation();
    let Some(endpoint) = packet::subject(&KernelTables, generation, p) else {
        count(caller.hook, VERDICT_UNMATCHED);
        return true;
    };
    let what = if p.readable { Reported::Dst(&p.dst) } else { Reported::Unparsed };
    judge(caller, generation, endpoint, what, cgroup_id, ancestor) != VERDICT_DENIED
}
