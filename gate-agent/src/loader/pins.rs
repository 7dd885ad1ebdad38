//! The pin dir: `<pin-dir>/v<ABI>/{maps,progs,links}/` on bpffs.
//!
//! `links/<hook>` are what keep the programs attached when no agent runs; `maps/<MAP>` keep the
//! policy; `progs/<hook>` name the programs for inspection. Removing the versioned dir is what
//! opens the gate ([`cleanup`]).
use std::{
    ffi::CStr,
    fs, io,
    path::{Path, PathBuf},
};

use gate_common::abi::ABI_VERSION;
use rustix::mount::MountFlags;

use super::LoaderError;

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Where one ABI version of the gate lives.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    /// `<pin-dir>/v<ABI>`.
    pub dir: PathBuf,
}

impl Layout {
    pub(crate) fn new(pin_dir: &Path) -> Self {
        Self { dir: versioned(pin_dir, ABI_VERSION) }
    }
    pub(crate) fn map(&self, name: &str) -> PathBuf {
        self.dir.join("maps").join(name)
    }
    pub(crate) fn link(&self, hook: &str) -> PathBuf {
        self.dir.join("links").join(hook)
    }
    pub(crate) fn prog(&self, hook: &str) -> PathBuf {
        self.dir.join("progs").join(hook)
    }
    /// Names of the pinned links.
    pub(crate) fn links(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.dir.join("links"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

/// `<pin-dir>/v<abi>`.
pub(crate) fn versioned(pin_dir: &Path, abi: u32) -> PathBuf {
    pin_dir.join(format!("v{abi}"))
}

/// Mount bpffs at the pin dir's parent if that is not on bpffs yet (and `may_mount`), then
/// create the layout.
pub(crate) fn prepare(pin_dir: &Path, may_mount: bool) -> Result<Layout, LoaderError> {
    let err = |reason: String| LoaderError::PinDir { path: pin_dir.to_path_buf(), reason };
    let parent = pin_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| err("has no parent directory to mount bpffs on".into()))?;
    fs::create_dir_all(parent).map_err(|e| err(format!("creating {}: {e}", parent.display())))?;
    if statfs_type(parent).map_err(|e| err(format!("statfs {}: {e}", parent.display())))?
        != BPF_FS_MAGIC
    {
        if !may_mount {
            return Err(err(format!(
                "{} is not on bpffs. In a pod, mount the host's /sys/fs/bpf (hostPath): a bpffs \
                 the agent mounted itself would vanish with its container, and the gate with it",
                parent.display()
            )));
        }
        mount_bpffs(parent)
            .map_err(|e| err(format!("mounting bpffs on {}: {e}", parent.display())))?;
        tracing::info!(path = %parent.display(), "mounted bpffs");
    }
    let layout = Layout::new(pin_dir);
    for sub in ["maps", "progs", "links"] {
        fs::create_dir_all(layout.dir.join(sub))
            .map_err(|e| err(format!("creating {sub}/: {e}")))?;
    }
    Ok(layout)
}

/// Other ABI versions pinned under the same pin dir (`v<N>` directories), oldest first.
pub(crate) fn other_versions(pin_dir: &Path) -> Vec<(u32, PathBuf)> {
    let mut v: Vec<(u32, PathBuf)> = fs::read_dir(pin_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let n: u32 = name.to_str()?.strip_prefix('v')?.parse().ok()?;
            (n != ABI_VERSION).then(|| (n, e.path()))
        })
        .collect();
    v.sort();
    v
}

fn statfs_type(path: &Path) -> io::Result<i64> {
    let st = rustix::fs::statfs(path)?;
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64)
}

fn mount_bpffs(path: &Path) -> io::Result<()> {
    mount_pseudo(c"bpffs", c"bpf", path, MountFlags::empty(), c"mode=0700")
}

/// mount(2) of a filesystem without a device (bpffs, securityfs): `fstype` on `target`, named
/// `source` in the mount table.
pub(super) fn mount_pseudo(
    source: &CStr,
    fstype: &CStr,
    target: &Path,
    flags: MountFlags,
    data: &CStr,
) -> io::Result<()> {
    Ok(rustix::mount::mount(source, target, fstype, flags, data)?)
}

/// Remove one versioned dir: its clsact filters (which no pin holds), then its pins.
/// Unpinning the links detaches them once no process holds them, which opens that version's
/// gate.
pub(crate) fn remove_version(dir: &Path) -> Result<(), LoaderError> {
    super::tc::cleanup_clsact(dir);
    // A running agent (`cleanup --force`) may pin again while the tree is removed: try again.
    let mut tries = 0;
    loop {
        match fs::remove_dir_all(dir) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) && tries < 20 => tries += 1,
            r => {
                return r.map_err(|e| LoaderError::PinDir {
                    path: dir.to_path_buf(),
                    reason: format!("removing: {e}"),
                });
            }
        }
    }
}

/// Remove every version pinned under `pin_dir`: this opens the gate. Returns the removed dirs.
pub(crate) fn cleanup(pin_dir: &Path) -> Result<Vec<PathBuf>, LoaderError> {
    let mut removed = Vec::new();
    let mut dirs = other_versions(pin_dir);
    dirs.push((ABI_VERSION, Layout::new(pin_dir).dir));
    for (_, dir) in dirs {
        if dir.exists() {
            remove_version(&dir)?;
            removed.push(dir);
        }
    }
    // Remove the pin dir itself if nothing else lives there.
    let _ = fs::remove_dir(pin_dir);
    Ok(removed)
}

/// Describe the link pinned as `links/<name>`.
pub(crate) fn pinned_link_info(layout: &Layout, name: &str) -> io::Result<super::LinkInfo> {
    use std::os::fd::AsFd as _;
    let fd = super::sys::obj_get(&layout.link(name))?;
    super::sys::link_info(fd.as_fd())
}
