//! Structural checks of the Prometheus Operator's custom resources, which k8s-openapi does
//! not know: at every level the fields the CRD defines (any other is reported, as the API
//! server would prune it), the required ones, the types, the enums and the durations.
//! Transcribed from prometheus-operator v0.93's CRDs
//! (example/prometheus-operator-crd/monitoring.coreos.com_{servicemonitors,prometheusrules}.yaml);
//! parts the manifests here do not use are taken as they come (`Any`). `metadata` is checked
//! against k8s-openapi's ObjectMeta by the caller.
use serde_json::Value;

pub(super) enum Shape {
    /// Not checked.
    Any,
    Str,
    Bool,
    Int,
    IntOrStr,
    Enum(&'static [&'static str]),
    /// A Prometheus duration: `0`, or units in the order y w d h m s ms (`1h30m`).
    Duration,
    /// `map[string]string`.
    StrMap,
    List(&'static Shape),
    /// Fields, and which of them are required.
    Obj(&'static [(&'static str, Shape)], &'static [&'static str]),
}

use Shape::*;

const LABEL_SELECTOR: Shape = Obj(
    &[
        ("matchLabels", StrMap),
        (
            "matchExpressions",
            List(&Obj(
                &[
                    ("key", Str),
                    ("operator", Enum(&["In", "NotIn", "Exists", "DoesNotExist"])),
                    ("values", List(&Str)),
                ],
                &["key", "operator"],
            )),
        ),
    ],
    &[],
);

const RELABEL: Shape = Obj(
    &[
        (
            "action",
            Enum(&[
                "replace",
                "Replace",
                "keep",
                "Keep",
                "drop",
                "Drop",
                "hashmod",
                "HashMod",
                "labelmap",
                "LabelMap",
                "labeldrop",
                "LabelDrop",
                "labelkeep",
                "LabelKeep",
                "lowercase",
                "Lowercase",
                "uppercase",
                "Uppercase",
                "keepequal",
                "KeepEqual",
                "dropequal",
                "DropEqual",
            ]),
        ),
        ("modulus", Int),
        ("regex", Str),
        ("replacement", Str),
        ("separator", Str),
        ("sourceLabels", List(&Str)),
        ("targetLabel", Str),
    ],
    &[],
);

const TLS_CONFIG: Shape = Obj(
    &[
        ("ca", Any),
        ("caFile", Str),
        ("cert", Any),
        ("certFile", Str),
        ("insecureSkipVerify", Bool),
        ("keyFile", Str),
        ("keySecret", Any),
        ("maxVersion", Enum(&["TLS10", "TLS11", "TLS12", "TLS13"])),
        ("minVersion", Enum(&["TLS10", "TLS11", "TLS12", "TLS13"])),
        ("serverName", Str),
    ],
    &[],
);

const ENDPOINT: Shape = Obj(
    &[
        ("authorization", Any),
        ("basicAuth", Any),
        ("bearerTokenFile", Str),
        ("bearerTokenSecret", Any),
        ("enableHttp2", Bool),
        ("filterRunning", Bool),
        ("followRedirects", Bool),
        ("honorLabels", Bool),
        ("honorTimestamps", Bool),
        ("interval", Duration),
        ("metricRelabelings", List(&RELABEL)),
        ("noProxy", Str),
        ("oauth2", Any),
        ("params", Any),
        ("path", Str),
        ("port", Str),
        ("proxyConnectHeader", Any),
        ("proxyFromEnvironment", Bool),
        ("proxyUrl", Str),
        ("relabelings", List(&RELABEL)),
        ("scheme", Enum(&["http", "https", "HTTP", "HTTPS"])),
        ("scrapeTimeout", Duration),
        ("targetPort", IntOrStr),
        ("tlsConfig", TLS_CONFIG),
        ("trackTimestampsStaleness", Bool),
    ],
    &[],
);

pub(super) const SERVICE_MONITOR: Shape = Obj(
    &[
        ("apiVersion", Str),
        ("kind", Str),
        ("metadata", Any),
        (
            "spec",
            Obj(
                &[
                    ("attachMetadata", Any),
                    ("bodySizeLimit", Str),
                    ("convertClassicHistogramsToNHCB", Bool),
                    ("endpoints", List(&ENDPOINT)),
                    ("fallbackScrapeProtocol", Str),
                    ("jobLabel", Str),
                    ("keepDroppedTargets", Int),
                    ("labelLimit", Int),
                    ("labelNameLengthLimit", Int),
                    ("labelValueLengthLimit", Int),
                    ("namespaceSelector", Obj(&[("any", Bool), ("matchNames", List(&Str))], &[])),
                    ("nativeHistogramBucketLimit", Int),
                    ("nativeHistogramMinBucketFactor", Any),
                    ("podTargetLabels", List(&Str)),
                    ("sampleLimit", Int),
                    ("scrapeClass", Str),
                    ("scrapeClassicHistograms", Bool),
                    ("scrapeNativeHistograms", Bool),
                    ("scrapeProtocols", List(&Str)),
                    ("selector", LABEL_SELECTOR),
                    ("selectorMechanism", Enum(&["RelabelConfig", "RoleSelector"])),
                    ("serviceDiscoveryRole", Enum(&["Endpoints", "EndpointSlice"])),
                    ("targetLabels", List(&Str)),
                    ("targetLimit", Int),
                ],
                &["endpoints", "selector"],
            ),
        ),
    ],
    &["spec"],
);

pub(super) const PROMETHEUS_RULE: Shape = Obj(
    &[
        ("apiVersion", Str),
        ("kind", Str),
        ("metadata", Any),
        (
            "spec",
            Obj(
                &[(
                    "groups",
                    List(&Obj(
                        &[
                            ("interval", Duration),
                            ("labels", StrMap),
                            ("limit", Int),
                            ("name", Str),
                            ("partial_response_strategy", Str),
                            ("query_offset", Duration),
                            (
                                "rules",
                                List(&Obj(
                                    &[
                                        ("alert", Str),
                                        ("annotations", StrMap),
                                        ("expr", IntOrStr),
                                        ("for", Duration),
                                        ("keep_firing_for", Duration),
                                        ("labels", StrMap),
                                        ("record", Str),
                                    ],
                                    &["expr"],
                                )),
                            ),
                        ],
                        &["name"],
                    )),
                )],
                &[],
            ),
        ),
    ],
    &["spec"],
);

/// Every way `v` departs from `shape`, each with its field path.
pub(super) fn check(v: &Value, shape: &Shape, path: &str, errs: &mut Vec<String>) {
    let at = |p: &str| if p.is_empty() { "the object".to_owned() } else { p.to_owned() };
    let mut expect = |what: &str| errs.push(format!("{}: expected {what}, got {v}", at(path)));
    match shape {
        Any => {}
        Str => {
            if !v.is_string() {
                expect("a string");
            }
        }
        Bool => {
            if !v.is_boolean() {
                expect("true or false");
            }
        }
        Int => {
            if !v.is_i64() && !v.is_u64() {
                expect("an integer");
            }
        }
        IntOrStr => {
            if !v.is_string() && !v.is_i64() && !v.is_u64() {
                expect("an integer or a string");
            }
        }
        Enum(values) => {
            if !v.as_str().is_some_and(|s| values.contains(&s)) {
                expect(&format!("one of {values:?}"));
            }
        }
        Duration => {
            if !v.as_str().is_some_and(is_duration) {
                expect("a duration such as 30s, 5m or 1h30m");
            }
        }
        StrMap => match v.as_object() {
            Some(m) if m.values().all(Value::is_string) => {}
            _ => expect("a map of strings"),
        },
        List(item) => match v.as_array() {
            Some(a) => {
                for (i, x) in a.iter().enumerate() {
                    check(x, item, &format!("{path}[{i}]"), errs);
                }
            }
            None => expect("a list"),
        },
        Obj(fields, required) => {
            let Some(m) = v.as_object() else { return expect("a mapping") };
            for (k, x) in m {
                let here = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                match fields.iter().find(|(f, _)| f == k) {
                    Some((_, s)) => check(x, s, &here, errs),
                    None => errs.push(format!("unknown field {here}")),
                }
            }
            for r in *required {
                if !m.contains_key(*r) {
                    let here =
                        if path.is_empty() { (*r).to_owned() } else { format!("{path}.{r}") };
                    errs.push(format!("{here} is required"));
                }
            }
        }
    }
}

/// `0`, or one or more of `<digits><unit>` with the units in the order y w d h m s ms, each
/// at most once (the CRDs' pattern, without the empty string it also admits).
pub(super) fn is_duration(s: &str) -> bool {
    const UNITS: &[&str] = &["y", "w", "d", "h", "m", "s", "ms"];
    if s == "0" {
        return true;
    }
    let mut rest = s;
    let mut next_unit = 0;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return false;
        }
        rest = &rest[digits..];
        // "ms" before "m": the longest unit that matches.
        let Some(u) = (next_unit..UNITS.len())
            .filter(|&u| rest.starts_with(UNITS[u]))
            .max_by_key(|&u| UNITS[u].len())
        else {
            return false;
        };
        rest = &rest[UNITS[u].len()..];
        next_unit = u + 1;
    }
    !s.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        for ok in ["0", "30s", "5m", "1h30m", "100ms", "1y2w3d4h5m6s7ms", "1m500ms"] {
            assert!(is_duration(ok), "{ok}");
        }
        for bad in ["", "5", "m", "30s5m", "5mm", "1.5h", "-5m", "5 m"] {
            assert!(!is_duration(bad), "{bad}");
        }
    }

    #[test]
    fn misplaced_fields_wrong_types_and_missing_requirements_are_named() {
        let v: Value = serde_json::json!({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {},
            "spec": {"endpoints": [{"port": "m", "scheme": "tcp", "interval": "30",
                                    "tlsConfig": {"insecureSkipVerify": "yes", "serverName": "s"},
                                    "bearerToken": "x"}]}
        });
        let mut errs = Vec::new();
        check(&v, &SERVICE_MONITOR, "", &mut errs);
        for want in [
            "spec.endpoints[0].scheme: expected one of",
            "spec.endpoints[0].interval: expected a duration",
            "spec.endpoints[0].tlsConfig.insecureSkipVerify: expected true or false",
            "unknown field spec.endpoints[0].bearerToken",
            "spec.selector is required",
        ] {
            assert!(errs.iter().any(|e| e.starts_with(want)), "{want}: {errs:?}");
        }
        assert_eq!(errs.len(), 5, "{errs:?}");
    }
}
