//! From the document as written ([`schema`](super::schema)) to a valid [`Policy`], or the first
//! error with its field path and reason.
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use gate_common::abi::MAX_ENDPOINTS;
use globset::GlobBuilder;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::schema::{RawAllow, RawEndpoint, RawLabelExpr, RawPodSelector, RawPolicy};
use super::{
    AllowEntry, AllowSelector, CgroupGlob, Endpoint, LabelExpr, LabelOperator, Mode, PLATFORMS,
    PodSelector, Policy, PolicyError, Protocol,
};

/// Field name for errors about the whole document.
const DOCUMENT: &str = "(document)";

/// Parse the YAML into the raw schema. Unknown fields and wrong types are reported with their
/// path (`endpoints[2].protocol`).
pub(super) fn deserialize(source: &str, text: &str) -> Result<RawPolicy> {
    // Syntax first, so that broken YAML is reported as such, at its line and column.
    serde_yaml::from_str::<serde::de::IgnoredAny>(text).map_err(|e| yaml_error(source, &e))?;
    // Then the shape: serde's messages for an empty or non-mapping document ("invalid type:
    // unit value") help nobody. (`Value` cannot hold every integer; if it fails, the typed
    // parse below reports the problem with its path.)
    if let Ok(value) = serde_yaml::from_str::<serde_yaml::Value>(text) {
        let kind = match value {
            serde_yaml::Value::Mapping(_) => None,
            serde_yaml::Value::Null => {
                return Err(PolicyError::new(
                    source,
                    DOCUMENT,
                    "the document is empty; a policy is a mapping with at least `platform` and \
                     `endpoints` (see docs/policy.md)",
                ));
            }
            serde_yaml::Value::Bool(_) => Some("a boolean"),
            serde_yaml::Value::Number(_) => Some("a number"),
            serde_yaml::Value::String(_) => Some("a string"),
            serde_yaml::Value::Sequence(_) => Some("a list"),
            serde_yaml::Value::Tagged(_) => Some("a tagged value"),
        };
        if let Some(kind) = kind {
            return Err(PolicyError::new(
                source,
                DOCUMENT,
                format!(
                    "expected a mapping of policy fields (platform, mode, endpoints, allow), \
                     found {kind}"
                ),
            ));
        }
    }

    let de = serde_yaml::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            PolicyError::new(source, location(&inner), inner.to_string())
        } else {
            PolicyError::new(source, &path, with_hint(strip_path(&path, inner.to_string())))
        }
    })
}

/// serde_yaml prefixes its messages with its own idea of the path (`endpoints[2]: unknown
/// field ...`); the field is reported separately, so drop it.
fn strip_path(path: &str, msg: String) -> String {
    match msg.split_once(": ") {
        Some((prefix, rest)) if path.starts_with(prefix) => rest.to_owned(),
        _ => msg,
    }
}

fn location(e: &serde_yaml::Error) -> String {
    match e.location() {
        Some(l) => format!("line {} column {}", l.line(), l.column()),
        None => DOCUMENT.to_owned(),
    }
}

fn yaml_error(source: &str, e: &serde_yaml::Error) -> PolicyError {
    PolicyError::new(source, location(e), format!("not valid YAML: {e}"))
}

/// For "unknown field `x`, expected one of `a`, `b`": add "did you mean `a`?" when `x` is a
/// near miss (singular/plural, case, `_`/`-` instead of camelCase).
fn with_hint(msg: String) -> String {
    let Some(rest) = msg.strip_prefix("unknown field `") else { return msg };
    let Some((unknown, rest)) = rest.split_once('`') else { return msg };
    let norm = |s: &str| s.replace(['_', '-'], "").to_lowercase();
    let candidates: Vec<&str> = rest.split('`').skip(1).step_by(2).collect();
    let close = candidates.iter().find(|c| {
        let (c, u) = (norm(c), norm(unknown));
        c == u || c == format!("{u}s") || u == format!("{c}s")
    });
    let Some(c) = close else { return msg };
    match msg.find(" at line ") {
        Some(at) => format!("{} (did you mean `{c}`?){}", &msg[..at], &msg[at..]),
        None => format!("{msg} (did you mean `{c}`?)"),
    }
}

type Result<T> = std::result::Result<T, PolicyError>;

struct Ctx<'a> {
    source: &'a str,
}

impl Ctx<'_> {
    fn err(&self, field: impl Into<String>, reason: impl Into<String>) -> PolicyError {
        PolicyError::new(self.source, field, reason)
    }

    /// A required, non-empty, unique name.
    fn name(
        &self,
        field: &str,
        kind: &str,
        name: Option<String>,
        seen: &mut HashMap<String, String>,
    ) -> Result<String> {
        let Some(name) = name else {
            return Err(self.err(field, format!("missing; every {kind} needs a unique name")));
        };
        if name.trim().is_empty() {
            return Err(self.err(field, format!("is empty; every {kind} needs a unique name")));
        }
        if let Some(first) = seen.get(&name) {
            return Err(self.err(field, format!("duplicate {kind} name {name:?} (also {first})")));
        }
        seen.insert(name.clone(), field.trim_end_matches(".name").to_owned());
        Ok(name)
    }
}

/// Check everything and build the policy.
pub(super) fn validate(source: &str, raw: RawPolicy) -> Result<Policy> {
    let cx = Ctx { source };
    let platform = platform(&cx, raw.platform)?;
    let mode = mode(&cx, raw.mode)?;

    if raw.endpoints.len() > MAX_ENDPOINTS as usize {
        return Err(cx.err(
            "endpoints",
            format!("{} endpoints, at most {MAX_ENDPOINTS} fit", raw.endpoints.len()),
        ));
    }
    if raw.endpoints.is_empty() && mode != Mode::Audit && !raw.allow_no_endpoints {
        return Err(cx.err(
            "endpoints",
            "no endpoints: the policy would protect nothing. List the endpoints to protect; for a \
             platform without a metadata service (docs/platforms.md) set \
             `allowNoEndpoints: true` or `mode: audit`",
        ));
    }
    let mut names = HashMap::new();
    let endpoints = raw
        .endpoints
        .into_iter()
        .enumerate()
        .map(|(i, e)| endpoint(&cx, &format!("endpoints[{i}]"), e, &mut names))
        .collect::<Result<Vec<_>>>()?;

    let mut names = HashMap::new();
    let allow = raw
        .allow
        .into_iter()
        .enumerate()
        .map(|(i, a)| allow_entry(&cx, &format!("allow[{i}]"), a, &mut names))
        .collect::<Result<Vec<_>>>()?;

    Policy::new(source, platform, mode, endpoints, allow)
}

fn platform(cx: &Ctx, platform: Option<String>) -> Result<String> {
    let valid = PLATFORMS.join(", ");
    let Some(p) = platform else {
        return Err(cx.err("platform", format!("missing; one of: {valid}")));
    };
    if PLATFORMS.contains(&p.as_str()) {
        return Ok(p);
    }
    let hint = PLATFORMS
        .iter()
        .find(|v| v.eq_ignore_ascii_case(&p))
        .map(|v| format!("did you mean {v}? "))
        .unwrap_or_default();
    Err(cx.err("platform", format!("unknown platform {p:?}; {hint}valid values: {valid}")))
}

fn mode(cx: &Ctx, mode: Option<String>) -> Result<Mode> {
    match mode.as_deref() {
        None | Some("enforce") => Ok(Mode::Enforce),
        Some("audit") => Ok(Mode::Audit),
        Some(m) => Err(cx.err("mode", format!("unknown mode {m:?}; expected enforce or audit"))),
    }
}

// ---- endpoints -----------------------------------------------------------------------------

/// OVN-Kubernetes masquerade subnets: node networking breaks if these are blocked. The
/// current defaults are 169.254.0.0/17 and fd69::/112; clusters installed before OpenShift 4.14
/// keep the old 169.254.169.0/29 (169.254.169.1-.5; docs/policy.md) and fd69::/125, which the
/// /112 contains.
fn masquerade_nets() -> [IpNet; 3] {
    [
        IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(169, 254, 0, 0), 17)),
        IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(169, 254, 169, 0), 29)),
        IpNet::V6(Ipv6Net::new_assert(Ipv6Addr::new(0xfd69, 0, 0, 0, 0, 0, 0, 0), 112)),
    ]
}

fn overlaps(a: IpNet, b: IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// The masquerade subnet `net` overlaps, also through the IPv4-mapped IPv6 form.
fn masquerade_overlap(net: IpNet) -> Option<IpNet> {
    masquerade_nets().into_iter().find(|m| {
        overlaps(net, *m)
            || match (net, m) {
                (IpNet::V6(_), IpNet::V4(m4)) => {
                    let mapped = Ipv6Net::new(m4.network().to_ipv6_mapped(), 96 + m4.prefix_len());
                    mapped.is_ok_and(|mapped| overlaps(net, IpNet::V6(mapped)))
                }
                _ => false,
            }
    })
}

fn endpoint(
    cx: &Ctx,
    at: &str,
    raw: RawEndpoint,
    names: &mut HashMap<String, String>,
) -> Result<Endpoint> {
    let name = cx.name(&format!("{at}.name"), "endpoint", raw.name, names)?;
    let cidr = cidr(cx, &format!("{at}.cidr"), raw.cidr)?;

    let mut ports = Vec::new();
    if let Some(raw_ports) = raw.ports {
        if raw_ports.is_empty() {
            return Err(cx.err(
                format!("{at}.ports"),
                "an empty list would match no port; omit the field to mean all ports",
            ));
        }
        let mut seen = BTreeMap::new();
        for (j, p) in raw_ports.into_iter().enumerate() {
            let field = format!("{at}.ports[{j}]");
            let port = match u16::try_from(p.0) {
                Ok(port) if port != 0 => port,
                _ => return Err(cx.err(field, format!("port {} is outside 1-65535", p.0))),
            };
            if let Some(first) = seen.insert(port, j) {
                return Err(cx.err(field, format!("duplicate port {port} (also ports[{first}])")));
            }
            ports.push(port);
        }
    }

    let mut protocols = Vec::new();
    if let Some(raw_protocols) = raw.protocols {
        if raw_protocols.is_empty() {
            return Err(cx.err(
                format!("{at}.protocols"),
                "an empty list would match no protocol; omit the field to mean all protocols",
            ));
        }
        for (j, p) in raw_protocols.iter().enumerate() {
            let field = format!("{at}.protocols[{j}]");
            let proto = match p.as_str() {
                "TCP" => Protocol::Tcp,
                "UDP" => Protocol::Udp,
                other if other.eq_ignore_ascii_case("tcp") || other.eq_ignore_ascii_case("udp") => {
                    return Err(cx.err(
                        field,
                        format!(
                            "unknown protocol {other:?}; write {} (upper case)",
                            other.to_ascii_uppercase()
                        ),
                    ));
                }
                other => {
                    return Err(cx.err(
                        field,
                        format!(
                            "unknown protocol {other:?}; expected TCP or UDP (omit `protocols` to \
                             protect every protocol)"
                        ),
                    ));
                }
            };
            if let Some(first) = protocols.iter().position(|&q| q == proto) {
                return Err(
                    cx.err(field, format!("duplicate protocol {proto} (also protocols[{first}])"))
                );
            }
            protocols.push(proto);
        }
    }

    Ok(Endpoint { name, cidr, ports, protocols })
}

fn cidr(cx: &Ctx, field: &str, raw: Option<String>) -> Result<IpNet> {
    let Some(s) = raw else {
        return Err(cx.err(field, "missing; e.g. 169.254.169.254/32"));
    };
    let net: IpNet = match s.parse() {
        Ok(net) => net,
        Err(e) => {
            let reason = match s.parse::<IpAddr>() {
                Ok(a) => format!(
                    "{s:?} has no prefix length; write {a}/{} for the single address",
                    if a.is_ipv4() { 32 } else { 128 }
                ),
                Err(_) => format!(
                    "{s:?} is not a CIDR ({e}); expected address/prefix-length, e.g. \
                     169.254.169.254/32 or fd00:ec2::254/128"
                ),
            };
            return Err(cx.err(field, reason));
        }
    };
    if net != net.trunc() {
        return Err(cx.err(
            field,
            format!(
                "{net} has host bits set: did you mean the network {}? (or {}/{} for the single \
                 address)",
                net.trunc(),
                net.addr(),
                net.max_prefix_len()
            ),
        ));
    }
    if let Some(m) = masquerade_overlap(net) {
        return Err(cx.err(
            field,
            format!(
                "{net} overlaps the OVN-Kubernetes masquerade subnet {m}: blocking it would break \
                 node networking; protect exact /32 or /128 addresses instead"
            ),
        ));
    }
    Ok(net)
}

// ---- allow ---------------------------------------------------------------------------------

fn allow_entry(
    cx: &Ctx,
    at: &str,
    raw: RawAllow,
    names: &mut HashMap<String, String>,
) -> Result<AllowEntry> {
    let name = cx.name(&format!("{at}.name"), "allow entry", raw.name, names)?;

    // Fields that only narrow a namespace (cluster mode) entry, in document order.
    let pod_fields: Vec<&str> = [
        ("podSelector", raw.pod_selector.is_some()),
        ("serviceAccount", raw.service_account.is_some()),
        ("containers", raw.containers.is_some()),
        ("hostNetwork", raw.host_network.is_some()),
    ]
    .into_iter()
    .filter_map(|(f, set)| set.then_some(f))
    .collect();

    let selector = match (raw.cgroup, raw.namespace) {
        (Some(_), Some(_)) => {
            return Err(cx.err(
                at,
                "has both `cgroup` (standalone mode) and `namespace` (cluster mode); an entry \
                 selects either cgroups or pods, split it into two entries",
            ));
        }
        (Some(glob), None) => {
            if let Some(f) = pod_fields.first() {
                return Err(cx.err(
                    format!("{at}.{f}"),
                    format!(
                        "`{f}` narrows a `namespace` (cluster mode) entry and cannot be combined \
                         with `cgroup`"
                    ),
                ));
            }
            AllowSelector::Cgroup(cgroup_glob(cx, &format!("{at}.cgroup"), glob)?)
        }
        (None, Some(namespace)) => {
            let narrowing = RawPods {
                pod_selector: raw.pod_selector,
                service_account: raw.service_account,
                containers: raw.containers,
                host_network: raw.host_network,
            };
            AllowSelector::Pods(pods(cx, at, namespace, narrowing)?)
        }
        (None, None) => {
            return Err(match pod_fields.first() {
                Some(f) => cx.err(
                    format!("{at}.{f}"),
                    format!("`{f}` only applies together with `namespace` (cluster mode); add `namespace`"),
                ),
                None => cx.err(
                    at,
                    "selects nothing: set `cgroup` (standalone mode: a cgroup path glob under \
                     --cgroup-root) or `namespace` (cluster mode)",
                ),
            });
        }
    };
    Ok(AllowEntry { name, selector })
}

/// The narrowing fields of a `namespace` entry.
struct RawPods {
    pod_selector: Option<RawPodSelector>,
    service_account: Option<String>,
    containers: Option<Vec<String>>,
    host_network: Option<bool>,
}

fn cgroup_glob(cx: &Ctx, field: &str, glob: String) -> Result<CgroupGlob> {
    if glob.is_empty() {
        return Err(cx.err(
            field,
            "empty cgroup glob; write a path relative to --cgroup-root, e.g. \"tools/*\"",
        ));
    }
    if glob.starts_with('/') {
        return Err(cx.err(
            field,
            format!(
                "{glob:?} is absolute; cgroup globs are relative to --cgroup-root, e.g. {:?}",
                glob.trim_start_matches('/')
            ),
        ));
    }
    for comp in glob.split('/') {
        let reason = match comp {
            ".." => {
                "contains a `..` component; cgroup globs select cgroups below --cgroup-root only"
            }
            "." => "contains a `.` component; write the path without it",
            "" => "contains an empty path component (`//` or a trailing `/`)",
            _ => continue,
        };
        return Err(cx.err(field, format!("{glob:?} {reason}")));
    }
    let compiled = GlobBuilder::new(&glob)
        .literal_separator(true)
        .build()
        .map_err(|e| cx.err(field, format!("{glob:?} is not a valid glob: {}", e.kind())))?;
    let literal = !glob.contains(['*', '?', '[', ']', '{', '}', '\\']);
    let matcher = (!literal).then(|| compiled.compile_matcher());
    Ok(CgroupGlob::new(glob, matcher))
}

/// A Kubernetes object name that must be an RFC 1123 label (namespaces).
fn dns_label_problem(s: &str) -> Option<&'static str> {
    if s.is_empty() {
        Some("is empty")
    } else if s.len() > 63 {
        Some("is longer than 63 characters")
    } else if !s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') {
        Some("may contain only lower-case letters, digits and `-`")
    } else if s.starts_with('-') || s.ends_with('-') {
        Some("must start and end with a letter or digit")
    } else {
        None
    }
}

fn pods(cx: &Ctx, at: &str, namespace: String, raw: RawPods) -> Result<PodSelector> {
    if let Some(problem) = dns_label_problem(&namespace) {
        return Err(cx.err(format!("{at}.namespace"), format!("namespace {namespace:?} {problem}")));
    }

    let selector = raw.pod_selector.unwrap_or_default();
    if let Some(k) = selector.match_labels.keys().find(|k| k.is_empty()) {
        return Err(
            cx.err(format!("{at}.podSelector.matchLabels"), format!("label key {k:?} is empty"))
        );
    }
    let match_expressions = selector
        .match_expressions
        .into_iter()
        .enumerate()
        .map(|(j, x)| label_expr(cx, &format!("{at}.podSelector.matchExpressions[{j}]"), x))
        .collect::<Result<Vec<_>>>()?;

    if raw.service_account.as_deref() == Some("") {
        return Err(cx.err(
            format!("{at}.serviceAccount"),
            "is empty; omit the field to mean any service account",
        ));
    }

    let containers = match raw.containers {
        None => Vec::new(),
        Some(c) if c.is_empty() => {
            return Err(cx.err(
                format!("{at}.containers"),
                "an empty list would match no container; omit the field to mean all containers",
            ));
        }
        Some(c) => {
            for (j, name) in c.iter().enumerate() {
                let field = format!("{at}.containers[{j}]");
                if name.is_empty() {
                    return Err(cx.err(field, "container name is empty"));
                }
                if let Some(first) = c[..j].iter().position(|n| n == name) {
                    return Err(cx.err(
                        field,
                        format!("duplicate container {name:?} (also containers[{first}])"),
                    ));
                }
            }
            c
        }
    };

    Ok(PodSelector {
        namespace,
        match_labels: selector.match_labels,
        match_expressions,
        service_account: raw.service_account,
        containers,
        host_network: raw.host_network,
    })
}

fn label_expr(cx: &Ctx, at: &str, raw: RawLabelExpr) -> Result<LabelExpr> {
    let key = match raw.key {
        Some(k) if !k.is_empty() => k,
        Some(_) => return Err(cx.err(format!("{at}.key"), "is empty")),
        None => return Err(cx.err(format!("{at}.key"), "missing; the label key to test")),
    };
    const OPS: &str = "In, NotIn, Exists, DoesNotExist";
    let operator = match raw.operator.as_deref() {
        Some("In") => LabelOperator::In,
        Some("NotIn") => LabelOperator::NotIn,
        Some("Exists") => LabelOperator::Exists,
        Some("DoesNotExist") => LabelOperator::DoesNotExist,
        Some(op) => {
            return Err(
                cx.err(format!("{at}.operator"), format!("unknown operator {op:?}; one of {OPS}"))
            );
        }
        None => return Err(cx.err(format!("{at}.operator"), format!("missing; one of {OPS}"))),
    };
    let values = raw.values.unwrap_or_default();
    match operator {
        LabelOperator::In | LabelOperator::NotIn if values.is_empty() => {
            return Err(cx.err(
                format!("{at}.values"),
                format!("operator {} needs at least one value", operator.as_str()),
            ));
        }
        LabelOperator::Exists | LabelOperator::DoesNotExist if !values.is_empty() => {
            return Err(cx.err(
                format!("{at}.values"),
                format!("operator {} takes no values; remove `values`", operator.as_str()),
            ));
        }
        _ => {}
    }
    Ok(LabelExpr { key, operator, values })
}
