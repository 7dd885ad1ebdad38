//! What the node-level programs need to know of the network namespace, read over rtnetlink:
//! its interfaces, with their link type.
use std::time::Duration;

use gate_common::user::bytes_of;

use crate::netlink::{NetlinkError, NlSocket, WireError, attrs, read};

const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const IFLA_IFNAME: u16 = 3;
const IFF_LOOPBACK: u32 = 0x8;
/// Multicast groups: links, tc (qdiscs and filters).
pub(crate) const RTMGRP_LINK: u32 = 0x1;
pub(crate) const RTMGRP_TC: u32 = 0x8;

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

const _: () = assert!(size_of::<IfInfoMsg>() == 16);

// SAFETY: integers only, no padding (size asserted above).
unsafe impl aya::Pod for IfInfoMsg {}

/// An interface of the namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    pub ifindex: u32,
    pub name: String,
    pub loopback: bool,
    /// The link type (`ARPHRD_*`): what the interface's packets start with.
    pub link_type: u16,
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
        loopback: msg.flags & IFF_LOOPBACK != 0,
        link_type: msg.ty,
    };
    for (ty, data) in attrs(payload.get(size_of::<IfInfoMsg>()..).unwrap_or_default())? {
        if ty == IFLA_IFNAME {
            let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
            link.name = String::from_utf8_lossy(&data[..end]).into_owned();
        }
    }
    Ok(link)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::attr;

    #[test]
    fn parses_links() {
        let msg = IfInfoMsg { index: 7, flags: IFF_LOOPBACK, ty: 772, ..Default::default() };
        let mut p = bytes_of(&msg).to_vec();
        p.extend(attr(IFLA_IFNAME, b"lo\0"));
        // An attribute the agent does not read (IFLA_MASTER) is skipped.
        p.extend(attr(10, &3u32.to_ne_bytes()));
        let l = parse_link(&p).unwrap();
        assert_eq!(l, Link { ifindex: 7, name: "lo".into(), loopback: true, link_type: 772 });
    }
}
