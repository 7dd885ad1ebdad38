//! `gate-bench`: what the gate costs against no gate, nftables and iptables, measured in one
//! run in throwaway namespaces and cgroups, variants interleaved slice by slice, each ratio
//! with its 95 % interval and every comparison decided only as far as the interval allows
//! ([`stats`]). Writes target/bench/{report.json,report.md,chart.png}.
//!
//! `cargo xtask bench [ARGS]` builds it with the agent it measures and runs it with ARGS; it
//! measures the gate-agent and `bench-probe` found next to it (or where `GATE_AGENT_BIN` and
//! `BENCH_PROBE_BIN` say).
mod abuse;
mod apply;
mod chart;
mod clock;
mod deny;
mod nsrun;
mod policy;
mod proxy;
mod rates;
mod report;
mod scale;
mod stats;
mod variants;
mod workload;
mod world;

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use clap::Parser as _;
use integration_tests::sys::{missing_privileges, sweep_stale};
pub(crate) use report::Report;

/// How long and how often: `--quick` is a smoke run, never judged on its numbers. (report.json
/// keeps it under `details.config`.)
#[derive(serde::Serialize)]
pub(crate) struct Cfg {
    pub quick: bool,
    /// Seconds per workload run of the statistics pass (scenario 8).
    pub secs: f64,
    /// Rounds of the denied-connect and proxy scenarios (each puts every variant in force once).
    pub rounds: usize,
    /// Denied connect() calls per variant and round; against nft drop (each waits for the
    /// timeout): calls per round and their timeout.
    pub deny_n: usize,
    pub drop_n: usize,
    pub drop_timeout_ms: u64,
    /// Policy changes (each way) and new cgroups for the latency scenario.
    pub changes: usize,
    /// gate-agent and bench-probe: the release build, the tests' for `--quick`.
    #[serde(skip)]
    pub bins: Bins,
    /// The CPU the rate scenarios' workloads and sinks share (the last this process may use).
    #[serde(skip)]
    pub cpu: usize,
    /// Cycles of the rate scenarios (in each, every variant runs one slice, in a rotating
    /// order) and milliseconds per slice.
    pub cycles: usize,
    pub slice_ms: f64,
    /// Rate scenarios with no variant in force in any world: a check of the method, whose
    /// every comparison should come out level.
    pub calibrate: bool,
}

/// The binaries a run drives.
pub(crate) struct Bins {
    /// gate-agent, as the harness's agent guard takes it.
    pub under_test: integration_tests::bins::Bins,
    /// The workload (src/bin/bench-probe.rs).
    pub bench_probe: PathBuf,
}

/// Names bench-probe for a run (`cargo xtask bench` sets it with `GATE_AGENT_BIN`).
const BENCH_PROBE_VAR: &str = "BENCH_PROBE_BIN";

impl Bins {
    /// From `GATE_AGENT_BIN` and `BENCH_PROBE_BIN`, else next to this executable (one cargo
    /// build puts them in one profile directory); each must exist.
    fn locate() -> Result<Bins> {
        let under_test = integration_tests::bins::Bins::from_env();
        let bench_probe = match std::env::var_os(BENCH_PROBE_VAR) {
            Some(p) => PathBuf::from(p),
            None => std::env::current_exe()
                .context("locating gate-bench")?
                .with_file_name("bench-probe"),
        };
        for bin in [&under_test.agent, &bench_probe] {
            if !bin.is_file() {
                bail!("{} is missing: `cargo xtask bench` builds it", bin.display());
            }
        }
        Ok(Bins { under_test, bench_probe })
    }
}

/// The scenarios, by the name `--only` takes.
type Scenario = fn(&Cfg, &mut Report) -> Result<()>;
const SCENARIOS: [(&str, &str, Scenario); 7] = [
    ("rates", "1-3, 7: connect, UDP and bulk rates; agent memory and CPU", rates::run),
    ("deny", "4: denied connect() latency", deny::run),
    ("scale", "5: scale", scale::run),
    ("apply", "6: policy change and new cgroup to enforcement", apply::run),
    ("stats", "8: ns per program run (BPF statistics on)", nsrun::run),
    ("abuse", "9: the agent under abuse (denied cgroups, events)", abuse::run),
    ("proxy", "10: a served path through the metadata proxy vs direct", proxy::run),
];

/// What the command line asks of a run.
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "gate-bench",
    about = "Benchmarks: the gate against no gate, nftables and iptables, side by side; writes target/bench/{report.json,report.md,chart.png} (root)"
)]
struct Options {
    /// A short smoke run (numbers are not meaningful; never fails on timing)
    #[arg(long)]
    quick: bool,
    /// Cycles of the rate scenarios 1-3, each variant one slice per cycle (default 800;
    /// quick 6; scale runs half as many): 95 % intervals need at least 6
    #[arg(long, value_name = "N")]
    cycles: Option<usize>,
    /// Milliseconds per slice of the rate scenarios (default 25; quick 10)
    #[arg(long, value_name = "MS")]
    slice_ms: Option<f64>,
    /// Only these scenarios: rates, deny, scale, apply, stats, abuse, proxy (repeatable); the
    /// report is then not checked for completeness
    #[arg(long, value_name = "SCENARIO", value_parser = SCENARIOS.map(|s| s.0))]
    only: Option<Vec<String>>,
    /// Calibrate the method: the rate scenarios with nothing in force in any world (run
    /// with `--only rates`); every comparison should come out level
    #[arg(long, conflicts_with = "quick")]
    calibrate: bool,
    /// Only redraw chart.png from an existing report.json (target/bench/, or --out)
    #[arg(long, conflicts_with = "quick")]
    redraw: bool,
    /// Where the report goes (default: bench/ in the target directory gate-bench was built in)
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

fn main() -> Result<()> {
    run(Options::parse())
}

/// `target/bench` of the build this executable belongs to (`target/<profile>/gate-bench`).
fn default_out() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating gate-bench")?;
    let target = exe.parent().and_then(Path::parent).context("gate-bench has no target dir")?;
    Ok(target.join("bench"))
}

fn run(opts: Options) -> Result<()> {
    let out = match opts.out {
        Some(ref dir) => dir.clone(),
        None => default_out()?,
    };
    if opts.redraw {
        chart::draw(&Report::load(&out.join("report.json"))?, &out.join("chart.png"))?;
        println!("wrote {}", out.join("chart.png").display());
        return Ok(());
    }
    if let Some(why) = missing_privileges() {
        bail!("the benchmark {why}: run it as root (sudo -E cargo xtask bench)");
    }
    for tool in ["nft", "iptables-nft-restore", "nsenter"] {
        if output(Command::new(tool).arg("--version")).is_none() {
            bail!("{tool} is missing: `cargo xtask setup` installs it");
        }
    }
    let quick = opts.quick;
    let bins = Bins::locate()?;
    sweep_stale();
    let (secs, rounds, deny_n, drop_n, drop_timeout_ms, changes, cycles, slice_ms) = if quick {
        (0.3, 2, 200, 1, 300, 3, 6, 10.0)
    } else {
        (2.0, 10, 2000, 3, 1000, 20, 800, 25.0)
    };
    let cfg = Cfg {
        quick,
        secs,
        rounds,
        deny_n,
        drop_n,
        drop_timeout_ms,
        changes,
        bins,
        cpu: integration_tests::sys::last_allowed_cpu()?,
        cycles: opts.cycles.unwrap_or(cycles).max(1),
        slice_ms: opts.slice_ms.unwrap_or(slice_ms).max(1.0),
        calibrate: opts.calibrate,
    };
    let started = Instant::now();
    let mut rep = Report::new(&cfg);
    let wanted = |key: &str| opts.only.as_ref().is_none_or(|o| o.iter().any(|x| x == key));
    for (_, name, f) in SCENARIOS.into_iter().filter(|s| wanted(s.0)) {
        eprintln!("\x1b[1m== scenario {name}\x1b[0m");
        let t = Instant::now();
        f(&cfg, &mut rep)?;
        eprintln!("   ({:.0} s)", t.elapsed().as_secs_f64());
    }
    rep.set_num("duration_s", started.elapsed().as_secs_f64());
    rep.finish();
    rep.write(&out)?;
    chart::draw(&rep, &out.join("chart.png"))?;
    println!("{}", rep.markdown());
    println!("wrote {}/{{report.json,report.md,chart.png}}", out.display());
    leftovers()?;
    if opts.only.is_some() { Ok(()) } else { complete(&rep, &out) }
}

/// The report has everything a run must produce, whatever the numbers: a ratio for every
/// variant of every rate scenario and scale size, a verdict for every comparison, the
/// statistics pass, and the files. (The smoke run in `cargo xtask test` asserts this; no
/// speed is ever asserted.)
fn complete(rep: &Report, out: &Path) -> Result<()> {
    let mut missing = Vec::new();
    for s in &rates::SCENARIOS {
        for v in rates::VARIANTS.iter().filter(|v| **v != variants::Variant::None) {
            missing.push(format!("{}_{}", s.key, v.key()));
        }
        for other in ["nft", "ipt"] {
            missing.push(format!("{}_gate_minus_{other}", s.key));
        }
        missing.push(format!("ns_per_run_{}_egress", s.name));
        missing.push(format!("ns_per_run_{}_tc", s.name));
    }
    for k in ["1", "100", "10k", "cg1", "cg100", "cg1000"] {
        missing.push(format!("connect_rate_ratio_gate_{k}"));
    }
    missing.push("ns_per_run_connect_connect4".into());
    for k in ["p50_us_direct", "p50_us_proxied", "p99_us_proxied", "rps_ratio", "agent_rss_mib"] {
        missing.push(format!("proxy_{k}"));
    }
    for p in ["egress", "tc", "empty_program"] {
        missing.push(format!("ns_per_test_run_{p}"));
    }
    missing.retain(|k| rep.get(k).is_none_or(|v| !v.is_finite()));
    for v in
        ["connect_gate_vs_nft", "udp_gate_vs_nft", "bulk_gate_vs_nft", "bulk_gate_at_least_0.99"]
    {
        if !rep.verdicts().contains_key(v) {
            missing.push(format!("verdict {v}"));
        }
    }
    for f in ["report.json", "report.md", "chart.png"] {
        if !out.join(f).is_file() {
            missing.push(f.into());
        }
    }
    if !missing.is_empty() {
        bail!("the report lacks {missing:?}");
    }
    Ok(())
}

/// Nothing of ours may survive the run.
fn leftovers() -> Result<()> {
    let me = format!("mg-{}-", std::process::id());
    let mine = format!("mg-test-{}-", std::process::id());
    let netns = output(Command::new("ip").args(["netns", "list"])).unwrap_or_default();
    let cg = integration_tests::sys::cgroup2_mount()?;
    let mut left: Vec<String> =
        netns.lines().filter(|l| l.starts_with(&me)).map(String::from).collect();
    for dir in [cg, std::env::temp_dir()] {
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with(&me) || n.starts_with(&mine) {
                    left.push(e.path().display().to_string());
                }
            }
        }
    }
    if !left.is_empty() {
        bail!("left behind: {left:?}");
    }
    Ok(())
}

/// Run quietly and capture stdout; None if the program is missing or fails.
pub(crate) fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The nearest-rank p50 and p99 of `v`.
pub(crate) fn p50_p99(v: &[f64]) -> (f64, f64) {
    (percentile(v, 50.0), percentile(v, 99.0))
}

/// The numbers of a JSON array (bench-probe's `samples_us`); none for anything else.
pub(crate) fn numbers(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
        .unwrap_or_default()
}

/// `items` in round `round`'s order: rotated by one a round, so that none is always first.
pub(crate) fn rotated<T: Copy>(items: &[T], round: usize) -> impl Iterator<Item = (usize, T)> {
    (0..items.len()).map(move |i| (i + round) % items.len()).map(|k| (k, items[k]))
}

/// Median of `v` (NaN for none).
pub(crate) fn median(v: &[f64]) -> f64 {
    percentile(v, 50.0)
}

/// Nearest-rank percentile.
pub(crate) fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// Agent resident memory (MiB) and CPU time (seconds, user + system).
pub(crate) fn agent_usage(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = after_comm.split_whitespace().collect();
    // Fields 14 and 15 of stat(5); after the comm field they are at 11 and 12.
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((kb / 1024.0, ticks / hz))
}
