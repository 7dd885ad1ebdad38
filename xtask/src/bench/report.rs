//! report.json (flat numeric keys + details), the markdown table and the machine description.
use std::{fs, path::Path};

use anyhow::{Context as _, Result};
use serde_json::{Map, Value, json};

use super::Cfg;

pub(super) struct Row {
    pub scenario: String,
    pub variant: String,
    pub value: String,
    pub ratio: Option<f64>,
    pub target: String,
}

pub(crate) struct Report {
    keys: Map<String, Value>,
    details: Map<String, Value>,
    rows: Vec<Row>,
    machine: Value,
}

fn first_line(cmd: &str, args: &[&str]) -> String {
    crate::util::output(std::process::Command::new(cmd).args(args))
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
    json!({
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
        let mut r =
            Report { keys: Map::new(), details: Map::new(), rows: vec![], machine: machine() };
        r.detail(
            "config",
            json!({"quick": cfg.quick, "secs": cfg.secs, "rounds": cfg.rounds,
                   "deny_n": cfg.deny_n, "drop_n": cfg.drop_n,
                   "drop_timeout_ms": cfg.drop_timeout_ms, "changes": cfg.changes}),
        );
        r
    }

    /// The numeric keys of a written report.json (to redraw its chart).
    pub(crate) fn load(path: &Path) -> Result<Report> {
        let text = fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let v: Value =
            serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
        let mut keys = v.as_object().cloned().unwrap_or_default();
        keys.retain(|_, v| v.is_number() || v.is_null());
        Ok(Report { keys, details: Map::new(), rows: vec![], machine: v["machine"].clone() })
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

    pub(crate) fn row(
        &mut self,
        scenario: &str,
        variant: &str,
        value: String,
        ratio: Option<f64>,
        target: &str,
    ) {
        self.rows.push(Row {
            scenario: scenario.into(),
            variant: variant.into(),
            value,
            ratio,
            target: target.into(),
        });
    }

    pub(crate) fn write(&self, dir: &Path) -> Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let mut all = self.keys.clone();
        all.insert("machine".into(), self.machine.clone());
        all.insert("details".into(), Value::Object(self.details.clone()));
        fs::write(dir.join("report.json"), serde_json::to_string_pretty(&all)? + "\n")?;
        fs::write(dir.join("report.md"), self.markdown())?;
        Ok(())
    }

    pub(crate) fn machine_line(&self) -> String {
        let m = &self.machine;
        format!(
            "{} × {} ({} GiB), Linux {}, {}, {}",
            m["cpus"],
            m["cpu_model"].as_str().unwrap_or("?"),
            m["mem_gib"],
            m["kernel"].as_str().unwrap_or("?"),
            m["nft"].as_str().unwrap_or("?"),
            m["iptables"].as_str().unwrap_or("?")
        )
    }

    pub(crate) fn markdown(&self) -> String {
        let mut s = format!("Machine: {}\n\n", self.machine_line());
        s.push_str(
            "| scenario | variant | result | ratio to no gate | target |\n|---|---|---|---|---|\n",
        );
        for r in &self.rows {
            let ratio = r.ratio.filter(|x| x.is_finite()).map_or("".into(), |x| format!("{x:.3}"));
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                r.scenario, r.variant, r.value, ratio, r.target
            ));
        }
        s.push_str("\nKeys (report.json):\n\n```json\n");
        s.push_str(
            &serde_json::to_string_pretty(&Value::Object(self.keys.clone())).unwrap_or_default(),
        );
        s.push_str("\n```\n");
        s
    }
}

/// `1234567.8` → `1.23 M`.
pub(super) fn si(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    let (d, u) = if v >= 1e9 {
        (1e9, " G")
    } else if v >= 1e6 {
        (1e6, " M")
    } else if v >= 1e3 {
        (1e3, " k")
    } else {
        (1.0, " ")
    };
    format!("{:.3}{u}", v / d).trim_end().to_string()
}
