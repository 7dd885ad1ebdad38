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
//! Policy updates are generational (see `gate_common::abi`): a new policy is written into the
//! inactive generation, the CONFIG slot is flipped with one 4-byte write, and only then are the
//! old generation's entries deleted. A program reads the generation once per invocation, so
//! it always sees one complete policy.
mod maps;
pub mod pins;
mod sys;
mod tc;

use std::{
    collections::BTreeMap,
    fs,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{MapData, MapError, RingBuf, lpm_trie::Key},
    programs::{
        CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSockAddr, ProgramError,
        links::{FdLink, LinkError},
    },
};
use gate_common::{
    abi::{
        AllowKey, CONFIG_ACTIVE_GEN, EndpointCounters, EndpointName, EpNameKey, GateInfo,
        MAX_ENDPOINTS, PolicyMeta, PortRuleKey, PrefixV4, PrefixV6, fixed_str, names, programs,
    },
    compile::Compiled,
};
pub use maps::{Maps, Stats};
pub use pins::{Layout, cleanup};
pub use tc::{TcConfig, TcMode};

use crate::cgroup::GatedRoot;

/// The eBPF object built by build.rs (gate-ebpf for bpfel-unknown-none).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/gate"));

#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
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
}

fn map_err(name: &'static str) -> impl FnOnce(MapError) -> LoaderError {
    move |source| LoaderError::Map { name, source }
}

/// One attach point: its pin name and program.
#[derive(Clone, Copy, Debug)]
pub struct Hook {
    /// Name of the pinned link and program (`links/<name>`, `progs/<name>`).
    pub name: &'static str,
    pub program: &'static str,
}

const SOCK_HOOKS: [Hook; 4] = [
    Hook { name: "connect4", program: programs::CONNECT4 },
    Hook { name: "connect6", program: programs::CONNECT6 },
    Hook { name: "sendmsg4", program: programs::SENDMSG4 },
    Hook { name: "sendmsg6", program: programs::SENDMSG6 },
];
pub const EGRESS_HOOK: &str = "egress";

/// Which cgroup_skb egress program to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EgressProgram {
    /// With pid/comm in events where the kernel allows, else without.
    #[default]
    Auto,
    /// With pid/comm (fails where the kernel refuses the helpers).
    Task,
    /// Without pid/comm.
    Notask,
}

/// How the gate came up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// Nothing was pinned: a first install (or after `cleanup`).
    Fresh,
    /// A pinned gate was taken over; it never stopped enforcing.
    Adopted,
}

/// What happened to one hook in [`Gate::attach`].
#[derive(Clone, Debug)]
pub struct HookChange {
    pub hook: &'static str,
    pub program: &'static str,
    /// Program id before (adopted links) and after.
    pub old_prog_id: Option<u32>,
    pub new_prog_id: u32,
}

/// Keys a generation holds, so that it can be emptied after the flip.
#[derive(Default)]
struct Written {
    v4: Vec<Key<PrefixV4>>,
    v6: Vec<Key<PrefixV6>>,
    rules: Vec<PortRuleKey>,
    allowed: BTreeMap<u64, u32>,
    names: u32,
}

/// What `apply` records about a policy besides its tables.
#[derive(Clone, Debug, Default)]
pub struct PolicyInfo {
    pub hash: u64,
    pub platform: String,
    pub endpoint_names: Vec<String>,
    pub terminate: u32,
}

/// The loaded, pinned gate.
pub struct Gate {
    ebpf: Ebpf,
    layout: Layout,
    maps: Maps,
    events: Option<RingBuf<MapData>>,
    active: u32,
    written: [Written; 2],
    info: GateInfo,
    start: Start,
    /// The egress program variant the kernel accepted.
    egress: &'static str,
    /// clsact filters attached by this agent (TC_CLSACT keys).
    clsact_done: std::collections::BTreeSet<u64>,
}

/// A program of the object by name, as its concrete type.
fn program<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, LoaderError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(LoaderError::MissingProgram(name))?
        .try_into()
        .map_err(|source| LoaderError::Program { name, source })
}

impl Gate {
    /// Load and verify the programs; create the maps, or reuse the pinned ones when a gate is
    /// already pinned (nothing attached changes here).
    /// `may_mount`: whether bpffs may be mounted on the pin dir's parent when it is missing
    /// (standalone; never in a pod, where the mount would not outlive the container).
    pub fn open(
        pin_dir: &Path,
        egress: EgressProgram,
        may_mount: bool,
    ) -> Result<Gate, LoaderError> {
        let layout = pins::prepare(pin_dir, may_mount)?;
        let start = if layout.links().is_empty() { Start::Fresh } else { Start::Adopted };
        let mut loader = EbpfLoader::new();
        for name in names::ALL {
            loader.map_pin_path(name, layout.map(name));
        }
        let mut ebpf = loader.load(OBJECT)?;
        for hook in SOCK_HOOKS {
            let prog: &mut CgroupSockAddr = program(&mut ebpf, hook.program)?;
            prog.load().map_err(|source| LoaderError::Program { name: hook.program, source })?;
        }
        let egress = load_egress(&mut ebpf, egress)?;
        let tc: &mut aya::programs::SchedClassifier = program(&mut ebpf, programs::TC)?;
        tc.load().map_err(|source| LoaderError::Program { name: programs::TC, source })?;
        let mut maps = Maps::take(&mut ebpf)?;
        let events = Some(
            ebpf.take_map(names::EVENTS)
                .ok_or(LoaderError::MissingMap(names::EVENTS))?
                .try_into()
                .map_err(map_err(names::EVENTS))?,
        );
        let active = maps.active()?;
        let info = maps.info()?;
        let written = scan(&mut maps, &info, active)?;
        Ok(Gate {
            ebpf,
            layout,
            maps,
            events,
            active,
            written,
            info,
            start,
            egress,
            clsact_done: Default::default(),
        })
    }

    pub fn start(&self) -> Start {
        self.start
    }

    /// What was last applied (for an adopted gate: by the previous agent).
    pub fn info(&self) -> &GateInfo {
        &self.info
    }

    /// Refuse to adopt a gate that protects another cgroup: enforcing elsewhere would open it.
    pub fn check_root(&self, root: &GatedRoot) -> Result<(), LoaderError> {
        let pinned = self.info.root_cgroup_id;
        if self.start == Start::Adopted && pinned != 0 && pinned != root.id {
            return Err(LoaderError::RootMismatch {
                pin_dir: self.layout.dir.parent().map(Path::to_path_buf).unwrap_or_default(),
                pinned: gate_common::abi::fixed_str_value(&self.info.root_path).to_owned(),
                pinned_id: pinned,
                wanted: root.path.clone(),
            });
        }
        Ok(())
    }

    /// Install a compiled policy and its allow set as the next generation and make it live.
    /// On error the live generation is untouched.
    pub fn apply(
        &mut self,
        compiled: &Compiled,
        meta: PolicyMeta,
        allow: &[(u64, u32)],
        root: &GatedRoot,
        policy: &PolicyInfo,
    ) -> Result<(), LoaderError> {
        let next = self.active ^ 1;
        debug_assert_eq!(compiled.generation, next);
        self.clear(next)?;
        let m = &mut self.maps;
        let w = &mut self.written[next as usize];
        for &(plen, data, value) in &compiled.v4 {
            let key = Key::new(plen, data);
            m.v4.insert(&key, value, 0).map_err(map_err(names::PREFIX_V4))?;
            w.v4.push(key);
        }
        for &(plen, data, value) in &compiled.v6 {
            let key = Key::new(plen, data);
            m.v6.insert(&key, value, 0).map_err(map_err(names::PREFIX_V6))?;
            w.v6.push(key);
        }
        for &(key, endpoint) in &compiled.rules {
            m.rules.insert(key, endpoint, 0).map_err(map_err(names::PORT_RULES))?;
            w.rules.push(key);
        }
        for &(cgroup_id, entry) in allow {
            m.allowed
                .insert(AllowKey::new(next, cgroup_id), entry, 0)
                .map_err(map_err(names::ALLOWED))?;
            w.allowed.insert(cgroup_id, entry);
        }
        for (index, name) in policy.endpoint_names.iter().enumerate().take(MAX_ENDPOINTS as usize) {
            let key = EpNameKey { generation: next, index: index as u32 };
            m.names
                .insert(key, EndpointName { name: fixed_str(name) }, 0)
                .map_err(map_err(names::EP_NAMES))?;
            w.names = index as u32 + 1;
        }
        m.meta.set(next, meta, 0).map_err(map_err(names::POLICY_META))?;
        // The flip: one aligned 4-byte write.
        m.config.set(CONFIG_ACTIVE_GEN, next, 0).map_err(map_err(names::CONFIG))?;
        let old = self.active;
        self.active = next;
        self.clear(old)?;
        // Counters are per endpoint index: a new policy starts them afresh.
        for i in 0..meta.endpoints.min(MAX_ENDPOINTS) {
            self.maps
                .ep_counters
                .set(i, EndpointCounters::default(), 0)
                .map_err(map_err(names::EP_COUNTERS))?;
        }
        self.info = GateInfo {
            policy_generation: self.info.policy_generation + 1,
            policy_hash: policy.hash,
            root_cgroup_id: root.id,
            applied_at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            agent_pid: std::process::id(),
            terminate: policy.terminate,
            platform: fixed_str(&policy.platform),
            root_path: fixed_str(&root.path.to_string_lossy()),
        };
        self.maps.info.set(0, self.info, 0).map_err(map_err(names::GATE_INFO))
    }

    /// Record whether established connections are terminated (TERMINATE_*), for `status`.
    pub fn set_terminate(&mut self, terminate: u32) -> Result<(), LoaderError> {
        self.info.terminate = terminate;
        self.maps.info.set(0, self.info, 0).map_err(map_err(names::GATE_INFO))
    }

    /// Make the live allow set equal `allow` (cgroups that appeared under or vanished from a
    /// glob). Single inserts and deletes, each atomic on its own. Returns (added, removed).
    pub fn sync_allow(&mut self, allow: &[(u64, u32)]) -> Result<(usize, usize), LoaderError> {
        let live = self.active;
        let w = &mut self.written[live as usize];
        let want: BTreeMap<u64, u32> = allow.iter().copied().collect();
        let mut added = 0;
        for (&id, &entry) in &want {
            if w.allowed.get(&id) != Some(&entry) {
                self.maps
                    .allowed
                    .insert(AllowKey::new(live, id), entry, 0)
                    .map_err(map_err(names::ALLOWED))?;
                w.allowed.insert(id, entry);
                added += 1;
            }
        }
        let gone: Vec<u64> =
            w.allowed.keys().filter(|id| !want.contains_key(id)).copied().collect();
        for id in &gone {
            ignore_missing(self.maps.allowed.remove(&AllowKey::new(live, *id)))
                .map_err(map_err(names::ALLOWED))?;
            w.allowed.remove(id);
        }
        Ok((added, gone.len()))
    }

    /// Cgroup ids on the live allow set.
    pub fn allowed_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.written[self.active as usize].allowed.keys().copied()
    }

    fn clear(&mut self, generation: u32) -> Result<(), LoaderError> {
        let w = std::mem::take(&mut self.written[generation as usize]);
        let m = &mut self.maps;
        for k in &w.v4 {
            ignore_missing(m.v4.remove(k)).map_err(map_err(names::PREFIX_V4))?;
        }
        for k in &w.v6 {
            ignore_missing(m.v6.remove(k)).map_err(map_err(names::PREFIX_V6))?;
        }
        for k in &w.rules {
            ignore_missing(m.rules.remove(k)).map_err(map_err(names::PORT_RULES))?;
        }
        for id in w.allowed.keys() {
            ignore_missing(m.allowed.remove(&AllowKey::new(generation, *id)))
                .map_err(map_err(names::ALLOWED))?;
        }
        for index in 0..w.names {
            ignore_missing(m.names.remove(&EpNameKey { generation, index }))
                .map_err(map_err(names::EP_NAMES))?;
        }
        Ok(())
    }

    /// The generation the next [`apply`](Self::apply) must be compiled for.
    pub fn next_generation(&self) -> u32 {
        self.active ^ 1
    }

    /// Attach every hook to the gated root, or, where a link is already pinned, swap its
    /// program in place (BPF_LINK_UPDATE). Links are pinned under `links/<hook>`, programs
    /// under `progs/<hook>`.
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
        let hooks =
            SOCK_HOOKS.into_iter().chain([Hook { name: EGRESS_HOOK, program: self.egress }]);
        for hook in hooks {
            let name = hook.program;
            let perr = |source| LoaderError::Program { name, source };
            let link_path = self.layout.link(hook.name);
            let (old_prog_id, fresh_link) = if link_path.exists() {
                let link = sys::obj_get(&link_path).map_err(|source| LoaderError::Io {
                    what: "opening pinned link",
                    path: link_path.clone(),
                    source,
                })?;
                let old = sys::link_info(link.as_fd()).ok().map(|i| i.prog_id);
                let prog = self.ebpf.program(name).ok_or(LoaderError::MissingProgram(name))?;
                let fd = prog.fd().map_err(perr)?;
                sys::link_update(link.as_fd(), fd.as_fd()).map_err(|source| LoaderError::Io {
                    what: "replacing the program of link",
                    path: link_path.clone(),
                    source,
                })?;
                (old, None)
            } else if hook.name == EGRESS_HOOK {
                let prog: &mut CgroupSkb = program(&mut self.ebpf, name)?;
                let id = prog
                    .attach(&cgroup, CgroupSkbAttachType::Egress, CgroupAttachMode::Single)
                    .map_err(perr)?;
                let link = FdLink::try_from(prog.take_link(id).map_err(perr)?)
                    .map_err(|source| LoaderError::Link { name, source })?;
                (None, Some(link))
            } else {
                let prog: &mut CgroupSockAddr = program(&mut self.ebpf, name)?;
                let id = prog.attach(&cgroup, CgroupAttachMode::Single).map_err(perr)?;
                let link = FdLink::try_from(prog.take_link(id).map_err(perr)?)
                    .map_err(|source| LoaderError::Link { name, source })?;
                (None, Some(link))
            };
            if let Some(link) = fresh_link {
                link.pin(&link_path)
                    .map_err(|source| LoaderError::Pin { path: link_path.clone(), source })?;
            }
            let new_prog_id = self.pin_program(hook)?;
            changes.push(HookChange { hook: hook.name, program: name, old_prog_id, new_prog_id });
        }
        Ok(changes)
    }

    /// Pin (or re-pin) the program of a hook; returns its id.
    fn pin_program(&mut self, hook: Hook) -> Result<u32, LoaderError> {
        let name = hook.program;
        let path = self.layout.prog(hook.name);
        if path.exists() {
            fs::remove_file(&path).map_err(|source| LoaderError::Io {
                what: "unpinning the old program",
                path: path.clone(),
                source,
            })?;
        }
        let prog = self.ebpf.program_mut(name).ok_or(LoaderError::MissingProgram(name))?;
        let id = prog.info().map_err(|source| LoaderError::Program { name, source })?.id();
        prog.pin(&path).map_err(|source| LoaderError::Pin { path, source })?;
        Ok(id)
    }

    /// Unpin other ABI versions under the same pin dir, once this one enforces: a clean
    /// hand-over (both enforced while they overlapped). Returns what was removed.
    pub fn retire_other_versions(&self) -> Vec<PathBuf> {
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

    /// The denial event ring buffer (taken once, by the event reader).
    pub fn take_events(&mut self) -> Option<RingBuf<MapData>> {
        self.events.take()
    }

    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    /// Read all counters of the live policy.
    pub fn stats(&self, endpoints: u32) -> Result<Stats, LoaderError> {
        self.maps.stats(endpoints)
    }

    /// Entries the live generation holds, per map, for the capacity metric.
    pub fn usage(&self) -> [(&'static str, usize, u32); 4] {
        use gate_common::abi::{MAX_ALLOWED_CGROUPS, MAX_PORT_RULES};
        let w = &self.written[self.active as usize];
        [
            (names::PREFIX_V4, w.v4.len(), MAX_ENDPOINTS),
            (names::PREFIX_V6, w.v6.len(), MAX_ENDPOINTS),
            (names::PORT_RULES, w.rules.len(), MAX_PORT_RULES),
            (names::ALLOWED, w.allowed.len(), MAX_ALLOWED_CGROUPS),
        ]
    }

    pub fn pin_dir(&self) -> &Path {
        &self.layout.dir
    }

    pub fn egress_program(&self) -> &'static str {
        self.egress
    }
}

/// Rebuild what each generation holds from the maps (an adopted gate's agent kept this in
/// memory only). Leftovers of an apply that was cut short sit in the inactive generation and
/// are cleared by the next apply.
fn scan(maps: &mut Maps, info: &GateInfo, active: u32) -> Result<[Written; 2], LoaderError> {
    let mut w: [Written; 2] = Default::default();
    let generation = |g: [u8; 4]| (u32::from_be_bytes(g) & 1) as usize;
    for k in maps.v4.keys() {
        let k = k.map_err(map_err(names::PREFIX_V4))?;
        w[generation(k.data().generation)].v4.push(k);
    }
    for k in maps.v6.keys() {
        let k = k.map_err(map_err(names::PREFIX_V6))?;
        w[generation(k.data().generation)].v6.push(k);
    }
    for k in maps.rules.keys() {
        let k = k.map_err(map_err(names::PORT_RULES))?;
        w[(k.generation & 1) as usize].rules.push(k);
    }
    for item in maps.allowed.iter() {
        let (k, entry) = item.map_err(map_err(names::ALLOWED))?;
        w[(k.generation & 1) as usize].allowed.insert(k.cgroup_id, entry);
    }
    for k in maps.names.keys() {
        let k = k.map_err(map_err(names::EP_NAMES))?;
        let slot = &mut w[(k.generation & 1) as usize];
        slot.names = slot.names.max(k.index + 1);
    }
    if info.policy_generation > 0 {
        tracing::debug!(
            active,
            live_prefixes = w[active as usize].v4.len() + w[active as usize].v6.len(),
            "found a pinned policy"
        );
    }
    Ok(w)
}

/// Load the egress program; `Auto` prefers the one with task info (pid, comm in events) and
/// falls back to the variant without it where the verifier refuses those helpers.
fn load_egress(ebpf: &mut Ebpf, choice: EgressProgram) -> Result<&'static str, LoaderError> {
    let candidates: &[&'static str] = match choice {
        EgressProgram::Auto => &[programs::EGRESS, programs::EGRESS_NOTASK],
        EgressProgram::Task => &[programs::EGRESS],
        EgressProgram::Notask => &[programs::EGRESS_NOTASK],
    };
    let mut first_err = None;
    for &name in candidates {
        let prog: &mut CgroupSkb = program(ebpf, name)?;
        match prog.load() {
            Ok(()) => {
                if let Some(e) = first_err {
                    tracing::warn!(error = %e, "egress denials will carry no pid/comm on this kernel");
                }
                return Ok(name);
            }
            Err(source) if first_err.is_none() => {
                first_err = Some(LoaderError::Program { name, source });
            }
            Err(source) => return Err(LoaderError::Program { name, source }),
        }
    }
    Err(first_err.unwrap_or(LoaderError::MissingProgram(programs::EGRESS)))
}

fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        r => r,
    }
}
