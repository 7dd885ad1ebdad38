//! Two network namespaces joined by a veth pair: `node`, where workloads run, and `imds`,
//! where the fake metadata service lives at 169.254.169.254 / fd00:ec2::254.
use anyhow::{Result, bail};

use crate::sys::{sh, unique};

/// Addresses of the imds side.
pub const IMDS_V4: &str = "169.254.169.254";
pub const DNS_V4: &str = "169.254.169.253";
pub const NTP_V4: &str = "169.254.169.123";
pub const IMDS_V6: &str = "fd00:ec2::254";
pub const DNS_V6: &str = "fd00:ec2::253";
pub const NODE_V4: &str = "169.254.0.1";

pub struct TestNet {
    pub node: String,
    pub imds: String,
}

impl TestNet {
    pub fn new() -> Result<TestNet> {
        let base = unique("mg");
        let net = TestNet { node: format!("{base}-node"), imds: format!("{base}-imds") };
        sh("ip", &["netns", "add", &net.node])?;
        sh("ip", &["netns", "add", &net.imds])?;
        let n = |args: &str| -> Result<()> {
            let mut v = vec!["-n", &net.node];
            v.extend(args.split(' '));
            sh("ip", &v).map(drop)
        };
        let m = |args: &str| -> Result<()> {
            let mut v = vec!["-n", &net.imds];
            v.extend(args.split(' '));
            sh("ip", &v).map(drop)
        };
        // The veth pair is created inside the test namespaces, never in the host's.
        sh(
            "ip",
            &[
                "-n", &net.node, "link", "add", "vnode", "type", "veth", "peer", "name", "vimds",
                "netns", &net.imds,
            ],
        )?;
        n("link set lo up")?;
        n(&format!("addr add {NODE_V4}/16 dev vnode"))?;
        n("addr add fd00:ec2::1/64 dev vnode nodad")?;
        n("link set vnode up")?;
        m("link set lo up")?;
        m(&format!("addr add {IMDS_V4}/16 dev vimds"))?;
        m(&format!("addr add {DNS_V4}/16 dev vimds"))?;
        m(&format!("addr add {NTP_V4}/16 dev vimds"))?;
        m(&format!("addr add {IMDS_V6}/64 dev vimds nodad"))?;
        m(&format!("addr add {DNS_V6}/64 dev vimds nodad"))?;
        m("link set vimds up")?;
        net.assert_routes()?;
        Ok(net)
    }

    /// Path for setns(2).
    pub fn node_path(&self) -> String {
        format!("/run/netns/{}", self.node)
    }

    pub fn imds_path(&self) -> String {
        format!("/run/netns/{}", self.imds)
    }

    /// Every destination a test sends to leaves the node netns on the test veth.
    pub fn assert_routes(&self) -> Result<()> {
        for dst in [IMDS_V4, DNS_V4, NTP_V4, IMDS_V6, DNS_V6] {
            let r = sh("ip", &["-n", &self.node, "route", "get", dst])?;
            if !r.contains("dev vnode") {
                bail!("route to {dst} in {} does not use the test veth: {r}", self.node);
            }
        }
        Ok(())
    }
}

/// A third namespace, `pod`, behind the node: a VM or pod whose traffic the node forwards.
/// Its veth's node end is `vpod` (the workload-facing interface), 10.99.0.1/24 on the node,
/// 10.99.0.2/24 in the pod with a default route through the node.
pub struct PodNet {
    pub name: String,
}

pub const POD_IFACE: &str = "vpod";

impl PodNet {
    pub fn new(net: &TestNet) -> Result<PodNet> {
        let pod = PodNet { name: format!("{}-pod", net.node.trim_end_matches("-node")) };
        sh("ip", &["netns", "add", &pod.name])?;
        sh(
            "ip",
            &[
                "-n", &net.node, "link", "add", POD_IFACE, "type", "veth", "peer", "name", "eth0",
                "netns", &pod.name,
            ],
        )?;
        let run = |ns: &str, args: &str| -> Result<()> {
            let mut v = vec!["-n", ns];
            v.extend(args.split(' '));
            sh("ip", &v).map(drop)
        };
        run(&net.node, "addr add 10.99.0.1/24 dev vpod")?;
        run(&net.node, "link set vpod up")?;
        run(&pod.name, "link set lo up")?;
        run(&pod.name, "addr add 10.99.0.2/24 dev eth0")?;
        run(&pod.name, "link set eth0 up")?;
        run(&pod.name, "route add default via 10.99.0.1")?;
        run(&net.imds, "route add 10.99.0.0/24 via 169.254.0.1")?;
        sh("ip", &["netns", "exec", &net.node, "sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
        let r = sh("ip", &["-n", &pod.name, "route", "get", IMDS_V4])?;
        if !r.contains("dev eth0") {
            bail!("route to {IMDS_V4} in {} does not use the test veth: {r}", pod.name);
        }
        Ok(pod)
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }
}

impl Drop for PodNet {
    fn drop(&mut self) {
        let _ = sh("ip", &["netns", "del", &self.name]);
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        // Deleting a netns destroys its veth end and, with it, the pair.
        let _ = sh("ip", &["netns", "del", &self.node]);
        let _ = sh("ip", &["netns", "del", &self.imds]);
    }
}
