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
    agent::{AgentProcess, HEALTH_PORT, ManifestDir, ManifestEndpoint as Ep, service_yaml},
    cluster::Cluster,
    echo::{EchoServer, TcpClient, tcp_request},
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const NODE_PORT: u16 = 30080;
const TARGET: u16 = 8080;

struct Sandbox {
    agents: Vec<AgentProcess>,
    _servers: Vec<EchoServer>,
    manifests: ManifestDir,
    cluster: Cluster,
}

impl Sandbox {
    /// Pods a (node1), b (node2), c (node2) serving TCP on 8080; `yaml` is the
    /// first content of the manifests; an agent per node.
    fn new(yaml: impl Fn(&Cluster) -> String) -> Self {
        let mut cluster = Cluster::new();
        for (name, node) in [("a", 0), ("b", 1), ("c", 1)] {
            cluster.add_pod(node, name);
        }
        let servers = cluster
            .pods
            .iter()
            .map(|p| EchoServer::tcp(&p.ns, &p.name, SocketAddrV4::new(p.ip, TARGET)))
            .collect();
        let manifests = ManifestDir::new(cluster.prefix());
        manifests.write("web.yaml", &yaml(&cluster));
        let agents = (0..2)
            .map(|i| cluster.start_agent(BIN, i, &manifests, &[]))
            .collect();
        Self {
            agents,
            _servers: servers,
            manifests,
            cluster,
        }
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
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if check() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("{what}: not reached in 10 s\n{}", self.logs());
    }

    fn logs(&self) -> String {
        self.agents
            .iter()
            .map(|a| a.log_text())
            .collect::<Vec<_>>()
            .join("\n---\n")
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
    s.manifests
        .write("web.yaml", &node_port_service(&s.cluster, "", &["a", "b", "c"]));
    s.eventually("c serves after scale-up", || {
        s.servers_seen(dst, 20).contains("c")
    });

    // Scale down to a.
    s.manifests
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
    s.manifests.write("web.yaml", &yaml);
    s.eventually("the terminating endpoint gets no new flows", || {
        s.servers_seen(dst, 10) == BTreeSet::from(["b".into()])
    });

    // eTP flipped to Local: node1 serves its local a... a is terminating, so
    // the local set falls back to it; the client address is kept.
    s.manifests.write(
        "web.yaml",
        &node_port_service(&s.cluster, "  externalTrafficPolicy: Local\n", &["a", "b"]),
    );
    s.eventually("eTP=Local keeps the client address", || {
        tcp_request(&s.cluster.client.ns, dst, "x")
            .is_ok_and(|r| r.server == "a" && *r.peer.ip() == s.cluster.client.ip)
    });

    // Service deleted: the NodePort is no longer translated (the node itself
    // has no listener there: refused by its stack).
    s.manifests.remove("web.yaml");
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
    s.manifests.remove("web.yaml");
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
    std::thread::sleep(Duration::from_millis(500));
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
        log.contains("adopted the pinned service table frontends=3"),
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
    let _ = Ipv4Addr::LOCALHOST;
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

    // trace --live copies the pinned table (read-only) into a private datapath.
    let pins = s.cluster.bpffs.path().join("node1");
    let before = inspect(&s, 0, &["conntrack"])["total"].clone();
    let out = std::process::Command::new(BIN)
        .args(["trace", "--live", "--bpffs-dir"])
        .arg(&pins)
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
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
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
}
