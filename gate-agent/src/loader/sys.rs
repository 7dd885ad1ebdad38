//! The few bpf(2) commands aya 0.14 does not expose for an already pinned link: open it
//! (BPF_OBJ_GET), swap its program (BPF_LINK_UPDATE, 5.7+), describe it
//! (BPF_OBJ_GET_INFO_BY_FD), hold one open by id (BPF_LINK_GET_FD_BY_ID), detach it
//! (BPF_LINK_DETACH, 5.9+); and the load
//! and attach of an `fmod_ret` program (BPF_PROG_LOAD, BPF_RAW_TRACEPOINT_OPEN), a program
//! type aya 0.14 lacks.
use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_RAW_TRACEPOINT_OPEN: libc::c_long = 17;
/// `enum bpf_prog_type` BPF_PROG_TYPE_TRACING.
const BPF_PROG_TYPE_TRACING: u32 = 26;
/// `enum bpf_attach_type` BPF_MODIFY_RETURN.
const BPF_MODIFY_RETURN: u32 = 26;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_CREATE: libc::c_long = 28;
/// `enum bpf_attach_type` BPF_CGROUP_SETSOCKOPT.
pub(super) const BPF_CGROUP_SETSOCKOPT: u32 = 22;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
const BPF_LINK_DETACH: libc::c_long = 34;

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a properly sized, initialised bpf_attr prefix for `cmd`; the kernel
    // zero-extends attributes shorter than its own.
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, cmd, attr as *mut T as *mut libc::c_void, size_of::<T>())
    };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

/// A bpf(2) command that returns a new file descriptor.
fn bpf_fd<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<OwnedFd> {
    let fd = bpf(cmd, attr)?;
    // SAFETY: the commands passed here (BPF_OBJ_GET, BPF_LINK_CREATE, BPF_LINK_GET_FD_BY_ID,
    // BPF_PROG_LOAD, BPF_RAW_TRACEPOINT_OPEN) return a new file descriptor that nothing else
    // owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[repr(C)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// Open a pinned bpf object (link, program or map).
pub(super) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let mut attr = ObjGetAttr { pathname: c.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
    bpf_fd(BPF_OBJ_GET, &mut attr)
}

#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

/// Attach a program to a cgroup with a bpf_link (5.7+): for program types whose aya link
/// cannot be pinned.
pub(super) fn link_create_cgroup(
    prog: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<OwnedFd> {
    let mut attr = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: cgroup.as_raw_fd() as u32,
        attach_type,
        flags: 0,
    };
    bpf_fd(BPF_LINK_CREATE, &mut attr)
}

/// Pin a bpf object (link, program, map) at `path` on bpffs.
pub(super) fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let mut attr =
        ObjGetAttr { pathname: c.as_ptr() as u64, bpf_fd: fd.as_raw_fd() as u32, file_flags: 0 };
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

#[repr(C)]
struct GetFdByIdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

/// A file descriptor of our own on the link `id` (aya's links do not lend theirs): while it
/// is open the link stays attached, pinned or not.
pub(super) fn link_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut attr = GetFdByIdAttr { id, next_id: 0, open_flags: 0 };
    bpf_fd(BPF_LINK_GET_FD_BY_ID, &mut attr)
}

#[repr(C)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// Replace the program of a link in one step: there is no moment without a program.
pub(super) fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkUpdateAttr {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

#[repr(C)]
struct LinkDetachAttr {
    link_fd: u32,
}

/// Detach a link from its target now (5.9+), whoever else holds it: its pin then only names
/// a defunct link.
pub(super) fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkDetachAttr { link_fd: link.as_raw_fd() as u32 };
    bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

/// The head of the BPF_PROG_LOAD attributes, up to `attach_prog_fd` (5.5+).
#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    prog_btf_fd: u32,
    func_info_rec_size: u32,
    func_info: u64,
    func_info_cnt: u32,
    line_info_rec_size: u32,
    line_info: u64,
    line_info_cnt: u32,
    attach_btf_id: u32,
    attach_prog_fd: u32,
    /// `core_relo_cnt` on kernels that know it: zero.
    _pad: u32,
}

const _: () = assert!(size_of::<ProgLoadAttr>() == 120);

/// Load relocated instructions as an `fmod_ret` program on the kernel function whose BTF id
/// is `attach_btf_id`. A rejection carries the verifier's last lines.
pub(super) fn prog_load_fmod_ret(
    name: &str,
    insns: &[aya_obj::generated::bpf_insn],
    license: &std::ffi::CStr,
    attach_btf_id: u32,
) -> io::Result<OwnedFd> {
    // The kernel keeps 15 bytes of a name (and a NUL), as aya does for the programs it loads.
    let mut prog_name = [0u8; 16];
    for (d, s) in prog_name.iter_mut().zip(name.bytes().take(15)) {
        *d = s;
    }
    let load = |log: &mut [u8]| {
        let mut attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_TRACING,
            insn_cnt: u32::try_from(insns.len()).unwrap_or(u32::MAX),
            insns: insns.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: u32::from(!log.is_empty()),
            log_size: log.len() as u32,
            log_buf: if log.is_empty() { 0 } else { log.as_mut_ptr() as u64 },
            kern_version: 0,
            prog_flags: 0,
            prog_name,
            prog_ifindex: 0,
            expected_attach_type: BPF_MODIFY_RETURN,
            prog_btf_fd: 0,
            func_info_rec_size: 0,
            func_info: 0,
            func_info_cnt: 0,
            line_info_rec_size: 0,
            line_info: 0,
            line_info_cnt: 0,
            attach_btf_id,
            attach_prog_fd: 0,
            _pad: 0,
        };
        bpf_fd(BPF_PROG_LOAD, &mut attr)
    };
    // Quietly first, as aya does; with the verifier's log only to say why it failed.
    load(&mut []).or_else(|first| {
        let mut log = vec![0u8; 256 * 1024];
        load(&mut log).map_err(|_| {
            let text = String::from_utf8_lossy(&log);
            let text = text.trim_end_matches('\0').trim();
            let tail: Vec<&str> = text.lines().rev().take(3).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            if tail.is_empty() {
                first
            } else {
                io::Error::new(first.kind(), format!("{first}: verifier: {}", tail.join(" / ")))
            }
        })
    })
}

#[repr(C)]
struct RawTracepointOpenAttr {
    name: u64,
    prog_fd: u32,
    _pad: u32,
}

/// Attach a loaded tracing program (fmod_ret) to the function it was loaded for; the link
/// returned is pinnable like any other.
pub(super) fn raw_tracepoint_open(prog: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut attr = RawTracepointOpenAttr { name: 0, prog_fd: prog.as_raw_fd() as u32, _pad: 0 };
    bpf_fd(BPF_RAW_TRACEPOINT_OPEN, &mut attr)
}

/// `enum bpf_link_type` values we read.
const BPF_LINK_TYPE_CGROUP: u32 = 3;
const BPF_LINK_TYPE_TCX: u32 = 11;

/// The head of `struct bpf_link_info`: the fixed fields and the first 16 bytes of the
/// per-type union.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawLinkInfo {
    link_type: u32,
    id: u32,
    prog_id: u32,
    _pad: u32,
    /// cgroup links: `__u64 cgroup_id; __u32 attach_type;` tcx links: `__u32 ifindex;
    /// __u32 attach_type;`.
    target: [u8; 16],
}

/// What a link is attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkTarget {
    /// A cgroup link: the cgroup v2 id.
    Cgroup(u64),
    /// A tcx link: the interface index.
    Ifindex(u32),
    /// Another kind of link.
    Other,
}

/// A link's id, program and target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LinkInfo {
    pub id: u32,
    pub prog_id: u32,
    pub target: LinkTarget,
}

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// Describe a link.
pub(super) fn link_info(link: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    let mut raw = RawLinkInfo::default();
    let mut attr = InfoAttr {
        bpf_fd: link.as_raw_fd() as u32,
        info_len: size_of::<RawLinkInfo>() as u32,
        info: &mut raw as *mut RawLinkInfo as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    let t = raw.target;
    let target = match raw.link_type {
        BPF_LINK_TYPE_CGROUP => {
            LinkTarget::Cgroup(u64::from_ne_bytes([t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]]))
        }
        BPF_LINK_TYPE_TCX => LinkTarget::Ifindex(u32::from_ne_bytes([t[0], t[1], t[2], t[3]])),
        _ => LinkTarget::Other,
    };
    Ok(LinkInfo { id: raw.id, prog_id: raw.prog_id, target })
}

impl LinkTarget {
    /// The cgroup id or ifindex, for display.
    pub(crate) fn id(self) -> u64 {
        match self {
            LinkTarget::Cgroup(id) => id,
            LinkTarget::Ifindex(i) => u64::from(i),
            LinkTarget::Other => 0,
        }
    }
}

const _: () = assert!(size_of::<RawLinkInfo>() == 32);

/// Wait for an RCU grace period: every BPF program that was running when this is called has
/// finished when it returns (`membarrier(MEMBARRIER_CMD_GLOBAL)` is `synchronize_rcu()`).
/// Fails on kernels that reject the command (nohz_full CPUs).
pub(super) fn rcu_grace_period() -> io::Result<()> {
    Ok(rustix::thread::membarrier(rustix::thread::MembarrierCommand::Global)?)
}
