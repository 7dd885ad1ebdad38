//! `cargo xtask cluster e2e`: the DaemonSet on a real node, from `kubectl apply -k` to
//! packets. Every path is first shown open: the fake metadata service and the clients run
//! before the agent is applied, and each client reaches the service. Then the agent is
//! applied as users apply it, and each path is shown as the gate leaves it.
//!
//! The clients are real pods of the node: one on the pod network, one on the host network,
//! one on the host network with `NET_RAW` that sends raw frames (AF_PACKET), and one that
//! the AWS policy allows (the cloud controller manager's namespace, labels and container).
//! Each sends a unique token, and the fake metadata service says whether it arrived.
use std::{
    fmt::Write as _,
    fs,
    io::Write as _,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::Value;

use super::{
    Cluster,
    control_plane::NODE_NAME,
    images::{self, Imported},
    node::POD_CIDR,
    root, show,
};
use crate::{
    bins::Bins,
    frame,
    imds::FakeImds,
    net::{IMDS_V4, NODE_V4, ip, mac, sysctl},
    probe::{Held, token},
    sys::unique,
};

/// Where the clients live.
const NS: &str = "metadata-gate-e2e";
/// The allow-listed component: the AWS policy's `aws-cloud-controller-manager` entry.
const CCM_NS: &str = "openshift-cloud-controller-manager";
/// The agent's namespace and DaemonSet (deploy/base).
const AGENT_NS: &str = "metadata-gate";
const AGENT_DS: &str = "metadata-gate-agent";
/// The policy the test's platform (AWS) reads.
const POLICY_CM: &str = "metadata-gate-policy-aws";
/// The taint a new node carries until its agent has closed the gate.
const NOT_READY_TAINT: &str = "metadata-gate.io/not-ready";

/// What the caller provides: the binaries of this build, and the CRDs the overlay's objects
/// and the Infrastructure object need.
pub struct Inputs {
    pub bins: Bins,
    pub crds: Vec<Value>,
    /// Keep the cluster after the scenario (passed or failed) until Ctrl-C.
    pub keep: bool,
}

/// One client pod and what the gate must do to it.
struct Client {
    ns: &'static str,
    pod: &'static str,
    /// What it sends: `http` (a GET) or `frame` (a TCP SYN in an Ethernet frame on an
    /// AF_PACKET socket, on the node's link to the service).
    how: How,
    allowed: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum How {
    Http,
    Frame,
}

const CLIENTS: [Client; 4] = [
    Client { ns: NS, pod: "pod-network", how: How::Http, allowed: false },
    Client { ns: NS, pod: "host-network", how: How::Http, allowed: false },
    Client { ns: NS, pod: "host-network-raw", how: How::Frame, allowed: false },
    Client { ns: CCM_NS, pod: "aws-ccm", how: How::Http, allowed: true },
];

/// The scenario's lines, without and with the gate, for the log and the closing summary.
#[derive(Default)]
pub struct Report {
    lines: Vec<String>,
}

impl Report {
    fn line(&mut self, s: String) {
        eprintln!("e2e: {s}");
        self.lines.push(s);
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}

pub fn run(inputs: &Inputs) -> Result<Report> {
    let started = Instant::now();
    let mut cluster = Cluster::start()?;
    let mut report = Report::default();
    report.line(format!("cluster up in {:.1} s", started.elapsed().as_secs_f64()));
    let result = scenario(&mut cluster, inputs, &mut report);
    if let Err(e) = &result {
        eprintln!("e2e failed: {e:#}");
        diagnostics(&cluster);
    }
    if inputs.keep {
        eprintln!(
            "e2e: keeping the cluster: kubectl --kubeconfig {} in network namespace {}; Ctrl-C \
             removes it",
            cluster.cp.kubeconfig().display(),
            cluster.cp.net.node
        );
        super::wait_for_signal()?;
    }
    result.map(|()| report)
}

fn scenario(cluster: &mut Cluster, inputs: &Inputs, report: &mut Report) -> Result<()> {
    let imds = FakeImds::start(&cluster.cp.net)?;
    // The service answers the pods directly (the node routes, it does not masquerade).
    ip(&cluster.cp.net.imds, &format!("route add {POD_CIDR} via {NODE_V4}"))?;
    sysctl(&cluster.cp.net.node, &["net.ipv4.ip_forward=1"])?;
    let t = Instant::now();
    let (cp, node) = (&cluster.cp, &cluster.node);
    let agent = node.import(cp, &images::agent(&inputs.bins.agent)?)?;
    node.import(cp, &images::pause()?)?;
    let client = node.import(cp, &images::client(&inputs.bins.probe)?)?;
    report.line(format!("images built and imported in {:.1} s", t.elapsed().as_secs_f64()));

    let k = Kubectl(cluster);
    let crds: String = inputs.crds.iter().map(|c| c.to_string() + "\n").collect();
    k.stdin(&["apply", "-f", "-"], &crds).context("serving the CRDs")?;
    k.run(&["wait", "--for=condition=Established", "crd", "--all", "--timeout=60s"])?;
    k.stdin(&["apply", "-f", "-"], &infrastructure("AWS"))?;
    k.stdin(&["apply", "-f", "-"], &clients_yaml(&client))?;
    for c in &CLIENTS {
        k.run(&[
            "-n",
            c.ns,
            "wait",
            "--for=condition=Ready",
            &format!("pod/{}", c.pod),
            "--timeout=120s",
        ])?;
    }
    for c in &CLIENTS {
        let reached = attempt(&k, &imds, c)?;
        ensure!(reached, "{}/{} did not reach the metadata service without the gate", c.ns, c.pod);
        report.line(format!(
            "without the gate: {}/{} ({}) reaches {IMDS_V4}",
            c.ns,
            c.pod,
            c.how.name()
        ));
    }

    // IMDSv2 at hop limit 1 (EC2's default for a new instance), the service's own defence:
    // the node forwards a pod's traffic, so the token's answer dies on the way; a host-network
    // pod is one hop away and gets it.
    imds.set_token_hop_limit(1);
    let pod_net = imdsv2(&k, &CLIENTS[0], "/latest/meta-data/instance-id")?;
    let host_net = imdsv2(&k, &CLIENTS[1], "/latest/meta-data/instance-id")?;
    imds.set_token_hop_limit(0);
    ensure!(
        !pod_net.ok && pod_net.stage == "token",
        "hop limit 1 let a pod-network pod's token through: {pod_net:?}"
    );
    ensure!(
        host_net.reply.as_deref().is_some_and(|r| r.contains(crate::imds::INSTANCE_ID)),
        "hop limit 1 kept the host-network pod's token: {host_net:?}"
    );
    report.line(format!(
        "without the gate, IMDSv2 at hop limit 1: {NS}/{} gets no token (the node's forward \
         drops it), {NS}/{} is served",
        CLIENTS[0].pod, CLIENTS[1].pod
    ));

    // Connections opened before the gate: one used now (open without the gate), one held
    // across the rollout, which the agent must end (it reaches the pod's network namespace
    // through /proc/<pid>/ns/net).
    let t = token("before");
    let open = hold(&k, &CLIENTS[0])?.send(&t)?;
    ensure!(open.ok, "a connection opened before the gate was not served: {open:?}");
    ensure!(imds.wait_for(&t, Duration::from_secs(3)), "its token never arrived");
    report.line(format!(
        "without the gate: {NS}/{} holds a TCP connection to {IMDS_V4}:80 and is answered on it",
        CLIENTS[0].pod
    ));
    let held = hold(&k, &CLIENTS[0])?;

    let overlay = write_overlay(cluster, &agent, report)?;
    let t = Instant::now();
    k.run(&["apply", "-k", &overlay])?;
    k.run(&["-n", AGENT_NS, "rollout", "status", &format!("ds/{AGENT_DS}"), "--timeout=180s"])?;
    report.line(format!(
        "kubectl apply -k {overlay}: DaemonSet rolled out in {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    wait_until(Duration::from_secs(60), "the not-ready taint to go", || {
        Ok(!k
            .run(&["get", "node", NODE_NAME, "-o", "jsonpath={.spec.taints}"])?
            .contains(NOT_READY_TAINT))
    })?;
    report.line(format!("node {NODE_NAME}: taint {NOT_READY_TAINT} removed by the agent"));
    let t = token("held");
    let cut = held.send(&t)?;
    ensure!(
        !cut.ok
            && cut.errno == Some(libc::ECONNABORTED)
            && !imds.wait_for(&t, Duration::from_secs(1)),
        "a connection held since before the gate was not ended by the agent: {cut:?}"
    );
    report.line(format!(
        "with the gate: {NS}/{}'s connection held since before it ended by the agent \
         (ECONNABORTED on its next send; nothing arrived)",
        CLIENTS[0].pod
    ));

    for c in &CLIENTS {
        let reached = attempt(&k, &imds, c)?;
        ensure!(
            reached == c.allowed,
            "{}/{} ({}) {} the metadata service with the gate",
            c.ns,
            c.pod,
            c.how.name(),
            if reached { "reached" } else { "did not reach" }
        );
        let verdict = if c.allowed { "served" } else { "denied" };
        report.line(format!("with the gate: {}/{} ({}) {verdict}", c.ns, c.pod, c.how.name()));
    }
    wait_until(Duration::from_secs(30), "a MetadataAccessBlocked Event", || {
        Ok(k.run(&[
            "get",
            "events",
            "-A",
            "--field-selector",
            "reason=MetadataAccessBlocked",
            "-o",
            "name",
        ])?
        .lines()
        .next()
        .is_some())
    })?;
    let events =
        k.run(&["get", "events", "-A", "--field-selector", "reason=MetadataAccessBlocked"])?;
    report.line(format!("kubectl get events:\n{}", indent(&events)));
    let agent_pod =
        k.run(&["-n", AGENT_NS, "get", "pods", "-o", "jsonpath={.items[0].metadata.name}"])?;
    for args in [
        vec!["status"],
        vec!["report"],
        vec!["explain", "--pod", "metadata-gate-e2e/pod-network", IMDS_V4],
    ] {
        let mut argv = vec!["-n", AGENT_NS, "exec", &agent_pod, "-c", "agent", "--", "/gate-agent"];
        argv.extend(&args);
        // `explain` exits 1 for a denied workload: its answer is the output.
        let out = k.output(&argv)?;
        // Every gated process's namespace was open to the scan (hostPID and SYS_PTRACE).
        ensure!(!out.contains("not open to the agent"), "status: {out}");
        report.line(format!(
            "kubectl exec {agent_pod} -- gate-agent {}:\n{}",
            args.join(" "),
            indent(&out)
        ));
    }
    policy_edits(&k, &imds, report)?;
    upgrade(&k, &imds, &inputs.bins, report)?;
    platform_switch(&k, &imds, report)?;
    must_gather(&k, report)
}

/// The AWS policy's ConfigMap, edited as an operator edits it: an entry narrowed to paths
/// (IMDSv2's token request among them, as the AWS SDKs need) for the pod-network client (live: served through the proxy, refused the credentials),
/// then a bad edit (refused with an Event, the last good policy kept), then the original.
fn policy_edits(k: &Kubectl<'_>, imds: &FakeImds, report: &mut Report) -> Result<()> {
    let jsonpath = "jsonpath={.data.policy\\.yaml}";
    let original = k.run(&["-n", AGENT_NS, "get", "cm", POLICY_CM, "-o", jsonpath])?;
    ensure!(
        original.trim_end().ends_with("containers: [csi-driver]"),
        "the AWS policy no longer ends with its allow list:\n{original}"
    );
    let narrowed = format!(
        "{original}  - name: e2e-pod-network\n    namespace: {NS}\n    podSelector: {{matchLabels: \
         {{app: pod-network}}}}\n    paths: [/latest/api/token, /latest/meta-data/instance-id]\n    \
         methods: [GET, HEAD, PUT]\n"
    );
    set_policy(k, &narrowed)?;
    let pod = &CLIENTS[0];
    let served = |k: &Kubectl<'_>| -> Result<bool> {
        Ok(get(k, pod, "/latest/meta-data/instance-id")?.contains(crate::imds::INSTANCE_ID))
    };
    wait_until(Duration::from_secs(30), "the narrowed entry to serve pod-network", || served(k))?;
    report.line(format!(
        "policy edited (an entry narrowed to paths for {NS}/pod-network): instance-id served \
         through the proxy"
    ));
    let credentials = get(k, pod, "/latest/meta-data/iam/security-credentials/")?;
    ensure!(credentials.contains(" 403 "), "the credentials were not refused: {credentials}");
    report.line(format!("  the credentials path: {}", status_line(&credentials)));
    // The proxy is on the node, one hop from the service: the pod gets its paths by IMDSv2
    // at hop limit 1, which it could not reach on its own.
    imds.set_token_hop_limit(1);
    let id = imdsv2(k, pod, "/latest/meta-data/instance-id");
    let creds = imdsv2(k, pod, "/latest/meta-data/iam/security-credentials/");
    imds.set_token_hop_limit(0);
    let (id, creds) = (id?, creds?);
    let reply = |o: &crate::probe::Outcome| o.reply.clone().unwrap_or_default();
    ensure!(
        reply(&id).contains(crate::imds::INSTANCE_ID),
        "IMDSv2 at hop limit 1 through the proxy: {id:?}"
    );
    ensure!(reply(&creds).contains(" 403 "), "IMDSv2: the credentials were not refused: {creds:?}");
    report.line(format!(
        "  by IMDSv2 at hop limit 1: a token and instance-id through the proxy, the credentials \
         {}",
        reply(&creds).lines().nth(1).unwrap_or("").trim_end()
    ));

    set_policy(k, "platform: AWS\nmode: maybe\n")?;
    let rejected = ["-n", AGENT_NS, "get", "events", "--field-selector", "reason=PolicyRejected"];
    wait_until(Duration::from_secs(30), "a PolicyRejected Event", || {
        Ok(!k.run(&[&rejected[..], &["-o", "name"]].concat())?.trim().is_empty())
    })?;
    let why = k.run(&[&rejected[..], &["-o", "jsonpath={.items[0].message}"]].concat())?;
    ensure!(served(k)?, "the last good policy was lost");
    report.line(format!(
        "bad edit (mode: maybe): Event PolicyRejected \"{why}\"; the last good policy still serves"
    ));

    set_policy(k, &original)?;
    wait_until(Duration::from_secs(30), "the original policy to deny pod-network again", || {
        Ok(get(k, pod, "/latest/meta-data/instance-id")?.contains("\"errno\":1,"))
    })?;
    report.line("original policy restored: pod-network denied again".into());
    Ok(())
}

/// The agent upgraded (a new image rolled out) and then its pod deleted, while a
/// host-network client connects to the service in a loop: never once served. The allowed
/// component is served again afterwards.
fn upgrade(k: &Kubectl<'_>, imds: &FakeImds, bins: &Bins, report: &mut Report) -> Result<()> {
    let token = unique("e2e-hammer");
    let argv = ["-n", NS, "exec", "-i", "host-network", "--", "probe", "--netns", "self"];
    let mut hammer = k.cmd(&[&argv[..], &["hammer-tcp", IMDS_V4, "80", &token]].concat())?;
    hammer.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
    let mut hammer = hammer.spawn().context("starting the hammer")?;
    let mut out = std::io::BufReader::new(hammer.stdout.take().context("hammer stdout")?);
    let mut first = String::new();
    std::io::BufRead::read_line(&mut out, &mut first)?;
    ensure!(first.contains("connected"), "the hammer did not start: {first}");

    // A new build: the same binary in a new image (another digest).
    let mut image = images::agent(&bins.agent)?;
    image.name = "localhost/metadata-gate:cluster-upgrade".into();
    image.file("/etc/metadata-gate-build", b"upgrade\n".to_vec(), 0o644);
    let next = k.0.node.import(&k.0.cp, &image)?;
    let ds = format!("ds/{AGENT_DS}");
    let t = Instant::now();
    k.run(&["-n", AGENT_NS, "set", "image", &ds, &format!("agent={}", next.by_digest())])?;
    k.run(&["-n", AGENT_NS, "rollout", "status", &ds, "--timeout=180s"])?;
    report.line(format!(
        "upgrade to {}: rolled out in {:.1} s",
        next.by_digest(),
        t.elapsed().as_secs_f64()
    ));
    let t = Instant::now();
    let selector = "app.kubernetes.io/name=metadata-gate";
    k.run(&["-n", AGENT_NS, "delete", "pod", "-l", selector, "--wait=true"])?;
    k.run(&["-n", AGENT_NS, "rollout", "status", &ds, "--timeout=180s"])?;
    report
        .line(format!("agent pod deleted: a new one ready in {:.1} s", t.elapsed().as_secs_f64()));

    if let Some(mut stdin) = hammer.stdin.take() {
        stdin.write_all(b"stop\n")?;
    }
    let mut result = String::new();
    std::io::BufRead::read_line(&mut out, &mut result)?;
    let _ = hammer.wait();
    ensure!(result.contains("successes=0 "), "a connect was served during the upgrade: {result}");
    ensure!(!imds.saw(&token), "the hammer's token reached the metadata service");
    let counts = result.split("\"reply\":\"").nth(1).and_then(|r| r.split('"').next());
    report.line(format!(
        "  host-network client throughout: {}; its token never arrived",
        counts.unwrap_or("")
    ));
    let ccm = &CLIENTS[3];
    wait_until(Duration::from_secs(30), "the allowed component to be served again", || {
        attempt(k, imds, ccm)
    })?;
    report.line("  the allow-listed cloud controller manager served again".into());
    Ok(())
}

/// The platform switched through the Infrastructure object: on GCP the AWS controller
/// manager is no component of the platform's, and is denied; back on AWS, served.
fn platform_switch(k: &Kubectl<'_>, imds: &FakeImds, report: &mut Report) -> Result<()> {
    let ccm = &CLIENTS[3];
    k.stdin(&["apply", "-f", "-"], &infrastructure("GCP"))?;
    wait_until(
        Duration::from_secs(60),
        "the GCP policy to deny the AWS controller manager",
        || Ok(!attempt(k, imds, ccm)?),
    )?;
    report.line("Infrastructure switched to GCP: the AWS cloud controller manager denied".into());
    k.stdin(&["apply", "-f", "-"], &infrastructure("AWS"))?;
    wait_until(Duration::from_secs(60), "the AWS policy to serve it again", || {
        attempt(k, imds, ccm)
    })?;
    report.line("Infrastructure switched back to AWS: served again".into());
    Ok(())
}

/// deploy/must-gather/gather against this cluster, as `oc adm must-gather` runs it.
fn must_gather(k: &Kubectl<'_>, report: &mut Report) -> Result<()> {
    let cp = &k.0.cp;
    let out = cp.dir.join("must-gather");
    let mut cmd = Command::new(root().join("deploy/must-gather/gather"));
    cmd.env("MUST_GATHER_DIR", &out).env("KUBECTL", cp.bin().join("kubectl"));
    cmd.env("KUBECONFIG", cp.kubeconfig());
    crate::sys::exec_in_netns(&mut cmd, &cp.net.node_path())?;
    let run = cmd.output().context("running deploy/must-gather/gather")?;
    ensure!(run.status.success(), "must-gather failed: {}", String::from_utf8_lossy(&run.stderr));
    let mut files: Vec<String> = walk(&out)
        .into_iter()
        .filter_map(|p| p.strip_prefix(&out).ok().map(|p| p.display().to_string()))
        .collect();
    files.sort();
    ensure!(
        files.iter().any(|f| f.ends_with("infrastructure.yaml")),
        "must-gather has no infrastructure.yaml: {files:?}"
    );
    report.line(format!("must-gather ({} files):\n{}", files.len(), indent(&files.join("\n"))));
    Ok(())
}

/// Every file below `dir`.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() { out.extend(walk(&p)) } else { out.push(p) }
    }
    out
}

/// GET `path` from the service in client `c`: `probe`'s JSON line.
fn get(k: &Kubectl<'_>, c: &Client, path: &str) -> Result<String> {
    let argv = ["-n", c.ns, "exec", c.pod, "--", "probe", "--netns", "self", "http"];
    k.output(&[&argv[..], &[IMDS_V4, "80", "e2e", path]].concat())
}

/// `probe imdsv2` of `path` from `c`.
fn imdsv2(k: &Kubectl<'_>, c: &Client, path: &str) -> Result<crate::probe::Outcome> {
    let argv = ["-n", c.ns, "exec", c.pod, "--", "probe", "--netns", "self", "imdsv2"];
    let out = k.output(&[&argv[..], &[IMDS_V4, "80", "e2e", path]].concat())?;
    let line = out.lines().rfind(|l| l.starts_with('{')).unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("probe imdsv2 {path}: {out}"))
}

/// The HTTP status line in `probe`'s JSON reply.
fn status_line(reply: &str) -> &str {
    reply.split("\\n").nth(1).and_then(|l| l.split("\\r").next()).unwrap_or(reply)
}

/// Replace the AWS policy's text in its ConfigMap.
fn set_policy(k: &Kubectl<'_>, text: &str) -> Result<()> {
    let patch = serde_json::json!({"data": {"policy.yaml": text}}).to_string();
    k.run(&["-n", AGENT_NS, "patch", "cm", POLICY_CM, "--type=merge", "-p", &patch]).map(drop)
}

impl How {
    fn name(self) -> &'static str {
        match self {
            How::Http => "HTTP",
            How::Frame => "AF_PACKET frame",
        }
    }
}

/// Have `c` send a fresh token to the metadata service; whether it arrived.
fn attempt(k: &Kubectl<'_>, imds: &FakeImds, c: &Client) -> Result<bool> {
    let token = unique("e2e");
    // `probe` in the pod's own network namespace. (Debian's static busybox crashes in its
    // `wget`: static glibc has no name service to load in an image without one.)
    let frame = syn_frame(k, &token)?;
    let mut argv = vec!["probe", "--netns", "self"];
    match c.how {
        How::Http => argv.extend(["http", IMDS_V4, "80", &token, "/latest/meta-data/instance-id"]),
        How::Frame => argv.extend(["frame", "vnode", "0800", &frame]),
    }
    let mut all = vec!["-n", c.ns, "exec", c.pod, "--"];
    all.extend(&argv);
    let out = k.output(&all)?;
    let arrived = imds.wait_for(&token, Duration::from_secs(3));
    eprintln!("e2e: {}/{}: {} -> {}", c.ns, c.pod, argv.join(" "), out.trim());
    Ok(arrived)
}

/// `c` connected to the service's port 80 over TCP and waiting for a token to send.
fn hold(k: &Kubectl<'_>, c: &Client) -> Result<Held> {
    let mut cmd = k.cmd(&["-n", c.ns, "exec", "-i", c.pod, "--"])?;
    cmd.args(["probe", "--netns", "self", "hold-tcp", IMDS_V4, "80"]);
    Held::spawn(cmd)?.map_err(|o| anyhow::anyhow!("{}/{} could not connect: {o:?}", c.ns, c.pod))
}

/// A TCP SYN to the service's port 80 carrying `token`, in an Ethernet frame from the node's
/// link to the service's (hex, as `probe frame` takes it): what a host-network pod with
/// `NET_RAW` can write on the node's uplink, past every socket hook.
fn syn_frame(k: &Kubectl<'_>, token: &str) -> Result<String> {
    let net = &k.0.cp.net;
    let (src, dst): (std::net::Ipv4Addr, std::net::Ipv4Addr) = (NODE_V4.parse()?, IMDS_V4.parse()?);
    let syn = frame::tcp_syn(&src.octets(), &dst.octets(), 40000, 80, 0, token.as_bytes());
    let packet = frame::ipv4(src, dst, frame::PROTO_TCP, 0x4d47, 0, &syn);
    let eth = frame::ethernet(
        mac(&net.imds, "vimds")?,
        mac(&net.node, "vnode")?,
        &[],
        frame::ETH_P_IP,
        &packet,
    );
    Ok(frame::to_hex(&eth))
}

/// kubectl as the cluster's admin.
struct Kubectl<'a>(&'a Cluster);

impl Kubectl<'_> {
    fn cmd(&self, args: &[&str]) -> Result<Command> {
        let mut c = self.0.cp.kubectl()?;
        c.args(args);
        Ok(c)
    }

    /// Run; its stdout, or fail with its stderr.
    fn run(&self, args: &[&str]) -> Result<String> {
        self.stdin(args, "")
    }

    fn stdin(&self, args: &[&str], input: &str) -> Result<String> {
        let mut cmd = self.cmd(args)?;
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().with_context(|| format!("starting {}", show(&cmd)))?;
        if let Some(mut s) = child.stdin.take() {
            s.write_all(input.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Run; stdout and stderr together, whatever its exit status.
    fn output(&self, args: &[&str]) -> Result<String> {
        let mut cmd = self.cmd(args)?;
        let out = cmd.output().with_context(|| format!("starting {}", show(&cmd)))?;
        Ok(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if done()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("waited {} s for {what}", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn indent(text: &str) -> String {
    text.lines().fold(String::new(), |mut s, l| {
        let _ = writeln!(s, "    {l}");
        s
    })
}

/// The cluster's Infrastructure object, as an OpenShift installer leaves it.
fn infrastructure(platform: &str) -> String {
    serde_json::json!({
        "apiVersion": "config.openshift.io/v1",
        "kind": "Infrastructure",
        "metadata": {"name": "cluster"},
        "spec": {"platformSpec": {"type": platform}},
        "status": {
            "infrastructureName": "mg-e2e",
            "platform": platform,
            "platformStatus": {"type": platform},
        },
    })
    .to_string()
}

/// The client pods, on the node before the agent (they tolerate its not-ready taint, as the
/// node's own DaemonSets do).
fn clients_yaml(image: &Imported) -> String {
    let image = image.by_digest();
    let pod = |ns: &str, name: &str, host: bool, labels: &str, container: &str, caps: &str| {
        format!(
            r#"---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}, labels: {{{labels}}}}}
spec:
  hostNetwork: {host}
  terminationGracePeriodSeconds: 1
  tolerations: [{{operator: Exists}}]
  containers:
    - name: {container}
      image: "{image}"
      imagePullPolicy: Never
      command: [sleep, "3600"]
      securityContext: {{capabilities: {{add: [{caps}]}}}}
"#
        )
    };
    let mut out = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NS}}}\n---\napiVersion: v1\nkind: \
         Namespace\nmetadata: {{name: {CCM_NS}}}\n"
    );
    out += &pod(NS, "pod-network", false, "app: pod-network", "client", "");
    out += &pod(NS, "host-network", true, "", "client", "");
    out += &pod(NS, "host-network-raw", true, "", "client", "NET_RAW");
    out += &pod(
        CCM_NS,
        "aws-ccm",
        true,
        "k8s-app: aws-cloud-controller-manager",
        "cloud-controller-manager",
        "",
    );
    out
}

/// linux/capability.h.
const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this machine grants `cap` (a capability number) to its root: a container cannot
/// be given one its runtime lacks.
fn machine_grants(cap: u32) -> Result<bool> {
    let status = fs::read_to_string("/proc/self/status")?;
    let bounding = status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .context("no CapBnd in /proc/self/status")?;
    Ok(bounding & (1 << cap) != 0)
}

/// The overlay the test applies: the shipped OpenShift overlay with this build's image by
/// digest, and without the kube-rbac-proxy sidecar, whose image cannot be built here (its
/// module is not served by the Go module proxy this machine reaches, and no registry is).
/// Where the machine withholds CAP_SYS_RESOURCE from root (as the CI machines do), the
/// agent cannot be granted it either: it is asked for only to lift RLIMIT_MEMLOCK for
/// kernels before 5.11, and the overlay leaves it out (the report says so).
fn write_overlay(cluster: &Cluster, agent: &Imported, report: &mut Report) -> Result<String> {
    let dir = cluster.cp.dir.join("overlay");
    fs::create_dir_all(&dir)?;
    let (name, digest) = agent
        .by_digest()
        .split_once('@')
        .map(|(n, d)| (n.to_owned(), d.to_owned()))
        .context("digest")?;
    let kustomization = format!(
        r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {shipped}
images:
  - name: metadata-gate
    newName: {name}
    digest: {digest}
patches:
  - target: {{group: apps, version: v1, kind: DaemonSet, name: {AGENT_DS}}}
    patch: |-
      - op: test
        path: /spec/template/spec/containers/1/name
        value: kube-rbac-proxy
      - op: remove
        path: /spec/template/spec/containers/1
{sys_resource}"#,
        shipped = relative(&dir, &root().join("deploy/overlays/openshift"))?.display(),
        sys_resource = if machine_grants(CAP_SYS_RESOURCE)? {
            ""
        } else {
            report.line(
                "this machine withholds CAP_SYS_RESOURCE: the agent runs without it (kernel \
                 5.11+ does not charge BPF memory to RLIMIT_MEMLOCK)"
                    .into(),
            );
            "      - op: test\n        path: /spec/template/spec/containers/0/securityContext/capabilities/add/4\n        value: SYS_RESOURCE\n      - op: remove\n        path: /spec/template/spec/containers/0/securityContext/capabilities/add/4\n"
        },
    );
    fs::write(dir.join("kustomization.yaml"), kustomization)?;
    Ok(dir.display().to_string())
}

/// `to` as a path relative to the directory `from` (kustomize takes no absolute roots).
fn relative(from: &std::path::Path, to: &std::path::Path) -> Result<std::path::PathBuf> {
    let (from, to) = (from.canonicalize()?, to.canonicalize()?);
    let common = from.components().zip(to.components()).take_while(|(a, b)| a == b).count();
    let mut out: std::path::PathBuf = from.components().skip(common).map(|_| "..").collect();
    out.extend(to.components().skip(common));
    Ok(out)
}

/// What a failure needs to be understood: the pods, the agent's log, the events.
fn diagnostics(cluster: &Cluster) {
    let k = Kubectl(cluster);
    for args in [
        &["get", "pods", "-A", "-o", "wide"][..],
        &["-n", AGENT_NS, "logs", &format!("ds/{AGENT_DS}"), "-c", "agent", "--tail=60"][..],
        &["get", "events", "-A"][..],
    ] {
        eprintln!("$ kubectl {}\n{}", args.join(" "), k.output(args).unwrap_or_default());
    }
    eprintln!("kubelet's log ends:\n{}", cluster.node.log_tail("kubelet"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_relative_to_another() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("x/y/overlay"), dir.path().join("deploy/overlays/openshift"));
        fs::create_dir_all(&a).unwrap();
        fs::create_dir_all(&b).unwrap();
        assert_eq!(
            relative(&a, &b).unwrap(),
            std::path::Path::new("../../../deploy/overlays/openshift")
        );
    }
}
