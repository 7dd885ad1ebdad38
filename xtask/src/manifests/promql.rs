//! What an alerting rule's expression refers to, read from the AST of `promql-parser` (the
//! PromQL grammar of Prometheus): every series selector (metric name and label matchers) and
//! every label named in `by`, `without`, `on`, `ignoring`, `group_left` and `group_right`.
//! An expression the parser refuses (unbalanced brackets, an unknown function, a bad
//! matcher) is refused here too.
use promql_parser::label::{MatchOp, Matcher as AstMatcher};
use promql_parser::parser::{self, Expr, LabelModifier, VectorMatchCardinality, VectorSelector};
use promql_parser::util::{ExprVisitor, walk_expr};

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
}

/// What `expr` refers to, or why it cannot be read.
pub(super) fn refs(expr: &str) -> Result<Refs, String> {
    let ast = parser::parse(expr)?;
    let mut refs = Refs::default();
    walk_expr(&mut refs, &ast)?;
    Ok(refs)
}

impl ExprVisitor for Refs {
    type Error = String;

    fn pre_visit(&mut self, expr: &Expr) -> Result<bool, String> {
        match expr {
            Expr::VectorSelector(vs) => self.selector(vs)?,
            Expr::MatrixSelector(ms) => self.selector(&ms.vs)?,
            Expr::Aggregate(agg) => {
                if let Some(m) = &agg.modifier {
                    let labels = &m.labels().labels;
                    self.grouping.extend(labels.iter().cloned());
                    if let LabelModifier::Include(_) = m {
                        self.by.extend(labels.iter().cloned());
                    }
                }
            }
            Expr::Binary(bin) => {
                if let Some(m) = &bin.modifier {
                    if let Some(matching) = &m.matching {
                        self.grouping.extend(matching.labels().labels.iter().cloned());
                    }
                    if let VectorMatchCardinality::ManyToOne(l)
                    | VectorMatchCardinality::OneToMany(l) = &m.card
                    {
                        self.grouping.extend(l.labels.iter().cloned());
                        self.joined.extend(l.labels.iter().cloned());
                    }
                }
            }
            _ => {}
        }
        Ok(true)
    }
}

impl Refs {
    fn selector(&mut self, vs: &VectorSelector) -> Result<(), String> {
        let all = vs.matchers.matchers.iter().chain(vs.matchers.or_matchers.iter().flatten());
        let matchers: Vec<Matcher> = all.map(matcher).collect();
        let by_matcher = matchers.iter().find(|m| m.label == "__name__" && m.op == "=");
        let Some(metric) = vs.name.clone().or_else(|| by_matcher.map(|m| m.value.clone())) else {
            return Err(format!("{vs}: a selector without a metric name"));
        };
        self.selectors.push(Selector { metric, matchers });
        Ok(())
    }
}

fn matcher(m: &AstMatcher) -> Matcher {
    let op = match m.op {
        MatchOp::Equal => "=",
        MatchOp::NotEqual => "!=",
        MatchOp::Re(_) => "=~",
        MatchOp::NotRe(_) => "!~",
    };
    Matcher { label: m.name.clone(), op: op.to_owned(), value: m.value.clone() }
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

    fn sorted(v: &[String]) -> Vec<&str> {
        let mut v: Vec<&str> = v.iter().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn selectors_and_groupings() {
        let r = refs(
            "sum by (node, workload) (rate(metadata_gate_workload_denials_total{verdict!=\"x\"}[5m]))\n  \
             * on (namespace, pod) group_left (node) kube_pod_info{namespace='a', created_by_name=~\"b.*\"} offset 1h > 1e-3\n\
             # a comment with words(and) {braces}\n\
             or max_over_time(up[10m:1m]) == bool 0 or {__name__=\"x_total\", job=\"j\"}",
        )
        .expect("readable");
        let mut found = r.selectors.clone();
        found.sort_by(|a, b| a.metric.cmp(&b.metric));
        assert_eq!(
            found,
            vec![
                sel("kube_pod_info", &[("namespace", "=", "a"), ("created_by_name", "=~", "b.*")]),
                sel("metadata_gate_workload_denials_total", &[("verdict", "!=", "x")]),
                sel("up", &[]),
                sel("x_total", &[("__name__", "=", "x_total"), ("job", "=", "j")]),
            ]
        );
        assert_eq!(sorted(&r.grouping), ["namespace", "node", "node", "pod", "workload"]);
        assert_eq!(sorted(&r.by), ["node", "workload"]);
        assert_eq!(r.joined, ["node"]);
        let r = refs("count without (a) (x) > sum(y) by (b)").expect("readable");
        assert_eq!(sorted(&r.grouping), ["a", "b"]);
        assert_eq!(r.by, ["b"]);
    }

    #[test]
    fn what_cannot_be_read_is_refused() {
        for expr in [
            "rate(x[5m]",
            "x{a=\"b\"",
            "x{a=b}",
            "increse(x[5m])",
            "x{a=\"b}",
            "sum by x",
            "x ~ y",
            "{job=\"a\"}",
            // Set operators match many-to-many: no group_left (the hand lexer let this by).
            "x unless on (a) group_left (b) y",
        ] {
            assert!(refs(expr).is_err(), "{expr} was read");
        }
    }
}
