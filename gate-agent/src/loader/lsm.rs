//! The node-wide BPF LSM programs (`lsm/socket_setsockopt`, `socket_create`, `socket_bind`):
//! the side doors around tc through every syscall ABI, and sockets that would read the node's
//! traffic. They run as LSM programs where the kernel has the BPF LSM active (`bpf` in the
//! kernel's list of LSMs), else as `fmod_ret` programs on the `security_socket_*` functions
//! where the kernel has BPF trampolines ([`fmod_ret`](super::fmod_ret)); where neither loads
//! the gate says so ([`LsmState::Inactive`]) and those doors stay as the cgroup hooks leave
//! them (native setsockopt denied; 32-bit compat, io_uring and capture open).
//!
//! Links are pinned as `links/lsm-<hook>`. An LSM link's program cannot be swapped in place,
//! so a new agent attaches its own link first and then renames its pin over the old one:
//! both enforce for that moment, never neither.
use std::{
    fs, io,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::{
    Btf, Ebpf,
    programs::{Lsm, links::FdLink},
};
use gate_common::user::AttachPoint;

use super::{
    Gate, LoaderError,
    attach::Repair,
    fmod_ret::{self, FmodRet},
    pins::Layout,
    program, sys,
};

/// Whether the LSM programs enforce on this node, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LsmState {
    /// Loaded and attached as BPF LSM programs.
    Active,
    /// Loaded and attached as `fmod_ret` programs on the `security_socket_*` functions: the
    /// kernel runs no BPF LSM (or refused the LSM programs), but has BPF trampolines.
    FmodRet,
    /// Not attached, and why (no BPF LSM and no trampolines, the kernel rejected the
    /// programs): two doors are open on this node.
    Inactive(String),
}

impl LsmState {
    /// Whether the programs are attached, either way.
    pub(crate) fn enforcing(&self) -> bool {
        !matches!(self, LsmState::Inactive(_))
    }

    /// `enforcing` (and how, where not as LSM programs), or `open: <the doors>: <why>`, as
    /// `status` shows it: not running the programs leaves two doors open, and the word says
    /// so.
    pub(crate) fn text(&self) -> String {
        match self {
            LsmState::Active => "enforcing".into(),
            LsmState::FmodRet => {
                "enforcing (as fmod_ret on security_socket_*: the kernel runs no BPF LSM)".into()
            }
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

/// Load the programs as LSM programs where the BPF LSM is active, else (or where the kernel
/// rejects them) as `fmod_ret`; where neither loads, say why (the rest of the gate loads all
/// the same).
pub(super) fn load(ebpf: &mut Ebpf, object: &[u8], layout: &Layout) -> (LsmState, Option<FmodRet>) {
    let loaded = match Btf::from_sys_fs() {
        Ok(btf) => load_with_btf(ebpf, object, layout, &btf),
        Err(e) => (LsmState::Inactive(format!("reading the kernel's BTF: {e}")), None),
    };
    give_back_freed_memory();
    loaded
}

fn load_with_btf(
    ebpf: &mut Ebpf,
    object: &[u8],
    layout: &Layout,
    btf: &Btf,
) -> (LsmState, Option<FmodRet>) {
    let not_as_lsm = match bpf_lsm_active() {
        Ok(true) => match load_as_lsm(ebpf, btf) {
            Ok(()) => return (LsmState::Active, None),
            Err(why) => why,
        },
        Ok(false) => {
            format!("the BPF LSM is not active (`bpf` is not in {LSM_LIST}; boot with lsm=...,bpf)")
        }
        Err(why) => why,
    };
    match fmod_ret::load(object, layout, btf) {
        Ok(programs) => {
            tracing::info!(why = not_as_lsm, "LSM programs loaded as fmod_ret");
            (LsmState::FmodRet, Some(programs))
        }
        Err(why) => (LsmState::Inactive(format!("{not_as_lsm}; as fmod_ret: {why}")), None),
    }
}

fn load_as_lsm(ebpf: &mut Ebpf, btf: &Btf) -> Result<(), String> {
    for point in AttachPoint::LSM {
        let (prog, hook) = (point.program(), point.lsm_hook().unwrap_or_default());
        let loaded = program::<Lsm>(ebpf, prog).and_then(|p| {
            p.load(hook, btf).map_err(|source| LoaderError::Program { name: prog.name(), source })
        });
        if let Err(e) = loaded {
            return Err(format!("the kernel rejected {}: {e}", prog.name()));
        }
    }
    Ok(())
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
        if !self.lsm.enforcing() {
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
            self.pin_lsm_program(point)?;
        }
        Ok(())
    }

    /// Put back an LSM link or program pin that was removed.
    pub(super) fn repair_lsm(&mut self, repaired: &mut Vec<Repair>) -> Result<(), LoaderError> {
        if !self.lsm.enforcing() {
            return Ok(());
        }
        for point in AttachPoint::LSM {
            let path = self.layout.link(point.pin_name());
            if !path.exists() {
                self.attach_lsm_link(point, &path)?;
                repaired.push(Repair::Link(point));
            }
            if !self.layout.prog(point.pin_name()).exists() {
                self.pin_lsm_program(point)?;
                repaired.push(Repair::ProgramPin(point));
            }
        }
        Ok(())
    }

    fn attach_lsm_link(&mut self, point: AttachPoint, pin: &PathBuf) -> Result<(), LoaderError> {
        let prog = point.program();
        if let Some(fmod) = &self.fmod_ret {
            let io = |what, path: &PathBuf| {
                let path = path.clone();
                move |source| LoaderError::Io { what, path, source }
            };
            let loaded = fmod.prog(point).ok_or(LoaderError::MissingProgram(prog.name()))?;
            let link = fmod_ret::attach(loaded).map_err(io("attaching as fmod_ret", pin))?;
            let _ = fs::remove_file(pin);
            return sys::obj_pin(link.as_fd(), pin).map_err(io("pinning", pin));
        }
        let perr = |source| LoaderError::Program { name: prog.name(), source };
        let p: &mut Lsm = program(&mut self.ebpf, prog)?;
        let id = p.attach().map_err(perr)?;
        let link = FdLink::from(p.take_link(id).map_err(perr)?);
        let _ = fs::remove_file(pin);
        link.pin(pin).map_err(|source| LoaderError::Pin { path: pin.clone(), source })?;
        Ok(())
    }

    /// Pin (or re-pin) an LSM attach point's program, as whichever kind it was loaded.
    fn pin_lsm_program(&mut self, point: AttachPoint) -> Result<(), LoaderError> {
        let Some(fmod) = &self.fmod_ret else {
            return self.pin_program(point, point.program()).map(drop);
        };
        let path = self.layout.prog(point.pin_name());
        let loaded = fmod.prog(point).ok_or(LoaderError::MissingProgram(point.program().name()))?;
        let _ = fs::remove_file(&path);
        sys::obj_pin(loaded, &path).map_err(|source| LoaderError::Io {
            what: "pinning",
            path,
            source,
        })
    }

    /// Whether the LSM programs enforce, or why not.
    pub(crate) fn lsm(&self) -> &LsmState {
        &self.lsm
    }
}
