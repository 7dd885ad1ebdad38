//! The agent's file descriptor limit. Container runtimes (containerd 2.x) and systemd start a
//! process with a soft RLIMIT_NOFILE of 1024 and a far higher hard one, expecting a program
//! that needs more to raise it: the agent does at start, so that the proxy's and the
//! listeners' connections, the netlink sockets and the kernel objects it holds do not run out
//! of descriptors long before their own bounds are reached.
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
}
