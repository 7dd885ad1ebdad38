//! Bounded bookkeeping for denials: a per-workload log rate limit, so that a pod hammering the
//! metadata address cannot flood the log, and per-workload counters with a label-cardinality
//! cap for /metrics. Pure logic; time is passed in.
use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

/// Label that absorbs workloads beyond [`WorkloadCounts`]'s cap.
pub const OTHER: &str = "_other";

/// Whether to log an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    Log,
    Suppress,
}

struct Window {
    start: Instant,
    logged: u32,
    suppressed: u64,
}

/// At most `burst` log events per workload per `window`; the rest are counted and reported
/// by [`flush`](Self::flush) as one summary per workload and window.
pub struct RateLimiter {
    burst: u32,
    window: Duration,
    max_keys: usize,
    windows: HashMap<String, Window>,
}

impl RateLimiter {
    pub fn new(burst: u32, window: Duration, max_keys: usize) -> Self {
        Self { burst, window, max_keys: max_keys.max(1), windows: HashMap::new() }
    }

    pub fn admit(&mut self, key: &str, now: Instant) -> Admit {
        if !self.windows.contains_key(key) && self.windows.len() >= self.max_keys {
            // Too many distinct workloads at once: they share one bucket.
            return self.admit_in(OTHER.to_owned(), now);
        }
        self.admit_in(key.to_owned(), now)
    }

    fn admit_in(&mut self, key: String, now: Instant) -> Admit {
        let w = self.windows.entry(key).or_insert(Window { start: now, logged: 0, suppressed: 0 });
        if now.duration_since(w.start) >= self.window && w.suppressed == 0 {
            *w = Window { start: now, logged: 0, suppressed: 0 };
        }
        if w.logged < self.burst {
            w.logged += 1;
            Admit::Log
        } else {
            w.suppressed += 1;
            Admit::Suppress
        }
    }

    /// Summaries `(workload, suppressed)` of every window that has ended, and forget those
    /// windows. Call it periodically.
    pub fn flush(&mut self, now: Instant) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        self.windows.retain(|key, w| {
            if now.duration_since(w.start) < self.window {
                return true;
            }
            if w.suppressed > 0 {
                out.push((key.clone(), w.suppressed));
            }
            false
        });
        out.sort();
        out
    }
}

/// Denials per workload, at most `cap` distinct labels; the rest count under [`OTHER`].
#[derive(Debug, Default)]
pub struct WorkloadCounts {
    cap: usize,
    counts: HashMap<String, u64>,
}

impl WorkloadCounts {
    pub fn new(cap: usize) -> Self {
        Self { cap, counts: HashMap::new() }
    }

    pub fn add(&mut self, workload: &str) {
        if let Some(c) = self.counts.get_mut(workload) {
            *c += 1;
        } else if self.counts.len() < self.cap {
            self.counts.insert(workload.to_owned(), 1);
        } else {
            *self.counts.entry(OTHER.to_owned()).or_default() += 1;
        }
    }

    pub fn snapshot(&self) -> Vec<(String, u64)> {
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
