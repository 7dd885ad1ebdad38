//! `gate-agent boot`: close the gate on every boot before the kubelet starts, the first one
//! included.
//!
//! A reboot empties bpffs, and a new node has no gate at all, while the kubelet starts pods
//! (tolerate-all DaemonSets among them) before the DaemonSet's agent is ready. A systemd unit
//! ordered before the kubelet runs this step: it does what the agent does at start —
//! [`engine::bring_up`]: the cgroup hooks, the node-level programs on every interface there
//! is, the LSM programs — pins it all and exits. The agent adopts the gate when it comes up.
//!
//! The policy, in order: the last good one the agent kept in the state dir (with its allow
//! set); else, on a first boot or when the kept state is unreadable or invalid, the
//! installed one (`--policy`, or the policy shipped for `--platform`) with nothing allowed.
//! Either way every gated workload is denied until the agent resolves its allow list; the
//! components that must reach the metadata service retry (docs: "New nodes and reboots").
//! No policy at all is an error: the unit fails and, by its ordering, holds the kubelet.
use std::{
    path::PathBuf,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, anyhow};
use gate_common::user::AllowSet;

use crate::{
    cgroup::GatedRoot,
    cli::BootArgs,
    config::Scope,
    engine,
    loader::Layout,
    node::NodeLevel,
    policy::{
        Policy,
        detect::{self, Dmi},
        shipped,
    },
    state::{BootRecord, StateDir, boot_id},
};

/// Where the installed policy comes from when nothing valid was kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Installed {
    File(PathBuf),
    Platform(String),
    /// The platform the node names: its kernel command line, else its firmware's DMI strings.
    Auto,
    None,
}

impl Installed {
    fn from_args(policy: Option<PathBuf>, platform: Option<String>) -> Installed {
        match (policy, platform) {
            (Some(f), _) => Installed::File(f),
            (None, Some(p)) if p == "auto" => Installed::Auto,
            (None, Some(p)) => Installed::Platform(p),
            (None, None) => Installed::None,
        }
    }

    /// The installed policy's (source, text); `cmdline` and `dmi` are the node's, for `Auto`.
    fn read(&self, cmdline: &str, dmi: &Dmi) -> Result<(String, String)> {
        match self {
            Installed::File(f) => {
                let text = std::fs::read_to_string(f)
                    .with_context(|| format!("--policy {}", f.display()))?;
                Ok((format!("installed {}", f.display()), text))
            }
            Installed::Platform(p) => Ok((format!("shipped for {p}"), shipped::policy_for(p)?)),
            Installed::Auto => {
                let (p, by) = detect::from_ignition(cmdline)
                    .map(|p| (p, "ignition.platform.id".to_owned()))
                    .or_else(|| detect::from_dmi(dmi).map(|(p, field)| (p, format!("DMI {field}"))))
                    .ok_or_else(|| {
                        anyhow!(
                            "--platform auto: neither the kernel command line's \
                             ignition.platform.id nor the DMI strings (sys_vendor, \
                             product_name, chassis_asset_tag) name a known platform; pass \
                             --platform or --policy"
                        )
                    })?;
                Ok((format!("shipped for {p} ({by})"), shipped::policy_for(p.name())?))
            }
            Installed::None => Err(anyhow!("no --policy or --platform to fall back on")),
        }
    }
}

/// The policy to close the gate with: the kept one if it reads and validates, else the
/// installed one. `kept` is whether it is the kept one (only then does the kept allow set
/// belong to it). What was wrong with the kept state is pushed on `problems`.
pub(crate) fn choose(
    kept: std::io::Result<String>,
    kept_source: &str,
    installed: impl FnOnce() -> Result<(String, String)>,
    problems: &mut Vec<String>,
) -> Result<(Policy, String, bool)> {
    match kept
        .map_err(|e| e.to_string())
        .and_then(|t| Policy::parse(kept_source, &t).map_err(|e| format!("invalid, rejected: {e}")))
    {
        Ok(p) => return Ok((p, format!("kept {kept_source}"), true)),
        Err(e) => problems.push(format!("kept policy {kept_source}: {e}")),
    }
    let (source, text) = installed().context("no kept policy to close the gate with")?;
    let policy = Policy::parse(&source, &text).with_context(|| format!("{source}: invalid"))?;
    Ok((policy, source, false))
}

pub(crate) fn run(args: BootArgs) -> Result<()> {
    let state = StateDir::new(&args.state_dir);
    let mut record = BootRecord {
        boot_id: boot_id(),
        closed: false,
        policy: None,
        allowed: 0,
        problems: Vec::new(),
        at: 0,
    };
    let result = close(args, &state, &mut record);
    for p in &record.problems {
        tracing::warn!(problem = %p, "kept state");
    }
    match &result {
        Ok(()) => record.closed = true,
        Err(e) => record.problems.push(format!("{e:#}")),
    }
    record.at = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if let Err(e) = state.save_boot(&record) {
        tracing::warn!(dir = %state.dir().display(), error = %e, "recording the boot step's outcome");
    }
    result
}

fn close(args: BootArgs, state: &StateDir, record: &mut BootRecord) -> Result<()> {
    let installed = Installed::from_args(args.policy, args.platform);
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let dmi = Dmi::read(std::path::Path::new("/"));
    let kept_source = state.policy_path().display().to_string();
    let (policy, source, kept) = choose(
        state.load_policy(),
        &kept_source,
        || installed.read(&cmdline, &dmi),
        &mut record.problems,
    )?;
    record.policy = Some(source.clone());
    let cfg = args.gate.into_config(false, Scope::from(args.gate_scope), true, false);
    if !Layout::new(&cfg.pin_dir).links().is_empty() {
        tracing::info!(pin_dir = %cfg.pin_dir.display(), "a gate is pinned already; it stays as it is");
        return Ok(());
    }
    let cgroup_root = &args.cgroup_root;
    if !cgroup_root.exists() {
        std::fs::create_dir_all(cgroup_root)
            .with_context(|| format!("creating the gated root {}", cgroup_root.display()))?;
        tracing::info!(cgroup_root = %cgroup_root.display(), "created the gated root");
    }
    let root = GatedRoot::open(cgroup_root)?;
    let allow = if kept { kept_allow(state, &root, &mut record.problems) } else { AllowSet::new() };
    record.allowed = allow.len();
    let node = NodeLevel::new(cfg.node.clone())?;
    // No metadata proxy before the agent runs: its programs stay out (the agent puts them
    // in when it adopts the gate, if its proxy serves).
    let _gate = engine::bring_up(&cfg, &node, &policy, &root, &allow, None)?;
    tracing::info!(
        policy = %source,
        policy_hash = %policy.hash(),
        cgroup_root = %root.path.display(),
        pin_dir = %cfg.pin_dir.display(),
        allowed_cgroups = allow.len(),
        "the gate is closed (boot step); the agent adopts it when it starts"
    );
    Ok(())
}

/// The kept allow set, by the ids the cgroups have on this boot. Unreadable: nothing allowed
/// (the agent resolves the allow list when it runs), and a problem recorded.
fn kept_allow(state: &StateDir, root: &GatedRoot, problems: &mut Vec<String>) -> AllowSet {
    let kept = match state.load_allow() {
        Ok(k) => k,
        Err(e) => {
            problems.push(format!("kept allow set: {e}; nothing allowed until the agent runs"));
            return AllowSet::new();
        }
    };
    kept.into_iter()
        .filter_map(|a| {
            let meta = std::fs::metadata(root.path.join(&a.path)).ok()?;
            Some((std::os::unix::fs::MetadataExt::ino(&meta), a.value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const AWS: &str = "platform: AWS\nendpoints:\n  - name: imds\n    cidr: 169.254.169.254/32\n";

    fn installed() -> Result<(String, String)> {
        Ok((
            "installed".into(),
            "platform: GCP\nendpoints:\n  - name: m\n    cidr: 169.254.169.254/32\n".into(),
        ))
    }

    #[test]
    fn a_valid_kept_policy_wins() {
        let mut problems = vec![];
        let (p, source, kept) =
            choose(Ok(AWS.into()), "kept.yaml", installed, &mut problems).unwrap();
        assert_eq!((p.platform.as_str(), kept, problems.len()), ("AWS", true, 0));
        assert_eq!(source, "kept kept.yaml");
    }

    #[test]
    fn missing_truncated_or_corrupt_kept_state_falls_back_to_the_installed_policy() {
        let cases = [
            Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
            Ok(String::new()),
            Ok(AWS[..AWS.len() - 12].to_owned()),
            Ok("\u{0}\u{0}\u{0}".to_owned()),
        ];
        for kept in cases {
            let shown = format!("{kept:?}");
            let mut problems = vec![];
            let (p, source, k) = choose(kept, "kept.yaml", installed, &mut problems).unwrap();
            assert_eq!(
                (p.platform.as_str(), source.as_str(), k),
                ("GCP", "installed", false),
                "{shown}"
            );
            assert_eq!(problems.len(), 1, "{shown}: the kept state's problem is recorded");
        }
    }

    #[test]
    fn no_policy_anywhere_is_an_error_never_an_open_gate() {
        let mut problems = vec![];
        let e = choose(
            Ok("{".into()),
            "kept.yaml",
            || Installed::None.read("", &Dmi::default()),
            &mut problems,
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("no --policy or --platform"), "{e:#}");
        let e = choose(
            Ok("{".into()),
            "kept.yaml",
            || Installed::Auto.read("quiet", &Dmi::default()),
            &mut problems,
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("ignition.platform.id"), "{e:#}");
        let bad = || Ok(("installed".into(), "platform: AWS\nendpoints: 3\n".into()));
        let e = choose(Ok("{".into()), "kept.yaml", bad, &mut problems).unwrap_err();
        assert!(format!("{e:#}").contains("installed: invalid"), "{e:#}");
    }

    #[test]
    fn auto_reads_the_ignition_platform_else_the_dmi_strings() {
        let gce = Dmi { product_name: "Google Compute Engine".into(), ..Dmi::default() };
        let (source, text) = Installed::Auto.read("ro ignition.platform.id=azure", &gce).unwrap();
        assert_eq!(source, "shipped for Azure (ignition.platform.id)", "ignition comes first");
        assert_eq!(Policy::parse(&source, &text).unwrap().platform, "Azure");
        // Without it, the firmware's strings.
        let (source, text) = Installed::Auto.read("ro quiet", &gce).unwrap();
        assert_eq!(source, "shipped for GCP (DMI product_name)");
        assert_eq!(Policy::parse(&source, &text).unwrap().platform, "GCP");
    }
}
