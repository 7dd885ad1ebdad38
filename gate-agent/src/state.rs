//! What a node keeps on its own disk for the boot step (`gate-agent boot`, run by systemd
//! before the kubelet): the last good policy as written, the allow set by cgroup path, and
//! a copy of the agent's binary (the DaemonSet's image is not on the host), and the boot
//! step's record of what it did. Every file is replaced durably (write aside, fsync, rename,
//! fsync the directory), so a crash or power loss never leaves half of one.
use std::{
    fs, io,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

const POLICY: &str = "policy.yaml";
const ALLOW: &str = "allow.json";
const BINARY: &str = "bin/gate-agent";
const BOOT: &str = "boot.json";

/// What the boot step did on one boot: written by `gate-agent boot`, read by the agent and
/// `status` (a record of another boot means the boot step did not run on this one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BootRecord {
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`) of the boot it ran on.
    pub boot_id: String,
    /// Whether the gate was closed (or already pinned) when the step exited.
    pub closed: bool,
    /// Where the policy came from (`kept …`, `installed …`, `shipped …`), if one was read.
    pub policy: Option<String>,
    /// How many cgroups were allowed from the kept allow set.
    pub allowed: usize,
    /// Why the gate could not be closed, or what was wrong with the kept state.
    pub problems: Vec<String>,
    /// Seconds since the epoch.
    pub at: u64,
}

/// This boot's id; empty where the kernel does not say.
pub(crate) fn boot_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// One allowed cgroup, by path relative to the gated root.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AllowedPath {
    pub path: PathBuf,
    /// Its ALLOWED value (entry and grants). Files of agents before grants hold the bare
    /// entry index (`entry`): read as granting nothing until the agent resolves the set.
    #[serde(alias = "entry")]
    pub value: u32,
}

/// A node's state directory (default `/var/lib/metadata-gate` in a cluster).
#[derive(Clone, Debug)]
pub(crate) struct StateDir(PathBuf);

impl StateDir {
    pub(crate) fn new(dir: &Path) -> StateDir {
        StateDir(dir.to_path_buf())
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.0
    }

    /// Replace `rel` with `bytes` (file mode `mode`) so that a power loss leaves the old file
    /// or the new one, never a torn or empty one: write a temporary file, fsync it, rename it
    /// over, fsync the directory (the rename itself is durable only then).
    fn write(&self, rel: &str, bytes: &[u8], mode: u32) -> io::Result<()> {
        use std::{io::Write as _, os::unix::fs::OpenOptionsExt as _};
        let path = self.0.join(rel);
        let parent = path.parent().unwrap_or(&self.0).to_path_buf();
        fs::create_dir_all(&parent)?;
        let tmp = path.with_extension("tmp");
        // A leftover of a write cut short would keep its mode.
        let _ = fs::remove_file(&tmp);
        let mut f =
            fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, &path)?;
        fs::File::open(&parent)?.sync_all()
    }

    pub(crate) fn save_policy(&self, text: &str) -> io::Result<()> {
        self.write(POLICY, text.as_bytes(), 0o644)
    }

    pub(crate) fn policy_path(&self) -> PathBuf {
        self.0.join(POLICY)
    }

    pub(crate) fn load_policy(&self) -> io::Result<String> {
        fs::read_to_string(self.policy_path())
    }

    pub(crate) fn save_allow(&self, allowed: &[AllowedPath]) -> io::Result<()> {
        let json = serde_json::to_vec_pretty(allowed).map_err(io::Error::other)?;
        self.write(ALLOW, &json, 0o644)
    }

    /// The saved allow set; empty if none was saved.
    pub(crate) fn load_allow(&self) -> io::Result<Vec<AllowedPath>> {
        match fs::read(self.0.join(ALLOW)) {
            Ok(b) => serde_json::from_slice(&b).map_err(io::Error::other),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn save_boot(&self, record: &BootRecord) -> io::Result<()> {
        let json = serde_json::to_vec_pretty(record).map_err(io::Error::other)?;
        self.write(BOOT, &json, 0o644)
    }

    /// The boot step's record of this boot: `None` if it did not run on this boot (or left
    /// nothing readable).
    pub(crate) fn this_boot(&self) -> Option<BootRecord> {
        let r: BootRecord = serde_json::from_slice(&fs::read(self.0.join(BOOT)).ok()?).ok()?;
        (r.boot_id == boot_id()).then_some(r)
    }

    /// Copy the running binary to `bin/gate-agent` (if it differs), for the boot unit.
    pub(crate) fn install_binary(&self) -> io::Result<PathBuf> {
        let me = fs::read("/proc/self/exe")?;
        let dst = self.0.join(BINARY);
        if fs::read(&dst).is_ok_and(|b| b == me) {
            return Ok(dst);
        }
        self.write(BINARY, &me, 0o755)?;
        Ok(dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_defaults() {
        let dir = std::env::temp_dir().join(format!("mg-state-test-{}", std::process::id()));
        let st = StateDir::new(&dir);
        assert!(st.load_allow().unwrap().is_empty());
        st.save_policy("platform: AWS\n").unwrap();
        assert_eq!(st.load_policy().unwrap(), "platform: AWS\n");
        let allowed = vec![AllowedPath { path: "a/b".into(), value: 2 }];
        st.save_allow(&allowed).unwrap();
        assert_eq!(st.load_allow().unwrap(), allowed);
        let bin = st.install_binary().unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(fs::metadata(&bin).unwrap().permissions().mode() & 0o777, 0o755);
        assert!(!dir.join("policy.tmp").exists(), "no temporary file left");
        assert_eq!(st.this_boot(), None);
        let mut rec = BootRecord {
            boot_id: "another boot".into(),
            closed: true,
            policy: None,
            allowed: 0,
            problems: vec![],
            at: 1,
        };
        st.save_boot(&rec).unwrap();
        assert_eq!(st.this_boot(), None, "a record of another boot is not this boot's");
        rec.boot_id = boot_id();
        st.save_boot(&rec).unwrap();
        assert_eq!(st.this_boot(), Some(rec));
        let _ = fs::remove_dir_all(&dir);
    }
}
