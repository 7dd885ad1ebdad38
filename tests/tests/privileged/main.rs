//! Privileged kernel tests: real sockets in real network namespaces and cgroups, against the
//! real gate-agent binary. Root only; run with `--test-threads=1` (`cargo xtask test` does):
//! every test loads programs into the kernel.
//!
//! Every denial (or refusal by the proxy) is paired with proof that the token never reached
//! the fake metadata service, and with a positive control where one makes sense, so no test
//! passes vacuously.
//!
//! One binary, one module per area (test names carry it: `tc::…`, `lifecycle::…`):
//!
//! | module | what |
//! |---|---|
//! | [`enforcement`] | connect, UDP, raw, IPv4-mapped, IPv6 extension headers, neighbouring addresses, nested cgroups, audit mode, denial events, a bad policy |
//! | [`terminate`] | connections established before the gate |
//! | [`tc`] | AF_PACKET frames, a forwarding workload interface, the clsact fallback |
//! | [`lifecycle`] | kill and adopt, upgrade, policy file edits, log rate limits, cleanup, ABI hand-over |
//! | [`resilience`] | one agent per gate, repairs, a recreated root, retried applies, policy flips under load |
//! | [`progrun`] | the packet programs run by BPF_PROG_TEST_RUN on hand-built packets: parser and verdict edges (truncated headers, IPv4 options, IPv6 chains, fragments, VLAN tags), gated vs allowed callers |
//! | [`proxy`] | the metadata proxy: served paths, refused paths, connections without a record, its port, the proxy down; the clouds' Python SDKs through it (`proxy::sdk`) |
//! | [`inspect`] | audit → report → suggest → enforce, `explain` against the live maps |
//! | [`cluster`] | cluster mode against a Kubernetes API double |
//! | [`bypass`] | every way around the gate (frames, rewrites, forwarding, VLAN tags, fragments, IPv6 chains, qdisc bypass, AF_XDP, a VM's tap), each without an agent, standalone and in cluster mode |
use std::{path::PathBuf, process::Output, time::Duration};

use integration_tests::{
    agent::{Agent, metric},
    bins::Bins,
    cgroups::CgroupTree,
    imds::{FakeImds, INSTANCE_ID},
    net::TestNet,
    probe::{self, Held, Outcome, token},
    sys::kernel_has_tcx,
};

/// Gate for a privileged test: returns early (skips) when it cannot run here, and fails under
/// CI=true instead.
macro_rules! privileged {
    ($name:ident) => {
        if !integration_tests::sys::require_privileges(stringify!($name)) {
            return;
        }
    };
}

mod bypass;
mod cluster;
mod enforcement;
mod inspect;
mod lifecycle;
mod progrun;
mod proxy;
mod resilience;
mod tc;
mod terminate;

const EPERM: i32 = 1;

/// The allowed `cloud-agent` also has the capture grant: `raw_socket_never_reaches_the_service`
/// has it talk to the service over a raw TCP socket, which reads the node's TCP traffic.
fn policy(mode: &str) -> String {
    format!(
        r#"platform: AWS
mode: {mode}
endpoints:
  - {{name: ec2-imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}}
  - {{name: ec2-imds-udp-test, cidr: 169.254.169.254/32, ports: [80], protocols: [UDP]}}
  - {{name: ec2-imds-v6, cidr: "fd00:ec2::254/128", ports: [80]}}
allow:
  - {{name: cloud-agent, cgroup: "cloud-agent", grants: [metadata, capture]}}
"#
    )
}

/// One test's world. Field order is drop order: the agent goes first.
struct Env {
    agent: Option<Agent>,
    imds: FakeImds,
    net: TestNet,
    cg: CgroupTree,
    policy_file: PathBuf,
    /// The binaries of this build (`cargo xtask test` names them in the environment).
    bins: Bins,
}

impl Env {
    /// Network, fake IMDS, cgroups `gated/{pod-a,cloud-agent/nested}` and `outside`; no agent.
    fn new(mode: &str) -> Env {
        let net = TestNet::new().expect("test network");
        let imds = FakeImds::start(&net).expect("fake IMDS");
        let cg = CgroupTree::new().expect("cgroup tree");
        for c in ["gated/pod-a", "gated/cloud-agent/nested"] {
            cg.create(c).expect("cgroup");
        }
        let policy_file = cg_policy_path(&cg);
        std::fs::write(&policy_file, policy(mode)).expect("policy file");
        Env { agent: None, imds, net, cg, policy_file, bins: Bins::from_env() }
    }

    fn with_agent(mode: &str) -> Env {
        let mut env = Env::new(mode);
        env.start_agent();
        env
    }

    fn start_agent(&mut self) {
        self.start_agent_with(&[]);
    }

    /// Start the agent on the env's policy and gated root, with extra `run` arguments.
    fn start_agent_with(&mut self, extra: &[&str]) {
        let netns = self.net.node_path();
        let agent =
            Agent::start_with(&self.bins, &netns, &self.policy_file, &self.cg.gated(), extra);
        self.agent = Some(agent.expect("agent ready"));
    }

    fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("agent started")
    }

    fn cgroup(&self, rel: &str) -> PathBuf {
        self.cg.base.join(rel)
    }

    fn probe(&self, cgroup: &str, args: &[&str]) -> Outcome {
        probe::run(&self.bins, &self.net, &self.cgroup(cgroup), args).expect("probe ran")
    }

    /// A probe in `cgroup` (relative to the tree's base) holding a connection (`hold-tcp`, …).
    fn hold(&self, cgroup: &str, args: &[&str]) -> anyhow::Result<Held> {
        Held::start(&self.bins, &self.net, &self.cgroup(cgroup), args)
    }

    /// `cmd` to addr:port from `cgroup` is denied with EPERM at `stage`, at once, and the
    /// token never reaches the service.
    fn assert_refused(&self, cgroup: &str, cmd: &str, addr: &str, port: &str, stage: &str) {
        let t = token(cmd);
        let o = self.probe(cgroup, &[cmd, addr, port, &t]);
        assert!(!o.ok, "{cmd} {addr}:{port} from {cgroup} got through: {o:?}");
        assert_eq!(o.errno, Some(EPERM), "{cmd} {addr}:{port} from {cgroup}: {o:?}");
        assert_eq!(o.stage, stage, "{cmd} {addr}:{port} from {cgroup}: {o:?}");
        // EPERM comes from the hook itself; a drop would surface as a timeout after seconds.
        // This tells the two apart; it is not a speed assertion.
        assert!(o.elapsed_us < 500_000, "denial took {} us: {o:?}", o.elapsed_us);
        assert!(!self.imds.wait_for(&t, Duration::from_millis(300)), "token {t} reached the IMDS");
    }

    /// `cmd` from `cgroup` is served and the token reaches the service.
    fn assert_served(&self, cgroup: &str, cmd: &str, addr: &str, port: &str) {
        let t = token(cmd);
        let o = self.probe(cgroup, &[cmd, addr, port, &t]);
        assert!(o.ok, "{cmd} {addr}:{port} from {cgroup} was not served: {o:?}");
        assert!(self.imds.wait_for(&t, Duration::from_secs(2)), "token {t} never reached the IMDS");
        if cmd == "tcp" {
            assert!(o.reply.as_deref().is_some_and(|r| r.contains(INSTANCE_ID)), "{o:?}");
        }
    }

    /// `gate-agent <args>` of this build, run to completion (at most `timeout`).
    fn gate_agent(&self, args: &[&str], timeout: Duration) -> anyhow::Result<Output> {
        integration_tests::agent::run_to_end(&self.bins.agent, &self.net.node_path(), args, timeout)
    }

    /// Rewrite the policy file the way editors and ConfigMap volumes do: write aside, rename
    /// over.
    fn replace_policy(&self, text: &str) {
        let tmp = self.policy_file.with_extension("tmp");
        std::fs::write(&tmp, text).expect("write policy");
        std::fs::rename(&tmp, &self.policy_file).expect("rename policy");
    }

    /// `gate-agent report --json` on the running agent's gate and `state` dir: its records.
    fn report(&self, state: &str) -> Vec<serde_json::Value> {
        let pin = self.agent().pin_dir.to_string_lossy().into_owned();
        let out = self
            .gate_agent(
                &["report", "--json", "--pin-dir", &pin, "--state-dir", state],
                Duration::from_secs(10),
            )
            .expect("report");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
        v.as_array().cloned().unwrap_or_else(|| panic!("not a list: {v}"))
    }

    /// `gate-agent suggest` on the running agent's gate and `state` dir.
    fn suggest(&self, state: &str) -> String {
        let pin = self.agent().pin_dir.to_string_lossy().into_owned();
        let out = self
            .gate_agent(
                &["suggest", "--pin-dir", &pin, "--state-dir", state],
                Duration::from_secs(10),
            )
            .expect("suggest");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Review done: paste `suggested` under `allow:` of the enforce policy, have `check` take
    /// it (a copy in `dir`), and apply it; the policy applied.
    fn enforce_suggested(&self, suggested: &str, dir: &std::path::Path) -> String {
        let indented: String = suggested.lines().map(|l| format!("  {l}\n")).collect();
        let enforced = policy("enforce").replace("allow:\n", &format!("allow:\n{indented}"));
        let file = dir.join("enforced.yaml");
        std::fs::write(&file, &enforced).expect("write");
        let out = self
            .gate_agent(&["check", &file.to_string_lossy()], Duration::from_secs(10))
            .expect("check");
        assert!(out.status.success(), "{}\n{enforced}", String::from_utf8_lossy(&out.stderr));
        self.replace_policy(&enforced);
        self.agent()
            .wait_log(|v| v["message"] == "policy applied", Duration::from_secs(5))
            .expect("applied");
        enforced
    }

    /// `gate-agent cleanup --pin-dir <pin>`: detach and unpin the gate.
    fn cleanup(&self, pin: &str) -> Output {
        self.gate_agent(&["cleanup", "--pin-dir", pin], Duration::from_secs(10)).expect("cleanup")
    }
}

/// A directory removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    /// A new empty one, uniquely named after `name`.
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(integration_tests::sys::unique(name));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn cg_policy_path(cg: &CgroupTree) -> PathBuf {
    let name = cg.base.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    std::env::temp_dir().join(format!("{name}-policy.yaml"))
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.policy_file);
    }
}

/// `gate-agent status --json` of the env's agent.
fn status(env: &Env) -> serde_json::Value {
    let (code, v) = env.agent().status().expect("status runs");
    assert_eq!(code, 0, "status exit code with a gate installed: {v}");
    v
}

/// `st` (`status --json`) shows a tc program on `dir` (`egress`, `ingress`) of `iface`: a
/// tcx link (`tc-<dir>-<iface>`) on 6.6+, a clsact filter before (`--tc-mode auto`, as
/// documented; listed as `<dir> <iface>`, followed by the netns when it is not the agent's own).
fn assert_tc(st: &serde_json::Value, dir: &str, iface: &str) {
    let list = |key: &str| st[key].as_array().cloned().unwrap_or_default();
    if kernel_has_tcx() {
        let hook = format!("tc-{dir}-{iface}");
        let linked = list("attachments").iter().any(|x| x["attach_point"] == hook.as_str());
        assert!(linked, "tcx link on {iface}: {st}");
    } else {
        let filter = format!("{dir} {iface}");
        let listed = list("tc_clsact").iter().filter_map(|x| x.as_str()).any(|x| {
            x == filter || x.strip_prefix(filter.as_str()).is_some_and(|r| r.starts_with(' '))
        });
        assert!(listed, "clsact filter on {iface} (no tcx before 6.6): {st}");
    }
}
