//! What the node-level programs need to know of the network namespace, read over rtnetlink:
//! its interfaces (with their kind and bridge master) and the routes that cover a protected
//! address, in every routing table (pods may leave by policy routing, e.g. one table per
//! ENI).
use std::{net::IpAddr, time::Duration};

use gate_common::user::bytes_of;

use crate::netlink::{NetlinkError, NlSocket, WireError, attrs, read};

const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_MULTIPATH: u16 = 9;
const RTA_TABLE: u16 = 15;
const RTN_UNICAST: u8 = 1;
const IFF_LOOPBACK: u32 = 0x8;
/// Multicast groups: links, tc (qdiscs and filters), IPv4 routes, IPv6 routes.
pub(crate) const RTMGRP_LINK: u32 = 0x1;
pub(crate) const RTMGRP_TC: u32 = 0x8;
pub(crate) const RTMGRP_IPV4_ROUTE: u32 = 0x40;
pub(crate) const RTMGRP_IPV6_ROUTE: u32 = 0x400;

/// `struct ifinfomsg`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct IfInfoMsg {
    family: u8,
    pad: u8,
    ty: u16,
    index: i32,
    flags: u32,
    change: u32,
}

/// `struct rtmsg`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RtMsg {
    family: u8,
    dst_len: u8,
    src_len: u8,
    tos: u8,
    table: u8,
    protocol: u8,
    scope: u8,
    ty: u8,
    flags: u32,
}

/// `struct rtnexthop`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RtNexthop {
    len: u16,
    flags: u8,
    hops: u8,
    ifindex: i32,
}

const _: () = {
    assert!(size_of::<IfInfoMsg>() == 16);
    assert!(size_of::<RtMsg>() == 12);
    assert!(size_of::<RtNexthop>() == 8);
};

// SAFETY: integers only, no padding (sizes asserted above).
unsafe impl aya::Pod for IfInfoMsg {}
// SAFETY: as above.
unsafe impl aya::Pod for RtMsg {}
// SAFETY: as above.
unsafe impl aya::Pod for RtNexthop {}

/// An interface of the namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    pub ifindex: u32,
    pub name: String,
    /// `IFLA_INFO_KIND` (`veth`, `bridge`, `openvswitch`, `tun`, `vxlan`, …); `None` for
    /// physical devices.
    pub kind: Option<String>,
    /// The bridge (or OVS datapath) this interface is a port of.
    pub master: Option<u32>,
    pub loopback: bool,
}

/// A route: its prefix and the interfaces it leaves by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Route {
    pub dst: IpAddr,
    pub dst_len: u8,
    pub table: u32,
    pub oifs: Vec<u32>,
}

impl Route {
    /// Whether the route's prefix contains `addr`.
    pub(crate) fn covers(&self, addr: IpAddr) -> bool {
        fn masked<const N: usize>(a: [u8; N], len: u8) -> [u8; N] {
            let mut o = a;
            for (i, b) in o.iter_mut().enumerate() {
                let keep = usize::from(len).saturating_sub(i * 8).min(8);
                *b &= if keep == 0 { 0 } else { 0xffu8 << (8 - keep) };
            }
            o
        }
        match (self.dst, addr) {
            (IpAddr::V4(d), IpAddr::V4(a)) => {
                masked(d.octets(), self.dst_len) == masked(a.octets(), self.dst_len)
            }
            (IpAddr::V6(d), IpAddr::V6(a)) => {
                masked(d.octets(), self.dst_len) == masked(a.octets(), self.dst_len)
            }
            _ => false,
        }
    }
}

/// A request socket on the calling thread's namespace.
pub(crate) fn open() -> std::io::Result<NlSocket> {
    NlSocket::open(libc::NETLINK_ROUTE, Duration::from_secs(5))
}

/// Every interface of the namespace.
pub(crate) fn links(sock: &mut NlSocket) -> Result<Vec<Link>, NetlinkError> {
    let req = IfInfoMsg::default();
    let replies = sock.dump(RTM_GETLINK, &[bytes_of(&req)], RTM_NEWLINK)?;
    replies.iter().map(|p| parse_link(p).map_err(NetlinkError::from)).collect()
}

fn parse_link(payload: &[u8]) -> Result<Link, WireError> {
    let msg: IfInfoMsg = read(payload, "ifinfomsg")?;
    let mut link = Link {
        ifindex: msg.index as u32,
        name: String::new(),
        kind: None,
        master: None,
        loopback: msg.flags & IFF_LOOPBACK != 0,
    };
    for (ty, data) in attrs(payload.get(size_of::<IfInfoMsg>()..).unwrap_or_default())? {
        match ty {
            IFLA_IFNAME => {
                let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
                link.name = String::from_utf8_lossy(&data[..end]).into_owned();
            }
            IFLA_MASTER => link.master = read::<u32>(data, "IFLA_MASTER").ok(),
            IFLA_LINKINFO => {
                for (ity, idata) in attrs(data)? {
                    if ity == IFLA_INFO_KIND {
                        let end = idata.iter().position(|&b| b == 0).unwrap_or(idata.len());
                        link.kind = Some(String::from_utf8_lossy(&idata[..end]).into_owned());
                    }
                }
            }
            _ => {}
        }
    }
    Ok(link)
}

/// Every unicast route of every table, IPv4 and IPv6.
pub(crate) fn routes(sock: &mut NlSocket) -> Result<Vec<Route>, NetlinkError> {
    let mut out = Vec::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        let req = RtMsg { family: family as u8, ..Default::default() };
        for p in sock.dump(RTM_GETROUTE, &[bytes_of(&req)], RTM_NEWROUTE)? {
            if let Some(r) = parse_route(&p)? {
                out.push(r);
            }
        }
    }
    Ok(out)
}

fn parse_route(payload: &[u8]) -> Result<Option<Route>, WireError> {
    let msg: RtMsg = read(payload, "rtmsg")?;
    if msg.ty != RTN_UNICAST {
        return Ok(None);
    }
    let v6 = i32::from(msg.family) == libc::AF_INET6;
    let mut dst = if v6 { IpAddr::V6(0.into()) } else { IpAddr::V4(0.into()) };
    let mut table = u32::from(msg.table);
    let mut oifs = Vec::new();
    for (ty, data) in attrs(payload.get(size_of::<RtMsg>()..).unwrap_or_default())? {
        match ty {
            RTA_DST if v6 => dst = IpAddr::V6(read::<[u8; 16]>(data, "RTA_DST")?.into()),
            RTA_DST => dst = IpAddr::V4(read::<[u8; 4]>(data, "RTA_DST")?.into()),
            RTA_OIF => oifs.push(read::<u32>(data, "RTA_OIF")?),
            RTA_TABLE => table = read::<u32>(data, "RTA_TABLE")?,
            RTA_MULTIPATH => {
                let mut rest = data;
                while rest.len() >= size_of::<RtNexthop>() {
                    let nh: RtNexthop = read(rest, "rtnexthop")?;
                    let len = usize::from(nh.len).max(size_of::<RtNexthop>());
                    oifs.push(nh.ifindex as u32);
                    rest = rest.get(crate::netlink::align4(len)..).unwrap_or_default();
                }
            }
            _ => {}
        }
    }
    Ok(Some(Route { dst, dst_len: msg.dst_len, table, oifs }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::attr;

    #[test]
    fn parses_links_and_routes() {
        let mut p =
            bytes_of(&IfInfoMsg { index: 7, flags: IFF_LOOPBACK, ..Default::default() }).to_vec();
        p.extend(attr(IFLA_IFNAME, b"lo\0"));
        p.extend(attr(IFLA_MASTER, &3u32.to_ne_bytes()));
        p.extend(attr(IFLA_LINKINFO, &attr(IFLA_INFO_KIND, b"veth\0")));
        let l = parse_link(&p).unwrap();
        assert_eq!(
            l,
            Link {
                ifindex: 7,
                name: "lo".into(),
                kind: Some("veth".into()),
                master: Some(3),
                loopback: true
            }
        );

        let msg = RtMsg {
            family: libc::AF_INET as u8,
            dst_len: 16,
            table: 254,
            ty: RTN_UNICAST,
            ..Default::default()
        };
        let mut r = bytes_of(&msg).to_vec();
        r.extend(attr(RTA_DST, &[169, 254, 0, 0]));
        let nh = |i: i32| bytes_of(&RtNexthop { len: 8, flags: 0, hops: 0, ifindex: i }).to_vec();
        r.extend(attr(RTA_MULTIPATH, &[nh(4), nh(5)].concat()));
        let route = parse_route(&r).unwrap().unwrap();
        assert_eq!(route.oifs, vec![4, 5]);
        assert!(route.covers("169.254.169.254".parse().unwrap()));
        assert!(!route.covers("169.253.0.1".parse().unwrap()));
        assert!(!route.covers("fd00::1".parse().unwrap()));
        let blackhole = RtMsg { ty: 6, ..msg };
        assert_eq!(parse_route(bytes_of(&blackhole)).unwrap(), None);
    }
}
