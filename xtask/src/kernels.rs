//! `cargo xtask test-kernels`: the privileged suite inside VMs booted on the kernels users run.
//!
//! (One file for one command: the per-kernel test table, the fetch and the VM runner, which
//! change together when a kernel is added.)
//!
//! Debian's stock kernels stand in for the nodes' (EKS AL2 and Bottlerocket, GKE COS and AKS
//! Ubuntu ship 5.10, 6.1 and 6.12 lines): `linux-image-*-amd64` of bullseye, bookworm and
//! trixie, fetched with apt through a private sources list and state dir (the machine's own
//! apt sources are never touched) and unpacked under `target/kernels/<suite>/root`, so a
//! rerun downloads nothing.
//!
//! Each kernel boots in QEMU through virtme-ng, with the host's filesystem shared read-only:
//! the guest runs this build's test binary and gate-agent where the host built them, as root,
//! with its own cgroup2 mount, a tmpfs on /tmp and a writable results dir under
//! `target/kernels/run/<kernel>/`. KVM does not work on these machines, so QEMU emulates
//! (TCG): about ten times slower than natively. [`MATRIX`] says which tests each kernel runs.
//!
//! VMs are processes of this command, each in its own process group: they are killed when
//! the command ends, fails, panics or is interrupted, and each guest powers itself off at its
//! deadline should the host side die first.
use std::{
    fs,
    io::Write as _,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicI32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    bins::target_dir,
    util::{self, output, show},
};

/// A kernel the suite runs on: Debian's stock amd64 kernel of one suite.
pub(crate) struct Kernel {
    /// What users call it, and what `--kernel` takes.
    pub(crate) name: &'static str,
    /// The Debian suite whose `linux-image-amd64` provides it.
    pub(crate) suite: &'static str,
    /// Who runs this line.
    pub(crate) stands_for: &'static str,
    /// Kernel command line added to the guest's.
    pub(crate) append: Option<&'static str>,
    /// How the agent's LSM programs must run there (`GATE_TEST_LSM`): `lsm` where the
    /// kernel's LSM list has `bpf`, `fmod_ret` where it has not, `open` where neither loads.
    pub(crate) lsm: &'static str,
}

pub(crate) const KERNELS: &[Kernel] = &[
    // bullseye's CONFIG_LSM has no `bpf`, and 5.10 gives tracing programs no
    // bpf_get_current_ancestor_cgroup_id, so fmod_ret is refused too: the doors are open.
    Kernel {
        name: "5.10",
        suite: "bullseye",
        stands_for: "EKS AL2 (5.10), Bottlerocket 1.x",
        append: None,
        lsm: "open",
    },
    Kernel {
        name: "6.1",
        suite: "bookworm",
        stands_for: "EKS AL2023, Bottlerocket, GKE COS",
        append: None,
        lsm: "lsm",
    },
    Kernel {
        name: "6.12",
        suite: "trixie",
        stands_for: "current LTS: AL2023, COS, Ubuntu HWE",
        append: None,
        lsm: "lsm",
    },
    // Ubuntu's and Flatcar's kernels list no `bpf` among their LSMs: the same kernel booted so.
    Kernel {
        name: "6.12-no-bpf-lsm",
        suite: "trixie",
        stands_for: "Ubuntu (AKS, EKS, GKE images), Flatcar: no `bpf` in lsm=",
        append: Some("lsm=landlock,lockdown,yama,apparmor"),
        lsm: "fmod_ret",
    },
];

/// Which privileged tests run on which kernel. Under TCG a test takes 12 to 90 s instead of 1
/// to 5, most of it starting the agent (verifying its programs), so every kernel runs the
/// core (the socket paths, on one agent; the programs' test runs, which cover the parser's
/// edges; kill-and-adopt, upgrade, AF_PACKET), the tests of what differs between kernels (tc
/// and clsact, setsockopt, link repair) run on one or two of them, and what is user-space
/// logic (cluster mode, inspection, policy edits, logs) or a socket-level repeat of a parser
/// edge runs natively only (`HOST`): 13 to 20 minutes a kernel, within CI's 90.
/// `cargo xtask test-kernels --kernel K FILTER` runs any test on any kernel; a test missing
/// here fails the run.
#[rustfmt::skip]
pub(crate) const MATRIX: &[(&str, &[&str])] = &[
    // test                                                                            kernels
    ("enforcement::socket_paths_are_denied_on_one_agent",                              ALL),
    ("enforcement::tcp_v4_denied_with_eperm_allowed_served",                           HOST),
    ("enforcement::tcp_v6_denied_allowed_served",                                      HOST),
    ("enforcement::udp_sendto_and_connected_udp_denied",                               HOST),
    ("enforcement::raw_socket_never_reaches_the_service",                              HOST),
    ("enforcement::ipv4_mapped_ipv6_denied",                                           HOST),
    ("enforcement::udp_denial_is_one_event_from_egress",                               K5_10),
    ("lifecycle::sigkill_keeps_the_gate_closed_and_a_restart_adopts_it",               ALL_AND_NO_BPF_LSM),
    ("lifecycle::upgrade_swaps_programs_without_an_open_window",                       ALL),
    ("progrun::egress_program_decides_every_parser_edge_as_the_host_does",             ALL),
    ("progrun::tc_program_reads_ethernet_and_ip_edges_and_the_callers_cgroup",         FROM_6_1),
    ("tc::af_packet_frames_from_a_gated_cgroup_never_arrive",                          ALL),
    ("bypass::qdisc_bypass_and_af_xdp_setup_are_denied_to_gated_workloads",            OLD),
    ("bypass::qdisc_bypass_through_the_32_bit_abi_is_denied",                          ALL_AND_NO_BPF_LSM),
    ("bypass::reading_the_nodes_traffic_is_denied_to_gated_workloads",                 LSM_EITHER_WAY),
    ("bypass::a_second_tc_program_still_sees_what_the_gate_passes",                    K6_12),
    ("tc::clsact_fallback_outlives_the_agent_is_replaced_in_place_and_cleaned_up",     K5_10),
    ("terminate::established_connections_are_terminated_when_the_gate_comes_up",       K5_10),
    ("lifecycle::an_abi_change_hands_over_to_a_new_pin_dir_without_an_open_window",    K5_10),
    ("proxy::served_paths_go_through_the_proxy_and_nothing_else_does",                 ALL),
    ("proxy::a_pod_network_workload_is_served_its_paths_under_hop_limit_1",            HOST),
    ("proxy::served_requests_reuse_one_connection_to_the_service",                     HOST),
    ("proxy::handshake::a_dnat_of_the_proxys_address_diverts_no_redirected_connection", K5_10),
    ("proxy::handshake::a_pod_holding_handshakes_is_held_to_its_quota",                K6_1),
    // Its strength is a native flood's rate; the kernels' part (the close callback) is the quota test's.
    ("proxy::handshake::an_orphan_handshake_flood_locks_no_other_workload_out",        HOST),
    ("proxy::budgets::idle_connections_to_the_probe_listener_starve_neither_probe_nor_proxy", HOST),
    ("proxy::budgets::a_host_network_pod_cannot_take_the_kubelets_probe_slots",        K5_10),
    ("proxy::budgets::a_pod_of_many_containers_holds_one_pods_proxy_slots",            HOST),
    ("proxy::budgets::a_pod_over_its_rate_gets_429_and_csi_node_is_served_beside_it",  HOST),
    ("proxy::cluster_mode::in_cluster_mode_the_proxy_serves_by_identity_and_no_pod_locks_it", HOST),
    ("proxy::audit::audit_shows_every_path_then_suggest_narrows_it_and_enforce_serves_only_that", HOST),
    // The oldest kernel with BPF_LINK_DETACH, and the newest's adoption of the proxy's links.
    ("proxy::hooks::the_proxys_programs_come_and_go_with_the_policys_need_for_a_proxy", K5_10),
    ("proxy::hooks::the_proxys_programs_follow_proxy_address_across_restarts",         K6_12),
    ("bypass::ipv6_extension_header_chains_are_denied",                                HOST),
    ("enforcement::nested_and_late_cgroups_under_an_allowed_one_are_allowed",          K5_10),
    ("tc::forwarded_traffic_from_a_workload_interface_is_dropped",                     K6_1),
    ("tc::a_deleted_clsact_qdisc_is_restored_on_the_event",                            K6_1),
    ("bypass::vlan_tagged_frames_are_denied",                                          K6_1),
    ("bypass::host_network_af_packet_frames_on_the_uplink_are_denied",                 K6_1),
    ("bypass::a_renamed_uplink_keeps_its_program",                                     K6_1),
    ("bypass::packets_on_an_l3_interface_are_denied",                                  K5_10),
    ("resilience::a_torn_down_gate_is_repaired_within_a_tick",                         K6_1),
    ("terminate::terminate_established_false_leaves_connections_open_but_dropped",     K6_1),
    ("bypass::first_fragment_without_its_transport_header_is_denied",                  HOST),
    ("enforcement::source_routed_udp_denied",                                          K6_12),
    ("bypass::pod_af_packet_frames_to_its_gateway_are_denied",                         K6_12),
    ("bypass::a_route_that_makes_a_pod_veth_an_uplink_opens_nothing",                 K6_12),
    ("resilience::after_a_reboot_the_boot_step_closes_the_gate_before_the_agent_runs", K6_12),
    ("bypass::boot::a_first_boot_is_closed_before_the_agent_runs",                     HOST),
    ("lifecycle::cleanup_opens_the_gate_and_status_says_so",                           LSM_EITHER_WAY),
    // Natively only (`cargo xtask test`, this machine's kernel).
    // The clouds' Python SDKs (botocore, google-auth) are installed on the host only.
    ("proxy::sdk::cloud_sdks_get_their_served_paths_and_are_refused_the_rest_at_once", HOST),
    ("proxy::sdk::gcp_detection_is_served_by_the_safe_profile_and_the_token_is_not",   HOST),
    ("bypass::forwarding_loop_inside_a_pod_is_denied",                                 HOST),
    ("bypass::frames_from_a_vm_tap_are_denied",                                        HOST),
    ("bypass::a_link_whose_pin_fails_is_held_not_dropped",                             HOST),
    ("bypass::a_new_interfaces_first_frames_are_judged",                               HOST),
    ("bypass::host_network_frame_looped_through_lo_and_forwarded_is_denied",           HOST),
    ("bypass::host_network_pod_duplicating_a_rewritten_decoy_with_nft_is_denied",      HOST),
    ("bypass::host_processes_allowed_pods_and_unprotected_ports_are_served",           HOST),
    ("bypass::pod_rewriting_a_decoy_after_the_socket_hooks_is_denied",                 HOST),
    ("bypass::qdisc_bypass_set_before_the_gate_is_named",                              HOST),
    ("cluster::a_new_nodes_not_ready_taint_is_removed_once_the_gate_is_closed",        HOST),
    ("cluster::cluster_mode_gates_pods_by_identity_and_follows_the_api",               HOST),
    ("cluster::cluster_mode_without_the_crd_uses_the_provider_id_and_a_bad_token_is_named", HOST),
    ("cluster::host_network_only_scope_gates_only_host_network_pods",                  HOST),
    ("enforcement::audit_mode_counts_and_logs_but_blocks_nothing",                     HOST),
    ("enforcement::an_entry_narrowed_to_paths_is_denied_until_a_proxy_serves_them",    HOST),
    ("enforcement::bad_policy_is_refused_and_attaches_nothing",                        HOST),
    ("enforcement::each_denial_is_one_structured_log_event",                           HOST),
    ("enforcement::harness_without_agent_serves_everything",                           HOST),
    ("enforcement::ipv6_extension_headers_do_not_hide_the_port",                       HOST),
    ("enforcement::neighbouring_addresses_stay_open",                                  HOST),
    ("enforcement::processes_outside_the_gated_root_are_not_affected",                 HOST),
    ("enforcement::protected_address_on_unprotected_port_stays_open",                  HOST),
    ("inspect::audit_then_report_then_suggest_then_enforce_from_evidence",             HOST),
    ("inspect::explain_decides_against_the_live_maps_and_says_why",                    HOST),
    ("inspect::must_gather_collects_every_nodes_gate_and_the_clusters_objects",        HOST),
    ("lifecycle::denial_logs_are_rate_limited_per_workload_and_metrics_count_all",     HOST),
    ("lifecycle::gate_stays_closed_after_the_agent_stops_until_cleanup",               HOST),
    ("lifecycle::metrics_apart_from_the_probes",                                       HOST),
    ("lifecycle::policy_file_edits_are_live_and_a_bad_edit_keeps_the_last_good",       HOST),
    ("resilience::a_policy_that_cannot_be_written_is_retried_and_never_taken_for_applied", HOST),
    ("resilience::a_quiet_workloads_denial_is_logged_while_others_hammer",             HOST),
    ("resilience::a_recreated_root_is_taken_over_live_and_by_a_restart",               HOST),
    ("resilience::one_agent_per_gate_and_cleanup_refuses_under_a_running_agent",       HOST),
    ("resilience::a_torn_kept_state_falls_back_to_the_installed_policy",               HOST),
    ("resilience::a_boot_step_that_cannot_close_fails_visibly",                        HOST),
    ("resilience::policy_flips_under_a_connect_hammer_never_open_the_gate",            HOST),
    ("terminate::audit_mode_terminates_nothing",                                       HOST),
    ("terminate::cluster_mode_sees_pod_network_namespaces",                            HOST),
    ("terminate::connections_opened_before_the_agent_are_cut_off",                    HOST),
];
const ALL: &[&str] = &["5.10", "6.1", "6.12"];
const ALL_AND_NO_BPF_LSM: &[&str] = &["5.10", "6.1", "6.12", "6.12-no-bpf-lsm"];
/// The LSM programs' doors, as LSM programs and as fmod_ret (6.12 without `bpf`).
const LSM_EITHER_WAY: &[&str] = &["6.12", "6.12-no-bpf-lsm"];
const OLD: &[&str] = &["5.10", "6.1"];
/// Test runs carry the caller's cgroup from 5.15 on.
const FROM_6_1: &[&str] = &["6.1", "6.12"];
const K5_10: &[&str] = &["5.10"];
const K6_1: &[&str] = &["6.1"];
const K6_12: &[&str] = &["6.12"];
const HOST: &[&str] = &[];

/// Guest memory and CPUs (the machine has 2 cores; QEMU's TCG runs one thread per vCPU).
const VM_MEMORY: &str = "3G";
const VM_CPUS: &str = "2";
/// How many times slower than natively the harness may expect things to be in the guest.
const SLOWDOWN: u32 = 4;
/// One test in the guest is stopped after this long.
const TEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Booting a guest and starting its script (about 20 s under TCG), with margin.
const BOOT_ALLOWANCE: Duration = Duration::from_secs(180);
/// Past a test's timeout, how long the host waits for its result line before it takes the
/// guest for hung.
const STALL_MARGIN: Duration = Duration::from_secs(60);

pub(crate) struct Options<'a> {
    /// `--kernel`: one name of [`KERNELS`], or `all`.
    pub(crate) kernel: &'a str,
    /// Run every test whose name contains this on the chosen kernels, instead of [`MATRIX`].
    pub(crate) filter: Option<&'a str>,
}

pub(crate) fn run(opts: &Options) -> Result<()> {
    let kernels: Vec<&Kernel> = match opts.kernel {
        "all" => KERNELS.iter().collect(),
        name => vec![KERNELS.iter().find(|k| k.name == name).with_context(|| {
            let names: Vec<_> = KERNELS.iter().map(|k| k.name).collect();
            format!("unknown kernel {name}: one of {names:?} or all")
        })?],
    };
    check_matrix()?;
    if !integration_tests::sys::is_root() {
        // virtme-ng runs the guest as the calling user; the tests need root there.
        bail!("test-kernels needs root (the guest runs as the calling user)");
    }
    let bins = crate::bins::build(crate::bins::Profile::Checked)?;
    let suite_bin = privileged_test_binary()?;
    let all_tests = list_tests(&suite_bin)?;
    let vng = vng()?;
    let base = target_dir().join("kernels");
    install_signal_handlers();

    let started = Instant::now();
    let mut reports = Vec::new();
    for k in kernels {
        let tests: Vec<&str> = match opts.filter {
            Some(f) => all_tests.iter().map(String::as_str).filter(|t| t.contains(f)).collect(),
            None => MATRIX.iter().filter(|(_, ks)| ks.contains(&k.name)).map(|(t, _)| *t).collect(),
        };
        if tests.is_empty() {
            eprintln!("kernel {}: no test selected", k.name);
            continue;
        }
        eprintln!("\n=== kernel {} (Debian {}), standing for {}", k.name, k.suite, k.stands_for);
        let image = fetch_kernel(k, &base.join(k.suite))?;
        let env: Vec<(&str, &Path)> = bins.env().into_iter().collect();
        let out = base.join("run").join(k.name);
        let mut report = run_in_vm(&vng, k, &image, &out, &suite_bin, &env, &tests)?;
        // A guest that stopped reporting (its kernel hung under emulation: an RCU stall while
        // a BPF trampoline was patched, seen once on 6.1) leaves tests unrun: they get one
        // second VM. A test that hangs the guest again fails.
        let unrun: Vec<&str> = report.unrun().collect();
        if !unrun.is_empty() {
            eprintln!("kernel {}: {} tests unrun; once more in a fresh VM", k.name, unrun.len());
            let again = run_in_vm(&vng, k, &image, &out.join("again"), &suite_bin, &env, &unrun)?;
            report.merge(again);
        }
        report.print();
        reports.push(report);
    }
    eprintln!("\n=== test-kernels: {} s in all", started.elapsed().as_secs());
    let (mut passed, mut failed) = (0, 0);
    for r in &reports {
        eprintln!("{}", r.summary());
        let ok = r.results.iter().filter(|(_, r)| matches!(r, Some((true, _)))).count();
        passed += ok;
        failed += r.results.len() - ok;
    }
    // The closing line CI reads.
    println!("test-kernels: {passed} passed, {failed} failed");
    if failed > 0 {
        bail!("privileged tests failed on some kernel (logs under {})", base.join("run").display());
    }
    Ok(())
}

/// Every test in [`MATRIX`] names kernels of [`KERNELS`], once.
fn check_matrix() -> Result<()> {
    for (i, (t, ks)) in MATRIX.iter().enumerate() {
        if let Some(k) = ks.iter().find(|k| !KERNELS.iter().any(|x| x.name == **k)) {
            bail!("MATRIX: {t} names an unknown kernel {k}");
        }
        if MATRIX[..i].iter().any(|(u, _)| u == t) {
            bail!("MATRIX: {t} is listed twice");
        }
    }
    Ok(())
}

/// Build the privileged test binary (without running it) and say where it is.
fn privileged_test_binary() -> Result<PathBuf> {
    let mut cmd = Command::new("cargo");
    cmd.args(["test", "-q", "-p", "integration-tests", "--test", "privileged", "--no-run"])
        .args(["--message-format", "json"])
        .current_dir(crate::util::root());
    eprintln!("\x1b[1m$ {}\x1b[0m", show(&cmd));
    let out = cmd.stderr(Stdio::inherit()).output().context("cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the privileged tests failed");
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if v["target"]["name"] == "privileged"
            && let Some(exe) = v["executable"].as_str()
        {
            return Ok(exe.into());
        }
    }
    bail!("cargo named no executable for the privileged tests")
}

/// The names of the tests in the privileged test binary.
fn list_tests(bin: &Path) -> Result<Vec<String>> {
    let list = output(Command::new(bin).arg("--list")).context("listing the privileged tests")?;
    let tests: Vec<String> =
        list.lines().filter_map(|l| l.strip_suffix(": test")).map(str::to_owned).collect();
    if let Some((t, _)) = MATRIX.iter().find(|(t, _)| !tests.iter().any(|x| x == t)) {
        bail!("MATRIX names {t}, which the privileged tests do not have");
    }
    if let Some(t) = tests.iter().find(|t| !MATRIX.iter().any(|(m, _)| m == t)) {
        bail!("the privileged test {t} is on no kernel of MATRIX: add it there");
    }
    Ok(tests)
}

/// virtme-ng's `vng`: on PATH, or in the scripts dir of the python3 that has it.
fn vng() -> Result<PathBuf> {
    if output(Command::new("vng").arg("--version")).is_some() {
        return Ok("vng".into());
    }
    let scripts = output(
        Command::new("python3")
            .args(["-c", "import sysconfig; print(sysconfig.get_path('scripts'))"]),
    )
    .unwrap_or_default();
    let vng = Path::new(scripts.trim()).join("vng");
    if output(Command::new(&vng).arg("--version")).is_some() {
        return Ok(vng);
    }
    bail!("virtme-ng's vng is missing: `cargo xtask setup` installs it (pip install virtme-ng)")
}

/// The kernel image of `k`, its modules beside it as virtme-ng wants them
/// (`<root>/boot/vmlinuz-V`, `<root>/lib/modules/V` with modules.dep). Fetched once into `dir`.
fn fetch_kernel(k: &Kernel, dir: &Path) -> Result<PathBuf> {
    let root = dir.join("root");
    let stamp = root.join(".unpacked");
    if !stamp.exists() {
        let _ = fs::remove_dir_all(&root);
        let deb = download_kernel_deb(k, dir)?;
        fs::create_dir_all(&root)?;
        util::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        // trixie ships its modules under usr/lib (merged /usr); virtme-ng looks in lib/.
        let usr_modules = root.join("usr/lib/modules");
        if !root.join("lib/modules").exists() && usr_modules.exists() {
            fs::create_dir_all(root.join("lib"))?;
            fs::rename(&usr_modules, root.join("lib/modules"))?;
        }
        let version = kernel_version(&root)?;
        util::run(Command::new("depmod").arg("-b").arg(&root).arg(&version))?;
        // The guest's root is the host's, over 9p: without its modules the guest panics.
        let dep = fs::read_to_string(root.join("lib/modules").join(&version).join("modules.dep"))?;
        for m in ["/9p.ko", "/9pnet_virtio.ko", "/veth.ko"] {
            if !dep.lines().any(|l| l.split(':').next().is_some_and(|p| p.contains(m))) {
                bail!("{}: the kernel {version} has no module {m}", k.suite);
            }
        }
        fs::write(&stamp, &version)?;
    }
    let version = fs::read_to_string(&stamp)?;
    Ok(root.join("boot").join(format!("vmlinuz-{}", version.trim())))
}

/// The one `lib/modules/<version>` under an unpacked kernel package.
fn kernel_version(root: &Path) -> Result<String> {
    let mut versions: Vec<String> = fs::read_dir(root.join("lib/modules"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    match versions.len() {
        1 => Ok(versions.remove(0)),
        _ => bail!("{}: expected one kernel version, found {versions:?}", root.display()),
    }
}

/// Download the suite's current `linux-image-<version>-amd64` (what `linux-image-amd64`
/// depends on) into `dir`, through apt with a private sources list, state and cache.
fn download_kernel_deb(k: &Kernel, dir: &Path) -> Result<PathBuf> {
    let apt = dir.join("apt");
    for d in ["state/lists/partial", "cache/archives/partial"] {
        fs::create_dir_all(apt.join(d))?;
    }
    let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
    if !Path::new(keyring).exists() {
        bail!("{keyring} is missing (Debian package debian-archive-keyring)");
    }
    let sources = apt.join("sources.list");
    fs::write(
        &sources,
        format!(
            "deb [signed-by={keyring}] http://deb.debian.org/debian {s} main\n\
             deb [signed-by={keyring}] http://deb.debian.org/debian-security {s}-security main\n",
            s = k.suite
        ),
    )?;
    let opts: Vec<String> = [
        format!("Dir::Etc::SourceList={}", sources.display()),
        "Dir::Etc::SourceParts=/nonexistent".into(),
        format!("Dir::State={}", apt.join("state").display()),
        "Dir::State::status=/dev/null".into(),
        format!("Dir::Cache={}", apt.join("cache").display()),
        "Debug::NoLocking=1".into(),
        "APT::Sandbox::User=root".into(),
    ]
    .into_iter()
    .flat_map(|o| ["-o".to_owned(), o])
    .collect();
    util::run(Command::new("apt-get").args(&opts).args(["update", "-qq"]))?;
    let deps = output(Command::new("apt-cache").args(&opts).args(["depends", "linux-image-amd64"]))
        .context("apt-cache depends linux-image-amd64")?;
    let pkg = deps
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
        .with_context(|| format!("{}: no linux-image package in {deps}", k.suite))?
        .to_owned();
    let mut cmd = Command::new("apt-get");
    cmd.args(&opts).args(["download", "-qq", &pkg]);
    eprintln!("\x1b[1m$ (in {}) {}\x1b[0m", dir.display(), show(&cmd));
    if !cmd.current_dir(dir).status()?.success() {
        bail!("apt-get download {pkg} failed");
    }
    fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{pkg}_")))
        })
        .with_context(|| format!("{pkg}: downloaded, but no .deb in {}", dir.display()))
}

/// One kernel's results.
struct Report {
    kernel: &'static str,
    version: String,
    /// Test name, passed, seconds in the guest; None: never reported.
    results: Vec<(String, Option<(bool, u64)>)>,
    wall: Duration,
    out: PathBuf,
    /// Tests that ran in a second VM, the first having stopped before them.
    again: Vec<String>,
}

impl Report {
    /// Tests the guest never reported on.
    fn unrun(&self) -> impl Iterator<Item = &str> {
        self.results.iter().filter(|(_, r)| r.is_none()).map(|(t, _)| t.as_str())
    }

    /// Take `again`'s results for the tests this report never got.
    fn merge(&mut self, again: Report) {
        for (t, r) in again.results {
            if let Some(slot) = self.results.iter_mut().find(|(u, _)| *u == t) {
                slot.1 = r;
            }
            self.again.push(t);
        }
        self.wall += again.wall;
    }

    fn summary(&self) -> String {
        let passed = self.results.iter().filter(|(_, r)| matches!(r, Some((true, _)))).count();
        format!(
            "kernel {} ({}): {passed} passed, {} failed, wall {} s under TCG",
            self.kernel,
            self.version,
            self.results.len() - passed,
            self.wall.as_secs()
        )
    }

    fn print(&self) {
        eprintln!("\n--- kernel {} ({}) ---", self.kernel, self.version);
        for (t, r) in &self.results {
            match r {
                Some((true, s)) => eprintln!("  ok     {s:>4} s  {t}"),
                Some((false, s)) => eprintln!("  FAILED {s:>4} s  {t}"),
                None => eprintln!("  NOT RUN         {t}"),
            }
            if self.again.contains(t) {
                eprintln!("                   (in a second VM: the first stopped reporting)");
            }
        }
        for (t, r) in &self.results {
            if !matches!(r, Some((true, _))) {
                let log = fs::read_to_string(self.out.join(format!("{t}.log"))).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(60).collect();
                eprintln!("\n--- {} on {}: last lines of its log ---", t, self.kernel);
                for l in tail.iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
        eprintln!("{}", self.summary());
    }
}

/// Boot `image` and run `tests` of `suite_bin` in it, one test process each, writing logs and
/// results into `out`.
fn run_in_vm(
    vng: &Path,
    k: &Kernel,
    image: &Path,
    out: &Path,
    suite_bin: &Path,
    env: &[(&str, &Path)],
    tests: &[&str],
) -> Result<Report> {
    let _ = fs::remove_dir_all(out);
    fs::create_dir_all(out)?;
    let out = out.canonicalize()?;
    let deadline = BOOT_ALLOWANCE + TEST_TIMEOUT * u32::try_from(tests.len())?;
    let script = guest_script(&out, suite_bin, env, tests, deadline, k.lsm);
    let script_path = out.join("guest.sh");
    fs::write(&script_path, script)?;

    let mut cmd = Vm::guarded(vng);
    cmd.arg("--run")
        .arg(image)
        .args(["--disable-kvm", "--force-9p", "--verbose"])
        .args(["--memory", VM_MEMORY, "--cpus", VM_CPUS])
        .args(k.append.iter().flat_map(|a| ["--append", a]))
        .arg("--rwdir")
        .arg(&out)
        .arg("--exec")
        .arg(format!("sh {}", script_path.display()));
    let console = fs::File::create(out.join("console.log"))?;
    cmd.stdin(Stdio::null()).stdout(console.try_clone()?).stderr(console);
    eprintln!(
        "\x1b[1m$ {}\x1b[0m\nkernel {}: {} tests, console in {}",
        show(&cmd),
        k.name,
        tests.len(),
        out.join("console.log").display()
    );
    let started = Instant::now();
    let mut vm = Vm::start(cmd)?;
    let finished = vm.wait(deadline + Duration::from_secs(60), &out.join("results"), tests)?;
    drop(vm);
    let wall = started.elapsed();

    let recorded = fs::read_to_string(out.join("results")).unwrap_or_default();
    let results = tests
        .iter()
        .map(|t| {
            let r = recorded.lines().find_map(|l| {
                let mut f = l.split(' ');
                (f.next() == Some(*t)).then(|| {
                    let rc = f.next().unwrap_or("?");
                    let secs = f.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                    (rc == "0", secs)
                })
            });
            ((*t).to_owned(), r)
        })
        .collect();
    let version = fs::read_to_string(out.join("uname")).unwrap_or_default().trim().to_owned();
    if !finished {
        eprintln!(
            "kernel {}: the guest did not finish (see {})",
            k.name,
            out.join("console.log").display()
        );
    }
    Ok(Report { kernel: k.name, version, results, wall, out, again: Vec::new() })
}

/// The guest's script: a private /tmp, then each test in its own process with a timeout,
/// appending `name exit-code seconds` to `results`; a watchdog powers the guest off at the
/// deadline whatever happens.
fn guest_script(
    out: &Path,
    suite_bin: &Path,
    env: &[(&str, &Path)],
    tests: &[&str],
    deadline: Duration,
    lsm: &str,
) -> String {
    let o = out.display();
    let mut s =
        String::from("#!/bin/sh\n# Written by cargo xtask test-kernels; runs inside the VM.\n");
    s += &format!("(sleep {}; echo o > /proc/sysrq-trigger) &\n", deadline.as_secs());
    s += "mount -t tmpfs tmpfs /tmp\n";
    // No udev/systemd in the guest to create static device nodes: /dev/net/tun appears only
    // once its module is in (a node has it from boot).
    s += "modprobe tun\n";
    s += &format!("uname -r > {o}/uname\n");
    // Waits in the harness (agent ready, …) are stretched by this much: TCG is slow.
    s += &format!("export CI=true GATE_TEST_SLOWDOWN={SLOWDOWN} GATE_TEST_LSM={lsm}\n");
    // The host's filesystem is shared uncached (9p): an exec of the agent from it took 4 to 6 s
    // under TCG, from the guest's tmpfs 1.2 s. The binaries are copied there once.
    // Each keeps its file name: tests read the probe's comm.
    s += "mkdir /tmp/vm-bin\n";
    for (k, v) in env {
        s += &format!("cp {} /tmp/vm-bin/\nexport {k}=/tmp/vm-bin/{}\n", v.display(), file_name(v));
    }
    s += &format!("cp {} /tmp/vm-bin/\n", suite_bin.display());
    for t in tests {
        s += &format!(
            "echo \"=== {t}\"; s=$(date +%s)\n\
             timeout -k 10 {tmo} /tmp/vm-bin/{suite} --exact --test-threads=1 --nocapture {t} > {o}/{t}.log 2>&1\n\
             rc=$?; echo \"{t} $rc $(( $(date +%s) - s ))\" | tee -a {o}/results\n",
            tmo = TEST_TIMEOUT.as_secs(),
            suite = file_name(suite_bin),
        );
    }
    s += &format!("echo finished > {o}/finished\nsync\n");
    s
}

fn file_name(path: &Path) -> String {
    path.file_name().unwrap_or_default().to_string_lossy().into_owned()
}

/// The process group of the running VM, for the signal handler.
static VM_PGID: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    let pgid = VM_PGID.load(Ordering::SeqCst);
    if pgid > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    // SAFETY: restore the default action and re-raise, so the exit status tells the signal.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only calls async-signal-safe functions.
        unsafe { libc::signal(sig, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t) };
    }
}

/// A running VM: vng and everything it starts (virtme-run, QEMU) in one process group, killed
/// as a whole when this is dropped (also on panic) or this process gets SIGINT/SIGTERM/SIGHUP.
struct Vm {
    child: Child,
    pgid: i32,
}

impl Vm {
    /// A command that runs `program` (and its arguments, added to it) under a guard shell:
    /// should this process die in a way no handler sees (SIGKILL), the kernel sends the guard
    /// SIGTERM (PR_SET_PDEATHSIG), and the guard SIGKILLs its whole process group: vng,
    /// virtme-run and QEMU, which vng starts as grandchildren.
    fn guarded(program: &Path) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", r#"trap 'kill -KILL 0' TERM INT HUP; "$@" & wait $!"#, "vm-guard"])
            .arg(program);
        cmd
    }

    /// Start a [`guarded`](Self::guarded) command in a process group of its own.
    fn start(mut cmd: Command) -> Result<Vm> {
        // SAFETY: prctl is async-signal-safe; it runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd.process_group(0).spawn().context("starting vng")?;
        let pgid = i32::try_from(child.id())?;
        VM_PGID.store(pgid, Ordering::SeqCst);
        Ok(Vm { child, pgid })
    }

    /// Wait until the VM exits, `limit` passes or the guest stops reporting, echoing each
    /// result line as it comes. True if the guest wrote its `finished` mark.
    fn wait(&mut self, limit: Duration, results: &Path, tests: &[&str]) -> Result<bool> {
        let started = Instant::now();
        let mut shown = 0;
        let mut progress = Instant::now();
        loop {
            let lines: Vec<String> = fs::read_to_string(results)
                .unwrap_or_default()
                .lines()
                .map(str::to_owned)
                .collect();
            for l in &lines[shown.min(lines.len())..] {
                eprintln!(
                    "  [{:>5} s] {l}  ({}/{})",
                    started.elapsed().as_secs(),
                    shown + 1,
                    tests.len()
                );
                shown += 1;
                progress = Instant::now();
            }
            let _ = std::io::stderr().flush();
            if self.child.try_wait()?.is_some() {
                break;
            }
            // Each test has its own timeout in the guest: no line past it means the guest
            // itself hangs (its timeout cannot run either).
            let boot = if shown == 0 { BOOT_ALLOWANCE } else { Duration::ZERO };
            if progress.elapsed() > boot + TEST_TIMEOUT + STALL_MARGIN {
                eprintln!(
                    "no result from the guest for {} s: it hangs (see its console.log); killing it",
                    progress.elapsed().as_secs()
                );
                break;
            }
            if started.elapsed() > limit {
                eprintln!("the VM ran past {} s: killing it", limit.as_secs());
                break;
            }
            std::thread::sleep(Duration::from_secs(2));
        }
        Ok(results.with_file_name("finished").exists())
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        // SAFETY: a process group this command created.
        unsafe { libc::kill(-self.pgid, libc::SIGKILL) };
        let _ = self.child.wait();
        VM_PGID.store(0, Ordering::SeqCst);
    }
}
