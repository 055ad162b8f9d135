//! An in-process fake Kubernetes API server speaking the real list/watch
//! protocol with k8s-openapi JSON: resourceVersions, bookmarks, 410 Gone
//! (expired watches force a relist), dropped connections, label and field
//! selectors. Enough to drive kube-rs watchers; it also records the Events
//! clients post.

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
const RESOURCES: [(&str, &str); 3] = [
    ("/api/v1/services", "ServiceList"),
    ("/apis/discovery.k8s.io/v1/endpointslices", "EndpointSliceList"),
    ("/api/v1/nodes", "NodeList"),
];

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
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        if self.without_labels.iter().any(|l| !labels[l].is_null()) {
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
        let listener = ns
            .run(|| TcpListener::bind("127.0.0.1:0"))
            .expect("bind the fake API server");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            rv: 100,
            ..Default::default()
        }));
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let st = st.clone();
                std::thread::spawn(move || {
                    let _ = serve(conn, &st);
                });
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
    let Some((collection, list_kind)) = RESOURCES.iter().find(|(p, _)| *p == path).copied() else {
        return respond(&mut conn, "404 Not Found", r#"{"kind":"Status","code":404}"#);
    };
    let filter = Filter {
        without_labels: params
            .get("labelSelector")
            .map(|s| {
                s.split(',')
                    .filter_map(|t| t.strip_prefix('!'))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default(),
        name: params
            .get("fieldSelector")
            .and_then(|f| f.strip_prefix("metadata.name="))
            .map(str::to_owned),
    };
    let mut s = state.lock().unwrap();
    if params.get("watch").map(String::as_str) != Some("true") {
        s.requests.push(format!("LIST {collection}"));
        let items: Vec<&Value> = s
            .objects
            .iter()
            .filter(|((c, _), v)| *c == collection && filter.matches(v))
            .map(|(_, v)| v)
            .collect();
        let list = json!({"kind": list_kind, "apiVersion": "v1", "metadata": {"resourceVersion": s.rv.to_string()}, "items": items});
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
