//! `cargo xtask demo`: the gate, working, in a throwaway world built by the test harness.
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use integration_tests::{
    agent::Agent,
    cgroups::CgroupTree,
    imds::FakeImds,
    net::{IMDS_V4, TestNet},
    probe::{self, token},
    sys::missing_privileges,
};

use crate::util::root;

const POLICY: &str = "deploy/examples/standalone-aws.yaml";

fn step(n: u32, text: &str) {
    println!("\n\x1b[1m{n}. {text}\x1b[0m");
}

fn show(who: &str, o: &probe::Outcome) {
    if o.ok {
        let body = o.reply.as_deref().and_then(|r| r.split("\r\n\r\n").nth(1)).unwrap_or("");
        println!(
            "   {who:<12} \x1b[32mserved\x1b[0m   200 OK, instance-id {body:?} ({} µs)",
            o.elapsed_us
        );
    } else {
        let err = o.errno.map(std::io::Error::from_raw_os_error);
        let err = err.map_or_else(|| "no answer".to_string(), |e| e.to_string());
        println!(
            "   {who:<12} \x1b[31mdenied\x1b[0m   at {}: {err} ({} µs)",
            o.stage, o.elapsed_us
        );
    }
}

pub(crate) fn run() -> Result<()> {
    if let Some(why) = missing_privileges() {
        bail!("the demo {why}: run it as root (sudo -E cargo xtask demo)");
    }
    step(1, "Building gate-agent (with its eBPF programs) and the workload probe");
    let bins = crate::bins::build(crate::bins::Profile::Demo)?;

    step(2, "A throwaway world: two network namespaces joined by a veth pair");
    let net = TestNet::new()?;
    let imds = FakeImds::start(&net)?;
    println!("   {:<22} workloads, 169.254.0.1", net.node);
    println!("   {:<22} fake metadata service, http://{IMDS_V4}/ (never the host's)", net.imds);
    let cg = CgroupTree::new()?;
    let web = cg.create("gated/web-app")?;
    let cloud = cg.create("gated/cloud-agent")?;
    println!("   cgroups under {}:", cg.base.display());
    println!("     gated/web-app       an ordinary workload");
    println!("     gated/cloud-agent   allow-listed by the policy (cgroup: \"cloud-agent\")");

    step(3, &format!("Starting gate-agent on the gated cgroup with {POLICY}"));
    let agent = Agent::start(&bins, &net.node_path(), &root().join(POLICY), &cg.gated())
        .context("starting gate-agent")?;
    println!(
        "   ready: programs attached with bpf_link, policy in the maps, pinned under {}",
        agent.pin_dir.display()
    );

    step(
        4,
        &format!(
            "Both workloads ask the metadata service: GET http://{IMDS_V4}/latest/meta-data/instance-id"
        ),
    );
    let denied = probe::run(&bins, &net, &web, &["tcp", IMDS_V4, "80", &token("demo-web")])?;
    show("web-app", &denied);
    let served = probe::run(&bins, &net, &cloud, &["tcp", IMDS_V4, "80", &token("demo-cloud")])?;
    show("cloud-agent", &served);
    let dns = probe::run(&bins, &net, &web, &["udp", IMDS_V4, "53", &token("demo-dns")])?;
    println!(
        "   {:<12} {} (port 53 on the same address is not protected)",
        "web-app",
        if dns.ok { "\x1b[32mDNS served\x1b[0m" } else { "\x1b[31mDNS denied\x1b[0m" }
    );

    step(5, "The denial event the agent logged");
    match agent.wait_log(|v| v["verdict"] == "denied", Duration::from_secs(5)) {
        Some(v) => println!("   {}", serde_json::to_string_pretty(&v)?.replace('\n', "\n   ")),
        None => println!("   (no denial event arrived)"),
    }
    let (_, metrics) = agent.http_get("/metrics")?;
    println!("\n   /metrics:");
    for l in
        metrics.lines().filter(|l| l.starts_with("metadata_gate_endpoint") && !l.ends_with(" 0"))
    {
        println!("   {l}");
    }

    step(6, "Cleaning up: agent stopped, gate unpinned, namespaces and cgroups removed");
    let ok = !denied.ok && served.ok && dns.ok && !imds.saw("demo-web");
    drop(agent);
    drop(imds);
    drop(net);
    drop(cg);
    if !ok {
        bail!("the gate did not behave as shown above");
    }
    println!(
        "\n\x1b[1mThe gate denied web-app with EPERM at connect(), served the allow-listed cloud-agent, and left DNS alone.\x1b[0m"
    );
    Ok(())
}
