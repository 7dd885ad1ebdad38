//! Cluster mode: the platform from the cluster, the policy from a ConfigMap, the allow set
//! from the pods on this node.
pub mod identity;
pub mod kevents;
pub mod platform;
pub mod run;
pub mod taint;
pub mod watches;
