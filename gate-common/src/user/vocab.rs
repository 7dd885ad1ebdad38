//! One spelling per concept. The kernel stores small integers (`abi::HOOK_*`,
//! `abi::VERDICT_*`, `abi::MODE_*`, `abi::TERMINATE_*`) and names programs by function name;
//! users read short names in logs, metrics and `status`; bpffs holds pins. Each enum here
//! maps between all of them, so no module re-spells them by hand.
use core::fmt;

use crate::abi;

macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident : $id_ty:ty {
            $( $(#[$vmeta:meta])* $variant:ident = ($id:expr, $text:literal), )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every value, in id order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The value the kernel stores.
            pub const fn id(self) -> $id_ty {
                match self {
                    $($name::$variant => $id,)+
                }
            }

            /// The name users read (logs, metrics, `status`).
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            /// The value of a kernel id, if it is one.
            pub fn from_id(id: $id_ty) -> Option<$name> {
                Self::ALL.iter().copied().find(|v| v.id() == id)
            }

            /// The value of a name, if it is one.
            pub fn from_name(name: &str) -> Option<$name> {
                Self::ALL.iter().copied().find(|v| v.name() == name)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

named_enum! {
    /// Where a decision is counted and reported: a STATS row and `DenyEvent::hook`.
    pub enum Hook: u32 {
        Connect4 = (abi::HOOK_CONNECT4, "connect4"),
        Connect6 = (abi::HOOK_CONNECT6, "connect6"),
        Egress4 = (abi::HOOK_EGRESS4, "egress4"),
        Egress6 = (abi::HOOK_EGRESS6, "egress6"),
        Tc4 = (abi::HOOK_TC4, "tc4"),
        Tc6 = (abi::HOOK_TC6, "tc6"),
        Setsockopt = (abi::HOOK_SETSOCKOPT, "setsockopt"),
        Socket = (abi::HOOK_SOCKET, "socket"),
    }
}

named_enum! {
    /// What a program decided about one piece of traffic.
    pub enum Verdict: u32 {
        /// The destination is not protected.
        Unmatched = (abi::VERDICT_UNMATCHED, "unmatched"),
        Allowed = (abi::VERDICT_ALLOWED, "allowed"),
        Denied = (abi::VERDICT_DENIED, "denied"),
        /// Audit mode: would have been denied, let through.
        Audited = (abi::VERDICT_AUDITED, "audited"),
        /// Sent to the agent's metadata proxy, which serves the workload's paths.
        Proxied = (abi::VERDICT_PROXIED, "proxied"),
    }
}

named_enum! {
    /// What the gate does with traffic it would deny (`mode:` in the policy).
    #[derive(Default)]
    pub enum Mode: u32 {
        /// Deny it (EPERM at the socket hooks, drop on the packet paths). The default.
        #[default]
        Enforce = (abi::MODE_ENFORCE, "enforce"),
        /// Let it through, log and count it as if denied.
        Audit = (abi::MODE_AUDIT, "audit"),
    }
}

named_enum! {
    /// Whether established connections are destroyed when a policy takes effect (GATE_INFO).
    pub enum TerminateState: u32 {
        Unknown = (abi::TERMINATE_UNKNOWN, "unknown"),
        On = (abi::TERMINATE_ON, "on"),
        Off = (abi::TERMINATE_OFF, "off"),
        Unsupported = (abi::TERMINATE_UNSUPPORTED, "unsupported by this kernel"),
    }
}

named_enum! {
    /// A program of the eBPF object, by the id of the function that defines it.
    pub enum Program: u8 {
        Connect4 = (0, "gate_connect4"),
        Connect6 = (1, "gate_connect6"),
        /// cgroup_skb egress with pid/comm in events.
        Egress = (2, "gate_egress"),
        /// The same without the current-task helpers, for kernels that reject them.
        EgressNotask = (3, "gate_egress_notask"),
        Tc = (4, "gate_tc"),
        Setsockopt = (5, "gate_setsockopt"),
        /// The same without the allow set, for kernels that offer cgroup/setsockopt no
        /// ancestor helper: the side doors are denied to every gated cgroup.
        SockoptNoallow = (6, "gate_sockopt_noallow"),
        /// BPF LSM: the side doors of `gate_setsockopt`, through every syscall ABI.
        LsmSetsockopt = (7, "gate_lsm_setsockopt"),
        /// BPF LSM: sockets that would read the node's IP traffic, at `socket()`.
        LsmSocket = (8, "gate_lsm_socket"),
        /// BPF LSM: the same at `bind()` (AF_PACKET).
        LsmBind = (9, "gate_lsm_bind"),
        /// `gate_tc` for interfaces whose packets do not start with an Ethernet header.
        TcL3 = (10, "gate_tc_l3"),
        /// `getpeername()` of a socket sent to the metadata proxy: the address it asked for.
        GetPeerName4 = (11, "gate_peername4"),
        GetPeerName6 = (12, "gate_peername6"),
        /// Moves a proxied connection's record from the client's socket to the proxy's.
        SockOps = (13, "gate_sock_ops"),
        /// Keeps the metadata proxy's port to the proxy.
        Bind4 = (14, "gate_bind4"),
        Bind6 = (15, "gate_bind6"),
    }
}

impl Mode {
    /// How the kernel programs read a stored mode: anything but audit enforces.
    pub fn from_kernel(id: u32) -> Mode {
        if id == abi::MODE_AUDIT { Mode::Audit } else { Mode::Enforce }
    }
}

impl Verdict {
    /// How an event's verdict byte reads: anything but audited was a denial.
    pub fn of_event(verdict: u8) -> Verdict {
        if u32::from(verdict) == abi::VERDICT_AUDITED { Verdict::Audited } else { Verdict::Denied }
    }
}

impl TerminateState {
    /// A stored state; an unknown value reads as [`TerminateState::Unknown`].
    pub fn from_kernel(id: u32) -> TerminateState {
        Self::from_id(id).unwrap_or(TerminateState::Unknown)
    }
}

impl Hook {
    /// A stored hook byte (`DenyEvent::hook`), if it is one.
    pub fn of_event(hook: u8) -> Option<Hook> {
        Self::from_id(u32::from(hook))
    }
}

impl Program {
    /// The program of one of our functions from the kernel's name of it, which is cut to
    /// 15 bytes (BPF_OBJ_NAME_LEN - 1).
    pub fn from_kernel_name(kernel_name: &str) -> Option<Program> {
        if kernel_name.is_empty() {
            return None;
        }
        Self::from_name(kernel_name).or_else(|| {
            (kernel_name.len() >= 15)
                .then(|| Self::ALL.iter().copied().find(|p| p.name().starts_with(kernel_name)))
                .flatten()
        })
    }

    /// The attach point this program serves.
    pub const fn attach_point(self) -> AttachPoint {
        match self {
            Program::Connect4 => AttachPoint::Connect4,
            Program::Connect6 => AttachPoint::Connect6,
            Program::Egress | Program::EgressNotask => AttachPoint::Egress,
            Program::Tc | Program::TcL3 => AttachPoint::Tc,
            Program::Setsockopt | Program::SockoptNoallow => AttachPoint::Setsockopt,
            Program::LsmSetsockopt => AttachPoint::LsmSetsockopt,
            Program::LsmSocket => AttachPoint::LsmSocket,
            Program::LsmBind => AttachPoint::LsmBind,
            Program::GetPeerName4 => AttachPoint::GetPeerName4,
            Program::GetPeerName6 => AttachPoint::GetPeerName6,
            Program::SockOps => AttachPoint::SockOps,
            Program::Bind4 => AttachPoint::Bind4,
            Program::Bind6 => AttachPoint::Bind6,
        }
    }
}

/// Where programs attach. Cgroup and LSM attach points have one pinned link each
/// (`links/<pin name>`); tc has one per interface and direction ([`AttachPoint::tc_pin_name`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AttachPoint {
    Connect4,
    Connect6,
    Egress,
    Setsockopt,
    Tc,
    LsmSetsockopt,
    LsmSocket,
    LsmBind,
    GetPeerName4,
    GetPeerName6,
    SockOps,
    Bind4,
    Bind6,
    /// `gate_sock_ops` on the metadata proxy's own cgroup (its accepted sockets), where
    /// that is not below the gated root.
    ProxySockOps,
}

impl AttachPoint {
    /// Every attach point on the gated cgroup: the gate's own ([`GATE`](Self::GATE)) and the
    /// metadata proxy's ([`PROXY`](Self::PROXY)).
    pub const CGROUP: [AttachPoint; 9] = [
        AttachPoint::Connect4,
        AttachPoint::Connect6,
        AttachPoint::Egress,
        AttachPoint::Setsockopt,
        AttachPoint::GetPeerName4,
        AttachPoint::GetPeerName6,
        AttachPoint::SockOps,
        AttachPoint::Bind4,
        AttachPoint::Bind6,
    ];

    /// The gate's attach points on the gated cgroup, always attached, in attach order. (No
    /// sendmsg4/6: an unconnected UDP datagram is judged once, on egress, which fails its
    /// `sendto()` with EPERM just the same.)
    pub const GATE: [AttachPoint; 4] = [
        AttachPoint::Connect4,
        AttachPoint::Connect6,
        AttachPoint::Egress,
        AttachPoint::Setsockopt,
    ];

    /// The metadata proxy's attach points on the gated cgroup: attached only while a proxy
    /// is configured and the policy sends connects to it, so that without one no TCP
    /// connection pays for them. ([`ProxySockOps`](Self::ProxySockOps), on the proxy's own
    /// cgroup, goes with them.)
    pub const PROXY: [AttachPoint; 5] = [
        AttachPoint::GetPeerName4,
        AttachPoint::GetPeerName6,
        AttachPoint::SockOps,
        AttachPoint::Bind4,
        AttachPoint::Bind6,
    ];

    /// The node-wide BPF LSM attach points (where the kernel runs the BPF LSM).
    pub const LSM: [AttachPoint; 3] =
        [AttachPoint::LsmSetsockopt, AttachPoint::LsmSocket, AttachPoint::LsmBind];

    /// Name of the pinned link and program (`links/<name>`, `progs/<name>`); for tc the
    /// prefix of [`tc_pin_name`](Self::tc_pin_name).
    pub const fn pin_name(self) -> &'static str {
        match self {
            AttachPoint::Connect4 => "connect4",
            AttachPoint::Connect6 => "connect6",
            AttachPoint::Egress => "egress",
            AttachPoint::Setsockopt => "setsockopt",
            AttachPoint::Tc => "tc",
            AttachPoint::LsmSetsockopt => "lsm-setsockopt",
            AttachPoint::LsmSocket => "lsm-socket",
            AttachPoint::LsmBind => "lsm-bind",
            AttachPoint::GetPeerName4 => "getpeername4",
            AttachPoint::GetPeerName6 => "getpeername6",
            AttachPoint::SockOps => "sock-ops",
            AttachPoint::Bind4 => "bind4",
            AttachPoint::Bind6 => "bind6",
            AttachPoint::ProxySockOps => "proxy-sock-ops",
        }
    }

    /// The kernel's LSM hook of an LSM attach point (`bpf_lsm_<hook>`).
    pub const fn lsm_hook(self) -> Option<&'static str> {
        match self {
            AttachPoint::LsmSetsockopt => Some("socket_setsockopt"),
            AttachPoint::LsmSocket => Some("socket_create"),
            AttachPoint::LsmBind => Some("socket_bind"),
            _ => None,
        }
    }

    /// The program attached here by default (egress: the variant with task info).
    pub const fn program(self) -> Program {
        match self {
            AttachPoint::Connect4 => Program::Connect4,
            AttachPoint::Connect6 => Program::Connect6,
            AttachPoint::Egress => Program::Egress,
            AttachPoint::Setsockopt => Program::Setsockopt,
            AttachPoint::Tc => Program::Tc,
            AttachPoint::LsmSetsockopt => Program::LsmSetsockopt,
            AttachPoint::LsmSocket => Program::LsmSocket,
            AttachPoint::LsmBind => Program::LsmBind,
            AttachPoint::GetPeerName4 => Program::GetPeerName4,
            AttachPoint::GetPeerName6 => Program::GetPeerName6,
            AttachPoint::SockOps | AttachPoint::ProxySockOps => Program::SockOps,
            AttachPoint::Bind4 => Program::Bind4,
            AttachPoint::Bind6 => Program::Bind6,
        }
    }

    /// Pin name of a tc link: `tc-<direction>-<ifindex>`. The program belongs to the
    /// interface, not its name: a rename keeps the pin (and the link), and interface names
    /// that bpffs rejects in a pin name (`eth1.100`) need none.
    pub fn tc_pin_name(direction: TcDirection, ifindex: u32) -> String {
        format!("tc-{}-{ifindex}", direction.name())
    }

    /// The (direction, ifindex) of a tc link's pin name.
    pub fn parse_tc_pin_name(pin: &str) -> Option<(TcDirection, u32)> {
        let rest = pin.strip_prefix("tc-")?;
        let (dir, ifindex) = rest.split_once('-')?;
        Some((TcDirection::from_name(dir)?, ifindex.parse().ok()?))
    }

    /// The attach point of a pinned link's name.
    pub fn from_pin_name(pin: &str) -> Option<AttachPoint> {
        if Self::parse_tc_pin_name(pin).is_some() {
            return Some(AttachPoint::Tc);
        }
        let proxy = [AttachPoint::ProxySockOps];
        Self::CGROUP.iter().chain(&Self::LSM).chain(&proxy).copied().find(|a| a.pin_name() == pin)
    }
}

impl fmt::Display for AttachPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.pin_name())
    }
}

named_enum! {
    /// The direction of a tc attachment.
    pub enum TcDirection: u8 {
        Ingress = (0, "ingress"),
        Egress = (1, "egress"),
    }
}

impl TcDirection {
    /// The TC_CLSACT map key of an attachment on `ifindex`.
    pub const fn clsact_key(self, ifindex: u32) -> u64 {
        abi::tc_clsact_key(ifindex, matches!(self, TcDirection::Egress))
    }

    /// The direction a TC_CLSACT key records.
    pub const fn of_clsact_key(key: u64) -> TcDirection {
        if key & 1 == 1 { TcDirection::Egress } else { TcDirection::Ingress }
    }
}

const _: () = {
    assert!(Hook::ALL.len() == abi::NUM_HOOKS as usize);
    assert!(Verdict::ALL.len() == abi::NUM_VERDICTS as usize);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_round_trip() {
        for h in Hook::ALL {
            assert_eq!(Hook::from_id(h.id()), Some(*h));
            assert_eq!(Hook::from_name(h.name()), Some(*h));
        }
        for (i, v) in Verdict::ALL.iter().enumerate() {
            assert_eq!(v.id(), i as u32, "verdicts index the STATS rows in id order");
        }
        assert_eq!(Hook::of_event(200), None);
    }

    #[test]
    fn unknown_kernel_values_fail_closed() {
        assert_eq!(Mode::from_kernel(77), Mode::Enforce);
        assert_eq!(Verdict::of_event(9), Verdict::Denied);
        assert_eq!(TerminateState::from_kernel(9), TerminateState::Unknown);
    }

    #[test]
    fn kernel_program_names_are_cut_to_15_bytes() {
        assert_eq!(Program::from_kernel_name("gate_egress_not"), Some(Program::EgressNotask));
        assert_eq!(Program::from_kernel_name("gate_setsockopt"), Some(Program::Setsockopt));
        assert_eq!(Program::from_kernel_name("gate_sockopt_no"), Some(Program::SockoptNoallow));
        assert_eq!(Program::from_kernel_name("gate_connect4"), Some(Program::Connect4));
        assert_eq!(Program::from_kernel_name("gate_e"), None);
        assert_eq!(Program::from_kernel_name(""), None);
    }

    #[test]
    fn pin_names() {
        let pin = AttachPoint::tc_pin_name(TcDirection::Egress, 7);
        assert_eq!(pin, "tc-egress-7");
        assert_eq!(AttachPoint::parse_tc_pin_name(&pin), Some((TcDirection::Egress, 7)));
        // Names of ABI 5 and earlier are not ours to parse.
        assert_eq!(AttachPoint::parse_tc_pin_name("tc-ingress-veth-ab"), None);
        assert_eq!(AttachPoint::from_pin_name("egress"), Some(AttachPoint::Egress));
        assert_eq!(AttachPoint::from_pin_name("tc-egress-12"), Some(AttachPoint::Tc));
        assert_eq!(AttachPoint::from_pin_name("lsm-bind"), Some(AttachPoint::LsmBind));
        assert_eq!(AttachPoint::from_pin_name("nope"), None);
        for a in AttachPoint::LSM {
            assert_eq!(a.program().attach_point(), a);
            assert!(a.lsm_hook().is_some(), "{a}");
        }
        for d in TcDirection::ALL {
            assert_eq!(TcDirection::of_clsact_key(d.clsact_key(7)), *d);
        }
    }

    #[test]
    fn the_cgroup_attach_points_are_the_gates_and_the_proxys() {
        let mut split: std::vec::Vec<AttachPoint> =
            AttachPoint::GATE.iter().chain(&AttachPoint::PROXY).copied().collect();
        let mut all = AttachPoint::CGROUP.to_vec();
        split.sort();
        all.sort();
        assert_eq!(split, all, "each cgroup attach point is the gate's or the proxy's, once");
        // What decides (connect) and what judges every packet (egress) are never the proxy's.
        for p in [AttachPoint::Connect4, AttachPoint::Connect6, AttachPoint::Egress] {
            assert!(!AttachPoint::PROXY.contains(&p), "{p}");
        }
    }
}
