//! The policy document exactly as written: the serde shape of the YAML (docs/policy.md).
//!
//! Everything a user may get wrong is kept loose here (strings, optional fields, wide integers)
//! so that [`validate`](super::validate) can reject it with a message naming the field and the
//! reason, instead of serde's generic type errors.
use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

/// Top level of a policy document.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawPolicy {
    pub platform: Option<String>,
    pub mode: Option<String>,
    /// Opt-out for platforms without a metadata service: an empty endpoint list is accepted.
    #[serde(default)]
    pub allow_no_endpoints: bool,
    #[serde(default)]
    pub endpoints: Vec<RawEndpoint>,
    #[serde(default)]
    pub allow: Vec<RawAllow>,
    /// Paths served to every gated workload that no allow entry selects.
    pub served: Option<RawServed>,
}

/// `served`: the same access fields as an allow entry, for every gated workload.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawServed {
    pub profile: Option<String>,
    pub paths: Option<Vec<String>>,
    pub methods: Option<Vec<String>>,
    pub query_parameters: Option<Vec<String>>,
    pub rate: Option<RawRate>,
}

/// `rate`: how many requests the proxy serves a workload, on average and at once.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawRate {
    pub per_second: Option<f64>,
    pub burst: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawEndpoint {
    pub name: Option<String>,
    pub cidr: Option<String>,
    pub ports: Option<Vec<RawPort>>,
    pub protocols: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawAllow {
    pub name: Option<String>,
    pub cgroup: Option<String>,
    pub namespace: Option<String>,
    pub pod_selector: Option<RawPodSelector>,
    pub service_account: Option<String>,
    pub containers: Option<Vec<String>>,
    pub host_network: Option<bool>,
    pub grants: Option<Vec<String>>,
    pub profile: Option<String>,
    pub paths: Option<Vec<String>>,
    pub methods: Option<Vec<String>>,
    pub query_parameters: Option<Vec<String>>,
    pub rate: Option<RawRate>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawPodSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default)]
    pub match_expressions: Vec<RawLabelExpr>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawLabelExpr {
    pub key: Option<String>,
    pub operator: Option<String>,
    pub values: Option<Vec<String>>,
}

/// A port as written: any integer, so that `70000` or `-1` reach validation and get a
/// "port N is outside 1-65535" message rather than serde's "invalid value ... expected u16".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RawPort(pub i128);

impl<'de> Deserialize<'de> for RawPort {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct PortVisitor;

        impl Visitor<'_> for PortVisitor {
            type Value = RawPort;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a port number 1-65535")
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawPort, E> {
                Ok(RawPort(i128::from(v)))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawPort, E> {
                Ok(RawPort(i128::from(v)))
            }

            fn visit_i128<E: de::Error>(self, v: i128) -> Result<RawPort, E> {
                Ok(RawPort(v))
            }

            fn visit_u128<E: de::Error>(self, v: u128) -> Result<RawPort, E> {
                i128::try_from(v)
                    .map(RawPort)
                    .map_err(|_| E::custom(format_args!("port {v} is outside 1-65535")))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<RawPort, E> {
                if v.is_finite() && v.fract() == 0.0 && !(0.0..=65535.0).contains(&v) {
                    return Err(E::custom(format_args!("port {v} is outside 1-65535")));
                }
                Err(E::custom(format_args!(
                    "port {v} is not a whole number; expected a port number 1-65535"
                )))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawPort, E> {
                let hint = if v.parse::<u32>().is_ok() {
                    format!("; write it without quotes: {v}")
                } else if v.contains('-') || v.contains(':') {
                    "; port ranges are not supported, list the ports".to_owned()
                } else {
                    String::new()
                };
                Err(E::custom(format_args!(
                    "port {v:?} is a string, expected a port number 1-65535{hint}"
                )))
            }
        }

        d.deserialize_any(PortVisitor)
    }
}
