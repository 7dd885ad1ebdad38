//! The gate's maps, typed. Opened from a freshly loaded object (the agent) or from their pins
//! (`gate-agent status`, which must work while no agent runs).
use aya::{
    Ebpf,
    maps::{Array, HashMap, IterableMap as _, LpmTrie, Map, MapData, MapError, PerCpuArray},
};
use gate_common::abi::{
    AccessKey, AccessStats, AllowKey, CONFIG_ACTIVE_GEN, CONFIG_RECENT_CURSOR, DenyEvent,
    EndpointCounters, EndpointName, EpNameKey, GateInfo, HandshakeKey, MAX_ENDPOINTS, NUM_HOOKS,
    NUM_VERDICTS, PolicyMeta, PortRuleKey, Prefilter, PrefixV4, PrefixV6, PrefixValue, ProxyConfig,
    ProxyRecord, RECENT_DENIALS, STAT_EVENTS_LOST, STAT_PENDING_CAPPED, STAT_PENDING_LOST,
    STAT_PROXY_DIVERTED, TcClsact, fixed_str_value, names, stat_slot,
};

use super::{LoaderError, map_err, pins::Layout};

pub(crate) struct Maps {
    pub config: Array<MapData, u32>,
    pub meta: Array<MapData, PolicyMeta>,
    pub v4: LpmTrie<MapData, PrefixV4, PrefixValue>,
    pub v6: LpmTrie<MapData, PrefixV6, PrefixValue>,
    pub rules: HashMap<MapData, PortRuleKey, u32>,
    pub allowed: HashMap<MapData, AllowKey, u32>,
    pub ep_counters: Array<MapData, EndpointCounters>,
    pub stats: PerCpuArray<MapData, u64>,
    pub recent: Array<MapData, DenyEvent>,
    pub info: Array<MapData, GateInfo>,
    pub names: HashMap<MapData, EpNameKey, EndpointName>,
    pub strict: HashMap<MapData, u32, u32>,
    pub trusted: HashMap<MapData, u32, u32>,
    pub access: HashMap<MapData, AccessKey, AccessStats>,
    pub clsact: HashMap<MapData, u64, TcClsact>,
    pub prefilter: Array<MapData, Prefilter>,
    pub proxy: Array<MapData, ProxyConfig>,
    /// Untyped: aya's typed socket storage gives no access to its map for pinning (the
    /// proxy reads it through its own handle, `loader::RecordReader`).
    pub records: Map,
    pub pending: HashMap<MapData, HandshakeKey, ProxyRecord>,
    /// Each workload's records in PENDING (the kernel's; pinned with the rest).
    pub inflight: HashMap<MapData, u64, u32>,
}

/// Counters read back from the kernel.
#[derive(Clone, Debug, Default)]
pub(crate) struct Stats {
    /// `[hook][verdict]` summed over CPUs.
    pub decisions: Vec<Vec<u64>>,
    pub events_lost: u64,
    /// Proxied handshakes whose record found no room (STAT_PENDING_LOST).
    pub pending_lost: u64,
    /// Connects to the proxy over their workload's quota of handshakes (STAT_PENDING_CAPPED).
    pub pending_capped: u64,
    /// Packets of redirected connections leaving for another address (STAT_PROXY_DIVERTED).
    pub proxy_diverted: u64,
    pub endpoints: Vec<EndpointCounters>,
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, LoaderError>
where
    T: TryFrom<Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(LoaderError::MissingMap(name))?;
    T::try_from(map).map_err(map_err(name))
}

fn from_pin<T>(layout: &Layout, name: &'static str) -> Result<T, LoaderError>
where
    T: TryFrom<Map, Error = MapError>,
{
    let data = MapData::from_pin(layout.map(name)).map_err(map_err(name))?;
    let map = Map::from_map_data(data).map_err(map_err(name))?;
    T::try_from(map).map_err(map_err(name))
}

fn take_raw(ebpf: &mut Ebpf, name: &'static str) -> Result<Map, LoaderError> {
    ebpf.take_map(name).ok_or(LoaderError::MissingMap(name))
}

fn from_pin_raw(layout: &Layout, name: &'static str) -> Result<Map, LoaderError> {
    let data = MapData::from_pin(layout.map(name)).map_err(map_err(name))?;
    Map::from_map_data(data).map_err(map_err(name))
}

macro_rules! open_all {
    ($f:ident, $raw:ident, $src:expr) => {
        Ok(Maps {
            config: $f($src, names::CONFIG)?,
            meta: $f($src, names::POLICY_META)?,
            v4: $f($src, names::PREFIX_V4)?,
            v6: $f($src, names::PREFIX_V6)?,
            rules: $f($src, names::PORT_RULES)?,
            allowed: $f($src, names::ALLOWED)?,
            ep_counters: $f($src, names::EP_COUNTERS)?,
            stats: $f($src, names::STATS)?,
            recent: $f($src, names::RECENT)?,
            info: $f($src, names::GATE_INFO)?,
            names: $f($src, names::EP_NAMES)?,
            strict: $f($src, names::STRICT_IFACES)?,
            trusted: $f($src, names::TRUSTED_IFACES)?,
            access: $f($src, names::ACCESS)?,
            clsact: $f($src, names::TC_CLSACT)?,
            prefilter: $f($src, names::PREFILTER)?,
            proxy: $f($src, names::PROXY)?,
            records: $raw($src, names::SK_RECORDS)?,
            pending: $f($src, names::PENDING)?,
            inflight: $f($src, names::INFLIGHT)?,
        })
    };
}

impl Maps {
    /// The map of a name, untyped (to pin it again).
    pub(crate) fn data(&self, name: &str) -> Option<&MapData> {
        Some(match name {
            names::CONFIG => self.config.map(),
            names::POLICY_META => self.meta.map(),
            names::PREFIX_V4 => self.v4.map(),
            names::PREFIX_V6 => self.v6.map(),
            names::PORT_RULES => self.rules.map(),
            names::ALLOWED => self.allowed.map(),
            names::EP_COUNTERS => self.ep_counters.map(),
            names::STATS => self.stats.map(),
            names::RECENT => self.recent.map(),
            names::GATE_INFO => self.info.map(),
            names::EP_NAMES => self.names.map(),
            names::STRICT_IFACES => self.strict.map(),
            names::TRUSTED_IFACES => self.trusted.map(),
            names::ACCESS => self.access.map(),
            names::TC_CLSACT => self.clsact.map(),
            names::PREFILTER => self.prefilter.map(),
            names::PROXY => self.proxy.map(),
            names::SK_RECORDS => match &self.records {
                Map::SkStorage(data) => data,
                _ => return None,
            },
            names::PENDING => self.pending.map(),
            names::INFLIGHT => self.inflight.map(),
            _ => return None,
        })
    }

    pub(crate) fn take(ebpf: &mut Ebpf) -> Result<Maps, LoaderError> {
        open_all!(take, take_raw, ebpf)
    }

    pub(crate) fn from_pins(layout: &Layout) -> Result<Maps, LoaderError> {
        open_all!(from_pin, from_pin_raw, layout)
    }

    /// The live generation (0 or 1).
    pub(crate) fn active(&self) -> Result<u32, LoaderError> {
        Ok(self.config.get(&CONFIG_ACTIVE_GEN, 0).map_err(map_err(names::CONFIG))? & 1)
    }

    pub(crate) fn info(&self) -> Result<GateInfo, LoaderError> {
        self.info.get(&0, 0).map_err(map_err(names::GATE_INFO))
    }

    pub(crate) fn policy_meta(&self, generation: u32) -> Result<PolicyMeta, LoaderError> {
        self.meta.get(&generation, 0).map_err(map_err(names::POLICY_META))
    }

    /// Endpoint names of a generation, by index (missing ones as `?`).
    pub(crate) fn endpoint_names(&self, generation: u32, count: u32) -> Vec<String> {
        (0..count.min(MAX_ENDPOINTS))
            .map(|index| {
                self.names
                    .get(&EpNameKey { generation, index }, 0)
                    .map(|n| fixed_str_value(&n.name).to_owned())
                    .unwrap_or_else(|_| "?".to_owned())
            })
            .collect()
    }

    /// All counters.
    pub(crate) fn stats(&self, endpoints: u32) -> Result<Stats, LoaderError> {
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
        Ok(Stats {
            decisions,
            events_lost: read(STAT_EVENTS_LOST)?,
            pending_lost: read(STAT_PENDING_LOST)?,
            pending_capped: read(STAT_PENDING_CAPPED)?,
            proxy_diverted: read(STAT_PROXY_DIVERTED)?,
            endpoints: eps,
        })
    }

    /// The last denials, oldest first.
    pub(crate) fn recent(&self) -> Result<Vec<DenyEvent>, LoaderError> {
        let cursor = self.config.get(&CONFIG_RECENT_CURSOR, 0).map_err(map_err(names::CONFIG))?;
        let n = cursor.min(RECENT_DENIALS);
        let mut out = Vec::new();
        for i in 0..n {
            let slot = cursor.wrapping_sub(n).wrapping_add(i) & (RECENT_DENIALS - 1);
            out.push(self.recent.get(&slot, 0).map_err(map_err(names::RECENT))?);
        }
        Ok(out)
    }

    /// Entries per generation in the allow set: `[gen0, gen1]`.
    pub(crate) fn allowed_counts(&self) -> [usize; 2] {
        let mut n = [0; 2];
        for k in self.allowed.keys().flatten() {
            n[(k.generation & 1) as usize] += 1;
        }
        n
    }
}
