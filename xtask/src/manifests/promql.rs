//! Just enough PromQL to check an alerting rule against the metrics that exist: a lexer, and
//! a walk over its tokens that finds every series selector (metric name and label matchers),
//! every label named in `by`, `without`, `on`, `ignoring`, `group_left` and `group_right`,
//! and every function called. Not a full parser: it does not check operator placement or
//! argument types (Prometheus refuses those on load); it does refuse what would make its own
//! findings wrong: an unterminated string, unbalanced brackets, an unknown function, a
//! matcher that is not `label op "string"`.

/// One series selector: `name{label op "value", ...}` (the name may also come as a
/// `__name__` matcher).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Selector {
    pub metric: String,
    pub matchers: Vec<Matcher>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Matcher {
    pub label: String,
    /// `=`, `!=`, `=~` or `!~`.
    pub op: String,
    pub value: String,
}

/// What an expression refers to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Refs {
    pub selectors: Vec<Selector>,
    /// Labels of `by`, `without`, `on`, `ignoring`, `group_left`, `group_right`.
    pub grouping: Vec<String>,
    /// Labels of `by` alone.
    pub by: Vec<String>,
    /// Labels of `group_left` and `group_right`: copied from the other side of a join.
    pub joined: Vec<String>,
    pub functions: Vec<String>,
}

/// Functions and aggregation operators (Prometheus 2.x and 3.x).
const FUNCTIONS: &[&str] = &[
    // aggregation operators
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    // functions
    "abs",
    "absent",
    "absent_over_time",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "avg_over_time",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "cos",
    "cosh",
    "count_over_time",
    "day_of_month",
    "day_of_week",
    "day_of_year",
    "days_in_month",
    "deg",
    "delta",
    "deriv",
    "exp",
    "floor",
    "histogram_avg",
    "histogram_count",
    "histogram_fraction",
    "histogram_quantile",
    "histogram_stddev",
    "histogram_stdvar",
    "histogram_sum",
    "holt_winters",
    "hour",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "last_over_time",
    "ln",
    "log10",
    "log2",
    "mad_over_time",
    "max_over_time",
    "min_over_time",
    "minute",
    "month",
    "pi",
    "predict_linear",
    "present_over_time",
    "quantile_over_time",
    "rad",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sin",
    "sinh",
    "sort",
    "sort_desc",
    "sort_by_label",
    "sort_by_label_desc",
    "sqrt",
    "stddev_over_time",
    "stdvar_over_time",
    "sum_over_time",
    "tan",
    "tanh",
    "time",
    "timestamp",
    "vector",
    "year",
];

/// Keywords that take a parenthesised list of label names.
const GROUPING: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];
/// Binary keywords and modifiers that are neither metrics nor functions.
const KEYWORDS: &[&str] = &["and", "or", "unless", "bool", "offset", "start", "end"];

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    /// A number or a duration (`5m`, `1h30m`, `0.9`, `1e3`).
    Num,
    Punct(&'static str),
}

fn lex(expr: &str) -> Result<Vec<Tok>, String> {
    const PUNCT: &[&str] = &[
        "==", "!=", "=~", "!~", "<=", ">=", "(", ")", "{", "}", "[", "]", ",", "=", "<", ">", "+",
        "-", "*", "/", "%", "^", "@", ":",
    ];
    let b = expr.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i] as char;
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c == '#' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if matches!(c, '"' | '\'' | '`') {
            let mut s = String::new();
            i += 1;
            loop {
                let Some(&d) = b.get(i) else { return Err(format!("unterminated string {c}{s}")) };
                i += 1;
                match d as char {
                    d if d == c => break,
                    '\\' if c != '`' => {
                        let Some(&e) = b.get(i) else { return Err("unterminated string".into()) };
                        s.push(e as char);
                        i += 1;
                    }
                    d => s.push(d),
                }
            }
            toks.push(Tok::Str(s));
        } else if c.is_ascii_digit() || (c == '.' && b.get(i + 1).is_some_and(u8::is_ascii_digit)) {
            while i < b.len() {
                let d = b[i] as char;
                let exponent_sign = matches!(d, '+' | '-') && matches!(b[i - 1], b'e' | b'E');
                if d.is_ascii_alphanumeric() || d == '.' || d == '_' || exponent_sign {
                    i += 1;
                } else {
                    break;
                }
            }
            toks.push(Tok::Num);
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b':') {
                i += 1;
            }
            let word = &expr[start..i];
            if word.eq_ignore_ascii_case("inf") || word.eq_ignore_ascii_case("nan") {
                toks.push(Tok::Num);
            } else {
                toks.push(Tok::Ident(word.to_owned()));
            }
        } else if let Some(p) = PUNCT.iter().find(|p| expr[i..].starts_with(**p)) {
            toks.push(Tok::Punct(p));
            i += p.len();
        } else {
            return Err(format!("unexpected character {c:?}"));
        }
    }
    Ok(toks)
}

/// What `expr` refers to, or why it cannot be read.
pub(super) fn refs(expr: &str) -> Result<Refs, String> {
    let toks = lex(expr)?;
    let mut refs = Refs::default();
    // Brackets must balance; `[...]` holds a range or a subquery step and nothing else.
    let mut depth: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Punct(p @ ("(" | "[")) => depth.push(p),
            Tok::Punct(p @ (")" | "]")) => {
                let open = if *p == ")" { "(" } else { "[" };
                if depth.pop() != Some(open) {
                    return Err(format!("unbalanced {p:?}"));
                }
            }
            Tok::Punct("{") => {
                // A selector without a name: `{__name__="m", ...}`.
                let (matchers, next) = matchers(&toks, i)?;
                let name = matchers.iter().find(|m| m.label == "__name__" && m.op == "=");
                let Some(name) = name else {
                    return Err("a selector without a metric name".into());
                };
                refs.selectors.push(Selector { metric: name.value.clone(), matchers });
                i = next;
                continue;
            }
            Tok::Punct("}") => return Err("unbalanced \"}\"".into()),
            Tok::Ident(word) => {
                let next = toks.get(i + 1);
                let lower = word.to_ascii_lowercase();
                if GROUPING.contains(&lower.as_str()) {
                    if next == Some(&Tok::Punct("(")) {
                        let kind = lower.clone();
                        let mut j = i + 2;
                        loop {
                            match toks.get(j) {
                                Some(Tok::Ident(l) | Tok::Str(l)) => {
                                    refs.grouping.push(l.clone());
                                    match kind.as_str() {
                                        "by" => refs.by.push(l.clone()),
                                        "group_left" | "group_right" => refs.joined.push(l.clone()),
                                        _ => {}
                                    }
                                }
                                Some(Tok::Punct(",")) => {}
                                Some(Tok::Punct(")")) => break,
                                other => {
                                    return Err(format!("{word} (...): unexpected {other:?}"));
                                }
                            }
                            j += 1;
                        }
                        i = j + 1;
                        continue;
                    } else if !lower.starts_with("group_") {
                        return Err(format!("{word} needs a list of labels"));
                    }
                } else if KEYWORDS.contains(&lower.as_str()) {
                    // offset 5m, @ start(), and/or/unless, bool
                } else if FUNCTIONS.contains(&word.as_str())
                    && matches!(next, Some(Tok::Ident(k)) if k == "by" || k == "without")
                {
                    // sum by (l) (...)
                    refs.functions.push(word.clone());
                } else if next == Some(&Tok::Punct("(")) {
                    if !FUNCTIONS.contains(&word.as_str()) {
                        return Err(format!("unknown function {word}()"));
                    }
                    refs.functions.push(word.clone());
                } else if next == Some(&Tok::Punct("{")) {
                    let (matchers, after) = matchers(&toks, i + 1)?;
                    refs.selectors.push(Selector { metric: word.clone(), matchers });
                    i = after;
                    continue;
                } else {
                    refs.selectors.push(Selector { metric: word.clone(), matchers: Vec::new() });
                }
            }
            _ => {}
        }
        // Skip what a range or subquery holds: durations, `:`.
        if toks[i] == Tok::Punct("[") {
            let close = toks[i..].iter().position(|t| *t == Tok::Punct("]"));
            let Some(close) = close else { return Err("unbalanced \"[\"".into()) };
            depth.pop();
            i += close + 1;
            continue;
        }
        i += 1;
    }
    if let Some(open) = depth.pop() {
        return Err(format!("unbalanced {open:?}"));
    }
    Ok(refs)
}

/// The matchers of the `{...}` at `toks[open]`, and the index after its `}`.
fn matchers(toks: &[Tok], open: usize) -> Result<(Vec<Matcher>, usize), String> {
    let mut out = Vec::new();
    let mut i = open + 1;
    loop {
        match (toks.get(i), toks.get(i + 1), toks.get(i + 2)) {
            (Some(Tok::Punct("}")), _, _) => return Ok((out, i + 1)),
            (Some(Tok::Ident(l) | Tok::Str(l)), Some(Tok::Punct(op)), Some(Tok::Str(v)))
                if matches!(*op, "=" | "!=" | "=~" | "!~") =>
            {
                out.push(Matcher { label: l.clone(), op: (*op).to_owned(), value: v.clone() });
                i += 3;
                match toks.get(i) {
                    Some(Tok::Punct(",")) => i += 1,
                    Some(Tok::Punct("}")) => {}
                    other => return Err(format!("label matchers: unexpected {other:?}")),
                }
            }
            (other, _, _) => {
                return Err(format!("label matchers: expected label op \"value\", got {other:?}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(metric: &str, m: &[(&str, &str, &str)]) -> Selector {
        Selector {
            metric: metric.into(),
            matchers: m
                .iter()
                .map(|(l, o, v)| Matcher {
                    label: (*l).into(),
                    op: (*o).into(),
                    value: (*v).into(),
                })
                .collect(),
        }
    }

    #[test]
    fn selectors_groupings_and_functions() {
        let r = refs(
            "sum by (node, workload) (rate(metadata_gate_workload_denials_total{verdict!=\"x\"}[5m])) > 1e-3\n  \
             unless on (namespace, pod) group_left (node) kube_pod_info{namespace='a', created_by_name=~\"b.*\"} offset 1h\n\
             # a comment with words(and) {braces}\n\
             or max_over_time(up[10m:1m]) == bool 0 or {__name__=\"x_total\", job=\"j\"}",
        )
        .expect("readable");
        assert_eq!(
            r.selectors,
            vec![
                sel("metadata_gate_workload_denials_total", &[("verdict", "!=", "x")]),
                sel("kube_pod_info", &[("namespace", "=", "a"), ("created_by_name", "=~", "b.*")]),
                sel("up", &[]),
                sel("x_total", &[("__name__", "=", "x_total"), ("job", "=", "j")]),
            ]
        );
        assert_eq!(r.grouping, ["node", "workload", "namespace", "pod", "node"]);
        assert_eq!(r.by, ["node", "workload"]);
        assert_eq!(r.joined, ["node"]);
        assert_eq!(r.functions, ["sum", "rate", "max_over_time"]);
        let r = refs("count without (a) (x) > sum(y) by (b)").expect("readable");
        assert_eq!(r.functions, ["count", "sum"]);
        assert_eq!(r.grouping, ["a", "b"]);
        assert_eq!(r.selectors, vec![sel("x", &[]), sel("y", &[])]);
    }

    #[test]
    fn what_cannot_be_read_is_refused() {
        for (expr, why) in [
            ("rate(x[5m]", "unbalanced"),
            ("x{a=\"b\"", "label matchers"),
            ("x{a=b}", "label matchers"),
            ("increse(x[5m])", "unknown function increse()"),
            ("x{a=\"b}", "unterminated string"),
            ("sum by x", "needs a list of labels"),
            ("x ~ y", "unexpected character"),
            ("{job=\"a\"}", "without a metric name"),
        ] {
            let e = refs(expr).expect_err(expr);
            assert!(e.contains(why), "{expr}: {e}");
        }
    }
}
