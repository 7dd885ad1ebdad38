//! Running code inside another network namespace.
//!
//! A network namespace belongs to a thread, not to the process, and the agent's async runtime
//! must never change its own. [`run_in`] therefore spawns a short-lived thread, has it
//! `setns(CLONE_NEWNET)` into the namespace, runs the closure there and returns its result;
//! the thread, and the namespace with it, ends when the closure does. No other thread changes
//! namespace.
use std::{
    fs::File,
    io,
    os::fd::{AsFd as _, BorrowedFd},
    path::Path,
};

/// The network namespace to run in.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Netns<'a> {
    /// The namespace of the calling thread: nothing is entered, the closure still runs on a
    /// thread of its own (so a panic in it is reported like in any other namespace).
    Current,
    /// A namespace file (`/run/netns/NAME`, `/proc/PID/ns/net`), opened on the new thread.
    Path(&'a Path),
    /// An open namespace file, and the name errors give it.
    File { file: &'a File, name: &'a str },
}

impl Netns<'_> {
    /// How errors name the namespace.
    pub(crate) fn name(&self) -> String {
        match self {
            Netns::Current => "(the agent's own)".to_owned(),
            Netns::Path(path) => path.display().to_string(),
            Netns::File { name, .. } => (*name).to_owned(),
        }
    }
}

/// What kept a closure from running in a network namespace, or from returning.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NetnsError {
    #[error("network namespace {netns}: {op}: {source}")]
    Io { netns: String, op: &'static str, source: io::Error },
    #[error("network namespace {netns}: the thread running in it panicked")]
    Panicked { netns: String },
}

/// Run `f` on a short-lived thread (named `thread`) inside `netns` and return its result.
pub(crate) fn run_in<T: Send>(
    netns: Netns<'_>,
    thread: &str,
    f: impl FnOnce() -> T + Send,
) -> Result<T, NetnsError> {
    let io_err = |op, source| NetnsError::Io { netns: netns.name(), op, source };
    std::thread::scope(|s| {
        let handle = std::thread::Builder::new().name(thread.to_owned()).spawn_scoped(s, || {
            match netns {
                Netns::Current => {}
                Netns::Path(path) => {
                    let file = File::open(path).map_err(|e| io_err("opening", e))?;
                    enter(file.as_fd()).map_err(|e| io_err("setns", e))?;
                }
                Netns::File { file, .. } => enter(file.as_fd()).map_err(|e| io_err("setns", e))?,
            }
            Ok(f())
        });
        match handle {
            Ok(h) => h.join().unwrap_or_else(|_| Err(NetnsError::Panicked { netns: netns.name() })),
            Err(e) => Err(io_err("spawning a thread", e)),
        }
    })
}

/// Move the calling thread into the network namespace `fd`.
fn enter(fd: BorrowedFd<'_>) -> io::Result<()> {
    // setns(2) changes the namespace of the calling thread only, which is the short-lived
    // thread of `run_in`.
    Ok(rustix::thread::move_into_link_name_space(
        fd,
        Some(rustix::thread::LinkNameSpaceType::Network),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (device, inode) of the namespace the calling thread is in.
    fn current() -> (u64, u64) {
        use std::os::unix::fs::MetadataExt as _;
        let m = std::fs::metadata("/proc/thread-self/ns/net").unwrap();
        (m.dev(), m.ino())
    }

    #[test]
    fn runs_on_a_named_thread_and_returns_the_result() {
        let here = current();
        let (name, ns) = run_in(Netns::Current, "mg-netns-test", || {
            (std::thread::current().name().map(str::to_owned), current())
        })
        .unwrap();
        assert_eq!(name.as_deref(), Some("mg-netns-test"));
        assert_eq!(ns, here, "Current enters nothing");
        // Entering the namespace one is already in changes nothing either (needs
        // CAP_SYS_ADMIN; without it the error names the namespace and the operation).
        let file = File::open("/proc/thread-self/ns/net").unwrap();
        match run_in(Netns::File { file: &file, name: "mine" }, "mg-netns-test", current) {
            Ok(ns) => assert_eq!(ns, here),
            Err(e) => assert!(e.to_string().starts_with("network namespace mine: setns: "), "{e}"),
        }
    }

    #[test]
    fn errors_name_the_namespace_and_the_operation() {
        let e = run_in(Netns::Path(Path::new("/nonexistent/netns")), "mg-netns-test", || ())
            .unwrap_err();
        assert!(
            e.to_string().starts_with("network namespace /nonexistent/netns: opening: "),
            "{e}"
        );
        let e = run_in(Netns::Current, "mg-netns-test", || panic!("boom")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "network namespace (the agent's own): the thread running in it panicked"
        );
        // A file that is no namespace: setns rejects it.
        let file = File::open("/proc/self/status").unwrap();
        let e = run_in(Netns::File { file: &file, name: "status" }, "mg-netns-test", || ())
            .unwrap_err();
        assert!(e.to_string().starts_with("network namespace status: setns: "), "{e}");
    }
}
