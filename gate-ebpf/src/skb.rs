//! Reading an sk_buff: gate-common's parsers through bpf_skb_load_bytes, and the packet
//! programs' fast path on bytes of the linear area.
use aya_ebpf::programs::sk_buff::SkBuff;
use gate_common::packet::{Packet, passes_fast_v4, passes_fast_v6};

use crate::maps::PREFILTER;

/// The packet of an sk_buff, for gate-common's parsers.
pub(crate) struct Skb<'a>(pub(crate) &'a SkBuff);

impl Packet for Skb<'_> {
    #[inline(always)]
    fn bytes<const N: usize>(&self, off: usize) -> Option<[u8; N]> {
        self.0.load::<[u8; N]>(off).ok()
    }
}

/// The packet's bytes `[off, off + N)` where they lie in the linear area, after one bounds
/// check: the fast paths read the few bytes they need in place, copying nothing.
#[inline(always)]
pub(crate) fn linear<const N: usize>(skb: &SkBuff, off: usize) -> Option<&[u8; N]> {
    // SAFETY: reads fields of the context.
    let (data, end) = unsafe { ((*skb.skb).data as usize, (*skb.skb).data_end as usize) };
    if data + off + N <= end {
        // SAFETY: bounds checked against data_end just above (the verifier checks it too);
        // a byte array has no alignment.
        Some(unsafe { &*((data + off) as *const [u8; N]) })
    } else {
        None
    }
}

/// The packet programs' fast path on the IP header at `l3` (IPv6 when `v6`): one bounds
/// check, four byte loads, one PREFILTER read and one bit test of the destination's (first,
/// last) byte pair (gate-common's `passes_fast_v4`/`_v6`). True: the packet passes without another look.
#[inline(always)]
pub(crate) fn passes_fast_ip(skb: &SkBuff, l3: usize, v6: bool) -> bool {
    if v6 {
        let Some(h) = linear::<40>(skb, l3) else { return false };
        let Some(f) = PREFILTER.get(0) else { return false };
        passes_fast_v6(f, h[0], h[6], h[24], h[39])
    } else {
        let Some(h) = linear::<20>(skb, l3) else { return false };
        let Some(f) = PREFILTER.get(0) else { return false };
        passes_fast_v4(f, h[0], h[16], h[19])
    }
}
