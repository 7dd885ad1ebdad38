//! The transport protocols a policy names: a leaf that the policy and the platform registry
//! both use.
use std::fmt;

use gate_common::abi::{PROTO_TCP, PROTO_UDP};

/// A transport protocol an endpoint can be restricted to (`TCP` / `UDP` in the document).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// The spelling used in the policy document.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }

    /// IP protocol number (`gate_common::abi::PROTO_TCP` / `PROTO_UDP`).
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => PROTO_TCP,
            Protocol::Udp => PROTO_UDP,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
