//! New nodes: a node carries the taint `metadata-gate.io/not-ready` (`NoSchedule` from the
//! kubelet's `--register-with-taints`; `NoExecute` where it lands after the node joined, as
//! an OpenShift MachineSet's taints do), so nothing but tolerating pods — the agent among
//! them — runs before the agent is ready (tolerate-all DaemonSets are the boot step's). The
//! agent removes the taint, whatever its effect, from its own Node once it is ready.
//!
//! `spec.taints` is replaced as a whole by a patch, so the patch carries the resourceVersion
//! it was computed from: a taint another controller added meanwhile makes it fail with 409
//! and it is computed afresh — never removed by us.
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::json;

/// The taint new nodes carry until the gate is closed on them.
pub(crate) const NOT_READY_TAINT: &str = "metadata-gate.io/not-ready";

/// Remove [`NOT_READY_TAINT`] from `node`, retrying with backoff until it is gone (or was
/// never there). Runs until done; errors are logged once per change of kind.
pub(crate) async fn remove_not_ready(client: Client, node: String) {
    let api: Api<Node> = Api::all(client);
    let mut backoff = Duration::from_millis(500);
    let mut failing = false;
    loop {
        match try_remove(&api, &node).await {
            Ok(Some(())) => {
                tracing::info!(
                    node,
                    taint = NOT_READY_TAINT,
                    "the gate is closed here: removed the node's not-ready taint"
                );
                return;
            }
            Ok(None) => return,
            Err(Conflict::Retry) => continue,
            Err(Conflict::Failed(e)) => {
                if !failing {
                    tracing::warn!(node, error = %e, "removing the node's not-ready taint; retrying with backoff");
                    failing = true;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}

enum Conflict {
    /// Someone changed the node meanwhile: compute the patch afresh.
    Retry,
    Failed(kube::Error),
}

/// `Some(())` if the taint was there and is gone now, `None` if it was not there.
async fn try_remove(api: &Api<Node>, node: &str) -> Result<Option<()>, Conflict> {
    let n = api.get(node).await.map_err(Conflict::Failed)?;
    let taints = n.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
    if !taints.iter().any(|t| t.key == NOT_READY_TAINT) {
        return Ok(None);
    }
    let rest: Vec<_> = taints.into_iter().filter(|t| t.key != NOT_READY_TAINT).collect();
    let patch = json!({
        "metadata": {"resourceVersion": n.metadata.resource_version},
        "spec": {"taints": rest},
    });
    match api.patch(node, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => Ok(Some(())),
        Err(kube::Error::Api(e)) if e.code == 409 => Err(Conflict::Retry),
        Err(e) => Err(Conflict::Failed(e)),
    }
}
