//! The clock both sides of a latency read: the bench and `bench-probe` (its `flip` mode).

/// CLOCK_MONOTONIC in nanoseconds: comparable between processes (no time namespaces here).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid timespec pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
