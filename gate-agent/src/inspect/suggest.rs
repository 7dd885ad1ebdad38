//! `suggest`: allow entries written from the evidence of `report`'s records.
use std::{collections::BTreeMap, fmt::Write as _};

use crate::access::{AccessRecord, Counts, Identity};

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

/// Allow entries for the workloads that were denied or audited (those already allowed are
/// fine as they are): one per owner — namespace, the owner's pod labels without the ones
/// its controller generates, service account, hostNetwork and the containers that made the
/// accesses — or, for cgroups known by path only, one `cgroup:` entry each. A YAML list
/// to paste under `allow:`, each entry commented with its evidence.
pub(crate) fn suggest(records: &[AccessRecord]) -> String {
    struct Group<'a> {
        first: &'a Identity,
        containers: std::collections::BTreeSet<String>,
        endpoints: std::collections::BTreeSet<String>,
        counts: Counts,
    }
    let mut groups: BTreeMap<String, Group<'_>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.counts.denied + r.counts.audited > 0) {
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
        });
        g.containers.extend(id.container.clone());
        g.endpoints.insert(r.endpoint.clone());
        g.counts.add(r.counts);
    }
    let mut o = String::new();
    for g in groups.values() {
        let id = g.first;
        let endpoints = g.endpoints.iter().cloned().collect::<Vec<_>>().join(", ");
        let _ = writeln!(
            o,
            "# {} refused {} times, audited {} times ({endpoints})",
            id.owner.as_deref().unwrap_or(&id.workload),
            g.counts.denied,
            g.counts.audited
        );
        let Some(ns) = &id.namespace else {
            let path = id.cgroup.as_deref().unwrap_or(&id.workload);
            let _ = writeln!(o, "- name: {}", entry_name(path));
            let _ = writeln!(o, "  cgroup: {}", yaml_str(path));
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
                    "  # a pod-network pod: node-level enforcement refuses its forwarded traffic\n  \
                     # whatever this entry says; run it with hostNetwork: true, or gate host-network\n  \
                     # pods only (--gate-scope host-network-only)"
                );
            }
        }
        if !g.containers.is_empty() {
            let list: Vec<String> = g.containers.iter().map(|c| yaml_str(c)).collect();
            let _ = writeln!(o, "  containers: [{}]", list.join(", "));
        }
    }
    if o.is_empty() {
        o.push_str("# no workload was refused or audited: nothing to allow\n");
    }
    o
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
