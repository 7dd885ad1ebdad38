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

impl Drop for TestNet {
    fn drop(&mut self) {
        // Deleting a netns destroys its veth end and, with it, the pair.
        let _ = sh("ip", &["netns", "del", &self.node]);
        let _ = sh("ip", &["netns", "del", &self.imds]);
    }
}
