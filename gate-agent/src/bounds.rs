//! How many connections a listener holds open: at most so many per caller and so many in all,
//! of which a reserve only privileged callers may take, so that one caller cannot take the
//! listener from the others (and a metric shows the one that tries). The metadata proxy's
//! caller is a workload (a pod: all its containers count against one bound), privileged when
//! an allow entry names it, so that the `served` pods together cannot take the proxy from the
//! components the policy names; the probe and metrics listeners' is a peer address, with no
//! reserve.
use std::{
    collections::HashMap,
    hash::Hash,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

/// Pause after a failed `accept()` (out of file descriptors, say), so that an accept loop
/// does not spin while the condition lasts.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Why a connection gets no slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Full {
    /// Its caller holds `per_caller` connections already.
    Caller,
    /// The listener holds `total` connections already.
    Total,
    /// Not a privileged caller, and only the reserve is left.
    Reserved,
}

/// The open connections, by caller.
#[derive(Debug)]
pub(crate) struct Slots<K = u64> {
    per_caller: usize,
    total: usize,
    /// Of `total`, the slots only privileged callers may take.
    reserve: usize,
    open: Mutex<Open<K>>,
}

#[derive(Debug)]
struct Open<K> {
    total: usize,
    /// Only callers with a connection open: the map never outgrows `total`.
    by_caller: HashMap<K, usize>,
}

/// A connection's place, given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Slot<K: Hash + Eq + Copy = u64> {
    slots: Arc<Slots<K>>,
    caller: K,
}

impl<K: Hash + Eq + Copy> Slots<K> {
    pub(crate) fn new(per_caller: usize, total: usize, reserve: usize) -> Arc<Slots<K>> {
        let open = Open { total: 0, by_caller: HashMap::new() };
        let reserve = reserve.min(total);
        Arc::new(Slots { per_caller, total, reserve, open: Mutex::new(open) })
    }

    /// The counts stay right even if a holder of the lock panicked: nothing between
    /// the lock and the unlock can leave them half-updated.
    fn lock(&self) -> MutexGuard<'_, Open<K>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for a connection of `caller` (`privileged`: it may take the reserve), if it has
    /// one left and so does the listener.
    pub(crate) fn acquire(self: &Arc<Self>, caller: K, privileged: bool) -> Result<Slot<K>, Full> {
        let mut open = self.lock();
        let mine = open.by_caller.get(&caller).copied().unwrap_or(0);
        if mine >= self.per_caller {
            return Err(Full::Caller);
        }
        if open.total >= self.total {
            return Err(Full::Total);
        }
        if !privileged && open.total >= self.total - self.reserve {
            return Err(Full::Reserved);
        }
        open.total += 1;
        open.by_caller.insert(caller, mine + 1);
        Ok(Slot { slots: Arc::clone(self), caller })
    }

    /// Connections open for `caller`, and in all.
    #[cfg(test)]
    pub(crate) fn open(&self, caller: K) -> (usize, usize) {
        let open = self.lock();
        (open.by_caller.get(&caller).copied().unwrap_or(0), open.total)
    }
}

impl<K: Hash + Eq + Copy> Drop for Slot<K> {
    fn drop(&mut self) {
        let mut open = self.slots.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_caller.get_mut(&self.caller) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.by_caller.remove(&self.caller);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_caller_then_total() {
        let slots = Slots::<u64>::new(2, 3, 0);
        let a1 = slots.acquire(1, false).expect("a1");
        let a2 = slots.acquire(1, false).expect("a2");
        assert_eq!(slots.acquire(1, false).err(), Some(Full::Caller));
        let b1 = slots.acquire(2, false).expect("b1");
        assert_eq!(slots.acquire(3, false).err(), Some(Full::Total));
        assert_eq!(slots.acquire(1, false).err(), Some(Full::Caller), "the caller's bound first");
        drop(a1);
        assert_eq!(slots.open(1), (1, 2));
        let a3 = slots.acquire(1, false).expect("a slot given back is free again");
        drop((a2, a3, b1));
        assert_eq!(slots.open(1), (0, 0));
        assert!(slots.lock().by_caller.is_empty(), "no caller without a connection is kept");
    }

    #[test]
    fn the_reserve_is_for_privileged_callers_only() {
        let slots = Slots::<u64>::new(8, 4, 2);
        let held = [1, 2].map(|w| slots.acquire(w, false).expect("unprivileged"));
        // Two slots left, both the reserve: no unprivileged caller gets one, a privileged does.
        assert_eq!(slots.acquire(3, false).err(), Some(Full::Reserved));
        let e1 = slots.acquire(4, true).expect("a privileged caller takes the reserve");
        let e2 = slots.acquire(5, true).expect("and the rest of it");
        assert_eq!(slots.acquire(6, true).err(), Some(Full::Total));
        drop((held, e1, e2));
        assert_eq!(slots.open(0), (0, 0));
    }
}
