//! One scenario's throwaway world: node + imds netns joined by a veth, the traffic sinks,
//! a cgroup tree with a gated workload and an allow-listed cgroup, and a
//! private directory for policy files. Everything is removed on drop, also on panic.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use integration_tests::{
    cgroups::CgroupTree,
    net::TestNet,
    sys::{CpuPin, cgroup2_mount, unique},
};

use crate::{
    Cfg,
    workload::{DEST_V4, Sink, Slicer},
};

// Field order is drop order: sink threads leave the netns before it is deleted.
pub(super) struct World {
    _sink: Sink,
    pub net: TestNet,
    pub cg: CgroupTree,
    /// `/tmp/mg-<pid>-<n>/`, for policy files (the stale sweep knows the name).
    pub dir: tempfile::TempDir,
    /// `gated/workload`: the benchmarked process.
    pub workload: PathBuf,
    /// `gated/cloud-agent`: allow-listed by the policy.
    pub allowed: PathBuf,
}

impl World {
    pub(super) fn new() -> Result<World> {
        let net = TestNet::new()?;
        let sink = Sink::start(&net)?;
        let cg = CgroupTree::new()?;
        let workload = cg.create("gated/workload")?;
        let allowed = cg.create("gated/cloud-agent")?;
        let dir = tempfile::Builder::new().prefix(&unique("mg")).rand_bytes(0).tempdir()?;
        Ok(World { _sink: sink, net, cg, dir, workload, allowed })
    }

    /// A world whose sinks (threads of this process, which inherit the CPU of the thread
    /// that starts them) run on `cpu`, where the rate scenarios put their workloads too.
    pub(super) fn on_cpu(cpu: usize) -> Result<World> {
        let _pin = CpuPin::new(cpu)?;
        World::new()
    }

    /// A rate workload (`bench-probe serve`) in `cgroup` of this world, on the run's CPU,
    /// to the unprotected destination of scenarios 1–3 and 5.
    pub(super) fn slicer(&self, cfg: &Cfg, cgroup: &Path, mode: &str, port: u16) -> Result<Slicer> {
        Slicer::start(&cfg.bins, &self.net, cgroup, mode, (DEST_V4, port), cfg.cpu)
    }

    /// Write `text` as `name` in the world's directory (write to a temp file, then rename,
    /// as an editor or a ConfigMap update would).
    pub(super) fn write_policy(&self, name: &str, text: &str) -> Result<PathBuf> {
        let p = self.dir.path().join(name);
        let tmp = self.dir.path().join(format!(".{name}.tmp"));
        fs::write(&tmp, text).with_context(|| format!("write {}", tmp.display()))?;
        fs::rename(&tmp, &p).with_context(|| format!("rename to {}", p.display()))?;
        Ok(p)
    }
}

/// `path` relative to the cgroup2 mount, and its level (depth) in the cgroup2 hierarchy.
pub(super) fn cgroup_rel(path: &Path) -> Result<(String, usize)> {
    let mount = cgroup2_mount()?;
    let rel = path
        .strip_prefix(&mount)
        .with_context(|| format!("{} is not below {}", path.display(), mount.display()))?;
    Ok((rel.to_string_lossy().into_owned(), rel.components().count()))
}

/// `path` as nft's `socket cgroupv2` wants it: relative to /sys/fs/cgroup, where nft looks
/// it up (on a hybrid layout the cgroup2 mount is /sys/fs/cgroup/unified).
pub(super) fn nft_cgroup_path(path: &Path) -> Result<String> {
    let rel = path.strip_prefix("/sys/fs/cgroup").with_context(|| {
        format!("{} is not below /sys/fs/cgroup, where nft resolves cgroupv2 paths", path.display())
    })?;
    Ok(rel.to_string_lossy().into_owned())
}
