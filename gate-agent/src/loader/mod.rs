//! Loads the kernel programs, keeps the policy maps, attaches to the gated cgroup root, and
//! adopts a gate that an earlier agent left pinned.
//!
//! Lifecycle (the gate never opens between agents):
//! * **Fresh**: no links pinned under `<pin-dir>/v<ABI>/links`. Maps are created and pinned, the
//!   policy written, then the programs attached with bpf_link and the links pinned.
//! * **Adopt**: links are pinned (the previous agent stopped, crashed or is being upgraded).
//!   The pinned maps are reused as they are, so the old programs keep enforcing the old policy
//!   while the new agent loads. The new policy goes in with a generation flip, then each link's
//!   program is swapped with BPF_LINK_UPDATE: one atomic step per hook, never detach-then-attach.
//! * **ABI change**: a new `v<N>` dir is set up fresh next to the old one; only once the new
//!   gate is attached and ready is the old version unpinned (see [`Gate::retire_other_versions`]).
//!
//! Parts: [`generations`] writes a policy image into the inactive generation and flips;
//! [`attach`] attaches (or swaps) the cgroup programs; [`proxy`] puts the metadata proxy's
//! in and takes them out; [`lsm`] the node-wide LSM programs
//! ([`fmod_ret`] where the kernel runs no BPF LSM);
//! [`tc`] the interface programs;
//! [`maps`] opens the maps typed; [`pins`] is the bpffs layout; [`sys`] the raw bpf(2) calls
//! aya lacks.
mod attach;
mod fmod_ret;
mod generations;
pub(crate) mod lock;
mod lsm;
mod maps;
pub(crate) mod pins;
mod proxy;
mod sys;
mod tc;

use std::path::{Path, PathBuf};

pub(crate) use attach::{HookChange, Repair};
use aya::{
    Ebpf, EbpfLoader,
    maps::{MapData, MapError, RingBuf},
    programs::{CgroupSkb, CgroupSockAddr, CgroupSockopt, ProgramError, SockOps, links::LinkError},
};
use gate_common::{
    abi::{GateInfo, names},
    user::Program,
};
pub(crate) use generations::Install;
pub(crate) use lsm::{LsmState, bpf_lsm_active};
pub(crate) use maps::{Maps, Stats};
pub(crate) use pins::{Layout, cleanup};
pub(crate) use proxy::{ProxySide, RecordReader};
pub(crate) use sys::{LinkInfo, LinkTarget};
pub(crate) use tc::{Framing, TcMode, TcPlan, TcReport, TcTarget};

use crate::cgroup::GatedRoot;

/// The access tally (ACCESS), typed.
pub(crate) type AccessMap =
    aya::maps::HashMap<MapData, gate_common::abi::AccessKey, gate_common::abi::AccessStats>;

/// The eBPF object built by build.rs (gate-ebpf for bpfel-unknown-none).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/gate"));

#[derive(Debug, thiserror::Error)]
pub(crate) enum LoaderError {
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {name}: {source}")]
    Program { name: &'static str, source: ProgramError },
    #[error("map {name}: {source}")]
    Map { name: &'static str, source: MapError },
    #[error("map {0} missing from the eBPF object")]
    MissingMap(&'static str),
    #[error("program {0} missing from the eBPF object")]
    MissingProgram(&'static str),
    #[error("pin dir {path}: {reason}")]
    PinDir { path: PathBuf, reason: String },
    #[error("link of program {name}: {source}")]
    Link { name: &'static str, source: LinkError },
    #[error("pinning {path}: {source}")]
    Pin { path: PathBuf, source: aya::pin::PinError },
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("tc: {0}")]
    Tc(String),
    #[error(transparent)]
    Netns(#[from] crate::netns::NetnsError),
    #[error(
        "the gate pinned under {pin_dir} protects cgroup {pinned} (id {pinned_id}), not {wanted}: \
         run `gate-agent cleanup --pin-dir {pin_dir}` first, or keep --cgroup-root"
    )]
    RootMismatch { pin_dir: PathBuf, pinned: String, pinned_id: u64, wanted: PathBuf },
    #[error(
        "another gate-agent (pid {holder}) holds {pin_dir}: one agent per gate. Stop it first \
         (a DaemonSet update replaces the pod; it never runs two)"
    )]
    Locked { pin_dir: PathBuf, holder: String },
}

fn map_err(name: &'static str) -> impl FnOnce(MapError) -> LoaderError {
    move |source| LoaderError::Map { name, source }
}

/// Which cgroup_skb egress program to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum EgressProgram {
    /// With pid/comm in events where the kernel allows, else without.
    #[default]
    Auto,
    /// With pid/comm (fails where the kernel rejects the helpers).
    Task,
    /// Without pid/comm.
    Notask,
}

/// How the gate came up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// Nothing was pinned: a first install (or after `cleanup`).
    Fresh,
    /// A pinned gate was taken over; it never stopped enforcing.
    Adopted,
}

/// The loaded, pinned gate.
pub(crate) struct Gate {
    ebpf: Ebpf,
    layout: Layout,
    maps: Maps,
    events: Option<RingBuf<MapData>>,
    /// The event ring buffer opened once more, so that its pin can be put back while the
    /// reader owns the first.
    events_pin: Option<MapData>,
    gens: generations::Generations,
    info: GateInfo,
    start: Start,
    /// The egress program variant the kernel accepted.
    egress: Program,
    /// The setsockopt program variant the kernel accepted.
    sockopt: Program,
    /// Whether the LSM programs are loaded (and attached by [`Gate::attach`]).
    lsm: LsmState,
    /// The LSM programs as loaded for `fmod_ret` (aya holds them otherwise).
    fmod_ret: Option<fmod_ret::FmodRet>,
    /// tcx links whose pin failed, by pin name: held open so that their interface stays
    /// guarded ([`TcReport::held`]).
    held_tc: std::collections::BTreeMap<String, std::os::fd::OwnedFd>,
    /// clsact filters attached by this agent (TC_CLSACT keys).
    clsact_done: std::collections::BTreeMap<u64, tc::Framing>,
    /// The metadata proxy whose programs this agent put in; `None`: they are out (or not
    /// decided yet: an adopted gate's are as its predecessor left them until then).
    proxy: Option<ProxySide>,
    /// Held for the agent's life: one agent per gate.
    _lock: lock::PinLock,
}

/// A program of the object, as its concrete type.
fn program<'a, T>(ebpf: &'a mut Ebpf, prog: Program) -> Result<&'a mut T, LoaderError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    let name = prog.name();
    ebpf.program_mut(name)
        .ok_or(LoaderError::MissingProgram(name))?
        .try_into()
        .map_err(|source| LoaderError::Program { name, source })
}

/// Swap in place the program of the pinned link `link` (at `path`, named in the error): there
/// is no moment without a program.
fn replace_program(
    link: std::os::fd::BorrowedFd<'_>,
    prog: std::os::fd::BorrowedFd<'_>,
    path: &Path,
) -> Result<(), LoaderError> {
    sys::link_update(link, prog).map_err(|source| LoaderError::Io {
        what: "replacing the program of link",
        path: path.to_path_buf(),
        source,
    })
}

impl Gate {
    /// Load and verify the programs; create the maps, or reuse the pinned ones when a gate is
    /// already pinned (nothing attached changes here).
    /// `may_mount`: whether bpffs may be mounted on the pin dir's parent when it is missing
    /// (standalone; never in a pod, where the mount would not outlive the container).
    pub(crate) fn open(
        pin_dir: &Path,
        egress: EgressProgram,
        lsm_programs: bool,
        may_mount: bool,
    ) -> Result<Gate, LoaderError> {
        let layout = pins::prepare(pin_dir, may_mount)?;
        let lock = lock::lock(pin_dir)?;
        let start = if layout.links().is_empty() { Start::Fresh } else { Start::Adopted };
        let mut loader = EbpfLoader::new();
        for name in names::ALL {
            loader.map_pin_path(name, layout.map(name));
        }
        let mut ebpf = loader.load(OBJECT)?;
        for prog in [
            Program::Connect4,
            Program::Connect6,
            Program::GetPeerName4,
            Program::GetPeerName6,
            Program::Bind4,
            Program::Bind6,
        ] {
            let p: &mut CgroupSockAddr = program(&mut ebpf, prog)?;
            p.load().map_err(|source| LoaderError::Program { name: prog.name(), source })?;
        }
        let p: &mut SockOps = program(&mut ebpf, Program::SockOps)?;
        p.load()
            .map_err(|source| LoaderError::Program { name: Program::SockOps.name(), source })?;
        let egress = load_egress(&mut ebpf, egress)?;
        let sockopt = load_sockopt(&mut ebpf)?;
        let (lsm, fmod_ret) = if lsm_programs {
            lsm::load(&mut ebpf, OBJECT, &layout)
        } else {
            (LsmState::Inactive("off (--lsm-programs=false)".into()), None)
        };
        for prog in [Program::Tc, Program::TcL3] {
            let tc: &mut aya::programs::SchedClassifier = program(&mut ebpf, prog)?;
            tc.load().map_err(|source| LoaderError::Program { name: prog.name(), source })?;
        }
        let mut maps = Maps::take(&mut ebpf)?;
        let events = Some(
            ebpf.take_map(names::EVENTS)
                .ok_or(LoaderError::MissingMap(names::EVENTS))?
                .try_into()
                .map_err(map_err(names::EVENTS))?,
        );
        let events_pin = MapData::from_pin(layout.map(names::EVENTS)).ok();
        let info = maps.info()?;
        let gens = generations::Generations::scan(&mut maps, &info)?;
        Ok(Gate {
            ebpf,
            layout,
            maps,
            events,
            events_pin,
            gens,
            info,
            start,
            egress,
            sockopt,
            lsm,
            fmod_ret,
            held_tc: Default::default(),
            clsact_done: Default::default(),
            proxy: None,
            _lock: lock,
        })
    }

    pub(crate) fn start(&self) -> Start {
        self.start
    }

    /// What was last applied (for an adopted gate: by the previous agent).
    pub(crate) fn info(&self) -> &GateInfo {
        &self.info
    }

    /// Never adopt a gate that protects another cgroup: enforcing elsewhere would open it.
    /// A gate pinned for the same path whose cgroup was recreated (a new id: a kubelet that
    /// restarted its slices, a node that rebooted with pins kept) is taken over: its links
    /// are re-attached to the cgroup that is there now.
    pub(crate) fn check_root(&self, root: &GatedRoot) -> Result<(), LoaderError> {
        let pinned = self.info.root_cgroup_id;
        let pinned_path = gate_common::abi::fixed_str_value(&self.info.root_path);
        let same_path = Path::new(pinned_path) == root.path;
        if self.start == Start::Adopted && pinned != 0 && pinned != root.id && !same_path {
            return Err(LoaderError::RootMismatch {
                pin_dir: self.layout.dir.parent().map(Path::to_path_buf).unwrap_or_default(),
                pinned: gate_common::abi::fixed_str_value(&self.info.root_path).to_owned(),
                pinned_id: pinned,
                wanted: root.path.clone(),
            });
        }
        Ok(())
    }

    /// Unpin other ABI versions under the same pin dir, once this one enforces: a clean
    /// hand-over (both enforced while they overlapped). Returns what was removed.
    pub(crate) fn retire_other_versions(&self) -> Vec<PathBuf> {
        let Some(pin_dir) = self.layout.dir.parent() else { return Vec::new() };
        let mut removed = Vec::new();
        for (abi, dir) in pins::other_versions(pin_dir) {
            match pins::remove_version(&dir) {
                Ok(()) => {
                    tracing::info!(abi, path = %dir.display(), "retired the gate of another ABI version");
                    removed.push(dir);
                }
                Err(e) => tracing::error!(abi, error = %e, "retiring another ABI version"),
            }
        }
        removed
    }

    /// What the event reader reads (taken once): the denial event ring buffer, and the
    /// access tally (ACCESS, opened again so that the reader needs no lock).
    pub(crate) fn take_events(&mut self) -> Option<(RingBuf<MapData>, AccessMap)> {
        let ring = self.events.take()?;
        let data = MapData::from_pin(self.layout.map(names::ACCESS)).ok()?;
        let tally = aya::maps::Map::from_map_data(data).ok()?.try_into().ok()?;
        Some((ring, tally))
    }

    /// Read all counters of the live policy.
    pub(crate) fn stats(&self, endpoints: u32) -> Result<Stats, LoaderError> {
        self.maps.stats(endpoints)
    }

    pub(crate) fn pin_dir(&self) -> &Path {
        &self.layout.dir
    }

    /// The egress program variant the kernel accepted.
    pub(crate) fn egress_program(&self) -> Program {
        self.egress
    }
}

/// Load the egress program; `Auto` prefers the one with task info (pid, comm in events) and
/// falls back to the variant without it where the verifier rejects those helpers.
fn load_egress(ebpf: &mut Ebpf, choice: EgressProgram) -> Result<Program, LoaderError> {
    let candidates: &[Program] = match choice {
        EgressProgram::Auto => &[Program::Egress, Program::EgressNotask],
        EgressProgram::Task => &[Program::Egress],
        EgressProgram::Notask => &[Program::EgressNotask],
    };
    let mut first_err = None;
    for &prog in candidates {
        let p: &mut CgroupSkb = program(ebpf, prog)?;
        match p.load() {
            Ok(()) => {
                if let Some(e) = first_err {
                    tracing::warn!(error = %e, "egress denials will carry no pid/comm on this kernel");
                }
                return Ok(prog);
            }
            Err(source) if first_err.is_none() => {
                first_err = Some(LoaderError::Program { name: prog.name(), source });
            }
            Err(source) => return Err(LoaderError::Program { name: prog.name(), source }),
        }
    }
    Err(first_err.unwrap_or(LoaderError::MissingProgram(Program::Egress.name())))
}

/// Load the setsockopt program: the one that consults the allow set, or, where the kernel
/// offers cgroup/setsockopt programs no ancestor helper (5.10), the one that denies the side
/// doors to every gated cgroup.
fn load_sockopt(ebpf: &mut Ebpf) -> Result<Program, LoaderError> {
    let p: &mut CgroupSockopt = program(ebpf, Program::Setsockopt)?;
    let Err(first) = p.load() else { return Ok(Program::Setsockopt) };
    let p: &mut CgroupSockopt = program(ebpf, Program::SockoptNoallow)?;
    match p.load() {
        Ok(()) => {
            let first = LoaderError::Program { name: Program::Setsockopt.name(), source: first };
            tracing::warn!(
                error = %first,
                "PACKET_QDISC_BYPASS and AF_XDP setup are denied to every gated workload on \
                 this kernel, allow-listed ones included"
            );
            Ok(Program::SockoptNoallow)
        }
        Err(source) => Err(LoaderError::Program { name: Program::SockoptNoallow.name(), source }),
    }
}

fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        r => r,
    }
}
