//! Bounded bookkeeping: a per-workload log rate limit, so that a pod hammering the metadata
//! address cannot flood the log; per-workload counters with a label-cardinality cap for
//! /metrics; and per-workload token buckets, so that one workload cannot spend the node's
//! metadata quota through the proxy. Pure logic; time is passed in.
use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

/// Label that absorbs workloads beyond [`WorkloadCounts`]'s cap.
pub(crate) const OTHER: &str = "_other";

/// Whether to log an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    Log,
    Suppress,
}

struct Window {
    start: Instant,
    logged: u32,
    /// Events seen and not logged.
    suppressed: u64,
    /// Denials counted elsewhere for the window (the kernel's per-cgroup tally, which also
    /// holds the denials it never sent as events); 0 if nobody counts.
    tally: u64,
}

impl Window {
    fn new(start: Instant) -> Window {
        Window { start, logged: 0, suppressed: 0, tally: 0 }
    }

    /// What the window's summary reports: by the tally where there is one, else by the
    /// events seen.
    fn unlogged(&self) -> u64 {
        if self.tally > 0 {
            self.tally.saturating_sub(u64::from(self.logged))
        } else {
            self.suppressed
        }
    }
}

/// At most `burst` log events per workload per `window`; the rest are counted and reported
/// by [`flush`](Self::flush) as one summary per workload and window.
pub(crate) struct RateLimiter {
    burst: u32,
    window: Duration,
    max_keys: usize,
    windows: HashMap<String, Window>,
}

impl RateLimiter {
    pub(crate) fn new(burst: u32, window: Duration, max_keys: usize) -> Self {
        Self { burst, window, max_keys: max_keys.max(1), windows: HashMap::new() }
    }

    pub(crate) fn admit(&mut self, key: &str, now: Instant) -> Admit {
        if !self.windows.contains_key(key) && self.windows.len() >= self.max_keys {
            // Too many distinct workloads at once: they share one bucket.
            return self.admit_in(OTHER.to_owned(), now);
        }
        self.admit_in(key.to_owned(), now)
    }

    fn admit_in(&mut self, key: String, now: Instant) -> Admit {
        let w = self.windows.entry(key).or_insert(Window::new(now));
        if now.duration_since(w.start) >= self.window && w.unlogged() == 0 {
            *w = Window::new(now);
        }
        if w.logged < self.burst {
            w.logged += 1;
            Admit::Log
        } else {
            w.suppressed += 1;
            Admit::Suppress
        }
    }

    /// Add `n` denials of `key` counted elsewhere (the kernel's tally) to its current window:
    /// a window's summary then reports every denial that was not logged, also those that
    /// never arrived as events.
    pub(crate) fn tally(&mut self, key: &str, n: u64, now: Instant) {
        let key = if !self.windows.contains_key(key) && self.windows.len() >= self.max_keys {
            OTHER
        } else {
            key
        };
        let w = self.windows.entry(key.to_owned()).or_insert(Window::new(now));
        if now.duration_since(w.start) >= self.window && w.unlogged() == 0 {
            *w = Window::new(now);
        }
        w.tally += n;
    }

    /// Summaries `(workload, unlogged)` of every window that has ended, and forget those
    /// windows. Call it periodically.
    pub(crate) fn flush(&mut self, now: Instant) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        self.windows.retain(|key, w| {
            if now.duration_since(w.start) < self.window {
                return true;
            }
            if w.unlogged() > 0 {
                out.push((key.clone(), w.unlogged()));
            }
            false
        });
        out.sort();
        out
    }
}

/// Denials per workload, at most `cap` distinct labels; the rest count under [`OTHER`].
#[derive(Debug, Default)]
pub(crate) struct WorkloadCounts {
    cap: usize,
    counts: HashMap<String, u64>,
}

impl WorkloadCounts {
    pub(crate) fn new(cap: usize) -> Self {
        Self { cap, counts: HashMap::new() }
    }

    #[cfg(test)]
    pub(crate) fn add(&mut self, workload: &str) {
        self.add_n(workload, 1);
    }

    pub(crate) fn add_n(&mut self, workload: &str, n: u64) {
        if let Some(c) = self.counts.get_mut(workload) {
            *c += n;
        } else if self.counts.len() < self.cap {
            self.counts.insert(workload.to_owned(), n);
        } else {
            *self.counts.entry(OTHER.to_owned()).or_default() += n;
        }
    }

    pub(crate) fn snapshot(&self) -> Vec<(String, u64)> {
        let mut v: Vec<_> = self.counts.iter().map(|(k, &c)| (k.clone(), c)).collect();
        v.sort();
        v
    }
}

/// A rate of requests: `milli_per_second / 1000` per second on average, `burst` at once.
/// Thousandths, so that a policy may say 0.5 per second and the type stays `Eq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub milli_per_second: u32,
    pub burst: u32,
}

impl Rate {
    fn per_second(self) -> f64 {
        f64::from(self.milli_per_second) / 1000.0
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} per second, burst {}", self.per_second(), self.burst)
    }
}

#[derive(Clone)]
struct Bucket {
    tokens: f64,
    at: Instant,
    rate: Rate,
}

impl Bucket {
    /// The tokens at `now`, never above the burst.
    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate.per_second()).min(f64::from(self.rate.burst));
        self.at = now.max(self.at);
    }
}

/// A token bucket per workload: a request takes a token, tokens come back at the rate, up to
/// the burst. At most `max_keys` buckets; a full bucket is the same as none, so those go
/// first when room is needed, and a new workload finds no room only when every bucket is in
/// use (then it waits like an empty bucket: the node's quota is what this protects).
pub(crate) struct Buckets {
    max_keys: usize,
    by_key: HashMap<u64, Bucket>,
}

impl Buckets {
    pub(crate) fn new(max_keys: usize) -> Buckets {
        Buckets { max_keys: max_keys.max(1), by_key: HashMap::new() }
    }

    /// Take a token of `key`'s bucket at `rate`, or say how long until one comes. A changed
    /// rate (a new policy) applies from now, with the tokens held, up to its burst.
    pub(crate) fn take(&mut self, key: u64, rate: Rate, now: Instant) -> Result<(), Duration> {
        if rate.milli_per_second == 0 || rate.burst == 0 {
            return Err(Duration::from_secs(1));
        }
        if !self.by_key.contains_key(&key) && self.by_key.len() >= self.max_keys {
            self.by_key.retain(|_, b| {
                b.refill(now);
                b.tokens < f64::from(b.rate.burst)
            });
            if self.by_key.len() >= self.max_keys {
                return Err(Duration::from_secs(1));
            }
        }
        let b = self.by_key.entry(key).or_insert(Bucket {
            tokens: f64::from(rate.burst),
            at: now,
            rate,
        });
        b.refill(now);
        if b.rate != rate {
            b.rate = rate;
            b.tokens = b.tokens.min(f64::from(rate.burst));
        }
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / rate.per_second()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_suppress_then_summary() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(3, Duration::from_secs(10), 100);
        let verdicts: Vec<_> =
            (0..10).map(|i| rl.admit("ns/pod", t0 + Duration::from_millis(i))).collect();
        assert_eq!(verdicts.iter().filter(|&&a| a == Admit::Log).count(), 3);
        assert_eq!(verdicts[3..], [Admit::Suppress; 7]);
        // Another workload has its own budget.
        assert_eq!(rl.admit("other/pod", t0), Admit::Log);
        // Nothing to report before the window ends.
        assert!(rl.flush(t0 + Duration::from_secs(5)).is_empty());
        assert_eq!(rl.flush(t0 + Duration::from_secs(10)), vec![("ns/pod".to_owned(), 7)]);
        // A new window starts afresh.
        assert_eq!(rl.admit("ns/pod", t0 + Duration::from_secs(11)), Admit::Log);
    }

    #[test]
    fn the_tally_reports_denials_that_never_arrived() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(5, Duration::from_secs(10), 100);
        // 16 events arrived (the kernel's burst); 20 denials were counted.
        for i in 0..16 {
            rl.admit("w", t0 + Duration::from_millis(i));
        }
        rl.tally("w", 20, t0 + Duration::from_secs(1));
        assert_eq!(rl.flush(t0 + Duration::from_secs(10)), vec![("w".to_owned(), 15)]);
        // Only tallied, never logged: all of them are reported.
        rl.tally("quiet", 3, t0);
        assert_eq!(rl.flush(t0 + Duration::from_secs(20)), vec![("quiet".to_owned(), 3)]);
    }

    #[test]
    fn window_resets_without_suppression() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(1, Duration::from_secs(1), 100);
        assert_eq!(rl.admit("a", t0), Admit::Log);
        assert_eq!(rl.admit("a", t0 + Duration::from_secs(2)), Admit::Log);
    }

    #[test]
    fn key_cap_shares_one_bucket() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(1, Duration::from_secs(10), 2);
        assert_eq!(rl.admit("a", t0), Admit::Log);
        assert_eq!(rl.admit("b", t0), Admit::Log);
        // Over the cap: "c" and "d" share OTHER's bucket — memory stays bounded.
        assert_eq!(rl.admit("c", t0), Admit::Log);
        assert_eq!(rl.admit("d", t0), Admit::Suppress);
        assert!(rl.windows.len() <= 3);
    }

    #[test]
    fn workload_labels_are_bounded() {
        let mut c = WorkloadCounts::new(2);
        for w in ["a", "b", "c", "d", "a"] {
            c.add(w);
        }
        assert_eq!(
            c.snapshot(),
            vec![("_other".to_owned(), 2), ("a".to_owned(), 2), ("b".to_owned(), 1)]
        );
    }

    const TWO: Rate = Rate { milli_per_second: 2000, burst: 5 };

    #[test]
    fn a_bucket_gives_its_burst_then_its_rate() {
        let mut b = Buckets::new(8);
        let t0 = Instant::now();
        for _ in 0..5 {
            assert_eq!(b.take(1, TWO, t0), Ok(()));
        }
        let wait = b.take(1, TWO, t0).expect_err("empty");
        assert_eq!(wait, Duration::from_millis(500));
        // Another workload has its own bucket.
        assert_eq!(b.take(2, TWO, t0), Ok(()));
        // Half a second later: one token back.
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(b.take(1, TWO, t1), Ok(()));
        assert!(b.take(1, TWO, t1).is_err());
        // Long idle: back to the burst, never above it.
        let t2 = t1 + Duration::from_secs(3600);
        for _ in 0..5 {
            assert_eq!(b.take(1, TWO, t2), Ok(()));
        }
        assert!(b.take(1, TWO, t2).is_err());
    }

    #[test]
    fn a_new_rate_keeps_the_tokens_up_to_its_burst() {
        let mut b = Buckets::new(8);
        let t0 = Instant::now();
        assert_eq!(b.take(1, TWO, t0), Ok(()));
        let one = Rate { milli_per_second: 1000, burst: 1 };
        assert_eq!(b.take(1, one, t0), Ok(()), "4 tokens held, cut to the new burst of 1");
        assert_eq!(b.take(1, one, t0), Err(Duration::from_secs(1)));
        let off = Rate { milli_per_second: 0, burst: 5 };
        assert!(b.take(3, off, t0).is_err(), "a zero rate serves nothing");
    }

    #[test]
    fn full_buckets_make_room_and_busy_ones_are_kept() {
        let mut b = Buckets::new(2);
        let t0 = Instant::now();
        for _ in 0..5 {
            b.take(1, TWO, t0).expect("burst");
        }
        b.take(2, TWO, t0).expect("second key");
        // No room: key 1 is empty, key 2 not full. A third waits.
        assert!(b.take(3, TWO, t0).is_err());
        // Later key 2 is full again (as good as gone) and makes room; key 1 keeps its debt.
        let t1 = t0 + Duration::from_millis(600);
        assert_eq!(b.take(3, TWO, t1), Ok(()));
        assert_eq!(b.take(1, TWO, t1), Ok(()));
        assert!(b.take(1, TWO, t1).is_err(), "key 1 was not reset by the eviction");
    }

    proptest::proptest! {
        /// However requests arrive, a workload is served at most its burst plus its rate times
        /// the time elapsed, and a refused request was told a wait that is right.
        #[test]
        fn never_more_than_burst_plus_rate_times_time(
            milli in 1u32..=10_000,
            burst in 1u32..=50,
            gaps in proptest::collection::vec(0u64..2_000, 1..400),
        ) {
            let rate = Rate { milli_per_second: milli, burst };
            let mut b = Buckets::new(4);
            let t0 = Instant::now();
            let mut now = t0;
            let mut served = 0u64;
            for gap in gaps {
                now += Duration::from_millis(gap);
                match b.take(7, rate, now) {
                    Ok(()) => served += 1,
                    Err(wait) => {
                        proptest::prop_assert!(wait > Duration::ZERO);
                        // At the time it named, a token is there.
                        let mut later = Buckets { max_keys: 4, by_key: b.by_key.clone() };
                        let ok = later.take(7, rate, now + wait + Duration::from_micros(1));
                        proptest::prop_assert!(ok.is_ok(), "no token after the wait");
                    }
                }
                let elapsed = now.duration_since(t0).as_secs_f64();
                let bound = f64::from(burst) + elapsed * f64::from(milli) / 1000.0;
                proptest::prop_assert!(served as f64 <= bound + 1e-9, "{served} > {bound}");
            }
        }
    }
}
