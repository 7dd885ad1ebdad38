//! The API side of cluster mode: the client, and the watches the run loop reads — each one
//! backing off exponentially on errors (403, 5xx, an unreachable API server) and logging one
//! line when it starts failing and one when it recovers, never a line per retry.
use std::path::Path;

use anyhow::{Context as _, Result};
use futures::{Stream, StreamExt as _, future, stream::BoxStream};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::{
    Api, Client, ResourceExt as _,
    api::DynamicObject,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        WatchStreamExt as _,
        watcher::{self, Event},
    },
};

use super::platform::{self, Origin};

pub(crate) async fn client(kubeconfig: Option<&Path>) -> Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no in-cluster config and no kubeconfig")?,
    };
    Client::try_from(config).context("building the Kubernetes client")
}

/// A watch with exponential backoff (kube-runtime's default: from 0.8 s up to 30 s, reset
/// after two quiet minutes) whose errors are logged once per change of state.
fn backed_off<K: Send + 'static>(
    what: &'static str,
    stream: impl Stream<Item = watcher::Result<Event<K>>> + Send + 'static,
) -> BoxStream<'static, Event<K>> {
    let mut failing = false;
    stream
        .default_backoff()
        .filter_map(move |r| {
            let out = match r {
                Ok(ev) => {
                    if failing {
                        failing = false;
                        tracing::info!(watch = what, "watch recovered");
                    }
                    Some(ev)
                }
                Err(e) => {
                    if failing {
                        tracing::debug!(watch = what, error = %e, "watch still failing");
                    } else {
                        failing = true;
                        tracing::warn!(
                            watch = what, error = %e,
                            "watch failing; retrying with exponential backoff"
                        );
                    }
                    None
                }
            };
            future::ready(out)
        })
        .boxed()
}

/// The policy ConfigMap `ns/name`.
pub(crate) fn configmap(
    client: &Client,
    ns: &str,
    name: &str,
) -> BoxStream<'static, Event<ConfigMap>> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    backed_off("policy configmap", watcher::watcher(api, config))
}

/// OpenShift's Infrastructure object, if that is where the platform came from.
pub(crate) fn infrastructure(
    client: &Client,
    origin: Origin,
) -> BoxStream<'static, Event<DynamicObject>> {
    if origin != Origin::Infrastructure {
        return futures::stream::pending().boxed();
    }
    let api: Api<DynamicObject> =
        Api::all_with(client.clone(), &platform::infrastructure_resource());
    let config = watcher::Config::default().fields("metadata.name=cluster");
    backed_off("infrastructure", watcher::watcher(api, config))
}

/// The pods of this node, without their managedFields (the agent reads none of them, and the
/// pod store would keep them all).
pub(crate) fn pods(client: &Client, node: &str) -> BoxStream<'static, Event<Pod>> {
    let api: Api<Pod> = Api::all(client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let pods = watcher::watcher(api, config).modify(|pod| pod.managed_fields_mut().clear());
    backed_off("pods", pods)
}
