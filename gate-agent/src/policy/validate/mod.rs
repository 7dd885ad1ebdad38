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
use super::{Mode, Policy, PolicyError, platform_types};

/// Field name for errors about the whole document.
const DOCUMENT: &str = "(document)";

/// Parse the YAML into the raw schema. Unknown fields and wrong types are reported with their
/// path (`endpoints[2].protocol`).
pub(super) fn deserialize(source: &str, text: &str) -> Result<RawPolicy> {
    // Syntax first, so that broken YAML is reported as such, at its line and column. The
    // parser's limits (nesting depth, alias expansion, size) reject a hostile text here.
    serde_saphyr::from_str_with_options::<serde::de::IgnoredAny>(text, yaml_options())
        .map_err(|e| yaml_error(source, &e))?;
    // Then the shape: serde's messages for an empty or non-mapping document ("invalid type:
    // unit value") help nobody. (A JSON value cannot hold every YAML mapping, e.g. one with
    // integer keys; if it fails, the typed parse below reports the problem with its path.)
    let value = serde_saphyr::from_str_with_options::<serde_json::Value>(text, yaml_options()).ok();
    if let Some(value) = &value {
        let kind = match value {
            serde_json::Value::Object(_) => None,
            serde_json::Value::Null => {
                return Err(PolicyError::new(
                    source,
                    DOCUMENT,
                    "the document is empty; a policy is a mapping with at least `platform` and \
                     `endpoints` (see docs/policy.md)",
                ));
            }
            serde_json::Value::Bool(_) => Some("a boolean"),
            serde_json::Value::Number(_) => Some("a number"),
            serde_json::Value::String(_) => Some("a string"),
            serde_json::Value::Array(_) => Some("a list"),
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

    // serde_path_to_error needs the deserializer itself, which the YAML crate lends only to a
    // closure; the path comes out beside the error.
    let mut path = None;
    serde_saphyr::with_deserializer_from_str_with_options(text, yaml_options(), |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = Some(e.path().clone());
            e.into_inner()
        })
    })
    .map_err(|inner| {
        let shown = path.as_ref().map(ToString::to_string).unwrap_or_default();
        if shown == "." || shown.is_empty() {
            PolicyError::new(source, location(&inner), message(&inner))
        } else {
            // The YAML crate says what it expected there; add what the document holds.
            let found = value.as_ref().zip(path.as_ref()).and_then(|(v, p)| found_at(v, p));
            let msg = match found {
                Some(found) if is_shape_error(&inner) => {
                    format!("{}, found {found}", message(&inner))
                }
                _ => message(&inner),
            };
            PolicyError::new(source, shown, with_hint(msg))
        }
    })
}

/// The parser's defaults, but for the source snippet (errors here are one line that names the
/// field, or line and column, and the reason) and YAML 1.2 as serde_yaml read it: only
/// `true`/`false` are booleans (`yes` is not), `<<` merges nothing, unknown tags are rejected.
/// The defaults keep the limits: 64 levels of nesting, 50 000 aliases and at most ten times
/// as many as anchors, 1 000 000 events replayed from aliases, 250 000 nodes, duplicate keys
/// rejected.
pub(super) fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        with_snippet: false,
        strict_booleans: true,
        merge_keys: serde_saphyr::MergeKeyPolicy::Error,
        reject_unsupported_tags: true,
    }
}

/// The YAML crate's message for users (its default one names its own API), without the
/// location it appends (`at line 3, column 5`): the location, or the field path, is reported
/// as the field.
fn message(e: &serde_saphyr::Error) -> String {
    let msg = e.without_snippet().render_with_formatter(&serde_saphyr::UserMessageFormatter);
    let is_location = |tail: &str| {
        let mut words = tail.split(' ');
        words.next() == Some("line")
            && words.next().is_some_and(|n| n.trim_end_matches(',').parse::<u64>().is_ok())
            && words.next() == Some("column")
            && words.next().is_some_and(|n| n.parse::<u64>().is_ok())
            && words.next().is_none()
    };
    let msg = match msg.rfind(" at ") {
        Some(at) if is_location(&msg[at + 4..]) => msg[..at].to_owned(),
        _ => msg,
    };
    // Its words for YAML events, in the words of the policy reference.
    msg.replace("expected sequence start", "expected a list")
        .replace("expected mapping start", "expected a mapping")
        .replace("expected string scalar", "expected a string")
}

/// A value of the wrong shape or kind, whose message says what was expected but not what
/// was found.
fn is_shape_error(e: &serde_saphyr::Error) -> bool {
    matches!(
        e.without_snippet(),
        serde_saphyr::Error::Unexpected { .. } | serde_saphyr::Error::InvalidBooleanStrict { .. }
    )
}

/// What the document holds at `path`, in a few words: `the number 80`, `a list`.
fn found_at(doc: &serde_json::Value, path: &serde_path_to_error::Path) -> Option<String> {
    use serde_path_to_error::Segment;
    let mut v = doc;
    for seg in path {
        v = match seg {
            Segment::Seq { index } => v.get(*index)?,
            Segment::Map { key } => v.get(key)?,
            Segment::Enum { .. } | Segment::Unknown => return None,
        };
    }
    Some(match v {
        serde_json::Value::Null => "nothing (null)".to_owned(),
        serde_json::Value::Bool(b) => format!("the boolean {b}"),
        serde_json::Value::Number(n) => format!("the number {n}"),
        serde_json::Value::String(s) => format!("the string {s:?}"),
        serde_json::Value::Array(_) => "a list".to_owned(),
        serde_json::Value::Object(_) => "a mapping".to_owned(),
    })
}

fn location(e: &serde_saphyr::Error) -> String {
    match e.location() {
        Some(l) => format!("line {} column {}", l.line(), l.column()),
        None => DOCUMENT.to_owned(),
    }
}

fn yaml_error(source: &str, e: &serde_saphyr::Error) -> PolicyError {
    PolicyError::new(source, location(e), format!("not valid YAML: {}", message(e)))
}

/// For "unknown field `x`, expected one of `a`, `b`": add "did you mean `a`?" when `x` is a
/// near miss (singular/plural, case, `_`/`-` instead of camelCase).
fn with_hint(msg: String) -> String {
    let Some(rest) = msg.strip_prefix("unknown field `") else { return msg };
    let Some((unknown, rest)) = rest.split_once('`') else { return msg };
    let norm = |s: &str| s.replace(['_', '-'], "").to_lowercase();
    // "expected one of a, b, c" (the YAML crate) or "expected one of `a`, `b`" (serde).
    let list = rest.split_once("expected ").map_or("", |(_, l)| l);
    let list = list.strip_prefix("one of ").unwrap_or(list);
    let candidates: Vec<&str> = list
        .split([',', ' '])
        .map(|c| c.trim_matches('`'))
        .filter(|c| !c.is_empty() && *c != "or")
        .collect();
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
                rate: s.rate,
            };
            Some(access::served_paths(&cx, "served", &platform, raw)?)
        }
    };

    Policy::new(source, platform, mode, endpoints, allow, served)
}

fn platform(cx: &Ctx, platform: Option<String>) -> Result<String> {
    let types = platform_types();
    let valid = types.join(", ");
    let Some(p) = platform else {
        return Err(cx.err("platform", format!("missing; one of: {valid}")));
    };
    if types.contains(&p.as_str()) {
        return Ok(p);
    }
    let hint = types
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
