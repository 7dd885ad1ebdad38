//! From the document as written ([`schema`](super::schema)) to a valid [`Policy`], or the first
//! error with its field path and reason. The document and its top-level fields here; the
//! endpoints and the allow entries in modules of their own.
use std::collections::HashMap;

use gate_common::abi::MAX_ENDPOINTS;

mod access;
mod allow;
mod endpoints;

use allow::allow_entry;
use endpoints::endpoint;

use super::schema::RawPolicy;
use super::{Mode, PLATFORMS, Policy, PolicyError};

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
        .map(|(i, a)| allow_entry(&cx, &format!("allow[{i}]"), &platform, a, &mut names))
        .collect::<Result<Vec<_>>>()?;

    let served = match raw.served {
        None => None,
        Some(s) => {
            let raw = access::RawAccess {
                profile: s.profile,
                paths: s.paths,
                methods: s.methods,
                query_parameters: s.query_parameters,
            };
            Some(access::served_paths(&cx, "served", &platform, raw)?)
        }
    };

    Policy::new(source, platform, mode, endpoints, allow, served)
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
