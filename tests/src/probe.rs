//! Running the `probe` binary as a workload in a cgroup of the node netns.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::Path,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
};

use anyhow::{Context as _, Result, anyhow};
use serde::{Deserialize, de::DeserializeOwned};

use crate::{bins::Bins, net::TestNet};

/// One probe result.
#[derive(Clone, Debug, Deserialize)]
pub struct Outcome {
    pub ok: bool,
    pub errno: Option<i32>,
    pub stage: String,
    pub elapsed_us: u64,
    pub reply: Option<String>,
}

/// `bin <args>` as a workload (`probe`, the bench's `bench-probe`): it enters the test netns
/// at `netns_path` and `cgroup` itself, before it does anything else.
pub fn workload(bin: &Path, netns_path: &str, cgroup: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(bin);
    c.arg("--netns").arg(netns_path).arg("--cgroup").arg(cgroup).args(args);
    c
}

/// Run `probe <args>` in `cgroup` and the node netns and return its result.
pub fn run(bins: &Bins, net: &TestNet, cgroup: &Path, args: &[&str]) -> Result<Outcome> {
    net.assert_routes()?;
    run_in(bins, &net.node_path(), cgroup, args)
}

/// Run `probe <args>` in another test netns (`path` under /run/netns) and `cgroup`.
pub fn run_in(bins: &Bins, netns_path: &str, cgroup: &Path, args: &[&str]) -> Result<Outcome> {
    if !netns_path.starts_with("/run/netns/mg-") {
        return Err(anyhow!("{netns_path} is not a test network namespace"));
    }
    let out = workload(&bins.probe, netns_path, cgroup, args)
        .output()
        .with_context(|| format!("running {}", bins.probe.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().ok_or_else(|| {
        anyhow!("probe {args:?} printed nothing; stderr: {}", String::from_utf8_lossy(&out.stderr))
    })?;
    serde_json::from_str(line).with_context(|| format!("probe output {line:?}"))
}

/// A workload process with piped stdin and stdout that answers a JSON line at a time
/// (`probe hold-*`, the bench's `bench-probe flip` and `bench-probe serve`); killed on drop.
pub struct Piped {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    what: &'static str,
}

impl Piped {
    /// Spawn `command` (a [`workload`]) with its stdin and stdout piped; `what` names it in
    /// errors.
    pub fn spawn(mut command: Command, what: &'static str) -> Result<Piped> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("spawning {what}"))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?);
        Ok(Piped { child, stdin, stdout, what })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next line of output, parsed.
    pub fn read_json<T: DeserializeOwned>(&mut self) -> Result<T> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        serde_json::from_str(line.trim()).with_context(|| format!("{} output {line:?}", self.what))
    }

    /// Write `line` to its stdin; `last` closes stdin after it.
    pub fn send(&mut self, line: &str, last: bool) -> Result<()> {
        let stdin = self.stdin.as_mut().ok_or_else(|| anyhow!("{} stdin closed", self.what))?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        if last {
            drop(self.stdin.take());
        }
        Ok(())
    }
}

impl Drop for Piped {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A probe that connected and waits for its token (`hold-tcp` / `hold-udp`).
pub struct Held(Piped);

impl Held {
    pub fn start(bins: &Bins, net: &TestNet, cgroup: &Path, args: &[&str]) -> Result<Held> {
        net.assert_routes()?;
        Self::start_in(bins, &net.node_path(), cgroup, args)
    }

    /// [`start`](Self::start) in another test netns (`/run/netns/mg-…`: a pod's).
    pub fn start_in(bins: &Bins, netns_path: &str, cgroup: &Path, args: &[&str]) -> Result<Held> {
        Self::try_start_in(bins, netns_path, cgroup, args)?
            .map_err(|first| anyhow!("hold probe did not connect: {first:?}"))
    }

    /// [`start_in`](Self::start_in) for a probe that may be denied before it holds
    /// anything: the denial is the inner error.
    pub fn try_start_in(
        bins: &Bins,
        netns_path: &str,
        cgroup: &Path,
        args: &[&str],
    ) -> Result<Result<Held, Outcome>> {
        if !crate::sys::is_test_netns(netns_path) {
            return Err(anyhow!("{netns_path} is not a test network namespace"));
        }
        Self::spawn(workload(&bins.probe, netns_path, cgroup, args))
    }

    /// A hold probe started by `command` however it reaches its namespace (`kubectl exec -i`
    /// into a pod): held once it says it connected, its first answer otherwise.
    pub(crate) fn spawn(command: Command) -> Result<Result<Held, Outcome>> {
        let mut p = Piped::spawn(command, "probe")?;
        let first: Outcome = p.read_json()?;
        Ok(if first.stage == "connected" { Ok(Held(p)) } else { Err(first) })
    }

    /// The probe's process id.
    pub fn pid(&self) -> u32 {
        self.0.pid()
    }

    /// Send the token over the held connection and return the result.
    pub fn send(mut self, token: &str) -> Result<Outcome> {
        self.0.send(token, true)?;
        self.0.read_json()
    }
}

/// A fresh token for one probe. It ends in `.end`, so no token is a substring of another
/// (`…-4.end` is not inside `…-45.end`).
pub fn token(tag: &str) -> String {
    format!("tok-{tag}-{}.end", crate::sys::unique("t"))
}
