//! The node-level programs (`gate_tc`, and `gate_tc_l3` where packets do not start with an
//! Ethernet header) on interfaces: attaching it where a [`TcPlan`] says,
//! swapping it in place on upgrade, re-attaching what someone removed, and detaching it from
//! interfaces the plan no longer names. Which interfaces those are is decided above, by
//! [`crate::node`]; this module only makes the kernel match the plan.
//!
//! * **tcx** (kernel 6.6+): links pinned under `links/tc-<dir>-<ifindex>` like the cgroup links,
//!   so they outlive the agent and are swapped in place (BPF_LINK_UPDATE) on upgrade. New
//!   links go first in the interface's tcx order, ahead of CNI programs that might redirect
//!   a frame past us; a link keeps its place when its program is swapped.
//! * **clsact** (older kernels, RHEL 9): a cls_bpf filter with our fixed priority and handle.
//!   The kernel keeps it after the agent exits; a new agent replaces it in place (netlink
//!   replace of the same priority/handle). Filters are recorded in the TC_CLSACT map so that
//!   `cleanup` can find and remove them.
//!
//! What the program does not drop goes on to whatever else is attached (TCX_NEXT /
//! TC_ACT_UNSPEC), so it shares interfaces with the CNI.
use std::{
    collections::{BTreeMap, BTreeSet},
    os::fd::{AsFd as _, OwnedFd},
    path::PathBuf,
};

use aya::{
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        links::FdLink,
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    },
    util::KernelVersion,
};
use gate_common::{
    abi::{TcClsact, fixed_str, fixed_str_value, names},
    user::{AttachPoint, Program, TcDirection},
};

use super::{Gate, LinkTarget, LoaderError, map_err, sys};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcHandle as NlTcHandle, TcHeader, TcMessage},
};

use crate::{
    netlink::{DUMP, NetlinkError, NlSocket},
    netns::{self, Netns},
};

/// How tc programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum TcMode {
    /// tcx where the kernel has it (6.6+), else clsact.
    #[default]
    Auto,
    Tcx,
    Clsact,
}

/// What an interface's packets start with at tc, which decides the program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Framing {
    /// An Ethernet header (`gate_tc`).
    Ethernet,
    /// Anything else, or nothing: read at the kernel's network header (`gate_tc_l3`).
    Network,
}

impl Framing {
    pub(crate) fn program(self) -> Program {
        match self {
            Framing::Ethernet => Program::Tc,
            Framing::Network => Program::TcL3,
        }
    }
}

/// One interface and direction the program belongs on, and the variant.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct TcTarget {
    pub ifindex: u32,
    pub name: String,
    pub direction: TcDirection,
    pub framing: Framing,
}

/// Where the program should be attached: every target, in one network namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TcPlan {
    pub targets: BTreeSet<TcTarget>,
    /// Workload-facing interfaces (ifindex) where only an allowed gated socket passes.
    pub strict: BTreeSet<u32>,
    /// Interfaces (ifindex) whose forwarded traffic the uplinks let through.
    pub trusted: BTreeSet<u32>,
    /// Network namespace of the interfaces (a /run/netns/ or /proc/PID/ns/net path); default
    /// the agent's own.
    pub netns: Option<PathBuf>,
    pub mode: TcMode,
}

/// What one [`Gate::sync_tc`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TcReport {
    /// Newly attached (including re-attached after someone removed ours).
    pub attached: Vec<TcTarget>,
    /// Attachments that had gone missing (detached link, deleted filter) and were restored.
    pub repaired: Vec<TcTarget>,
    /// Programs swapped in place (agent start).
    pub replaced: usize,
    /// Pin names or `<dir> <iface>` of attachments removed because the plan dropped them.
    pub removed: Vec<String>,
    /// Targets that could not be attached, with the reason; the others were.
    pub failed: Vec<(TcTarget, String)>,
    /// tcx links attached but not pinned (the pin failed): the agent holds them open, so the
    /// interface stays guarded while it runs, and pins them when it can. Listed in `failed`
    /// too.
    pub held: usize,
}

/// Priority and handle of our clsact filters: fixed, so that a new agent replaces the old
/// agent's filter in place and keeps its place among the interface's filters.
const CLSACT_PRIORITY: u16 = 0x4d47;
const CLSACT_HANDLE: TcHandle = TcHandle::new(0, 0x4d47);

fn use_tcx(mode: TcMode) -> bool {
    match mode {
        TcMode::Tcx => true,
        TcMode::Clsact => false,
        TcMode::Auto => KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0)),
    }
}

fn attach_type(dir: TcDirection) -> TcAttachType {
    match dir {
        TcDirection::Ingress => TcAttachType::Ingress,
        TcDirection::Egress => TcAttachType::Egress,
    }
}

impl Gate {
    /// Make the tc attachments match `plan`: attach where missing, restore what was removed,
    /// swap the program of existing attachments when `update` (agent start), and detach from
    /// interfaces the plan no longer names. A target that fails is reported and the rest go
    /// on; an error means the namespace could not be entered, and nothing was changed.
    pub(crate) fn sync_tc(&mut self, plan: &TcPlan, update: bool) -> Result<TcReport, LoaderError> {
        let layout = self.layout.clone();
        let ebpf = &mut self.ebpf;
        let clsact_map = &mut self.maps.clsact;
        let strict_map = &mut self.maps.strict;
        let trusted_map = &mut self.maps.trusted;
        let clsact_done = &mut self.clsact_done;
        let held = &mut self.held_tc;
        let tcx = use_tcx(plan.mode);
        let netns_str =
            plan.netns.as_deref().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        let target = plan.netns.as_deref().map_or(Netns::Current, Netns::Path);
        netns::run_in(target, "mg-tc", move || {
            let mut report = TcReport::default();
            // Interface roles first, so a newly attached interface has its role from its first
            // frame.
            sync_set(strict_map, &plan.strict, names::STRICT_IFACES)?;
            sync_set(trusted_map, &plan.trusted, names::TRUSTED_IFACES)?;
            if tcx {
                let mut wanted = BTreeSet::new();
                // The kernel's id of each variant, read once: a link that runs the other is
                // swapped.
                let mut ids = BTreeMap::new();
                for f in [Framing::Ethernet, Framing::Network] {
                    let p: &mut SchedClassifier = super::program(ebpf, f.program())?;
                    let perr = |source| LoaderError::Program { name: f.program().name(), source };
                    ids.insert(f, p.info().map_err(perr)?.id());
                }
                for t in &plan.targets {
                    let pin = AttachPoint::tc_pin_name(t.direction, t.ifindex);
                    wanted.insert(pin.clone());
                    let prog: &mut SchedClassifier = super::program(ebpf, t.framing.program())?;
                    let id = ids.get(&t.framing).copied().unwrap_or_default();
                    match sync_tcx(prog, id, &layout, held, t, &pin, update) {
                        Ok(Tcx::Kept) => {}
                        Ok(Tcx::Replaced) => report.replaced += 1,
                        Ok(Tcx::Attached) => report.attached.push(t.clone()),
                        Ok(Tcx::Repaired) => {
                            report.attached.push(t.clone());
                            report.repaired.push(t.clone());
                        }
                        Err(e) => report.failed.push((t.clone(), e.to_string())),
                    }
                }
                for pin in layout.links().into_iter().filter(|h| h.starts_with("tc-")) {
                    if !wanted.contains(&pin) {
                        let _ = std::fs::remove_file(layout.link(&pin));
                        report.removed.push(pin);
                    }
                }
                // A held link whose interface the plan dropped is closed, as a pin is removed.
                held.retain(|pin, _| wanted.contains(pin));
                report.held = held.len();
                return Ok(report);
            }
            let mut rtnl =
                NlSocket::open(libc::NETLINK_ROUTE as isize, std::time::Duration::from_secs(5))
                    .map_err(|e| LoaderError::Tc(format!("rtnetlink socket: {e}")))?;
            let mut wanted = BTreeSet::new();
            for t in &plan.targets {
                let key = t.direction.clsact_key(t.ifindex);
                wanted.insert(key);
                let present = clsact_present(&mut rtnl, t.ifindex, t.direction).unwrap_or(false);
                // Kept unless this agent put the other variant there (the interface's link
                // type changed: a bond that took its first slave's).
                let other = clsact_done.get(&key).is_some_and(|f| *f != t.framing);
                if present && !update && !other {
                    // The filter stays on a renamed interface; its record follows the name,
                    // which is how cleanup finds it.
                    let rec = TcClsact { ifname: fixed_str(&t.name), netns: fixed_str(&netns_str) };
                    if clsact_map.get(&key, 0).ok().is_some_and(|r| r.ifname != rec.ifname) {
                        clsact_map.insert(key, rec, 0).map_err(map_err(names::TC_CLSACT))?;
                    }
                    clsact_done.entry(key).or_insert(t.framing);
                    continue;
                }
                let prog: &mut SchedClassifier = super::program(ebpf, t.framing.program())?;
                match attach_clsact(prog, &t.name, attach_type(t.direction)) {
                    Ok(()) => {
                        let rec =
                            TcClsact { ifname: fixed_str(&t.name), netns: fixed_str(&netns_str) };
                        clsact_map.insert(key, rec, 0).map_err(map_err(names::TC_CLSACT))?;
                        if present {
                            report.replaced += 1;
                        } else {
                            if clsact_done.contains_key(&key) {
                                report.repaired.push(t.clone());
                            }
                            report.attached.push(t.clone());
                        }
                        clsact_done.insert(key, t.framing);
                    }
                    Err(e) => report.failed.push((t.clone(), e.to_string())),
                }
            }
            let recorded: Vec<(u64, TcClsact)> = clsact_map.iter().flatten().collect();
            for (key, rec) in recorded {
                if !wanted.contains(&key) {
                    let dir = TcDirection::of_clsact_key(key);
                    detach_clsact(&rec, dir);
                    let _ = clsact_map.remove(&key);
                    clsact_done.remove(&key);
                    report.removed.push(format!("{} {}", dir.name(), fixed_str_value(&rec.ifname)));
                }
            }
            Ok(report)
        })?
    }
}

/// Make the set of ifindexes `map` holds `wanted`.
fn sync_set(
    map: &mut aya::maps::HashMap<aya::maps::MapData, u32, u32>,
    wanted: &BTreeSet<u32>,
    name: &'static str,
) -> Result<(), LoaderError> {
    let present: BTreeSet<u32> = map.keys().flatten().collect();
    for i in wanted.difference(&present) {
        map.insert(*i, 1, 0).map_err(map_err(name))?;
    }
    for i in present.difference(wanted) {
        let _ = map.remove(i);
    }
    Ok(())
}

/// What [`sync_tcx`] did for one target.
enum Tcx {
    Kept,
    Replaced,
    Attached,
    /// The pinned link had been detached (interface recreated, someone detached it).
    Repaired,
}

fn sync_tcx(
    prog: &mut SchedClassifier,
    prog_id: u32,
    layout: &super::Layout,
    held: &mut BTreeMap<String, OwnedFd>,
    t: &TcTarget,
    pin: &str,
    update: bool,
) -> Result<Tcx, LoaderError> {
    let path = layout.link(pin);
    let name = t.framing.program().name();
    let perr = |source| LoaderError::Program { name, source };
    let pin_err = |source| LoaderError::Io {
        what: "pinning link (held open by the agent: the interface stays guarded; pinned again at every sync)",
        path: path.clone(),
        source,
    };
    // A link whose pin failed before: pin it now if the path is free, else keep holding it.
    if let Some(fd) = held.get(pin) {
        let here =
            sys::link_info(fd.as_fd()).is_ok_and(|i| i.target == LinkTarget::Ifindex(t.ifindex));
        if !here {
            held.remove(pin);
        } else if !path.exists() {
            sys::obj_pin(fd.as_fd(), &path).map_err(pin_err)?;
            held.remove(pin);
        } else {
            return Err(pin_err(std::io::Error::from_raw_os_error(libc::EEXIST)));
        }
    }
    let was_pinned = path.exists();
    // What sits at the pin name but is no link of ours there (an unreadable file, a link of a
    // gone interface) is removed if it can be; if it cannot, the new link is held below.
    let pinned = if was_pinned { sys::obj_get(&path).ok() } else { None };
    if let Some(fd) = pinned {
        // Still attached to this very interface.
        if let Ok(info) = sys::link_info(fd.as_fd())
            && info.target == LinkTarget::Ifindex(t.ifindex)
        {
            // The other variant is there when the interface's link type changed.
            if !update && info.prog_id == prog_id {
                return Ok(Tcx::Kept);
            }
            super::replace_program(fd.as_fd(), prog.fd().map_err(perr)?.as_fd(), &path)?;
            return Ok(Tcx::Replaced);
        }
    }
    if was_pinned {
        let _ = std::fs::remove_file(&path);
    }
    let id = prog
        .attach_with_options(&t.name, attach_type(t.direction), TcAttachOptions::TcxOrder(LinkOrder::first()))
        .map_err(|e| {
            LoaderError::Tc(format!(
                "attaching to {} of {} (tcx needs kernel 6.6+; --tc-mode clsact for older kernels): {e}",
                t.direction, t.name
            ))
        })?;
    let link = FdLink::try_from(prog.take_link(id).map_err(perr)?)
        .map_err(|source| LoaderError::Link { name, source })?;
    // A descriptor of our own, so that a pin that fails does not take the link with it.
    let link_id = link.info().map_err(|source| LoaderError::Link { name, source })?.id();
    let fd = sys::link_fd_by_id(link_id).map_err(|source| LoaderError::Io {
        what: "opening the new link by id",
        path: path.clone(),
        source,
    })?;
    drop(link);
    if let Err(e) = sys::obj_pin(fd.as_fd(), &path) {
        held.insert(pin.to_owned(), fd);
        return Err(pin_err(e));
    }
    Ok(if was_pinned && !update { Tcx::Repaired } else { Tcx::Attached })
}

/// Attach (or replace in place) our clsact filter on `iface` and leave it in the kernel.
fn attach_clsact(
    prog: &mut SchedClassifier,
    iface: &str,
    attach_type: TcAttachType,
) -> Result<(), LoaderError> {
    let err = |e: String| LoaderError::Tc(format!("clsact on {iface}: {e}"));
    match tc::qdisc_add_clsact(iface) {
        Ok(()) => {}
        Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(e) => return Err(err(format!("adding the clsact qdisc: {e}"))),
    }
    // Replace the filter a previous agent left (same priority and handle) in one step; if
    // there is none, create it.
    let replaced =
        SchedClassifierLink::attached(iface, attach_type, CLSACT_PRIORITY, CLSACT_HANDLE, None)
            .map_err(|e| err(e.to_string()))
            .and_then(|old| prog.attach_to_link(old).map_err(|e| err(e.to_string())));
    let id = match replaced {
        Ok(id) => id,
        Err(_) => prog
            .attach_with_options(
                iface,
                attach_type,
                TcAttachOptions::Netlink(NlOptions {
                    priority: CLSACT_PRIORITY,
                    handle: CLSACT_HANDLE,
                    classid: None,
                }),
            )
            .map_err(|e| err(e.to_string()))?,
    };
    let link = prog.take_link(id).map_err(|e| err(e.to_string()))?;
    // Dropping the link would remove the filter: the kernel keeps it after we exit.
    std::mem::forget(link);
    Ok(())
}

/// Whether our clsact filter (our priority and handle) is on `ifindex` in `dir`. Only the
/// filter's header is read: a filter of someone else's that the crate cannot parse does not
/// hide ours.
fn clsact_present(
    sock: &mut NlSocket,
    ifindex: u32,
    dir: TcDirection,
) -> Result<bool, NetlinkError> {
    let minor = match dir {
        TcDirection::Ingress => NlTcHandle::MIN_INGRESS,
        TcDirection::Egress => NlTcHandle::MIN_EGRESS,
    };
    let mut req = TcMessage::with_index(ifindex as i32);
    req.header.parent = NlTcHandle { major: NlTcHandle::CLSACT.major, minor };
    let mut found = false;
    let r = sock.request(RouteNetlinkMessage::GetTrafficFilter(req), DUMP, |ty, payload| {
        found |= ty == libc::RTM_NEWTFILTER
            && TcHeader::parse(payload).is_ok_and(|h| {
                u32::from(h.handle) == u32::from(CLSACT_HANDLE)
                    && (h.info >> 16) as u16 == CLSACT_PRIORITY
            });
        Ok(())
    });
    match r {
        Ok(()) => Ok(found),
        // No clsact qdisc on the interface (EINVAL / ENOENT): no filter either.
        Err(NetlinkError::Kernel(libc::EINVAL | libc::ENOENT)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Remove our clsact filter recorded in `rec` (best effort: the interface or netns may be gone).
fn detach_clsact(rec: &TcClsact, dir: TcDirection) {
    let iface = fixed_str_value(&rec.ifname).to_owned();
    let netns = fixed_str_value(&rec.netns);
    let netns = (!netns.is_empty()).then(|| PathBuf::from(netns));
    let target = netns.as_deref().map_or(Netns::Current, Netns::Path);
    let r = netns::run_in(target, "mg-tc", || {
        tc::qdisc_detach_program(&iface, attach_type(dir), Program::Tc.name())
            .map_err(|e| LoaderError::Tc(e.to_string()))
    })
    .map_err(LoaderError::from)
    .and_then(|r| r);
    match r {
        Ok(()) => tracing::info!(interface = %iface, "tc clsact filter removed"),
        Err(e) => tracing::warn!(interface = %iface, error = %e, "removing tc clsact filter"),
    }
}

/// Remove every clsact filter recorded in the pinned TC_CLSACT map of `version_dir` (part of
/// `cleanup`, and of retiring another ABI version).
pub(super) fn cleanup_clsact(version_dir: &std::path::Path) {
    let path = version_dir.join("maps").join(names::TC_CLSACT);
    let Ok(data) = aya::maps::MapData::from_pin(path) else { return };
    let Ok(map) = aya::maps::Map::from_map_data(data) else { return };
    let Ok(map) = aya::maps::HashMap::<_, u64, TcClsact>::try_from(map) else { return };
    for (key, rec) in map.iter().flatten() {
        detach_clsact(&rec, TcDirection::of_clsact_key(key));
    }
}
