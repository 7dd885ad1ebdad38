//! Terminating established connections that predate the gate (or a policy change).
//!
//! The eBPF programs deny new connects and drop packets on egress, but a socket that was
//! connected before the gate took effect stays open: its owner only sees a stalled
//! connection until TCP gives up. [`after_policy_change`] destroys such sockets the way
//! `ss -K` does: a netlink `sock_diag` dump of TCP and connected UDP sockets, then
//! `SOCK_DESTROY` for each one that the kernel programs would deny. The owner sees
//! `ECONNABORTED` at once.
//!
//! A socket is destroyed only if all of these hold, decided with gate-common's own functions
//! ([`match_endpoint`], [`cgroup_allowed`], [`decide`]) over the compiled policy, so user
//! space and kernel agree:
//! - its cgroup (`INET_DIAG_CGROUP_ID`, the cgroup that created it, which is what the egress
//!   program checks) is the gated root or a descendant of it;
//! - its destination (remote address, port, protocol; IPv4-mapped IPv6 as IPv4) is a
//!   protected endpoint;
//! - neither its cgroup nor an ancestor below the root is allowed, and the mode is enforce
//!   (audit mode destroys nothing and reports the matches as `audited`).
//!
//! Network namespaces scanned: the agent's own and every distinct one (by inode) of the
//! processes in cgroups at or below the gated root. Each foreign namespace is entered with
//! `setns(CLONE_NEWNET)` on a short-lived thread of its own ([`crate::netns`]); no other
//! thread changes namespace.
//!
//! Needs `CONFIG_INET_DIAG_DESTROY` (the kernel answers `SOCK_DESTROY` with `EOPNOTSUPP`
//! otherwise) and the cgroup id attribute of sock_diag (Linux 5.7+). Without either,
//! [`Report::unsupported`] says why and nothing is destroyed.
//!
//! Limits: cgroups deeper than [`MAX_CGROUP_DEPTH`](gate_common::abi::MAX_CGROUP_DEPTH)
//! below the root and cgroups created during the scan are not known to the scan and their
//! sockets are left alone (their packets are still dropped on egress); so are sockets in a
//! namespace in which no gated process lives any more (other than the agent's own).
//!
//! AF_PACKET sockets that predate the gate cannot be destroyed; [`count_pregate_sockets`]
//! names their holders instead (see [`pregate_sockets`]).
//!
//! Four parts: this module decides ([`Judge`]) and reports ([`Report`], the log lines of
//! [`after_policy_change`]); `scan` finds the namespaces and sockets to judge; `diag` is the
//! NETLINK_SOCK_DIAG client that dumps and destroys them; `pregate_sockets` finds the AF_PACKET
//! sockets opened before the gate (pre-gate sockets).
use std::{fmt, io, net::SocketAddr, path::PathBuf};

use gate_common::{
    abi::{AllowKey, GRANT_METADATA},
    compile::HostTables,
    user::{AllowSet, proto_name},
    verdict::{Dst, cgroup_allowed, decide, match_endpoint},
};

use crate::{cgroup::GatedRoot, netns::NetnsError, policy::Policy};

mod pregate_sockets;
mod scan;

pub(crate) use scan::terminate_established;

/// What can stop a scan, or one namespace of it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TerminateError {
    #[error("network namespace {netns}: {op}: {source}")]
    Io { netns: String, op: &'static str, source: io::Error },
    #[error("network namespace {netns}: malformed sock_diag reply: {error}")]
    Wire { netns: String, error: crate::netlink::DecodeError },
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("the blocking scan task failed: {0}")]
    Task(String),
}

/// Why the kernel cannot terminate established connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unsupported {
    /// `SOCK_DESTROY` answered `EOPNOTSUPP` (kernel without `CONFIG_INET_DIAG_DESTROY`).
    SockDestroy,
    /// sock_diag replies carry no cgroup id (kernel older than 5.7), so the gated sockets
    /// cannot be told apart from the others.
    CgroupId,
}

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Unsupported::SockDestroy => {
                "SOCK_DESTROY rejected with EOPNOTSUPP (kernel built without CONFIG_INET_DIAG_DESTROY)"
            }
            Unsupported::CgroupId => {
                "sock_diag reports no socket cgroup ids (INET_DIAG_CGROUP_ID needs Linux 5.7+)"
            }
        })
    }
}

/// One socket that matched: destroyed (enforce) or would have been (audit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Conn {
    pub cgroup_id: u64,
    /// Path of its cgroup relative to the gated root (`.` for the root itself).
    pub cgroup: PathBuf,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// IP protocol number.
    pub proto: u8,
    /// Index of the policy endpoint it matched.
    pub endpoint: u32,
}

/// What a scan found and did.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// Network namespaces scanned.
    pub netns: usize,
    /// Sockets inspected (all connected TCP and UDP sockets of those namespaces).
    pub scanned: usize,
    /// Sockets destroyed.
    pub destroyed: Vec<Conn>,
    /// Audit mode: sockets that enforce mode would have destroyed.
    pub audited: Vec<Conn>,
    /// Sockets that should have been destroyed but the kernel rejected (see `unsupported`).
    pub refused: usize,
    /// Set when the kernel cannot do it; then nothing is destroyed.
    pub unsupported: Option<Unsupported>,
    /// UDP sockets could not be dumped or destroyed (no udp_diag, or no UDP SOCK_DESTROY);
    /// connected UDP sockets were left alone (their datagrams are still dropped on egress).
    pub udp_unsupported: bool,
    /// Namespaces that could not be scanned completely (the others were).
    pub errors: Vec<TerminateError>,
    /// Gated processes whose network namespace the agent could not open: not in its pid
    /// namespace (a pod without hostPID), not open to it (without CAP_SYS_PTRACE), or exited
    /// during the scan. Their connections were
    /// not checked (their packets are still dropped).
    pub hidden: usize,
}

impl Report {
    /// One line for status output.
    pub(crate) fn status_line(&self) -> String {
        match self.unsupported {
            Some(why) => format!("terminate-established: unsupported by this kernel ({why})"),
            None => format!(
                "terminate-established: on ({} destroyed in {} network namespaces{}{})",
                self.destroyed.len(),
                self.netns,
                if self.udp_unsupported { "; UDP unsupported by this kernel" } else { "" },
                if self.hidden > 0 {
                    format!(
                        "; {} gated processes' namespaces not open to the agent (it needs \
                         hostPID and CAP_SYS_PTRACE)",
                        self.hidden
                    )
                } else {
                    String::new()
                }
            ),
        }
    }

    fn merge(&mut self, o: Report) {
        self.netns += o.netns;
        self.scanned += o.scanned;
        self.destroyed.extend(o.destroyed);
        self.audited.extend(o.audited);
        self.refused += o.refused;
        self.unsupported = self.unsupported.or(o.unsupported);
        self.udp_unsupported |= o.udp_unsupported;
        self.errors.extend(o.errors);
        self.hidden += o.hidden;
    }
}

// ---- the decision ----------------------------------------------------------------------------

/// The decision context: the compiled policy and allow set, in the form the kernel programs
/// read them.
pub(crate) struct Judge {
    tables: HostTables,
    generation: u32,
    mode: u32,
    root_level: u32,
}

impl Judge {
    /// The policy's compiled image and the allow set as written to the maps.
    pub(crate) fn new(policy: &Policy, root: &GatedRoot, allow: &AllowSet) -> Judge {
        let generation = 0;
        let mut tables = HostTables::default();
        tables.load(policy.image(), generation);
        for (id, entry) in allow.iter() {
            tables.allow(AllowKey::new(generation, id), entry);
        }
        Judge { tables, generation, mode: policy.mode.id(), root_level: root.level }
    }

    /// (endpoint, verdict) for traffic to `dst` from a cgroup whose ids below the gated root
    /// are `chain` (outermost first), or `None` if `dst` is not protected.
    fn verdict(&self, dst: &Dst, chain: &[u64]) -> Option<(u32, u32)> {
        let endpoint = match_endpoint(&self.tables, self.generation, dst)?;
        Some((endpoint, decide(self.mode, self.allowed(chain))))
    }

    /// Whether a cgroup whose ids below the gated root are `chain` is allowed.
    fn allowed(&self, chain: &[u64]) -> bool {
        let ancestor = |level: u32| {
            level
                .checked_sub(self.root_level + 1)
                .and_then(|i| chain.get(i as usize).copied())
                .unwrap_or(0)
        };
        let need = GRANT_METADATA;
        cgroup_allowed(&self.tables, self.generation, self.root_level, need, ancestor).is_some()
    }
}

// ---- entry points ----------------------------------------------------------------------------

/// Run `scan` off the async runtime with the decision context of `policy` and `allow`.
async fn judged<T: Send + 'static>(
    root: &GatedRoot,
    policy: &Policy,
    allow: AllowSet,
    scan: fn(&GatedRoot, &Judge) -> T,
) -> Result<T, TerminateError> {
    let (root, policy) = (root.clone(), policy.clone());
    tokio::task::spawn_blocking(move || scan(&root, &Judge::new(&policy, &root, &allow)))
        .await
        .map_err(|e| TerminateError::Task(e.to_string()))
}

/// Destroy the sockets the current policy denies, logging each and a summary; call it once the
/// gate is attached, and again after each policy change. Runs the scan off the async runtime.
/// `allow` is the mode's allow set for `policy`, resolved afresh by the caller (a cgroup that
/// has just appeared under an allowed glob or pod is spared even if the maps lag behind).
pub(crate) async fn after_policy_change(
    root: &GatedRoot,
    policy: &Policy,
    allow: AllowSet,
) -> Option<Report> {
    let scan = judged(root, policy, allow, terminate_established).await;
    let report = match scan {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "terminating established connections");
            return None;
        }
    };
    let endpoint = |i: u32| policy.endpoints.get(i as usize).map_or("?", |e| e.name.as_str());
    for c in &report.destroyed {
        tracing::info!(
            cgroup = %c.cgroup.display(), src = %c.src, dst = %c.dst.ip(), port = c.dst.port(),
            proto = proto_name(c.proto), endpoint = endpoint(c.endpoint),
            "terminated established connection"
        );
    }
    for c in &report.audited {
        tracing::info!(
            cgroup = %c.cgroup.display(), src = %c.src, dst = %c.dst.ip(), port = c.dst.port(),
            proto = proto_name(c.proto), endpoint = endpoint(c.endpoint), verdict = "audited",
            "established connection left open (audit mode)"
        );
    }
    for e in &report.errors {
        tracing::warn!(error = %e, "terminating established connections");
    }
    if let Some(why) = report.unsupported {
        tracing::warn!(reason = %why, refused = report.refused, "terminate-established: unsupported by this kernel");
    }
    if report.udp_unsupported {
        tracing::warn!("terminate-established: UDP sockets unsupported by this kernel; left open");
    }
    tracing::info!(
        netns = report.netns,
        scanned = report.scanned,
        destroyed = report.destroyed.len(),
        audited = report.audited.len(),
        hidden = report.hidden,
        status = %report.status_line(),
        "established connections checked"
    );
    Some(report)
}

/// Name every AF_PACKET socket a gated, not allowed process holds (see
/// [`pregate_sockets`]); call it once the gate is attached. Returns how many there are
/// (`None`: the scan failed).
pub(crate) async fn count_pregate_sockets(
    root: &GatedRoot,
    policy: &Policy,
    allow: AllowSet,
) -> Option<usize> {
    let holders = judged(root, policy, allow, pregate_sockets::packet_holders).await;
    let holders = match holders {
        Ok(h) => h,
        Err(e) => {
            tracing::error!(error = %e, "looking for AF_PACKET sockets that predate the gate");
            return None;
        }
    };
    for h in &holders {
        tracing::warn!(
            pid = h.pid, comm = %h.comm, cgroup = %h.cgroup.display(), inode = h.inode,
            "a gated process holds an AF_PACKET socket opened before the gate: if it set \
             PACKET_QDISC_BYPASS, its frames skip every tc program, this gate's included; \
             restart it"
        );
    }
    Some(holders.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_flag_defaults_on_and_takes_false() {
        use clap::Parser as _;
        let run = |extra: &[&str]| {
            let args = ["gate-agent", "run", "--policy", "p", "--cgroup-root", "c"];
            match crate::cli::Cli::try_parse_from(args.iter().chain(extra)).unwrap().command {
                crate::cli::Command::Run(r) => r.terminate_established,
                _ => unreachable!(),
            }
        };
        assert!(run(&[]));
        assert!(run(&["--terminate-established"]));
        assert!(run(&["--terminate-established=true"]));
        assert!(!run(&["--terminate-established=false"]));
        assert!(!run(&["--terminate-established", "false"]));
    }

    #[test]
    fn status_lines() {
        let r = Report { unsupported: Some(Unsupported::SockDestroy), ..Report::default() };
        assert!(r.status_line().starts_with("terminate-established: unsupported by this kernel"));
        let r = Report { netns: 2, ..Report::default() };
        assert_eq!(
            r.status_line(),
            "terminate-established: on (0 destroyed in 2 network namespaces)"
        );
    }
}
