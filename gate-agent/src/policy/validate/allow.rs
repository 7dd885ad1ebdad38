//! Allow entries: a cgroup glob (standalone) or pods by namespace, labels, service account
//! and containers (cluster mode).
use std::collections::HashMap;

use globset::GlobBuilder;

use super::access::{RawAccess, served_paths};
use super::{Ctx, Result};
use gate_common::abi::GRANT_METADATA;

use crate::policy::{
    AllowEntry, AllowSelector, CgroupGlob, GRANTS, LabelExpr, LabelOperator, PodSelector,
    schema::{RawAllow, RawLabelExpr, RawPodSelector},
};

pub(super) fn allow_entry(
    cx: &Ctx,
    at: &str,
    platform: &str,
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
    let access = RawAccess {
        profile: raw.profile,
        paths: raw.paths,
        methods: raw.methods,
        query_parameters: raw.query_parameters,
        rate: raw.rate,
    };
    let paths = if access.is_set() { Some(served_paths(cx, at, platform, access)?) } else { None };
    let grants = grants(cx, &format!("{at}.grants"), raw.grants, paths.is_some())?;
    Ok(AllowEntry { name, selector, grants, paths })
}

/// `grants`: names from [`GRANTS`], at least one, each once; absent: `[metadata]`, or nothing
/// for an entry narrowed to paths (which cannot also have the whole metadata service).
fn grants(cx: &Ctx, at: &str, raw: Option<Vec<String>>, narrowed: bool) -> Result<u32> {
    let Some(list) = raw else { return Ok(if narrowed { 0 } else { GRANT_METADATA }) };
    if list.is_empty() {
        return Err(
            cx.err(at, "grants nothing; list `metadata`, `capture` or both, or remove the entry")
        );
    }
    let mut bits = 0;
    for (i, name) in list.iter().enumerate() {
        let Some(&(_, bit)) = GRANTS.iter().find(|(n, _)| n == name) else {
            let known: Vec<&str> = GRANTS.iter().map(|(n, _)| *n).collect();
            return Err(cx.err(
                format!("{at}[{i}]"),
                format!("unknown grant {name:?}; one of {}", known.join(", ")),
            ));
        };
        if bits & bit != 0 {
            return Err(cx.err(format!("{at}[{i}]"), format!("{name:?} is listed twice")));
        }
        if narrowed && bit == GRANT_METADATA {
            return Err(cx.err(
                format!("{at}[{i}]"),
                "`metadata` grants the whole metadata service and `paths` narrows it to some                  paths: keep one of them",
            ));
        }
        bits |= bit;
    }
    Ok(bits)
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
