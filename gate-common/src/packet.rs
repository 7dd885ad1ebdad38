//! Reading a packet the way it will be delivered, failing closed: the kernel programs call
//! these functions on an sk_buff, the host tests on byte slices.
//!
//! * The Ethernet type comes from the frame's bytes, after at most [`MAX_VLAN_TAGS`]
//!   802.1Q / 802.1ad tags — never from `skb->protocol`, which an AF_PACKET sender chooses.
//! * IPv6 extension headers are walked for at most [`MAX_V6_EXT_HEADERS`] headers. A chain
//!   longer than that, a header or transport header that cannot be read, ESP, or any fragment
//!   leaves the transport unknown: the packet is then [`Parsed::complete`] `false` and is
//!   judged on its destination address alone ([`endpoint`]): a
//!   protected address is denied whatever its port rules say.
//! * The same for IPv4 when the transport header cannot be read, and for fragments (the
//!   ports of a fragmented datagram are not trustworthy until it is reassembled).
//! * A frame whose network header cannot be read at all is [`CARRIES_UNREADABLE`]; the
//!   programs decide it as if it were bound for a protected address.
//! * A source route (IPv4 LSRR/SSRR, an IPv6 routing header with segments left) names
//!   destinations beyond the header's: such a packet is [`Parsed::routed`], and the programs
//!   decide it as if it were bound for a protected address too. (No socket hook stands
//!   before egress for an unconnected UDP datagram, and a raw socket never had one.)
//! * [`passes_fast_v4`] and [`passes_fast_v6`]: the packet programs' fast path, on four
//!   bytes of the fixed header and the PREFILTER map: what surely concerns no protected
//!   endpoint passes without another look.
use crate::{
    abi::{ENDPOINT_NONE, PORT_ANY, PROTO_TCP, PROTO_UDP, Prefilter},
    verdict::{Addr, Dst, Tables, match_address, match_endpoint},
};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;
/// VLAN tags skipped before the Ethernet type that counts (QinQ: two).
pub const MAX_VLAN_TAGS: usize = 2;
/// IPv6 extension headers walked before the transport header is given up on.
pub const MAX_V6_EXT_HEADERS: usize = 8;

/// Read access to the bytes of a packet.
pub trait Packet {
    /// The `N` bytes at `off`, if the packet has them.
    fn bytes<const N: usize>(&self, off: usize) -> Option<[u8; N]>;
}

impl Packet for [u8] {
    fn bytes<const N: usize>(&self, off: usize) -> Option<[u8; N]> {
        self.get(off..off.checked_add(N)?)?.try_into().ok()
    }
}

/// What a frame carries, by its Ethernet type (`CARRIES_*`).
pub type Carries = u32;
pub const CARRIES_IPV4: Carries = 4;
pub const CARRIES_IPV6: Carries = 6;
/// Not IP (ARP, LLDP, …): nothing a metadata service answers.
pub const CARRIES_OTHER: Carries = 0;
/// More VLAN tags than we skip, or a frame too short for its Ethernet type.
pub const CARRIES_UNREADABLE: Carries = 255;

/// The network layer of a frame: what it carries and where its header starts. Plain
/// full-width integers rather than an enum: the BPF verifier rejects code that copies the
/// undefined payload or padding registers an enum leaves behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Network {
    pub carries: Carries,
    /// Offset of the network header (meaningful for IPv4 and IPv6).
    pub l3: u32,
}

#[inline(always)]
fn is_vlan(ethertype: u16) -> bool {
    ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD
}

/// Where the network header of an Ethernet frame starts, by the frame's own bytes: the
/// Ethernet type after at most [`MAX_VLAN_TAGS`] tags (written out, not looped: the tags are
/// two at most).
#[inline(always)]
pub fn network_of_frame<P: Packet + ?Sized>(p: &P) -> Network {
    const UNREADABLE: Network = Network { carries: CARRIES_UNREADABLE, l3: 0 };
    let Some(t) = p.bytes::<2>(12) else { return UNREADABLE };
    let mut ethertype = u16::from_be_bytes(t);
    let mut off: u32 = 12;
    if is_vlan(ethertype) {
        let Some(t) = p.bytes::<2>(16) else { return UNREADABLE };
        ethertype = u16::from_be_bytes(t);
        off = 16;
    }
    if is_vlan(ethertype) {
        let Some(t) = p.bytes::<2>(20) else { return UNREADABLE };
        ethertype = u16::from_be_bytes(t);
        off = 20;
    }
    if ethertype == ETH_P_IP {
        Network { carries: CARRIES_IPV4, l3: off + 2 }
    } else if ethertype == ETH_P_IPV6 {
        Network { carries: CARRIES_IPV6, l3: off + 2 }
    } else if is_vlan(ethertype) {
        UNREADABLE
    } else {
        Network { carries: CARRIES_OTHER, l3: 0 }
    }
}

/// What a packet read at the kernel's network header carries (interfaces without an
/// Ethernet header: tun, ipip, gre, sit, WireGuard, IPoIB, …): by the version nibble there
/// (`None`: not readable), else by the sk_buff's protocol. A packet the sk_buff calls IP
/// whose header does not say so is unreadable (fail closed); what is neither passes as not IP.
#[inline(always)]
pub fn network_of_packet(nibble: Option<u8>, protocol: u16) -> Carries {
    match nibble {
        Some(4) => CARRIES_IPV4,
        Some(6) => CARRIES_IPV6,
        _ if protocol == ETH_P_IP || protocol == ETH_P_IPV6 => CARRIES_UNREADABLE,
        _ => CARRIES_OTHER,
    }
}

const _: () = assert!(MAX_VLAN_TAGS == 2, "network_of_frame skips exactly two tags");

/// A packet's destination as far as it could be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// Destination; `port` is [`PORT_ANY`] and `proto` the last header type seen when the
    /// transport is unknown.
    pub dst: Dst,
    /// A TCP reset without payload (what a socket destroyed by `--terminate-established`
    /// sends): it conveys nothing to a metadata service.
    pub rst: bool,
    /// A TCP segment without payload, whatever its flags (a handshake step, an ACK, a
    /// reset): it carries no request.
    pub bare: bool,
    /// Whether the transport (protocol and port) is known. `false`: judge on the address.
    pub complete: bool,
    /// Whether the network header (and with it the destination address) could be read.
    /// `false`: decide as if the packet were bound for a protected address.
    pub readable: bool,
    /// A source route names further destinations (or the options holding it could not be
    /// walked): decide as if the packet were bound for a protected address.
    pub routed: bool,
}

impl Parsed {
    /// A packet whose network header could not be read. (A value rather than `None`: every
    /// field defined, which the BPF verifier insists on.)
    pub const UNREADABLE: Parsed = Parsed {
        dst: Dst { addr: Addr::v4([0; 4]), port: PORT_ANY, proto: 0 },
        rst: false,
        bare: false,
        complete: false,
        readable: false,
        routed: false,
    };

    /// A destination known in full (the socket hooks').
    pub const fn complete(dst: Dst) -> Parsed {
        Parsed { dst, rst: false, bare: false, complete: true, readable: true, routed: false }
    }

    fn address_only(addr: Addr, proto: u8, routed: bool) -> Parsed {
        Parsed {
            dst: Dst { addr, port: PORT_ANY, proto },
            rst: false,
            bare: false,
            complete: false,
            readable: true,
            routed,
        }
    }

    /// Whether the destination in the header is all there is to judge: readable, and no
    /// source route naming others.
    #[inline(always)]
    pub fn judgeable(&self) -> bool {
        self.readable && !self.routed
    }
}

/// IPv4 option types that carry a source route (loose, strict).
pub const IPOPT_LSRR: u8 = 131;
pub const IPOPT_SSRR: u8 = 137;
/// IPv4 options walked at most (no-operation bytes count). Real packets carry one or two; a
/// list longer than this is taken for a route (no-ops cannot pad one out of sight), which
/// keeps the walk small enough for the verifier on every path that parses a packet.
pub const MAX_IPV4_OPTIONS: usize = 4;

/// Whether the IPv4 options between `l3 + 20` and `l3 + ihl` hold a source route, or cannot
/// be walked (cut off, a length below 2 or past the header, more than [`MAX_IPV4_OPTIONS`]
/// before the end): either way the packet may be bound for more than its destination field
/// says.
#[inline(always)]
pub fn ipv4_source_routed<P: Packet + ?Sized>(p: &P, l3: usize, ihl: usize) -> bool {
    let end = l3 + ihl;
    let mut off = l3 + 20;
    let mut i = 0;
    while i < MAX_IPV4_OPTIONS && off < end {
        let Some([kind]) = p.bytes::<1>(off) else { return true };
        match kind {
            // End of options.
            0 => return false,
            // No operation: one byte.
            1 => off += 1,
            IPOPT_LSRR | IPOPT_SSRR => return true,
            _ => {
                let Some([_, len]) = p.bytes::<2>(off) else { return true };
                if len < 2 {
                    return true;
                }
                off += usize::from(len);
            }
        }
        i += 1;
    }
    off != end
}

/// The packet programs' fast path on an IPv4 header: `ver_ihl` its first byte, `first` and
/// `last` its destination's first and last bytes. True: the packet goes to that destination
/// and nowhere else (version 4, no options that could hold a route), and `filter` says no
/// protected prefix holds it: it passes without another look. False decides nothing: the
/// full parse does.
#[inline(always)]
pub fn passes_fast_v4(filter: &Prefilter, ver_ihl: u8, first: u8, last: u8) -> bool {
    ver_ihl == 0x45 && !filter.may(false, first, last)
}

/// The fast path on an IPv6 header: `ver` its first byte, `next` its next-header field,
/// `first` and `last` its destination's first and last bytes. Only when the transport comes
/// right after the fixed header: behind any extension header the full path walks (not only
/// hop-by-hop and destination options, also AH, mobility, HIP, shim6 and the experimental
/// ones) a routing header may follow. Not for a destination starting with 0 either, which may
/// be IPv4-mapped (judged as the IPv4 address by the full path).
#[inline(always)]
pub fn passes_fast_v6(filter: &Prefilter, ver: u8, next: u8, first: u8, last: u8) -> bool {
    ver >> 4 == 6 && !is_v6_extension(next) && first != 0 && !filter.may(true, first, last)
}

/// What the transport header at `l4` says (`end`: where the IP packet ends). Every field
/// defined on every path, `known` in place of an `Option`: the payload of a `None` is
/// undefined, and kernels before 5.12 reject a program that reads what it leaves behind.
struct Transport {
    port: u16,
    rst: bool,
    bare: bool,
    /// Whether the header could be read; `false`: judge on the address.
    known: bool,
}

impl Transport {
    const UNKNOWN: Transport = Transport { port: PORT_ANY, rst: false, bare: false, known: false };

    /// The destination as far as it is known: the whole of it, or its address alone.
    #[inline(always)]
    fn parsed(&self, addr: Addr, proto: u8, routed: bool) -> Parsed {
        if !self.known {
            return Parsed::address_only(addr, proto, routed);
        }
        Parsed {
            dst: Dst { addr, port: self.port, proto },
            rst: self.rst,
            bare: self.bare,
            complete: true,
            readable: true,
            routed,
        }
    }
}

/// Destination port, and for TCP whether the segment is bare (no payload) and a reset;
/// [`Transport::UNKNOWN`] when a TCP/UDP header cannot be read.
#[inline(always)]
fn transport<P: Packet + ?Sized>(p: &P, proto: u8, l4: usize, end: usize) -> Transport {
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Transport { port: PORT_ANY, rst: false, bare: false, known: true };
    }
    let Some(ports) = p.bytes::<4>(l4) else { return Transport::UNKNOWN };
    let port = u16::from_be_bytes([ports[2], ports[3]]);
    if proto != PROTO_TCP {
        return Transport { port, rst: false, bare: false, known: true };
    }
    let (rst, bare) = match p.bytes::<2>(l4 + 12) {
        Some(h) => {
            let bare = l4 + usize::from(h[0] >> 4) * 4 == end;
            (bare && h[1] & 0x04 != 0, bare)
        }
        None => (false, false),
    };
    Transport { port, rst, bare, known: true }
}

/// Parse the IPv4 header at `l3` ([`Parsed::UNREADABLE`] if the header, with the
/// destination, cannot be read).
#[inline(always)]
pub fn parse_ipv4<P: Packet + ?Sized>(p: &P, l3: usize) -> Parsed {
    let Some(h) = p.bytes::<20>(l3) else { return Parsed::UNREADABLE };
    if h[0] >> 4 != 4 {
        return Parsed::UNREADABLE;
    }
    let addr = Addr::v4([h[16], h[17], h[18], h[19]]);
    let proto = h[9];
    let ihl = usize::from(h[0] & 0x0f) * 4;
    let frag = u16::from_be_bytes([h[6], h[7]]);
    let routed = ihl > 20 && ipv4_source_routed(p, l3, ihl);
    // MF set or a fragment offset: any fragment.
    if ihl < 20 || frag & 0x3fff != 0 {
        return Parsed::address_only(addr, proto, routed);
    }
    let end = l3 + usize::from(u16::from_be_bytes([h[2], h[3]]));
    transport(p, proto, l3 + ihl, end).parsed(addr, proto, routed)
}

/// Parse the IPv6 header at `l3` and its extension headers ([`Parsed::UNREADABLE`] if the
/// fixed header cannot be read). IPv4-mapped destinations are read as IPv4.
#[inline(always)]
pub fn parse_ipv6<P: Packet + ?Sized>(p: &P, l3: usize) -> Parsed {
    let Some(h) = p.bytes::<40>(l3) else { return Parsed::UNREADABLE };
    if h[0] >> 4 != 6 {
        return Parsed::UNREADABLE;
    }
    let mut a = [0u8; 16];
    a.copy_from_slice(&h[24..40]);
    let addr = Addr::from_v6(a);
    let end = l3 + 40 + usize::from(u16::from_be_bytes([h[4], h[5]]));
    let mut next = h[6];
    let mut off = l3 + 40;
    let mut i = 0;
    // A routing header with segments left names destinations beyond the header's. (One
    // behind more headers than we walk stays unseen; what processes it is a router with
    // segment routing on, not a host by default.)
    let mut routed = false;
    while i < MAX_V6_EXT_HEADERS {
        match next {
            // routing: (length + 1) * 8 bytes; segments left in its fourth byte
            43 => {
                let Some(e) = p.bytes::<4>(off) else {
                    return Parsed::address_only(addr, next, routed);
                };
                routed |= e[3] != 0;
                next = e[0];
                off += (usize::from(e[1]) + 1) * 8;
            }
            // hop-by-hop, destination options, mobility, HIP, shim6, experimental:
            // (length + 1) * 8 bytes
            0 | 60 | 135 | 139 | 140 | 253 | 254 => {
                let Some(e) = p.bytes::<2>(off) else {
                    return Parsed::address_only(addr, next, routed);
                };
                next = e[0];
                off += (usize::from(e[1]) + 1) * 8;
            }
            // fragment: any fragment leaves the transport unknown (a routing header comes
            // before it, if at all)
            44 => return Parsed::address_only(addr, next, routed),
            // authentication header: (length + 2) * 4 bytes
            51 => {
                let Some(e) = p.bytes::<2>(off) else {
                    return Parsed::address_only(addr, next, routed);
                };
                next = e[0];
                off += (usize::from(e[1]) + 2) * 4;
            }
            // ESP: the rest is encrypted
            50 => return Parsed::address_only(addr, next, routed),
            _ => break,
        }
        i += 1;
    }
    if is_v6_extension(next) {
        // The chain goes on past what we walk.
        return Parsed::address_only(addr, next, routed);
    }
    transport(p, next, off, end).parsed(addr, next, routed)
}

/// Whether an IPv6 next-header value is an extension header (or ESP) rather than a transport.
#[inline(always)]
pub fn is_v6_extension(next: u8) -> bool {
    matches!(next, 0 | 43 | 44 | 50 | 51 | 60 | 135 | 139 | 140 | 253 | 254)
}

/// Parse whatever IP packet starts at `l3`, by its version nibble.
#[inline(always)]
pub fn parse_ip<P: Packet + ?Sized>(p: &P, l3: usize) -> Parsed {
    let Some(b) = p.bytes::<1>(l3) else { return Parsed::UNREADABLE };
    let v = b[0] >> 4;
    if v == 4 {
        parse_ipv4(p, l3)
    } else if v == 6 {
        parse_ipv6(p, l3)
    } else {
        Parsed::UNREADABLE
    }
}

/// The endpoint a readable packet is bound for: by its full destination when the transport
/// was read, else by its address alone (fail closed). (An unreadable one is the caller's to
/// deny.)
#[inline(always)]
pub fn endpoint<T: Tables>(t: &T, generation: u32, p: &Parsed) -> Option<u32> {
    if p.complete {
        match_endpoint(t, generation, &p.dst)
    } else {
        match_address(t, generation, &p.dst.addr)
    }
}

/// The endpoint a packet is judged against: `Some(endpoint)` — [`ENDPOINT_NONE`] when where
/// it goes cannot be known (its header unreadable, a source route naming further
/// destinations, or no live generation to judge by), which is decided as if it were bound
/// for a protected endpoint — or `None`: bound for no protected endpoint, it passes.
#[inline(always)]
pub fn subject<T: Tables>(t: &T, generation: Option<u32>, p: &Parsed) -> Option<u32> {
    match generation {
        Some(g) if p.judgeable() => endpoint(t, g, p),
        _ => Some(ENDPOINT_NONE),
    }
}

#[cfg(all(not(target_arch = "bpf"), any(test, feature = "fuzzing")))]
pub mod fuzzing;
#[cfg(test)]
mod tests;
