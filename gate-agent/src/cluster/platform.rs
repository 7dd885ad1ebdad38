//! Which cloud platform this node runs on: OpenShift's `Infrastructure` object, else the
//! node's `spec.providerID`, unless `--platform` says.
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, GroupVersionKind},
};
use serde_json::Value;

use crate::policy::platform::{self, EXTERNAL, Platform};

#[derive(Debug, thiserror::Error)]
pub enum PlatformError {
    #[error("infrastructures.config.openshift.io/cluster: {field}: {reason}")]
    Infrastructure { field: &'static str, reason: String },
    #[error(
        "node {node}: spec.providerID {provider_id:?} names no platform metadata-gate knows; \
         pass --platform"
    )]
    UnknownProvider { node: String, provider_id: String },
    #[error("node {node}: spec.providerID is empty; pass --platform")]
    NoProvider { node: String },
    #[error("reading {what}: {source}")]
    Api { what: String, source: kube::Error },
}

/// Where the platform came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Flag,
    Infrastructure,
    ProviderId,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detected {
    /// OpenShift PlatformType (`AWS`, `GCP`, …); `External` carries its platform name as
    /// `External/<name>` (e.g. `External/oci`).
    pub platform: String,
    pub origin: Origin,
}

impl Detected {
    /// The per-platform ConfigMap name: `metadata-gate-policy-<platform lowercase>`, with
    /// `External/oci` as `external-oci` (an External provider the agent has no row for has
    /// one too).
    pub fn configmap_name(&self) -> String {
        platform::configmap_name(&self.platform)
    }
}

/// The Infrastructure API resource (a CRD that plain Kubernetes does not have).
pub fn infrastructure_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("config.openshift.io", "v1", "Infrastructure"),
        "infrastructures",
    )
}

/// The platform named by an Infrastructure object: `status.platformStatus.type`, falling
/// back to the deprecated `status.platform`; `External` adds
/// `spec.platformSpec.external.platformName`.
pub fn from_infrastructure(obj: &Value) -> Result<String, PlatformError> {
    fn s(v: Option<&Value>) -> Option<&str> {
        v.and_then(Value::as_str).filter(|s| !s.is_empty())
    }
    let ty = s(obj.pointer("/status/platformStatus/type"))
        .or_else(|| s(obj.pointer("/status/platform")))
        .ok_or(PlatformError::Infrastructure {
            field: "status.platformStatus.type",
            reason: "missing, and so is status.platform".into(),
        })?;
    if ty == EXTERNAL {
        let name = s(obj.pointer("/spec/platformSpec/external/platformName"))
            .or_else(|| s(obj.pointer("/status/platformStatus/external/platformName")))
            .filter(|n| *n != "Unknown");
        return Ok(match name {
            Some(n) => format!("{EXTERNAL}/{}", n.to_lowercase()),
            None => EXTERNAL.to_owned(),
        });
    }
    Ok(ty.to_owned())
}

/// The platform a node's `spec.providerID` (`<provider>://…`) points to: the row whose
/// `provider_ids` hold its scheme.
pub fn from_provider_id(provider_id: &str) -> Option<Platform> {
    Platform::by_provider_scheme(provider_id.split_once("://")?.0)
}

/// Read the Infrastructure object; `Ok(None)` when the cluster has no such CRD or object
/// (plain Kubernetes).
pub async fn read_infrastructure(client: &Client) -> Result<Option<Value>, PlatformError> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &infrastructure_resource());
    match api.get_opt("cluster").await {
        Ok(Some(obj)) => Ok(Some(serde_json::to_value(obj).map_err(|e| {
            PlatformError::Infrastructure { field: "(object)", reason: e.to_string() }
        })?)),
        Ok(None) => Ok(None),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        Err(source) => Err(PlatformError::Api {
            what: "infrastructures.config.openshift.io/cluster".into(),
            source,
        }),
    }
}

/// `--platform`, else Infrastructure, else the node's providerID.
pub async fn detect(
    client: &Client,
    node: &str,
    flag: Option<&str>,
) -> Result<Detected, PlatformError> {
    if let Some(p) = flag {
        return Ok(Detected { platform: p.to_owned(), origin: Origin::Flag });
    }
    if let Some(infra) = read_infrastructure(client).await? {
        return Ok(Detected {
            platform: from_infrastructure(&infra)?,
            origin: Origin::Infrastructure,
        });
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes
        .get(node)
        .await
        .map_err(|source| PlatformError::Api { what: format!("node {node}"), source })?;
    let provider_id = n.spec.and_then(|s| s.provider_id).unwrap_or_default();
    if provider_id.is_empty() {
        return Err(PlatformError::NoProvider { node: node.to_owned() });
    }
    from_provider_id(&provider_id)
        .map(|p| Detected { platform: p.name().to_owned(), origin: Origin::ProviderId })
        .ok_or(PlatformError::UnknownProvider { node: node.to_owned(), provider_id })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn infrastructure_fields_in_order_of_preference() {
        let infra = json!({"status": {"platform": "GCP", "platformStatus": {"type": "AWS"}}});
        assert_eq!(from_infrastructure(&infra).unwrap(), "AWS");
        let old = json!({"status": {"platform": "Azure"}});
        assert_eq!(from_infrastructure(&old).unwrap(), "Azure");
        let ext = json!({"spec": {"platformSpec": {"type": "External", "external": {"platformName": "OCI"}}},
                         "status": {"platformStatus": {"type": "External"}}});
        assert_eq!(from_infrastructure(&ext).unwrap(), "External/oci");
        let ext_unknown = json!({"spec": {"platformSpec": {"external": {"platformName": "Unknown"}}},
                                 "status": {"platformStatus": {"type": "External"}}});
        assert_eq!(from_infrastructure(&ext_unknown).unwrap(), "External");
        let err = from_infrastructure(&json!({"status": {}})).unwrap_err().to_string();
        assert!(err.contains("status.platformStatus.type"), "{err}");
    }

    #[test]
    fn provider_ids() {
        let name = |id: &str| from_provider_id(id).map(Platform::name);
        assert_eq!(name("aws:///us-east-1a/i-0123"), Some("AWS"));
        assert_eq!(name("gce://proj/zone/vm"), Some("GCP"));
        assert_eq!(name("azure:///subscriptions/x"), Some("Azure"));
        assert_eq!(name("oci://ocid1.instance"), Some("External/oci"));
        assert_eq!(name("hcloud://42"), Some("External/hetzner"));
        assert_eq!(name("hrobot://321"), Some("External/hetzner"));
        assert_eq!(from_provider_id("kind://docker/kind/kind-worker"), None);
        assert_eq!(from_provider_id("no-scheme"), None);
    }

    #[test]
    fn configmap_names() {
        let d = |p: &str| Detected { platform: p.into(), origin: Origin::Flag }.configmap_name();
        assert_eq!(d("AWS"), "metadata-gate-policy-aws");
        assert_eq!(d("External/oci"), "metadata-gate-policy-external-oci");
        assert_eq!(d("AlibabaCloud"), "metadata-gate-policy-alibabacloud");
    }
}
