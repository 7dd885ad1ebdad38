//! Which paths each workload asked the proxy for, with counts by verdict: what `report`
//! shows per workload and `suggest` turns into `paths:` (audit, then suggest, then enforce,
//! per path). Only requests whose form passed are recorded (their path is well formed), only
//! for the methods an entry may list.
//!
//! Bounded, so that a workload asking for ever new paths costs the node a fixed amount: at
//! most [`PER_WORKLOAD`] paths per cgroup and [`MAX_PATHS`] in all (then the least recently
//! seen path of any workload makes room), paths of at most [`MAX_PATH`] bytes; what does not
//! fit is counted in `metadata_gate_proxy_paths_untracked`. The agent keeps the record in its
//! state dir ([`PATHS_FILE`]), where `report` reads it, also when no agent runs.
use std::{
    collections::{BTreeMap, HashMap},
    io,
    path::Path,
    sync::Mutex,
};

use gate_common::http::{Methods, Target};
use serde::{Deserialize, Serialize};

/// Paths recorded per workload (cgroup).
pub(crate) const PER_WORKLOAD: usize = 128;
/// Paths recorded in all.
pub(crate) const MAX_PATHS: usize = 8192;
/// Longest path recorded (metadata paths are short).
pub(crate) const MAX_PATH: usize = 256;
/// File of the record in the state dir.
pub(crate) const PATHS_FILE: &str = "paths.json";

/// What was asked: by whom, of which endpoint, with which method, path and query parameter
/// names (sorted).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct PathKey {
    pub cgroup_id: u64,
    pub endpoint: String,
    pub method: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub query: Vec<String>,
}

/// Requests by verdict, and the last time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PathCounts {
    pub served: u64,
    pub refused: u64,
    /// Served in audit mode though the policy would refuse them.
    pub audited: u64,
    /// Answered 429: the workload was over its rate.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub limited: u64,
    /// Wall clock, ms since the Unix epoch.
    pub last_seen_unix_ms: u64,
}

impl PathCounts {
    pub(crate) fn add(&mut self, o: &PathCounts) {
        self.served += o.served;
        self.refused += o.refused;
        self.audited += o.audited;
        self.limited += o.limited;
        self.last_seen_unix_ms = self.last_seen_unix_ms.max(o.last_seen_unix_ms);
    }
}

/// One line of [`PATHS_FILE`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PathRecord {
    #[serde(flatten)]
    pub key: PathKey,
    #[serde(flatten)]
    pub counts: PathCounts,
}

/// A request's verdict, as the record counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    Served,
    Refused,
    Audited,
    /// Over the workload's rate (429).
    Limited,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Default)]
struct Inner {
    by: HashMap<PathKey, PathCounts>,
    per_workload: HashMap<u64, usize>,
    /// Changed since the last [`PathLog::save`].
    dirty: bool,
}

/// The proxy's record of paths asked for.
#[derive(Default)]
pub(crate) struct PathLog {
    inner: Mutex<Inner>,
}

impl PathLog {
    /// The record kept in `state_dir`, to go on counting where the last agent stopped; an
    /// unreadable file starts afresh (it is a diagnostic, not a policy).
    pub(crate) fn load(state_dir: &Path) -> PathLog {
        let log = PathLog::default();
        let records = match read(state_dir) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "reading the metadata proxy's path record: starting afresh");
                Vec::new()
            }
        };
        if let Ok(mut inner) = log.inner.lock() {
            for r in records.into_iter().take(MAX_PATHS) {
                if *inner.per_workload.get(&r.key.cgroup_id).unwrap_or(&0) < PER_WORKLOAD {
                    *inner.per_workload.entry(r.key.cgroup_id).or_default() += 1;
                    inner.by.insert(r.key, r.counts);
                }
            }
        }
        log
    }

    /// Count `method target` of `cgroup_id` to `endpoint` under `seen`, at `now_unix_ms`.
    /// Whether it was recorded (false: untracked, or not a request to record).
    pub(crate) fn note(
        &self,
        cgroup_id: u64,
        endpoint: &str,
        method: &str,
        target: &str,
        seen: Seen,
        now_unix_ms: u64,
    ) -> bool {
        if Methods::parse(method).is_none() {
            return false;
        }
        let Ok(t) = Target::parse(target) else { return false };
        if t.path.len() > MAX_PATH {
            return false;
        }
        let mut query: Vec<String> = t.query.iter().map(|(k, _)| (*k).to_owned()).collect();
        query.sort();
        let key = PathKey {
            cgroup_id,
            endpoint: endpoint.to_owned(),
            method: method.to_owned(),
            path: t.path.to_owned(),
            query,
        };
        let Ok(mut inner) = self.inner.lock() else { return false };
        let inner = &mut *inner;
        if !inner.by.contains_key(&key) {
            if *inner.per_workload.get(&cgroup_id).unwrap_or(&0) >= PER_WORKLOAD {
                return false;
            }
            if inner.by.len() >= MAX_PATHS {
                evict_oldest(inner);
            }
            *inner.per_workload.entry(cgroup_id).or_default() += 1;
        }
        let c = inner.by.entry(key).or_default();
        match seen {
            Seen::Served => c.served += 1,
            Seen::Refused => c.refused += 1,
            Seen::Audited => c.audited += 1,
            Seen::Limited => c.limited += 1,
        }
        c.last_seen_unix_ms = c.last_seen_unix_ms.max(now_unix_ms);
        inner.dirty = true;
        true
    }

    /// Every record, sorted.
    pub(crate) fn records(&self) -> Vec<PathRecord> {
        let Ok(inner) = self.inner.lock() else { return Vec::new() };
        let sorted: BTreeMap<_, _> = inner.by.iter().collect();
        sorted.into_iter().map(|(k, c)| PathRecord { key: k.clone(), counts: *c }).collect()
    }

    /// Write the record to `state_dir` if it changed since the last save.
    pub(crate) fn save(&self, state_dir: &Path) -> io::Result<()> {
        let records = {
            let Ok(mut inner) = self.inner.lock() else { return Ok(()) };
            if !inner.dirty {
                return Ok(());
            }
            inner.dirty = false;
            drop(inner);
            self.records()
        };
        let written = (|| {
            let json = serde_json::to_vec(&records).map_err(io::Error::other)?;
            std::fs::create_dir_all(state_dir)?;
            let tmp = state_dir.join(format!("{PATHS_FILE}.tmp"));
            std::fs::write(&tmp, json)?;
            std::fs::rename(tmp, state_dir.join(PATHS_FILE))
        })();
        // Not written: try again at the next save, changed or not.
        if written.is_err()
            && let Ok(mut inner) = self.inner.lock()
        {
            inner.dirty = true;
        }
        written
    }
}

/// The least recently seen path goes, to make room for a new one.
fn evict_oldest(inner: &mut Inner) {
    let Some(oldest) =
        inner.by.iter().min_by_key(|(_, c)| c.last_seen_unix_ms).map(|(k, _)| k.clone())
    else {
        return;
    };
    inner.by.remove(&oldest);
    if let Some(n) = inner.per_workload.get_mut(&oldest.cgroup_id) {
        *n -= 1;
        if *n == 0 {
            inner.per_workload.remove(&oldest.cgroup_id);
        }
    }
}

/// The record in `state_dir` (none yet: empty).
pub(crate) fn read(state_dir: &Path) -> io::Result<Vec<PathRecord>> {
    match std::fs::read(state_dir.join(PATHS_FILE)) {
        Ok(b) => serde_json::from_slice(&b).map_err(io::Error::other),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMDS: &str = "ec2-imds";

    #[test]
    fn requests_are_counted_by_path_method_and_parameters() {
        let log = PathLog::default();
        assert!(log.note(1, IMDS, "GET", "/latest/meta-data/instance-id", Seen::Served, 10));
        assert!(log.note(1, IMDS, "GET", "/latest/meta-data/instance-id", Seen::Audited, 30));
        assert!(log.note(1, IMDS, "PUT", "/latest/api/token", Seen::Refused, 20));
        assert!(log.note(
            1,
            "azure",
            "GET",
            "/metadata/instance?format=text&api-version=1",
            Seen::Served,
            5
        ));
        // Not recorded: a method no entry may list, a target that does not read strictly.
        assert!(!log.note(1, IMDS, "POST", "/latest/api/token", Seen::Refused, 1));
        assert!(!log.note(1, IMDS, "GET", "/latest/../user-data", Seen::Refused, 1));
        let r = log.records();
        assert_eq!(r.len(), 3);
        let id = r.iter().find(|r| r.key.path == "/latest/meta-data/instance-id").expect("id");
        assert_eq!((id.counts.served, id.counts.audited, id.counts.last_seen_unix_ms), (1, 1, 30));
        let azure = r.iter().find(|r| r.key.endpoint == "azure").expect("azure");
        assert_eq!(
            (azure.key.path.as_str(), &azure.key.query[..]),
            ("/metadata/instance", &["api-version".to_owned(), "format".to_owned()][..])
        );
    }

    #[test]
    fn a_workload_cannot_take_more_than_its_share_nor_push_out_another() {
        let log = PathLog::default();
        for i in 0..PER_WORKLOAD + 10 {
            let recorded = log.note(1, IMDS, "GET", &format!("/p/{i}"), Seen::Refused, i as u64);
            assert_eq!(recorded, i < PER_WORKLOAD, "path {i}");
        }
        assert!(log.note(2, IMDS, "GET", "/latest/meta-data/instance-id", Seen::Served, 1));
        // A path it already has is still counted.
        assert!(log.note(1, IMDS, "GET", "/p/0", Seen::Refused, 500));
        assert!(!log.note(1, IMDS, "GET", &format!("/{}", "a".repeat(MAX_PATH)), Seen::Served, 1));
        assert_eq!(log.records().len(), PER_WORKLOAD + 1);
    }

    #[test]
    fn a_full_record_drops_the_least_recently_seen_path() {
        let log = PathLog::default();
        let workloads = MAX_PATHS / PER_WORKLOAD;
        for w in 0..workloads as u64 {
            for i in 0..PER_WORKLOAD as u64 {
                assert!(log.note(
                    w,
                    IMDS,
                    "GET",
                    &format!("/p/{i}"),
                    Seen::Served,
                    100 + w * 1000 + i
                ));
            }
        }
        assert!(log.note(999, IMDS, "GET", "/new", Seen::Served, 1_000_000));
        let r = log.records();
        assert_eq!(r.len(), MAX_PATHS);
        assert!(!r.iter().any(|r| r.key.cgroup_id == 0 && r.key.path == "/p/0"), "the oldest went");
        assert!(r.iter().any(|r| r.key.cgroup_id == 999));
    }

    /// A directory of the test's own, removed when dropped.
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("mg-paths-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("scratch dir");
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_record_survives_a_restart_through_the_state_dir() {
        let dir = Scratch::new("restart");
        let log = PathLog::default();
        log.note(7, IMDS, "GET", "/latest/meta-data/placement/region", Seen::Served, 42);
        log.save(&dir.0).expect("save");
        let again = PathLog::load(&dir.0);
        assert_eq!(again.records(), log.records());
        assert_eq!(read(&dir.0).expect("read"), log.records());
        // A save that fails is tried again.
        let blocked = Scratch::new("blocked");
        std::fs::write(blocked.0.join("file"), b"").expect("write");
        log.note(7, IMDS, "GET", "/latest/meta-data/instance-id", Seen::Served, 43);
        assert!(log.save(&blocked.0.join("file")).is_err(), "a file is no directory");
        log.save(&dir.0).expect("retried");
        assert_eq!(read(&dir.0).expect("read").len(), 2);
        // Unreadable: afresh, never an error that stops the proxy.
        std::fs::write(dir.0.join(PATHS_FILE), b"{not json").expect("write");
        assert!(PathLog::load(&dir.0).records().is_empty());
        assert!(read(&Scratch::new("empty").0).expect("none yet").is_empty());
    }
}
