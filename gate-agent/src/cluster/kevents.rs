//! Kubernetes Events: `MetadataAccessBlocked` on a pod whose workload the kernel denied,
//! `MetadataRequestRefused` on one whose request the metadata proxy refused, and
//! `PolicyRejected` on a policy ConfigMap that was rejected. Rate-limited per object and
//! reason, so a hammering pod costs the API server one Event a minute.
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
    events::{Block, Blocked},
    ratelimit::{Admit, RateLimiter},
};

/// Why an Event is published: its reason and its action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The kernel denied a workload.
    Blocked,
    /// The metadata proxy refused a workload's request.
    Refused,
    /// A policy ConfigMap was rejected; the last good policy stays.
    PolicyRejected,
}

impl Reason {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Reason::Blocked => "MetadataAccessBlocked",
            Reason::Refused => "MetadataRequestRefused",
            Reason::PolicyRejected => "PolicyRejected",
        }
    }

    pub(crate) fn action(self) -> &'static str {
        match self {
            Reason::Blocked => "Block",
            Reason::Refused => "Refuse",
            Reason::PolicyRejected => "Validate",
        }
    }

    /// The reason of a workload's Event.
    pub(crate) fn of(b: &Block) -> Reason {
        match b {
            Block::Denied { .. } => Reason::Blocked,
            Block::Refused { .. } => Reason::Refused,
        }
    }
}

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
        reason: Reason,
        note: String,
    ) {
        let key = format!(
            "{}/{}/{}",
            object.namespace.as_deref().unwrap_or_default(),
            object.name.as_deref().unwrap_or_default(),
            reason.name()
        );
        if self.limiter.admit(&key, Instant::now()) == Admit::Suppress {
            return;
        }
        let _ = self.limiter.flush(Instant::now());
        let ev = Event {
            type_: if warning { EventType::Warning } else { EventType::Normal },
            reason: reason.name().into(),
            note: Some(note),
            action: reason.action().into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &object).await {
            tracing::warn!(error = %e, reason = reason.name(), "publishing a Kubernetes Event");
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

/// The note of a workload's Event: the kernel's denial (who, to where), or the metadata
/// proxy's refusal (which request, and why).
pub(crate) fn blocked_note(b: &Blocked, container: Option<&str>) -> String {
    let who = container.map(|c| format!("container {c}: ")).unwrap_or_default();
    match &b.how {
        Block::Refused { dst, request, why } => format!(
            "{who}{request} to {dst} refused by the metadata proxy: {why}; only the listed \
             paths are served"
        ),
        Block::Denied { event, endpoint } => format!(
            "{who}{} to {}:{}/{} ({endpoint}) denied: cloud instance metadata is not for \
             workloads",
            // The node-level program judges a packet with no process to name: a frame the
            // workload wrote past its socket hooks (AF_PACKET, a tap).
            Some(event.comm()).filter(|c| !c.is_empty()).unwrap_or_else(|| "a packet".into()),
            event.dst_text(),
            event.port,
            event.proto_name(),
        ),
    }
}

#[cfg(test)]
pub(crate) mod notes {
    use gate_common::abi::{DenyEvent, PROTO_TCP};

    use super::{Block, Blocked, Reason, blocked_note};

    /// A denial of curl's TCP connect to 169.254.169.254:80 (the cluster loop's tests too).
    pub(crate) fn denied() -> Blocked {
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
        let how = Block::Denied { event, endpoint: "ec2-imds".into() };
        Blocked { workload: Default::default(), how }
    }

    /// The metadata proxy's refusal of a GET of the node's role.
    pub(crate) fn refused() -> Blocked {
        let how = Block::Refused {
            dst: ([169, 254, 169, 254], 80).into(),
            request: "GET /latest/meta-data/iam/info".into(),
            why: "path not allowed (entry csi)".into(),
        };
        Blocked { workload: Default::default(), how }
    }

    #[test]
    fn a_denial_and_a_refusal_say_what_they_are() {
        let kernel = denied();
        assert_eq!(
            blocked_note(&kernel, Some("app")),
            "container app: curl to 169.254.169.254:80/TCP (ec2-imds) denied: cloud instance \
             metadata is not for workloads"
        );
        let Block::Denied { mut event, endpoint } = kernel.how.clone() else { unreachable!() };
        event.comm = [0; 16];
        let frame =
            Blocked { workload: Default::default(), how: Block::Denied { event, endpoint } };
        assert_eq!(
            blocked_note(&frame, Some("app")),
            "container app: a packet to 169.254.169.254:80/TCP (ec2-imds) denied: cloud instance \
             metadata is not for workloads"
        );
        assert_eq!(Reason::of(&kernel.how), Reason::Blocked);
        assert_eq!(
            (Reason::Blocked.name(), Reason::Blocked.action()),
            ("MetadataAccessBlocked", "Block")
        );
        let proxy = refused();
        assert_eq!(
            blocked_note(&proxy, None),
            "GET /latest/meta-data/iam/info to 169.254.169.254:80 refused by the metadata proxy: \
             path not allowed (entry csi); only the listed paths are served"
        );
        assert_eq!(Reason::of(&proxy.how), Reason::Refused);
        assert_eq!(
            (Reason::Refused.name(), Reason::Refused.action()),
            ("MetadataRequestRefused", "Refuse")
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
