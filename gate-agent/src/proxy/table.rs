//! What the proxy serves under one policy generation: each allow entry's access block, by the
//! index the kernel reports, and `served`'s.
use gate_common::{
    http::Access,
    user::{Mode, PolicyHash},
};

use crate::policy::{
    Platform, Policy, Rate, SERVED_RATE, ServedPaths,
    platform::{AnswerGate, ProxyFacts, SessionScheme},
};

/// The access blocks of one policy, as applied under one generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Table {
    generation: u32,
    hash: PolicyHash,
    /// By allow entry index: its name, and its paths if it lists any.
    entries: Vec<(String, Option<Block>)>,
    served: Option<Block>,
    /// Endpoint names, by the index the kernel records.
    endpoints: Vec<String>,
    /// Audit mode: every path is served, and what the policy would refuse is recorded.
    audit: bool,
    /// The platform's session tokens and what a cached answer needs.
    proxy: ProxyFacts,
    /// The paths whose answers are kept (exact, the platform's fixed values).
    fixed: Vec<&'static str>,
}

/// What one entry (or `served`) is served.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Block {
    access: Access,
    rate: Option<Rate>,
}

impl Block {
    fn of(p: &ServedPaths, default: Option<Rate>) -> Block {
        Block { access: p.access.clone(), rate: p.rate.or(default) }
    }
}

/// The access block a caller gets, the name its refusals give (the entry's, or `served`),
/// and the rate its workload is served at (`None`: no limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant<'a> {
    pub(crate) who: &'a str,
    pub(crate) access: &'a Access,
    pub(crate) rate: Option<Rate>,
}

/// Why a caller has no access block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoGrant<'a> {
    /// The entry (or `served`, when `who` is `served`) lists no paths.
    NoPaths { who: &'a str },
    /// The record names an entry index the policy does not have.
    UnknownEntry(u32),
}

/// What refusals name for callers no entry selects.
pub(crate) const SERVED: &str = "served";

impl Table {
    pub(crate) fn new(policy: &Policy, generation: u32) -> Table {
        Table {
            generation,
            hash: policy.hash(),
            entries: policy
                .allow
                .iter()
                .map(|e| (e.name.clone(), e.paths.as_ref().map(|p| Block::of(p, None))))
                .collect(),
            served: policy.served.as_ref().map(|p| Block::of(p, Some(SERVED_RATE))),
            endpoints: policy.endpoint_names(),
            audit: policy.mode == Mode::Audit,
            proxy: Platform::from_name(&policy.platform)
                .map_or(ProxyFacts::NONE, |p| p.facts().proxy),
            fixed: Platform::from_name(&policy.platform)
                .into_iter()
                .flat_map(|p| p.facts().profiles)
                .flat_map(|profile| profile.paths)
                .filter(|p| p.fixed.is_some() && !p.path.ends_with('/'))
                .map(|p| p.path)
                .collect(),
        }
    }

    /// The platform's session-token scheme, if the proxy issues tokens of its own.
    pub(crate) fn session(&self) -> Option<&SessionScheme> {
        self.proxy.session.as_ref()
    }

    /// What a request must carry for a cached answer.
    pub(crate) fn answers_need(&self) -> AnswerGate {
        self.proxy.answers_need
    }

    /// Whether the answer to `GET path` (no query but the profile's) is kept.
    pub(crate) fn is_fixed(&self, path: &str) -> bool {
        self.fixed.contains(&path)
    }

    /// Whether the policy is in audit mode.
    pub(crate) fn audit(&self) -> bool {
        self.audit
    }

    /// The name of endpoint `index` (as the kernel recorded it).
    pub(crate) fn endpoint(&self, index: u32) -> &str {
        usize::try_from(index).ok().and_then(|i| self.endpoints.get(i)).map_or("(unknown)", |s| s)
    }

    pub(crate) fn generation(&self) -> u32 {
        self.generation
    }

    pub(crate) fn hash(&self) -> PolicyHash {
        self.hash
    }

    /// The access block of allow entry `entry`, or of `served` for `None`.
    pub(crate) fn grant(&self, entry: Option<u32>) -> Result<Grant<'_>, NoGrant<'_>> {
        let (who, access) = match entry {
            None => (SERVED, self.served.as_ref()),
            Some(i) => {
                let Some((name, access)) =
                    usize::try_from(i).ok().and_then(|i| self.entries.get(i))
                else {
                    return Err(NoGrant::UnknownEntry(i));
                };
                (name.as_str(), access.as_ref())
            }
        };
        match access {
            Some(b) => Ok(Grant { who, access: &b.access, rate: b.rate }),
            None => Err(NoGrant::NoPaths { who }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = "platform: AWS
endpoints:
  - {name: imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}
allow:
  - {name: plain, cgroup: plain}
  - name: csi
    cgroup: csi
    paths: [/latest/meta-data/instance-id, /latest/meta-data/placement/]
served:
  paths: [/latest/meta-data/placement/region]
";

    #[test]
    fn entries_by_index_and_served() {
        let policy = Policy::parse("t.yaml", POLICY).expect("policy");
        let t = Table::new(&policy, 7);
        assert_eq!(t.generation(), 7);
        assert_eq!(t.hash(), policy.hash());
        assert_eq!(t.grant(Some(0)), Err(NoGrant::NoPaths { who: "plain" }));
        let csi = t.grant(Some(1)).expect("csi");
        assert_eq!(csi.who, "csi");
        assert!(csi.access.judge("GET", "/latest/meta-data/placement/zone").is_ok());
        assert_eq!(t.grant(Some(2)), Err(NoGrant::UnknownEntry(2)));
        assert_eq!(t.grant(Some(u32::MAX)), Err(NoGrant::UnknownEntry(u32::MAX)));
        assert_eq!((t.endpoint(0), t.endpoint(1), t.audit()), ("imds", "(unknown)", false));
        assert_eq!(csi.rate, None, "an allow entry without `rate` is not limited");
        let served = t.grant(None).expect("served");
        assert_eq!(served.who, SERVED);
        assert_eq!(served.rate, Some(SERVED_RATE), "`served` without `rate`");
        assert!(served.access.judge("GET", "/latest/meta-data/placement/zone").is_err());
        assert!(served.access.judge("GET", "/latest/meta-data/placement/region").is_ok());

        let without = Policy::parse("t.yaml", POLICY.split("served:").next().expect("head"))
            .expect("policy without served");
        assert_eq!(Table::new(&without, 1).grant(None), Err(NoGrant::NoPaths { who: SERVED }));
    }
}
