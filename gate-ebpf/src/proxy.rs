//! The way to the metadata proxy: a connect whose verdict is "through the proxy" is sent to
//! the proxy's address with a record of who asked for what (SK_RECORDS, on the client's
//! socket); `getpeername` gives the application the address it asked for; at the end of
//! the handshake the record moves to the proxy's accepted socket, found by the handshake's
//! two initial sequence numbers (PENDING), where the proxy reads it. A connection the proxy
//! accepts without a record is refused there: nothing here has to be trusted from the wire.
//!
//! A record waits in PENDING one round trip. It leaves it when the proxy's side takes it, or
//! when the client's socket closes first (the state callback: a client that delays its last
//! ACK and resets lays no orphan), and each workload may have only so many there at once
//! (INFLIGHT), so that no workload can fill the table for the others.
//!
//! A redirected connection's packets must leave for the proxy itself: one that a DNAT or
//! route after the redirect sends elsewhere (a hostPort, a Service's externalIP on the
//! proxy's port) is dropped on egress rather than served by whoever is there.
use core::{
    intrinsics::{AtomicOrdering, atomic_xadd},
    ptr,
};

use aya_ebpf::{
    bindings::{
        BPF_NOEXIST, BPF_SK_STORAGE_GET_F_CREATE, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_TCP_CLOSE, bpf_sock,
    },
    helpers::{
        bpf_get_current_cgroup_id, bpf_ktime_get_ns,
        generated::{bpf_sk_fullsock, bpf_sk_storage_get},
    },
    programs::{SkBuffContext, SockAddrContext, SockOpsContext},
};
use gate_common::{
    abi::{
        HandshakeKey, PROTO_TCP, PROXY_V4, PROXY_V6, ProxyConfig, ProxyRecord, STAT_PENDING_CAPPED,
        STAT_PENDING_LOST, STAT_PROXY_DIVERTED,
    },
    packet::Parsed,
    verdict::may_start_handshake,
};

use crate::maps::{INFLIGHT, PENDING, PROXY, SK_RECORDS, bump};

/// The proxy's settings, if it has a port.
#[inline(always)]
fn config() -> Option<&'static ProxyConfig> {
    PROXY.get(0).filter(|c| c.port != 0)
}

/// Whether a metadata proxy is configured (connects may be sent to it).
#[inline(always)]
pub(crate) fn configured() -> bool {
    config().is_some()
}

/// Whether `cgroup_id` is the metadata proxy's (the agent's) cgroup.
#[inline(always)]
pub(crate) fn is_proxy(cgroup_id: u64) -> bool {
    config().is_some_and(|c| c.cgroup_id == cgroup_id)
}

/// IPv4-mapped IPv6 address of `v4`, as the four network-order words of `user_ip6`.
#[inline(always)]
fn mapped_words(v4: [u8; 4]) -> [u32; 4] {
    [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff]), u32::from_ne_bytes(v4)]
}

#[inline(always)]
fn words(a: [u8; 16]) -> [u32; 4] {
    let w = |i: usize| u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
    [w(0), w(4), w(8), w(12)]
}

/// Send the connect to the proxy: record who asked for what on the socket, then rewrite the
/// destination. `false`: no proxy configured for the family, or no room for the record: the
/// connect is denied (fail closed), never let through to the endpoint.
#[inline(always)]
pub(crate) fn redirect(ctx: &SockAddrContext, via_v6: bool, mut record: ProxyRecord) -> bool {
    let Some(cfg) = config() else { return false };
    let (has_v4, has_v6) = (cfg.families & PROXY_V4 != 0, cfg.families & PROXY_V6 != 0);
    // An IPv6 connect to an IPv6 endpoint goes to the proxy's IPv6 address, else to its
    // IPv4-mapped one (a V6ONLY socket then fails at once); an IPv4 connect to its IPv4 one.
    let target = match (via_v6, record.v6 != 0) {
        (false, _) if has_v4 => [0; 4],
        (true, true) if has_v6 => words(cfg.addr_v6),
        (true, _) if has_v4 => mapped_words(cfg.addr_v4),
        _ => return false,
    };
    // The workload's quota of handshakes in flight (taken at the handshake, read here so that
    // a workload over it is told at once).
    // SAFETY: the value is copied out at once.
    if unsafe { INFLIGHT.get(record.workload) }.is_some_and(|n| !may_start_handshake(*n)) {
        bump(STAT_PENDING_CAPPED);
        return false;
    }
    record.via_v6 = u8::from(via_v6);
    // SAFETY: helper without arguments.
    record.ts_ns = unsafe { bpf_ktime_get_ns() };
    // SAFETY: the context's socket; the helper checks the map and the socket.
    let slot = unsafe { SK_RECORDS.get_or_insert_ptr_mut(ctx, None) };
    if slot.is_null() {
        return false;
    }
    // SAFETY: `slot` points to this socket's storage, valid for the program's run.
    unsafe { *slot = record };
    // SAFETY: the context pointer is valid and these fields are writable in connect hooks.
    let sa = unsafe { &mut *ctx.sock_addr };
    if via_v6 {
        sa.user_ip6 = target;
    } else {
        sa.user_ip4 = u32::from_ne_bytes(cfg.addr_v4);
    }
    sa.user_port = u32::from(cfg.port.to_be());
    true
}

/// `getpeername()` of a socket sent to the proxy: the address and port the application asked
/// for, as the kernel's connect_force_port selftests do.
#[inline(always)]
pub(crate) fn restore(ctx: &SockAddrContext, v6: bool) {
    let Some(cfg) = config() else { return };
    // SAFETY: the context pointer is valid for the program's run.
    let sa = unsafe { &mut *ctx.sock_addr };
    if u16::from_be(sa.user_port as u16) != cfg.port {
        return;
    }
    // SAFETY: the context's socket; no record: not ours.
    let rec = unsafe { SK_RECORDS.get_ptr_mut(ctx) };
    if rec.is_null() {
        return;
    }
    // SAFETY: non-null storage of this socket.
    let rec = unsafe { *rec };
    if v6 {
        sa.user_ip6 = if rec.v6 != 0 {
            words(rec.addr)
        } else {
            mapped_words([rec.addr[0], rec.addr[1], rec.addr[2], rec.addr[3]])
        };
    } else {
        sa.user_ip4 = u32::from_ne_bytes([rec.addr[0], rec.addr[1], rec.addr[2], rec.addr[3]]);
    }
    sa.user_port = u32::from(rec.port.to_be());
}

/// Whether a sock_ops port field holds `port`. The kernel gives `remote_port` in network
/// order in the upper half of the word on some versions and the lower half on others; a
/// false match costs nothing, as the socket must also carry a record.
#[inline(always)]
fn is_port(field: u32, port: u16) -> bool {
    u32::from_be(field) as u16 == port || u16::from_be(field as u16) == port
}

/// The socket of a sock_ops context (a full socket at the established callbacks).
#[inline(always)]
fn socket(ctx: &SockOpsContext) -> *mut bpf_sock {
    // SAFETY: reads a field of the context.
    unsafe { (*ctx.ops).__bindgen_anon_2.sk }
}

/// The record of a socket, created empty if `create` (null if there is none, or no room).
#[inline(always)]
fn storage(sk: *mut bpf_sock, create: bool) -> *mut ProxyRecord {
    let flags = if create { u64::from(BPF_SK_STORAGE_GET_F_CREATE) } else { 0 };
    let map = ptr::from_ref(&SK_RECORDS).cast_mut().cast();
    // SAFETY: a socket storage map and a non-null full socket.
    unsafe { bpf_sk_storage_get(map, sk.cast(), ptr::null_mut(), flags) }.cast()
}

/// One more record of `workload` in PENDING, if its quota allows.
#[inline(always)]
fn take_slot(workload: u64) -> bool {
    if let Some(n) = INFLIGHT.get_ptr_mut(workload) {
        // SAFETY: `n` points into the map's value, shared by all CPUs: read, then an atomic
        // add (CPUs racing past the check overshoot the quota by at most one each).
        unsafe {
            if !may_start_handshake(*n) {
                return false;
            }
            atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(n, 1);
        }
        return true;
    }
    // The workload's first: a concurrent first insert wins, and this one adds to it.
    if INFLIGHT.insert(workload, 1, u64::from(BPF_NOEXIST)).is_err()
        && let Some(n) = INFLIGHT.get_ptr_mut(workload)
    {
        // SAFETY: as above.
        unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(n, 1) };
    }
    true
}

/// A record of `workload` left PENDING.
#[inline(always)]
fn give_slot(workload: u64) {
    if let Some(n) = INFLIGHT.get_ptr_mut(workload) {
        // SAFETY: as in `take_slot`; adding u32::MAX subtracts one.
        unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(n, u32::MAX) };
    }
}

/// sock_ops of the proxy's way: at the end of a handshake, the client's (its record goes to
/// PENDING under the handshake's initial sequence numbers, before its ACK leaves) and the
/// proxy's (the record moves onto the accepted socket, before `accept()` returns it); and
/// the client's socket closing while its record still waits (the record leaves PENDING).
#[inline(always)]
pub(crate) fn handshake(ctx: &SockOpsContext) {
    let op = ctx.op();
    if op == BPF_SOCK_OPS_STATE_CB {
        return closing(ctx);
    }
    if op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB {
        return;
    }
    let Some(cfg) = config() else { return };
    let sk = socket(ctx);
    if sk.is_null() {
        return;
    }
    // SAFETY: reads fields of the context (a full TCP socket at these callbacks).
    let (snd_una, rcv_nxt) = unsafe { ((*ctx.ops).snd_una, (*ctx.ops).rcv_nxt) };
    // Each side's SYN took one sequence number.
    let (ours, theirs) = (snd_una.wrapping_sub(1), rcv_nxt.wrapping_sub(1));
    if op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB {
        if !is_port(ctx.remote_port(), cfg.port) {
            return;
        }
        let rec = storage(sk, false);
        if rec.is_null() {
            return;
        }
        // SAFETY: non-null storage of this socket, valid for the program's run.
        let rec = unsafe { &mut *rec };
        if !take_slot(rec.workload) {
            // Over the workload's quota (CPUs raced past the connect's check): no record,
            // so the proxy refuses the connection; the others' records are untouched.
            bump(STAT_PENDING_CAPPED);
            return;
        }
        let key = HandshakeKey { client_isn: ours, server_isn: theirs };
        // A full map or a key already taken (a collision of two 32-bit pairs) leaves the
        // proxy without a record: refused there, and counted.
        if PENDING.insert(key, *rec, u64::from(BPF_NOEXIST)).is_err() {
            give_slot(rec.workload);
            bump(STAT_PENDING_LOST);
            return;
        }
        rec.handshake = key;
        rec.pending = 1;
        // Told when this socket changes state, so that its record goes with it. Without
        // the callback (it cannot fail on a full TCP socket) the sweep still removes it.
        let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
        return;
    }
    if ctx.local_port() != u32::from(cfg.port) {
        return;
    }
    let key = HandshakeKey { client_isn: theirs, server_isn: ours };
    // SAFETY: the value is copied out at once.
    let Some(rec) = (unsafe { PENDING.get(key) }).copied() else { return };
    // Whoever removes the record gives its slot back: this side or the client's closing.
    if PENDING.remove(key).is_ok() {
        give_slot(rec.workload);
    }
    let slot = storage(sk, true);
    if !slot.is_null() {
        // SAFETY: non-null storage of this socket.
        unsafe { *slot = rec };
    }
}

/// The client's socket closed: its record, if the proxy's side has not taken it yet, leaves
/// PENDING (a handshake whose last ACK never reached the proxy).
#[inline(always)]
fn closing(ctx: &SockOpsContext) {
    // (old state, new state)
    if ctx.arg(1) != BPF_TCP_CLOSE {
        return;
    }
    let sk = socket(ctx);
    if sk.is_null() {
        return;
    }
    let rec = storage(sk, false);
    if rec.is_null() {
        return;
    }
    // SAFETY: non-null storage of this socket, valid for the program's run.
    let rec = unsafe { &mut *rec };
    if rec.pending == 0 {
        return;
    }
    rec.pending = 0;
    if PENDING.remove(rec.handshake).is_ok() {
        give_slot(rec.workload);
    }
}

/// Whether a packet of a gated socket is one of a connection sent to the proxy that is
/// leaving for anything but the proxy's own address and port (a DNAT or route after the
/// redirect: a hostPort, a Service's externalIP): it must be dropped. Cheap for every other
/// packet: a socket not connected to the proxy's port is not looked at further.
#[inline(always)]
pub(crate) fn diverted(ctx: &SkBuffContext, parsed: impl FnOnce() -> Parsed) -> bool {
    let Some(cfg) = config() else { return false };
    // SAFETY: reads a field of the context.
    let sk = unsafe { (*ctx.skb.skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return false;
    }
    // SAFETY: a socket pointer from the context; the field is in its common part (a 16-bit
    // load: the kernel converts it on every version, whether it declares the field 16 or 32
    // bits wide).
    if u16::from_be(unsafe { (*sk).dst_port }) != cfg.port {
        return false;
    }
    // SAFETY: the helper checks the pointer.
    let full = unsafe { bpf_sk_fullsock(sk) };
    if full.is_null() || storage(full, false).is_null() {
        return false;
    }
    // A connection the kernel sent to the proxy: its packets go to the proxy, or nowhere.
    let p = parsed();
    if !p.readable || p.routed || !p.complete || p.dst.proto != PROTO_TCP || p.dst.port != cfg.port
    {
        bump(STAT_PROXY_DIVERTED);
        return true;
    }
    let b = p.dst.addr.bytes();
    let to_proxy = if p.dst.addr.is_v6() {
        cfg.families & PROXY_V6 != 0 && *b == cfg.addr_v6
    } else {
        cfg.families & PROXY_V4 != 0 && b[..4] == cfg.addr_v4
    };
    if !to_proxy {
        bump(STAT_PROXY_DIVERTED);
    }
    !to_proxy
}

/// `bind()` in the gated root: the proxy's port is the proxy's, also while the agent is
/// down (a workload that took it would serve forged metadata to every redirected client).
/// Returns whether the bind may proceed.
#[inline(always)]
pub(crate) fn bind_allowed(ctx: &SockAddrContext) -> bool {
    let Some(cfg) = config() else { return true };
    // SAFETY: the context pointer is valid for the program's run.
    let port = u16::from_be(unsafe { (*ctx.sock_addr).user_port } as u16);
    // SAFETY: helper without arguments.
    port != cfg.port || unsafe { bpf_get_current_cgroup_id() } == cfg.cgroup_id
}
