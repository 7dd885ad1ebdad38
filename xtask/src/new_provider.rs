//! `cargo xtask new-provider NAME`: docs/new-provider.md's checklist, checked. It says, in
//! order, which step of adding platform NAME (as `--platform` names it: `External/acme`) is
//! done and what the first missing one needs, naming the file and the row, until the
//! platform is complete: endpoints, first-boot detection, providerID, the policy and its allow
//! list, safe paths, docs. What the agent knows of NAME comes from the agent itself
//! (`gate-agent platforms --json`, its platform registry); the rest from the files.
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::util::{root, run, yaml_options};

/// Where a provider's row lives, for the messages.
const TABLE: &str = "gate-agent/src/policy/platform/table.rs";
const ENUM: &str = "gate-agent/src/policy/platform/mod.rs";
const DOCS: &str = "docs/platforms.md";
const COMPONENTS: &str = "gate-agent/tests/fixtures/components.yaml";

/// One step of the checklist: done (with what was found) or what is missing.
struct Step {
    title: &'static str,
    outcome: std::result::Result<String, String>,
}

pub(crate) fn run_check(name: &str) -> Result<()> {
    let registry = registry()?;
    let row =
        items(&registry).find(|r| r["name"].as_str().is_some_and(|n| n.eq_ignore_ascii_case(name)));
    let steps = steps(name, row, &root())?;
    println!("new provider {name}:");
    let mut missing = None;
    for (i, s) in steps.iter().enumerate() {
        match (&s.outcome, missing) {
            (_, Some(_)) => println!("  {}. {:<22} not checked yet", i + 1, s.title),
            (Ok(found), None) => println!("  {}. {:<22} ok: {found}", i + 1, s.title),
            (Err(todo), None) => {
                println!("  {}. {:<22} MISSING\n{}", i + 1, s.title, indent(todo));
                missing = Some(i);
            }
        }
    }
    match missing {
        Some(i) => bail!(
            "{name} is not complete: step {} ({}) is next (docs/new-provider.md)",
            i + 1,
            steps[i].title
        ),
        None => {
            let file = row.and_then(|r| r["policyFile"].as_str()).unwrap_or("FILE");
            let protects = row.is_some_and(|r| r["noMetadataService"].is_null());
            println!("{name} is complete.");
            if protects {
                println!(
                    "Next: sudo -E cargo xtask policy-test --platform {name} {file}, then audit \
                     mode on a cluster (docs/new-provider.md, steps 7 and 8)"
                );
            }
            Ok(())
        }
    }
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("       {l}")).collect::<Vec<_>>().join("\n")
}

/// The agent's platform registry, from the agent built as the demo is (the quickest profile).
fn registry() -> Result<Value> {
    run(std::process::Command::new("cargo").args([
        "build",
        "-q",
        "-p",
        "gate-agent",
        "--profile",
        "demo",
    ]))
    .context("gate-agent must build before its platforms can be read")?;
    let agent = crate::bins::target_dir().join("demo/gate-agent");
    let out = std::process::Command::new(&agent)
        .args(["platforms", "--json"])
        .output()
        .with_context(|| format!("running {} platforms --json", agent.display()))?;
    if !out.status.success() {
        bail!("gate-agent platforms --json failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).context("gate-agent platforms --json printed no JSON")
}

/// The items of a JSON array (none for anything else).
fn items(v: &Value) -> impl Iterator<Item = &Value> {
    v.as_array().into_iter().flatten()
}

/// The strings of a JSON array.
fn strings(v: &Value) -> Vec<&str> {
    items(v).filter_map(Value::as_str).collect()
}

fn steps(name: &str, row: Option<&Value>, root: &Path) -> Result<Vec<Step>> {
    let Some(row) = row else {
        return Ok(vec![Step {
            title: "endpoints",
            outcome: Err(format!(
                "the agent knows no platform {name}. Add a variant to `Platform` in {ENUM} \
                 (an External provider: `External<Name>`), its arm in `facts` in {TABLE}, and \
                 its row there: `name: \"{name}\"`, the metadata service in `metadata` (every \
                 address, IPv4 and IPv6, with its ports and protocol) and the neighbours \
                 workloads need in `keep_open` (DNS, NTP on the same or nearby addresses). \
                 Leave the other fields empty (`&[]`, `None`) for the steps that follow."
            )),
        }]);
    };
    let no_service = row["noMetadataService"].as_str();
    let not_needed = |what: &str| format!("not needed: {what} ({})", no_service.unwrap_or(""));
    let described = |v: &Value| {
        let list: Vec<&str> = items(v).filter_map(|s| s["describe"].as_str()).collect();
        if list.is_empty() { "nothing".to_owned() } else { list.join(", ") }
    };

    let endpoints = match (row["metadata"].as_array().is_some_and(|m| !m.is_empty()), no_service) {
        (true, _) => Ok(format!(
            "protects {}; keeps open {}",
            described(&row["metadata"]),
            described(&row["keepOpen"])
        )),
        (false, Some(why)) => Ok(format!("no metadata service: {why}")),
        (false, None) => Err(format!(
            "{TABLE}, row {name}: `metadata` is empty. List the metadata service's \
             addresses (IPv4 and IPv6), ports and protocol, or say in \
             `no_metadata_service` why there is none."
        )),
    };

    let ids = strings(&row["ignitionIds"]);
    let dmi: Vec<String> = items(&row["dmi"])
        .map(|r| format!("DMI {} {}", r["field"].as_str().unwrap_or("?"), r["value"]))
        .collect();
    let first_boot = if !ids.is_empty() || !dmi.is_empty() {
        let ids = ids.iter().map(|i| format!("ignition.platform.id={i}"));
        Ok(ids.chain(dmi.iter().cloned()).collect::<Vec<_>>().join(", "))
    } else if no_service.is_some() {
        Ok(not_needed("nothing to protect before the agent runs"))
    } else {
        Err(format!(
            "{TABLE}, row {name}: `ignition_ids` and `dmi` are empty, so `gate-agent boot \
             --platform auto` cannot name {name} on a node's first boot and the node stays \
             open until the agent runs. Add the kernel command line's ignition.platform.id of \
             its CoreOS nodes (coreos/ignition docs/supported-platforms.md) to \
             `ignition_ids`, and the firmware strings that name it (cloud-init's \
             tools/ds-identify, dscheck_<Provider>) to `dmi`."
        ))
    };

    let schemes = strings(&row["providerIds"]);
    let provider_id = if !schemes.is_empty() {
        Ok(schemes.iter().map(|s| format!("{s}://")).collect::<Vec<_>>().join(", "))
    } else if no_service.is_some() {
        Ok(not_needed("no providerID to read it from is needed"))
    } else {
        Err(format!(
            "{TABLE}, row {name}: `provider_ids` is empty, so on Kubernetes without \
             OpenShift's Infrastructure object the agent cannot tell {name} from a node's \
             spec.providerID. Add the scheme its cloud-controller-manager writes \
             (`acme` of `acme://zone/id`)."
        ))
    };

    let policy = policy_step(name, row, root)?;

    let profiles: Vec<&str> = items(&row["profiles"]).filter_map(|p| p["name"].as_str()).collect();
    let sensitive = row["sensitive"].as_array().map_or(0, Vec::len);
    let safe_paths = if no_service.is_some() {
        Ok(not_needed("nothing is served"))
    } else if profiles.is_empty() || sensitive == 0 {
        Err(format!(
            "{TABLE}, row {name}: `profiles` ({} now) and `sensitive` ({sensitive} now). Add \
             the `safe` profile, `safe(&[get(PATH, WHAT IT REVEALS), ...], &[QUERY \
             PARAMETERS])`: the fewest exact paths that tell a workload where it runs \
             (instance id, region, zone, type) and nothing that authenticates it; and in \
             `sensitive` every path that must never be served (credentials, tokens, user data, \
             SSH keys, signed identity documents), exact or a prefix ending in `/`.",
            profiles.len()
        ))
    } else {
        Ok(format!("profiles {}; {sensitive} sensitive path(s)", profiles.join(", ")))
    };

    let docs = docs_step(name, row, root)?;
    Ok(vec![
        Step { title: "endpoints", outcome: endpoints },
        Step { title: "first-boot detection", outcome: first_boot },
        Step { title: "providerID", outcome: provider_id },
        Step { title: "policy and allow list", outcome: policy },
        Step { title: "safe paths", outcome: safe_paths },
        Step { title: "docs", outcome: docs },
    ])
}

/// The policy ConfigMap: the file, in the kustomization, built into the agent, valid and
/// without warnings for the platform, every pod entry pinned to its component.
fn policy_step(
    name: &str,
    row: &Value,
    root: &Path,
) -> Result<std::result::Result<String, String>> {
    let file = row["policyFile"].as_str().unwrap_or_default();
    let configmap = row["configMap"].as_str().unwrap_or_default();
    let path = root.join(file);
    if !path.exists() {
        return Ok(Err(format!(
            "{file} does not exist. Write the ConfigMap {configmap} (namespace metadata-gate, \
             key policy.yaml, `platform: {}`): the endpoints of step 1 and an allow entry per \
             host-network component that reads the metadata service, each with \
             hostNetwork: true and containers:, its labels from the component's manifest (for \
             OpenShift's own: the cluster-cloud-controller-manager-operator's \
             pkg/cloud/<platform>/assets/); say in a comment why a component is not listed.",
            row["platformType"].as_str().unwrap_or_default()
        )));
    }
    let stem = Path::new(file).file_name().and_then(|f| f.to_str()).unwrap_or_default();
    let kustomization = std::fs::read_to_string(root.join("deploy/policies/kustomization.yaml"))
        .context("reading deploy/policies/kustomization.yaml")?;
    if !kustomization.lines().any(|l| l.trim() == format!("- {stem}")) {
        return Ok(Err(format!(
            "deploy/policies/kustomization.yaml does not list {stem}: add `- {stem}` to its \
             resources"
        )));
    }
    if row["shipped"] != Value::Bool(true) {
        return Ok(Err(format!(
            "{TABLE}, row {name}: `shipped` is None. Set it to \
             `Some(include_str!(\"../../../../{file}\"))`, so that the boot step can install \
             the policy on a node's first boot."
        )));
    }
    let agent = crate::bins::target_dir().join("demo/gate-agent");
    let out = std::process::Command::new(&agent)
        .args(["check", "--json", "--platform", name])
        .arg(&path)
        .output()
        .context("running gate-agent check")?;
    let report: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("gate-agent check --json printed {:?}", out.stdout))?;
    let report = &report[0];
    let text = |v: &Value| v.as_str().unwrap_or("?").to_owned();
    if let Some(e) = report.get("error") {
        return Ok(Err(format!(
            "gate-agent check {file}: {}: {}",
            text(&e["field"]),
            text(&e["reason"])
        )));
    }
    let warnings: Vec<String> = items(&report["warnings"])
        .map(|w| format!("{}: {}", text(&w["field"]), text(&w["reason"])))
        .collect();
    if !warnings.is_empty() {
        return Ok(Err(format!(
            "gate-agent check --platform {name} {file} warns (a shipped policy has no \
             warnings):\n{}",
            warnings.join("\n")
        )));
    }
    let entries = strings(&report["allow"]);
    let components = std::fs::read_to_string(root.join(COMPONENTS))
        .with_context(|| format!("reading {COMPONENTS}"))?;
    let components: Value = serde_saphyr::from_str_with_options(&components, yaml_options())
        .with_context(|| format!("parsing {COMPONENTS}"))?;
    let pinned = |id: &str| items(&components["components"]).any(|c| c["id"] == id);
    let unpinned: Vec<&str> = entries.iter().copied().filter(|e| !pinned(e)).collect();
    if !unpinned.is_empty() {
        return Ok(Err(format!(
            "{COMPONENTS}: no component with id {} (the entry's name): pin each entry to the \
             manifest it was read from (repository, commit, path, the pod's labels, \
             hostNetwork, containers); cargo test -p gate-agent --test shipped_policies holds \
             it to that",
            unpinned.join(", ")
        )));
    }
    let allow = if entries.is_empty() {
        "no allow entry (its comment says why)".to_owned()
    } else {
        format!("allows {}", entries.join(", "))
    };
    Ok(Ok(format!("{file} ({configmap}), no warnings, {allow}")))
}

/// The rows of docs/platforms.md that name the platform: the endpoints table (with a source),
/// its providerID schemes, ignition ids and DMI strings, and its safe and sensitive paths.
fn docs_step(name: &str, row: &Value, root: &Path) -> Result<std::result::Result<String, String>> {
    let text =
        std::fs::read_to_string(root.join(DOCS)).with_context(|| format!("reading {DOCS}"))?;
    let section = |title: &str| {
        text.split(title).nth(1).and_then(|t| t.split("\n## ").next()).unwrap_or_default()
    };
    // A table row with a cell that is the platform's name, or a first cell whose bold text
    // lists it (`| **External / oci** |`, `| **PowerVS, VSphere** |`).
    let names_it = |line: &str| {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').map(str::trim).collect();
        let bold =
            cells.first().and_then(|c| c.strip_prefix("**")).and_then(|c| c.split_once("**"));
        let listed =
            bold.is_some_and(|(b, _)| b.replace(" / ", "/").split(", ").any(|n| n == name));
        listed || cells.contains(&name)
    };
    let row_with = |section: &str, cell: &str| {
        section
            .lines()
            .map(str::trim_start)
            .any(|l| l.starts_with('|') && names_it(l) && l.contains(cell))
    };
    let mut missing = Vec::new();
    let endpoints = section("## Protected endpoints, per platform");
    match endpoints.lines().find(|l| l.starts_with("| **") && names_it(l)) {
        None => missing.push(format!(
            "the endpoints table (\"Protected endpoints, per platform\"): a row `| **{}** | \
             protected | left open | sources |`",
            name.replace('/', " / ")
        )),
        Some(l) if !l.contains("](http") => missing
            .push(format!("the endpoints table's row for {name}: its sources cell links no page")),
        Some(_) => {}
    }
    let detection = section("## How the platform is detected");
    for s in strings(&row["providerIds"]) {
        if !row_with(detection, &format!("`{s}`")) {
            missing.push(format!("the providerID table: a row `| `{s}` | {name} |`"));
        }
    }
    for id in strings(&row["ignitionIds"]) {
        if !row_with(detection, &format!("`{id}`")) {
            missing.push(format!("the ignition.platform.id table: a row `| `{id}` | {name} |`"));
        }
    }
    for r in items(&row["dmi"]) {
        let value = r["value"].as_str().unwrap_or_default();
        if !row_with(detection, &format!("`{value}`")) {
            missing.push(format!(
                "the DMI table: a row `| `{}` | `{value}` | {name} |`",
                r["field"].as_str().unwrap_or_default()
            ));
        }
    }
    if row["profiles"].as_array().is_some_and(|p| !p.is_empty()) {
        let safe = section("## Safe profiles");
        let (safe_table, never_table) = safe.split_once("**Never served").unwrap_or((safe, ""));
        if !row_with(safe_table, "") {
            missing.push(format!("the safe paths table: a row `| {name} | paths | query | what they reveal | sources |`"));
        }
        if !row_with(never_table, "") {
            missing.push(format!(
                "the \"Never served\" table: a row `| {name} | sensitive paths | what they reveal |`"
            ));
        }
    }
    Ok(if missing.is_empty() {
        Ok(format!("{DOCS} has its rows"))
    } else {
        Err(format!("{DOCS} lacks:\n- {}", missing.join("\n- ")))
    })
}
