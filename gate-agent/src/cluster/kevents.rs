//! Kubernetes Events: `MetadataAccessBlocked` on a pod whose workload was denied (or refused
//! by the metadata proxy), and `PolicyRejected` on a policy ConfigMap that was rejected.
//! Rate-limited per object so a hammering pod costs the API server one Event a minute.
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::{
    Client,
    runtime::{
        events::{Event, EventType, Recorder, Reporter},
        reflector::ObjectRef,
    },
};

use crate::{
    access::Identity,
    events::Denied,
    ratelimit::{Admit, RateLimiter},
};

pub(crate) const BLOCKED_REASON: &str = "MetadataAccessBlocked";
pub(crate) const REJECTED_REASON: &str = "PolicyRejected";

pub(crate) struct Publisher {
    recorder: Recorder,
    limiter: RateLimiter,
}

impl Publisher {
    pub(crate) fn new(client: Client, node: &str) -> Self {
        let reporter = Reporter {
            controller: "metadata-gate".into(),
            instance: Some(format!("metadata-gate-{node}")),
        };
        Self {
            recorder: Recorder::new(client, reporter),
            limiter: RateLimiter::new(1, Duration::from_secs(60), 4096),
        }
    }

    /// Publish unless this object already got an Event within the last minute. Failures are
    /// logged, never fatal: Events are a courtesy, enforcement does not depend on them.
    pub(crate) async fn publish(
        &mut self,
        object: ObjectReference,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        let key = format!(
            "{}/{}/{}",
            object.namespace.as_deref().unwrap_or_default(),
            object.name.as_deref().unwrap_or_default(),
            reason
        );
        if self.limiter.admit(&key, Instant::now()) == Admit::Suppress {
            return;
        }
        let _ = self.limiter.flush(Instant::now());
        let ev = Event {
            type_: if warning { EventType::Warning } else { EventType::Normal },
            reason: reason.into(),
            note: Some(note),
            action: if reason == BLOCKED_REASON { "Block".into() } else { "Validate".into() },
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &object).await {
            tracing::warn!(error = %e, reason, "publishing a Kubernetes Event");
        }
    }
}

/// The pod a workload runs in, if it is one.
pub(crate) fn pod_ref(w: &Identity) -> Option<ObjectRef<Pod>> {
    let (Some(namespace), Some(name)) = (w.namespace.as_deref(), w.pod.as_deref()) else {
        return None;
    };
    let mut pod = ObjectRef::new(name).within(namespace);
    pod.extra.uid.clone_from(&w.pod_uid);
    Some(pod)
}

/// The note of a denial's Event: the kernel's (who, to where), or the metadata proxy's (which
/// request, and why).
pub(crate) fn denial_note(d: &Denied, container: Option<&str>) -> String {
    let who = container.map(|c| format!("container {c}: ")).unwrap_or_default();
    let (dst, port) = (d.event.dst_text(), d.event.port);
    match &d.request {
        Some((request, why)) => format!(
            "{who}{request} to {dst}:{port} refused by the metadata proxy: {why}; only the \
             listed paths are served"
        ),
        None => format!(
            "{who}{} to {dst}:{port}/{} ({}) denied: cloud instance metadata is not for \
             workloads",
            d.event.comm(),
            d.event.proto_name(),
            d.endpoint,
        ),
    }
}

#[cfg(test)]
pub(crate) mod notes {
    use gate_common::abi::{DenyEvent, PROTO_TCP};

    use super::{Denied, denial_note};

    /// A denial of curl's TCP connect to 169.254.169.254:80 (the cluster loop's tests too).
    pub(crate) fn denied(request: Option<(String, String)>) -> Denied {
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(&[169, 254, 169, 254]);
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(b"curl");
        let event = DenyEvent {
            cgroup_id: 1,
            ts_ns: 0,
            addr,
            pid: 0,
            endpoint: 0,
            port: 80,
            proto: PROTO_TCP,
            family: 4,
            verdict: 2,
            hook: 0,
            _pad: [0; 2],
            comm,
        };
        Denied { workload: Default::default(), event, endpoint: "ec2-imds".into(), request }
    }

    #[test]
    fn an_event_says_which_request_the_proxy_refused() {
        let kernel = denial_note(&denied(None), Some("app"));
        assert_eq!(
            kernel,
            "container app: curl to 169.254.169.254:80/TCP (ec2-imds) denied: cloud instance \
             metadata is not for workloads"
        );
        let request =
            ("GET /latest/meta-data/iam/info".into(), "path not allowed (entry csi)".into());
        let proxy = denial_note(&denied(Some(request)), None);
        assert_eq!(
            proxy,
            "GET /latest/meta-data/iam/info to 169.254.169.254:80 refused by the metadata proxy: \
             path not allowed (entry csi); only the listed paths are served"
        );
    }
}

#[cfg(test)]
mod refs {
    use k8s_openapi::api::core::v1::ObjectReference;

    use super::*;

    #[test]
    fn a_denial_names_its_pod_by_uid_and_nothing_else_is_a_pod() {
        let w = Identity {
            workload: "ns/p/c".into(),
            namespace: Some("ns".into()),
            pod: Some("p".into()),
            container: Some("c".into()),
            pod_uid: Some("u-1".into()),
            ..Identity::default()
        };
        let object: ObjectReference = pod_ref(&w).map(Into::into).unwrap();
        let want = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some("ns".into()),
            name: Some("p".into()),
            uid: Some("u-1".into()),
            ..Default::default()
        };
        assert_eq!(object, want);
        assert!(pod_ref(&Identity::cgroup("system.slice/x")).is_none());
    }
}
