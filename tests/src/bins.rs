//! The binaries the harness runs: gate-agent and the `probe` workload.
//!
//! Every harness function that starts one of them takes a [`Bins`]: the caller says which
//! build it means (xtask: the profile it just built; a test: the binaries of its own build).
use std::path::{Path, PathBuf};

/// Paths of the binaries that `cargo build -p gate-agent -p integration-tests --bins` builds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bins {
    pub agent: PathBuf,
    pub probe: PathBuf,
}

/// Environment variables that name each binary for a test process (see [`Bins::from_env`]).
const AGENT_VAR: &str = "GATE_AGENT_BIN";
const PROBE_VAR: &str = "PROBE_BIN";

impl Bins {
    /// The binaries in one target profile directory (`target/debug`, `target/release`).
    pub fn in_dir(dir: &Path) -> Bins {
        Bins { agent: dir.join("gate-agent"), probe: dir.join("probe") }
    }

    /// For a test process: each binary from its environment variable (`GATE_AGENT_BIN`,
    /// `PROBE_BIN`) if set, else from the target profile directory of the running executable.
    /// Reads the environment, never changes it.
    pub fn from_env() -> Bins {
        let dir = Bins::in_dir(&exe_profile_dir());
        let var = |name: &str, default: PathBuf| std::env::var_os(name).map_or(default, Into::into);
        Bins { agent: var(AGENT_VAR, dir.agent), probe: var(PROBE_VAR, dir.probe) }
    }

    /// The variables that make [`Bins::from_env`] in a child process find these binaries:
    /// set them on the child's `Command` (`cmd.envs(bins.env())`).
    pub fn env(&self) -> [(&'static str, &Path); 2] {
        [(AGENT_VAR, self.agent.as_path()), (PROBE_VAR, self.probe.as_path())]
    }
}

/// `target/<profile>` of the running executable (tests run from `target/<profile>/deps`).
fn exe_profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") { dir.parent().map(Path::to_path_buf).unwrap_or(dir) } else { dir }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names_what_from_env_reads() {
        let bins = Bins::in_dir(Path::new("/t/debug"));
        let names: Vec<&str> = bins.env().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, [AGENT_VAR, PROBE_VAR]);
        assert_eq!(bins.env()[1].1, Path::new("/t/debug/probe"));
    }
}
