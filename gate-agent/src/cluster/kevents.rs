//! Kubernetes Events: `MetadataAccessBlocked` on a pod whose workload was denied (or refused
//! by the metadata proxy), and `PolicyRejected` on a policy ConfigMap that was rejected.
//! Rate-limited per object so a hammering pod costs the API server one Event a minute.
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};

use crate::ratelimit::{Admit, RateLimiter};

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
