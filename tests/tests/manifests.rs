//! Bad manifests lose nothing: a syntax error, an invalid object, a file
//! truncated to nothing and malformed endpoint addresses each leave every
//! valid Service working, with a log line naming the file and line and a
//! metric; `trace --manifests` refuses a broken file with a clear error.

use std::{
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddrV4},
    time::{Duration, Instant},
};

use dataplane_tests::{
    agent::{AgentProcess, HEALTH_PORT, METRICS_PORT, ManifestDir, ManifestEndpoint as Ep, service_yaml},
    cluster::Cluster,
    echo::{TcpClient, tcp_request},
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const NODE_PORT: u16 = 30080;
const TARGET: u16 = 8080;

/// The shared sandbox, with this file's helpers.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

impl Sandbox {
    fn new() -> Self {
        Self::with_args(&[])
    }

    /// Pod a on node1 serving TCP, the NodePort `web`, an agent on node1
    /// with `extra` flags.
    fn with_args(extra: &[&str]) -> Self {
        Self(
            dataplane_tests::sandbox::Sandbox::builder(Cluster::new())
                .pods(&[("a", 0)])
                .tcp_echo(TARGET)
                .manifest("web.yaml", web)
                .agents(1, |s, i| s.start_agent(BIN, i, extra)),
        )
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
        self.health("/healthz")
    }

    /// The status of `path` on the health port (0: no answer).
    fn health(&self, path: &str) -> u16 {
        let n = &self.cluster.nodes[0];
        AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), HEALTH_PORT), path).map_or(0, |(s, _)| s)
    }

    /// Retries `check` until it holds (the agent applies a stable change
    /// within a few 100 ms polls).
    fn eventually(&self, what: &str, check: impl Fn() -> bool) {
        dataplane_tests::eventually(what, check, || self.agents[0].log_text());
    }

    /// The problem was logged, counted, and every valid Service still works.
    fn refused(&self, what: &str, reason: &str, log_needle: &str) {
        let counter = format!("dataplane_skipped_objects_total{{reason=\"{reason}\"}} ");
        self.eventually(what, || {
            self.metrics()
                .lines()
                .any(|l| l.starts_with(&counter) && !l.ends_with(" 0"))
        });
        let log = self.agents[0].log_text();
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
    s.manifests().write("web.yaml", &format!("{good}---\na: [\n"));
    s.refused("syntax error", "syntax", &format!("web.yaml:{}:", good_lines + 2));

    // An object that does not deserialize (`port: eighty`).
    let eighty = good
        .replace("name: web", "name: web2")
        .replace("port: 80,", "port: eighty,");
    s.manifests().write("web.yaml", &format!("{good}---\n{eighty}"));
    s.refused("port: eighty", "invalid_object", "\"web2\"");

    // Truncated to nothing by a non-atomic writer.
    std::fs::write(s.manifests().path().join("web.yaml"), "").unwrap();
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
    s.manifests().write("eps.yaml", &bad_eps);
    let eps_port = SocketAddrV4::new(s.cluster.nodes[0].ip(), NODE_PORT + 1);
    s.eventually("the valid endpoint of the bad slice serves", || {
        s.serves(eps_port)
    });
    s.eventually("bad addresses are counted", || {
        s.metrics()
            .lines()
            .any(|l| l.starts_with("dataplane_sync_problems ") && l != "dataplane_sync_problems 0")
    });
    let log = s.agents[0].log_text();
    for needle in [
        "\"not-an-ip\"",
        "\"10.244.0.999\"",
        "IPv6 address in an IPv4 slice",
    ] {
        assert!(log.contains(needle), "{needle} not logged:\n{log}");
    }

    // Deleting the file is how its objects are removed.
    s.manifests().remove("web.yaml");
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
        .args(["trace", "--no-cache", "--manifests"])
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

/// `services` Services for another proxy (`service-proxy-name: other`):
/// parsed in full, nothing to program. The last document is a ConfigMap
/// named `end-of-large`, reported (a log line) once the file is parsed.
fn large_manifest(services: usize) -> String {
    let mut y = String::with_capacity(services * 256);
    for i in 0..services {
        y.push_str(&format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: other-{i}\n  namespace: default\n  labels: {{service.kubernetes.io/service-proxy-name: other}}\nspec:\n  clusterIP: 10.96.{}.{}\n  ports: [{{name: p, port: 80, protocol: TCP}}, {{name: q, port: 443, protocol: TCP}}]\n---\n",
            (i >> 8) & 255,
            i & 255,
        ));
    }
    y.push_str("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: end-of-large, namespace: default}\n");
    y
}

/// The agent's pid: our child whose command line names its pin directory.
fn agent_pid(agent: &AgentProcess) -> i32 {
    let me = std::process::id().to_string();
    let pins = agent.pin_dir.display().to_string();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
        let ppid = stat.rsplit(')').next().and_then(|r| r.split_whitespace().nth(1));
        let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if ppid == Some(me.as_str())
            && args
                .windows(2)
                .any(|w| w[0] == b"--bpffs-dir" && w[1] == pins.as_bytes())
        {
            return pid;
        }
    }
    panic!("no agent process with --bpffs-dir {pins}");
}

/// A large manifest file is parsed off the control loop: while the agent
/// parses one (about 50 MB, renamed into place), its syncs go on, so
/// `/healthz` and `/livez` keep answering 200 (they fail after two sync
/// periods without a sync, here 2 s), and SIGTERM ends it at once instead
/// of after the parse.
#[test]
fn the_loop_keeps_syncing_and_stops_on_sigterm_while_a_large_manifest_is_parsed() {
    let mut s = Sandbox::with_args(&["--sync-period-seconds", "1"]);
    let large = large_manifest(200_000);
    let size = large.len();
    s.manifests().write("large.yaml", &large);
    let renamed = Instant::now();
    drop(large);

    // Three sync periods and more: every answer 200.
    let mut answers = Vec::new();
    while renamed.elapsed() < Duration::from_secs(4) {
        for path in ["/healthz", "/livez"] {
            let asked = Instant::now();
            let status = s.health(path);
            answers.push((path, asked - renamed, status, asked.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // The test's premise: the parse is still going on.
    let parsed = s.agents[0].log_text().contains("end-of-large");

    let pid = agent_pid(&s.agents[0]);
    let sent = Instant::now();
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let exited = s.agents[0].wait_exit(Duration::from_secs(5));
    let took = sent.elapsed();
    let slowest = answers.iter().map(|a| a.3).max().unwrap_or_default();
    eprintln!(
        "{} MB file: SIGTERM -> exit {took:?} ({exited:?}); {} health answers, slowest {slowest:?}",
        size >> 20,
        answers.len()
    );
    assert!(
        !parsed,
        "the {} MB file was parsed within 4 s: too small to test anything here",
        size >> 20
    );
    let bad: Vec<_> = answers.iter().filter(|a| a.2 != 200).collect();
    assert!(
        bad.is_empty(),
        "health answers other than 200 during the parse (path, since the rename, status, latency): {bad:?}\n{}",
        s.agents[0].log_text()
    );
    assert!(
        exited.is_some(),
        "SIGTERM during the parse of a large manifest: still running after 5 s\n{}",
        s.agents[0].log_text()
    );
}
