use std::path::Path;

use super::*;

/// OpenShift's `PlatformType` values (openshift/api `config/v1/types_infrastructure.go`), in
/// its order: the reference the table is held to.
const OPENSHIFT: [&str; 16] = [
    "AWS",
    "Azure",
    "BareMetal",
    "GCP",
    "Libvirt",
    "OpenStack",
    "None",
    "VSphere",
    "oVirt",
    "IBMCloud",
    "KubeVirt",
    "EquinixMetal",
    "PowerVS",
    "AlibabaCloud",
    "Nutanix",
    "External",
];

fn repo(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

#[test]
fn every_address_parses_and_is_exact_or_a_network() {
    for p in Platform::all() {
        let f = p.facts();
        for s in f.metadata.iter().chain(f.keep_open) {
            let net = s.net();
            assert_eq!(net, net.trunc(), "{p}: {} has host bits set", s.net);
            assert!(!s.what.is_empty());
        }
    }
}

#[test]
fn every_platform_is_named_once_and_is_a_platform_type() {
    assert_eq!(platform_types(), OPENSHIFT, "the policy's platform values are OpenShift's");
    let all: Vec<Platform> = Platform::all().collect();
    for (i, p) in all.iter().enumerate() {
        let f = p.facts();
        assert!(OPENSHIFT.contains(&p.platform_type()), "{p} is no OpenShift platform type");
        assert_eq!(
            p.platform_type() == EXTERNAL,
            f.name.contains('/'),
            "{p}: an External provider is External/<platformName>, nothing else has a /"
        );
        assert!(
            all[i + 1..].iter().all(|q| !q.name().eq_ignore_ascii_case(f.name)),
            "{p} listed twice"
        );
        assert_eq!(
            f.metadata.is_empty(),
            f.no_metadata_service.is_some(),
            "{p}: a platform either has a metadata service or says why not"
        );
        assert_eq!(Platform::from_name(f.name), Some(*p));
    }
    // Every platform type but External (whose rows are per platformName) has its row.
    for t in OPENSHIFT.iter().filter(|t| **t != EXTERNAL) {
        assert!(Platform::from_name(t).is_some(), "no row for {t}");
    }
}

#[test]
fn ids_and_schemes_name_one_platform_each() {
    let mut seen: Vec<(&str, &str, Platform)> = Vec::new();
    for p in Platform::all() {
        let f = p.facts();
        let ids = f.ignition_ids.iter().map(|i| ("ignition id", *i));
        for (kind, id) in ids.chain(f.provider_ids.iter().map(|s| ("providerID scheme", *s))) {
            if let Some((_, _, q)) = seen.iter().find(|(k, i, _)| *k == kind && *i == id) {
                panic!("{kind} {id:?} names both {q} and {p}");
            }
            seen.push((kind, id, p));
        }
        // A node on a platform with a metadata service must name it before any API server
        // can be asked (else the boot step cannot close the gate on its first boot).
        if f.no_metadata_service.is_none() {
            assert!(!f.ignition_ids.is_empty() || !f.dmi.is_empty(), "{p}: no first-boot id");
            assert!(!f.provider_ids.is_empty(), "{p}: no providerID scheme");
        }
    }
}

#[test]
fn no_neighbour_is_a_metadata_port() {
    // A neighbour on the metadata address itself (GCP's DNS on :53) must not share a port
    // with the metadata service, or no policy could protect one and leave the other open.
    for p in Platform::all() {
        let f = p.facts();
        for m in f.metadata {
            for k in f.keep_open.iter().filter(|k| k.net == m.net) {
                assert!(
                    k.ports.iter().all(|port| !m.ports.contains(port)),
                    "{p}: {} and {} share a port",
                    m.describe(),
                    k.describe()
                );
            }
        }
    }
}

#[test]
fn every_platform_ships_its_policy_and_every_shipped_policy_is_a_platform() {
    let dir = repo("deploy/policies");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .expect("deploy/policies")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n != "kustomization.yaml")
        .filter_map(|n| n.strip_suffix(".yaml").map(str::to_owned))
        .collect();
    on_disk.sort();
    let mut stems: Vec<String> = Platform::all().map(|p| stem(p.name())).collect();
    stems.sort();
    assert_eq!(stems, on_disk, "one file of deploy/policies/ per platform, named by its stem");
    for p in Platform::all() {
        let file = dir.join(format!("{}.yaml", stem(p.name())));
        let text = std::fs::read_to_string(&file).expect("read");
        assert_eq!(p.facts().shipped, Some(text.as_str()), "{p}: shipped is {}", file.display());
    }
}

/// The platforms a row of docs/platforms.md's endpoints table names: its first cell's bold
/// text, `External / oci` as `External/oci`, lists split at commas.
fn documented() -> Vec<String> {
    let text = std::fs::read_to_string(repo("docs/platforms.md")).expect("docs/platforms.md");
    let table = text
        .split("## Protected endpoints, per platform")
        .nth(1)
        .and_then(|t| t.split("\n## ").next())
        .expect("the endpoints table");
    table
        .lines()
        .filter_map(|l| l.strip_prefix("| **"))
        .filter_map(|l| l.split_once("**").map(|(bold, _)| bold.replace(" / ", "/")))
        .flat_map(|bold| bold.split(", ").map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

#[test]
fn every_platform_has_its_row_in_the_docs() {
    let rows = documented();
    for p in Platform::all() {
        assert!(
            rows.iter().any(|r| r == p.name()),
            "docs/platforms.md: no row for {p} in the endpoints table ({rows:?})"
        );
    }
}

#[test]
fn lookups() {
    assert_eq!(Platform::from_name("aws"), Some(Platform::Aws));
    assert_eq!(Platform::from_name("external/OCI"), Some(Platform::ExternalOci));
    assert!(Platform::from_name("External").is_none(), "External alone names no provider");
    assert!(Platform::from_name("External/foo").is_none());
    assert_eq!(Platform::ExternalOci.platform_type(), "External");
    assert_eq!(Platform::Gcp.platform_type(), "GCP");
    assert_eq!(Platform::by_ignition_id("aliyun"), Some(Platform::AlibabaCloud));
    assert_eq!(Platform::by_provider_scheme("gce"), Some(Platform::Gcp));
    assert_eq!(Platform::ExternalOci.configmap_name(), "metadata-gate-policy-external-oci");
    assert_eq!(configmap_name("External/acme"), "metadata-gate-policy-external-acme");
    assert_eq!(name_of_configmap("metadata-gate-policy-aws").as_deref(), Some("AWS"));
    assert_eq!(
        name_of_configmap("metadata-gate-policy-external-acme").as_deref(),
        Some("External/acme")
    );
    assert_eq!(name_of_configmap("metadata-gate-policy-mars"), None);
    assert_eq!(canonical("external/OCI"), "External/oci");
    assert_eq!(canonical("ovirt"), "oVirt");
    assert_eq!(canonical("Mars"), "Mars");
    assert!(Platform::Aws.profile("safe").is_some());
    assert!(Platform::BareMetal.profile("safe").is_none());
}

#[test]
fn description() {
    let aws = Platform::Aws.facts();
    let described: Vec<String> = aws.keep_open.iter().map(Service::describe).collect();
    assert!(described.contains(&"169.254.169.253 port 53".to_owned()), "{described:?}");
    assert!(described.contains(&"fd00:ec2::123 UDP 123".to_owned()), "{described:?}");
    assert!(described.contains(&"169.254.170.23 TCP 80".to_owned()), "{described:?}");
    let gcp = Platform::Gcp.facts();
    assert_eq!(gcp.metadata[0].describe(), "169.254.169.254 TCP 80, 443, 8080");
    let network = Service { what: "x", net: "100.100.0.0/16", ports: &[], protocols: &[] };
    assert_eq!(network.describe(), "100.100.0.0/16", "a network is shown as a network");
}

#[test]
fn dmi_tests() {
    assert!(DmiTest::StartsWithAnyCase("ec2").passes("EC2E1916"));
    assert!(!DmiTest::StartsWithAnyCase("ec2").passes("e"));
    assert!(DmiTest::StartsWith("GoogleCloud-").passes("GoogleCloud-4A"));
    assert!(!DmiTest::Is("Scale").passes("Scaleway"));
}

#[test]
fn only_exact_read_paths_the_platform_cites_are_kept_and_never_a_sensitive_one() {
    use gate_common::http::PathRule;
    for p in Platform::all() {
        let f = p.facts();
        for s in f.profiles.iter().flat_map(|pr| pr.paths).filter(|s| s.fixed.is_some()) {
            let src = s.fixed.unwrap_or_default();
            assert!(src.starts_with("https://"), "{}: {}: no source", f.name, s.path);
            assert_eq!(s.method, "GET", "{}: {}: only reads are kept", f.name, s.path);
            assert!(!s.path.ends_with('/'), "{}: {}: a prefix is never kept", f.name, s.path);
            let rule = PathRule::parse(s.path).expect("a safe path parses");
            for never in f.sensitive {
                let never_rule = PathRule::parse(never.path).expect("a sensitive path parses");
                assert!(!rule.overlaps(&never_rule), "{}: {} is sensitive", f.name, s.path);
            }
            if let Some(scheme) = f.proxy.session {
                assert_ne!(s.path, scheme.path, "{}: the token is never kept", f.name);
            }
        }
        // A cached answer is given only on what the service requires of a request.
        let fixed = f.profiles.iter().flat_map(|pr| pr.paths).any(|s| s.fixed.is_some());
        assert!(
            !fixed || f.proxy.answers_need != AnswerGate::Never,
            "{}: fixed paths but no rule for who gets them",
            f.name
        );
    }
}
