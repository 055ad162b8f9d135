//! The agent end to end: one `dataplane-agent run` process per sandbox node,
//! fed by a manifests directory; real traffic follows Service edits; health
//! ports answer as kube-proxy's; `kill -9` under traffic loses nothing.

use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddrV4},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use dataplane_tests::{
    agent::{AgentProcess, HEALTH_PORT, METRICS_PORT, ManifestEndpoint as Ep, service_yaml},
    cluster::Cluster,
    echo::{TcpClient, tcp_request},
    load::{self, LineServer},
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const NODE_PORT: u16 = 30080;
const TARGET: u16 = 8080;

/// The shared sandbox, with this file's helpers.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

impl Sandbox {
    /// Pods a (node1), b (node2), c (node2) serving TCP on 8080; `yaml` is the
    /// first content of the manifests; an agent per node.
    fn new(yaml: impl Fn(&Cluster) -> String) -> Self {
        Self::with_args(yaml, &[])
    }

    /// As [`Sandbox::new`], with extra `run` flags for every agent.
    fn with_args(yaml: impl Fn(&Cluster) -> String, extra: &[&str]) -> Self {
        Self(
            dataplane_tests::sandbox::Sandbox::builder(Cluster::new())
                .pods(&[("a", 0), ("b", 1), ("c", 1)])
                .tcp_echo(TARGET)
                .manifest("web.yaml", yaml)
                .agents(2, |s, i| s.start_agent(BIN, i, extra)),
        )
    }

    fn ep(&self, pod: &str) -> Ep {
        let p = self.cluster.pod(pod);
        Ep::ready(p.ip, &self.cluster.nodes[p.node].name)
    }

    fn node_port(&self, node: usize) -> SocketAddrV4 {
        SocketAddrV4::new(self.cluster.nodes[node].ip(), NODE_PORT)
    }

    /// Backends that answered `n` new connections to `dst`.
    fn servers_seen(&self, dst: SocketAddrV4, n: usize) -> BTreeSet<String> {
        (0..n)
            .map(|i| {
                tcp_request(&self.cluster.client.ns, dst, "x")
                    .unwrap_or_else(|e| panic!("request {i} to {dst}: {e}\n{}", self.logs()))
                    .server
            })
            .collect()
    }

    /// Retries `check` until it holds (the agent applies edits within its
    /// 100 ms poll); panics with the agents' logs after 10 s.
    fn eventually(&self, what: &str, check: impl Fn() -> bool) {
        dataplane_tests::eventually(what, check, || self.logs());
    }

    /// A counter or gauge of agent `node`'s /metrics (0 when absent).
    fn metric(&self, node: usize, name: &str) -> u64 {
        let n = &self.cluster.nodes[node];
        let (status, body) =
            AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), METRICS_PORT), "/metrics")
                .unwrap_or_else(|e| panic!("metrics of node {node}: {e}"));
        assert_eq!(status, 200, "metrics of node {node}: {body}");
        body.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .map_or(0, |v| v as u64)
    }
}

fn node_port_service(s: &Cluster, spec: &str, pods: &[&str]) -> String {
    let eps: Vec<Ep> = pods
        .iter()
        .map(|p| {
            let pod = s.pod(p);
            Ep::ready(pod.ip, &s.nodes[pod.node].name)
        })
        .collect();
    service_yaml(
        "web",
        &format!("  type: NodePort\n  clusterIP: 10.96.0.10\n{spec}"),
        80,
        Some(NODE_PORT),
        TARGET,
        &eps,
    )
}

#[test]
fn traffic_follows_service_edits() {
    let s = Sandbox::new(|c| node_port_service(c, "", &["a", "b"]));
    let dst = s.node_port(0);
    assert_eq!(s.servers_seen(dst, 30), BTreeSet::from(["a".into(), "b".into()]));

    // Scale up: c joins.
    s.manifests()
        .write("web.yaml", &node_port_service(&s.cluster, "", &["a", "b", "c"]));
    s.eventually("c serves after scale-up", || {
        s.servers_seen(dst, 20).contains("c")
    });

    // Scale down to a.
    s.manifests()
        .write("web.yaml", &node_port_service(&s.cluster, "", &["a"]));
    s.eventually("only a serves after scale-down", || {
        s.servers_seen(dst, 10) == BTreeSet::from(["a".into()])
    });

    // a becomes terminating while b is ready: new flows go to b only.
    let yaml = service_yaml(
        "web",
        "  type: NodePort\n  clusterIP: 10.96.0.10\n",
        80,
        Some(NODE_PORT),
        TARGET,
        &[s.ep("a").terminating(), s.ep("b")],
    );
    s.manifests().write("web.yaml", &yaml);
    s.eventually("the terminating endpoint gets no new flows", || {
        s.servers_seen(dst, 10) == BTreeSet::from(["b".into()])
    });

    // eTP flipped to Local: node1 serves its local a... a is terminating, so
    // the local set falls back to it; the client address is kept.
    s.manifests().write(
        "web.yaml",
        &node_port_service(&s.cluster, "  externalTrafficPolicy: Local\n", &["a", "b"]),
    );
    s.eventually("eTP=Local keeps the client address", || {
        tcp_request(&s.cluster.client.ns, dst, "x")
            .is_ok_and(|r| r.server == "a" && r.peer.ip() == s.cluster.client.ip)
    });
    // Those flows' forward packets came in through node1's external device,
    // whose TC ingress left egress a word, and the agent told egress to
    // trust that device's word (DP_HINT_DEVICES_V1: nothing stacked here).
    s.eventually(
        "egress passes unmasqueraded forward packets on the ingress word",
        || {
            s.metric(
                0,
                "dataplane_packets_total{hook=\"tc_egress\",event=\"pass_by_ingress\"}",
            ) > 0
        },
    );

    // Service deleted: the NodePort is no longer translated (the node itself
    // has no listener there: refused by its stack).
    s.manifests().remove("web.yaml");
    s.eventually("the deleted Service is gone", || {
        TcpClient::connect(&s.cluster.client.ns, dst).is_err_and(|e| e.kind() == ErrorKind::ConnectionRefused)
    });
}

#[test]
fn health_check_node_ports_answer_like_kube_proxy() {
    let s = Sandbox::new(|c| {
        let pod = c.pod("a");
        service_yaml(
            "lb",
            "  type: LoadBalancer\n  clusterIP: 10.96.0.20\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n",
            80,
            Some(30090),
            TARGET,
            &[Ep::ready(pod.ip, "node1")],
        )
    });
    let get = |node: usize, path: &str| {
        let n = &s.cluster.nodes[node];
        AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), 32000), path).expect("health check port")
    };
    let (status, body) = get(0, "/any/path");
    assert_eq!(status, 200, "node1 has a local endpoint: {body}");
    assert_eq!(
        body,
        r#"{"service":{"namespace":"default","name":"lb"},"localEndpoints":1,"serviceProxyHealthy":true}"#
    );
    let (status, body) = get(1, "/");
    assert_eq!(status, 503, "node2 has none: {body}");
    assert!(body.contains(r#""localEndpoints":0"#));

    // /healthz and /livez on the proxy's health port.
    let n = &s.cluster.nodes[0];
    let (status, body) =
        AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), HEALTH_PORT), "/healthz").unwrap();
    assert_eq!(status, 200);
    assert!(body.contains(r#""nodeEligible":true"#), "{body}");
    let (status, _) =
        AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), HEALTH_PORT), "/livez").unwrap();
    assert_eq!(status, 200);

    // `inspect health` shows the same, from the node.
    let out = n
        .ns()
        .command(BIN)
        .args([
            "inspect",
            "health",
            "--health-address",
            &format!("{}:{HEALTH_PORT}", n.ip()),
            "-o",
            "json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let h: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(h["healthz"]["status"], 200);
    let check = &h["healthCheckNodePorts"][0];
    assert_eq!(
        (
            check["name"].as_str(),
            check["port"].as_u64(),
            check["status"].as_u64()
        ),
        (Some("lb"), Some(32000), Some(200))
    );

    // The Service goes: its health server closes.
    s.manifests().remove("web.yaml");
    s.eventually("the health server closes with its Service", || {
        AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), 32000), "/").is_err()
    });
}

#[test]
fn kill_9_under_traffic_loses_no_connection() {
    let mut s = Sandbox::new(|c| node_port_service(c, "", &["a", "b", "c"]));
    let dst = s.node_port(0);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));

    // Continuous new connections, and one long connection used throughout.
    let mut long = TcpClient::connect(&s.cluster.client.ns, dst).unwrap();
    let long_backend = long.request("start").unwrap().server;
    let client_ns = s.cluster.client.ns.name().to_owned();
    let traffic = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        let ns = dataplane_tests::netns::NetNs::adopt(&client_ns);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match tcp_request(&ns, dst, "x") {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        })
    };
    s.eventually("new connections flow", || ok.load(Ordering::Relaxed) > 0);
    s.agents[0].kill9();
    let down_at = ok.load(Ordering::Relaxed);
    for i in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            long.request(&format!("down {i}"))
                .expect("long connection while the agent is down")
                .server,
            long_backend
        );
    }
    assert!(
        ok.load(Ordering::Relaxed) > down_at + 10,
        "new connections kept working while the agent was down"
    );
    let ns = s.cluster.nodes[0].ns();
    // Restart: it adopts the pinned maps and replaces the programs atomically.
    let ns_name = ns.name().to_owned();
    s.agents[0].restart(&dataplane_tests::netns::NetNs::adopt(&ns_name));
    for i in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            long.request(&format!("up {i}"))
                .expect("long connection after the restart")
                .server,
            long_backend
        );
    }
    stop.store(true, Ordering::Relaxed);
    traffic.join().unwrap();
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "failed connections\n{}",
        s.logs()
    );
    assert!(ok.load(Ordering::Relaxed) > 100);
    let log = s.agents[0].log_text();
    assert!(
        log.contains("adopted the pinned service table frontends=2"),
        "adopted: {log}"
    );
    assert!(
        log.contains("replaced=true"),
        "programs replaced through the pinned links: {log}"
    );
    // The first sync after the restart changed nothing.
    let after_restart = log.rsplit("adopted the pinned service table").next().unwrap();
    assert!(
        after_restart.contains(" ops=0 "),
        "nothing rewritten after the restart: {after_restart}"
    );
    assert_no_drops(&s, 0);
}

/// Churn beside a live flow: a long-lived masqueraded connection keeps its
/// backend and its SNAT port while 100,000 new connections to the same
/// backends go by (the port space of each backend goes round more than
/// once), and none of those fails: ports of closed flows are taken over,
/// a live one never is, and reopened tuples (client ports come round too)
/// are translated as new connections.
#[test]
fn a_live_masqueraded_connection_survives_100k_new_connections_beside_it() {
    const CHURN_PORT: u16 = 30090;
    const LINE_PORT: u16 = 8090;
    const CONNECTIONS: u64 = 100_000;
    let s = Sandbox::new(|c| {
        let eps: Vec<Ep> = ["a", "b", "c"]
            .iter()
            .map(|p| Ep::ready(c.pod(p).ip, &c.nodes[c.pod(p).node].name))
            .collect();
        service_yaml(
            "churn",
            "  type: NodePort\n  clusterIP: 10.96.0.20\n",
            80,
            Some(CHURN_PORT),
            LINE_PORT,
            &eps,
        )
    });
    let _line_servers: Vec<LineServer> = s
        .cluster
        .pods
        .iter()
        .map(|p| {
            // Server-side TIME_WAIT would refuse a reused tuple: as every
            // benchmark of masquerading does, keep none.
            p.ns.sysctl("net/ipv4/tcp_max_tw_buckets", "0");
            LineServer::start(&p.ns, &p.name, SocketAddrV4::new(p.ip, LINE_PORT))
        })
        .collect();
    let dst = SocketAddrV4::new(s.cluster.nodes[0].ip(), CHURN_PORT);
    let mut long = TcpClient::connect(&s.cluster.client.ns, dst).unwrap();
    let first = long.request("keep start").unwrap();
    assert_ne!(
        first.peer.ip(),
        s.cluster.client.ip,
        "eTP=Cluster: the backend sees the node"
    );

    let client_ns = s.cluster.client.ns.name().to_owned();
    let churn = std::thread::spawn(move || {
        load::churn(
            &dataplane_tests::netns::NetNs::adopt(&client_ns),
            dst,
            load::Amount::Connections(CONNECTIONS),
            32,
            Duration::from_secs(5),
        )
    });
    let mut rounds = 0;
    while !churn.is_finished() {
        std::thread::sleep(Duration::from_millis(100));
        let r = long
            .request(&format!("keep {rounds}"))
            .unwrap_or_else(|e| panic!("long connection, round {rounds}: {e}\n{}", s.logs()));
        assert_eq!(
            (r.server.as_str(), r.peer),
            (first.server.as_str(), first.peer),
            "same backend, same SNAT address and port"
        );
        rounds += 1;
    }
    let report = churn.join().unwrap();
    assert_eq!(
        (report.ok, report.failed),
        (CONNECTIONS, 0),
        "every new connection beside it worked: {:?}\n{}\n{}",
        report.errors,
        inspect(&s, 0, &["stats"]),
        s.logs()
    );
    assert!(
        rounds > 10,
        "the long connection was used throughout ({rounds} rounds)"
    );
    let stats = assert_no_drops(&s, 0);
    let flows = &stats["flows"];
    let count = |name: &str| flow_count(flows, name);
    // Node 1's share of 100k connections over 3 backends cycles each port
    // space more than once: closed flows' ports were taken over (by a new
    // flow from the same client port: `tuple_takeover`; from another one
    // hashed to the same SNAT port: `snat_port_takeover`).
    assert!(
        count("snat_port_takeover") + count("tuple_takeover") > 0,
        "takeovers: {flows}"
    );
    // Client ports come round too: SYNs on closed connections' tuples
    // opened new ones (and each of those worked, above). This needs a port
    // to come round before the 16384-entry map evicts its entries: current
    // Linux kernels pick connect() ports with random steps, so ports recur
    // within a few thousand connections; a kernel that walked the range in
    // order would reuse one only every ~28k.
    assert!(count("reopened_closed_flow") > 0, "reopened tuples: {flows}");
    eprintln!(
        "100k connections beside a live one: {:.0}/s, p50 {} µs, p99 {} µs; flows {flows}",
        report.rate(),
        report.percentile_us(0.5),
        report.percentile_us(0.99)
    );
}

#[test]
fn pods_that_appear_after_the_agent_started_reach_services() {
    let mut s = Sandbox::new(|c| node_port_service(c, "", &["a", "b"]));
    // The CNI creates a pod (and its host interface) while the agent runs.
    s.cluster.add_pod(0, "late");
    let late = s.cluster.pod("late");
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
    s.eventually("the new pod reaches the ClusterIP", || {
        tcp_request(&late.ns, cluster_ip, "x").is_ok()
    });
    assert!(
        s.agents[0].log_text().contains("attached to pod interface"),
        "{}",
        s.logs()
    );
}

/// A flood of new flows that fills conntrack (each agent's LRU holds
/// 16384 entries) breaks no established connection: 20 idle connections
/// through a masqueraded NodePort with three endpoints, then three times
/// the table in new UDP flows (three datagrams each, a new source port
/// every flow) to an eTP=Local UDP NodePort on the same node; afterwards every
/// connection answers, from its backend, seen from its SNAT address and
/// port, as netfilter keeps assured connections through a full table.
#[test]
fn a_flood_that_fills_conntrack_breaks_no_established_connection() {
    const FLOOD_PORT: u16 = 30053;
    const FLOWS: u16 = 3 * 16384 / 2;
    let s = Sandbox::new(|c| {
        let eps: Vec<Ep> = ["a", "b", "c"]
            .iter()
            .map(|p| Ep::ready(c.pod(p).ip, &c.nodes[c.pod(p).node].name))
            .collect();
        let web = service_yaml(
            "web",
            "  type: NodePort\n  clusterIP: 10.96.0.21\n",
            80,
            Some(NODE_PORT),
            TARGET,
            &eps,
        );
        // eTP=Local (pod a is on node 1): not masqueraded, so the flood
        // fills conntrack without exhausting SNAT ports.
        let local = "  type: NodePort\n  clusterIP: 10.96.0.22\n  externalTrafficPolicy: Local\n";
        let flood = service_yaml("flood", local, 53, Some(FLOOD_PORT), 5353, &eps)
            .replace("protocol: TCP", "protocol: UDP");
        format!("{web}---\n{flood}")
    });
    let dst = s.node_port(0);
    s.eventually("the NodePort is served", || {
        tcp_request(&s.cluster.client.ns, dst, "x").is_ok()
    });
    let mut conns: Vec<(TcpClient, String, std::net::SocketAddr)> = (0..20)
        .map(|i| {
            let mut c = TcpClient::connect(&s.cluster.client.ns, dst)
                .unwrap_or_else(|e| panic!("connection {i}: {e}\n{}", s.logs()));
            let r = c.request("hello").unwrap();
            (c, r.server, r.peer)
        })
        .collect();
    let servers: BTreeSet<&str> = conns.iter().map(|(_, s, _)| s.as_str()).collect();
    assert!(servers.len() > 1, "several backends in use: {servers:?}");

    // The flood, from the client: nobody listens on the pods' port 5353
    // (their ICMP errors go back through the datapath too).
    let flood_dst = SocketAddrV4::new(s.cluster.nodes[0].ip(), FLOOD_PORT);
    s.cluster.client.ns.run(|| {
        for i in 0..FLOWS {
            let sock = std::net::UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 10_000 + i))
                .unwrap_or_else(|e| panic!("bind port {}: {e}", 10_000 + i));
            for _ in 0..3 {
                sock.send_to(b"flood", flood_dst).unwrap();
            }
        }
    });
    let stats = inspect(&s, 0, &["stats"]);
    let flows = &stats["flows"];
    let count = |name: &str| flow_count(flows, name);
    assert!(
        count("ct_inserted") >= 2 * FLOWS as u64,
        "the flood's flows went through conntrack: {flows}"
    );

    for (i, (c, server, peer)) in conns.iter_mut().enumerate() {
        let r = c
            .request("after the flood")
            .unwrap_or_else(|e| panic!("connection {i} after the flood: {e}\n{flows}\n{}", s.logs()));
        assert_eq!(
            (&r.server, r.peer),
            (&*server, *peer),
            "connection {i}: same backend, same SNAT address and port"
        );
    }
    let after = inspect(&s, 0, &["stats"]);
    let restored = after["flows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["stat"] == "ct_restored")
        .and_then(|f| f["count"].as_u64())
        .unwrap_or(0);
    assert!(
        restored > 0,
        "the flood evicted established entries, restored: {}",
        after["flows"]
    );
    assert_eq!(count("ct_midstream_pickup"), 0, "no connection picked up anew");
    assert_no_drops(&s, 0);
}

/// Endpoint churn loses no new connection: new connections (one request
/// each, the server closing first so that TIME_WAIT stays on its side, as
/// with HTTP's `Connection: close`) to a masqueraded NodePort for 10 s
/// while its second endpoint leaves and rejoins every 50 ms and 50 other
/// Services move their endpoints; a connection refused, reset or
/// unanswered within 2 s is lost.
#[test]
fn new_connections_survive_endpoint_churn() {
    let others = |c: &Cluster, round: usize| -> String {
        (0..50)
            .map(|i| {
                let pod = if (i + round).is_multiple_of(2) { "a" } else { "c" };
                let ep = Ep::ready(c.pod(pod).ip, &c.nodes[c.pod(pod).node].name);
                let spec = format!("  clusterIP: 10.96.1.{}\n", 10 + i);
                format!(
                    "---\n{}",
                    service_yaml(&format!("other{i}"), &spec, 80, None, TARGET, &[ep])
                )
            })
            .collect()
    };
    let manifest = |c: &Cluster, round: usize| -> String {
        let mut eps = vec![Ep::ready(c.pod("a").ip, &c.nodes[0].name)];
        if round.is_multiple_of(2) {
            eps.push(Ep::ready(c.pod("b").ip, &c.nodes[1].name));
        }
        let web = service_yaml(
            "web",
            "  type: NodePort\n  clusterIP: 10.96.0.23\n",
            80,
            Some(NODE_PORT),
            LINE_PORT,
            &eps,
        );
        format!("{web}{}", others(c, round))
    };
    const LINE_PORT: u16 = 8090;
    let s = Sandbox::new(|c| manifest(c, 0));
    // Line servers answer one line and close first: the pods keep TIME_WAIT
    // (the kernel's default), as HTTP servers with `Connection: close` do.
    let servers: Vec<LineServer> = ["a", "b"]
        .iter()
        .map(|name| {
            let p = s.cluster.pod(name);
            LineServer::start(&p.ns, &p.name, SocketAddrV4::new(p.ip, LINE_PORT))
        })
        .collect();
    let dst = s.node_port(0);
    s.eventually("both endpoints serve", || {
        load::churn(
            &s.cluster.client.ns,
            dst,
            load::Amount::Connections(20),
            4,
            Duration::from_secs(2),
        )
        .ok == 20
            && servers.iter().all(|l| l.accepted.load(Ordering::Relaxed) > 0)
    });

    let client_ns = s.cluster.client.ns.name().to_owned();
    let churn = std::thread::spawn(move || {
        load::churn(
            &dataplane_tests::netns::NetNs::adopt(&client_ns),
            dst,
            load::Amount::For(Duration::from_secs(10)),
            2,
            Duration::from_secs(2),
        )
    });
    let mut round = 0;
    while !churn.is_finished() {
        round += 1;
        s.manifests().write("web.yaml", &manifest(&s.cluster, round));
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = churn.join().unwrap();
    let stats = inspect(&s, 0, &["stats"]);
    eprintln!(
        "endpoint churn: {} rounds, {} connections ({:.0}/s), {} failed; flows {}",
        round,
        report.ok,
        report.rate(),
        report.failed,
        stats["flows"]
    );
    // Until ports another client closed were held for TIME_WAIT, about 1
    // connection in 5000 was lost here: the pod, in TIME_WAIT on a reused
    // SNAT tuple, answered the new SYN with an ACK of the old connection.
    assert_eq!(
        report.failed,
        0,
        "lost connections: {} of {}: {:?}\n{}",
        report.failed,
        report.ok,
        report.errors,
        s.logs()
    );
    assert!(
        flow_count(&stats["flows"], "snat_time_wait_held") > 0,
        "hashed ports closed moments ago were passed over: {}",
        stats["flows"]
    );
    assert!(report.ok > 500, "the churn ran: {} connections", report.ok);
    assert!(round > 100, "the endpoints moved: {round} rounds");
    assert_no_drops(&s, 0);
}

/// Asserts that node `agent`'s datapath dropped nothing (a dropped SYN is
/// retransmitted after 1 s, within the clients' timeouts: a connection that
/// "worked" may still have lost its first packet); returns `inspect stats`.
fn assert_no_drops(s: &Sandbox, agent: usize) -> serde_json::Value {
    let stats = inspect(s, agent, &["stats"]);
    let drops: Vec<&serde_json::Value> = stats["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["drop"] == true)
        .collect();
    assert!(drops.is_empty(), "node{}: no drops: {drops:?}", agent + 1);
    stats
}

/// A count of `inspect stats`' `flows` (0 when absent).
fn flow_count(flows: &serde_json::Value, name: &str) -> u64 {
    flows
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["stat"] == name)
        .and_then(|f| f["count"].as_u64())
        .unwrap_or(0)
}

/// `dataplane-agent inspect ... -o json` against `agent`'s pins.
fn inspect(s: &Sandbox, agent: usize, what: &[&str]) -> serde_json::Value {
    let pins = s.cluster.bpffs.path().join(&s.cluster.nodes[agent].name);
    let out = std::process::Command::new(BIN)
        .arg("inspect")
        .arg("--bpffs-dir")
        .arg(&pins)
        .args(["-o", "json"])
        .args(what)
        .output()
        .expect("run inspect");
    assert!(
        out.status.success(),
        "inspect {what:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("inspect json")
}

#[test]
fn inspect_and_trace_read_a_running_agent_and_a_stopped_one() {
    let mut s = Sandbox::new(|c| node_port_service(c, "  externalTrafficPolicy: Local\n", &["a", "b"]));
    let dst = s.node_port(0);
    assert!(s.servers_seen(dst, 5).contains("a"));

    let services = inspect(&s, 0, &["services"]);
    let rows = services["services"].as_array().unwrap();
    let np = rows
        .iter()
        .find(|r| r["frontend"] == format!("{dst}/TCP").as_str())
        .unwrap_or_else(|| panic!("NodePort row in {services}"));
    assert_eq!(np["type"], "NodePort");
    assert_eq!(np["service"], "default/web:p");
    assert!(np["flags"].as_array().unwrap().contains(&"eTP=Local".into()));
    assert_eq!(
        np["external"]["backends"].as_array().unwrap().len(),
        1,
        "the local set"
    );
    assert_eq!(
        np["internal"]["backends"].as_array().unwrap().len(),
        2,
        "the cluster set"
    );
    assert!(np["packets"].as_u64().unwrap() >= 5, "traffic counted: {np}");

    let backends = inspect(&s, 0, &["backends"]);
    assert_eq!(backends["backends"].as_array().unwrap().len(), 2);
    let ct = inspect(
        &s,
        0,
        &["conntrack", "--address", &s.cluster.client.ip.to_string()],
    );
    assert!(ct["count"].as_u64().unwrap() >= 10, "the client's flows: {ct}");
    assert!(ct["capacity"].as_u64().unwrap() > 0);
    let stats = inspect(&s, 0, &["stats"]);
    assert!(
        stats["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["event"] == "new_flow")
    );

    // The agent is down: the pins still answer.
    s.agents[0].kill9();
    let again = inspect(&s, 0, &["services"]);
    assert_eq!(again["services"].as_array().unwrap().len(), rows.len());

    // trace --live copies the pinned table (read-only) into a private
    // datapath: loaded and verified, then reopened from the trace cache (in
    // the sandbox's bpffs, removed with it); neither writes the live maps.
    let pins = s.cluster.bpffs.path().join("node1");
    let cache = s.cluster.bpffs.path().join("trace-cache");
    let before = inspect(&s, 0, &["conntrack"])["total"].clone();
    let live_trace = || {
        let out = std::process::Command::new(BIN)
            .args(["trace", "--live", "--verbose", "--bpffs-dir"])
            .arg(&pins)
            .arg("--cache-dir")
            .arg(&cache)
            .args([
                "--node-name",
                "node1",
                "--node-ip",
                &s.cluster.nodes[0].ip().to_string(),
            ])
            .args([
                "--cluster-cidr",
                "10.244.0.0/16",
                "--from",
                "external",
                "--src",
                "203.0.113.9",
            ])
            .args(["--dst", &dst.to_string(), "--proto", "tcp", "-o", "json"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        let t: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(t["verdict"], "forward");
        assert_eq!(
            t["backend"],
            format!("{}:8080", s.cluster.pod("a").ip).as_str(),
            "the local endpoint"
        );
        assert_eq!(t["snat"], false);
        assert_eq!(t["service"], "default/web:p");
        assert_eq!(
            inspect(&s, 0, &["conntrack"])["total"],
            before,
            "the live maps were not written"
        );
        stderr
    };
    let cold = live_trace();
    assert!(cold.contains("loaded and verified"), "{cold}");
    let warm = live_trace();
    assert!(warm.contains("reused the verified programs"), "{warm}");
}

/// kube-proxy keeps established TCP flows to an endpoint that leaves its
/// slice or turns unready, and sends new flows elsewhere at once. Here b
/// leaves and rejoins, and flaps unready and ready, 1000 times, each change
/// synced (minSyncPeriod 0, checked on the agent's own counter) while new
/// connections stream through node 1: none fails, a connection held to b
/// lives through all of it, and while b is out no new connection reaches it.
#[test]
fn endpoint_churn_under_traffic_fails_no_connection_and_keeps_established_flows() {
    const CHANGES: u64 = 1000;
    const CHANGES_METRIC: &str = "kubeproxy_sync_proxy_rules_endpoint_changes_total";
    let yaml = |c: &Cluster, b: Option<bool>| {
        let mut eps = vec![];
        for p in ["a", "b", "c"] {
            let pod = c.pod(p);
            let mut ep = Ep::ready(pod.ip, &c.nodes[pod.node].name);
            if p == "b" {
                match b {
                    None => continue,
                    Some(ready) => (ep.ready, ep.serving) = (ready, ready),
                }
            }
            eps.push(ep);
        }
        service_yaml(
            "web",
            "  type: NodePort\n  clusterIP: 10.96.0.10\n",
            80,
            Some(NODE_PORT),
            TARGET,
            &eps,
        )
    };
    let s = Sandbox::with_args(|c| yaml(c, Some(true)), &["--min-sync-period-ms", "0"]);
    let dst = s.node_port(0);
    let mut long = (0..100)
        .find_map(|_| {
            let mut c = TcpClient::connect(&s.cluster.client.ns, dst).ok()?;
            (c.request("start").ok()?.server == "b").then_some(c)
        })
        .expect("a connection to b within 100 tries");

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let client_ns = s.cluster.client.ns.name().to_owned();
    let traffic: Vec<_> = (0..2)
        .map(|_| {
            let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
            let ns = dataplane_tests::netns::NetNs::adopt(&client_ns);
            std::thread::spawn(move || {
                let mut errors = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    match tcp_request(&ns, dst, "x") {
                        Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            errors.push(e.to_string());
                            failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
                errors
            })
        })
        .collect();

    let before = s.metric(0, CHANGES_METRIC);
    let mut b_out_checked = 0;
    for i in 0..CHANGES {
        // Out, back ready, unready, ready again.
        let b = match i % 4 {
            0 => None,
            2 => Some(false),
            _ => Some(true),
        };
        s.manifests().write("web.yaml", &yaml(&s.cluster, b));
        let deadline = Instant::now() + Duration::from_secs(5);
        while s.metric(0, CHANGES_METRIC) < before + i + 1 {
            assert!(
                Instant::now() < deadline,
                "change {i} not synced in 5 s\n{}",
                s.logs()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        if i % 100 == 0 {
            // b just left (i % 4 == 0): new flows go to a and c only.
            let seen = s.servers_seen(dst, 10);
            assert!(!seen.contains("b"), "change {i}: b got a new flow: {seen:?}");
            b_out_checked += 1;
        }
        if i % 10 == 0 {
            let r = long
                .request(&format!("keep {i}"))
                .unwrap_or_else(|e| panic!("connection to b, change {i}: {e}\n{}", s.logs()));
            assert_eq!(r.server, "b", "change {i}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    let errors: Vec<String> = traffic.into_iter().flat_map(|t| t.join().unwrap()).collect();
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert_eq!(failed, 0, "failed connections: {errors:?}\n{}", s.logs());
    assert!(ok > 1000, "traffic ran throughout ({ok} connections)");
    assert_eq!(b_out_checked, 10);
    assert_eq!(long.request("end").unwrap().server, "b");
    assert_no_drops(&s, 0);
    eprintln!(
        "{CHANGES} endpoint changes synced, {} counted by the agent; {ok} new connections, 0 failed",
        s.metric(0, CHANGES_METRIC) - before
    );
}
