//! What the agent writes besides the compiled endpoint tables: the allow set, and the hash
//! that names a policy.
use core::fmt;
use std::collections::BTreeMap;

use crate::abi::{ALLOW_ENTRY_MASK, allow_entry, allow_value};

/// The cgroups on the allow set: cgroup v2 id → the ALLOWED value (the allow entry that put
/// it there and what its entries grant, [`allow_value`]). What `ALLOWED` holds for one
/// generation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllowSet(BTreeMap<u64, u32>);

impl AllowSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Put a cgroup on the set with an ALLOWED value. When several entries select it, it
    /// is listed with the lowest entry index and has what any of them grants.
    pub fn insert(&mut self, cgroup_id: u64, value: u32) {
        let e = self.0.entry(cgroup_id).or_insert(value);
        let entry = allow_entry(*e).min(allow_entry(value));
        *e = allow_value(entry, (*e | value) & !ALLOW_ENTRY_MASK);
    }

    pub fn remove(&mut self, cgroup_id: u64) -> Option<u32> {
        self.0.remove(&cgroup_id)
    }

    /// The ALLOWED value of a cgroup, if it is on the set.
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

    /// (cgroup id, ALLOWED value) in cgroup id order.
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
    fn lowest_entry_and_every_grant_and_hash_is_16_hex_digits() {
        use crate::abi::{GRANT_CAPTURE, GRANT_METADATA};
        let (m, c) = (GRANT_METADATA, GRANT_CAPTURE);
        let set: AllowSet =
            [(7, allow_value(3, c)), (7, allow_value(1, m)), (9, allow_value(2, m))]
                .into_iter()
                .collect();
        assert_eq!(set.get(7), Some(allow_value(1, m | c)));
        assert_eq!(set.get(9), Some(allow_value(2, m)));
        assert_eq!(set.len(), 2);
        assert_eq!(PolicyHash(0xab).to_string(), "00000000000000ab");
    }
}
