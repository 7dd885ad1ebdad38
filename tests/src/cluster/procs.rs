//! The processes one part of the cluster started, each with its log in the run directory:
//! started, waited for, and stopped by pid (SIGTERM, then SIGKILL on drop).
use std::{
    fs,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::show;

#[derive(Default)]
pub(super) struct Procs {
    /// Where each one's `<name>.log` goes.
    dir: PathBuf,
    list: Vec<(&'static str, Child)>,
}

impl Procs {
    pub(super) fn new(dir: PathBuf) -> Procs {
        Procs { dir, list: Vec::new() }
    }

    /// Start `cmd` as `name`, its output in `<name>.log`.
    pub(super) fn spawn(&mut self, name: &'static str, mut cmd: Command) -> Result<()> {
        let log = fs::File::create(self.dir.join(format!("{name}.log")))?;
        cmd.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        let child = cmd.spawn().with_context(|| format!("starting {}", show(&cmd)))?;
        self.list.push((name, child));
        Ok(())
    }

    /// Wait until `ready` holds, or fail with `name`'s log if it exits or `limit` passes.
    pub(super) fn wait(
        &mut self,
        name: &str,
        limit: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            if ready() {
                return Ok(());
            }
            let exited = self
                .list
                .iter_mut()
                .find(|(n, _)| *n == name)
                .and_then(|(_, c)| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                let why =
                    exited.map_or("did not get ready in time".into(), |s| format!("exited: {s}"));
                bail!("{name} {why}; its log ends:\n{}", self.log_tail(name));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The last lines of `name`'s log.
    pub(super) fn log_tail(&self, name: &str) -> String {
        let text = fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// SIGTERM to each, then up to `grace` for them to exit; what is left is killed on drop.
    pub(super) fn terminate(&mut self, grace: Duration) {
        for (_, child) in &mut self.list {
            // SAFETY: a pid of a child this process started and has not reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let deadline = Instant::now() + grace;
        for (_, child) in &mut self.list {
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, child) in &mut self.list {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
