//! Terminating established connections that predate the gate (or a policy change).
//!
//! The eBPF programs refuse new connects and drop packets on egress, but a socket that was
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
//! `setns(CLONE_NEWNET)` on a short-lived thread of its own; no other thread changes
//! namespace.
//!
//! Needs `CONFIG_INET_DIAG_DESTROY` (the kernel answers `SOCK_DESTROY` with `EOPNOTSUPP`
//! otherwise) and the cgroup id attribute of sock_diag (Linux 5.7+). Without either,
//! [`Report::unsupported`] says why and nothing is destroyed.
//!
//! Limits: cgroups deeper than [`MAX_CGROUP_DEPTH`](gate_common::abi::MAX_CGROUP_DEPTH)
//! below the root and cgroups created during the scan are not known to the scan and their
//! sockets are left alone (their packets are still dropped on egress); so are sockets in a
//! namespace in which no gated process lives any more (other than the agent's own).
use std::{
    collections::{HashMap, HashSet},
    fmt,
    fs::File,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use gate_common::{
    abi::{AllowKey, PROTO_TCP, PROTO_UDP, VERDICT_AUDITED, VERDICT_DENIED},
    compile::HostTables,
    user::{AllowSet, proto_name},
    verdict::{Addr, Dst, cgroup_allowed, decide, match_endpoint},
};

use crate::{cgroup::GatedRoot, policy::Policy};

/// What can stop a scan, or one namespace of it.
#[derive(Debug, thiserror::Error)]
pub enum TerminateError {
    #[error("network namespace {netns}: {op}: {source}")]
    Io { netns: String, op: &'static str, source: io::Error },
    #[error("network namespace {netns}: malformed sock_diag reply: {error}")]
    Wire { netns: String, error: WireError },
    #[error("network namespace {netns}: the scanning thread panicked")]
    Thread { netns: String },
    #[error("the blocking scan task failed: {0}")]
    Task(String),
}

/// Why the kernel cannot terminate established connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsupported {
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
                "SOCK_DESTROY refused with EOPNOTSUPP (kernel built without CONFIG_INET_DIAG_DESTROY)"
            }
            Unsupported::CgroupId => {
                "sock_diag reports no socket cgroup ids (INET_DIAG_CGROUP_ID needs Linux 5.7+)"
            }
        })
    }
}

/// One socket that matched: destroyed (enforce) or would have been (audit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conn {
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
pub struct Report {
    /// Network namespaces scanned.
    pub netns: usize,
    /// Sockets inspected (all connected TCP and UDP sockets of those namespaces).
    pub scanned: usize,
    /// Sockets destroyed.
    pub destroyed: Vec<Conn>,
    /// Audit mode: sockets that enforce mode would have destroyed.
    pub audited: Vec<Conn>,
    /// Sockets that should have been destroyed but the kernel refused (see `unsupported`).
    pub refused: usize,
    /// Set when the kernel cannot do it; then nothing is destroyed.
    pub unsupported: Option<Unsupported>,
    /// UDP sockets could not be dumped or destroyed (no udp_diag, or no UDP SOCK_DESTROY);
    /// connected UDP sockets were left alone (their datagrams are still dropped on egress).
    pub udp_unsupported: bool,
    /// Namespaces that could not be scanned completely (the others were).
    pub errors: Vec<TerminateError>,
}

impl Report {
    /// One line for status output.
    pub fn status_line(&self) -> String {
        match self.unsupported {
            Some(why) => format!("terminate-established: unsupported by this kernel ({why})"),
            None => format!(
                "terminate-established: on ({} destroyed in {} network namespaces{})",
                self.destroyed.len(),
                self.netns,
                if self.udp_unsupported { "; UDP unsupported by this kernel" } else { "" }
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
    }
}

// ---- the decision ----------------------------------------------------------------------------

/// The compiled policy and allow set, in the form the kernel programs read them.
pub struct Scope {
    tables: HostTables,
    generation: u32,
    mode: u32,
    root_level: u32,
}

impl Scope {
    /// `allow` is the allow set as written to the maps.
    pub fn new(policy: &Policy, root: &GatedRoot, allow: &AllowSet) -> Scope {
        let generation = 0;
        let mut tables = HostTables::default();
        tables.load(policy.image(), generation);
        for (id, entry) in allow.iter() {
            tables.allow(AllowKey::new(generation, id), entry);
        }
        Scope { tables, generation, mode: policy.mode.id(), root_level: root.level }
    }

    /// (endpoint, verdict) for traffic to `dst` from a cgroup whose ids below the gated root
    /// are `chain` (outermost first), or `None` if `dst` is not protected.
    fn judge(&self, dst: &Dst, chain: &[u64]) -> Option<(u32, u32)> {
        let endpoint = match_endpoint(&self.tables, self.generation, dst)?;
        let ancestor = |level: u32| {
            level
                .checked_sub(self.root_level + 1)
                .and_then(|i| chain.get(i as usize).copied())
                .unwrap_or(0)
        };
        let allowed =
            cgroup_allowed(&self.tables, self.generation, self.root_level, ancestor).is_some();
        Some((endpoint, decide(self.mode, allowed)))
    }
}

/// The cgroups at or below the gated root: id → (relative path, ids of the path's
/// components below the root, outermost first).
struct CgroupIndex(HashMap<u64, (PathBuf, Vec<u64>)>);

impl CgroupIndex {
    fn new(root_id: u64, walked: Vec<(PathBuf, u64)>) -> CgroupIndex {
        let by_path: HashMap<&Path, u64> =
            walked.iter().map(|(p, id)| (p.as_path(), *id)).collect();
        let mut map: HashMap<u64, (PathBuf, Vec<u64>)> = walked
            .iter()
            .map(|(rel, id)| {
                let mut chain: Vec<u64> = rel
                    .ancestors()
                    .filter(|a| !a.as_os_str().is_empty())
                    .map(|a| by_path.get(a).copied().unwrap_or(0))
                    .collect();
                chain.reverse();
                (*id, (rel.clone(), chain))
            })
            .collect();
        map.insert(root_id, (PathBuf::from("."), Vec::new()));
        CgroupIndex(map)
    }

    fn get(&self, id: u64) -> Option<&(PathBuf, Vec<u64>)> {
        self.0.get(&id)
    }

    fn paths(&self) -> impl Iterator<Item = &Path> {
        self.0.values().map(|(p, _)| p.as_path())
    }
}

// ---- entry points ----------------------------------------------------------------------------

/// Destroy the sockets the current policy denies, logging each and a summary; call it once the
/// gate is attached, and again after each policy change. Runs the scan off the async runtime.
/// `allow` is the mode's allow set for `policy`, resolved afresh by the caller (a cgroup that
/// has just appeared under an allowed glob or pod is spared even if the maps lag behind).
pub async fn after_policy_change(
    root: &GatedRoot,
    policy: &Policy,
    allow: AllowSet,
) -> Option<Report> {
    let (root, policy) = (root.clone(), policy.clone());
    let result = tokio::task::spawn_blocking(move || {
        let scope = Scope::new(&policy, &root, &allow);
        let report = terminate_established(&root, &scope);
        Ok::<_, TerminateError>((report, policy))
    })
    .await
    .map_err(|e| TerminateError::Task(e.to_string()))
    .and_then(|r| r);
    let (report, policy) = match result {
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
        status = %report.status_line(),
        "established connections checked"
    );
    Some(report)
}

/// The blocking scan: every namespace of the gated processes plus the agent's own.
pub fn terminate_established(root: &GatedRoot, scope: &Scope) -> Report {
    let index = CgroupIndex::new(root.id, root.walk());
    let mut report = scan_here("agent", scope, &index);
    let mut seen: HashSet<(u64, u64)> =
        netns_id(Path::new("/proc/thread-self/ns/net")).ok().into_iter().collect();
    for (pid, file, id) in gated_namespaces(root, &index) {
        if seen.insert(id) {
            let label = format!("net:[{}] of pid {pid}", id.1);
            report.merge(scan_in(&label, file, scope, &index));
        }
    }
    report
}

/// Scan the namespace `netns` on a thread of its own, which enters it and then ends.
fn scan_in(label: &str, netns: File, scope: &Scope, index: &CgroupIndex) -> Report {
    let failed = |e: TerminateError| Report { errors: vec![e], ..Report::default() };
    let io_err = |op, source| TerminateError::Io { netns: label.to_string(), op, source };
    std::thread::scope(|s| {
        let handle =
            std::thread::Builder::new().name("mg-terminate".into()).spawn_scoped(s, || {
                // SAFETY: valid namespace fd; changes only this short-lived thread.
                if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return failed(io_err("setns", io::Error::last_os_error()));
                }
                scan_here(label, scope, index)
            });
        match handle {
            Ok(h) => h
                .join()
                .unwrap_or_else(|_| failed(TerminateError::Thread { netns: label.to_string() })),
            Err(e) => failed(io_err("spawning a thread", e)),
        }
    })
}

/// (device, inode) of a namespace file.
fn netns_id(path: &Path) -> io::Result<(u64, u64)> {
    std::fs::metadata(path).map(|m| (m.dev(), m.ino()))
}

/// The distinct network namespaces of the processes in cgroups at or below the root: (a pid
/// in it, the open namespace file, its (device, inode)). Processes that exit meanwhile are
/// skipped.
fn gated_namespaces(root: &GatedRoot, index: &CgroupIndex) -> Vec<(u32, File, (u64, u64))> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for rel in index.paths() {
        let Ok(procs) = std::fs::read_to_string(root.path.join(rel).join("cgroup.procs")) else {
            continue;
        };
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let Ok(file) = File::open(format!("/proc/{pid}/ns/net")) else { continue };
            let Ok(meta) = file.metadata() else { continue };
            let id = (meta.dev(), meta.ino());
            if seen.insert(id) {
                out.push((pid, file, id));
            }
        }
    }
    out
}

/// TCP states of a connected socket: ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2,
/// CLOSE_WAIT, LAST_ACK, CLOSING (not LISTEN, SYN_RECV, TIME_WAIT, CLOSE).
const TCP_CONNECTED_STATES: u32 =
    (1 << 1) | (1 << 2) | (1 << 4) | (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11);
/// A connected UDP socket is in state ESTABLISHED.
const UDP_CONNECTED_STATES: u32 = 1 << 1;

/// Scan the namespace of the calling thread.
fn scan_here(label: &str, scope: &Scope, index: &CgroupIndex) -> Report {
    match DiagSocket::open() {
        Ok(mut sock) => scan_with(&mut sock, label, scope, index),
        Err(source) => Report {
            netns: 1,
            errors: vec![TerminateError::Io {
                netns: label.to_string(),
                op: "opening a NETLINK_SOCK_DIAG socket",
                source,
            }],
            ..Report::default()
        },
    }
}

/// The two sock_diag operations a scan uses (a fake in the unit tests).
trait Diag {
    fn dump(&mut self, family: u8, proto: u8, states: u32) -> Result<Vec<DiagSock>, DiagError>;
    fn destroy(&mut self, s: &DiagSock, proto: u8) -> Result<(), DiagError>;
}

/// Dump one namespace's connected sockets through `sock` and destroy the denied ones.
fn scan_with(sock: &mut impl Diag, label: &str, scope: &Scope, index: &CgroupIndex) -> Report {
    let mut report = Report { netns: 1, ..Report::default() };
    // Ask up front, so status is right even when nothing needs destroying.
    for proto in [PROTO_TCP, PROTO_UDP] {
        match support_probe(sock, proto) {
            Some(false) if proto == PROTO_TCP => {
                report.unsupported = Some(Unsupported::SockDestroy)
            }
            Some(false) => report.udp_unsupported = true,
            _ => {}
        }
    }
    let mut without_cgroup = 0usize;
    for (proto, states) in [(PROTO_TCP, TCP_CONNECTED_STATES), (PROTO_UDP, UDP_CONNECTED_STATES)] {
        for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
            let socks = match sock.dump(family, proto, states) {
                Ok(v) => v,
                Err(DiagError::Kernel(e))
                    if proto == PROTO_UDP
                        && matches!(e, libc::ENOENT | libc::EOPNOTSUPP | libc::EINVAL) =>
                {
                    report.udp_unsupported = true;
                    continue;
                }
                Err(e) => {
                    report.errors.push(e.into_error(label, "dumping sockets"));
                    continue;
                }
            };
            for s in socks {
                report.scanned += 1;
                let Some(cgroup_id) = s.cgroup_id else {
                    without_cgroup += 1;
                    continue;
                };
                let Some((rel, chain)) = index.get(cgroup_id) else { continue };
                let dst = Dst { addr: s.dst_addr(), port: s.dport(), proto };
                let Some((endpoint, verdict)) = scope.judge(&dst, chain) else { continue };
                let conn = Conn {
                    cgroup_id,
                    cgroup: rel.clone(),
                    src: s.src(),
                    dst: s.dst(),
                    proto,
                    endpoint,
                };
                if verdict == VERDICT_AUDITED {
                    report.audited.push(conn);
                    continue;
                }
                if verdict != VERDICT_DENIED {
                    continue;
                }
                if report.unsupported.is_some() || (proto == PROTO_UDP && report.udp_unsupported) {
                    report.refused += 1;
                    continue;
                }
                match sock.destroy(&s, proto) {
                    Ok(()) => report.destroyed.push(conn),
                    // Closed meanwhile: nothing left to do.
                    Err(DiagError::Kernel(libc::ENOENT)) => {}
                    Err(DiagError::Kernel(libc::EOPNOTSUPP)) if proto == PROTO_UDP => {
                        report.udp_unsupported = true;
                        report.refused += 1;
                    }
                    Err(DiagError::Kernel(libc::EOPNOTSUPP)) => {
                        report.unsupported = Some(Unsupported::SockDestroy);
                        report.refused += 1;
                    }
                    Err(e) => report.errors.push(e.into_error(label, "SOCK_DESTROY")),
                }
            }
        }
    }
    // Every socket without a cgroup id: the kernel does not report them at all.
    if without_cgroup > 0 && without_cgroup == report.scanned && report.unsupported.is_none() {
        report.unsupported = Some(Unsupported::CgroupId);
    }
    report
}

/// Whether the kernel implements `SOCK_DESTROY` for `proto`: `Some(false)` if it answers
/// `EOPNOTSUPP`, `None` if the answer says nothing. The request names no socket (all-zero
/// addresses and ports, and a cookie no socket has), so the kernel, which checks for support
/// before looking the socket up, answers `ENOENT` when it has support; nothing is destroyed.
fn support_probe(sock: &mut impl Diag, proto: u8) -> Option<bool> {
    let nobody = DiagSock {
        family: libc::AF_INET as u8,
        state: 0,
        id: InetDiagSockId::default(),
        cgroup_id: None,
    };
    match sock.destroy(&nobody, proto) {
        Err(DiagError::Kernel(libc::EOPNOTSUPP)) => Some(false),
        Err(DiagError::Kernel(libc::ENOENT)) => Some(true),
        _ => None,
    }
}

// ---- netlink sock_diag -----------------------------------------------------------------------

/// Malformed netlink data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("truncated {what}: {len} bytes")]
    Truncated { what: &'static str, len: usize },
    #[error("{what} length {len} outside the {avail} bytes left")]
    BadLength { what: &'static str, len: usize, avail: usize },
}

#[derive(Debug)]
enum DiagError {
    Io(io::Error),
    /// The kernel answered with this errno.
    Kernel(i32),
    Wire(WireError),
}

impl DiagError {
    fn into_error(self, label: &str, op: &'static str) -> TerminateError {
        let netns = label.to_string();
        match self {
            DiagError::Io(source) => TerminateError::Io { netns, op, source },
            DiagError::Kernel(errno) => {
                TerminateError::Io { netns, op, source: io::Error::from_raw_os_error(errno) }
            }
            DiagError::Wire(error) => TerminateError::Wire { netns, error },
        }
    }
}

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const INET_DIAG_CGROUP_ID: u16 = 21;
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLM_F_REQUEST: u16 = 0x01;
const NLM_F_ACK: u16 = 0x04;
const NLM_F_DUMP: u16 = 0x300;

/// `struct nlmsghdr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct NlMsgHdr {
    len: u32,
    ty: u16,
    flags: u16,
    seq: u32,
    pid: u32,
}

/// `struct inet_diag_sockid`; ports and addresses in network order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InetDiagSockId {
    sport: [u8; 2],
    dport: [u8; 2],
    src: [u8; 16],
    dst: [u8; 16],
    ifindex: u32,
    cookie: [u32; 2],
}

/// `struct inet_diag_req_v2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InetDiagReqV2 {
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: InetDiagSockId,
}

/// `struct inet_diag_msg`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InetDiagMsg {
    family: u8,
    state: u8,
    timer: u8,
    retrans: u8,
    id: InetDiagSockId,
    expires: u32,
    rqueue: u32,
    wqueue: u32,
    uid: u32,
    inode: u32,
}

const HDR_LEN: usize = size_of::<NlMsgHdr>();
const REQ_LEN: usize = size_of::<InetDiagReqV2>();
const MSG_LEN: usize = size_of::<InetDiagMsg>();

const _: () = {
    assert!(HDR_LEN == 16);
    assert!(size_of::<InetDiagSockId>() == 48);
    assert!(REQ_LEN == 56);
    assert!(MSG_LEN == 72);
};

/// Plain-integer `#[repr(C)]` types without padding (the size asserts above check that the
/// fields fill them), so any byte pattern is a valid value and every byte is initialised.
///
/// # Safety
/// Only for such types.
unsafe trait Pod: Copy {}
// SAFETY: see the size asserts: integers and integer arrays only, no padding.
unsafe impl Pod for NlMsgHdr {}
// SAFETY: as above.
unsafe impl Pod for InetDiagReqV2 {}
// SAFETY: as above.
unsafe impl Pod for InetDiagMsg {}

fn bytes_of<T: Pod>(v: &T) -> &[u8] {
    // SAFETY: T is Pod: size_of::<T>() initialised bytes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }
}

fn read<T: Pod>(b: &[u8], what: &'static str) -> Result<T, WireError> {
    if b.len() < size_of::<T>() {
        return Err(WireError::Truncated { what, len: b.len() });
    }
    // SAFETY: length checked; T is Pod, so any bytes are a valid T; unaligned read.
    Ok(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) })
}

const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A request message: header + `inet_diag_req_v2`.
fn request(ty: u16, flags: u16, seq: u32, req: &InetDiagReqV2) -> Vec<u8> {
    let hdr = NlMsgHdr { len: (HDR_LEN + REQ_LEN) as u32, ty, flags, seq, pid: 0 };
    let mut out = Vec::with_capacity(HDR_LEN + REQ_LEN);
    out.extend_from_slice(bytes_of(&hdr));
    out.extend_from_slice(bytes_of(req));
    out
}

/// The netlink messages in one datagram: (header, payload).
fn messages(mut buf: &[u8]) -> Result<Vec<(NlMsgHdr, &[u8])>, WireError> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let hdr: NlMsgHdr = read(buf, "netlink header")?;
        let len = hdr.len as usize;
        if len < HDR_LEN || len > buf.len() {
            return Err(WireError::BadLength { what: "netlink message", len, avail: buf.len() });
        }
        out.push((hdr, &buf[HDR_LEN..len]));
        buf = &buf[align4(len).min(buf.len())..];
    }
    Ok(out)
}

/// The errno of an `NLMSG_ERROR` / `NLMSG_DONE` payload (0 = success / ack).
fn errno_of(payload: &[u8]) -> Result<i32, WireError> {
    let b: [u8; 4] = payload
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or(WireError::Truncated { what: "netlink error", len: payload.len() })?;
    Ok(i32::from_ne_bytes(b).saturating_neg())
}

/// One socket of a dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DiagSock {
    family: u8,
    state: u8,
    id: InetDiagSockId,
    cgroup_id: Option<u64>,
}

impl DiagSock {
    fn parse(payload: &[u8]) -> Result<DiagSock, WireError> {
        let msg: InetDiagMsg = read(payload, "inet_diag_msg")?;
        let mut attrs = &payload[MSG_LEN..];
        let mut cgroup_id = None;
        while attrs.len() >= 4 {
            let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
            let ty = u16::from_ne_bytes([attrs[2], attrs[3]]) & NLA_TYPE_MASK;
            if len < 4 || len > attrs.len() {
                return Err(WireError::BadLength {
                    what: "netlink attribute",
                    len,
                    avail: attrs.len(),
                });
            }
            if ty == INET_DIAG_CGROUP_ID {
                let v: [u8; 8] = attrs[4..len].try_into().map_err(|_| WireError::BadLength {
                    what: "INET_DIAG_CGROUP_ID",
                    len,
                    avail: 12,
                })?;
                cgroup_id = Some(u64::from_ne_bytes(v));
            }
            attrs = &attrs[align4(len).min(attrs.len())..];
        }
        Ok(DiagSock { family: msg.family, state: msg.state, id: msg.id, cgroup_id })
    }

    fn is_v4(&self) -> bool {
        i32::from(self.family) == libc::AF_INET
    }

    fn ip(&self, a: [u8; 16]) -> IpAddr {
        if self.is_v4() {
            IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))
        } else {
            IpAddr::V6(Ipv6Addr::from(a))
        }
    }

    fn dport(&self) -> u16 {
        u16::from_be_bytes(self.id.dport)
    }

    /// The destination as the gate's hooks see it (IPv4-mapped IPv6 as IPv4).
    fn dst_addr(&self) -> Addr {
        let a = self.id.dst;
        if self.is_v4() { Addr::V4([a[0], a[1], a[2], a[3]]) } else { Addr::from_v6(a) }
    }

    fn src(&self) -> SocketAddr {
        SocketAddr::new(self.ip(self.id.src), u16::from_be_bytes(self.id.sport))
    }

    fn dst(&self) -> SocketAddr {
        SocketAddr::new(self.ip(self.id.dst), self.dport())
    }
}

/// The request that dumps `proto` sockets of `family` in `states`.
fn dump_request(seq: u32, family: u8, proto: u8, states: u32) -> Vec<u8> {
    let req = InetDiagReqV2 { family, protocol: proto, states, ..Default::default() };
    request(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, &req)
}

/// The request that destroys one socket of a dump (the id includes its cookie).
fn destroy_request(seq: u32, s: &DiagSock, proto: u8) -> Vec<u8> {
    let req = InetDiagReqV2 {
        family: s.family,
        protocol: proto,
        states: u32::MAX,
        id: s.id,
        ..Default::default()
    };
    request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, seq, &req)
}

/// What one received datagram of a dump holds.
#[derive(Debug, Default, PartialEq, Eq)]
struct DumpPart {
    socks: Vec<DiagSock>,
    done: bool,
    /// errno of an `NLMSG_ERROR` or failed `NLMSG_DONE`.
    error: Option<i32>,
}

fn parse_dump(buf: &[u8], seq: u32) -> Result<DumpPart, WireError> {
    let mut part = DumpPart::default();
    for (hdr, payload) in messages(buf)? {
        if hdr.seq != seq {
            continue;
        }
        match hdr.ty {
            NLMSG_DONE => {
                part.done = true;
                // Older kernels send DONE without a payload.
                let e = if payload.len() >= 4 { errno_of(payload)? } else { 0 };
                if e != 0 {
                    part.error = Some(e);
                }
            }
            NLMSG_ERROR => {
                part.done = true;
                part.error = Some(errno_of(payload)?);
            }
            SOCK_DIAG_BY_FAMILY => part.socks.push(DiagSock::parse(payload)?),
            _ => {}
        }
    }
    Ok(part)
}

/// The ack of a request: `Some(errno)` (0 = success) once found.
fn parse_ack(buf: &[u8], seq: u32) -> Result<Option<i32>, WireError> {
    for (hdr, payload) in messages(buf)? {
        if hdr.seq == seq && hdr.ty == NLMSG_ERROR {
            return Ok(Some(errno_of(payload)?));
        }
    }
    Ok(None)
}

/// A NETLINK_SOCK_DIAG socket, bound to the namespace of the thread that opened it.
struct DiagSocket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

/// A reply that takes longer than this means something is badly wrong.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);

impl DiagSocket {
    fn open() -> io::Result<DiagSocket> {
        // SAFETY: plain socket(2).
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_SOCK_DIAG,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let tv = libc::timeval { tv_sec: RECV_TIMEOUT.as_secs() as libc::time_t, tv_usec: 0 };
        // SAFETY: valid fd and option value of the right size.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(DiagSocket { fd, seq: 0, buf: vec![0; 64 * 1024] })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn send(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_nl is plain integers.
        let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: valid fd, buffer and address of the given sizes.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&to as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }

    /// One datagram from the kernel (others are ignored); its length in `self.buf`.
    fn recv(&mut self) -> io::Result<usize> {
        loop {
            // SAFETY: sockaddr_nl is plain integers.
            let mut from: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
            let mut from_len = size_of::<libc::sockaddr_nl>() as libc::socklen_t;
            // SAFETY: valid fd; buffer and address valid for their lengths.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    0,
                    (&mut from as *mut libc::sockaddr_nl).cast(),
                    &mut from_len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if from.nl_pid == 0 {
                return Ok(n as usize);
            }
        }
    }
}

impl Diag for DiagSocket {
    fn dump(&mut self, family: u8, proto: u8, states: u32) -> Result<Vec<DiagSock>, DiagError> {
        let seq = self.next_seq();
        self.send(&dump_request(seq, family, proto, states)).map_err(DiagError::Io)?;
        let mut socks = Vec::new();
        loop {
            let n = self.recv().map_err(DiagError::Io)?;
            let part = parse_dump(&self.buf[..n], seq).map_err(DiagError::Wire)?;
            socks.extend(part.socks);
            if let Some(e) = part.error {
                return Err(DiagError::Kernel(e));
            }
            if part.done {
                return Ok(socks);
            }
        }
    }

    fn destroy(&mut self, s: &DiagSock, proto: u8) -> Result<(), DiagError> {
        let seq = self.next_seq();
        self.send(&destroy_request(seq, s, proto)).map_err(DiagError::Io)?;
        loop {
            let n = self.recv().map_err(DiagError::Io)?;
            match parse_ack(&self.buf[..n], seq).map_err(DiagError::Wire)? {
                Some(0) => return Ok(()),
                Some(e) => return Err(DiagError::Kernel(e)),
                None => continue,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(len: usize, ty: u16, flags: u16, seq: u32) -> Vec<u8> {
        bytes_of(&NlMsgHdr { len: len as u32, ty, flags, seq, pid: 0 }).to_vec()
    }

    fn attr(ty: u16, data: &[u8]) -> Vec<u8> {
        let mut v = ((4 + data.len()) as u16).to_ne_bytes().to_vec();
        v.extend_from_slice(&ty.to_ne_bytes());
        v.extend_from_slice(data);
        v.resize(align4(v.len()), 0);
        v
    }

    fn sockid(src: [u8; 16], sport: u16, dst: [u8; 16], dport: u16) -> InetDiagSockId {
        InetDiagSockId {
            sport: sport.to_be_bytes(),
            dport: dport.to_be_bytes(),
            src,
            dst,
            ifindex: 0,
            cookie: [0x1234, 0x5678],
        }
    }

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut o = [0; 16];
        o[..4].copy_from_slice(&a);
        o
    }

    fn mapped(a: [u8; 4]) -> [u8; 16] {
        let mut o = [0; 16];
        o[10] = 0xff;
        o[11] = 0xff;
        o[12..].copy_from_slice(&a);
        o
    }

    /// A SOCK_DIAG_BY_FAMILY reply message as the kernel builds it.
    fn sock_msg(seq: u32, family: u8, id: InetDiagSockId, attrs: &[Vec<u8>]) -> Vec<u8> {
        let msg = InetDiagMsg { family, state: 1, id, inode: 4242, ..Default::default() };
        let mut body = bytes_of(&msg).to_vec();
        for a in attrs {
            body.extend_from_slice(a);
        }
        let mut out = hdr(HDR_LEN + body.len(), SOCK_DIAG_BY_FAMILY, 2, seq);
        out.extend(body);
        out
    }

    fn done(seq: u32, errno: i32) -> Vec<u8> {
        let mut out = hdr(HDR_LEN + 4, NLMSG_DONE, 2, seq);
        out.extend_from_slice(&(-errno).to_ne_bytes());
        out
    }

    fn error(seq: u32, errno: i32) -> Vec<u8> {
        let mut out = hdr(HDR_LEN + 4 + HDR_LEN, NLMSG_ERROR, 0, seq);
        out.extend_from_slice(&(-errno).to_ne_bytes());
        out.extend(hdr(HDR_LEN + REQ_LEN, SOCK_DESTROY, 5, seq));
        out
    }

    #[test]
    fn dump_request_layout() {
        let r = dump_request(7, libc::AF_INET6 as u8, PROTO_TCP, TCP_CONNECTED_STATES);
        assert_eq!(r.len(), 72);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 72);
        assert_eq!(u16::from_ne_bytes(r[4..6].try_into().unwrap()), SOCK_DIAG_BY_FAMILY);
        assert_eq!(u16::from_ne_bytes(r[6..8].try_into().unwrap()), 0x301);
        assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), 7);
        assert_eq!(r[16], libc::AF_INET6 as u8);
        assert_eq!(r[17], 6);
        assert_eq!(u32::from_ne_bytes(r[20..24].try_into().unwrap()), 0b1011_0011_0110);
        assert!(r[24..].iter().all(|&b| b == 0), "no socket id in a dump request");
        // Listening sockets (state 10) are never dumped, nor TIME_WAIT (6).
        assert_eq!(TCP_CONNECTED_STATES & (1 << 10 | 1 << 6 | 1 << 7 | 1 << 3), 0);
    }

    #[test]
    fn destroy_request_carries_the_socket_id_and_cookie() {
        let id = sockid(v4([10, 0, 0, 1]), 40000, v4([169, 254, 169, 254]), 80);
        let s = DiagSock { family: libc::AF_INET as u8, state: 1, id, cgroup_id: Some(9) };
        let r = destroy_request(3, &s, PROTO_UDP);
        assert_eq!(r.len(), 72);
        assert_eq!(u16::from_ne_bytes(r[4..6].try_into().unwrap()), SOCK_DESTROY);
        assert_eq!(u16::from_ne_bytes(r[6..8].try_into().unwrap()), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!((r[16], r[17]), (libc::AF_INET as u8, PROTO_UDP));
        // inet_diag_sockid at offset 16 + 8.
        assert_eq!(&r[24..26], &40000u16.to_be_bytes());
        assert_eq!(&r[26..28], &80u16.to_be_bytes());
        assert_eq!(&r[28..32], &[10, 0, 0, 1]);
        assert_eq!(&r[44..48], &[169, 254, 169, 254]);
        assert_eq!(u32::from_ne_bytes(r[64..68].try_into().unwrap()), 0x1234);
        assert_eq!(u32::from_ne_bytes(r[68..72].try_into().unwrap()), 0x5678);
    }

    #[test]
    fn parses_a_dump_with_cgroup_ids_and_other_attributes() {
        let a = sockid(v4([169, 254, 0, 1]), 41000, v4([169, 254, 169, 254]), 80);
        let b = sockid([0; 16], 41001, mapped([169, 254, 169, 254]), 80);
        let mut buf = sock_msg(
            5,
            libc::AF_INET as u8,
            a,
            &[
                attr(1, &[0; 6]), // INET_DIAG_MEMINFO-like, odd length, padded
                attr(INET_DIAG_CGROUP_ID, &77u64.to_ne_bytes()),
            ],
        );
        buf.extend(sock_msg(
            5,
            libc::AF_INET6 as u8,
            b,
            &[attr(INET_DIAG_CGROUP_ID | 0x8000, &78u64.to_ne_bytes())],
        ));
        // A stale message of an earlier request is ignored.
        buf.extend(sock_msg(4, libc::AF_INET as u8, a, &[]));
        buf.extend(done(5, 0));
        let part = parse_dump(&buf, 5).unwrap();
        assert!(part.done);
        assert_eq!(part.error, None);
        assert_eq!(part.socks.len(), 2);
        let (s0, s1) = (part.socks[0], part.socks[1]);
        assert_eq!(s0.cgroup_id, Some(77));
        assert_eq!(s0.dst(), "169.254.169.254:80".parse().unwrap());
        assert_eq!(s0.src(), "169.254.0.1:41000".parse().unwrap());
        assert_eq!(s0.dst_addr(), Addr::V4([169, 254, 169, 254]));
        assert_eq!(s0.id.cookie, [0x1234, 0x5678]);
        // IPv4-mapped IPv6 is looked up as IPv4.
        assert_eq!(s1.cgroup_id, Some(78));
        assert_eq!(s1.dst_addr(), Addr::V4([169, 254, 169, 254]));
        assert_eq!(s1.dst(), "[::ffff:169.254.169.254]:80".parse().unwrap());
    }

    #[test]
    fn dump_without_cgroup_attribute_and_errors() {
        let a = sockid(v4([1, 2, 3, 4]), 1, v4([5, 6, 7, 8]), 2);
        let part = parse_dump(&sock_msg(1, libc::AF_INET as u8, a, &[]), 1).unwrap();
        assert!(!part.done);
        assert_eq!(part.socks[0].cgroup_id, None);
        assert_eq!(parse_dump(&done(1, libc::ENOENT), 1).unwrap().error, Some(libc::ENOENT));
        assert_eq!(parse_dump(&error(1, libc::EINVAL), 1).unwrap().error, Some(libc::EINVAL));
        // DONE without payload (old kernels).
        assert!(parse_dump(&hdr(HDR_LEN, NLMSG_DONE, 2, 1), 1).unwrap().done);
    }

    #[test]
    fn acks() {
        assert_eq!(parse_ack(&error(9, 0), 9).unwrap(), Some(0));
        assert_eq!(parse_ack(&error(9, libc::EOPNOTSUPP), 9).unwrap(), Some(libc::EOPNOTSUPP));
        assert_eq!(parse_ack(&error(8, 0), 9).unwrap(), None);
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let a = sockid(v4([1, 2, 3, 4]), 1, v4([5, 6, 7, 8]), 2);
        let good =
            sock_msg(1, libc::AF_INET as u8, a, &[attr(INET_DIAG_CGROUP_ID, &1u64.to_ne_bytes())]);
        // Every truncation, and every corrupted length byte, fails cleanly.
        for cut in 0..good.len() {
            let _ = parse_dump(&good[..cut], 1);
        }
        for i in 0..good.len() {
            for v in [0u8, 1, 3, 4, 0x7f, 0xff] {
                let mut b = good.clone();
                b[i] = v;
                let _ = parse_dump(&b, 1);
            }
        }
        let mut short = good.clone();
        short[0] = 20; // header says 20 bytes: inet_diag_msg truncated
        assert!(matches!(parse_dump(&short[..20], 1), Err(WireError::Truncated { .. })));
        let mut long = good.clone();
        long[0] = 0xff;
        assert!(matches!(parse_dump(&long, 1), Err(WireError::BadLength { .. })));
        // Cgroup attribute with a 4-byte payload.
        let bad = sock_msg(1, libc::AF_INET as u8, a, &[attr(INET_DIAG_CGROUP_ID, &[1, 2, 3, 4])]);
        assert!(parse_dump(&bad, 1).is_err());
        assert!(errno_of(&[1, 2]).is_err());
    }

    fn policy(mode: &str) -> Policy {
        Policy::parse(
            "t.yaml",
            &format!(
                "platform: AWS\nmode: {mode}\nendpoints:\n\
                 \x20 - {{name: imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}}\n\
                 \x20 - {{name: v6, cidr: \"fd00:ec2::254/128\"}}\n\
                 allow:\n  - {{name: agent, cgroup: cloud-agent}}\n"
            ),
        )
        .unwrap()
    }

    fn root() -> GatedRoot {
        GatedRoot { path: "/nonexistent".into(), mount: "/".into(), id: 10, level: 2 }
    }

    #[test]
    fn judge_reuses_the_kernel_decision() {
        let walked = vec![
            (PathBuf::from("cloud-agent"), 11),
            (PathBuf::from("cloud-agent/nested"), 12),
            (PathBuf::from("pod-a"), 13),
            (PathBuf::from("pod-a/c"), 14),
        ];
        let index = CgroupIndex::new(10, walked);
        assert_eq!(index.get(12).unwrap().1, vec![11, 12]);
        assert_eq!(index.get(10).unwrap(), &(PathBuf::from("."), vec![]));
        assert!(index.get(99).is_none());
        let scope = Scope::new(&policy("enforce"), &root(), &[(11, 0)].into_iter().collect());
        let imds = Dst { addr: Addr::V4([169, 254, 169, 254]), port: 80, proto: PROTO_TCP };
        let chain = |id| index.get(id).unwrap().1.clone();
        assert_eq!(scope.judge(&imds, &chain(14)), Some((0, VERDICT_DENIED)));
        assert_eq!(scope.judge(&imds, &chain(10)), Some((0, VERDICT_DENIED)));
        assert_eq!(scope.judge(&imds, &chain(12)), Some((0, gate_common::abi::VERDICT_ALLOWED)));
        assert_eq!(scope.judge(&imds, &chain(11)), Some((0, gate_common::abi::VERDICT_ALLOWED)));
        // Not protected: other port, other protocol.
        assert_eq!(scope.judge(&Dst { port: 53, ..imds }, &chain(14)), None);
        assert_eq!(scope.judge(&Dst { proto: PROTO_UDP, ..imds }, &chain(14)), None);
        let v6 = [0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54];
        let d6 = Dst { addr: Addr::V6(v6), port: 443, proto: PROTO_UDP };
        assert_eq!(scope.judge(&d6, &chain(13)), Some((1, VERDICT_DENIED)));
        let audit = Scope::new(&policy("audit"), &root(), &[(11, 0)].into_iter().collect());
        assert_eq!(audit.judge(&imds, &chain(14)), Some((0, VERDICT_AUDITED)));
    }

    /// A namespace's sockets and how the kernel answers SOCK_DESTROY.
    #[derive(Default)]
    struct FakeKernel {
        socks: Vec<(u8, DiagSock)>,
        destroy_errno: i32,
        udp_dump_errno: Option<i32>,
        udp_destroy_unsupported: bool,
        destroyed: Vec<DiagSock>,
    }

    impl Diag for FakeKernel {
        fn dump(&mut self, family: u8, proto: u8, _: u32) -> Result<Vec<DiagSock>, DiagError> {
            if let (PROTO_UDP, Some(e)) = (proto, self.udp_dump_errno) {
                return Err(DiagError::Kernel(e));
            }
            Ok(self
                .socks
                .iter()
                .filter(|(p, s)| *p == proto && s.family == family)
                .map(|(_, s)| *s)
                .collect())
        }
        fn destroy(&mut self, s: &DiagSock, proto: u8) -> Result<(), DiagError> {
            let unsupported = self.destroy_errno == libc::EOPNOTSUPP
                || (proto == PROTO_UDP && self.udp_destroy_unsupported);
            if s.id == InetDiagSockId::default() {
                // The support probe: the kernel checks support before the lookup.
                let e = if unsupported { libc::EOPNOTSUPP } else { libc::ENOENT };
                return Err(DiagError::Kernel(e));
            }
            if unsupported {
                return Err(DiagError::Kernel(libc::EOPNOTSUPP));
            }
            if self.destroy_errno != 0 {
                return Err(DiagError::Kernel(self.destroy_errno));
            }
            self.destroyed.push(*s);
            Ok(())
        }
    }

    fn sock(family: i32, dst: [u8; 16], dport: u16, cgroup: Option<u64>) -> DiagSock {
        let src = if family == libc::AF_INET { v4([169, 254, 0, 1]) } else { [0; 16] };
        DiagSock {
            family: family as u8,
            state: 1,
            id: sockid(src, 40000, dst, dport),
            cgroup_id: cgroup,
        }
    }

    /// root(10)/{cloud-agent(11)/nested(12), pod-a(13)}; 99 is outside the root.
    fn world(mode: &str) -> (Scope, CgroupIndex) {
        let walked = vec![
            (PathBuf::from("cloud-agent"), 11),
            (PathBuf::from("cloud-agent/nested"), 12),
            (PathBuf::from("pod-a"), 13),
        ];
        (
            Scope::new(&policy(mode), &root(), &[(11, 0)].into_iter().collect()),
            CgroupIndex::new(10, walked),
        )
    }

    fn kernel() -> FakeKernel {
        let imds = v4([169, 254, 169, 254]);
        let v6 = [0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54];
        let (inet, inet6) = (libc::AF_INET, libc::AF_INET6);
        FakeKernel {
            socks: vec![
                (PROTO_TCP, sock(inet, imds, 80, Some(13))), // denied
                (PROTO_TCP, sock(inet6, mapped([169, 254, 169, 254]), 80, Some(10))), // denied
                (PROTO_UDP, sock(inet6, v6, 80, Some(13))),  // denied
                (PROTO_TCP, sock(inet, imds, 80, Some(12))), // allowed (ancestor)
                (PROTO_TCP, sock(inet, imds, 80, Some(99))), // not gated
                (PROTO_TCP, sock(inet, imds, 443, Some(13))), // not protected
                (PROTO_UDP, sock(inet, imds, 80, Some(13))), // not protected (TCP only)
                (PROTO_TCP, sock(inet, v4([10, 0, 0, 1]), 80, Some(13))), // not protected
            ],
            ..FakeKernel::default()
        }
    }

    #[test]
    fn scan_destroys_exactly_the_denied_sockets() {
        let (scope, index) = world("enforce");
        let mut k = kernel();
        let r = scan_with(&mut k, "test", &scope, &index);
        assert_eq!(r.scanned, 8);
        assert_eq!(k.destroyed, vec![k.socks[0].1, k.socks[1].1, k.socks[2].1]);
        let got: Vec<_> = r.destroyed.iter().map(|c| (c.cgroup_id, c.proto, c.endpoint)).collect();
        assert_eq!(got, vec![(13, PROTO_TCP, 0), (10, PROTO_TCP, 0), (13, PROTO_UDP, 1)]);
        assert_eq!(r.destroyed[0].cgroup, PathBuf::from("pod-a"));
        assert_eq!(r.destroyed[1].cgroup, PathBuf::from("."));
        assert_eq!(r.destroyed[0].dst, "169.254.169.254:80".parse().unwrap());
        assert_eq!((r.unsupported, r.udp_unsupported, r.refused), (None, false, 0));
        assert!(r.errors.is_empty() && r.audited.is_empty());
    }

    #[test]
    fn audit_destroys_nothing() {
        let (scope, index) = world("audit");
        let mut k = kernel();
        let r = scan_with(&mut k, "test", &scope, &index);
        assert!(k.destroyed.is_empty() && r.destroyed.is_empty());
        assert_eq!(r.audited.len(), 3);
    }

    #[test]
    fn kernel_without_sock_destroy_is_reported_unsupported() {
        let (scope, index) = world("enforce");
        let mut k = FakeKernel { destroy_errno: libc::EOPNOTSUPP, ..kernel() };
        let r = scan_with(&mut k, "test", &scope, &index);
        assert_eq!(r.unsupported, Some(Unsupported::SockDestroy));
        assert!(r.destroyed.is_empty());
        assert_eq!(r.refused, 3);
        assert!(r.errors.is_empty());
        assert!(r.status_line().contains("unsupported by this kernel"), "{}", r.status_line());
        assert!(r.status_line().contains("CONFIG_INET_DIAG_DESTROY"), "{}", r.status_line());
    }

    #[test]
    fn sockets_gone_meanwhile_are_no_error_and_other_errors_are_reported() {
        let (scope, index) = world("enforce");
        let mut k = FakeKernel { destroy_errno: libc::ENOENT, ..kernel() };
        let r = scan_with(&mut k, "test", &scope, &index);
        assert!(r.destroyed.is_empty() && r.errors.is_empty() && r.unsupported.is_none());
        let mut k = FakeKernel { destroy_errno: libc::EPERM, ..kernel() };
        let r = scan_with(&mut k, "ns1", &scope, &index);
        assert_eq!(r.errors.len(), 3);
        assert!(r.errors[0].to_string().contains("ns1"), "{}", r.errors[0]);
    }

    #[test]
    fn no_udp_diag_skips_udp_only() {
        let (scope, index) = world("enforce");
        let mut k = FakeKernel { udp_dump_errno: Some(libc::ENOENT), ..kernel() };
        let r = scan_with(&mut k, "test", &scope, &index);
        assert!(r.udp_unsupported);
        assert_eq!(r.destroyed.len(), 2);
        assert!(r.destroyed.iter().all(|c| c.proto == PROTO_TCP));
        assert!(r.status_line().contains("UDP unsupported"), "{}", r.status_line());
    }

    #[test]
    fn unsupported_kernel_is_reported_with_nothing_to_destroy() {
        let (scope, index) = world("enforce");
        let mut k = FakeKernel { destroy_errno: libc::EOPNOTSUPP, ..FakeKernel::default() };
        let r = scan_with(&mut k, "test", &scope, &index);
        assert_eq!(r.unsupported, Some(Unsupported::SockDestroy));
        assert_eq!(r.refused, 0);
        let mut k = FakeKernel { udp_destroy_unsupported: true, ..kernel() };
        let r = scan_with(&mut k, "test", &scope, &index);
        assert_eq!((r.unsupported, r.udp_unsupported, r.refused), (None, true, 1));
        assert_eq!(r.destroyed.len(), 2);
    }

    /// Read-only against the running kernel: a dump of this namespace parses, and the support
    /// probe gets a definite answer. Skipped where sock_diag is not available.
    #[test]
    fn real_kernel_dump_and_support_probe() {
        let Ok(mut sock) = DiagSocket::open() else { return };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(addr).unwrap();
        let local = client.local_addr().unwrap();
        let socks = sock.dump(libc::AF_INET as u8, PROTO_TCP, TCP_CONNECTED_STATES).unwrap();
        let mine = socks.iter().find(|s| s.src() == local && s.dst() == addr);
        let mine = mine.expect("our own connection is in the dump");
        assert_eq!(mine.state, 1, "established");
        assert!(socks.iter().all(|s| s.state != 10), "no listeners");
        assert!(support_probe(&mut sock, PROTO_TCP).is_some());
        assert!(support_probe(&mut sock, PROTO_UDP).is_some());
        drop(client);
    }

    #[test]
    fn no_cgroup_ids_is_reported_unsupported() {
        let (scope, index) = world("enforce");
        let mut k = kernel();
        for (_, s) in &mut k.socks {
            s.cgroup_id = None;
        }
        let r = scan_with(&mut k, "test", &scope, &index);
        assert_eq!(r.unsupported, Some(Unsupported::CgroupId));
        assert!(k.destroyed.is_empty());
    }

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
