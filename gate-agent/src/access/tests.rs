use super::*;
use crate::proxy::{PathCounts, PathKey, PathRecord};
use crate::{
    inspect::{report::render_table, suggest::suggest},
    policy::Policy,
};

fn stats(allowed: u64, denied: u64, audited: u64, last_ns: u64) -> AccessStats {
    AccessStats { allowed, denied, audited, last_ns, ..AccessStats::default() }
}

fn key(cgroup_id: u64, endpoint: u32) -> AccessKey {
    AccessKey { cgroup_id, endpoint, _pad: 0 }
}

fn pod(container: &str, host_network: bool) -> Identity {
    Identity {
        workload: format!("kube-system/csi-node-x1/{container}"),
        cgroup: None,
        namespace: Some("kube-system".into()),
        pod: Some("csi-node-x1".into()),
        container: Some(container.into()),
        owner: Some("DaemonSet/csi-node".into()),
        service_account: Some("csi-node-sa".into()),
        host_network: Some(host_network),
        labels: [("app", "csi-node"), ("controller-revision-hash", "abc")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        pod_uid: None,
    }
}

#[test]
fn records_aggregate_per_workload_and_endpoint_and_date_the_last_access() {
    let entries = vec![
        (key(1, 0), stats(0, 3, 0, 9_000_000_000)),
        (key(2, 0), stats(0, 2, 0, 8_000_000_000)), // the same workload, another cgroup
        (key(1, 1), stats(5, 0, 0, 7_000_000_000)),
    ];
    let identify = |id: u64| if id == 3 { Identity::cgroup("x") } else { pod("driver", true) };
    let eps = ["ec2-imds", "ec2-imds-v6"];
    let r = records(&entries, identify, |i| eps[i as usize].to_owned(), 10_000_000_000, 100_000);
    assert_eq!(r.len(), 2);
    let imds = r.iter().find(|r| r.endpoint == "ec2-imds").unwrap();
    assert_eq!(imds.counts, Counts { allowed: 0, denied: 5, audited: 0, proxied: 0 });
    assert_eq!(imds.last_seen_unix_ms, 100_000 - 1_000, "the later of the two, one second ago");
    assert!(render_table(&r, 100_000).contains("DaemonSet/csi-node (sa csi-node-sa)"));
}

#[test]
fn suggested_entries_are_a_valid_policy_and_narrow_to_the_owner() {
    let records = vec![
        AccessRecord {
            identity: pod("driver", true),
            endpoint: "ec2-imds".into(),
            counts: Counts { allowed: 0, denied: 4, audited: 0, proxied: 0 },
            last_seen_unix_ms: 1,
            paths: vec![],
        },
        AccessRecord {
            identity: pod("liveness", true),
            endpoint: "ec2-imds".into(),
            counts: Counts { allowed: 0, denied: 0, audited: 1, proxied: 0 },
            last_seen_unix_ms: 1,
            paths: vec![],
        },
        // Allowed already: no entry needed.
        AccessRecord {
            identity: Identity::cgroup("tools/ok"),
            endpoint: "ec2-imds".into(),
            counts: Counts { allowed: 9, denied: 0, audited: 0, proxied: 0 },
            last_seen_unix_ms: 1,
            paths: vec![],
        },
        AccessRecord {
            identity: Identity::cgroup("tools/agent"),
            endpoint: "ec2-imds".into(),
            counts: Counts { allowed: 0, denied: 1, audited: 0, proxied: 0 },
            last_seen_unix_ms: 1,
            paths: vec![],
        },
    ];
    let s = suggest(&records, Some("AWS"));
    assert!(s.contains("namespace: \"kube-system\""), "{s}");
    assert!(s.contains("\"app\": \"csi-node\"") && !s.contains("controller-revision-hash"), "{s}");
    assert!(
        s.contains("serviceAccount: \"csi-node-sa\"") && s.contains("hostNetwork: true"),
        "{s}"
    );
    assert!(s.contains("containers: [\"driver\", \"liveness\"]"), "{s}");
    assert!(s.contains("cgroup: \"tools/agent\"") && !s.contains("tools/ok"), "{s}");
    let doc = format!(
        "platform: AWS\nendpoints:\n  - {{name: ec2-imds, cidr: 169.254.169.254/32, ports: [80]}}\nallow:\n{}",
        s.lines().map(|l| format!("  {l}\n")).collect::<String>()
    );
    let p = Policy::parse("suggested.yaml", &doc).unwrap_or_else(|e| panic!("{e}\n{doc}"));
    assert_eq!(p.allow.len(), 2);
}

#[test]
fn known_identities_prefer_pods_and_are_bounded() {
    let mut k = Known::default();
    k.learn(1, pod("driver", true));
    k.learn(1, Identity::cgroup("kubepods.slice/x"));
    assert_eq!(k.0[&1].namespace.as_deref(), Some("kube-system"));
}

fn path(
    cgroup_id: u64,
    method: &str,
    path: &str,
    served: u64,
    refused: u64,
    audited: u64,
) -> PathRecord {
    PathRecord {
        key: PathKey {
            cgroup_id,
            endpoint: "ec2-imds".into(),
            method: method.into(),
            path: path.into(),
            query: vec![],
        },
        counts: PathCounts { served, refused, audited, limited: 0, last_seen_unix_ms: 50 },
    }
}

#[test]
fn paths_join_their_workload_s_record_or_make_one() {
    let entries = vec![(
        key(1, 0),
        AccessStats { proxied: 3, last_ns: 9_000_000_000, ..AccessStats::default() },
    )];
    let identify =
        |id: u64| if id == 1 { pod("driver", true) } else { Identity::cgroup("tools/gone") };
    let mut r = records(&entries, identify, |_| "ec2-imds".to_owned(), 10_000_000_000, 100_000);
    assert_eq!(r[0].counts.proxied, 3);
    let paths = [
        path(1, "GET", "/latest/meta-data/instance-id", 2, 0, 0),
        path(1, "GET", "/latest/meta-data/iam/info", 0, 1, 0),
        // The same workload in another cgroup: one line per path.
        path(9, "GET", "/x", 0, 0, 1),
        path(2, "GET", "/latest/meta-data/placement/region", 1, 0, 0),
    ];
    let identify = |id: u64| match id {
        1 | 9 => pod("driver", true),
        _ => Identity::cgroup("tools/gone"),
    };
    add_paths(&mut r, &paths, identify);
    assert_eq!(r.len(), 2, "{r:#?}");
    let driver = r.iter().find(|r| r.identity.container.is_some()).expect("driver");
    let got: Vec<_> = driver.paths.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(got, ["/latest/meta-data/iam/info", "/latest/meta-data/instance-id", "/x"]);
    let gone = r.iter().find(|r| r.identity.workload == "tools/gone").expect("made");
    assert_eq!((gone.counts, gone.paths.len(), gone.last_seen_unix_ms), (Counts::default(), 1, 50));
    let table = render_table(&r, 100_000);
    assert!(table.contains("GET /latest/meta-data/iam/info"), "{table}");
}

#[test]
fn suggested_paths_are_what_the_workload_asked_for_and_never_credentials_unasked() {
    let mut records = vec![AccessRecord {
        identity: pod("driver", true),
        endpoint: "ec2-imds".into(),
        counts: Counts { proxied: 4, ..Counts::default() },
        last_seen_unix_ms: 1,
        paths: vec![],
    }];
    let paths = [
        path(1, "GET", "/latest/meta-data/instance-id", 0, 0, 2),
        path(1, "PUT", "/latest/api/token", 0, 0, 1),
        path(1, "GET", "/latest/meta-data/placement/region", 3, 0, 0),
        path(1, "GET", "/latest/meta-data/iam/security-credentials/role", 0, 0, 1),
    ];
    add_paths(&mut records, &paths, |_| pod("driver", true));
    let s = suggest(&records, Some("AWS"));
    for p in
        ["/latest/meta-data/instance-id", "/latest/api/token", "/latest/meta-data/placement/region"]
    {
        assert!(s.contains(&format!("    - \"{p}\"\n")), "{p}: {s}");
    }
    assert!(s.contains("    # - \"/latest/meta-data/iam/security-credentials/role\""), "{s}");
    assert!(s.contains("methods: [\"GET\", \"HEAD\", \"PUT\"]"), "{s}");
    let doc = format!(
        "platform: AWS\nendpoints:\n  - {{name: ec2-imds, cidr: 169.254.169.254/32, ports: [80]}}\nallow:\n{}",
        s.lines().map(|l| format!("  {l}\n")).collect::<String>()
    );
    let p = Policy::parse("suggested.yaml", &doc).unwrap_or_else(|e| panic!("{e}\n{doc}"));
    let access = &p.allow[0].paths.as_ref().expect("paths").access;
    assert_eq!(access.paths.len(), 3, "the credentials stay commented out");
    assert!(access.judge("GET", "/latest/meta-data/iam/security-credentials/role").is_err());

    // Only credentials asked for: an empty list that `check` rejects, never a whole-service entry.
    let mut only = records.clone();
    only[0].paths.retain(|p| p.path.contains("iam"));
    let s = suggest(&only, Some("AWS"));
    assert!(s.contains("paths: []"), "{s}");
    let doc = format!(
        "platform: AWS\nendpoints:\n  - {{name: ec2-imds, cidr: 169.254.169.254/32, ports: [80]}}\nallow:\n{}",
        s.lines().map(|l| format!("  {l}\n")).collect::<String>()
    );
    assert!(Policy::parse("suggested.yaml", &doc).is_err(), "{doc}");

    // A directory asked for (google-auth's `/`, botocore's `availability-zone/`) is
    // suggested exact: that path alone, never the tree below it.
    let mut dirs = records.clone();
    dirs[0].paths.clear();
    let asked = [
        path(1, "GET", "/", 0, 1, 0),
        path(1, "GET", "/latest/meta-data/placement/availability-zone/", 0, 1, 0),
        path(1, "GET", "/latest/meta-data/iam/security-credentials/", 0, 1, 0),
    ];
    add_paths(&mut dirs, &asked, |_| pod("driver", true));
    let s = suggest(&dirs, Some("AWS"));
    assert!(s.contains("    - \"=/\"\n"), "{s}");
    assert!(s.contains("    - \"=/latest/meta-data/placement/availability-zone/\"\n"), "{s}");
    assert!(s.contains("    # - \"=/latest/meta-data/iam/security-credentials/\""), "{s}");
    let doc = format!(
        "platform: AWS\nendpoints:\n  - {{name: ec2-imds, cidr: 169.254.169.254/32, ports: [80]}}\nallow:\n{}",
        s.lines().map(|l| format!("  {l}\n")).collect::<String>()
    );
    let p = Policy::parse("suggested.yaml", &doc).unwrap_or_else(|e| panic!("{e}\n{doc}"));
    let access = &p.allow[0].paths.as_ref().expect("paths").access;
    assert!(access.judge("GET", "/").is_ok());
    assert!(access.judge("GET", "/latest/meta-data/iam/security-credentials/").is_err());
    assert!(access.judge("GET", "/latest/meta-data/placement/availability-zone/x").is_err());

    // Served everything it asked for under `served`: nothing to suggest.
    let mut fine = records;
    fine[0].paths.retain(|p| p.counts.served > 0);
    assert!(
        suggest(&fine, Some("AWS")).starts_with("# no workload"),
        "{}",
        suggest(&fine, Some("AWS"))
    );
}
