//! metadata-gate kernel programs.
//!
//! Thin by design: read the destination from the context, ask gate-common's pure functions
//! (`verdict`, `packet`) for the verdict, count it, and report denials. All decisions live in
//! gate-common, which is unit- and property-tested on the host.
//!
//! * `cgroup/connect4|6`: deny a TCP or UDP `connect()` with EPERM at the syscall, judged
//!   on the address the application named (before any NAT).
//! * `cgroup_skb/egress`: judges every packet of a gated socket as it leaves, after NAT: an
//!   unconnected UDP `sendto()` (denied here: the kernel hands the program's verdict back
//!   as EPERM from the very call), raw sockets, sockets connected before the gate existed.
//!   No sendmsg4/6 hooks: a datagram is judged once, not twice with the socket lock taken
//!   in between.
//! * `cgroup/setsockopt`: denies the side doors around tc (PACKET_QDISC_BYPASS, AF_XDP).
//! * `lsm/socket_setsockopt`, `lsm/socket_create`, `lsm/socket_bind` (as LSM programs where
//!   the kernel runs the BPF LSM, else loaded by the agent as `fmod_ret` on the
//!   `security_socket_*` functions, which take the same arguments): the same side doors
//!   through every syscall ABI (32-bit compat, io_uring), and sockets that would read the
//!   node's IP traffic (AF_PACKET of an IP EtherType, raw IP of a transport protocol).
//! * The way to the metadata proxy (`proxy`): `cgroup/connect4|6` send a connect of a workload
//!   narrowed to paths to the proxy and record who made it; `cgroup/getpeername4|6` give the
//!   application back the address it asked for; `sock_ops` hands the record to the proxy's
//!   accepted socket and drops it when the handshake ends; `cgroup/bind4|6` keep the proxy's
//!   port for the agent's own cgroup.
//! * `tc` (`gate_tc`, node level): on the uplinks' egress and the workload-facing interfaces'
//!   ingress, denies frames the cgroup hooks never judged: AF_PACKET sends, packets
//!   rewritten after the socket hooks, traffic forwarded from pods and VMs.
//!
//! `main.rs` holds the programs; `maps` the maps, `skb` the reading of a packet and the
//! fast path, `judge` what every program does once it knows the destination (decide,
//! count, report), `proxy` the records of connections sent to the proxy.
//!
//! Every path fails closed: a frame that cannot be read, or a map that cannot be, is decided
//! as if it were bound for a protected endpoint.
#![no_std]
#![no_main]
// The BPF target has no compare-and-swap, so `AtomicU64::fetch_add` is unavailable; the
// intrinsic lowers to the BPF atomic add instruction.
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod judge;
mod maps;
mod proxy;
mod skb;

use aya_ebpf::{
    helpers::{
        bpf_get_current_cgroup_id, bpf_probe_read_kernel,
        generated::{
            bpf_get_current_ancestor_cgroup_id, bpf_skb_ancestor_cgroup_id, bpf_skb_cgroup_id,
        },
    },
    macros::{cgroup_skb, cgroup_sock_addr, cgroup_sockopt, classifier, lsm, sock_ops},
    programs::{
        LsmContext, SkBuffContext, SockAddrContext, SockOpsContext, SockoptContext, TcContext,
    },
};
use gate_common::{
    abi::{
        ENDPOINT_NONE, HOOK_CONNECT4, HOOK_CONNECT6, HOOK_EGRESS4, HOOK_EGRESS6, HOOK_SETSOCKOPT,
        HOOK_SOCKET, HOOK_TC4, HOOK_TC6, NODE_GATE_FORWARDED, ProxyRecord, VERDICT_DENIED,
        VERDICT_PROXIED, VERDICT_UNMATCHED,
    },
    packet::{
        self, CARRIES_IPV4, CARRIES_IPV6, CARRIES_OTHER, ETH_P_IP, ETH_P_IPV6, Packet as _, Parsed,
        parse_ip, parse_ipv4, parse_ipv6,
    },
    sockets,
    verdict::{Addr, Dst, workload_of},
};

use crate::{
    judge::{Caller, Reported, count, gate, judge, live_generation, passes_fast, settle},
    maps::{KernelTables, POLICY_META, STRICT_IFACES, TRUSTED_IFACES},
    skb::{NetSkb, Skb, linear, passes_fast_ip},
};

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
    let generation = live_generation();
    let Some(endpoint) = packet::subject(&KernelTables, generation, &parsed) else {
        count(hook, VERDICT_UNMATCHED);
        return 1;
    };
    let caller = Caller { hook, task: true };
    // SAFETY: helper without pointer arguments.
    let cgroup_id = || unsafe { bpf_get_current_cgroup_id() };
    // SAFETY: helper without pointer arguments; returns 0 past the task's own level.
    let ancestor = |level: u32| unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
    let what = Reported::Dst(&dst);
    // Without a proxy nothing goes through it: denied (and reported) as before.
    let http = proxy::configured().then_some(&dst);
    let (verdict, entry) = settle(&caller, generation, endpoint, what, http, cgroup_id, ancestor);
    if verdict != VERDICT_PROXIED {
        return i32::from(verdict != VERDICT_DENIED);
    }
    let root_level = generation.and_then(|g| POLICY_META.get(g)).map_or(0, |m| m.root_level);
    let record = ProxyRecord {
        cgroup_id: cgroup_id(),
        workload: workload_of(root_level, cgroup_id(), ancestor),
        addr: *dst.addr.bytes(),
        port: dst.port,
        v6: u8::from(dst.addr.is_v6()),
        generation: generation.unwrap_or(0),
        entry,
        endpoint,
        ..ProxyRecord::default()
    };
    if proxy::redirect(ctx, v6, record) {
        return 1;
    }
    // No proxy for this family, or no room for the record: denied, never sent direct.
    count(hook, VERDICT_DENIED);
    0
}

#[cgroup_sock_addr(connect4)]
fn gate_connect4(ctx: SockAddrContext) -> i32 {
    sock_addr(&ctx, HOOK_CONNECT4, false)
}

#[cgroup_sock_addr(connect6)]
fn gate_connect6(ctx: SockAddrContext) -> i32 {
    sock_addr(&ctx, HOOK_CONNECT6, true)
}

// ---- the way to the metadata proxy (see `proxy`) ---------------------------------------------

#[cgroup_sock_addr(getpeername4)]
fn gate_peername4(ctx: SockAddrContext) -> i32 {
    proxy::restore(&ctx, false);
    1
}

#[cgroup_sock_addr(getpeername6)]
fn gate_peername6(ctx: SockAddrContext) -> i32 {
    proxy::restore(&ctx, true);
    1
}

/// At the gated root (clients) and on the proxy's cgroup (its accepted sockets).
#[sock_ops]
fn gate_sock_ops(ctx: SockOpsContext) -> u32 {
    proxy::handshake(&ctx);
    1
}

#[cgroup_sock_addr(bind4)]
fn gate_bind4(ctx: SockAddrContext) -> i32 {
    i32::from(proxy::bind_allowed(&ctx))
}

#[cgroup_sock_addr(bind6)]
fn gate_bind6(ctx: SockAddrContext) -> i32 {
    i32::from(proxy::bind_allowed(&ctx))
}

// ---- setsockopt: side doors around tc ----------------------------------------------------------

/// Denies, for gated cgroups not on the allow set, the socket options that let frames skip
/// tc egress: PACKET_QDISC_BYPASS (AF_PACKET straight to the driver) and the rings and UMEM
/// of AF_XDP. Everything else passes untouched. The kernel runs cgroup/setsockopt for native
/// calls only: the LSM programs below close the 32-bit compat and io_uring ways in.
#[cgroup_sockopt(setsockopt)]
fn gate_setsockopt(ctx: SockoptContext) -> i32 {
    // SAFETY: helper without pointer arguments; returns 0 past the task's own level.
    sockopt(&ctx, true, |level| unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) })
}

/// The same for kernels that offer cgroup/setsockopt programs neither the current task's
/// ancestors nor its pid (5.10 and the kernels of its time): the allow set cannot be
/// consulted, so the options are denied to every gated cgroup, allowed ones included (fail
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
    // optlen 0: the kernel uses the caller's own buffer, untouched; this also keeps options
    // longer than a page working on kernels that would otherwise reject them.
    so.optlen = 0;
    if !sockets::sockopt_side_door(level, optname) {
        return 1;
    }
    let caller = Caller { hook: HOOK_SETSOCKOPT, task };
    // SAFETY: helper without pointer arguments.
    let cgroup_id = || unsafe { bpf_get_current_cgroup_id() };
    let what = Reported::Sockopt { level, optname };
    let verdict = judge(&caller, live_generation(), ENDPOINT_NONE, what, cgroup_id, ancestor);
    i32::from(verdict != VERDICT_DENIED)
}

// ---- LSM: every syscall ABI ----------------------------------------------------------------------
//
// Global BPF LSM programs (where the kernel runs the BPF LSM): security hooks run for native,
// 32-bit compat and io_uring calls alike, which cgroup/setsockopt does not. Each first tests
// its arguments (almost every call returns there), then whether the caller is gated. An
// earlier LSM program's denial never reaches these: the kernel stops at the first.

const EPERM: i32 = 1;

/// The side doors of `gate_setsockopt`, for every ABI.
#[lsm(hook = "socket_setsockopt")]
fn gate_lsm_setsockopt(ctx: LsmContext) -> i32 {
    // (struct socket *sock, int level, int optname)
    let (level, optname): (i32, i32) = (ctx.arg(1), ctx.arg(2));
    if !sockets::sockopt_side_door(level, optname) {
        return 0;
    }
    lsm_judge(HOOK_SETSOCKOPT, Reported::Sockopt { level, optname })
}

/// A socket that would read the node's IP traffic: AF_PACKET of an IP EtherType, raw IP of
/// a transport protocol.
#[lsm(hook = "socket_create")]
fn gate_lsm_socket(ctx: LsmContext) -> i32 {
    // (int family, int type, int protocol, int kern)
    let (family, sock_type, protocol, kern): (i32, i32, i32, i32) =
        (ctx.arg(0), ctx.arg(1), ctx.arg(2), ctx.arg(3));
    if kern != 0 || !sockets::socket_reads_traffic(family, sock_type, protocol) {
        return 0;
    }
    lsm_judge(HOOK_SOCKET, Reported::Socket { family, protocol })
}

/// An AF_PACKET socket made with protocol 0 (which reads nothing) and bound to an IP
/// EtherType afterwards.
#[lsm(hook = "socket_bind")]
fn gate_lsm_bind(ctx: LsmContext) -> i32 {
    // (struct socket *sock, struct sockaddr *address, int addrlen): the address is already
    // in kernel memory.
    let (address, addrlen): (*const [u8; 4], i32) = (ctx.arg(1), ctx.arg(2));
    if addrlen < 4 {
        return 0;
    }
    // SAFETY: a kernel pointer read through the helper, which checks it. Unreadable: taken
    // for a packet address of an IP EtherType (fail closed).
    let head = unsafe { bpf_probe_read_kernel(address) }.unwrap_or([0xff; 4]);
    let unreadable = head == [0xff; 4];
    if !unreadable && !sockets::bind_reads_traffic(head) {
        return 0;
    }
    let protocol = i32::from(u16::from_be_bytes([head[2], head[3]]).to_be());
    lsm_judge(HOOK_SOCKET, Reported::Socket { family: sockets::AF_PACKET, protocol })
}

/// The verdict for the current task: callers outside the gated root pass; gated ones are
/// judged against the allow set like every other hook (the `socket` hook asks for the
/// capture grant, the others for the metadata grant). Without the live policy the caller
/// counts as gated (fail closed).
#[inline(always)]
fn lsm_judge(hook: u32, what: Reported<'_>) -> i32 {
    let generation = live_generation();
    // SAFETY: helper without pointer arguments; returns 0 past the task's own level.
    let ancestor = |level: u32| unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
    let meta = generation.and_then(|g| POLICY_META.get(g));
    if meta.is_some_and(|m| ancestor(m.root_level) != m.root_id) {
        return 0;
    }
    // SAFETY: helper without pointer arguments.
    let cgroup_id = || unsafe { bpf_get_current_cgroup_id() };
    let caller = Caller { hook, task: true };
    let verdict = judge(&caller, generation, ENDPOINT_NONE, what, cgroup_id, ancestor);
    if verdict == VERDICT_DENIED { -EPERM } else { 0 }
}

// ---- egress ----------------------------------------------------------------------------------
#[inline(always)]
fn egress(ctx: &SkBuffContext, task: bool) -> i32 {
    let skb = ctx.skb.skb;
    // Before the fast path: the proxy's address is not a protected one.
    if proxy::diverted(ctx, || parse_ip(&Skb(&ctx.skb), 0)) {
        return 0;
    }
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
/// verifier rejects `gate_egress`).
#[cgroup_skb(egress)]
fn gate_egress_notask(ctx: SkBuffContext) -> i32 {
    egress(&ctx, false)
}

// ---- tc: the node level ------------------------------------------------------------------------

/// Pass on to whatever else is attached (TCX_NEXT; TC_ACT_UNSPEC for clsact: the same -1).
const TC_NEXT: i32 = -1;
const TC_ACT_SHOT: i32 = 2;

/// The node-level program, on the uplinks' egress and the workload-facing interfaces'
/// ingress. A frame bound for a protected endpoint (or that cannot be read) is denied when
/// * its socket belongs to a gated cgroup that is not allowed (AF_PACKET and other senders
///   the cgroup hooks do not see; the socket survives a veth hop), or
/// * it enters on a workload-facing interface without a socket (a VM, a forwarding loop
///   inside a pod's namespace, a decapsulated tunnel), or with a socket outside the gated
///   root where the interface is strict (STRICT_IFACES), or
/// * it leaves by an uplink, forwarded and without a socket, where the policy gates such
///   traffic (NODE_GATE_FORWARDED: pod-network traffic, Service DNAT after our ingress,
///   frames that entered by an interface whose ingress program is missing), unless it
///   entered by a trusted interface (TRUSTED_IFACES), or
/// * it was made on this node without a socket and carries more than a bare TCP segment
///   (a copy a netfilter rule made of a gated socket's packet).
///
/// Everything else goes on to the next program: host processes outside the gated root
/// (kubelet, CRI-O, the kernel's own sockets), replies, other addresses.
#[classifier]
fn gate_tc(ctx: TcContext) -> i32 {
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
    match net.carries {
        CARRIES_OTHER => TC_NEXT,
        CARRIES_IPV4 => tc_verdict(&ctx, &parse_ipv4(&pkt, net.l3 as usize), HOOK_TC4),
        CARRIES_IPV6 => tc_verdict(&ctx, &parse_ipv6(&pkt, net.l3 as usize), HOOK_TC6),
        _ => tc_verdict(&ctx, &Parsed::UNREADABLE, HOOK_TC4),
    }
}

/// The same for interfaces whose packets do not start with an Ethernet header — tun,
/// WireGuard, ipip, gre, sit, ip6tnl, IPoIB, and every link type not known to carry
/// Ethernet: the packet is read where the kernel says its network header is, which holds
/// whatever header (or none) the link type puts in front. The loader picks the program by
/// the interface's link type.
#[classifier]
fn gate_tc_l3(ctx: TcContext) -> i32 {
    let skb = ctx.skb.skb;
    let pkt = NetSkb(&ctx.skb);
    if pkt.passes_fast() {
        return TC_NEXT;
    }
    // The slow path reads beyond the linear area the header helper sees: pull the headers
    // in (a failure leaves them unreadable, which is denied).
    pkt.pull_headers();
    // SAFETY: reads a field of the context.
    let protocol = u16::from_be(unsafe { (*skb).protocol } as u16);
    match packet::network_of_packet(pkt.bytes::<1>(0).map(|b| b[0] >> 4), protocol) {
        CARRIES_OTHER => TC_NEXT,
        CARRIES_IPV4 => tc_verdict(&ctx, &parse_ipv4(&pkt, 0), HOOK_TC4),
        CARRIES_IPV6 => tc_verdict(&ctx, &parse_ipv6(&pkt, 0), HOOK_TC6),
        _ => tc_verdict(&ctx, &Parsed::UNREADABLE, HOOK_TC4),
    }
}

/// What both node-level programs do once the packet is read (see [`gate_tc`]).
#[inline(always)]
fn tc_verdict(ctx: &TcContext, parsed: &Parsed, hook: u32) -> i32 {
    let skb = ctx.skb.skb;
    if parsed.complete && parsed.rst {
        return TC_NEXT;
    }
    let generation = live_generation();
    let Some(endpoint) = packet::subject(&KernelTables, generation, parsed) else {
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
        // Forwarded: denied where the policy gates such traffic (unless it entered by a
        // trusted interface), else left to the pod network.
        // SAFETY: the value is not read.
        let trusted = || unsafe { TRUSTED_IFACES.get(ingress_ifindex) }.is_some();
        if meta.is_some_and(|m| m.node_flags & NODE_GATE_FORWARDED == 0) || trusted() {
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
