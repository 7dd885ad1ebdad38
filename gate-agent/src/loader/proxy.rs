//! The kernel side of the metadata proxy, as the agent sees it: its programs, put in and
//! taken out as the proxy comes and goes ([`Gate::proxy_on`], [`Gate::proxy_off`]), where
//! redirected connects go (PROXY), and the record of an accepted connection (SK_RECORDS).
//!
//! PROXY names a proxy only while its programs are in: the connect programs send nothing to a
//! proxy whose sock_ops program would not hand the record over, and whose port nothing holds.
use std::{
    fs,
    os::fd::{AsFd as _, AsRawFd},
};

use aya::maps::{Array, HashMap, Map, MapData, MapError, SkStorage};
use gate_common::{
    abi::{CONFIG_ACTIVE_GEN, HandshakeKey, ProxyConfig, ProxyRecord, names},
    user::AttachPoint,
};

use super::{Gate, HookChange, LoaderError, map_err, sys};
use crate::cgroup::GatedRoot;

/// The metadata proxy as the kernel programs are told of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ProxySide {
    /// The proxy's (the agent's) own cgroup: its accepted sockets get their records there,
    /// and only it may bind the proxy's port in the gated root.
    pub(crate) own: GatedRoot,
    /// Where redirected connects go, and whose the port is (`own`'s id).
    pub(crate) config: ProxyConfig,
}

impl ProxySide {
    /// Whether the proxy's cgroup is at or below `root`, where the root's sock_ops link
    /// already runs for its accepted sockets.
    pub(crate) fn below(&self, root: &GatedRoot) -> bool {
        self.own.path.starts_with(&root.path)
    }
}

impl Gate {
    /// Put the metadata proxy's programs in: on the gated root (getpeername, sock_ops, bind;
    /// an earlier agent's links have their programs swapped in place) and sock_ops on the
    /// proxy's own cgroup where that is outside the root; then, every one of them in, tell
    /// the kernel where the proxy is. A failure leaves PROXY as it was: a connect the policy
    /// sends to the proxy is denied, never let through.
    pub(crate) fn proxy_on(
        &mut self,
        root: &GatedRoot,
        side: &ProxySide,
    ) -> Result<Vec<HookChange>, LoaderError> {
        let mut changes = self.attach_points(&AttachPoint::PROXY, root)?;
        if side.below(root) {
            self.take_out(AttachPoint::ProxySockOps)?;
        } else {
            changes.extend(self.attach_points(&[AttachPoint::ProxySockOps], &side.own)?);
        }
        self.maps.proxy.set(0, side.config, 0).map_err(map_err(names::PROXY))?;
        self.proxy = Some(side.clone());
        Ok(changes)
    }

    /// Take the metadata proxy's programs out: first tell the kernel there is no proxy (a
    /// connect the policy would send there is denied from then on), then detach and unpin
    /// each of its links. Returns the attach points whose links were there.
    pub(crate) fn proxy_off(&mut self) -> Result<Vec<AttachPoint>, LoaderError> {
        self.maps.proxy.set(0, ProxyConfig::default(), 0).map_err(map_err(names::PROXY))?;
        self.proxy = None;
        let mut removed = Vec::new();
        for point in AttachPoint::PROXY.into_iter().chain([AttachPoint::ProxySockOps]) {
            if self.take_out(point)? {
                removed.push(point);
            }
        }
        Ok(removed)
    }

    /// Whether the metadata proxy's programs are in (as this agent last put them).
    pub(crate) fn proxy_in(&self) -> bool {
        self.proxy.is_some()
    }

    /// Detach and unpin the link of `point`, and unpin its program; whether there was a link.
    fn take_out(&mut self, point: AttachPoint) -> Result<bool, LoaderError> {
        let io = |what: &'static str, path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| LoaderError::Io { what, path, source }
        };
        let link_path = self.layout.link(point.pin_name());
        let there = link_path.exists();
        if there {
            // Detached at once rather than when the kernel drops the last reference to the
            // unpinned link (deferred work): gone by the time this returns. Kernels before
            // 5.9 have no detach; there the unpin alone detaches it, a moment later.
            if let Ok(link) = sys::obj_get(&link_path) {
                let _ = sys::link_detach(link.as_fd());
            }
            fs::remove_file(&link_path).map_err(io("unpinning the link", &link_path))?;
        }
        let prog_path = self.layout.prog(point.pin_name());
        if prog_path.exists() {
            fs::remove_file(&prog_path).map_err(io("unpinning the program", &prog_path))?;
        }
        Ok(there)
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
