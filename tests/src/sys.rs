//! Small system helpers: privilege checks, unique names, commands, stale-leftover sweeping.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{Context as _, Result, bail};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A name unique to this process and call: `mg-<pid>-<n>`.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed))
}

pub fn is_root() -> bool {
    // SAFETY: no preconditions.
    unsafe { libc::geteuid() == 0 }
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The cgroup2 mount point, from /proc/self/mountinfo (hybrid layouts put it elsewhere than
/// /sys/fs/cgroup).
pub fn cgroup2_mount() -> Result<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo")?;
    for line in info.lines() {
        let Some((pre, post)) = line.split_once(" - ") else { continue };
        if post.split_whitespace().next() == Some("cgroup2")
            && let Some(mp) = pre.split_whitespace().nth(4)
        {
            return Ok(PathBuf::from(mp.replace("\\040", " ")));
        }
    }
    bail!("no cgroup2 mount in /proc/self/mountinfo")
}

/// Why the privileged tests cannot run here, if they cannot.
pub fn missing_privileges() -> Option<String> {
    if !is_root() {
        return Some("needs root".into());
    }
    if cgroup2_mount().is_err() {
        return Some("needs a cgroup2 mount".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("needs iproute2 (`ip`)".into());
    }
    None
}

/// Gate for privileged tests: true if they can run. Under CI=true a missing privilege is a
/// failure (panic), never a skip.
pub fn require_privileges(test: &str) -> bool {
    match missing_privileges() {
        None => {
            sweep_stale();
            true
        }
        Some(why) if in_ci() => panic!("{test}: {why}, and CI=true forbids skipping"),
        Some(why) => {
            eprintln!("{test}: SKIPPED ({why})");
            false
        }
    }
}

/// Run a command, failing with its stderr.
pub fn sh(program: &str, args: &[&str]) -> Result<String> {
    let out =
        Command::new(program).args(args).output().with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `pid` exists and has not exited: an exited child that nobody reaped yet (a zombie,
/// state `Z`) still has its /proc entry.
pub fn pid_running(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) != Some("Z")
    })
}

/// `GATE_TEST_LSM`: how the kernel under test must run the agent's LSM programs, where the
/// runner knows it (`cargo xtask test-kernels` sets it per kernel): `lsm` (the BPF LSM),
/// `fmod_ret` (BPF trampolines, no BPF LSM) or `open` (neither). Unset: the kernel decides,
/// and the test says what it saw.
pub fn expected_lsm() -> Option<String> {
    std::env::var("GATE_TEST_LSM").ok().filter(|v| !v.is_empty())
}

/// How `status` says the LSM programs run: `lsm`, `fmod_ret` or `open`.
pub fn lsm_mechanism(status_lsm: &str) -> &'static str {
    match status_lsm {
        "enforcing" => "lsm",
        l if l.starts_with("enforcing") && l.contains("fmod_ret") => "fmod_ret",
        _ => "open",
    }
}

/// `GATE_TEST_SLOWDOWN`: how many times slower than a native run this machine is (an emulated
/// VM: `cargo xtask test-kernels` sets it). Default 1.
pub fn slowdown() -> u32 {
    std::env::var("GATE_TEST_SLOWDOWN").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1)
}

/// A bound on waiting for something to happen (never a speed assertion), stretched by
/// [`slowdown`].
pub fn slow(wait: std::time::Duration) -> std::time::Duration {
    wait * slowdown()
}

/// The running kernel's `major.minor` (from /proc/sys/kernel/osrelease).
pub fn kernel_version() -> (u32, u32) {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release.trim().split(['.', '-']).map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// Whether the kernel has tcx (6.6+): where it has not, `--tc-mode auto` attaches tc programs
/// as clsact filters instead of tcx links (as documented).
pub fn kernel_has_tcx() -> bool {
    kernel_version() >= (6, 6)
}

/// The pid in a name `mg-<pid>-…` or `mg-test-<pid>-…`.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("mg-")?;
    let rest = rest.strip_prefix("test-").unwrap_or(rest);
    rest.split('-').next()?.parse().ok()
}

/// Remove netns, cgroups and pin dirs left by test processes that no longer exist.
pub fn sweep_stale() {
    if let Ok(list) = sh("ip", &["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if owner_pid(name).is_some_and(|p| !pid_alive(p)) {
                let _ = sh("ip", &["netns", "del", name]);
            }
        }
    }
    if let Ok(cg) = cgroup2_mount()
        && let Ok(rd) = fs::read_dir(&cg)
    {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("mg-test-") && owner_pid(&name).is_some_and(|p| !pid_alive(p)) {
                crate::cgroups::remove_tree(&e.path());
            }
        }
    }
    if let Ok(rd) = fs::read_dir(std::env::temp_dir()) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("mg-") && owner_pid(&name).is_some_and(|p| !pid_alive(p)) {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    crate::agent::remove_pin_root(&e.path());
                } else {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
    }
}

/// Whether `path` names a test network namespace (`/run/netns/mg-…`): the only namespaces a
/// harness process enters, so nothing of a test ever runs in the host's own.
pub fn is_test_netns(path: &str) -> bool {
    path.starts_with("/run/netns/mg-")
}

/// Move the calling thread into the network namespace at `path`.
pub fn enter_netns(path: &str) -> Result<()> {
    use std::os::fd::AsRawFd as _;
    let f = fs::File::open(path).with_context(|| format!("open {path}"))?;
    // SAFETY: valid fd; affects only the calling thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns {path}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Run `f` on a short-lived thread inside the test network namespace `path`.
pub fn in_netns<T: Send>(path: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    if !is_test_netns(path) {
        bail!("{path} is not a test network namespace");
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            enter_netns(path)?;
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread in {path} panicked"))?
    })
}

/// Make `cmd` enter the test network namespace `path` before it executes (the agent under
/// test runs in the node netns, as a DaemonSet pod with hostNetwork runs in the node's).
pub fn exec_in_netns(cmd: &mut Command, path: &str) -> Result<()> {
    use std::os::{fd::AsRawFd as _, unix::process::CommandExt as _};
    if !is_test_netns(path) {
        bail!("{path} is not a test network namespace");
    }
    let f = fs::File::open(path).with_context(|| format!("open {path}"))?;
    // SAFETY: setns is async-signal-safe; the fd stays open (owned by the closure) until exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// The calling thread's CPU affinity.
fn affinity() -> Result<libc::cpu_set_t> {
    // SAFETY: an all-zero cpu_set_t is the empty set, which sched_getaffinity fills.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer of the size passed; pid 0 is the calling thread.
    if unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        bail!("sched_getaffinity: {}", std::io::Error::last_os_error());
    }
    Ok(set)
}

fn set_affinity(set: &libc::cpu_set_t, what: &str) -> Result<()> {
    // SAFETY: valid set of the size passed; pid 0 is the calling thread.
    if unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set) } != 0 {
        bail!("sched_setaffinity({what}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Run the calling thread on `cpu` alone from now on; threads it spawns afterwards inherit
/// it. The benchmark keeps its workloads and the sinks they talk to on one CPU, so that a
/// rate is the cost of a whole round trip, not the luck of where the scheduler put the two
/// ends.
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        bail!("CPU {cpu} is beyond the affinity mask");
    }
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: cpu < CPU_SETSIZE, checked above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    set_affinity(&set, &format!("CPU {cpu}"))
}

/// The calling thread pinned to one CPU while this lives (see [`pin_to_cpu`]); dropped, its
/// previous CPUs are restored.
pub struct CpuPin(libc::cpu_set_t);

impl CpuPin {
    pub fn new(cpu: usize) -> Result<CpuPin> {
        let previous = affinity()?;
        pin_to_cpu(cpu)?;
        Ok(CpuPin(previous))
    }
}

impl Drop for CpuPin {
    fn drop(&mut self) {
        let _ = set_affinity(&self.0, "the previous CPUs");
    }
}

/// The highest-numbered CPU this thread may run on (a container's cpuset need not hold
/// the machine's last CPU).
pub fn last_allowed_cpu() -> Result<usize> {
    let set = affinity()?;
    // SAFETY: c < CPU_SETSIZE; CPU_ISSET only reads the set.
    (0..libc::CPU_SETSIZE as usize)
        .rev()
        .find(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .ok_or_else(|| anyhow::anyhow!("the affinity mask is empty"))
}
