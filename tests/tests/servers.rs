//! The agent's HTTP servers: a healthCheckNodePort keeps answering while
//! hundreds of slow and idle clients hold connections to it; the server's
//! limits (keep-alive, header limits, header-read timeout, connection cap
//! with the oldest idle shed first); `/metrics` parses with Prometheus' own
//! parser (the Python client's).

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{SocketAddr, SocketAddrV4, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use dataplane_agent::agent::http::{Handler, Limits, Response, Server, ServerRuntime};
use dataplane_tests::{
    agent::{AgentProcess, METRICS_PORT, ManifestEndpoint as Ep, service_yaml},
    cluster::Cluster,
    netns::NetNs,
    sandbox::Sandbox,
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const HEALTH_CHECK_PORT: u16 = 32000;
const ATTACKERS: usize = 500;
const PROBES: usize = 30;

/// One HTTP/1.1 request on `s`; returns (status, body), reading exactly the
/// response (Content-Length), so the connection can be reused.
fn request(s: &mut TcpStream, path: &str, close: bool) -> std::io::Result<(u16, String)> {
    let connection = if close { "close" } else { "keep-alive" };
    // One write: a request split over several could meet an early answer.
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: {connection}\r\n\r\n");
    s.write_all(req.as_bytes())?;
    read_response(s)
}

fn read_response(s: &mut TcpStream) -> std::io::Result<(u16, String)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte)? == 0 {
            return Err(ErrorKind::UnexpectedEof.into());
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Whether the server still holds `s` open (no EOF, no reset).
fn still_open(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let open = matches!(s.peek(&mut b), Err(e) if e.kind() == ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    open
}

/// Waits (up to 10 s) for the server to close `s`; true when it did.
fn closed_by_server(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// A fresh sandbox with pod `a` on node1 and an agent on node1 serving one
/// Service `name` (`spec`: its type and policies) with endpoint `a`.
fn one_service(name: &str, spec: &str) -> Sandbox {
    Sandbox::builder(Cluster::new())
        .pods(&[("a", 0)])
        .manifest(&format!("{name}.yaml"), |c| {
            let pod = c.pod("a").ip;
            service_yaml(name, spec, 80, Some(30080), 8080, &[Ep::ready(pod, "node1")])
        })
        .agents(1, |s, i| s.start_agent(BIN, i, &[]))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn a_health_check_node_port_answers_every_probe_while_500_slow_and_idle_clients_hold_connections() {
    let s = one_service(
        "lb",
        &format!(
            "  type: LoadBalancer\n  clusterIP: 10.96.0.20\n  externalTrafficPolicy: Local\n  healthCheckNodePort: {HEALTH_CHECK_PORT}\n"
        ),
    );
    let (cluster, agent) = (&s.cluster, &s.agents[0]);
    let target = SocketAddrV4::new(cluster.nodes[0].ip(), HEALTH_CHECK_PORT);
    let client = &cluster.client.ns;
    let expected =
        r#"{"service":{"namespace":"default","name":"lb"},"localEndpoints":1,"serviceProxyHealthy":true}"#;

    // Half the attackers send a request line and then one header line a
    // second (slowloris); the other half connect and send nothing.
    let attackers: Vec<TcpStream> = client.run(|| {
        (0..ATTACKERS)
            .map(|i| {
                let mut s = TcpStream::connect_timeout(&target.into(), Duration::from_secs(3))
                    .unwrap_or_else(|e| panic!("attacker {i}: {e}"));
                if i % 2 == 0 {
                    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
                }
                s
            })
            .collect()
    });
    let attackers = Arc::new(attackers);
    let stop = Arc::new(AtomicBool::new(false));
    let drip = {
        let (attackers, stop) = (attackers.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(1));
                n += 1;
                for s in attackers.iter().step_by(2) {
                    let _ = (&*s).write_all(format!("X-Slow-{n}: y\r\n").as_bytes());
                }
            }
        })
    };

    // A load balancer's prober: a new connection every 100 ms. Every probe
    // must be answered while every attacker still holds its connection (a
    // server that serves one connection at a time leaves probes unanswered
    // behind them); how long the answers took is reported, not asserted.
    let mut latencies = Vec::new();
    for i in 0..PROBES {
        let started = Instant::now();
        let answer = client.run(|| {
            let mut s = TcpStream::connect_timeout(&target.into(), Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            request(&mut s, "/", true)
        });
        let took = started.elapsed();
        let (status, body) =
            answer.unwrap_or_else(|e| panic!("probe {i} was not answered: {e}\n{}", agent.log_text()));
        assert_eq!((status, body.as_str()), (200, expected), "probe {i}");
        latencies.push(took);
        std::thread::sleep(Duration::from_millis(100).saturating_sub(took));
    }
    stop.store(true, Ordering::Relaxed);
    drip.join().unwrap();
    // The attackers were really holding their connections all along.
    let open = attackers.iter().filter(|s| still_open(s)).count();
    assert_eq!(open, ATTACKERS, "attackers whose connection the server kept");

    latencies.sort();
    eprintln!(
        "probe latency with {ATTACKERS} slow/idle clients: p50 {:?}, p99 {:?}, max {:?} ({PROBES} probes)",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies[latencies.len() - 1]
    );
}

/// A server of the agent's HTTP stack inside a fresh network namespace.
struct TestServer {
    ns: NetNs,
    addr: SocketAddr,
    _server: Server,
    _runtime: ServerRuntime,
}

impl TestServer {
    fn new(limits: Limits) -> Self {
        dataplane_tests::require_privileges();
        let ns = NetNs::new(&format!("{}-http", dataplane_tests::unique_prefix()));
        let runtime = ServerRuntime::start().expect("runtime");
        let handler: Handler = Arc::new(|path: &str| Response::json(200, format!("{{\"path\":\"{path}\"}}")));
        let handle = runtime.handle();
        let server = ns.run(|| Server::bind(&handle, "127.0.0.1:0", limits, handler).expect("bind"));
        Self {
            addr: server.addr,
            ns,
            _server: server,
            _runtime: runtime,
        }
    }

    fn connect(&self) -> TcpStream {
        let s = self.ns.run(|| TcpStream::connect(self.addr)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    }
}

#[test]
fn the_http_stack_keeps_connections_alive_limits_headers_and_times_out_slow_ones() {
    let limits = Limits {
        max_connections: 64,
        header_read_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_secs(30),
        max_header_bytes: 4096,
        max_headers: 16,
    };
    let srv = TestServer::new(limits);

    // Keep-alive: three requests on one connection.
    let mut s = srv.connect();
    for path in ["/a", "/b?x=1", "/c"] {
        assert_eq!(
            request(&mut s, path, false).unwrap(),
            (200, format!("{{\"path\":\"{path}\"}}"))
        );
    }

    // Too many headers, or too large a header: 431.
    let mut s = srv.connect();
    let many: String = (0..20).map(|i| format!("X-{i}: y\r\n")).collect();
    s.write_all(format!("GET / HTTP/1.1\r\nHost: x\r\n{many}\r\n").as_bytes())
        .unwrap();
    assert_eq!(read_response(&mut s).unwrap().0, 431);
    // (Larger than the limit, smaller than the read buffer: the server has
    // read the whole request when it answers and closes, so the close is a
    // FIN, not a reset that could discard the answer.)
    let mut s = srv.connect();
    let big = format!(
        "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "y".repeat(6_000)
    );
    s.write_all(big.as_bytes()).unwrap();
    assert_eq!(read_response(&mut s).unwrap().0, 431);

    // A header that never completes is dropped; an idle connection is not
    // (its timeout is the idle one).
    let mut slow = srv.connect();
    slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
    let idle = srv.connect();
    assert!(closed_by_server(&mut slow), "the slow header was not cut off");
    assert!(
        still_open(&idle),
        "the idle connection was closed with the slow one"
    );
    // Headers and methods kube-proxy's probes see.
    let mut s = srv.connect();
    s.write_all(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut head = [0u8; 512];
    let n = s.read(&mut head).unwrap();
    let head = String::from_utf8_lossy(&head[..n]);
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(head.contains("Content-Type: application/json\r\n"), "{head}");
    assert!(head.contains("X-Content-Type-Options: nosniff\r\n"), "{head}");
}

#[test]
fn beyond_the_connection_cap_the_longest_idle_connections_are_shed_first() {
    let srv = TestServer::new(Limits {
        max_connections: 4,
        ..Limits::default()
    });
    // Four idle connections fill the cap, in this order.
    let mut idle: Vec<TcpStream> = (0..4).map(|_| srv.connect()).collect();
    // Each new client is answered; the oldest idle connection makes room.
    // The answered ones stay open (idle themselves now, but newer).
    let mut answered = Vec::new();
    for (i, victim) in idle.iter_mut().take(2).enumerate() {
        let mut s = srv.connect();
        assert_eq!(
            request(&mut s, "/", false).unwrap().0,
            200,
            "client {i} over the cap"
        );
        assert!(closed_by_server(victim), "idle connection {i} was not shed");
        answered.push(s);
    }
    assert!(
        still_open(&idle[2]) && still_open(&idle[3]),
        "newer idle connections were shed"
    );
}

#[test]
fn metrics_parse_with_prometheus_own_parser_over_a_kept_alive_connection() {
    let s = one_service("web", "  type: NodePort\n  clusterIP: 10.96.0.10\n");
    let node = &s.cluster.nodes[0];
    let addr = SocketAddrV4::new(node.ip(), METRICS_PORT);
    let (first, second) = node.ns().run(|| {
        let mut s = TcpStream::connect(addr).expect("metrics port");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let first = request(&mut s, "/metrics", false).expect("first scrape");
        let second = request(&mut s, "/metrics", false).expect("second scrape on the same connection");
        (first, second)
    });
    assert_eq!((first.0, second.0), (200, 200));
    let families = prometheus_parse(&second.1);
    for (name, kind) in [
        ("kubeproxy_sync_proxy_rules_duration_seconds", "histogram"),
        ("kubeproxy_network_programming_duration_seconds", "histogram"),
        ("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "gauge"),
        ("kubeproxy_sync_proxy_rules_service_changes", "counter"),
        ("kubeproxy_sync_proxy_rules_endpoint_changes", "counter"),
        ("kubeproxy_sync_proxy_rules_no_local_endpoints_total", "gauge"),
        ("dataplane_sync_problems", "gauge"),
        ("dataplane_skipped_objects", "counter"),
        ("dataplane_map_entries", "gauge"),
        ("dataplane_packets", "counter"),
    ] {
        assert_eq!(
            families.get(name).map(String::as_str),
            Some(kind),
            "{name} in {families:?}"
        );
    }
    assert!(AgentProcess::http_get(node.ns(), addr, "/other").is_ok_and(|(s, _)| s == 404));
}

/// Family name → type, as `prometheus_client.parser` (Prometheus' Python
/// client) reads `text`; panics with the parser's error.
fn prometheus_parse(text: &str) -> std::collections::BTreeMap<String, String> {
    let script = "import sys, json\n\
                  from prometheus_client.parser import text_string_to_metric_families\n\
                  print(json.dumps({f.name: f.type for f in text_string_to_metric_families(sys.stdin.read())}))\n";
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 (cargo xtask setup installs prometheus-client)");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the exposition does not parse: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
