//! Host side: compiles endpoints into the generational table entries that
//! [`match_endpoint`](crate::verdict::match_endpoint) reads.
//!
//! An LPM trie returns only the longest matching prefix, so each prefix's rule set also carries
//! the rules of every policy prefix that contains it: the prefixes that contain an address form
//! a chain, and the longest one's set is then exactly the rules of all endpoints covering the
//! address. Each rule key keeps the lowest endpoint index that has it, so the kernel's
//! "lowest index among the hits" equals the lowest-indexed matching endpoint.
//!
//! IPv4-mapped IPv6 destinations are looked up as IPv4, so IPv6 CIDRs inside `::ffff:0:0/96`
//! compile to IPv4 prefixes, and IPv6 CIDRs that contain all of it also cover `0.0.0.0/0`.
use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::abi::{
    GEN_PREFIX_BITS, KIND_ANYPORT_ANYPROTO, KIND_ANYPORT_PROTO, KIND_PORT_ANYPROTO,
    KIND_PORT_PROTO, MAX_ENDPOINTS, MAX_PORT_RULES, PORT_ANY, PROTO_ANY, PortRuleKey, PrefixV4,
    PrefixV6, PrefixValue,
};
use crate::verdict::Tables;

/// A CIDR; host bits beyond `len` are ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Net {
    V4 { addr: [u8; 4], len: u8 },
    V6 { addr: [u8; 16], len: u8 },
}

/// One protected endpoint. Empty `ports` / `protos` mean all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    pub net: Net,
    pub ports: Vec<u16>,
    pub protos: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompileError {
    TooManyEndpoints { count: usize, max: u32 },
    TooManyRules { count: usize, max: u32 },
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooManyEndpoints { count, max } => {
                write!(f, "{count} endpoints (and IPv4 forms of IPv6 ones), at most {max} fit")
            }
            Self::TooManyRules { count, max } => write!(
                f,
                "the endpoints expand to {count} (prefix, port, protocol) rules, at most {max} fit; \
                 use fewer overlapping CIDRs or port lists"
            ),
        }
    }
}

impl std::error::Error for CompileError {}

/// A rule of the image: (rule set of a prefix, port, protocol), without a generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    pub set_id: u32,
    /// Host byte order; [`PORT_ANY`] for any port.
    pub port: u16,
    /// [`PROTO_ANY`] for any protocol.
    pub proto: u8,
}

/// The table entries of one policy, generation-free: compiled once, kept with the policy,
/// and stamped with a generation only by whoever writes them ([`Image::v4_entries`] and
/// friends: the loader into the maps, [`HostTables::load`] into memory).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Image {
    /// (prefix length in bits, address with host bits clear, value)
    pub v4: Vec<(u8, [u8; 4], PrefixValue)>,
    pub v6: Vec<(u8, [u8; 16], PrefixValue)>,
    /// Rule → endpoint index.
    pub rules: Vec<(Rule, u32)>,
    /// First-byte pre-check of the protected prefixes (goes into PolicyMeta).
    pub prefilter: crate::abi::Prefilter,
}

impl Image {
    /// IPv4 LPM entries of generation `generation`: (LPM prefix length including
    /// [`GEN_PREFIX_BITS`], key data, value).
    pub fn v4_entries(
        &self,
        generation: u32,
    ) -> impl Iterator<Item = (u32, PrefixV4, PrefixValue)> + '_ {
        self.v4.iter().map(move |&(len, addr, v)| {
            (GEN_PREFIX_BITS + u32::from(len), PrefixV4::new(generation, addr), v)
        })
    }

    pub fn v6_entries(
        &self,
        generation: u32,
    ) -> impl Iterator<Item = (u32, PrefixV6, PrefixValue)> + '_ {
        self.v6.iter().map(move |&(len, addr, v)| {
            (GEN_PREFIX_BITS + u32::from(len), PrefixV6::new(generation, addr), v)
        })
    }

    /// PORT_RULES entries of generation `generation`.
    pub fn rule_entries(&self, generation: u32) -> impl Iterator<Item = (PortRuleKey, u32)> + '_ {
        self.rules.iter().map(move |&(r, endpoint)| {
            (PortRuleKey::new(generation, r.set_id, r.port, r.proto), endpoint)
        })
    }
}

fn mask<const N: usize>(mut a: [u8; N], len: u8) -> [u8; N] {
    let len = usize::from(len).min(N * 8);
    for (i, b) in a.iter_mut().enumerate() {
        let keep = len.saturating_sub(i * 8).min(8);
        *b &= if keep == 0 { 0 } else { 0xffu8 << (8 - keep) };
    }
    a
}

const MAPPED_PREFIX: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

impl Net {
    /// The same CIDR with host bits cleared.
    pub fn masked(self) -> Net {
        match self {
            Net::V4 { addr, len } => Net::V4 { addr: mask(addr, len.min(32)), len: len.min(32) },
            Net::V6 { addr, len } => Net::V6 { addr: mask(addr, len.min(128)), len: len.min(128) },
        }
    }

    /// The prefixes the kernel looks this CIDR up under (see the module docs).
    pub fn lookup_forms(self) -> Vec<Net> {
        match self.masked() {
            v4 @ Net::V4 { .. } => vec![v4],
            Net::V6 { addr, len } => {
                let mapped_net = mask(MAPPED_PREFIX_16, len.min(96));
                if len >= 96 && addr[..12] == MAPPED_PREFIX {
                    vec![Net::V4 { addr: [addr[12], addr[13], addr[14], addr[15]], len: len - 96 }]
                } else if len <= 96 && mask(addr, len) == mapped_net {
                    vec![Net::V6 { addr, len }, Net::V4 { addr: [0; 4], len: 0 }]
                } else {
                    vec![Net::V6 { addr, len }]
                }
            }
        }
    }

    fn len(self) -> u8 {
        match self {
            Net::V4 { len, .. } | Net::V6 { len, .. } => len,
        }
    }

    fn with_len(self, l: u8) -> Net {
        match self {
            Net::V4 { addr, .. } => Net::V4 { addr, len: l }.masked(),
            Net::V6 { addr, .. } => Net::V6 { addr, len: l }.masked(),
        }
    }
}

const MAPPED_PREFIX_16: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 0, 0];

/// Compile `endpoints` (policy order = endpoint index) into table entries.
pub fn compile(endpoints: &[EndpointSpec]) -> Result<Image, CompileError> {
    if endpoints.len() > MAX_ENDPOINTS as usize {
        return Err(CompileError::TooManyEndpoints { count: endpoints.len(), max: MAX_ENDPOINTS });
    }
    // Exact prefix -> endpoints declared with it.
    let mut by_net: BTreeMap<Net, Vec<u32>> = BTreeMap::new();
    for (idx, ep) in endpoints.iter().enumerate() {
        for net in ep.net.lookup_forms() {
            by_net.entry(net).or_default().push(idx as u32);
        }
    }
    let (n4, n6) = by_net.keys().fold((0, 0), |(a, b), n| match n {
        Net::V4 { .. } => (a + 1, b),
        Net::V6 { .. } => (a, b + 1),
    });
    if n4 > MAX_ENDPOINTS as usize || n6 > MAX_ENDPOINTS as usize {
        return Err(CompileError::TooManyEndpoints { count: n4.max(n6), max: MAX_ENDPOINTS });
    }

    let mut out = Image::default();
    let mut rules: BTreeMap<Rule, u32> = BTreeMap::new();
    for (set_id, &net) in by_net.keys().enumerate() {
        let set_id = set_id as u32;
        let mut kinds = 0;
        let mut lowest = u32::MAX;
        // Every endpoint whose prefix contains `net`: `net` itself and its shorter forms.
        for l in 0..=net.len() {
            let Some(idxs) = by_net.get(&net.with_len(l)) else { continue };
            for &idx in idxs {
                lowest = lowest.min(idx);
                let ep = &endpoints[idx as usize];
                let ports: &[u16] = if ep.ports.is_empty() { &[PORT_ANY] } else { &ep.ports };
                let protos: &[u8] = if ep.protos.is_empty() { &[PROTO_ANY] } else { &ep.protos };
                for &port in ports {
                    for &proto in protos {
                        kinds |= match (port == PORT_ANY, proto == PROTO_ANY) {
                            (false, false) => KIND_PORT_PROTO,
                            (true, false) => KIND_ANYPORT_PROTO,
                            (false, true) => KIND_PORT_ANYPROTO,
                            (true, true) => KIND_ANYPORT_ANYPROTO,
                        };
                        let e = rules.entry(Rule { set_id, port, proto }).or_insert(idx);
                        *e = (*e).min(idx);
                    }
                }
            }
            if rules.len() > MAX_PORT_RULES as usize {
                return Err(CompileError::TooManyRules { count: rules.len(), max: MAX_PORT_RULES });
            }
        }
        let value = PrefixValue { set_id, kinds, endpoint: lowest };
        match net {
            Net::V4 { addr, len } => {
                out.prefilter.add(false, &addr, u32::from(len));
                out.v4.push((len, addr, value));
            }
            Net::V6 { addr, len } => {
                out.prefilter.add(true, &addr, u32::from(len));
                out.v6.push((len, addr, value));
            }
        }
    }
    out.rules = rules.into_iter().collect();
    Ok(out)
}

/// The compiled tables held in memory and looked up the way the kernel maps do (longest prefix
/// first). Used by tests and by `gate-agent check --explain`-style tooling.
#[derive(Default, Debug)]
pub struct HostTables {
    v4: HashMap<(u32, [u8; 4], u8), PrefixValue>,
    v6: HashMap<(u32, [u8; 16], u8), PrefixValue>,
    rules: HashMap<PortRuleKey, u32>,
    allow: HashMap<crate::abi::AllowKey, u32>,
    prefilter: HashMap<u32, crate::abi::Prefilter>,
}

impl HostTables {
    /// Load an image as generation `generation`.
    pub fn load(&mut self, image: &Image, generation: u32) {
        for &(len, addr, v) in &image.v4 {
            self.v4.insert((generation, addr, len), v);
        }
        for &(len, addr, v) in &image.v6 {
            self.v6.insert((generation, addr, len), v);
        }
        self.rules.extend(image.rule_entries(generation));
        self.prefilter.insert(generation, image.prefilter);
    }

    pub fn allow(&mut self, key: crate::abi::AllowKey, entry: u32) {
        self.allow.insert(key, entry);
    }
}

impl Tables for HostTables {
    fn prefix_v4(&self, generation: u32, addr: [u8; 4]) -> Option<PrefixValue> {
        (0..=32u8).rev().find_map(|l| self.v4.get(&(generation, mask(addr, l), l)).copied())
    }
    fn prefix_v6(&self, generation: u32, addr: [u8; 16]) -> Option<PrefixValue> {
        (0..=128u8).rev().find_map(|l| self.v6.get(&(generation, mask(addr, l), l)).copied())
    }
    fn port_rule(&self, key: &PortRuleKey) -> Option<u32> {
        self.rules.get(key).copied()
    }
    fn allowed(&self, key: &crate::abi::AllowKey) -> Option<u32> {
        self.allow.get(key).copied()
    }
    fn may_match(&self, generation: u32, addr: &crate::verdict::Addr) -> bool {
        let Some(p) = self.prefilter.get(&generation) else { return true };
        !crate::verdict::surely_unprotected(p, addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{PROTO_TCP, PROTO_UDP};
    use crate::verdict::{Addr, Dst, Octets, match_address, match_endpoint};
    use proptest::prelude::*;

    fn v4(a: [u8; 4], len: u8) -> Net {
        Net::V4 { addr: a, len }
    }
    fn v6(a: [u8; 16], len: u8) -> Net {
        Net::V6 { addr: a, len }
    }
    fn mapped(a: [u8; 4]) -> [u8; 16] {
        let mut m = MAPPED_PREFIX_16;
        m[12..].copy_from_slice(&a);
        m
    }
    const EC2_V6: [u8; 16] = [0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54];

    /// The policy read plainly: lowest-indexed endpoint that covers the destination.
    fn reference(eps: &[EndpointSpec], dst: &Dst) -> Option<u32> {
        let contains = |net: Net, addr: Addr| match (net.masked(), addr.octets()) {
            (Net::V4 { addr: n, len }, Octets::V4(a)) => mask(a, len) == n,
            (Net::V6 { addr: n, len }, Octets::V6(a)) => mask(a, len) == n,
            (Net::V6 { addr: n, len }, Octets::V4(a)) => mask(mapped(a), len) == n,
            (Net::V4 { .. }, Octets::V6(_)) => false,
        };
        eps.iter()
            .position(|e| {
                contains(e.net, dst.addr)
                    && (e.ports.is_empty() || e.ports.contains(&dst.port))
                    && (e.protos.is_empty() || e.protos.contains(&dst.proto))
            })
            .map(|i| i as u32)
    }

    /// The lowest-indexed endpoint whose CIDR covers the address, ports and protocols aside.
    fn reference_address(eps: &[EndpointSpec], addr: Addr) -> Option<u32> {
        let any = |e: &EndpointSpec| EndpointSpec { ports: vec![], protos: vec![], ..e.clone() };
        let wide: Vec<EndpointSpec> = eps.iter().map(any).collect();
        reference(&wide, &Dst { addr, port: 0, proto: 0 })
    }

    fn tables(generation: u32, eps: &[EndpointSpec]) -> HostTables {
        let mut t = HostTables::default();
        t.load(&compile(eps).expect("compiles"), generation);
        t
    }

    fn ep(net: Net, ports: &[u16], protos: &[u8]) -> EndpointSpec {
        EndpointSpec { net, ports: ports.to_vec(), protos: protos.to_vec() }
    }

    fn dst4(a: [u8; 4], port: u16, proto: u8) -> Dst {
        Dst { addr: Addr::v4(a), port, proto }
    }

    #[test]
    fn gcp_dns_stays_open_while_http_is_refused() {
        let eps = [ep(v4([169, 254, 169, 254], 32), &[80, 443], &[PROTO_TCP])];
        let t = tables(0, &eps);
        let imds = [169, 254, 169, 254];
        assert_eq!(match_endpoint(&t, 0, &dst4(imds, 80, PROTO_TCP)), Some(0));
        assert_eq!(match_endpoint(&t, 0, &dst4(imds, 443, PROTO_TCP)), Some(0));
        assert_eq!(match_endpoint(&t, 0, &dst4(imds, 53, PROTO_UDP)), None);
        assert_eq!(match_endpoint(&t, 0, &dst4(imds, 80, PROTO_UDP)), None);
        assert_eq!(match_endpoint(&t, 0, &dst4([169, 254, 169, 253], 80, PROTO_TCP)), None);
        // The other generation is empty.
        assert_eq!(match_endpoint(&t, 1, &dst4(imds, 80, PROTO_TCP)), None);
    }

    #[test]
    fn shorter_prefix_rules_survive_a_longer_prefix() {
        // /16 all ports; /32 only :80. A lookup of .254:443 hits the /32 in the trie and must
        // still see the /16's rule.
        let eps = [
            ep(v4([169, 254, 169, 254], 32), &[80], &[PROTO_TCP]),
            ep(v4([100, 100, 0, 0], 16), &[], &[]),
            ep(v4([169, 254, 0, 0], 16), &[], &[PROTO_UDP]),
        ];
        let t = tables(0, &eps);
        assert_eq!(match_endpoint(&t, 0, &dst4([169, 254, 169, 254], 80, PROTO_TCP)), Some(0));
        assert_eq!(match_endpoint(&t, 0, &dst4([169, 254, 169, 254], 53, PROTO_UDP)), Some(2));
        assert_eq!(match_endpoint(&t, 0, &dst4([169, 254, 169, 254], 443, PROTO_TCP)), None);
        assert_eq!(match_endpoint(&t, 0, &dst4([100, 100, 100, 200], 0, 1)), Some(1));
    }

    #[test]
    fn mapped_v6_cidr_protects_the_v4_address() {
        let eps = [ep(v6(mapped([169, 254, 169, 254]), 128), &[80], &[])];
        let t = tables(0, &eps);
        assert_eq!(match_endpoint(&t, 0, &dst4([169, 254, 169, 254], 80, PROTO_TCP)), Some(0));
        let c = compile(&eps).unwrap();
        assert!(c.v6.is_empty(), "a mapped CIDR lives in the IPv4 trie only");
    }

    #[test]
    fn v6_cidr_covering_mapped_range_covers_all_v4() {
        let eps = [ep(v6([0; 16], 0), &[80], &[])];
        let t = tables(0, &eps);
        assert_eq!(match_endpoint(&t, 0, &dst4([1, 2, 3, 4], 80, PROTO_TCP)), Some(0));
        let d = Dst { addr: Addr::v6(EC2_V6), port: 80, proto: PROTO_TCP };
        assert_eq!(match_endpoint(&t, 0, &d), Some(0));
    }

    #[test]
    fn limits_are_errors() {
        let many: Vec<_> =
            (0..=MAX_ENDPOINTS).map(|i| ep(v4(i.to_be_bytes(), 32), &[80], &[])).collect();
        assert!(matches!(compile(&many), Err(CompileError::TooManyEndpoints { .. })));
        let ports: Vec<u16> = (1..=u16::MAX).collect();
        let wide = [ep(v4([10, 0, 0, 0], 8), &ports, &[PROTO_TCP, PROTO_UDP])];
        assert!(matches!(compile(&wide), Err(CompileError::TooManyRules { .. })));
    }

    #[test]
    fn ten_thousand_endpoints_compile() {
        let many: Vec<_> = (0..10_000u32)
            .map(|i| ep(v4((0x0a00_0000 + i).to_be_bytes(), 32), &[80], &[PROTO_TCP]))
            .collect();
        let c = compile(&many).unwrap();
        assert_eq!(c.v4.len(), 10_000);
        assert_eq!(c.rules.len(), 10_000);
    }

    // ---- property: compiled tables agree with the plain reading ----------------------------

    fn arb_v4() -> impl Strategy<Value = [u8; 4]> {
        prop_oneof![
            Just([169, 254, 169, 254]),
            Just([169, 254, 169, 253]),
            Just([168, 63, 129, 16]),
            Just([100, 100, 100, 200]),
            Just([10, 0, 0, 1]),
            any::<[u8; 4]>(),
        ]
    }
    fn arb_v6() -> impl Strategy<Value = [u8; 16]> {
        prop_oneof![
            Just(EC2_V6),
            Just([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xa9, 0xfe, 0xa9, 0xfe]),
            arb_v4().prop_map(mapped),
            any::<[u8; 16]>(),
        ]
    }
    fn arb_net() -> impl Strategy<Value = Net> {
        prop_oneof![
            (arb_v4(), prop_oneof![Just(32u8), Just(24), Just(16), Just(0), 0..=32u8])
                .prop_map(|(a, l)| v4(a, l)),
            (arb_v6(), prop_oneof![Just(128u8), Just(96), Just(104), Just(64), Just(0), 0..=128u8])
                .prop_map(|(a, l)| v6(a, l)),
        ]
    }
    fn arb_ep() -> impl Strategy<Value = EndpointSpec> {
        (
            arb_net(),
            proptest::collection::vec(
                prop_oneof![Just(53u16), Just(80), Just(443), 1..=65535u16],
                0..3,
            ),
            proptest::collection::vec(prop_oneof![Just(PROTO_TCP), Just(PROTO_UDP)], 0..2),
        )
            .prop_map(|(net, ports, protos)| EndpointSpec { net, ports, protos })
    }
    fn arb_dst() -> impl Strategy<Value = Dst> {
        (
            prop_oneof![arb_v4().prop_map(Addr::v4), arb_v6().prop_map(Addr::from_v6)],
            prop_oneof![Just(0u16), Just(53), Just(80), Just(443), any::<u16>()],
            prop_oneof![Just(PROTO_TCP), Just(PROTO_UDP), Just(1u8), any::<u8>()],
        )
            .prop_map(|(addr, port, proto)| Dst { addr, port, proto })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        #[test]
        fn compiled_tables_agree_with_reference(
            eps in proptest::collection::vec(arb_ep(), 0..12),
            dsts in proptest::collection::vec(arb_dst(), 1..24),
            generation in 0u32..2,
        ) {
            let t = tables(generation, &eps);
            for d in &dsts {
                prop_assert_eq!(match_endpoint(&t, generation, d), reference(&eps, d), "dst {:?}", d);
                prop_assert_eq!(
                    match_address(&t, generation, &d.addr),
                    reference_address(&eps, d.addr),
                    "address of {:?}", d
                );
                // Destinations drawn near the endpoints, to hit the prefixes.
            }
            for e in &eps {
                let addr = match e.net { Net::V4 { addr, .. } => Addr::v4(addr), Net::V6 { addr, .. } => Addr::from_v6(addr) };
                prop_assert_eq!(match_address(&t, generation, &addr), reference_address(&eps, addr));
                for port in [0u16, 53, 80, 443] {
                    for proto in [PROTO_TCP, PROTO_UDP, 1] {
                        let d = Dst { addr, port, proto };
                        prop_assert_eq!(match_endpoint(&t, generation, &d), reference(&eps, &d), "dst {:?}", d);
                    }
                }
            }
        }
    }
}
