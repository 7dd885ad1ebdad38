use std::sync::atomic::{AtomicU32, Ordering};

use super::*;

/// A scratch directory tree, removed on drop (also on panic).
struct TempTree(PathBuf);

impl TempTree {
    fn new(dirs: &[&str]) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let base = std::env::temp_dir().join(format!(
            "gate-agent-cgroup-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        for d in dirs {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        // Control files, as in a real cgroup directory: never listed as cgroups.
        std::fs::write(base.join("cgroup.procs"), "").unwrap();
        TempTree(base)
    }

    /// A GatedRoot over the plain directory (open() would reject it: not cgroup2).
    fn root(&self) -> GatedRoot {
        GatedRoot {
            path: self.0.clone(),
            mount: self.0.parent().unwrap().to_path_buf(),
            id: std::fs::metadata(&self.0).unwrap().ino(),
            level: 1,
        }
    }

    fn ino(&self, rel: &str) -> u64 {
        std::fs::metadata(self.0.join(rel)).unwrap().ino()
    }
}

impl Drop for TempTree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const HYBRID: &str = "\
22 28 0:20 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
25 28 0:5 / /dev rw,nosuid,relatime shared:2 - devtmpfs udev rw,size=4010412k,nr_inodes=1002603,mode=755
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime shared:9 - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
";

#[test]
fn hybrid_layout_finds_the_unified_mount() {
    assert_eq!(cgroup2_mount_from(HYBRID).unwrap(), PathBuf::from("/sys/fs/cgroup/unified"));
}

#[test]
fn unified_layout_and_optional_fields() {
    let text = "\
29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 master:1 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";
    assert_eq!(cgroup2_mount_from(text).unwrap(), PathBuf::from("/sys/fs/cgroup"));
}

#[test]
fn escaped_mount_point() {
    let text = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
90 31 0:50 / /tmp/my\\040cgroups\\134x rw,relatime - cgroup2 none rw
";
    assert_eq!(cgroup2_mount_from(text).unwrap(), PathBuf::from("/tmp/my cgroups\\x"));
}

#[test]
fn every_cgroup2_mount_in_order() {
    let text = format!("{HYBRID}99 41 0:60 / /run/test\\011cg rw - cgroup2 cgroup2 rw\n");
    assert_eq!(
        cgroup2_mounts_from(&text),
        vec![PathBuf::from("/sys/fs/cgroup/unified"), PathBuf::from("/run/test\tcg")]
    );
}

#[test]
fn no_cgroup2_is_an_error() {
    let text = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n\
                33 31 0:29 / /cgroup2 rw,relatime - tmpfs cgroup2 rw\n\
                garbage line - cgroup2\n";
    let e = cgroup2_mount_from(text).unwrap_err();
    assert!(matches!(e, CgroupError::NoCgroup2), "{e}");
    assert!(e.to_string().contains("no cgroup2 filesystem"), "{e}");
    assert!(cgroup2_mount_from("").is_err());
}

#[test]
fn open_refuses_a_plain_directory() {
    let t = TempTree::new(&[]);
    let e = GatedRoot::open(&t.0).unwrap_err();
    assert!(matches!(e, CgroupError::NotCgroup2 { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("not on a cgroup2 filesystem"), "{msg}");
    assert!(msg.contains(&t.0.display().to_string()), "{msg}");
}

#[test]
fn open_refuses_missing_and_non_directories() {
    let t = TempTree::new(&[]);
    let e = GatedRoot::open(&t.0.join("nope")).unwrap_err();
    assert!(matches!(e, CgroupError::NotFound { .. }), "{e}");
    assert!(e.to_string().ends_with("nope: does not exist"), "{e}");
    let e = GatedRoot::open(&t.0.join("cgroup.procs")).unwrap_err();
    assert!(matches!(e, CgroupError::NotADirectory { .. }), "{e}");
    assert!(e.to_string().contains("not a directory"), "{e}");
}

/// Read-only checks against this machine's real cgroup2 mount, where there is one.
#[test]
fn open_refuses_the_hierarchy_root_and_accepts_a_child() {
    let Ok(mount) = cgroup2_mount() else { return };
    let Ok(meta) = std::fs::metadata(&mount) else { return };
    assert!(meta.is_dir());
    let e = GatedRoot::open(&mount).unwrap_err();
    assert!(matches!(e, CgroupError::IsRoot { .. }), "{e}");
    assert!(e.to_string().contains("the root cgroup is never gated"), "{e}");
    let child = std::fs::read_dir(&mount)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_type().is_ok_and(|t| t.is_dir()));
    if let Some(child) = child {
        let root = GatedRoot::open(&child.path()).unwrap();
        assert_eq!(root.level, 1);
        assert_eq!(root.id, std::fs::metadata(child.path()).unwrap().ino());
        assert_eq!(root.path_of(root.id), Some(PathBuf::from(".")));
    }
}

#[test]
fn walk_is_depth_first_in_name_order_without_the_root() {
    let t = TempTree::new(&["b/x", "a/y/z", "a/w"]);
    let got: Vec<_> = t.root().walk().into_iter().map(|(p, _)| p).collect();
    let want: Vec<PathBuf> =
        ["a", "a/w", "a/y", "a/y/z", "b", "b/x"].iter().map(PathBuf::from).collect();
    assert_eq!(got, want);
    for (rel, id) in t.root().walk() {
        assert_eq!(id, std::fs::metadata(t.0.join(&rel)).unwrap().ino());
    }
}

#[test]
fn walk_is_bounded_in_depth() {
    let deep: String =
        (0..MAX_CGROUP_DEPTH + 3).map(|i| format!("d{i}")).collect::<Vec<_>>().join("/");
    let t = TempTree::new(&[&deep]);
    let walked = t.root().walk();
    assert_eq!(walked.len(), MAX_CGROUP_DEPTH as usize);
    let deepest = walked.last().unwrap().0.components().count();
    assert_eq!(deepest, MAX_CGROUP_DEPTH as usize);
}

#[test]
fn path_of_finds_ids() {
    let t = TempTree::new(&["tools/a", "svc"]);
    let root = t.root();
    assert_eq!(root.path_of(t.ino("tools/a")), Some(PathBuf::from("tools/a")));
    assert_eq!(root.path_of(t.ino("svc")), Some(PathBuf::from("svc")));
    assert_eq!(root.path_of(root.id), Some(PathBuf::from(".")));
    assert_eq!(root.path_of(u64::MAX), None);
}

fn policy(allow: &str) -> Policy {
    let text = format!(
        "platform: AWS\nendpoints:\n  - name: imds\n    cidr: 169.254.169.254/32\nallow:\n{allow}"
    );
    Policy::parse("test.yaml", &text).unwrap()
}

#[test]
fn star_does_not_cross_slash_and_first_entry_wins() {
    let t = TempTree::new(&["tools/a/inner", "tools/b", "cloud-agent/sub", "other"]);
    let p = policy(
        "  - {name: pods, namespace: kube-system}\n\
         \x20 - {name: tools, cgroup: \"tools/*\"}\n\
         \x20 - {name: agent, cgroup: cloud-agent}\n\
         \x20 - {name: all-b, cgroup: \"**/b\"}\n",
    );
    let got: Vec<_> = t
        .root()
        .resolve_allow(&p)
        .into_iter()
        .map(|r| (r.rel.display().to_string(), r.id, r.entry))
        .collect();
    assert_eq!(
        got,
        vec![
            ("cloud-agent".to_owned(), t.ino("cloud-agent"), 2),
            ("tools/a".to_owned(), t.ino("tools/a"), 1),
            ("tools/b".to_owned(), t.ino("tools/b"), 1),
        ]
    );
}

#[test]
fn double_star_crosses_slash() {
    let t = TempTree::new(&["tools/a/inner", "x"]);
    let p = policy("  - {name: tools, cgroup: \"tools/**\"}\n");
    let got: Vec<_> = t.root().resolve_allow(&p).into_iter().map(|r| r.rel).collect();
    assert_eq!(got, vec![PathBuf::from("tools/a"), PathBuf::from("tools/a/inner")]);
}

#[test]
fn no_cgroup_entries_resolve_to_nothing() {
    let t = TempTree::new(&["a"]);
    let p = policy("  - {name: pods, namespace: kube-system}\n");
    assert!(t.root().resolve_allow(&p).is_empty());
}

#[test]
fn places_tell_the_gated_tree_from_the_rest_of_the_hierarchy() {
    let t = TempTree::new(&["kubepods/pod1/c1", "system.slice/kubelet.service", "kubepods-x"]);
    let root = GatedRoot {
        path: t.0.join("kubepods"),
        mount: t.0.clone(),
        id: t.ino("kubepods"),
        level: 1,
    };
    let places: std::collections::HashMap<u64, Place> = root.places().into_iter().collect();
    assert_eq!(places.get(&t.ino("system.slice/kubelet.service")), Some(&Place::Outside));
    assert_eq!(places.get(&t.ino("system.slice")), Some(&Place::Outside));
    assert_eq!(places.get(&t.ino("kubepods-x")), Some(&Place::Outside), "a prefix is no parent");
    assert_eq!(places.get(&t.ino("kubepods")), Some(&Place::Below));
    assert_eq!(places.get(&t.ino("kubepods/pod1/c1")), Some(&Place::Below));
    let mount = std::fs::metadata(&t.0).unwrap().ino();
    assert_eq!(places.get(&mount), Some(&Place::Outside), "the hierarchy's root");
    // Not cgroup2: no file handles here, so the caller walks.
    assert!(root.place_by_handle(t.ino("kubepods")).is_err());
}

/// The kernel counts a cgroup's level from the hierarchy's real root; a mount made inside a
/// cgroup namespace (a node in a container: kind, the cluster test) shows a subtree whose top
/// is deeper than level 0, and a mount bound in from the host shows the whole hierarchy even
/// to a process in a nested namespace.
#[test]
fn a_namespace_level_that_cannot_be_proved_is_refused() {
    // The initial namespace is level 0 whatever pid 2 is.
    assert_eq!(ns_level(Some(INIT_CGROUP_NS_INO), None).ok(), Some(0));
    // A namespace of its own, kthreadd visible: counted from kthreadd.
    assert_eq!(ns_level(Some(4026532999), Some("0::/..\n")).ok(), Some(1));
    assert_eq!(ns_level(None, Some("0::/../..\n")).ok(), Some(2));
    // A namespace of its own and no host pid namespace: no guess (a guess of 0 would let raw
    // frames pass), an error that says what to change.
    let err = ns_level(Some(4026532999), None).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("hostPID"), "{err}");
    assert!(ns_level(None, None).is_err());
}

#[test]
fn levels_count_from_the_real_root_whatever_the_mount_shows() {
    // kthreadd as seen from the host's namespace, and from one rooted two levels down.
    assert_eq!(cgroup_ns_level_from("0::/\n"), 0);
    assert_eq!(cgroup_ns_level_from("1:name=systemd:/\n0::/../..\n"), 2);
    assert_eq!(cgroup_ns_level_from(""), 0, "no cgroup2 line: the host's view");
    // A mount made in the node's namespace (root `/`), seen from there: its top is the
    // namespace root.
    assert_eq!(mount_root_level(1, "/"), 1);
    // The host's whole hierarchy bound into a container with a nested namespace.
    assert_eq!(mount_root_level(1, "/.."), 0);
    assert_eq!(mount_root_level(3, "/../../.."), 0);
    // A subtree of the host's hierarchy, seen from the host.
    assert_eq!(mount_root_level(0, "/kubepods.slice"), 1);
    assert_eq!(mount_root_level(0, "/a/./b"), 2);
    let info = "352 312 0:38 /mg-1-node /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
    assert_eq!(
        cgroup2_mount_roots_from(info),
        [("/sys/fs/cgroup/unified".into(), "/mg-1-node".to_owned())]
    );
}
