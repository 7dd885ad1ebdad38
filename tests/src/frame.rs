//! Hand-built packets and Ethernet frames for the bypass tests: what a workload with
//! CAP_NET_RAW (AF_PACKET, raw IP) or a VM (a tap) can put on the wire, checksums included,
//! so that the receiver accepts them when nothing is in the way. The test process builds
//! them; `probe` or a tap writer only sends the bytes.
use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Context as _, Result, bail};

pub type Mac = [u8; 6];

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
const IPV6_DSTOPTS: u8 = 60;
/// The source MAC of every hand-built frame: locally administered.
pub const SRC_MAC: Mac = [0x02, 0, 0, 0, 0, 0x01];

/// `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<Mac> {
    let bytes: Vec<u8> = s
        .trim()
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("MAC {s:?}"))?;
    bytes.try_into().map_err(|_| anyhow::anyhow!("MAC {s:?}: not 6 bytes"))
}

pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn from_hex(s: &str) -> Result<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        bail!("odd number of hex digits");
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).with_context(|| format!("hex at {i}")))
        .collect()
}

/// The Internet checksum (RFC 1071) over the concatenation of `parts`.
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let bytes: Vec<u8> = parts.concat();
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 header (no options) followed by `payload`. `frag` is the flags-and-offset field
/// (0x2000: more fragments; the low 13 bits: offset in 8-byte units).
pub fn ipv4(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    id: u16,
    frag: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&((20 + payload.len()) as u16).to_be_bytes());
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h[6..8].copy_from_slice(&frag.to_be_bytes());
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let c = checksum(&[&h]);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    [&h[..], payload].concat()
}

/// The pseudo-header the TCP and UDP checksums cover.
fn pseudo(src: &[u8], dst: &[u8], proto: u8, len: usize) -> Vec<u8> {
    let mut p = [src, dst].concat();
    if src.len() == 4 {
        p.extend_from_slice(&[0, proto]);
        p.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        p.extend_from_slice(&(len as u32).to_be_bytes());
        p.extend_from_slice(&[0, 0, 0, proto]);
    }
    p
}

/// A UDP datagram with its checksum (for the addresses `src` and `dst`, 4 or 16 bytes).
pub fn udp(src: &[u8], dst: &[u8], sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let len = 8 + payload.len();
    let mut d = Vec::with_capacity(len);
    d.extend_from_slice(&sport.to_be_bytes());
    d.extend_from_slice(&dport.to_be_bytes());
    d.extend_from_slice(&(len as u16).to_be_bytes());
    d.extend_from_slice(&[0, 0]);
    d.extend_from_slice(payload);
    let c = match checksum(&[&pseudo(src, dst, PROTO_UDP, len), &d]) {
        0 => 0xffff,
        c => c,
    };
    d[6..8].copy_from_slice(&c.to_be_bytes());
    d
}

/// A TCP SYN carrying `payload`, with its checksum. Its acknowledgment field (unused in a SYN)
/// is `ack`.
pub fn tcp_syn(
    src: &[u8],
    dst: &[u8],
    sport: u16,
    dport: u16,
    ack: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut s = vec![0u8; 20];
    s[0..2].copy_from_slice(&sport.to_be_bytes());
    s[2..4].copy_from_slice(&dport.to_be_bytes());
    s[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    s[8..12].copy_from_slice(&ack.to_be_bytes());
    s[12] = 5 << 4;
    s[13] = 0x02;
    s[14..16].copy_from_slice(&64240u16.to_be_bytes());
    s.extend_from_slice(payload);
    let c = checksum(&[&pseudo(src, dst, PROTO_TCP, s.len()), &s]);
    s[16..18].copy_from_slice(&c.to_be_bytes());
    s
}

/// IPv4 + UDP to `dst:dport` carrying `payload`.
pub fn udp4(src: Ipv4Addr, dst: Ipv4Addr, dport: u16, payload: &[u8]) -> Vec<u8> {
    let d = udp(&src.octets(), &dst.octets(), 40000, dport, payload);
    ipv4(src, dst, PROTO_UDP, 0x4d47, 0, &d)
}

/// IPv6 + `dstopts` destination-options headers (8 bytes each: one PadN option) + UDP to
/// `dst:dport` carrying `payload`.
pub fn udp6_dstopts(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    dstopts: usize,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    let l4 = udp(&src.octets(), &dst.octets(), 40000, dport, payload);
    let mut ext = Vec::with_capacity(dstopts * 8);
    for i in 0..dstopts {
        let next = if i + 1 < dstopts { IPV6_DSTOPTS } else { PROTO_UDP };
        // next header, length 0 (8 bytes), PadN with 4 zero bytes
        ext.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]);
    }
    let first = if dstopts > 0 { IPV6_DSTOPTS } else { PROTO_UDP };
    let mut h = vec![0x60, 0, 0, 0];
    h.extend_from_slice(&((ext.len() + l4.len()) as u16).to_be_bytes());
    h.extend_from_slice(&[first, 64]);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    [h, ext, l4].concat()
}

/// A TCP SYN to `dst:dport` carrying `payload`, as two IPv4 fragments built to fool a parser
/// that reads fragments as whole packets:
/// * the first carries only the first 8 bytes of the TCP header (MF set, no flags, no data
///   offset), and the frame goes on past the IP packet with bytes that, read as the rest of
///   that header, say "a bare reset" — which such a parser lets through;
/// * the second (offset 8) starts with the acknowledgment field, which such a parser reads
///   as ports: destination port 53.
///
/// Reassembled, it is a plain SYN with the payload to `dport`. Returns the two IP packets and
/// the bytes to append to the first one's frame.
pub fn disguised_fragments(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    dport: u16,
    payload: &[u8],
) -> ([Vec<u8>; 2], Vec<u8>) {
    let seg = tcp_syn(&src.octets(), &dst.octets(), 40001, dport, 53, payload);
    let first = ipv4(src, dst, PROTO_TCP, 0x4242, 0x2000, &seg[..8]);
    let second = ipv4(src, dst, PROTO_TCP, 0x4242, 1, &seg[8..]);
    // Past the first packet, where a parser would look for bytes 8.. of the TCP header:
    // acknowledgment (4), data offset 2 words (ending the header at the packet's end), RST.
    let trailer = vec![0, 0, 0, 0, 2 << 4, 0x04, 0, 0, 0, 0, 0, 0];
    ([first, second], trailer)
}

/// An Ethernet frame: `tags` are (TPID, VLAN id) pairs, outermost first.
pub fn ethernet(
    dst: Mac,
    src: Mac,
    tags: &[(u16, u16)],
    ethertype: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + 4 * tags.len() + payload.len());
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    for (tpid, vid) in tags {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&vid.to_be_bytes());
    }
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The Ethernet type of an IP packet, by its version nibble.
pub fn ethertype_of(packet: &[u8]) -> u16 {
    if packet.first().is_some_and(|b| b >> 4 == 6) { ETH_P_IPV6 } else { ETH_P_IP }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);
    const B: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

    #[test]
    fn checksums_verify() {
        let p = udp4(A, B, 80, b"token");
        assert_eq!(checksum(&[&p[..20]]), 0, "IPv4 header");
        assert_eq!(checksum(&[&pseudo(&A.octets(), &B.octets(), PROTO_UDP, 13), &p[20..]]), 0);
        let s = tcp_syn(&A.octets(), &B.octets(), 1, 80, 0, b"odd");
        assert_eq!(checksum(&[&pseudo(&A.octets(), &B.octets(), PROTO_TCP, s.len()), &s]), 0);
    }

    #[test]
    fn ipv6_chain_layout() {
        let (a, b) = ("fd00:99::2".parse().unwrap(), "fd00:ec2::254".parse().unwrap());
        let p = udp6_dstopts(a, b, 30, 80, b"x");
        assert_eq!(p.len(), 40 + 30 * 8 + 8 + 1);
        assert_eq!(p[6], IPV6_DSTOPTS);
        assert_eq!(p[40 + 29 * 8], PROTO_UDP, "the last header names UDP");
        assert_eq!(u16::from_be_bytes([p[40 + 240 + 2], p[40 + 240 + 3]]), 80);
    }

    #[test]
    fn disguised_fragments_reassemble_to_the_syn() {
        let ([first, second], trailer) = disguised_fragments(A, B, 80, b"tok");
        assert_eq!(first.len(), 28);
        assert_eq!(u16::from_be_bytes([first[6], first[7]]), 0x2000);
        assert_eq!(u16::from_be_bytes([second[6], second[7]]), 1);
        let whole = [&first[20..], &second[20..]].concat();
        assert_eq!(whole, tcp_syn(&A.octets(), &B.octets(), 40001, 80, 53, b"tok"));
        // Read in place, the first packet's "TCP header" ends at the packet's end with RST.
        let frame = [&first[..], &trailer].concat();
        assert_eq!((frame[20 + 12] >> 4, frame[20 + 13]), (2, 0x04));
        assert_eq!(u16::from_be_bytes([second[22], second[23]]), 53);
    }

    #[test]
    fn hex_and_mac() {
        assert_eq!(from_hex(&to_hex(&[0, 0xab, 0xff])).unwrap(), vec![0, 0xab, 0xff]);
        assert_eq!(parse_mac("02:00:00:00:00:0a").unwrap(), [2, 0, 0, 0, 0, 10]);
        assert!(parse_mac("02:00").is_err());
    }
}
