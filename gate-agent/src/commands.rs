//! The binary's commands: parse the command line, set up logging, run one command, turn its
//! outcome into an exit code.
use std::process::ExitCode;

use crate::{
    cli::{Cli, Command, LogFormat},
    config::RunMode,
    loader, policy, standalone,
    status::Status,
};
use clap::Parser as _;
use tracing_subscriber::EnvFilter;

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_target(false);
    match format {
        LogFormat::Json => {
            builder.json().flatten_event(true).with_current_span(false).with_span_list(false).init()
        }
        LogFormat::Text => builder.init(),
    }
}

fn check(files: &[std::path::PathBuf], platform: Option<&str>, json: bool) -> ExitCode {
    let mut ok = true;
    let mut out = Vec::new();
    for f in files {
        match policy::check::check_file(f, platform) {
            Ok(c) if json => out.push(c.to_json()),
            Ok(c) => {
                let p = &c.policy;
                println!(
                    "{}: ok (platform {}, {:?}, {} endpoints, {} allow entries)",
                    f.display(),
                    p.platform,
                    p.mode,
                    p.endpoints.len(),
                    p.allow.len()
                );
                for w in &c.warnings {
                    eprintln!("{w}");
                }
            }
            Err(e) => {
                ok = false;
                if json {
                    out.push(serde_json::json!({
                        "source": e.source, "error": {"field": e.field, "reason": e.reason},
                    }));
                } else {
                    eprintln!("{e}");
                }
            }
        }
    }
    if json {
        println!("{}", serde_json::Value::Array(out));
    }
    if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

fn cleanup(pin_dir: &std::path::Path) -> ExitCode {
    match loader::cleanup(pin_dir) {
        Ok(removed) if removed.is_empty() => {
            println!("nothing pinned under {}", pin_dir.display());
            ExitCode::SUCCESS
        }
        Ok(removed) => {
            for dir in removed {
                println!("removed the gate pinned under {}", dir.display());
            }
            println!("the gate is open");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn report(pin_dir: &std::path::Path, state_dir: &std::path::Path, json: bool) -> ExitCode {
    match crate::inspect::report(pin_dir, Some(state_dir)) {
        Ok(found) if json => match serde_json::to_string_pretty(&found.records) {
            Ok(s) => {
                println!("{s}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Ok(found) => {
            let now = crate::inspect::now_unix_ms();
            print!("{}", crate::inspect::report::render_table(&found.records, now));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `explain`: exit 0 passes, 1 denied, 2 audited, 3 through the proxy (the worst over the
/// destinations), 4 error.
fn explain(
    pin_dir: &std::path::Path,
    cgroup: Option<std::path::PathBuf>,
    pod: Option<String>,
    kubeconfig: Option<std::path::PathBuf>,
    dst: Option<String>,
    // (method, target, the state dir the policy in force is kept in)
    request: Option<(String, String, std::path::PathBuf)>,
    json: bool,
) -> ExitCode {
    use crate::inspect::{Pinned, explain};
    let run = || -> anyhow::Result<Vec<explain::Explanation>> {
        let pinned = Pinned::open(pin_dir)?;
        let root = pinned.root.clone().ok_or_else(|| {
            anyhow::anyhow!("the gated root {} no longer exists", pinned.root_path)
        })?;
        let path = match (cgroup, pod) {
            (Some(c), _) if c.is_absolute() => c,
            (Some(c), _) => root.path.join(c),
            (None, Some(p)) => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(explain::pod_cgroup(kubeconfig.as_deref(), &p, &root))?,
            (None, None) => anyhow::bail!("--cgroup or --pod is required"),
        };
        let dsts = match dst {
            Some(d) => vec![explain::parse_dst(&d).map_err(|e| anyhow::anyhow!("{d}: {e}"))?],
            None => explain::protected_destinations(&pinned),
        };
        let kept = match &request {
            Some((_, _, dir)) => {
                let state = crate::state::StateDir::new(dir);
                let file = state.policy_path();
                let text = state.load_policy().map_err(|e| {
                    anyhow::anyhow!(
                        "--path needs the policy the agent keeps: {}: {e}",
                        file.display()
                    )
                })?;
                Some(crate::policy::Policy::parse(&file.display().to_string(), &text)?)
            }
            None => None,
        };
        let asked = match (&request, &kept) {
            (Some((method, target, _)), Some(policy)) => {
                Some(explain::Request { method, target, policy })
            }
            _ => None,
        };
        dsts.iter().map(|d| Ok(explain::explain(&pinned, &path, d, asked.as_ref())?)).collect()
    };
    match run() {
        Ok(found) => {
            if json {
                println!("{}", serde_json::to_string_pretty(&found).unwrap_or_default());
            } else {
                for e in &found {
                    print!("{}", e.render());
                }
            }
            // Denied beats audited beats "through the proxy" beats passing.
            let codes: Vec<u8> = found.iter().map(|e| e.exit_code()).collect();
            ExitCode::from([1, 2, 3].into_iter().find(|c| codes.contains(c)).unwrap_or(0))
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(4)
        }
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Report { pin_dir, state_dir, json } => report(&pin_dir, &state_dir, json),
        Command::Suggest { pin_dir, state_dir } => {
            match crate::inspect::report(&pin_dir, Some(&state_dir)) {
                Ok(found) => {
                    let platform = Some(found.platform.as_str()).filter(|p| !p.is_empty());
                    print!("{}", crate::inspect::suggest::suggest(&found.records, platform));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Explain {
            pin_dir,
            state_dir,
            path,
            method,
            cgroup,
            pod,
            kubeconfig,
            dst,
            json,
        } => {
            let request = path.map(|p| (method, p, state_dir));
            explain(&pin_dir, cgroup, pod, kubeconfig, dst, request, json)
        }
        Command::Boot(args) => {
            init_logging(LogFormat::Text);
            crate::rlimits::raise_memlock();
            match crate::boot::run(*args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Check { files, platform, json } => check(&files, platform.as_deref(), json),
        Command::Platforms { json } => {
            let all = policy::Platform::all();
            if json {
                println!(
                    "{}",
                    serde_json::Value::Array(all.map(policy::Platform::to_json).collect())
                );
            } else {
                for p in all {
                    println!("{}", p.summary());
                }
            }
            ExitCode::SUCCESS
        }
        Command::Status { pin_dir, state_dir, json } => match Status::read(&pin_dir, &state_dir) {
            Ok(st) => {
                if json {
                    match serde_json::to_string_pretty(&st) {
                        Ok(s) => println!("{s}"),
                        Err(e) => {
                            eprintln!("error: {e}");
                            return ExitCode::FAILURE;
                        }
                    }
                } else {
                    print!("{}", st.render_text());
                }
                // 0: a gate is installed; 3: none (scripts can tell the two apart).
                if st.installed { ExitCode::SUCCESS } else { ExitCode::from(3) }
            }
            Err(e) => {
                eprintln!("error: reading the gate pinned under {}: {e}", pin_dir.display());
                ExitCode::FAILURE
            }
        },
        Command::Cleanup { pin_dir, force } => {
            if let Some(pid) = loader::lock::running_agent(&pin_dir) {
                if !force {
                    eprintln!(
                        "error: a gate-agent (pid {pid}) runs on {}: stop it first (it would \
                         repair the gate), or pass --force",
                        pin_dir.display()
                    );
                    return ExitCode::FAILURE;
                }
                eprintln!("warning: --force: cleaning up under a running gate-agent (pid {pid})");
            }
            cleanup(&pin_dir)
        }
        Command::Run(args) => {
            let args = *args;
            init_logging(args.log_format);
            // Before anything holds a descriptor: connections and sockets need the room.
            crate::rlimits::raise_nofile();
            crate::rlimits::raise_memlock();
            let cfg = match args.into_config() {
                Ok(cfg) => cfg,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            // Two workers: /readyz and /metrics answer while denials are being processed.
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: starting the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let result = match &cfg.mode {
                RunMode::Standalone { policy, cgroup_root } => {
                    rt.block_on(standalone::run(&cfg, policy, cgroup_root))
                }
                RunMode::Cluster(cluster) => rt.block_on(crate::cluster::run::run(&cfg, cluster)),
            };
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = format!("{e:#}"), "failed");
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
