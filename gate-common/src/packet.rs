//! Reading a packet the way it will be delivered, failing closed: the kernel programs call
//! these functions on an sk_buff, the host tests on byte slices.
//!
//! * The Ethernet type comes from the frame's bytes, after at most [`MAX_VLAN_TAGS`]
//!   802.1Q / 802.1ad tags — never from `skb->protocol`, which an AF_PACKET sender chooses.
//! * IPv6 extension headers are walked for at most [`MAX_V6_EXT_HEADERS`] headers. A chain
//!   longer than that, a header or transport header that cannot be read, ESP, or any fragment
//!   leaves the transport unknown: the packet is then [`Parsed::complete`] `false` and is
//!   judged on its destination address alone ([`crate::verdict::packet_endpoint`]): a
//!   protected address is refused whatever its port rules say.
//! * The same for IPv4 when the transport header cannot be read, and for fragments (the
//!   ports of a fragmented datagram are not trustworthy until it is reassembled).
//! * A frame whose network header cannot be read at all is [`CARRIES_UNREADABLE`]; the
//!   programs decide it as if it were bound for a protected address.
use crate::{
    abi::{PORT_ANY, PROTO_TCP, PROTO_UDP},
    verdict::{Addr, Dst},
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
/// full-width integers rather than an enum: the BPF verifier refuses code that copies the
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
}

impl Parsed {
    /// A packet whose network header could not be read. (A value rather than `None`: every
    /// field defined, which the BPF verifier insists on.)
    pub const UNREADABLE: Parsed = Parsed {
        dst: Dst { addr: Addr::V4([0; 4]), port: PORT_ANY, proto: 0 },
        rst: false,
        bare: false,
        complete: false,
        readable: false,
    };

    /// A destination known in full (the socket hooks').
    pub const fn complete(dst: Dst) -> Parsed {
        Parsed { dst, rst: false, bare: false, complete: true, readable: true }
    }

    fn address_only(addr: Addr, proto: u8) -> Parsed {
        Parsed {
            dst: Dst { addr, port: PORT_ANY, proto },
            rst: false,
            bare: false,
            complete: false,
            readable: true,
        }
    }
}

/// What the transport header at `l4` says (`end`: where the IP packet ends).
struct Transport {
    port: u16,
    rst: bool,
    bare: bool,
}

/// Destination port, and for TCP whether the segment is bare (no payload) and a reset.
/// `None` when a TCP/UDP header cannot be read.
#[inline(always)]
fn transport<P: Packet + ?Sized>(p: &P, proto: u8, l4: usize, end: usize) -> Option<Transport> {
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Some(Transport { port: PORT_ANY, rst: false, bare: false });
    }
    let ports = p.bytes::<4>(l4)?;
    let port = u16::from_be_bytes([ports[2], ports[3]]);
    if proto != PROTO_TCP {
        return Some(Transport { port, rst: false, bare: false });
    }
    let (rst, bare) = match p.bytes::<2>(l4 + 12) {
        Some(h) => {
            let bare = l4 + usize::from(h[0] >> 4) * 4 == end;
            (bare && h[1] & 0x04 != 0, bare)
        }
        None => (false, false),
    };
    Some(Transport { port, rst, bare })
}

/// Parse the IPv4 header at `l3` ([`Parsed::UNREADABLE`] if the header, with the
/// destination, cannot be read).
#[inline(always)]
pub fn parse_ipv4<P: Packet + ?Sized>(p: &P, l3: usize) -> Parsed {
    let Some(h) = p.bytes::<20>(l3) else { return Parsed::UNREADABLE };
    if h[0] >> 4 != 4 {
        return Parsed::UNREADABLE;
    }
    let addr = Addr::V4([h[16], h[17], h[18], h[19]]);
    let proto = h[9];
    let ihl = usize::from(h[0] & 0x0f) * 4;
    let frag = u16::from_be_bytes([h[6], h[7]]);
    // MF set or a fragment offset: any fragment.
    if ihl < 20 || frag & 0x3fff != 0 {
        return Parsed::address_only(addr, proto);
    }
    let end = l3 + usize::from(u16::from_be_bytes([h[2], h[3]]));
    match transport(p, proto, l3 + ihl, end) {
        Some(t) => Parsed {
            dst: Dst { addr, port: t.port, proto },
            rst: t.rst,
            bare: t.bare,
            complete: true,
            readable: true,
        },
        None => Parsed::address_only(addr, proto),
    }
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
    while i < MAX_V6_EXT_HEADERS {
        match next {
            // hop-by-hop, routing, destination options, mobility, HIP, shim6, experimental:
            // (length + 1) * 8 bytes
            0 | 43 | 60 | 135 | 139 | 140 | 253 | 254 => {
                let Some(e) = p.bytes::<2>(off) else { return Parsed::address_only(addr, next) };
                next = e[0];
                off += (usize::from(e[1]) + 1) * 8;
            }
            // fragment: any fragment leaves the transport unknown
            44 => return Parsed::address_only(addr, next),
            // authentication header: (length + 2) * 4 bytes
            51 => {
                let Some(e) = p.bytes::<2>(off) else { return Parsed::address_only(addr, next) };
                next = e[0];
                off += (usize::from(e[1]) + 2) * 4;
            }
            // ESP: the rest is encrypted
            50 => return Parsed::address_only(addr, next),
            _ => break,
        }
        i += 1;
    }
    if is_v6_extension(next) {
        // The chain goes on past what we walk.
        return Parsed::address_only(addr, next);
    }
    match transport(p, next, off, end) {
        Some(t) => Parsed {
            dst: Dst { addr, port: t.port, proto: next },
            rst: t.rst,
            bare: t.bare,
            complete: true,
            readable: true,
        },
        None => Parsed::address_only(addr, next),
    }
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

#[cfg(test)]
mod tests;
