//! Cluster mode: the platform from the cluster, the policy from a ConfigMap, the allow set
//! from the pods on this node.
pub(crate) mod control;
pub mod identity;
pub(crate) mod kevents;
pub mod platform;
pub(crate) mod pods;
pub(crate) mod run;
pub(crate) mod taint;
pub(crate) mod watches;
