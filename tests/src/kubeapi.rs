//! A Kubernetes API server double that speaks the real wire format, for cluster-mode tests
//! without a cluster: GET of one object, LIST with `resourceVersion` in the list metadata,
//! WATCH as a chunked stream of `{"type","object"}` lines from a resourceVersion (with
//! BOOKMARKs when asked, and a 410 `Expired` ERROR for a compacted one, after which clients
//! re-list), 404 for unknown resources (a missing CRD), 401 without the bearer token, 403
//! for forbidden resources, and POST/PATCH of Events. Field selectors `a.b=c` (comma
//! separated) are evaluated on the objects.
//!
//! It listens on loopback only; tests point the agent at it with [`KubeApi::kubeconfig`].
use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

/// A collection: the API prefix and resource, e.g. `("/api/v1", "pods")`,
/// `("/apis/config.openshift.io/v1", "infrastructures")`.
pub type Coll = (&'static str, &'static str);

pub const PODS: Coll = ("/api/v1", "pods");
pub const CONFIGMAPS: Coll = ("/api/v1", "configmaps");
pub const NODES: Coll = ("/api/v1", "nodes");
pub const INFRASTRUCTURES: Coll = ("/apis/config.openshift.io/v1", "infrastructures");
pub const EVENTS: Coll = ("/apis/events.k8s.io/v1", "events");
/// Core (v1) Events, which `kubectl get events` reads.
pub const CORE_EVENTS: Coll = ("/api/v1", "events");
pub const DAEMONSETS: Coll = ("/apis/apps/v1", "daemonsets");

#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    coll: String,
    kind: &'static str,
    obj: Value,
}

#[derive(Default)]
struct State {
    rv: u64,
    /// (collection key, namespace, name) → object.
    objects: BTreeMap<(String, String, String), Value>,
    log: Vec<Change>,
    /// Watches from a resourceVersion below this get 410 Gone.
    compacted: u64,
    /// Collections that do not exist (a CRD that is not installed): 404.
    missing: BTreeSet<String>,
    forbidden: BTreeSet<String>,
    token: Option<String>,
    /// Request lines served, for assertions.
    requests: Vec<String>,
    /// (namespace, pod, container) → what `kubectl logs` prints.
    logs: BTreeMap<(String, String, String), String>,
}

/// The resources discovery announces (`kubectl` asks before anything else): group-version
/// prefix, resource, kind, namespaced.
const RESOURCES: &[(&str, &str, &str, bool)] = &[
    ("/api/v1", "pods", "Pod", true),
    ("/api/v1", "configmaps", "ConfigMap", true),
    ("/api/v1", "events", "Event", true),
    ("/api/v1", "nodes", "Node", false),
    ("/api/v1", "namespaces", "Namespace", false),
    ("/apis/apps/v1", "daemonsets", "DaemonSet", true),
    ("/apis/config.openshift.io/v1", "infrastructures", "Infrastructure", false),
    ("/apis/events.k8s.io/v1", "events", "Event", true),
];

/// The discovery documents: `/api`, `/apis` and each group-version's resource list (the
/// legacy, unaggregated form, which clients fall back to).
fn discovery(path: &str) -> Option<Value> {
    let path = path.trim_end_matches('/');
    let gv_of =
        |prefix: &str| prefix.trim_start_matches("/apis/").trim_start_matches("/api/").to_owned();
    match path {
        "/api" => Some(
            json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}),
        ),
        "/apis" => {
            let mut groups: Vec<Value> = Vec::new();
            for (prefix, ..) in RESOURCES.iter().filter(|r| r.0.starts_with("/apis/")) {
                let gv = gv_of(prefix);
                let (group, version) = gv.split_once('/').unwrap_or((&gv, ""));
                if groups.iter().any(|g| g["name"] == group) {
                    continue;
                }
                let v = json!({"groupVersion": gv, "version": version});
                groups.push(json!({"name": group, "versions": [v], "preferredVersion": v}));
            }
            Some(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}))
        }
        _ => {
            let resources: Vec<Value> = RESOURCES
                .iter()
                .filter(|r| r.0 == path)
                .map(|(_, name, kind, namespaced)| {
                    json!({"name": name, "singularName": kind.to_lowercase(), "namespaced": namespaced,
                           "kind": kind, "verbs": ["get", "list", "watch", "create", "patch"]})
                })
                .collect();
            (!resources.is_empty()).then(|| {
                json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv_of(path),
                       "resources": resources})
            })
        }
    }
}

/// Whether an object's labels satisfy a `labelSelector` of `k=v`, `k==v` and `k!=v` terms.
fn labels_match(selector: &str, obj: &Value) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let label = |k: &str| obj["metadata"]["labels"][k.trim()].as_str().map(str::to_owned);
        if let Some((k, v)) = term.split_once("!=") {
            label(k).as_deref() != Some(v.trim())
        } else if let Some((k, v)) = term.split_once('=') {
            label(k).as_deref() == Some(v.trim_start_matches('=').trim())
        } else {
            label(term).is_some()
        }
    })
}

fn key(c: Coll) -> String {
    format!("{}/{}", c.0, c.1)
}

pub struct KubeApi {
    pub addr: String,
    state: Arc<(Mutex<State>, Condvar)>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl KubeApi {
    /// Start on a free loopback port. `token`: the bearer token required, if any.
    pub fn start(token: Option<&str>) -> Result<KubeApi> {
        Self::serve_on(TcpListener::bind("127.0.0.1:0")?, token)
    }

    /// Start on a free loopback port of the test netns `netns`, where the agent under test
    /// runs.
    pub fn start_in(netns: &str, token: Option<&str>) -> Result<KubeApi> {
        let listener = crate::sys::in_netns(netns, || Ok(TcpListener::bind("127.0.0.1:0")?))?;
        Self::serve_on(listener, token)
    }

    fn serve_on(listener: TcpListener, token: Option<&str>) -> Result<KubeApi> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?.to_string();
        let state = Arc::new((
            Mutex::new(State { token: token.map(str::to_owned), rv: 100, ..State::default() }),
            Condvar::new(),
        ));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !sp.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let (st, sp) = (st.clone(), sp.clone());
                        std::thread::spawn(move || {
                            let _ = serve(conn, &st, &sp);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Ok(KubeApi { addr, state, stop, thread: Some(thread) })
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let (lock, cv) = &*self.state;
        let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
        let r = f(&mut st);
        cv.notify_all();
        r
    }

    /// The log of a pod's container, served at `pods/NAME/log?container=C` (there is no
    /// previous instance: `previous=true` gets 400, as from a real API server).
    pub fn set_log(&self, ns: &str, pod: &str, container: &str, text: &str) {
        self.with(|st| {
            st.logs.insert((ns.into(), pod.into(), container.into()), text.into());
        });
    }

    /// Create or replace an object (ADDED or MODIFIED). Sets metadata.resourceVersion.
    pub fn put(&self, coll: Coll, mut obj: Value) {
        self.with(|st| {
            st.rv += 1;
            let rv = st.rv;
            obj["metadata"]["resourceVersion"] = json!(rv.to_string());
            if obj["metadata"]["uid"].is_null() {
                obj["metadata"]["uid"] = json!(format!("uid-{rv}"));
            }
            let ns = obj["metadata"]["namespace"].as_str().unwrap_or_default().to_owned();
            let name = obj["metadata"]["name"].as_str().unwrap_or_default().to_owned();
            let k = (key(coll), ns, name);
            let kind = if st.objects.contains_key(&k) { "MODIFIED" } else { "ADDED" };
            st.objects.insert(k, obj.clone());
            st.log.push(Change { rv, coll: key(coll), kind, obj });
        })
    }

    /// Delete an object (DELETED).
    pub fn delete(&self, coll: Coll, namespace: &str, name: &str) {
        self.with(|st| {
            if let Some(mut obj) = st.objects.remove(&(key(coll), namespace.into(), name.into())) {
                st.rv += 1;
                obj["metadata"]["resourceVersion"] = json!(st.rv.to_string());
                let rv = st.rv;
                st.log.push(Change { rv, coll: key(coll), kind: "DELETED", obj });
            }
        })
    }

    /// Forget history: open watches end, and watches from an older resourceVersion get 410
    /// Gone, so clients must re-list.
    pub fn compact(&self) {
        self.with(|st| {
            st.compacted = st.rv + 1;
            st.log.clear();
        })
    }

    /// Make a collection 404 (as a cluster without that CRD).
    pub fn remove_resource(&self, coll: Coll) {
        self.with(|st| st.missing.insert(key(coll)));
    }

    pub fn forbid(&self, coll: Coll) {
        self.with(|st| st.forbidden.insert(key(coll)));
    }

    /// Objects of a collection (e.g. the Events the agent created).
    pub fn objects(&self, coll: Coll) -> Vec<Value> {
        self.with(|st| {
            st.objects
                .iter()
                .filter(|((c, _, _), _)| *c == key(coll))
                .map(|(_, v)| v.clone())
                .collect()
        })
    }

    pub fn requests(&self) -> Vec<String> {
        self.with(|st| st.requests.clone())
    }

    /// Write a kubeconfig for this server to `path`, with `token`.
    pub fn kubeconfig(&self, path: &Path, token: &str) -> Result<PathBuf> {
        let path = path.to_path_buf();
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: http://{}\n\
             users:\n- name: agent\n  user:\n    token: {token}\ncontexts:\n- name: double\n  context:\n    cluster: double\n    user: agent\n\
             current-context: double\n",
            self.addr
        );
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.state.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn respond(conn: &mut TcpStream, code: u16, body: &Value) -> std::io::Result<()> {
    let text = body.to_string();
    let reason = match code {
        200 => "OK",
        201 => "Created",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        _ => "Error",
    };
    write!(
        conn,
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    )?;
    conn.flush()
}

fn chunk(conn: &mut TcpStream, line: &Value) -> std::io::Result<()> {
    let text = format!("{line}\n");
    write!(conn, "{:x}\r\n{text}\r\n", text.len())?;
    conn.flush()
}

/// `a.b=c,d=e` → matches `obj` when every path has that string value.
fn fields_match(selector: &str, obj: &Value) -> bool {
    selector.split(',').filter(|s| !s.is_empty()).all(|term| {
        let Some((path, want)) = term.split_once('=') else { return false };
        let want = want.trim_start_matches('=');
        let pointer = format!("/{}", path.replace('.', "/"));
        obj.pointer(&pointer).and_then(Value::as_str).unwrap_or_default() == want
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Split `/api/v1/namespaces/ns/pods/name` into (collection key, namespace, name).
fn route(path: &str) -> Option<(String, String, Option<String>)> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (prefix, rest) = match *segs.first()? {
        "api" => (format!("/api/{}", segs.get(1)?), &segs[2..]),
        "apis" => (format!("/apis/{}/{}", segs.get(1)?, segs.get(2)?), &segs[3..]),
        _ => return None,
    };
    let (ns, rest) = match rest {
        ["namespaces", ns, r @ ..] if !r.is_empty() => (ns.to_string(), r),
        r => (String::new(), r),
    };
    match rest {
        [resource] => Some((format!("{prefix}/{resource}"), ns, None)),
        [resource, name] => Some((format!("{prefix}/{resource}"), ns, Some(name.to_string()))),
        _ => None,
    }
}

fn serve(
    mut conn: TcpStream,
    state: &Arc<(Mutex<State>, Condvar)>,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        if let Some((k, v)) = h.trim_end().split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
        }
    }
    let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut body = vec![0; len];
    reader.read_exact(&mut body)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let q: BTreeMap<String, String> = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), percent_decode(v)))
        .collect();
    let (lock, cv) = &**state;
    {
        let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
        st.requests.push(format!("{method} {target}"));
        if let Some(t) = &st.token
            && headers.get("authorization") != Some(&format!("Bearer {t}"))
        {
            drop(st);
            return respond(&mut conn, 401, &status(401, "Unauthorized", "Unauthorized"));
        }
    }
    if method == "GET"
        && let Some(doc) = discovery(path)
    {
        return respond(&mut conn, 200, &doc);
    }
    if method == "GET"
        && let Some(pod_path) = path.strip_suffix("/log")
        && let Some((c, ns, Some(pod))) = route(pod_path)
        && c == key(PODS)
    {
        let container = q.get("container").cloned().unwrap_or_default();
        let st = lock.lock().unwrap_or_else(|e| e.into_inner());
        let log = st.logs.get(&(ns, pod.clone(), container.clone())).cloned();
        drop(st);
        return match log {
            Some(_) if q.get("previous").is_some_and(|v| v == "true") => respond(
                &mut conn,
                400,
                &status(
                    400,
                    "BadRequest",
                    &format!(
                        "previous terminated container \"{container}\" in pod \"{pod}\" not found"
                    ),
                ),
            ),
            Some(text) => {
                write!(
                    conn,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                )
            }
            None => respond(
                &mut conn,
                400,
                &status(
                    400,
                    "BadRequest",
                    &format!("container {container} is not valid for pod {pod}"),
                ),
            ),
        };
    }
    let Some((coll, ns, name)) = route(path) else {
        return respond(
            &mut conn,
            404,
            &status(404, "NotFound", "the server could not find the requested resource"),
        );
    };
    {
        let st = lock.lock().unwrap_or_else(|e| e.into_inner());
        if st.missing.contains(&coll) {
            drop(st);
            return respond(
                &mut conn,
                404,
                &status(404, "NotFound", "the server could not find the requested resource"),
            );
        }
        if st.forbidden.contains(&coll) {
            drop(st);
            return respond(
                &mut conn,
                403,
                &status(403, "Forbidden", &format!("{coll} is forbidden")),
            );
        }
    }
    let in_scope = |k: &(String, String, String)| k.0 == coll && (ns.is_empty() || k.1 == ns);
    match (method, name) {
        ("GET", Some(name)) => {
            let st = lock.lock().unwrap_or_else(|e| e.into_inner());
            match st.objects.get(&(coll.clone(), ns.clone(), name.clone())) {
                Some(o) => {
                    let o = o.clone();
                    drop(st);
                    respond(&mut conn, 200, &o)
                }
                None => {
                    drop(st);
                    respond(
                        &mut conn,
                        404,
                        &status(404, "NotFound", &format!("\"{name}\" not found")),
                    )
                }
            }
        }
        ("POST", None) => {
            let mut obj: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
            st.rv += 1;
            obj["metadata"]["resourceVersion"] = json!(st.rv.to_string());
            if obj["metadata"]["namespace"].is_null() {
                obj["metadata"]["namespace"] = json!(ns);
            }
            let name = obj["metadata"]["name"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| format!("obj-{}", st.rv));
            obj["metadata"]["name"] = json!(name);
            st.objects.insert((coll, ns, name), obj.clone());
            cv.notify_all();
            drop(st);
            respond(&mut conn, 201, &obj)
        }
        ("PATCH", Some(name)) => {
            let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
            let k = (coll, ns, name.clone());
            let Some(obj) = st.objects.get_mut(&k) else {
                drop(st);
                return respond(
                    &mut conn,
                    404,
                    &status(404, "NotFound", &format!("\"{name}\" not found")),
                );
            };
            // A resourceVersion in the patch is a precondition, as on a real API server.
            if let Some(want) = patch["metadata"]["resourceVersion"].as_str()
                && obj["metadata"]["resourceVersion"].as_str() != Some(want)
            {
                drop(st);
                return respond(
                    &mut conn,
                    409,
                    &status(
                        409,
                        "Conflict",
                        "the object has been modified; please apply your changes to the latest version and try again",
                    ),
                );
            }
            merge(obj, &patch);
            st.rv += 1;
            let rv = st.rv.to_string();
            let obj = {
                let Some(obj) = st.objects.get_mut(&k) else {
                    drop(st);
                    return respond(&mut conn, 404, &status(404, "NotFound", "gone"));
                };
                obj["metadata"]["resourceVersion"] = json!(rv);
                obj.clone()
            };
            cv.notify_all();
            drop(st);
            respond(&mut conn, 200, &obj)
        }
        ("GET", None) if q.get("watch").is_some_and(|w| w == "true" || w == "1") => {
            let selector = q.get("fieldSelector").cloned().unwrap_or_default();
            let from: u64 = q.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
            let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
            let timeout =
                q.get("timeoutSeconds").and_then(|v| v.parse().ok()).unwrap_or(290u64).min(30);
            write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            )?;
            let deadline = Instant::now() + Duration::from_secs(timeout);
            let mut sent = from;
            let mut last_bookmark = Instant::now();
            let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
            if from < st.compacted {
                drop(st);
                chunk(
                    &mut conn,
                    &json!({"type": "ERROR", "object": status(410, "Expired", "too old resource version")}),
                )?;
                return write!(conn, "0\r\n\r\n");
            }
            let epoch = st.compacted;
            loop {
                let pending: Vec<Change> = st
                    .log
                    .iter()
                    .filter(|c| c.rv > sent && c.coll == coll)
                    .filter(|c| ns.is_empty() || c.obj["metadata"]["namespace"] == json!(ns))
                    .filter(|c| fields_match(&selector, &c.obj))
                    .cloned()
                    .collect();
                let rv = st.rv;
                let compacted = st.compacted != epoch;
                drop(st);
                if compacted {
                    // History is gone: end the stream; the client resumes and gets 410.
                    return write!(conn, "0\r\n\r\n");
                }
                for c in &pending {
                    chunk(&mut conn, &json!({"type": c.kind, "object": c.obj}))?;
                }
                sent = sent.max(rv);
                if bookmarks && last_bookmark.elapsed() > Duration::from_millis(500) {
                    let kind = coll.rsplit('/').next().unwrap_or_default();
                    chunk(
                        &mut conn,
                        &json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": rv.to_string()}}}),
                    )?;
                    last_bookmark = Instant::now();
                }
                if Instant::now() >= deadline || stop.load(Ordering::Acquire) {
                    return write!(conn, "0\r\n\r\n");
                }
                st = lock.lock().unwrap_or_else(|e| e.into_inner());
                st = cv
                    .wait_timeout(st, Duration::from_millis(200))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
        ("GET", None) => {
            let selector = q.get("fieldSelector").cloned().unwrap_or_default();
            let labels = q.get("labelSelector").cloned().unwrap_or_default();
            let st = lock.lock().unwrap_or_else(|e| e.into_inner());
            let items: Vec<Value> = st
                .objects
                .iter()
                .filter(|(k, o)| {
                    in_scope(k) && fields_match(&selector, o) && labels_match(&labels, o)
                })
                .map(|(_, o)| o.clone())
                .collect();
            let rv = st.rv;
            drop(st);
            let resource = coll.rsplit('/').next().unwrap_or_default();
            let kind = RESOURCES
                .iter()
                .find(|r| coll == format!("{}/{}", r.0, r.1))
                .map_or(resource, |r| r.2);
            respond(
                &mut conn,
                200,
                &json!({"kind": format!("{kind}List"), "apiVersion": "v1",
                "metadata": {"resourceVersion": rv.to_string()}, "items": items}),
            )
        }
        _ => respond(&mut conn, 405, &status(405, "MethodNotAllowed", method)),
    }
}

/// JSON merge patch (RFC 7386).
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// A pod on `node` as the API returns it, with a running container of `runtime` and `id`.
pub fn pod(
    ns: &str,
    name: &str,
    uid: &str,
    node: &str,
    labels: Value,
    host_network: bool,
    container_id: &str,
) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": uid, "labels": labels},
        "spec": {"nodeName": node, "hostNetwork": host_network, "serviceAccountName": "default",
                 "containers": [{"name": "main", "image": "x"}]},
        "status": {"qosClass": "BestEffort", "phase": "Running",
                   "containerStatuses": [{"name": "main", "containerID": container_id, "image": "x",
                       "imageID": "", "ready": true, "restartCount": 0}]}
    })
}

pub fn configmap(ns: &str, name: &str, policy: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns},
           "data": {"policy.yaml": policy}})
}

pub fn node(name: &str, provider_id: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {"providerID": provider_id}})
}

pub fn infrastructure(platform: &str) -> Value {
    json!({"apiVersion": "config.openshift.io/v1", "kind": "Infrastructure", "metadata": {"name": "cluster"},
           "spec": {"platformSpec": {"type": platform}},
           "status": {"platform": platform, "platformStatus": {"type": platform}}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_and_label_selectors() {
        assert_eq!(discovery("/api").unwrap()["versions"], json!(["v1"]));
        let groups = discovery("/apis").unwrap();
        let names: Vec<&str> = groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|g| g["name"].as_str())
            .collect();
        assert_eq!(names, ["apps", "config.openshift.io", "events.k8s.io"]);
        let apps = discovery("/apis/apps/v1").unwrap();
        assert_eq!(apps["groupVersion"], "apps/v1");
        assert_eq!(apps["resources"][0]["kind"], "DaemonSet");
        assert!(discovery("/apis/apps/v2").is_none());
        assert!(discovery("/api/v1/pods").is_none());
        let o = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        assert!(labels_match("", &o) && labels_match("a=1,b==2", &o) && labels_match("a,c!=3", &o));
        assert!(!labels_match("a=2", &o) && !labels_match("c", &o) && !labels_match("b!=2", &o));
    }

    #[test]
    fn routes_and_selectors() {
        assert_eq!(route("/api/v1/pods"), Some(("/api/v1/pods".into(), String::new(), None)));
        assert_eq!(
            route("/api/v1/namespaces/ns/configmaps/cm"),
            Some(("/api/v1/configmaps".into(), "ns".into(), Some("cm".into())))
        );
        assert_eq!(
            route("/apis/config.openshift.io/v1/infrastructures/cluster"),
            Some((
                "/apis/config.openshift.io/v1/infrastructures".into(),
                String::new(),
                Some("cluster".into())
            ))
        );
        let obj = json!({"metadata": {"name": "a"}, "spec": {"nodeName": "n1"}});
        assert!(fields_match("spec.nodeName=n1", &obj));
        assert!(fields_match("metadata.name==a,spec.nodeName=n1", &obj));
        assert!(!fields_match("spec.nodeName=n2", &obj));
        assert_eq!(percent_decode("spec.nodeName%3Dn1"), "spec.nodeName=n1");
    }
}
