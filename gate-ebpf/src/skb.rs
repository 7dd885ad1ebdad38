//! Reading an sk_buff: gate-common's parsers through bpf_skb_load_bytes, and the packet
//! programs' fast path on bytes of the linear area.
use aya_ebpf::{
    bindings::bpf_hdr_start_off::BPF_HDR_START_NET,
    cty::c_void,
    helpers::generated::{bpf_skb_load_bytes_relative, bpf_skb_pull_data},
    programs::sk_buff::SkBuff,
};
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

/// The packet of an sk_buff from the kernel's network header on, whatever the link layer
/// put in front of it (the header helper reads the linear area only: see `pull_headers`).
pub(crate) struct NetSkb<'a>(pub(crate) &'a SkBuff);

/// How much of a packet the slow path makes linear: the IP header with options or an
/// extension chain, and the transport header, behind whatever link header there is.
const HEADERS: u32 = 256;

impl NetSkb<'_> {
    /// The fast path on the header at the network offset, by its version nibble (an IPv4
    /// packet may be shorter than an IPv6 header: 20 bytes are read first).
    #[inline(always)]
    pub(crate) fn passes_fast(&self) -> bool {
        let Some(h) = self.bytes::<20>(0) else { return false };
        match h[0] >> 4 {
            4 => fast_v4(&h),
            6 => self.bytes::<40>(0).is_some_and(|h| fast_v6(&h)),
            _ => false,
        }
    }

    /// Make the packet's first [`HEADERS`] bytes linear, where they are not (best effort:
    /// what stays out of reach is unreadable, and denied).
    #[inline(always)]
    pub(crate) fn pull_headers(&self) {
        let skb = self.0.skb;
        // SAFETY: reads fields of the context.
        let (len, linear) = unsafe { ((*skb).len, (*skb).data_end - (*skb).data) };
        let want = if len < HEADERS { len } else { HEADERS };
        if linear < want {
            // SAFETY: the context pointer; the helper checks the length. Packet pointers
            // taken before are stale after it, and none are kept.
            unsafe { bpf_skb_pull_data(skb, want) };
        }
    }
}

impl Packet for NetSkb<'_> {
    #[inline(always)]
    fn bytes<const N: usize>(&self, off: usize) -> Option<[u8; N]> {
        let mut buf = [0u8; N];
        // SAFETY: the context pointer and a stack buffer of the length passed.
        let r = unsafe {
            bpf_skb_load_bytes_relative(
                self.0.skb as *const c_void,
                off as u32,
                buf.as_mut_ptr() as *mut c_void,
                N as u32,
                BPF_HDR_START_NET,
            )
        };
        (r == 0).then_some(buf)
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
        linear::<40>(skb, l3).is_some_and(fast_v6)
    } else {
        linear::<20>(skb, l3).is_some_and(fast_v4)
    }
}

/// The fast path on an IPv4 header's first 20 bytes.
#[inline(always)]
fn fast_v4(h: &[u8; 20]) -> bool {
    PREFILTER.get(0).is_some_and(|f| passes_fast_v4(f, h[0], h[16], h[19]))
}

/// The fast path on an IPv6 header's 40 bytes.
#[inline(always)]
fn fast_v6(h: &[u8; 40]) -> bool {
    PREFILTER.get(0).is_some_and(|f| passes_fast_v6(f, h[0], h[6], h[24], h[39]))
}
