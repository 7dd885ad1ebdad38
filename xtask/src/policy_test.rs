//! `cargo xtask policy-test [--platform NAME] FILE`: the packet test of one policy, before it
//! goes near a cluster (root). FILE is a policy or a policy ConfigMap (deploy/policies/*.yaml).
//!
//! In a throwaway world of the test harness (two network namespaces joined by a veth pair, a
//! cgroup tree), it puts every exact address the policy protects, and every neighbour that
//! `gate-agent check` knows for the platform (DNS, NTP, the EKS Pod Identity agent), on the far
//! side, with a TCP or UDP responder on each port. It runs the agent standalone on the policy
//! (in enforce mode, plus one allow entry for a cgroup `allowed`) and sends from two cgroups
//! below the gated root:
//!
//! - a gated workload: every protected port must fail with EPERM, every neighbour must answer;
//! - the allowed cgroup: every protected port must answer (what an allow-listed component sees).
//!
//! Pod entries select nothing in standalone mode; what they select is pinned by
//! gate-agent/tests/shipped_policies.rs against the components' manifests. Link-local IPv6
//! endpoints (OpenStack's `fe80::a9fe:a9fe`) and endpoints wider than one address are listed
//! as not probed.
use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};

use integration_tests::{
    agent::Agent,
    cgroups::CgroupTree,
    net::{DNS_V4, DNS_V6, IMDS_V4, IMDS_V6, NTP_V4, TestNet, ip},
    probe::{self, token},
    sys::{enter_netns, missing_privileges, unique},
};
use serde_json::Value;

use crate::util::yaml_options;

const EPERM: i32 = 1;
/// The allow entry the test adds (standalone mode: a cgroup below the gated root).
const ALLOWED: &str = "allowed";

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Target {
    addr: IpAddr,
    port: u16,
    /// `tcp` or `udp`, as the probe takes it.
    proto: &'static str,
    /// The endpoint's or neighbour's name.
    what: String,
}

pub(crate) fn run(file: &Path, platform: Option<&str>) -> Result<()> {
    if let Some(why) = missing_privileges() {
        bail!("the policy test {why}: run it as root (sudo -E cargo xtask policy-test FILE)");
    }
    let bins = crate::bins::build(crate::bins::Profile::Checked)?;

    // What the agent's own `check` makes of the file: endpoints, neighbours, warnings.
    let mut cmd = std::process::Command::new(&bins.agent);
    cmd.args(["check", "--json"]);
    if let Some(p) = platform {
        cmd.args(["--platform", p]);
    }
    let out = cmd.arg(file).output().context("running gate-agent check")?;
    let report: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("gate-agent check --json printed {:?}", out.stdout))?;
    let report = report.get(0).cloned().unwrap_or(Value::Null);
    if let Some(e) = report.get("error") {
        let text = |v: &Value| v.as_str().unwrap_or("?").to_owned();
        bail!("{}: {}: {}", text(&report["source"]), text(&e["field"]), text(&e["reason"]));
    }
    let text = |v: &Value| v.as_str().unwrap_or("?").to_owned();
    println!("policy {} (platform {})", text(&report["source"]), text(&report["platform"]));
    for w in report["warnings"].as_array().into_iter().flatten() {
        println!("  check warns: {}: {}", text(&w["field"]), text(&w["reason"]));
    }

    let (protected, skipped) = targets(&report["endpoints"], "name")?;
    let (neighbours, skipped_n) = targets(&report["keepOpen"], "what")?;
    for s in skipped.iter().chain(&skipped_n) {
        println!("  not probed: {s}");
    }
    if protected.is_empty() {
        bail!("the policy protects no exact, routable address: nothing to probe");
    }

    let dir = std::env::temp_dir().join(unique("mg-policy-test"));
    std::fs::create_dir_all(&dir)?;
    let policy_file = dir.join("policy.yaml");
    let was_audit = report["mode"] == "audit";
    std::fs::write(&policy_file, test_policy(file)?)?;
    if was_audit {
        println!("  the policy is in audit mode: tested as it will be once it enforces");
    }

    let result = (|| -> Result<Vec<String>> {
        let net = TestNet::new()?;
        let all: BTreeSet<&Target> = protected.iter().chain(&neighbours).collect();
        place_addresses(&net, all.iter().map(|t| t.addr).collect())?;
        let servers = Responders::start(&net, all.iter().copied())?;
        let cg = CgroupTree::new()?;
        let workload = cg.create("gated/workload")?;
        let allowed = cg.create(&format!("gated/{ALLOWED}"))?;
        let agent = Agent::start(&bins, &net.node_path(), &policy_file, &cg.gated())
            .context("starting gate-agent on the policy")?;
        let mut failures = Vec::new();
        let mut probe = |cgroup: &Path, who: &str, t: &Target, want_served: bool| -> Result<()> {
            let tok = token("policy-test");
            let (addr, port) = (t.addr.to_string(), t.port.to_string());
            let o = probe::run(&bins, &net, cgroup, &[t.proto, &addr, &port, &tok])?;
            let denied = !o.ok && o.errno == Some(EPERM);
            let pass = if want_served { o.ok } else { denied };
            let seen = if o.ok {
                "served".to_owned()
            } else if denied {
                "denied (EPERM)".to_owned()
            } else {
                format!(
                    "failed at {} ({:?})",
                    o.stage,
                    o.errno.map(std::io::Error::from_raw_os_error)
                )
            };
            println!(
                "  {} {who:<9} {:<5} {:>15} {:>5}  {seen:<18} {}",
                if pass { "ok  " } else { "FAIL" },
                t.proto.to_uppercase(),
                addr,
                port,
                t.what
            );
            if !pass {
                failures.push(format!(
                    "{who} → {} {addr} port {port} ({}): {seen}, expected {}",
                    t.proto,
                    t.what,
                    if want_served { "served" } else { "denied with EPERM" }
                ));
            }
            Ok(())
        };
        println!("\nprotected endpoints, from a gated workload and from the allowed cgroup:");
        for t in &protected {
            probe(&workload, "workload", t, false)?;
            probe(&allowed, "allowed", t, true)?;
        }
        if !neighbours.is_empty() {
            println!("\nneighbours that must stay open, from the gated workload:");
            for t in &neighbours {
                probe(&workload, "workload", t, true)?;
            }
        }
        drop(agent);
        drop(servers);
        drop(cg);
        drop(net);
        Ok(failures)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    let failures = result?;
    if !failures.is_empty() {
        bail!("the policy does not do what it says:\n  {}", failures.join("\n  "));
    }
    println!(
        "\nevery protected port denied the gated workload with EPERM and served the allowed \
         cgroup{}",
        if neighbours.is_empty() { "" } else { "; every neighbour stayed open" }
    );
    Ok(())
}

/// Probe targets from `check --json` endpoints or services: exact addresses, each port (all
/// ports: 80), each protocol (all: TCP and UDP). The rest is returned as "not probed".
fn targets(list: &Value, label: &str) -> Result<(Vec<Target>, Vec<String>)> {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for e in list.as_array().into_iter().flatten() {
        let what = e[label].as_str().unwrap_or("?").to_owned();
        let net = e.get("cidr").or_else(|| e.get("net")).and_then(Value::as_str).unwrap_or("");
        let (addr, len) = net.split_once('/').context("a CIDR from gate-agent check")?;
        let addr: IpAddr = addr.parse().with_context(|| format!("address {addr:?}"))?;
        let exact = len == if addr.is_ipv4() { "32" } else { "128" };
        let link_local = matches!(addr, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80);
        if !exact || link_local {
            skipped.push(format!(
                "{what} {net} ({})",
                if exact {
                    "link-local: the harness routes only global addresses"
                } else {
                    "a network"
                }
            ));
            continue;
        }
        let mut ports: Vec<u16> = e["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p.as_u64().and_then(|p| u16::try_from(p).ok()))
            .collect();
        if ports.is_empty() {
            ports.push(80);
        }
        let mut protos: Vec<&'static str> = e["protocols"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| match p.as_str() {
                Some("TCP") => Some("tcp"),
                Some("UDP") => Some("udp"),
                _ => None,
            })
            .collect();
        if protos.is_empty() {
            protos = vec!["tcp", "udp"];
        }
        for port in &ports {
            for proto in &protos {
                out.push(Target { addr, port: *port, proto, what: what.clone() });
            }
        }
    }
    Ok((out, skipped))
}

/// The policy document of FILE (a policy, or a ConfigMap's `policy.yaml`), in enforce mode,
/// with one more allow entry: the cgroup `allowed`.
fn test_policy(file: &Path) -> Result<String> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let doc: serde_json::Value = serde_saphyr::from_str_with_options(&text, yaml_options())?;
    let mut policy: serde_json::Value = match doc.get("kind").and_then(|k| k.as_str()) {
        Some("ConfigMap") => {
            let inner = doc
                .get("data")
                .and_then(|d| d.get("policy.yaml"))
                .and_then(|p| p.as_str())
                .context("the ConfigMap has no data[\"policy.yaml\"]")?;
            serde_saphyr::from_str_with_options(inner, yaml_options())?
        }
        _ => doc,
    };
    let map = policy.as_object_mut().context("a policy is a mapping")?;
    map.insert("mode".into(), "enforce".into());
    let entry = serde_json::json!({"name": format!("policy-test-{ALLOWED}"), "cgroup": ALLOWED});
    match map.get_mut("allow").and_then(|a| a.as_array_mut()) {
        Some(list) => list.push(entry),
        None => {
            map.insert("allow".into(), serde_json::Value::Array(vec![entry]));
        }
    }
    Ok(serde_saphyr::to_string(&policy)?)
}

/// Put the addresses the test net lacks on the far side, with a route to each from the node.
fn place_addresses(net: &TestNet, addrs: BTreeSet<IpAddr>) -> Result<()> {
    let present = [IMDS_V4, DNS_V4, NTP_V4, IMDS_V6, DNS_V6];
    for a in addrs {
        if present.iter().any(|p| p.parse::<IpAddr>().ok() == Some(a)) {
            continue;
        }
        let (len, v6) = if a.is_ipv4() { (32, "") } else { (128, " nodad") };
        ip(&net.imds, &format!("addr add {a}/{len} dev vimds{v6}"))?;
        ip(&net.node, &format!("route add {a}/{len} dev vnode"))?;
        let r = ip(&net.node, &format!("route get {a}"))?;
        if !r.contains("dev vnode") {
            bail!("route to {a} in {} does not use the test veth: {r}", net.node);
        }
    }
    Ok(())
}

/// A TCP or UDP responder on every target's address and port, in the far namespace.
struct Responders {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Responders {
    fn start<'a>(net: &TestNet, targets: impl Iterator<Item = &'a Target>) -> Result<Responders> {
        let mut r = Responders { stop: Arc::new(AtomicBool::new(false)), threads: Vec::new() };
        let sockets: BTreeSet<(IpAddr, u16, &str)> =
            targets.map(|t| (t.addr, t.port, t.proto)).collect();
        for (addr, port, proto) in sockets {
            let (tx, rx) = std::sync::mpsc::channel();
            let (stop, path, proto) = (r.stop.clone(), net.imds_path(), proto.to_owned());
            r.threads.push(std::thread::spawn(move || {
                let bound = enter_netns(&path).and_then(|()| {
                    let at = SocketAddr::new(addr, port);
                    if proto == "tcp" {
                        let l = TcpListener::bind(at).with_context(|| format!("tcp {at}"))?;
                        l.set_nonblocking(true)?;
                        Ok(Socket::Tcp(l))
                    } else {
                        let u = UdpSocket::bind(at).with_context(|| format!("udp {at}"))?;
                        u.set_read_timeout(Some(Duration::from_millis(50)))?;
                        Ok(Socket::Udp(u))
                    }
                });
                match bound {
                    Ok(s) => {
                        let _ = tx.send(Ok(()));
                        s.serve(&stop);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            }));
            rx.recv_timeout(Duration::from_secs(5)).context("responder did not start")??;
        }
        Ok(r)
    }
}

impl Drop for Responders {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

enum Socket {
    Tcp(TcpListener),
    Udp(UdpSocket),
}

impl Socket {
    fn serve(self, stop: &AtomicBool) {
        let mut buf = [0u8; 2048];
        while !stop.load(Ordering::Relaxed) {
            match &self {
                Socket::Tcp(l) => match l.accept() {
                    Ok((mut c, _)) => {
                        let _ = c.set_nonblocking(false);
                        let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
                        let _ = c.read(&mut buf);
                        let _ = c.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok");
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                },
                Socket::Udp(u) => {
                    if let Ok((_, from)) = u.recv_from(&mut buf) {
                        let _ = u.send_to(b"ok", from);
                    }
                }
            }
        }
    }
}
