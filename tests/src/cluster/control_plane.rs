//! A control plane as plain processes: etcd and kube-apiserver, in the node network namespace of
//! a test network of their own (`integration_tests::net::TestNet`: the node's namespace, and
//! the fake metadata service's behind it). Nothing listens in, or routes through, the
//! machine's own namespace. Authentication and authorization as a real cluster has them: client
//! certificates and service-account tokens, no anonymous access, the Node and RBAC authorizers,
//! NodeRestriction. Everything goes on drop, also after a failure: the processes (by pid), the
//! namespaces, the run directory (certificates, etcd's data, the logs).
use std::{
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use super::{build, pki, procs::Procs, show, target_dir};
use crate::{
    net::{NODE_V4, TestNet},
    sys::{exec_in_netns, unique},
};
use anyhow::{Context as _, Result, bail};

/// The Service range: the API server's own Service takes its first address.
const SERVICE_RANGE: &str = "10.96.0.0/16";
const SERVICE_IP: &str = "10.96.0.1";
/// The API server's port, on every address of the node's namespace: the `kubernetes`
/// Service's own port, since no kube-proxy runs. The Service's address is an address of the
/// node itself (on [`NODE_LINK`]), so that in-cluster clients (the agent) reach the API
/// server as in any cluster, by `KUBERNETES_SERVICE_HOST`, without a proxy's rules.
const API_PORT: u16 = 443;
/// The node's name and its address. Not the link-local address the fake metadata service
/// faces ([`NODE_V4`]): the kubelet refuses a link-local node IP.
pub const NODE_NAME: &str = "mg-node";
pub const NODE_IP: &str = "10.250.0.1";
/// The link that holds the node's address and the Service's: loopback, as this kernel has no
/// dummy links; every address of the node's namespace is the node's alike.
const NODE_LINK: &str = "lo";
/// How long each component may take to answer after it starts (a cold etcd and API server
/// answer in a few seconds here).
const START: Duration = Duration::from_secs(90);

/// The running control plane.
pub struct ControlPlane {
    /// Declared first: dropped (killed) before the namespaces go.
    procs: Procs,
    pub net: TestNet,
    /// Certificates, etcd's data, kubeconfigs and the components' logs.
    pub dir: PathBuf,
    bin: PathBuf,
}

impl ControlPlane {
    /// Build what is missing, then start etcd and the API server and wait until both answer.
    pub fn start() -> Result<ControlPlane> {
        let bin = build()?;
        let net = TestNet::new().context("the cluster's network namespaces")?;
        let dir = target_dir().join("cluster/run").join(unique("mg-cluster"));
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut cp = ControlPlane { procs: Procs::new(dir.clone()), net, dir, bin };
        let node: IpAddr = NODE_V4.parse()?;
        let kubelet = pki::Kubelet { name: NODE_NAME.into(), ip: NODE_IP.parse()? };
        pki::write(&cp.dir, node, SERVICE_IP.parse()?, &kubelet)?;
        let link = |args: &str| crate::net::ip(&cp.net.node, args).map(drop);
        link(&format!("addr add {NODE_IP}/32 dev {NODE_LINK}"))?;
        link(&format!("addr add {SERVICE_IP}/32 dev {NODE_LINK}"))?;
        let server = cp.server();
        let admin = pki::kubeconfig(&cp.dir, &server, pki::ADMIN_CERT, pki::ADMIN_KEY)?;
        fs::write(cp.kubeconfig(), admin)?;
        let started = Instant::now();
        let controller =
            pki::kubeconfig(&cp.dir, &server, pki::CONTROLLER_CERT, pki::CONTROLLER_KEY)?;
        fs::write(cp.dir.join("controller-manager.kubeconfig"), controller)?;
        cp.start_etcd()?;
        cp.start_apiserver()?;
        cp.let_apiserver_reach_kubelets()?;
        cp.start_controller_manager()?;
        cp.start_scheduler()?;
        eprintln!(
            "cluster: etcd, kube-apiserver, kube-controller-manager and kube-scheduler answer \
             after {:.1} s (run dir {})",
            started.elapsed().as_secs_f64(),
            cp.dir.display()
        );
        Ok(cp)
    }

    /// The API server's address for the node's components.
    pub(super) fn server(&self) -> String {
        format!("https://{NODE_V4}:{API_PORT}")
    }

    /// The cluster's binaries (`target/cluster/bin`).
    pub(super) fn bin(&self) -> &Path {
        &self.bin
    }

    /// The admin's kubeconfig (`system:masters`).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// `kubectl` (the one built with the cluster) as the admin, in the node's namespace.
    pub fn kubectl(&self) -> Result<Command> {
        let mut cmd = Command::new(self.bin.join("kubectl"));
        cmd.arg("--kubeconfig").arg(self.kubeconfig());
        exec_in_netns(&mut cmd, &self.net.node_path())?;
        Ok(cmd)
    }

    /// Start `name` from the cluster's binaries with `args`, its output in `<name>.log`.
    fn spawn(&mut self, name: &'static str, args: &[String]) -> Result<()> {
        let mut cmd = Command::new(self.bin.join(name));
        cmd.args(args);
        exec_in_netns(&mut cmd, &self.net.node_path())?;
        self.procs.spawn(name, cmd)
    }

    /// Wait until `ready` holds, or fail with `name`'s log if it exits or `START` passes.
    fn wait(&mut self, name: &str, mut ready: impl FnMut(&Self) -> bool) -> Result<()> {
        // Out of `self` while `ready` reads it.
        let mut procs = std::mem::take(&mut self.procs);
        let result = procs.wait(name, START, || ready(self));
        self.procs = procs;
        result
    }

    fn start_etcd(&mut self) -> Result<()> {
        // Plain HTTP on the node namespace's loopback, which nothing outside it reaches.
        let data = self.dir.join("etcd");
        let args = [
            "--name=node",
            &format!("--data-dir={}", data.display()),
            "--listen-client-urls=http://127.0.0.1:2379",
            "--advertise-client-urls=http://127.0.0.1:2379",
            "--listen-peer-urls=http://127.0.0.1:2380",
            "--initial-advertise-peer-urls=http://127.0.0.1:2380",
            "--initial-cluster=node=http://127.0.0.1:2380",
            "--listen-metrics-urls=http://127.0.0.1:2381",
            "--log-level=warn",
        ]
        .map(String::from);
        self.spawn("etcd", &args)?;
        let etcdctl = self.bin.join("etcdctl");
        let node = self.net.node_path();
        self.wait("etcd", |_| {
            let mut cmd = Command::new(&etcdctl);
            cmd.args(["--endpoints=http://127.0.0.1:2379", "endpoint", "health"]);
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
            exec_in_netns(&mut cmd, &node).is_ok() && cmd.status().is_ok_and(|s| s.success())
        })
    }

    fn start_apiserver(&mut self) -> Result<()> {
        let f = |name: &str| self.dir.join(name).display().to_string();
        let args = vec![
            "--etcd-servers=http://127.0.0.1:2379".to_owned(),
            format!("--advertise-address={NODE_V4}"),
            format!("--secure-port={API_PORT}"),
            format!("--cert-dir={}", f("apiserver-certs")),
            format!("--tls-cert-file={}", f(pki::SERVER_CERT)),
            format!("--tls-private-key-file={}", f(pki::SERVER_KEY)),
            format!("--client-ca-file={}", f(pki::CA)),
            format!("--kubelet-client-certificate={}", f(pki::KUBELET_CLIENT_CERT)),
            format!("--kubelet-client-key={}", f(pki::KUBELET_CLIENT_KEY)),
            format!("--kubelet-certificate-authority={}", f(pki::CA)),
            // The node's name resolves nowhere: reach the kubelet at its address, as kubeadm
            // configures it.
            "--kubelet-preferred-address-types=InternalIP".to_owned(),
            format!("--service-account-key-file={}", f(pki::SA_PUB)),
            format!("--service-account-signing-key-file={}", f(pki::SA_KEY)),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
            format!("--service-cluster-ip-range={SERVICE_RANGE}"),
            "--anonymous-auth=false".to_owned(),
            "--authorization-mode=Node,RBAC".to_owned(),
            "--enable-admission-plugins=NodeRestriction".to_owned(),
            "--allow-privileged=true".to_owned(),
            "--profiling=false".to_owned(),
            "--v=1".to_owned(),
        ];
        self.spawn("kube-apiserver", &args)?;
        self.wait("kube-apiserver", |cp| {
            cp.kubectl()
                .map(|mut c| {
                    c.args(["get", "--raw=/readyz"]).stdout(Stdio::null()).stderr(Stdio::null());
                    c.status().is_ok_and(|s| s.success())
                })
                .unwrap_or(false)
        })
    }

    /// What kubeadm grants the API server's kubelet client: the kubelet API (exec, logs,
    /// port-forward), through the bootstrap role made for it.
    fn let_apiserver_reach_kubelets(&self) -> Result<()> {
        let mut cmd = self.kubectl()?;
        cmd.args([
            "create",
            "clusterrolebinding",
            "kube-apiserver-kubelet-api-admin",
            "--clusterrole=system:kubelet-api-admin",
            "--user=kube-apiserver-kubelet-client",
        ]);
        let out = cmd.output().with_context(|| format!("starting {}", show(&cmd)))?;
        if !out.status.success() {
            bail!(
                "binding the API server's kubelet client: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// The controller manager, with every controller's own service account, as kubeadm runs
    /// it; ready once it has made the `default` service account of `kube-system`.
    fn start_controller_manager(&mut self) -> Result<()> {
        let f = |name: &str| self.dir.join(name).display().to_string();
        let kubeconfig = f("controller-manager.kubeconfig");
        let args = vec![
            format!("--kubeconfig={kubeconfig}"),
            format!("--authentication-kubeconfig={kubeconfig}"),
            format!("--authorization-kubeconfig={kubeconfig}"),
            "--bind-address=127.0.0.1".to_owned(),
            "--secure-port=10257".to_owned(),
            "--use-service-account-credentials=true".to_owned(),
            format!("--service-account-private-key-file={}", f(pki::SA_KEY)),
            format!("--root-ca-file={}", f(pki::CA)),
            format!("--cluster-signing-cert-file={}", f(pki::CA)),
            format!("--cluster-signing-key-file={}", f(pki::CA_KEY)),
            format!("--cert-dir={}", f("controller-manager-certs")),
            "--leader-elect=false".to_owned(),
            "--profiling=false".to_owned(),
            "--v=1".to_owned(),
        ];
        self.spawn("kube-controller-manager", &args)?;
        self.wait_for_default_account("kube-system")
    }

    /// The scheduler (DaemonSet pods are bound by it), ready once its health check answers.
    fn start_scheduler(&mut self) -> Result<()> {
        let kubeconfig =
            pki::kubeconfig(&self.dir, &self.server(), pki::SCHEDULER_CERT, pki::SCHEDULER_KEY)?;
        let path = self.dir.join("scheduler.kubeconfig");
        fs::write(&path, kubeconfig)?;
        let path = path.display().to_string();
        let args = vec![
            format!("--kubeconfig={path}"),
            format!("--authentication-kubeconfig={path}"),
            format!("--authorization-kubeconfig={path}"),
            "--bind-address=127.0.0.1".to_owned(),
            "--leader-elect=false".to_owned(),
            "--profiling=false".to_owned(),
            "--v=1".to_owned(),
        ];
        self.spawn("kube-scheduler", &args)?;
        let node = self.net.node_path();
        self.wait("kube-scheduler", |_| {
            crate::sys::in_netns(&node, || {
                Ok(std::net::TcpStream::connect(("127.0.0.1", 10259)).is_ok())
            })
            .unwrap_or(false)
        })
    }

    /// Wait until namespace `ns` has its `default` service account (the controller manager
    /// makes it), which a pod without one names.
    pub fn wait_for_default_account(&mut self, ns: &str) -> Result<()> {
        self.wait("kube-controller-manager", |cp| {
            cp.kubectl()
                .map(|mut c| {
                    c.args(["-n", ns, "get", "serviceaccount", "default"]);
                    c.stdout(Stdio::null()).stderr(Stdio::null());
                    c.status().is_ok_and(|s| s.success())
                })
                .unwrap_or(false)
        })
    }

    /// Where the components' logs are, for a failure's message.
    pub fn logs(&self) -> &Path {
        &self.dir
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // Only the processes this started, by pid: SIGTERM, then SIGKILL after a while.
        self.procs.terminate(Duration::from_secs(10));
        drop(std::mem::take(&mut self.procs));
        if std::env::var_os("MG_CLUSTER_KEEP_LOGS").is_none() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}
