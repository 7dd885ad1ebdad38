//! The gate's packet programs run on hand-built frames with BPF_PROG_TEST_RUN, through aya's
//! [`TestRun`]: the benchmark's fast-path cost (scenario 8) and the program-level tests
//! (`progrun`). The kernel runs a program there on a copy of the bytes, outside any
//! interface, and hands back its return code.
use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow};
use aya::programs::{
    CgroupSkb, CgroupSkbAttachType, ProgramInfo, SchedClassifier, TestRun as _, TestRunOptions,
    loaded_programs,
};

/// A loaded packet program BPF_PROG_TEST_RUN can run.
pub enum SkbProgram {
    /// `gate_tc` (a tc classifier): it sees the frame from its Ethernet header on.
    Tc(SchedClassifier),
    /// `gate_egress` (cgroup_skb/egress): it sees the packet from its IP header on (the
    /// kernel takes the frame's Ethernet header off first).
    Egress(CgroupSkb),
}

/// Which kind of packet program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Tc,
    Egress,
}

/// One run's outcome.
#[derive(Clone, Copy, Debug)]
pub struct Ran {
    /// The program's return code.
    pub code: u32,
    /// Mean time per run, as the kernel measured it (one clock read for all runs).
    pub per_run: Duration,
}

impl SkbProgram {
    /// The loaded program `id` (of `kind`: checked against the kernel's program type).
    pub fn by_id(id: u32, kind: Kind) -> Result<SkbProgram> {
        let info = loaded_programs()
            .filter_map(Result::ok)
            .find(|p| p.id() == id)
            .ok_or_else(|| anyhow!("no loaded program {id}"))?;
        Self::from_info(info, kind).with_context(|| format!("program {id}"))
    }

    fn from_info(info: ProgramInfo, kind: Kind) -> Result<SkbProgram> {
        let name = info.name_as_str().unwrap_or("?").to_owned().into();
        Ok(match kind {
            Kind::Tc => SkbProgram::Tc(SchedClassifier::from_program_info(info, name)?),
            Kind::Egress => SkbProgram::Egress(CgroupSkb::from_program_info(
                info,
                name,
                Some(CgroupSkbAttachType::Egress),
            )?),
        })
    }

    /// The program pinned at `path` (the agent pins each attach point's program as
    /// `<pin dir>/v<abi>/progs/<attach point>`).
    pub fn from_pin(path: &Path, kind: Kind) -> Result<SkbProgram> {
        let what = || format!("program pinned at {}", path.display());
        Ok(match kind {
            Kind::Tc => SkbProgram::Tc(SchedClassifier::from_pin(path).with_context(what)?),
            Kind::Egress => SkbProgram::Egress(
                CgroupSkb::from_pin(path, CgroupSkbAttachType::Egress).with_context(what)?,
            ),
        })
    }

    /// Run the program `repeat` times on `frame` (an Ethernet frame, at least 14 bytes: the
    /// kernel rejects shorter input).
    pub fn run(&self, frame: &[u8], repeat: u32) -> Result<Ran> {
        let opts = TestRunOptions { data_in: Some(frame), repeat, ..TestRunOptions::default() };
        let r = match self {
            SkbProgram::Tc(p) => p.test_run(opts),
            SkbProgram::Egress(p) => p.test_run(opts),
        }
        .context("BPF_PROG_TEST_RUN")?;
        Ok(Ran { code: r.return_value, per_run: r.duration })
    }
}

/// `enum bpf_cmd`: BPF_PROG_LOAD.
const BPF_PROG_LOAD: libc::c_long = 5;
/// `enum bpf_prog_type`: BPF_PROG_TYPE_SCHED_CLS.
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;

/// An empty tc program (`return TC_ACT_UNSPEC`): the floor of the test-run loop. Loaded by
/// hand: aya loads programs only out of an ELF object, and this one is two instructions.
pub fn empty_tc() -> Result<SkbProgram> {
    // r0 = -1; exit
    let insns: [u8; 16] = [0xb7, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x95, 0, 0, 0, 0, 0, 0, 0];
    let license = c"GPL";
    // union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns, license; the rest zero.
    let mut attr = [0u8; 128];
    attr[..4].copy_from_slice(&BPF_PROG_TYPE_SCHED_CLS.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    // SAFETY: bpf(2) with an attribute buffer of the size given, whose pointers (`insns`,
    // `license`) outlive the call.
    let fd = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, attr.as_mut_ptr(), attr.len() as u32)
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("loading an empty program");
    }
    // SAFETY: a descriptor bpf(2) just returned, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // Its id, from the descriptor's fdinfo; aya then holds a descriptor of its own.
    let fdinfo = format!("/proc/self/fdinfo/{}", fd.as_raw_fd());
    let text = std::fs::read_to_string(&fdinfo).with_context(|| format!("reading {fdinfo}"))?;
    let id = text
        .lines()
        .find_map(|l| l.strip_prefix("prog_id:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow!("no prog_id in {fdinfo}"))?;
    SkbProgram::by_id(id, Kind::Tc)
}

/// The id of the loaded program named `name` (the kernel keeps 15 bytes of it) that uses the
/// gate's CONFIG map pinned under `versioned` (`<pin dir>/v<abi>`): that gate's program, not
/// another agent's.
pub fn gate_program_id(versioned: &Path, name: &str) -> Result<u32> {
    let config = versioned.join("maps/CONFIG");
    let map_id = aya::maps::MapInfo::from_pin(&config)
        .with_context(|| format!("opening {}", config.display()))?
        .id();
    let short = &name.as_bytes()[..name.len().min(15)];
    loaded_programs()
        .filter_map(Result::ok)
        .find(|p| {
            p.name() == short && p.map_ids().ok().flatten().is_some_and(|m| m.contains(&map_id))
        })
        .map(|p| p.id())
        .ok_or_else(|| anyhow!("no program {name} of the gate at {}", versioned.display()))
}
