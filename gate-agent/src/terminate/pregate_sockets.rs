//! AF_PACKET sockets that predate the gate.
//!
//! A packet socket that set `PACKET_QDISC_BYPASS` hands its frames straight to the driver:
//! they pass no qdisc, so no tc program sees them, and on an uplink nothing else on the node
//! does either. The setsockopt program denies the option once the gate is attached, but a
//! socket that set it before (a host-network pod that started before the agent, on a node
//! without the boot step) keeps it, and neither sock_diag nor `/proc` says whether it did.
//!
//! Nothing can take the option back or close another process's socket, so the agent finds
//! every AF_PACKET socket held by a gated process in a cgroup that is not allowed and names
//! it (pid, command, cgroup): the operator restarts that pod. Which sockets are packet
//! sockets: the `Inode` column of `/proc/<pid>/net/packet` (per network namespace), matched
//! against the `socket:[inode]` links in `/proc/<pid>/fd`.
use std::{
    collections::{HashMap, HashSet},
    fs,
    os::unix::fs::MetadataExt as _,
    path::PathBuf,
};

use super::{Judge, scan::CgroupIndex};
use crate::cgroup::GatedRoot;

/// A gated process holding an AF_PACKET socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PacketHolder {
    pub pid: u32,
    /// `/proc/<pid>/comm`.
    pub comm: String,
    /// Its cgroup, relative to the gated root.
    pub cgroup: PathBuf,
    /// Socket inode (as `ss -p` and `/proc/<pid>/fd` show it).
    pub inode: u64,
}

/// Every AF_PACKET socket that a process in a gated, not allowed cgroup holds now.
pub(super) fn packet_holders(root: &GatedRoot, judge: &Judge) -> Vec<PacketHolder> {
    let index = CgroupIndex::new(root.id, root.walk());
    // Packet socket inodes per network namespace (device, inode of the namespace file).
    let mut by_netns: HashMap<(u64, u64), HashSet<u64>> = HashMap::new();
    let mut out = Vec::new();
    for (rel, chain) in index.entries() {
        if judge.allowed(chain) {
            continue;
        }
        let Ok(procs) = fs::read_to_string(root.path.join(rel).join("cgroup.procs")) else {
            continue;
        };
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let Ok(ns) = fs::metadata(format!("/proc/{pid}/ns/net")) else { continue };
            let packet = by_netns
                .entry((ns.dev(), ns.ino()))
                .or_insert_with(|| packet_inodes(&format!("/proc/{pid}/net/packet")));
            if packet.is_empty() {
                continue;
            }
            for inode in socket_inodes(pid).into_iter().filter(|i| packet.contains(i)) {
                let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                out.push(PacketHolder {
                    pid,
                    comm: comm.trim_end().to_string(),
                    cgroup: rel.to_path_buf(),
                    inode,
                });
            }
        }
    }
    out
}

/// The `Inode` column of a `/proc/<pid>/net/packet` table (empty if unreadable).
fn packet_inodes(path: &str) -> HashSet<u64> {
    fs::read_to_string(path).map(|t| parse_packet_table(&t)).unwrap_or_default()
}

fn parse_packet_table(text: &str) -> HashSet<u64> {
    let mut lines = text.lines();
    let Some(column) = lines.next().and_then(|h| h.split_whitespace().position(|c| c == "Inode"))
    else {
        return HashSet::new();
    };
    lines.filter_map(|l| l.split_whitespace().nth(column)?.parse().ok()).collect()
}

/// Inodes of the sockets among `pid`'s open files.
fn socket_inodes(pid: u32) -> Vec<u64> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    dir.filter_map(|e| {
        let target = fs::read_link(e.ok()?.path()).ok()?;
        let s = target.to_str()?;
        s.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packet_table_inodes() {
        let t = "sk               RefCnt Type Proto  Iface R Rmem   User   Inode\n\
                 ffff8881060f8000 3      3    0003   2     1 0      0      41234\n\
                 ffff8881060f9000 3      2    0800   0     1 0      0      41240\n";
        assert_eq!(parse_packet_table(t), HashSet::from([41234, 41240]));
        assert!(parse_packet_table("").is_empty());
        assert!(parse_packet_table("sk RefCnt\n1 2\n").is_empty());
    }

    #[test]
    fn own_packet_socket_is_found() {
        use rustix::net::{AddressFamily, SocketType, socket};
        let Ok(_owned) = socket(AddressFamily::PACKET, SocketType::RAW, None) else {
            eprintln!("skipped: no AF_PACKET socket without CAP_NET_RAW");
            return;
        };
        let packet = packet_inodes("/proc/self/net/packet");
        let mine: Vec<u64> =
            socket_inodes(std::process::id()).into_iter().filter(|i| packet.contains(i)).collect();
        assert_eq!(mine.len(), 1, "{packet:?}");
    }
}
