//! tc programs on named interfaces (`--tc-interface`, `--tc-workload-interface`): defense in
//! depth for frames the cgroup hooks never see (AF_PACKET) and for forwarded traffic of pods
//! and VM-based runtimes.
//!
//! * **tcx** (kernel 6.6+): links pinned under `links/tc-<dir>-<iface>` like the cgroup links,
//!   so they outlive the agent and are swapped in place (BPF_LINK_UPDATE) on upgrade.
//! * **clsact** (older kernels, RHEL 9): a cls_bpf filter with our fixed priority and handle.
//!   The kernel keeps it after the agent exits; a new agent replaces it in place (netlink
//!   replace of the same priority/handle). Filters are recorded in the TC_CLSACT map so that
//!   `cleanup` can find and remove them.
use std::{collections::BTreeSet, ffi::CStr, os::fd::AsFd as _, path::PathBuf};

use aya::{
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        links::FdLink,
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    },
    util::KernelVersion,
};
use gate_common::{
    abi::{TcClsact, fixed_str, fixed_str_value, names},
    user::{AttachPoint, Program, TcDirection},
};
use globset::{Glob, GlobSet, GlobSetBuilder};

use super::{Gate, HookChange, LinkTarget, LoaderError, map_err, sys};
use crate::netns::{self, Netns};

/// Interfaces to guard, as globs over interface names.
#[derive(Clone, Debug, Default)]
pub struct TcConfig {
    /// Egress of these interfaces (uplinks): drop gated sockets' packets to protected endpoints.
    pub egress: Vec<String>,
    /// Ingress of these interfaces (pod veths, VM taps: workload-facing): drop everything to
    /// protected endpoints; forwarded packets from them are also dropped at egress.
    pub workload: Vec<String>,
    /// Network namespace of the interfaces (a /run/netns/ or /proc/PID/ns/net path); default
    /// the agent's own.
    pub netns: Option<PathBuf>,
    pub mode: TcMode,
}

/// How tc programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TcMode {
    /// tcx where the kernel has it (6.6+), else clsact.
    #[default]
    Auto,
    Tcx,
    Clsact,
}

/// Priority and handle of our clsact filters: fixed, so that a new agent replaces the old
/// agent's filter in place.
const CLSACT_PRIORITY: u16 = 0x4d47;
const CLSACT_HANDLE: TcHandle = TcHandle::new(0, 0x4d47);

fn use_tcx(mode: TcMode) -> bool {
    match mode {
        TcMode::Tcx => true,
        TcMode::Clsact => false,
        TcMode::Auto => KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0)),
    }
}

impl TcConfig {
    pub fn is_empty(&self) -> bool {
        self.egress.is_empty() && self.workload.is_empty()
    }
}

fn globset(patterns: &[String]) -> Result<GlobSet, LoaderError> {
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        b.add(Glob::new(p).map_err(|e| LoaderError::Tc(format!("interface glob {p:?}: {e}")))?);
    }
    b.build().map_err(|e| LoaderError::Tc(e.to_string()))
}

/// (ifindex, name) of every interface of the current thread's network namespace.
fn interfaces() -> Vec<(u32, String)> {
    let mut out = Vec::new();
    // SAFETY: if_nameindex returns a list terminated by a zero entry, freed below.
    unsafe {
        let list = libc::if_nameindex();
        if list.is_null() {
            return out;
        }
        let mut p = list;
        while (*p).if_index != 0 && !(*p).if_name.is_null() {
            let name = CStr::from_ptr((*p).if_name).to_string_lossy().into_owned();
            out.push(((*p).if_index, name));
            p = p.add(1);
        }
        libc::if_freenameindex(list);
    }
    out
}

impl Gate {
    /// Attach the tc program to every interface the config matches that has none yet, swap the
    /// program of already pinned tc links when `update` (agent start), and unpin tc links of
    /// interfaces no longer matched or gone. Keeps WORKLOAD_IFACES in step.
    pub fn sync_tc(
        &mut self,
        cfg: &TcConfig,
        update: bool,
    ) -> Result<Vec<HookChange>, LoaderError> {
        let egress = globset(&cfg.egress)?;
        let workload = globset(&cfg.workload)?;
        let layout = self.layout.clone();
        let prog_name = Program::Tc.name();
        let ebpf = &mut self.ebpf;
        let workload_map = &mut self.maps.workload;
        let clsact_map = &mut self.maps.clsact;
        let clsact_done = &mut self.clsact_done;
        let tcx = use_tcx(cfg.mode);
        let netns_str =
            cfg.netns.as_deref().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        let target = cfg.netns.as_deref().map_or(Netns::Current, Netns::Path);
        netns::run_in(target, "mg-tc", move || {
            let prog: &mut SchedClassifier = super::program(ebpf, Program::Tc)?;
            let perr = |source| LoaderError::Program { name: prog_name, source };
            let mut wanted = BTreeSet::new();
            let mut wanted_clsact = BTreeSet::new();
            let mut changes = Vec::new();
            let mut workload_ifindexes = BTreeSet::new();
            for (ifindex, name) in interfaces() {
                let mut targets = Vec::new();
                if egress.is_match(&name) || workload.is_match(&name) {
                    targets.push(TcDirection::Egress);
                }
                if workload.is_match(&name) {
                    targets.push(TcDirection::Ingress);
                    workload_ifindexes.insert(ifindex);
                }
                for dir in targets {
                    let attach_type = attach_type(dir);
                    let hook = AttachPoint::tc_pin_name(dir, &name);
                    if !tcx {
                        let key = dir.clsact_key(ifindex);
                        wanted_clsact.insert(key);
                        if update || !clsact_done.contains(&key) {
                            attach_clsact(prog, &name, attach_type)?;
                            let rec =
                                TcClsact { ifname: fixed_str(&name), netns: fixed_str(&netns_str) };
                            clsact_map.insert(key, rec, 0).map_err(map_err(names::TC_CLSACT))?;
                            clsact_done.insert(key);
                            tracing::info!(interface = %name, direction = dir.name(), mode = "clsact", "tc program attached");
                            changes.push(HookChange {
                                point: AttachPoint::Tc,
                                program: Program::Tc,
                                old_prog_id: None,
                                new_prog_id: 0,
                            });
                        }
                        continue;
                    }
                    let path = layout.link(&hook);
                    wanted.insert(hook.clone());
                    let pinned = if path.exists() {
                        let fd = sys::obj_get(&path).map_err(|source| LoaderError::Io {
                            what: "opening pinned link",
                            path: path.clone(),
                            source,
                        })?;
                        match sys::link_info(fd.as_fd()) {
                            // Still attached to this very interface.
                            Ok(info) if info.target == LinkTarget::Ifindex(ifindex) => {
                                Some((fd, info.prog_id))
                            }
                            _ => {
                                let _ = std::fs::remove_file(&path);
                                None
                            }
                        }
                    } else {
                        None
                    };
                    let prog_fd = prog.fd().map_err(perr)?;
                    match pinned {
                        Some((fd, old)) if update => {
                            sys::link_update(fd.as_fd(), prog_fd.as_fd()).map_err(|source| {
                                LoaderError::Io {
                                    what: "replacing the program of link",
                                    path: path.clone(),
                                    source,
                                }
                            })?;
                            changes.push(HookChange {
                                point: AttachPoint::Tc,
                                program: Program::Tc,
                                old_prog_id: Some(old),
                                new_prog_id: 0,
                            });
                        }
                        Some(_) => {}
                        None => {
                            let id = prog
                                .attach_with_options(&name, attach_type, TcAttachOptions::TcxOrder(LinkOrder::default()))
                                .map_err(|e| LoaderError::Tc(format!(
                                    "attaching to {dir} of {name} (tcx needs kernel 6.6+; --tc-mode clsact for older kernels): {e}"
                                )))?;
                            let link = FdLink::try_from(prog.take_link(id).map_err(perr)?)
                                .map_err(|source| LoaderError::Link { name: prog_name, source })?;
                            link.pin(&path).map_err(|source| LoaderError::Pin {
                                path: path.clone(),
                                source,
                            })?;
                            tracing::info!(interface = %name, direction = dir.name(), mode = "tcx", "tc program attached");
                            changes.push(HookChange {
                                point: AttachPoint::Tc,
                                program: Program::Tc,
                                old_prog_id: None,
                                new_prog_id: 0,
                            });
                        }
                    }
                }
            }
            // clsact filters of interfaces that went away or are no longer named.
            let recorded: Vec<(u64, TcClsact)> = clsact_map.iter().flatten().collect();
            for (key, rec) in recorded {
                if !wanted_clsact.contains(&key) {
                    detach_clsact(&rec, TcDirection::of_clsact_key(key));
                    let _ = clsact_map.remove(&key);
                    clsact_done.remove(&key);
                }
            }
            // Interfaces that went away or are no longer named: their links go.
            for hook in layout.links().into_iter().filter(|h| h.starts_with("tc-")) {
                if !wanted.contains(&hook) {
                    let _ = std::fs::remove_file(layout.link(&hook));
                    tracing::info!(link = %hook, "tc link removed (interface gone or no longer matched)");
                }
            }
            let present: BTreeSet<u32> = workload_map.keys().flatten().collect();
            for i in workload_ifindexes.difference(&present) {
                workload_map.insert(*i, 1, 0).map_err(map_err(names::WORKLOAD_IFACES))?;
            }
            for i in present.difference(&workload_ifindexes) {
                let _ = workload_map.remove(i);
            }
            Ok(changes)
        })?
    }
}

/// Attach (or replace in place) our clsact filter on `iface` and leave it in the kernel.
fn attach_clsact(
    prog: &mut SchedClassifier,
    iface: &str,
    attach_type: TcAttachType,
) -> Result<(), LoaderError> {
    let err = |e: String| LoaderError::Tc(format!("clsact on {iface}: {e}"));
    match tc::qdisc_add_clsact(iface) {
        Ok(()) => {}
        Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(e) => return Err(err(format!("adding the clsact qdisc: {e}"))),
    }
    // Replace the filter a previous agent left (same priority and handle) in one step; if
    // there is none, create it.
    let replaced =
        SchedClassifierLink::attached(iface, attach_type, CLSACT_PRIORITY, CLSACT_HANDLE, None)
            .map_err(|e| err(e.to_string()))
            .and_then(|old| prog.attach_to_link(old).map_err(|e| err(e.to_string())));
    let id = match replaced {
        Ok(id) => id,
        Err(_) => prog
            .attach_with_options(
                iface,
                attach_type,
                TcAttachOptions::Netlink(NlOptions {
                    priority: CLSACT_PRIORITY,
                    handle: CLSACT_HANDLE,
                    classid: None,
                }),
            )
            .map_err(|e| err(e.to_string()))?,
    };
    let link = prog.take_link(id).map_err(|e| err(e.to_string()))?;
    // Dropping the link would remove the filter: the kernel keeps it after we exit.
    std::mem::forget(link);
    Ok(())
}

fn attach_type(dir: TcDirection) -> TcAttachType {
    match dir {
        TcDirection::Ingress => TcAttachType::Ingress,
        TcDirection::Egress => TcAttachType::Egress,
    }
}

/// Remove our clsact filter recorded in `rec` (best effort: the interface or netns may be gone).
fn detach_clsact(rec: &TcClsact, dir: TcDirection) {
    let iface = fixed_str_value(&rec.ifname).to_owned();
    let netns = fixed_str_value(&rec.netns);
    let netns = (!netns.is_empty()).then(|| PathBuf::from(netns));
    let target = netns.as_deref().map_or(Netns::Current, Netns::Path);
    let r = netns::run_in(target, "mg-tc", || {
        tc::qdisc_detach_program(&iface, attach_type(dir), Program::Tc.name())
            .map_err(|e| LoaderError::Tc(e.to_string()))
    })
    .map_err(LoaderError::from)
    .and_then(|r| r);
    match r {
        Ok(()) => tracing::info!(interface = %iface, "tc clsact filter removed"),
        Err(e) => tracing::warn!(interface = %iface, error = %e, "removing tc clsact filter"),
    }
}

/// Remove every clsact filter recorded under the pin dir (part of `cleanup`).
pub fn cleanup_clsact(layout: &super::Layout) {
    let Ok(data) = aya::maps::MapData::from_pin(layout.map(names::TC_CLSACT)) else { return };
    let Ok(map) = aya::maps::Map::from_map_data(data) else { return };
    let Ok(map) = aya::maps::HashMap::<_, u64, TcClsact>::try_from(map) else { return };
    for (key, rec) in map.iter().flatten() {
        detach_clsact(&rec, TcDirection::of_clsact_key(key));
    }
}
