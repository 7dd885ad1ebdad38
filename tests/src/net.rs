//! Two network namespaces joined by a veth pair: `node`, where workloads run, and `imds`,
//! where the fake metadata service lives at 169.254.169.254 / fd00:ec2::254; a `pod` behind
//! the node, which forwards and masquerades its traffic as a node does; and what a node may
//! also have: a bridge holding its address, a VM's tap.
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, bail};

use crate::{
    frame::{Mac, parse_mac},
    sys::{is_test_netns, sh, unique},
};

/// Addresses of the imds side.
pub const IMDS_V4: &str = "169.254.169.254";
pub const DNS_V4: &str = "169.254.169.253";
pub const NTP_V4: &str = "169.254.169.123";
pub const IMDS_V6: &str = "fd00:ec2::254";
pub const DNS_V6: &str = "fd00:ec2::253";
pub const NODE_V4: &str = "169.254.0.1";
/// The pod's addresses, behind the node's `vpod` (10.99.0.1, fd00:99::1).
pub const POD_V4: &str = "10.99.0.2";
pub const POD_V6: &str = "fd00:99::2";
/// What the node masquerades toward the imds side: every pod and VM subnet of the tests.
const POD_NETS_V4: &str = "10.96.0.0/12";
const POD_NETS_V6: &str = "fd00:99::/32";

/// `ip -n NETNS ARGS…` (ARGS split on spaces).
pub fn ip(netns: &str, args: &str) -> Result<String> {
    let mut v = vec!["-n", netns];
    v.extend(args.split(' '));
    sh("ip", &v)
}

/// Run `program args…` inside the test network namespace at `netns` (`/run/netns/mg-…`)
/// with nsenter, which enters only the network namespace (`ip netns exec` would also remount
/// /sys, where nft resolves cgroup paths), feeding it `stdin`; its output.
pub fn nsenter(netns: &str, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
    if !is_test_netns(netns) {
        bail!("{netns} is not a test network namespace");
    }
    let mut child = Command::new("nsenter")
        .arg(format!("--net={netns}"))
        .arg(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("nsenter {program}"))?;
    if let Some(mut input) = child.stdin.take() {
        std::io::Write::write_all(&mut input, stdin.unwrap_or("").as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{program} {} in {netns}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim(),
            stdin.map(|s| format!("\ninput:\n{s}")).unwrap_or_default()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Load an nftables ruleset into the test network namespace named `netns`.
pub fn nft(netns: &str, ruleset: &str) -> Result<()> {
    nsenter(&format!("/run/netns/{netns}"), "nft", &["-f", "-"], Some(ruleset)).map(drop)
}

/// Set sysctls (`key=value`) in the test network namespace named `netns`.
pub fn sysctl(netns: &str, settings: &[&str]) -> Result<()> {
    let mut args = vec!["-qw"];
    args.extend_from_slice(settings);
    nsenter(&format!("/run/netns/{netns}"), "sysctl", &args, None).map(drop)
}

/// The MAC address of `iface` in `netns`.
pub fn mac(netns: &str, iface: &str) -> Result<Mac> {
    let out = ip(netns, &format!("-o link show dev {iface}"))?;
    let addr = out
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .with_context(|| format!("no MAC for {iface} in {netns}: {out}"))?;
    parse_mac(addr)
}

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
        let n = |args: &str| ip(&net.node, args).map(drop);
        let m = |args: &str| ip(&net.imds, args).map(drop);
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
/// Its veth's node end is `vpod` (the workload-facing interface), 10.99.0.1/24 and
/// fd00:99::1/64 on the node, [`POD_V4`] and [`POD_V6`] in the pod with default routes
/// through the node. The node forwards (IPv4 and IPv6) and masquerades pod traffic toward
/// the imds side, as a node does.
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
        for args in ["addr add 10.99.0.1/24 dev vpod", "addr add fd00:99::1/64 dev vpod nodad"] {
            ip(&net.node, args)?;
        }
        ip(&net.node, "link set vpod up")?;
        for args in [
            "link set lo up",
            &format!("addr add {POD_V4}/24 dev eth0"),
            &format!("addr add {POD_V6}/64 dev eth0 nodad"),
            "link set eth0 up",
            "route add default via 10.99.0.1",
            "-6 route add default via fd00:99::1",
        ] {
            ip(&pod.name, args)?;
        }
        ip(&net.imds, "route add 10.99.0.0/24 via 169.254.0.1")?;
        sysctl(&net.node, &["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"])?;
        nft(
            &net.node,
            &format!(
                "table inet mg_node {{
                    chain postrouting {{
                        type nat hook postrouting priority srcnat; policy accept;
                        ip saddr {POD_NETS_V4} masquerade
                        ip6 saddr {POD_NETS_V6} masquerade
                    }}
                }}"
            ),
        )?;
        for dst in [IMDS_V4, IMDS_V6] {
            let r = ip(&pod.name, &format!("route get {dst}"))?;
            if !r.contains("dev eth0") {
                bail!("route to {dst} in {} does not use the test veth: {r}", pod.name);
            }
        }
        Ok(pod)
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// A forwarding loop inside the pod's reach: a veth pair `lp0`/`lp1` in the pod's own
    /// namespace, `lp1` at 10.97.0.1/24, and forwarding on in the pod. A frame sent on `lp0`
    /// to `lp1` is received by the pod's stack, which drops its socket, and routed out of
    /// `eth0`: it reaches the node without a socket, as a VM's would. Returns `lp1`'s MAC.
    pub fn forwarding_loop(&self) -> Result<Mac> {
        ip(&self.name, "link add lp0 type veth peer name lp1")?;
        ip(&self.name, "addr add 10.97.0.1/24 dev lp1")?;
        ip(&self.name, "link set lp0 up")?;
        ip(&self.name, "link set lp1 up")?;
        sysctl(&self.name, &["net.ipv4.ip_forward=1"])?;
        mac(&self.name, "lp1")
    }
}

/// Put the node's address on a Linux bridge `br0` whose port is the uplink veth `vnode`, as
/// nodes whose NIC is bridged (OVS or Linux bridge) have it.
pub fn bridge_uplink(net: &TestNet) -> Result<()> {
    for args in [
        "link add br0 type bridge",
        "link set vnode master br0",
        &format!("addr del {NODE_V4}/16 dev vnode"),
        "addr del fd00:ec2::1/64 dev vnode",
        &format!("addr add {NODE_V4}/16 dev br0"),
        "addr add fd00:ec2::1/64 dev br0 nodad",
        "link set br0 up",
    ] {
        ip(&net.node, args)?;
    }
    let r = ip(&net.node, &format!("route get {IMDS_V4}"))?;
    if !r.contains("dev br0") {
        bail!("route to {IMDS_V4} in {} does not use the bridge: {r}", net.node);
    }
    Ok(())
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
