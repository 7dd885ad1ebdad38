//! `cargo xtask manifests`: render every Kustomize target under deploy/ with `kubectl
//! kustomize` and check the decisions the objects encode, without a cluster.
//!
//! Their shape (kinds, fields, types, the custom resources against their CRDs' schemas) is
//! not checked here: a real API server judges it, every object applied with server-side dry
//! run and strict field validation (`cargo xtask cluster manifests`, root, in `.ci/run`).
//!
//! The decisions, across the objects of one render: Bidirectional mounts only in privileged
//! containers, the DaemonSet's namespace and service account exist, the SCC allows exactly
//! what the DaemonSet asks and is granted to it, policy ConfigMaps are named after their
//! platform, the MachineConfigs carry the boot unit as shipped; how the metrics are reached
//! and alerted on is in [`monitoring`]; how the metadata proxy's port is kept from other pods
//! and from Services is in [`proxy`].
mod monitoring;
mod promql;
mod proxy;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::util::{output, root, show, yaml_options};

/// Kustomize directories, relative to the workspace root. Each must render.
pub(crate) const TARGETS: &[&str] = &[
    "deploy/base",
    "deploy/policies",
    "deploy/overlays/openshift",
    "deploy/overlays/kind",
    "deploy/overlays/openshift-boot",
    "deploy/profiles/gke",
    "deploy/profiles/eks",
    "deploy/profiles/aks",
];

/// Plain manifests (applied with `kubectl apply -f`): parsed here, judged by the API server.
pub(crate) const PLAIN_DIRS: &[&str] = &["deploy/kind/e2e"];

/// Targets applied together, checked as one render: a component that only adds objects
/// (`kubectl apply -k` of each, or the component listed under `components:`) together with
/// the overlay it goes on. overlays/openshift includes components/monitoring itself.
pub(crate) const COMBINED: &[&[&str]] =
    &[&["deploy/overlays/kind", "deploy/components/monitoring"]];

/// Namespace of the agent and of its policy ConfigMaps.
const NAMESPACE: &str = "metadata-gate";
const POLICY_PREFIX: &str = "metadata-gate-policy-";

/// One rendered object and where it came from.
struct Object {
    /// `deploy/overlays/kind` or a file name.
    origin: String,
    value: Value,
}

impl Object {
    fn str_at(&self, pointer: &str) -> Option<&str> {
        self.value.pointer(pointer).and_then(Value::as_str)
    }

    fn kind(&self) -> &str {
        self.str_at("/kind").unwrap_or("")
    }

    fn name(&self) -> &str {
        self.str_at("/metadata/name").unwrap_or("")
    }

    fn namespace(&self) -> Option<&str> {
        self.str_at("/metadata/namespace")
    }

    /// The containers and init containers of a DaemonSet's pod.
    fn containers(&self) -> Vec<&Value> {
        ["containers", "initContainers"]
            .iter()
            .filter_map(|k| self.value.pointer(&format!("/spec/template/spec/{k}")))
            .filter_map(Value::as_array)
            .flatten()
            .collect()
    }

    /// `deploy/overlays/kind: DaemonSet metadata-gate/metadata-gate-agent`
    fn label(&self) -> String {
        let ns = self.namespace().map(|n| format!("{n}/")).unwrap_or_default();
        format!("{}: {} {ns}{}", self.origin, self.kind(), self.name())
    }
}

/// Where the objects' shape is checked, for the messages of this offline check.
const SHAPE: &str = "kinds, fields and schemas: `cargo xtask cluster manifests` (root)";

pub(crate) fn run() -> Result<()> {
    let mut problems = Vec::new();
    let mut objects_seen = 0;
    for target in TARGETS {
        let objects = render(target)?;
        objects_seen += objects.len();
        problems.extend(check_set(&objects));
    }
    for targets in COMBINED {
        problems.extend(check_set(&render_combined(targets)?));
    }
    for dir in PLAIN_DIRS {
        objects_seen += read_plain(dir)?.len();
    }
    problems.extend(verify_boot_unit()?);
    if !problems.is_empty() {
        bail!("{} problem(s) in deploy/:\n  {}", problems.len(), problems.join("\n  "));
    }
    eprintln!(
        "manifests: {} Kustomize targets, {} combined, {} plain dirs, {objects_seen} objects: \
         decisions OK ({SHAPE})",
        TARGETS.len(),
        COMBINED.len(),
        PLAIN_DIRS.len()
    );
    Ok(())
}

/// Every object deploy/ ships, by where it comes from: each Kustomize target rendered, each
/// combination of [`COMBINED`], and each plain directory's files (for the API server's own
/// check, `cargo xtask cluster manifests`).
pub(crate) fn shipped() -> Result<Vec<(String, Vec<Value>)>> {
    let values = |objects: Vec<Object>| objects.into_iter().map(|o| o.value).collect();
    let mut out = Vec::new();
    for target in TARGETS {
        out.push((target.to_string(), values(render(target)?)));
    }
    for targets in COMBINED {
        out.push((targets.join(" + "), values(render_combined(targets)?)));
    }
    for dir in PLAIN_DIRS {
        out.push((dir.to_string(), values(read_plain(dir)?)));
    }
    Ok(out)
}

/// The objects of `targets` rendered one by one, as one render named `A + B`.
fn render_combined(targets: &[&str]) -> Result<Vec<Object>> {
    let mut objects = Vec::new();
    for target in targets {
        objects.extend(render(target)?);
    }
    let name = targets.join(" + ");
    for o in &mut objects {
        o.origin = name.clone();
    }
    Ok(objects)
}

/// `kubectl kustomize DIR`, split into objects.
fn render(target: &str) -> Result<Vec<Object>> {
    if output(Command::new("kubectl").args(["version", "--client"])).is_none() {
        bail!(
            "kubectl not found: the manifest check renders deploy/ with `kubectl kustomize`; \
             install the Debian package kubectl (`cargo xtask setup` does)"
        );
    }
    let mut cmd = Command::new("kubectl");
    cmd.arg("kustomize").arg(root().join(target));
    let out = cmd.output().with_context(|| format!("starting {}", show(&cmd)))?;
    if !out.status.success() {
        bail!(
            "{target}: `kubectl kustomize` failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text =
        String::from_utf8(out.stdout).with_context(|| format!("{target}: output is not UTF-8"))?;
    let objects = split(target, &text)?;
    if objects.is_empty() {
        bail!("{target}: renders no object");
    }
    Ok(objects)
}

/// Every `*.yaml` in a directory, split into objects (origin: the file).
fn read_plain(dir: &str) -> Result<Vec<Object>> {
    let path = root().join(dir);
    let mut files: Vec<_> = std::fs::read_dir(&path)
        .with_context(|| format!("cannot read {dir}"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("cannot list {dir}"))?;
    files.retain(|p| p.extension().is_some_and(|x| x == "yaml"));
    files.sort();
    let mut objects = Vec::new();
    for file in files {
        let origin = relative(&file);
        let text =
            std::fs::read_to_string(&file).with_context(|| format!("cannot read {origin}"))?;
        objects.extend(split(&origin, &text)?);
    }
    Ok(objects)
}

fn relative(path: &Path) -> String {
    path.strip_prefix(root()).unwrap_or(path).display().to_string()
}

/// Split a multi-document YAML stream into JSON values; empty documents are skipped.
fn split(origin: &str, text: &str) -> Result<Vec<Object>> {
    let mut objects = Vec::new();
    let docs: Vec<Value> = serde_saphyr::from_multiple_with_options(text, yaml_options())
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("{origin}: a YAML document is not valid"))?;
    for (i, value) in docs.into_iter().enumerate() {
        match value {
            Value::Null => {}
            Value::Object(_) => objects.push(Object { origin: origin.to_owned(), value }),
            _ => bail!("{origin}: YAML document {} is not a mapping", i + 1),
        }
    }
    Ok(objects)
}

/// The rules for the objects of one render.
fn check_set(objects: &[Object]) -> Vec<String> {
    let mut problems = check_machineconfigs(objects);
    problems.extend(check_policy_configmaps(objects));
    problems.extend(check_daemonsets(objects));
    problems.extend(proxy::check(objects));
    problems.extend(monitoring::check_services(objects));
    let (found, scrapes) = monitoring::check_service_monitors(objects);
    problems.extend(found);
    problems.extend(monitoring::check_rules(objects, &scrapes));
    problems
}

// ---- MachineConfig (the boot step) ---------------------------------------------------------

/// The boot unit and script every MachineConfig of ours carries, word for word.
const BOOT_UNIT: &str = "deploy/boot/metadata-gate-boot.service";
const BOOT_SCRIPT: &str = "deploy/boot/metadata-gate-boot.sh";
const ROLE_LABEL: &str = "machineconfiguration.openshift.io/role";
/// The DaemonSet whose image the boot step runs on a node's first boot.
const DAEMONSET: &str = "deploy/base/daemonset.yaml";

/// Every MachineConfig of the render, by [`machineconfig`].
fn check_machineconfigs(objects: &[Object]) -> Vec<String> {
    let mcs = objects.iter().filter(|o| o.kind() == "MachineConfig");
    mcs.flat_map(|o| machineconfig(&o.value).into_iter().map(|r| format!("{}: {r}", o.label())))
        .collect()
}

/// What a MachineConfig of ours carries (its CRD leaves `spec.config` free, so the API server
/// does not look inside): a role label, Ignition 3, the boot unit as [`BOOT_UNIT`] and
/// enabled, the script as [`BOOT_SCRIPT`] and executable, and a boot.env naming the
/// DaemonSet's image.
fn machineconfig(v: &Value) -> Vec<String> {
    use base64::Engine as _;
    let read = |f: &str| std::fs::read(root().join(f)).unwrap_or_default();
    let script = base64::engine::general_purpose::STANDARD.encode(read(BOOT_SCRIPT));
    let (unit_file, script_file) =
        ("metadata-gate-boot.service", "/usr/local/bin/metadata-gate-boot");
    let item = |list: &str, key: &str, name: &str| {
        let items = v.pointer(list).and_then(Value::as_array);
        items.and_then(|l| l.iter().find(|i| i[key] == name)).cloned().unwrap_or(Value::Null)
    };
    let unit = item("/spec/config/systemd/units", "name", unit_file);
    let bin = item("/spec/config/storage/files", "path", script_file);
    let env = item("/spec/config/storage/files", "path", "/etc/metadata-gate/boot.env");
    let role = v.pointer(&format!("/metadata/labels/{}", ROLE_LABEL.replace('/', "~1")));
    let ignition = v.pointer("/spec/config/ignition/version").and_then(Value::as_str).unwrap_or("");
    let want_env =
        format!("data:,METADATA_GATE_IMAGE={}%0A", daemonset_image().unwrap_or_default());
    let checks = [
        (role.is_some_and(Value::is_string), format!("metadata.labels: {ROLE_LABEL} is missing")),
        (ignition.starts_with("3."), format!("Ignition version {ignition:?}: 3.x expected")),
        (unit["enabled"] == true, format!("systemd unit {unit_file}: missing or not enabled")),
        (
            unit["contents"] == *String::from_utf8_lossy(&read(BOOT_UNIT)),
            format!("{unit_file}: contents differ from {BOOT_UNIT}"),
        ),
        (bin["mode"] == 0o755, format!("file {script_file}: missing or mode not 493 (0755)")),
        (
            bin["contents"]["source"] == format!("data:text/plain;charset=utf-8;base64,{script}"),
            format!("{script_file}: contents differ from {BOOT_SCRIPT}"),
        ),
        (
            env["contents"]["source"] == want_env,
            format!(
                "/etc/metadata-gate/boot.env: {}, expected {want_env:?} (the image of {DAEMONSET})",
                env["contents"]["source"]
            ),
        ),
    ];
    checks.into_iter().filter(|(ok, _)| !ok).map(|(_, e)| e).collect()
}

/// `systemd-analyze verify` of the boot unit, installed with its script under a scratch root
/// as the MachineConfigs install them: every warning is a problem (systemd only warns about
/// a misspelt setting and goes on without it).
fn verify_boot_unit() -> Result<Vec<String>> {
    if output(Command::new("systemd-analyze").arg("--version")).is_none() {
        bail!(
            "systemd-analyze not found: the manifest check verifies the boot unit with it (Debian package systemd)"
        );
    }
    let scratch = std::env::temp_dir().join(format!("mg-unit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let (bin, units) = (scratch.join("usr/local/bin"), scratch.join("etc/systemd/system"));
    std::fs::create_dir_all(&bin)?;
    std::fs::create_dir_all(&units)?;
    std::fs::copy(root().join(BOOT_SCRIPT), bin.join("metadata-gate-boot"))?;
    std::fs::copy(root().join(BOOT_UNIT), units.join("metadata-gate-boot.service"))?;
    let mut cmd = Command::new("systemd-analyze");
    cmd.arg("verify")
        .arg(format!("--root={}", scratch.display()))
        .arg("metadata-gate-boot.service");
    let out = cmd.output().with_context(|| format!("starting {}", show(&cmd)));
    let _ = std::fs::remove_dir_all(&scratch);
    let out = out?;
    let said = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    Ok(if out.status.success() && said.is_empty() {
        Vec::new()
    } else {
        vec![format!("{BOOT_UNIT}: systemd-analyze verify ({}): {said}", out.status)]
    })
}

/// The agent container's image in the base DaemonSet.
fn daemonset_image() -> Option<String> {
    let text = std::fs::read_to_string(root().join(DAEMONSET)).ok()?;
    let ds: Value = serde_saphyr::from_str_with_options(&text, yaml_options()).ok()?;
    let containers = ds.pointer("/spec/template/spec/containers")?.as_array()?;
    let agent = containers.iter().find(|c| c["name"] == "agent")?;
    agent["image"].as_str().map(str::to_owned)
}

/// The value of `--name=VALUE` or `--name VALUE` among `args`.
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix(&format!("{name}="))
            .map(str::to_owned)
            .or_else(|| (a == name).then(|| args.get(i + 1).cloned().unwrap_or_default()))
    })
}

fn string_list(v: &Value, pointer: &str) -> Vec<String> {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default()
}

// ---- cross-object rules --------------------------------------------------------------------

fn has_object(objects: &[Object], kind: &str, ns: Option<&str>, name: &str) -> bool {
    objects.iter().any(|o| o.kind() == kind && o.namespace() == ns && o.name() == name)
}

/// `metadata-gate-policy-<suffix>` ConfigMaps: in the agent's namespace, key policy.yaml,
/// named after the policy's platform (lower case; External adds `-<platformName>`).
fn check_policy_configmaps(objects: &[Object]) -> Vec<String> {
    let mut problems = Vec::new();
    for o in objects.iter().filter(|o| o.kind() == "ConfigMap") {
        let Some(suffix) = o.name().strip_prefix(POLICY_PREFIX) else { continue };
        if o.namespace() != Some(NAMESPACE) {
            problems
                .push(format!("{}: policy ConfigMaps belong in namespace {NAMESPACE}", o.label()));
        }
        let Some(text) = o.str_at("/data/policy.yaml") else {
            problems.push(format!("{}: data[\"policy.yaml\"] is missing", o.label()));
            continue;
        };
        let platform = serde_saphyr::from_str_with_options::<Value>(text, yaml_options())
            .ok()
            .and_then(|p| p.get("platform").and_then(|p| p.as_str()).map(str::to_owned));
        let Some(platform) = platform else {
            problems.push(format!("{}: policy.yaml names no platform", o.label()));
            continue;
        };
        let lower = platform.to_ascii_lowercase();
        let matches = suffix == lower || (lower == "external" && suffix.starts_with("external-"));
        if !matches {
            problems.push(format!(
                "{}: holds the policy for platform {platform}, but the agent looks for \
                 {POLICY_PREFIX}{lower}",
                o.label()
            ));
        }
    }
    problems
}

/// Rules for each DaemonSet of a render, against the other objects of the same render.
fn check_daemonsets(objects: &[Object]) -> Vec<String> {
    let mut problems = Vec::new();
    for ds in objects.iter().filter(|o| o.kind() == "DaemonSet") {
        let label = ds.label();
        let ns = ds.namespace().unwrap_or("default");
        let spec = ds.value.pointer("/spec/template/spec").cloned().unwrap_or(Value::Null);
        let containers = ds.containers();

        // The API server refuses Bidirectional propagation on an unprivileged container.
        for c in &containers {
            let cname = c.get("name").and_then(Value::as_str).unwrap_or("?");
            let privileged =
                c.pointer("/securityContext/privileged").and_then(Value::as_bool).unwrap_or(false);
            for m in c.get("volumeMounts").and_then(Value::as_array).into_iter().flatten() {
                if m.get("mountPropagation").and_then(Value::as_str) == Some("Bidirectional")
                    && !privileged
                {
                    problems.push(format!(
                        "{label}: container {cname}: mountPropagation Bidirectional on {} is \
                         refused by the API server for a container that is not privileged",
                        m.get("mountPath").and_then(Value::as_str).unwrap_or("?")
                    ));
                }
            }
        }

        let sa = spec.get("serviceAccountName").and_then(Value::as_str).unwrap_or("default");
        for (kind, in_ns, name) in [("Namespace", None, ns), ("ServiceAccount", Some(ns), sa)] {
            if !has_object(objects, kind, in_ns, name) {
                let at = in_ns.map(|n| format!("{n}/")).unwrap_or_default();
                problems.push(format!("{label}: {kind} {at}{name} is not part of this render"));
            }
        }
        problems.extend(check_scc(objects, ds, &spec, &containers, ns, sa));
        problems.extend(check_agent_args(objects, &label, &containers, ns));
        problems.extend(monitoring::check_daemonset(objects, &label, &spec, &containers, ns, sa));
    }
    problems
}

/// The agent's own flags that name objects or values: `--platform NAME` needs the ConfigMap
/// `metadata-gate-policy-<name>` (lower case, `/` as `-`) in the agent's namespace of the same
/// render, unless `--policy-configmap` names another; `--gate-scope` takes `all-pods` or
/// `host-network-only`.
fn check_agent_args(
    objects: &[Object],
    label: &str,
    containers: &[&Value],
    ns: &str,
) -> Vec<String> {
    let mut problems = Vec::new();
    for c in containers {
        let args = string_list(c, "/args");
        let value = |name: &str| flag(&args, name);
        if let Some(scope) = value("--gate-scope")
            && !matches!(scope.as_str(), "all-pods" | "host-network-only")
        {
            problems.push(format!(
                "{label}: --gate-scope {scope:?}: expected all-pods or host-network-only"
            ));
        }
        let Some(platform) = value("--platform") else { continue };
        if value("--policy-configmap").is_some() {
            continue;
        }
        let want = format!("{POLICY_PREFIX}{}", platform.to_ascii_lowercase().replace('/', "-"));
        if !has_object(objects, "ConfigMap", Some(ns), &want) {
            problems.push(format!(
                "{label}: --platform {platform} reads ConfigMap {ns}/{want}, which is not part of \
                 this render"
            ));
        }
    }
    problems
}

/// If the render has an SCC (OpenShift), it must admit this DaemonSet's pod exactly: allowed
/// capabilities = the added ones, host network and hostPath only as used, granted to the
/// pod's service account, and required by the pod's annotation.
fn check_scc(
    objects: &[Object],
    ds: &Object,
    spec: &Value,
    containers: &[&Value],
    ns: &str,
    sa: &str,
) -> Vec<String> {
    let sccs: Vec<&Object> =
        objects.iter().filter(|o| o.kind() == "SecurityContextConstraints").collect();
    if sccs.is_empty() {
        return Vec::new();
    }
    let label = ds.label();
    let mut problems = Vec::new();
    let required = ds
        .str_at("/spec/template/metadata/annotations/openshift.io~1required-scc")
        .map(str::to_owned);
    let Some(required) = required else {
        return vec![format!(
            "{label}: set annotation openshift.io/required-scc on the pod template to the SCC of \
             this render ({})",
            sccs.iter().map(|s| s.name()).collect::<Vec<_>>().join(", ")
        )];
    };
    let Some(scc) = sccs.iter().find(|s| s.name() == required) else {
        return vec![format!("{label}: requires SCC {required}, which is not part of this render")];
    };
    let scc_label = scc.label();

    let added: BTreeSet<String> = containers
        .iter()
        .flat_map(|c| string_list(c, "/securityContext/capabilities/add"))
        .collect();
    let allowed: BTreeSet<String> =
        string_list(&scc.value, "/allowedCapabilities").into_iter().collect();
    if added != allowed {
        problems.push(format!(
            "{scc_label}: allowedCapabilities {allowed:?} must equal the capabilities the \
             DaemonSet adds {added:?}"
        ));
    }
    problems.extend(scc_admits_users(scc, spec, containers));
    let scc_bool = |f: &str| scc.value.get(f).and_then(Value::as_bool).unwrap_or(false);
    for (pod_field, scc_field) in [
        ("hostNetwork", "allowHostNetwork"),
        ("hostPID", "allowHostPID"),
        ("hostIPC", "allowHostIPC"),
    ] {
        let used = spec.get(pod_field).and_then(Value::as_bool).unwrap_or(false);
        if used != scc_bool(scc_field) {
            problems.push(format!(
                "{scc_label}: {scc_field} is {} but the DaemonSet's {pod_field} is {used}",
                scc_bool(scc_field)
            ));
        }
    }
    // On a hostNetwork pod every declared containerPort is a hostPort.
    let host_network = spec.get("hostNetwork").and_then(Value::as_bool).unwrap_or(false);
    let host_ports = containers.iter().any(|c| {
        c.get("ports").and_then(Value::as_array).into_iter().flatten().any(|p| {
            host_network || p.get("hostPort").and_then(Value::as_u64).is_some_and(|n| n > 0)
        })
    });
    if host_ports != scc_bool("allowHostPorts") {
        problems.push(format!(
            "{scc_label}: allowHostPorts is {} but the pod {} host ports",
            scc_bool("allowHostPorts"),
            if host_ports { "declares" } else { "declares no" }
        ));
    }
    if containers
        .iter()
        .any(|c| c.pointer("/securityContext/privileged").and_then(Value::as_bool) == Some(true))
        != scc_bool("allowPrivilegedContainer")
    {
        problems
            .push(format!("{scc_label}: allowPrivilegedContainer does not match the DaemonSet"));
    }

    // Volume types the pod uses, plus `projected` for the service account token.
    let mut used_volumes: BTreeSet<String> = spec
        .get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_object())
        .filter_map(|v| v.keys().find(|k| *k != "name").cloned())
        .collect();
    used_volumes.insert("projected".into());
    let scc_volumes: BTreeSet<String> = string_list(&scc.value, "/volumes").into_iter().collect();
    if used_volumes != scc_volumes {
        problems.push(format!(
            "{scc_label}: volumes {scc_volumes:?} must equal the volume types the pod uses \
             {used_volumes:?}"
        ));
    }
    if used_volumes.contains("hostPath") != scc_bool("allowHostDirVolumePlugin") {
        problems.push(format!(
            "{scc_label}: allowHostDirVolumePlugin does not match the hostPath volumes"
        ));
    }

    // Granted to the service account: `users:` or an RBAC `use` rule bound to it.
    let sa_user = format!("system:serviceaccount:{ns}:{sa}");
    let by_user = string_list(&scc.value, "/users").contains(&sa_user);
    let by_rbac = monitoring::grants(objects, ns, sa).iter().any(|(scope, r)| {
        // A RoleBinding grants `use` only to pods of its own namespace.
        scope.as_deref().is_none_or(|s| s == ns)
            && monitoring::allows(r, "security.openshift.io", "securitycontextconstraints", "use")
            && (r.get("resourceNames").is_none() || monitoring::has(r, "resourceNames", scc.name()))
    });
    if !by_user && !by_rbac {
        problems.push(format!(
            "{scc_label}: not granted to {sa_user}: add a Role/ClusterRole with verb `use` on \
             securitycontextconstraints {} bound to it",
            scc.name()
        ));
    }
    problems
}

/// Each container's user (its own runAsUser, else the pod's, else the SCC's default, which
/// always fits) is one the SCC's runAsUser strategy admits.
fn scc_admits_users(scc: &Object, spec: &Value, containers: &[&Value]) -> Vec<String> {
    let strategy = scc.str_at("/runAsUser/type").unwrap_or("");
    let at = |f: &str| scc.value.pointer(&format!("/runAsUser/{f}")).and_then(Value::as_u64);
    let pod_user = spec.pointer("/securityContext/runAsUser").and_then(Value::as_u64);
    let mut problems = Vec::new();
    for c in containers {
        let cname = c.get("name").and_then(Value::as_str).unwrap_or("?");
        let Some(uid) =
            c.pointer("/securityContext/runAsUser").and_then(Value::as_u64).or(pod_user)
        else {
            continue;
        };
        let admitted = match strategy {
            "MustRunAs" => at("uid") == Some(uid),
            "MustRunAsRange" => at("uidRangeMin")
                .zip(at("uidRangeMax"))
                .is_some_and(|(lo, hi)| (lo..=hi).contains(&uid)),
            "MustRunAsNonRoot" => uid != 0,
            _ => true,
        };
        if !admitted {
            problems.push(format!(
                "{}: runAsUser {strategy} does not admit user {uid} of container {cname}",
                scc.label()
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(yaml: &str) -> Object {
        let value: Value =
            serde_saphyr::from_str_with_options(yaml, yaml_options()).expect("test YAML");
        Object { origin: "test".into(), value }
    }

    /// A DaemonSet d/n with one container `c`; `container` and `pod` are more YAML lines for
    /// the container and the pod spec.
    fn daemonset(container: &str, pod: &str) -> Object {
        obj(&format!(
            "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {{name: d, namespace: n}}\nspec:\n  \
             selector: {{matchLabels: {{a: b}}}}\n  template:\n    metadata: {{labels: {{a: b}}}}\n    \
             spec:\n      containers:\n        - name: c\n          image: i\n          \
             {container}\n      {pod}\n"
        ))
    }

    #[test]
    fn bidirectional_needs_privileged() {
        let ds = daemonset(
            "volumeMounts: [{name: v, mountPath: /x, mountPropagation: Bidirectional}]",
            "volumes: [{name: v, hostPath: {path: /x}}]",
        );
        let problems = check_daemonsets(&[ds]);
        assert!(problems.iter().any(|p| p.contains("Bidirectional")), "{problems:?}");
    }

    #[test]
    fn a_fixed_platform_needs_its_policy_in_the_render() {
        let ds = daemonset("args: [run, --platform, External/oci, --gate-scope, pods]", "");
        let c = ds.value.pointer("/spec/template/spec/containers/0").cloned().expect("container");
        let problems = check_agent_args(&[], "ds", &[&c], "n");
        assert!(
            problems.iter().any(|p| p.contains("n/metadata-gate-policy-external-oci")),
            "{problems:?}"
        );
        assert!(problems.iter().any(|p| p.contains("--gate-scope \"pods\"")), "{problems:?}");
        let cm = obj(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: metadata-gate-policy-external-oci, namespace: n}\n",
        );
        let problems = check_agent_args(&[cm], "ds", &[&c], "n");
        assert_eq!(problems.len(), 1, "{problems:?}");
    }

    #[test]
    fn the_scc_admits_every_container_user() {
        let scc = |user: &str| {
            obj(&format!(
                "apiVersion: security.openshift.io/v1\nkind: SecurityContextConstraints\nmetadata: {{name: s}}\nrunAsUser: {user}\n"
            ))
        };
        let ds = daemonset(
            "securityContext: {runAsUser: 0}\n        - name: proxy\n          image: p\n          securityContext: {runAsUser: 65534}",
            "",
        );
        let spec = ds.value.pointer("/spec/template/spec").cloned().expect("spec");
        let containers: Vec<&Value> =
            spec["containers"].as_array().expect("containers").iter().collect();
        let found = scc_admits_users(&scc("{type: MustRunAs, uid: 0}"), &spec, &containers);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("user 65534 of container proxy"), "{found:?}");
        let range = scc("{type: MustRunAsRange, uidRangeMin: 0, uidRangeMax: 65534}");
        assert_eq!(scc_admits_users(&range, &spec, &containers), Vec::<String>::new());
        let nonroot = scc_admits_users(&scc("{type: MustRunAsNonRoot}"), &spec, &containers);
        assert!(nonroot.len() == 1 && nonroot[0].contains("user 0 of container c"), "{nonroot:?}");
    }

    #[test]
    fn the_machineconfigs_carry_the_boot_step_as_shipped() {
        for file in [
            "deploy/overlays/openshift-boot/machineconfig-worker.yaml",
            "deploy/overlays/openshift-boot/machineconfig-master.yaml",
        ] {
            let text = std::fs::read_to_string(root().join(file)).expect(file);
            let shipped = split(file, &text).expect(file);
            assert_eq!(check_machineconfigs(&shipped), Vec::<String>::new(), "{file}");
            let changed = text.replace("mode: 493", "mode: 420").replace("enabled: true", "");
            let problems = check_machineconfigs(&split(file, &changed).expect(file));
            assert!(problems.iter().any(|p| p.contains("mode not 493")), "{problems:?}");
            assert!(problems.iter().any(|p| p.contains("not enabled")), "{problems:?}");
        }
    }
}
