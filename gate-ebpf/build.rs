//! Rebuild when the bpf-linker on PATH changes (an undeclared dependency of the eBPF build).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
