//! The agent's resource limits, raised at start.
//!
//! - RLIMIT_NOFILE: container runtimes (containerd 2.x) and systemd start a process with a
//!   soft limit of 1024 and a far higher hard one, expecting a program that needs more to
//!   raise it, so that the proxy's and the listeners' connections, the netlink sockets and
//!   the kernel objects the agent holds do not run out of descriptors long before their own
//!   bounds are reached.
//! - RLIMIT_MEMLOCK: kernels before 5.11 charge BPF maps and programs to it (later ones to
//!   the memory cgroup), and a process often starts with 64 KiB or 8 MiB, less than the gate
//!   needs; the DaemonSet grants CAP_SYS_RESOURCE to lift it, as aya-template's programs do.
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Raise the soft RLIMIT_NOFILE to the hard one; a failure is logged, not fatal (the agent
/// runs as before, with less room).
pub(crate) fn raise_nofile() {
    let before = getrlimit(Resource::Nofile);
    let shown = |v: Option<u64>| v.map_or_else(|| "unlimited".to_owned(), |n| n.to_string());
    if before.current == before.maximum {
        tracing::info!(soft = %shown(before.current), hard = %shown(before.maximum), "file descriptor limit");
        return;
    }
    let raised = Rlimit { current: before.maximum, maximum: before.maximum };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => {
            let after = getrlimit(Resource::Nofile);
            tracing::info!(
                before = %shown(before.current),
                soft = %shown(after.current),
                hard = %shown(after.maximum),
                "file descriptor limit raised to the hard limit"
            );
        }
        Err(e) => tracing::warn!(
            error = %e,
            soft = %shown(before.current),
            hard = %shown(before.maximum),
            "could not raise the file descriptor limit; it stays as it was"
        ),
    }
}

/// Lift RLIMIT_MEMLOCK (to unlimited, else the soft limit to the hard one); a failure is
/// logged, not fatal: 5.11 and later never consult it, and on older kernels a load that
/// needs more fails with its own error.
pub(crate) fn raise_memlock() {
    let before = getrlimit(Resource::Memlock);
    let shown = |v: Option<u64>| v.map_or_else(|| "unlimited".to_owned(), |n| n.to_string());
    if before.current.is_none() {
        return;
    }
    let unlimited = Rlimit { current: None, maximum: None };
    let to_hard = Rlimit { current: before.maximum, maximum: before.maximum };
    match setrlimit(Resource::Memlock, unlimited).or_else(|_| setrlimit(Resource::Memlock, to_hard))
    {
        Ok(()) => tracing::info!(
            before = %shown(before.current),
            soft = %shown(getrlimit(Resource::Memlock).current),
            "locked memory limit raised (BPF memory on kernels before 5.11)"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            soft = %shown(before.current),
            "could not raise the locked memory limit; kernels before 5.11 charge BPF maps to it"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Raising to the hard limit needs no privilege, and the hard limit stays.
    #[test]
    fn the_soft_limit_reaches_the_hard_one() {
        let before = getrlimit(Resource::Nofile);
        raise_nofile();
        let after = getrlimit(Resource::Nofile);
        assert_eq!(after.maximum, before.maximum);
        if before.maximum.is_some() {
            assert_eq!(after.current, after.maximum);
        }
    }

    /// Without CAP_SYS_RESOURCE the soft limit still reaches the hard one; with it, no limit.
    #[test]
    fn the_locked_memory_limit_is_lifted_as_far_as_allowed() {
        let before = getrlimit(Resource::Memlock);
        raise_memlock();
        let after = getrlimit(Resource::Memlock);
        assert_eq!(after.current, after.maximum, "{before:?} -> {after:?}");
    }
}
