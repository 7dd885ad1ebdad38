//! `cargo xtask cluster manifests`: every object deploy/ ships, applied to a real API server
//! with server-side dry run and strict field validation, so that the server's own checks
//! (kinds, fields, schemas, defaults, admission) judge the manifests, not a copy of them. The
//! custom resources' CRDs are served from the schemas xtask/schemas vendors; the namespaces
//! the objects name are created first (a real cluster has them), nothing else is.
use std::{
    collections::BTreeSet,
    io::Write as _,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{manifests, util::show};
use integration_tests::cluster::ControlPlane;

/// Run `cmd` with `input` on stdin; its stdout, or its stderr as the error.
fn feed(mut cmd: Command, input: &[u8]) -> Result<String> {
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("starting {}", show(&cmd)))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input)?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `items` as a stream of JSON documents, as `kubectl apply -f` reads a file of several (a
/// `List` would lose their `null` fields on the way, which a file keeps).
fn list(items: Vec<Value>) -> Vec<u8> {
    items.iter().map(|i| i.to_string() + "\n").collect::<String>().into_bytes()
}

/// The namespaces `objects` live in, and those they create.
fn namespaces<'a>(objects: impl Iterator<Item = &'a Value>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for o in objects {
        if let Some(ns) = o.pointer("/metadata/namespace").and_then(Value::as_str) {
            out.insert(ns.to_owned());
        }
        if o.get("kind").and_then(Value::as_str) == Some("Namespace")
            && let Some(name) = o.pointer("/metadata/name").and_then(Value::as_str)
        {
            out.insert(name.to_owned());
        }
    }
    out
}

pub(crate) fn run() -> Result<()> {
    let shipped = manifests::shipped()?;
    let mut cp = ControlPlane::start()?;
    let kubectl = |args: &[&str]| -> Result<Command> {
        let mut c = cp.kubectl()?;
        c.args(args);
        Ok(c)
    };
    let crds = super::custom_resource_definitions()?;
    feed(kubectl(&["apply", "-f", "-"])?, &list(crds)).context("serving the vendored CRDs")?;
    feed(kubectl(&["wait", "--for=condition=Established", "crd", "--all", "--timeout=60s"])?, b"")?;
    let all = shipped.iter().flat_map(|(_, objects)| objects.iter());
    let namespaces = namespaces(all);
    for ns in &namespaces {
        let obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
        feed(kubectl(&["apply", "-f", "-"])?, &list(vec![obj]))
            .with_context(|| format!("creating namespace {ns}"))?;
    }
    for ns in &namespaces {
        cp.wait_for_default_account(ns)?;
    }
    let kubectl = |args: &[&str]| -> Result<Command> {
        let mut c = cp.kubectl()?;
        c.args(args);
        Ok(c)
    };
    let mut problems = Vec::new();
    let mut accepted = 0;
    for (origin, objects) in &shipped {
        let args = ["apply", "--dry-run=server", "--validate=strict", "-f", "-"];
        match feed(kubectl(&args)?, &list(objects.clone())) {
            Ok(_) => {
                accepted += objects.len();
                eprintln!("{origin}: {} objects accepted", objects.len());
            }
            Err(e) => problems.push(format!("{origin}:\n{e}")),
        }
    }
    if !problems.is_empty() {
        bail!(
            "the API server refused objects of deploy/ (logs in {}):\n{}",
            cp.logs().display(),
            problems.join("\n")
        );
    }
    eprintln!(
        "cluster manifests: {accepted} objects of {} targets accepted by kube-apiserver (dry run, \
         strict validation)",
        shipped.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_those_named_and_those_created() {
        let objects = [
            json!({"kind": "Namespace", "metadata": {"name": "metadata-gate"}}),
            json!({"kind": "ConfigMap", "metadata": {"name": "a", "namespace": "openshift-config"}}),
            json!({"kind": "ClusterRole", "metadata": {"name": "r"}}),
        ];
        let got: Vec<String> = namespaces(objects.iter()).into_iter().collect();
        assert_eq!(got, ["metadata-gate", "openshift-config"]);
    }
}
