//! Cluster-mode API code, offline: against kube-rs tower-test mocks (exact requests) and
//! against the Kubernetes API double of the integration tests (real wire format).
use gate_agent::cluster::platform::{self, Origin};
use http::{Request, Response};
use integration_tests::kubeapi::{self, INFRASTRUCTURES, KubeApi, NODES};
use kube::client::Body;

fn json_response(code: u16, body: serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string().into_bytes()))
        .expect("response")
}

/// No Infrastructure CRD (404): the platform comes from the node's providerID.
#[tokio::test]
async fn detect_falls_back_to_the_provider_id_on_404() {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let server = tokio::spawn(async move {
        let (req, send) = handle.next_request().await.expect("infrastructure request");
        assert_eq!(req.method(), "GET");
        assert_eq!(req.uri().path(), "/apis/config.openshift.io/v1/infrastructures/cluster");
        send.send_response(json_response(
            404,
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "NotFound", "code": 404, "message": "the server could not find the requested resource"}),
        ));
        let (req, send) = handle.next_request().await.expect("node request");
        assert_eq!(req.uri().path(), "/api/v1/nodes/node-1");
        send.send_response(json_response(200, kubeapi::node("node-1", "gce://proj/zone/vm-1")));
    });
    let d = platform::detect(&client, "node-1", None).await.expect("detected");
    assert_eq!(d.platform, "GCP");
    assert_eq!(d.origin, Origin::ProviderId);
    assert_eq!(d.configmap_name(), "metadata-gate-policy-gcp");
    server.await.expect("mock server");
}

/// `--platform` wins and asks the API nothing.
#[tokio::test]
async fn the_flag_needs_no_api() {
    let (service, _handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let d = platform::detect(&client, "node-1", Some("Azure")).await.expect("detected");
    assert_eq!((d.platform.as_str(), d.origin), ("Azure", Origin::Flag));
}

fn client_for(api: &KubeApi, token: &str) -> kube::Client {
    let mut config = kube::Config::new(format!("http://{}", api.addr).parse().expect("url"));
    config.auth_info.token = Some(token.to_owned().into());
    kube::Client::try_from(config).expect("client")
}

#[tokio::test]
async fn detect_against_the_api_double() {
    let api = KubeApi::start(Some("t0k")).expect("double");
    api.put(NODES, kubeapi::node("node-1", "aws:///us-east-1a/i-1"));
    // OpenShift: the Infrastructure object decides, External carries its platform name.
    let mut infra = kubeapi::infrastructure("External");
    infra["spec"]["platformSpec"]["external"] = serde_json::json!({"platformName": "oci"});
    api.put(INFRASTRUCTURES, infra);
    let d = platform::detect(&client_for(&api, "t0k"), "node-1", None).await.expect("detected");
    assert_eq!((d.platform.as_str(), d.origin), ("External/oci", Origin::Infrastructure));
    assert_eq!(d.configmap_name(), "metadata-gate-policy-external-oci");

    // Plain Kubernetes: no CRD.
    api.remove_resource(INFRASTRUCTURES);
    let d = platform::detect(&client_for(&api, "t0k"), "node-1", None).await.expect("detected");
    assert_eq!((d.platform.as_str(), d.origin), ("AWS", Origin::ProviderId));

    // A node with an unknown provider: a clear error that names the flag.
    api.put(NODES, kubeapi::node("node-2", "kind://docker/kind/kind-worker"));
    let e =
        platform::detect(&client_for(&api, "t0k"), "node-2", None).await.unwrap_err().to_string();
    assert!(e.contains("kind://") && e.contains("--platform"), "{e}");

    // Wrong token and forbidden reads surface as errors naming what was read.
    let e =
        platform::detect(&client_for(&api, "nope"), "node-1", None).await.unwrap_err().to_string();
    assert!(e.contains("infrastructures.config.openshift.io/cluster") && e.contains("401"), "{e}");
    api.forbid(NODES);
    let e =
        platform::detect(&client_for(&api, "t0k"), "node-1", None).await.unwrap_err().to_string();
    assert!(e.contains("403"), "{e}");
}
