//! The cgroup programs on the gated root: attaching them with bpf_links, swapping the
//! program of a link an earlier agent pinned (BPF_LINK_UPDATE), pinning links and programs —
//! and putting back what went missing while the agent runs ([`Gate::repair`]): a link that
//! was detached or unpinned, a pin that was removed, a root that was recreated. The metadata
//! proxy's programs come and go with the proxy ([`super::proxy`]); while they are in, they are
//! kept whole here like the gate's.
use std::{fs, os::fd::AsFd as _, path::Path};

use gate_common::{
    abi::names,
    user::{AttachPoint, Program},
};

use super::{Gate, LinkTarget, LoaderError, sys};
use crate::cgroup::GatedRoot;

/// What happened to one attach point in [`Gate::attach`].
#[derive(Clone, Debug)]
pub(crate) struct HookChange {
    pub point: AttachPoint,
    pub program: Program,
    /// Program id before (adopted links) and after.
    pub old_prog_id: Option<u32>,
    pub new_prog_id: u32,
}

/// Something [`Gate::repair`] found missing and put back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Repair {
    /// The link of this attach point was missing, detached, or on another cgroup.
    Link(AttachPoint),
    /// The pin of this map was removed.
    MapPin(&'static str),
    /// The pin of this attach point's program was removed.
    ProgramPin(AttachPoint),
}

impl Repair {
    /// The `what` label of the repair metric.
    pub(crate) fn what(&self) -> &'static str {
        match self {
            Repair::Link(_) => "link",
            Repair::MapPin(_) => "map-pin",
            Repair::ProgramPin(_) => "program-pin",
        }
    }
}

impl std::fmt::Display for Repair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Repair::Link(p) => write!(f, "link {p}"),
            Repair::MapPin(m) => write!(f, "map pin {m}"),
            Repair::ProgramPin(p) => write!(f, "program pin {p}"),
        }
    }
}

/// `enum bpf_attach_type` of a cgroup attach point.
fn attach_type(point: AttachPoint) -> u32 {
    match point {
        AttachPoint::Egress => 1,    // BPF_CGROUP_INET_EGRESS
        AttachPoint::Connect4 => 10, // BPF_CGROUP_INET4_CONNECT
        AttachPoint::Connect6 => 11, // BPF_CGROUP_INET6_CONNECT
        AttachPoint::Setsockopt => sys::BPF_CGROUP_SETSOCKOPT,
        AttachPoint::SockOps | AttachPoint::ProxySockOps => 3, // BPF_CGROUP_SOCK_OPS
        AttachPoint::Bind4 => 8,                               // BPF_CGROUP_INET4_BIND
        AttachPoint::Bind6 => 9,                               // BPF_CGROUP_INET6_BIND
        AttachPoint::GetPeerName4 => 29,                       // BPF_CGROUP_INET4_GETPEERNAME
        AttachPoint::GetPeerName6 => 30,                       // BPF_CGROUP_INET6_GETPEERNAME
        AttachPoint::Tc
        | AttachPoint::LsmSetsockopt
        | AttachPoint::LsmSocket
        | AttachPoint::LsmBind => u32::MAX,
    }
}

/// The state of one attach point's link.
enum LinkState {
    /// Pinned and attached to the root: with `update`, its program was swapped (old id).
    Live(Option<u32>),
    /// Missing, detached or elsewhere: a new link was attached and pinned.
    Created,
}

impl Gate {
    /// The program that runs at a cgroup attach point (egress and setsockopt: the variant
    /// the kernel took).
    fn program_for(&self, point: AttachPoint) -> Program {
        match point {
            AttachPoint::Egress => self.egress,
            AttachPoint::Setsockopt => self.sockopt,
            _ => point.program(),
        }
    }

    /// Attach the gate's cgroup programs to the gated root, or, where a link is already
    /// pinned and attached there, swap its program in place (BPF_LINK_UPDATE: never
    /// detach-then-attach). Links are pinned under `links/<point>`, programs under
    /// `progs/<point>`. The metadata proxy's are left as they are: [`Gate::proxy_on`] and
    /// [`Gate::proxy_off`] decide them.
    pub(crate) fn attach(&mut self, root: &GatedRoot) -> Result<Vec<HookChange>, LoaderError> {
        let changes = self.attach_points(&AttachPoint::GATE, root)?;
        self.attach_lsm();
        Ok(changes)
    }

    /// Attach (or swap in place) the programs of `points` on `target`.
    ///
    /// A cgroup bpf_link always coexists with other programs on the cgroup (the kernel treats
    /// it as multi-attach), so the link takes no flags.
    pub(super) fn attach_points(
        &mut self,
        points: &[AttachPoint],
        target: &GatedRoot,
    ) -> Result<Vec<HookChange>, LoaderError> {
        let mut changes = Vec::new();
        for &point in points {
            let prog = self.program_for(point);
            let old_prog_id = match self.ensure_link(point, target, true)? {
                LinkState::Live(old) => old,
                LinkState::Created => None,
            };
            let new_prog_id = self.pin_program(point, prog)?;
            changes.push(HookChange { point, program: prog, old_prog_id, new_prog_id });
        }
        Ok(changes)
    }

    /// The cgroup attach points that must be live now, each with the cgroup it is on: the
    /// gate's on `root`, and while the metadata proxy's programs are in, theirs (the proxy's
    /// accepted sockets' on its own cgroup, where that is not below the root).
    fn live_points(&self, root: &GatedRoot) -> Vec<(AttachPoint, GatedRoot)> {
        let mut points: Vec<_> = AttachPoint::GATE.iter().map(|&p| (p, root.clone())).collect();
        if let Some(side) = &self.proxy {
            points.extend(AttachPoint::PROXY.iter().map(|&p| (p, root.clone())));
            if !side.below(root) {
                points.push((AttachPoint::ProxySockOps, side.own.clone()));
            }
        }
        points
    }

    /// Check every pin and link against `root` and put back what is missing: re-pin maps and
    /// programs from the agent's own descriptors, re-attach links that were detached,
    /// unpinned or are on another cgroup (a root recreated under the same path). Returns what
    /// was repaired; an error means the gate is not whole.
    pub(crate) fn repair(&mut self, root: &GatedRoot) -> Result<Vec<Repair>, LoaderError> {
        let mut repaired = Vec::new();
        for sub in ["maps", "progs", "links"] {
            let dir = self.layout.dir.join(sub);
            fs::create_dir_all(&dir).map_err(|source| LoaderError::Io {
                what: "recreating",
                path: dir,
                source,
            })?;
        }
        for name in names::ALL {
            let path = self.layout.map(name);
            if path.exists() {
                continue;
            }
            let data = self.maps.data(name).or(if name == names::EVENTS {
                self.events_pin.as_ref()
            } else {
                None
            });
            if let Some(data) = data {
                data.pin(&path).map_err(|source| LoaderError::Pin { path, source })?;
                repaired.push(Repair::MapPin(name));
            }
        }
        for (point, target) in self.live_points(root) {
            if let LinkState::Created = self.ensure_link(point, &target, false)? {
                repaired.push(Repair::Link(point));
            }
            if !self.layout.prog(point.pin_name()).exists() {
                self.pin_program(point, self.program_for(point))?;
                repaired.push(Repair::ProgramPin(point));
            }
        }
        self.repair_lsm(&mut repaired)?;
        Ok(repaired)
    }

    /// Make the link of `point` live on `target`: keep it (swapping its program when
    /// `update`) if it is pinned and attached there, else attach a new one and pin it.
    fn ensure_link(
        &mut self,
        point: AttachPoint,
        target: &GatedRoot,
        update: bool,
    ) -> Result<LinkState, LoaderError> {
        let prog = self.program_for(point);
        let name = prog.name();
        let perr = |source| LoaderError::Program { name, source };
        let link_path = self.layout.link(point.pin_name());
        if link_path.exists() {
            let link = sys::obj_get(&link_path).map_err(|source| LoaderError::Io {
                what: "opening pinned link",
                path: link_path.clone(),
                source,
            })?;
            let info = sys::link_info(link.as_fd()).ok();
            if info.is_some_and(|i| i.target == LinkTarget::Cgroup(target.id)) {
                if !update {
                    return Ok(LinkState::Live(None));
                }
                let p = self.ebpf.program(name).ok_or(LoaderError::MissingProgram(name))?;
                let fd = p.fd().map_err(perr)?;
                super::replace_program(link.as_fd(), fd.as_fd(), &link_path)?;
                return Ok(LinkState::Live(info.map(|i| i.prog_id)));
            }
            // Detached (its cgroup is gone) or on another cgroup: replace it.
            fs::remove_file(&link_path).map_err(|source| LoaderError::Io {
                what: "unpinning a stale link",
                path: link_path.clone(),
                source,
            })?;
        }
        self.link_cgroup(point, &target.path)?;
        Ok(LinkState::Created)
    }

    /// Attach the program of `point` to the cgroup at `dir` with a new bpf_link and pin it
    /// under `links/<point>`.
    pub(super) fn link_cgroup(&self, point: AttachPoint, dir: &Path) -> Result<(), LoaderError> {
        let name = self.program_for(point).name();
        let cgroup = fs::File::open(dir).map_err(|source| LoaderError::Io {
            what: "opening cgroup",
            path: dir.to_path_buf(),
            source,
        })?;
        let p = self.ebpf.program(name).ok_or(LoaderError::MissingProgram(name))?;
        let fd = p.fd().map_err(|source| LoaderError::Program { name, source })?;
        let link = sys::link_create_cgroup(fd.as_fd(), cgroup.as_fd(), attach_type(point))
            .map_err(|source| LoaderError::Io {
                what: "attaching with a bpf_link to",
                path: dir.to_path_buf(),
                source,
            })?;
        let link_path = self.layout.link(point.pin_name());
        sys::obj_pin(link.as_fd(), &link_path).map_err(|source| LoaderError::Io {
            what: "pinning",
            path: link_path,
            source,
        })
    }

    /// Pin (or re-pin) the program of an attach point; returns its id.
    pub(super) fn pin_program(
        &mut self,
        point: AttachPoint,
        prog: Program,
    ) -> Result<u32, LoaderError> {
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
