//! The custom resources k8s-openapi does not know (OpenShift's SecurityContextConstraints and
//! MachineConfig, the Prometheus Operator's ServiceMonitor and PrometheusRule), validated
//! against the openAPIV3Schema of their CRDs, vendored under xtask/schemas/ (its README names
//! the sources). `metadata` is checked against k8s-openapi's ObjectMeta by the caller.
use std::sync::LazyLock;

use jsonschema::Validator;
use serde_json::Value;

/// One vendored CRD: what it serves, and its schema.
struct Crd {
    api: &'static str,
    kind: &'static str,
    plural: &'static str,
    namespaced: bool,
    schema: &'static str,
}

const SCHEMAS: &[Crd] = &[
    Crd {
        api: "security.openshift.io/v1",
        kind: "SecurityContextConstraints",
        plural: "securitycontextconstraints",
        namespaced: false,
        schema: include_str!("../../schemas/securitycontextconstraints.json"),
    },
    Crd {
        api: "machineconfiguration.openshift.io/v1",
        kind: "MachineConfig",
        plural: "machineconfigs",
        namespaced: false,
        schema: include_str!("../../schemas/machineconfig.json"),
    },
    Crd {
        api: "monitoring.coreos.com/v1",
        kind: "ServiceMonitor",
        plural: "servicemonitors",
        namespaced: true,
        schema: include_str!("../../schemas/servicemonitor.json"),
    },
    Crd {
        api: "monitoring.coreos.com/v1",
        kind: "PrometheusRule",
        plural: "prometheusrules",
        namespaced: true,
        schema: include_str!("../../schemas/prometheusrule.json"),
    },
    // Not in deploy/: what the agent reads the platform from, which the cluster test serves.
    Crd {
        api: "config.openshift.io/v1",
        kind: "Infrastructure",
        plural: "infrastructures",
        namespaced: false,
        schema: include_str!("../../schemas/infrastructure.json"),
    },
];

type Compiled = Vec<(&'static str, &'static str, Result<Validator, String>)>;

static VALIDATORS: LazyLock<Compiled> =
    LazyLock::new(|| SCHEMAS.iter().map(|c| (c.api, c.kind, compile(c.schema))).collect());

/// The vendored CRDs as CustomResourceDefinition objects, for an API server to serve (one
/// version, the vendored schema as written).
pub(super) fn definitions() -> serde_json::Result<Vec<Value>> {
    SCHEMAS
        .iter()
        .map(|c| {
            let (group, version) = c.api.split_once('/').unwrap_or(("", c.api));
            let schema: Value = serde_json::from_str(c.schema)?;
            Ok(serde_json::json!({
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": format!("{}.{group}", c.plural)},
                "spec": {
                    "group": group,
                    "scope": if c.namespaced { "Namespaced" } else { "Cluster" },
                    "names": {
                        "plural": c.plural,
                        "singular": c.kind.to_ascii_lowercase(),
                        "kind": c.kind,
                        "listKind": format!("{}List", c.kind),
                    },
                    "versions": [{
                        "name": version,
                        "served": true,
                        "storage": true,
                        "schema": {"openAPIV3Schema": schema},
                    }],
                },
            }))
        })
        .collect()
}

fn compile(text: &str) -> Result<Validator, String> {
    let mut schema: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    structural(&mut schema);
    // Draft 4 is what OpenAPI 3.0 schemas are; formats (int64, date-time) are type hints there.
    jsonschema::draft4::options()
        .should_validate_formats(false)
        .build(&schema)
        .map_err(|e| e.to_string())
}

/// Every way `value` breaks its CRD's schema, each as `path: reason`.
pub(super) fn validate(api: &str, kind: &str, value: &Value) -> Vec<String> {
    let Some((_, _, compiled)) = VALIDATORS.iter().find(|(a, k, _)| *a == api && *k == kind) else {
        return vec![format!("no schema vendored for {api} {kind}")];
    };
    match compiled {
        Err(e) => vec![format!("the vendored schema of {kind} does not compile: {e}")],
        Ok(v) => v
            .iter_errors(value)
            .map(|e| {
                let at = e.instance_path().to_string();
                format!("{}: {e}", if at.is_empty() { "/" } else { at.as_str() })
            })
            .collect(),
    }
}

/// Read an OpenAPI 3.0 structural schema as the API server does: a field the schema does not
/// define is pruned (unless `x-kubernetes-preserve-unknown-fields`), so here it is an error
/// (a misspelt or misplaced field); `nullable: true` admits null.
fn structural(schema: &mut Value) {
    let Some(obj) = schema.as_object_mut() else { return };
    if obj.get("nullable") == Some(&Value::Bool(true))
        && let Some(Value::String(t)) = obj.get("type").cloned()
    {
        obj.insert("type".into(), Value::Array(vec![Value::String(t), "null".into()]));
    }
    if let Some(Value::String(p)) = obj.get_mut("pattern")
        && let Some(at) = p.find("(?i)")
    {
        *p = case_insensitive(&p[..at], &p[at + 4..]);
    }
    let preserves = obj.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    if obj.contains_key("properties") && !obj.contains_key("additionalProperties") && !preserves {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (key, child) in obj.iter_mut() {
        match (key.as_str(), child) {
            ("properties", Value::Object(fields)) => fields.values_mut().for_each(structural),
            ("items" | "additionalProperties" | "not", c) => structural(c),
            ("anyOf" | "allOf" | "oneOf", Value::Array(cs)) => cs.iter_mut().for_each(structural),
            _ => {}
        }
    }
}

/// `head` + `tail` with each letter of `tail` as `[xX]`: the CRDs' patterns are Go's (RE2),
/// whose inline flag `(?i)` the ECMA 262 regexes of JSON Schema lack.
fn case_insensitive(head: &str, tail: &str) -> String {
    let mut out = head.to_owned();
    let mut escaped = false;
    for c in tail.chars() {
        if c.is_ascii_alphabetic() && !escaped {
            out.push_str(&format!("[{}{}]", c.to_ascii_lowercase(), c.to_ascii_uppercase()));
        } else {
            out.push(c);
        }
        escaped = c == '\\' && !escaped;
    }
    out
}
