//! One agent per gate: `run` holds an exclusive `flock` on the pin dir for as long as it
//! lives (the kernel drops it when the process ends, however it ends, so no lock is ever
//! stale). A second `run` on the same pin dir, and `cleanup` while an agent runs, are
//! fails with the holder's pid, read from `/proc/locks`.
use std::{fs::File, io, os::unix::fs::MetadataExt as _, path::Path};

use rustix::fs::{FlockOperation, flock};

use super::LoaderError;

/// The held lock; dropping it releases the pin dir.
#[derive(Debug)]
pub(crate) struct PinLock {
    _dir: File,
}

/// Take the pin dir's lock, or say who holds it.
pub(crate) fn lock(pin_dir: &Path) -> Result<PinLock, LoaderError> {
    let dir = File::open(pin_dir).map_err(|source| LoaderError::Io {
        what: "opening the pin dir to lock",
        path: pin_dir.to_path_buf(),
        source,
    })?;
    if let Err(e) = flock(&dir, FlockOperation::NonBlockingLockExclusive) {
        let e = io::Error::from(e);
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(LoaderError::Locked {
                pin_dir: pin_dir.to_path_buf(),
                holder: holder(pin_dir).map_or_else(|| "unknown".into(), |p| p.to_string()),
            });
        }
        return Err(LoaderError::Io { what: "locking", path: pin_dir.to_path_buf(), source: e });
    }
    Ok(PinLock { _dir: dir })
}

/// The pid of the process holding the pin dir's lock, if any (as `/proc/locks` shows it in
/// this pid namespace).
pub(crate) fn holder(pin_dir: &Path) -> Option<u32> {
    let meta = std::fs::metadata(pin_dir).ok()?;
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    holder_in(&locks, meta.dev(), meta.ino())
}

/// `/proc/locks` lines: `1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF`, the device as
/// hex major:minor.
fn holder_in(locks: &str, dev: u64, ino: u64) -> Option<u32> {
    let want = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // "->" marks a waiter, not a holder.
        (f.get(1) == Some(&"FLOCK") && f.get(5) == Some(&want.as_str()))
            .then(|| f.get(4)?.parse().ok())
            .flatten()
    })
}

/// Whether a pin dir is locked by a running agent, for `cleanup` (which fails then).
pub(crate) fn running_agent(pin_dir: &Path) -> Option<u32> {
    let dir = File::open(pin_dir).ok()?;
    // Released when `dir` drops.
    let free = flock(&dir, FlockOperation::NonBlockingLockExclusive).is_ok();
    if free { None } else { Some(holder(pin_dir).unwrap_or(0)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_holder_by_device_and_inode() {
        let locks = "1: POSIX  ADVISORY  WRITE 77 00:2d:99 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 4242 00:2d:5678 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 4343 00:2d:5678 0 EOF\n";
        let dev = libc::makedev(0, 0x2d);
        assert_eq!(holder_in(locks, dev, 5678), Some(4242));
        assert_eq!(holder_in(locks, dev, 99), None, "POSIX locks are not ours");
        assert_eq!(holder_in(locks, dev, 1), None);
    }

    #[test]
    fn a_second_lock_is_refused_naming_the_holder() {
        let dir = std::env::temp_dir().join(format!("mg-lock-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let held = lock(&dir).expect("first lock");
        // flock locks belong to the open file: a second open in this process conflicts too.
        match lock(&dir) {
            Err(LoaderError::Locked { holder, .. }) => {
                assert_eq!(holder, std::process::id().to_string())
            }
            other => panic!("second lock: {other:?}"),
        }
        assert_eq!(running_agent(&dir), Some(std::process::id()));
        drop(held);
        assert_eq!(running_agent(&dir), None);
        let _ = std::fs::remove_dir(&dir);
    }
}
