//! What is attached to a cgroup, as `bpftool cgroup show` lists it (bpftool is not on every
//! machine the tests run on): the kernel's own answer (BPF_PROG_QUERY), not the agent's pins.
use std::{fs::File, os::fd::AsRawFd as _, path::Path};

use anyhow::{Context as _, Result};

const BPF_PROG_QUERY: libc::c_long = 16;

/// `enum bpf_attach_type` of the cgroup hooks the tests ask about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupHook {
    SockOps = 3,
    Bind4 = 8,
    Bind6 = 9,
    GetPeerName4 = 29,
    GetPeerName6 = 30,
}

/// The head of the BPF_PROG_QUERY attributes (the fields 5.10 knows; the kernel takes a
/// shorter attribute as zero-extended).
#[repr(C)]
#[derive(Default)]
struct QueryAttr {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
}

/// The names of the programs attached directly to the cgroup at `dir` for `hook` (not those
/// it inherits from its ancestors).
pub fn attached(dir: &Path, hook: CgroupHook) -> Result<Vec<String>> {
    let cgroup = File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    let mut ids = [0u32; 64];
    let mut attr = QueryAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_type: hook as u32,
        prog_ids: ids.as_mut_ptr() as u64,
        prog_cnt: ids.len() as u32,
        ..QueryAttr::default()
    };
    // SAFETY: `attr` is a BPF_PROG_QUERY attribute whose `prog_ids` points at `ids`, which
    // holds `prog_cnt` entries and outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_QUERY,
            &mut attr as *mut QueryAttr as *mut libc::c_void,
            size_of::<QueryAttr>(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("BPF_PROG_QUERY {hook:?} on {}", dir.display()));
    }
    let ids = &ids[..(attr.prog_cnt as usize).min(ids.len())];
    let loaded: Vec<_> = aya::programs::loaded_programs().flatten().collect();
    Ok(ids
        .iter()
        .map(|id| {
            loaded
                .iter()
                .find(|p| p.id() == *id)
                .and_then(|p| p.name_as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("id {id}"))
        })
        .collect())
}
