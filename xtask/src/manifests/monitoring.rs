//! How the agents' metrics are reached and alerted on, across the objects of one render:
//! the listeners of the agent's pod, read from its containers' flags (plain /metrics never
//! beyond loopback; probes on the probe listener; kube-rbac-proxy's upstream is the agent's
//! metrics listener, with its certificate files mounted and its TokenReview and
//! SubjectAccessReview RBAC); Services selecting the agent's pods and reaching a listener off
//! loopback, never plain /metrics; ServiceMonitors selecting Services by a port they have,
//! in the listener's scheme, with credentials and the certificate checks it allows, and a
//! scraper bound to read them; alerting rules read by [`super::promql`], naming only metrics
//! of the agent's catalog ([`families`]) or of [`EXTERNAL`], their labels, and namespaces,
//! DaemonSets and jobs of the render, each with a severity, a summary, a description and a
//! runbook with the four sections of openshift/runbooks.
use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::promql;
use super::{Object, flag, string_list};

/// The agent's metric catalog.
use gate_common::metrics as families;

/// Metrics of other exporters the rules may use, with their labels: kube-state-metrics v2
/// (docs/metrics/workload/pod-metrics.md and daemonset-metrics.md) and Prometheus' own `up`
/// (whose labels are its target's).
const EXTERNAL: &[(&str, &str)] = &[
    ("up", ""),
    (
        "kube_pod_info",
        "namespace pod uid host_ip pod_ip node created_by_kind created_by_name priority_class \
         host_network",
    ),
    ("kube_pod_status_ready", "namespace pod uid condition"),
    ("kube_daemonset_status_desired_number_scheduled", "namespace daemonset"),
    ("kube_daemonset_status_current_number_scheduled", "namespace daemonset"),
    ("kube_daemonset_status_number_ready", "namespace daemonset"),
    ("kube_daemonset_status_number_available", "namespace daemonset"),
    ("kube_daemonset_status_number_unavailable", "namespace daemonset"),
];

/// Labels every scrape of a ServiceMonitor target carries (the Prometheus Operator's).
const SCRAPE_LABELS: &[&str] =
    &["job", "instance", "namespace", "service", "pod", "container", "endpoint"];
/// Labels the scrape of an exporter such as kube-state-metrics adds to its own.
const EXPORTER_LABELS: &[&str] = &["job", "instance"];
const SEVERITIES: &[&str] = &["critical", "warning", "info"];
/// Where the alerts' `runbook_url`s point: this repository's docs/runbooks/, by a URL that
/// names the file. The repository has no public address yet, so the host is a reserved
/// placeholder (RFC 2606 `.invalid`: it resolves nowhere, and never to someone else's page);
/// once published, change it here and in components/monitoring/prometheusrule.yaml (this
/// check holds the two together). docs/runbooks/README.md says the same.
pub(super) const RUNBOOK_BASE: &str = "https://metadata-gate.invalid/blob/main/docs/runbooks/";
/// The runbooks' directory, relative to the workspace root.
const RUNBOOK_DIR: &str = "docs/runbooks";
/// The sections every runbook has, in the openshift/runbooks shape.
const RUNBOOK_SECTIONS: &[&str] = &["## Meaning", "## Impact", "## Diagnosis", "## Mitigation"];
/// The annotation that has OpenShift's service CA sign a certificate into a secret.
const SERVING_CERT: &str =
    "/metadata/annotations/service.beta.openshift.io~1serving-cert-secret-name";

// ---- listeners -----------------------------------------------------------------------------

/// What a listener serves.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Serves {
    /// The agent's `--listen`: /healthz and /readyz, and /metrics unless apart.
    AgentProbes { metrics: bool },
    /// The agent's `--metrics-listen`.
    AgentMetrics,
    /// kube-rbac-proxy: https, authenticated and authorized, in front of `upstream`.
    Proxy { upstream: Option<String>, cert: Option<String>, key: Option<String> },
}

/// A port a container of the pod listens on, as its flags say.
#[derive(Clone, Debug)]
pub(super) struct Listener {
    pub(super) container: String,
    pub(super) host: String,
    pub(super) port: u16,
    serves: Serves,
}

impl Listener {
    fn loopback(&self) -> bool {
        is_loopback(&self.host)
    }

    fn plain_metrics(&self) -> bool {
        matches!(self.serves, Serves::AgentMetrics | Serves::AgentProbes { metrics: true })
    }
}

fn is_loopback(host: &str) -> bool {
    host.starts_with("127.") || host == "::1" || host.eq_ignore_ascii_case("localhost")
}

/// `HOST:PORT`, `[HOST]:PORT` or `:PORT` (all addresses) as (host, port).
fn split_addr(addr: &str) -> Option<(String, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_owned(), port.parse().ok()?))
}

pub(super) fn container_name(c: &Value) -> String {
    c.get("name").and_then(Value::as_str).unwrap_or("?").to_owned()
}

/// The agent's container: the one whose first argument is `run`.
pub(super) fn is_agent(c: &Value) -> bool {
    string_list(c, "/args").first().is_some_and(|a| a == "run")
}

/// Every listener the containers' flags declare, and what cannot be read.
pub(super) fn listeners(containers: &[&Value]) -> (Vec<Listener>, Vec<String>) {
    let (mut out, mut errs) = (Vec::new(), Vec::new());
    for c in containers {
        let args = string_list(c, "/args");
        let container = container_name(c);
        let mut add = |flag_name: &str, addr: &str, serves: Serves| match split_addr(addr) {
            Some((host, port)) => {
                out.push(Listener { container: container.clone(), host, port, serves })
            }
            None => {
                errs.push(format!("container {container}: {flag_name} {addr:?}: not HOST:PORT"))
            }
        };
        if is_agent(c) {
            let metrics = flag(&args, "--metrics-listen");
            let listen = flag(&args, "--listen").unwrap_or_else(|| "127.0.0.1:9750".into());
            add("--listen", &listen, Serves::AgentProbes { metrics: metrics.is_none() });
            if let Some(m) = metrics {
                add("--metrics-listen", &m, Serves::AgentMetrics);
            }
        } else if let Some(addr) = flag(&args, "--secure-listen-address") {
            let serves = Serves::Proxy {
                upstream: flag(&args, "--upstream"),
                cert: flag(&args, "--tls-cert-file"),
                key: flag(&args, "--tls-private-key-file"),
            };
            add("--secure-listen-address", &addr, serves);
        }
    }
    (out, errs)
}

/// The number a probe's or a Service's port stands for: the number itself, or the
/// `containerPort` of the port that name declares in one of `containers`.
pub(super) fn port_number(containers: &[&Value], port: &Value) -> Option<u64> {
    if let Some(n) = port.as_u64() {
        return Some(n);
    }
    let name = port.as_str()?;
    containers
        .iter()
        .flat_map(|c| c.get("ports").and_then(Value::as_array).into_iter().flatten())
        .find(|p| p.get("name").and_then(Value::as_str) == Some(name))
        .and_then(|p| p.get("containerPort").and_then(Value::as_u64))
}

/// The volume a container mounts at the directory holding `path`, if any.
fn volume_for<'a>(spec: &'a Value, container: &Value, path: &str) -> Option<&'a Value> {
    let mounts = container.get("volumeMounts").and_then(Value::as_array)?;
    let mount = mounts.iter().find(|m| {
        m.get("mountPath").and_then(Value::as_str).is_some_and(|d| {
            let d = d.trim_end_matches('/');
            path.strip_prefix(d).is_some_and(|rest| rest.starts_with('/'))
        })
    })?;
    let name = mount.get("name").and_then(Value::as_str)?;
    spec.get("volumes")
        .and_then(Value::as_array)?
        .iter()
        .find(|v| v.get("name").and_then(Value::as_str) == Some(name))
}

/// The DaemonSet rules about its listeners.
pub(super) fn check_daemonset(
    objects: &[Object],
    label: &str,
    spec: &Value,
    containers: &[&Value],
    ns: &str,
    sa: &str,
) -> Vec<String> {
    let mut problems = Vec::new();
    let (ls, errs) = listeners(containers);
    problems.extend(errs.into_iter().map(|e| format!("{label}: {e}")));
    for l in &ls {
        let c = &l.container;
        if l.plain_metrics() && !l.loopback() {
            problems.push(format!(
                "{label}: container {c} serves /metrics in plain HTTP on {}:{}, to every \
                 process that reaches the node: give the agent --metrics-listen on loopback \
                 and serve it through kube-rbac-proxy",
                l.host, l.port
            ));
        }
    }

    // The kubelet probes the pod's IP: the probes name the probe listener, off loopback.
    for c in containers.iter().filter(|c| is_agent(c)) {
        let probe = ls.iter().find(|l| matches!(l.serves, Serves::AgentProbes { .. }));
        for (kind, paths) in
            [("livenessProbe", &["/healthz"][..]), ("readinessProbe", &["/readyz", "/healthz"])]
        {
            let Some(get) = c.pointer(&format!("/{kind}/httpGet")) else { continue };
            let port = get.get("port").and_then(|p| port_number(&[c], p));
            let path = get.get("path").and_then(Value::as_str).unwrap_or("/");
            match probe {
                Some(p) if port == Some(u64::from(p.port)) && !p.loopback() => {}
                Some(p) => problems.push(format!(
                    "{label}: {kind} probes port {port:?}, but the agent's probes listen on \
                     {}:{} (--listen), which the kubelet {}",
                    p.host,
                    p.port,
                    if p.loopback() { "cannot reach on loopback" } else { "must probe" }
                )),
                None => {}
            }
            if !paths.contains(&path) {
                problems.push(format!("{label}: {kind} probes {path}; expected one of {paths:?}"));
            }
        }
    }

    // kube-rbac-proxy: in front of the agent's metrics, with certificate files that exist.
    let metrics_at: Vec<&Listener> =
        ls.iter().filter(|l| l.plain_metrics() && l.loopback()).collect();
    let proxies: Vec<&Listener> =
        ls.iter().filter(|l| matches!(l.serves, Serves::Proxy { .. })).collect();
    for m in metrics_at.iter().filter(|m| m.serves == Serves::AgentMetrics) {
        let fronts = |p: &&Listener| matches!(&p.serves, Serves::Proxy { upstream: Some(u), .. } if serves_upstream(m, u));
        if !proxies.iter().any(fronts) {
            problems.push(format!(
                "{label}: the agent's /metrics on {}:{} (--metrics-listen) is proxied by no \
                 kube-rbac-proxy (--upstream=http://{}:{}/): nothing off the node can read it",
                m.host, m.port, m.host, m.port
            ));
        }
    }
    for p in &proxies {
        let Serves::Proxy { upstream, cert, key } = &p.serves else { continue };
        let c = &p.container;
        match upstream {
            Some(u) if metrics_at.iter().any(|m| serves_upstream(m, u)) => {}
            Some(u) => problems.push(format!(
                "{label}: container {c}: --upstream={u} is not the agent's loopback /metrics ({})",
                metrics_at
                    .iter()
                    .map(|m| format!("{}:{}", m.host, m.port))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            None => problems.push(format!("{label}: container {c}: --upstream is missing")),
        }
        if cert.is_some() != key.is_some() {
            problems.push(format!(
                "{label}: container {c}: give both --tls-cert-file and --tls-private-key-file, \
                 or neither (a self-signed certificate)"
            ));
        }
        let container = containers.iter().find(|x| container_name(x) == *c);
        for file in [cert, key].into_iter().flatten() {
            if container.and_then(|x| volume_for(spec, x, file)).is_none() {
                problems.push(format!(
                    "{label}: container {c}: {file} is on no volume the container mounts"
                ));
            }
        }
        let may = |group: &str, resource: &str| {
            grants(objects, ns, sa)
                .iter()
                .any(|(scope, rule)| scope.is_none() && allows(rule, group, resource, "create"))
        };
        for (group, resource) in [
            ("authentication.k8s.io", "tokenreviews"),
            ("authorization.k8s.io", "subjectaccessreviews"),
        ] {
            if !may(group, resource) {
                problems.push(format!(
                    "{label}: container {c} (kube-rbac-proxy) checks every token, but service \
                     account {ns}/{sa} may not create {resource}.{group} cluster-wide"
                ));
            }
        }
    }
    problems
}

/// Whether `upstream` (`http://HOST:PORT/...`) is the listener `m`.
fn serves_upstream(m: &Listener, upstream: &str) -> bool {
    let Some(rest) = upstream.strip_prefix("http://") else { return false };
    let hostport = rest.split('/').next().unwrap_or("");
    split_addr(hostport).is_some_and(|(h, p)| p == m.port && (h == m.host || is_loopback(&h)))
}

// ---- RBAC ----------------------------------------------------------------------------------

/// Every rule granted to service account `ns/sa`, with its scope (a namespace, or none:
/// cluster-wide).
pub(super) fn grants(objects: &[Object], ns: &str, sa: &str) -> Vec<(Option<String>, Value)> {
    let mut out = Vec::new();
    for b in bindings(objects).filter(|b| subjects(b).any(|s| s == (ns, sa))) {
        let role_kind = b.str_at("/roleRef/kind").unwrap_or("");
        let role_name = b.str_at("/roleRef/name").unwrap_or("");
        let role = objects.iter().find(|o| {
            o.kind() == role_kind
                && o.name() == role_name
                && (role_kind == "ClusterRole" || o.namespace() == b.namespace())
        });
        let scope = (b.kind() == "RoleBinding").then(|| b.namespace().unwrap_or("").to_owned());
        let rules = role.and_then(|r| r.value.get("rules")).and_then(Value::as_array);
        out.extend(rules.into_iter().flatten().map(|rule| (scope.clone(), rule.clone())));
    }
    out
}

fn bindings(objects: &[Object]) -> impl Iterator<Item = &Object> {
    objects.iter().filter(|o| matches!(o.kind(), "RoleBinding" | "ClusterRoleBinding"))
}

/// The service accounts a binding names, as (namespace, name).
fn subjects(b: &Object) -> impl Iterator<Item = (&str, &str)> {
    let all = b.value.get("subjects").and_then(Value::as_array).into_iter().flatten();
    all.filter(|s| s.get("kind").and_then(Value::as_str) == Some("ServiceAccount")).map(|s| {
        let at = |f: &str| s.get(f).and_then(Value::as_str).unwrap_or("");
        (at("namespace"), at("name"))
    })
}

pub(super) fn has(rule: &Value, field: &str, want: &str) -> bool {
    string_list(rule, &format!("/{field}")).iter().any(|x| x == want || x == "*")
}

pub(super) fn allows(rule: &Value, group: &str, resource: &str, verb: &str) -> bool {
    has(rule, "apiGroups", group) && has(rule, "resources", resource) && has(rule, "verbs", verb)
}

fn allows_url(rule: &Value, url: &str, verb: &str) -> bool {
    let urls = string_list(rule, "/nonResourceURLs");
    let matches = urls.iter().any(|u| {
        u == url || u == "*" || u.strip_suffix('*').is_some_and(|prefix| url.starts_with(prefix))
    });
    matches && has(rule, "verbs", verb)
}

// ---- Services and ServiceMonitors ----------------------------------------------------------

fn labels(v: &Value, pointer: &str) -> BTreeMap<String, String> {
    v.pointer(pointer)
        .and_then(Value::as_object)
        .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned()))).collect())
        .unwrap_or_default()
}

/// Whether a LabelSelector (`matchLabels`, `matchExpressions`) selects `have`.
fn selects(selector: &Value, have: &BTreeMap<String, String>) -> bool {
    let by_labels = labels(selector, "/matchLabels").iter().all(|(k, v)| have.get(k) == Some(v));
    let exprs = selector.get("matchExpressions").and_then(Value::as_array);
    let by_exprs = exprs.into_iter().flatten().all(|e| {
        let key = e.get("key").and_then(Value::as_str).unwrap_or("");
        let values = string_list(e, "/values");
        let value = have.get(key);
        match e.get("operator").and_then(Value::as_str) {
            Some("In") => value.is_some_and(|v| values.contains(v)),
            Some("NotIn") => !value.is_some_and(|v| values.contains(v)),
            Some("Exists") => value.is_some(),
            Some("DoesNotExist") => value.is_none(),
            _ => false,
        }
    });
    by_labels && by_exprs
}

/// The DaemonSets whose pods a Service selects.
fn selected_daemonsets<'a>(objects: &'a [Object], svc: &Object) -> Vec<&'a Object> {
    let selector = serde_json::json!({ "matchLabels": svc.value.pointer("/spec/selector") });
    let any = labels(&svc.value, "/spec/selector").is_empty();
    let pods = |ds: &Object| labels(&ds.value, "/spec/template/metadata/labels");
    let same_ns = |o: &&Object| o.kind() == "DaemonSet" && o.namespace() == svc.namespace();
    objects.iter().filter(same_ns).filter(|ds| !any && selects(&selector, &pods(ds))).collect()
}

/// The listener a Service port reaches on a DaemonSet's pods, or why none.
fn target(ds: &Object, port: &Value) -> Result<Listener, String> {
    let target = port.get("targetPort").or_else(|| port.get("port"));
    let Some(n) = target.and_then(|t| port_number(&ds.containers(), t)) else {
        return Err(format!(
            "targetPort {}: neither a number nor the name of a port the pod declares",
            target.map(Value::to_string).unwrap_or_default()
        ));
    };
    let (ls, _) = listeners(&ds.containers());
    ls.into_iter()
        .find(|l| u64::from(l.port) == n)
        .ok_or_else(|| format!("targetPort {n}: no container of {} listens there", ds.label()))
}

/// Services: they select a DaemonSet's pods and reach a listener off loopback, never the
/// agent's plain /metrics; a service CA certificate is served by the listener it targets.
pub(super) fn check_services(objects: &[Object]) -> Vec<String> {
    let mut problems = Vec::new();
    for svc in objects.iter().filter(|o| o.kind() == "Service") {
        let label = svc.label();
        let dss = selected_daemonsets(objects, svc);
        if dss.is_empty() {
            problems.push(format!("{label}: its selector matches the pods of no DaemonSet here"));
            continue;
        }
        let cert_secret = svc.str_at(SERVING_CERT);
        for ds in &dss {
            for port in
                svc.value.pointer("/spec/ports").and_then(Value::as_array).into_iter().flatten()
            {
                let pname = port.get("name").and_then(Value::as_str).unwrap_or("?");
                let l = match target(ds, port) {
                    Ok(l) => l,
                    Err(e) => {
                        problems.push(format!("{label}: port {pname}: {e}"));
                        continue;
                    }
                };
                if l.loopback() {
                    problems.push(format!(
                        "{label}: port {pname} reaches {}:{} of container {}, which listens on \
                         loopback only",
                        l.host, l.port, l.container
                    ));
                }
                if l.plain_metrics() {
                    problems.push(format!(
                        "{label}: port {pname} exposes the agent's plain /metrics (container {}): \
                         target kube-rbac-proxy instead",
                        l.container
                    ));
                }
                let Some(secret) = cert_secret else { continue };
                let Serves::Proxy { cert: Some(cert), .. } = &l.serves else {
                    problems.push(format!(
                        "{label}: asks the service CA for a certificate in secret {secret}, but \
                         port {pname} reaches a listener that serves none"
                    ));
                    continue;
                };
                let spec = ds.value.pointer("/spec/template/spec").unwrap_or(&Value::Null);
                let containers = ds.containers();
                let c = containers.iter().find(|c| container_name(c) == l.container);
                let from = c.and_then(|c| volume_for(spec, c, cert));
                if from.and_then(|v| v.pointer("/secret/secretName")).and_then(Value::as_str)
                    != Some(secret)
                {
                    problems.push(format!(
                        "{label}: the service CA writes its certificate to secret {secret}, but \
                         container {} reads {cert} from elsewhere",
                        l.container
                    ));
                }
            }
        }
    }
    problems
}

/// What the rules may refer to in one render.
#[derive(Debug, Default)]
pub(super) struct Scrapes {
    /// Job names of the agent's scrapes (the Service's name, or its `jobLabel` label).
    jobs: BTreeSet<String>,
    /// Labels the agent's scrapes carry: the scrape's own and the relabelings' targets.
    target_labels: BTreeSet<String>,
}

/// ServiceMonitors: each selects Services of the render by a port they have, in the
/// listener's scheme, with the credentials and certificate checks the listener needs; some
/// service account can both discover the targets and read /metrics.
pub(super) fn check_service_monitors(objects: &[Object]) -> (Vec<String>, Scrapes) {
    let mut problems = Vec::new();
    let mut scrapes = Scrapes {
        target_labels: SCRAPE_LABELS.iter().map(|l| (*l).to_owned()).collect(),
        ..Scrapes::default()
    };
    for sm in objects.iter().filter(|o| o.kind() == "ServiceMonitor") {
        let label = sm.label();
        let spec = sm.value.get("spec").cloned().unwrap_or(Value::Null);
        let namespaces: Option<Vec<String>> =
            if spec.pointer("/namespaceSelector/any").and_then(Value::as_bool) == Some(true) {
                None
            } else {
                let names = string_list(&spec, "/namespaceSelector/matchNames");
                Some(if names.is_empty() {
                    sm.namespace().map(str::to_owned).into_iter().collect()
                } else {
                    names
                })
            };
        let selector = spec.get("selector").cloned().unwrap_or(Value::Null);
        let services: Vec<&Object> = objects
            .iter()
            .filter(|o| o.kind() == "Service")
            .filter(|o| {
                namespaces
                    .as_ref()
                    .is_none_or(|ns| o.namespace().is_some_and(|n| ns.iter().any(|x| x == n)))
            })
            .filter(|o| selects(&selector, &labels(&o.value, "/metadata/labels")))
            .collect();
        if services.is_empty() {
            problems.push(format!("{label}: selects no Service of this render"));
            continue;
        }
        let job_label = spec.get("jobLabel").and_then(Value::as_str);
        for svc in &services {
            let job = match job_label {
                Some(l) => labels(&svc.value, "/metadata/labels").get(l).cloned(),
                None => Some(svc.name().to_owned()),
            };
            scrapes.jobs.extend(job);
        }
        let mut needs_metrics_access = false;
        for (i, ep) in
            spec.get("endpoints").and_then(Value::as_array).into_iter().flatten().enumerate()
        {
            let at = format!("{label}: endpoints[{i}]");
            for r in ep.get("relabelings").and_then(Value::as_array).into_iter().flatten() {
                scrapes
                    .target_labels
                    .extend(r.get("targetLabel").and_then(Value::as_str).map(str::to_owned));
            }
            let Some(pname) = ep.get("port").and_then(Value::as_str) else {
                problems.push(format!("{at}: name the Service port (port:)"));
                continue;
            };
            for svc in &services {
                let ports = svc.value.pointer("/spec/ports").and_then(Value::as_array);
                let Some(port) = ports
                    .into_iter()
                    .flatten()
                    .find(|p| p.get("name").and_then(Value::as_str) == Some(pname))
                else {
                    problems.push(format!("{at}: port {pname} is not a port of {}", svc.label()));
                    continue;
                };
                for ds in selected_daemonsets(objects, svc) {
                    let Ok(l) = target(ds, port) else { continue };
                    problems.extend(check_endpoint(&at, ep, svc, &l));
                    needs_metrics_access |= matches!(l.serves, Serves::Proxy { .. });
                }
            }
        }
        if needs_metrics_access {
            problems.extend(check_scraper_access(objects, &label, &services));
        }
    }
    (problems, scrapes)
}

/// One endpoint against the listener it reaches.
fn check_endpoint(at: &str, ep: &Value, svc: &Object, l: &Listener) -> Vec<String> {
    let mut problems = Vec::new();
    let scheme = ep.get("scheme").and_then(Value::as_str).unwrap_or("http").to_ascii_lowercase();
    let Serves::Proxy { cert, .. } = &l.serves else {
        if scheme != "http" {
            problems.push(format!("{at}: scheme {scheme}, but {} speaks plain HTTP", l.container));
        }
        return problems;
    };
    if scheme != "https" {
        problems.push(format!("{at}: kube-rbac-proxy ({}) speaks https only", l.container));
    }
    if !["bearerTokenFile", "bearerTokenSecret", "authorization"]
        .iter()
        .any(|k| ep.get(*k).is_some())
    {
        problems.push(format!(
            "{at}: kube-rbac-proxy answers 401 without a token: set bearerTokenFile (the \
             scraper's own service account token) or authorization"
        ));
    }
    let tls = ep.get("tlsConfig").cloned().unwrap_or(Value::Null);
    let skip = tls.get("insecureSkipVerify").and_then(Value::as_bool) == Some(true);
    let has_ca = tls.get("caFile").is_some() || tls.get("ca").is_some();
    if cert.is_none() {
        if !skip {
            problems.push(format!(
                "{at}: kube-rbac-proxy ({}) serves a self-signed certificate that no CA \
                 verifies: set tlsConfig.insecureSkipVerify: true, or give it a certificate",
                l.container
            ));
        }
        return problems;
    }
    if svc.value.pointer(SERVING_CERT).is_some() {
        let want = format!("{}.{}.svc", svc.name(), svc.namespace().unwrap_or("default"));
        let server = tls.get("serverName").and_then(Value::as_str);
        if skip || !has_ca {
            problems.push(format!(
                "{at}: {} serves a certificate of the service CA: verify it (tlsConfig.caFile \
                 or ca, and no insecureSkipVerify)",
                l.container
            ));
        }
        if server != Some(want.as_str()) {
            problems.push(format!(
                "{at}: tlsConfig.serverName {server:?}: the service CA's certificate names {want}"
            ));
        }
    }
    problems
}

/// Some service account bound in this render may list the targets' endpoints in their
/// namespace and `get` /metrics.
fn check_scraper_access(objects: &[Object], label: &str, services: &[&Object]) -> Vec<String> {
    let accounts: BTreeSet<(&str, &str)> = bindings(objects).flat_map(subjects).collect();
    let able = accounts.iter().any(|(ns, name)| {
        let rules = grants(objects, ns, name);
        let reads =
            rules.iter().any(|(scope, r)| scope.is_none() && allows_url(r, "/metrics", "get"));
        let discovers = services.iter().all(|svc| {
            rules.iter().any(|(scope, r)| {
                scope.as_deref().is_none_or(|s| Some(s) == svc.namespace())
                    && (allows(r, "", "endpoints", "list")
                        || allows(r, "discovery.k8s.io", "endpointslices", "list"))
            })
        });
        reads && discovers
    });
    if able {
        Vec::new()
    } else {
        vec![format!(
            "{label}: no service account in this render may both list the targets' endpoints \
             and `get` /metrics: bind the scraper's service account to a Role for service \
             discovery and to a ClusterRole with nonResourceURLs [/metrics], verbs [get]"
        )]
    }
}

// ---- PrometheusRules -----------------------------------------------------------------------

/// The labels of a metric a rule may name, or none if the metric is unknown.
fn metric_labels(name: &str, scrapes: &Scrapes) -> Option<BTreeSet<String>> {
    if let Some(f) = families::ALL.iter().find(|f| f.sample_name() == name) {
        let mut l: BTreeSet<String> = f.labels.iter().map(|l| (*l).to_owned()).collect();
        l.extend(scrapes.target_labels.iter().cloned());
        return Some(l);
    }
    let (metric, own) = EXTERNAL.iter().find(|(m, _)| *m == name)?;
    let mut l: BTreeSet<String> = own.split_whitespace().map(str::to_owned).collect();
    if *metric == "up" {
        l.extend(scrapes.target_labels.iter().cloned());
    } else {
        l.extend(EXPORTER_LABELS.iter().map(|l| (*l).to_owned()));
    }
    Some(l)
}

/// `{{ $labels.NAME }}` references in an annotation.
fn template_labels(text: &str) -> Vec<String> {
    text.split("$labels.")
        .skip(1)
        .map(|rest| rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect())
        .collect()
}

/// Every alerting rule of every PrometheusRule in the render.
pub(super) fn check_rules(objects: &[Object], scrapes: &Scrapes) -> Vec<String> {
    let mut problems = Vec::new();
    let namespaces: BTreeSet<&str> =
        objects.iter().filter(|o| o.kind() == "Namespace").map(Object::name).collect();
    let daemonsets: BTreeSet<&str> =
        objects.iter().filter(|o| o.kind() == "DaemonSet").map(Object::name).collect();
    let mut alerts = BTreeSet::new();
    for pr in objects.iter().filter(|o| o.kind() == "PrometheusRule") {
        let groups = pr.value.pointer("/spec/groups").and_then(Value::as_array);
        for (g, group) in groups.into_iter().flatten().enumerate() {
            for (r, rule) in
                group.get("rules").and_then(Value::as_array).into_iter().flatten().enumerate()
            {
                let alert = rule.get("alert").and_then(Value::as_str);
                let at = format!(
                    "{}: groups[{g}].rules[{r}] ({})",
                    pr.label(),
                    alert.or(rule.get("record").and_then(Value::as_str)).unwrap_or("?")
                );
                let found = check_rule(rule, scrapes, &namespaces, &daemonsets);
                problems.extend(found.into_iter().map(|p| format!("{at}: {p}")));
                if let Some(a) = alert
                    && !alerts.insert(a.to_owned())
                {
                    problems.push(format!("{at}: a second alert named {a}"));
                }
            }
        }
    }
    problems
}

fn check_rule(
    rule: &Value,
    scrapes: &Scrapes,
    namespaces: &BTreeSet<&str>,
    daemonsets: &BTreeSet<&str>,
) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(a) = rule.get("alert").and_then(Value::as_str) {
        let severity = rule.pointer("/labels/severity").and_then(Value::as_str);
        if !severity.is_some_and(|s| SEVERITIES.contains(&s)) {
            problems.push(format!("labels.severity {severity:?}: one of {SEVERITIES:?}"));
        }
        for a in ["summary", "description"] {
            if rule
                .pointer(&format!("/annotations/{a}"))
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                problems.push(format!("annotations.{a} is missing"));
            }
        }
        problems.extend(check_runbook(a, rule.pointer("/annotations/runbook_url")));
    }
    let expr = match rule.get("expr") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => return problems,
    };
    let refs = match promql::refs(&expr) {
        Ok(r) => r,
        Err(e) => {
            problems.push(format!("expr does not read: {e}"));
            return problems;
        }
    };
    let mut all_labels: BTreeSet<String> = BTreeSet::new();
    let mut uses_agent = false;
    let mut all_known = true;
    for s in &refs.selectors {
        let Some(known) = metric_labels(&s.metric, scrapes) else {
            all_known = false;
            let counter = families::ALL
                .iter()
                .find(|f| f.name == s.metric && f.kind == families::Kind::Counter);
            problems.push(match counter {
                Some(f) => format!(
                    "metric {}: a counter's samples are named {}",
                    s.metric,
                    f.sample_name()
                ),
                None => format!(
                    "metric {} is neither exported by the agent \
                     (gate-common/src/metrics.rs) nor a known kube-state-metrics or \
                     Prometheus metric",
                    s.metric
                ),
            });
            continue;
        };
        uses_agent |= s.metric.starts_with("metadata_gate_") || s.metric == "up";
        for m in &s.matchers {
            if m.label != "__name__" && !known.contains(&m.label) {
                problems.push(format!(
                    "{}{{{}...}}: {} has no label {} (it has {known:?})",
                    s.metric, m.label, s.metric, m.label
                ));
            }
            if m.op != "=" {
                continue;
            }
            let created_by_ds =
                s.matchers.iter().any(|x| x.label == "created_by_kind" && x.value == "DaemonSet");
            let unknown = match m.label.as_str() {
                "namespace" => (!namespaces.contains(m.value.as_str())).then_some("namespace"),
                "daemonset" => (!daemonsets.contains(m.value.as_str())).then_some("DaemonSet"),
                "created_by_name" if created_by_ds => {
                    (!daemonsets.contains(m.value.as_str())).then_some("DaemonSet")
                }
                "job" => (!scrapes.jobs.contains(&m.value)).then_some("scrape job"),
                _ => None,
            };
            if let Some(what) = unknown {
                problems.push(format!(
                    "{}{{{}=\"{}\"}}: no {what} of that name in this render",
                    s.metric, m.label, m.value
                ));
            }
        }
        all_labels.extend(known);
    }
    if uses_agent && scrapes.jobs.is_empty() {
        problems
            .push("reads the agent's metrics, but no ServiceMonitor here scrapes the agent".into());
    }
    if !all_known {
        // Which labels it has is unknown: one problem is enough.
        return problems;
    }
    for l in &refs.grouping {
        if !all_labels.contains(l) {
            problems.push(format!("groups by {l}, a label none of its metrics has"));
        }
    }
    // Where it aggregates `by` labels, its result carries those (and what a join copies);
    // else the labels of its metrics (a simplification: `without` and joins keep some).
    let result_labels: BTreeSet<String> = if refs.by.is_empty() {
        all_labels
    } else {
        refs.by.iter().chain(&refs.joined).cloned().collect()
    };
    for (k, text) in rule.get("annotations").and_then(Value::as_object).into_iter().flatten() {
        for l in template_labels(text.as_str().unwrap_or("")) {
            if !result_labels.contains(&l) {
                problems.push(format!(
                    "annotations.{k}: $labels.{l} is a label its result does not carry"
                ));
            }
        }
    }
    problems
}

/// An alert's `runbook_url` is [`RUNBOOK_BASE`] + `<alert>.md`, and that runbook exists under
/// [`RUNBOOK_DIR`], titled with the alert's name, with every section of [`RUNBOOK_SECTIONS`].
fn check_runbook(alert: &str, url: Option<&Value>) -> Vec<String> {
    check_runbook_in(&crate::util::root(), alert, url)
}

/// [`check_runbook`] with the runbooks under `root`.
fn check_runbook_in(root: &std::path::Path, alert: &str, url: Option<&Value>) -> Vec<String> {
    let mut problems = Vec::new();
    let want = format!("{RUNBOOK_BASE}{alert}.md");
    match url.and_then(Value::as_str) {
        None => problems.push(format!("annotations.runbook_url is missing: give {want}")),
        Some(u) if u != want => problems.push(format!(
            "annotations.runbook_url {u:?}: the runbook of {alert} is {want} (the URL names \
             {RUNBOOK_DIR}/{alert}.md of this repository)"
        )),
        Some(_) => {}
    }
    let file = format!("{RUNBOOK_DIR}/{alert}.md");
    match std::fs::read_to_string(root.join(&file)) {
        Err(_) => problems
            .push(format!("no runbook {file}: write it (Meaning, Impact, Diagnosis, Mitigation)")),
        Ok(text) => {
            if text.lines().next().map(str::trim) != Some(&format!("# {alert}")) {
                problems.push(format!("{file}: its first line must be the title \"# {alert}\""));
            }
            for section in RUNBOOK_SECTIONS {
                if !text.lines().any(|l| l.trim_end() == *section) {
                    problems.push(format!("{file}: section \"{section}\" is missing"));
                }
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::super::{check_set, split};
    use super::*;
    use crate::util::root;

    /// The objects of deploy/base, components/monitoring and components/proxy-port-guard as
    /// shipped (what `kubectl apply -k` of them creates, less the policies), each file's text
    /// first changed by `edits`
    /// (file, from, to); every edit must apply.
    fn shipped_with(edits: &[(&str, &str, &str)]) -> Vec<Object> {
        const FILES: &[&str] = &[
            "deploy/base/namespace.yaml",
            "deploy/base/serviceaccount.yaml",
            "deploy/base/rbac.yaml",
            "deploy/base/daemonset.yaml",
            "deploy/base/service.yaml",
            "deploy/components/monitoring/servicemonitor.yaml",
            "deploy/components/monitoring/prometheusrule.yaml",
            "deploy/components/monitoring/prometheus-rbac.yaml",
            "deploy/components/proxy-port-guard/validatingadmissionpolicy.yaml",
        ];
        let mut objects = Vec::new();
        for file in FILES {
            let mut text = std::fs::read_to_string(root().join(file)).expect(file);
            for (f, from, to) in edits.iter().filter(|(f, _, _)| f == file) {
                assert!(text.contains(from), "{f}: {from:?} is not in the file");
                text = text.replace(from, to);
            }
            objects.extend(split(file, &text).expect(file));
        }
        objects
    }

    fn problems(edits: &[(&str, &str, &str)]) -> Vec<String> {
        check_set(&shipped_with(edits))
    }

    /// `edits` give exactly problems containing each of `want`.
    fn refused(edits: &[(&str, &str, &str)], want: &[&str]) {
        let found = problems(edits);
        for w in want {
            assert!(found.iter().any(|p| p.contains(w)), "{w:?} not among {found:#?}");
        }
        assert_eq!(found.len(), want.len(), "{found:#?}");
    }

    const RULES: &str = "deploy/components/monitoring/prometheusrule.yaml";
    const SM: &str = "deploy/components/monitoring/servicemonitor.yaml";
    const DS: &str = "deploy/base/daemonset.yaml";
    const SVC: &str = "deploy/base/service.yaml";

    #[test]
    fn the_shipped_objects_pass() {
        assert_eq!(problems(&[]), Vec::<String>::new());
    }

    #[test]
    fn a_rule_on_a_metric_the_agent_does_not_export_fails() {
        refused(
            &[(RULES, "metadata_gate_repairs_total", "metadata_gate_repaired_total")],
            &["metric metadata_gate_repaired_total is neither exported by the agent"],
        );
        refused(
            &[(RULES, "metadata_gate_events_lost_total", "metadata_gate_events_lost")],
            &["a counter's samples are named metadata_gate_events_lost_total"],
        );
        refused(
            &[(RULES, "kube_pod_status_ready{", "kube_pod_ready{")],
            &["metric kube_pod_ready is neither"],
        );
    }

    #[test]
    fn rules_name_only_labels_namespaces_daemonsets_and_jobs_that_exist() {
        refused(
            &[(
                RULES,
                "increase(metadata_gate_repairs_total[15m])",
                "increase(metadata_gate_repairs_total{part=\"link\"}[15m])",
            )],
            &["metadata_gate_repairs_total has no label part"],
        );
        refused(
            &[(
                RULES,
                "up{job=\"metadata-gate-agent-metrics\"}",
                "up{job=\"metadata-gate-agent\"}",
            )],
            &["up{job=\"metadata-gate-agent\"}: no scrape job of that name"],
        );
        refused(
            &[(
                RULES,
                "created_by_name=\"metadata-gate-agent\"",
                "created_by_name=\"metadata-gate\"",
            )],
            &["no DaemonSet of that name"],
        );
        refused(
            &[(
                RULES,
                "sum by (namespace, node, workload)",
                "sum by (namespace, nodename, workload)",
            )],
            &[
                "groups by nodename",
                "annotations.summary: $labels.node is a label its result does not carry",
                "annotations.description: $labels.node is a label its result does not carry",
            ],
        );
        // Without the relabeling, the agent's series have no `node` label.
        let found = problems(&[(SM, "targetLabel: node", "targetLabel: hostname")]);
        assert!(
            found.iter().any(|p| p.contains("$labels.node is a label its result")),
            "{found:#?}"
        );
    }

    #[test]
    fn alerts_have_a_severity_a_summary_and_a_description() {
        refused(
            &[(
                RULES,
                "severity: critical\n          annotations:\n            runbook_url: \
                 https://metadata-gate.invalid/blob/main/docs/runbooks/MetadataGateAgentMissing.md\n            \
                 summary: \"{{ $value }} node(s)",
                "severity: page\n          annotations:\n            runbook_url: \
                 https://metadata-gate.invalid/blob/main/docs/runbooks/MetadataGateAgentMissing.md\n            \
                 sumary: \"{{ $value }} node(s)",
            )],
            &["labels.severity Some(\"page\")", "annotations.summary is missing"],
        );
        refused(&[(RULES, "rate(metadata", "rate((metadata")], &["expr does not read"]);
    }

    #[test]
    fn every_alert_has_a_runbook_that_exists() {
        // No runbook_url.
        let url = "            runbook_url: https://metadata-gate.invalid/blob/main/docs/runbooks/MetadataGateEventsLost.md\n";
        refused(
            &[(RULES, url, "")],
            &["(MetadataGateEventsLost): annotations.runbook_url is missing"],
        );
        // A URL elsewhere.
        refused(
            &[(RULES, url, &url.replace("metadata-gate.invalid", "example.com"))],
            &["the runbook of MetadataGateEventsLost is https://metadata-gate.invalid/"],
        );
        // An alert whose runbook was never written: its URL names no file.
        refused(
            &[(RULES, "alert: MetadataGateEventsLost", "alert: MetadataGateEventsGone")],
            &[
                "the runbook of MetadataGateEventsGone is",
                "no runbook docs/runbooks/MetadataGateEventsGone.md",
            ],
        );
    }

    #[test]
    fn a_runbook_has_its_title_and_the_four_sections() {
        let dir = std::env::temp_dir().join(format!("xtask-runbooks-{}", std::process::id()));
        std::fs::create_dir_all(dir.join(RUNBOOK_DIR)).expect("temp dir");
        let url = Value::String(format!("{RUNBOOK_BASE}MetadataGateX.md"));
        let write = |text: &str| {
            std::fs::write(dir.join(RUNBOOK_DIR).join("MetadataGateX.md"), text).expect("write")
        };
        write("# MetadataGateX\n\n## Meaning\n\n## Impact\n\n## Diagnosis\n\n## Mitigation\n");
        assert_eq!(check_runbook_in(&dir, "MetadataGateX", Some(&url)), Vec::<String>::new());
        write("# Something else\n\n## Meaning\n\n## Impact\n\n### Diagnosis\n");
        let found = check_runbook_in(&dir, "MetadataGateX", Some(&url));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found.len(), 3, "{found:#?}");
        assert!(found[0].contains("the title \"# MetadataGateX\""), "{found:#?}");
        assert!(found[1].contains("\"## Diagnosis\" is missing"), "{found:#?}");
        assert!(found[2].contains("\"## Mitigation\" is missing"), "{found:#?}");
    }

    #[test]
    fn plain_metrics_stay_on_loopback() {
        let off = "            - --metrics-listen\n            - 127.0.0.1:9751\n";
        let found = problems(&[(DS, off, "")]);
        assert!(
            found.iter().any(|p| p.contains("serves /metrics in plain HTTP on 0.0.0.0:9750")),
            "{found:#?}"
        );
        assert!(
            found.iter().any(|p| p.contains("--upstream=http://127.0.0.1:9751/ is not")),
            "{found:#?}"
        );
        refused(
            &[(DS, "- 127.0.0.1:9751\n", "- 0.0.0.0:9751\n")],
            &[
                "serves /metrics in plain HTTP on 0.0.0.0:9751",
                "is not the agent's loopback /metrics",
            ],
        );
    }

    #[test]
    fn probes_hit_the_probe_listener() {
        refused(
            &[(
                DS,
                "path: /readyz\n              port: probes",
                "path: /readyz\n              port: metrics-local",
            )],
            &["readinessProbe probes port Some(9751)"],
        );
        refused(
            &[(
                DS,
                "path: /readyz\n              port: probes",
                "path: /readyz\n              port: probe",
            )],
            &["readinessProbe probes port None"],
        );
        refused(&[(DS, "path: /healthz", "path: /metrics")], &["livenessProbe probes /metrics"]);
    }

    #[test]
    fn the_service_reaches_kube_rbac_proxy_and_nothing_else() {
        refused(
            &[(SVC, "targetPort: 9752", "targetPort: 9751")],
            &[
                "listens on loopback only",
                "exposes the agent's plain /metrics",
                "scheme https, but agent speaks plain HTTP",
            ],
        );
        refused(
            &[(
                SVC,
                "app.kubernetes.io/component: agent\n",
                "app.kubernetes.io/component: agents\n",
            )],
            &["matches the pods of no DaemonSet here"],
        );
        let found = problems(&[(
            SM,
            "      app.kubernetes.io/component: agent-metrics\n  namespaceSelector",
            "      app.kubernetes.io/component: agent\n  namespaceSelector",
        )]);
        for want in [
            "ServiceMonitor metadata-gate/metadata-gate-agent: selects no Service",
            "(MetadataGateRepaired): reads the agent's metrics, but no ServiceMonitor here",
            "up{job=\"metadata-gate-agent-metrics\"}: no scrape job of that name",
        ] {
            assert!(found.iter().any(|p| p.contains(want)), "{want}: {found:#?}");
        }
    }

    #[test]
    fn the_service_monitor_matches_the_service_and_the_proxy() {
        refused(
            &[(SM, "port: https-metrics", "port: metrics")],
            &["port metrics is not a port of"],
        );
        refused(
            &[(SM, "      tlsConfig:\n        insecureSkipVerify: true\n", "")],
            &["serves a self-signed certificate that no CA verifies"],
        );
        refused(
            &[(
                SM,
                "      bearerTokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n",
                "",
            )],
            &["answers 401 without a token"],
        );
        refused(&[(SM, "scheme: https", "scheme: http")], &["speaks https only"]);
    }

    #[test]
    fn kube_rbac_proxy_and_the_scraper_have_their_rbac() {
        let crb = "subjects:\n  - kind: ServiceAccount\n    name: prometheus-k8s\n    namespace: monitoring\n";
        // The metrics reader binding is the second binding of the file; break both subjects.
        let found = problems(&[(
            "deploy/components/monitoring/prometheus-rbac.yaml",
            crb,
            "subjects: []\n",
        )]);
        assert!(
            found.iter().any(|p| p.contains("no service account in this render may both")),
            "{found:#?}"
        );
        // kube-rbac-proxy's binding names another service account than the agent's.
        refused(
            &[(
                "deploy/base/rbac.yaml",
                "name: metadata-gate-kube-rbac-proxy\nsubjects:\n  - kind: ServiceAccount\n    \
                 name: metadata-gate-agent",
                "name: metadata-gate-kube-rbac-proxy\nsubjects:\n  - kind: ServiceAccount\n    \
                 name: someone-else",
            )],
            &["may not create tokenreviews", "may not create subjectaccessreviews"],
        );
    }

    #[test]
    fn a_service_ca_certificate_is_served_and_verified() {
        let annotate = (
            SVC,
            "  name: metadata-gate-agent-metrics\n",
            "  name: metadata-gate-agent-metrics\n  annotations:\n    service.beta.openshift.io/serving-cert-secret-name: tls\n",
        );
        refused(&[annotate], &["port https-metrics reaches a listener that serves none"]);
        let served = [
            annotate,
            (
                DS,
                "            - --tls-min-version=VersionTLS12\n",
                "            - --tls-min-version=VersionTLS12\n            - --tls-cert-file=/tls/tls.crt\n            - --tls-private-key-file=/tls/tls.key\n",
            ),
            (
                DS,
                "          securityContext:\n            # A network-facing",
                "          volumeMounts:\n            - {name: tls, mountPath: /tls}\n          securityContext:\n            # A network-facing",
            ),
            (
                DS,
                "      volumes:\n",
                "      volumes:\n        - {name: tls, secret: {secretName: tls}}\n",
            ),
        ];
        refused(
            &served,
            &["serves a certificate of the service CA: verify it", "tlsConfig.serverName None"],
        );
        let mut verified = served.to_vec();
        verified.push((
            SM,
            "insecureSkipVerify: true",
            "{caFile: /ca.crt, serverName: metadata-gate-agent-metrics.metadata-gate.svc}",
        ));
        assert_eq!(problems(&verified), Vec::<String>::new());
        let mut elsewhere = verified.clone();
        elsewhere.push((
            DS,
            "{name: tls, secret: {secretName: tls}}",
            "{name: tls, secret: {secretName: other}}",
        ));
        refused(&elsewhere, &["reads /tls/tls.crt from elsewhere"]);
    }
}
