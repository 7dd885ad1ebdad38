//! The gate-agent process under test, with its own bpffs pin dir.
use std::{
    ffi::CString,
    fs,
    io::{BufRead as _, BufReader, Read, Write as _},
    net::{TcpListener, TcpStream},
    os::unix::{ffi::OsStrExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    bins::Bins,
    sys::{exec_in_netns, in_netns, unique},
};

/// A command running the agent binary `bin`, which must exist.
fn agent_command(bin: &Path) -> Result<Command> {
    if !bin.exists() {
        bail!(
            "{} missing: build it with `cargo build -p gate-agent` (cargo xtask test does)",
            bin.display()
        );
    }
    Ok(Command::new(bin))
}

pub struct Agent {
    /// The gate-agent binary.
    bin: PathBuf,
    child: Option<Child>,
    lines: Arc<Mutex<Vec<String>>>,
    /// Parent of the pin dir; the agent mounts bpffs here.
    pin_root: PathBuf,
    pub pin_dir: PathBuf,
    /// `--listen`, inside [`netns`](Self::netns).
    pub listen: String,
    /// The test netns the agent runs in (`/run/netns/mg-…`), as a DaemonSet pod with
    /// hostNetwork runs in the node's: its node-level programs go on that namespace's
    /// interfaces, never the host's.
    pub netns: String,
    /// What selects the mode: `--policy P --cgroup-root R`, or cluster-mode flags.
    mode_args: Vec<std::ffi::OsString>,
    /// The harness's own flags (`--log-format json --rescan-ms 200`); off: every flag but
    /// the mode, the pin dir and `--listen` at its shipped default.
    harness_flags: bool,
    /// A test cgroup the agent runs in (from before its first instruction), as a DaemonSet's
    /// container has its own: where the metadata proxy's sock_ops program goes.
    cgroup: Option<PathBuf>,
}

pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A unique, empty directory under the temp dir for the agent's bpffs mount.
pub fn new_pin_root() -> Result<PathBuf> {
    let root = std::env::temp_dir().join(unique("mg"));
    fs::create_dir_all(&root)?;
    Ok(root)
}

impl Agent {
    /// Start `gate-agent run` in the test netns `netns` on `policy` gating `cgroup_root`, and
    /// wait until it is ready.
    pub fn start(bins: &Bins, netns: &str, policy: &Path, cgroup_root: &Path) -> Result<Agent> {
        Self::start_with(bins, netns, policy, cgroup_root, &[])
    }

    /// [`start`](Self::start) with extra `run` arguments.
    pub fn start_with(
        bins: &Bins,
        netns: &str,
        policy: &Path,
        cgroup_root: &Path,
        extra: &[&str],
    ) -> Result<Agent> {
        let mode =
            vec!["--policy".into(), policy.into(), "--cgroup-root".into(), cgroup_root.into()];
        Self::start_mode(bins, netns, mode, false, extra)
    }

    /// [`start`](Self::start) as shipped: no flag but the policy, the gated root, the pin dir
    /// and `--listen` (text logs, the default rescan period, node-level enforcement on). What
    /// the benchmark measures.
    pub fn start_shipped(
        bins: &Bins,
        netns: &str,
        policy: &Path,
        cgroup_root: &Path,
    ) -> Result<Agent> {
        let mode =
            vec!["--policy".into(), policy.into(), "--cgroup-root".into(), cgroup_root.into()];
        Self::start_full(bins, netns, mode, false, &[], false)
    }

    /// Cluster mode: `run` with these flags (kubeconfig, node name, …) and no --policy. The
    /// harness mounts bpffs on the pin root first, as the DaemonSet's host mount does (an agent
    /// in cluster mode never mounts it itself).
    pub fn start_cluster(bins: &Bins, netns: &str, flags: &[&str]) -> Result<Agent> {
        Self::start_mode(bins, netns, flags.iter().map(Into::into).collect(), true, &[])
    }

    fn start_mode(
        bins: &Bins,
        netns: &str,
        mode_args: Vec<std::ffi::OsString>,
        mount: bool,
        extra: &[&str],
    ) -> Result<Agent> {
        Self::start_full(bins, netns, mode_args, mount, extra, true)
    }

    fn start_full(
        bins: &Bins,
        netns: &str,
        mode_args: Vec<std::ffi::OsString>,
        mount: bool,
        extra: &[&str],
        harness_flags: bool,
    ) -> Result<Agent> {
        Self::start_in(bins, netns, new_pin_root()?, mode_args, mount, extra, harness_flags, None)
    }

    /// [`start_cluster`](Self::start_cluster), the agent running in the test cgroup `cgroup`
    /// (as the DaemonSet's pod runs under kubepods).
    pub fn start_cluster_in_cgroup(
        bins: &Bins,
        netns: &str,
        flags: &[&str],
        cgroup: &Path,
    ) -> Result<Agent> {
        let mode_args = flags.iter().map(Into::into).collect();
        Self::start_in(bins, netns, new_pin_root()?, mode_args, true, &[], true, Some(cgroup))
    }

    #[allow(clippy::too_many_arguments)]
    fn start_in(
        bins: &Bins,
        netns: &str,
        pin_root: PathBuf,
        mode_args: Vec<std::ffi::OsString>,
        mount: bool,
        extra: &[&str],
        harness_flags: bool,
        cgroup: Option<&Path>,
    ) -> Result<Agent> {
        if mount {
            crate::sys::sh("mount", &["-t", "bpf", "bpffs", &pin_root.to_string_lossy()])?;
        }
        let mut agent = Agent {
            bin: bins.agent.clone(),
            child: None,
            lines: Arc::new(Mutex::new(Vec::new())),
            pin_dir: pin_root.join("gate"),
            pin_root,
            listen: format!("127.0.0.1:{}", free_port()?),
            netns: netns.to_owned(),
            mode_args,
            harness_flags,
            cgroup: cgroup.map(Path::to_path_buf),
        };
        agent.spawn(extra)?;
        agent.wait_ready(crate::sys::slow(Duration::from_secs(30)))?;
        Ok(agent)
    }

    /// Start a new agent process on the same pin dir (after [`stop`](Self::stop) or
    /// [`kill`](Self::kill)), with fresh logs, and wait until it is ready.
    pub fn restart_with(&mut self, extra: &[&str]) -> Result<()> {
        self.stop();
        self.spawn(extra)?;
        self.wait_ready(crate::sys::slow(Duration::from_secs(30)))
    }

    /// [`start_with`](Self::start_with), the agent running in the test cgroup `cgroup`.
    pub fn start_in_cgroup(
        bins: &Bins,
        netns: &str,
        policy: &Path,
        cgroup_root: &Path,
        cgroup: &Path,
        extra: &[&str],
    ) -> Result<Agent> {
        let mut agent = Agent {
            bin: bins.agent.clone(),
            child: None,
            lines: Arc::new(Mutex::new(Vec::new())),
            pin_root: new_pin_root()?,
            pin_dir: PathBuf::new(),
            listen: format!("127.0.0.1:{}", free_port()?),
            netns: netns.to_owned(),
            mode_args: vec![
                "--policy".into(),
                policy.into(),
                "--cgroup-root".into(),
                cgroup_root.into(),
            ],
            harness_flags: true,
            cgroup: Some(cgroup.to_path_buf()),
        };
        agent.pin_dir = agent.pin_root.join("gate");
        agent.spawn(extra)?;
        agent.wait_ready(crate::sys::slow(Duration::from_secs(30)))?;
        Ok(agent)
    }

    fn spawn(&mut self, extra: &[&str]) -> Result<()> {
        let mut cmd = agent_command(&self.bin)?;
        cmd.arg("run");
        if self.harness_flags {
            cmd.args(["--log-format", "json"]);
            // A short rescan unless the test sets its own.
            if !extra.contains(&"--rescan-ms") {
                cmd.args(["--rescan-ms", "200"]);
            }
        }
        // A test's own `--listen` (on every address, as the DaemonSet's) replaces the harness's
        // loopback one; the harness asks it on loopback at the same port.
        match extra.iter().position(|a| *a == "--listen").and_then(|i| extra.get(i + 1)) {
            Some(own) => {
                let port = own.rsplit(':').next().unwrap_or_default();
                self.listen = format!("127.0.0.1:{port}");
            }
            None => {
                cmd.args(["--listen", &self.listen]);
            }
        }
        cmd.args(&self.mode_args)
            .arg("--pin-dir")
            .arg(&self.pin_dir)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        exec_in_netns(&mut cmd, &self.netns)?;
        // If the test process dies (SIGKILL, abort), the agent gets SIGTERM instead of
        // running on. It is tied to the spawning thread: an Agent stays on its test's thread.
        // Built before the fork: the child may only make async-signal-safe calls.
        let procs = match &self.cgroup {
            Some(cg) => Some(std::ffi::CString::new(
                cg.join("cgroup.procs").into_os_string().into_encoded_bytes(),
            )?),
            None => None,
        };
        // SAFETY: prctl, open, write and close are async-signal-safe; nothing else runs
        // between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(procs) = &procs {
                    let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                    let written = fd >= 0 && libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                    if fd >= 0 {
                        libc::close(fd);
                    }
                    if !written {
                        return Err(std::io::Error::last_os_error());
                    }
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
        self.lines = lines;
        self.child = Some(child);
        Ok(())
    }

    /// The agent's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL the agent (no chance to clean up anything) and reap it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Send a signal to the running agent.
    pub fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(pid as i32, sig) };
        }
    }

    /// `gate-agent status --json` on this agent's pin dir: (exit code, parsed output).
    pub fn status(&self) -> Result<(i32, serde_json::Value)> {
        let pin = self.pin_dir.to_string_lossy().into_owned();
        let out = run_to_end(
            &self.bin,
            &self.netns,
            &["status", "--json", "--pin-dir", &pin],
            Duration::from_secs(10),
        )?;
        let v = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("status output: {}", String::from_utf8_lossy(&out.stdout)))?;
        Ok((out.status.code().unwrap_or(-1), v))
    }

    fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            // Text logs (as shipped) are not parsed: /readyz alone says it.
            let logged = !self.harness_flags || self.find(|v| v["message"] == "ready").is_some();
            if logged && self.http_get("/readyz").is_ok_and(|(code, _)| code == 200) {
                return Ok(());
            }
            if let Some(child) = &self.child
                && !crate::sys::pid_running(child.id())
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("gate-agent not ready; its output:\n{}", self.logs().join("\n"))
    }

    /// GET a path on the agent's --listen address (loopback of its netns).
    pub fn http_get(&self, path: &str) -> Result<(u16, String)> {
        self.http_get_at(&self.listen, path)
    }

    /// GET a path on another address of the agent's netns (e.g. its --metrics-listen).
    pub fn http_get_at(&self, addr: &str, path: &str) -> Result<(u16, String)> {
        let r = in_netns(&self.netns, || {
            let mut s = TcpStream::connect(addr)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
            let mut r = String::new();
            s.read_to_string(&mut r)?;
            Ok(r)
        })?;
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

    /// Wait up to `timeout` (stretched by [`crate::sys::slow`]) for a JSON log line
    /// satisfying `pred`.
    pub fn wait_log(
        &self,
        pred: impl Fn(&serde_json::Value) -> bool,
        timeout: Duration,
    ) -> Option<serde_json::Value> {
        let deadline = Instant::now() + crate::sys::slow(timeout);
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
        if let Ok(mut cmd) = agent_command(&self.bin) {
            cmd.arg("cleanup").arg("--pin-dir").arg(&self.pin_dir);
            if exec_in_netns(&mut cmd, &self.netns).is_ok() {
                let _ = cmd.output();
            }
        }
        remove_pin_root(&self.pin_root);
    }
}

/// The boot script as shipped (deploy/boot/metadata-gate-boot.sh), built into the tests so
/// that they run it in the kernel VMs too.
const BOOT_SCRIPT: &str = include_str!("../../deploy/boot/metadata-gate-boot.sh");

/// A node right after the boot step (`deploy/boot/metadata-gate-boot.sh`, as systemd runs it
/// before the kubelet): a pinned gate, no agent. Its pins are removed on drop, unless an
/// agent took them over ([`BootStep::into_agent`]).
pub struct BootStep {
    bins: Bins,
    netns: String,
    pin_root: Option<PathBuf>,
    pub pin_dir: PathBuf,
    files: Vec<PathBuf>,
    /// The script's output and exit status.
    pub output: Output,
    /// podman's arguments, where the script ran the agent's image (no kept binary).
    pub podman_args: Option<String>,
}

/// How the boot step is asked to run.
pub struct BootSettings<'a> {
    pub state_dir: &'a Path,
    pub cgroup_root: &'a Path,
    /// `METADATA_GATE_POLICY` (installed policy file), if any.
    pub policy: Option<&'a Path>,
    /// `METADATA_GATE_PLATFORM`.
    pub platform: Option<&'a str>,
    /// `METADATA_GATE_BOOT_FAIL_OPEN=true`.
    pub fail_open: bool,
}

impl BootStep {
    /// Run the boot script in `netns` (the node's). `METADATA_GATE_IMAGE` names an image whose
    /// `podman run` a stand-in performs with this build's binary: where the state dir keeps
    /// no binary (a first boot), the script's podman path is the one exercised.
    pub fn run(bins: &Bins, netns: &str, s: &BootSettings<'_>) -> Result<BootStep> {
        let pin_root = new_pin_root()?;
        let tmp = std::env::temp_dir();
        let script = tmp.join(unique("mg-boot.sh"));
        let podman = tmp.join(unique("mg-podman"));
        let args_file = PathBuf::from(format!("{}.args", podman.display()));
        fs::write(&script, BOOT_SCRIPT)?;
        // Stands in for podman: records its arguments and runs the image's entrypoint (this
        // build's gate-agent) with the arguments after the image, as podman would.
        fs::write(
            &podman,
            "#!/bin/sh\necho \"$@\" > \"$0.args\"\n\
             while [ \"$#\" -gt 0 ] && [ \"$1\" != \"$MG_TEST_IMAGE\" ]; do shift; done\n\
             shift\nexec \"$MG_TEST_AGENT\" \"$@\"\n",
        )?;
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(&podman, fs::Permissions::from_mode(0o755))?;
        let mut cmd = Command::new("bash");
        cmd.arg(&script)
            .env("METADATA_GATE_STATE_DIR", s.state_dir)
            .env("METADATA_GATE_PIN_DIR", pin_root.join("gate"))
            .env("METADATA_GATE_CGROUP_ROOT", s.cgroup_root)
            .env("METADATA_GATE_POLICY", s.policy.unwrap_or(Path::new("/nonexistent/policy.yaml")))
            .env("METADATA_GATE_IMAGE", "registry.example/metadata-gate:test")
            .env("METADATA_GATE_PODMAN", &podman)
            .env("MG_TEST_IMAGE", "registry.example/metadata-gate:test")
            .env("MG_TEST_AGENT", &bins.agent);
        if let Some(p) = s.platform {
            cmd.env("METADATA_GATE_PLATFORM", p);
        }
        if s.fail_open {
            cmd.env("METADATA_GATE_BOOT_FAIL_OPEN", "true");
        }
        let output = command_to_end(cmd, netns, Duration::from_secs(60));
        let podman_args = fs::read_to_string(&args_file).ok();
        let mut step = BootStep {
            bins: bins.clone(),
            netns: netns.to_owned(),
            pin_dir: pin_root.join("gate"),
            pin_root: Some(pin_root),
            files: vec![script, podman, args_file],
            output: Output {
                status: std::process::ExitStatus::default(),
                stdout: vec![],
                stderr: vec![],
            },
            podman_args,
        };
        // On an error, the step is dropped: its pins are removed.
        step.output = output?;
        Ok(step)
    }

    /// Start the agent (cluster-mode `flags`) on this gate: it adopts it, and owns the pins.
    pub fn into_agent(mut self, flags: &[&str]) -> Result<Agent> {
        let root = self.pin_root.take().context("pins already handed over")?;
        let mode = flags.iter().map(Into::into).collect();
        Agent::start_in(&self.bins, &self.netns, root, mode, false, &[], true, None)
    }
}

impl Drop for BootStep {
    fn drop(&mut self) {
        for f in &self.files {
            let _ = fs::remove_file(f);
        }
        let Some(root) = self.pin_root.take() else { return };
        if let Ok(mut cmd) = agent_command(&self.bins.agent) {
            cmd.arg("cleanup").arg("--pin-dir").arg(&self.pin_dir);
            if exec_in_netns(&mut cmd, &self.netns).is_ok() {
                let _ = cmd.output();
            }
        }
        remove_pin_root(&root);
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

/// Run the gate-agent binary `bin` with `args` to completion in the test netns `netns`, with
/// a timeout (stretched by [`crate::sys::slow`]).
/// The value of the first line of a Prometheus text body that starts with `prefix` (a
/// name, with its labels for a labelled sample).
pub fn metric(body: &str, prefix: &str) -> Option<f64> {
    body.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Where each thread of `pid` waits in the kernel (its `wchan` and `stack`): what a hung
/// command was doing.
fn kernel_stacks(pid: u32) -> String {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return String::new() };
    let mut out = String::new();
    for t in tasks.flatten() {
        let p = t.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        out.push_str(&format!(
            "{} {} wchan={}\n{}",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan"),
            read("stack")
        ));
    }
    out
}

/// Run gate-agent with `args` in `netns` to its end, within `timeout` (stretched by
/// `GATE_TEST_SLOWDOWN`). Its output is read while it runs: a command that writes more than a
/// pipe holds (a verifier log in a warning) would otherwise block on the full pipe.
pub fn run_to_end(bin: &Path, netns: &str, args: &[&str], timeout: Duration) -> Result<Output> {
    let mut cmd = agent_command(bin)?;
    cmd.args(args);
    command_to_end(cmd, netns, timeout)
}

/// Run `cmd` in `netns` to its end (killed after `timeout`): the boot script, say.
pub fn command_to_end(mut cmd: Command, netns: &str, timeout: Duration) -> Result<Output> {
    let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    exec_in_netns(&mut cmd, netns)?;
    let mut child = cmd.spawn()?;
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(child.stdout.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let deadline = Instant::now() + crate::sys::slow(timeout);
    let mut status = None;
    while Instant::now() < deadline {
        status = child.try_wait()?;
        if status.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let stacks = if status.is_none() { kernel_stacks(child.id()) } else { String::new() };
    if status.is_none() {
        let _ = child.kill();
    }
    let status = child.wait()?;
    let out = Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    };
    if stacks.is_empty() {
        return Ok(out);
    }
    bail!(
        "{:?} {args:?} still running after {timeout:?}: {}\nwhere its threads wait:\n{stacks}",
        cmd.get_program(),
        String::from_utf8_lossy(&out.stderr)
    )
}
