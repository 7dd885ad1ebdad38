//! What the fake metadata service answers on the platforms' own paths, as the real services
//! do, closely enough for the clouds' client SDKs (botocore, google-auth, a managed-identity
//! client): AWS IMDSv2 (a session token from `PUT /latest/api/token`, required by every
//! `GET` that carries the token header), GCP (`Metadata-Flavor: Google` required and
//! answered) and Azure (`Metadata: true` and `api-version` required). Pure: request bytes in,
//! response bytes out.
//!
//! Requests that name no platform keep the service's one default reply ([`INSTANCE_ID`],
//! 200), whatever their path: a plain `GET` without IMDSv2's token header (IMDSv1), without
//! GCP's header on `/`, anything off the three trees. The probes send exactly those, and the
//! tests built on them stay as they were.
use super::INSTANCE_ID;

/// The session token `PUT /latest/api/token` hands out; a `GET` carrying another gets 401.
pub const AWS_SESSION_TOKEN: &str = "AQAEAFakeImdsSessionToken-gate-test==";
pub const AWS_REGION: &str = "eu-west-3";
/// botocore takes the region from the zone, less its last letter.
pub const AWS_ZONE: &str = "eu-west-3b";
pub const AWS_ROLE: &str = "gate-test-node-role";
/// The node role's access key id, in its credentials document.
pub const AWS_ACCESS_KEY_ID: &str = "ASIAGATETESTFAKEKEY01";
pub const GCP_PROJECT: &str = "gate-test-project";
pub const GCP_PROJECT_NUMBER: &str = "123456789012";
pub const GCP_ZONE: &str = "projects/123456789012/zones/europe-west9-b";
pub const GCP_SERVICE_ACCOUNT: &str = "node@gate-test-project.iam.gserviceaccount.com";
pub const GCP_ACCESS_TOKEN: &str = "ya29.gate-test-node-access-token";
pub const AZURE_LOCATION: &str = "westeurope";
pub const AZURE_ACCESS_TOKEN: &str = "eyJ0eXAiOiJKV1QifQ.gate-test-managed-identity.token";

/// A request as the service reads it: method, path, query pairs (raw), headers (names in
/// lower case).
struct Request<'a> {
    method: &'a str,
    path: &'a str,
    query: Vec<(&'a str, &'a str)>,
    headers: Vec<(String, &'a str)>,
}

impl<'a> Request<'a> {
    fn parse(head: &'a str) -> Option<Request<'a>> {
        let mut lines = head.split("\r\n");
        let mut first = lines.next()?.split(' ');
        let (method, target) = (first.next()?, first.next()?);
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let query = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| p.split_once('=').unwrap_or((p, "")))
            .collect();
        let headers = lines
            .take_while(|l| !l.is_empty())
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim()))
            .collect();
        Some(Request { method, path, query, headers })
    }

    fn header(&self, name: &str) -> Option<&'a str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| *v)
    }

    fn param(&self, name: &str) -> Option<&'a str> {
        self.query.iter().find(|(k, _)| *k == name).map(|(_, v)| *v)
    }
}

/// One response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    /// Further headers, each `Name: value`.
    pub headers: Vec<String>,
    pub body: String,
}

impl Reply {
    fn text(status: u16, body: impl Into<String>) -> Reply {
        Reply { status, content_type: "text/plain", headers: vec![], body: body.into() }
    }

    fn json(status: u16, body: impl Into<String>) -> Reply {
        Reply { status, content_type: "application/json", headers: vec![], body: body.into() }
    }

    fn with(mut self, header: impl Into<String>) -> Reply {
        self.headers.push(header.into());
        self
    }

    /// The service's default reply, to whatever names no platform.
    pub fn default_reply() -> Reply {
        Reply::text(200, INSTANCE_ID)
    }

    /// The response on the wire: HTTP/1.1 on a connection kept for the next request
    /// (`keep`), else HTTP/1.0, closed after it.
    pub fn to_bytes(&self, keep: bool) -> Vec<u8> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "Not Found",
            405 => "Method Not Allowed",
            _ => "Status",
        };
        let version = if keep { "1.1" } else { "1.0" };
        let mut head = format!(
            "HTTP/{version} {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\n",
            self.status,
            self.content_type,
            self.body.len()
        );
        for h in &self.headers {
            head.push_str(h);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        out.extend_from_slice(self.body.as_bytes());
        out
    }
}

/// The answer to a request whose head (request line and headers, up to the blank line) is
/// `head`.
pub fn answer(head: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(head);
    let Some(req) = Request::parse(&text) else { return Reply::default_reply() };
    let platform = if req.path.starts_with("/latest/") {
        aws(&req)
    } else if req.path == "/" || req.path.starts_with("/computeMetadata/") {
        gcp(&req)
    } else if req.path.starts_with("/metadata/") {
        azure(&req)
    } else {
        None
    };
    platform.unwrap_or_else(Reply::default_reply)
}

/// IMDSv2. `None`: an IMDSv1 request (no token header), which gets the default reply.
fn aws(req: &Request<'_>) -> Option<Reply> {
    if req.method == "PUT" {
        if req.path != "/latest/api/token" {
            return Some(Reply::text(405, ""));
        }
        let ttl = req.header("x-aws-ec2-metadata-token-ttl-seconds");
        return Some(match ttl.and_then(|t| t.parse::<u32>().ok()) {
            Some(t @ 1..=21600) => Reply::text(200, AWS_SESSION_TOKEN)
                .with(format!("X-aws-ec2-metadata-token-ttl-seconds: {t}")),
            _ => Reply::text(400, ""),
        });
    }
    let token = req.header("x-aws-ec2-metadata-token")?;
    if token != AWS_SESSION_TOKEN {
        return Some(Reply::text(401, ""));
    }
    let creds = format!("/latest/meta-data/iam/security-credentials/{AWS_ROLE}");
    Some(match req.path.trim_end_matches('/') {
        "/latest/meta-data/instance-id" => Reply::text(200, INSTANCE_ID),
        "/latest/meta-data/placement/region" => Reply::text(200, AWS_REGION),
        "/latest/meta-data/placement/availability-zone" => Reply::text(200, AWS_ZONE),
        "/latest/meta-data/iam/security-credentials" => Reply::text(200, AWS_ROLE),
        p if p == creds => Reply::text(
            200,
            format!(
                r#"{{"Code":"Success","LastUpdated":"2026-01-01T00:00:00Z","Type":"AWS-HMAC","AccessKeyId":"{AWS_ACCESS_KEY_ID}","SecretAccessKey":"gate-test-secret","Token":"gate-test-session","Expiration":"2099-01-01T00:00:00Z"}}"#
            ),
        ),
        _ => Reply::text(404, ""),
    })
}

/// GCP: the `Metadata-Flavor: Google` header in, and out. `None`: `/` without the header.
fn gcp(req: &Request<'_>) -> Option<Reply> {
    let flavored = req.header("metadata-flavor") == Some("Google");
    if req.path == "/" && !flavored {
        return None;
    }
    let reply = |r: Reply| Some(r.with("Metadata-Flavor: Google"));
    if !flavored {
        return reply(Reply::text(
            403,
            "Missing required header \"Metadata-Flavor\": \"Google\"\n",
        ));
    }
    let Some(rest) = req.path.strip_prefix("/computeMetadata/v1/") else {
        return reply(match req.path {
            "/" => Reply::text(200, "computeMetadata/\n"),
            _ => Reply::text(404, ""),
        });
    };
    let recursive = req.param("recursive") == Some("true");
    let account = rest
        .strip_prefix("instance/service-accounts/")
        .and_then(|r| r.split_once('/').or(Some((r, ""))))
        .filter(|(a, _)| *a == "default" || *a == GCP_SERVICE_ACCOUNT);
    reply(match (rest, account) {
        ("", _) => Reply::text(200, "instance/\noauth/\nproject/\nuniverse/\n"),
        ("project/project-id", _) => Reply::text(200, GCP_PROJECT),
        ("project/numeric-project-id", _) => Reply::text(200, GCP_PROJECT_NUMBER),
        ("instance/zone", _) => Reply::text(200, GCP_ZONE),
        ("instance/id", _) => Reply::text(200, "4520031799277581759"),
        ("universe/universe-domain", _) => Reply::text(200, "googleapis.com"),
        (_, Some((_, "" | "/"))) if recursive => Reply::json(
            200,
            format!(
                r#"{{"aliases":["default"],"email":"{GCP_SERVICE_ACCOUNT}","scopes":["https://www.googleapis.com/auth/cloud-platform"]}}"#
            ),
        ),
        (_, Some((_, "" | "/"))) => Reply::text(200, "aliases\nemail\nidentity\nscopes\ntoken\n"),
        (_, Some((_, "email"))) => Reply::text(200, GCP_SERVICE_ACCOUNT),
        (_, Some((_, "token"))) => Reply::json(
            200,
            format!(
                r#"{{"access_token":"{GCP_ACCESS_TOKEN}","expires_in":3599,"token_type":"Bearer"}}"#
            ),
        ),
        _ => Reply::text(404, ""),
    })
}

/// Azure IMDS: `Metadata: true` and an `api-version` on every request.
fn azure(req: &Request<'_>) -> Option<Reply> {
    if req.header("metadata") != Some("true") {
        return Some(Reply::json(
            400,
            r#"{"error":"Bad request. Required metadata header not specified"}"#,
        ));
    }
    if req.param("api-version").is_none_or(str::is_empty) {
        return Some(Reply::json(
            400,
            r#"{"error":"Bad request. api-version was not specified in the request"}"#,
        ));
    }
    Some(match req.path {
        "/metadata/instance/compute/location" => match req.param("format") {
            Some("text") => Reply::text(200, AZURE_LOCATION),
            _ => Reply::json(200, format!("\"{AZURE_LOCATION}\"")),
        },
        "/metadata/identity/oauth2/token" => match req.param("resource") {
            Some(resource) if !resource.is_empty() => Reply::json(
                200,
                format!(
                    r#"{{"access_token":"{AZURE_ACCESS_TOKEN}","expires_in":"86399","expires_on":"4102444800","not_before":"1767225600","resource":"{resource}","token_type":"Bearer"}}"#
                ),
            ),
            _ => Reply::json(
                400,
                r#"{"error":"invalid_request","error_description":"Required query variable 'resource' is missing"}"#,
            ),
        },
        _ => Reply::json(404, r#"{"error":"Not found"}"#),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(head: &str) -> Reply {
        answer(format!("{head}\r\n\r\n").as_bytes())
    }

    #[test]
    fn plain_requests_keep_the_default_reply() {
        for head in [
            "GET /latest/meta-data/instance-id HTTP/1.1\r\nHost: x\r\nX-Probe-Token: t",
            "GET /latest/meta-data/iam/security-credentials/ HTTP/1.1",
            "GET /latest/meta-data/placement/region HTTP/1.0",
            "GET /latest/meta-data/instance-id?token=tok HTTP/1.0\r\nHost: metadata",
            "GET / HTTP/1.1",
            "GET /anything HTTP/1.1",
            "tok-udp-1.end",
        ] {
            assert_eq!(ask(head), Reply::default_reply(), "{head}");
        }
    }

    #[test]
    fn imdsv2_needs_its_token() {
        let put =
            ask("PUT /latest/api/token HTTP/1.1\r\nX-aws-ec2-metadata-token-ttl-seconds: 21600");
        assert_eq!((put.status, put.body.as_str()), (200, AWS_SESSION_TOKEN));
        assert_eq!(put.headers, ["X-aws-ec2-metadata-token-ttl-seconds: 21600"]);
        assert_eq!(ask("PUT /latest/api/token HTTP/1.1").status, 400);
        assert_eq!(ask("PUT /latest/meta-data/x HTTP/1.1").status, 405);
        let get = |path: &str, token: &str| {
            ask(&format!("GET {path} HTTP/1.1\r\nx-aws-ec2-metadata-token: {token}"))
        };
        let t = AWS_SESSION_TOKEN;
        assert_eq!(get("/latest/meta-data/instance-id", "other").status, 401);
        assert_eq!(get("/latest/meta-data/instance-id", t).body, INSTANCE_ID);
        assert_eq!(get("/latest/meta-data/placement/availability-zone/", t).body, AWS_ZONE);
        assert_eq!(get("/latest/meta-data/placement/region", t).body, AWS_REGION);
        assert_eq!(get("/latest/meta-data/iam/security-credentials/", t).body, AWS_ROLE);
        let creds = get(&format!("/latest/meta-data/iam/security-credentials/{AWS_ROLE}"), t);
        let v: serde_json::Value = serde_json::from_str(&creds.body).expect("json");
        assert_eq!(v["AccessKeyId"], AWS_ACCESS_KEY_ID);
        assert_eq!(get("/latest/user-data", t).status, 404);
    }

    #[test]
    fn gcp_needs_and_answers_its_header() {
        let g = |target: &str| ask(&format!("GET {target} HTTP/1.1\r\nMetadata-Flavor: Google"));
        let flavor = "Metadata-Flavor: Google".to_owned();
        let r = ask("GET /computeMetadata/v1/project/project-id HTTP/1.1");
        assert_eq!((r.status, &r.headers), (403, &vec![flavor.clone()]));
        let r = g("/computeMetadata/v1/project/project-id");
        assert_eq!((r.status, r.body.as_str(), &r.headers), (200, GCP_PROJECT, &vec![flavor]));
        assert_eq!(g("/").status, 200);
        assert_eq!(g("/computeMetadata/v1/instance/zone").body, GCP_ZONE);
        let info = g("/computeMetadata/v1/instance/service-accounts/default/?recursive=true");
        assert_eq!(info.content_type, "application/json");
        assert!(info.body.contains(GCP_SERVICE_ACCOUNT), "{info:?}");
        let token = format!(
            "/computeMetadata/v1/instance/service-accounts/{GCP_SERVICE_ACCOUNT}/token?scopes=a,b"
        );
        assert!(g(&token).body.contains(GCP_ACCESS_TOKEN));
        assert_eq!(g("/computeMetadata/v1/instance/service-accounts/other/token").status, 404);
    }

    #[test]
    fn azure_needs_its_header_and_api_version() {
        let loc = "/metadata/instance/compute/location?api-version=2021-02-01&format=text";
        assert_eq!(ask(&format!("GET {loc} HTTP/1.1")).status, 400);
        let a = |target: &str| ask(&format!("GET {target} HTTP/1.1\r\nMetadata: true"));
        assert_eq!(a(loc).body, AZURE_LOCATION);
        assert_eq!(a("/metadata/instance/compute/location").status, 400);
        let token = "/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fmanagement.azure.com%2F";
        assert!(a(token).body.contains(AZURE_ACCESS_TOKEN));
        assert_eq!(a("/metadata/identity/oauth2/token?api-version=2018-02-01").status, 400);
    }
}
