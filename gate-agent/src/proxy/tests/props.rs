//! For any method and target: the metadata service is never asked for what the caller's access
//! block does not serve; and what it serves is forwarded as it was asked. Served in memory by
//! the real connection code (the fuzz target's harness), so that thousands of cases run fast.
use gate_common::http::Access;
use proptest::prelude::*;

use crate::proxy::{
    fake,
    fuzzing::{POLICY, serve_bytes},
    table::Table,
};

/// Segments an attacker would try, and the policy's own.
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "latest",
            "meta-data",
            "placement",
            "placementX",
            "region",
            "instance-id",
            "iam",
            "info",
            "api",
            "token",
            ".",
            "..",
            "",
            "%2e%2e",
            "%2f",
            "%2F..%2Fiam",
            "a\\b",
            "x#y",
            "a;b",
            "\u{e9}",
        ])
        .prop_map(str::to_owned),
        "[!-~]{0,6}",
    ]
}

fn target() -> impl Strategy<Value = String> {
    let path = proptest::collection::vec(segment(), 0..6).prop_map(|s| format!("/{}", s.join("/")));
    let query = prop_oneof![
        6 => Just(String::new()),
        2 => Just("?alt=text".to_owned()),
        1 => Just("?alt=json&alt=text".to_owned()),
        1 => Just("?recursive=true".to_owned()),
        1 => "\\?[!-~]{0,8}",
    ];
    // Paths the policy lists, with an attacker's tail half of the time: random segments alone
    // would rarely be served, and the property would hold by refusing everything.
    let listed = prop::sample::select(vec![
        "/latest/meta-data/instance-id",
        "/latest/meta-data/placement",
        "/latest/meta-data/placement/",
        "/latest/meta-data/placement/region",
        "/latest/api/token",
        "/latest/meta-data/iam/info",
    ]);
    let tail = prop_oneof![
        2 => Just(String::new()),
        2 => proptest::collection::vec(segment(), 1..3).prop_map(|s| format!("/{}", s.join("/"))),
    ];
    let near = (listed, tail).prop_map(|(l, t)| format!("{l}{t}"));
    prop_oneof![
        6 => (path, query.clone()).prop_map(|(p, q)| format!("{p}{q}")),
        12 => (near, query).prop_map(|(p, q)| format!("{p}{q}")),
        1 => "http://[a-z0-9.]{1,16}/latest/meta-data/[a-z-]{0,12}",
        1 => Just("169.254.169.254:80".to_owned()),
        1 => Just("*".to_owned()),
        1 => "[ -~]{0,24}",
    ]
}

fn method() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["GET", "HEAD", "PUT"]).prop_map(str::to_owned),
        2 => prop::sample::select(vec!["POST", "CONNECT", "OPTIONS", "get", "DELETE"])
            .prop_map(str::to_owned),
        1 => "[A-Za-z]{1,7}",
    ]
}

fn extra_header() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "",
        "",
        "",
        "",
        "",
        "",
        "Metadata-Flavor: Google\r\n",
        "X-Forwarded-For: 10.0.0.1\r\n",
        "Content-Length: 0\r\n",
        "Content-Length: 3\r\n",
        "Transfer-Encoding: chunked\r\n",
        "Host: evil.example\r\n",
        "Via: 1.1 x\r\n",
        "Connection: close, Metadata-Flavor\r\n",
    ])
}

/// The access block of the caller a selector picks (`fuzzing::caller`), if it has one.
fn access(table: &Table, selector: u8) -> Option<Access> {
    match selector % 8 {
        0..=3 => table.grant(Some(1)).ok().map(|g| g.access.clone()),
        4 | 5 => table.grant(None).ok().map(|g| g.access.clone()),
        _ => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn the_service_is_never_asked_for_what_the_caller_may_not_read(
        // The narrowed entry's callers (0-3) more often than the rest.
        selector in prop_oneof![2 => 0u8..4, 1 => any::<u8>()],
        method in method(),
        target in target(),
        extra in extra_header(),
    ) {
        let raw = format!("{method} {target} HTTP/1.1\r\nHost: 169.254.169.254\r\n{extra}\r\n");
        // `serve_bytes` panics if anything forwarded is not the caller's to read.
        let forwarded = serve_bytes(selector, raw.as_bytes());
        let lines: Vec<_> = forwarded.iter().filter_map(|r| fake::request_line(r)).collect();
        prop_assert!(lines.len() <= 1, "{lines:?}");

        // And a request the judge serves, in a form the proxy accepts, is forwarded as asked:
        // the property above does not hold by refusing everything. (hyper rejects with 400 some
        // bytes the judge accepts, `<` or `"`: never forwarded, which is the safe way round.)
        let table = Table::new(&crate::policy::Policy::parse("t", POLICY).expect("policy"), 3);
        let plain_form = extra.is_empty() || extra.starts_with("Metadata-Flavor") || extra == "Content-Length: 0\r\n";
        // A token request is answered by the proxy itself (tests/answers.rs).
        let own_token = table.session().is_some_and(|s| method == "PUT" && target.split('?').next() == Some(s.path));
        if let Some(a) = access(&table, selector)
            && plain_form
            && !own_token
            && target.parse::<http::Uri>().is_ok()
            && a.judge(&method, &target).is_ok()
        {
            prop_assert_eq!(lines, vec![(method.clone(), target.clone())]);
        }
    }
}
