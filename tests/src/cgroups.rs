//! A throwaway cgroup v2 tree: `<cgroup2>/mg-test-<pid>-<n>/` with `gated/` (the agent's
//! `--cgroup-root`) and `outside/` beside it.
use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use crate::sys::{cgroup2_mount, unique};

pub struct CgroupTree {
    pub base: PathBuf,
}

impl CgroupTree {
    pub fn new() -> Result<CgroupTree> {
        let base = cgroup2_mount()?.join(unique("mg-test"));
        fs::create_dir(&base).with_context(|| format!("mkdir {}", base.display()))?;
        let tree = CgroupTree { base };
        tree.create("gated")?;
        tree.create("outside")?;
        Ok(tree)
    }

    /// The gated root.
    pub fn gated(&self) -> PathBuf {
        self.base.join("gated")
    }

    /// Create `rel` (relative to the tree's base; parents included) and return its path.
    pub fn create(&self, rel: &str) -> Result<PathBuf> {
        let p = self.base.join(rel);
        fs::create_dir_all(&p).with_context(|| format!("mkdir {}", p.display()))?;
        Ok(p)
    }
}

impl Drop for CgroupTree {
    fn drop(&mut self) {
        remove_tree(&self.base);
    }
}

/// Kill every process in the tree, then remove its cgroups deepest first.
pub fn remove_tree(base: &Path) {
    let mut dirs = Vec::new();
    collect(base, &mut dirs);
    for d in &dirs {
        if fs::write(d.join("cgroup.kill"), "1").is_err()
            && let Ok(procs) = fs::read_to_string(d.join("cgroup.procs"))
        {
            for pid in procs.lines().filter_map(|l| l.parse::<i32>().ok()) {
                // SAFETY: plain kill(2).
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    for d in dirs.iter().rev() {
        let deadline = Instant::now() + Duration::from_secs(5);
        while fs::remove_dir(d).is_err() && d.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect(&e.path(), out);
            }
        }
    }
}
