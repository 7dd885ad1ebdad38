//! The policy's way into the maps: a compiled image and an allow set are written into the
//! inactive generation, the CONFIG slot is flipped with one 4-byte write, and only once an
//! RCU grace period has passed — every program that read the old generation before the flip
//! has finished — are the old generation's entries deleted. A program reads the generation
//! once per invocation, so it always sees one complete policy, never a half-deleted one (see
//! `gate_common::abi`).
//!
//! An apply either fails before the flip (nothing changed: the live generation is as it
//! was) or is in force: what follows the flip (clearing the old generation, resetting
//! counters, recording GATE_INFO) is logged if it fails, never reported as a failed apply,
//! so the agent's idea of the policy is always the kernel's.
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aya::maps::lpm_trie::Key;
use gate_common::{
    abi::{
        AllowKey, CONFIG_ACTIVE_GEN, EndpointCounters, EndpointName, EpNameKey, GateInfo,
        MAX_ALLOWED_CGROUPS, MAX_ENDPOINTS, MAX_PORT_RULES, PolicyMeta, PortRuleKey, PrefixV4,
        PrefixV6, fixed_str, names,
    },
    compile::Image,
    user::{AllowSet, Mode, PolicyHash, TerminateState},
};

use super::{Gate, LoaderError, Maps, ignore_missing, map_err, sys};
use crate::cgroup::GatedRoot;

/// A policy as the loader installs it: the compiled image plus what `status` and the
/// metrics read back. Generation-free; [`Gate::apply`] stamps the generation.
pub(crate) struct Install<'a> {
    pub image: &'a Image,
    pub mode: Mode,
    /// Endpoint names by index.
    pub endpoint_names: &'a [String],
    pub hash: PolicyHash,
    pub platform: &'a str,
    pub allow: &'a AllowSet,
    /// `NODE_*` bits for the node-level program.
    pub node_flags: u32,
    /// Whether the policy serves paths to every gated workload no entry selects.
    pub served: bool,
}

/// Keys a generation holds, so that it can be emptied after the flip.
#[derive(Default)]
struct Written {
    v4: Vec<Key<PrefixV4>>,
    v6: Vec<Key<PrefixV6>>,
    rules: Vec<PortRuleKey>,
    allowed: AllowSet,
    names: u32,
}

/// What each of the two generations holds, and which one is live.
pub(super) struct Generations {
    active: u32,
    written: [Written; 2],
    /// The generation left in place after the last flip because no grace period could be
    /// waited for (then it is cleared before the next apply, at least [`FALLBACK_GRACE`]
    /// after that flip).
    stale: Option<(u32, Instant)>,
}

/// How long a generation stays after its flip where the kernel rejects membarrier: far
/// longer than any program runs.
const FALLBACK_GRACE: Duration = Duration::from_secs(1);

impl Generations {
    /// Rebuild what each generation holds from the maps (an adopted gate's agent kept this in
    /// memory only). Leftovers of an apply that was cut short sit in the inactive generation
    /// and are cleared by the next apply.
    pub(super) fn scan(maps: &mut Maps, info: &GateInfo) -> Result<Generations, LoaderError> {
        let active = maps.active()?;
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
        // The inactive generation may hold the leftovers of an apply that was cut short, or
        // the previous policy of an agent that died before clearing it: in use by no program
        // once a grace period has passed since that flip, which cannot be known here.
        Ok(Generations { active, written: w, stale: Some((active ^ 1, Instant::now())) })
    }

    fn live(&self) -> &Written {
        &self.written[self.active as usize]
    }
}

impl Gate {
    /// Install a policy image and its allow set as the next generation and make it live.
    /// On error the live generation is untouched.
    pub(crate) fn apply(
        &mut self,
        install: &Install<'_>,
        root: &GatedRoot,
    ) -> Result<(), LoaderError> {
        let next = self.gens.active ^ 1;
        self.settle_stale();
        self.clear(next)?;
        let m = &mut self.maps;
        let w = &mut self.gens.written[next as usize];
        for (plen, data, value) in install.image.v4_entries(next) {
            let key = Key::new(plen, data);
            m.v4.insert(&key, value, 0).map_err(map_err(names::PREFIX_V4))?;
            w.v4.push(key);
        }
        for (plen, data, value) in install.image.v6_entries(next) {
            let key = Key::new(plen, data);
            m.v6.insert(&key, value, 0).map_err(map_err(names::PREFIX_V6))?;
            w.v6.push(key);
        }
        for (key, endpoint) in install.image.rule_entries(next) {
            m.rules.insert(key, endpoint, 0).map_err(map_err(names::PORT_RULES))?;
            w.rules.push(key);
        }
        for (cgroup_id, entry) in install.allow.iter() {
            m.allowed
                .insert(AllowKey::new(next, cgroup_id), entry, 0)
                .map_err(map_err(names::ALLOWED))?;
            w.allowed.insert(cgroup_id, entry);
        }
        let endpoints = install.endpoint_names.len().min(MAX_ENDPOINTS as usize) as u32;
        for (index, name) in install.endpoint_names.iter().take(endpoints as usize).enumerate() {
            let key = EpNameKey { generation: next, index: index as u32 };
            m.names
                .insert(key, EndpointName { name: fixed_str(name) }, 0)
                .map_err(map_err(names::EP_NAMES))?;
            w.names = index as u32 + 1;
        }
        let meta = PolicyMeta {
            mode: install.mode.id(),
            root_level: root.level,
            endpoints,
            node_flags: install.node_flags,
            served: u32::from(install.served),
            _pad: 0,
            root_id: root.id,
            prefilter: install.image.prefilter,
        };
        m.meta.set(next, meta, 0).map_err(map_err(names::POLICY_META))?;
        // The fast path's filter covers both policies across the flip (it must never let
        // through what the live generation protects), then only the new one.
        let live = m.meta.get(&self.gens.active, 0).map_err(map_err(names::POLICY_META))?;
        let both = live.prefilter.union(&install.image.prefilter);
        m.prefilter.set(0, both, 0).map_err(map_err(names::PREFILTER))?;
        // The flip: one aligned 4-byte write. From here on the new policy is in force.
        m.config.set(CONFIG_ACTIVE_GEN, next, 0).map_err(map_err(names::CONFIG))?;
        if let Err(e) = m.prefilter.set(0, install.image.prefilter, 0) {
            // Still a superset of the live policy's: only slower for the other one's traffic.
            tracing::warn!(error = %e, "narrowing the fast-path filter to the new policy");
        }
        let old = self.gens.active;
        self.gens.active = next;
        match sys::rcu_grace_period() {
            Ok(()) => {
                if let Err(e) = self.clear(old) {
                    tracing::warn!(error = %e, "clearing the previous policy generation; the next apply retries");
                    self.gens.stale = Some((old, Instant::now()));
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "no RCU grace period (membarrier); the previous generation stays until the next apply");
                self.gens.stale = Some((old, Instant::now()));
            }
        }
        // Counters are per endpoint index: a new policy starts them afresh.
        for i in 0..endpoints {
            if let Err(e) = self.maps.ep_counters.set(i, EndpointCounters::default(), 0) {
                tracing::warn!(error = %e, "resetting endpoint counters");
                break;
            }
        }
        self.info = GateInfo {
            policy_generation: self.info.policy_generation + 1,
            policy_hash: install.hash.0,
            root_cgroup_id: root.id,
            applied_at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            agent_pid: std::process::id(),
            terminate: TerminateState::Unknown.id(),
            terminate_netns: 0,
            terminate_hidden: 0,
            platform: fixed_str(install.platform),
            root_path: fixed_str(&root.path.to_string_lossy()),
        };
        if let Err(e) = self.maps.info.set(0, self.info, 0) {
            tracing::warn!(error = %e, "recording what was applied (GATE_INFO); status will lag");
        }
        Ok(())
    }

    /// Before the inactive generation is reused: if it was left in place after its flip,
    /// make sure no program can still be reading it.
    fn settle_stale(&mut self) {
        let Some((generation, flipped)) = self.gens.stale.take() else { return };
        if generation != self.gens.active ^ 1 {
            return;
        }
        if sys::rcu_grace_period().is_err() {
            std::thread::sleep(FALLBACK_GRACE.saturating_sub(flipped.elapsed()));
        }
    }

    /// Record whether established connections are terminated, and what the last scan could
    /// see (namespaces scanned, gated processes it could not look into), for `status`.
    pub(crate) fn set_terminate(
        &mut self,
        state: TerminateState,
        netns: usize,
        hidden: usize,
    ) -> Result<(), LoaderError> {
        self.info.terminate = state.id();
        self.info.terminate_netns = netns.min(u32::MAX as usize) as u32;
        self.info.terminate_hidden = hidden.min(u32::MAX as usize) as u32;
        self.maps.info.set(0, self.info, 0).map_err(map_err(names::GATE_INFO))
    }

    /// Make the live allow set equal `want` (cgroups that appeared under or vanished from a
    /// glob or a pod). Single inserts and deletes, each atomic on its own. Returns (added,
    /// removed).
    pub(crate) fn sync_allow(&mut self, want: &AllowSet) -> Result<(usize, usize), LoaderError> {
        let live = self.gens.active;
        let w = &mut self.gens.written[live as usize];
        let mut added = 0;
        for (id, entry) in want.iter() {
            if w.allowed.get(id) != Some(entry) {
                self.maps
                    .allowed
                    .insert(AllowKey::new(live, id), entry, 0)
                    .map_err(map_err(names::ALLOWED))?;
                w.allowed.remove(id);
                w.allowed.insert(id, entry);
                added += 1;
            }
        }
        let gone: Vec<u64> = w.allowed.ids().filter(|id| !want.contains(*id)).collect();
        for &id in &gone {
            ignore_missing(self.maps.allowed.remove(&AllowKey::new(live, id)))
                .map_err(map_err(names::ALLOWED))?;
            w.allowed.remove(id);
        }
        Ok((added, gone.len()))
    }

    /// The live allow set.
    pub(crate) fn allowed(&self) -> &AllowSet {
        &self.gens.live().allowed
    }

    fn clear(&mut self, generation: u32) -> Result<(), LoaderError> {
        let w = std::mem::take(&mut self.gens.written[generation as usize]);
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
        for id in w.allowed.ids() {
            ignore_missing(m.allowed.remove(&AllowKey::new(generation, id)))
                .map_err(map_err(names::ALLOWED))?;
        }
        for index in 0..w.names {
            ignore_missing(m.names.remove(&EpNameKey { generation, index }))
                .map_err(map_err(names::EP_NAMES))?;
        }
        Ok(())
    }

    /// Entries the live generation holds, per map, for the capacity metric:
    /// (map, used, capacity).
    pub(crate) fn usage(&self) -> [(&'static str, usize, u32); 4] {
        let w = self.gens.live();
        [
            (names::PREFIX_V4, w.v4.len(), MAX_ENDPOINTS),
            (names::PREFIX_V6, w.v6.len(), MAX_ENDPOINTS),
            (names::PORT_RULES, w.rules.len(), MAX_PORT_RULES),
            (names::ALLOWED, w.allowed.len(), MAX_ALLOWED_CGROUPS),
        ]
    }
}
