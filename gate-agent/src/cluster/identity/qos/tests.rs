//! The QoS class from the status or computed from the resources, and quantity parsing.
use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::cluster::identity::{IdentityError, PodInfo, test_fixtures::*};

// ---- QoS -----------------------------------------------------------------------------------

/// The computed QoS of a pod (no status) with these containers and init containers.
fn qos_of(containers: Value, init: Value) -> Result<QosClass, IdentityError> {
    PodInfo::from_pod(&api_pod(json!({
        "metadata": {"uid": UID, "namespace": "ns", "name": "p"},
        "spec": {"containers": containers, "initContainers": init},
    })))
    .map(|p| p.qos)
}

fn res(requests: Value, limits: Value) -> Value {
    json!({"name": "c", "resources": {"requests": requests, "limits": limits}})
}

#[test]
fn status_qos_class_wins() {
    for q in QosClass::ALL {
        let mut v = full_pod();
        set(&mut v, &["status", "qosClass"], json!(q.as_str()));
        assert_eq!(info(v).qos, q);
    }
}

#[test]
fn qos_is_computed_without_a_status() {
    use QosClass::*;
    let none = json!([]);
    let g = res(json!({"cpu": "1", "memory": "1Gi"}), json!({"cpu": "1000m", "memory": "1024Mi"}));
    assert_eq!(qos_of(json!([g.clone()]), none.clone()).unwrap(), Guaranteed, "equal quantities");
    assert_eq!(qos_of(json!([g.clone(), g.clone()]), json!([g.clone()])).unwrap(), Guaranteed);
    let be = json!({"name": "c"});
    assert_eq!(qos_of(json!([be.clone()]), none.clone()).unwrap(), BestEffort);
    assert_eq!(
        qos_of(json!([res(json!({"ephemeral-storage": "1Gi"}), json!({}))]), none.clone()).unwrap(),
        BestEffort,
        "only cpu and memory count"
    );
    assert_eq!(qos_of(json!([g.clone(), be.clone()]), none.clone()).unwrap(), Burstable, "mixed");
    assert_eq!(qos_of(json!([g.clone()]), json!([be.clone()])).unwrap(), Burstable, "init counts");
    assert_eq!(
        qos_of(json!([res(json!({"cpu": "1"}), json!({"cpu": "1"}))]), none.clone()).unwrap(),
        Burstable,
        "memory unset"
    );
    assert_eq!(
        qos_of(
            json!([res(
                json!({"cpu": "500m", "memory": "1Gi"}),
                json!({"cpu": "1", "memory": "1Gi"})
            )]),
            none.clone()
        )
        .unwrap(),
        Burstable,
        "request below limit"
    );
    assert_eq!(
        qos_of(json!([res(json!({"cpu": "0", "memory": "0"}), json!({}))]), none.clone()).unwrap(),
        BestEffort,
        "zero requests"
    );
    // Pod-level resources decide alone.
    let p = PodInfo::from_pod(&api_pod(json!({
        "metadata": {"uid": UID, "namespace": "ns", "name": "p"},
        "spec": {
            "containers": [be],
            "resources": {"requests": {"cpu": "2", "memory": "2G"},
                          "limits": {"cpu": "2", "memory": "2000M"}},
        },
    })))
    .unwrap();
    assert_eq!(p.qos, Guaranteed);
}

#[test]
fn unparseable_quantities_are_named() {
    let e =
        qos_of(json!([{"name": "a"}, res(json!({"cpu": "lots"}), json!({"cpu": "1"}))]), json!([]))
            .unwrap_err();
    assert_invalid(&e, "spec.containers[1].resources.requests.cpu", "\"lots\"");
    let e = qos_of(json!([]), json!([res(json!({}), json!({"memory": "1Qi"}))])).unwrap_err();
    assert_invalid(&e, "spec.initContainers[0].resources.limits.memory", "\"1Qi\"");
}

#[test]
fn quantities() {
    const N: i128 = 1_000_000_000;
    for (q, nanos) in [
        ("0", 0),
        ("1", N),
        ("+1", N),
        ("-1", -N),
        ("100m", N / 10),
        ("0.1", N / 10),
        (".5", N / 2),
        ("5.", 5 * N),
        ("1n", 1),
        ("1u", 1000),
        ("1k", 1000 * N),
        ("1M", 1_000_000 * N),
        ("1G", 1_000_000_000 * N),
        ("2T", 2_000_000_000_000 * N),
        ("1P", 10i128.pow(15) * N),
        ("1E", 10i128.pow(18) * N),
        ("1Ki", 1024 * N),
        ("1Mi", 1024 * 1024 * N),
        ("1.5Gi", 3 * 512 * 1024 * 1024 * N),
        ("1Ti", 1024i128.pow(4) * N),
        ("1Pi", 1024i128.pow(5) * N),
        ("1Ei", 1024i128.pow(6) * N),
        ("1e3", 1000 * N),
        ("1E3", 1000 * N),
        ("1e+3", 1000 * N),
        ("25e-2", N / 4),
        ("0.1n", 1),
        ("1e-30", 1),
        ("0e-30", 0),
        ("007", 7 * N),
    ] {
        assert_eq!(parse_quantity(q), Some(nanos), "{q}");
    }
    for q in
        ["", "+", ".", "1..2", "1.2.3", "1x", "1e", "1e+", "1ee3", "m", "1 ", " 1", "1kk", "1e99"]
    {
        assert_eq!(parse_quantity(q), None, "{q:?}");
    }
}

proptest! {
    #[test]
    fn quantity_parser_never_panics(s in "[-+0-9.eEkKMGTPiunm]{0,24}") {
        let _ = parse_quantity(&s);
    }
}
