//! Per platform, which metadata paths tell a workload where it runs and nothing that
//! authenticates it (the safe profile, `profile: safe`), and which paths must never be served
//! (credentials, tokens, user data, SSH keys, signed identity documents), which `check` warns
//! about. docs/platforms.md gives the source of every path.
//!
//! Platforms are named as in [`PLATFORM_FACTS`](super::platforms::PLATFORM_FACTS).
use gate_common::http::{Access, Methods, PathRule};

/// The one profile name a policy may give.
pub const SAFE: &str = "safe";

/// A path of a safe profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SafePath {
    /// An exact path (none of the profiles needs a prefix).
    pub path: &'static str,
    /// `PUT` for a token request, else `GET` (HEAD comes with GET).
    pub method: &'static str,
    /// What a workload learns from it.
    pub reveals: &'static str,
}

/// A path no profile serves, exact or a whole-segment prefix (trailing `/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sensitive {
    pub path: &'static str,
    pub reveals: &'static str,
}

/// One platform's paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathFacts {
    pub platform: &'static str,
    pub safe: &'static [SafePath],
    /// Query parameters the safe paths need (Azure's `api-version` and `format`).
    pub query: &'static [&'static str],
    pub sensitive: &'static [Sensitive],
}

const fn get(path: &'static str, reveals: &'static str) -> SafePath {
    SafePath { path, method: "GET", reveals }
}

const fn put(path: &'static str, reveals: &'static str) -> SafePath {
    SafePath { path, method: "PUT", reveals }
}

const fn never(path: &'static str, reveals: &'static str) -> Sensitive {
    Sensitive { path, reveals }
}

const SESSION_TOKEN: &str =
    "a session token for the metadata service itself (the instance rejects it elsewhere)";

/// The EC2-style tree, shared by AWS and Alibaba Cloud where their paths agree.
const USER_DATA: Sensitive = never("/latest/user-data", "user data (often bootstrap secrets)");
const PUBLIC_KEYS: Sensitive = never("/latest/meta-data/public-keys/", "SSH public keys");

pub const PATH_FACTS: &[PathFacts] = &[
    PathFacts {
        platform: "AWS",
        safe: &[
            put("/latest/api/token", SESSION_TOKEN),
            get("/latest/meta-data/instance-id", "the instance id"),
            get("/latest/meta-data/instance-type", "the instance type"),
            get("/latest/meta-data/placement/region", "the region"),
            // With its trailing `/` (a prefix: the path with or without it): botocore asks
            // for `…/availability-zone/`.
            get("/latest/meta-data/placement/availability-zone/", "the availability zone"),
            get("/latest/meta-data/placement/availability-zone-id", "the availability zone id"),
        ],
        query: &[],
        sensitive: &[
            never("/latest/meta-data/iam/", "the instance profile and its temporary credentials"),
            never("/latest/meta-data/identity-credentials/", "the instance identity credentials"),
            never(
                "/latest/dynamic/instance-identity/",
                "the signed instance identity document (signature, pkcs7, rsa2048)",
            ),
            USER_DATA,
            PUBLIC_KEYS,
            never("/latest/meta-data/tags/", "instance tags, which users fill"),
        ],
    },
    PathFacts {
        platform: "GCP",
        safe: &[
            get("/computeMetadata/v1/instance/id", "the instance id"),
            get("/computeMetadata/v1/instance/name", "the instance name"),
            get("/computeMetadata/v1/instance/zone", "the zone (and with it the region)"),
            get("/computeMetadata/v1/instance/machine-type", "the machine type"),
            get("/computeMetadata/v1/project/project-id", "the project id"),
            get("/computeMetadata/v1/project/numeric-project-id", "the project number"),
        ],
        query: &[],
        sensitive: &[
            never(
                "/computeMetadata/v1/instance/service-accounts/",
                "OAuth access tokens and signed identity tokens of the node's service accounts",
            ),
            never(
                "/computeMetadata/v1/instance/attributes/",
                "instance metadata: ssh-keys, startup scripts, user data, and GKE's kube-env \
                 (the kubelet's bootstrap credentials)",
            ),
            never("/computeMetadata/v1/project/attributes/", "project-wide SSH keys and metadata"),
            never(
                "/computeMetadata/v1/instance/guest-attributes/",
                "values workloads can write for others to read",
            ),
            never("/computeMetadata/v1beta1/", "the legacy tree, with the same data"),
            never("/0.1/", "the legacy tree, with the same data"),
        ],
    },
    PathFacts {
        platform: "Azure",
        safe: &[
            get("/metadata/instance/compute/location", "the region"),
            get("/metadata/instance/compute/zone", "the availability zone (may be empty)"),
            get("/metadata/instance/compute/vmId", "the VM's unique id"),
            get("/metadata/instance/compute/vmSize", "the VM size"),
        ],
        query: &["api-version", "format"],
        sensitive: &[
            never("/metadata/identity/", "managed identity OAuth tokens"),
            never("/metadata/attested/", "the signed attested document"),
            never(
                "/metadata/instance/compute/userData",
                "user data (the whole /metadata/instance document holds it too)",
            ),
            never("/metadata/instance/compute/customData", "custom data"),
            never("/metadata/instance/compute/osProfile", "the admin user name"),
            never("/metadata/instance/compute/publicKeys", "SSH public keys"),
            never(
                "/metadata/instance/compute/storageProfile",
                "disk encryption settings (Key Vault URLs)",
            ),
            never("/machine", "the WireServer's goal state: certificates, extension secrets"),
        ],
    },
    PathFacts {
        platform: "AlibabaCloud",
        safe: &[
            put("/latest/api/token", SESSION_TOKEN),
            get("/latest/meta-data/instance-id", "the instance id"),
            get("/latest/meta-data/region-id", "the region"),
            get("/latest/meta-data/zone-id", "the zone"),
            get("/latest/meta-data/instance/instance-type", "the instance type"),
        ],
        query: &[],
        sensitive: &[
            never("/latest/meta-data/ram/", "the RAM role's STS credentials"),
            never(
                "/latest/dynamic/instance-identity/",
                "the instance identity document and its pkcs7 signature",
            ),
            USER_DATA,
            PUBLIC_KEYS,
            never("/latest/meta-data/tags/", "instance tags, which users fill"),
        ],
    },
    PathFacts {
        platform: "OpenStack",
        safe: &[
            get("/latest/meta-data/instance-id", "the EC2-style instance id (not the Nova UUID)"),
            get("/latest/meta-data/instance-type", "the flavor"),
            get("/latest/meta-data/placement/availability-zone", "the availability zone"),
        ],
        query: &[],
        sensitive: &[
            never(
                "/openstack/",
                "meta_data.json (SSH keys, user properties), user_data, vendor data (deployer \
                 tokens), the encrypted admin password",
            ),
            USER_DATA,
            PUBLIC_KEYS,
        ],
    },
    PathFacts {
        platform: "IBMCloud",
        safe: &[
            put(
                "/instance_identity/v1/token",
                "the instance identity token, which opens the metadata service (older API \
                 versions)",
            ),
            put(
                "/identity/v1/token",
                "the instance identity token, which opens the metadata service (newer API \
                 versions)",
            ),
            get(
                "/metadata/v1/instance",
                "the instance document: id, name, CRN (with the account), zone, profile, VPC; \
                 no user data",
            ),
        ],
        query: &["version"],
        sensitive: &[
            never("/instance_identity/v1/iam_token", "an IAM token of the linked trusted profile"),
            never("/identity/v1/iam_tokens", "an IAM token of the linked trusted profile"),
            never("/instance_identity/v1/certificates", "the instance identity certificate"),
            never("/identity/v1/certificates", "the instance identity certificate"),
            never("/metadata/v1/instance/initialization", "user data, SSH keys, passwords"),
            never("/metadata/v1/keys", "SSH public keys"),
        ],
    },
    PathFacts {
        platform: "External/oci",
        safe: &[
            get("/opc/v2/instance/region", "the region"),
            get("/opc/v2/instance/availabilityDomain", "the availability domain"),
            get("/opc/v2/instance/id", "the instance OCID"),
            get("/opc/v2/instance/shape", "the shape"),
        ],
        query: &[],
        sensitive: &[
            never("/opc/v2/identity/", "the instance principal's certificate and private key"),
            never("/opc/v2/instance/metadata/", "SSH authorized keys and user data"),
            never("/opc/v1/", "the legacy tree, with the same data and no header check"),
            never("/openstack/", "the legacy tree"),
        ],
    },
];

/// The paths known for `platform` (as `--platform` names it).
pub fn facts(platform: &str) -> Option<&'static PathFacts> {
    PATH_FACTS.iter().find(|f| f.platform == platform)
}

/// The safe profile of `platform` as served access: its paths, GET and HEAD (and PUT where a
/// token request is among them), its query parameters.
pub fn safe(platform: &str) -> Option<Access> {
    let f = facts(platform)?;
    let mut methods = Methods::READ;
    let mut paths = Vec::new();
    for p in f.safe {
        if let Some(m) = Methods::parse(p.method) {
            methods = methods.union(m);
        }
        paths.push(PathRule::parse(p.path).ok()?);
    }
    Some(Access { paths, methods, query: f.query.iter().map(|q| (*q).to_owned()).collect() })
}

/// The sensitive paths of `platform` that `rule` reaches; a rule that covers the whole
/// service (`/`) reaches every one.
pub fn reached(platform: &str, rule: &PathRule) -> Vec<&'static Sensitive> {
    let Some(f) = facts(platform) else { return Vec::new() };
    f.sensitive
        .iter()
        .filter(|s| PathRule::parse(s.path).is_ok_and(|never| rule.overlaps(&never)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Safe paths written with a trailing `/` (a prefix): leaves a client library asks for
    /// that way (botocore, the availability zone).
    const LEAVES_ASKED_AS_DIRECTORIES: [&str; 1] =
        ["/latest/meta-data/placement/availability-zone/"];

    #[test]
    fn every_path_parses_and_no_safe_path_reaches_a_sensitive_one() {
        for f in PATH_FACTS {
            assert!(
                super::super::platforms::facts(f.platform).is_some(),
                "{}: not a platform of the platform table",
                f.platform
            );
            for s in f.sensitive {
                PathRule::parse(s.path).unwrap_or_else(|e| panic!("{}: {e}", s.path));
            }
            let access = safe(f.platform).expect("the safe profile builds");
            assert_eq!(access.paths.len(), f.safe.len());
            for rule in &access.paths {
                // Exact, but for a leaf that clients ask for with a trailing `/` (nothing
                // lives below it).
                let leaf = LEAVES_ASKED_AS_DIRECTORIES.contains(&rule.as_str());
                assert!(!rule.is_prefix() || leaf, "{rule}: safe paths are exact");
                assert!(reached(f.platform, rule).is_empty(), "{}: {rule}", f.platform);
            }
        }
    }

    #[test]
    fn parents_of_a_sensitive_path_reach_it() {
        let reached_by = |p: &str| {
            reached("AWS", &PathRule::parse(p).expect(p)).iter().map(|s| s.path).collect::<Vec<_>>()
        };
        assert!(reached_by("/latest/meta-data/").contains(&"/latest/meta-data/iam/"));
        assert!(reached_by("/").len() == facts("AWS").map_or(0, |f| f.sensitive.len()));
        assert_eq!(
            reached_by("/latest/meta-data/iam/security-credentials/role"),
            ["/latest/meta-data/iam/"]
        );
        assert!(reached_by("/latest/meta-data/placement/").is_empty());
    }

    #[test]
    fn token_requests_bring_put() {
        let aws = safe("AWS").expect("AWS has a profile");
        assert!(aws.methods.contains(Methods::PUT));
        assert!(aws.judge("PUT", "/latest/api/token").is_ok());
        assert!(aws.judge("GET", "/latest/meta-data/iam/security-credentials/").is_err());
        let gcp = safe("GCP").expect("GCP has a profile");
        assert!(!gcp.methods.contains(Methods::PUT));
        assert!(gcp.judge("GET", "/computeMetadata/v1/instance/zone?recursive=true").is_err());
        let azure = safe("Azure").expect("Azure has a profile");
        assert!(
            azure
                .judge(
                    "GET",
                    "/metadata/instance/compute/location?api-version=2021-02-01&format=text"
                )
                .is_ok()
        );
        assert!(safe("BareMetal").is_none());
    }
}
