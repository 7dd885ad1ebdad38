//! Every way around the gate that a workload with CAP_NET_RAW or CAP_NET_ADMIN in its own
//! namespace, or a VM, has: each case runs three times in one topology — without an agent
//! (where it MUST reach the fake metadata service: the path is real), with the agent in
//! standalone mode on its defaults, and with the agent in cluster mode on the shipped
//! DaemonSet's `run` arguments — and every hand-built packet goes twice: to the metadata
//! service, and to its unprotected neighbour (169.254.169.253, fd00:ec2::253), which must be
//! reached whatever the gate, so a denial is never a broken path.
//!
//! The topology: `imds` (the fake service), `node` (forwarding, masquerading pod traffic;
//! the agent runs here, as a host-network DaemonSet pod does), `pod` behind the node's
//! `vpod`, and, where a case needs them, a VM's tap on the node, a forwarding loop inside
//! the pod, a bridge holding the node's address. Workloads: the pod-network pod `web`, the
//! host-network pod `rogue` (gated, no allow entry), the allowed host-network pod `ccm`, and
//! a host process outside the gated root.
use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    time::{Duration, Instant},
};

use integration_tests::{
    agent::Agent,
    frame::{self, ETH_P_8021AD, ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6, Mac},
    imds::INSTANCE_ID,
    kubeapi::{self, CONFIGMAPS},
    net::{
        DNS_V4, DNS_V6, IMDS_V4, IMDS_V6, NODE_V4, POD_IFACE, POD_V4, POD_V6, PodNet,
        bridge_uplink, ip, mac, nft,
    },
    probe::{Held, Outcome, run_in, token},
    sys,
    tap::{TAP_IFACE, TUN_IFACE, TUN_PEER_V4, Tap, TunLink, VM_V4},
};

use super::{
    EPERM,
    cluster::{self, Cluster, NS},
    metric,
};

mod boot;

/// The IDS: a gated host-network pod whose allow entry grants capture only.
const IDS_UID: &str = "0b6c0f5e-4444-4a2b-9c3d-000000000004";
const IDS_ENTRY: &str = "  - {name: ids, namespace: ids, podSelector: {matchLabels: {app: suricata}}, grants: [capture]}\n";

/// What the policy protects, in both modes: port 80 of the metadata addresses, any protocol.
const ENDPOINTS: &str = r#"  - {name: ec2-imds, cidr: 169.254.169.254/32, ports: [80]}
  - {name: ec2-imds-v6, cidr: "fd00:ec2::254/128", ports: [80]}
"#;

/// The shipped DaemonSet, whose `run` arguments the cluster-mode agent gets.
const DAEMONSET: &str = include_str!("../../../deploy/base/daemonset.yaml");

/// Which gate is in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    None,
    Standalone,
    Cluster,
    /// The boot step's gate, before any agent runs (`boot` module).
    Boot,
}

const GATES: [Gate; 3] = [Gate::None, Gate::Standalone, Gate::Cluster];

/// Where a hand-built packet goes.
#[derive(Clone, Copy, Debug)]
enum To {
    /// The metadata service (169.254.169.254, fd00:ec2::254).
    Imds,
    /// Its unprotected neighbour (169.254.169.253, fd00:ec2::253).
    Neighbour,
}

impl To {
    fn v4(self) -> Ipv4Addr {
        let a = match self {
            To::Imds => IMDS_V4,
            To::Neighbour => DNS_V4,
        };
        a.parse().expect("IPv4 address")
    }

    fn v6(self) -> Ipv6Addr {
        let a = match self {
            To::Imds => IMDS_V6,
            To::Neighbour => DNS_V6,
        };
        a.parse().expect("IPv6 address")
    }
}

fn v4(s: &str) -> Ipv4Addr {
    s.parse().expect("IPv4 address")
}

/// A UDP datagram to port 80 of `to`, from `src`, carrying the token `t`.
fn udp80(src: &str, to: To, t: &str) -> Vec<u8> {
    frame::udp4(v4(src), to.v4(), 80, t.as_bytes())
}

/// An Ethernet frame carrying the IP packet `ip`, to `dst`.
fn eth(dst: Mac, ip: &[u8]) -> Vec<u8> {
    frame::ethernet(dst, frame::SRC_MAC, &[], frame::ethertype_of(ip), ip)
}

/// The `run` arguments of the shipped DaemonSet, less those the harness owns (`run` itself,
/// the pin dir, the listen addresses and the log format, which every agent under test gets:
/// /metrics is read on the harness's --listen) and the state dir (the node's
/// `/var/lib/metadata-gate`: an agent under test never writes outside its test's own files).
fn daemonset_run_args() -> Vec<String> {
    let mut args = Vec::new();
    for l in DAEMONSET.lines().skip_while(|l| l.trim() != "args:").skip(1) {
        let l = l.trim();
        if l.starts_with('#') {
            continue;
        }
        let Some(a) = l.strip_prefix("- ") else { break };
        args.push(a.trim().to_owned());
    }
    assert_eq!(args.first().map(String::as_str), Some("run"), "DaemonSet args: {args:?}");
    let mut rest = Vec::new();
    let mut it = args.into_iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--pin-dir" | "--listen" | "--metrics-listen" | "--state-dir" => drop(it.next()),
            "--log-format" => assert_eq!(it.next().as_deref(), Some("json")),
            _ => rest.push(a),
        }
    }
    rest
}

/// One way of sending, named: it sends a packet carrying the token to the given target.
type Attempt<'a> = (&'a str, &'a dyn Fn(&str, To));

/// One case's topology and workloads. Field order is drop order: agents first.
struct World {
    second: Option<Agent>,
    tap: Option<Tap>,
    tun: Option<TunLink>,
    c: Cluster,
    pod: PodNet,
    /// The gated host-network pod's cgroup (relative to the tree's base).
    rogue: String,
    /// The IDS's cgroup: allowed to capture, not to reach the metadata service.
    ids: String,
    /// The node's and the pod's network namespaces (paths).
    node: String,
    pod_ns: String,
    /// The MAC of the imds side of the uplink veth, and of the pod's gateway (the node's
    /// end of its veth).
    imds_mac: Mac,
    gw: Mac,
    files: Vec<PathBuf>,
}

impl World {
    fn new() -> World {
        let c = cluster::cluster();
        let rogue = c.rogue();
        let ids = c.host_network_pod(
            "ids",
            "suricata",
            IDS_UID,
            serde_json::json!({"app": "suricata"}),
            4,
        );
        let policy = cluster::policy_with(ENDPOINTS) + IDS_ENTRY;
        c.api.put(CONFIGMAPS, kubeapi::configmap(NS, "metadata-gate-policy-aws", &policy));
        // Standalone: the same endpoints, the CCM pod's cgroup allowed, the IDS's capture.
        let pod_of = |container: &str| {
            std::path::Path::new(container)
                .parent()
                .and_then(|p| p.strip_prefix("kubepods.slice").ok())
                .expect("pod cgroup")
                .to_string_lossy()
                .into_owned()
        };
        let (ccm_pod, ids_pod) = (pod_of(&c.ccm), pod_of(&ids));
        let standalone = format!(
            "platform: AWS\nmode: enforce\nendpoints:\n{ENDPOINTS}allow:\n  - {{name: ccm, cgroup: \"{ccm_pod}\"}}\n  - {{name: ids, cgroup: \"{ids_pod}\", grants: [capture]}}\n"
        );
        std::fs::write(&c.env.policy_file, standalone).expect("policy file");
        let pod = PodNet::new(&c.env.net).expect("pod netns");
        let (node, pod_ns) = (c.env.net.node_path(), pod.path());
        let imds_mac = mac(&c.env.net.imds, "vimds").expect("vimds MAC");
        let gw = mac(&c.env.net.node, POD_IFACE).expect("vpod MAC");
        World {
            second: None,
            tap: None,
            tun: None,
            c,
            pod,
            rogue,
            ids,
            node,
            pod_ns,
            imds_mac,
            gw,
            files: vec![],
        }
    }

    /// Put `gate` in place: stop (and clean up after) the agent running, start the next.
    fn gate(&mut self, gate: Gate) {
        self.c.env.agent = None;
        match gate {
            Gate::None => {}
            Gate::Standalone => {
                let env = &self.c.env;
                let root = self.c.kubepods();
                let agent = Agent::start(&env.bins, &self.node, &env.policy_file, &root);
                self.c.env.agent = Some(agent.expect("standalone agent ready"));
            }
            Gate::Cluster => {
                let args = daemonset_run_args();
                self.c.start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
            }
            Gate::Boot => unreachable!("the boot module puts the boot step's gate in place"),
        }
    }

    /// Run `case` without a gate, then under each mode of the agent.
    fn each(&mut self, case: impl Fn(&World, Gate)) {
        for g in GATES {
            self.gate(g);
            case(self, g);
        }
        self.gate(Gate::None);
    }

    /// `probe ARGS` in the test netns at `netns` and the cgroup `cgroup` (relative to the
    /// tree's base).
    fn probe(&self, netns: &str, cgroup: &str, args: &[&str]) -> Outcome {
        run_in(&self.c.env.bins, netns, &self.c.env.cgroup(cgroup), args).expect("probe ran")
    }

    /// Send `frames` on an AF_PACKET socket of `cgroup` in `netns`, bound to `iface`, with
    /// `sll_protocol` `proto`.
    fn frames(&self, netns: &str, cgroup: &str, iface: &str, proto: u16, frames: &[Vec<u8>]) {
        let hex: Vec<String> = frames.iter().map(|f| frame::to_hex(f)).collect();
        let o =
            self.probe(netns, cgroup, &["frame", iface, &format!("{proto:04x}"), &hex.join(",")]);
        // A frame dropped on the way out (tc egress) tells its sender ENOBUFS.
        let dropped = o.stage == "send" && o.errno == Some(libc::ENOBUFS);
        assert!(o.ok || dropped, "AF_PACKET send from {cgroup} on {iface}: {o:?}");
    }

    /// The running agent's tcx link on `dir` (`egress`, `ingress`) of the node's interface
    /// `iface`, as `status` lists it: (link id, program). `None` without an agent or link.
    fn tc_link(&self, dir: &str, iface: &str) -> Option<(u64, String)> {
        let (_, st) = self.c.env.agent.as_ref()?.status().expect("status");
        let shown = ip(&self.c.env.net.node, &format!("-o link show dev {iface}")).ok()?;
        let idx: u64 = shown.split(':').next()?.trim().parse().ok()?;
        st["attachments"].as_array()?.iter().find_map(|a| {
            let ours = a["attach_point"].as_str()?.starts_with(&format!("tc-{dir}-"));
            let program = a["program"].as_str()?.to_owned();
            (ours && a["target_id"] == idx).then(|| Some((a["link_id"].as_u64()?, program)))?
        })
    }

    /// Whether the running agent's setsockopt program consults the allow set: on kernels that
    /// offer cgroup/setsockopt no ancestor helper (5.10) the agent loads
    /// `gate_sockopt_noallow`, which denies the side doors to every gated cgroup.
    fn sockopt_consults_allow(&self) -> bool {
        let Some(agent) = &self.c.env.agent else { return true };
        let (_, st) = agent.status().expect("status");
        let program = st["attachments"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["attach_point"] == "setsockopt"))
            .map(|x| x["program"].as_str().unwrap_or_default().to_owned());
        match program.as_deref() {
            Some("gate_setsockopt") => true,
            Some("gate_sockopt_noallow") => false,
            other => panic!("setsockopt program in status: {other:?}: {st}"),
        }
    }

    /// Whether the running agent's LSM programs enforce (None without an agent), checked
    /// against what status and /metrics say: where the kernel runs no BPF LSM, both must say
    /// so, and the doors only they close are open (the documented limit).
    fn lsm_enforcing(&self) -> Option<bool> {
        let agent = self.c.env.agent.as_ref()?;
        let (_, st) = agent.status().expect("status");
        let lsm = st["lsm"].as_str().unwrap_or_default().to_owned();
        let (_, body) = agent.http_get("/metrics").expect("metrics");
        let gauge = super::metric(&body, "metadata_gate_lsm_enforcing");
        let how = integration_tests::sys::lsm_mechanism(&lsm);
        let enforcing = how != "open";
        assert!(enforcing || lsm.starts_with("open: "), "status lsm: {lsm:?}");
        assert_eq!(gauge, Some(f64::from(u8::from(enforcing))), "gauge against status {lsm:?}");
        let why: Vec<String> =
            agent.logs().into_iter().filter(|l| l.contains("LSM programs")).collect();
        eprintln!("bypass: LSM programs on this kernel: {lsm}; agent: {why:?}");
        if let Some(want) = integration_tests::sys::expected_lsm() {
            assert_eq!(how, want, "how this kernel must run the LSM programs: status {lsm:?}");
        }
        Some(enforcing)
    }

    /// Denials so far, by hook, from the running agent's /metrics (empty without an agent).
    fn denials(&self) -> BTreeMap<String, f64> {
        let Some(agent) = &self.c.env.agent else { return BTreeMap::new() };
        let (_, body) = agent.http_get("/metrics").expect("metrics");
        body.lines()
            .filter(|l| {
                l.starts_with("metadata_gate_decisions_total{") && l.contains("verdict=\"denied\"")
            })
            .filter_map(|l| {
                let hook = l.split("hook=\"").nth(1)?.split('"').next()?.to_owned();
                Some((hook, l.rsplit(' ').next()?.parse().ok()?))
            })
            .collect()
    }

    /// Send each attempt twice, to the metadata service and to its neighbour, each with its
    /// own token, and check: the neighbour is reached whatever the gate (unless
    /// `neighbour_passes` is false: frames the gate cannot read are denied whatever their
    /// address); the metadata service is reached without a gate; with one it never is, and
    /// the agent counted at least one denial per attempt.
    fn attempts(&self, gate: Gate, neighbour_passes: bool, list: &[Attempt<'_>]) {
        let imds = &self.c.env.imds;
        let before = self.denials();
        let mut sent = Vec::new();
        for (what, send) in list {
            let (ti, tn) = (token("bypass"), token("neighbour"));
            send(&ti, To::Imds);
            send(&tn, To::Neighbour);
            sent.push((*what, ti, tn));
        }
        if gate == Gate::None || neighbour_passes {
            for (what, _, tn) in &sent {
                let arrived = imds.wait_for(tn, Duration::from_secs(3));
                assert!(arrived, "{what} to the unprotected neighbour under {gate:?}: lost");
            }
        }
        if gate == Gate::None {
            for (what, ti, _) in &sent {
                assert!(
                    imds.wait_for(ti, Duration::from_secs(3)),
                    "{what}: without a gate it never reached the metadata service: the path is not real"
                );
                eprintln!("bypass: {what}: no gate: reached the metadata service");
            }
            return;
        }
        let deadline = Instant::now() + Duration::from_millis(500);
        for (what, ti, tn) in &sent {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !imds.wait_for(ti, left),
                "{what} under {gate:?}: reached the metadata service"
            );
            if !neighbour_passes {
                assert!(!imds.saw(tn), "{what} under {gate:?}: an unreadable frame passed");
            }
        }
        // The boot step leaves no agent to count denials.
        if gate == Gate::Boot {
            for (what, _, _) in &sent {
                eprintln!("bypass: {what}: {gate:?}: denied");
            }
            return;
        }
        let after = self.denials();
        let delta: BTreeMap<&String, f64> = after
            .iter()
            .map(|(h, n)| (h, n - before.get(h).copied().unwrap_or(0.0)))
            .filter(|(_, d)| *d > 0.0)
            .collect();
        let total: f64 = delta.values().sum();
        assert!(
            total >= sent.len() as f64,
            "under {gate:?}: {} attempts never arrived, but the agent counted {total} denials ({delta:?})",
            sent.len()
        );
        for (what, _, _) in &sent {
            eprintln!("bypass: {what}: {gate:?}: denied; denials of the batch by hook {delta:?}");
        }
    }

    /// A file removed with the world.
    fn file(&mut self, name: &str, text: &str) -> PathBuf {
        let base = self.c.env.cg.base.file_name().map(|n| n.to_string_lossy().into_owned());
        let path = std::env::temp_dir().join(format!("{}-{name}", base.unwrap_or_default()));
        std::fs::write(&path, text).expect("write file");
        self.files.push(path.clone());
        path
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// Case 1: the pod (NET_ADMIN in its own netns) connects to a decoy, which the socket hooks
/// let through, and an nftables netdev egress chain on its eth0 rewrites the destination to
/// the metadata service after them (and the source back on the way in).
#[test]
fn pod_rewriting_a_decoy_after_the_socket_hooks_is_denied() {
    privileged!(pod_rewriting_a_decoy_after_the_socket_hooks_is_denied);
    let mut w = World::new();
    nft(
        &w.pod.name,
        &format!(
            "table netdev mg_rewrite {{
                chain out {{
                    type filter hook egress device \"eth0\" priority 0; policy accept;
                    ip daddr 10.99.9.9 tcp dport 80 ip daddr set {IMDS_V4}
                    ip daddr 10.99.9.8 tcp dport 80 ip daddr set {DNS_V4}
                }}
                chain in {{
                    type filter hook ingress device \"eth0\" priority 0; policy accept;
                    ip saddr {IMDS_V4} tcp sport 80 ip saddr set 10.99.9.9
                    ip saddr {DNS_V4} tcp sport 80 ip saddr set 10.99.9.8
                }}
            }}"
        ),
    )
    .expect("nft netdev rewrite in the pod");
    w.each(|w, gate| {
        let connect = |t: &str, to: To| {
            let decoy = match to {
                To::Imds => "10.99.9.9",
                To::Neighbour => "10.99.9.8",
            };
            let o = w.probe(&w.pod_ns, &w.c.web, &["tcp", decoy, "80", t]);
            if gate == Gate::None || matches!(to, To::Neighbour) {
                let reply = o.reply.as_deref().unwrap_or_default();
                assert!(reply.starts_with("HTTP/1.0 200") && reply.contains(INSTANCE_ID), "{o:?}");
            } else {
                assert!(!o.ok, "{o:?}");
            }
        };
        w.attempts(gate, true, &[("pod: TCP to a decoy rewritten by nft netdev egress", &connect)]);
    });
}

/// Case 2: the pod sends hand-built frames (UDP, and a TCP SYN with the token as payload)
/// on an AF_PACKET socket to its gateway's MAC; the node would forward them.
#[test]
fn pod_af_packet_frames_to_its_gateway_are_denied() {
    privileged!(pod_af_packet_frames_to_its_gateway_are_denied);
    let mut w = World::new();
    w.each(|w, gate| {
        let udp = |t: &str, to: To| {
            w.frames(&w.pod_ns, &w.c.web, "eth0", ETH_P_IP, &[eth(w.gw, &udp80(POD_V4, to, t))]);
        };
        let syn = |t: &str, to: To| {
            let (src, dst) = (v4(POD_V4), to.v4());
            let seg = frame::tcp_syn(&src.octets(), &dst.octets(), 40002, 80, 0, t.as_bytes());
            let ip = frame::ipv4(src, dst, frame::PROTO_TCP, 7, 0, &seg);
            w.frames(&w.pod_ns, &w.c.web, "eth0", ETH_P_IP, &[eth(w.gw, &ip)]);
        };
        w.attempts(
            gate,
            true,
            &[("pod: AF_PACKET UDP to the gateway", &udp), ("pod: AF_PACKET TCP SYN", &syn)],
        );
    });
}

/// Case 2b: a route in a spare table that sends the metadata address out of the pod's veth (a
/// host-network pod with NET_ADMIN adds it; an IPv6 Router Advertisement from the pod does
/// the same for a default route) once made that veth an "uplink", which took no ingress
/// program. Routes decide nothing now: the veth keeps its ingress program (tcx: the very
/// link), and the pod's frames to its gateway are denied there (and, were it missing, where
/// they leave: forwarded traffic without a socket is denied at the uplinks in both modes).
#[test]
fn a_route_that_makes_a_pod_veth_an_uplink_opens_nothing() {
    privileged!(a_route_that_makes_a_pod_veth_an_uplink_opens_nothing);
    let mut w = World::new();
    let node = w.c.env.net.node.clone();
    let route = format!("route {{}} {IMDS_V4}/32 dev {POD_IFACE} table 100");
    w.each(|w, gate| {
        let before = w.tc_link("ingress", POD_IFACE);
        assert_eq!(before.is_some(), gate != Gate::None && sys::kernel_has_tcx(), "{gate:?}");
        ip(&node, &route.replace("{}", "add")).expect("spare-table route");
        // Time for the agent to see the route (it must change nothing).
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(w.tc_link("ingress", POD_IFACE), before, "{gate:?}: the veth's ingress link");
        let udp = |t: &str, to: To| {
            w.frames(&w.pod_ns, &w.c.web, "eth0", ETH_P_IP, &[eth(w.gw, &udp80(POD_V4, to, t))]);
        };
        w.attempts(gate, true, &[("pod: AF_PACKET UDP to the gateway, veth an uplink", &udp)]);
        ip(&node, &route.replace("{}", "del")).expect("removing the spare-table route");
    });
    // The operator's way out: the veth declared trusted, its forwarded frames pass.
    let root = w.c.kubepods();
    let extra = ["--tc-trusted-interface", POD_IFACE];
    let env = &w.c.env;
    let agent = Agent::start_with(&env.bins, &w.node, &env.policy_file, &root, &extra);
    w.c.env.agent = Some(agent.expect("standalone agent with a trusted interface"));
    let t = token("trusted");
    w.frames(&w.pod_ns, &w.c.web, "eth0", ETH_P_IP, &[eth(w.gw, &udp80(POD_V4, To::Imds, &t))]);
    assert!(
        w.c.env.imds.wait_for(&t, Duration::from_secs(3)),
        "a frame forwarded from the trusted {POD_IFACE} was denied"
    );
    w.gate(Gate::None);
}

/// Cases 3 and 4: the host-network pod sends hand-built frames on the uplink, once with
/// `sll_protocol` saying IPv4 and once saying 0x88b5 (local experimental) while the frame's
/// own Ethernet type is IPv4: the receiver goes by the frame.
#[test]
fn host_network_af_packet_frames_on_the_uplink_are_denied() {
    privileged!(host_network_af_packet_frames_on_the_uplink_are_denied);
    let mut w = World::new();
    w.each(|w, gate| {
        let send = |proto: u16| {
            move |t: &str, to: To| {
                w.frames(
                    &w.node,
                    &w.rogue,
                    "vnode",
                    proto,
                    &[eth(w.imds_mac, &udp80(NODE_V4, to, t))],
                );
            }
        };
        let (ip, lying) = (send(ETH_P_IP), send(0x88b5));
        w.attempts(
            gate,
            true,
            &[
                ("host network: AF_PACKET UDP on the uplink", &ip),
                ("host network: AF_PACKET, sll_protocol 0x88b5, EtherType IPv4", &lying),
            ],
        );
    });
}

/// Case 5: UDP behind 7 and behind 30 IPv6 destination-options headers: from the
/// host-network pod on a raw IPPROTO_RAW socket, and from the pod as AF_PACKET frames that
/// the node forwards.
#[test]
fn ipv6_extension_header_chains_are_denied() {
    privileged!(ipv6_extension_header_chains_are_denied);
    let mut w = World::new();
    w.each(|w, gate| {
        let packet = |src: &str, n: usize, t: &str, to: To| {
            frame::udp6_dstopts(src.parse().expect("IPv6"), to.v6(), n, 80, t.as_bytes())
        };
        let raw = |n: usize| {
            move |t: &str, to: To| {
                let hex = frame::to_hex(&packet("fd00:ec2::1", n, t, to));
                let o = w.probe(&w.node, &w.rogue, &["ip-raw", &hex]);
                // The egress program drops it; the sender may or may not be told.
                assert!(o.ok || o.errno == Some(EPERM), "{o:?}");
            }
        };
        let fwd = |n: usize| {
            move |t: &str, to: To| {
                w.frames(
                    &w.pod_ns,
                    &w.c.web,
                    "eth0",
                    0x86dd,
                    &[eth(w.gw, &packet(POD_V6, n, t, to))],
                );
            }
        };
        let (raw7, raw30, fwd7, fwd30) = (raw(7), raw(30), fwd(7), fwd(30));
        w.attempts(
            gate,
            true,
            &[
                ("host network: raw IPv6, 7 destination options headers", &raw7),
                ("host network: raw IPv6, 30 destination options headers", &raw30),
                ("pod: IPv6 frame, 7 destination options headers, forwarded", &fwd7),
                ("pod: IPv6 frame, 30 destination options headers, forwarded", &fwd30),
            ],
        );
    });
}

/// Case 6: a forwarding loop inside the pod: a frame sent on one end of a veth pair in the
/// pod's own namespace is received on the other, loses its socket, and is forwarded by the
/// pod out of eth0: it reaches the node without a socket.
#[test]
fn forwarding_loop_inside_a_pod_is_denied() {
    privileged!(forwarding_loop_inside_a_pod_is_denied);
    let mut w = World::new();
    let lp1 = w.pod.forwarding_loop().expect("forwarding loop in the pod");
    w.each(|w, gate| {
        let send = |t: &str, to: To| {
            w.frames(&w.pod_ns, &w.c.web, "lp0", ETH_P_IP, &[eth(lp1, &udp80("10.97.0.2", to, t))]);
        };
        w.attempts(gate, true, &[("pod: frame through its own forwarding loop", &send)]);
    });
}

/// Case 7: 802.1Q-tagged frames. This kernel has no 802.1Q module (no VLAN sub-interfaces),
/// so the tags are priority tags (VLAN 0), which every Linux receiver strips, as many as
/// there are: one tag, QinQ (802.1ad + 802.1Q), three tags (more than the gate reads: it
/// denies such a frame whatever its address). From the host-network pod on the uplink, and
/// from the pod to its gateway (QinQ).
#[test]
fn vlan_tagged_frames_are_denied() {
    privileged!(vlan_tagged_frames_are_denied);
    let mut w = World::new();
    w.each(|w, gate| {
        let host = |tags: &'static [(u16, u16)]| {
            move |t: &str, to: To| {
                let f = frame::ethernet(
                    w.imds_mac,
                    frame::SRC_MAC,
                    tags,
                    ETH_P_IP,
                    &udp80(NODE_V4, to, t),
                );
                w.frames(&w.node, &w.rogue, "vnode", tags[0].0, &[f]);
            }
        };
        const QINQ: &[(u16, u16)] = &[(ETH_P_8021AD, 0), (ETH_P_8021Q, 0)];
        let pod_qinq = |t: &str, to: To| {
            let f = frame::ethernet(w.gw, frame::SRC_MAC, QINQ, ETH_P_IP, &udp80(POD_V4, to, t));
            w.frames(&w.pod_ns, &w.c.web, "eth0", ETH_P_8021AD, &[f]);
        };
        let (one, qinq) = (host(&[(ETH_P_8021Q, 0)]), host(QINQ));
        w.attempts(
            gate,
            true,
            &[
                ("host network: 802.1Q tag", &one),
                ("host network: QinQ tags", &qinq),
                ("pod: QinQ tags to the gateway", &pod_qinq),
            ],
        );
        let three = host(&[(ETH_P_8021Q, 0), (ETH_P_8021Q, 0), (ETH_P_8021Q, 0)]);
        w.attempts(gate, false, &[("host network: three 802.1Q tags", &three)]);
    });
}

/// Case 8: a TCP SYN to :80 in two IPv4 fragments, the first with only 8 bytes of the TCP
/// header (MF set), its frame padded with bytes that read as "a bare reset" to a parser that
/// takes a fragment for a whole packet, the second starting with bytes that read as port 53.
/// From the pod to its gateway, and from the host-network pod on the uplink.
#[test]
fn first_fragment_without_its_transport_header_is_denied() {
    privileged!(first_fragment_without_its_transport_header_is_denied);
    let mut w = World::new();
    w.each(|w, gate| {
        let frames = |mac: Mac, src: &str, t: &str, to: To| {
            let ([first, second], trailer) =
                frame::disguised_fragments(v4(src), to.v4(), 80, t.as_bytes());
            let first = eth(mac, &[first, trailer].concat());
            vec![first, eth(mac, &second)]
        };
        let from_pod = |t: &str, to: To| {
            w.frames(&w.pod_ns, &w.c.web, "eth0", ETH_P_IP, &frames(w.gw, POD_V4, t, to));
        };
        let from_host = |t: &str, to: To| {
            w.frames(&w.node, &w.rogue, "vnode", ETH_P_IP, &frames(w.imds_mac, NODE_V4, t, to));
        };
        w.attempts(
            gate,
            true,
            &[
                ("pod: disguised IPv4 fragments, forwarded", &from_pod),
                ("host network: disguised IPv4 fragments on the uplink", &from_host),
            ],
        );
    });
}

/// Case 9: PACKET_QDISC_BYPASS (frames straight to the driver, past tc egress) and AF_XDP
/// setup are denied with EPERM to gated workloads that are not allowed, and a frame sent
/// anyway on the denied socket never arrives; the allowed pod and host processes outside the
/// gated root keep both.
#[test]
fn qdisc_bypass_and_af_xdp_setup_are_denied_to_gated_workloads() {
    privileged!(qdisc_bypass_and_af_xdp_setup_are_denied_to_gated_workloads);
    let mut w = World::new();
    w.each(|w, gate| {
        let on_node = |who: &'static str, cgroup: &str, gated: bool| {
            (who, w.node.as_str(), cgroup.to_owned(), "vnode", w.imds_mac, NODE_V4, gated)
        };
        let senders = [
            on_node("host-network pod", &w.rogue, true),
            ("pod", w.pod_ns.as_str(), w.c.web.clone(), "eth0", w.gw, POD_V4, true),
            on_node("allowed host-network pod", &w.c.ccm, false),
            on_node("host process outside the gated root", "outside", false),
        ];
        let before = w.denials();
        let mut denied = 0.0;
        let consults_allow = w.sockopt_consults_allow();
        let in_root = |cgroup: &str| cgroup != "outside";
        for (who, netns, cgroup, iface, mac, src, gated) in senders {
            let gated = gated && gate != Gate::None;
            // Without the allow set (5.10), allowed workloads are denied the options too.
            let denies = gated || (!consults_allow && in_root(&cgroup) && gate != Gate::None);
            let eperm = |o: &Outcome| (o.stage.as_str(), o.errno) == ("setsockopt", Some(EPERM));
            let t = token("qdisc-bypass");
            let f = frame::to_hex(&eth(mac, &udp80(src, To::Imds, &t)));
            let o = w.probe(netns, &cgroup, &["frame-bypass", iface, "0800", &f]);
            let arrived =
                w.c.env.imds.wait_for(&t, Duration::from_millis(if gated { 500 } else { 3000 }));
            if denies {
                assert!(eperm(&o), "{who}: PACKET_QDISC_BYPASS not denied: {o:?}");
                // Sent anyway, without the option: tc drops it (on the uplink's egress, the
                // sender is told ENOBUFS) unless the sender is allowed.
                let sent = o.reply.as_deref().unwrap_or_default();
                assert!(sent == "sent" || sent.contains("os error 105"), "{o:?}");
                assert_eq!(
                    arrived, !gated,
                    "{who} under {gate:?}: the frame sent on the denied socket"
                );
                denied += 1.0;
            } else {
                assert_eq!((o.stage.as_str(), o.errno), ("send", None), "{who}: {o:?}");
                assert!(arrived, "{who} under {gate:?}: the frame sent with the option was lost");
            }
            let o = w.probe(netns, &cgroup, &["xdp-umem-reg"]);
            let no_xdp = o.stage == "socket" && o.errno == Some(libc::EAFNOSUPPORT);
            assert!(
                !no_xdp,
                "{who}: no AF_XDP in this kernel (EAFNOSUPPORT): cannot show the denial"
            );
            if denies {
                assert!(eperm(&o), "{who}: XDP_UMEM_REG not denied: {o:?}");
                denied += 1.0;
            } else {
                assert!(o.ok, "{who} under {gate:?}: XDP_UMEM_REG denied: {o:?}");
            }
            let verdict = if denies { "denied with EPERM" } else { "accepted" };
            eprintln!("bypass: {who}: {gate:?}: PACKET_QDISC_BYPASS and XDP_UMEM_REG {verdict}");
        }
        if gate != Gate::None {
            let after = w.denials().get("setsockopt").copied().unwrap_or(0.0);
            let counted = after - before.get("setsockopt").copied().unwrap_or(0.0);
            assert_eq!(counted, denied, "setsockopt denials counted");
            let logged =
                |v: &serde_json::Value| v["message"] == "denied" && v["hook"] == "setsockopt";
            let line = w.c.env.agent().wait_log(logged, Duration::from_secs(5));
            let line = line.expect("setsockopt denial logged");
            assert_eq!(line["verdict"], "denied", "{line}");
        }
    });
}

/// Rename the node's interface `from` to `to` as a host-network pod with NET_ADMIN can (down,
/// rename, up), putting back the IPv6 address the kernel drops with the link.
fn rename(node: &str, from: &str, to: &str) {
    for args in [
        format!("link set {from} down"),
        format!("link set {from} name {to}"),
        format!("link set {to} up"),
    ] {
        ip(node, &args).expect("renaming the uplink");
    }
    let _ = ip(node, &format!("addr add fd00:ec2::1/64 dev {to} nodad"));
}

/// Case 3b: the uplink renamed while the gate runs, to a plain name and to a dotted one (as
/// VLAN interfaces are named, and which bpffs rejects in a pin name): the program belongs to
/// the interface, so the gated host-network pod's frames on it are denied throughout, and
/// (tcx) the very link that was there before the rename still is. Without a gate they arrive.
#[test]
fn a_renamed_uplink_keeps_its_program() {
    privileged!(a_renamed_uplink_keeps_its_program);
    let mut w = World::new();
    w.each(|w, gate| {
        // The id of the link on the egress of the uplink, now named `name` (tcx).
        let uplink_link = |name: &str| w.tc_link("egress", name).map(|(id, _)| id);
        let before = uplink_link("vnode");
        for name in ["uplink0", "vnode.100"] {
            rename(&w.c.env.net.node, "vnode", name);
            // Time for the agent to see the rename (it must change nothing).
            std::thread::sleep(Duration::from_millis(300));
            let send = |t: &str, to: To| {
                w.frames(
                    &w.node,
                    &w.rogue,
                    name,
                    ETH_P_IP,
                    &[eth(w.imds_mac, &udp80(NODE_V4, to, t))],
                );
            };
            w.attempts(gate, true, &[("AF_PACKET frame on the uplink renamed", &send)]);
            if sys::kernel_has_tcx() && gate != Gate::None {
                assert_eq!(
                    uplink_link(name),
                    before,
                    "{name} under {gate:?}: the uplink's link changed"
                );
            }
            rename(&w.c.env.net.node, name, "vnode");
            eprintln!("bypass: uplink renamed to {name}: {gate:?}: checked");
        }
    });
}

/// Case 3c: an L3 interface — a TUN device of a userspace VPN that leads to the metadata
/// service's side — on which the gated host-network pod sends hand-built IP packets with
/// AF_PACKET, and into which the VPN writes a packet from a peer (the node receives it on the
/// TUN, without a socket, and forwards it). They start with the IP header: read as an
/// Ethernet frame, the source address's first bytes pass for an Ethernet type and the packet
/// for "not IP". The interface gets `gate_tc_l3`, which reads at the network header, and they
/// are denied. Without a gate they arrive, through the VPN or forwarded.
#[test]
fn packets_on_an_l3_interface_are_denied() {
    privileged!(packets_on_an_l3_interface_are_denied);
    let mut w = World::new();
    w.tun = Some(TunLink::new(&w.c.env.net).expect("tun link"));
    w.each(|w, gate| {
        if gate != Gate::None && sys::kernel_has_tcx() {
            let program = w.tc_link("egress", TUN_IFACE).map(|(_, p)| p);
            assert_eq!(program.as_deref(), Some("gate_tc_l3"), "{gate:?}: the tun's program");
        }
        let v4 = |t: &str, to: To| {
            w.frames(&w.node, &w.rogue, TUN_IFACE, ETH_P_IP, &[udp80(NODE_V4, to, t)]);
        };
        let v6 = |t: &str, to: To| {
            let src = "fd00:ec2::1".parse().expect("IPv6");
            let p = frame::udp6_dstopts(src, to.v6(), 1, 80, t.as_bytes());
            w.frames(&w.node, &w.rogue, TUN_IFACE, ETH_P_IPV6, &[p]);
        };
        let written = |t: &str, to: To| {
            let tun = w.tun.as_ref().expect("tun link");
            tun.inject(&udp80(TUN_PEER_V4, to, t)).expect("write into the tun");
        };
        w.attempts(
            gate,
            true,
            &[
                ("AF_PACKET IPv4 packet on a tun", &v4),
                ("AF_PACKET IPv6 packet (destination options) on a tun", &v6),
                ("IPv4 packet written into a tun by its VPN, forwarded", &written),
            ],
        );
    });
}

/// Case 3d: a link whose pin fails is held, not dropped. Directories squat on the pin names of
/// an interface the agent has not seen yet (`ip link add … index 777`, a second way to the
/// metadata service's side); the agent attaches anyway, holds the links open, and says so
/// (`metadata_gate_node_attach_failures`, no pinned link in status): the gated host-network
/// pod's frames on that interface are denied all the same. Once the names are free, the
/// next check pins the links. Without a gate the frames arrive.
#[test]
fn a_link_whose_pin_fails_is_held_not_dropped() {
    privileged!(a_link_whose_pin_fails_is_held_not_dropped);
    let mut w = World::new();
    let (node, imds) = (w.c.env.net.node.clone(), w.c.env.net.imds.clone());
    w.each(|w, gate| {
        // `<pin dir>/v<ABI>/links`, as status names them.
        let links = w.c.env.agent.as_ref().map(|a| {
            let (_, st) = a.status().expect("status");
            a.pin_dir.join(format!("v{}/links", st["abi"]))
        });
        let squats: Vec<PathBuf> = ["egress", "ingress"]
            .iter()
            .filter_map(|d| Some(links.as_ref()?.join(format!("tc-{d}-777"))))
            .collect();
        for d in &squats {
            std::fs::create_dir(d).expect("squatting directory");
        }
        let add = format!("link add mgheld index 777 type veth peer name mgheldi netns {imds}");
        ip(&node, &add).expect("second veth");
        ip(&node, "link set mgheld up").expect("up");
        ip(&imds, "link set mgheldi up").expect("up");
        integration_tests::net::sysctl(
            &imds,
            &["net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.mgheldi.rp_filter=0"],
        )
        .expect("rp_filter");
        let peer = mac(&imds, "mgheldi").expect("peer MAC");
        // Time for the agent to see the interface.
        std::thread::sleep(Duration::from_millis(300));
        let failures = || {
            let (_, body) = w.c.env.agent.as_ref()?.http_get("/metrics").expect("metrics");
            super::metric(&body, "metadata_gate_node_attach_failures")
        };
        if gate != Gate::None {
            assert_eq!(failures(), Some(2.0), "{gate:?}: both directions reported");
            assert_eq!(w.tc_link("egress", "mgheld"), None, "{gate:?}: not pinned");
        }
        let send = |t: &str, to: To| {
            w.frames(&w.node, &w.rogue, "mgheld", ETH_P_IP, &[eth(peer, &udp80(NODE_V4, to, t))]);
        };
        w.attempts(gate, true, &[("AF_PACKET frame on an interface whose pin failed", &send)]);
        if gate != Gate::None {
            for d in &squats {
                std::fs::remove_dir(d).expect("freeing the pin name");
            }
            // A link event makes the agent look again.
            ip(&node, "link set mgheld mtu 1400").expect("mtu");
            std::thread::sleep(Duration::from_millis(300));
            assert_eq!(failures(), Some(0.0), "{gate:?}: pinned once the name was free");
            assert!(w.tc_link("egress", "mgheld").is_some(), "{gate:?}: the link pinned");
        }
        ip(&node, "link del mgheld").expect("removing the veth");
    });
}

/// Case 10b: a brand-new interface's first frames. A veth appears (its far end, in the
/// metadata service's namespace, stands for a new pod or VM), and frames to the metadata
/// service enter the node by it at once, before the agent can have attached anything there:
/// they are forwarded without a socket, and denied where they leave the node if not where
/// they enter. Without a gate they are forwarded to the service.
#[test]
fn a_new_interfaces_first_frames_are_judged() {
    privileged!(a_new_interfaces_first_frames_are_judged);
    let mut w = World::new();
    let (node, imds) = (w.c.env.net.node.clone(), w.c.env.net.imds.clone());
    let imds_path = w.c.env.net.imds_path();
    w.each(|w, gate| {
        let add = format!("link add mgnew type veth peer name mgnewi netns {imds}");
        for (ns, args) in [
            (&node, add.as_str()),
            (&node, "addr add 10.100.0.1/24 dev mgnew"),
            (&node, "link set mgnew up"),
            (&imds, "link set mgnewi up"),
        ] {
            ip(ns, args).expect("the new veth");
        }
        let gw = mac(&node, "mgnew").expect("MAC");
        let send = |t: &str, to: To| {
            let f = eth(gw, &udp80("10.100.0.2", to, t));
            w.frames(&imds_path, "outside", "mgnewi", ETH_P_IP, &[f]);
        };
        w.attempts(gate, true, &[("frames entering by a brand-new veth at once", &send)]);
        ip(&node, "link del mgnew").expect("removing the veth");
    });
}

/// Case 9b: PACKET_QDISC_BYPASS asked through the 32-bit compat ABI (`int 0x80`), for which
/// the kernel runs no cgroup/setsockopt program (`do_sock_setsockopt`: `if (!compat)`): the
/// LSM program denies it as the native call is denied, and the frame sent anyway never
/// arrives; the allowed pod keeps it. Where the kernel runs no BPF LSM the door is open, and
/// status and /metrics say so.
#[test]
fn qdisc_bypass_through_the_32_bit_abi_is_denied() {
    privileged!(qdisc_bypass_through_the_32_bit_abi_is_denied);
    let mut w = World::new();
    w.each(|w, gate| {
        let lsm = w.lsm_enforcing();
        let before = w.denials().get("setsockopt").copied().unwrap_or(0.0);
        for (who, cgroup, allowed) in
            [("host-network pod", &w.rogue, false), ("CCM", &w.c.ccm, true)]
        {
            let t = token("compat-bypass");
            let f = frame::to_hex(&eth(w.imds_mac, &udp80(NODE_V4, To::Imds, &t)));
            let o = w.probe(&w.node, cgroup, &["frame-bypass-compat", "vnode", "0800", &f]);
            let denied = gate != Gate::None && !allowed && lsm == Some(true);
            let arrived =
                w.c.env.imds.wait_for(&t, Duration::from_millis(if denied { 500 } else { 3000 }));
            if denied {
                assert_eq!(
                    (o.stage.as_str(), o.errno),
                    ("setsockopt", Some(EPERM)),
                    "{who}: {o:?}"
                );
                assert!(!arrived, "{who} under {gate:?}: the frame sent on the denied socket");
                eprintln!("bypass: {who}: {gate:?}: compat PACKET_QDISC_BYPASS denied with EPERM");
            } else {
                assert_eq!((o.stage.as_str(), o.errno), ("send", None), "{who}: {o:?}");
                assert!(arrived, "{who} under {gate:?}: a compat-bypass frame was lost");
                eprintln!("bypass: {who}: {gate:?}: compat PACKET_QDISC_BYPASS set, frame arrived");
            }
        }
        if lsm == Some(true) {
            let after = w.denials().get("setsockopt").copied().unwrap_or(0.0);
            assert_eq!(after - before, 1.0, "the compat denial counted under setsockopt");
        }
    });
}

/// Case 9c: reading the node's traffic. The gated host-network pod opens, on the uplink, an
/// AF_PACKET socket of ETH_P_ALL (natively and through the 32-bit ABI), one of protocol 0
/// bound to ETH_P_IP afterwards, and a raw IPPROTO_TCP socket; then the allowed CCM fetches
/// its instance id. Without the gate each socket reads the reply off the wire; with it each
/// is denied (EPERM at `socket()` or `bind()`), the CCM's own too: its entry grants the
/// metadata service, not capture. The IDS, whose entry grants capture only, reads it, and is
/// denied the metadata service. Sockets that read no IP (ETH_P_ARP, raw ICMP) stay open.
#[test]
fn reading_the_nodes_traffic_is_denied_to_gated_workloads() {
    privileged!(reading_the_nodes_traffic_is_denied_to_gated_workloads);
    let mut w = World::new();
    w.each(|w, gate| {
        let lsm = w.lsm_enforcing();
        let before = w.denials().get("socket").copied().unwrap_or(0.0);
        let hold = |cgroup: &str, kind: &str| {
            let args = ["hold-capture", kind, "vnode", INSTANCE_ID];
            let cg = w.c.env.cgroup(cgroup);
            Held::try_start_in(&w.c.env.bins, &w.node, &cg, &args).expect("capture probe ran")
        };
        let fetch = || {
            let o = w.probe(&w.node, &w.c.ccm, &["tcp", IMDS_V4, "80", &token("ccm")]);
            assert!(o.ok, "the allowed CCM's fetch under {gate:?}: {o:?}");
        };
        let captures = |held: Held| {
            fetch();
            held.send("go").expect("capture result")
        };
        let mut denied = 0.0;
        let kinds = ["packet-all", "packet-all-compat", "packet-bind", "raw-tcp"];
        let who = [
            (w.rogue.as_str(), "host-network pod", false),
            (w.c.ccm.as_str(), "CCM", false),
            (w.ids.as_str(), "IDS", true),
        ];
        for (cgroup, who, allowed) in who {
            for kind in kinds {
                let shut = gate != Gate::None && !allowed && lsm == Some(true);
                match hold(cgroup, kind) {
                    Err(o) => {
                        assert!(shut, "{who} {kind} under {gate:?}: denied: {o:?}");
                        let stage = if kind == "packet-bind" { "bind" } else { "socket" };
                        assert_eq!((o.stage.as_str(), o.errno), (stage, Some(EPERM)), "{kind}");
                        denied += 1.0;
                        eprintln!("bypass: {who}: {gate:?}: {kind} capture denied with EPERM");
                    }
                    Ok(held) => {
                        assert!(!shut, "{who} {kind} under {gate:?}: not denied");
                        let o = captures(held);
                        assert!(
                            o.ok,
                            "{who} {kind} under {gate:?}: read nothing: the path is not real: {o:?}"
                        );
                        eprintln!(
                            "bypass: {who}: {gate:?}: {kind} read the CCM's reply off the wire"
                        );
                    }
                }
            }
        }
        for kind in ["packet-arp", "raw-icmp"] {
            let held = hold(&w.rogue, kind);
            assert!(
                held.is_ok(),
                "{kind} (reads no IP) denied under {gate:?}: {held:?}",
                held = held.err()
            );
        }
        if lsm == Some(true) {
            let after = w.denials().get("socket").copied().unwrap_or(0.0);
            assert_eq!(after - before, denied, "socket denials counted");
        }
        // A capture grant is no way to the metadata service.
        let o = w.probe(&w.node, &w.ids, &["tcp", IMDS_V4, "80", &token("ids")]);
        if gate == Gate::None {
            assert!(o.ok, "the IDS's fetch without a gate: {o:?}");
        } else {
            assert_eq!((o.ok, o.errno), (false, Some(EPERM)), "the IDS's fetch under {gate:?}");
        }
    });
}

/// Case 10: a VM's frames, written into its tap on the node: through a NAPI-frags queue
/// they arrive with no socket at all (as vhost-net's batched path delivers them); through a
/// plain queue that the VMM, in the VM pod's gated cgroup, opened, they are charged to its
/// tun socket.
#[test]
fn frames_from_a_vm_tap_are_denied() {
    privileged!(frames_from_a_vm_tap_are_denied);
    let mut w = World::new();
    w.tap = Some(Tap::vm(&w.c.env.net).expect("tap"));
    w.each(|w, gate| {
        let tap = w.tap.as_ref().expect("tap");
        let socketless = |t: &str, to: To| {
            tap.send(&eth(tap.mac, &udp80(VM_V4, to, t))).expect("write into the tap");
        };
        let vmm = |t: &str, to: To| {
            let f = frame::to_hex(&eth(tap.mac, &udp80(VM_V4, to, t)));
            let o = w.probe(&w.node, &w.c.web, &["tap", TAP_IFACE, &f]);
            assert!(o.ok, "{o:?}");
        };
        w.attempts(
            gate,
            true,
            &[
                ("VM: frame written into its tap, no socket", &socketless),
                ("VM: frame written into its tap by its VMM in the pod's cgroup", &vmm),
            ],
        );
    });
}

/// Controls, with the node's address on a bridge whose port is the uplink: a host process
/// outside the gated root and the allowed host-network pod are served; the pod's DNS (UDP 53
/// on the neighbour and on the metadata address itself) is served; the gated host-network
/// pod is denied at connect(), so the gate is on in this topology.
#[test]
fn host_processes_allowed_pods_and_unprotected_ports_are_served() {
    privileged!(host_processes_allowed_pods_and_unprotected_ports_are_served);
    let mut w = World::new();
    bridge_uplink(&w.c.env.net).expect("bridge");
    w.each(|w, gate| {
        let served = |netns: &str, cgroup: &str, cmd: &str, addr: &str, port: &str| {
            let t = token("served");
            let o = w.probe(netns, cgroup, &[cmd, addr, port, &t]);
            let reply = o.reply.clone().unwrap_or_default();
            assert!(o.ok, "{cmd} {addr}:{port} from {cgroup} under {gate:?}: {o:?}");
            assert!(reply.contains(INSTANCE_ID) || reply.contains(&t), "{o:?}");
            assert!(w.c.env.imds.wait_for(&t, Duration::from_secs(2)), "token {t} lost");
            eprintln!("bypass: control {cmd} {addr}:{port} from {cgroup}: {gate:?}: served");
        };
        served(&w.node, "outside", "tcp", IMDS_V4, "80");
        served(&w.node, &w.c.ccm, "tcp", IMDS_V4, "80");
        served(&w.pod_ns, &w.c.web, "udp", DNS_V4, "53");
        served(&w.pod_ns, &w.c.web, "udp", IMDS_V4, "53");
        if gate != Gate::None {
            let o = w.probe(&w.node, &w.rogue, &["tcp", IMDS_V4, "80", &token("rogue")]);
            assert_eq!((o.stage.as_str(), o.errno), ("connect", Some(EPERM)), "{o:?}");
        }
    });
}

/// Control: the gate passes what it does not deny on to the next tc program (TCX_NEXT),
/// never ends the chain. A second gate agent, with its own pin dir and cgroup root, protects
/// UDP 53 of the metadata address in audit mode; it starts first, so the gate under test
/// attaches ahead of it. A VM's frame to :53 passes the first gate, reaches the service, and
/// the second gate's tc program audits it. (A tcx test: before 6.6 the gate is a clsact
/// filter with a fixed priority and handle, which a second gate agent on the same interface
/// replaces; `cargo xtask test-kernels` runs it on 6.12.)
#[test]
fn a_second_tc_program_still_sees_what_the_gate_passes() {
    privileged!(a_second_tc_program_still_sees_what_the_gate_passes);
    let mut w = World::new();
    w.tap = Some(Tap::vm(&w.c.env.net).expect("tap"));
    let root = w.c.env.cg.create("second").expect("second root");
    let policy = w.file(
        "second-policy.yaml",
        "platform: AWS\nmode: audit\nendpoints:\n  - {name: dns-audit, cidr: 169.254.169.254/32, ports: [53], protocols: [UDP]}\n",
    );
    let audited = r#"metadata_gate_decisions_total{hook="tc4",verdict="audited"}"#;
    for gate in [Gate::Standalone, Gate::Cluster] {
        w.gate(Gate::None);
        w.second = None;
        let second = Agent::start(&w.c.env.bins, &w.node, &policy, &root).expect("second agent");
        w.second = Some(second);
        w.gate(gate);
        let count = |w: &World| {
            let (_, body) =
                w.second.as_ref().expect("second").http_get("/metrics").expect("metrics");
            metric(&body, audited).unwrap_or(0.0)
        };
        let before = count(&w);
        let tap = w.tap.as_ref().expect("tap");
        let t = token("second-tc");
        let ip = frame::udp4(v4(VM_V4), v4(IMDS_V4), 53, t.as_bytes());
        tap.send(&eth(tap.mac, &ip)).expect("write into the tap");
        assert!(w.c.env.imds.wait_for(&t, Duration::from_secs(3)), "{gate:?}: frame to :53 lost");
        let after = count(&w);
        assert!(
            after > before,
            "{gate:?}: the second tc program never saw the frame ({before} -> {after})"
        );
        eprintln!("bypass: control second tc program: {gate:?}: audited {before} -> {after}");
    }
    w.gate(Gate::None);
    w.second = None;
}

/// Case 11: a gated host-network pod with CAP_NET_RAW sends a frame on an AF_PACKET socket
/// bound to `lo`, to the metadata address from a foreign source (the pod's). Loopback
/// drops the frame's socket before it is received, and the node, which forwards as every
/// Kubernetes node does, routes it out of the uplink, where it is forwarded traffic without
/// a socket (gated only in cluster all-pods mode). Closed where it starts: the node-level
/// program is on `lo`'s egress too, where the frame still has the pod's socket.
#[test]
fn host_network_frame_looped_through_lo_and_forwarded_is_denied() {
    privileged!(host_network_frame_looped_through_lo_and_forwarded_is_denied);
    let mut w = World::new();
    w.each(|w, gate| {
        let send = |t: &str, to: To| {
            w.frames(&w.node, &w.rogue, "lo", ETH_P_IP, &[eth([0; 6], &udp80(POD_V4, to, t))]);
        };
        w.attempts(gate, true, &[("host network: AF_PACKET frame on lo, forwarded", &send)]);
    });
}

/// Case 12: a gated host-network pod with CAP_NET_ADMIN (in its own namespace, the node's)
/// sends UDP to a decoy, which no socket hook judges, and an nftables output rule
/// rewrites it to the metadata address and duplicates it (`dup to`). The egress hook drops
/// the original, but the duplicate is a copy without a socket, made on this node (no
/// ingress interface). The node-level program passes such local socketless packets only
/// when they are a bare TCP segment (the kernel's own resets and ACKs): the copy is denied.
#[test]
fn host_network_pod_duplicating_a_rewritten_decoy_with_nft_is_denied() {
    privileged!(host_network_pod_duplicating_a_rewritten_decoy_with_nft_is_denied);
    let mut w = World::new();
    ip(&w.c.env.net.node, "route add 10.99.9.0/24 dev vnode").expect("route to the decoys");
    nft(
        &w.c.env.net.node,
        &format!(
            "table ip mg_dup {{
                chain out {{
                    type filter hook output priority 0; policy accept;
                    ip daddr 10.99.9.9 udp dport 80 ip daddr set {IMDS_V4} dup to {IMDS_V4}
                    ip daddr 10.99.9.8 udp dport 80 ip daddr set {DNS_V4} dup to {DNS_V4}
                }}
            }}"
        ),
    )
    .expect("nft dup in the node netns");
    w.each(|w, gate| {
        let send = |t: &str, to: To| {
            let decoy = match to {
                To::Imds => "10.99.9.9",
                To::Neighbour => "10.99.9.8",
            };
            // The original is dropped on egress (EPERM) under a gate; the copy goes out.
            w.probe(&w.node, &w.rogue, &["udp", decoy, "80", t]);
        };
        w.attempts(gate, true, &[("host network: decoy rewritten and duplicated by nft", &send)]);
    });
}

/// Limit, detected: an AF_PACKET socket that set PACKET_QDISC_BYPASS before the gate was
/// installed (a host-network pod started before the agent, on a node without the boot step)
/// keeps it: its frames go straight to the driver, past tc egress, and nothing else on the
/// node sees them. Nothing can take the option back, so the agent names the process at start
/// (log and `metadata_gate_pregate_packet_sockets`). This test proves both halves: the path
/// stays open (so the documented limit is true, and the day it closes this test says so) and
/// the agent names the holder; the setsockopt test proves no socket can set it afterwards.
#[test]
fn qdisc_bypass_set_before_the_gate_is_named() {
    privileged!(qdisc_bypass_set_before_the_gate_is_named);
    let mut w = World::new();
    for gate in GATES {
        w.gate(Gate::None);
        let held = w.c.env.hold(&w.rogue, &["hold-frame-bypass", "vnode", "0800"]);
        let held = held.expect("PACKET_QDISC_BYPASS before the gate");
        let pid = held.pid();
        w.gate(gate);
        if let Some(agent) = &w.c.env.agent {
            let named = agent.wait_log(
                |v| {
                    v["pid"].as_u64() == Some(u64::from(pid))
                        && v["message"]
                            .as_str()
                            .is_some_and(|m| m.contains("AF_PACKET socket opened before the gate"))
                },
                Duration::from_secs(10),
            );
            assert!(named.is_some(), "{gate:?}: the agent did not name pid {pid}");
            let (_, body) = agent.http_get("/metrics").expect("metrics");
            assert!(
                body.lines().any(|l| l == "metadata_gate_pregate_packet_sockets 1"),
                "{gate:?}: gauge: {body}"
            );
        }
        let (ti, tn) = (token("pre-gate-bypass"), token("neighbour"));
        let frames: Vec<String> = [(&ti, To::Imds), (&tn, To::Neighbour)]
            .iter()
            .map(|(t, to)| frame::to_hex(&eth(w.imds_mac, &udp80(NODE_V4, *to, t))))
            .collect();
        let o = held.send(&frames.join(",")).expect("send on the held socket");
        assert!(o.ok, "{o:?}");
        assert!(w.c.env.imds.wait_for(&tn, Duration::from_secs(3)), "{gate:?}: neighbour lost");
        assert!(
            w.c.env.imds.wait_for(&ti, Duration::from_secs(3)),
            "{gate:?}: a PACKET_QDISC_BYPASS socket set before the gate no longer reaches the \
             metadata service: the limit is closed, update docs/threat-model.md and this test"
        );
        eprintln!(
            "bypass: host network: PACKET_QDISC_BYPASS set before the gate: {gate:?}: open, named"
        );
    }
    w.gate(Gate::None);
}
