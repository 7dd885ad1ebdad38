//! The platforms the agent knows, as a type: [`Platform`] has one variant per OpenShift
//! `PlatformType` (config.openshift.io/v1 Infrastructure, `status.platformStatus.type`) and one
//! per provider on OpenShift's `External` platform (named by its `platformName`). Each variant
//! has one row, [`Facts`], in [`table`](self::table): everything the agent knows of it, from
//! how a node names it on its first boot to the paths the metadata proxy may serve. First-boot
//! detection ([`detect`](super::detect)), the cluster's providerID
//! ([`cluster::platform`](crate::cluster::platform)), the served-path profiles
//! ([`profiles`](super::profiles)), `check` and `--platform` are lookups on it.
//!
//! docs/new-provider.md is the checklist for a new row; docs/platforms.md gives the source of
//! every value in it.
use ipnet::IpNet;
use strum::IntoEnumIterator as _;

use super::protocol::Protocol;

mod table;

/// A platform the agent knows. The names are OpenShift's; an External provider is
/// `External/<platformName>` ([`Platform::name`]).
///
/// strum derives the list of variants (`Platform::iter`), so that no list of them is kept
/// by hand; the rows are a `match` ([`Platform::facts`]) that the compiler holds complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, strum::EnumIter)]
pub enum Platform {
    Aws,
    Azure,
    BareMetal,
    Gcp,
    Libvirt,
    OpenStack,
    /// OpenShift's `None`: no cloud at all.
    None,
    VSphere,
    OVirt,
    IbmCloud,
    KubeVirt,
    EquinixMetal,
    PowerVs,
    AlibabaCloud,
    Nutanix,
    /// Oracle Cloud Infrastructure, on OpenShift's External platform.
    ExternalOci,
    /// Hetzner Cloud, on OpenShift's External platform.
    ExternalHetzner,
}

/// OpenShift's `PlatformType` for providers that are not in it: a policy for one of them
/// says `platform: External`.
pub const EXTERNAL: &str = "External";

/// Everything the agent knows of one platform. Every value has its source in
/// docs/platforms.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    /// As `--platform` names it: the PlatformType (`AWS`), or `External/<platformName>`
    /// (`External/oci`) for a provider on the External platform.
    pub name: &'static str,
    /// The kernel command line's `ignition.platform.id` values of its CoreOS nodes.
    pub ignition_ids: &'static [&'static str],
    /// The firmware strings that name it (cloud-init's `ds-identify` rules), in order.
    pub dmi: &'static [DmiRule],
    /// The schemes of its nodes' `spec.providerID` (`aws` of `aws:///us-east-1a/i-0123`).
    pub provider_ids: &'static [&'static str],
    /// The metadata service: what a policy for this platform protects.
    pub metadata: &'static [Service],
    /// Neighbours on the same or nearby addresses that workloads need: never protected.
    pub keep_open: &'static [Service],
    /// For a platform without a metadata service at a fixed address: why. A policy that
    /// protects nothing is then expected, and the platform needs no first-boot detection,
    /// providerID or served paths of its own.
    pub no_metadata_service: Option<&'static str>,
    /// The served-path profiles a policy may name (`profile: safe`).
    pub profiles: &'static [Profile],
    /// Paths no profile serves; `check` warns about any listed path that reaches one.
    pub sensitive: &'static [Sensitive],
    /// What the metadata proxy does for this service beyond judging paths: its own session
    /// tokens, and answers from its cache.
    pub proxy: ProxyFacts,
    /// The shipped policy ConfigMap, deploy/policies/<[`stem`]>.yaml, built into the binary
    /// for the boot step. `None` only while a new platform is being added: a unit test
    /// requires it of every row.
    pub shipped: Option<&'static str>,
}

/// A service at a fixed address: the metadata service to protect, or a neighbour that every
/// workload needs and no policy may protect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Service {
    /// What it is, for messages ("Amazon DNS server").
    pub what: &'static str,
    /// Its address, as a CIDR (`169.254.169.253/32`).
    pub net: &'static str,
    /// Its ports; empty = every port.
    pub ports: &'static [u16],
    /// Its protocols; empty = every protocol.
    pub protocols: &'static [Protocol],
}

/// A DMI rule: `field` passes `test`, and, where `same_as` is set, equals that field too
/// (ASCII case ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmiRule {
    pub field: DmiField,
    pub test: DmiTest,
    pub same_as: Option<DmiField>,
}

/// The firmware strings a rule may read (`/sys/class/dmi/id/*`, a Xen guest's
/// `/sys/hypervisor/uuid`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmiField {
    SysVendor,
    ProductName,
    ProductSerial,
    ProductUuid,
    ChassisAssetTag,
    HypervisorUuid,
}

impl DmiField {
    /// The field as the boot record names what decided (`DMI product_name`).
    pub fn name(self) -> &'static str {
        match self {
            DmiField::SysVendor => "sys_vendor",
            DmiField::ProductName => "product_name",
            DmiField::ProductSerial => "product_serial",
            DmiField::ProductUuid => "product_uuid",
            DmiField::ChassisAssetTag => "chassis_asset_tag",
            DmiField::HypervisorUuid => "/sys/hypervisor/uuid",
        }
    }
}

/// What a DMI rule asks of its field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmiTest {
    /// Exactly this.
    Is(&'static str),
    /// Starts with this.
    StartsWith(&'static str),
    /// Starts with this, ASCII case ignored (UUIDs).
    StartsWithAnyCase(&'static str),
}

impl DmiTest {
    pub fn passes(self, value: &str) -> bool {
        match self {
            DmiTest::Is(v) => value == v,
            DmiTest::StartsWith(p) => value.starts_with(p),
            DmiTest::StartsWithAnyCase(p) => {
                value.get(..p.len()).is_some_and(|head| head.eq_ignore_ascii_case(p))
            }
        }
    }
}

/// A served-path profile: paths that tell a workload where it runs and nothing that
/// authenticates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    /// The name a policy gives (`profile: safe`).
    pub name: &'static str,
    pub paths: &'static [SafePath],
    /// Query parameters the paths need (Azure's `api-version` and `format`).
    pub query: &'static [&'static str],
}

/// A path of a profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SafePath {
    /// An exact path: a path without a trailing `/`, or `=` and one with it (GCP's `=/`);
    /// none of the profiles needs a prefix, but AWS's leaf that botocore asks for with a `/`.
    pub path: &'static str,
    /// `PUT` for a token request, else `GET` (HEAD comes with GET).
    pub method: &'static str,
    /// What a workload learns from it.
    pub reveals: &'static str,
    /// Where the platform documents its value as fixed for the instance's life (or until it
    /// is stopped, which is a new boot): the proxy answers it from its cache.
    pub fixed: Option<&'static str>,
}

/// What the metadata proxy does for a platform's service beyond judging paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyFacts {
    /// A session-token scheme (IMDSv2 and its likes): workloads get tokens of the proxy's
    /// own, valid at the proxy only; the service's token never leaves the agent.
    pub session: Option<SessionScheme>,
    /// What a request must carry for an answer from the proxy's cache, so that it is given
    /// only where the service itself would answer.
    pub answers_need: AnswerGate,
}

impl ProxyFacts {
    /// No tokens of its own, nothing answered from the cache.
    pub const NONE: ProxyFacts = ProxyFacts { session: None, answers_need: AnswerGate::Never };
}

/// A session-token scheme: `PUT path` with `ttl_header` (seconds, 1 to `max_ttl`) gives a token
/// that later requests carry in `token_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionScheme {
    pub path: &'static str,
    /// Lower case, as HTTP/1 header names are compared.
    pub token_header: &'static str,
    pub ttl_header: &'static str,
    pub max_ttl: u32,
}

/// What a request must carry for a cached answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerGate {
    /// Nothing is answered from the cache.
    Never,
    /// A session token the proxy issued to this workload, not expired (where IMDSv2 is
    /// required, the service answers nothing else).
    Session,
    /// This header with this value (GCE's `Metadata-Flavor: Google`, Azure's `Metadata:
    /// true`); the name in lower case.
    Header { name: &'static str, value: &'static str },
}

/// A path no profile serves, exact or a whole-segment prefix (trailing `/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sensitive {
    pub path: &'static str,
    pub reveals: &'static str,
}

impl Platform {
    /// Every platform, in the order of OpenShift's PlatformType list, External ones last.
    pub fn all() -> impl Iterator<Item = Platform> {
        Platform::iter()
    }

    /// Its row.
    pub fn facts(self) -> &'static Facts {
        table::facts(self)
    }

    /// As `--platform` names it (`AWS`, `External/oci`).
    pub fn name(self) -> &'static str {
        self.facts().name
    }

    /// OpenShift's PlatformType, what its policy's `platform` says (`External` for
    /// `External/oci`).
    pub fn platform_type(self) -> &'static str {
        platform_type(self.name())
    }

    /// The platform `name` names, as `--platform` does (ASCII case ignored).
    pub fn from_name(name: &str) -> Option<Platform> {
        Platform::all().find(|p| p.name().eq_ignore_ascii_case(name))
    }

    /// The platform whose CoreOS nodes boot with `ignition.platform.id=<id>`.
    pub fn by_ignition_id(id: &str) -> Option<Platform> {
        Platform::all().find(|p| p.facts().ignition_ids.contains(&id))
    }

    /// The platform whose nodes' providerIDs have this scheme (`aws`).
    pub fn by_provider_scheme(scheme: &str) -> Option<Platform> {
        Platform::all().find(|p| p.facts().provider_ids.contains(&scheme))
    }

    /// The name of its policy ConfigMap (`metadata-gate-policy-external-oci`).
    pub fn configmap_name(self) -> String {
        configmap_name(self.name())
    }

    /// The profile of this platform named `name`.
    pub fn profile(self, name: &str) -> Option<&'static Profile> {
        self.facts().profiles.iter().find(|p| p.name == name)
    }
}

impl Platform {
    /// Its row as JSON (`gate-agent platforms --json`, which `cargo xtask new-provider` reads):
    /// every field, the shipped policy as whether there is one.
    pub fn to_json(self) -> serde_json::Value {
        let f = self.facts();
        let services = |list: &[Service]| {
            list.iter()
                .map(|s| {
                    serde_json::json!({
                        "what": s.what, "net": s.net, "ports": s.ports,
                        "protocols": s.protocols.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
                        "describe": s.describe(),
                    })
                })
                .collect::<Vec<_>>()
        };
        let dmi = f.dmi.iter().map(|r| {
            let (test, value) = match r.test {
                DmiTest::Is(v) => ("is", v),
                DmiTest::StartsWith(v) => ("startsWith", v),
                DmiTest::StartsWithAnyCase(v) => ("startsWithAnyCase", v),
            };
            serde_json::json!({
                "field": r.field.name(), "test": test, "value": value,
                "sameAs": r.same_as.map(DmiField::name),
            })
        });
        let profiles = f.profiles.iter().map(|p| {
            serde_json::json!({
                "name": p.name,
                "paths": p.paths.iter().map(|s| serde_json::json!({
                    "path": s.path, "method": s.method, "reveals": s.reveals,
                    "fixedPerSource": s.fixed,
                })).collect::<Vec<_>>(),
                "query": p.query,
            })
        });
        serde_json::json!({
            "name": f.name,
            "platformType": self.platform_type(),
            "configMap": self.configmap_name(),
            "policyFile": format!("deploy/policies/{}.yaml", stem(f.name)),
            "ignitionIds": f.ignition_ids,
            "dmi": dmi.collect::<Vec<_>>(),
            "providerIds": f.provider_ids,
            "metadata": services(f.metadata),
            "keepOpen": services(f.keep_open),
            "noMetadataService": f.no_metadata_service,
            "profiles": profiles.collect::<Vec<_>>(),
            "sensitive": f.sensitive.iter().map(|s| serde_json::json!({
                "path": s.path, "reveals": s.reveals,
            })).collect::<Vec<_>>(),
            "shipped": f.shipped.is_some(),
        })
    }

    /// One line of `gate-agent platforms`: name, ConfigMap, how a node names it, what is
    /// protected.
    pub fn summary(self) -> String {
        let f = self.facts();
        let or_dash = |v: Vec<String>| if v.is_empty() { "-".to_owned() } else { v.join(", ") };
        let boot = f.ignition_ids.iter().map(|i| format!("ignition {i}"));
        let dmi = f.dmi.iter().map(|r| format!("DMI {}", r.field.name()));
        let protects = match f.no_metadata_service {
            Some(_) => "nothing (no metadata service)".to_owned(),
            None => or_dash(f.metadata.iter().map(Service::describe).collect()),
        };
        format!(
            "{}\n  configmap {}\n  first boot {}\n  providerID {}\n  protects {}\n  keeps open \
             {}\n  profiles {}",
            f.name,
            self.configmap_name(),
            or_dash(boot.chain(dmi).collect()),
            or_dash(f.provider_ids.iter().map(|s| format!("{s}://")).collect()),
            protects,
            or_dash(f.keep_open.iter().map(Service::describe).collect()),
            or_dash(f.profiles.iter().map(|p| p.name.to_owned()).collect()),
        )
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The OpenShift `PlatformType` values a policy may name, each once, in OpenShift's order.
pub fn platform_types() -> Vec<&'static str> {
    let mut types: Vec<&'static str> = Vec::new();
    for t in Platform::all().map(Platform::platform_type).chain([EXTERNAL]) {
        if !types.contains(&t) {
            types.push(t);
        }
    }
    types
}

/// The PlatformType part of a platform's name: `External/oci` -> `External`.
pub fn platform_type(name: &str) -> &str {
    name.split_once('/').map_or(name, |(base, _)| base)
}

/// A platform's name in its policy ConfigMap's name and file (`metadata-gate-policy-<stem>`,
/// `deploy/policies/<stem>.yaml`): lowercased, `External/oci` as `external-oci`. Any name
/// has one, so that an External provider the agent does not know still has a ConfigMap.
pub fn stem(name: &str) -> String {
    name.to_lowercase().replace('/', "-")
}

/// Prefix of the policy ConfigMaps' names.
pub const CONFIGMAP_PREFIX: &str = "metadata-gate-policy-";

/// `metadata-gate-policy-<stem>` of any platform name.
pub fn configmap_name(name: &str) -> String {
    format!("{CONFIGMAP_PREFIX}{}", stem(name))
}

/// The platform name a policy ConfigMap's name implies: `metadata-gate-policy-aws` -> `AWS`,
/// `metadata-gate-policy-external-acme` -> `External/acme` (known or not).
pub fn name_of_configmap(configmap: &str) -> Option<String> {
    let suffix = configmap.strip_prefix(CONFIGMAP_PREFIX)?;
    let external = format!("{}-", stem(EXTERNAL));
    if let Some(provider) = suffix.strip_prefix(&external) {
        return Some(format!("{EXTERNAL}/{provider}"));
    }
    platform_types().into_iter().find(|t| t.eq_ignore_ascii_case(suffix)).map(str::to_owned)
}

/// A platform name as the agent spells it: `aws` -> `AWS`, `external/OCI` -> `External/oci`;
/// a name whose PlatformType it does not know is kept as written.
pub fn canonical(name: &str) -> String {
    let (base, rest) = match name.split_once('/') {
        Some((b, r)) => (b, Some(r)),
        None => (name, None),
    };
    let Some(base) = platform_types().into_iter().find(|t| t.eq_ignore_ascii_case(base)) else {
        return name.to_owned();
    };
    match rest {
        Some(r) => format!("{base}/{}", r.to_ascii_lowercase()),
        None => base.to_owned(),
    }
}

impl Service {
    /// The address. Every entry of the table parses (a unit test holds it to that).
    pub fn net(&self) -> IpNet {
        self.net.parse().unwrap_or_else(|e| panic!("platform table: {:?}: {e}", self.net))
    }

    /// `169.254.169.253 port 53`, `fd00:ec2::123 UDP 123`, `100.100.0.0/16`.
    pub fn describe(&self) -> String {
        let net = self.net();
        let addr = if net.prefix_len() == net.max_prefix_len() {
            net.addr().to_string()
        } else {
            net.to_string()
        };
        let protos = match self.protocols {
            [] => String::new(),
            ps => ps.iter().map(|p| p.as_str()).collect::<Vec<_>>().join("/") + " ",
        };
        match self.ports {
            [] if protos.is_empty() => addr,
            [] => format!("{addr} {}", protos.trim_end()),
            [p] => format!("{addr} {}{p}", if protos.is_empty() { "port " } else { &protos }),
            ps => format!(
                "{addr} {}{}",
                if protos.is_empty() { "ports " } else { &protos },
                ps.iter().map(u16::to_string).collect::<Vec<_>>().join(", ")
            ),
        }
    }
}

#[cfg(test)]
mod tests;
