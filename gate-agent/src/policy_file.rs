//! Policy file events: inotify on the file's directory (so that editors' write-and-rename
//! and Kubernetes ConfigMap volume symlink swaps are seen), debounced, plus SIGHUP.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use notify::{RecursiveMode, Watcher as _};
use tokio::sync::mpsc;

/// Wait this long after the first change before reloading, so a multi-step write is whole.
pub(crate) const DEBOUNCE: Duration = Duration::from_millis(20);

/// Why a reload was asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Trigger {
    FileChanged,
    Sighup,
}

impl Trigger {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Trigger::FileChanged => "file changed",
            Trigger::Sighup => "SIGHUP",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum FileEventsError {
    #[error("following changes to {path}: {source}")]
    Notify { path: PathBuf, source: notify::Error },
    #[error("installing the SIGHUP handler: {0}")]
    Signal(std::io::Error),
}

/// Keeps the inotify watcher alive; yields debounced reload triggers.
pub(crate) struct PolicyFileEvents {
    _watcher: notify::RecommendedWatcher,
    rx: mpsc::UnboundedReceiver<Trigger>,
    hup: tokio::signal::unix::Signal,
    /// A trigger received and waiting out its debounce. Kept here, not in the future, so that
    /// [`next`](Self::next) is cancellation-safe inside `select!`.
    pending: Option<(Trigger, tokio::time::Instant)>,
}

/// Whether an event touched the policy file (by name) or a ConfigMap volume's `..data` link.
fn relevant(event: &notify::Event, file_name: &std::ffi::OsStr) -> bool {
    event.paths.iter().any(|p| p.file_name().is_some_and(|n| n == file_name || n == "..data"))
}

impl PolicyFileEvents {
    pub(crate) fn new(policy: &Path) -> Result<PolicyFileEvents, FileEventsError> {
        let dir = match policy.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let file_name = policy.file_name().map(ToOwned::to_owned).unwrap_or_default();
        let (tx, rx) = mpsc::unbounded_channel();
        let mut watcher =
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
                Ok(ev) if ev.kind.is_access() => {}
                Ok(ev) if relevant(&ev, &file_name) => {
                    let _ = tx.send(Trigger::FileChanged);
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "policy file events"),
            })
            .map_err(|source| FileEventsError::Notify { path: dir.clone(), source })?;
        watcher
            .watch(&dir, RecursiveMode::NonRecursive)
            .map_err(|source| FileEventsError::Notify { path: dir.clone(), source })?;
        let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(FileEventsError::Signal)?;
        Ok(PolicyFileEvents { _watcher: watcher, rx, hup, pending: None })
    }

    /// The next reload trigger, after the debounce; `None` if the watcher died.
    /// Cancellation-safe: a trigger received before the future was dropped is not lost.
    pub(crate) async fn next(&mut self) -> Option<Trigger> {
        loop {
            if let Some((trigger, at)) = self.pending {
                // SIGHUP means now: it cuts a file change's debounce short.
                let trigger = tokio::select! {
                    _ = tokio::time::sleep_until(at) => trigger,
                    _ = self.hup.recv() => Trigger::Sighup,
                };
                self.pending = None;
                // Coalesce what arrived meanwhile.
                while self.rx.try_recv().is_ok() {}
                return Some(trigger);
            }
            let trigger = tokio::select! {
                t = self.rx.recv() => t?,
                _ = self.hup.recv() => Trigger::Sighup,
            };
            let now = tokio::time::Instant::now();
            let at = if trigger == Trigger::FileChanged { now + DEBOUNCE } else { now };
            self.pending = Some((trigger, at));
        }
    }
}
