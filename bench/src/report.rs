//! report.json (flat numeric keys + details), the markdown table and the machine description.
use std::{fs, path::Path};

use anyhow::{Context as _, Result};
use serde_json::{Map, Value, json};

use crate::{Cfg, stats::Interval};

/// A row of report.md; [`Report::row`] adds one with the first three cells, the rest are set
/// on what it returns.
pub(crate) struct Row {
    scenario: String,
    variant: String,
    value: String,
    /// The ratio to no gate: median and interval over the rounds.
    pub ratio: Option<Interval>,
    /// How it compares with nftables (and iptables), from the paired differences.
    pub versus: String,
    /// The target and whether the interval says it is met.
    pub target: String,
}

#[derive(Default)]
pub(crate) struct Report {
    keys: Map<String, Value>,
    details: Map<String, Value>,
    verdicts: Map<String, Value>,
    rows: Vec<Row>,
    machine: Value,
}

fn first_line(cmd: &str, args: &[&str]) -> String {
    crate::output(std::process::Command::new(cmd).args(args))
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_default()
}

/// CPU count, model, kernel and tool versions.
pub(super) fn machine() -> Value {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_default();
    let mem_kb = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().next().and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    json!({
        "load": load.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": model,
        "mem_gib": (mem_kb as f64 / 1048576.0 * 10.0).round() / 10.0,
        "kernel": first_line("uname", &["-r"]),
        "nft": first_line("nft", &["--version"]),
        "iptables": first_line("iptables", &["-V"]),
    })
}

impl Report {
    pub(crate) fn new(cfg: &Cfg) -> Report {
        let mut r = Report { machine: machine(), ..Report::default() };
        r.detail("config", serde_json::to_value(cfg).unwrap_or_default());
        r
    }

    /// The machine's load average when the report ends (the start's is in `machine`).
    pub(crate) fn finish(&mut self) {
        let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let end = load.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
        self.machine["load_end"] = json!(end);
    }

    /// The numeric keys of a written report.json (to redraw its chart).
    pub(crate) fn load(path: &Path) -> Result<Report> {
        let text = fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let v: Value =
            serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
        let mut keys = v.as_object().cloned().unwrap_or_default();
        keys.retain(|_, v| v.is_number() || v.is_null());
        Ok(Report { keys, machine: v["machine"].clone(), ..Report::default() })
    }

    /// A ratio's median under `key`, its interval's ends under `key_lo` and `key_hi`.
    pub(crate) fn set_interval(&mut self, key: &str, iv: &Interval) {
        self.set_num(key, iv.median);
        self.set_num(&format!("{key}_lo"), iv.lo);
        self.set_num(&format!("{key}_hi"), iv.hi);
    }

    /// A verdict (`ahead`, `level`, `met`, …) under `verdicts` in report.json.
    pub(crate) fn verdict(&mut self, key: &str, verdict: &str) {
        self.verdicts.insert(key.into(), json!(verdict));
    }

    pub(crate) fn verdicts(&self) -> &Map<String, Value> {
        &self.verdicts
    }

    /// A top-level numeric key; NaN or infinite becomes null.
    pub(crate) fn set_num(&mut self, key: &str, v: f64) {
        let v = if v.is_finite() { json!((v * 1e4).round() / 1e4) } else { Value::Null };
        self.keys.insert(key.into(), v);
    }

    pub(crate) fn get(&self, key: &str) -> Option<f64> {
        self.keys.get(key).and_then(Value::as_f64)
    }

    pub(crate) fn detail(&mut self, key: &str, v: Value) {
        self.details.insert(key.into(), v);
    }

    /// A row of report.md: its scenario, variant and result; ratio, comparison and target
    /// are set on the row returned.
    pub(crate) fn row(&mut self, scenario: &str, variant: &str, value: String) -> &mut Row {
        let i = self.rows.len();
        self.rows.push(Row {
            scenario: scenario.into(),
            variant: variant.into(),
            value,
            ratio: None,
            versus: String::new(),
            target: String::new(),
        });
        &mut self.rows[i]
    }

    pub(crate) fn write(&self, dir: &Path) -> Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let mut all = self.keys.clone();
        all.insert("machine".into(), self.machine.clone());
        all.insert("verdicts".into(), Value::Object(self.verdicts.clone()));
        // Pretty, but each detail on one line: they hold thousands of raw samples.
        let pretty = serde_json::to_string_pretty(&all)?;
        let head = pretty.strip_suffix('}').unwrap_or(&pretty).trim_end();
        let mut details = Vec::new();
        for (k, v) in &self.details {
            details.push(format!(
                "    {}: {}",
                serde_json::to_string(k)?,
                serde_json::to_string(v)?
            ));
        }
        let text = format!("{head},\n  \"details\": {{\n{}\n  }}\n}}\n", details.join(",\n"));
        fs::write(dir.join("report.json"), text)?;
        fs::write(dir.join("report.md"), self.markdown())?;
        Ok(())
    }

    pub(crate) fn machine_line(&self) -> String {
        let m = |k: &str| self.machine[k].as_str().unwrap_or("?").to_owned();
        let (cpus, mem) = (&self.machine["cpus"], &self.machine["mem_gib"]);
        let (model, kernel, nft, ipt) = (m("cpu_model"), m("kernel"), m("nft"), m("iptables"));
        let (start, end) = (m("load"), m("load_end"));
        format!(
            "{cpus} × {model} ({mem} GiB), Linux {kernel}, {nft}, {ipt}; load average {start} at the start, {end} at the end"
        )
    }

    pub(crate) fn markdown(&self) -> String {
        let mut s = format!("Machine: {}\n\n", self.machine_line());
        if self.details["config"]["calibrate"] == true {
            s.push_str(
                "**Calibration run** (`--calibrate`): no variant was in force in any world; \
                 the rows name the worlds' slots, and every comparison should be level.\n\n",
            );
        }
        s.push_str(
            "| scenario | variant | result | ratio to no gate: median [95 % interval] | compared with nftables (gate − nft, per cycle) | target |\n|---|---|---|---|---|---|\n",
        );
        for r in &self.rows {
            let ratio = r.ratio.filter(|x| x.median.is_finite()).map_or(String::new(), |iv| {
                let cov = if iv.confident() {
                    String::new()
                } else {
                    format!(" ({:.0} %, n = {})", iv.coverage * 100.0, iv.n)
                };
                format!("{}{cov}", iv.text())
            });
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                r.scenario, r.variant, r.value, ratio, r.versus, r.target
            ));
        }
        for (what, map) in [
            ("Verdicts (report.json `verdicts`)", &self.verdicts),
            ("Keys (report.json)", &self.keys),
        ] {
            let json = serde_json::to_string_pretty(map).unwrap_or_default();
            s.push_str(&format!("\n{what}:\n\n```json\n{json}\n```\n"));
        }
        s
    }
}

/// `1234567.8` → `1.235 M`.
pub(super) fn si(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    let units = [(1e9, " G"), (1e6, " M"), (1e3, " k")];
    let (d, u) = units.into_iter().find(|(d, _)| v >= *d).unwrap_or((1.0, ""));
    format!("{:.3}{u}", v / d)
}

#[cfg(test)]
mod tests {
    use super::si;

    #[test]
    fn si_prefixes() {
        assert_eq!(si(1_234_567.8), "1.235 M");
        assert_eq!(
            (si(2e9), si(999.0), si(1500.0)),
            ("2.000 G".into(), "999.000".into(), "1.500 k".into())
        );
        assert_eq!(si(f64::NAN), "n/a");
    }
}
