//! The policies shipped in deploy/policies/, built into the binary (each row of
//! [`Platform`] holds its own): what the boot step installs on a node's first boot, before any
//! ConfigMap can be read. Each is the ConfigMap as applied to a cluster; its `policy.yaml`
//! key is the policy.
use std::collections::BTreeMap;

use super::platform::{Platform, stem};

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

/// The policy text shipped for `platform` (as `run --platform` names it: `AWS`,
/// `External/oci`; case does not matter, and the file's stem, `external-oci`, does too).
pub fn policy_for(platform: &str) -> Result<String, ShippedError> {
    let unknown = || {
        let known: Vec<_> = Platform::all().map(|p| stem(p.name())).collect();
        ShippedError::Unknown(platform.to_owned(), known.join(", "))
    };
    let wanted = stem(platform);
    let yaml = Platform::all()
        .find(|p| stem(p.name()) == wanted)
        .and_then(|p| p.facts().shipped)
        .ok_or_else(unknown)?;
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
        for p in Platform::all() {
            let text = policy_for(p.name()).expect("shipped");
            let policy = Policy::parse(p.name(), &text).unwrap_or_else(|e| panic!("{p}: {e}"));
            // `External/oci` is `platform: External` in its policy.
            assert_eq!(policy.platform, p.platform_type(), "{p}");
        }
        assert_eq!(
            Policy::parse("aws", &policy_for("aws").expect("AWS")).expect("p").platform,
            "AWS"
        );
        assert!(policy_for("external-oci").is_ok(), "the file's stem names it too");
        assert!(matches!(policy_for("Mars"), Err(ShippedError::Unknown(..))));
    }
}
