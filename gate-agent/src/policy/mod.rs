//! The policy: which endpoints are protected and who may still reach them.
//!
//! A policy is a YAML document (a file in standalone mode, the ConfigMap key `policy.yaml` in a
//! cluster) with this schema (every field: docs/policy.md):
//!
//! ```yaml
//! platform: AWS
//! mode: enforce            # enforce (default) | audit
//! endpoints:
//!   - name: ec2-imds
//!     cidr: 169.254.169.254/32
//!     ports: [80]          # omitted = all ports
//!     protocols: [TCP]     # TCP | UDP; omitted = all
//! allow:
//!   - name: local-tool
//!     cgroup: "tools/*"    # standalone: cgroup path glob relative to --cgroup-root
//!   - name: ccm            # cluster: pods by namespace (+ labels, service account, containers)
//!     namespace: openshift-cloud-controller-manager
//!     podSelector: {matchLabels: {k8s-app: aws-cloud-controller-manager}}
//! ```
//!
//! [`Policy::parse`] reads and validates a document in one go: a [`Policy`] value is always a
//! valid policy, and every error is a [`PolicyError`] naming the document, the field path
//! (`endpoints[1].ports[0]`) and the reason.
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::Path;
use std::sync::Arc;

use gate_common::abi::{GRANT_CAPTURE, GRANT_METADATA, GRANT_PROXY, allow_value};
use gate_common::compile::{self, EndpointSpec, Image, Net};
use gate_common::http::Access;
use gate_common::user::PolicyHash;
use globset::GlobMatcher;
use ipnet::IpNet;
use kube::core::{Expression, Selector, SelectorExt as _};

pub mod check;
pub mod detect;
pub mod platform;
pub mod profiles;
mod protocol;
mod schema;
pub mod shipped;
mod validate;

pub use platform::{Platform, platform_types};
pub use protocol::Protocol;

#[cfg(test)]
mod tests;

/// What the gate does with a matching connection from a cgroup that is not allowed.
pub use gate_common::user::Mode;

pub use crate::ratelimit::Rate;

/// A protected endpoint: a CIDR, optionally narrowed to ports and protocols.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Unique, non-empty name (used in logs, events and metrics).
    pub name: String,
    /// The network, host bits clear.
    pub cidr: IpNet,
    /// Destination ports, policy order, no duplicates; empty = all ports.
    pub ports: Vec<u16>,
    /// Protocols, no duplicates; empty = all protocols.
    pub protocols: Vec<Protocol>,
}

/// A compiled cgroup path glob (standalone mode), relative to the gated cgroup root.
///
/// `*` and `?` do not cross `/`; `**` does. Compares (and hashes) by its pattern.
#[derive(Clone)]
pub struct CgroupGlob {
    pattern: String,
    /// `None` for a literal path (no glob metacharacters): compared as a path, no regex
    /// compiled, so ten thousand literal entries cost kilobytes, not megabytes.
    matcher: Option<GlobMatcher>,
}

impl CgroupGlob {
    pub(crate) fn new(pattern: String, matcher: Option<GlobMatcher>) -> Self {
        Self { pattern, matcher }
    }

    /// The pattern as written in the policy.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The literal path this glob stands for, if it has no metacharacters.
    pub fn literal(&self) -> Option<&Path> {
        self.matcher.is_none().then(|| Path::new(&self.pattern))
    }

    /// Whether a cgroup path relative to the gated root matches.
    pub fn is_match(&self, rel: impl AsRef<Path>) -> bool {
        match &self.matcher {
            Some(m) => m.is_match(rel),
            None => rel.as_ref() == Path::new(&self.pattern),
        }
    }
}

impl fmt::Debug for CgroupGlob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CgroupGlob").field(&self.pattern).finish()
    }
}

impl PartialEq for CgroupGlob {
    fn eq(&self, other: &Self) -> bool {
        self.pattern == other.pattern
    }
}

impl Eq for CgroupGlob {}

/// How an allow entry selects the workloads it lets through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowSelector {
    /// Standalone mode: cgroups whose path relative to the gated root matches the glob (and
    /// everything nested below them).
    Cgroup(CgroupGlob),
    /// Cluster mode: pods selected by namespace and optional narrowing.
    Pods(PodSelector),
}

/// Operator of a [`LabelExpr`], as in Kubernetes label selectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

impl LabelOperator {
    /// The spelling used in the policy document.
    pub fn as_str(self) -> &'static str {
        match self {
            LabelOperator::In => "In",
            LabelOperator::NotIn => "NotIn",
            LabelOperator::Exists => "Exists",
            LabelOperator::DoesNotExist => "DoesNotExist",
        }
    }
}

/// One `podSelector.matchExpressions` item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelExpr {
    pub key: String,
    pub operator: LabelOperator,
    /// Non-empty for `In`/`NotIn`, empty for `Exists`/`DoesNotExist`.
    pub values: Vec<String>,
}

impl LabelExpr {
    /// Whether a pod's labels satisfy this expression.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.expression().matches(labels)
    }

    /// The expression as kube's label selectors have it (same semantics as the API server's).
    fn expression(&self) -> Expression {
        let (key, values) = (self.key.clone(), self.values.iter().cloned().collect());
        match self.operator {
            LabelOperator::In => Expression::In(key, values),
            LabelOperator::NotIn => Expression::NotIn(key, values),
            LabelOperator::Exists => Expression::Exists(key),
            LabelOperator::DoesNotExist => Expression::DoesNotExist(key),
        }
    }
}

/// Cluster-mode selection of pods. Every set field must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSelector {
    /// The pod's namespace (required).
    pub namespace: String,
    /// `podSelector.matchLabels`; empty = any labels.
    pub match_labels: BTreeMap<String, String>,
    /// `podSelector.matchExpressions`; empty = no constraint.
    pub match_expressions: Vec<LabelExpr>,
    /// The pod's service account, if narrowed.
    pub service_account: Option<String>,
    /// Container names the entry is limited to; empty = all containers of the pod.
    pub containers: Vec<String>,
    /// Only pods with (`true`) or without (`false`) host networking, if set.
    pub host_network: Option<bool>,
}

impl PodSelector {
    /// Whether a pod's labels satisfy `matchLabels` and `matchExpressions`.
    pub fn matches_labels(&self, labels: &BTreeMap<String, String>) -> bool {
        let equal = self.match_labels.iter().map(|(k, v)| Expression::Equal(k.clone(), v.clone()));
        Selector::from_iter(equal.chain(self.match_expressions.iter().map(LabelExpr::expression)))
            .matches(labels)
    }
}

/// One `allow` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowEntry {
    /// Unique, non-empty name (used in logs).
    pub name: String,
    pub selector: AllowSelector,
    /// What the entry grants (`GRANT_*` bits): `grants: [metadata, capture]`, default
    /// `[metadata]`, or nothing where the entry lists `paths`.
    pub grants: u32,
    /// The paths its workloads may read through the metadata proxy, instead of the whole
    /// metadata service.
    pub paths: Option<ServedPaths>,
}

/// Paths served through the metadata proxy: those of an allow entry, or those of `served`
/// (every gated workload no entry selects).
///
/// Without the proxy (`run` without `--proxy-address`), a workload whose access is narrowed
/// to paths is denied the metadata service (fail closed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedPaths {
    /// `profile` as written: a platform's safe profile ([`profiles`]), already expanded into
    /// `access`.
    pub profile: Option<String>,
    /// Paths (the profile's and those listed), methods and query parameters.
    pub access: Access,
    /// `rate` as written: requests served per workload. Without it an allow entry's
    /// workloads are served as many as they ask, and `served`'s [`SERVED_RATE`].
    pub rate: Option<Rate>,
}

/// What `served` workloads get without a `rate`: one request per second, ten at once. The
/// services limit per node (Azure: 5 requests per second per VM; AWS: 1 024 packets per
/// second per interface, some 100 requests), so that every pod of a node together, not each,
/// must stay within them; a workload that reads its few values at start never waits.
pub const SERVED_RATE: Rate = Rate { milli_per_second: 1000, burst: 10 };

/// The grants an allow entry may list, by name.
pub const GRANTS: [(&str, u32); 2] = [("metadata", GRANT_METADATA), ("capture", GRANT_CAPTURE)];

/// A validated policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Where it was read from (file name or `configmap ns/name`); used in messages, not part of
    /// [`Policy::hash`].
    pub source: String,
    /// The OpenShift platform type the policy is for (one of [`platform_types`]).
    pub platform: String,
    pub mode: Mode,
    /// Protected endpoints; the index is the endpoint number the kernel reports.
    pub endpoints: Vec<Endpoint>,
    /// Allow entries; the index is the entry number on the allow set.
    pub allow: Vec<AllowEntry>,
    /// Paths served to every gated workload that no allow entry selects.
    pub served: Option<ServedPaths>,
    /// The endpoints compiled to table entries, once, when the policy was read: the loader
    /// and the connection terminator use this very image.
    image: Arc<Image>,
    /// Digest of everything above but `source` (see [`Policy::hash`]).
    hash: PolicyHash,
    /// The document as written (what a node keeps for its boot step).
    text: Arc<str>,
}

/// A policy that cannot be read or is not valid.
///
/// Displays as `{source}: {field}: {reason}`, e.g.
/// `aws.yaml: endpoints[1].ports[0]: port 0 is outside 1-65535`.
///
/// (Display and Error are written by hand: thiserror would take a field named `source` for the
/// underlying error.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// The file name or `configmap ns/name`.
    pub source: String,
    /// Path of the offending field (`endpoints[2].cidr`), `(document)` for the whole document,
    /// or `line L column C` for YAML syntax errors.
    pub field: String,
    /// What is wrong and, where it helps, what to write instead.
    pub reason: String,
}

impl PolicyError {
    pub(crate) fn new(
        source: impl Into<String>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Self { source: source.into(), field: field.into(), reason: reason.into() }
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.source, self.field, self.reason)
    }
}

impl std::error::Error for PolicyError {}

impl Policy {
    /// Parse and validate a policy document. `source` names it in errors (a file name or
    /// `configmap ns/name`).
    pub fn parse(source: &str, text: &str) -> Result<Policy, PolicyError> {
        let raw = validate::deserialize(source, text)?;
        let mut policy = validate::validate(source, raw)?;
        policy.text = text.into();
        Ok(policy)
    }

    /// The document as written.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// A policy from validated parts: compiles the endpoints (rule-count and table limits are
    /// reported now rather than when the policy is applied) and computes the hash.
    pub(crate) fn new(
        source: &str,
        platform: String,
        mode: Mode,
        endpoints: Vec<Endpoint>,
        allow: Vec<AllowEntry>,
        served: Option<ServedPaths>,
    ) -> Result<Policy, PolicyError> {
        let image = compile::compile(&endpoint_specs(&endpoints))
            .map_err(|e| PolicyError::new(source, "endpoints", e.to_string()))?;
        let mut policy = Policy {
            source: source.to_owned(),
            platform,
            mode,
            endpoints,
            allow,
            served,
            image: Arc::new(image),
            hash: PolicyHash::default(),
            text: Arc::from(""),
        };
        policy.hash = PolicyHash(fnv1a64(policy.canonical().as_bytes()));
        Ok(policy)
    }

    /// Read and validate a policy file; errors name the file as given.
    pub fn load(path: &Path) -> Result<Policy, PolicyError> {
        let source = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| PolicyError::new(&source, "(file)", format!("cannot read it: {e}")))?;
        Self::parse(&source, &text)
    }

    /// The endpoints in the form the table compiler takes, in policy order.
    pub fn endpoint_specs(&self) -> Vec<EndpointSpec> {
        endpoint_specs(&self.endpoints)
    }

    /// The compiled table entries, generation-free.
    pub fn image(&self) -> &Image {
        &self.image
    }

    /// Endpoint names in index order (what the kernel reports by index).
    pub fn endpoint_names(&self) -> Vec<String> {
        self.endpoints.iter().map(|e| e.name.clone()).collect()
    }

    /// The allow entries that select cgroups by glob (standalone mode), with their index.
    /// The ALLOWED value of allow entry `entry` (its index and grants); an index past the
    /// entries grants nothing.
    /// An entry narrowed to paths also grants the way through the metadata proxy.
    pub fn allow_value(&self, entry: usize) -> u32 {
        let grants = self
            .allow
            .get(entry)
            .map_or(0, |e| if e.paths.is_some() { e.grants | GRANT_PROXY } else { e.grants });
        allow_value(u32::try_from(entry).unwrap_or(u32::MAX), grants)
    }

    /// The access blocks that list paths (allow entries by name, `served`): served only
    /// through the metadata proxy; without it their workloads are denied the metadata
    /// service.
    pub fn paths_not_served(&self) -> Vec<String> {
        let entries = self.allow.iter().filter(|a| a.paths.is_some()).map(|a| a.name.clone());
        entries.chain(self.served.as_ref().map(|_| "served".to_owned())).collect()
    }

    /// Whether the connect programs send connects to the metadata proxy under this policy,
    /// where one is configured (`gate_common::verdict::proxy_route`): an allow entry with
    /// paths, `served`, or audit mode (which sends every HTTP connect there, to record its
    /// path). Without that the proxy's programs stay out of the kernel.
    pub fn needs_proxy(&self) -> bool {
        self.mode == Mode::Audit || !self.paths_not_served().is_empty()
    }

    pub fn cgroup_entries(&self) -> impl Iterator<Item = (usize, &AllowEntry)> {
        self.allow
            .iter()
            .enumerate()
            .filter(|(_, e)| matches!(e.selector, AllowSelector::Cgroup(_)))
    }

    /// Stable digest (FNV-1a 64) of the canonical form of the policy: equal policies hash
    /// equally across runs, builds and versions; any change of platform, mode, endpoint or
    /// allow entry changes it. The source name is not included.
    pub fn hash(&self) -> PolicyHash {
        self.hash
    }

    /// A deterministic text form of everything that affects enforcement. Strings are length
    /// prefixed, so no choice of names can make two different policies collide textually.
    fn canonical(&self) -> String {
        fn s(out: &mut String, v: &str) {
            let _ = write!(out, "{}:{v};", v.len());
        }
        let mut out = String::from("metadata-gate-policy/1;");
        s(&mut out, &self.platform);
        s(&mut out, self.mode.name());
        let _ = write!(out, "endpoints={};", self.endpoints.len());
        for e in &self.endpoints {
            s(&mut out, &e.name);
            let _ = write!(out, "{};ports={:?};protocols=", e.cidr, e.ports);
            for p in &e.protocols {
                let _ = write!(out, "{p},");
            }
            out.push(';');
        }
        // Paths only where there are any, so that the hashes of policies without them stay.
        fn paths(out: &mut String, p: &ServedPaths) {
            let _ = write!(out, "paths={};", p.access.paths.len());
            for r in &p.access.paths {
                s(out, r.as_str());
            }
            let _ =
                write!(out, "methods={};", p.access.methods.names().collect::<Vec<_>>().join(","));
            let _ = write!(out, "query={};", p.access.query.len());
            for q in &p.access.query {
                s(out, q);
            }
            if let Some(r) = &p.rate {
                let _ = write!(out, "rate={},{};", r.milli_per_second, r.burst);
            }
        }
        let _ = write!(out, "allow={};", self.allow.len());
        for a in &self.allow {
            s(&mut out, &a.name);
            // Only when not the default, so that the hashes of policies without `grants` stay.
            if a.grants != GRANT_METADATA {
                let _ = write!(out, "grants={};", a.grants);
            }
            if let Some(p) = &a.paths {
                paths(&mut out, p);
            }
            match &a.selector {
                AllowSelector::Cgroup(g) => {
                    out.push_str("cgroup;");
                    s(&mut out, g.pattern());
                }
                AllowSelector::Pods(p) => {
                    out.push_str("pods;");
                    s(&mut out, &p.namespace);
                    let _ = write!(out, "labels={};", p.match_labels.len());
                    for (k, v) in &p.match_labels {
                        s(&mut out, k);
                        s(&mut out, v);
                    }
                    let _ = write!(out, "exprs={};", p.match_expressions.len());
                    for x in &p.match_expressions {
                        s(&mut out, &x.key);
                        let _ = write!(out, "{};values={};", x.operator.as_str(), x.values.len());
                        for v in &x.values {
                            s(&mut out, v);
                        }
                    }
                    match &p.service_account {
                        Some(sa) => {
                            out.push_str("sa=");
                            s(&mut out, sa);
                        }
                        None => out.push_str("sa-;"),
                    }
                    let _ = write!(out, "containers={};", p.containers.len());
                    for c in &p.containers {
                        s(&mut out, c);
                    }
                    let _ = write!(out, "hostNetwork={:?};", p.host_network);
                }
            }
        }
        if let Some(p) = &self.served {
            out.push_str("served;");
            paths(&mut out, p);
        }
        out
    }
}

fn endpoint_specs(endpoints: &[Endpoint]) -> Vec<EndpointSpec> {
    endpoints
        .iter()
        .map(|e| EndpointSpec {
            net: net_of(e.cidr),
            ports: e.ports.clone(),
            protos: e.protocols.iter().map(|p| p.number()).collect(),
        })
        .collect()
}

/// The compiler's form of a CIDR.
fn net_of(cidr: IpNet) -> Net {
    match cidr {
        IpNet::V4(n) => Net::V4 { addr: n.addr().octets(), len: n.prefix_len() },
        IpNet::V6(n) => Net::V6 { addr: n.addr().octets(), len: n.prefix_len() },
    }
}

/// FNV-1a, 64 bit: tiny, and its output never changes (unlike `std`'s hashers).
fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}
