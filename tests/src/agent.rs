//! The gate-agent process under test, with its own bpffs pin dir.
use std::{
    ffi::CString,
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::unix::{ffi::OsStrExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{probe::target_dir, sys::unique};

/// The agent binary: env `GATE_AGENT_BIN`, else `gate-agent` in the same target dir.
pub fn agent_bin() -> Result<PathBuf> {
    let p = std::env::var_os("GATE_AGENT_BIN")
        .map_or_else(|| target_dir().join("gate-agent"), PathBuf::from);
    if !p.exists() {
        bail!(
            "{} missing: build it with `cargo build -p gate-agent` (cargo xtask test does)",
            p.display()
        );
    }
    Ok(p)
}

pub struct Agent {
    child: Option<Child>,
    lines: Arc<Mutex<Vec<String>>>,
    /// Parent of the pin dir; the agent mounts bpffs here.
    pin_root: PathBuf,
    pub pin_dir: PathBuf,
    pub listen: String,
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A unique, empty directory under the temp dir for the agent's bpffs mount.
pub fn new_pin_root() -> Result<PathBuf> {
    let root = std::env::temp_dir().join(unique("mg"));
    fs::create_dir_all(&root)?;
    Ok(root)
}

impl Agent {
    /// Start `gate-agent run` on `policy` gating `cgroup_root`, and wait until it is ready.
    pub fn start(policy: &Path, cgroup_root: &Path) -> Result<Agent> {
        Self::start_with(policy, cgroup_root, &[])
    }

    /// [`Agent::start`] with extra `run` arguments (e.g. `--terminate-established=false`).
    pub fn start_with(policy: &Path, cgroup_root: &Path, extra: &[&str]) -> Result<Agent> {
        let pin_root = new_pin_root()?;
        let pin_dir = pin_root.join("gate");
        let listen = format!("127.0.0.1:{}", free_port()?);
        let mut cmd = Command::new(agent_bin()?);
        cmd.args(["run", "--log-format", "json", "--rescan-ms", "200", "--listen", &listen])
            .arg("--policy")
            .arg(policy)
            .arg("--cgroup-root")
            .arg(cgroup_root)
            .arg("--pin-dir")
            .arg(&pin_dir)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // If the test process dies (SIGKILL, abort), the agent gets SIGTERM instead of
        // running on. It is tied to the spawning thread: an Agent stays on its test's thread.
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().context("spawning gate-agent")?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        for stream in [
            child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if let Ok(mut l) = lines.lock() {
                        l.push(line);
                    }
                }
            });
        }
        let agent = Agent { child: Some(child), lines, pin_root, pin_dir, listen };
        agent.wait_ready(Duration::from_secs(30))?;
        Ok(agent)
    }

    fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let logged = self.find(|v| v["message"] == "ready").is_some();
            if logged && self.http_get("/readyz").is_ok_and(|(code, _)| code == 200) {
                return Ok(());
            }
            if let Some(child) = &self.child
                && std::fs::metadata(format!("/proc/{}", child.id())).is_err()
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("gate-agent not ready; its output:\n{}", self.logs().join("\n"))
    }

    /// GET a path on the agent's --listen address (loopback).
    pub fn http_get(&self, path: &str) -> Result<(u16, String)> {
        let mut s = TcpStream::connect(&self.listen)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut r = String::new();
        s.read_to_string(&mut r)?;
        let code = r.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = r.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Ok((code, body))
    }

    pub fn logs(&self) -> Vec<String> {
        self.lines.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// The first JSON log line satisfying `pred`.
    pub fn find(&self, pred: impl Fn(&serde_json::Value) -> bool) -> Option<serde_json::Value> {
        self.logs().iter().filter_map(|l| serde_json::from_str(l).ok()).find(|v| pred(v))
    }

    /// Wait up to `timeout` for a JSON log line satisfying `pred`.
    pub fn wait_log(
        &self,
        pred: impl Fn(&serde_json::Value) -> bool,
        timeout: Duration,
    ) -> Option<serde_json::Value> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.find(&pred) {
                return Some(v);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stop the agent with SIGTERM (SIGKILL after 5 s). The gate stays pinned.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        if let Ok(bin) = agent_bin() {
            let _ = Command::new(bin).arg("cleanup").arg("--pin-dir").arg(&self.pin_dir).output();
        }
        remove_pin_root(&self.pin_root);
    }
}

/// Unmount the bpffs an agent mounted on `root` (removing what is pinned there), then the dir.
pub fn remove_pin_root(root: &Path) {
    let _ = fs::remove_dir_all(root.join("gate"));
    if let Ok(c) = CString::new(root.as_os_str().as_bytes()) {
        // SAFETY: valid path; fails harmlessly when nothing is mounted.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
    let _ = fs::remove_dir_all(root);
}

/// Run gate-agent with `args` to completion (for bad-input tests), with a timeout.
pub fn run_to_end(args: &[&str], timeout: Duration) -> Result<Output> {
    let mut child = Command::new(agent_bin()?)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if child.try_wait()?.is_some() {
            return Ok(child.wait_with_output()?);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output()?;
    bail!(
        "gate-agent {args:?} still running after {timeout:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    )
}
