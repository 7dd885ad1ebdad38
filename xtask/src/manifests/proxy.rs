//! The metadata proxy's port on the nodes' addresses, across the objects of one render: no
//! other pod and no Service may take it. A pod holding it as a hostPort (the CNI's portmap
//! DNATs `<node IP>:PORT` to it), or a Service with externalIPs or a load balancer on it
//! (kube-proxy DNATs it), would receive the requests the kernel redirects to the proxy and
//! could answer them with forged metadata.
//!
//! - every port a container of the agent's pod listens on (read from its flags) is declared
//!   on that container: on a hostNetwork pod each declared port is a hostPort, which the
//!   scheduler and the kubelet's admission give to one pod per node;
//! - an agent run with `--proxy-address` or `PROXY_ADDRESSES` declares its `--proxy-port`
//!   (TCP, the same hostPort), and the render ships a ValidatingAdmissionPolicy, bound with
//!   `Deny`, that refuses Services with externalIPs, and LoadBalancer Services, on that port
//!   (deploy/components/proxy-port-guard).
use serde_json::Value;

use super::monitoring::{container_name, is_agent, listeners};
use super::{Object, flag, string_list};

/// `--proxy-port`'s default (gate-agent/src/cli.rs).
const DEFAULT_PROXY_PORT: u16 = 9254;
/// Renders never applied alone, which need not ship the policy: deploy/base (the overlays and
/// profiles add it).
const UNGUARDED: &[&str] = &["deploy/base"];
/// Where the shipped policy lives, for the messages.
const GUARD: &str = "deploy/components/proxy-port-guard";

pub(super) fn check(objects: &[Object]) -> Vec<String> {
    let mut problems = Vec::new();
    for ds in objects.iter().filter(|o| o.kind() == "DaemonSet") {
        let label = ds.label();
        let host_network =
            ds.value.pointer("/spec/template/spec/hostNetwork").and_then(Value::as_bool)
                == Some(true);
        let containers = ds.containers();
        let by_name = |n: &str| containers.iter().find(|c| container_name(c) == n).copied();

        // Every listener declared where it listens (listeners() reports what it cannot read).
        let (ls, _) = listeners(&containers);
        for l in &ls {
            if let Some(c) = by_name(&l.container)
                && !declares(c, l.port, host_network)
            {
                problems.push(format!(
                    "{label}: container {} listens on {}:{} but does not declare port {} (TCP{}): \
                     another pod could take it as a hostPort",
                    l.container,
                    l.host,
                    l.port,
                    l.port,
                    if host_network { "" } else { ", hostPort the same" }
                ));
            }
        }

        for c in containers.iter().filter(|c| is_agent(c) && proxy_on(c)) {
            let cname = container_name(c);
            let port = match proxy_port(c) {
                Ok(p) => p,
                Err(e) => {
                    problems.push(format!("{label}: container {cname}: {e}"));
                    continue;
                }
            };
            let rules = [
                (
                    declares(c, port, host_network),
                    format!(
                        "container {cname} runs the metadata proxy on port {port} but does not \
                         declare it (TCP{}): a pod with hostPort {port} would receive the \
                         redirected metadata requests",
                        if host_network { "" } else { ", hostPort the same" }
                    ),
                ),
                (
                    UNGUARDED.contains(&ds.origin.as_str()) || guarded(objects, port).is_ok(),
                    format!(
                        "the metadata proxy's port {port} is not kept from Services: {} \
                         (include {GUARD}, with the port changed to {port} if it is not the \
                         default)",
                        guarded(objects, port).err().unwrap_or_default()
                    ),
                ),
            ];
            problems.extend(
                rules.into_iter().filter(|(ok, _)| !ok).map(|(_, e)| format!("{label}: {e}")),
            );
        }
    }
    problems
}

/// Whether `c` declares TCP `port` as a port that is also a hostPort: on a hostNetwork pod
/// the API server defaults hostPort to containerPort; elsewhere it must be given.
fn declares(c: &Value, port: u16, host_network: bool) -> bool {
    let port = u64::from(port);
    c.get("ports").and_then(Value::as_array).into_iter().flatten().any(|p| {
        let num = |f: &str| p.get(f).and_then(Value::as_u64);
        let tcp = p.get("protocol").and_then(Value::as_str).is_none_or(|x| x == "TCP");
        let host = match num("hostPort") {
            Some(h) if h > 0 => h == port,
            _ => host_network,
        };
        tcp && num("containerPort") == Some(port) && host
    })
}

/// Whether the agent runs its metadata proxy: `--proxy-address` or the `PROXY_ADDRESSES`
/// environment variable.
fn proxy_on(c: &Value) -> bool {
    let env = c.get("env").and_then(Value::as_array).into_iter().flatten();
    flag(&string_list(c, "/args"), "--proxy-address").is_some()
        || env.into_iter().any(|e| e.get("name").and_then(Value::as_str) == Some("PROXY_ADDRESSES"))
}

fn proxy_port(c: &Value) -> Result<u16, String> {
    match flag(&string_list(c, "/args"), "--proxy-port") {
        None => Ok(DEFAULT_PROXY_PORT),
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("--proxy-port {p:?}: not a port")),
        },
    }
}

/// Ok if some ValidatingAdmissionPolicy of the render refuses, on every create and update of
/// a Service in any namespace, externalIPs and LoadBalancer Services on `port`, and is bound
/// with `Deny` to every namespace; else what each candidate lacks.
fn guarded(objects: &[Object], port: u16) -> Result<(), String> {
    let policies: Vec<&Object> =
        objects.iter().filter(|o| o.kind() == "ValidatingAdmissionPolicy").collect();
    if policies.is_empty() {
        return Err("no ValidatingAdmissionPolicy in this render".into());
    }
    let mut why = Vec::new();
    for vap in policies {
        let lacks = policy_lacks(objects, vap, port);
        if lacks.is_empty() {
            return Ok(());
        }
        why.push(format!("ValidatingAdmissionPolicy {}: {}", vap.name(), lacks.join("; ")));
    }
    Err(why.join(" | "))
}

fn policy_lacks(objects: &[Object], vap: &Object, port: u16) -> Vec<String> {
    let rules = vap.value.pointer("/spec/matchConstraints/resourceRules").and_then(Value::as_array);
    let any = |r: &Value, f: &str, want: &str| {
        string_list(r, &format!("/{f}")).iter().any(|x| x == want || x == "*")
    };
    let services = rules.into_iter().flatten().any(|r| {
        any(r, "apiGroups", "")
            && any(r, "apiVersions", "v1")
            && any(r, "resources", "services")
            && any(r, "operations", "CREATE")
            && any(r, "operations", "UPDATE")
    });
    let exprs: Vec<String> = vap
        .value
        .pointer("/spec/validations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|v| v.get("expression").and_then(Value::as_str).map(str::to_owned))
        .collect();
    // The port as a number of its own in the expression (not part of a longer one).
    let names_port =
        |e: &str| e.split(|ch: char| !ch.is_ascii_digit()).any(|t| t == port.to_string());
    let refuses = |what: &str| exprs.iter().any(|e| e.contains(what) && names_port(e));
    let selector_empty =
        |v: Option<&Value>| v.is_none_or(|s| s.as_object().is_none_or(|m| m.is_empty()));
    let bound =
        objects.iter().filter(|o| o.kind() == "ValidatingAdmissionPolicyBinding").any(|b| {
            b.str_at("/spec/policyName") == Some(vap.name())
                && string_list(&b.value, "/spec/validationActions").iter().any(|a| a == "Deny")
                && selector_empty(b.value.pointer("/spec/matchResources/namespaceSelector"))
                && selector_empty(b.value.pointer("/spec/matchResources/objectSelector"))
        });
    let checks = [
        (services, "matchConstraints covering CREATE and UPDATE of v1 services".to_owned()),
        (
            vap.str_at("/spec/failurePolicy") != Some("Ignore"),
            "failurePolicy Fail (Ignore lets a Service through when the policy errs)".to_owned(),
        ),
        (
            vap.value.pointer("/spec/matchConditions").is_none(),
            "no matchConditions (they would exempt some requests)".to_owned(),
        ),
        (refuses("externalIPs"), format!("a validation on externalIPs and port {port}")),
        (refuses("LoadBalancer"), format!("a validation on LoadBalancer and port {port}")),
        (
            bound,
            "a ValidatingAdmissionPolicyBinding naming it, with validationActions [Deny] and no \
             namespace or object selector"
                .to_owned(),
        ),
    ];
    checks.into_iter().filter(|(ok, _)| !ok).map(|(_, what)| format!("needs {what}")).collect()
}

#[cfg(test)]
mod tests {
    use super::super::split;
    use super::*;
    use crate::util::root;

    const DS: &str = "deploy/base/daemonset.yaml";
    const VAP: &str = "deploy/components/proxy-port-guard/validatingadmissionpolicy.yaml";

    /// The shipped DaemonSet and policy, each file's text first changed by `edits` (file,
    /// from, to; each must apply); `origin` stands for the render.
    fn found(origin: &str, edits: &[(&str, &str, &str)]) -> Vec<String> {
        let mut objects = Vec::new();
        for file in [DS, VAP] {
            let mut text = std::fs::read_to_string(root().join(file)).expect(file);
            for (_, from, to) in edits.iter().filter(|(f, _, _)| *f == file) {
                assert!(text.contains(from), "{file}: {from:?} is not in the file");
                text = text.replace(from, to);
            }
            objects.extend(split(origin, &text).expect(file));
        }
        check(&objects)
    }

    fn refused(edits: &[(&str, &str, &str)], want: &[&str]) {
        let found = found("deploy/overlays/kind", edits);
        for w in want {
            assert!(found.iter().any(|p| p.contains(w)), "{w:?} not among {found:#?}");
        }
        assert_eq!(found.len(), want.len(), "{found:#?}");
    }

    #[test]
    fn the_shipped_daemonset_and_policy_pass() {
        assert_eq!(found("deploy/overlays/kind", &[]), Vec::<String>::new());
    }

    #[test]
    fn the_proxy_port_and_every_listener_are_declared() {
        let proxy = "            - name: metadata-proxy\n              containerPort: 9254\n              protocol: TCP\n";
        refused(
            &[(DS, proxy, "")],
            &["runs the metadata proxy on port 9254 but does not declare it"],
        );
        refused(
            &[(
                DS,
                "containerPort: 9254\n              protocol: TCP",
                "containerPort: 9254\n              protocol: UDP",
            )],
            &["does not declare it"],
        );
        refused(
            &[(DS, "containerPort: 9752", "containerPort: 9753")],
            &[
                "container kube-rbac-proxy listens on $(NODE_IP):9752 but does not declare port 9752",
            ],
        );
        refused(
            &[(DS, "containerPort: 9751", "containerPort: 9761")],
            &["listens on 127.0.0.1:9751"],
        );
    }

    #[test]
    fn a_proxy_port_of_its_own_needs_the_policy_changed_with_it() {
        let arg = "            - --state-dir\n";
        let moved =
            "            - --proxy-port\n            - \"9260\"\n            - --state-dir\n";
        refused(
            &[(DS, arg, moved), (DS, "containerPort: 9254", "containerPort: 9260")],
            &[
                "port 9260 is not kept from Services: ValidatingAdmissionPolicy metadata-gate-proxy-port: needs a validation on externalIPs and port 9260; needs a validation on LoadBalancer and port 9260",
            ],
        );
        refused(
            &[
                (DS, arg, moved),
                (DS, "containerPort: 9254", "containerPort: 9260"),
                (VAP, "p.port == 9254", "p.port == 9260"),
            ],
            &[],
        );
    }

    #[test]
    fn the_policy_must_be_bound_with_deny_and_cover_updates() {
        refused(
            &[(VAP, "validationActions: [Deny]", "validationActions: [Warn]")],
            &["needs a ValidatingAdmissionPolicyBinding"],
        );
        refused(&[(VAP, "\"CREATE\", \"UPDATE\"", "\"CREATE\"")], &["needs matchConstraints"]);
        refused(
            &[(VAP, "failurePolicy: Fail", "failurePolicy: Ignore")],
            &["needs failurePolicy Fail"],
        );
        refused(
            &[(VAP, "policyName: metadata-gate-proxy-port", "policyName: other")],
            &["needs a ValidatingAdmissionPolicyBinding naming it"],
        );
        refused(
            &[(VAP, "object.spec.type != 'LoadBalancer'", "object.spec.type != 'NodePort'")],
            &["needs a validation on LoadBalancer"],
        );
    }

    #[test]
    fn base_alone_need_not_ship_the_policy_but_an_overlay_must() {
        let no_policy = found(
            "deploy/base",
            &[(VAP, "kind: ValidatingAdmissionPolicy\n", "kind: ValidatingAdmissionPolicyX\n")],
        );
        assert_eq!(no_policy, Vec::<String>::new());
        refused(
            &[(VAP, "kind: ValidatingAdmissionPolicy\n", "kind: ValidatingAdmissionPolicyX\n")],
            &["no ValidatingAdmissionPolicy in this render"],
        );
    }
}
