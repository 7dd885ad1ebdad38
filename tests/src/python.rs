//! The clouds' Python SDKs as workloads: the scripts of `tests/python/`, run with the pinned
//! SDKs of `tests/python/requirements.txt`, which `cargo xtask setup` (and `cargo xtask test`)
//! installs under `target/python-sdk` (`pip install --target`, nothing system-wide).
//!
//! A script runs as `probe --netns … --cgroup … exec python3 …`: the probe joins the cgroup
//! and enters the test netns, then becomes Python, so no line of Python runs elsewhere. The
//! environment is cleared: no proxy settings, no cloud credentials or config files from the
//! machine (HOME is a directory of the test's own).
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::Deserialize;

use crate::{bins::Bins, net::TestNet, probe::workload, sys::is_test_netns};

/// Names the install directory for a test process (`cargo xtask test` sets it).
pub const DIR_VAR: &str = "PYTHON_SDK_DIR";
/// The pins; the install directory keeps a copy of the file it was installed from.
pub const REQUIREMENTS: &str = include_str!("../python/requirements.txt");
/// That copy, in the install directory.
pub const STAMP: &str = ".requirements.txt";

/// The scripts' directory (`tests/python`).
pub fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python")
}

/// Where the SDKs are installed: `$PYTHON_SDK_DIR`, else `python-sdk` in the target
/// directory of the running executable (tests run from `target/<profile>/deps`).
pub fn dir() -> PathBuf {
    if let Some(d) = std::env::var_os(DIR_VAR) {
        return d.into();
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let target = exe.ancestors().find(|a| a.join("python-sdk").is_dir());
    target.map_or_else(|| PathBuf::from("target/python-sdk"), |t| t.join("python-sdk"))
}

/// Why the SDKs cannot be used from `dir`, if they cannot.
pub fn missing(dir: &Path) -> Option<String> {
    match std::fs::read_to_string(dir.join(STAMP)) {
        Ok(s) if s == REQUIREMENTS => None,
        Ok(_) => {
            Some(format!("{} holds other pins than tests/python/requirements.txt", dir.display()))
        }
        Err(_) => Some(format!("no Python SDKs installed in {}", dir.display())),
    }
}

/// One operation of a script (see `tests/python/sdk_common.py`).
#[derive(Clone, Debug, Deserialize)]
pub struct Op {
    /// What every request of the operation carries (User-Agent or X-Probe-Token).
    pub token: String,
    /// What the SDK returned (a string, a bool), `null` for nothing.
    pub value: serde_json::Value,
    /// What it raised.
    pub error: Option<String>,
    /// Each HTTP request the SDK sent: method, target, status (`null`: no response).
    pub requests: Vec<(String, String, Option<u16>)>,
    pub elapsed_ms: f64,
}

impl Op {
    /// The value as text (`None` for `null`).
    pub fn text(&self) -> Option<&str> {
        self.value.as_str()
    }

    /// The statuses the SDK saw, in order.
    pub fn statuses(&self) -> Vec<Option<u16>> {
        self.requests.iter().map(|r| r.2).collect()
    }
}

/// What a script printed.
#[derive(Clone, Debug, Deserialize)]
pub struct Report {
    pub sdk: String,
    pub ops: std::collections::BTreeMap<String, Op>,
}

impl Report {
    pub fn op(&self, name: &str) -> &Op {
        self.ops.get(name).unwrap_or_else(|| panic!("{} ran no {name}: {self:?}", self.sdk))
    }
}

/// `python3 tests/python/<script> <prefix> [ops…]` as a workload in `cgroup` of the node
/// netns, with the SDKs of `sdk` and `env` on a cleared environment; HOME is `home`.
pub struct Script<'a> {
    pub bins: &'a Bins,
    pub net: &'a TestNet,
    pub sdk: &'a Path,
    pub home: &'a Path,
}

impl Script<'_> {
    pub fn run(
        &self,
        cgroup: &Path,
        script: &str,
        prefix: &str,
        ops: &[&str],
        env: &[(&str, &str)],
    ) -> Result<(Report, std::time::Duration)> {
        self.net.assert_routes()?;
        let netns = self.net.node_path();
        if !is_test_netns(&netns) {
            bail!("{netns} is not a test network namespace");
        }
        let path = scripts().join(script);
        let (path, sdk) = (path.to_string_lossy(), self.sdk.to_string_lossy());
        let mut args = vec!["exec", "python3", "-s", &path, prefix];
        args.extend_from_slice(ops);
        let mut cmd: Command = workload(&self.bins.probe, &netns, cgroup, &args);
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
            .env("HOME", self.home)
            .env("PYTHONPATH", format!("{sdk}:{}", scripts().display()))
            .env("PYTHONNOUSERSITE", "1")
            // Bytecode goes with the SDKs, never into the source tree.
            .env("PYTHONPYCACHEPREFIX", self.sdk.join("pycache"))
            .envs(env.iter().copied());
        let started = Instant::now();
        let out = cmd.output().with_context(|| format!("running {script}"))?;
        let took = started.elapsed();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            bail!("{script} {ops:?}: {}\n{stdout}{stderr}", out.status);
        }
        let line =
            stdout.lines().last().ok_or_else(|| anyhow!("{script} printed nothing: {stderr}"))?;
        let report =
            serde_json::from_str(line).with_context(|| format!("{script}: {line}\n{stderr}"))?;
        Ok((report, took))
    }
}
