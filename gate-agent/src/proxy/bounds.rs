//! How many connections the proxy holds open: at most so many per workload and so many in
//! all, so that one workload cannot take the proxy from the others (and a metric shows the
//! one that tries).
use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

/// Why a connection gets no slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Full {
    /// Its workload holds `per_workload` connections already.
    Workload,
    /// The proxy holds `total` connections already.
    Node,
}

/// The open connections, by workload (cgroup id).
#[derive(Debug)]
pub(crate) struct Slots {
    per_workload: usize,
    total: usize,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    /// Only workloads with a connection open: the map never outgrows `total`.
    by_cgroup: HashMap<u64, usize>,
}

/// A connection's place, given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<Slots>,
    cgroup_id: u64,
}

impl Slots {
    pub(crate) fn new(per_workload: usize, total: usize) -> Arc<Slots> {
        Arc::new(Slots { per_workload, total, open: Mutex::new(Open::default()) })
    }

    /// The counts stay right even if a holder of the lock panicked: nothing between
    /// the lock and the unlock can leave them half-updated.
    fn lock(&self) -> MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for a connection of `cgroup_id`, if it has one left and so does the proxy.
    pub(crate) fn acquire(self: &Arc<Self>, cgroup_id: u64) -> Result<Slot, Full> {
        let mut open = self.lock();
        let mine = open.by_cgroup.get(&cgroup_id).copied().unwrap_or(0);
        if mine >= self.per_workload {
            return Err(Full::Workload);
        }
        if open.total >= self.total {
            return Err(Full::Node);
        }
        open.total += 1;
        open.by_cgroup.insert(cgroup_id, mine + 1);
        Ok(Slot { slots: Arc::clone(self), cgroup_id })
    }

    /// Connections open for `cgroup_id`, and in all.
    #[cfg(test)]
    pub(crate) fn open(&self, cgroup_id: u64) -> (usize, usize) {
        let open = self.lock();
        (open.by_cgroup.get(&cgroup_id).copied().unwrap_or(0), open.total)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.slots.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_cgroup.get_mut(&self.cgroup_id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.by_cgroup.remove(&self.cgroup_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_workload_then_total() {
        let slots = Slots::new(2, 3);
        let a1 = slots.acquire(1).expect("a1");
        let a2 = slots.acquire(1).expect("a2");
        assert_eq!(slots.acquire(1).err(), Some(Full::Workload));
        let b1 = slots.acquire(2).expect("b1");
        assert_eq!(slots.acquire(3).err(), Some(Full::Node));
        assert_eq!(slots.acquire(1).err(), Some(Full::Workload), "the workload's bound first");
        drop(a1);
        assert_eq!(slots.open(1), (1, 2));
        let a3 = slots.acquire(1).expect("a slot given back is free again");
        drop((a2, a3, b1));
        assert_eq!(slots.open(1), (0, 0));
        assert!(slots.lock().by_cgroup.is_empty(), "no workload without a connection is kept");
    }
}
