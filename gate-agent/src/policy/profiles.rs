//! Served-path profiles: per platform, the paths a profile names (`profile: safe`: those that
//! tell a workload where it runs and nothing that authenticates it), as the access the
//! metadata proxy serves, and the paths that must never be served (credentials, tokens, user
//! data, SSH keys, signed identity documents), which `check` warns about. The paths are the
//! rows of [`Platform`]; docs/platforms.md gives the source of every one.
use gate_common::http::{Access, Methods, PathRule};

use super::platform::{Platform, Sensitive};

/// Every profile name some platform offers, each once (for messages).
pub fn names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Vec::new();
    for p in Platform::all().flat_map(|p| p.facts().profiles) {
        if !names.contains(&p.name) {
            names.push(p.name);
        }
    }
    names
}

/// Profile `name` of `platform` (as `--platform` or a policy's `platform` names it) as served
/// access: its paths, GET and HEAD (and PUT where a token request is among them), its query
/// parameters. `None` where the platform has no such profile.
pub fn access(platform: &str, name: &str) -> Option<Access> {
    let profile = Platform::from_name(platform)?.profile(name)?;
    let mut methods = Methods::READ;
    let mut paths = Vec::new();
    for p in profile.paths {
        if let Some(m) = Methods::parse(p.method) {
            methods = methods.union(m);
        }
        paths.push(PathRule::parse(p.path).ok()?);
    }
    Some(Access { paths, methods, query: profile.query.iter().map(|q| (*q).to_owned()).collect() })
}

/// The sensitive paths of `platform` that `rule` reaches; a rule that covers the whole
/// service (`/`) reaches every one.
pub fn reached(platform: &str, rule: &PathRule) -> Vec<&'static Sensitive> {
    let Some(p) = Platform::from_name(platform) else { return Vec::new() };
    p.facts()
        .sensitive
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
        for p in Platform::all() {
            let f = p.facts();
            for s in f.sensitive {
                PathRule::parse(s.path).unwrap_or_else(|e| panic!("{}: {e}", s.path));
            }
            for profile in f.profiles {
                let access = access(f.name, profile.name).expect("the profile builds");
                assert_eq!(access.paths.len(), profile.paths.len());
                for rule in &access.paths {
                    // Exact, but for a leaf that clients ask for with a trailing `/`
                    // (nothing lives below it).
                    let leaf = LEAVES_ASKED_AS_DIRECTORIES.contains(&rule.as_str());
                    assert!(!rule.is_prefix() || leaf, "{rule}: safe paths are exact");
                    assert!(reached(f.name, rule).is_empty(), "{p}: {rule}");
                }
            }
            // A platform with a metadata service says what must never be served.
            if f.no_metadata_service.is_none() {
                assert!(!f.sensitive.is_empty(), "{p}: no sensitive paths");
                assert!(!f.profiles.is_empty(), "{p}: no profile");
            }
        }
        assert_eq!(names(), ["safe"]);
    }

    #[test]
    fn parents_of_a_sensitive_path_reach_it() {
        let reached_by = |p: &str| {
            reached("AWS", &PathRule::parse(p).expect(p)).iter().map(|s| s.path).collect::<Vec<_>>()
        };
        assert!(reached_by("/latest/meta-data/").contains(&"/latest/meta-data/iam/"));
        assert!(reached_by("/").len() == Platform::Aws.facts().sensitive.len());
        assert_eq!(
            reached_by("/latest/meta-data/iam/security-credentials/role"),
            ["/latest/meta-data/iam/"]
        );
        assert!(reached_by("/latest/meta-data/placement/").is_empty());
    }

    /// GCE's detection probe (`GET /` with `Metadata-Flavor: Google`, google-auth's `ping`)
    /// and the v1 root are served, alone: nothing below either, no `recursive` listing.
    #[test]
    fn gcp_serves_the_detection_probe_and_not_its_subtree() {
        let gcp = access("GCP", "safe").expect("GCP has a profile");
        for ok in ["/", "/computeMetadata/v1/", "/computeMetadata/v1/instance/zone"] {
            assert_eq!(gcp.judge("GET", ok), Ok(()), "{ok}");
            assert_eq!(gcp.judge("HEAD", ok), Ok(()), "{ok}");
        }
        for refused in [
            "/computeMetadata/v1/instance/service-accounts/default/token",
            "/computeMetadata/v1/instance/attributes/kube-env",
            "/computeMetadata/v1/instance/",
            "/computeMetadata/v1",
            "/computeMetadata/",
            "/computeMetadata/v1beta1/",
            "/0.1/meta-data/",
        ] {
            assert!(gcp.judge("GET", refused).is_err(), "{refused} is served");
        }
        assert!(gcp.judge("GET", "/?recursive=true").is_err());
        assert!(gcp.judge("GET", "/computeMetadata/v1/?recursive=true").is_err());
        for rule in gcp.paths.iter().filter(|r| r.path().ends_with('/')) {
            assert!(!rule.is_prefix(), "{rule}");
            assert!(rule.as_str().starts_with('='), "{rule}");
        }
    }

    #[test]
    fn token_requests_bring_put() {
        let aws = access("AWS", "safe").expect("AWS has a profile");
        assert!(aws.methods.contains(Methods::PUT));
        assert!(aws.judge("PUT", "/latest/api/token").is_ok());
        assert!(aws.judge("GET", "/latest/meta-data/iam/security-credentials/").is_err());
        let gcp = access("GCP", "safe").expect("GCP has a profile");
        assert!(!gcp.methods.contains(Methods::PUT));
        assert!(gcp.judge("GET", "/computeMetadata/v1/instance/zone?recursive=true").is_err());
        let azure = access("Azure", "safe").expect("Azure has a profile");
        assert!(
            azure
                .judge(
                    "GET",
                    "/metadata/instance/compute/location?api-version=2021-02-01&format=text"
                )
                .is_ok()
        );
        assert!(access("BareMetal", "safe").is_none());
        assert!(access("AWS", "strict").is_none());
    }
}
