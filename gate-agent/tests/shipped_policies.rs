//! Every policy ConfigMap shipped in deploy/policies/ and deploy/profiles/*/ is a valid policy
//! for its platform, and every allow entry is pinned to the manifest of the component it lets
//! through (gate-agent/tests/fixtures/components.yaml).
//!
//! Each file is one ConfigMap `metadata-gate-policy-<file stem>` in namespace `metadata-gate`
//! whose key `policy.yaml` must pass [`Policy::parse`] (the same validation the agent applies),
//! name the platform the file is for, protect exact /32 or /128 addresses only, and select
//! pods (cluster mode), not cgroup globs.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use gate_agent::cluster::identity::{CgroupDriver, PodInfo, allowed_cgroups, selects};
use gate_agent::policy::{AllowSelector, Mode, Policy, platform_types};
use serde::Deserialize;

const NAMESPACE: &str = "metadata-gate";
const PREFIX: &str = "metadata-gate-policy-";

fn policies_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/policies")
}

fn profiles_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/profiles")
}

/// The platform a file is for, from its stem: `aws` -> `AWS`, `external-oci` -> `External`.
fn platform_for(stem: &str) -> Option<&'static str> {
    let base = stem.split_once('-').map_or(stem, |(p, _)| p);
    platform_types().into_iter().find(|p| p.eq_ignore_ascii_case(base))
}

/// The policy ConfigMap files of a directory (every `*.yaml` but the kustomization), sorted.
fn configmap_files(dir: &Path) -> Vec<PathBuf> {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display())).path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .filter(|p| p.file_name().is_some_and(|n| n != "kustomization.yaml"))
        .collect();
    files.sort();
    files
}

/// The per-platform policies of deploy/policies/.
fn shipped_files() -> Vec<PathBuf> {
    configmap_files(&policies_dir())
}

/// The policies of the managed-Kubernetes profiles, deploy/profiles/<profile>/<platform>.yaml.
fn profile_files() -> Vec<PathBuf> {
    let dir = profiles_dir();
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    let mut profiles: Vec<PathBuf> = entries
        .map(|e| e.unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display())).path())
        .filter(|p| p.is_dir())
        .collect();
    profiles.sort();
    profiles.iter().flat_map(|p| configmap_files(p)).collect()
}

/// Every shipped policy file: the platforms' and the profiles'.
fn all_files() -> Vec<PathBuf> {
    let mut files = shipped_files();
    files.extend(profile_files());
    files
}

/// Check one file; Err names the file and what is wrong.
fn check(path: &Path) -> Result<Policy, String> {
    let file = path.display().to_string();
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| format!("{file}: file name is not UTF-8"))?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("{file}: cannot read: {e}"))?;
    // YAML 1.2 booleans only, as the agent reads policies: `n` and `yes` are strings.
    let strict = serde_saphyr::options! { strict_booleans: true };
    let cm: serde_json::Value = serde_saphyr::from_str_with_options(&text, strict)
        .map_err(|e| format!("{file}: not valid YAML: {e}"))?;
    let field =
        |v: &serde_json::Value, key: &str| v.get(key).and_then(|v| v.as_str()).map(str::to_owned);

    if field(&cm, "apiVersion").as_deref() != Some("v1")
        || field(&cm, "kind").as_deref() != Some("ConfigMap")
    {
        return Err(format!("{file}: expected apiVersion v1, kind ConfigMap"));
    }
    let meta = cm.get("metadata").ok_or_else(|| format!("{file}: no metadata"))?;
    let name = field(meta, "name").ok_or_else(|| format!("{file}: metadata.name missing"))?;
    let want = format!("{PREFIX}{stem}");
    if name != want {
        return Err(format!(
            "{file}: ConfigMap is named {name:?}, expected {want:?} (from the file name)"
        ));
    }
    if field(meta, "namespace").as_deref() != Some(NAMESPACE) {
        return Err(format!("{file}: ConfigMap {name}: metadata.namespace must be {NAMESPACE}"));
    }
    let data = cm.get("data").ok_or_else(|| format!("{file}: ConfigMap {name}: no data"))?;
    if let Some(keys) = data.as_object() {
        for k in keys.keys() {
            if k != "policy.yaml" {
                return Err(format!(
                    "{file}: ConfigMap {name}: unexpected data key {k:?}; only policy.yaml"
                ));
            }
        }
    }
    let source = field(data, "policy.yaml").ok_or_else(|| {
        format!("{file}: ConfigMap {name}: data[\"policy.yaml\"] missing or not a string")
    })?;

    let policy = Policy::parse(&format!("configmap {NAMESPACE}/{name} ({file})"), &source)
        .map_err(|e| e.to_string())?;

    let platform = platform_for(stem)
        .ok_or_else(|| format!("{file}: file name {stem:?} names no OpenShift platform type"))?;
    if policy.platform != platform {
        return Err(format!(
            "{file}: policy.yaml says platform {:?}, the file is for {platform}",
            policy.platform
        ));
    }
    for (i, e) in policy.endpoints.iter().enumerate() {
        if e.cidr.prefix_len() != e.cidr.max_prefix_len() {
            return Err(format!(
                "{file}: endpoints[{i}] ({}): {} is not an exact /32 or /128",
                e.name, e.cidr
            ));
        }
        if e.ports.is_empty() {
            return Err(format!(
                "{file}: endpoints[{i}] ({}): list the protected ports, so that the others stay open",
                e.name
            ));
        }
    }
    for (i, a) in policy.allow.iter().enumerate() {
        match &a.selector {
            AllowSelector::Pods(p) => {
                if p.match_labels.is_empty() && p.match_expressions.is_empty() {
                    return Err(format!(
                        "{file}: allow[{i}] ({}): selects every pod of namespace {}; give labels",
                        a.name, p.namespace
                    ));
                }
            }
            AllowSelector::Cgroup(_) => {
                return Err(format!(
                    "{file}: allow[{i}] ({}): cgroup globs are for standalone mode",
                    a.name
                ));
            }
        }
    }
    Ok(policy)
}

#[test]
fn every_shipped_policy_is_valid() {
    let files = all_files();
    assert!(!files.is_empty(), "no policies found in {}", policies_dir().display());
    assert!(!profile_files().is_empty(), "no profile policies in {}", profiles_dir().display());
    let errors: Vec<String> = files.iter().filter_map(|f| check(f).err()).collect();
    assert!(errors.is_empty(), "invalid shipped policies:\n  {}", errors.join("\n  "));
}

#[test]
fn every_platform_has_a_policy() {
    let mut by_platform: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for f in shipped_files() {
        if let Ok(p) = check(&f) {
            by_platform.entry(p.platform.clone()).or_default().push(f.display().to_string());
        }
    }
    let missing: Vec<&str> =
        platform_types().into_iter().filter(|p| !by_platform.contains_key(*p)).collect();
    assert!(missing.is_empty(), "no valid shipped policy for platform(s) {missing:?}");
}

#[test]
fn only_platforms_without_a_metadata_service_protect_nothing() {
    // docs/platforms.md: these have no metadata service by default; EquinixMetal's was shut
    // down with the platform on 2026-06-30 (deploy/policies/equinixmetal.yaml).
    const EMPTY: &[&str] = &[
        "PowerVS",
        "VSphere",
        "Nutanix",
        "KubeVirt",
        "BareMetal",
        "None",
        "Libvirt",
        "oVirt",
        "EquinixMetal",
    ];
    for f in shipped_files() {
        let p = check(&f).unwrap_or_else(|e| panic!("{e}"));
        let expect_empty = EMPTY.contains(&p.platform.as_str());
        assert_eq!(
            p.endpoints.is_empty(),
            expect_empty,
            "{}: platform {} should {}protect endpoints",
            f.display(),
            p.platform,
            if expect_empty { "not " } else { "" }
        );
        if !expect_empty {
            assert_eq!(
                p.mode,
                Mode::Enforce,
                "{}: a cloud policy ships in enforce mode",
                f.display()
            );
            // IBM Cloud: no component OpenShift deploys there reads the metadata service
            // (deploy/policies/ibmcloud.yaml says why).
            assert_eq!(
                p.allow.is_empty(),
                p.platform == "IBMCloud",
                "{}: a cloud policy needs its default allow list (IBMCloud's is empty)",
                f.display()
            );
        } else {
            assert!(p.allow.is_empty(), "{}: nothing to protect, nobody to allow", f.display());
        }
    }
}

#[test]
fn a_broken_configmap_is_reported_with_its_file() {
    let dir = std::env::temp_dir().join(format!("shipped-policies-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("aws.yaml");
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: metadata-gate-policy-aws\n  namespace: metadata-gate\n\
         data:\n  policy.yaml: |\n    platform: AWS\n    endpoints:\n      - name: x\n        cidr: 169.254.169.254/32\n        ports: [0]\n",
    )
    .expect("write");
    let err = check(&path).expect_err("port 0 must be rejected");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(err.contains("aws.yaml") && err.contains("endpoints[0].ports[0]"), "{err}");
}

// ---- allow entries pinned to their components' manifests -----------------------------------

/// gate-agent/tests/fixtures/components.yaml.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Fixtures {
    components: Vec<Component>,
}

/// One component as its manifest describes its pod (see the file's header).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Component {
    id: String,
    source: Source,
    workload: String,
    #[serde(default)]
    namespace_from: Option<String>,
    pod: FixturePod,
    metadata_containers: Vec<String>,
    why: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Source {
    repo: String,
    #[serde(rename = "ref")]
    reference: String,
    commit: String,
    path: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FixturePod {
    namespace: String,
    labels: BTreeMap<String, String>,
    host_network: bool,
    service_account: Option<String>,
    init_containers: Vec<String>,
    containers: Vec<String>,
}

fn fixtures() -> Vec<Component> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/components.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let f: Fixtures =
        serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.components
}

/// The API pod a component's manifest makes, as the agent would see it on a node: every
/// container running, with an id, so that the cgroups an entry allows can be listed.
fn pod_of(c: &Component) -> PodInfo {
    let p = &c.pod;
    let names: Vec<&String> = p.init_containers.iter().chain(&p.containers).collect();
    let statuses: Vec<serde_json::Value> = names
        .iter()
        .enumerate()
        .map(|(i, n)| serde_json::json!({"name": n, "containerID": format!("cri-o://{:064x}", i + 1)}))
        .collect();
    let (init_statuses, statuses) = statuses.split_at(p.init_containers.len());
    let pod = serde_json::json!({
        "metadata": {
            "uid": "0b6c0f5e-0000-4a2b-9c3d-000000000001",
            "name": format!("{}-x1", c.id),
            "namespace": p.namespace,
            "labels": p.labels,
        },
        "spec": {
            "hostNetwork": p.host_network,
            "serviceAccountName": p.service_account,
            "initContainers": p.init_containers.iter().map(|n| serde_json::json!({"name": n})).collect::<Vec<_>>(),
            "containers": p.containers.iter().map(|n| serde_json::json!({"name": n})).collect::<Vec<_>>(),
        },
        "status": {
            "qosClass": "Burstable",
            "initContainerStatuses": init_statuses,
            "containerStatuses": statuses,
        },
    });
    let pod: k8s_openapi::api::core::v1::Pod =
        serde_json::from_value(pod).unwrap_or_else(|e| panic!("fixture {}: {e}", c.id));
    PodInfo::from_pod(&pod).unwrap_or_else(|e| panic!("fixture {}: {e}", c.id))
}

#[test]
fn every_fixture_names_its_source() {
    let mut ids = BTreeSet::new();
    for c in fixtures() {
        assert!(ids.insert(c.id.clone()), "fixture {} is listed twice", c.id);
        let s = &c.source;
        assert!(
            s.repo.split('/').count() == 2 && !s.path.is_empty() && !s.reference.is_empty(),
            "fixture {}: source needs owner/name, a path and a ref: {s:?}",
            c.id
        );
        assert!(
            s.commit.len() == 40 && s.commit.chars().all(|ch| ch.is_ascii_hexdigit()),
            "fixture {}: source.commit must be the 40-hex commit that was read, not {:?}",
            c.id,
            s.commit
        );
        assert!(!c.workload.is_empty() && !c.why.is_empty(), "fixture {}: workload and why", c.id);
        if c.namespace_from.as_deref().is_some_and(str::is_empty) {
            panic!("fixture {}: namespaceFrom is empty; omit it or say where", c.id);
        }
        let all: BTreeSet<&String> =
            c.pod.init_containers.iter().chain(&c.pod.containers).collect();
        assert!(!c.metadata_containers.is_empty(), "fixture {}: metadataContainers is empty", c.id);
        for m in &c.metadata_containers {
            assert!(
                all.contains(m),
                "fixture {}: metadataContainers names {m:?}, no container of the pod",
                c.id
            );
        }
    }
}

/// Every allow entry of every shipped policy lets exactly its component's metadata
/// container(s) through: its namespace, labels, service account and hostNetwork select the
/// pod the manifest makes, and its `containers:` narrowing names those containers (and only
/// real ones), so that sidecars stay gated. Every entry requires hostNetwork: true.
#[test]
fn every_shipped_allow_entry_selects_its_component() {
    let components = fixtures();
    let by_id: BTreeMap<&str, &Component> = components.iter().map(|c| (c.id.as_str(), c)).collect();
    let mut problems = Vec::new();
    for f in all_files() {
        let policy = check(&f).unwrap_or_else(|e| panic!("{e}"));
        for (i, entry) in policy.allow.iter().enumerate() {
            let at = format!("{}: allow[{i}] ({})", f.display(), entry.name);
            let AllowSelector::Pods(sel) = &entry.selector else {
                problems.push(format!("{at}: not a pod entry"));
                continue;
            };
            let Some(c) = by_id.get(entry.name.as_str()) else {
                problems.push(format!(
                    "{at}: no component {:?} in tests/fixtures/components.yaml; add the manifest's pod there",
                    entry.name
                ));
                continue;
            };
            if sel.host_network != Some(true) {
                problems.push(format!(
                    "{at}: set hostNetwork: true (the component runs on the host network)"
                ));
            }
            let pod = pod_of(c);
            if !selects(sel, &pod) {
                problems.push(format!(
                    "{at}: does not select the pod of {} ({} {} at {}): namespace {}, labels {:?}, \
                     serviceAccount {:?}, hostNetwork {}",
                    c.workload,
                    c.source.repo,
                    c.source.path,
                    c.source.commit,
                    c.pod.namespace,
                    c.pod.labels,
                    pod.service_account,
                    c.pod.host_network
                ));
                continue;
            }
            let real: BTreeSet<&str> = pod.containers.iter().map(|x| x.name.as_str()).collect();
            for name in &sel.containers {
                if !real.contains(name.as_str()) {
                    problems.push(format!(
                        "{at}: containers names {name:?}, which the pod does not have ({real:?})"
                    ));
                }
            }
            let want: BTreeSet<&str> = c.metadata_containers.iter().map(String::as_str).collect();
            let got: BTreeSet<&str> = sel.containers.iter().map(String::as_str).collect();
            if got != want {
                problems.push(format!(
                    "{at}: containers {got:?}, but the container(s) that read the metadata service are \
                     {want:?}: narrow the entry to them"
                ));
            }
            // What the agent would put on the allow set for this pod: the cgroups of exactly the
            // metadata containers, not the pod's (which would cover every sidecar).
            let driver = CgroupDriver::Systemd;
            let allowed: BTreeSet<PathBuf> =
                allowed_cgroups(&policy, &pod, driver).into_iter().map(|(p, _)| p).collect();
            let expected: BTreeSet<PathBuf> = pod
                .containers
                .iter()
                .filter(|x| want.contains(x.name.as_str()))
                .filter_map(|x| pod.container_cgroup(driver, x))
                .collect();
            if allowed != expected {
                problems.push(format!("{at}: allows {allowed:?}, expected only {expected:?}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "allow entries and their components disagree:\n  {}",
        problems.join("\n  ")
    );
}

/// No fixture is stale: each is the component of some shipped entry.
#[test]
fn every_fixture_is_selected_by_a_shipped_entry() {
    let names: BTreeSet<String> = all_files()
        .iter()
        .flat_map(|f| check(f).unwrap_or_else(|e| panic!("{e}")).allow)
        .map(|a| a.name)
        .collect();
    let stale: Vec<String> =
        fixtures().into_iter().map(|c| c.id).filter(|id| !names.contains(id)).collect();
    assert!(stale.is_empty(), "components no shipped allow entry selects: {stale:?}");
}

/// The pinning catches a wrong label, a missing hostNetwork and a container narrowing that
/// names a sidecar.
#[test]
fn a_wrong_entry_is_caught() {
    let components = fixtures();
    let c = components.iter().find(|c| c.id == "aws-ebs-csi-driver-node").expect("fixture");
    let pod = pod_of(c);
    let entry = |extra: &str| {
        let text = format!(
            "platform: AWS\nendpoints: [{{name: imds, cidr: 169.254.169.254/32}}]\nallow:\n  - \
             {{name: aws-ebs-csi-driver-node, namespace: openshift-cluster-csi-drivers, {extra}}}\n"
        );
        let p = Policy::parse("t.yaml", &text).expect("valid");
        let AllowSelector::Pods(sel) = &p.allow[0].selector else { panic!() };
        (p.clone(), sel.clone())
    };
    let (_, good) = entry(
        "hostNetwork: true, podSelector: {matchLabels: {app: aws-ebs-csi-driver-node}}, containers: [csi-driver]",
    );
    assert!(selects(&good, &pod));
    let (_, wrong_label) =
        entry("hostNetwork: true, podSelector: {matchLabels: {app: aws-ebs-csi-driver}}");
    assert!(!selects(&wrong_label, &pod));
    let (_, pod_network) =
        entry("hostNetwork: false, podSelector: {matchLabels: {app: aws-ebs-csi-driver-node}}");
    assert!(!selects(&pod_network, &pod));
    let (p, sidecar) = entry(
        "hostNetwork: true, podSelector: {matchLabels: {app: aws-ebs-csi-driver-node}}, containers: [csi-liveness-probe]",
    );
    assert!(selects(&sidecar, &pod), "containers narrows, it does not unselect");
    let allowed = allowed_cgroups(&p, &pod, CgroupDriver::Systemd);
    let probe = pod.containers.iter().find(|x| x.name == "csi-liveness-probe").expect("probe");
    assert_eq!(allowed.len(), 1);
    assert_eq!(Some(&allowed[0].0), pod.container_cgroup(CgroupDriver::Systemd, probe).as_ref());
}

/// The shipped policies pass their own `gate-agent check`: no neighbour protected, no part of
/// a metadata service left open, no namespace allowed wholesale. The profiles' only warning is
/// their audit mode (they ship in audit on purpose: deploy/profiles/*/).
#[test]
fn shipped_policies_pass_check_without_warnings() {
    let mut problems = Vec::new();
    for f in all_files() {
        let c = gate_agent::policy::check::check_file(&f, None).unwrap_or_else(|e| panic!("{e}"));
        let in_profile = f.starts_with(profiles_dir());
        for w in c.warnings {
            if in_profile && w.field == "mode" {
                continue;
            }
            problems.push(w.to_string());
        }
        if in_profile {
            assert_eq!(c.policy.mode, Mode::Audit, "{}: profiles ship in audit mode", f.display());
        }
    }
    assert!(problems.is_empty(), "warnings on shipped policies:\n  {}", problems.join("\n  "));
}
