//! Policies the benchmark writes: the AWS example, optionally with generated endpoints and
//! allow entries (scale) or an extra endpoint (policy change latency).
use std::fmt::Write as _;

#[derive(Default)]
pub(super) struct Extra {
    /// (name, cidr, ports)
    pub endpoints: Vec<(String, String, String)>,
    /// (name, cgroup glob)
    pub allow: Vec<(String, String)>,
}

/// The AWS example policy (deploy/examples/standalone-aws.yaml) plus `extra`.
pub(super) fn aws(extra: &Extra) -> String {
    let mut s = String::from(
        "platform: AWS\nmode: enforce\nendpoints:\n\
         \x20 - name: ec2-imds\n    cidr: 169.254.169.254/32\n    ports: [80]\n    protocols: [TCP]\n\
         \x20 - name: ec2-imds-v6\n    cidr: fd00:ec2::254/128\n    ports: [80]\n    protocols: [TCP]\n",
    );
    for (name, cidr, ports) in &extra.endpoints {
        let _ = write!(
            s,
            "  - name: {name}\n    cidr: {cidr}\n    ports: [{ports}]\n    protocols: [TCP]\n"
        );
    }
    s.push_str("allow:\n  - name: cloud-agent\n    cgroup: \"cloud-agent\"\n");
    for (name, glob) in &extra.allow {
        let _ = write!(s, "  - name: {name}\n    cgroup: \"{glob}\"\n");
    }
    s
}

/// `n` endpoints and `n` allow entries in all: the example's plus `n - 1` generated ones
/// (IPv4 /32s in 10.0.0.0/8, never the benchmark's destination).
pub(super) fn scaled(n: usize) -> String {
    let k = n.saturating_sub(1);
    aws(&Extra {
        endpoints: (1..=k)
            .map(|i| {
                (
                    format!("gen-{i}"),
                    format!("10.{}.{}.{}/32", (i >> 16) & 255, (i >> 8) & 255, i & 255),
                    "80, 443".into(),
                )
            })
            .collect(),
        allow: (1..=k).map(|i| (format!("gen-{i}"), format!("allowed-{i}"))).collect(),
    })
}
