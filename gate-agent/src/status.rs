//! `gate-agent status`: what the pinned gate is doing, read from bpffs alone, so it works
//! whether or not an agent runs.
use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use aya::programs::loaded_programs;
use gate_common::{
    abi::fixed_str_value,
    user::{AttachPoint, Hook, Mode, Program, TcDirection, TerminateState, Verdict},
};
use serde::Serialize;

use crate::loader::{Layout, LinkTarget, LoaderError, LsmState, Maps, bpf_lsm_active, pins};

#[derive(Debug, Serialize)]
pub(crate) struct Status {
    pub pin_dir: PathBuf,
    /// Whether a gate of this agent's ABI is pinned (programs attached).
    pub installed: bool,
    pub abi: u32,
    /// Other ABI versions pinned under the same pin dir (an unfinished hand-over).
    pub other_versions: Vec<PathBuf>,
    pub attachments: Vec<Attachment>,
    /// tc programs attached as clsact filters (kernels without tcx): `<dir> <iface> [netns]`.
    pub tc_clsact: Vec<String>,
    pub cgroup_root: String,
    pub cgroup_root_id: u64,
    pub policy: Option<PolicyStatus>,
    pub decisions: Vec<HookCounters>,
    pub events_lost: u64,
    pub recent_denials: Vec<Denial>,
    pub terminate_established: &'static str,
    /// What the last terminate-established scan could see.
    pub terminate_scan: TerminateScan,
    /// Whether the LSM programs enforce (`enforcing`), or which doors are open and why (`open: …`):
    /// without them, 32-bit compat and io_uring setsockopt and packet capture stay open.
    pub lsm: String,
    /// The boot step's record of this boot (`gate-agent boot`), from the state dir; none: it
    /// did not run on this boot (no boot unit, or it could not start).
    pub boot: Option<crate::state::BootRecord>,
}

/// What the last terminate-established scan could see.
#[derive(Debug, Default, Serialize)]
pub(crate) struct TerminateScan {
    /// Network namespaces scanned.
    pub netns: u32,
    /// Gated processes whose network namespace the agent could not open (without hostPID or
    /// CAP_SYS_PTRACE): their connections were not checked.
    pub hidden_processes: u32,
}

#[derive(Debug, Serialize)]
pub(crate) struct Attachment {
    /// The attach point's pin name (`connect4`, `egress`, `tc-egress-<ifindex>` …); the
    /// `hook` of `decisions` and `denials` is the kernel hook that decided instead.
    pub attach_point: String,
    pub link_id: u32,
    pub program_id: u32,
    pub program: String,
    /// Program tag (hash of its instructions) in hex: differs when the program changed.
    pub tag: String,
    /// cgroup id for cgroup hooks, ifindex for tc hooks.
    pub target_id: u64,
    /// Runs and total run time, counted while the kernel's BPF statistics are on
    /// (`sysctl kernel.bpf_stats_enabled=1`); 0 otherwise.
    pub run_count: u64,
    pub run_time_ns: u64,
    /// A tracing program (the LSM programs loaded as `fmod_ret`).
    #[serde(skip)]
    pub tracing: bool,
}

#[derive(Debug, Serialize)]
pub(crate) struct PolicyStatus {
    pub generation: u64,
    pub hash: String,
    pub platform: String,
    pub mode: &'static str,
    pub applied_at_unix_ms: u64,
    pub applied_by_pid: u32,
    pub allowed_cgroups: usize,
    pub endpoints: Vec<EndpointStatus>,
}

#[derive(Debug, Serialize)]
pub(crate) struct EndpointStatus {
    pub name: String,
    pub allowed: u64,
    pub denied: u64,
    pub audited: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct HookCounters {
    pub hook: &'static str,
    pub unmatched: u64,
    pub allowed: u64,
    pub denied: u64,
    pub audited: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct Denial {
    /// Seconds before this status was taken.
    pub age_s: f64,
    pub cgroup_id: u64,
    pub dst: String,
    pub port: u16,
    pub proto: String,
    pub pid: u32,
    pub comm: String,
    pub endpoint: String,
    pub verdict: &'static str,
    pub hook: &'static str,
}

/// CLOCK_MONOTONIC now, in ns: the clock of the kernel programs' timestamps
/// (bpf_ktime_get_ns).
pub(crate) fn monotonic_now_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One line on what the boot step did on this boot.
fn boot_line(boot: Option<&crate::state::BootRecord>) -> String {
    let Some(b) = boot else {
        return "no record for this boot (the boot unit is not installed, or could not start)"
            .into();
    };
    let policy = b.policy.as_deref().unwrap_or("no policy");
    let mut line = if b.closed {
        format!("closed the gate ({policy}, {} cgroups allowed)", b.allowed)
    } else {
        format!("FAILED ({policy})")
    };
    for p in &b.problems {
        line.push_str("; ");
        line.push_str(p);
    }
    line
}

impl Status {
    /// Read the gate pinned under `pin_dir`.
    pub(crate) fn read(pin_dir: &Path, state_dir: &Path) -> Result<Status, LoaderError> {
        let layout = Layout::new(pin_dir);
        let other_versions = pins::other_versions(pin_dir).into_iter().map(|(_, p)| p).collect();
        let mut status = Status {
            pin_dir: pin_dir.to_path_buf(),
            installed: false,
            abi: gate_common::abi::ABI_VERSION,
            other_versions,
            attachments: Vec::new(),
            tc_clsact: Vec::new(),
            cgroup_root: String::new(),
            cgroup_root_id: 0,
            policy: None,
            decisions: Vec::new(),
            events_lost: 0,
            recent_denials: Vec::new(),
            terminate_established: "unknown",
            terminate_scan: TerminateScan::default(),
            lsm: String::new(),
            boot: None,
        };
        if !layout.dir.join("maps").exists() {
            return Ok(status);
        }
        status.attachments = attachments(&layout);
        status.installed = !status.attachments.is_empty();
        status.lsm = lsm_state(&status.attachments).text();
        let maps = Maps::from_pins(&layout)?;
        let info = maps.info()?;
        status.tc_clsact = maps
            .clsact
            .iter()
            .flatten()
            .map(|(key, rec)| {
                let dir = TcDirection::of_clsact_key(key).name();
                let netns = fixed_str_value(&rec.netns);
                format!("{dir} {} {netns}", fixed_str_value(&rec.ifname)).trim_end().to_owned()
            })
            .collect();
        status.tc_clsact.sort();
        status.cgroup_root = fixed_str_value(&info.root_path).to_owned();
        status.cgroup_root_id = info.root_cgroup_id;
        status.terminate_established = TerminateState::from_kernel(info.terminate).name();
        status.terminate_scan =
            TerminateScan { netns: info.terminate_netns, hidden_processes: info.terminate_hidden };
        let generation = maps.active()?;
        let meta = maps.policy_meta(generation)?;
        let names = maps.endpoint_names(generation, meta.endpoints);
        let stats = maps.stats(meta.endpoints)?;
        if info.policy_generation > 0 {
            status.policy = Some(PolicyStatus {
                generation: info.policy_generation,
                hash: format!("{:016x}", info.policy_hash),
                platform: fixed_str_value(&info.platform).to_owned(),
                mode: Mode::from_kernel(meta.mode).name(),
                applied_at_unix_ms: info.applied_at_ms,
                applied_by_pid: info.agent_pid,
                allowed_cgroups: maps.allowed_counts()[generation as usize],
                endpoints: names
                    .iter()
                    .zip(&stats.endpoints)
                    .map(|(name, c)| EndpointStatus {
                        name: name.clone(),
                        allowed: c.allowed,
                        denied: c.denied,
                        audited: c.audited,
                    })
                    .collect(),
            });
        }
        status.decisions = stats
            .decisions
            .iter()
            .enumerate()
            .map(|(hook, row)| HookCounters {
                hook: Hook::from_id(hook as u32).map_or("unknown", Hook::name),
                unmatched: row[Verdict::Unmatched.id() as usize],
                allowed: row[Verdict::Allowed.id() as usize],
                denied: row[Verdict::Denied.id() as usize],
                audited: row[Verdict::Audited.id() as usize],
            })
            .collect();
        status.events_lost = stats.events_lost;
        let now = monotonic_now_ns();
        status.recent_denials = maps
            .recent()?
            .iter()
            .rev()
            .map(|ev| Denial {
                age_s: now.saturating_sub(ev.ts_ns) as f64 / 1e9,
                cgroup_id: ev.cgroup_id,
                dst: ev.dst_text(),
                port: ev.port,
                proto: ev.proto_name(),
                pid: ev.pid,
                comm: ev.comm(),
                endpoint: crate::events::endpoint_name(ev, &names),
                verdict: Verdict::of_event(ev.verdict).name(),
                hook: Hook::of_event(ev.hook).map_or("unknown", Hook::name),
            })
            .collect();
        status.boot = crate::state::StateDir::new(state_dir).this_boot();
        Ok(status)
    }

    pub(crate) fn render_text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "boot step: {}", boot_line(self.boot.as_ref()));
        if !self.installed {
            let _ = writeln!(
                o,
                "gate: not installed (nothing attached under {})",
                self.pin_dir.display()
            );
            for v in &self.other_versions {
                let _ = writeln!(o, "other ABI version pinned: {}", v.display());
            }
            return o;
        }
        let _ = writeln!(o, "gate: installed (ABI v{}) under {}", self.abi, self.pin_dir.display());
        let _ = writeln!(o, "cgroup root: {} (id {})", self.cgroup_root, self.cgroup_root_id);
        for v in &self.other_versions {
            let _ = writeln!(o, "other ABI version pinned: {} (hand-over unfinished)", v.display());
        }
        let _ = writeln!(o, "attached:");
        for a in &self.attachments {
            let _ = write!(
                o,
                "  {:<9} link {:<6} program {:<6} {:<20} tag {}",
                a.attach_point, a.link_id, a.program_id, a.program, a.tag
            );
            if a.run_count > 0 {
                let _ = write!(
                    o,
                    "  {} runs, {:.0} ns/run",
                    a.run_count,
                    a.run_time_ns as f64 / a.run_count as f64
                );
            }
            let _ = writeln!(o);
        }
        for c in &self.tc_clsact {
            let _ = writeln!(o, "  tc (clsact) {c}");
        }
        match &self.policy {
            Some(p) => {
                let applied = UNIX_EPOCH + Duration::from_millis(p.applied_at_unix_ms);
                let ago = SystemTime::now().duration_since(applied).unwrap_or_default().as_secs();
                let _ = writeln!(
                    o,
                    "policy: generation {} hash {} platform {} mode {} ({} s ago by pid {})",
                    p.generation, p.hash, p.platform, p.mode, ago, p.applied_by_pid
                );
                let _ = writeln!(
                    o,
                    "  {} endpoints, {} allowed cgroups",
                    p.endpoints.len(),
                    p.allowed_cgroups
                );
                for e in &p.endpoints {
                    let _ = writeln!(
                        o,
                        "  {:<24} allowed {:<8} denied {:<8} audited {}",
                        e.name, e.allowed, e.denied, e.audited
                    );
                }
            }
            None => {
                let _ = writeln!(o, "policy: none applied");
            }
        }
        let _ = writeln!(o, "lsm: {}", self.lsm);
        let _ = write!(o, "terminate-established: {}", self.terminate_established);
        if self.terminate_established == "on" {
            let _ = write!(o, " (last scan: {} network namespaces", self.terminate_scan.netns);
            if self.terminate_scan.hidden_processes > 0 {
                let _ = write!(
                    o,
                    "; {} gated processes' namespaces not open to the agent: it needs hostPID \
                     and CAP_SYS_PTRACE",
                    self.terminate_scan.hidden_processes
                );
            }
            let _ = write!(o, ")");
        }
        let _ = writeln!(o);
        let _ = writeln!(o, "decisions (unmatched/allowed/denied/audited):");
        for h in
            self.decisions.iter().filter(|h| h.unmatched + h.allowed + h.denied + h.audited > 0)
        {
            let _ = writeln!(
                o,
                "  {:<9} {}/{}/{}/{}",
                h.hook, h.unmatched, h.allowed, h.denied, h.audited
            );
        }
        let _ = writeln!(o, "events lost: {}", self.events_lost);
        let _ = writeln!(o, "recent denials (newest first):");
        for d in &self.recent_denials {
            let _ = writeln!(
                o,
                "  {:>8.1}s ago  {} {}:{}/{} pid {} ({}) cgroup-id {} endpoint {} via {}",
                d.age_s,
                d.verdict,
                d.dst,
                d.port,
                d.proto,
                d.pid,
                d.comm,
                d.cgroup_id,
                d.endpoint,
                d.hook
            );
        }
        o
    }
}

/// The LSM programs enforce where their links are pinned (as `fmod_ret` where those run
/// tracing programs); otherwise the kernel says why not.
fn lsm_state(attachments: &[Attachment]) -> LsmState {
    let pinned = |p: AttachPoint| attachments.iter().find(|a| a.attach_point == p.pin_name());
    let links: Option<Vec<&Attachment>> = AttachPoint::LSM.into_iter().map(pinned).collect();
    if let Some(links) = links {
        let fmod_ret = links.iter().all(|a| a.tracing);
        return if fmod_ret { LsmState::FmodRet } else { LsmState::Active };
    }
    LsmState::Inactive(match bpf_lsm_active() {
        Ok(true) => "the BPF LSM is active, but the programs are not attached (the kernel refused \
             them, or --lsm-programs=false: the agent's log says which)"
            .into(),
        Ok(false) => "the BPF LSM is not active and the programs are not attached as \
                      fmod_ret (the agent's log says why)"
            .into(),
        Err(why) => why,
    })
}

/// How a pinned link's hook reads: a tc link (pinned by ifindex, so that a rename keeps it)
/// as `tc-<direction>-<interface>`, the interface named as the namespace `status` runs in
/// names it (the agent's own, unless it runs with --tc-netns); by its index where that
/// namespace has no such interface.
fn hook_name(pin: String, target: LinkTarget) -> String {
    let (Some((dir, ifindex)), LinkTarget::Ifindex(attached)) =
        (AttachPoint::parse_tc_pin_name(&pin), target)
    else {
        return pin;
    };
    // What if_indextoname(3) does: SIOCGIFNAME on a socket of this namespace.
    use rustix::net::{AddressFamily, SocketType, netdevice::index_to_name, socket};
    let name = socket(AddressFamily::INET, SocketType::DGRAM, None)
        .and_then(|s| index_to_name(s, attached))
        .unwrap_or_else(|_| ifindex.to_string());
    format!("tc-{}-{name}", dir.name())
}

/// The pinned links and the programs they run.
fn attachments(layout: &Layout) -> Vec<Attachment> {
    let programs: Vec<_> = loaded_programs().flatten().collect();
    layout
        .links()
        .into_iter()
        .filter_map(|hook| {
            let info = pins::pinned_link_info(layout, &hook).ok()?;
            let prog = programs.iter().find(|p| p.id() == info.prog_id);
            let kernel_name = prog.and_then(|p| p.name_as_str()).unwrap_or("?");
            Some(Attachment {
                program: Program::from_kernel_name(kernel_name)
                    .map_or_else(|| kernel_name.to_owned(), |p| p.name().to_owned()),
                tag: prog.map(|p| format!("{:016x}", p.tag())).unwrap_or_default(),
                attach_point: hook_name(hook, info.target),
                link_id: info.id,
                program_id: info.prog_id,
                target_id: info.target.id(),
                run_count: prog.map_or(0, |p| p.run_count()),
                run_time_ns: prog.map_or(0, |p| p.run_time().as_nanos() as u64),
                tracing: prog.is_some_and(|p| {
                    p.program_type() == aya_obj::generated::bpf_prog_type::BPF_PROG_TYPE_TRACING
                }),
            })
        })
        .collect()
}
