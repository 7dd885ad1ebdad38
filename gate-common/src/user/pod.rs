//! Plain-data glue: the map types may be read from and written to aya maps, and raw bytes
//! become structs in exactly one way ([`read_pod`]).
use crate::abi::{
    AccessKey, AccessStats, AllowKey, DenyEvent, EndpointCounters, EndpointName, EpNameKey,
    GateInfo, HandshakeKey, PolicyMeta, PortRuleKey, Prefilter, PrefixV4, PrefixV6, PrefixValue,
    ProxyConfig, ProxyRecord, TcClsact,
};

// SAFETY: all are #[repr(C)], Copy, with explicit padding and no invalid bit patterns.
unsafe impl aya::Pod for PolicyMeta {}
// SAFETY: as above.
unsafe impl aya::Pod for PrefixV4 {}
// SAFETY: as above.
unsafe impl aya::Pod for PrefixV6 {}
// SAFETY: as above.
unsafe impl aya::Pod for PrefixValue {}
// SAFETY: as above.
unsafe impl aya::Pod for PortRuleKey {}
// SAFETY: as above.
unsafe impl aya::Pod for AllowKey {}
// SAFETY: as above.
unsafe impl aya::Pod for EndpointCounters {}
// SAFETY: as above.
unsafe impl aya::Pod for DenyEvent {}
// SAFETY: as above.
unsafe impl aya::Pod for GateInfo {}
// SAFETY: as above.
unsafe impl aya::Pod for EpNameKey {}
// SAFETY: as above.
unsafe impl aya::Pod for EndpointName {}
// SAFETY: as above.
unsafe impl aya::Pod for TcClsact {}
// SAFETY: as above.
unsafe impl aya::Pod for AccessKey {}
// SAFETY: as above.
unsafe impl aya::Pod for AccessStats {}
// SAFETY: as above.
unsafe impl aya::Pod for Prefilter {}
// SAFETY: as above.
unsafe impl aya::Pod for ProxyConfig {}
// SAFETY: as above.
unsafe impl aya::Pod for ProxyRecord {}
// SAFETY: as above.
unsafe impl aya::Pod for HandshakeKey {}

/// A plain-data value copied out of the front of `bytes`; `None` if `bytes` is too short.
/// Alignment does not matter (the copy is unaligned).
pub fn read_pod<T: aya::Pod>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < size_of::<T>() {
        return None;
    }
    // SAFETY: length checked above; `T: Pod` is valid for any bit pattern.
    Some(unsafe { core::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// The bytes of a plain-data value (to build netlink requests and the like).
pub fn bytes_of<T: aya::Pod>(v: &T) -> &[u8] {
    // SAFETY: `T: Pod` has no padding with undefined contents by contract and every byte of
    // it may be read; the slice borrows `v`.
    unsafe { core::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_pod_round_trips_and_refuses_short_input() {
        let k = AllowKey::new(1, 0x1122_3344_5566_7788);
        let b = bytes_of(&k).to_vec();
        assert_eq!(read_pod::<AllowKey>(&b), Some(k));
        // Unaligned input works too.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&b);
        assert_eq!(read_pod::<AllowKey>(&shifted[1..]), Some(k));
        assert_eq!(read_pod::<AllowKey>(&b[..b.len() - 1]), None);
    }
}
