//! The policies shipped in deploy/policies/, built into the binary: what the boot step
//! installs on a node's first boot, before any ConfigMap can be read. Each is the ConfigMap
//! as applied to a cluster; its `policy.yaml` key is the policy.
use std::collections::BTreeMap;

/// (file stem, the ConfigMap's YAML). The stem is the ConfigMap's name after
/// `metadata-gate-policy-`: the platform lowercased, `/` as `-`.
const SHIPPED: &[(&str, &str)] = &[
    ("alibabacloud", include_str!("../../../deploy/policies/alibabacloud.yaml")),
    ("aws", include_str!("../../../deploy/policies/aws.yaml")),
    ("azure", include_str!("../../../deploy/policies/azure.yaml")),
    ("baremetal", include_str!("../../../deploy/policies/baremetal.yaml")),
    ("equinixmetal", include_str!("../../../deploy/policies/equinixmetal.yaml")),
    ("external-oci", include_str!("../../../deploy/policies/external-oci.yaml")),
    ("gcp", include_str!("../../../deploy/policies/gcp.yaml")),
    ("ibmcloud", include_str!("../../../deploy/policies/ibmcloud.yaml")),
    ("kubevirt", include_str!("../../../deploy/policies/kubevirt.yaml")),
    ("libvirt", include_str!("../../../deploy/policies/libvirt.yaml")),
    ("none", include_str!("../../../deploy/policies/none.yaml")),
    ("nutanix", include_str!("../../../deploy/policies/nutanix.yaml")),
    ("openstack", include_str!("../../../deploy/policies/openstack.yaml")),
    ("ovirt", include_str!("../../../deploy/policies/ovirt.yaml")),
    ("powervs", include_str!("../../../deploy/policies/powervs.yaml")),
    ("vsphere", include_str!("../../../deploy/policies/vsphere.yaml")),
];

/// Why no shipped policy could be had.
#[derive(Debug, thiserror::Error)]
pub enum ShippedError {
    #[error("no policy is shipped for platform {0:?}; one of {1}")]
    Unknown(String, String),
    #[error("the shipped ConfigMap for {0} has no data.policy.yaml: {1}")]
    Malformed(String, String),
}

#[derive(serde::Deserialize)]
struct ConfigMap {
    data: BTreeMap<String, String>,
}

/// A platform's name in the policy ConfigMap's name and file (`metadata-gate-policy-<stem>`,
/// `deploy/policies/<stem>.yaml`): lowercased, `External/oci` as `external-oci`.
pub fn stem(platform: &str) -> String {
    platform.to_lowercase().replace('/', "-")
}

/// The policy text shipped for `platform` (as `run --platform` names it: `AWS`,
/// `External/oci`; case does not matter).
pub fn policy_for(platform: &str) -> Result<String, ShippedError> {
    let stem = stem(platform);
    let (_, yaml) = SHIPPED.iter().find(|(s, _)| *s == stem).ok_or_else(|| {
        let known: Vec<_> = SHIPPED.iter().map(|(s, _)| *s).collect();
        ShippedError::Unknown(platform.to_owned(), known.join(", "))
    })?;
    let cm: ConfigMap = serde_saphyr::from_str(yaml)
        .map_err(|e| ShippedError::Malformed(platform.to_owned(), e.to_string()))?;
    cm.data
        .get("policy.yaml")
        .cloned()
        .ok_or_else(|| ShippedError::Malformed(platform.to_owned(), "key missing".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;

    #[test]
    fn every_shipped_policy_is_built_in_and_valid() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/policies");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .expect("deploy/policies")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n != "kustomization.yaml")
            .filter_map(|n| n.strip_suffix(".yaml").map(str::to_owned))
            .collect();
        on_disk.sort();
        let built_in: Vec<_> = SHIPPED.iter().map(|(s, _)| s.to_string()).collect();
        assert_eq!(built_in, on_disk, "SHIPPED lists every file of deploy/policies");
        for (stem, _) in SHIPPED {
            let text = policy_for(stem).expect("shipped");
            let p = Policy::parse(stem, &text).unwrap_or_else(|e| panic!("{stem}: {e}"));
            // `External/oci` is `platform: External` in its policy.
            assert!(stem.starts_with(&p.platform.to_lowercase()), "{stem}: {}", p.platform);
        }
        assert_eq!(
            Policy::parse("aws", &policy_for("AWS").expect("AWS")).expect("p").platform,
            "AWS"
        );
        assert!(matches!(policy_for("Mars"), Err(ShippedError::Unknown(..))));
    }
}
