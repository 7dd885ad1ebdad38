//! Just enough bpf(2) to reach into a pinned map from a test: fill it with junk (to make the
//! agent's next write fail, as a full map would) and take the junk out again.
use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use anyhow::{Context as _, Result};

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_OBJ_GET: libc::c_long = 7;

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a properly sized bpf_attr prefix for `cmd`.
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, cmd, attr as *mut T as *mut libc::c_void, size_of::<T>())
    };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

#[repr(C)]
struct ObjGet {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

#[repr(C)]
struct Elem {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// A pinned map, opened.
pub struct PinnedMap(OwnedFd);

impl PinnedMap {
    pub fn open(path: &Path) -> Result<PinnedMap> {
        let c = CString::new(path.as_os_str().as_bytes())?;
        let mut attr = ObjGet { pathname: c.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
        let fd =
            bpf(BPF_OBJ_GET, &mut attr).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: a new fd we own.
        Ok(PinnedMap(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
    }

    pub fn insert(&self, key: &[u8], value: &[u8]) -> io::Result<()> {
        let mut attr = Elem {
            map_fd: self.0.as_raw_fd() as u32,
            _pad: 0,
            key: key.as_ptr() as u64,
            value: value.as_ptr() as u64,
            flags: 0,
        };
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
    }

    pub fn remove(&self, key: &[u8]) -> io::Result<()> {
        let mut attr = Elem {
            map_fd: self.0.as_raw_fd() as u32,
            _pad: 0,
            key: key.as_ptr() as u64,
            value: 0,
            flags: 0,
        };
        bpf(BPF_MAP_DELETE_ELEM, &mut attr).map(drop)
    }
}

/// The gate's IPv4 prefix trie filled to the brim with entries of generation 2, which no
/// lookup ever reads (programs look up generation 0 or 1): the next policy write fails as
/// on a full map. Dropping it takes them out.
pub struct JunkV4 {
    map: PinnedMap,
    keys: Vec<[u8; 12]>,
}

impl JunkV4 {
    pub fn fill(pin: &Path) -> Result<JunkV4> {
        let map = PinnedMap::open(pin)?;
        let mut keys = Vec::new();
        // struct { u32 prefixlen; u8 generation[4]; u8 addr[4] }, value: 12 bytes.
        for i in 0u32.. {
            let mut key = [0u8; 12];
            key[..4].copy_from_slice(&64u32.to_ne_bytes());
            key[4..8].copy_from_slice(&2u32.to_be_bytes());
            key[8..].copy_from_slice(&i.to_be_bytes());
            match map.insert(&key, &[0u8; 12]) {
                Ok(()) => keys.push(key),
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::E2BIG)) => break,
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
