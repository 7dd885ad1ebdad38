//! Which sockets and socket options a gated workload that is not allowed is denied, whatever
//! the syscall ABI that asks (native, 32-bit compat, io_uring): the pure half of the LSM
//! programs and of cgroup/setsockopt, the same code in the kernel and in the host tests.
//!
//! Two kinds of door:
//! * **Past tc** (`setsockopt`): PACKET_QDISC_BYPASS hands AF_PACKET frames straight to the
//!   driver, and an AF_XDP socket sends beside the stack; both skip the node-level program.
//! * **Reading the node's traffic** (`socket`, `bind`): an AF_PACKET socket bound to an
//!   EtherType that carries IP sees every such frame of the node (an allow-listed component's
//!   credentials on their way in included), and a raw IP socket of a transport protocol gets
//!   a copy of every packet of that protocol the node receives. Non-IP link protocols (ARP,
//!   LLDP, …) and the raw protocols that carry no metadata traffic (ICMP, VRRP, …) stay open:
//!   ARP announcers, LLDP agents, `ping`, keepalived and routing daemons keep working.
//!
//! Everything not on those short lists of harmless protocols is denied: a protocol this
//! build does not know is taken for one that carries IP (fail closed).

pub const AF_INET: i32 = 2;
pub const AF_INET6: i32 = 10;
pub const AF_PACKET: i32 = 17;
pub const SOCK_RAW: i32 = 3;
/// The socket type without SOCK_NONBLOCK / SOCK_CLOEXEC.
pub const SOCK_TYPE_MASK: i32 = 0xf;

pub const SOL_PACKET: i32 = 263;
pub const PACKET_QDISC_BYPASS: i32 = 20;
pub const SOL_XDP: i32 = 283;
/// XDP_RX_RING (2) … XDP_UMEM_COMPLETION_RING (6): what an AF_XDP socket needs before bind.
pub const XDP_FIRST_SETUP_OPT: i32 = 2;
pub const XDP_LAST_SETUP_OPT: i32 = 6;

/// Whether a socket option opens a way past tc (PACKET_QDISC_BYPASS, the AF_XDP setup).
#[inline(always)]
pub fn sockopt_side_door(level: i32, optname: i32) -> bool {
    (level == SOL_PACKET && optname == PACKET_QDISC_BYPASS)
        || (level == SOL_XDP && (XDP_FIRST_SETUP_OPT..=XDP_LAST_SETUP_OPT).contains(&optname))
}

/// Whether an AF_PACKET socket of EtherType `proto` (host order, as `ntohs` gives it) would
/// receive IP frames: 0 receives nothing; the link protocols below carry no IP; anything else
/// (ETH_P_ALL, IPv4, IPv6, VLAN tags, MPLS, PPPoE, one this list does not know) may.
#[inline(always)]
pub fn packet_protocol_reads_ip(proto: u16) -> bool {
    !matches!(
        proto,
        0 | 0x0806 // ARP
            | 0x8035 // RARP
            | 0x88cc // LLDP
            | 0x888e // 802.1X EAPOL
            | 0x8809 // slow protocols: LACP
            | 0x88f7 // PTP
            | 0x8902 // CFM (802.1ag)
            | 0x0004 // ETH_P_802_2: LLC frames (STP, CDP)
    )
}

/// Whether a raw IP socket of `protocol` would receive copies of metadata traffic: every
/// protocol but those below, which carry none (IPPROTO_RAW only sends).
#[inline(always)]
pub fn raw_protocol_reads_traffic(protocol: i32) -> bool {
    !matches!(
        protocol,
        1 // ICMP
            | 2 // IGMP
            | 58 // ICMPv6
            | 89 // OSPF
            | 103 // PIM
            | 112 // VRRP
            | 255 // IPPROTO_RAW
    )
}

/// Whether `socket(family, type, protocol)` makes a socket that reads the node's IP traffic.
/// `protocol` is as the caller passed it: for AF_PACKET, an EtherType in network order.
#[inline(always)]
pub fn socket_reads_traffic(family: i32, sock_type: i32, protocol: i32) -> bool {
    match family {
        AF_PACKET => packet_protocol_reads_ip(u16::from_be(protocol as u16)),
        AF_INET | AF_INET6 => {
            sock_type & SOCK_TYPE_MASK == SOCK_RAW && raw_protocol_reads_traffic(protocol)
        }
        _ => false,
    }
}

/// Whether `bind()` to an address whose first four bytes are `head` turns a socket into one
/// that reads the node's IP traffic: an AF_PACKET address (`sll_family`, then `sll_protocol`
/// in network order) naming an IP-carrying EtherType. `sll_protocol` 0 keeps the socket's
/// own, judged when it was made. (The kernel binds an AF_PACKET socket only to an AF_PACKET
/// address, and no other socket to one, so the address alone decides.)
#[inline(always)]
pub fn bind_reads_traffic(head: [u8; 4]) -> bool {
    u16::from_ne_bytes([head[0], head[1]]) == AF_PACKET as u16
        && packet_protocol_reads_ip(u16::from_be_bytes([head[2], head[3]]))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const ETH_P_ALL: u16 = 0x0003;

    #[test]
    fn side_doors() {
        assert!(sockopt_side_door(SOL_PACKET, PACKET_QDISC_BYPASS));
        for o in 2..=6 {
            assert!(sockopt_side_door(SOL_XDP, o), "XDP option {o}");
        }
        assert!(!sockopt_side_door(SOL_XDP, 1), "XDP_MMAP_OFFSETS reads, sets up nothing");
        assert!(!sockopt_side_door(SOL_XDP, 7));
        assert!(!sockopt_side_door(SOL_PACKET, 1), "PACKET_ADD_MEMBERSHIP");
        assert!(!sockopt_side_door(1, 20), "SOL_SOCKET with the same number");
    }

    #[test]
    fn packet_sockets_reading_ip_are_told_apart_from_link_protocols() {
        for p in [ETH_P_ALL, 0x0800, 0x86dd, 0x8100, 0x88a8, 0x8847, 0x8864, 0x1234] {
            assert!(packet_protocol_reads_ip(p), "{p:#06x}");
            assert!(socket_reads_traffic(AF_PACKET, SOCK_RAW, i32::from(p.to_be())), "{p:#06x}");
            assert!(socket_reads_traffic(AF_PACKET, 2, i32::from(p.to_be())), "SOCK_DGRAM");
        }
        for p in [0, 0x0806, 0x88cc, 0x888e] {
            assert!(!packet_protocol_reads_ip(p), "{p:#06x}");
            assert!(!socket_reads_traffic(AF_PACKET, SOCK_RAW, i32::from(p.to_be())));
        }
    }

    #[test]
    fn raw_ip_sockets_of_transport_protocols_read_traffic() {
        for family in [AF_INET, AF_INET6] {
            for p in [6, 17, 132, 136, 4, 47] {
                assert!(socket_reads_traffic(family, SOCK_RAW, p), "{family}/{p}");
                // SOCK_NONBLOCK | SOCK_CLOEXEC do not hide the type.
                assert!(socket_reads_traffic(family, SOCK_RAW | 0o4000 | 0o2000000, p));
            }
            for p in [1, 58, 112, 255] {
                assert!(!socket_reads_traffic(family, SOCK_RAW, p), "{family}/{p}");
            }
            assert!(!socket_reads_traffic(family, 1, 6), "a TCP stream socket");
            assert!(!socket_reads_traffic(family, 2, 17), "a UDP socket");
        }
        assert!(!socket_reads_traffic(1, SOCK_RAW, 6), "AF_UNIX");
    }

    #[test]
    fn bind_to_an_ip_ethertype_reads_traffic() {
        let head = |family: u16, proto: u16| {
            let (f, p) = (family.to_ne_bytes(), proto.to_be_bytes());
            [f[0], f[1], p[0], p[1]]
        };
        assert!(bind_reads_traffic(head(17, ETH_P_ALL)));
        assert!(bind_reads_traffic(head(17, 0x0800)));
        assert!(!bind_reads_traffic(head(17, 0)), "keeps the protocol judged at socket()");
        assert!(!bind_reads_traffic(head(17, 0x0806)));
        assert!(!bind_reads_traffic(head(2, ETH_P_ALL)), "an AF_INET address");
    }

    proptest! {
        /// Only the listed link protocols pass; every other EtherType reads IP, and the
        /// network-order argument of socket() agrees with the host-order one of bind().
        #[test]
        fn unknown_ethertypes_fail_closed(p in any::<u16>()) {
            let listed = [0u16, 0x0806, 0x8035, 0x88cc, 0x888e, 0x8809, 0x88f7, 0x8902, 0x0004];
            prop_assert_eq!(packet_protocol_reads_ip(p), !listed.contains(&p));
            prop_assert_eq!(
                socket_reads_traffic(AF_PACKET, SOCK_RAW, i32::from(p.to_be())),
                packet_protocol_reads_ip(p)
            );
            let (f, b) = ((AF_PACKET as u16).to_ne_bytes(), p.to_be_bytes());
            prop_assert_eq!(bind_reads_traffic([f[0], f[1], b[0], b[1]]), packet_protocol_reads_ip(p));
        }

        /// Families other than AF_PACKET and the IP ones never read traffic, whatever the
        /// type and protocol.
        #[test]
        fn other_families_are_left_alone(family in 0i32..64, t in any::<i32>(), p in any::<i32>()) {
            prop_assume!(![AF_INET, AF_INET6, AF_PACKET].contains(&family));
            prop_assert!(!socket_reads_traffic(family, t, p));
        }
    }
}
