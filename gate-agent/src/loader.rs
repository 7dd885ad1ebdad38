//! Loads the kernel programs, keeps the policy maps, attaches to the gated cgroup root.
//!
//! Policy updates are generational (see `gate_common::abi`): a new policy is written into the
//! inactive generation, the CONFIG slot is flipped with one 4-byte write, and only then are the
//! old generation's entries deleted. A program reads the generation once per invocation, so
//! it always sees one complete policy.
//!
//! Attachment uses bpf_link (kernel 5.7+, so RHEL 9 / RHCOS 5.14 included) in multi mode, so it
//! coexists with other programs on the same cgroup. Links and maps are pinned under
//! `<pin-dir>/v<ABI>/`: enforcement outlives the agent process; `gate-agent cleanup` is the
//! only way to remove it.
use std::{
    fs,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, MapData, MapError, PerCpuArray, RingBuf, lpm_trie::Key},
    programs::{
        CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSockAddr, ProgramError,
        links::{FdLink, LinkError, PinnedLink},
    },
};
use gate_common::{
    abi::{
        ABI_VERSION, AllowKey, CONFIG_ACTIVE_GEN, EndpointCounters, MAX_ENDPOINTS, NUM_HOOKS,
        NUM_VERDICTS, PolicyMeta, PortRuleKey, PrefixV4, PrefixV6, PrefixValue, STAT_EVENTS_LOST,
        names, programs, stat_slot,
    },
    compile::Compiled,
};

use crate::cgroup::GatedRoot;

/// The eBPF object built by build.rs (gate-ebpf for bpfel-unknown-none).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/gate"));

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

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
    Link { name: &'static str, source: aya::programs::links::LinkError },
    #[error("pinning {path}: {source}")]
    Pin { path: PathBuf, source: aya::pin::PinError },
    #[error("opening cgroup {path}: {source}")]
    Cgroup { path: PathBuf, source: std::io::Error },
}

fn map_err(name: &'static str) -> impl FnOnce(MapError) -> LoaderError {
    move |source| LoaderError::Map { name, source }
}

/// Keys a generation holds, so that it can be emptied after the flip.
#[derive(Default)]
struct Written {
    v4: Vec<Key<PrefixV4>>,
    v6: Vec<Key<PrefixV6>>,
    rules: Vec<PortRuleKey>,
    allowed: Vec<AllowKey>,
}

/// Counters read back from the kernel.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// `[hook][verdict]` summed over CPUs.
    pub decisions: Vec<Vec<u64>>,
    pub events_lost: u64,
    pub endpoints: Vec<EndpointCounters>,
}

/// The loaded, pinned gate.
pub struct Gate {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    config: Array<MapData, u32>,
    meta: Array<MapData, PolicyMeta>,
    v4: LpmTrie<MapData, PrefixV4, PrefixValue>,
    v6: LpmTrie<MapData, PrefixV6, PrefixValue>,
    rules: HashMap<MapData, PortRuleKey, u32>,
    allowed: HashMap<MapData, AllowKey, u32>,
    ep_counters: Array<MapData, EndpointCounters>,
    stats: PerCpuArray<MapData, u64>,
    events: Option<RingBuf<MapData>>,
    active: u32,
    written: [Written; 2],
    links: Vec<PinnedLink>,
    /// The egress program variant the kernel accepted.
    egress: &'static str,
    /// Policy generation counter (monotonic, for status and metrics); the map generation
    /// is its low bit.
    pub generation: u64,
}

/// `<pin-dir>/v<ABI>`.
pub fn versioned(pin_dir: &Path) -> PathBuf {
    pin_dir.join(format!("v{ABI_VERSION}"))
}

/// Mount bpffs at the pin dir's parent if that is not on bpffs yet, then create the pin dir.
fn prepare_pin_dir(pin_dir: &Path) -> Result<PathBuf, LoaderError> {
    let err = |reason: String| LoaderError::PinDir { path: pin_dir.to_path_buf(), reason };
    let parent = pin_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| err("has no parent directory to mount bpffs on".into()))?;
    fs::create_dir_all(parent).map_err(|e| err(format!("creating {}: {e}", parent.display())))?;
    if statfs_type(parent).map_err(|e| err(format!("statfs {}: {e}", parent.display())))?
        != BPF_FS_MAGIC
    {
        mount_bpffs(parent)
            .map_err(|e| err(format!("mounting bpffs on {}: {e}", parent.display())))?;
        tracing::info!(path = %parent.display(), "mounted bpffs");
    }
    let dir = versioned(pin_dir);
    if dir.join("links").exists() {
        return Err(err(format!(
            "a gate is already pinned at {}; stop the other agent or run `gate-agent cleanup --pin-dir {}`",
            dir.display(),
            pin_dir.display()
        )));
    }
    for sub in ["maps", "links"] {
        fs::create_dir_all(dir.join(sub)).map_err(|e| err(format!("creating {sub}/: {e}")))?;
    }
    Ok(dir)
}

fn statfs_type(path: &Path) -> std::io::Result<i64> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64)
}

fn mount_bpffs(path: &Path) -> std::io::Result<()> {
    let target = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c"bpffs".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            0,
            c"mode=0700".as_ptr().cast(),
        )
    };
    if rc != 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
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

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, LoaderError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(LoaderError::MissingMap(name))?;
    T::try_from(map).map_err(map_err(name))
}

impl Gate {
    /// Load and verify the programs and create the maps (nothing is attached yet).
    pub fn load(pin_dir: &Path) -> Result<Gate, LoaderError> {
        let dir = prepare_pin_dir(pin_dir)?;
        let mut ebpf = EbpfLoader::new().load(OBJECT)?;
        for name in [programs::CONNECT4, programs::CONNECT6, programs::SENDMSG4, programs::SENDMSG6]
        {
            let prog: &mut CgroupSockAddr = program(&mut ebpf, name)?;
            prog.load().map_err(|source| LoaderError::Program { name, source })?;
        }
        let egress = load_egress(&mut ebpf)?;
        for (name, map) in ebpf.maps() {
            let path = dir.join("maps").join(name);
            map.pin(&path).map_err(|source| LoaderError::Pin { path, source })?;
        }
        Ok(Gate {
            config: take(&mut ebpf, names::CONFIG)?,
            meta: take(&mut ebpf, names::POLICY_META)?,
            v4: take(&mut ebpf, names::PREFIX_V4)?,
            v6: take(&mut ebpf, names::PREFIX_V6)?,
            rules: take(&mut ebpf, names::PORT_RULES)?,
            allowed: take(&mut ebpf, names::ALLOWED)?,
            ep_counters: take(&mut ebpf, names::EP_COUNTERS)?,
            stats: take(&mut ebpf, names::STATS)?,
            events: Some(take(&mut ebpf, names::EVENTS)?),
            ebpf,
            pin_dir: dir,
            active: 0,
            written: Default::default(),
            links: Vec::new(),
            generation: 0,
            egress,
        })
    }

    /// Install a compiled policy and its allow set as the next generation and make it live.
    /// On error the live generation is untouched.
    pub fn apply(
        &mut self,
        compiled: &Compiled,
        meta: PolicyMeta,
        allow: &[(u64, u32)],
    ) -> Result<(), LoaderError> {
        let next = self.active ^ 1;
        debug_assert_eq!(compiled.generation, next);
        self.clear(next)?;
        let w = &mut self.written[next as usize];
        for &(plen, data, value) in &compiled.v4 {
            let key = Key::new(plen, data);
            self.v4.insert(&key, value, 0).map_err(map_err(names::PREFIX_V4))?;
            w.v4.push(key);
        }
        for &(plen, data, value) in &compiled.v6 {
            let key = Key::new(plen, data);
            self.v6.insert(&key, value, 0).map_err(map_err(names::PREFIX_V6))?;
            w.v6.push(key);
        }
        for &(key, endpoint) in &compiled.rules {
            self.rules.insert(key, endpoint, 0).map_err(map_err(names::PORT_RULES))?;
            w.rules.push(key);
        }
        for &(cgroup_id, entry) in allow {
            let key = AllowKey::new(next, cgroup_id);
            self.allowed.insert(key, entry, 0).map_err(map_err(names::ALLOWED))?;
            w.allowed.push(key);
        }
        self.meta.set(next, meta, 0).map_err(map_err(names::POLICY_META))?;
        // The flip: one aligned 4-byte write.
        self.config.set(CONFIG_ACTIVE_GEN, next, 0).map_err(map_err(names::CONFIG))?;
        let old = self.active;
        self.active = next;
        self.generation += 1;
        self.clear(old)?;
        // Counters are per endpoint index: a new policy starts them afresh.
        for i in 0..meta.endpoints.min(MAX_ENDPOINTS) {
            self.ep_counters
                .set(i, EndpointCounters::default(), 0)
                .map_err(map_err(names::EP_COUNTERS))?;
        }
        Ok(())
    }

    /// Add cgroups to the live allow set (a cgroup that appeared under a glob). Additions are
    /// single map inserts, atomic on their own.
    pub fn allow_more(&mut self, allow: &[(u64, u32)]) -> Result<(), LoaderError> {
        let live = self.active;
        for &(cgroup_id, entry) in allow {
            let key = AllowKey::new(live, cgroup_id);
            self.allowed.insert(key, entry, 0).map_err(map_err(names::ALLOWED))?;
            self.written[live as usize].allowed.push(key);
        }
        Ok(())
    }

    fn clear(&mut self, generation: u32) -> Result<(), LoaderError> {
        let w = std::mem::take(&mut self.written[generation as usize]);
        for k in &w.v4 {
            ignore_missing(self.v4.remove(k)).map_err(map_err(names::PREFIX_V4))?;
        }
        for k in &w.v6 {
            ignore_missing(self.v6.remove(k)).map_err(map_err(names::PREFIX_V6))?;
        }
        for k in &w.rules {
            ignore_missing(self.rules.remove(k)).map_err(map_err(names::PORT_RULES))?;
        }
        for k in &w.allowed {
            ignore_missing(self.allowed.remove(k)).map_err(map_err(names::ALLOWED))?;
        }
        Ok(())
    }

    /// The generation the next [`apply`](Self::apply) must be compiled for.
    pub fn next_generation(&self) -> u32 {
        self.active ^ 1
    }

    /// Attach all programs to the gated root with bpf_link and pin the links. A cgroup bpf_link
    /// always coexists with other programs on the cgroup (the kernel treats it as multi-attach
    /// and rejects BPF_F_ALLOW_MULTI as a link flag), hence `Single`: flags 0.
    pub fn attach(&mut self, root: &GatedRoot) -> Result<(), LoaderError> {
        let cgroup = fs::File::open(&root.path)
            .map_err(|source| LoaderError::Cgroup { path: root.path.clone(), source })?;
        for name in [programs::CONNECT4, programs::CONNECT6, programs::SENDMSG4, programs::SENDMSG6]
        {
            let perr = |source| LoaderError::Program { name, source };
            let prog: &mut CgroupSockAddr = program(&mut self.ebpf, name)?;
            let id = prog.attach(&cgroup, CgroupAttachMode::Single).map_err(perr)?;
            let link = prog.take_link(id).map_err(perr)?;
            self.pin_link(name, link)?;
        }
        let name = self.egress;
        let perr = |source| LoaderError::Program { name, source };
        let prog: &mut CgroupSkb = program(&mut self.ebpf, name)?;
        let id = prog
            .attach(&cgroup, CgroupSkbAttachType::Egress, CgroupAttachMode::Single)
            .map_err(perr)?;
        let link = prog.take_link(id).map_err(perr)?;
        self.pin_link(name, link)
    }

    /// Pin a freshly attached link under `links/<program>` and keep it.
    fn pin_link<L>(&mut self, name: &'static str, link: L) -> Result<(), LoaderError>
    where
        FdLink: TryFrom<L, Error = LinkError>,
    {
        let fd = FdLink::try_from(link).map_err(|source| LoaderError::Link { name, source })?;
        let path = self.pin_dir.join("links").join(name);
        self.links.push(fd.pin(&path).map_err(|source| LoaderError::Pin { path, source })?);
        Ok(())
    }

    /// The denial event ring buffer (taken once, by the event reader).
    pub fn take_events(&mut self) -> Option<RingBuf<MapData>> {
        self.events.take()
    }

    /// Read all counters.
    pub fn stats(&self, endpoints: u32) -> Result<Stats, LoaderError> {
        let read = |slot: u32| -> Result<u64, LoaderError> {
            let v = self.stats.get(&slot, 0).map_err(map_err(names::STATS))?;
            Ok(v.iter().sum())
        };
        let mut decisions = Vec::new();
        for hook in 0..NUM_HOOKS {
            let mut row = Vec::new();
            for verdict in 0..NUM_VERDICTS {
                row.push(read(stat_slot(hook, verdict))?);
            }
            decisions.push(row);
        }
        let mut eps = Vec::new();
        for i in 0..endpoints.min(MAX_ENDPOINTS) {
            eps.push(self.ep_counters.get(&i, 0).map_err(map_err(names::EP_COUNTERS))?);
        }
        Ok(Stats { decisions, events_lost: read(STAT_EVENTS_LOST)?, endpoints: eps })
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }
}

/// Load the egress program with task info (pid, comm in events); fall back to the variant
/// without it where the kernel's verifier refuses those helpers for cgroup_skb.
fn load_egress(ebpf: &mut Ebpf) -> Result<&'static str, LoaderError> {
    let mut first_err = None;
    for name in [programs::EGRESS, programs::EGRESS_NOTASK] {
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

/// Remove everything pinned under `<pin_dir>/v<ABI>/`. Unpinning a link is what detaches it
/// (no process holds it once the agent is gone), so this opens the gate.
pub fn cleanup(pin_dir: &Path) -> Result<bool, LoaderError> {
    let dir = versioned(pin_dir);
    if !dir.exists() {
        return Ok(false);
    }
    fs::remove_dir_all(&dir)
        .map_err(|e| LoaderError::PinDir { path: dir.clone(), reason: format!("removing: {e}") })?;
    // Remove the pin dir itself if nothing else lives there.
    let _ = fs::remove_dir(pin_dir);
    Ok(true)
}
