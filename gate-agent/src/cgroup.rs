//! cgroup v2 helpers: find the cgroup2 mount, open the gated root, walk its descendants and
//! resolve the policy's cgroup globs to cgroup ids.
//!
//! On cgroup v2 a cgroup's id (what `bpf_get_current_cgroup_id` returns) is the inode number of
//! its directory, so ids are read with a plain `stat`.
use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use gate_common::abi::MAX_CGROUP_DEPTH;

use crate::policy::{AllowSelector, Policy};

/// `statfs.f_type` of a cgroup v2 filesystem.
pub(crate) const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// Where the mount table is read from.
const MOUNTINFO: &str = "/proc/self/mountinfo";

/// A cgroup directory that cannot be used, or a mount table without cgroup v2.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CgroupError {
    #[error("{}: cannot read the mount table: {source}", MOUNTINFO)]
    MountInfo { source: io::Error },
    #[error("{}: no cgroup2 filesystem is mounted (cgroup v2 is required)", MOUNTINFO)]
    NoCgroup2,
    #[error("{}: does not exist", path.display())]
    NotFound { path: PathBuf },
    #[error("{}: not a directory; pass a cgroup directory", path.display())]
    NotADirectory { path: PathBuf },
    #[error(
        "{}: not on a cgroup2 filesystem (filesystem type {fs_type:#x}); pass a cgroup v2 \
         directory below the cgroup2 mount",
        path.display()
    )]
    NotCgroup2 { path: PathBuf, fs_type: i64 },
    #[error(
        "{}: on a cgroup2 filesystem but below none of the cgroup2 mount points in {}",
        path.display(),
        MOUNTINFO
    )]
    NotUnderMount { path: PathBuf },
    #[error("{}: rejected: the root cgroup is never gated; pass a child cgroup", path.display())]
    IsRoot { path: PathBuf },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "the agent runs in a cgroup namespace of its own and cannot see kthreadd (pid 2) to \
         learn how deep that namespace sits in the hierarchy, so it cannot count the gated \
         cgroup's level as the kernel does; run it in the host's pid namespace (hostPID: true) \
         or the host's cgroup namespace"
    )]
    NamespaceLevelUnknown,
}

/// The cgroup2 mount point of this mount namespace, from `/proc/self/mountinfo`.
pub(crate) fn cgroup2_mount() -> Result<PathBuf, CgroupError> {
    let text =
        std::fs::read_to_string(MOUNTINFO).map_err(|source| CgroupError::MountInfo { source })?;
    cgroup2_mount_from(&text)
}

/// The first cgroup2 mount point in a mountinfo text (`proc_pid_mountinfo(5)` format).
pub(crate) fn cgroup2_mount_from(mountinfo: &str) -> Result<PathBuf, CgroupError> {
    cgroup2_mounts_from(mountinfo).into_iter().next().ok_or(CgroupError::NoCgroup2)
}

/// Every cgroup2 mount point in a mountinfo text, in table order.
///
/// A line is `id parent major:minor root mount-point options [optional...] - fstype source
/// super-options`; the mount point has spaces, tabs, newlines and backslashes escaped as
/// `\040`, `\011`, `\012`, `\134`.
pub(crate) fn cgroup2_mounts_from(mountinfo: &str) -> Vec<PathBuf> {
    cgroup2_mount_roots_from(mountinfo).into_iter().map(|(mount, _)| mount).collect()
}

/// Every cgroup2 mount in a mountinfo text: its mount point, and its root (the cgroup it
/// shows as its top, as a path from the reader's cgroup namespace root: `/` for a mount made
/// in that namespace, `/..` for one made in the namespace above).
fn cgroup2_mount_roots_from(mountinfo: &str) -> Vec<(PathBuf, String)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_ascii_whitespace().collect();
            let sep = fields.iter().position(|&f| f == "-")?;
            // The separator follows at least the six fixed fields.
            if sep < 6 || fields.get(sep + 1) != Some(&"cgroup2") {
                return None;
            }
            let root = unescape_octal(fields[3]).to_string_lossy().into_owned();
            Some((PathBuf::from(unescape_octal(fields[4])), root))
        })
        .collect()
}

/// Inode number of the initial cgroup namespace (`PROC_CGROUP_INIT_INO`,
/// include/linux/proc_ns.h): fixed since the namespace's introduction in Linux 4.6.
const INIT_CGROUP_NS_INO: u64 = 0xEFFF_FFFB;

/// The level, in the whole hierarchy, of this process's cgroup namespace root: 0 in the
/// initial namespace; otherwise from the cgroup of kthreadd (pid 2, which lives in the
/// hierarchy's root) as this namespace shows it, one `..` per level (`0::/..` for a namespace
/// rooted one level down).
fn cgroup_ns_level() -> Result<u32, CgroupError> {
    let ns_ino = std::fs::metadata("/proc/self/ns/cgroup").map(|m| m.ino()).ok();
    let is_kthreadd = std::fs::read_to_string("/proc/2/comm").is_ok_and(|c| c.trim() == "kthreadd");
    let text = if is_kthreadd { std::fs::read_to_string("/proc/2/cgroup").ok() } else { None };
    ns_level(ns_ino, text.as_deref())
}

/// [`cgroup_ns_level`] from this namespace's inode and kthreadd's `/proc/2/cgroup`. Without
/// either proof it is an error, not a guess: a level counted too low lets the node-level
/// programs and the allow list look at the wrong ancestor, and raw frames pass.
fn ns_level(ns_ino: Option<u64>, kthreadd_cgroup: Option<&str>) -> Result<u32, CgroupError> {
    match (ns_ino, kthreadd_cgroup) {
        (Some(INIT_CGROUP_NS_INO), _) => Ok(0),
        (_, Some(text)) => Ok(cgroup_ns_level_from(text)),
        (_, None) => Err(CgroupError::NamespaceLevelUnknown),
    }
}

/// [`cgroup_ns_level`] from the text of `/proc/2/cgroup`.
fn cgroup_ns_level_from(proc_cgroup: &str) -> u32 {
    let path = proc_cgroup.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or("/");
    let ups = path.split('/').take_while(|c| c.is_empty() || *c == "..").filter(|c| *c == "..");
    u32::try_from(ups.count()).unwrap_or(u32::MAX)
}

/// The level, in the whole hierarchy, of a cgroup2 mount's root: the namespace root's level,
/// moved by the mount's root path (mountinfo's fourth field) from that namespace root.
fn mount_root_level(ns_level: u32, root: &str) -> u32 {
    root.split('/').filter(|c| !c.is_empty() && *c != ".").fold(ns_level, |level, c| {
        if c == ".." { level.saturating_sub(1) } else { level.saturating_add(1) }
    })
}

/// Undo the kernel's `\ooo` escaping of mountinfo paths.
fn unescape_octal(s: &str) -> std::ffi::OsString {
    use std::os::unix::ffi::OsStringExt as _;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = b[i + 1..i + 4].iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            if let Ok(byte) = u8::try_from(v) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    std::ffi::OsString::from_vec(out)
}

/// `statfs(2)` f_type of the filesystem holding `path`.
fn fs_type(path: &Path) -> io::Result<i64> {
    let buf = rustix::fs::statfs(path)?;
    #[allow(clippy::unnecessary_cast)] // f_type's integer type differs between libcs
    Ok(buf.f_type as i64)
}

/// The gated cgroup root: the cgroup the programs are attached to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GatedRoot {
    /// Canonical path of the cgroup directory.
    pub path: PathBuf,
    /// The cgroup2 mount point it lives under.
    pub mount: PathBuf,
    /// cgroup id (inode number of the directory).
    pub id: u64,
    /// cgroup v2 level in the whole hierarchy, as the kernel's ancestor helpers count it (a
    /// child of the real root is 1), whatever part of the hierarchy the mount shows.
    pub level: u32,
}

impl GatedRoot {
    /// Open `dir` as the gated root. It must be an existing directory on a cgroup2 filesystem
    /// and not the hierarchy's root.
    pub(crate) fn open(dir: &Path) -> Result<GatedRoot, CgroupError> {
        let io_err = |source: io::Error| CgroupError::Io { path: dir.to_path_buf(), source };
        let meta = match std::fs::metadata(dir) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(CgroupError::NotFound { path: dir.to_path_buf() });
            }
            Err(e) => return Err(io_err(e)),
        };
        if !meta.is_dir() {
            return Err(CgroupError::NotADirectory { path: dir.to_path_buf() });
        }
        let path = dir.canonicalize().map_err(io_err)?;
        let fs_type = fs_type(&path).map_err(io_err)?;
        if fs_type != CGROUP2_SUPER_MAGIC {
            return Err(CgroupError::NotCgroup2 { path, fs_type });
        }

        let text = std::fs::read_to_string(MOUNTINFO)
            .map_err(|source| CgroupError::MountInfo { source })?;
        // The innermost cgroup2 mount that contains the path.
        let (mount, mount_root) = cgroup2_mount_roots_from(&text)
            .into_iter()
            .map(|(m, root)| (m.canonicalize().unwrap_or(m), root))
            .filter(|(m, _)| path.starts_with(m))
            .max_by_key(|(m, _)| m.components().count())
            .ok_or_else(|| CgroupError::NotUnderMount { path: path.clone() })?;
        let depth = path.strip_prefix(&mount).map(|r| r.components().count()).unwrap_or(0);
        if depth == 0 {
            return Err(CgroupError::IsRoot { path });
        }
        // The kernel counts levels from the hierarchy's real root. A node that runs in a
        // cgroup namespace of its own (kind, a nested runtime) mounts only its subtree, whose
        // top is not level 0: counted from the mount, every ancestor lookup (the node-level
        // programs, the allow list) would ask one level too high and miss the pod.
        let depth = u32::try_from(depth).unwrap_or(u32::MAX);
        let level = mount_root_level(cgroup_ns_level()?, &mount_root).saturating_add(depth);
        Ok(GatedRoot { id: meta.ino(), path, mount, level })
    }

    /// Every descendant cgroup (not the root itself) as (path relative to the root, id),
    /// depth-first in name order, at most [`MAX_CGROUP_DEPTH`] levels deep. Directories that
    /// vanish or cannot be read during the walk are skipped.
    pub(crate) fn walk(&self) -> Vec<(PathBuf, u64)> {
        let mut out = Vec::new();
        self.visit(|rel, id| {
            out.push((rel.to_path_buf(), id));
            false
        });
        out
    }

    /// Depth-first pre-order walk below the root; stops as soon as `f` returns true.
    fn visit(&self, f: impl FnMut(&Path, u64) -> bool) {
        visit(&self.path, MAX_CGROUP_DEPTH, f);
    }

    /// Every cgroup of the hierarchy the root lives in, the root's ancestors and siblings
    /// included, with its place: one walk of the whole mount.
    pub(crate) fn places(&self) -> Vec<(u64, Place)> {
        let mut out = Vec::new();
        if let Ok(meta) = std::fs::metadata(&self.mount) {
            out.push((meta.ino(), Place::Outside));
        }
        visit(&self.mount, self.level.saturating_add(MAX_CGROUP_DEPTH), |rel, id| {
            out.push((id, self.place_of(&self.mount.join(rel))));
            false
        });
        out
    }

    fn place_of(&self, abs: &Path) -> Place {
        if abs.starts_with(&self.path) { Place::Below } else { Place::Outside }
    }

    /// Descendants whose relative path matches a cgroup glob of `policy`, with the index of
    /// the first matching allow entry. Only what a glob itself matches is listed: cgroups
    /// nested below a match need no entry of their own, as the kernel programs also check a
    /// socket's ancestors below the gated root.
    pub(crate) fn resolve_allow(&self, policy: &Policy) -> Vec<ResolvedAllow> {
        let globs: Vec<_> = policy
            .cgroup_entries()
            .filter_map(|(i, e)| match &e.selector {
                AllowSelector::Cgroup(g) => Some((i, g)),
                AllowSelector::Pods(_) => None,
            })
            .collect();
        if globs.is_empty() {
            return Vec::new();
        }
        // Literal paths by hash lookup (first entry wins); patterns in order.
        let mut literals: std::collections::HashMap<&Path, usize> = Default::default();
        let mut patterns = Vec::new();
        for &(i, g) in &globs {
            match g.literal() {
                Some(p) => {
                    literals.entry(p).or_insert(i);
                }
                None => patterns.push((i, g)),
            }
        }
        self.walk()
            .into_iter()
            .filter_map(|(rel, id)| {
                let lit = literals.get(rel.as_path()).copied();
                let pat = patterns
                    .iter()
                    .take_while(|(i, _)| lit.is_none_or(|l| *i < l))
                    .find(|(_, g)| g.is_match(&rel))
                    .map(|(i, _)| *i);
                let entry = pat.or(lit)?;
                Some(ResolvedAllow { rel, id, entry })
            })
            .collect()
    }

    /// Path relative to the root of the cgroup with id `id` (`.` for the root itself), or
    /// `None` if no cgroup below the root has it (any more). By file handle where the agent
    /// may open one (O(1)), else by walking the tree.
    pub(crate) fn path_of(&self, id: u64) -> Option<PathBuf> {
        if id == self.id {
            return Some(PathBuf::from("."));
        }
        // Not permitted (no CAP_DAC_READ_SEARCH) or not supported: walk.
        if let Ok(found) = self.path_by_handle(id) {
            return found;
        }
        let mut found = None;
        self.visit(|rel, ino| {
            if ino == id {
                found = Some(rel.to_path_buf());
            }
            found.is_some()
        });
        found
    }
}

impl GatedRoot {
    /// The cgroup with id `id` by file handle: cgroup2 hands out handles of type
    /// FILEID_KERNFS whose 8 bytes are the cgroup id, so `open_by_handle_at` on the mount
    /// finds it without a walk. Needs CAP_DAC_READ_SEARCH. `Ok(None)`: no such cgroup, or
    /// not below the root; `Err`: the lookup itself is not possible here.
    pub(crate) fn path_by_handle(&self, id: u64) -> io::Result<Option<PathBuf>> {
        Ok(self.abs_by_handle(id)?.and_then(|abs| {
            abs.strip_prefix(&self.path).ok().map(|rel| {
                if rel.as_os_str().is_empty() { PathBuf::from(".") } else { rel.to_path_buf() }
            })
        }))
    }

    /// Where the cgroup with id `id` lies, found by file handle as [`Self::path_by_handle`]
    /// finds it; `Ok(None)`: no cgroup has that id (any more).
    pub(crate) fn place_by_handle(&self, id: u64) -> io::Result<Option<Place>> {
        Ok(self.abs_by_handle(id)?.map(|abs| self.place_of(&abs)))
    }

    /// The absolute path of the cgroup with id `id` anywhere in the root's hierarchy.
    fn abs_by_handle(&self, id: u64) -> io::Result<Option<PathBuf>> {
        use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
        /// `struct file_handle` with room for one kernfs id.
        #[repr(C)]
        struct Handle {
            bytes: u32,
            ty: i32,
            id: [u8; 8],
        }
        const FILEID_KERNFS: i32 = 0xfe;
        if fs_type(&self.mount)? != CGROUP2_SUPER_MAGIC {
            return Err(io::Error::from(io::ErrorKind::Unsupported));
        }
        let mount = std::fs::File::open(&self.mount)?;
        let mut h = Handle { bytes: 8, ty: FILEID_KERNFS, id: id.to_ne_bytes() };
        // By hand: rustix 1.1 has no open_by_handle_at.
        // SAFETY: a valid mount fd and handle; the kernel writes nothing back.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_by_handle_at,
                mount.as_raw_fd(),
                &mut h as *mut Handle,
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ESTALE | libc::ENOENT) => Ok(None),
                _ => Err(e),
            };
        }
        // SAFETY: a new fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).map(Some)
    }
}

/// Where a cgroup lies, seen from the gated root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// The root or a cgroup below it: a gated workload's.
    Below,
    /// Anywhere else in the hierarchy: the node's own processes (the kubelet, the runtime).
    Outside,
}

/// Depth-first pre-order walk of the cgroups below `base`, at most `max_depth` levels deep,
/// each given with its path relative to `base` and its id; stops as soon as `f` returns
/// true. Directories that vanish or cannot be read during the walk are skipped.
fn visit(base: &Path, max_depth: u32, mut f: impl FnMut(&Path, u64) -> bool) {
    // Stack of (relative path, depth); children pushed in reverse name order so they are
    // visited in name order.
    let mut stack: Vec<(PathBuf, u32)> = vec![(PathBuf::new(), 0)];
    while let Some((rel, depth)) = stack.pop() {
        if depth > 0 {
            let Ok(meta) = std::fs::symlink_metadata(base.join(&rel)) else { continue };
            if f(&rel, meta.ino()) {
                return;
            }
        }
        if depth >= max_depth {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(base.join(&rel)) else { continue };
        let mut children: Vec<_> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name())
            .collect();
        children.sort_unstable_by(|x, y| y.cmp(x));
        stack.extend(children.into_iter().map(|name| (rel.join(name), depth + 1)));
    }
}

/// A cgroup that an allow entry's glob selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResolvedAllow {
    /// Path relative to the gated root.
    pub rel: PathBuf,
    /// cgroup id.
    pub id: u64,
    /// Index of the allow entry (in `Policy::allow`) that matched first.
    pub entry: usize,
}

#[cfg(test)]
mod tests;
