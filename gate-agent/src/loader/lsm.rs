//! The node-wide BPF LSM programs (`lsm/socket_setsockopt`, `socket_create`, `socket_bind`):
//! the side doors around tc through every syscall ABI, and sockets that would read the node's
//! traffic. They run only where the kernel has the BPF LSM active (`bpf` in the kernel's list
//! of LSMs); elsewhere the gate says so ([`LsmState::Inactive`]) and those doors stay as the
//! cgroup hooks leave them (native setsockopt denied; 32-bit compat, io_uring and capture
//! open).
//!
//! Links are pinned as `links/lsm-<hook>`. An LSM link's program cannot be swapped in place,
//! so a new agent attaches its own link first and then renames its pin over the old one:
//! both enforce for that moment, never neither.
use std::{
    fs, io,
    path::{Path, PathBuf},
};

use aya::{
    Btf, Ebpf,
    programs::{Lsm, links::FdLink},
};
use gate_common::user::AttachPoint;

use super::{Gate, LoaderError, attach::Repair, program};

/// Whether the LSM programs enforce on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LsmState {
    /// Loaded and attached; the kernel runs them.
    Active,
    /// Not attached, and why (the BPF LSM is not active, the kernel rejected the programs):
    /// two doors are open on this node.
    Inactive(String),
}

impl LsmState {
    /// `enforcing`, or `open: <the doors>: <why>`, as `status` shows it: not running the
    /// programs leaves two doors open, and the word says so.
    pub(crate) fn text(&self) -> String {
        match self {
            LsmState::Active => "enforcing".into(),
            LsmState::Inactive(why) => format!("open: {OPEN_DOORS}: {why}"),
        }
    }
}

/// What stays open where the LSM programs do not run (docs/threat-model.md).
const OPEN_DOORS: &str =
    "PACKET_QDISC_BYPASS through the 32-bit ABI and capturing the node's traffic are not closed";

const LSM_LIST: &str = "/sys/kernel/security/lsm";

/// The kernel's list of active LSMs, comma-separated. securityfs is seldom mounted inside a
/// container: where the usual path is missing, it is mounted on a private directory for the
/// one read.
fn active_lsms() -> io::Result<String> {
    match fs::read_to_string(LSM_LIST) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        r => return r,
    }
    let dir = std::env::temp_dir().join(format!("metadata-gate-securityfs-{}", std::process::id()));
    fs::create_dir_all(&dir)?;
    let read = mount_securityfs(&dir).and_then(|()| {
        let list = fs::read_to_string(dir.join("lsm"));
        let _ = unmount(&dir);
        list
    });
    let _ = fs::remove_dir(&dir);
    read
}

/// Whether `bpf` is among the active LSMs, or why that cannot be known.
pub(crate) fn bpf_lsm_active() -> Result<bool, String> {
    let list = active_lsms().map_err(|e| format!("reading the kernel's active LSMs: {e}"))?;
    Ok(list.trim().split(',').any(|l| l == "bpf"))
}

fn mount_securityfs(dir: &Path) -> io::Result<()> {
    use rustix::mount::MountFlags;
    let flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC | MountFlags::RDONLY;
    super::pins::mount_pseudo(c"securityfs", c"securityfs", dir, flags, c"")
}

fn unmount(dir: &Path) -> io::Result<()> {
    Ok(rustix::mount::unmount(dir, rustix::mount::UnmountFlags::DETACH)?)
}

/// Load the LSM programs where the BPF LSM is active; otherwise, or where the kernel rejects
/// them, say why (the rest of the gate loads all the same).
pub(super) fn load(ebpf: &mut Ebpf) -> LsmState {
    match bpf_lsm_active() {
        Ok(true) => {}
        Ok(false) => {
            return LsmState::Inactive(format!(
                "the BPF LSM is not active (`bpf` is not in {LSM_LIST}; boot with lsm=...,bpf)"
            ));
        }
        Err(why) => return LsmState::Inactive(why),
    }
    let state = load_with_btf(ebpf);
    give_back_freed_memory();
    state
}

fn load_with_btf(ebpf: &mut Ebpf) -> LsmState {
    let btf = match Btf::from_sys_fs() {
        Ok(b) => b,
        Err(e) => return LsmState::Inactive(format!("reading the kernel's BTF: {e}")),
    };
    for point in AttachPoint::LSM {
        let (prog, hook) = (point.program(), point.lsm_hook().unwrap_or_default());
        let loaded = program::<Lsm>(ebpf, prog).and_then(|p| {
            p.load(hook, &btf).map_err(|source| LoaderError::Program { name: prog.name(), source })
        });
        if let Err(e) = loaded {
            return LsmState::Inactive(format!("the kernel rejected {}: {e}", prog.name()));
        }
    }
    LsmState::Active
}

/// The kernel's BTF, parsed for the LSM programs' hooks, takes some 15 MiB while it lives;
/// glibc keeps what it frees for later, so the agent would carry it for good. Hand it back.
fn give_back_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim(3) only releases free heap memory; no pointer is passed.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl Gate {
    /// Attach every LSM program and pin its link; where a link is pinned already (an earlier
    /// agent's), the new one is attached first and its pin renamed over the old.
    /// A failure leaves the rest of the gate enforcing: the state turns inactive, saying why.
    pub(super) fn attach_lsm(&mut self) {
        if self.lsm != LsmState::Active {
            return;
        }
        if let Err(e) = self.try_attach_lsm() {
            self.lsm = LsmState::Inactive(format!("attaching: {e}"));
        }
    }

    fn try_attach_lsm(&mut self) -> Result<(), LoaderError> {
        for point in AttachPoint::LSM {
            let path = self.layout.link(point.pin_name());
            // bpffs rejects names with a dot.
            let fresh = self.layout.link(&format!("{}-new", point.pin_name()));
            self.attach_lsm_link(point, &fresh)?;
            fs::rename(&fresh, &path).map_err(|source| LoaderError::Io {
                what: "moving the new LSM link's pin over",
                path: path.clone(),
                source,
            })?;
            self.pin_program(point, point.program())?;
        }
        Ok(())
    }

    /// Put back an LSM link or program pin that was removed.
    pub(super) fn repair_lsm(&mut self, repaired: &mut Vec<Repair>) -> Result<(), LoaderError> {
        if self.lsm != LsmState::Active {
            return Ok(());
        }
        for point in AttachPoint::LSM {
            let path = self.layout.link(point.pin_name());
            if !path.exists() {
                self.attach_lsm_link(point, &path)?;
                repaired.push(Repair::Link(point));
            }
            if !self.layout.prog(point.pin_name()).exists() {
                self.pin_program(point, point.program())?;
                repaired.push(Repair::ProgramPin(point));
            }
        }
        Ok(())
    }

    fn attach_lsm_link(&mut self, point: AttachPoint, pin: &PathBuf) -> Result<(), LoaderError> {
        let prog = point.program();
        let perr = |source| LoaderError::Program { name: prog.name(), source };
        let p: &mut Lsm = program(&mut self.ebpf, prog)?;
        let id = p.attach().map_err(perr)?;
        let link = FdLink::from(p.take_link(id).map_err(perr)?);
        let _ = fs::remove_file(pin);
        link.pin(pin).map_err(|source| LoaderError::Pin { path: pin.clone(), source })?;
        Ok(())
    }

    /// Whether the LSM programs enforce, or why not.
    pub(crate) fn lsm(&self) -> &LsmState {
        &self.lsm
    }
}
