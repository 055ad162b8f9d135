//! An in-process fake Kubernetes API server speaking the real list/watch
//! protocol with k8s-openapi JSON: resourceVersions, bookmarks, 410 Gone
//! (expired watches force a relist), dropped connections, label and field
//! selectors. Enough to drive kube-rs watchers; it also records the Events
//! clients post.
//!
//! Objects can also be read and written one by one (`GET`, `POST`, `PUT`,
//! `DELETE`, and `PUT .../status` for Services and LoadBalancerIPPools) with
//! the API server's optimistic concurrency: a write whose resourceVersion is
//! not the object's current one gets 409 Conflict, and
//! [`FakeApiServer::conflict_next_status_writes`] makes a concurrent writer
//! win the next status writes. Leases are served namespaced, pools
//! and ServiceCIDRs cluster-scoped.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Mutex},
    time::Duration,
};

use serde_json::{Value, json};

use crate::netns::NetNs;

/// The collections served: (URL path, List kind).
const RESOURCES: [(&str, &str); 8] = [
    ("/api/v1/services", "ServiceList"),
    ("/apis/discovery.k8s.io/v1/endpointslices", "EndpointSliceList"),
    ("/api/v1/nodes", "NodeList"),
    ("/apis/coordination.k8s.io/v1/leases", "LeaseList"),
    (
        "/apis/dataplane.example.com/v1alpha1/loadbalancerippools",
        "LoadBalancerIPPoolList",
    ),
    ("/apis/networking.k8s.io/v1/servicecidrs", "ServiceCIDRList"),
    ("/apis/dataplane.example.com/v1alpha1/bgppeers", "BGPPeerList"),
    (
        "/apis/dataplane.example.com/v1alpha1/bgpadvertisements",
        "BGPAdvertisementList",
    ),
];

/// Collections with a status subresource: a plain `PUT` keeps the status.
const WITH_STATUS: [&str; 2] = [RESOURCES[0].0, RESOURCES[4].0];

#[derive(Default)]
struct State {
    rv: u64,
    /// (collection, namespace/name) → object.
    objects: BTreeMap<(&'static str, String), Value>,
    /// Every change: (rv, collection, type, object).
    history: Vec<(u64, &'static str, &'static str, Value)>,
    /// Watches older than this get 410 Gone.
    compacted: u64,
    watchers: Vec<Watcher>,
    events: Vec<Value>,
    requests: Vec<String>,
    /// Status writes still to lose against a concurrent writer.
    status_conflicts: usize,
}

struct Watcher {
    collection: &'static str,
    filter: Filter,
    stream: TcpStream,
}

#[derive(Clone, Default)]
struct Filter {
    /// Labels that must be absent (`!key`).
    without_labels: Vec<String>,
    name: Option<String>,
    /// Labels that must be present (`key`), with a value (`key=value`).
    with_labels: Vec<(String, Option<String>)>,
    /// A namespaced collection's namespace.
    namespace: Option<String>,
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        if self.without_labels.iter().any(|l| !labels[l].is_null()) {
            return false;
        }
        if self
            .with_labels
            .iter()
            .any(|(k, v)| labels[k].is_null() || v.as_ref().is_some_and(|v| labels[k] != *v.as_str()))
        {
            return false;
        }
        if self
            .namespace
            .as_ref()
            .is_some_and(|ns| obj["metadata"]["namespace"] != *ns.as_str())
        {
            return false;
        }
        self.name
            .as_ref()
            .is_none_or(|n| obj["metadata"]["name"] == *n.as_str())
    }
}

pub struct FakeApiServer {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

fn key(obj: &Value) -> String {
    format!(
        "{}/{}",
        obj["metadata"]["namespace"].as_str().unwrap_or(""),
        obj["metadata"]["name"].as_str().unwrap_or("")
    )
}

fn collection_of(kind: &str) -> &'static str {
    match kind {
        "Service" => RESOURCES[0].0,
        "EndpointSlice" => RESOURCES[1].0,
        "Node" => RESOURCES[2].0,
        "Lease" => RESOURCES[3].0,
        "LoadBalancerIPPool" => RESOURCES[4].0,
        "ServiceCIDR" => RESOURCES[5].0,
        "BGPPeer" => RESOURCES[6].0,
        "BGPAdvertisement" => RESOURCES[7].0,
        other => panic!("the fake API server does not serve {other}"),
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
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

impl FakeApiServer {
    /// Listens on 127.0.0.1 (an ephemeral port) inside `ns`.
    pub fn start(ns: &NetNs) -> Self {
        Self::start_at(ns, "127.0.0.1:0")
    }

    /// Listens on `addr` inside `ns` (an address of the sandbox's LAN, for
    /// agents on several nodes).
    pub fn start_at(ns: &NetNs, addr: &str) -> Self {
        let listener = ns
            .run(|| TcpListener::bind(addr))
            .expect("bind the fake API server");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            rv: 100,
            ..Default::default()
        }));
        let st = state.clone();
        std::thread::spawn(move || {
            let mut pool = Pool::new(st);
            for conn in listener.incoming().flatten() {
                pool.dispatch(conn);
            }
        });
        Self { addr, state }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Creates or replaces an object (any k8s-openapi type), notifying watches.
    pub fn apply<T: serde::Serialize>(&self, obj: &T) {
        let mut v = serde_json::to_value(obj).expect("serialize");
        let collection = collection_of(v["kind"].as_str().expect("kind"));
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        let rv = s.rv;
        v["metadata"]["resourceVersion"] = json!(rv.to_string());
        if v["metadata"]["uid"].is_null() {
            v["metadata"]["uid"] = json!(format!("uid-{}", key(&v).replace('/', "-")));
        }
        let k = (collection, key(&v));
        // As the API server: creation time and generation are its own, and
        // an update without a status keeps the status (a subresource).
        let old = s.objects.get(&k).cloned();
        let created = old
            .as_ref()
            .map(|o| o["metadata"]["creationTimestamp"].clone())
            .unwrap_or_else(|| json!(now_rfc3339()));
        if v["metadata"]["creationTimestamp"].is_null() {
            v["metadata"]["creationTimestamp"] = created;
        }
        if v["metadata"]["generation"].is_null() {
            v["metadata"]["generation"] = old.as_ref().map_or(json!(1), |o| {
                json!(o["metadata"]["generation"].as_i64().unwrap_or(1) + 1)
            });
        }
        if let Some(old) = &old
            && v.get("status").is_none_or(Value::is_null)
            && WITH_STATUS.contains(&collection)
            && !old["status"].is_null()
        {
            v["status"] = old["status"].clone();
        }
        let kind = if s.objects.contains_key(&k) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        s.objects.insert(k, v.clone());
        s.history.push((rv, collection, kind, v.clone()));
        notify(&mut s, collection, kind, &v);
    }

    /// Deletes an object by kind, namespace and name.
    pub fn delete(&self, kind: &str, namespace: &str, name: &str) {
        let collection = collection_of(kind);
        let mut s = self.state.lock().unwrap();
        let Some(mut v) = s.objects.remove(&(collection, format!("{namespace}/{name}"))) else {
            return;
        };
        s.rv += 1;
        let rv = s.rv;
        v["metadata"]["resourceVersion"] = json!(rv.to_string());
        s.history.push((rv, collection, "DELETED", v.clone()));
        notify(&mut s, collection, "DELETED", &v);
    }

    /// Closes every watch, and makes resuming from any version seen so far
    /// fail with 410 Gone: clients must relist.
    pub fn expire_watches(&self) {
        let mut s = self.state.lock().unwrap();
        s.compacted = s.rv + 1;
        for w in s.watchers.drain(..) {
            let _ = w.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Drops every watch connection (clients resume from their last version).
    pub fn drop_connections(&self) {
        let mut s = self.state.lock().unwrap();
        for w in s.watchers.drain(..) {
            let _ = w.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Sends a bookmark with the current version to every watch.
    pub fn bookmark(&self) {
        let mut s = self.state.lock().unwrap();
        let rv = s.rv.to_string();
        let mut alive = Vec::new();
        for mut w in std::mem::take(&mut s.watchers) {
            let kind = RESOURCES
                .iter()
                .find(|(p, _)| *p == w.collection)
                .unwrap()
                .1
                .trim_end_matches("List");
            let line = json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": rv}}});
            if writeln!(w.stream, "{line}").is_ok() {
                alive.push(w);
            }
        }
        s.watchers = alive;
    }

    /// Events posted by clients (events.k8s.io/v1 JSON).
    pub fn events(&self) -> Vec<Value> {
        self.state.lock().unwrap().events.clone()
    }

    /// Number of list requests per collection (relists show up here).
    pub fn lists(&self, collection_suffix: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|r| r.starts_with("LIST ") && r.ends_with(collection_suffix))
            .count()
    }

    pub fn watch_count(&self) -> usize {
        self.state.lock().unwrap().watchers.len()
    }

    /// The stored object (`namespace` empty for cluster-scoped kinds).
    pub fn get(&self, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let collection = collection_of(kind);
        self.state
            .lock()
            .unwrap()
            .objects
            .get(&(collection, format!("{namespace}/{name}")))
            .cloned()
    }

    /// Every stored object of `kind`.
    pub fn list(&self, kind: &str) -> Vec<Value> {
        let collection = collection_of(kind);
        self.state
            .lock()
            .unwrap()
            .objects
            .iter()
            .filter(|((c, _), _)| *c == collection)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The next `n` status writes lose a race: a concurrent writer changes
    /// the object first (an annotation, so its resourceVersion moves on), and
    /// the write gets 409 Conflict.
    pub fn conflict_next_status_writes(&self, n: usize) {
        self.state.lock().unwrap().status_conflicts = n;
    }

    /// Requests other than lists and watches, as `METHOD path` and the
    /// answer's status code (`PUT /api/v1/namespaces/default/services/web/status 409`).
    pub fn writes(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|r| !r.starts_with("LIST ") && !r.starts_with("WATCH "))
            .cloned()
            .collect()
    }
}

fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil from days (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A request path: its collection, and namespace, name and subresource when
/// present (`/apis/coordination.k8s.io/v1/namespaces/ns/leases/l`).
struct Route {
    collection: &'static str,
    list_kind: &'static str,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

impl Route {
    fn parse(path: &str) -> Option<Self> {
        let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let prefix_len = match segs.first() {
            Some(&"api") => 2,
            Some(&"apis") => 3,
            _ => return None,
        };
        let prefix = format!("/{}", segs.get(..prefix_len)?.join("/"));
        let mut rest = &segs[prefix_len..];
        let mut namespace = None;
        if rest.len() >= 3 && rest[0] == "namespaces" {
            namespace = Some(rest[1].to_owned());
            rest = &rest[2..];
        }
        let plural = rest.first()?;
        let (collection, list_kind) = RESOURCES
            .iter()
            .find(|(p, _)| *p == format!("{prefix}/{plural}"))
            .copied()?;
        Some(Self {
            collection,
            list_kind,
            namespace,
            name: rest.get(1).map(|s| s.to_string()),
            subresource: rest.get(2).map(|s| s.to_string()),
        })
    }
}

fn status_body(code: u16, reason: &str, message: &str) -> String {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code})
    .to_string()
}

/// (status line, body) of a read or write of one object.
fn object_request(s: &mut State, method: &str, route: &Route, body: &[u8]) -> (&'static str, String) {
    let conflict = |what: &str| ("409 Conflict", status_body(409, "Conflict", what));
    let not_found = || ("404 Not Found", status_body(404, "NotFound", "not found"));
    let ns = route.namespace.clone().unwrap_or_default();
    let collection = route.collection;
    let posted: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let Some(name) = route.name.clone() else {
        if method != "POST" {
            return (
                "405 Method Not Allowed",
                status_body(405, "MethodNotAllowed", method),
            );
        }
        let mut v = posted;
        if route.namespace.is_some() {
            v["metadata"]["namespace"] = json!(ns);
        }
        let k = (collection, key(&v));
        if s.objects.contains_key(&k) {
            return (
                "409 Conflict",
                status_body(409, "AlreadyExists", "already exists"),
            );
        }
        s.rv += 1;
        v["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        v["metadata"]["uid"] = json!(format!("uid-{}-{}", k.1.replace('/', "-"), s.rv));
        v["metadata"]["creationTimestamp"] = json!(now_rfc3339());
        v["metadata"]["generation"] = json!(1);
        s.objects.insert(k, v.clone());
        s.history.push((s.rv, collection, "ADDED", v.clone()));
        notify(s, collection, "ADDED", &v);
        return ("201 Created", v.to_string());
    };
    let k = (collection, format!("{ns}/{name}"));
    let Some(current) = s.objects.get(&k).cloned() else {
        return not_found();
    };
    let rv_matches = |v: &Value| {
        let want = &v["metadata"]["resourceVersion"];
        want.is_null() || *want == current["metadata"]["resourceVersion"]
    };
    let mut next = match (method, route.subresource.as_deref()) {
        ("GET", None | Some("status")) => return ("200 OK", current.to_string()),
        ("PUT", Some("status")) => {
            if s.status_conflicts > 0 {
                s.status_conflicts -= 1;
                let mut theirs = current.clone();
                let n = theirs["metadata"]["annotations"]["fake-api/concurrent-writes"]
                    .as_str()
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
                theirs["metadata"]["annotations"]["fake-api/concurrent-writes"] = json!((n + 1).to_string());
                s.rv += 1;
                theirs["metadata"]["resourceVersion"] = json!(s.rv.to_string());
                s.objects.insert(k, theirs.clone());
                s.history.push((s.rv, collection, "MODIFIED", theirs.clone()));
                notify(s, collection, "MODIFIED", &theirs);
                return conflict(
                    "the object has been modified; please apply your changes to the latest version and try again",
                );
            }
            if !rv_matches(&posted) {
                return conflict(
                    "the object has been modified; please apply your changes to the latest version and try again",
                );
            }
            let mut v = current.clone();
            v["status"] = posted["status"].clone();
            v
        }
        ("PUT", None) => {
            if !rv_matches(&posted) {
                return conflict(
                    "the object has been modified; please apply your changes to the latest version and try again",
                );
            }
            let mut v = posted;
            for field in ["uid", "creationTimestamp", "namespace", "name"] {
                v["metadata"][field] = current["metadata"][field].clone();
            }
            if WITH_STATUS.contains(&collection) {
                v["status"] = current["status"].clone();
            }
            let generation = current["metadata"]["generation"].as_i64().unwrap_or(1);
            v["metadata"]["generation"] = json!(if v["spec"] != current["spec"] {
                generation + 1
            } else {
                generation
            });
            v
        }
        ("DELETE", None) => {
            let want = &posted["preconditions"]["resourceVersion"];
            if !want.is_null() && *want != current["metadata"]["resourceVersion"] {
                return conflict("precondition failed: resourceVersion");
            }
            s.objects.remove(&k);
            s.rv += 1;
            let mut v = current;
            v["metadata"]["resourceVersion"] = json!(s.rv.to_string());
            s.history.push((s.rv, collection, "DELETED", v.clone()));
            notify(s, collection, "DELETED", &v);
            return ("200 OK", v.to_string());
        }
        _ => {
            return (
                "405 Method Not Allowed",
                status_body(405, "MethodNotAllowed", method),
            );
        }
    };
    s.rv += 1;
    next["metadata"]["resourceVersion"] = json!(s.rv.to_string());
    s.objects.insert(k, next.clone());
    s.history.push((s.rv, collection, "MODIFIED", next.clone()));
    notify(s, collection, "MODIFIED", &next);
    ("200 OK", next.to_string())
}

fn notify(s: &mut State, collection: &'static str, kind: &str, obj: &Value) {
    let line = json!({"type": kind, "object": obj}).to_string();
    s.watchers.retain_mut(|w| {
        if w.collection != collection || !w.filter.matches(obj) {
            return true;
        }
        writeln!(w.stream, "{line}").is_ok()
    });
}

/// The threads that serve connections, as many as were ever busy at once.
///
/// Every response closes its connection (`Connection: close`), so clients
/// make a connection per request, and a thread per connection created up
/// to thousands of threads per test (the same pattern in the echo servers
/// and `NetNs::run` made tens of thousands per test binary, thread ids
/// wrapped past `pid_max`, and one run hung). A connection still never
/// waits for another to be served (a client slow to send its request holds
/// its thread up to the 5 s read timeout): it goes to an idle thread, or to
/// a new one when none is idle. Watches hand their stream to [`State`] and
/// free the thread at once.
struct Pool {
    conns: std::sync::mpsc::Sender<TcpStream>,
    queue: Arc<Mutex<std::sync::mpsc::Receiver<TcpStream>>>,
    /// Threads waiting for a connection nobody dispatched to them yet:
    /// only the accept thread takes from it, so a load then a decrement
    /// do not race.
    idle: Arc<std::sync::atomic::AtomicUsize>,
    state: Arc<Mutex<State>>,
}

impl Pool {
    fn new(state: Arc<Mutex<State>>) -> Self {
        let (conns, queue) = std::sync::mpsc::channel();
        Self {
            conns,
            queue: Arc::new(Mutex::new(queue)),
            idle: Arc::default(),
            state,
        }
    }

    fn dispatch(&mut self, conn: TcpStream) {
        use std::sync::atomic::Ordering;
        if self.idle.load(Ordering::Acquire) > 0 {
            self.idle.fetch_sub(1, Ordering::AcqRel);
        } else {
            let (queue, idle, state) = (self.queue.clone(), self.idle.clone(), self.state.clone());
            std::thread::spawn(move || {
                loop {
                    let next = queue.lock().unwrap().recv();
                    let Ok(conn) = next else { return };
                    let _ = serve(conn, &state);
                    idle.fetch_add(1, Ordering::AcqRel);
                }
            });
        }
        let _ = self.conns.send(conn);
    }
}

fn respond(conn: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

fn serve(mut conn: TcpStream, state: &Mutex<State>) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("/").to_owned(),
    );
    let mut content_length = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? <= 2 {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            content_length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; content_length];
    reader.read_exact(&mut body)?;
    let (path, query) = target.split_once('?').unwrap_or((target.as_str(), ""));
    let params: BTreeMap<String, String> = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), percent_decode(v)))
        .collect();

    if path.starts_with("/apis/events.k8s.io/v1/") {
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        state.lock().unwrap().events.push(v.clone());
        let status = if method == "POST" { "201 Created" } else { "200 OK" };
        return respond(&mut conn, status, &v.to_string());
    }
    let Some(route) = Route::parse(path) else {
        return respond(&mut conn, "404 Not Found", r#"{"kind":"Status","code":404}"#);
    };
    if route.name.is_some() || method != "GET" {
        let mut s = state.lock().unwrap();
        let (status, answer) = object_request(&mut s, &method, &route, &body);
        s.requests.push(format!("{method} {path} {}", &status[..3]));
        drop(s);
        return respond(&mut conn, status, &answer);
    }
    let (collection, list_kind) = (route.collection, route.list_kind);
    let selector = params.get("labelSelector").cloned().unwrap_or_default();
    let terms = selector.split(',').filter(|t| !t.is_empty());
    let filter = Filter {
        without_labels: terms
            .clone()
            .filter_map(|t| t.strip_prefix('!'))
            .map(str::to_owned)
            .collect(),
        name: params
            .get("fieldSelector")
            .and_then(|f| f.strip_prefix("metadata.name="))
            .map(str::to_owned),
        with_labels: terms
            .filter(|t| !t.starts_with('!'))
            .map(|t| match t.split_once('=') {
                Some((k, v)) => (k.to_owned(), Some(v.to_owned())),
                None => (t.to_owned(), None),
            })
            .collect(),
        namespace: route.namespace,
    };
    let mut s = state.lock().unwrap();
    if params.get("watch").map(String::as_str) != Some("true") {
        s.requests.push(format!("LIST {collection}"));
        // Pages as the API server serves them (`limit`, `continue`: here
        // the key to start after).
        let limit: usize = params
            .get("limit")
            .and_then(|l| l.parse().ok())
            .filter(|l| *l > 0)
            .unwrap_or(usize::MAX);
        let after = params.get("continue").cloned().unwrap_or_default();
        let mut items: Vec<&Value> = Vec::new();
        let mut next = None;
        for (_, v) in s
            .objects
            .range((collection, after.clone())..)
            .take_while(|((c, _), _)| *c == collection)
            .filter(|((_, k), v)| *k != after && filter.matches(v))
        {
            if items.len() == limit {
                next = Some(items.last().map(|v| key(v)).unwrap_or_default());
                break;
            }
            items.push(v);
        }
        let mut meta = json!({"resourceVersion": s.rv.to_string()});
        if let Some(n) = next {
            meta["continue"] = json!(n);
        }
        let list = json!({"kind": list_kind, "apiVersion": "v1", "metadata": meta, "items": items});
        drop(s);
        return respond(&mut conn, "200 OK", &list.to_string());
    }
    s.requests.push(format!("WATCH {collection}"));
    let from: u64 = params
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    write!(
        conn,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    )?;
    if from < s.compacted {
        let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": "too old resource version", "reason": "Expired", "code": 410}});
        writeln!(conn, "{gone}")?;
        return conn.shutdown(std::net::Shutdown::Both);
    }
    // Events after the client's version, then live ones.
    let backlog: Vec<String> = s
        .history
        .iter()
        .filter(|(rv, c, _, obj)| *rv > from && *c == collection && filter.matches(obj))
        .map(|(_, _, kind, obj)| json!({"type": kind, "object": obj}).to_string())
        .collect();
    for l in backlog {
        writeln!(conn, "{l}")?;
    }
    s.watchers.push(Watcher {
        collection,
        filter,
        stream: conn,
    });
    Ok(())
}
