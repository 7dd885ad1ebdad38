//! Attaching the cgroup programs to the gated root, or swapping the program of a link an
//! earlier agent pinned (BPF_LINK_UPDATE), and pinning links and programs.
use std::{fs, os::fd::AsFd as _};

use aya::programs::{
    CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSockAddr, CgroupSockopt, links::FdLink,
};
use gate_common::user::{AttachPoint, Program};

use super::{Gate, LoaderError, program, sys};
use crate::cgroup::GatedRoot;

/// What happened to one attach point in [`Gate::attach`].
#[derive(Clone, Debug)]
pub struct HookChange {
    pub point: AttachPoint,
    pub program: Program,
    /// Program id before (adopted links) and after.
    pub old_prog_id: Option<u32>,
    pub new_prog_id: u32,
}

impl Gate {
    /// The program that runs at a cgroup attach point (egress: the variant the kernel took).
    fn program_for(&self, point: AttachPoint) -> Program {
        if point == AttachPoint::Egress { self.egress } else { point.program() }
    }

    /// Attach every cgroup program to the gated root, or, where a link is already pinned, swap
    /// its program in place (BPF_LINK_UPDATE). Links are pinned under `links/<point>`,
    /// programs under `progs/<point>`.
    ///
    /// A cgroup bpf_link always coexists with other programs on the cgroup (the kernel treats
    /// it as multi-attach and rejects BPF_F_ALLOW_MULTI as a link flag), hence `Single`: flags 0.
    pub fn attach(&mut self, root: &GatedRoot) -> Result<Vec<HookChange>, LoaderError> {
        let cgroup = fs::File::open(&root.path).map_err(|source| LoaderError::Io {
            what: "opening cgroup",
            path: root.path.clone(),
            source,
        })?;
        let mut changes = Vec::new();
        for point in AttachPoint::CGROUP {
            let prog = self.program_for(point);
            let name = prog.name();
            let perr = |source| LoaderError::Program { name, source };
            let link_path = self.layout.link(point.pin_name());
            let (old_prog_id, fresh_link) = if link_path.exists() {
                let link = sys::obj_get(&link_path).map_err(|source| LoaderError::Io {
                    what: "opening pinned link",
                    path: link_path.clone(),
                    source,
                })?;
                let old = sys::link_info(link.as_fd()).ok().map(|i| i.prog_id);
                let p = self.ebpf.program(name).ok_or(LoaderError::MissingProgram(name))?;
                let fd = p.fd().map_err(perr)?;
                sys::link_update(link.as_fd(), fd.as_fd()).map_err(|source| LoaderError::Io {
                    what: "replacing the program of link",
                    path: link_path.clone(),
                    source,
                })?;
                (old, None)
            } else if point == AttachPoint::Egress {
                let p: &mut CgroupSkb = program(&mut self.ebpf, prog)?;
                let id = p
                    .attach(&cgroup, CgroupSkbAttachType::Egress, CgroupAttachMode::Single)
                    .map_err(perr)?;
                let link = FdLink::try_from(p.take_link(id).map_err(perr)?)
                    .map_err(|source| LoaderError::Link { name, source })?;
                (None, Some(link))
            } else if point == AttachPoint::Setsockopt {
                // aya's link for this type cannot be pinned: create the bpf_link directly.
                let p: &mut CgroupSockopt = program(&mut self.ebpf, prog)?;
                let fd = p.fd().map_err(perr)?;
                let link =
                    sys::link_create_cgroup(fd.as_fd(), cgroup.as_fd(), sys::BPF_CGROUP_SETSOCKOPT)
                        .map_err(|source| LoaderError::Io {
                            what: "attaching with a bpf_link to",
                            path: root.path.clone(),
                            source,
                        })?;
                sys::obj_pin(link.as_fd(), &link_path).map_err(|source| LoaderError::Io {
                    what: "pinning",
                    path: link_path.clone(),
                    source,
                })?;
                (None, None)
            } else {
                let p: &mut CgroupSockAddr = program(&mut self.ebpf, prog)?;
                let id = p.attach(&cgroup, CgroupAttachMode::Single).map_err(perr)?;
                let link = FdLink::try_from(p.take_link(id).map_err(perr)?)
                    .map_err(|source| LoaderError::Link { name, source })?;
                (None, Some(link))
            };
            if let Some(link) = fresh_link {
                link.pin(&link_path)
                    .map_err(|source| LoaderError::Pin { path: link_path.clone(), source })?;
            }
            let new_prog_id = self.pin_program(point, prog)?;
            changes.push(HookChange { point, program: prog, old_prog_id, new_prog_id });
        }
        Ok(changes)
    }

    /// Pin (or re-pin) the program of an attach point; returns its id.
    fn pin_program(&mut self, point: AttachPoint, prog: Program) -> Result<u32, LoaderError> {
        let name = prog.name();
        let path = self.layout.prog(point.pin_name());
        if path.exists() {
            fs::remove_file(&path).map_err(|source| LoaderError::Io {
                what: "unpinning the old program",
                path: path.clone(),
                source,
            })?;
        }
        let p = self.ebpf.program_mut(name).ok_or(LoaderError::MissingProgram(name))?;
        let id = p.info().map_err(|source| LoaderError::Program { name, source })?.id();
        p.pin(&path).map_err(|source| LoaderError::Pin { path, source })?;
        Ok(id)
    }
}
