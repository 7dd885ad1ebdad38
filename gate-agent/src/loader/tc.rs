//! tc programs on named interfaces (`--tc-interface`, `--tc-workload-interface`): defense in
//! depth for frames the cgroup hooks never see (AF_PACKET) and for forwarded traffic of pods
//! and VM-based runtimes. tcx links (kernel 6.6+) are pinned under `links/tc-<dir>-<iface>`
//! like the cgroup links, so they outlive the agent and are swapped in place on upgrade.
use std::{
    collections::BTreeSet,
    ffi::CStr,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::programs::{LinkOrder, SchedClassifier, TcAttachType, links::FdLink, tc::TcAttachOptions};
use gate_common::abi::{names, programs};
use globset::{Glob, GlobSet, GlobSetBuilder};

use super::{Gate, HookChange, LoaderError, map_err, sys};

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

/// Run `f` on a thread inside `netns` (or the current one).
fn in_netns<T: Send>(
    netns: Option<&Path>,
    f: impl FnOnce() -> Result<T, LoaderError> + Send,
) -> Result<T, LoaderError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(path) = netns {
                let file = std::fs::File::open(path).map_err(|source| LoaderError::Io {
                    what: "opening netns",
                    path: path.to_path_buf(),
                    source,
                })?;
                // SAFETY: setns on this thread only, with a valid netns fd.
                if unsafe {
                    libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET)
                } != 0
                {
                    return Err(LoaderError::Io {
                        what: "entering netns",
                        path: path.to_path_buf(),
                        source: std::io::Error::last_os_error(),
                    });
                }
            }
            f()
        })
        .join()
        .map_err(|_| LoaderError::Tc("the tc attach thread panicked".into()))?
    })
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
        let prog_name = programs::TC;
        let ebpf = &mut self.ebpf;
        let workload_map = &mut self.maps.workload;
        in_netns(cfg.netns.as_deref(), move || {
            let prog: &mut SchedClassifier = super::program(ebpf, prog_name)?;
            let perr = |source| LoaderError::Program { name: prog_name, source };
            let mut wanted = BTreeSet::new();
            let mut changes = Vec::new();
            let mut workload_ifindexes = BTreeSet::new();
            for (ifindex, name) in interfaces() {
                let mut targets = Vec::new();
                if egress.is_match(&name) || workload.is_match(&name) {
                    targets.push(("egress", TcAttachType::Egress));
                }
                if workload.is_match(&name) {
                    targets.push(("ingress", TcAttachType::Ingress));
                    workload_ifindexes.insert(ifindex);
                }
                for (dir, attach_type) in targets {
                    let hook = format!("tc-{dir}-{name}");
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
                            Ok(info) if info.cgroup_id as u32 == ifindex => {
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
                                hook: "tc",
                                program: prog_name,
                                old_prog_id: Some(old),
                                new_prog_id: 0,
                            });
                        }
                        Some(_) => {}
                        None => {
                            let id = prog
                                .attach_with_options(
                                    &name,
                                    attach_type,
                                    TcAttachOptions::TcxOrder(LinkOrder::default()),
                                )
                                .map_err(|e| {
                                    LoaderError::Tc(format!(
                                        "attaching to {dir} of {name} (tcx needs kernel 6.6+): {e}"
                                    ))
                                })?;
                            let link = FdLink::try_from(prog.take_link(id).map_err(perr)?)
                                .map_err(|source| LoaderError::Link { name: prog_name, source })?;
                            link.pin(&path).map_err(|source| LoaderError::Pin {
                                path: path.clone(),
                                source,
                            })?;
                            tracing::info!(interface = %name, direction = dir, "tc program attached");
                            changes.push(HookChange {
                                hook: "tc",
                                program: prog_name,
                                old_prog_id: None,
                                new_prog_id: 0,
                            });
                        }
                    }
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
        })
    }
}
