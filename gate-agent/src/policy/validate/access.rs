//! Served paths: `paths`, `methods`, `queryParameters` and `profile`, of an allow entry or of
//! `served`.
use gate_common::http::{Access, Methods, PathRule, is_parameter_name};

use super::{Ctx, Result};
use crate::policy::{Rate, ServedPaths, profiles, schema::RawRate};

/// The most a `rate` may say: past it, the rate protects nothing.
const MAX_PER_SECOND: f64 = 1000.0;
const MAX_BURST: i64 = 1000;

/// The access fields as written, wherever they stand.
pub(super) struct RawAccess {
    pub profile: Option<String>,
    pub paths: Option<Vec<String>>,
    pub methods: Option<Vec<String>>,
    pub query_parameters: Option<Vec<String>>,
    pub rate: Option<RawRate>,
}

impl RawAccess {
    /// Whether any access field is set: the entry is then narrowed to served paths.
    pub(super) fn is_set(&self) -> bool {
        self.profile.is_some()
            || self.paths.is_some()
            || self.methods.is_some()
            || self.query_parameters.is_some()
            || self.rate.is_some()
    }
}

/// Validate the access fields at `at` (`allow[2]`, `served`) for a policy of `platform`.
pub(super) fn served_paths(
    cx: &Ctx,
    at: &str,
    platform: &str,
    raw: RawAccess,
) -> Result<ServedPaths> {
    let mut paths: Vec<PathRule> = Vec::new();
    let mut methods = Methods::NONE;
    let mut query: Vec<String> = Vec::new();

    if let Some(name) = &raw.profile {
        let field = format!("{at}.profile");
        let names = profiles::names();
        if !names.contains(&name.as_str()) {
            let known = names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ");
            return Err(
                cx.err(field, format!("unknown profile {name:?}; the profiles are {known}"))
            );
        }
        let Some(profile) = profiles::access(platform, name) else {
            return Err(cx.err(
                field,
                format!(
                    "there is no {name} profile for platform {platform}; list the paths \
                     (docs/platforms.md names the ones of each platform that has a profile)"
                ),
            ));
        };
        paths = profile.paths;
        methods = profile.methods;
        query = profile.query;
    }

    if let Some(list) = raw.paths {
        if list.is_empty() {
            return Err(cx.err(
                format!("{at}.paths"),
                "an empty list serves nothing; list paths, or remove the field",
            ));
        }
        for (i, p) in list.iter().enumerate() {
            let field = format!("{at}.paths[{i}]");
            let rule = PathRule::parse(p).map_err(|e| cx.err(&field, format!("{p:?}: {e}")))?;
            // The same rule in two spellings (`/a` and `=/a`) is listed twice too.
            let same = |q: &String| PathRule::parse(q).is_ok_and(|q| q == rule);
            if let Some(j) = list[..i].iter().position(same) {
                let also = if list[j] == *p {
                    format!("paths[{j}]")
                } else {
                    format!(
                        "paths[{j}], {:?}: = before a path without a trailing / is the path",
                        list[j]
                    )
                };
                return Err(cx.err(field, format!("{p:?} is listed twice (also {also})")));
            }
            if !paths.contains(&rule) {
                paths.push(rule);
            }
        }
    }
    if paths.is_empty() {
        return Err(cx.err(
            format!("{at}.paths"),
            "missing: `methods`, `queryParameters` and `rate` narrow the paths an entry is \
             served; list them in `paths`, or name `profile: safe`",
        ));
    }
    let rate = raw.rate.map(|r| rate(cx, &format!("{at}.rate"), r)).transpose()?;

    match raw.methods {
        None if raw.profile.is_none() => methods = Methods::READ,
        None => {}
        Some(list) => {
            if list.is_empty() {
                return Err(cx.err(
                    format!("{at}.methods"),
                    "an empty list allows no request; omit the field to mean GET and HEAD",
                ));
            }
            for (i, m) in list.iter().enumerate() {
                let field = format!("{at}.methods[{i}]");
                let Some(bit) = Methods::parse(m) else {
                    let known: Vec<&str> = Methods::NAMES.iter().map(|(n, _)| *n).collect();
                    return Err(cx.err(
                        field,
                        format!(
                            "method {m:?} is never served; one of {} (PUT: the token request \
                             of IMDSv2 and its kind)",
                            known.join(", ")
                        ),
                    ));
                };
                if list[..i].contains(m) {
                    return Err(cx.err(field, format!("{m:?} is listed twice")));
                }
                methods = methods.union(bit);
            }
        }
    }

    if let Some(list) = raw.query_parameters {
        for (i, q) in list.iter().enumerate() {
            let field = format!("{at}.queryParameters[{i}]");
            if !is_parameter_name(q) {
                return Err(cx.err(
                    field,
                    format!(
                        "{q:?} is not a query parameter name: letters, digits and - . _ ~ : , only"
                    ),
                ));
            }
            if list[..i].contains(q) {
                return Err(cx.err(field, format!("{q:?} is listed twice")));
            }
            if !query.contains(q) {
                query.push(q.clone());
            }
        }
    }

    Ok(ServedPaths { profile: raw.profile, access: Access { paths, methods, query }, rate })
}

/// `rate`: `perSecond` above 0 and at most [`MAX_PER_SECOND`] (thousandths count), `burst`
/// 1 to [`MAX_BURST`], by default `perSecond` rounded up.
fn rate(cx: &Ctx, at: &str, raw: RawRate) -> Result<Rate> {
    let field = format!("{at}.perSecond");
    let Some(per_second) = raw.per_second else {
        return Err(cx.err(field, "missing: how many requests per second a workload is served"));
    };
    if !(0.001..=MAX_PER_SECOND).contains(&per_second) {
        return Err(cx.err(
            field,
            format!(
                "{per_second} is outside 0.001-{MAX_PER_SECOND}: a workload is served at least \
                 one request in 1 000 s (to serve none, list no paths)"
            ),
        ));
    }
    let milli_per_second = (per_second * 1000.0).round() as u32;
    let burst = match raw.burst {
        None => per_second.ceil() as i64,
        Some(b) if (1..=MAX_BURST).contains(&b) => b,
        Some(b) => {
            return Err(cx.err(
                format!("{at}.burst"),
                format!("{b} is outside 1-{MAX_BURST}: the requests served at once, after a pause"),
            ));
        }
    };
    Ok(Rate { milli_per_second, burst: burst.max(1) as u32 })
}
