use super::*;
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
    assert_eq!(imds.counts, Counts { allowed: 0, denied: 5, audited: 0 });
    assert_eq!(imds.last_seen_unix_ms, 100_000 - 1_000, "the later of the two, one second ago");
    assert!(render_table(&r, 100_000).contains("DaemonSet/csi-node (sa csi-node-sa)"));
}

#[test]
fn suggested_entries_are_a_valid_policy_and_narrow_to_the_owner() {
    let records = vec![
        AccessRecord {
            identity: pod("driver", true),
            endpoint: "ec2-imds".into(),
            counts: Counts { allowed: 0, denied: 4, audited: 0 },
            last_seen_unix_ms: 1,
        },
        AccessRecord {
            identity: pod("liveness", true),
            endpoint: "ec2-imds".into(),
            counts: Counts { allowed: 0, denied: 0, audited: 1 },
            last_seen_unix_ms: 1,
        },
        // Allowed already: no entry needed.
        AccessRecord {
            identity: Identity::cgroup("tools/ok"),
            endpoint: "ec2-imds".into(),
            counts: Counts { allowed: 9, denied: 0, audited: 0 },
            last_seen_unix_ms: 1,
        },
        AccessRecord {
            identity: Identity::cgroup("tools/agent"),
            endpoint: "ec2-imds".into(),
            counts: Counts { allowed: 0, denied: 1, audited: 0 },
            last_seen_unix_ms: 1,
        },
    ];
    let s = suggest(&records);
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
