//! The variants every scenario compares, all enforcing the same AWS policy
//! (deploy/examples/standalone-aws.yaml: 169.254.169.254 TCP 80 and fd00:ec2::254 TCP 80
//! denied from the gated cgroup, `cloud-agent` below it allowed):
//! no enforcement, metadata-gate, nftables and iptables rules in the workload netns.
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use integration_tests::{
    agent::Agent,
    net::{IMDS_V4, ip, nsenter},
};

use crate::{
    Bins,
    workload::{self, IMDS_PORT},
    world::{World, cgroup_rel, nft_cgroup_path},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub(super) enum Variant {
    None,
    Gate,
    /// nftables `socket cgroupv2` + `reject with tcp reset`
    Nft,
    /// the same rules with `drop`
    NftDrop,
    /// iptables (nf_tables backend) `-m cgroup --path` + `REJECT --reject-with tcp-reset`
    Ipt,
}

impl Variant {
    /// Its name in report keys: `none`, `gate`, `nft`, `nft_drop`, `ipt`.
    pub(super) fn key(self) -> &'static str {
        self.into()
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Variant::None => "no gate",
            Variant::Gate => "metadata-gate",
            Variant::Nft => "nftables reject",
            Variant::NftDrop => "nftables drop",
            Variant::Ipt => "iptables REJECT",
        }
    }
}

/// A variant in force in a world; removed on drop.
pub(super) enum Active {
    None,
    Gate(Box<Agent>),
    Rules { netns: String, tables: &'static [&'static str] },
}

impl Active {
    pub(super) fn agent(&self) -> Option<&Agent> {
        match self {
            Active::Gate(a) => Some(a),
            _ => None,
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        if let Active::Rules { netns, tables } = self {
            for t in tables.iter() {
                let args: Vec<&str> = ["delete", "table"].into_iter().chain(t.split(' ')).collect();
                let _ = nsenter(netns, "nft", &args, None);
            }
        }
    }
}

/// The nftables ruleset a careful administrator would write: cheap address match first,
/// the allow-listed cgroup accepted, the rest of the gated cgroup denied.
pub(super) fn nft_ruleset(world: &World, verdict: &str) -> Result<String> {
    let (_, level) = cgroup_rel(&world.cg.gated())?;
    let gated = nft_cgroup_path(&world.cg.gated())?;
    let allowed = nft_cgroup_path(&world.allowed)?;
    let mut rules = String::new();
    for (daddr, dst) in [("ip daddr", IMDS_V4), ("ip6 daddr", "fd00:ec2::254")] {
        rules.push_str(&format!(
            "    {daddr} {dst} tcp dport 80 socket cgroupv2 level {} \"{allowed}\" accept\n\
             \x20   {daddr} {dst} tcp dport 80 socket cgroupv2 level {level} \"{gated}\" {verdict}\n",
            level + 1
        ));
    }
    Ok(format!(
        "table inet mg_bench {{\n  chain output {{\n    type filter hook output priority 0; policy accept;\n{rules}  }}\n}}\n"
    ))
}

fn ipt_rules(world: &World, dst: &str) -> Result<String> {
    let (gated, _) = cgroup_rel(&world.cg.gated())?;
    let (allowed, _) = cgroup_rel(&world.allowed)?;
    Ok(format!(
        "*filter\n\
         -A OUTPUT -d {dst} -p tcp --dport 80 -m cgroup --path {allowed} -j ACCEPT\n\
         -A OUTPUT -d {dst} -p tcp --dport 80 -m cgroup --path {gated} -j REJECT --reject-with tcp-reset\n\
         COMMIT\n"
    ))
}

/// What the gate variant must have attached to be the shipped default configuration: the
/// gate's four cgroup hooks on the gated root, the node-level program on the egress of the
/// uplink (the veth toward the metadata service) and of loopback (tcx links are pinned by
/// ifindex), and the LSM programs where the kernel runs them.
fn shipped_hooks(world: &World, lsm: bool) -> Result<Vec<String>> {
    // Without a proxy none of its programs (peer name, sock_ops, bind) is attached.
    let cgroup = "connect4 connect6 egress setsockopt";
    let mut hooks: Vec<String> = cgroup.split(' ').map(String::from).collect();
    if lsm {
        hooks.extend(["lsm-bind", "lsm-setsockopt", "lsm-socket"].map(String::from));
    }
    for iface in ["lo", "vnode"] {
        let shown = ip(&world.net.node, &format!("-o link show dev {iface}"))?;
        let ifindex = shown.split(':').next().unwrap_or_default().trim();
        hooks.push(format!("tc-egress-{ifindex}"));
        // Every interface but loopback takes ingress, the uplink included.
        if iface != "lo" {
            hooks.push(format!("tc-ingress-{ifindex}"));
        }
    }
    hooks.sort();
    Ok(hooks)
}

/// The gate as shipped: `gate-agent run --policy --cgroup-root` with every other flag at its
/// default (node-level enforcement on), checked by what it attached; the hooks it attached.
pub(super) fn shipped_gate(
    world: &World,
    policy: &Path,
    bins: &Bins,
) -> Result<(Agent, Vec<String>)> {
    let agent =
        Agent::start_shipped(&bins.under_test, &world.net.node_path(), policy, &world.cg.gated())
            .context("starting gate-agent")?;
    // The pinned links (`<pin dir>/v<ABI>/links/<hook>`), as `status` lists them; read here
    // directly, since `status` also reads every endpoint (slow with 10 000 of them).
    let mut hooks = Vec::new();
    for version in std::fs::read_dir(&agent.pin_dir)?.flatten() {
        if let Ok(links) = std::fs::read_dir(version.path().join("links")) {
            hooks.extend(links.flatten().map(|l| l.file_name().to_string_lossy().into_owned()));
        }
    }
    hooks.sort();
    let expected = shipped_hooks(world, hooks.iter().any(|h| h.starts_with("lsm-")))?;
    if hooks != expected {
        bail!("the gate is not attached as shipped: {hooks:?}, expected {expected:?}");
    }
    Ok((agent, hooks))
}

/// Put `v` in force in `world` (`policy` is the gate's policy file) and check that it
/// enforces the policy: the workload is denied, the allow-listed cgroup served.
/// `bins` is the build under test (gate-agent, and bench-probe for the check).
pub(super) fn apply(v: Variant, world: &World, policy: &Path, bins: &Bins) -> Result<Active> {
    let netns = world.net.node_path();
    let active = match v {
        Variant::None => Active::None,
        Variant::Gate => Active::Gate(Box::new(shipped_gate(world, policy, bins)?.0)),
        Variant::Nft | Variant::NftDrop => {
            let verdict = if v == Variant::Nft { "reject with tcp reset" } else { "drop" };
            let active = Active::Rules { netns: netns.clone(), tables: &["inet mg_bench"] };
            nsenter(&netns, "nft", &["-f", "-"], Some(&nft_ruleset(world, verdict)?))?;
            active
        }
        Variant::Ipt => {
            let active =
                Active::Rules { netns: netns.clone(), tables: &["ip filter", "ip6 filter"] };
            let v4 = ipt_rules(world, &format!("{IMDS_V4}/32"))?;
            let v6 = ipt_rules(world, "fd00:ec2::254/128")?;
            nsenter(&netns, "iptables-nft-restore", &["-n"], Some(&v4))?;
            nsenter(&netns, "ip6tables-nft-restore", &["-n"], Some(&v6))?;
            active
        }
    };
    verify(v, world, bins)?;
    Ok(active)
}

/// One connect() to the protected endpoint from the workload and from the allowed cgroup.
pub(super) fn verify(v: Variant, world: &World, bins: &Bins) -> Result<()> {
    let port = IMDS_PORT.to_string();
    let timeout = if v == Variant::NftDrop { "300" } else { "2000" };
    let try_from = |cg: &Path| -> Result<bool> {
        let r = workload::run(bins, &world.net, cg, &["deny", IMDS_V4, &port, "1", timeout])?;
        Ok(r["served"].as_u64() == Some(1))
    };
    let workload = try_from(&world.workload)?;
    let allowed = try_from(&world.allowed)?;
    let want_workload = v == Variant::None;
    if workload != want_workload || !allowed {
        bail!(
            "{} does not enforce the policy: workload {}, cloud-agent {}",
            v.label(),
            if workload { "served" } else { "denied" },
            if allowed { "served" } else { "denied" }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Variant;

    #[test]
    fn report_keys() {
        let keys = [Variant::None, Variant::Gate, Variant::Nft, Variant::NftDrop, Variant::Ipt]
            .map(Variant::key);
        assert_eq!(keys, ["none", "gate", "nft", "nft_drop", "ipt"]);
    }
}
