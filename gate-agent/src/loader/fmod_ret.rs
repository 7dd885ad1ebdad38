//! The LSM programs loaded as `fmod_ret` programs on the kernel's `security_socket_*`
//! functions, for kernels that do not run the BPF LSM (`bpf` missing from `lsm=`: Ubuntu,
//! Flatcar) but have BPF trampolines. The verifier lets `fmod_ret` change the return of any
//! `security_*` function (5.7+); a non-zero return skips the function and is what the
//! syscall returns, as an LSM denial is. The instructions are the LSM programs' own: the
//! `bpf_lsm_<hook>` stubs and `security_<hook>` take the same arguments, so one program
//! reads both contexts alike and the verdicts cannot drift apart.
//!
//! aya 0.14 has no `fmod_ret` program type, so the object is parsed again with aya's own
//! parser (aya-obj), relocated against the pinned maps, and loaded with bpf(2) ([`sys`]).
use std::{
    collections::HashSet,
    ffi::CString,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd, RawFd},
};

use aya::Btf;
use aya_obj::{Object, btf::BtfKind, generated::bpf_insn};
use gate_common::{abi::names, user::AttachPoint};

use super::{pins::Layout, sys};

/// The three programs, loaded and not yet attached.
pub(crate) struct FmodRet {
    progs: Vec<(AttachPoint, OwnedFd)>,
}

impl FmodRet {
    /// The loaded program of an LSM attach point.
    pub(super) fn prog(&self, point: AttachPoint) -> Option<BorrowedFd<'_>> {
        self.progs.iter().find(|(p, _)| *p == point).map(|(_, fd)| fd.as_fd())
    }
}

/// The kernel function an LSM attach point's program modifies the return of.
fn security_function(point: AttachPoint) -> Option<String> {
    point.lsm_hook().map(|hook| format!("security_{hook}"))
}

/// Load every LSM program as `fmod_ret`, or say why not (the first failure).
pub(super) fn load(object: &[u8], layout: &Layout, btf: &Btf) -> Result<FmodRet, String> {
    // The instructions name the maps by these descriptors until the kernel has loaded them.
    let mut fds: Vec<OwnedFd> = Vec::new();
    let relocated = relocate(object, |name| {
        let fd = sys::obj_get(&layout.map(name))
            .map_err(|e| format!("opening the pinned map {name}: {e}"))?;
        let raw = fd.as_raw_fd();
        fds.push(fd);
        Ok(raw)
    })?;
    let mut progs = Vec::new();
    for Relocated { point, name, instructions, license } in relocated {
        let target = security_function(point).unwrap_or_default();
        let id = btf
            .id_by_type_name_kind(&target, BtfKind::Func)
            .map_err(|e| format!("{target} in the kernel's BTF: {e}"))?;
        let fd = sys::prog_load_fmod_ret(name, &instructions, &license, id)
            .map_err(|e| format!("the kernel rejected {name} as fmod_ret on {target}: {e}"))?;
        progs.push((point, fd));
    }
    Ok(FmodRet { progs })
}

/// One LSM program, ready for the kernel.
struct Relocated {
    point: AttachPoint,
    name: &'static str,
    instructions: Vec<bpf_insn>,
    license: CString,
}

/// The LSM programs of `object`, their calls linked and their maps named by the descriptor
/// `map_fd` gives for each pinned map.
fn relocate(
    object: &[u8],
    mut map_fd: impl FnMut(&str) -> Result<RawFd, String>,
) -> Result<Vec<Relocated>, String> {
    let mut obj = Object::parse(object).map_err(|e| format!("parsing the eBPF object: {e}"))?;
    // As aya does: every section holding a function takes part in call relocation.
    let text_sections: HashSet<usize> = obj.functions.keys().map(|(section, _)| *section).collect();
    // Only the LSM programs and the shared text are relocated: the other programs use a map
    // that is not pinned (.rodata), and aya loads them.
    let program_sections: HashSet<usize> = obj.programs.values().map(|p| p.section_index).collect();
    let wanted = |name: &str| AttachPoint::LSM.iter().any(|p| p.program().name() == name);
    obj.programs.retain(|name, _| wanted(name));
    let lsm_sections: HashSet<usize> = obj.programs.values().map(|p| p.section_index).collect();
    obj.functions.retain(|(section, _), _| {
        lsm_sections.contains(section) || !program_sections.contains(section)
    });
    let obj_maps = std::mem::take(&mut obj.maps);
    let mut maps = Vec::new();
    for (name, map) in obj_maps.iter().filter(|(name, _)| names::ALL.contains(&name.as_str())) {
        maps.push((name.as_str(), map_fd(name)?, map));
    }
    obj.relocate_maps(maps.into_iter(), &text_sections)
        .map_err(|e| format!("relocating maps: {e}"))?;
    obj.relocate_calls(&text_sections).map_err(|e| format!("relocating calls: {e}"))?;
    AttachPoint::LSM
        .into_iter()
        .map(|point| {
            let name = point.program().name();
            let program =
                obj.programs.get(name).ok_or_else(|| format!("{name} missing from the object"))?;
            let function = obj
                .functions
                .get(&program.function_key())
                .ok_or_else(|| format!("{name}: no instructions"))?;
            Ok(Relocated {
                point,
                name,
                instructions: function.instructions.clone(),
                license: program.license.clone(),
            })
        })
        .collect()
}

/// Attach a loaded program; the link keeps it attached once pinned.
pub(super) fn attach(prog: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    sys::raw_tracepoint_open(prog)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `BPF_LD | BPF_IMM | BPF_DW` with `src_reg` BPF_PSEUDO_MAP_FD: a map named by descriptor.
    fn map_fds(insns: &[bpf_insn]) -> Vec<i32> {
        insns.iter().filter(|i| i.code == 0x18 && i.src_reg() == 1).map(|i| i.imm).collect()
    }

    #[test]
    fn the_lsm_programs_are_relocated_against_the_pinned_maps_alone() {
        let fds: Vec<(String, RawFd)> = names::ALL
            .iter()
            .enumerate()
            .map(|(i, n)| ((*n).to_owned(), 1000 + i as i32))
            .collect();
        let progs = relocate(super::super::OBJECT, |name| {
            fds.iter().find(|(n, _)| n == name).map(|(_, fd)| *fd).ok_or(name.to_owned())
        })
        .expect("relocated");
        let points: Vec<AttachPoint> = progs.iter().map(|p| p.point).collect();
        assert_eq!(points, AttachPoint::LSM);
        for p in &progs {
            // LSM and tracing programs must be GPL to use the helpers they call.
            assert_eq!(p.license.to_str(), Ok("GPL"), "{}", p.name);
            let used = map_fds(&p.instructions);
            assert!(!used.is_empty(), "{}: reads no map", p.name);
            for fd in used {
                assert!(fds.iter().any(|(_, f)| *f == fd), "{}: map fd {fd} not supplied", p.name);
            }
            // No call into another function is left unlinked: a call with src_reg 1
            // (BPF_PSEUDO_CALL) must land inside the program.
            let len = p.instructions.len() as i32;
            for (at, i) in p.instructions.iter().enumerate() {
                if i.code == 0x85 && i.src_reg() == 1 {
                    let to = at as i32 + 1 + i.imm;
                    assert!((0..len).contains(&to), "{}: call at {at} leaves the program", p.name);
                }
            }
            assert_eq!(
                security_function(p.point).map(|f| f.starts_with("security_socket_")),
                Some(true)
            );
        }
    }

    #[test]
    fn a_map_that_cannot_be_opened_is_named() {
        let Err(e) = relocate(super::super::OBJECT, |name| Err(format!("no {name}"))) else {
            panic!("relocated without maps")
        };
        assert!(e.starts_with("no "), "{e}");
    }
}
