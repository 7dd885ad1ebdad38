//! `gate-agent check`: read a policy file (or a policy ConfigMap manifest), validate it, and
//! find what is valid but probably wrong for its platform. Errors are [`PolicyError`]s as
//! everywhere; the rest are [`Warning`]s, which name the field as errors do.
//!
//! The warnings hold the policy against its platform's row of [`Platform`]:
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

use super::platform::{self, Facts, Platform, Service};
use super::profiles;
use super::{AllowSelector, Endpoint, Mode, Policy, PolicyError};

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
        let facts = Platform::from_name(&self.platform).map(Platform::facts);
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
    let named = platform.or(configmap_platform).map(platform::canonical);
    if let Some(named) = named.as_deref()
        && platform::platform_type(named) != policy.platform
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
    let facts = Platform::from_name(&platform).map(Platform::facts);

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
                 the node's network namespace; node-level enforcement denies pod-network \
                 traffic to it whatever the entry says (with the default gate scope), so \
                 require hostNetwork: true"
                    .to_owned(),
            );
        }
    }
    let blocks = policy
        .allow
        .iter()
        .enumerate()
        .filter_map(|(i, a)| a.paths.as_ref().map(|p| (format!("allow[{i}]"), p)));
    let served = policy.served.as_ref().map(|p| ("served".to_owned(), p));
    for (at, p) in blocks.chain(served) {
        for rule in &p.access.paths {
            for s in profiles::reached(&platform, rule) {
                warn(
                    &format!("{at}.paths"),
                    format!(
                        "{rule} reaches {} ({}): list the exact paths the component needs \
                         (docs/platforms.md has the safe ones)",
                        s.path, s.reveals
                    ),
                );
            }
        }
    }
    Checked { policy, platform, warnings }
}

fn protects_nothing(
    policy: &Policy,
    platform: &str,
    facts: Option<&Facts>,
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
            "audit: nothing is denied, would-be denials are only logged; set mode: enforce once \
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
    Ok((policy, platform::name_of_configmap(&name)))
}

/// `(name, namespace, data["policy.yaml"])` of a ConfigMap manifest; `None` for anything else.
fn configmap(text: &str) -> Option<(String, String, Option<String>)> {
    let v: serde_json::Value =
        serde_saphyr::from_str_with_options(text, super::validate::yaml_options()).ok()?;
    let s = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
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

#[cfg(test)]
mod tests;
