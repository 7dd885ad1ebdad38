//! The metadata proxy against the clouds' own client libraries, from PyPI at pinned versions
//! (`tests/python/requirements.txt`): botocore with IMDSv2, google-auth, and an Azure
//! workload on Python's urllib. Each script runs as a gated workload (the probe enters the
//! test netns and cgroup, then becomes Python), once without the agent, where every request
//! must reach the fake metadata service, and once with it, where each library gets exactly
//! the paths of its entry (or of `served`), its refused requests are answered 403 at once,
//! and none of them reaches the service.
//!
//! Every request of one operation carries one token (User-Agent, X-Probe-Token): the fake
//! service's log says which requests got there; each script lists the requests its library
//! sent with the status it saw; the agent's `metadata_gate_proxy_requests` says how many the
//! proxy decided.
use std::{collections::BTreeMap, path::Path, time::Duration};

use integration_tests::{
    agent::{Agent, metric},
    imds::{FakeImds, INSTANCE_ID, platforms as fake},
    python::{self, Op, Report, Script},
    sys::{in_ci, slow, unique},
};

use super::super::{Env, TempDir, policy};

const AWS: &str = "aws_botocore.py";
const GCP: &str = "gcp_google_auth.py";
const AZURE: &str = "azure_urllib.py";

/// google-auth asks `metadata.google.internal` unless told (a name nothing resolves here).
const GCP_ENV: &[(&str, &str)] = &[("GCE_METADATA_HOST", "169.254.169.254")];

/// botocore (IMDSv2: the token `PUT` listed) reads the zone, whence its region, and the
/// instance id; google-auth the project and zone; the Azure workload its location, with the
/// two query parameters IMDS needs. Every other gated workload (`served`): the zone only.
///
/// botocore asks for `placement/availability-zone/`, with a trailing slash: the exact path
/// `…/availability-zone` would refuse it; the prefix rule covers both spellings.
fn sdk_policy() -> String {
    policy("enforce")
        + "  - {name: aws-sdk, cgroup: \"aws-sdk\", methods: [GET, PUT], paths: \
           [/latest/api/token, /latest/meta-data/placement/availability-zone/, \
           /latest/meta-data/instance-id]}\n\
           \x20 - {name: gcp-sdk, cgroup: \"gcp-sdk\", paths: \
           [/computeMetadata/v1/project/project-id, /computeMetadata/v1/instance/zone]}\n\
           \x20 - {name: azure-sdk, cgroup: \"azure-sdk\", paths: \
           [/metadata/instance/compute/location], queryParameters: [api-version, format]}\n\
           served: {methods: [GET, PUT], paths: \
           [/latest/api/token, /latest/meta-data/placement/availability-zone/]}\n"
}

/// What one operation must give when it is served, and the path that shows it refused.
struct Expect {
    op: &'static str,
    /// The value served, or a part of it.
    value: &'static str,
    /// Served with the agent; else refused, and no request of it for `guarded` (a path
    /// prefix of a request line, `GET /…`) ever reaches the service.
    served: bool,
    guarded: &'static str,
    /// How many requests the library sends for it with the agent: a refusal must not set
    /// off a retry storm.
    sent: usize,
}

const fn served(op: &'static str, value: &'static str, sent: usize) -> Expect {
    Expect { op, value, served: true, guarded: "", sent }
}

const fn refused(
    op: &'static str,
    value: &'static str,
    guarded: &'static str,
    sent: usize,
) -> Expect {
    Expect { op, value, served: false, guarded, sent }
}

struct Case {
    cgroup: &'static str,
    script: &'static str,
    env: &'static [(&'static str, &'static str)],
    /// Its connections go through the proxy with the agent (narrowed to paths, or `served`).
    proxied: bool,
    ops: &'static [Expect],
}

const AWS_CREDS: &str = "GET /latest/meta-data/iam/";
const CASES: &[Case] = &[
    Case {
        cgroup: "gated/aws-sdk",
        script: AWS,
        env: &[],
        proxied: true,
        ops: &[
            served("region", fake::AWS_REGION, 2),
            served("instance_id", INSTANCE_ID, 2),
            // The session token (served), then the role's name: 403, and botocore gives up.
            refused("credentials", fake::AWS_ACCESS_KEY_ID, AWS_CREDS, 2),
        ],
    },
    // botocore told to try the metadata service 3 times (AWS_METADATA_SERVICE_NUM_ATTEMPTS):
    // it asks for the role's name 3 times in a row, without a pause, then gives up.
    Case {
        cgroup: "gated/aws-sdk",
        script: AWS,
        env: &[("AWS_METADATA_SERVICE_NUM_ATTEMPTS", "3")],
        proxied: true,
        ops: &[refused("credentials", fake::AWS_ACCESS_KEY_ID, AWS_CREDS, 4)],
    },
    // No entry selects it: `served`, the zone and nothing else.
    Case {
        cgroup: "gated/pod-a",
        script: AWS,
        env: &[],
        proxied: true,
        ops: &[
            served("region", fake::AWS_REGION, 2),
            refused("instance_id", INSTANCE_ID, "GET /latest/meta-data/instance-id", 2),
            refused("credentials", fake::AWS_ACCESS_KEY_ID, AWS_CREDS, 2),
        ],
    },
    // The positive control: an entry with `grants: [metadata]` keeps the whole service,
    // credentials included, and never meets the proxy.
    Case {
        cgroup: "gated/cloud-agent",
        script: AWS,
        env: &[],
        proxied: false,
        ops: &[
            served("region", fake::AWS_REGION, 2),
            served("instance_id", INSTANCE_ID, 2),
            served("credentials", fake::AWS_ACCESS_KEY_ID, 3),
        ],
    },
    Case {
        cgroup: "gated/gcp-sdk",
        script: GCP,
        env: GCP_ENV,
        proxied: true,
        ops: &[
            served("project_id", fake::GCP_PROJECT, 1),
            served("zone", fake::GCP_ZONE, 1),
            // Refused at its first request, the account's info (`?recursive=true`).
            refused(
                "token",
                fake::GCP_ACCESS_TOKEN,
                "GET /computeMetadata/v1/instance/service-accounts/",
                1,
            ),
            // google.auth.default()'s detection asks for `/` itself, which this entry does
            // not list (`=/` would serve it alone; `gcp_detection` proves that): refused.
            refused("ping", "true", "GET / ", 1),
        ],
    },
    Case {
        cgroup: "gated/azure-sdk",
        script: AZURE,
        env: &[],
        proxied: true,
        ops: &[
            served("location", fake::AZURE_LOCATION, 1),
            // As azure-identity asks: refused for its form already (a percent-encoded
            // resource), before its path is looked at.
            refused("token", fake::AZURE_ACCESS_TOKEN, "GET /metadata/identity/", 1),
            // A resource that needs no encoding: refused for its path.
            refused("token_plain", fake::AZURE_ACCESS_TOKEN, "GET /metadata/identity/", 1),
        ],
    },
];

/// `(method, target)` of each request line received with `token`.
fn received(imds: &FakeImds, token: &str) -> Vec<(String, String)> {
    imds.http_requests(token)
        .iter()
        .filter_map(|head| {
            let mut w = head.split(' ');
            Some((w.next()?.to_owned(), w.next()?.to_owned()))
        })
        .collect()
}

/// Requests the proxy decided so far (every verdict and reason).
fn proxy_requests(agent: &Agent) -> f64 {
    let (_, body) = agent.http_get("/metrics").expect("metrics");
    body.lines()
        .filter(|l| l.starts_with("metadata_gate_proxy_requests"))
        .filter_map(|l| metric(l, ""))
        .sum()
}

/// The value as the test compares it: a string, or `true`/`false`.
fn shown(op: &Op) -> String {
    match &op.value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => String::new(),
        v => v.to_string(),
    }
}

/// One line of what the test prints (on stderr: shown when it fails, or with --nocapture).
fn line(
    phase: &str,
    case: &Case,
    sdk: &str,
    name: &str,
    op: &Op,
    at_service: usize,
    at_proxy: &str,
) {
    let statuses: Vec<String> = op
        .requests
        .iter()
        .map(|(m, t, s)| format!("{m} {t} {}", s.map_or("-".into(), |s| s.to_string())))
        .collect();
    let value = op.error.clone().unwrap_or_else(|| shown(op));
    eprintln!(
        "{phase:<8} {:<18} {sdk:<20} {name:<12} {:>7.1} ms  sent {}  at service {at_service}  \
         at proxy {at_proxy}  [{}]  {}",
        case.cgroup,
        op.elapsed_ms,
        op.requests.len(),
        statuses.join(", "),
        value.chars().take(100).collect::<String>(),
    );
}

/// Run every case's script in `env` and check each operation.
fn run_cases(env: &Env, script: &Script<'_>, cases: &[Case], with_agent: bool) {
    let phase = if with_agent { "agent" } else { "no agent" };
    for case in cases {
        let prefix = format!("tok-sdk-{}", unique("s"));
        let ops: Vec<&str> = case.ops.iter().map(|e| e.op).collect();
        let before = env.agent.as_ref().map(proxy_requests);
        let (report, took) = script
            .run(&env.cgroup(case.cgroup), case.script, &prefix, &ops, case.env)
            .unwrap_or_else(|e| panic!("{} in {}: {e:#}", case.script, case.cgroup));
        let decided = env.agent.as_ref().map(|a| proxy_requests(a) - before.unwrap_or(0.0));
        let sent: usize = report.ops.values().map(|o| o.requests.len()).sum();
        eprintln!(
            "{phase:<8} {:<18} {:<20} {took:.2?} in all (Python included); {sent} requests \
             sent, {} decided by the proxy",
            case.cgroup,
            report.sdk,
            decided.map_or("-".into(), |d| d.to_string())
        );
        for e in case.ops {
            check_op(env, case, e, &report, with_agent);
        }
        if let Some(decided) = decided {
            // Everything a proxied workload sends is decided by the proxy, once; nothing of
            // the others is.
            let want = if case.proxied { sent as f64 } else { 0.0 };
            assert_eq!(
                decided, want,
                "{} in {}: the proxy's count: {report:?}",
                case.script, case.cgroup
            );
        }
    }
}

/// Every request target (path and query as the SDKs send them, or the path alone) whose
/// answer the agent keeps, from `gate-agent platforms --json`.
fn fixed_paths(env: &Env) -> &'static std::collections::BTreeSet<String> {
    static FIXED: std::sync::OnceLock<std::collections::BTreeSet<String>> =
        std::sync::OnceLock::new();
    FIXED.get_or_init(|| {
        let out = std::process::Command::new(&env.bins.agent)
            .args(["platforms", "--json"])
            .output()
            .expect("gate-agent platforms --json");
        let all: serde_json::Value = serde_json::from_slice(&out.stdout).expect("its JSON");
        let mut set = std::collections::BTreeSet::new();
        for p in all.as_array().into_iter().flatten() {
            for profile in p["profiles"].as_array().into_iter().flatten() {
                for path in profile["paths"].as_array().into_iter().flatten() {
                    if path["fixedPerSource"].is_string() {
                        set.insert(path["path"].as_str().unwrap_or_default().to_owned());
                    }
                }
            }
        }
        assert!(!set.is_empty(), "no fixed paths in {all}");
        set
    })
}

fn check_op(env: &Env, case: &Case, e: &Expect, report: &Report, with_agent: bool) {
    let what = format!("{} {} in {}", report.sdk, e.op, case.cgroup);
    let op = report.op(e.op);
    assert!(!op.requests.is_empty(), "{what}: sent nothing: {op:?}");
    let at_service = received(&env.imds, &op.token);
    let not_refused: Vec<(String, String)> = op
        .requests
        .iter()
        .filter(|r| r.2 != Some(403))
        .map(|(m, t, _)| (m.clone(), t.clone()))
        .collect();
    // Exactly the requests the proxy did not refuse reached the service, in order (all of
    // them without the agent): nothing was lost, nothing else arrived. With the agent, the
    // proxy answers some itself: a token request (its own tokens), and a value the platform
    // documents as fixed once it has it; the workload's token request never reaches the service.
    let proxied = with_agent && case.proxied;
    let own = |m: &str, t: &str| {
        proxied
            && ((m == "PUT" && t == "/latest/api/token")
                || fixed_paths(env).contains(t.split('?').next().unwrap_or(t)))
    };
    let others = |v: &[(String, String)]| -> Vec<(String, String)> {
        v.iter().filter(|(m, t)| !own(m, t)).cloned().collect()
    };
    assert_eq!(
        others(&at_service),
        others(&not_refused),
        "{what}: what reached the service: {op:?}"
    );
    assert!(
        !at_service.iter().any(|(m, t)| proxied && m == "PUT" && t == "/latest/api/token"),
        "{what}: the workload's token request reached the service: {op:?}"
    );
    let reached_guarded = env
        .imds
        .http_requests(&op.token)
        .iter()
        .any(|h| !e.guarded.is_empty() && h.starts_with(e.guarded));
    let refusals = op.statuses().iter().filter(|s| **s == Some(403)).count();
    if with_agent {
        assert_eq!(op.requests.len(), e.sent, "{what}: requests sent: {op:?}");
    }
    if !with_agent || e.served {
        assert!(shown(op).contains(e.value), "{what}: want {}: {op:?}", e.value);
        assert!(op.error.is_none(), "{what}: {op:?}");
        assert!(op.statuses().iter().all(|s| *s == Some(200)), "{what}: {op:?}");
        if !e.guarded.is_empty() {
            // Without the agent the guarded path reaches the service: the case proves
            // something when the agent refuses it.
            assert!(reached_guarded, "{what}: {} never reached the service: {op:?}", e.guarded);
        }
    } else {
        assert!(!shown(op).contains(e.value), "{what}: got the value: {op:?}");
        assert!(refusals >= 1, "{what}: not refused: {op:?}");
        assert!(!reached_guarded, "{what}: {} reached the service: {op:?}", e.guarded);
        // Answered, not dropped: a drop would cost the library's timeout (botocore's is 1 s,
        // google-auth's 3 s) per attempt.
        let budget = slow(Duration::from_millis(1000)).as_secs_f64() * 1000.0;
        assert!(op.elapsed_ms < budget, "{what}: refused in {} ms: {op:?}", op.elapsed_ms);
        assert!(op.requests.iter().all(|r| r.2.is_some()), "{what}: unanswered: {op:?}");
    }
    let phase = if with_agent { "agent" } else { "no agent" };
    let at_proxy = if with_agent && case.proxied {
        format!("{} ({refusals} refused)", op.requests.len())
    } else {
        "-".into()
    };
    line(phase, case, &report.sdk, e.op, op, at_service.len(), &at_proxy);
}

/// The Python SDKs' directory; `None` (the test is skipped, never under CI=true) where they
/// are not installed.
fn sdks() -> Option<std::path::PathBuf> {
    let sdk = python::dir();
    if let Some(why) = python::missing(&sdk) {
        assert!(!in_ci(), "{why}, and CI=true forbids skipping: run `cargo xtask setup`");
        eprintln!("proxy::sdk: SKIPPED ({why}; `cargo xtask setup` installs them)");
        return None;
    }
    Some(sdk)
}

#[test]
fn cloud_sdks_get_their_served_paths_and_are_refused_the_rest_at_once() {
    privileged!(cloud_sdks_get_their_served_paths_and_are_refused_the_rest_at_once);
    let Some(sdk) = sdks() else { return };
    let mut env = Env::new("enforce");
    for c in ["gated/aws-sdk", "gated/gcp-sdk", "gated/azure-sdk", "agent"] {
        env.cg.create(c).expect("cgroup");
    }
    std::fs::write(&env.policy_file, sdk_policy()).expect("policy file");
    let home = TempDir::new("sdk-home");
    let bins = env.bins.clone();
    let script = Script { bins: &bins, net: &env.net, sdk: &sdk, home: Path::new(&home.0) };

    // Without the gate every library reaches every path, the guarded ones included.
    run_cases(&env, &script, CASES, false);

    let agent = super::proxy_agent(&env, "agent");
    env.agent = Some(agent);
    run_cases(&env, &script, CASES, true);

    // Each refusal names the entry (or `served`) whose paths refused it, and why.
    let mut refusals: BTreeMap<String, usize> = BTreeMap::new();
    for v in
        env.agent().logs().iter().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    {
        if v["message"] == "metadata proxy request" && v["verdict"] == "refused" {
            let entry = v["entry"].as_str().unwrap_or("?");
            *refusals.entry(entry.to_owned()).or_default() += 1;
            let (path, reason) = (v["path"].as_str().unwrap_or(""), v["reason"].as_str());
            eprintln!("refused  {entry:<16} {} {path}: {}", v["method"], v["reason"]);
            // Refused for its path; a percent-encoded query for its form, before that.
            let want = if path.contains('%') {
                "request target: malformed query parameter"
            } else {
                "path not allowed"
            };
            assert_eq!(reason, Some(want), "{v}");
        }
    }
    for entry in ["entry aws-sdk", "served", "entry gcp-sdk", "entry azure-sdk"] {
        assert!(refusals.contains_key(entry), "no refusal logged for {entry}: {refusals:?}");
    }
}

/// A GCP policy: the fake service as the Compute Engine metadata server, `gcp-sdk` narrowed to
/// `profile: safe`, and `served` (every other gated workload) the zone alone.
fn gcp_policy() -> String {
    "platform: GCP\n\
     mode: enforce\n\
     endpoints:\n\
     \x20 - {name: gce-metadata, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}\n\
     allow:\n\
     \x20 - {name: gcp-sdk, cgroup: \"gcp-sdk\", profile: safe}\n\
     served: {paths: [/computeMetadata/v1/instance/zone]}\n"
        .to_owned()
}

const GCP_TOKEN: &str = "GET /computeMetadata/v1/instance/service-accounts/";

/// google-auth as `google.auth.default()` runs it on a GCE node whose policy serves the safe
/// profile: the detection probe (`GET /` with `Metadata-Flavor: Google`, which must come back
/// as a 200 with `Metadata-Flavor: Google`) is served, exactly; the token is not.
const GCP_DETECTION: &[Case] = &[
    Case {
        cgroup: "gated/gcp-sdk",
        script: GCP,
        env: GCP_ENV,
        proxied: true,
        ops: &[
            served("ping", "true", 1),
            served("is_on_gce", "true", 1),
            // `=/computeMetadata/v1/`: the listing, exactly; `recursive` is not the profile's.
            served("v1_root", "instance/", 1),
            refused("v1_recursive", "instance/", "GET /computeMetadata/v1/?recursive", 1),
            served("project_id", fake::GCP_PROJECT, 1),
            served("zone", fake::GCP_ZONE, 1),
            // The token path itself: 403, at once, and google-auth does not retry a 403.
            refused("token_path", fake::GCP_ACCESS_TOKEN, GCP_TOKEN, 1),
            // Credentials.refresh: refused at the account's info, before the token.
            refused("token", fake::GCP_ACCESS_TOKEN, GCP_TOKEN, 1),
        ],
    },
    // Without `=/` among its paths (`served` lists the zone alone), the same probe is refused
    // and google-auth says it is not on GCE: the exact rule is what answers it.
    Case {
        cgroup: "gated/pod-a",
        script: GCP,
        env: GCP_ENV,
        proxied: true,
        ops: &[
            refused("is_on_gce", "true", "GET / ", 1),
            served("zone", fake::GCP_ZONE, 1),
            refused("token_path", fake::GCP_ACCESS_TOKEN, GCP_TOKEN, 1),
        ],
    },
];

#[test]
fn gcp_detection_is_served_by_the_safe_profile_and_the_token_is_not() {
    privileged!(gcp_detection_is_served_by_the_safe_profile_and_the_token_is_not);
    let Some(sdk) = sdks() else { return };
    let mut env = Env::new("enforce");
    for c in ["gated/gcp-sdk", "agent"] {
        env.cg.create(c).expect("cgroup");
    }
    std::fs::write(&env.policy_file, gcp_policy()).expect("policy file");
    let home = TempDir::new("sdk-home");
    let bins = env.bins.clone();
    let script = Script { bins: &bins, net: &env.net, sdk: &sdk, home: Path::new(&home.0) };

    // Without the gate google-auth detects GCE and gets the token: the refusals below are
    // the gate's.
    run_cases(&env, &script, GCP_DETECTION, false);

    env.agent = Some(super::proxy_agent(&env, "agent"));
    run_cases(&env, &script, GCP_DETECTION, true);

    // The served probe passed the service's `Metadata-Flavor: Google` back (google-auth's
    // ping is true only then); each refusal is logged for its path.
    let mut refused = Vec::new();
    for v in
        env.agent().logs().iter().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    {
        if v["message"] == "metadata proxy request" && v["verdict"] == "refused" {
            let want = if v["path"].as_str() == Some("/computeMetadata/v1/?recursive=true") {
                "query parameter \"recursive\" not allowed"
            } else {
                "path not allowed"
            };
            assert_eq!(v["reason"].as_str(), Some(want), "{v}");
            let (entry, path) = (v["entry"].as_str().unwrap_or("?"), v["path"].as_str());
            refused.push((entry.to_owned(), path.unwrap_or("").to_owned()));
        }
    }
    eprintln!("refused: {refused:?}");
    for (entry, path) in [
        ("entry gcp-sdk", "/computeMetadata/v1/instance/service-accounts/default/token"),
        ("served", "/"),
    ] {
        assert!(
            refused.iter().any(|(e, p)| e == entry && p == path),
            "no refusal of {path} logged for {entry}: {refused:?}"
        );
    }
}
