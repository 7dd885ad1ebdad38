use std::path::PathBuf;

use gate_common::abi::{MAX_ENDPOINTS, PROTO_TCP, PROTO_UDP};

use super::*;

const EXAMPLE: &str =
    include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/examples/standalone-aws.yaml"));

fn parse(text: &str) -> Result<Policy, PolicyError> {
    Policy::parse("aws.yaml", text)
}

/// A document with the given `endpoints:` items (YAML list items, indented 2).
fn with_endpoints(items: &str) -> String {
    format!("platform: AWS\nendpoints:\n{items}")
}

/// A valid document with the given `allow:` items.
fn with_allow(items: &str) -> String {
    format!(
        "platform: AWS\nendpoints:\n  - {{name: imds, cidr: 169.254.169.254/32}}\nallow:\n{items}"
    )
}

#[track_caller]
fn assert_err(text: &str, field: &str, phrase: &str) -> PolicyError {
    let e = match parse(text) {
        Ok(p) => panic!("expected an error at {field}, parsed {p:?}"),
        Err(e) => e,
    };
    assert_eq!(e.source, "aws.yaml");
    assert_eq!(e.field, field, "field of: {e}");
    assert!(e.reason.contains(phrase), "reason {:?} lacks {phrase:?}", e.reason);
    assert_eq!(e.to_string(), format!("aws.yaml: {}: {}", e.field, e.reason));
    e
}

// ---- the example and defaults ---------------------------------------------------------------

#[test]
fn example_parses() {
    let p = parse(EXAMPLE).unwrap();
    assert_eq!(p.platform, "AWS");
    assert_eq!(p.mode, Mode::Enforce);
    assert_eq!(p.endpoints.len(), 2);
    assert_eq!(p.endpoints[0].name, "ec2-imds");
    assert_eq!(p.endpoints[0].cidr, "169.254.169.254/32".parse::<IpNet>().unwrap());
    assert_eq!(p.endpoints[0].ports, vec![80]);
    assert_eq!(p.endpoints[0].protocols, vec![Protocol::Tcp]);
    assert_eq!(p.endpoints[1].name, "ec2-imds-v6");
    assert_eq!(p.endpoints[1].cidr, "fd00:ec2::254/128".parse::<IpNet>().unwrap());
    assert_eq!(p.allow.len(), 1);
    assert_eq!(p.allow[0].name, "cloud-agent");
    let AllowSelector::Cgroup(g) = &p.allow[0].selector else { panic!("{:?}", p.allow[0]) };
    assert_eq!(g.pattern(), "cloud-agent");
    assert!(g.is_match("cloud-agent"));
    assert!(!g.is_match("cloud-agent/worker"), "nested cgroups are allowed via the ancestor");
    assert_eq!(p.cgroup_entries().map(|(i, _)| i).collect::<Vec<_>>(), vec![0]);
}

#[test]
fn load_names_the_file() {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/examples/standalone-aws.yaml"
    ));
    let p = Policy::load(&path).unwrap();
    assert_eq!(p.source, path.display().to_string());
    let missing = PathBuf::from("/nonexistent/policy.yaml");
    let e = Policy::load(&missing).unwrap_err();
    assert_eq!(e.source, "/nonexistent/policy.yaml");
    assert!(e.reason.contains("cannot read"), "{e}");
}

#[test]
fn design_md_example_parses() {
    let text = r#"
platform: AWS                 # OpenShift PlatformType this policy is for
mode: enforce                 # enforce | audit (audit: log and count, never deny)
endpoints:
  - name: ec2-imds
    cidr: 169.254.169.254/32
    ports: [80]               # omitted = all ports
    protocols: [TCP]          # TCP | UDP; omitted = all
  - name: ec2-imds-v6
    cidr: fd00:ec2::254/128
    ports: [80]
allow:
  - name: aws-cloud-controller-manager      # cluster mode: pods by namespace + labels
    namespace: openshift-cloud-controller-manager
    podSelector: {matchLabels: {k8s-app: aws-cloud-controller-manager}}
  - name: node-exporter-sidecar              # optional narrowing
    namespace: openshift-monitoring
    serviceAccount: node-exporter
    containers: [kube-rbac-proxy]
  - name: local-tool                         # standalone mode: cgroup path glob under the root
    cgroup: "tools/*"
"#;
    let p = parse(text).unwrap();
    assert_eq!(p.endpoints[1].protocols, vec![], "omitted = all");
    let AllowSelector::Pods(ccm) = &p.allow[0].selector else { panic!() };
    assert_eq!(ccm.namespace, "openshift-cloud-controller-manager");
    assert_eq!(
        ccm.match_labels.get("k8s-app").map(String::as_str),
        Some("aws-cloud-controller-manager")
    );
    let AllowSelector::Pods(ne) = &p.allow[1].selector else { panic!() };
    assert_eq!(ne.service_account.as_deref(), Some("node-exporter"));
    assert_eq!(ne.containers, vec!["kube-rbac-proxy".to_owned()]);
    assert_eq!(ne.host_network, None);
    assert_eq!(
        p.cgroup_entries().map(|(i, e)| (i, e.name.as_str())).collect::<Vec<_>>(),
        vec![(2, "local-tool")]
    );
}

#[test]
fn defaults() {
    let p = parse("platform: GCP\nendpoints:\n  - {name: md, cidr: 169.254.169.254/32}\n").unwrap();
    assert_eq!(p.mode, Mode::Enforce);
    assert!(p.endpoints[0].ports.is_empty());
    assert!(p.endpoints[0].protocols.is_empty());
    assert!(p.allow.is_empty());
    let p = parse("platform: GCP\nmode: audit\nendpoints:\n  - {name: md, cidr: 169.254.169.254/32, protocols: [UDP, TCP]}\n").unwrap();
    assert_eq!(p.mode, Mode::Audit);
    assert_eq!(p.endpoints[0].protocols, vec![Protocol::Udp, Protocol::Tcp]);
}

#[test]
fn every_platform_is_accepted() {
    for platform in platform_types() {
        let p = parse(&format!("platform: {platform}\nallowNoEndpoints: true\n")).unwrap();
        assert_eq!(p.platform, platform);
    }
}

// ---- document-level errors ------------------------------------------------------------------

#[test]
fn empty_and_non_mapping_documents() {
    assert_err("", "(document)", "the document is empty");
    assert_err("# only a comment\n", "(document)", "the document is empty");
    assert_err("- a\n- b\n", "(document)", "expected a mapping of policy fields");
    assert_err("just a string", "(document)", "found a string");
}

#[test]
fn yaml_syntax_errors_name_the_line() {
    // The YAML crate points at the bracket left open.
    let e = parse("platform: AWS\nendpoints: [\n").unwrap_err();
    assert_eq!(e.field, "line 2 column 12", "{e}");
    assert!(e.reason.contains("not valid YAML: unclosed bracket"), "{e}");
    let e = parse("platform: AWS\n  mode: audit\n").unwrap_err();
    assert!(e.field.starts_with("line 2 "), "{e}");
    let e = parse("platform: AWS\n---\nplatform: GCP\n").unwrap_err();
    assert!(e.reason.contains("multiple found"), "{e}");
    let e = parse("platform: AWS\nplatform: GCP\nendpoints: []\n").unwrap_err();
    assert_eq!(e.field, "line 2 column 1", "{e}");
    assert!(e.reason.contains("duplicate mapping key `platform`"), "{e}");
}

/// Policy text comes from a ConfigMap anyone with edit rights on it writes: a hostile
/// document is rejected with an error, quickly, never a hang, a stack overflow or an
/// exhausted memory.
#[test]
fn hostile_yaml_is_refused() {
    use std::time::{Duration, Instant};
    let deep = format!("platform: AWS\nendpoints: {}{}\n", "[".repeat(10_000), "]".repeat(10_000));
    let block: String =
        (0..200).map(|i| format!("{}- \n", "  ".repeat(i))).collect::<Vec<_>>().concat();
    let deep_block = format!("platform: AWS\nendpoints:\n{block}");
    // The billion laughs: nine levels of ten aliases each, 10^9 strings once expanded.
    let mut laughs = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..10 {
        let p = i - 1;
        laughs += &format!("a{i}: &a{i} [{}]\n", vec![format!("*a{p}"); 10].join(", "));
    }
    let laughs = format!("platform: AWS\nendpoints: []\n{laughs}");
    let laughs_in_a_field = format!(
        "platform: AWS\nmode: audit\nendpoints: []\nallow:\n  - &e {{name: x, cgroup: x}}\n{}",
        "  - *e\n".repeat(2_000)
    );
    for (what, text) in [
        ("deep flow nesting", deep),
        ("deep block nesting", deep_block),
        ("alias bomb", laughs),
        ("one anchor, many aliases", laughs_in_a_field),
    ] {
        let t = Instant::now();
        let e = parse(&text).expect_err(what);
        assert!(t.elapsed() < Duration::from_secs(10), "{what}: took {:?}", t.elapsed());
        assert!(!e.reason.is_empty(), "{what}: {e}");
    }
}

#[test]
fn yaml_1_1_forms_are_not_read_as_meant() {
    // `yes` is a string in YAML 1.2, as serde_yaml read it: no boolean here.
    assert_err(
        "platform: AWS\nallowNoEndpoints: yes\nendpoints: []\n",
        "allowNoEndpoints",
        "found the string \"yes\"",
    );
    // `<<` merges nothing: it was an unknown field, it is rejected.
    let e = parse(
        "platform: AWS\nendpoints:\n  - &b {name: a, cidr: 10.0.0.1/32}\n  - {<<: *b, name: c}\n",
    )
    .unwrap_err();
    assert!(e.reason.contains("merge"), "{e}");
}

#[test]
fn unknown_fields_name_their_path() {
    let e = assert_err(
        &with_endpoints(
            "  - {name: a, cidr: 10.0.0.1/32}\n  - {name: b, cidr: 10.0.0.2/32}\n  - name: c\n    cidr: 10.0.0.3/32\n    protocol: [TCP]\n",
        ),
        "endpoints[2].protocol",
        "unknown field `protocol`",
    );
    assert!(e.reason.contains("did you mean `protocols`?"), "{e}");
    assert_err("platform: AWS\nendpoint: []\n", "endpoint", "unknown field");
    assert_err(
        &with_allow("  - name: x\n    namespace: ns\n    podSelector: {match_labels: {a: b}}\n"),
        "allow[0].podSelector.match_labels",
        "did you mean `matchLabels`?",
    );
}

#[test]
fn wrong_types_name_their_path() {
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, ports: 80}\n"),
        "endpoints[0].ports",
        "expected a list, found the number 80",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, ports: [\"80\"]}\n"),
        "endpoints[0].ports[0]",
        "write it without quotes: 80",
    );
    assert_err(
        &with_allow("  - {name: x, namespace: ns, hostNetwork: maybe}\n"),
        "allow[0].hostNetwork",
        "invalid boolean (true or false expected), found the string \"maybe\"",
    );
}

#[test]
fn platform_errors_list_valid_values() {
    let e = assert_err("mode: audit\n", "platform", "missing");
    assert!(e.reason.contains("AWS, Azure, BareMetal"), "{e}");
    let e = assert_err(
        "platform: aws\nallowNoEndpoints: true\n",
        "platform",
        "unknown platform \"aws\"",
    );
    assert!(e.reason.contains("did you mean AWS?"), "{e}");
    assert!(e.reason.contains("AlibabaCloud, Nutanix, External"), "{e}");
    assert_err("platform: Mars\nallowNoEndpoints: true\n", "platform", "valid values: AWS");
}

#[test]
fn mode_errors() {
    assert_err("platform: AWS\nmode: enforcing\n", "mode", "expected enforce or audit");
}

// ---- endpoints ------------------------------------------------------------------------------

#[test]
fn empty_endpoint_list_needs_an_opt_out() {
    assert_err("platform: AWS\n", "endpoints", "no endpoints");
    assert_err("platform: VSphere\nendpoints: []\n", "endpoints", "allowNoEndpoints: true");
    let p = parse("platform: VSphere\nendpoints: []\nallowNoEndpoints: true\n").unwrap();
    assert!(p.endpoints.is_empty());
    let p = parse("platform: VSphere\nmode: audit\n").unwrap();
    assert!(p.endpoints.is_empty());
}

#[test]
fn endpoint_names_are_required_and_unique() {
    assert_err(&with_endpoints("  - {cidr: 10.0.0.1/32}\n"), "endpoints[0].name", "missing");
    assert_err(
        &with_endpoints("  - {name: \"\", cidr: 10.0.0.1/32}\n"),
        "endpoints[0].name",
        "is empty",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32}\n  - {name: a, cidr: 10.0.0.2/32}\n"),
        "endpoints[1].name",
        "duplicate endpoint name \"a\" (also endpoints[0])",
    );
}

#[test]
fn cidr_errors() {
    assert_err(&with_endpoints("  - {name: a}\n"), "endpoints[0].cidr", "missing");
    assert_err(
        &with_endpoints("  - {name: a, cidr: 169.254.169.300/32}\n"),
        "endpoints[0].cidr",
        "is not a CIDR",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/33}\n"),
        "endpoints[0].cidr",
        "is not a CIDR",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 169.254.169.254}\n"),
        "endpoints[0].cidr",
        "no prefix length; write 169.254.169.254/32",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 100.100.100.200/16}\n"),
        "endpoints[0].cidr",
        "host bits set: did you mean the network 100.100.0.0/16? (or 100.100.100.200/32",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: \"fd00:ec2::254/64\"}\n"),
        "endpoints[0].cidr",
        "did you mean the network fd00:ec2::/64?",
    );
}

#[test]
fn masquerade_subnets_are_refused() {
    for cidr in [
        "169.254.169.0/24",
        "169.254.0.0/16",
        "169.254.0.0/17",
        "0.0.0.0/0",
        "\"fd69::/16\"",
        "\"::/0\"",
    ] {
        assert_err(
            &with_endpoints(&format!("  - {{name: a, cidr: {cidr}}}\n")),
            "endpoints[0].cidr",
            "would break node networking; protect exact /32 or /128 addresses instead",
        );
    }
    for cidr in
        ["169.254.169.1/32", "169.254.0.1/32", "\"fd69::5/128\"", "\"::ffff:169.254.0.1/128\""]
    {
        let e = assert_err(
            &with_endpoints(&format!("  - {{name: a, cidr: {cidr}}}\n")),
            "endpoints[0].cidr",
            "lies inside the OVN-Kubernetes masquerade subnet",
        );
        assert!(!e.reason.contains("protect exact"), "{e}");
    }
    // Right next to it is fine.
    parse(&with_endpoints(
        "  - {name: a, cidr: 169.254.128.0/24}\n  - {name: b, cidr: \"fd69::1:0/112\"}\n",
    ))
    .unwrap();
}

#[test]
fn an_exact_address_in_a_masquerade_subnet_is_refused_for_what_it_is() {
    // Scaleway's metadata service: already a /32, so "protect exact addresses" would not help.
    let e = assert_err(
        &with_endpoints("  - {name: a, cidr: 169.254.42.42/32}\n"),
        "endpoints[0].cidr",
        "169.254.42.42/32 lies inside the OVN-Kubernetes masquerade subnet 169.254.0.0/17, \
         from which OVN-Kubernetes allocates the node's own addresses",
    );
    assert!(e.reason.contains("leave it out of the policy (docs/platforms.md"), "{e}");
    assert!(!e.reason.contains("/32 or /128"), "{e}");
}

#[test]
fn port_errors() {
    let e = assert_err(
        &with_endpoints(
            "  - {name: a, cidr: 10.0.0.1/32}\n  - {name: b, cidr: 10.0.0.2/32, ports: [0]}\n",
        ),
        "endpoints[1].ports[0]",
        "port 0 is outside 1-65535",
    );
    assert_eq!(e.to_string(), "aws.yaml: endpoints[1].ports[0]: port 0 is outside 1-65535");
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, ports: [80, 70000]}\n"),
        "endpoints[0].ports[1]",
        "port 70000 is outside 1-65535",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, ports: [-1]}\n"),
        "endpoints[0].ports[0]",
        "port -1 is outside 1-65535",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, ports: [99999999999999999999999]}\n"),
        "endpoints[0].ports[0]",
        "1-65535",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, ports: [80, 443, 80]}\n"),
        "endpoints[0].ports[2]",
        "duplicate port 80 (also ports[0])",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, ports: []}\n"),
        "endpoints[0].ports",
        "omit the field to mean all",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, ports: [8.5]}\n"),
        "endpoints[0].ports[0]",
        "not a whole number",
    );
    parse(&with_endpoints("  - {name: a, cidr: 10.0.0.1/32, ports: [1, 65535]}\n")).unwrap();
}

#[test]
fn protocol_errors() {
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, protocols: [ICMP]}\n"),
        "endpoints[0].protocols[0]",
        "unknown protocol \"ICMP\"; expected TCP or UDP",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, protocols: [TCP, tcp]}\n"),
        "endpoints[0].protocols[1]",
        "write TCP (upper case)",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, protocols: [UDP, UDP]}\n"),
        "endpoints[0].protocols[1]",
        "duplicate protocol UDP",
    );
    assert_err(
        &with_endpoints("  - {name: a, cidr: 10.0.0.1/32, protocols: []}\n"),
        "endpoints[0].protocols",
        "omit the field to mean all",
    );
}

#[test]
fn too_many_endpoints() {
    let items: String = (0..=MAX_ENDPOINTS)
        .map(|i| {
            let [_, b, c, d] = i.to_be_bytes();
            format!("  - {{name: e{i}, cidr: 10.{b}.{c}.{d}/32}}\n")
        })
        .collect();
    assert_err(&with_endpoints(&items), "endpoints", &format!("at most {MAX_ENDPOINTS} fit"));
}

#[test]
fn rule_overflow_is_reported_at_parse_time() {
    // 32 endpoints x 2048 ports x 2 protocols on nested prefixes: far beyond MAX_PORT_RULES.
    let ports: Vec<String> = (1..=2048).map(|p| p.to_string()).collect();
    let ports = ports.join(", ");
    let items: String = (0..32)
        .map(|i| {
            format!(
                "  - {{name: e{i}, cidr: 10.{i}.0.0/16, ports: [{ports}], protocols: [TCP, UDP]}}\n"
            )
        })
        .collect();
    assert_err(&with_endpoints(&items), "endpoints", "rules, at most");
}

// ---- allow ----------------------------------------------------------------------------------

#[test]
fn allow_names_are_required_and_unique() {
    assert_err(&with_allow("  - {cgroup: a}\n"), "allow[0].name", "missing");
    assert_err(&with_allow("  - {name: \" \", cgroup: a}\n"), "allow[0].name", "is empty");
    assert_err(
        &with_allow("  - {name: x, cgroup: a}\n  - {name: x, namespace: ns}\n"),
        "allow[1].name",
        "duplicate allow entry name \"x\" (also allow[0])",
    );
}

#[test]
fn allow_needs_exactly_one_selector() {
    assert_err(&with_allow("  - {name: x}\n"), "allow[0]", "selects nothing");
    assert_err(
        &with_allow("  - {name: x, cgroup: a, namespace: ns}\n"),
        "allow[0]",
        "has both `cgroup`",
    );
    for field in ["serviceAccount: sa", "containers: [c]", "podSelector: {}", "hostNetwork: true"] {
        let key = field.split(':').next().unwrap_or_default();
        assert_err(
            &with_allow(&format!("  - {{name: x, {field}}}\n")),
            &format!("allow[0].{key}"),
            "only applies together with `namespace`",
        );
        assert_err(
            &with_allow(&format!("  - {{name: x, cgroup: a, {field}}}\n")),
            &format!("allow[0].{key}"),
            "cannot be combined with `cgroup`",
        );
    }
}

#[test]
fn cgroup_glob_errors() {
    assert_err(
        &with_allow("  - {name: x, cgroup: \"\"}\n"),
        "allow[0].cgroup",
        "empty cgroup glob",
    );
    assert_err(
        &with_allow("  - {name: x, cgroup: /sys/fs/cgroup/tools}\n"),
        "allow[0].cgroup",
        "is absolute; cgroup globs are relative to --cgroup-root",
    );
    assert_err(
        &with_allow("  - {name: x, cgroup: \"tools/../other\"}\n"),
        "allow[0].cgroup",
        "`..`",
    );
    assert_err(&with_allow("  - {name: x, cgroup: \"..\"}\n"), "allow[0].cgroup", "`..`");
    assert_err(
        &with_allow("  - {name: x, cgroup: \"tools/\"}\n"),
        "allow[0].cgroup",
        "empty path component",
    );
    assert_err(
        &with_allow("  - {name: x, cgroup: \"tools/[a\"}\n"),
        "allow[0].cgroup",
        "not a valid glob",
    );
}

#[test]
fn cgroup_glob_semantics() {
    let p = parse(&with_allow(
        "  - {name: t, cgroup: \"tools/*\"}\n  - {name: d, cgroup: \"deep/**\"}\n",
    ))
    .unwrap();
    let AllowSelector::Cgroup(t) = &p.allow[0].selector else { panic!() };
    assert!(t.is_match("tools/a"));
    assert!(!t.is_match("tools/a/b"), "* must not cross /");
    assert!(!t.is_match("tools"));
    let AllowSelector::Cgroup(d) = &p.allow[1].selector else { panic!() };
    assert!(d.is_match("deep/a/b"));
}

#[test]
fn pod_selector_parses() {
    let p = parse(&with_allow(
        "  - name: x\n    namespace: ns-1\n    hostNetwork: true\n    podSelector:\n      matchLabels: {app: a}\n      matchExpressions:\n        - {key: tier, operator: In, values: [x, y]}\n        - {key: canary, operator: DoesNotExist}\n",
    ))
    .unwrap();
    let AllowSelector::Pods(s) = &p.allow[0].selector else { panic!() };
    assert_eq!(s.host_network, Some(true));
    assert_eq!(s.match_expressions.len(), 2);
    assert_eq!(s.match_expressions[0].operator, LabelOperator::In);
    assert_eq!(s.match_expressions[0].values, vec!["x".to_owned(), "y".to_owned()]);
    let labels = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    };
    assert!(s.matches_labels(&labels(&[("app", "a"), ("tier", "y")])));
    assert!(!s.matches_labels(&labels(&[("app", "a"), ("tier", "z")])));
    assert!(!s.matches_labels(&labels(&[("app", "a"), ("tier", "x"), ("canary", "1")])));
    assert!(!s.matches_labels(&labels(&[("tier", "x")])));
    assert!(p.cgroup_entries().next().is_none());
}

#[test]
fn not_in_and_exists_match_as_the_api_server_does() {
    let p = parse(&with_allow(
        "  - name: x\n    namespace: ns-1\n    podSelector:\n      matchExpressions:\n        - {key: tier, operator: NotIn, values: [x]}\n        - {key: app, operator: Exists}\n",
    ))
    .unwrap();
    let AllowSelector::Pods(s) = &p.allow[0].selector else { panic!() };
    let labels = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    };
    assert!(s.matches_labels(&labels(&[("app", "a")])), "NotIn holds where the key is absent");
    assert!(s.matches_labels(&labels(&[("app", "a"), ("tier", "y")])));
    assert!(!s.matches_labels(&labels(&[("app", "a"), ("tier", "x")])));
    assert!(!s.matches_labels(&labels(&[("tier", "y")])), "Exists needs the key");
}

#[test]
fn pod_selector_errors() {
    assert_err(&with_allow("  - {name: x, namespace: \"\"}\n"), "allow[0].namespace", "is empty");
    assert_err(
        &with_allow("  - {name: x, namespace: Kube_System}\n"),
        "allow[0].namespace",
        "lower-case",
    );
    assert_err(
        &with_allow("  - {name: x, namespace: ns, serviceAccount: \"\"}\n"),
        "allow[0].serviceAccount",
        "is empty",
    );
    assert_err(
        &with_allow("  - {name: x, namespace: ns, containers: []}\n"),
        "allow[0].containers",
        "omit the field to mean all containers",
    );
    assert_err(
        &with_allow("  - {name: x, namespace: ns, containers: [a, a]}\n"),
        "allow[0].containers[1]",
        "duplicate container \"a\"",
    );
    let expr = |e: &str| {
        with_allow(&format!(
            "  - name: x\n    namespace: ns\n    podSelector:\n      matchExpressions:\n        - {e}\n"
        ))
    };
    assert_err(
        &expr("{key: a, operator: In}"),
        "allow[0].podSelector.matchExpressions[0].values",
        "In needs at least one value",
    );
    assert_err(
        &expr("{key: a, operator: NotIn, values: []}"),
        "allow[0].podSelector.matchExpressions[0].values",
        "NotIn needs at least one value",
    );
    assert_err(
        &expr("{key: a, operator: Exists, values: [b]}"),
        "allow[0].podSelector.matchExpressions[0].values",
        "Exists takes no values",
    );
    assert_err(
        &expr("{key: a, operator: DoesNotExist, values: [b]}"),
        "allow[0].podSelector.matchExpressions[0].values",
        "takes no values",
    );
    assert_err(
        &expr("{key: a, operator: Has}"),
        "allow[0].podSelector.matchExpressions[0].operator",
        "one of In, NotIn, Exists, DoesNotExist",
    );
    assert_err(&expr("{key: a}"), "allow[0].podSelector.matchExpressions[0].operator", "missing");
    assert_err(
        &expr("{operator: Exists}"),
        "allow[0].podSelector.matchExpressions[0].key",
        "missing",
    );
}

// ---- compiling and hashing ------------------------------------------------------------------

#[test]
fn endpoint_specs_map_protocols_and_keep_mapped_nets_v6() {
    let p = parse(&with_endpoints(
        "  - {name: a, cidr: 169.254.169.254/32, ports: [80, 443], protocols: [TCP, UDP]}\n  - {name: b, cidr: \"::ffff:100.100.100.200/128\", protocols: [UDP]}\n  - {name: c, cidr: \"fd00:ec2::254/128\"}\n",
    ))
    .unwrap();
    let specs = p.endpoint_specs();
    assert_eq!(specs.len(), 3);
    assert_eq!(specs[0].net, Net::V4 { addr: [169, 254, 169, 254], len: 32 });
    assert_eq!(specs[0].ports, vec![80, 443]);
    assert_eq!(specs[0].protos, vec![PROTO_TCP, PROTO_UDP]);
    assert_eq!(specs[0].protos, vec![6, 17]);
    let mut mapped = [0u8; 16];
    mapped[10] = 0xff;
    mapped[11] = 0xff;
    mapped[12..].copy_from_slice(&[100, 100, 100, 200]);
    assert_eq!(specs[1].net, Net::V6 { addr: mapped, len: 128 });
    assert_eq!(specs[1].protos, vec![17]);
    assert!(specs[2].ports.is_empty() && specs[2].protos.is_empty());
    // gate-common turns the mapped net into an IPv4 prefix.
    let c = p.image();
    assert!(c.v4_entries(1).all(|(_, k, _)| k.generation == 1u32.to_be_bytes()));
    assert_eq!(c.v4.len(), 2);
    assert_eq!(c.v6.len(), 1);
}

#[test]
fn hash_is_stable_and_sensitive() {
    let a = parse(EXAMPLE).unwrap();
    let b = Policy::parse("elsewhere.yaml", EXAMPLE).unwrap();
    assert_eq!(a.hash(), b.hash(), "the source is not part of the hash");
    assert_eq!(a.hash().to_string().len(), 16);
    assert!(a.hash().to_string().bytes().all(|c| c.is_ascii_hexdigit()));
    // Formatting and comments do not matter, only content.
    let reformatted = "platform: AWS\nmode: enforce\nendpoints:\n- {name: ec2-imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}\n- {name: ec2-imds-v6, cidr: \"fd00:ec2::254/128\", ports: [80], protocols: [TCP]}\nallow: [{name: cloud-agent, cgroup: cloud-agent}]\n";
    assert_eq!(parse(reformatted).unwrap().hash(), a.hash());
    let changed = EXAMPLE.replacen("ports: [80]", "ports: [8080]", 1);
    assert_ne!(parse(&changed).unwrap().hash(), a.hash());
    let audit = EXAMPLE.replace("mode: enforce", "mode: audit");
    assert_ne!(parse(&audit).unwrap().hash(), a.hash());
    // Pinned: digests must not change between builds or versions (they are logged and
    // compared across agent upgrades).
    let pinned = "platform: AWS\nendpoints:\n  - {name: imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}\nallow:\n  - {name: t, cgroup: \"tools/*\"}\n";
    assert_eq!(parse(pinned).unwrap().hash().to_string(), "16cadac36d46eeae");
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
}

#[test]
fn grants_default_to_metadata_and_are_checked() {
    use gate_common::abi::{GRANT_CAPTURE, GRANT_METADATA, allow_entry};
    let p = parse(&with_allow(
        "  - {name: ccm, cgroup: a}\n  - {name: ids, cgroup: b, grants: [capture]}\n  - {name: both, cgroup: c, grants: [metadata, capture]}\n",
    ))
    .unwrap();
    let grants: Vec<u32> = p.allow.iter().map(|e| e.grants).collect();
    assert_eq!(grants, [GRANT_METADATA, GRANT_CAPTURE, GRANT_METADATA | GRANT_CAPTURE]);
    assert_eq!(p.allow_value(1) & !0xff_ffff, GRANT_CAPTURE);
    assert_eq!(allow_entry(p.allow_value(2)), 2);
    assert_eq!(p.allow_value(9), 9, "an index past the entries grants nothing");
    // The default changes no hash; a grant does.
    let plain = parse(&with_allow("  - {name: ccm, cgroup: a}\n")).unwrap();
    let explicit = parse(&with_allow("  - {name: ccm, cgroup: a, grants: [metadata]}\n")).unwrap();
    let capture = parse(&with_allow("  - {name: ccm, cgroup: a, grants: [capture]}\n")).unwrap();
    assert_eq!(plain.hash(), explicit.hash());
    assert_ne!(plain.hash(), capture.hash());
    assert_err(
        &with_allow("  - {name: x, cgroup: a, grants: []}\n"),
        "allow[0].grants",
        "grants nothing",
    );
    assert_err(
        &with_allow("  - {name: x, cgroup: a, grants: [metadata, pcap]}\n"),
        "allow[0].grants[1]",
        "unknown grant \"pcap\"; one of metadata, capture",
    );
    assert_err(
        &with_allow("  - {name: x, cgroup: a, grants: [capture, capture]}\n"),
        "allow[0].grants[1]",
        "listed twice",
    );
}

// ---- served paths ----------------------------------------------------------------------------

#[test]
fn an_entry_narrowed_to_paths_grants_no_metadata() {
    let p = parse(&with_allow(
        "  - name: ebs-csi\n    cgroup: csi\n    paths: [/latest/meta-data/instance-id, \
         /latest/meta-data/placement/]\n",
    ))
    .unwrap();
    let a = &p.allow[0];
    assert_eq!(a.grants, 0, "an entry with paths reaches the metadata service only by them");
    let paths = a.paths.as_ref().expect("paths kept");
    assert_eq!(paths.access.methods, gate_common::http::Methods::READ);
    assert!(paths.access.judge("GET", "/latest/meta-data/placement/region").is_ok());
    assert!(paths.access.judge("GET", "/latest/meta-data/placementX").is_err());
    assert!(paths.access.judge("PUT", "/latest/meta-data/instance-id").is_err());
    assert_eq!(p.paths_not_served(), ["ebs-csi"]);
    // With capture: the grant is kept, metadata is not added.
    let p = parse(&with_allow(
        "  - {name: ids, cgroup: ids, grants: [capture], paths: [/latest/meta-data/instance-id]}\n",
    ))
    .unwrap();
    assert_eq!(p.allow[0].grants, gate_common::abi::GRANT_CAPTURE);
}

#[test]
fn the_safe_profile_expands_with_its_methods_and_listed_additions() {
    let p = parse(&with_allow(
        "  - {name: nth, cgroup: nth, profile: safe, paths: [/latest/meta-data/spot/instance-action]}\n",
    ))
    .unwrap();
    let access = &p.allow[0].paths.as_ref().unwrap().access;
    assert!(access.judge("PUT", "/latest/api/token").is_ok(), "the profile's token request");
    assert!(access.judge("GET", "/latest/meta-data/placement/region").is_ok());
    assert!(access.judge("GET", "/latest/meta-data/spot/instance-action").is_ok());
    assert!(access.judge("GET", "/latest/meta-data/iam/security-credentials/").is_err());
    let served = parse(&with_endpoints(
        "  - {name: imds, cidr: 169.254.169.254/32}\nserved: {profile: safe}\n",
    ))
    .unwrap();
    assert!(served.served.is_some());
    assert_eq!(served.paths_not_served(), ["served"]);
}

#[test]
fn an_exact_rule_serves_its_path_and_nothing_below_it() {
    let p = parse(&with_allow(
        "  - {name: a, cgroup: a, paths: [=/, '=/computeMetadata/v1/', /latest/meta-data/]}\n",
    ))
    .unwrap();
    let access = &p.allow[0].paths.as_ref().unwrap().access;
    let rules: Vec<&str> = access.paths.iter().map(|r| r.as_str()).collect();
    assert_eq!(rules, ["=/", "=/computeMetadata/v1/", "/latest/meta-data/"]);
    assert!(access.judge("GET", "/").is_ok());
    assert!(access.judge("GET", "/computeMetadata/v1/").is_ok());
    assert!(access.judge("GET", "/latest/meta-data/placement/region").is_ok(), "a prefix still");
    for refused in ["/computeMetadata/v1/instance/service-accounts/default/token", "/latest"] {
        assert!(access.judge("GET", refused).is_err(), "{refused}");
    }
}

#[test]
fn bad_access_fields_are_named() {
    let e = |item: &str, field: &str, phrase: &str| {
        assert_err(&with_allow(&format!("  - {{name: a, cgroup: a, {item}}}\n")), field, phrase);
    };
    e("paths: [latest/meta-data]", "allow[0].paths[0]", "must start with /");
    e("paths: [/latest/../iam/]", "allow[0].paths[0]", ". and .. segments");
    e("paths: [/latest//x]", "allow[0].paths[0]", "empty segment");
    e("paths: [/latest/%2e%2e/iam]", "allow[0].paths[0]", "percent-encoding");
    e("paths: ['/latest?x=1']", "allow[0].paths[0]", "list query parameters apart");
    e("paths: [/a, /a]", "allow[0].paths[1]", "listed twice");
    e("paths: [/a, =/a]", "allow[0].paths[1]", "listed twice (also paths[0], \"/a\"");
    e("paths: [=latest/]", "allow[0].paths[0]", "= (an exact path) must be followed by a path");
    e("paths: [\"=\"]", "allow[0].paths[0]", "= (an exact path) must be followed by a path");
    e("paths: [=/a/../]", "allow[0].paths[0]", ". and .. segments");
    e("paths: []", "allow[0].paths", "serves nothing");
    e("methods: [GET]", "allow[0].paths", "missing");
    e("paths: [/a], methods: [POST]", "allow[0].methods[0]", "never served");
    e("paths: [/a], methods: [GET, GET]", "allow[0].methods[1]", "listed twice");
    e("paths: [/a], methods: []", "allow[0].methods", "allows no request");
    e(
        "paths: [/a], queryParameters: ['a b']",
        "allow[0].queryParameters[0]",
        "not a query parameter",
    );
    e("paths: [/a], queryParameters: [v, v]", "allow[0].queryParameters[1]", "listed twice");
    e("profile: strict", "allow[0].profile", "unknown profile");
    e("paths: [/a], grants: [metadata]", "allow[0].grants[0]", "keep one of them");
    e("rate: {perSecond: 1}", "allow[0].paths", "missing");
    e("paths: [/a], rate: {burst: 3}", "allow[0].rate.perSecond", "missing");
    e("paths: [/a], rate: {perSecond: 0}", "allow[0].rate.perSecond", "outside 0.001-1000");
    e("paths: [/a], rate: {perSecond: 5000}", "allow[0].rate.perSecond", "outside 0.001-1000");
    e("paths: [/a], rate: {perSecond: 1, burst: 0}", "allow[0].rate.burst", "outside 1-1000");
    e("paths: [/a], rate: {perSecond: 1, burst: -2}", "allow[0].rate.burst", "outside 1-1000");
    assert_err(
        "platform: BareMetal\nallowNoEndpoints: true\nserved: {profile: safe}\n",
        "served.profile",
        "no safe profile for platform BareMetal",
    );
}

#[test]
fn rates_are_read_in_thousandths_with_a_burst_of_at_least_one() {
    let rate = |item: &str| {
        let p = parse(&with_allow(&format!("  - {{name: a, cgroup: a, paths: [/a], {item}}}\n")))
            .unwrap();
        p.allow[0].paths.as_ref().unwrap().rate
    };
    let r = |milli_per_second, burst| Some(crate::policy::Rate { milli_per_second, burst });
    assert_eq!(rate("rate: {perSecond: 0.5, burst: 3}"), r(500, 3));
    assert_eq!(rate("rate: {perSecond: 0.5}"), r(500, 1), "burst: perSecond rounded up");
    assert_eq!(rate("rate: {perSecond: 2.5}"), r(2500, 3));
    assert_eq!(rate("methods: [GET]"), None, "no rate: as written");
    let a = parse(&with_allow("  - {name: a, cgroup: a, paths: [/a]}\n")).unwrap();
    let b = parse(&with_allow("  - {name: a, cgroup: a, paths: [/a], rate: {perSecond: 1}}\n"))
        .unwrap();
    assert_ne!(a.hash(), b.hash(), "a rate is part of the policy");
}

#[test]
fn paths_change_the_hash_and_their_absence_keeps_it() {
    let plain = parse(&with_allow("  - {name: a, cgroup: a}\n")).unwrap();
    let narrowed = parse(&with_allow("  - {name: a, cgroup: a, paths: [/a]}\n")).unwrap();
    let other = parse(&with_allow("  - {name: a, cgroup: a, paths: [/b]}\n")).unwrap();
    let put =
        parse(&with_allow("  - {name: a, cgroup: a, paths: [/a], methods: [PUT]}\n")).unwrap();
    // `=/` (the root alone) is not `/` (the whole service): another policy.
    let root = parse(&with_allow("  - {name: a, cgroup: a, paths: [/]}\n")).unwrap();
    let exact_root = parse(&with_allow("  - {name: a, cgroup: a, paths: [=/]}\n")).unwrap();
    let hashes =
        [plain.hash(), narrowed.hash(), other.hash(), put.hash(), root.hash(), exact_root.hash()];
    for (i, a) in hashes.iter().enumerate() {
        for b in &hashes[i + 1..] {
            assert_ne!(a, b);
        }
    }
}
