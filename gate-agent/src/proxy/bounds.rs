//! How many connections the proxy holds open: at most so many per workload (a pod: every
//! container of it counts against one bound) and so many in all, of which a reserve only
//! callers under an allow entry may take, so that neither one pod nor every `served` pod
//! together can take the proxy from the components the policy names (and a metric shows who
//! tries).
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
    /// A `served` caller (no allow entry), and only the reserve for allow entries is left.
    Served,
}

/// The open connections, by workload (the kernel's record names it).
#[derive(Debug)]
pub(crate) struct Slots {
    per_workload: usize,
    total: usize,
    /// Of `total`, the slots only callers under an allow entry may take.
    reserve: usize,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    /// Only workloads with a connection open: the map never outgrows `total`.
    by_workload: HashMap<u64, usize>,
}

/// A connection's place, given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<Slots>,
    workload: u64,
}

impl Slots {
    pub(crate) fn new(per_workload: usize, total: usize, reserve: usize) -> Arc<Slots> {
        let reserve = reserve.min(total);
        Arc::new(Slots { per_workload, total, reserve, open: Mutex::new(Open::default()) })
    }

    /// The counts stay right even if a holder of the lock panicked: nothing between
    /// the lock and the unlock can leave them half-updated.
    fn lock(&self) -> MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for a connection of `workload` (`entry`: its caller is under an allow entry,
    /// and may take the reserve), if it has one left and so does the proxy.
    pub(crate) fn acquire(self: &Arc<Self>, workload: u64, entry: bool) -> Result<Slot, Full> {
        let mut open = self.lock();
        let mine = open.by_workload.get(&workload).copied().unwrap_or(0);
        if mine >= self.per_workload {
            return Err(Full::Workload);
        }
        if open.total >= self.total {
            return Err(Full::Node);
        }
        if !entry && open.total >= self.total - self.reserve {
            return Err(Full::Served);
        }
        open.total += 1;
        open.by_workload.insert(workload, mine + 1);
        Ok(Slot { slots: Arc::clone(self), workload })
    }

    /// Connections open for `workload`, and in all.
    #[cfg(test)]
    pub(crate) fn open(&self, workload: u64) -> (usize, usize) {
        let open = self.lock();
        (open.by_workload.get(&workload).copied().unwrap_or(0), open.total)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.slots.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_workload.get_mut(&self.workload) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.by_workload.remove(&self.workload);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_workload_then_total() {
        let slots = Slots::new(2, 3, 0);
        let a1 = slots.acquire(1, true).expect("a1");
        let a2 = slots.acquire(1, true).expect("a2");
        assert_eq!(slots.acquire(1, true).err(), Some(Full::Workload));
        let b1 = slots.acquire(2, true).expect("b1");
        assert_eq!(slots.acquire(3, true).err(), Some(Full::Node));
        assert_eq!(slots.acquire(1, true).err(), Some(Full::Workload), "the workload's first");
        drop(a1);
        assert_eq!(slots.open(1), (1, 2));
        let a3 = slots.acquire(1, true).expect("a slot given back is free again");
        drop((a2, a3, b1));
        assert_eq!(slots.open(1), (0, 0));
        assert!(slots.lock().by_workload.is_empty(), "no workload without a connection is kept");
    }

    #[test]
    fn the_reserve_is_for_allow_entries_only() {
        let slots = Slots::new(8, 4, 2);
        let served = [1, 2].map(|w| slots.acquire(w, false).expect("served"));
        // Two slots left, both the reserve: no served caller gets one, an entry's does.
        assert_eq!(slots.acquire(3, false).err(), Some(Full::Served));
        let e1 = slots.acquire(4, true).expect("an allow entry takes the reserve");
        let e2 = slots.acquire(5, true).expect("and the rest of it");
        assert_eq!(slots.acquire(6, true).err(), Some(Full::Node));
        drop((served, e1, e2));
        assert_eq!(slots.open(0), (0, 0));
    }
}
