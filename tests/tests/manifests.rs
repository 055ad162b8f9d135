//! Bad manifests lose nothing: a syntax error, an invalid object, a file
//! truncated to nothing and malformed endpoint addresses each leave every
//! valid Service working, with a log line naming the file and line and a
//! metric; `trace --manifests` refuses a broken file with a clear error.

use std::{
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddrV4},
};

use dataplane_tests::{
    agent::{AgentProcess, HEALTH_PORT, METRICS_PORT, ManifestDir, ManifestEndpoint as Ep, service_yaml},
    cluster::Cluster,
    echo::{EchoServer, TcpClient, tcp_request},
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const NODE_PORT: u16 = 30080;
const TARGET: u16 = 8080;

struct Sandbox {
    agent: AgentProcess,
    manifests: ManifestDir,
    _server: EchoServer,
    cluster: Cluster,
}

impl Sandbox {
    fn new() -> Self {
        let mut cluster = Cluster::new();
        cluster.add_pod(0, "a");
        let p = cluster.pod("a");
        let server = EchoServer::tcp(&p.ns, &p.name, SocketAddrV4::new(p.ip, TARGET));
        let manifests = ManifestDir::new(cluster.prefix());
        manifests.write("web.yaml", &web(&cluster));
        let agent = cluster.start_agent(BIN, 0, &manifests, &[]);
        Self {
            agent,
            manifests,
            _server: server,
            cluster,
        }
    }

    fn node_port(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.cluster.nodes[0].ip(), NODE_PORT)
    }

    fn serves(&self, dst: SocketAddrV4) -> bool {
        tcp_request(&self.cluster.client.ns, dst, "x").is_ok_and(|r| r.server == "a")
    }

    fn metrics(&self) -> String {
        let n = &self.cluster.nodes[0];
        AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), METRICS_PORT), "/metrics")
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    fn healthz(&self) -> u16 {
        let n = &self.cluster.nodes[0];
        AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), HEALTH_PORT), "/healthz")
            .map_or(0, |(s, _)| s)
    }

    /// Retries `check` until it holds (the agent applies a stable change
    /// within a few 100 ms polls).
    fn eventually(&self, what: &str, check: impl Fn() -> bool) {
        dataplane_tests::eventually(what, check, || self.agent.log_text());
    }

    /// The problem was logged, counted, and every valid Service still works.
    fn refused(&self, what: &str, reason: &str, log_needle: &str) {
        let counter = format!("dataplane_skipped_objects_total{{reason=\"{reason}\"}} ");
        self.eventually(what, || {
            self.metrics()
                .lines()
                .any(|l| l.starts_with(&counter) && !l.ends_with(" 0"))
        });
        let log = self.agent.log_text();
        assert!(
            log.lines()
                .any(|l| l.contains("manifest not applied") && l.contains(log_needle)),
            "{what}: no log line with {log_needle:?}:\n{log}"
        );
        assert!(
            self.serves(self.node_port()),
            "{what}: the Service stopped working"
        );
        assert_eq!(self.healthz(), 200, "{what}");
    }
}

fn web(c: &Cluster) -> String {
    let p = c.pod("a");
    service_yaml(
        "web",
        "  type: NodePort\n  clusterIP: 10.96.0.10\n",
        80,
        Some(NODE_PORT),
        TARGET,
        &[Ep::ready(p.ip, "node1")],
    )
}

#[test]
fn bad_manifests_keep_the_last_good_set_with_a_log_line_and_a_metric() {
    let s = Sandbox::new();
    assert!(s.serves(s.node_port()));
    let good = web(&s.cluster);
    let good_lines = good.lines().count();

    // A YAML syntax error: the file's last good set stays.
    s.manifests.write("web.yaml", &format!("{good}---\na: [\n"));
    s.refused("syntax error", "syntax", &format!("web.yaml:{}:", good_lines + 2));

    // An object that does not deserialize (`port: eighty`).
    let eighty = good
        .replace("name: web", "name: web2")
        .replace("port: 80,", "port: eighty,");
    s.manifests.write("web.yaml", &format!("{good}---\n{eighty}"));
    s.refused("port: eighty", "invalid_object", "\"web2\"");

    // Truncated to nothing by a non-atomic writer.
    std::fs::write(s.manifests.path().join("web.yaml"), "").unwrap();
    s.refused("empty file", "empty_file", "became empty");

    // Malformed endpoint addresses in another file: reported, skipped, the
    // valid endpoint serves.
    let pod = s.cluster.pod("a").ip.to_string();
    let bad_eps = service_yaml(
        "eps",
        "  type: NodePort\n  clusterIP: 10.96.0.30\n",
        80,
        Some(NODE_PORT + 1),
        TARGET,
        &[Ep::ready(Ipv4Addr::UNSPECIFIED, "node1")],
    )
    .replace(
        "  - {addresses: [0.0.0.0],",
        &format!(
            "  - {{addresses: [not-an-ip]}}\n  - {{addresses: [10.244.0.999]}}\n  - {{addresses: [\"fd00::1\"]}}\n  - {{addresses: [{pod}],"
        ),
    );
    s.manifests.write("eps.yaml", &bad_eps);
    let eps_port = SocketAddrV4::new(s.cluster.nodes[0].ip(), NODE_PORT + 1);
    s.eventually("the valid endpoint of the bad slice serves", || {
        s.serves(eps_port)
    });
    s.eventually("bad addresses are counted", || {
        s.metrics()
            .lines()
            .any(|l| l.starts_with("dataplane_sync_problems ") && l != "dataplane_sync_problems 0")
    });
    let log = s.agent.log_text();
    for needle in [
        "\"not-an-ip\"",
        "\"10.244.0.999\"",
        "IPv6 address in an IPv4 slice",
    ] {
        assert!(log.contains(needle), "{needle} not logged:\n{log}");
    }

    // Deleting the file is how its objects are removed.
    s.manifests.remove("web.yaml");
    s.eventually("the deleted file's Service is gone", || {
        TcpClient::connect(&s.cluster.client.ns, s.node_port())
            .is_err_and(|e| e.kind() == ErrorKind::ConnectionRefused)
    });
}

#[test]
fn trace_refuses_a_broken_manifest_with_the_file_and_line() {
    let dir = ManifestDir::new(&format!("{}-trace", dataplane_tests::unique_prefix()));
    dir.write(
        "broken.yaml",
        "kind: Service\nmetadata: {name: x}\nspec:\n  ports: [\n",
    );
    let out = std::process::Command::new(BIN)
        .args(["trace", "--manifests"])
        .arg(dir.path().join("broken.yaml"))
        .args(["--node-name", "node1", "--node-ip", "198.18.0.11"])
        .args([
            "--from",
            "external",
            "--src",
            "203.0.113.9",
            "--dst",
            "198.18.0.11:30080",
            "--proto",
            "tcp",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "trace accepted a broken file: {stderr}");
    assert!(stderr.contains("broken.yaml:4:10: unclosed bracket"), "{stderr}");
}
