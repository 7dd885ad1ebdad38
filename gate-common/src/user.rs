//! User-space glue: these types may be read from and written to aya maps.
use crate::abi::{
    AllowKey, DenyEvent, EndpointCounters, EndpointName, EpNameKey, GateInfo, PolicyMeta,
    PortRuleKey, PrefixV4, PrefixV6, PrefixValue, TcClsact,
};

// SAFETY: all are #[repr(C)], Copy, with explicit padding and no invalid bit patterns.
unsafe impl aya::Pod for PolicyMeta {}
unsafe impl aya::Pod for PrefixV4 {}
unsafe impl aya::Pod for PrefixV6 {}
unsafe impl aya::Pod for PrefixValue {}
unsafe impl aya::Pod for PortRuleKey {}
unsafe impl aya::Pod for AllowKey {}
unsafe impl aya::Pod for EndpointCounters {}
unsafe impl aya::Pod for DenyEvent {}
unsafe impl aya::Pod for GateInfo {}
unsafe impl aya::Pod for EpNameKey {}
unsafe impl aya::Pod for EndpointName {}
unsafe impl aya::Pod for TcClsact {}
