//! The namespace scan: which cgroups are gated ([`CgroupIndex`]), which network namespaces
//! their processes use, entering each on a thread of its own, and deciding per socket
//! ([`scan_with`]) which ones the kernel programs would deny.
use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use gate_common::{
    abi::{PROTO_TCP, PROTO_UDP, VERDICT_AUDITED, VERDICT_DENIED},
    verdict::Dst,
};

use super::{Conn, Judge, Report, TerminateError, Unsupported};
use crate::{
    cgroup::GatedRoot,
    netlink::NetlinkError,
    netns::{self, Netns},
    sockdiag::{Diag, DiagSocket, TCP_CONNECTED_STATES, UDP_CONNECTED_STATES, support_probe},
};

/// The cgroups at or below the gated root: id → (relative path, ids of the path's
/// components below the root, outermost first).
pub(super) struct CgroupIndex(HashMap<u64, (PathBuf, Vec<u64>)>);

impl CgroupIndex {
    pub(super) fn new(root_id: u64, walked: Vec<(PathBuf, u64)>) -> CgroupIndex {
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

    /// (relative path, ids below the root) of every indexed cgroup.
    pub(super) fn entries(&self) -> impl Iterator<Item = (&Path, &[u64])> {
        self.0.values().map(|(p, chain)| (p.as_path(), chain.as_slice()))
    }
}

/// The blocking scan: every namespace of the gated processes plus the agent's own.
pub(crate) fn terminate_established(root: &GatedRoot, judge: &Judge) -> Report {
    let index = CgroupIndex::new(root.id, root.walk());
    let mut report = scan_here("agent", judge, &index);
    let mut seen: HashSet<(u64, u64)> =
        netns_id(Path::new("/proc/thread-self/ns/net")).ok().into_iter().collect();
    let (namespaces, hidden) = gated_namespaces(root, &index);
    report.hidden = hidden;
    for (pid, file, id) in namespaces {
        if seen.insert(id) {
            let label = format!("net:[{}] of pid {pid}", id.1);
            report.merge(scan_in(&label, file, judge, &index));
        }
    }
    report
}

/// Scan the namespace `netns` on a thread of its own, which enters it and then ends.
fn scan_in(label: &str, netns: File, judge: &Judge, index: &CgroupIndex) -> Report {
    let target = Netns::File { file: &netns, name: label };
    netns::run_in(target, "mg-terminate", || scan_here(label, judge, index))
        .unwrap_or_else(|e| Report { errors: vec![e.into()], ..Report::default() })
}

/// (device, inode) of a namespace file.
fn netns_id(path: &Path) -> io::Result<(u64, u64)> {
    std::fs::metadata(path).map(|m| (m.dev(), m.ino()))
}

/// The distinct network namespaces of the processes in cgroups at or below the root: (a pid
/// in it, the open namespace file, its (device, inode)); and how many gated processes had a
/// namespace the agent could not open: not in its pid namespace (a pod without hostPID), not
/// open to it (ptrace read access: without CAP_SYS_PTRACE, a process holding a capability the
/// agent lacks), or exited meanwhile.
type Namespaces = Vec<(u32, File, (u64, u64))>;
fn gated_namespaces(root: &GatedRoot, index: &CgroupIndex) -> (Namespaces, usize) {
    let mut out = Vec::new();
    let mut hidden = 0;
    let mut seen = HashSet::new();
    for rel in index.paths() {
        let Ok(procs) = std::fs::read_to_string(root.path.join(rel).join("cgroup.procs")) else {
            continue;
        };
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let Ok(file) = File::open(format!("/proc/{pid}/ns/net")) else {
                hidden += 1;
                continue;
            };
            let Ok(meta) = file.metadata() else { continue };
            let id = (meta.dev(), meta.ino());
            if seen.insert(id) {
                out.push((pid, file, id));
            }
        }
    }
    (out, hidden)
}

/// Scan the namespace of the calling thread.
fn scan_here(label: &str, judge: &Judge, index: &CgroupIndex) -> Report {
    match DiagSocket::open() {
        Ok(mut sock) => scan_with(&mut sock, label, judge, index),
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

/// Dump one namespace's connected sockets through `sock` and destroy the denied ones.
fn scan_with(sock: &mut impl Diag, label: &str, judge: &Judge, index: &CgroupIndex) -> Report {
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
                Err(NetlinkError::Kernel(e))
                    if proto == PROTO_UDP
                        && matches!(e, libc::ENOENT | libc::EOPNOTSUPP | libc::EINVAL) =>
                {
                    report.udp_unsupported = true;
                    continue;
                }
                Err(e) => {
                    report.errors.push(scan_error(e, label, "dumping sockets"));
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
                let Some((endpoint, verdict)) = judge.verdict(&dst, chain) else { continue };
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
                    Err(NetlinkError::Kernel(libc::ENOENT)) => {}
                    Err(NetlinkError::Kernel(libc::EOPNOTSUPP)) if proto == PROTO_UDP => {
                        report.udp_unsupported = true;
                        report.refused += 1;
                    }
                    Err(NetlinkError::Kernel(libc::EOPNOTSUPP)) => {
                        report.unsupported = Some(Unsupported::SockDestroy);
                        report.refused += 1;
                    }
                    Err(e) => report.errors.push(scan_error(e, label, "SOCK_DESTROY")),
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

/// The error of the scan of namespace `label` for a failed `op`.
fn scan_error(e: NetlinkError, label: &str, op: &'static str) -> TerminateError {
    let netns = label.to_string();
    match e {
        NetlinkError::Io(source) => TerminateError::Io { netns, op, source },
        NetlinkError::Kernel(errno) => {
            TerminateError::Io { netns, op, source: io::Error::from_raw_os_error(errno) }
        }
        NetlinkError::Wire(error) => TerminateError::Wire { netns, error },
    }
}

#[cfg(test)]
mod tests {
    use gate_common::{
        abi::{GRANT_METADATA, VERDICT_ALLOWED, allow_value},
        verdict::Addr,
    };

    use super::*;
    use crate::{
        policy::Policy,
        sockdiag::{
            DiagSock,
            tests::{mapped, sockid, v4},
        },
    };

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
        let judge = Judge::new(
            &policy("enforce"),
            &root(),
            &[(11, allow_value(0, GRANT_METADATA))].into_iter().collect(),
        );
        let imds = Dst { addr: Addr::v4([169, 254, 169, 254]), port: 80, proto: PROTO_TCP };
        let chain = |id| index.get(id).unwrap().1.clone();
        assert_eq!(judge.verdict(&imds, &chain(14)), Some((0, VERDICT_DENIED)));
        assert_eq!(judge.verdict(&imds, &chain(10)), Some((0, VERDICT_DENIED)));
        assert_eq!(judge.verdict(&imds, &chain(12)), Some((0, VERDICT_ALLOWED)));
        assert_eq!(judge.verdict(&imds, &chain(11)), Some((0, VERDICT_ALLOWED)));
        // Not protected: other port, other protocol.
        assert_eq!(judge.verdict(&Dst { port: 53, ..imds }, &chain(14)), None);
        assert_eq!(judge.verdict(&Dst { proto: PROTO_UDP, ..imds }, &chain(14)), None);
        let v6 = [0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54];
        let d6 = Dst { addr: Addr::v6(v6), port: 443, proto: PROTO_UDP };
        assert_eq!(judge.verdict(&d6, &chain(13)), Some((1, VERDICT_DENIED)));
        let audit = Judge::new(
            &policy("audit"),
            &root(),
            &[(11, allow_value(0, GRANT_METADATA))].into_iter().collect(),
        );
        assert_eq!(audit.verdict(&imds, &chain(14)), Some((0, VERDICT_AUDITED)));
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
        fn dump(&mut self, family: u8, proto: u8, _: u32) -> Result<Vec<DiagSock>, NetlinkError> {
            if let (PROTO_UDP, Some(e)) = (proto, self.udp_dump_errno) {
                return Err(NetlinkError::Kernel(e));
            }
            Ok(self
                .socks
                .iter()
                .filter(|(p, s)| *p == proto && s.family == family)
                .map(|(_, s)| s.clone())
                .collect())
        }
        fn destroy(&mut self, s: &DiagSock, proto: u8) -> Result<(), NetlinkError> {
            let unsupported = self.destroy_errno == libc::EOPNOTSUPP
                || (proto == PROTO_UDP && self.udp_destroy_unsupported);
            if s.id == netlink_packet_sock_diag::inet::SocketId::new_v4() {
                // The support probe: the kernel checks support before the lookup.
                let e = if unsupported { libc::EOPNOTSUPP } else { libc::ENOENT };
                return Err(NetlinkError::Kernel(e));
            }
            if unsupported {
                return Err(NetlinkError::Kernel(libc::EOPNOTSUPP));
            }
            if self.destroy_errno != 0 {
                return Err(NetlinkError::Kernel(self.destroy_errno));
            }
            self.destroyed.push(s.clone());
            Ok(())
        }
    }

    fn sock(family: i32, dst: std::net::IpAddr, dport: u16, cgroup: Option<u64>) -> DiagSock {
        let src = if family == libc::AF_INET {
            v4([169, 254, 0, 1])
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        };
        DiagSock {
            family: family as u8,
            state: 1,
            id: sockid(src, 40000, dst, dport),
            cgroup_id: cgroup,
        }
    }

    /// root(10)/{cloud-agent(11)/nested(12), pod-a(13)}; 99 is outside the root.
    fn world(mode: &str) -> (Judge, CgroupIndex) {
        let walked = vec![
            (PathBuf::from("cloud-agent"), 11),
            (PathBuf::from("cloud-agent/nested"), 12),
            (PathBuf::from("pod-a"), 13),
        ];
        (
            Judge::new(
                &policy(mode),
                &root(),
                &[(11, allow_value(0, GRANT_METADATA))].into_iter().collect(),
            ),
            CgroupIndex::new(10, walked),
        )
    }

    fn kernel() -> FakeKernel {
        let imds = v4([169, 254, 169, 254]);
        let v6 =
            std::net::IpAddr::from([0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54]);
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
        let (judge, index) = world("enforce");
        let mut k = kernel();
        let r = scan_with(&mut k, "test", &judge, &index);
        assert_eq!(r.scanned, 8);
        assert_eq!(
            k.destroyed,
            vec![k.socks[0].1.clone(), k.socks[1].1.clone(), k.socks[2].1.clone()]
        );
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
        let (judge, index) = world("audit");
        let mut k = kernel();
        let r = scan_with(&mut k, "test", &judge, &index);
        assert!(k.destroyed.is_empty() && r.destroyed.is_empty());
        assert_eq!(r.audited.len(), 3);
    }

    #[test]
    fn kernel_without_sock_destroy_is_reported_unsupported() {
        let (judge, index) = world("enforce");
        let mut k = FakeKernel { destroy_errno: libc::EOPNOTSUPP, ..kernel() };
        let r = scan_with(&mut k, "test", &judge, &index);
        assert_eq!(r.unsupported, Some(Unsupported::SockDestroy));
        assert!(r.destroyed.is_empty());
        assert_eq!(r.refused, 3);
        assert!(r.errors.is_empty());
        assert!(r.status_line().contains("unsupported by this kernel"), "{}", r.status_line());
        assert!(r.status_line().contains("CONFIG_INET_DIAG_DESTROY"), "{}", r.status_line());
    }

    #[test]
    fn sockets_gone_meanwhile_are_no_error_and_other_errors_are_reported() {
        let (judge, index) = world("enforce");
        let mut k = FakeKernel { destroy_errno: libc::ENOENT, ..kernel() };
        let r = scan_with(&mut k, "test", &judge, &index);
        assert!(r.destroyed.is_empty() && r.errors.is_empty() && r.unsupported.is_none());
        let mut k = FakeKernel { destroy_errno: libc::EPERM, ..kernel() };
        let r = scan_with(&mut k, "ns1", &judge, &index);
        assert_eq!(r.errors.len(), 3);
        assert!(r.errors[0].to_string().contains("ns1"), "{}", r.errors[0]);
    }

    #[test]
    fn no_udp_diag_skips_udp_only() {
        let (judge, index) = world("enforce");
        let mut k = FakeKernel { udp_dump_errno: Some(libc::ENOENT), ..kernel() };
        let r = scan_with(&mut k, "test", &judge, &index);
        assert!(r.udp_unsupported);
        assert_eq!(r.destroyed.len(), 2);
        assert!(r.destroyed.iter().all(|c| c.proto == PROTO_TCP));
        assert!(r.status_line().contains("UDP unsupported"), "{}", r.status_line());
    }

    #[test]
    fn unsupported_kernel_is_reported_with_nothing_to_destroy() {
        let (judge, index) = world("enforce");
        let mut k = FakeKernel { destroy_errno: libc::EOPNOTSUPP, ..FakeKernel::default() };
        let r = scan_with(&mut k, "test", &judge, &index);
        assert_eq!(r.unsupported, Some(Unsupported::SockDestroy));
        assert_eq!(r.refused, 0);
        let mut k = FakeKernel { udp_destroy_unsupported: true, ..kernel() };
        let r = scan_with(&mut k, "test", &judge, &index);
        assert_eq!((r.unsupported, r.udp_unsupported, r.refused), (None, true, 1));
        assert_eq!(r.destroyed.len(), 2);
    }

    #[test]
    fn no_cgroup_ids_is_reported_unsupported() {
        let (judge, index) = world("enforce");
        let mut k = kernel();
        for (_, s) in &mut k.socks {
            s.cgroup_id = None;
        }
        let r = scan_with(&mut k, "test", &judge, &index);
        assert_eq!(r.unsupported, Some(Unsupported::CgroupId));
        assert!(k.destroyed.is_empty());
    }
}
