//! Self-healing: retry a policy whose apply failed, and check every tick that the gate is
//! whole (the root, every link, every pin, the metadata proxy's programs as the policy needs
//! them), putting back what is missing.
use std::{sync::atomic::Ordering, time::Instant};

use anyhow::Context as _;

use super::{Engine, GateOps, install};

impl<G: GateOps> Engine<G> {
    /// Retry a policy whose apply failed, once its backoff has passed.
    pub(super) async fn retry_due(&mut self) {
        let Some(r) = self.retry.as_ref().filter(|r| Instant::now() >= r.at) else { return };
        let (source, text) = (r.source.clone(), r.text.clone());
        self.offer(&source, &text, "retry").await;
    }

    /// Check that the gate is whole — the gated root is the cgroup the programs are on, every
    /// link attached, every pin in place — and put back what is missing. `/readyz` answers
    /// ready only while it is whole.
    pub(super) fn verify(&mut self) {
        let mut whole = true;
        let mut repaired: Vec<String> = Vec::new();
        match (self.reopen)(&self.root.path) {
            Ok(now) if now.id != self.root.id => {
                // Recreated under the same path: the live policy goes onto the new cgroup.
                let allow = self.allow.allow_set(&self.policy);
                let names = self.policy.endpoint_names();
                let applied =
                    self.gate.lock().map_err(|_| anyhow::anyhow!("gate lock poisoned")).and_then(
                        |mut g| {
                            g.apply(
                                &install(&self.policy, &names, &allow, self.node.node_flags()),
                                &now,
                            )
                            .context("writing the policy maps for the recreated root")?;
                            Ok(())
                        },
                    );
                match applied {
                    Ok(()) => {
                        repaired.push(format!("root (cgroup id {} -> {})", self.root.id, now.id));
                        self.metrics.repaired("root");
                        self.root = now;
                    }
                    Err(e) => {
                        whole = false;
                        tracing::error!(
                            error = format!("{e:#}"),
                            "taking over the recreated gated root"
                        );
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                whole = false;
                if self.ready.load(Ordering::Acquire) {
                    tracing::error!(error = %e, "the gated root is gone; not ready until it is back");
                }
            }
        }
        if whole {
            let result = self
                .gate
                .lock()
                .map_err(|_| anyhow::anyhow!("gate lock poisoned"))
                .and_then(|mut g| Ok(g.repair(&self.root)?));
            match result {
                Ok(r) => {
                    for what in &r {
                        self.metrics.repaired(what.what());
                    }
                    repaired.extend(r.iter().map(ToString::to_string));
                }
                Err(e) => {
                    whole = false;
                    tracing::error!(
                        error = format!("{e:#}"),
                        "repairing the gate; not ready until it is whole"
                    );
                }
            }
        }
        // The proxy's programs as the policy in force needs them: put in where that failed at
        // its apply (until then the kernel is not told of the proxy, and its paths are
        // denied), taken out where they were left in.
        if whole && !self.sync_proxy(super::proxy_for(self.proxy_side.as_ref(), &self.policy)) {
            whole = false;
        }
        if !repaired.is_empty() {
            tracing::warn!(what = repaired.join(", "), "gate repaired");
        }
        let was = self.ready.swap(whole, Ordering::AcqRel);
        if !was && whole {
            tracing::info!("the gate is whole again; ready");
        }
    }
}

/// A valid policy text whose apply failed.
pub(super) struct Retry {
    pub(super) source: String,
    pub(super) text: String,
    pub(super) at: Instant,
    pub(super) backoff: std::time::Duration,
}

impl Retry {
    pub(super) const FIRST: std::time::Duration = std::time::Duration::from_millis(500);
    pub(super) const MAX: std::time::Duration = std::time::Duration::from_secs(30);
}
