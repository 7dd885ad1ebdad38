//! Bounded bookkeeping for denials: a per-workload log rate limit, so that a pod hammering the
//! metadata address cannot flood the log, and per-workload counters with a label-cardinality
//! cap for /metrics. Pure logic; time is passed in.
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
}
