//! The node: containerd and the kubelet as plain processes, in the node's network namespace
//! (beside the API server) and in a mount and a cgroup namespace of their own, so that
//! nothing of the node is seen by, or touches, the machine:
//!
//! - **cgroups**: a cgroup of its own in every hierarchy of the machine (this machine mixes
//!   cgroup v1 controllers with a cgroup2 hierarchy at `/sys/fs/cgroup/unified`), and a cgroup
//!   namespace rooted there. Inside, the node mounts the same hierarchies at the usual places,
//!   so the kubelet (cgroupfs driver) makes `/kubepods/…` at what is, on the machine,
//!   `<hierarchy>/mg-…-node/kubepods/…`. runc joins each container's cgroup in the cgroup2
//!   hierarchy too, at the same path (its hybrid mode), which is where the agent gates pods.
//! - **mounts**: a fresh sysfs (the node netns's view) with the node's own bpffs at
//!   `/sys/fs/bpf`, where the DaemonSet pins; tmpfs on `/run` (containerd's socket, the pods'
//!   network namespaces); `/var/lib` and `/var/log` from the run directory (images, the
//!   kubelet's pods, logs). Made shared inside, as a node's are, so that the agent's
//!   `HostToContainer` mounts see the node's mounts.
//! - **kernel settings**: the kubelet sets `vm.overcommit_memory`, `vm.panic_on_oom`,
//!   `kernel.panic`, `kernel.panic_on_oops` and two key limits unless they already hold its
//!   values. Inside the node's mount namespace each of those `/proc/sys` files is a file of
//!   the run directory holding the kubelet's value, so it finds nothing to change and the
//!   machine's settings are never written.
//!
//! On drop every process in the node's cgroups (containerd, the kubelet, the shims and the
//! containers, all started from here) is killed by pid, then the cgroups are removed; the
//! namespaces go with their last process.
use std::{
    fs,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{
    ControlPlane,
    control_plane::{NODE_IP, NODE_NAME},
    pki,
    procs::Procs,
    show,
};
use crate::sys::exec_in_netns;

/// The pod network's range on this node (the CNI bridge's), and its gateway, the node.
pub const POD_CIDR: &str = "10.244.0.0/24";
/// containerd's socket, inside the node's mount namespace.
const CONTAINERD_SOCK: &str = "/run/containerd/containerd.sock";
/// The sandbox image every pod starts with (containerd's `sandbox_image`), built here.
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10.1";
/// How long the kubelet may take to register a Ready node.
const READY: Duration = Duration::from_secs(120);

/// What the kubelet would write into the machine's kernel settings (its
/// `setupKernelTunables`), given to it as already set.
const KUBELET_SYSCTLS: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

/// One cgroup hierarchy of the machine: where it is mounted and how to mount it again.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hierarchy {
    mount: PathBuf,
    /// `cgroup2`, or the v1 hierarchy's options (`cpu`, `none,name=systemd`).
    kind: HierarchyKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum HierarchyKind {
    V1 { options: String },
    V2,
}

/// The machine's cgroup hierarchies, from a mountinfo text.
fn hierarchies(mountinfo: &str) -> Vec<Hierarchy> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let Some((pre, post)) = line.split_once(" - ") else { continue };
        let mut post = post.split_whitespace();
        let (fstype, _source, options) = (post.next(), post.next(), post.next().unwrap_or(""));
        let Some(mount) =
            pre.split_whitespace().nth(4).map(|m| PathBuf::from(m.replace("\\040", " ")))
        else {
            continue;
        };
        let kind = match fstype {
            Some("cgroup2") => HierarchyKind::V2,
            Some("cgroup") => {
                // The controllers and the name; not the mount flags (`rw`) nor `clone_children`.
                let opts: Vec<&str> = options
                    .split(',')
                    .filter(|o| {
                        !matches!(*o, "rw" | "ro" | "clone_children")
                            && !o.starts_with("release_agent")
                    })
                    .collect();
                HierarchyKind::V1 { options: opts.join(",") }
            }
            _ => continue,
        };
        if !out.iter().any(|h: &Hierarchy| h.mount == mount) {
            out.push(Hierarchy { mount, kind });
        }
    }
    out
}

/// The node's cgroup in every hierarchy; on drop, every process in them is killed and they
/// are removed.
struct Cgroups {
    name: String,
    hierarchies: Vec<Hierarchy>,
}

impl Cgroups {
    fn create(name: &str) -> Result<Cgroups> {
        let info = fs::read_to_string("/proc/self/mountinfo")?;
        let hierarchies = hierarchies(&info);
        if !hierarchies.iter().any(|h| h.kind == HierarchyKind::V2) {
            bail!("no cgroup2 hierarchy on this machine: the agent gates cgroup2 cgroups");
        }
        let me = Cgroups { name: name.to_owned(), hierarchies };
        for h in &me.hierarchies {
            let dir = h.mount.join(name);
            fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            // A new cpuset cgroup has no CPUs and no memory nodes until given its parent's.
            if matches!(&h.kind, HierarchyKind::V1 { options } if options.split(',').any(|o| o == "cpuset"))
            {
                for f in ["cpuset.cpus", "cpuset.mems"] {
                    let parent = fs::read_to_string(h.mount.join(f))?;
                    fs::write(dir.join(f), parent.trim())
                        .with_context(|| format!("writing {}", dir.join(f).display()))?;
                }
            }
        }
        Ok(me)
    }

    /// Each hierarchy's `cgroup.procs` of the node's cgroup, open for writing: a process that
    /// writes `0` to each joins the node.
    fn procs_files(&self) -> Result<Vec<fs::File>> {
        self.hierarchies
            .iter()
            .map(|h| {
                let p = h.mount.join(&self.name).join("cgroup.procs");
                fs::OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .with_context(|| format!("opening {}", p.display()))
            })
            .collect()
    }

    /// Make `cmd` join the node's cgroups before it executes.
    fn join(&self, cmd: &mut Command) -> Result<()> {
        let files = self.procs_files()?;
        // SAFETY: write(2) is async-signal-safe; the files stay open (owned by the closure).
        unsafe {
            cmd.pre_exec(move || {
                for f in &files {
                    if libc::write(f.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Every pid in the node's cgroup2 subtree (every process joins it: runc's hybrid mode).
    fn pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for h in self.hierarchies.iter().filter(|h| h.kind == HierarchyKind::V2) {
            let mut stack = vec![h.mount.join(&self.name)];
            while let Some(dir) = stack.pop() {
                if let Ok(text) = fs::read_to_string(dir.join("cgroup.procs")) {
                    pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
                }
                if let Ok(rd) = fs::read_dir(&dir) {
                    stack.extend(
                        rd.flatten()
                            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                            .map(|e| e.path()),
                    );
                }
            }
        }
        pids
    }

    /// Kill every process of the node, by pid, until none is left.
    fn kill_all(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let pids = self.pids();
            if pids.is_empty() || Instant::now() > deadline {
                return;
            }
            for pid in pids {
                // SAFETY: a pid in the node's own cgroup, so a process this harness started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        self.kill_all();
        for h in &self.hierarchies {
            crate::cgroups::remove_tree(&h.mount.join(&self.name));
        }
    }
}

/// The running node.
pub struct Node {
    /// containerd and the kubelet: stopped first.
    procs: Procs,
    /// The process that holds the node's mount and cgroup namespaces.
    holder: Child,
    /// Dropped after the processes: kills whatever is left (shims, containers).
    cgroups: Cgroups,
    dir: PathBuf,
}

impl Node {
    /// Start containerd and the kubelet beside `cp`, and wait until the node is Ready.
    pub fn start(cp: &ControlPlane) -> Result<Node> {
        let started = Instant::now();
        let dir = cp.dir.join("node");
        for d in ["var-lib", "var-log", "sysctl", "cni"] {
            fs::create_dir_all(dir.join(d))?;
        }
        let cgroups = Cgroups::create(&format!("{}-node", cp.net.node))?;
        let holder = start_holder(cp, &dir, &cgroups)?;
        let mut node = Node { procs: Procs::new(dir.clone()), holder, cgroups, dir };
        node.write_configs(cp)?;
        node.spawn(cp, "containerd", &["containerd", "--config", &node.path("containerd.toml")])?;
        let sock = node.in_ns(CONTAINERD_SOCK);
        node.wait("containerd", || sock.exists())?;
        let kubelet = cp.bin().join("kubelet").display().to_string();
        let args = [
            kubelet.as_str(),
            &format!("--config={}", node.path("kubelet.yaml")),
            &format!("--kubeconfig={}", node.path("kubelet.kubeconfig")),
            &format!("--hostname-override={NODE_NAME}"),
            &format!("--node-ip={NODE_IP}"),
            // A new node is held off from workloads until its agent has closed the gate
            // (deploy/README.md, New nodes).
            "--register-with-taints=metadata-gate.io/not-ready=:NoExecute",
            "--v=1",
        ];
        node.spawn(cp, "kubelet", &args)?;
        node.wait("kubelet", || node_ready(cp))?;
        eprintln!("cluster: node {NODE_NAME} Ready after {:.1} s", started.elapsed().as_secs_f64());
        Ok(node)
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// `path` of the node's mount namespace, as the machine reaches it.
    pub fn in_ns(&self, path: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{path}", self.holder.id()))
    }

    /// A command run inside the node: its mount, cgroup and network namespaces and its
    /// cgroups.
    pub fn command(&self, cp: &ControlPlane, argv: &[&str]) -> Result<Command> {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--target={}", self.holder.id())).args(["--mount", "--cgroup", "--"]);
        cmd.args(argv);
        exec_in_netns(&mut cmd, &cp.net.node_path())?;
        self.cgroups.join(&mut cmd)?;
        Ok(cmd)
    }

    /// `ctr` in the namespace the kubelet's images live in.
    pub fn ctr(&self, cp: &ControlPlane, args: &[&str]) -> Result<Command> {
        let mut argv = vec!["ctr", "--address", CONTAINERD_SOCK, "--namespace", "k8s.io"];
        argv.extend_from_slice(args);
        self.command(cp, &argv)
    }

    fn spawn(&mut self, cp: &ControlPlane, name: &'static str, argv: &[&str]) -> Result<()> {
        let cmd = self.command(cp, argv)?;
        self.procs.spawn(name, cmd)
    }

    fn wait(&mut self, name: &str, ready: impl FnMut() -> bool) -> Result<()> {
        self.procs.wait(name, READY, ready)
    }

    pub fn log_tail(&self, name: &str) -> String {
        self.procs.log_tail(name)
    }

    fn write_configs(&self, cp: &ControlPlane) -> Result<()> {
        let put = |name: &str, text: String| {
            fs::write(self.dir.join(name), text).with_context(|| format!("writing {name}"))
        };
        let cni = self.dir.join("cni");
        put(
            "containerd.toml",
            format!(
                r#"version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{CONTAINERD_SOCK}"
[plugins."io.containerd.internal.v1.opt"]
  path = "/var/lib/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # This machine withholds CAP_SYS_RESOURCE, which lowering a score needs: the kubelet's
  # scores (-998 for a sandbox, -997 for a Guaranteed pod) become containerd's own (0).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#,
                cni = cni.display()
            ),
        )?;
        // The pod network: a bridge on the node, which routes (and does not masquerade) the
        // pods' traffic; the fake metadata service routes the pod range back to the node.
        put(
            "cni/10-pods.conflist",
            serde_json::json!({
                "cniVersion": "1.0.0",
                "name": "pods",
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": "cni0",
                        "isGateway": true,
                        "ipMasq": false,
                        "hairpinMode": true,
                        "ipam": {
                            "type": "host-local",
                            "ranges": [[{"subnet": POD_CIDR}]],
                            "routes": [{"dst": "0.0.0.0/0"}],
                        },
                    },
                    {"type": "portmap", "capabilities": {"portMappings": true}},
                ],
            })
            .to_string(),
        )?;
        let f = |name: &str| cp.dir.join(name).display().to_string();
        put(
            "kubelet.yaml",
            format!(
                r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: "{ca}"}}
authorization: {{mode: Webhook}}
cgroupDriver: cgroupfs
containerRuntimeEndpoint: "unix://{CONTAINERD_SOCK}"
tlsCertFile: "{cert}"
tlsPrivateKeyFile: "{key}"
healthzBindAddress: 127.0.0.1
failSwapOn: false
protectKernelDefaults: false
resolvConf: ""
# The images are imported, never pulled: nothing may collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}}
serializeImagePulls: false
"#,
                ca = f(pki::CA),
                cert = f(pki::NODE_SERVING_CERT),
                key = f(pki::NODE_SERVING_KEY),
            ),
        )?;
        put(
            "kubelet.kubeconfig",
            pki::kubeconfig(&cp.dir, &cp.server(), pki::NODE_CERT, pki::NODE_KEY)?,
        )?;
        Ok(())
    }

    /// Write `image` and import it into the kubelet's containerd namespace.
    pub fn import(
        &self,
        cp: &ControlPlane,
        image: &super::images::Image,
    ) -> Result<super::images::Imported> {
        let file = self.dir.join("images");
        fs::create_dir_all(&file)?;
        let file = file.join(format!("{}.tar", image.name.replace(['/', ':'], "_")));
        let digest = image.write(&file)?;
        let mut cmd = self.ctr(cp, &["images", "import", &file.display().to_string()])?;
        let out = cmd.output().with_context(|| format!("starting {}", show(&cmd)))?;
        if !out.status.success() {
            bail!("importing {}: {}", image.name, String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(super::images::Imported { name: image.name.clone(), digest })
    }

    /// Where the node's logs are.
    pub fn logs(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.procs.terminate(Duration::from_secs(5));
        // The holder, the shims and the containers (and anything the TERM left): by pid.
        self.cgroups.kill_all();
        drop(std::mem::take(&mut self.procs));
        let _ = self.holder.wait();
    }
}

/// Whether the kubelet has registered the node and reports it Ready.
fn node_ready(cp: &ControlPlane) -> bool {
    let Ok(mut cmd) = cp.kubectl() else { return false };
    cmd.args([
        "get",
        "node",
        NODE_NAME,
        "-o",
        "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
    ]);
    cmd.stderr(Stdio::null());
    cmd.output().is_ok_and(|o| o.stdout == b"True")
}

/// Start the process that makes and holds the node's mount and cgroup namespaces, in the
/// node's cgroups and network namespace; wait until its mounts are made.
fn start_holder(cp: &ControlPlane, dir: &Path, cgroups: &Cgroups) -> Result<Child> {
    let mut script = String::from("set -e\n");
    let mut line = |l: String| {
        script.push_str(&l);
        script.push('\n');
    };
    // sysfs of the node's network namespace, then what the node mounts under it.
    line("mount -t sysfs sysfs /sys".into());
    line("mount -t securityfs securityfs /sys/kernel/security".into());
    line("mount -t bpf bpf /sys/fs/bpf".into());
    line("mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup".into());
    for h in &cgroups.hierarchies {
        let name =
            h.mount.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let target = format!("/sys/fs/cgroup/{name}");
        line(format!("mkdir -p {target}"));
        line(match &h.kind {
            HierarchyKind::V2 => format!("mount -t cgroup2 cgroup2 {target}"),
            HierarchyKind::V1 { options } => {
                format!("mount -t cgroup -o {options} cgroup {target}")
            }
        });
    }
    line("mount -t tmpfs -o mode=755 run /run".into());
    line(format!("mount --bind {} /var/lib", dir.join("var-lib").display()));
    line(format!("mount --bind {} /var/log", dir.join("var-log").display()));
    for (name, value) in KUBELET_SYSCTLS {
        let file = dir.join("sysctl").join(name.replace('/', "."));
        fs::write(&file, format!("{value}\n"))?;
        line(format!("mount --bind {} /proc/sys/{name}", file.display()));
    }
    line("mount --make-rshared /".into());
    let ready = dir.join("holder.ready");
    line(format!("touch {}", ready.display()));
    line("exec sleep infinity".into());
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--cgroup", "--propagation", "private", "--", "sh", "-c", &script]);
    let log = fs::File::create(dir.join("holder.log"))?;
    cmd.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
    exec_in_netns(&mut cmd, &cp.net.node_path())?;
    cgroups.join(&mut cmd)?;
    let mut child = cmd.spawn().context("starting the node's namespaces (unshare)")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready.exists() {
        if let Some(status) = child.try_wait()? {
            let log = fs::read_to_string(dir.join("holder.log")).unwrap_or_default();
            bail!("making the node's namespaces failed ({status}):\n{log}");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("making the node's namespaces took too long");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hierarchies_are_read_as_they_are_mounted_again() {
        let info = "\
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
32 30 0:28 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
33 30 0:29 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
34 30 0:30 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset,clone_children
";
        let got = hierarchies(info);
        let v1 = |m: &str, o: &str| Hierarchy {
            mount: m.into(),
            kind: HierarchyKind::V1 { options: o.into() },
        };
        assert_eq!(
            got,
            [
                v1("/sys/fs/cgroup/cpu", "cpu"),
                v1("/sys/fs/cgroup/systemd", "xattr,name=systemd"),
                Hierarchy { mount: "/sys/fs/cgroup/unified".into(), kind: HierarchyKind::V2 },
                v1("/sys/fs/cgroup/cpuset", "cpuset"),
            ]
        );
    }
}
