//! The decision on one request, without I/O: whether the proxy's policy is the kernel's,
//! whether the request's form passes ([`super::request`]), and whether the caller's access
//! block serves its method and target (`gate_common::http`'s judge).
use std::fmt;

use gate_common::http::Refusal;
use http::{request::Parts, uri::PathAndQuery};

use super::{
    Caller,
    request::{self, Refused},
    table::{Grant, NoGrant, Table},
};
use crate::policy::{Rate, SERVED_RATE};

/// What to do with a request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decision<'a> {
    /// 503: the proxy cannot decide under the kernel's policy now.
    Unavailable(Unavailable),
    /// 403.
    Refused { who: Who<'a>, why: Why },
    /// Forward `target` (origin form, exactly what was judged). `audited`: served because the
    /// policy is in audit mode, though it would refuse it for this reason. `rate`: at most so
    /// many per second for the caller's workload (`None`: no limit).
    Serve { who: Who<'a>, target: &'a PathAndQuery, audited: Option<Why>, rate: Option<Rate> },
}

/// Why the proxy cannot decide now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unavailable {
    NoTable,
    /// The kernel decided the connection under `caller`, decides under `live` now, and the
    /// proxy holds `table`: all three must agree, or the caller's entry index may name another
    /// entry in the proxy's policy than in the kernel's.
    Generation {
        caller: u32,
        live: Option<u32>,
        table: u32,
    },
}

impl Unavailable {
    /// The `reason` label of the request metric (verdict `unavailable`).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Unavailable::NoTable => "no_table",
            Unavailable::Generation { .. } => "generation",
        }
    }
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::NoTable => f.write_str("no policy loaded yet"),
            Unavailable::Generation { caller, live, table } => {
                let live = live.map_or_else(|| "unreadable".to_owned(), |g| g.to_string());
                write!(
                    f,
                    "policy changing (connection generation {caller}, kernel {live}, proxy {table})"
                )
            }
        }
    }
}

/// Whose access block decided: an allow entry's, `served`'s, or an index the policy does not
/// have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Who<'a> {
    Entry(&'a str),
    Served,
    Unknown(u32),
}

impl fmt::Display for Who<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Who::Entry(name) => write!(f, "entry {name}"),
            Who::Served => f.write_str("served"),
            Who::Unknown(i) => write!(f, "entry #{i}"),
        }
    }
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Why {
    Request(Refused),
    Judge(Refusal),
    /// The caller's entry (or `served`) lists no paths: nothing is served to it.
    NoPaths,
    /// The record names an entry the policy does not have.
    UnknownEntry,
}

impl Why {
    /// Whether audit mode serves a request refused for this reason: the path, method or
    /// parameters the policy would refuse, never a target that cannot be judged or an entry
    /// the policy does not have.
    pub(crate) fn auditable(&self) -> bool {
        matches!(
            self,
            Why::Judge(Refusal::Method | Refusal::Path | Refusal::Parameter(_)) | Why::NoPaths
        )
    }

    /// The `reason` label of the request metric.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Why::Request(r) => r.label(),
            Why::Judge(Refusal::Target(_)) => "target",
            Why::Judge(Refusal::Method) => "method",
            Why::Judge(Refusal::Path) => "path",
            Why::Judge(Refusal::Parameter(_)) => "parameter",
            Why::NoPaths => "no_paths",
            Why::UnknownEntry => "unknown_entry",
        }
    }
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::Request(r) => r.fmt(f),
            Why::Judge(r) => r.fmt(f),
            Why::NoPaths => f.write_str("no paths are served to it"),
            Why::UnknownEntry => f.write_str("its allow entry is not in the policy"),
        }
    }
}

/// Decide `head` (whose body is empty, or not) from `caller` under `table`, the kernel
/// deciding under generation `live`.
pub(crate) fn decide<'a>(
    caller: &Caller,
    table: Option<&'a Table>,
    live: Option<u32>,
    head: &'a Parts,
    body_empty: bool,
) -> Decision<'a> {
    let Some(table) = table else {
        return Decision::Unavailable(Unavailable::NoTable);
    };
    if caller.generation != table.generation() || live != Some(table.generation()) {
        return Decision::Unavailable(Unavailable::Generation {
            caller: caller.generation,
            live,
            table: table.generation(),
        });
    }
    let (who, grant) = match table.grant(caller.entry) {
        Ok(g @ Grant { who, .. }) if caller.entry.is_some() => (Who::Entry(who), Ok(g)),
        Ok(g) => (Who::Served, Ok(g)),
        Err(NoGrant::NoPaths { who }) if caller.entry.is_some() => {
            (Who::Entry(who), Err(Why::NoPaths))
        }
        Err(NoGrant::NoPaths { .. }) => (Who::Served, Err(Why::NoPaths)),
        Err(NoGrant::UnknownEntry(i)) => (Who::Unknown(i), Err(Why::UnknownEntry)),
    };
    let refused = |why| Decision::Refused { who, why };
    let target = match request::check(&head.method, &head.uri, head.version, &head.headers) {
        Ok(t) => t,
        Err(r) => return refused(Why::Request(r)),
    };
    if !body_empty {
        return refused(Why::Request(Refused::Body));
    }
    // Audit mode serves `served` callers without a block too: at `served`'s default rate.
    let rate = match &grant {
        Ok(g) => g.rate,
        Err(_) if caller.entry.is_none() => Some(SERVED_RATE),
        Err(_) => None,
    };
    let judged = grant
        .and_then(|g| g.access.judge(head.method.as_str(), target.as_str()).map_err(Why::Judge));
    match judged {
        Ok(()) => Decision::Serve { who, target, audited: None, rate },
        Err(why) if table.audit() && why.auditable() => {
            Decision::Serve { who, target, audited: Some(why), rate }
        }
        Err(why) => refused(why),
    }
}

/// How the proxy decides `method target` from a caller under `entry` (`None`: `served`) by
/// `table`, for `explain`: the verdict (`served`, `audited` or `refused`) and why, in words.
pub(crate) fn judge_request(
    table: &Table,
    entry: Option<u32>,
    method: &str,
    target: &str,
) -> (&'static str, String) {
    let head = match http::Request::builder().method(method).uri(target).body(()) {
        Ok(r) => r.into_parts().0,
        Err(e) => return ("refused", format!("the request cannot be read: {e}")),
    };
    let caller = Caller {
        cgroup_id: 0,
        workload: 0,
        generation: table.generation(),
        entry,
        endpoint: 0,
        dst: ([0, 0, 0, 0], 0).into(),
    };
    match decide(&caller, Some(table), Some(table.generation()), &head, true) {
        Decision::Serve { who, audited: None, .. } => ("served", format!("{who} lists it")),
        Decision::Serve { who, audited: Some(why), .. } => {
            ("audited", format!("audit mode serves it; {who} would refuse it: {why}"))
        }
        Decision::Refused { who, why } => ("refused", format!("{why} ({who})")),
        Decision::Unavailable(u) => ("refused", u.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;
    use crate::policy::Policy;

    const POLICY: &str = "platform: AWS
endpoints:
  - {name: imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}
allow:
  - {name: plain, cgroup: plain}
  - name: csi
    cgroup: csi
    paths: [/latest/meta-data/instance-id, /latest/meta-data/placement/]
";

    fn caller(generation: u32, entry: Option<u32>) -> Caller {
        let dst = "169.254.169.254:80".parse().expect("dst");
        Caller { cgroup_id: 9, workload: 9, generation, entry, endpoint: 0, dst }
    }

    fn head(method: &str, target: &str) -> Parts {
        Request::builder().method(method).uri(target).body(()).expect("request").into_parts().0
    }

    #[test]
    fn generations_must_agree() {
        let table = Table::new(&Policy::parse("t", POLICY).expect("policy"), 4);
        let h = head("GET", "/latest/meta-data/instance-id");
        let d =
            |c: u32, live: Option<u32>| decide(&caller(c, Some(1)), Some(&table), live, &h, true);
        assert!(matches!(d(4, Some(4)), Decision::Serve { .. }));
        for (c, live) in [(3, Some(4)), (4, Some(5)), (4, None), (5, Some(5))] {
            assert_eq!(
                d(c, live),
                Decision::Unavailable(Unavailable::Generation { caller: c, live, table: 4 })
            );
        }
        let none = decide(&caller(4, Some(1)), None, Some(4), &h, true);
        assert_eq!(none, Decision::Unavailable(Unavailable::NoTable));
    }

    #[test]
    fn who_and_why() {
        let table = Table::new(&Policy::parse("t", POLICY).expect("policy"), 1);
        let d = |entry, m, t, empty| {
            let h = head(m, t);
            match decide(&caller(1, entry), Some(&table), Some(1), &h, empty) {
                Decision::Serve { who, target, audited: None, .. } => {
                    Ok((who.to_string(), target.to_string()))
                }
                Decision::Serve { audited: Some(why), .. } => Err(("audited".into(), why.label())),
                Decision::Refused { who, why } => Err((who.to_string(), why.label())),
                Decision::Unavailable(u) => Err((u.to_string(), "unavailable")),
            }
        };
        let ok = |t: &str| Ok(("entry csi".to_owned(), t.to_owned()));
        assert_eq!(
            d(Some(1), "GET", "/latest/meta-data/placement/zone", true),
            ok("/latest/meta-data/placement/zone")
        );
        let no = |who: &str, why| Err((who.to_owned(), why));
        assert_eq!(
            d(Some(1), "GET", "/latest/meta-data/placementX", true),
            no("entry csi", "path")
        );
        assert_eq!(
            d(Some(1), "PUT", "/latest/meta-data/instance-id", true),
            no("entry csi", "method")
        );
        assert_eq!(
            d(Some(1), "GET", "/latest/meta-data/placement/%2e%2e/iam", true),
            no("entry csi", "target")
        );
        assert_eq!(
            d(Some(1), "GET", "/latest/meta-data/instance-id?x=1", true),
            no("entry csi", "parameter")
        );
        assert_eq!(
            d(Some(1), "GET", "http://evil/latest/meta-data/instance-id", true),
            no("entry csi", "form")
        );
        assert_eq!(
            d(Some(1), "GET", "/latest/meta-data/instance-id", false),
            no("entry csi", "framing")
        );
        assert_eq!(
            d(Some(0), "GET", "/latest/meta-data/instance-id", true),
            no("entry plain", "no_paths")
        );
        assert_eq!(d(None, "GET", "/latest/meta-data/instance-id", true), no("served", "no_paths"));
        assert_eq!(
            d(Some(2), "GET", "/latest/meta-data/instance-id", true),
            no("entry #2", "unknown_entry")
        );
    }

    #[test]
    fn explain_judges_a_request_as_the_proxy_does() {
        let table = Table::new(&Policy::parse("t", POLICY).expect("policy"), 4);
        let j = |entry, m, t| judge_request(&table, entry, m, t).0;
        assert_eq!(j(Some(1), "GET", "/latest/meta-data/instance-id"), "served");
        assert_eq!(j(Some(1), "GET", "/latest/meta-data/iam/info"), "refused");
        assert_eq!(j(Some(1), "GET", "/latest/meta-data/placement/../../iam"), "refused");
        assert_eq!(j(None, "GET", "/latest/meta-data/instance-id"), "refused");
        assert_eq!(j(Some(1), "G E T", "/"), "refused");
        let (_, why) = judge_request(&table, Some(1), "GET", "/latest/meta-data/iam/info");
        assert_eq!(why, "path not allowed (entry csi)");
    }

    #[test]
    fn audit_mode_serves_what_the_policy_would_refuse_and_says_why() {
        let audit = format!("mode: audit\n{POLICY}");
        let table = Table::new(&Policy::parse("t", &audit).expect("policy"), 1);
        let d = |entry, m, t| {
            let h = head(m, t);
            match decide(&caller(1, entry), Some(&table), Some(1), &h, true) {
                Decision::Serve { audited, .. } => Ok(audited.map(|w| w.label())),
                Decision::Refused { why, .. } => Err(why.label()),
                Decision::Unavailable(_) => Err("unavailable"),
            }
        };
        assert_eq!(d(Some(1), "GET", "/latest/meta-data/instance-id"), Ok(None));
        assert_eq!(d(Some(1), "GET", "/latest/meta-data/iam/"), Ok(Some("path")));
        assert_eq!(d(Some(1), "PUT", "/latest/api/token"), Ok(Some("method")));
        assert_eq!(d(Some(1), "GET", "/latest/meta-data/instance-id?x=1"), Ok(Some("parameter")));
        assert_eq!(d(Some(0), "GET", "/latest/user-data"), Ok(Some("no_paths")));
        assert_eq!(d(None, "GET", "/latest/user-data"), Ok(Some("no_paths")));
        // What cannot be judged is refused in audit mode too.
        assert_eq!(d(Some(1), "GET", "/latest/meta-data/placement/%2e%2e/iam"), Err("target"));
        assert_eq!(d(Some(1), "GET", "http://evil/latest/meta-data/instance-id"), Err("form"));
        assert_eq!(d(Some(2), "GET", "/latest/meta-data/instance-id"), Err("unknown_entry"));
    }
}
