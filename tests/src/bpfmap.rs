//! Reaching into a pinned map from a test, through aya's typed maps: fill the gate's IPv4
//! prefix trie with junk (to make the agent's next write fail, as a full map would) and take
//! the junk out again.
use std::path::Path;

use anyhow::{Context as _, Result};
use aya::maps::{
    Map, MapData, MapError,
    lpm_trie::{Key, LpmTrie},
};

/// A PREFIX_V4 key's data after its prefix length: the generation (4 bytes) and the address.
type KeyData = [u8; 8];
/// A PREFIX_V4 value (`PrefixValue`, 12 bytes), contents irrelevant here.
type Value = [u8; 12];

/// The gate's IPv4 prefix trie filled to the brim with entries of generation 2, which no
/// lookup ever reads (programs look up generation 0 or 1): the next policy write fails as
/// on a full map. Dropping it takes them out.
pub struct JunkV4 {
    map: LpmTrie<MapData, KeyData, Value>,
    keys: Vec<Key<KeyData>>,
}

impl JunkV4 {
    pub fn fill(pin: &Path) -> Result<JunkV4> {
        let data = MapData::from_pin(pin).with_context(|| format!("opening {}", pin.display()))?;
        let mut map: LpmTrie<MapData, KeyData, Value> = Map::from_map_data(data)
            .and_then(LpmTrie::try_from)
            .with_context(|| format!("{} as an IPv4 prefix trie", pin.display()))?;
        let mut keys = Vec::new();
        for i in 0u32.. {
            let mut data = [0u8; 8];
            data[..4].copy_from_slice(&2u32.to_be_bytes());
            data[4..].copy_from_slice(&i.to_be_bytes());
            let key = Key::new(64, data);
            match map.insert(&key, [0u8; 12], 0) {
                Ok(()) => keys.push(key),
                Err(MapError::SyscallError(e))
                    if matches!(e.io_error.raw_os_error(), Some(libc::ENOSPC | libc::E2BIG)) =>
                {
                    break;
                }
                Err(e) => return Err(e).context("filling the prefix trie"),
            }
        }
        Ok(JunkV4 { map, keys })
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

impl Drop for JunkV4 {
    fn drop(&mut self) {
        for k in &self.keys {
            let _ = self.map.remove(k);
        }
    }
}
