//! A denial event read the way users see it.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::abi::{DenyEvent, PROTO_TCP, PROTO_UDP};

use super::{Hook, Verdict};

impl DenyEvent {
    /// The destination address.
    pub fn dst(&self) -> IpAddr {
        if self.family == 4 {
            IpAddr::V4(Ipv4Addr::new(self.addr[0], self.addr[1], self.addr[2], self.addr[3]))
        } else {
            IpAddr::V6(Ipv6Addr::from(self.addr))
        }
    }

    /// The sending task's command name (empty where the hook had no task).
    pub fn comm(&self) -> String {
        let end = self.comm.iter().position(|&b| b == 0).unwrap_or(self.comm.len());
        String::from_utf8_lossy(&self.comm[..end]).into_owned()
    }

    /// Denied, or audited (let through in audit mode).
    pub fn verdict(&self) -> Verdict {
        Verdict::of_event(self.verdict)
    }

    /// The hook's name, `unknown` for a value this build does not know.
    pub fn hook_name(&self) -> &'static str {
        Hook::of_event(self.hook).map_or("unknown", Hook::name)
    }

    /// The protocol's name.
    pub fn proto_name(&self) -> String {
        proto_name(self.proto)
    }

    /// The destination as text: the address, or what stands in for one (a denied socket
    /// option names no destination; an unreadable frame has none that could be read).
    pub fn dst_text(&self) -> String {
        match (self.family, self.sockopt()) {
            (4 | 6, _) => self.dst().to_string(),
            (_, Some(_)) => "-".into(),
            _ => "(unreadable frame)".into(),
        }
    }

    /// For a denied socket option (hook `setsockopt`): `LEVEL/OPTION`.
    pub fn sockopt(&self) -> Option<String> {
        if u32::from(self.hook) != crate::abi::HOOK_SETSOCKOPT {
            return None;
        }
        let level = i32::from_ne_bytes([self.addr[0], self.addr[1], self.addr[2], self.addr[3]]);
        let level_name = match level {
            263 => "SOL_PACKET".to_owned(),
            283 => "SOL_XDP".to_owned(),
            l => l.to_string(),
        };
        let opt = match (level, self.port) {
            (263, 20) => "PACKET_QDISC_BYPASS".to_owned(),
            (283, 2) => "XDP_RX_RING".to_owned(),
            (283, 3) => "XDP_TX_RING".to_owned(),
            (283, 4) => "XDP_UMEM_REG".to_owned(),
            (283, 5) => "XDP_UMEM_FILL_RING".to_owned(),
            (283, 6) => "XDP_UMEM_COMPLETION_RING".to_owned(),
            (_, o) => o.to_string(),
        };
        Some(format!("{level_name}/{opt}"))
    }
}

/// Name of an IP protocol number: TCP, UDP, ICMP, ICMPv6, or the number.
pub fn proto_name(proto: u8) -> String {
    match proto {
        PROTO_TCP => "TCP".into(),
        PROTO_UDP => "UDP".into(),
        1 => "ICMP".into(),
        58 => "ICMPv6".into(),
        p => p.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_an_event() {
        let mut ev = DenyEvent {
            cgroup_id: 1,
            ts_ns: 0,
            addr: [0; 16],
            pid: 1,
            endpoint: 0,
            port: 80,
            proto: PROTO_TCP,
            family: 4,
            verdict: crate::abi::VERDICT_AUDITED as u8,
            hook: crate::abi::HOOK_EGRESS6 as u8,
            _pad: [0; 2],
            comm: *b"curl\0\0\0\0\0\0\0\0\0\0\0\0",
        };
        ev.addr[..4].copy_from_slice(&[169, 254, 169, 254]);
        assert_eq!(ev.dst().to_string(), "169.254.169.254");
        assert_eq!(ev.comm(), "curl");
        assert_eq!(ev.verdict(), Verdict::Audited);
        assert_eq!(ev.hook_name(), "egress6");
        assert_eq!(ev.proto_name(), "TCP");
        assert_eq!(proto_name(47), "47");
    }
}
