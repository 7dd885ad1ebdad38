//! The CRDs of the custom resources deploy/ uses (OpenShift's SecurityContextConstraints and
//! MachineConfig, the Prometheus Operator's ServiceMonitor and PrometheusRule) and of
//! OpenShift's Infrastructure, which the cluster tests serve: the openAPIV3Schema of each is
//! vendored under xtask/schemas/ (its README names the sources), and the API server judges
//! the objects against it.
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

/// The vendored CRDs as CustomResourceDefinition objects, for an API server to serve (one
/// version, the vendored schema as written).
pub(crate) fn definitions() -> serde_json::Result<Vec<Value>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_vendored_schema_makes_a_crd() {
        let crds = definitions().expect("the vendored schemas are JSON");
        let names: Vec<&str> =
            crds.iter().filter_map(|c| c.pointer("/metadata/name")?.as_str()).collect();
        assert_eq!(
            names,
            [
                "securitycontextconstraints.security.openshift.io",
                "machineconfigs.machineconfiguration.openshift.io",
                "servicemonitors.monitoring.coreos.com",
                "prometheusrules.monitoring.coreos.com",
                "infrastructures.config.openshift.io",
            ]
        );
        assert!(crds.iter().all(|c| c.pointer("/spec/versions/0/schema/openAPIV3Schema/type")
            == Some(&Value::from("object"))));
    }
}
