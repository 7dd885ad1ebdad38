use super::*;

fn policy(text: &str) -> Policy {
    Policy::parse("p.yaml", text).unwrap_or_else(|e| panic!("{e}"))
}

fn warnings(text: &str, platform: Option<&str>) -> Vec<(String, String)> {
    check(policy(text), platform, None).warnings.into_iter().map(|w| (w.field, w.reason)).collect()
}

const ALLOW: &str = "allow:\n  - {name: ccm, namespace: ns, hostNetwork: true, podSelector: {matchLabels: {a: b}}, containers: [c]}\n";

#[test]
fn a_good_policy_has_no_warnings() {
    let text = format!(
        "platform: AWS\nendpoints:\n  - {{name: v4, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}}\n  - {{name: v6, cidr: fd00:ec2::254/128, ports: [80]}}\n{ALLOW}"
    );
    assert_eq!(warnings(&text, None), vec![]);
    assert_eq!(warnings(&text, Some("AWS")), vec![]);
}

#[test]
fn the_eks_pod_identity_agent_is_a_neighbour() {
    let text = format!(
        "platform: AWS\nendpoints:\n  - {{name: v4, cidr: 169.254.169.254/32, ports: [80]}}\n  - {{name: v6, cidr: fd00:ec2::254/128, ports: [80]}}\n  - {{name: pia, cidr: 169.254.170.23/32, ports: [80]}}\n  - {{name: pia6, cidr: fd00:ec2::/32}}\n{ALLOW}"
    );
    let w = warnings(&text, Some("AWS"));
    let fields: Vec<&str> = w.iter().map(|(f, _)| f.as_str()).collect();
    assert!(fields.contains(&"endpoints[2].cidr"), "{w:?}");
    assert!(w.iter().any(|(f, r)| f == "endpoints[2].cidr"
        && r.contains("169.254.170.23 TCP 80")
        && r.contains("EKS Pod Identity")
        && r.contains("remove the endpoint")));
    // The /32 covers the IPv6 DNS, NTP and Pod Identity addresses: three warnings on cidr.
    assert_eq!(w.iter().filter(|(f, _)| f == "endpoints[3].cidr").count(), 3, "{w:?}");
}

#[test]
fn gcp_dns_and_ntp_stay_open() {
    let all_ports = "platform: GCP\nendpoints:\n  - {name: md, cidr: 169.254.169.254/32}\n";
    let w = warnings(&format!("{all_ports}{ALLOW}"), None);
    assert!(w.iter().any(|(f, r)| f == "endpoints[0].ports" && r.contains("port 53")), "{w:?}");
    assert!(w.iter().any(|(f, r)| f == "endpoints[0].ports" && r.contains("UDP 123")), "{w:?}");
    assert!(
        w.iter().any(|(f, r)| f == "endpoints" && r.contains("fd20:ce::254")),
        "the IPv6 address is unprotected: {w:?}"
    );
    let ntp = "platform: GCP\nendpoints:\n  - {name: md, cidr: 169.254.169.254/32, ports: [80, 443, 8080, 123]}\n  - {name: v6, cidr: fd20:ce::254/128, ports: [80, 443, 8080]}\n";
    let w = warnings(&format!("{ntp}{ALLOW}"), None);
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].0, "endpoints[0].ports");
    let udp = "platform: GCP\nendpoints:\n  - {name: md, cidr: 169.254.169.254/32, ports: [80, 443, 8080], protocols: [UDP]}\n  - {name: v6, cidr: fd20:ce::254/128, ports: [80, 443, 8080]}\n";
    let w = warnings(&format!("{udp}{ALLOW}"), None);
    assert!(
        w.iter().any(|(f, r)| f == "endpoints"
            && r.contains("169.254.169.254")
            && r.contains("80, 443, 8080")),
        "UDP only leaves the TCP metadata ports open: {w:?}"
    );
}

#[test]
fn azure_and_oci_neighbours() {
    let az = "platform: Azure\nendpoints:\n  - {name: imds, cidr: 169.254.169.254/32, ports: [80]}\n  - {name: ws, cidr: 168.63.129.16/32}\n";
    let w = warnings(&format!("{az}{ALLOW}"), None);
    assert!(
        w.iter().any(|(f, r)| f == "endpoints[1].ports" && r.contains("168.63.129.16 port 53")),
        "{w:?}"
    );
    let oci = "platform: External\nendpoints:\n  - {name: imds, cidr: 169.254.169.254/32, protocols: [UDP]}\n  - {name: v6, cidr: fd00:c1::a9fe:a9fe/128, ports: [80]}\n";
    let w = warnings(&format!("{oci}{ALLOW}"), Some("External/oci"));
    let fields: Vec<&str> = w.iter().map(|(f, _)| f.as_str()).collect();
    assert!(fields.contains(&"endpoints[0].ports"), "{w:?}");
    assert!(fields.contains(&"endpoints"), "TCP 80 is not protected: {w:?}");
    // Without the platform name, External has no table: only the generic checks.
    assert_eq!(warnings(&format!("{oci}{ALLOW}"), None), vec![]);
}

#[test]
fn protecting_nothing() {
    let empty = "platform: External\nallowNoEndpoints: true\nendpoints: []\n";
    let w = warnings(empty, Some("External/acme"));
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].0, "endpoints");
    assert!(w[0].1.contains("protects nothing"), "{w:?}");
    let w = warnings("platform: AWS\nallowNoEndpoints: true\nendpoints: []\n", None);
    assert!(w[0].1.contains("AWS has a metadata service: 169.254.169.254 TCP 80"), "{w:?}");
    assert_eq!(
        warnings("platform: VSphere\nallowNoEndpoints: true\nendpoints: []\n", None),
        vec![]
    );
    assert_eq!(warnings("platform: EquinixMetal\nallowNoEndpoints: true\n", None), vec![]);
    let audit = format!(
        "platform: IBMCloud\nmode: audit\nendpoints: [{{name: md, cidr: 169.254.169.254/32, ports: [80, 443]}}]\n{ALLOW}"
    );
    let w = warnings(&audit, None);
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].0, "mode");
}

#[test]
fn wholesale_namespaces_and_pod_network_entries() {
    let base = "platform: IBMCloud\nendpoints: [{name: md, cidr: 169.254.169.254/32, ports: [80, 443]}]\nallow:\n";
    let w = warnings(
        &format!("{base}  - {{name: a, namespace: kube-system, hostNetwork: true}}\n"),
        None,
    );
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].0, "allow[0]");
    assert!(w[0].1.contains("every pod of namespace kube-system on the host network"));
    let w = warnings(&format!("{base}  - {{name: a, namespace: x, serviceAccount: sa}}\n"), None);
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].0, "allow[0].hostNetwork");
    let w = warnings(
        &format!(
            "{base}  - {{name: a, namespace: x, hostNetwork: true, containers: [c]}}\n  - {{name: g, cgroup: tools}}\n"
        ),
        None,
    );
    assert_eq!(w, vec![], "containers narrow; cgroup entries are standalone");
}

#[test]
fn platform_mismatch() {
    let text = format!(
        "platform: AWS\nendpoints:\n  - {{name: v4, cidr: 169.254.169.254/32, ports: [80]}}\n  - {{name: v6, cidr: fd00:ec2::254/128, ports: [80]}}\n{ALLOW}"
    );
    let c = check(policy(&text), Some("GCP"), None);
    assert_eq!(c.platform, "GCP");
    assert_eq!(c.warnings[0].field, "platform");
    assert!(c.warnings[0].reason.contains("--platform names GCP"), "{:?}", c.warnings);
    let c = check(policy(&text), None, Some("Azure"));
    assert!(c.warnings[0].reason.contains("the ConfigMap's name names Azure"), "{:?}", c.warnings);
    let c = check(policy(&text), Some("aws"), Some("Azure"));
    assert_eq!(c.warnings, vec![], "--platform wins, case-insensitively: {:?}", c.warnings);
    assert_eq!(
        Warning { source: "f".into(), field: "mode".into(), reason: "r".into() }.to_string(),
        "warning: f: mode: r"
    );
}

#[test]
fn json_has_what_a_packet_test_needs() {
    let text = format!(
        "platform: GCP\nmode: audit\nendpoints:\n  - {{name: md, cidr: 169.254.169.254/32, ports: [80, 443, 8080], protocols: [TCP]}}\n{ALLOW}"
    );
    let j = check(policy(&text), None, None).to_json();
    assert_eq!(j["platform"], "GCP");
    assert_eq!(j["mode"], "audit");
    assert_eq!(j["endpoints"][0]["cidr"], "169.254.169.254/32");
    assert_eq!(j["endpoints"][0]["ports"], serde_json::json!([80, 443, 8080]));
    assert_eq!(j["endpoints"][0]["protocols"], serde_json::json!(["TCP"]));
    assert_eq!(j["allow"], serde_json::json!(["ccm"]));
    assert_eq!(j["keepOpen"][0]["ports"], serde_json::json!([53]));
    assert_eq!(j["keepOpen"][1]["protocols"], serde_json::json!(["UDP"]));
    let fields: Vec<&str> = j["warnings"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|w| w["field"].as_str())
        .collect();
    assert!(fields.contains(&"mode") && fields.contains(&"endpoints"), "{fields:?}");
}

#[test]
fn configmaps_are_read_and_named() {
    assert_eq!(
        platform::name_of_configmap("metadata-gate-policy-external-oci").as_deref(),
        Some("External/oci")
    );
    assert_eq!(
        platform::name_of_configmap("metadata-gate-policy-alibabacloud").as_deref(),
        Some("AlibabaCloud")
    );
    assert_eq!(platform::name_of_configmap("metadata-gate-policy-nope"), None);
    assert_eq!(platform::name_of_configmap("other"), None);
    let dir = std::env::temp_dir().join(format!("gate-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        path
    };
    let cm = file(
        "cm.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: metadata-gate-policy-gcp, namespace: metadata-gate}\ndata:\n  policy.yaml: |\n    platform: GCP\n    endpoints:\n      - {name: md, cidr: 169.254.169.254/32, ports: [0]}\n",
    );
    let e = check_file(&cm, None).expect_err("port 0");
    assert_eq!(
        e.source,
        format!("{} (configmap metadata-gate/metadata-gate-policy-gcp)", cm.display())
    );
    assert_eq!(e.field, "endpoints[0].ports[0]");
    let broken =
        file("broken.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {}\n");
    let e = check_file(&broken, None).expect_err("no policy.yaml");
    assert_eq!(e.field, "data[\"policy.yaml\"]");
    let plain = file(
        "plain.yaml",
        "platform: AWS\nendpoints: [{name: md, cidr: 169.254.169.254/32}]\nbogus: 1\n",
    );
    let e = check_file(&plain, None).expect_err("unknown field");
    assert_eq!(e.source, plain.display().to_string(), "a plain policy is reported as before");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn paths_that_reach_credentials_are_named_and_unserved_paths_said() {
    let text = "platform: AWS\nendpoints:\n  - {name: v4, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}\n  - {name: v6, cidr: fd00:ec2::254/128, ports: [80]}\nallow:\n  - {name: ccm, namespace: ns, hostNetwork: true, podSelector: {matchLabels: {a: b}}, paths: [/latest/meta-data/, /latest/meta-data/placement/region]}\nserved: {profile: safe}\n";
    let w = warnings(text, None);
    let on = |field: &str, phrase: &str| {
        w.iter().filter(|(f, r)| f == field && r.contains(phrase)).count()
    };
    // The prefix reaches the instance profile, the identity credentials, the keys and tags.
    assert_eq!(
        on("allow[0].paths", "/latest/meta-data/ reaches /latest/meta-data/iam/"),
        1,
        "{w:?}"
    );
    assert_eq!(on("allow[0].paths", "reaches"), 4, "{w:?}");
    // The safe profile reaches nothing sensitive.
    assert_eq!(on("served.paths", "reaches"), 0, "{w:?}");
    // Served paths are served (by the agent's proxy): nothing to warn about beyond what they
    // reach.
    assert_eq!(on("served.paths", ""), 0, "{w:?}");
}
