//! Running commands from the workspace root.
use std::{
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

/// The workspace root (xtask lives one level below it).
pub(crate) fn root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// Run a command in the workspace root, echoing it; fail on non-zero exit.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    cmd.current_dir(root());
    eprintln!("\x1b[1m$ {}\x1b[0m", show(cmd));
    let status = cmd.status().with_context(|| format!("starting {}", show(cmd)))?;
    if !status.success() {
        bail!("{} failed: {status}", show(cmd));
    }
    Ok(())
}

/// A command from one line of words separated by spaces (no quoting: for fixed arguments).
pub(crate) fn cmd(line: &str) -> Command {
    let mut words = line.split_whitespace();
    let mut cmd = Command::new(words.next().unwrap_or_default());
    cmd.args(words);
    cmd
}

/// Run quietly and capture stdout; None if the program is missing or fails.
pub(crate) fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(crate) fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// How xtask reads YAML into untyped values: YAML 1.2 booleans only (`n`, `yes` and `on` stay
/// strings), as serde_yaml did and as the agent reads policies.
pub(crate) fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! { strict_booleans: true }
}
