//! `gate-agent explain`: the verdict for one workload and destination, and why — decided by
//! gate-common's own functions ([`match_endpoint`], [`cgroup_allowed`], [`decide`]) over the
//! LIVE pinned maps, as the kernel programs decide it.
use std::{
    fmt::Write as _,
    net::IpAddr,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use aya::maps::lpm_trie::Key;
use gate_common::{
    abi::{
        AllowKey, ENTRY_SERVED, GEN_PREFIX_BITS, GRANT_METADATA, GRANT_PROXY, PROTO_TCP, PROTO_UDP,
        PortRuleKey, PrefixV4, PrefixV6, PrefixValue, allow_entry,
    },
    user::{Mode, Verdict},
    verdict::{Addr, Dst, Tables, cgroup_allowed, decide, match_endpoint, proxy_route},
};
use serde::Serialize;

use super::{InspectError, Pinned};
use crate::{cgroup::GatedRoot, policy::Policy, proxy::Table};

/// The pinned maps as gate-common's [`Tables`]: the very lookups the programs make (the LPM
/// trie lookup is longest-prefix in the kernel, as in the programs).
struct PinnedTables<'a>(&'a Pinned);

impl Tables for PinnedTables<'_> {
    fn prefix_v4(&self, generation: u32, addr: [u8; 4]) -> Option<PrefixValue> {
        let key = Key::new(GEN_PREFIX_BITS + 32, PrefixV4::new(generation, addr));
        self.0.maps.v4.get(&key, 0).ok()
    }
    fn prefix_v6(&self, generation: u32, addr: [u8; 16]) -> Option<PrefixValue> {
        let key = Key::new(GEN_PREFIX_BITS + 128, PrefixV6::new(generation, addr));
        self.0.maps.v6.get(&key, 0).ok()
    }
    fn port_rule(&self, key: &PortRuleKey) -> Option<u32> {
        self.0.maps.rules.get(key, 0).ok()
    }
    fn allowed(&self, key: &AllowKey) -> Option<u32> {
        self.0.maps.allowed.get(key, 0).ok()
    }
}

/// A destination as written: `ADDR[:PORT][/PROTO]` (`[v6]:port` for IPv6 with a port).
pub(crate) fn parse_dst(s: &str) -> Result<Dst, String> {
    let (hostport, proto) = match s.rsplit_once('/') {
        Some((h, p)) => (h, Some(p)),
        None => (s, None),
    };
    let proto = match proto.map(str::to_ascii_uppercase).as_deref() {
        None | Some("TCP") => PROTO_TCP,
        Some("UDP") => PROTO_UDP,
        Some(p) => return Err(format!("protocol {p:?}: TCP or UDP")),
    };
    let (addr, port) = if let Some(rest) = hostport.strip_prefix('[') {
        let (a, p) = rest.split_once(']').ok_or("unclosed [ in an IPv6 address")?;
        (a, p.strip_prefix(':'))
    } else if hostport.matches(':').count() == 1 {
        let (a, p) = hostport.split_once(':').ok_or("address")?;
        (a, Some(p))
    } else {
        (hostport, None)
    };
    let ip: IpAddr = addr.parse().map_err(|e| format!("address {addr:?}: {e}"))?;
    let port = match port {
        Some(p) => p.parse::<u16>().map_err(|e| format!("port {p:?}: {e}"))?,
        None => 80,
    };
    Ok(Dst { addr: Addr::from(ip), port, proto })
}

/// One cgroup on the way from the root to the workload's, and whether it is on the allow set.
#[derive(Debug, Serialize)]
pub(crate) struct Step {
    pub cgroup: String,
    pub id: u64,
    /// Index of the allow entry that put it on the allow set.
    pub allow_entry: Option<u32>,
}

/// The verdict for one destination.
#[derive(Debug, Serialize)]
pub(crate) struct Explanation {
    pub generation: u32,
    pub mode: &'static str,
    pub cgroup: String,
    /// The cgroups below the gated root, outermost first: an allow entry on any allows.
    pub path: Vec<Step>,
    pub dst: String,
    pub port: u16,
    pub proto: &'static str,
    /// The protected endpoint the destination falls under, if any.
    pub endpoint: Option<String>,
    pub verdict: &'static str,
    pub why: String,
    /// For a connect that goes through the metadata proxy, and a request asked about: the
    /// proxy's decision on it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request: Option<RequestVerdict>,
}

/// A request asked about (`--path`), as the metadata proxy would decide it.
#[derive(Debug, Serialize)]
pub(crate) struct RequestVerdict {
    pub method: String,
    pub path: String,
    /// `served`, `refused`, or `audited` (served in audit mode, though the policy refuses it).
    pub verdict: &'static str,
    pub why: String,
}

/// The request `explain` is asked about, and the policy to judge it by.
pub(crate) struct Request<'a> {
    pub method: &'a str,
    pub target: &'a str,
    /// The policy in force, as the agent kept it (its hash must be the live one's).
    pub policy: &'a Policy,
}

impl Explanation {
    /// The exit code for scripts: 0 passes (unprotected, allowed, or a request the proxy
    /// serves), 1 denied (or a request the proxy refuses), 2 audited, 3 through the proxy with
    /// no request asked about (it serves some paths and refuses the rest).
    pub(crate) fn exit_code(&self) -> u8 {
        match (self.verdict, self.request.as_ref().map(|r| r.verdict)) {
            (_, Some("served")) => 0,
            (_, Some("refused")) | ("denied", _) => 1,
            (_, Some(_)) | ("audited", _) => 2,
            ("proxied", None) => 3,
            _ => 0,
        }
    }

    pub(crate) fn render(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "{} {}:{}/{} from {}",
            self.verdict.to_uppercase(),
            self.dst,
            self.port,
            self.proto,
            self.cgroup
        );
        let _ = writeln!(o, "  why: {}", self.why);
        if let Some(r) = &self.request {
            let _ = writeln!(
                o,
                "  request: {} {} {}: {}",
                r.method,
                r.path,
                r.verdict.to_uppercase(),
                r.why
            );
        }
        let _ = writeln!(
            o,
            "  endpoint: {}",
            self.endpoint.as_deref().unwrap_or("(none: not protected)")
        );
        let _ =
            writeln!(o, "  policy: generation {} in the maps, mode {}", self.generation, self.mode);
        for s in &self.path {
            let allow = match s.allow_entry {
                Some(e) => format!("on the allow set (entry #{e})"),
                None => "not on the allow set".into(),
            };
            let _ = writeln!(o, "  cgroup {} (id {}): {allow}", s.cgroup, s.id);
        }
        o
    }
}

/// The cgroups from just below `root` down to `cgroup`: (relative path, id), outermost
/// first.
fn steps(root: &GatedRoot, cgroup: &Path) -> Result<Vec<(PathBuf, u64)>, InspectError> {
    let rel = cgroup.strip_prefix(&root.path).map_err(|_| InspectError::Target {
        what: cgroup.display().to_string(),
        reason: format!(
            "not below the gated root {}: the gate does not apply",
            root.path.display()
        ),
    })?;
    let mut out = Vec::new();
    let mut at = PathBuf::new();
    for c in rel.components() {
        at.push(c);
        let meta = std::fs::metadata(root.path.join(&at)).map_err(|e| InspectError::Target {
            what: root.path.join(&at).display().to_string(),
            reason: e.to_string(),
        })?;
        out.push((at.clone(), meta.ino()));
    }
    Ok(out)
}

/// Explain the verdict for traffic from `cgroup` (an absolute cgroup directory) to `dst`, and
/// for `request` where the connect goes through the metadata proxy.
pub(crate) fn explain(
    pinned: &Pinned,
    cgroup: &Path,
    dst: &Dst,
    request: Option<&Request<'_>>,
) -> Result<Explanation, InspectError> {
    let root = pinned.root.as_ref().ok_or_else(|| InspectError::Target {
        what: pinned.root_path.clone(),
        reason: "the gated root the gate protects no longer exists".into(),
    })?;
    let chain = steps(root, cgroup)?;
    let g = pinned.generation;
    let t = PinnedTables(pinned);
    let meta = pinned.maps.policy_meta(g)?;
    let mode = Mode::from_kernel(meta.mode);
    let path: Vec<Step> = chain
        .iter()
        .map(|(rel, id)| Step {
            cgroup: rel.display().to_string(),
            id: *id,
            allow_entry: t.allowed(&AllowKey::new(g, *id)).map(allow_entry),
        })
        .collect();
    let ancestor = |level: u32| {
        level.checked_sub(root.level + 1).and_then(|i| chain.get(i as usize)).map_or(0, |c| c.1)
    };
    let endpoint = match_endpoint(&t, g, dst);
    let allowed =
        endpoint.and_then(|_| cgroup_allowed(&t, g, root.level, GRANT_METADATA, ancestor));
    // As the connect programs decide it: through the proxy only where one is configured.
    let route = match (endpoint, allowed) {
        (Some(_), None) if proxy_configured(pinned) => {
            proxy_route(meta.mode, meta.served, dst, || {
                cgroup_allowed(&t, g, root.level, GRANT_PROXY, ancestor)
            })
        }
        _ => None,
    };
    let (verdict, why) = match (endpoint, allowed, route) {
        (None, ..) => (
            Verdict::Unmatched,
            "the destination is not a protected endpoint (address, port and protocol)".to_owned(),
        ),
        (Some(_), Some(entry), _) => (
            Verdict::Allowed,
            format!(
                "allow entry #{entry} puts this cgroup or an ancestor below the root on the allow set"
            ),
        ),
        (Some(_), None, Some(ENTRY_SERVED)) => (
            Verdict::Proxied,
            "no allow entry covers this cgroup: its HTTP connects go to the metadata proxy, which \
             serves the policy's `served` paths (in audit mode: every path) and refuses the rest"
                .to_owned(),
        ),
        (Some(_), None, Some(entry)) => (
            Verdict::Proxied,
            format!(
                "allow entry #{entry} lists paths: its HTTP connects go to the metadata proxy, \
                 which serves those paths and refuses the rest"
            ),
        ),
        (Some(_), None, None) => {
            let v = Verdict::from_id(decide(meta.mode, false)).unwrap_or(Verdict::Denied);
            let why = if v == Verdict::Audited {
                "no allow entry covers this cgroup; audit mode lets it through and logs it"
            } else {
                "no allow entry covers this cgroup or an ancestor below the gated root"
            };
            (v, why.to_owned())
        }
    };
    let request = match (route, request) {
        (Some(entry), Some(r)) => Some(judge_request(pinned, entry, r)?),
        _ => None,
    };
    let (addr, proto) = (IpAddr::from(dst.addr).to_string(), dst.proto);
    Ok(Explanation {
        generation: g,
        mode: mode.name(),
        cgroup: cgroup.display().to_string(),
        path,
        dst: addr,
        port: dst.port,
        proto: if proto == PROTO_UDP { "UDP" } else { "TCP" },
        endpoint: endpoint.map(|e| pinned.endpoint(e)),
        verdict: match verdict {
            Verdict::Unmatched => "unprotected",
            v => v.name(),
        },
        why,
        request,
    })
}

/// Whether the pinned gate sends connects to a metadata proxy (as the programs read it).
fn proxy_configured(pinned: &Pinned) -> bool {
    pinned.maps.proxy.get(&0, 0).is_ok_and(|c| c.port != 0)
}

/// The proxy's decision on `request` from a caller recorded under `entry`: the same table and
/// judge the proxy uses, over the policy the agent kept, which must be the live one.
fn judge_request(
    pinned: &Pinned,
    entry: u32,
    request: &Request<'_>,
) -> Result<RequestVerdict, InspectError> {
    let hash = request.policy.hash();
    if hash.0 != pinned.policy_hash {
        return Err(InspectError::Target {
            what: "--path".into(),
            reason: format!(
                "the kept policy (hash {hash}) is not the live one (hash {:016x}): the agent has \
                 not kept the policy in force; run explain where the agent keeps its state \
                 (--state-dir)",
                pinned.policy_hash
            ),
        });
    }
    let table = Table::new(request.policy, pinned.generation);
    let entry = (entry != ENTRY_SERVED).then_some(entry);
    let (verdict, why) = crate::proxy::judge_request(&table, entry, request.method, request.target);
    Ok(RequestVerdict {
        method: request.method.to_owned(),
        path: request.target.to_owned(),
        verdict,
        why,
    })
}

/// Every protected destination of the live policy, one per (prefix, port, protocol) rule:
/// the prefix's first address (what `explain` checks when no destination is named).
pub(crate) fn protected_destinations(pinned: &Pinned) -> Vec<Dst> {
    let g = pinned.generation;
    let mut rules: std::collections::BTreeMap<u32, Vec<(u16, u8)>> = Default::default();
    for k in pinned.maps.rules.keys().flatten() {
        if k.generation == g {
            rules.entry(k.set_id).or_default().push((k.port, k.proto));
        }
    }
    let mut out = Vec::new();
    let mut add = |addr: Addr, set_id: u32| {
        for &(port, proto) in rules.get(&set_id).into_iter().flatten() {
            let proto = if proto == 0 { PROTO_TCP } else { proto };
            let port = if port == 0 { 80 } else { port };
            out.push(Dst { addr, port, proto });
        }
    };
    for (k, v) in pinned.maps.v4.iter().flatten() {
        if u32::from_be_bytes(k.data().generation) & 1 == g {
            add(Addr::v4(k.data().addr), v.set_id);
        }
    }
    for (k, v) in pinned.maps.v6.iter().flatten() {
        if u32::from_be_bytes(k.data().generation) & 1 == g {
            add(Addr::v6(k.data().addr), v.set_id);
        }
    }
    out.sort_by_key(|d| (format!("{:?}", d.addr), d.port, d.proto));
    out.dedup();
    out
}

/// The cgroup of `NAMESPACE/POD[/CONTAINER]` on this node, from the pod the API server
/// reports and the kubelet's cgroup naming below the gated root: the container's cgroup if
/// one is named, else the pod's.
pub(crate) async fn pod_cgroup(
    kubeconfig: Option<&Path>,
    target: &str,
    root: &GatedRoot,
) -> Result<PathBuf, InspectError> {
    use crate::cluster::identity::{PodCgroups, PodInfo};
    let bad =
        |reason: &str| InspectError::Target { what: target.to_owned(), reason: reason.into() };
    let mut parts = target.splitn(3, '/');
    let (Some(ns), Some(name)) = (parts.next(), parts.next()) else {
        return Err(bad("expected NAMESPACE/POD[/CONTAINER]"));
    };
    let container = parts.next();
    let client = crate::cluster::watches::client(kubeconfig)
        .await
        .map_err(|e| InspectError::Kube(format!("{e:#}")))?;
    let api: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(client, ns);
    let pod = api.get(name).await.map_err(|e| InspectError::Kube(e.to_string()))?;
    let info = PodInfo::from_pod(&pod).map_err(|e| bad(&e.to_string()))?;
    let cgroups = PodCgroups::new(&root.path);
    let rel = match container {
        Some(c) => {
            let c = info
                .containers
                .iter()
                .find(|x| x.name == c)
                .ok_or_else(|| bad(&format!("the pod has no container {c:?}")))?;
            info.container_cgroup(cgroups.driver, c)
                .ok_or_else(|| bad("the container has not started (no container id yet)"))?
        }
        None => info.pod_cgroup(cgroups.driver),
    };
    let path = root.path.join(cgroups.localize(rel));
    if !path.exists() {
        return Err(bad(&format!(
            "{} does not exist on this node (is the pod here?)",
            path.display()
        )));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_parse() {
        let d = parse_dst("169.254.169.254:80/tcp").unwrap();
        assert_eq!((d.addr, d.port, d.proto), (Addr::v4([169, 254, 169, 254]), 80, PROTO_TCP));
        let d = parse_dst("[fd00:ec2::254]:53/UDP").unwrap();
        assert_eq!((d.port, d.proto), (53, PROTO_UDP));
        assert_eq!(parse_dst("fd00:ec2::254").unwrap().port, 80);
        assert_eq!(
            parse_dst("::ffff:169.254.169.254").unwrap().addr,
            Addr::v4([169, 254, 169, 254])
        );
        assert!(parse_dst("169.254.169.254:80/sctp").is_err());
        assert!(parse_dst("nope:80").is_err());
    }
}
