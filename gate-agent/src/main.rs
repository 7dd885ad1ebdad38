//! gate-agent: the metadata-gate node agent. The commands live in the library
//! (`commands`), so that every other module can stay private to it.
fn main() -> std::process::ExitCode {
    gate_agent::commands::main()
}
