//! The report's statistics, pure: a median with a distribution-free confidence interval,
//! and the verdicts such an interval supports (ahead / level / behind a competitor, a target
//! met or missed), never more than it supports.
//!
//! The ratios are paired per cycle (a slow cycle slows both), and the interval for the median
//! of n of them is the order-statistic one, k-th smallest to k-th largest with k the largest
//! whose coverage 1 − 2·P(Binomial(n, ½) < k) is still ≥ 95 %: docs/benchmarks.md, "Method".
use serde_json::{Value, json};

/// The confidence the intervals aim for.
pub(super) const CONFIDENCE: f64 = 0.95;

/// Half-width of "level": two ratios within this of each other cost the same, for a user
/// (one percent of a rate).
pub(super) const LEVEL_MARGIN: f64 = 0.01;

/// The median of a sample and the interval around it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Interval {
    pub n: usize,
    pub median: f64,
    /// The interval's ends: order statistics of the sample.
    pub lo: f64,
    pub hi: f64,
    /// Its coverage: ≥ [`CONFIDENCE`] from 6 samples on, less below.
    pub coverage: f64,
    pub min: f64,
    pub max: f64,
}

impl Interval {
    /// Whether the interval has the coverage the verdicts ask for.
    pub(crate) fn confident(&self) -> bool {
        self.coverage >= CONFIDENCE
    }

    pub(crate) fn contains(&self, x: f64) -> bool {
        self.lo <= x && x <= self.hi
    }

    pub(crate) fn to_json(self) -> Value {
        json!({"n": self.n, "median": self.median, "lo": self.lo, "hi": self.hi,
               "coverage": self.coverage, "min": self.min, "max": self.max})
    }

    /// `0.987 [0.975, 0.995]`
    pub(crate) fn text(&self) -> String {
        format!("{:.3} [{:.3}, {:.3}]", self.median, self.lo, self.hi)
    }
}

/// P(Binomial(n, ½) < k).
fn binomial_below(n: usize, k: usize) -> f64 {
    // C(n, i) / 2^n, summed; in f64 the terms are exact enough for any n a benchmark has.
    let mut term = 0.5f64.powi(n as i32);
    let mut sum = 0.0;
    for i in 0..k.min(n + 1) {
        sum += term;
        term *= (n - i) as f64 / (i + 1) as f64;
    }
    sum
}

/// The median of `samples` (NaN ones left out) and its order-statistic interval. `None` for
/// an empty sample.
pub(super) fn median_interval(samples: &[f64]) -> Option<Interval> {
    let mut s: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
    // The largest k (1-based) whose interval still covers ≥ CONFIDENCE; at least 1.
    let mut k = 1;
    while k < n.div_ceil(2) && 1.0 - 2.0 * binomial_below(n, k + 1) >= CONFIDENCE {
        k += 1;
    }
    let coverage = 1.0 - 2.0 * binomial_below(n, k);
    Some(Interval { n, median, lo: s[k - 1], hi: s[n - k], coverage, min: s[0], max: s[n - 1] })
}

/// Per-round ratios `a[i] / b[i]` (as far as both have rounds).
pub(super) fn ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x / y).collect()
}

/// Per-round differences `a[i] − b[i]`.
pub(super) fn differences(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x - y).collect()
}

/// How one variant compares with another, from the interval of their paired differences
/// (this one's ratio minus the other's, per round).
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "lowercase")]
pub(super) enum Comparison {
    /// The whole interval above 0, and not all of it within the margin.
    Ahead,
    /// The whole interval within ±[`LEVEL_MARGIN`] (whether or not it contains 0).
    Level,
    /// Not behind by more than the margin, possibly ahead by more: the interval from
    /// −margin up, crossing +margin.
    #[strum(serialize = "level or ahead")]
    LevelOrAhead,
    /// Not ahead by more than the margin, possibly behind by more.
    #[strum(serialize = "level or behind")]
    LevelOrBehind,
    /// The whole interval below 0, and not all of it within the margin.
    Behind,
    /// The interval reaches beyond both margins, or falls short of the confidence: these
    /// rounds cannot tell.
    Undecided,
}

impl Comparison {
    pub(super) fn name(self) -> &'static str {
        self.into()
    }

    /// What a user choosing between the two wants to know: this one is not the dearer.
    pub(super) fn at_least_level(self) -> bool {
        matches!(self, Comparison::Ahead | Comparison::Level | Comparison::LevelOrAhead)
    }

    /// The target "at least as cheap as the other": met when at least level, missed when
    /// behind.
    pub(super) fn as_target(self) -> Target {
        match self {
            c if c.at_least_level() => Target::Met,
            Comparison::Behind => Target::Missed,
            _ => Target::Undecided,
        }
    }
}

/// The comparison the interval of paired differences supports.
pub(super) fn compare(diff: &Interval) -> Comparison {
    if !diff.confident() {
        return Comparison::Undecided;
    }
    // Level first: a difference the interval confines to within the margin is no
    // difference to a user, even where the interval also excludes 0 (a calibration run,
    // identical worlds, finds such differences of a few tenths of a percent).
    if diff.lo >= -LEVEL_MARGIN && diff.hi <= LEVEL_MARGIN {
        Comparison::Level
    } else if diff.lo > 0.0 {
        Comparison::Ahead
    } else if diff.hi < 0.0 {
        Comparison::Behind
    } else if diff.lo >= -LEVEL_MARGIN {
        Comparison::LevelOrAhead
    } else if diff.hi <= LEVEL_MARGIN {
        Comparison::LevelOrBehind
    } else {
        Comparison::Undecided
    }
}

/// Whether a target of "at least `target`" holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "lowercase")]
pub(super) enum Target {
    /// The whole interval at or above the target.
    Met,
    /// The whole interval below it.
    Missed,
    /// The interval straddles it, or falls short of the confidence.
    Undecided,
}

impl Target {
    pub(super) fn name(self) -> &'static str {
        self.into()
    }
}

/// A target decided on one number (no interval): `met` or `missed`.
pub(super) fn met(ok: bool) -> &'static str {
    if ok { Target::Met.name() } else { Target::Missed.name() }
}

/// Whether the interval supports "at least `target`".
pub(super) fn at_least(iv: &Interval, target: f64) -> Target {
    if !iv.confident() {
        Target::Undecided
    } else if iv.lo >= target {
        Target::Met
    } else if iv.hi < target {
        Target::Missed
    } else {
        Target::Undecided
    }
}

/// Whether a measurement stays where a reference is: its median inside the reference's
/// interval (scale: 10 000 entries against 1).
pub(super) fn within(iv: &Interval, reference: &Interval) -> Target {
    if !reference.confident() {
        Target::Undecided
    } else if reference.contains(iv.median) {
        Target::Met
    } else {
        Target::Missed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(v: &[f64]) -> Interval {
        median_interval(v).expect("samples")
    }

    #[test]
    fn binomial_tail() {
        assert!((binomial_below(10, 1) - 1.0 / 1024.0).abs() < 1e-12);
        assert!((binomial_below(10, 2) - 11.0 / 1024.0).abs() < 1e-12);
        assert!((binomial_below(4, 5) - 1.0).abs() < 1e-12);
        assert_eq!(binomial_below(3, 0), 0.0);
    }

    #[test]
    fn order_statistic_intervals() {
        // n = 10: the 2nd smallest to the 2nd largest, 97.9 %.
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        let i = iv(&v);
        assert_eq!((i.n, i.median, i.lo, i.hi), (10, 5.5, 2.0, 9.0));
        assert!((i.coverage - (1.0 - 22.0 / 1024.0)).abs() < 1e-12 && i.confident());
        // n = 12: 3rd to 10th, 96.1 %; n = 6: the whole range, 96.9 %.
        let i = iv(&(1..=12).map(f64::from).collect::<Vec<_>>());
        assert_eq!((i.lo, i.hi), (3.0, 10.0));
        assert!(i.confident());
        let i = iv(&[6.0, 1.0, 5.0, 2.0, 4.0, 3.0]);
        assert_eq!((i.lo, i.hi, i.median), (1.0, 6.0, 3.5));
        assert!(i.confident());
        // n = 5: the whole range covers only 93.75 %: not confident.
        let i = iv(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!((i.lo, i.hi, i.median), (1.0, 5.0, 3.0));
        assert!(!i.confident() && (i.coverage - 0.9375).abs() < 1e-12);
        // Order does not matter, NaN is left out, nothing gives nothing.
        assert_eq!(iv(&[3.0, f64::NAN, 1.0, 2.0]).median, 2.0);
        assert_eq!(median_interval(&[]), None);
        assert_eq!(median_interval(&[f64::NAN]), None);
        // The coverage never falls below the confidence from 6 samples on.
        for n in 6..200 {
            let i = iv(&(0..n).map(f64::from).collect::<Vec<_>>());
            assert!(i.confident(), "n = {n}: {}", i.coverage);
            assert!(i.lo <= i.median && i.median <= i.hi);
        }
    }

    #[test]
    fn comparisons_say_only_what_the_interval_supports() {
        let d = |v: &[f64]| compare(&iv(v));
        let ten = |c: f64, w: f64| -> Vec<f64> {
            (0..10).map(|i| c + w * (f64::from(i) / 9.0 - 0.5)).collect()
        };
        assert_eq!(d(&ten(0.05, 0.02)), Comparison::Ahead);
        assert_eq!(d(&ten(-0.05, 0.02)), Comparison::Behind);
        assert_eq!(d(&ten(0.0, 0.01)), Comparison::Level);
        // From −0.008 to −0.002: surely below 0, but by less than the margin.
        assert_eq!(d(&ten(-0.005, 0.006)), Comparison::Level);
        assert_eq!(d(&ten(0.005, 0.006)), Comparison::Level);
        // From −0.014 to −0.006: behind, possibly by more than the margin.
        assert_eq!(d(&ten(-0.01, 0.008)), Comparison::Behind);
        // From −0.004 to +0.03: not behind, maybe ahead.
        assert_eq!(d(&ten(0.013, 0.04)), Comparison::LevelOrAhead);
        assert_eq!(d(&ten(-0.013, 0.04)), Comparison::LevelOrBehind);
        assert_eq!(d(&ten(0.0, 0.2)), Comparison::Undecided);
        // Five rounds decide nothing, however clear they look.
        assert_eq!(d(&[0.1, 0.1, 0.1, 0.1, 0.1]), Comparison::Undecided);
        assert!(Comparison::LevelOrAhead.at_least_level());
        assert_eq!(Comparison::LevelOrBehind.name(), "level or behind");
        assert_eq!((Comparison::Ahead.name(), Target::Undecided.name()), ("ahead", "undecided"));
        assert!(!Comparison::Undecided.at_least_level());
    }

    #[test]
    fn targets() {
        let v: Vec<f64> = (0..10).map(|i| 0.99 + 0.001 * f64::from(i)).collect();
        assert_eq!(at_least(&iv(&v), 0.99), Target::Met);
        assert_eq!(at_least(&iv(&v), 0.995), Target::Undecided);
        assert_eq!(at_least(&iv(&v), 1.1), Target::Missed);
        let reference = iv(&v);
        assert_eq!(within(&iv(&[0.994; 7]), &reference), Target::Met);
        assert_eq!(within(&iv(&[0.95; 7]), &reference), Target::Missed);
        assert_eq!(within(&iv(&[0.994; 7]), &iv(&[0.99, 0.995])), Target::Undecided);
    }

    #[test]
    fn paired_helpers() {
        assert_eq!(ratios(&[2.0, 3.0, 9.0], &[1.0, 3.0]), vec![2.0, 1.0]);
        assert_eq!(differences(&[1.0, 0.5], &[0.5, 0.75]), vec![0.5, -0.25]);
    }
}
