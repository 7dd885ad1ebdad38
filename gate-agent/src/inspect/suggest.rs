//! `suggest`: allow entries written from the evidence of `report`'s records.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use gate_common::http::{Methods, PathRule};

use crate::{
    access::{AccessRecord, Counts, Identity},
    policy::profiles,
};

/// Labels a controller sets on the pods it makes; never part of an owner's selector.
const GENERATED_LABELS: &[&str] = &[
    "pod-template-hash",
    "controller-revision-hash",
    "pod-template-generation",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
    "batch.kubernetes.io/controller-uid",
    "controller-uid",
    "batch.kubernetes.io/job-name",
    "job-name",
];

/// Allow entries for the workloads that were denied or audited, or asked the metadata proxy
/// for a path it refused or audited (those served all they asked are fine as they are): one
/// per owner — namespace, the owner's pod labels without the ones its controller generates,
/// service account, hostNetwork and the containers that made the accesses — or, for cgroups
/// known by path only, one `cgroup:` entry each. A workload seen through the proxy gets the
/// smallest `paths:` that serves what it asked for: the exact paths (`=/…/` where one ends
/// in `/`), the methods beyond GET
/// and HEAD, the query parameters; a path that reaches one of `platform`'s sensitive paths
/// (credentials, user data) is written commented out, for the operator to decide. A YAML list
/// to paste under `allow:`, each entry commented with its evidence.
pub(crate) fn suggest(records: &[AccessRecord], platform: Option<&str>) -> String {
    struct Group<'a> {
        first: &'a Identity,
        containers: BTreeSet<String>,
        endpoints: BTreeSet<String>,
        counts: Counts,
        paths: BTreeSet<&'a str>,
        methods: BTreeSet<&'a str>,
        query: BTreeSet<&'a str>,
        path_refusals: u64,
    }
    let wants_entry = |r: &AccessRecord| {
        r.counts.denied + r.counts.audited > 0
            || r.paths.iter().any(|p| p.counts.refused + p.counts.audited > 0)
    };
    let mut groups: BTreeMap<String, Group<'_>> = BTreeMap::new();
    for r in records.iter().filter(|r| wants_entry(r)) {
        let id = &r.identity;
        let key = match (&id.namespace, &id.owner, &id.pod) {
            (Some(ns), Some(owner), _) => format!("{ns}/{owner}"),
            (Some(ns), None, Some(pod)) => format!("{ns}/Pod/{pod}"),
            _ => format!("cgroup:{}", id.cgroup.as_deref().unwrap_or(&id.workload)),
        };
        let g = groups.entry(key).or_insert_with(|| Group {
            first: id,
            containers: Default::default(),
            endpoints: Default::default(),
            counts: Counts::default(),
            paths: Default::default(),
            methods: Default::default(),
            query: Default::default(),
            path_refusals: 0,
        });
        g.containers.extend(id.container.clone());
        g.endpoints.insert(r.endpoint.clone());
        g.counts.add(r.counts);
        for p in &r.paths {
            g.paths.insert(&p.path);
            g.methods.insert(&p.method);
            g.query.extend(p.query.iter().map(String::as_str));
            g.path_refusals += p.counts.refused + p.counts.audited;
        }
    }
    let mut o = String::new();
    for g in groups.values() {
        let id = g.first;
        let endpoints = g.endpoints.iter().cloned().collect::<Vec<_>>().join(", ");
        let _ = writeln!(
            o,
            "# {} denied {} times, audited {} times, {} paths refused or audited ({endpoints})",
            id.owner.as_deref().unwrap_or(&id.workload),
            g.counts.denied,
            g.counts.audited,
            g.path_refusals,
        );
        let Some(ns) = &id.namespace else {
            let path = id.cgroup.as_deref().unwrap_or(&id.workload);
            let _ = writeln!(o, "- name: {}", entry_name(path));
            let _ = writeln!(o, "  cgroup: {}", yaml_str(path));
            write_paths(&mut o, &g.paths, &g.methods, &g.query, platform);
            continue;
        };
        let name = id.owner.as_deref().map_or(id.pod.as_deref().unwrap_or("pod"), |o| {
            o.split_once('/').map_or(o, |(_, n)| n)
        });
        let _ = writeln!(o, "- name: {}", entry_name(&format!("{ns}-{name}")));
        let _ = writeln!(o, "  namespace: {}", yaml_str(ns));
        let labels: Vec<_> =
            id.labels.iter().filter(|(k, _)| !GENERATED_LABELS.contains(&k.as_str())).collect();
        if !labels.is_empty() {
            let _ = writeln!(o, "  podSelector:\n    matchLabels:");
            for (k, v) in labels {
                let _ = writeln!(o, "      {}: {}", yaml_str(k), yaml_str(v));
            }
        }
        if let Some(sa) = &id.service_account {
            let _ = writeln!(o, "  serviceAccount: {}", yaml_str(sa));
        }
        match id.host_network {
            Some(true) => {
                let _ = writeln!(o, "  hostNetwork: true");
            }
            _ => {
                let _ = writeln!(
                    o,
                    "  # a pod-network pod: node-level enforcement denies its forwarded traffic\n  \
                     # whatever this entry says; run it with hostNetwork: true, or gate host-network\n  \
                     # pods only (--gate-scope host-network-only)"
                );
            }
        }
        if !g.containers.is_empty() {
            let list: Vec<String> = g.containers.iter().map(|c| yaml_str(c)).collect();
            let _ = writeln!(o, "  containers: [{}]", list.join(", "));
        }
        write_paths(&mut o, &g.paths, &g.methods, &g.query, platform);
    }
    if o.is_empty() {
        o.push_str("# no workload was denied, refused or audited: nothing to allow\n");
    }
    o
}

/// `paths:` (and `methods:`, `queryParameters:`) for the paths a workload asked for, if it
/// asked through the proxy at all. A path reaching a sensitive one is commented out; with
/// none left, `paths: []`, which `check` rejects: never an entry without paths, which would
/// open the whole service.
fn write_paths(
    o: &mut String,
    paths: &BTreeSet<&str>,
    methods: &BTreeSet<&str>,
    query: &BTreeSet<&str>,
    platform: Option<&str>,
) {
    if paths.is_empty() {
        return;
    }
    let reaches = |p: &str| {
        let Some(platform) = platform else { return Vec::new() };
        PathRule::parse(p).map_or_else(
            |_| Vec::new(),
            |rule| profiles::reached(platform, &rule).iter().map(|s| s.reveals).collect(),
        )
    };
    let mut lines = Vec::new();
    let mut kept = 0;
    for asked in paths {
        // What it asked, exactly: `=` before a path ending in `/`, which alone would be a
        // prefix of the whole tree below it (`/` of the whole service).
        let rule = if asked.ends_with('/') { format!("={asked}") } else { (*asked).to_owned() };
        let p = rule.as_str();
        let what = reaches(p);
        if what.is_empty() {
            kept += 1;
            lines.push(format!("    - {}", yaml_str(p)));
        } else {
            lines.push(format!(
                "    # - {}  (reaches {}: uncomment only if it needs them)",
                yaml_str(p),
                what.join(", ")
            ));
        }
    }
    if kept == 0 {
        let _ = writeln!(o, "  paths: []  # every path it asked for is sensitive: decide");
        lines.iter().for_each(|l| {
            let _ = writeln!(o, "{l}");
        });
    } else {
        let _ = writeln!(o, "  paths:");
        lines.iter().for_each(|l| {
            let _ = writeln!(o, "{l}");
        });
    }
    // GET and HEAD are the default; anything else the workload used is listed with them.
    if methods.iter().any(|m| !matches!(*m, "GET" | "HEAD")) {
        let mut all: BTreeSet<&str> = ["GET", "HEAD"].into();
        all.extend(methods.iter().copied());
        let names: Vec<String> = Methods::NAMES
            .iter()
            .filter(|(n, _)| all.contains(n))
            .map(|(n, _)| yaml_str(n))
            .collect();
        let _ = writeln!(o, "  methods: [{}]", names.join(", "));
    }
    if !query.is_empty() {
        let list: Vec<String> = query.iter().map(|q| yaml_str(q)).collect();
        let _ = writeln!(o, "  queryParameters: [{}]", list.join(", "));
    }
}

/// An allow entry name from free text: lower case, `[a-z0-9-]`, at most 63 characters.
fn entry_name(s: &str) -> String {
    let mut n: String = s
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .collect();
    n = n.trim_matches('-').to_owned();
    n.truncate(63);
    if n.is_empty() { "workload".into() } else { n }
}

/// A YAML scalar, quoted.
fn yaml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn entry_names_are_dns_labels() {
        assert_eq!(super::entry_name("Kube-System/My_Pod"), "kube-system-my-pod");
        assert_eq!(super::entry_name("--"), "workload");
    }
}
