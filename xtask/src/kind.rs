//! `cargo xtask e2e-kind`: the agent as a DaemonSet on a kind cluster, against a fake AWS
//! IMDS on the worker node. .github/workflows/kind-e2e.yml runs exactly this.
//!
//! 1. build the image `metadata-gate:dev` (Dockerfile) unless `--no-build`;
//! 2. create the kind cluster of deploy/kind/cluster.yaml (one worker) and load the images;
//! 3. on every node: make sure bpffs is mounted at /sys/fs/bpf (the DaemonSet mounts it with
//!    HostToContainer propagation, so the pins must land in the node's own bpffs);
//! 4. on the worker: 169.254.169.254/32 on a dummy link, served by the host-network pod of
//!    deploy/kind/e2e/fake-imds.yaml; start the clients of deploy/kind/e2e/clients.yaml;
//! 5. baseline, before the gate: every client is served (proves the fake IMDS is reachable);
//! 6. `kubectl apply -k deploy/overlays/kind` (AWS policy) and wait for the rollout;
//! 7. the pod-network and the host-network client are denied with EPERM; the host-network
//!    client that matches the AWS policy's aws-cloud-controller-manager entry is served;
//! 8. the worker's metrics, from the worker itself: https on port 9752 answers 401 without
//!    a token, 403 to a service account without `get` on /metrics and the agent's metrics to
//!    one bound to metadata-gate-metrics-reader (deploy/kind/e2e/metrics-readers.yaml); the
//!    probe port 9750 answers /readyz and not /metrics.
//!
//! It needs docker, kind and kubectl, and fails at once, naming what is missing.
use std::process::Command;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

use crate::util::{cmd, output, root, run, show};

const CLUSTER: &str = "metadata-gate-e2e";
const IMAGE: &str = "metadata-gate:dev";
const CLIENT_IMAGE: &str = "busybox:1.36";
const IMDS: &str = "169.254.169.254";
const URL: &str = "http://169.254.169.254/latest/meta-data/instance-id";
/// What the fake IMDS answers (deploy/kind/e2e/fake-imds.yaml).
const SERVED: &str = "metadata-gate-e2e-served";
const CONTEXT: &str = "kind-metadata-gate-e2e";

pub(crate) struct Options {
    /// Keep the cluster at the end (also after a failure).
    pub keep: bool,
    /// Build the image first.
    pub build: bool,
}

/// A client pod and what must happen when it fetches the metadata URL under the gate.
struct Client {
    namespace: &'static str,
    pod: &'static str,
    allowed: bool,
}

const CLIENTS: &[Client] = &[
    Client { namespace: "metadata-gate-e2e", pod: "pod-network", allowed: false },
    Client { namespace: "metadata-gate-e2e", pod: "host-network", allowed: false },
    Client { namespace: "openshift-cloud-controller-manager", pod: "aws-ccm", allowed: true },
];

pub(crate) fn e2e(opts: Options) -> Result<()> {
    require_tools()?;
    if opts.build {
        run(Command::new("docker").args(["build", "-t", IMAGE, "-f", "Dockerfile", "."]))?;
    }
    // A cluster left over from an earlier run (--keep, or a crash) is replaced.
    if output(Command::new("kind").arg("get").arg("clusters"))
        .is_some_and(|c| c.lines().any(|l| l.trim() == CLUSTER))
    {
        run(Command::new("kind").args(["delete", "cluster", "--name", CLUSTER]))?;
    }
    run(&mut cmd(&format!(
        "kind create cluster --name {CLUSTER} --config deploy/kind/cluster.yaml --wait 180s"
    )))?;

    let result = scenario();
    if result.is_err() {
        diagnostics();
    }
    if opts.keep {
        eprintln!(
            "keeping cluster {CLUSTER} (kubectl --context {CONTEXT}; kind delete cluster --name {CLUSTER})"
        );
    } else if let Err(e) = run(Command::new("kind").args(["delete", "cluster", "--name", CLUSTER]))
    {
        eprintln!("warning: {e:#}");
    }
    result
}

fn require_tools() -> Result<()> {
    let missing: Vec<&str> = [
        ("docker", &["version", "--format", "{{.Server.Version}}"][..]),
        ("kind", &["version"][..]),
        ("kubectl", &["version", "--client"][..]),
    ]
    .into_iter()
    .filter(|(tool, args)| output(Command::new(tool).args(*args)).is_none())
    .map(|(tool, _)| tool)
    .collect();
    if !missing.is_empty() {
        bail!(
            "e2e-kind needs {} (not found or not working: {}). It builds a container image and \
             runs a kind cluster, so it needs a running Docker engine; CI runs it in \
             .github/workflows/kind-e2e.yml",
            ["docker (with a running engine)", "kind", "kubectl"].join(", "),
            missing.join(", ")
        );
    }
    Ok(())
}

/// kubectl on the e2e cluster, with `args` (words separated by spaces, no quoting).
fn kubectl(args: &str) -> Command {
    cmd(&format!("kubectl --context {CONTEXT} {args}"))
}

fn scenario() -> Result<()> {
    if output(Command::new("docker").args(["image", "inspect", CLIENT_IMAGE])).is_none() {
        run(Command::new("docker").args(["pull", CLIENT_IMAGE]))?;
    }
    for image in [IMAGE, CLIENT_IMAGE] {
        run(Command::new("kind").args(["load", "docker-image", image, "--name", CLUSTER]))?;
    }

    let nodes = output(Command::new("kind").args(["get", "nodes", "--name", CLUSTER]))
        .context("kind get nodes")?;
    let nodes: Vec<&str> = nodes.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    for node in &nodes {
        // The pins must live in the node's bpffs, not in one the agent mounts in its own
        // mount namespace (see the DaemonSet's volumeMounts).
        let mount = "mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf";
        run(Command::new("docker").args(["exec", node, "sh", "-c", mount]))?;
    }
    let worker = worker_node()?;
    // The fake IMDS address, in the worker's own network namespace (the node container's).
    let dummy = format!(
        "ip link add imds0 type dummy && ip addr add {IMDS}/32 dev imds0 && ip link set imds0 up"
    );
    run(Command::new("docker").args(["exec", &worker, "sh", "-c", &dummy]))?;

    for file in ["deploy/kind/e2e/fake-imds.yaml", "deploy/kind/e2e/clients.yaml"] {
        run(&mut kubectl(&format!("apply -f {file}")))?;
    }
    for pods in [
        "metadata-gate-e2e pod/fake-imds pod/pod-network pod/host-network",
        "openshift-cloud-controller-manager pod/aws-ccm",
    ] {
        run(&mut kubectl(&format!("wait --for=condition=Ready --timeout=180s -n {pods}")))?;
    }

    eprintln!("\n== baseline, no gate: every client reaches the fake IMDS");
    for c in CLIENTS {
        let got = fetch(c)?;
        if !got.served() {
            bail!(
                "baseline: {}/{} cannot reach the fake IMDS before the gate exists ({}); the \
                 test setup is broken, not the gate",
                c.namespace,
                c.pod,
                got.describe()
            );
        }
        eprintln!("   {}/{}: served", c.namespace, c.pod);
    }

    eprintln!("\n== deploy the gate (deploy/overlays/kind: AWS policy)");
    run(&mut kubectl("apply -k deploy/overlays/kind"))?;
    run(&mut kubectl(
        "-n metadata-gate rollout status daemonset/metadata-gate-agent --timeout=300s",
    ))?;

    eprintln!("\n== under the gate");
    let deadline = Duration::from_secs(90);
    for c in CLIENTS {
        // The agent maps allow-listed pods to cgroups as they appear: give it time, but a
        // verdict that holds is required (the last attempt decides).
        let start = Instant::now();
        let mut got = fetch(c)?;
        while got.served() != c.allowed && start.elapsed() < deadline {
            sleep(Duration::from_secs(3));
            got = fetch(c)?;
        }
        let who = format!("{}/{}", c.namespace, c.pod);
        match (c.allowed, &got) {
            (true, Fetch::Served) => eprintln!("   {who}: served (allow-listed)"),
            (false, Fetch::Failed { message, elapsed }) if message.contains("not permitted") => {
                if *elapsed > Duration::from_secs(3) {
                    bail!("{who}: denied, but only after {elapsed:?}; EPERM must come at once");
                }
                eprintln!("   {who}: denied at once ({})", message.trim());
            }
            (true, _) => bail!("{who} is allow-listed but was not served: {}", got.describe()),
            (false, _) => bail!(
                "{who} must be denied with EPERM (Operation not permitted), got: {}",
                got.describe()
            ),
        }
    }
    metrics(&worker)?;
    eprintln!("\ne2e-kind: OK");
    Ok(())
}

/// What the worker's metrics endpoints answer whom (step 8).
fn metrics(worker: &str) -> Result<()> {
    eprintln!("\n== metrics of the worker's agent");
    run(&mut kubectl("apply -f deploy/kind/e2e/metrics-readers.yaml"))?;
    let jsonpath = r#"jsonpath={.status.addresses[?(@.type=="InternalIP")].address}"#;
    let ip = output(&mut kubectl(&format!("get node {worker} -o {jsonpath}")))
        .context("the worker's InternalIP")?;
    let ip = ip.trim();
    let token = |sa: &str| {
        output(&mut kubectl(&format!("-n metadata-gate-e2e create token {sa}")))
            .map(|t| t.trim().to_owned())
            .with_context(|| format!("a token for {sa}"))
    };
    let (reader, other) = (token("metrics-reader")?, token("no-metrics")?);
    let https = format!("https://{ip}:9752/metrics");
    // kube-rbac-proxy starts beside the agent: give it time to listen (and the new binding
    // time to reach the authorizer), but the answers that hold are required.
    let start = Instant::now();
    let cases: [(&str, &str, Option<&str>, &str); 5] = [
        ("no token", &https, None, "401"),
        ("no-metrics", &https, Some(&other), "403"),
        ("metrics-reader", &https, Some(&reader), "200"),
        ("probe port /readyz", &format!("http://{ip}:9750/readyz"), None, "200"),
        ("probe port /metrics", &format!("http://{ip}:9750/metrics"), None, "404"),
    ];
    for (who, url, token, want) in cases {
        let mut got = curl(worker, url, token)?;
        while got.0 != want && start.elapsed() < Duration::from_secs(90) {
            sleep(Duration::from_secs(3));
            got = curl(worker, url, token)?;
        }
        if got.0 != want {
            bail!("{url} as {who}: HTTP {} (want {want}): {}", got.0, got.1.trim());
        }
        if who == "metrics-reader" && !got.1.contains("metadata_gate_decisions_total") {
            bail!("{url} as {who}: 200 but no agent metrics:\n{}", got.1);
        }
        eprintln!("   {url} as {who}: {want}");
    }
    Ok(())
}

/// `curl` on the worker: (status code, body).
fn curl(worker: &str, url: &str, token: Option<&str>) -> Result<(String, String)> {
    let mut cmd = Command::new("docker");
    cmd.args(["exec", worker, "curl", "-sk", "-m", "5", "-w", "\n%{http_code}"]);
    if let Some(t) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
    }
    cmd.arg(url);
    let out = cmd.output().with_context(|| format!("starting {}", show(&cmd)))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", text.as_str()));
    Ok((code.trim().to_owned(), body.to_owned()))
}

fn worker_node() -> Result<String> {
    let out = output(&mut kubectl(
        "get nodes -l metadata-gate-e2e=worker -o jsonpath={.items[*].metadata.name}",
    ))
    .context("listing the worker node")?;
    match out.split_whitespace().collect::<Vec<_>>()[..] {
        [one] => Ok(one.to_owned()),
        ref other => bail!(
            "expected one node labelled metadata-gate-e2e=worker (deploy/kind/cluster.yaml), found {other:?}"
        ),
    }
}

enum Fetch {
    Served,
    /// Ran, but got something other than the fake IMDS's answer.
    Other(String),
    Failed {
        message: String,
        elapsed: Duration,
    },
}

impl Fetch {
    fn served(&self) -> bool {
        matches!(self, Fetch::Served)
    }

    fn describe(&self) -> String {
        match self {
            Fetch::Served => "served".into(),
            Fetch::Other(s) => format!("unexpected answer {s:?}"),
            Fetch::Failed { message, elapsed } => {
                format!("failed after {elapsed:?}: {}", message.trim())
            }
        }
    }
}

/// `wget` the metadata URL inside the client pod.
fn fetch(c: &Client) -> Result<Fetch> {
    let mut cmd = kubectl(&format!("exec -n {} {} -- wget -q -T 5 -O - {URL}", c.namespace, c.pod));
    let start = Instant::now();
    let out = cmd.output().with_context(|| format!("starting {}", show(&cmd)))?;
    let elapsed = start.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        return Ok(if stdout.trim() == SERVED { Fetch::Served } else { Fetch::Other(stdout) });
    }
    let message = format!("{}{}", String::from_utf8_lossy(&out.stderr), stdout);
    Ok(Fetch::Failed { message, elapsed })
}

/// What helps to understand a failure; errors here are printed, not raised.
fn diagnostics() {
    eprintln!("\n== diagnostics");
    for args in [
        "get pods -A -o wide",
        "-n metadata-gate describe daemonset/metadata-gate-agent",
        "-n metadata-gate logs -l app.kubernetes.io/name=metadata-gate --prefix --tail=200",
        "-n metadata-gate-e2e logs pod/fake-imds --tail=50",
        "-n metadata-gate logs -l app.kubernetes.io/name=metadata-gate -c kube-rbac-proxy \
         --prefix --tail=50",
    ] {
        let mut cmd = kubectl(args);
        cmd.current_dir(root());
        eprintln!("$ {}", show(&cmd));
        if let Err(e) = cmd.status() {
            eprintln!("   ({e})");
        }
    }
}
