//! What the node-level programs need to know of the network namespace, read over rtnetlink:
//! its interfaces, with their link type.
use std::time::Duration;

use netlink_packet_core::{NlasIterator, ParseableParametrized as _};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    link::{LinkAttribute, LinkFlags, LinkHeader, LinkMessage},
};

use crate::netlink::{DUMP, DecodeError, NetlinkError, NlSocket};

/// `struct ifinfomsg`, ahead of the attributes.
const LINK_HEADER_LEN: usize = 16;
/// Multicast groups: links, tc (qdiscs and filters).
pub(crate) const RTMGRP_LINK: u32 = libc::RTMGRP_LINK as u32;
pub(crate) const RTMGRP_TC: u32 = libc::RTMGRP_TC as u32;

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
    NlSocket::open(libc::NETLINK_ROUTE as isize, Duration::from_secs(5))
}

/// Every interface of the namespace.
pub(crate) fn links(sock: &mut NlSocket) -> Result<Vec<Link>, NetlinkError> {
    let mut links = Vec::new();
    sock.request(RouteNetlinkMessage::GetLink(LinkMessage::default()), DUMP, |ty, payload| {
        if ty == libc::RTM_NEWLINK {
            links.push(parse_link(payload)?);
        }
        Ok(())
    })?;
    Ok(links)
}

/// The header and the name; the other attributes are not read, so one the crate cannot
/// parse does not hide the interface.
fn parse_link(payload: &[u8]) -> Result<Link, DecodeError> {
    let hdr = LinkHeader::parse(payload)?;
    let mut link = Link {
        ifindex: hdr.index,
        name: String::new(),
        loopback: hdr.flags.contains(LinkFlags::Loopback),
        link_type: hdr.link_layer_type.into(),
    };
    for nla in NlasIterator::new(payload.get(LINK_HEADER_LEN..).unwrap_or_default()) {
        let nla = nla?;
        if nla.kind() == libc::IFLA_IFNAME
            && let Ok(LinkAttribute::IfName(name)) =
                LinkAttribute::parse_with_param(&nla, AddressFamily::Unspec)
        {
            link.name = name;
        }
    }
    Ok(link)
}

#[cfg(test)]
mod tests {
    use netlink_packet_core::Emitable as _;
    use netlink_packet_route::link::LinkLayerType;

    use super::*;

    #[test]
    fn parses_links() {
        let mut msg = LinkMessage::default();
        msg.header.index = 7;
        msg.header.flags = LinkFlags::Loopback;
        msg.header.link_layer_type = LinkLayerType::Loopback;
        msg.attributes.push(LinkAttribute::IfName("lo".into()));
        // An attribute the agent does not read (IFLA_MASTER) is skipped.
        msg.attributes.push(LinkAttribute::Controller(3));
        let mut p = vec![0; msg.buffer_len()];
        msg.emit(&mut p);
        let l = parse_link(&p).unwrap();
        assert_eq!(l, Link { ifindex: 7, name: "lo".into(), loopback: true, link_type: 772 });
    }
}
