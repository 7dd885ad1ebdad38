//! The decisions the kernel programs make, as pure functions over a [`Tables`] view of the maps.
//!
//! Order of work per invocation, cheapest exit first:
//! 0. [`surely_unprotected`]: the packet programs' fast path: one bit of the PREFILTER map
//!    for the destination's first byte; most traffic ends here.
//! 1. [`match_endpoint`]: one LPM lookup; a miss (the common case: not a metadata address)
//!    ends it. A hit costs at most four hash lookups, only for the key shapes the prefix has.
//! 2. [`cgroup_allowed`]: walks the cgroup's ancestors below the gated root (bounded).
//! 3. [`decide`]: mode and allow → verdict.
use crate::abi::{
    AllowKey, ENDPOINT_NONE, ENTRY_SERVED, HTTP_PORT, KIND_ANYPORT_ANYPROTO, KIND_ANYPORT_PROTO,
    KIND_PORT_ANYPROTO, KIND_PORT_PROTO, MAX_CGROUP_DEPTH, MAX_PENDING_PER_WORKLOAD, MODE_AUDIT,
    PORT_ANY, PROTO_ANY, PROTO_TCP, PortRuleKey, Prefilter, PrefixValue, VERDICT_ALLOWED,
    VERDICT_AUDITED, VERDICT_DENIED, allow_entry,
};

/// A destination address as the hooks see it: IPv4 (its four bytes first, the other twelve
/// zero) or IPv6. Bytes and a flag rather than an enum of the two: an enum's IPv4 variant
/// leaves twelve bytes undefined, the compiler spills them where an IPv4 and an IPv6 path
/// meet, and kernels before 5.12 reject any program that reads an uninitialised stack slot.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Addr {
    bytes: [u8; 16],
    v6: bool,
}

/// An [`Addr`] to match on (user space: the programs read [`Addr::bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Octets {
    V4([u8; 4]),
    V6([u8; 16]),
}

impl Addr {
    /// An IPv4 address.
    #[inline(always)]
    pub const fn v4(a: [u8; 4]) -> Self {
        let mut bytes = [0u8; 16];
        bytes[0] = a[0];
        bytes[1] = a[1];
        bytes[2] = a[2];
        bytes[3] = a[3];
        Addr { bytes, v6: false }
    }

    /// An IPv6 address, as it is (see [`from_v6`](Self::from_v6) for IPv4-mapped ones).
    #[inline(always)]
    pub const fn v6(a: [u8; 16]) -> Self {
        Addr { bytes: a, v6: true }
    }

    /// An IPv6 address, with IPv4-mapped ones (`::ffff:a.b.c.d`) turned into the IPv4 address
    /// they reach.
    #[inline(always)]
    pub fn from_v6(a: [u8; 16]) -> Self {
        if a[..10] == [0; 10] && a[10] == 0xff && a[11] == 0xff {
            Addr::v4([a[12], a[13], a[14], a[15]])
        } else {
            Addr::v6(a)
        }
    }

    /// IPv6 address from the four network-order u32 words of `bpf_sock_addr.user_ip6` /
    /// `__sk_buff.remote_ip6` as read by a little- or big-endian host.
    #[inline(always)]
    pub fn from_v6_words(w: [u32; 4]) -> Self {
        let mut a = [0u8; 16];
        let mut i = 0;
        while i < 4 {
            let b = w[i].to_ne_bytes();
            a[i * 4] = b[0];
            a[i * 4 + 1] = b[1];
            a[i * 4 + 2] = b[2];
            a[i * 4 + 3] = b[3];
            i += 1;
        }
        Self::from_v6(a)
    }

    #[inline(always)]
    pub const fn is_v6(&self) -> bool {
        self.v6
    }

    /// The address bytes: an IPv4 address in the first four, the rest zero.
    #[inline(always)]
    pub const fn bytes(&self) -> &[u8; 16] {
        &self.bytes
    }

    /// The first and the last byte of the address (what the prefilter tests).
    #[inline(always)]
    pub const fn first_last(&self) -> (u8, u8) {
        (self.bytes[0], if self.v6 { self.bytes[15] } else { self.bytes[3] })
    }

    /// The IPv4 address (the first four bytes; meaningful when not [`is_v6`](Self::is_v6)).
    #[inline(always)]
    pub const fn v4_octets(&self) -> [u8; 4] {
        [self.bytes[0], self.bytes[1], self.bytes[2], self.bytes[3]]
    }

    /// The address to match on.
    #[inline(always)]
    pub const fn octets(&self) -> Octets {
        if self.v6 { Octets::V6(self.bytes) } else { Octets::V4(self.v4_octets()) }
    }
}

impl From<core::net::IpAddr> for Addr {
    /// IPv4-mapped IPv6 addresses become the IPv4 address they reach.
    fn from(ip: core::net::IpAddr) -> Self {
        match ip {
            core::net::IpAddr::V4(a) => Addr::v4(a.octets()),
            core::net::IpAddr::V6(a) => Addr::from_v6(a.octets()),
        }
    }
}

impl From<Addr> for core::net::IpAddr {
    fn from(a: Addr) -> Self {
        match a.octets() {
            Octets::V4(b) => core::net::IpAddr::from(b),
            Octets::V6(b) => core::net::IpAddr::from(b),
        }
    }
}

impl core::fmt::Debug for Addr {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}", core::net::IpAddr::from(*self))
    }
}

/// Destination of a connect, a datagram or a packet. `port` is host order, 0 if none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Dst {
    pub addr: Addr,
    pub port: u16,
    pub proto: u8,
}

/// Read-only view of the policy maps of one generation.
pub trait Tables {
    /// Longest-prefix match of an IPv4 address in generation `generation`.
    fn prefix_v4(&self, generation: u32, addr: [u8; 4]) -> Option<PrefixValue>;
    fn prefix_v6(&self, generation: u32, addr: [u8; 16]) -> Option<PrefixValue>;
    /// Endpoint index of a rule key.
    fn port_rule(&self, key: &PortRuleKey) -> Option<u32>;
    /// The ALLOWED value (entry and grants, [`crate::abi::allow_value`]) if the cgroup is on
    /// the allow set.
    fn allowed(&self, key: &AllowKey) -> Option<u32>;
    /// Cheap pre-check: `false` only if no protected prefix of the generation can contain
    /// `addr` (see [`crate::abi::Prefilter`]).
    fn may_match(&self, _generation: u32, _addr: &Addr) -> bool {
        true
    }
}

/// The policy endpoint `dst` falls under, if any: the lowest-indexed endpoint whose CIDR
/// contains the address and whose ports and protocols admit the destination.
#[inline(always)]
pub fn match_endpoint<T: Tables>(t: &T, generation: u32, dst: &Dst) -> Option<u32> {
    if !t.may_match(generation, &dst.addr) {
        return None;
    }
    let pv = if dst.addr.is_v6() {
        t.prefix_v6(generation, *dst.addr.bytes())
    } else {
        t.prefix_v4(generation, dst.addr.v4_octets())
    }?;
    let lookup = |port: u16, proto: u8| {
        t.port_rule(&PortRuleKey::new(generation, pv.set_id, port, proto)).unwrap_or(ENDPOINT_NONE)
    };
    let has_port = dst.port != PORT_ANY;
    // [`ENDPOINT_NONE`] (the highest index) while combining lookups: a plain sentinel rather
    // than `Option`, whose `None` payload is undefined and which the BPF verifier rejects to
    // see copied around.
    let mut best = ENDPOINT_NONE;
    if pv.kinds & KIND_PORT_PROTO != 0 && has_port {
        best = best.min(lookup(dst.port, dst.proto));
    }
    if pv.kinds & KIND_ANYPORT_PROTO != 0 {
        best = best.min(lookup(PORT_ANY, dst.proto));
    }
    if pv.kinds & KIND_PORT_ANYPROTO != 0 && has_port {
        best = best.min(lookup(dst.port, PROTO_ANY));
    }
    if pv.kinds & KIND_ANYPORT_ANYPROTO != 0 {
        best = best.min(lookup(PORT_ANY, PROTO_ANY));
    }
    if best == ENDPOINT_NONE { None } else { Some(best) }
}

/// The policy endpoint whose CIDR covers `addr`, whatever its ports and protocols: the
/// lowest-indexed one. What a packet is judged against when its transport cannot be read.
#[inline(always)]
pub fn match_address<T: Tables>(t: &T, generation: u32, addr: &Addr) -> Option<u32> {
    if !t.may_match(generation, addr) {
        return None;
    }
    let pv = if addr.is_v6() {
        t.prefix_v6(generation, *addr.bytes())
    } else {
        t.prefix_v4(generation, addr.v4_octets())
    }?;
    Some(pv.endpoint)
}

/// Whether `filter` says that no protected prefix can contain `addr` (the packet programs'
/// first test: then the packet passes without another look).
#[inline(always)]
pub fn surely_unprotected(filter: &Prefilter, addr: &Addr) -> bool {
    let (first, last) = addr.first_last();
    !filter.may(addr.is_v6(), first, last)
}

/// Whether a cgroup, or one of its ancestors strictly below the gated root, is on the allow
/// set by an entry that grants `need` (`GRANT_*`); returns the allow entry index. An
/// ancestor on the set without that grant does not end the walk: a pod allowed the metadata
/// service may hold a container allowed to capture. `ancestor(level)` returns the cgroup id of the ancestor
/// at that absolute level, or 0 past the cgroup's own level (what
/// `bpf_get_current_ancestor_cgroup_id` / `bpf_skb_ancestor_cgroup_id` do). The walk is
/// bounded by [`MAX_CGROUP_DEPTH`] levels below the root.
#[inline(always)]
pub fn cgroup_allowed<T: Tables>(
    t: &T,
    generation: u32,
    root_level: u32,
    need: u32,
    mut ancestor: impl FnMut(u32) -> u64,
) -> Option<u32> {
    let mut depth = 1;
    while depth <= MAX_CGROUP_DEPTH {
        let id = ancestor(root_level + depth);
        if id == 0 {
            return None;
        }
        if let Some(value) = t.allowed(&AllowKey::new(generation, id))
            && value & need != 0
        {
            return Some(allow_entry(value));
        }
        depth += 1;
    }
    None
}

/// Where a connect that the allow set does not let through goes instead of being denied:
/// to the metadata proxy, under the allow entry whose paths apply (`proxy_entry`, the walk
/// for [`GRANT_PROXY`](crate::abi::GRANT_PROXY)), else under the policy's `served` paths
/// ([`ENTRY_SERVED`]); `None`: denied. In audit mode every such connect goes to the proxy,
/// which passes every path and records which ones the workload read (audit, then
/// `suggest`'s `paths:`). Only TCP to the endpoint's [`HTTP_PORT`]: other ports and
/// protocols keep the allow-or-deny verdict.
#[inline(always)]
pub fn proxy_route(
    mode: u32,
    served: u32,
    dst: &Dst,
    proxy_entry: impl FnOnce() -> Option<u32>,
) -> Option<u32> {
    if dst.proto != PROTO_TCP || dst.port != HTTP_PORT {
        return None;
    }
    match proxy_entry() {
        Some(entry) => Some(entry),
        None if served != 0 || mode == MODE_AUDIT => Some(ENTRY_SERVED),
        None => None,
    }
}

/// The workload a connect belongs to, for quotas one workload must not be able to exhaust for
/// the others: the parent of the caller's cgroup (`cgroup_id`, at some level below the gated
/// root at `root_level`), which on a node is the pod's cgroup (containers are its leaves,
/// the QoS classes' cgroups sit above it); the caller's own cgroup where its parent is the
/// root itself (standalone workloads one level down) or where the walk does not find it.
/// `ancestor(level)` returns the caller's ancestor at `level` (0 past its own level).
#[inline(always)]
pub fn workload_of(root_level: u32, cgroup_id: u64, mut ancestor: impl FnMut(u32) -> u64) -> u64 {
    let mut parent = 0;
    let mut depth = 1;
    while depth <= MAX_CGROUP_DEPTH {
        let id = ancestor(root_level + depth);
        if id == 0 {
            break;
        }
        if id == cgroup_id {
            return if parent == 0 { cgroup_id } else { parent };
        }
        parent = id;
        depth += 1;
    }
    cgroup_id
}

/// Whether a workload with `count` handshakes in flight (INFLIGHT's value) may start another
/// one. The count is kept with atomic adds and subtracts; one lost to an LRU eviction can make
/// a later subtract wrap below zero, which is read as zero (a workload is never denied for
/// records it does not have).
#[inline(always)]
pub fn may_start_handshake(count: u32) -> bool {
    !(MAX_PENDING_PER_WORKLOAD..1 << 31).contains(&count)
}

/// Verdict for traffic that matched an endpoint. Any mode other than audit enforces.
#[inline(always)]
pub fn decide(mode: u32, allowed: bool) -> u32 {
    if allowed {
        VERDICT_ALLOWED
    } else if mode == MODE_AUDIT {
        VERDICT_AUDITED
    } else {
        VERDICT_DENIED
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{ALLOW_ENTRY_MASK, GRANT_METADATA, GRANTS_ALL, allow_value, grant_needed};
    use std::collections::HashMap;

    #[test]
    fn v4_mapped_v6_becomes_v4() {
        let mut a = [0u8; 16];
        a[10] = 0xff;
        a[11] = 0xff;
        a[12..].copy_from_slice(&[169, 254, 169, 254]);
        assert_eq!(Addr::from_v6(a), Addr::v4([169, 254, 169, 254]));
        // ::169.254.169.254 (IPv4-compatible, deprecated) is not mapped: stays IPv6.
        a[10] = 0;
        a[11] = 0;
        assert_eq!(Addr::from_v6(a), Addr::v6(a));
    }

    #[test]
    fn words_are_network_order() {
        // fd00:ec2::254 as the kernel stores it: network-order bytes in each u32.
        let bytes: [u8; 16] = [0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54];
        let w = [0, 1, 2, 3].map(|i| {
            u32::from_ne_bytes([bytes[i * 4], bytes[i * 4 + 1], bytes[i * 4 + 2], bytes[i * 4 + 3]])
        });
        assert_eq!(Addr::from_v6_words(w), Addr::v6(bytes));
    }

    #[test]
    fn decide_modes() {
        assert_eq!(decide(crate::abi::MODE_ENFORCE, false), VERDICT_DENIED);
        assert_eq!(decide(MODE_AUDIT, false), VERDICT_AUDITED);
        assert_eq!(decide(MODE_AUDIT, true), VERDICT_ALLOWED);
        // Unknown modes fail closed.
        assert_eq!(decide(77, false), VERDICT_DENIED);
    }

    struct Allow(HashMap<(u32, u64), u32>);
    impl Tables for Allow {
        fn prefix_v4(&self, _: u32, _: [u8; 4]) -> Option<PrefixValue> {
            None
        }
        fn prefix_v6(&self, _: u32, _: [u8; 16]) -> Option<PrefixValue> {
            None
        }
        fn port_rule(&self, _: &PortRuleKey) -> Option<u32> {
            None
        }
        fn allowed(&self, k: &AllowKey) -> Option<u32> {
            self.0.get(&(k.generation, k.cgroup_id)).copied()
        }
    }

    /// Path of cgroup ids from level 0 (root of the hierarchy) down.
    fn walker(path: &'static [u64]) -> impl FnMut(u32) -> u64 {
        move |level| path.get(level as usize).copied().unwrap_or(0)
    }

    #[test]
    fn allow_walk_covers_descendants_below_root_only() {
        // hierarchy root(1) / gated(2) / allowed(3) / child(4) / grandchild(5)
        const M: u32 = GRANT_METADATA;
        let t = Allow([((0, 3), allow_value(7, M))].into_iter().collect());
        assert_eq!(cgroup_allowed(&t, 0, 1, M, walker(&[1, 2, 3, 4, 5])), Some(7));
        assert_eq!(cgroup_allowed(&t, 0, 1, M, walker(&[1, 2, 3])), Some(7));
        // Another generation does not see it.
        assert_eq!(cgroup_allowed(&t, 1, 1, M, walker(&[1, 2, 3, 4, 5])), None);
        // A sibling is not allowed, nor the root itself.
        assert_eq!(cgroup_allowed(&t, 0, 1, M, walker(&[1, 2, 9, 4])), None);
        assert_eq!(cgroup_allowed(&t, 0, 1, M, walker(&[1, 2])), None);
        // The gated root on the allow set does not open the gate for everything below it.
        let t = Allow([((0, 2), allow_value(1, M))].into_iter().collect());
        assert_eq!(cgroup_allowed(&t, 0, 1, M, walker(&[1, 2, 3, 4])), None);
    }

    #[test]
    fn the_walk_looks_for_the_grant_it_needs() {
        use crate::abi::{GRANT_CAPTURE, HOOK_CONNECT4, HOOK_SOCKET, HOOK_TC4};
        const M: u32 = GRANT_METADATA;
        const C: u32 = GRANT_CAPTURE;
        // pod(3) allowed the metadata service by entry 0, its container(4) capture by entry 1.
        let t = Allow([((0, 3), allow_value(0, M)), ((0, 4), allow_value(1, C))].into());
        let container = || walker(&[1, 2, 3, 4]);
        assert_eq!(cgroup_allowed(&t, 0, 1, M, container()), Some(0));
        assert_eq!(cgroup_allowed(&t, 0, 1, C, container()), Some(1));
        // The pod's other containers: metadata only.
        assert_eq!(cgroup_allowed(&t, 0, 1, C, walker(&[1, 2, 3, 5])), None);
        // An entry granting nothing allows nothing (a value of an older layout, fail closed).
        let t = Allow([((0, 3), 7)].into());
        assert_eq!(cgroup_allowed(&t, 0, 1, M, container()), None);
        // Which grant each hook needs.
        assert_eq!(grant_needed(HOOK_SOCKET), C);
        assert_eq!((grant_needed(HOOK_CONNECT4), grant_needed(HOOK_TC4)), (M, M));
        assert_eq!(
            (allow_entry(allow_value(5, GRANTS_ALL)), GRANTS_ALL & ALLOW_ENTRY_MASK),
            (5, 0)
        );
    }

    #[test]
    fn only_http_connects_go_through_the_proxy() {
        use crate::abi::{MODE_ENFORCE, PROTO_UDP};
        let dst = |port, proto| Dst { addr: Addr::v4([169, 254, 169, 254]), port, proto };
        let http = dst(HTTP_PORT, PROTO_TCP);
        // An entry narrowed to paths: its own entry, whatever `served` says.
        assert_eq!(proxy_route(MODE_ENFORCE, 0, &http, || Some(3)), Some(3));
        assert_eq!(proxy_route(MODE_ENFORCE, 1, &http, || Some(3)), Some(3));
        // No entry: `served`, or denied.
        assert_eq!(proxy_route(MODE_ENFORCE, 1, &http, || None), Some(ENTRY_SERVED));
        assert_eq!(proxy_route(MODE_ENFORCE, 0, &http, || None), None);
        // Other ports and protocols keep allow-or-deny: DNS, UDP, TLS.
        for other in [dst(53, PROTO_TCP), dst(HTTP_PORT, PROTO_UDP), dst(443, PROTO_TCP)] {
            assert_eq!(proxy_route(MODE_ENFORCE, 1, &other, || Some(3)), None, "{other:?}");
        }
        // Audit mode sends every HTTP connect to the proxy, which passes and records paths.
        assert_eq!(proxy_route(MODE_AUDIT, 1, &http, || Some(3)), Some(3));
        assert_eq!(proxy_route(MODE_AUDIT, 0, &http, || None), Some(ENTRY_SERVED));
        assert_eq!(proxy_route(MODE_AUDIT, 0, &dst(53, PROTO_UDP), || None), None);
        // An unknown mode enforces.
        assert_eq!(proxy_route(77, 1, &http, || None), Some(ENTRY_SERVED));
    }

    #[test]
    fn prefilter_fast_path() {
        let mut f = Prefilter::default();
        let mut v6 = [0u8; 16];
        v6[0] = 0xfd;
        v6[15] = 0x54;
        f.add(false, &[169, 254, 169, 254], 32);
        f.add(true, &v6, 128);
        assert!(!surely_unprotected(&f, &Addr::v4([169, 254, 169, 254])));
        assert!(surely_unprotected(&f, &Addr::v4([10, 0, 0, 1])));
        assert!(surely_unprotected(&f, &Addr::v4([169, 254, 169, 253])), "the DNS neighbour");
        assert!(!surely_unprotected(&f, &Addr::v6(v6)));
        // 169 as an IPv6 first byte is not IPv4's 169.
        v6[0] = 169;
        assert!(surely_unprotected(&f, &Addr::v6(v6)));
        // An empty filter (a gate whose first policy is not yet written) protects nothing;
        // the agent writes the policy before it attaches anything.
        assert!(surely_unprotected(&Prefilter::default(), &Addr::v4([169, 254, 169, 254])));
    }

    #[test]
    fn allow_walk_is_bounded() {
        let t = Allow([((0, 999), 0)].into_iter().collect());
        let mut calls = 0;
        // An endless chain of ancestors (ids 100, 101, …) never on the allow set.
        let r = cgroup_allowed(&t, 0, 0, GRANT_METADATA, |l| {
            calls += 1;
            100 + u64::from(l)
        });
        assert_eq!(r, None);
        assert_eq!(calls, MAX_CGROUP_DEPTH);
    }

    /// Ancestors of a cgroup as a list of ids from the level below the root (level 1 here).
    fn chain(ids: &[u64]) -> impl FnMut(u32) -> u64 + '_ {
        move |level| ids.get(level as usize - 1).copied().unwrap_or(0)
    }

    #[test]
    fn a_workload_is_the_parent_of_the_callers_cgroup() {
        // kubepods(root, level 0) / burstable(1) / pod(2) / container(3).
        assert_eq!(workload_of(0, 3, chain(&[1, 2, 3])), 2, "a burstable pod's container");
        // kubepods / pod(2) / container(3): a guaranteed pod.
        assert_eq!(workload_of(0, 3, chain(&[2, 3])), 2);
        // Two containers of one pod share the workload; another pod's do not.
        assert_eq!(workload_of(0, 4, chain(&[1, 2, 4])), 2);
        assert_eq!(workload_of(0, 6, chain(&[1, 5, 6])), 5);
        // Standalone: a workload cgroup right below the root is its own workload.
        assert_eq!(workload_of(0, 9, chain(&[9])), 9);
        // The root at a deeper level: the same.
        assert_eq!(workload_of(4, 3, chain(&[0, 0, 0, 0, 1, 2, 3])), 2);
    }

    #[test]
    fn a_caller_not_found_below_the_root_is_its_own_workload() {
        // The walk ends (0) before it meets the caller, or never meets it within the depth.
        assert_eq!(workload_of(0, 42, chain(&[1, 2])), 42);
        let deep: std::vec::Vec<u64> = (1..=u64::from(MAX_CGROUP_DEPTH) + 2).collect();
        assert_eq!(workload_of(0, 999, chain(&deep)), 999);
    }

    #[test]
    fn a_workload_starts_handshakes_up_to_its_quota_and_a_wrapped_count_reads_as_none() {
        assert!(may_start_handshake(0));
        assert!(may_start_handshake(MAX_PENDING_PER_WORKLOAD - 1));
        assert!(!may_start_handshake(MAX_PENDING_PER_WORKLOAD));
        assert!(!may_start_handshake(1 << 20));
        // One subtract too many (its add was lost to an eviction): below zero, read as zero.
        assert!(may_start_handshake(0u32.wrapping_sub(1)));
    }
}
