//! `gate-agent check`: read a policy file (or a policy ConfigMap manifest), validate it, and
//! find what is valid but probably wrong for its platform. Errors are [`PolicyError`]s as
//! everywhere; the rest are [`Warning`]s, which name the field as errors do.
//!
//! The warnings hold the policy against [`PLATFORM_FACTS`](super::platforms::PLATFORM_FACTS):
//!
//! - it protects nothing: no endpoints (where the platform has a metadata service), or audit
//!   mode;
//! - it protects a neighbour of the metadata service that workloads need (a DNS resolver, an
//!   NTP server, the EKS Pod Identity agent);
//! - it leaves part of the platform's metadata service unprotected;
//! - an allow entry lets a whole namespace through (no labels, service account or
//!   containers), or does not require hostNetwork: true.
use std::fmt;
use std::path::Path;

use ipnet::IpNet;

use super::platforms::{self, PlatformFacts, Service};
use super::{AllowSelector, Endpoint, Mode, PLATFORMS, Policy, PolicyError};

/// Prefix of the policy ConfigMaps' names (`metadata-gate-policy-aws`).
const CONFIGMAP_PREFIX: &str = "metadata-gate-policy-";

/// Something valid that is probably not what the author meant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// The file name, or `FILE (configmap NS/NAME)`.
    pub source: String,
    /// Path of the field (`endpoints[1].ports`, `allow[0]`), as in errors.
    pub field: String,
    pub reason: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "warning: {}: {}: {}", self.source, self.field, self.reason)
    }
}

/// A valid policy and what `check` has to say about it.
#[derive(Debug)]
pub struct Checked {
    pub policy: Policy,
    /// The platform the policy was checked for (`--platform`, else the ConfigMap's name, else
    /// the policy's `platform`), as `--platform` spells it.
    pub platform: String,
    pub warnings: Vec<Warning>,
}

impl Checked {
    /// The policy and the findings as JSON (`gate-agent check --json`): the platform it was
    /// checked for, mode, endpoints, allow entry names, what the platform table knows about
    /// the platform (`metadata`, `keepOpen`: `{what, net, ports, protocols}`) and the warnings.
    pub fn to_json(&self) -> serde_json::Value {
        let facts = platforms::facts(&self.platform);
        let services = |list: &[Service]| {
            list.iter()
                .map(|s| {
                    serde_json::json!({
                        "what": s.what,
                        "net": s.net().to_string(),
                        "ports": s.ports,
                        "protocols": s.protocols.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
                    })
                })
                .collect::<Vec<_>>()
        };
        serde_json::json!({
            "source": self.policy.source,
            "platform": self.platform,
            "mode": self.policy.mode.name(),
            "endpoints": self.policy.endpoints.iter().map(|e| serde_json::json!({
                "name": e.name,
                "cidr": e.cidr.to_string(),
                "ports": e.ports,
                "protocols": e.protocols.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "allow": self.policy.allow.iter().map(|a| a.name.clone()).collect::<Vec<_>>(),
            "metadata": facts.map(|f| services(f.metadata)).unwrap_or_default(),
            "keepOpen": facts.map(|f| services(f.keep_open)).unwrap_or_default(),
            "warnings": self.warnings.iter().map(|w| serde_json::json!({
                "field": w.field, "reason": w.reason,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Read, validate and check one file: a policy document, or a ConfigMap manifest with the
/// policy under `data["policy.yaml"]` (as deploy/policies/ ships them). `platform` is
/// `--platform`.
pub fn check_file(path: &Path, platform: Option<&str>) -> Result<Checked, PolicyError> {
    let (policy, configmap_platform) = load(path)?;
    Ok(check(policy, platform, configmap_platform.as_deref()))
}

/// Check a valid policy for `platform` (else `configmap_platform`, else its own `platform`).
pub fn check(policy: Policy, platform: Option<&str>, configmap_platform: Option<&str>) -> Checked {
    let mut warnings = Vec::new();
    let mut warn = |field: &str, reason: String| {
        warnings.push(Warning { source: policy.source.clone(), field: field.to_owned(), reason });
    };
    let named = platform.or(configmap_platform).map(canonical);
    if let Some(named) = named.as_deref()
        && platforms::policy_platform(named) != policy.platform
    {
        let by = if platform.is_some() { "--platform" } else { "the ConfigMap's name" };
        warn(
            "platform",
            format!(
                "the policy says {}, but {by} names {named}: the agent on {named} reads this policy \
                 as its own",
                policy.platform
            ),
        );
    }
    let platform = named.unwrap_or_else(|| policy.platform.clone());
    let facts = platforms::facts(&platform);

    protects_nothing(&policy, &platform, facts, &mut warn);
    if let Some(facts) = facts {
        for (i, e) in policy.endpoints.iter().enumerate() {
            for k in facts.keep_open {
                if let Some((field, hint)) = covers(e, k, facts.metadata) {
                    warn(
                        &format!("endpoints[{i}].{field}"),
                        format!(
                            "protects {} ({}), which workloads need on {}; {hint}",
                            k.describe(),
                            k.what,
                            facts.name
                        ),
                    );
                }
            }
        }
        if !policy.endpoints.is_empty() {
            for m in facts.metadata {
                let missing = unprotected(&policy.endpoints, m);
                if !missing.is_empty() {
                    let ports = missing.iter().map(u16::to_string).collect::<Vec<_>>().join(", ");
                    warn(
                        "endpoints",
                        format!(
                            "{} ({}) is not protected on TCP port(s) {ports}: add an endpoint for it",
                            m.net().addr(),
                            m.what
                        ),
                    );
                }
            }
        }
    }
    for (i, a) in policy.allow.iter().enumerate() {
        let AllowSelector::Pods(p) = &a.selector else { continue };
        if p.match_labels.is_empty()
            && p.match_expressions.is_empty()
            && p.service_account.is_none()
            && p.containers.is_empty()
        {
            warn(
                &format!("allow[{i}]"),
                format!(
                    "lets every pod of namespace {}{} through: select the component with \
                     podSelector labels, serviceAccount or containers",
                    p.namespace,
                    if p.host_network == Some(true) { " on the host network" } else { "" }
                ),
            );
        }
        if p.host_network != Some(true) {
            warn(
                &format!("allow[{i}].hostNetwork"),
                "not `true`: in a cluster an allowed component reaches the metadata service from \
                 the node's network namespace; node-level enforcement refuses pod-network \
                 traffic to it whatever the entry says (with the default gate scope), so \
                 require hostNetwork: true"
                    .to_owned(),
            );
        }
    }
    Checked { policy, platform, warnings }
}

/// A platform name as the agent spells it: `aws` -> `AWS`, `external/oci` -> `External/oci`;
/// a name it does not know is kept as written.
fn canonical(name: &str) -> String {
    let (base, rest) = match name.split_once('/') {
        Some((b, r)) => (b, Some(r)),
        None => (name, None),
    };
    let Some(base) = PLATFORMS.iter().find(|p| p.eq_ignore_ascii_case(base)) else {
        return name.to_owned();
    };
    match rest {
        Some(r) => format!("{base}/{}", r.to_ascii_lowercase()),
        None => (*base).to_owned(),
    }
}

fn protects_nothing(
    policy: &Policy,
    platform: &str,
    facts: Option<&PlatformFacts>,
    warn: &mut impl FnMut(&str, String),
) {
    if policy.endpoints.is_empty() {
        match facts {
            Some(f) if f.no_metadata_service.is_some() => {}
            Some(f) => warn(
                "endpoints",
                format!(
                    "protects nothing, but {} has a metadata service: {}",
                    f.name,
                    f.metadata.iter().map(Service::describe).collect::<Vec<_>>().join("; ")
                ),
            ),
            None => warn(
                "endpoints",
                format!(
                    "protects nothing: no endpoints (platform {platform}; list the metadata \
                     service's addresses and ports, see docs/new-provider.md)"
                ),
            ),
        }
    }
    if policy.mode == Mode::Audit && !policy.endpoints.is_empty() {
        warn(
            "mode",
            "audit: nothing is refused, would-be denials are only logged; set mode: enforce once \
             the audit log shows no component that needs an allow entry"
                .to_owned(),
        );
    }
}

/// Whether endpoint `e` protects (some of) neighbour `k`, and if so which field to change and
/// how. `metadata` is the platform's metadata service.
fn covers(e: &Endpoint, k: &Service, metadata: &[Service]) -> Option<(&'static str, String)> {
    let knet = k.net();
    if !nets_overlap(e.cidr, knet) {
        return None;
    }
    let ports_meet =
        e.ports.is_empty() || k.ports.is_empty() || k.ports.iter().any(|p| e.ports.contains(p));
    let protos_meet = e.protocols.is_empty()
        || k.protocols.is_empty()
        || k.protocols.iter().any(|p| e.protocols.contains(p));
    if !(ports_meet && protos_meet) {
        return None;
    }
    if !metadata.iter().any(|m| nets_overlap(e.cidr, m.net())) {
        return Some(("cidr", "it is not the metadata service: remove the endpoint".into()));
    }
    if e.cidr.prefix_len() < knet.prefix_len() {
        return Some(("cidr", format!("protect exact addresses instead of {}", e.cidr)));
    }
    if e.ports.is_empty() {
        return Some(("ports", "list only the metadata service's ports (e.g. ports: [80])".into()));
    }
    if k.ports.iter().any(|p| e.ports.contains(p)) {
        return Some(("ports", "remove the neighbour's port from the list".into()));
    }
    Some(("protocols", "restrict the endpoint to the metadata service's protocol (TCP)".into()))
}

fn nets_overlap(a: IpNet, b: IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// The TCP ports of metadata service `m` that no endpoint protects.
fn unprotected(endpoints: &[Endpoint], m: &Service) -> Vec<u16> {
    let mnet = m.net();
    m.ports
        .iter()
        .copied()
        .filter(|port| {
            !endpoints.iter().any(|e| {
                e.cidr.contains(&mnet)
                    && (e.ports.is_empty() || e.ports.contains(port))
                    && (e.protocols.is_empty() || e.protocols.contains(&super::Protocol::Tcp))
            })
        })
        .collect()
}

/// A policy file, or a ConfigMap manifest holding one; with the platform the ConfigMap's name
/// implies (`metadata-gate-policy-external-oci` -> `External/oci`).
fn load(path: &Path) -> Result<(Policy, Option<String>), PolicyError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| PolicyError::new(&file, "(file)", format!("cannot read it: {e}")))?;
    let Some((name, namespace, policy_text)) = configmap(&text) else {
        return Policy::parse(&file, &text).map(|p| (p, None));
    };
    let source = format!("{file} (configmap {namespace}/{name})");
    let Some(policy_text) = policy_text else {
        return Err(PolicyError::new(
            source,
            "data[\"policy.yaml\"]",
            "missing or not a string: a policy ConfigMap holds the policy under data key \
             policy.yaml",
        ));
    };
    let policy = Policy::parse(&source, &policy_text)?;
    Ok((policy, platform_of_configmap(&name)))
}

/// `(name, namespace, data["policy.yaml"])` of a ConfigMap manifest; `None` for anything else.
fn configmap(text: &str) -> Option<(String, String, Option<String>)> {
    let v: serde_yaml::Value = serde_yaml::from_str(text).ok()?;
    let s = |v: &serde_yaml::Value, k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
    if s(&v, "kind").as_deref() != Some("ConfigMap") || s(&v, "apiVersion").as_deref() != Some("v1")
    {
        return None;
    }
    let meta = v.get("metadata");
    let name = meta.and_then(|m| s(m, "name")).unwrap_or_default();
    let namespace = meta.and_then(|m| s(m, "namespace")).unwrap_or_else(|| "default".into());
    let policy = v.get("data").and_then(|d| s(d, "policy.yaml"));
    Some((name, namespace, policy))
}

/// `metadata-gate-policy-aws` -> `AWS`, `metadata-gate-policy-external-oci` -> `External/oci`.
fn platform_of_configmap(name: &str) -> Option<String> {
    let suffix = name.strip_prefix(CONFIGMAP_PREFIX)?;
    if let Some(external) = suffix.strip_prefix("external-") {
        return Some(format!("External/{external}"));
    }
    PLATFORMS.iter().find(|p| p.eq_ignore_ascii_case(suffix)).map(|p| (*p).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(text: &str) -> Policy {
        Policy::parse("p.yaml", text).unwrap_or_else(|e| panic!("{e}"))
    }

    fn warnings(text: &str, platform: Option<&str>) -> Vec<(String, String)> {
        check(policy(text), platform, None)
            .warnings
            .into_iter()
            .map(|w| (w.field, w.reason))
            .collect()
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
        let w =
            warnings(&format!("{base}  - {{name: a, namespace: x, serviceAccount: sa}}\n"), None);
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
        assert!(
            c.warnings[0].reason.contains("the ConfigMap's name names Azure"),
            "{:?}",
            c.warnings
        );
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
            platform_of_configmap("metadata-gate-policy-external-oci").as_deref(),
            Some("External/oci")
        );
        assert_eq!(
            platform_of_configmap("metadata-gate-policy-alibabacloud").as_deref(),
            Some("AlibabaCloud")
        );
        assert_eq!(platform_of_configmap("metadata-gate-policy-nope"), None);
        assert_eq!(platform_of_configmap("other"), None);
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
}
