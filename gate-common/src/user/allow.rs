//! What the agent writes besides the compiled endpoint tables: the allow set, and the hash
//! that names a policy.
use core::fmt;
use std::collections::BTreeMap;

/// The cgroups on the allow set: cgroup v2 id → index of the allow entry that put it there.
/// What `ALLOWED` holds for one generation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllowSet(BTreeMap<u64, u32>);

impl AllowSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Put a cgroup on the set; the lowest entry index wins when several entries select it.
    pub fn insert(&mut self, cgroup_id: u64, entry: u32) {
        let e = self.0.entry(cgroup_id).or_insert(entry);
        *e = (*e).min(entry);
    }

    pub fn remove(&mut self, cgroup_id: u64) -> Option<u32> {
        self.0.remove(&cgroup_id)
    }

    /// The allow entry of a cgroup, if it is on the set.
    pub fn get(&self, cgroup_id: u64) -> Option<u32> {
        self.0.get(&cgroup_id).copied()
    }

    pub fn contains(&self, cgroup_id: u64) -> bool {
        self.0.contains_key(&cgroup_id)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// (cgroup id, allow entry) in cgroup id order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.0.iter().map(|(&id, &entry)| (id, entry))
    }

    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.keys().copied()
    }
}

impl FromIterator<(u64, u32)> for AllowSet {
    fn from_iter<I: IntoIterator<Item = (u64, u32)>>(iter: I) -> Self {
        let mut set = AllowSet::new();
        for (id, entry) in iter {
            set.insert(id, entry);
        }
        set
    }
}

/// A stable 64-bit digest of a policy's canonical form (what `GATE_INFO` records), shown as
/// 16 hex digits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyHash(pub u64);

impl fmt::Display for PolicyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_entry_wins_and_hash_is_16_hex_digits() {
        let set: AllowSet = [(7, 3), (7, 1), (9, 2)].into_iter().collect();
        assert_eq!(set.get(7), Some(1));
        assert_eq!(set.len(), 2);
        assert_eq!(PolicyHash(0xab).to_string(), "00000000000000ab");
    }
}
