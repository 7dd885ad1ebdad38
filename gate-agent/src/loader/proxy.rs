//! The kernel side of the metadata proxy, as the agent sees it: where redirected connects go
//! (PROXY), `gate_sock_ops` on the proxy's own cgroup, and the record of an accepted
//! connection (SK_RECORDS).
use std::{fs, os::fd::AsRawFd};

use aya::maps::{Array, HashMap, Map, MapData, MapError, SkStorage};
use gate_common::{
    abi::{CONFIG_ACTIVE_GEN, HandshakeKey, ProxyConfig, ProxyRecord, names},
    user::AttachPoint,
};

use super::{Gate, LoaderError, map_err};
use crate::cgroup::GatedRoot;

impl Gate {
    /// Where redirected connects go from now on; `ProxyConfig::default()` (port 0): nowhere,
    /// they are denied.
    pub(crate) fn set_proxy(&mut self, cfg: ProxyConfig) -> Result<(), LoaderError> {
        self.maps.proxy.set(0, cfg, 0).map_err(map_err(names::PROXY))
    }

    /// Attach `gate_sock_ops` to the proxy's cgroup, where its accepted sockets get their
    /// records, unless that cgroup is below the gated root (the root's link already runs
    /// there). Replaces an earlier agent's link in place, or a stale one.
    pub(crate) fn attach_proxy(
        &mut self,
        proxy: &GatedRoot,
        root: &GatedRoot,
    ) -> Result<(), LoaderError> {
        let point = AttachPoint::ProxySockOps;
        let link_path = self.layout.link(point.pin_name());
        if link_path.exists() {
            fs::remove_file(&link_path).map_err(|source| LoaderError::Io {
                what: "unpinning the proxy's old link",
                path: link_path.clone(),
                source,
            })?;
        }
        if proxy.path.starts_with(&root.path) {
            return Ok(());
        }
        self.link_cgroup(point, &proxy.path)
    }

    /// What the proxy reads for each connection, opened apart from the gate (whose lock an
    /// apply holds) from the pinned maps.
    pub(crate) fn record_reader(&self) -> Result<RecordReader, LoaderError> {
        let open = |name: &'static str| {
            let data = MapData::from_pin(self.layout.map(name)).map_err(map_err(name))?;
            Map::from_map_data(data).map_err(map_err(name))
        };
        let config = Array::try_from(open(names::CONFIG)?).map_err(map_err(names::CONFIG))?;
        let pending = HashMap::try_from(open(names::PENDING)?).map_err(map_err(names::PENDING))?;
        let inflight =
            HashMap::try_from(open(names::INFLIGHT)?).map_err(map_err(names::INFLIGHT))?;
        Ok(RecordReader { records: open(names::SK_RECORDS)?, config, pending, inflight })
    }
}

/// The proxy's view of the kernel: the record on an accepted connection, and the live
/// generation.
pub(crate) struct RecordReader {
    records: Map,
    config: Array<MapData, u32>,
    pending: HashMap<MapData, HandshakeKey, ProxyRecord>,
    inflight: HashMap<MapData, u64, u32>,
}

impl RecordReader {
    /// The record a kernel program left on an accepted connection; `None`: there is none.
    pub(crate) fn record(&self, socket: &impl AsRawFd) -> Result<Option<ProxyRecord>, LoaderError> {
        let records: SkStorage<&MapData, ProxyRecord> =
            SkStorage::try_from(&self.records).map_err(map_err(names::SK_RECORDS))?;
        match records.get(socket, 0) {
            Ok(r) => Ok(Some(r)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(names::SK_RECORDS)(e)),
        }
    }

    /// The generation the programs decide under now (0 or 1).
    pub(crate) fn live_slot(&self) -> Result<u32, LoaderError> {
        let g = self.config.get(&CONFIG_ACTIVE_GEN, 0).map_err(map_err(names::CONFIG))?;
        Ok(g & 1)
    }

    /// Remove the records that waited longer than `max_age_ns` (CLOCK_MONOTONIC) for the
    /// proxy's side of their handshake: a client that never sent its last ACK, a connection
    /// reset before `accept()`. Returns how many, and how many are left.
    pub(crate) fn sweep(&mut self, now_ns: u64, max_age_ns: u64) -> (usize, usize) {
        let stale: Vec<(HandshakeKey, u64)> = self
            .pending
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, r)| now_ns.saturating_sub(r.ts_ns) > max_age_ns)
            .map(|(k, r)| (k, r.workload))
            .collect();
        let mut removed = 0;
        for (key, workload) in stale {
            // Whoever removes a record gives its workload's count back (as the programs do).
            // From here without an atomic subtract: a kernel update racing with it may be lost
            // (one off, rare: only records the close callback did not remove get here).
            if self.pending.remove(&key).is_ok() {
                removed += 1;
                if let Ok(n) = self.inflight.get(&workload, 0)
                    && n > 0
                    && n < 1 << 31
                {
                    let _ = self.inflight.insert(workload, n - 1, 0);
                }
            }
        }
        (removed, self.pending.keys().count())
    }
}
