//! `dataplane-agent monitor` end to end: a running agent's datapath drops
//! and rejects real packets from the sandbox's client, and `monitor`
//! (another process, reading the pinned ring buffer in the node's network
//! namespace) shows each with its reason, hook, device, addresses and
//! Service; filters leave the others out; a flood of drops is cut to the
//! kernel's rate, the rest counted as lost, and the agent keeps answering.

use std::{
    io::{BufRead, BufReader},
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    process::{Child, Stdio},
    sync::mpsc,
    time::Duration,
};

use dataplane_tests::{
    agent::{AgentProcess, HEALTH_PORT, ManifestEndpoint as Ep, service_yaml},
    cluster::{CLIENT_IP, Cluster},
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 21);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 30);
const LOCAL_NONE: u16 = 30082;
const EMPTY: u16 = 30081;
const OPEN: u16 = 30083;

/// UDP Services on node1 (agent there only), pod b on node2:
/// - `local-none`: NodePort 30082, eTP=Local, its one endpoint on node2;
/// - `empty`: NodePort 30081, no endpoints;
/// - `ranged`: LoadBalancer 198.19.0.30 open to 203.0.113.0/24 only;
/// - `open`: NodePort 30083, eTP=Cluster, its one endpoint on node2 (the
///   packets node1 translates).
fn services(c: &Cluster) -> String {
    let b = c.pod("b");
    let eps = [Ep::ready(b.ip, &c.nodes[1].name)];
    let udp = |y: String| y.replace("protocol: TCP", "protocol: UDP");
    let local_none = udp(service_yaml(
        "local-none",
        &format!("  type: NodePort\n  clusterIP: {CLUSTER_IP}\n  externalTrafficPolicy: Local\n"),
        53,
        Some(LOCAL_NONE),
        5353,
        &eps,
    ));
    let empty = udp(service_yaml(
        "empty",
        "  type: NodePort\n  clusterIP: 10.96.0.22\n",
        53,
        Some(EMPTY),
        5353,
        &[],
    ));
    let ranged = udp(service_yaml(
        "ranged",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.23\n  loadBalancerSourceRanges: [203.0.113.0/24]\n",
        53,
        None,
        5353,
        &eps,
    ))
    .replacen(
        "\n---\n",
        &format!("\nstatus:\n  loadBalancer:\n    ingress: [{{ip: {LB_IP}}}]\n---\n"),
        1,
    );
    let open = udp(service_yaml(
        "open",
        "  type: NodePort\n  clusterIP: 10.96.0.24\n",
        53,
        Some(OPEN),
        5353,
        &eps,
    ));
    format!("{local_none}---\n{empty}---\n{ranged}---\n{open}")
}

/// node1's agent with [`services`], pod b on node2.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

impl Sandbox {
    fn new() -> Self {
        let s = Self(
            dataplane_tests::sandbox::Sandbox::builder(Cluster::new())
                .pods(&[("b", 1)])
                .manifest("services.yaml", services)
                .route_from_client("198.19.0.0/24", 0)
                .route_from_client("10.96.0.0/16", 0)
                .agents(1, |s, i| s.start_agent(BIN, i, &[])),
        );
        s.wait_programmed();
        s
    }

    /// Until the agent programmed the three Services' external frontends.
    fn wait_programmed(&self) {
        let wanted = [
            self.node_port(LOCAL_NONE).to_string(),
            self.node_port(EMPTY).to_string(),
            self.node_port(OPEN).to_string(),
            format!("{LB_IP}:53"),
        ];
        let inspect = || {
            let out = std::process::Command::new(BIN)
                .args(["inspect", "--bpffs-dir", &self.pins(), "-o", "json", "services"])
                .output()
                .expect("run inspect");
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        };
        dataplane_tests::poll_until(
            Duration::from_secs(20),
            Duration::from_millis(100),
            "the agent programs the Services",
            || {
                let (ok, text) = inspect();
                ok && wanted.iter().all(|w| text.contains(&format!("\"{w}/UDP\"")))
            },
            || format!("{}\n{}", inspect().1, self.agents[0].log_text()),
        );
    }

    fn pins(&self) -> String {
        self.cluster
            .bpffs
            .path()
            .join(&self.cluster.nodes[0].name)
            .display()
            .to_string()
    }

    /// `monitor -o json` in node1's namespace with `args`, once the kernel
    /// writes its events.
    fn monitor(&self, args: &[&str]) -> Monitor {
        let pins = self.pins();
        let mut child = self.cluster.nodes[0]
            .ns()
            .command(BIN)
            .args(["monitor", "--bpffs-dir", &pins, "-o", "json"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start monitor");
        let (tx, rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut said = Vec::new();
        loop {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(line) if line.starts_with("following the events") => break,
                Ok(line) => said.push(line),
                Err(_) => {
                    let _ = child.kill();
                    panic!("monitor did not start: {said:?}\n{}", self.agents[0].log_text());
                }
            }
        }
        Monitor { child, stderr: rx }
    }

    /// `n` datagrams from the client, each from a port of its own.
    fn send(&self, dst: SocketAddrV4, n: usize) {
        self.cluster.client.ns.run(|| {
            for _ in 0..n {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                s.send_to(b"x", dst).unwrap();
            }
        });
    }

    /// `n` datagrams from one client socket; its address.
    fn send_from_one(&self, dst: SocketAddrV4, n: usize) -> SocketAddrV4 {
        self.cluster.client.ns.run(|| {
            // Unconnected: the endpoint's port unreachable does not fail
            // the next send.
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            for _ in 0..n {
                s.send_to(b"x", dst).unwrap();
            }
            SocketAddrV4::new(
                dataplane_tests::cluster::CLIENT_IP,
                s.local_addr().unwrap().port(),
            )
        })
    }

    /// Packets node1's datapath counted under `event` (every hook).
    fn dropped(&self, event: &str) -> u64 {
        let out = std::process::Command::new(BIN)
            .args(["inspect", "--bpffs-dir", &self.pins(), "-o", "json", "stats"])
            .output()
            .expect("run inspect");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["event"] == event)
            .map(|e| e["packets"].as_u64().unwrap())
            .sum()
    }

    fn node_port(&self, port: u16) -> SocketAddrV4 {
        SocketAddrV4::new(self.cluster.nodes[0].ip(), port)
    }
}

struct Monitor {
    child: Child,
    stderr: mpsc::Receiver<String>,
}

impl Monitor {
    /// Its JSON lines (it stops by itself: `--count` or `--seconds`), and
    /// its last words.
    fn lines(mut self) -> (Vec<Value>, String) {
        let out = self.child.stdout.take().unwrap();
        let lines = BufReader::new(out)
            .lines()
            .map(|l| serde_json::from_str(&l.unwrap()).expect("a JSON line"))
            .collect();
        let status = self.child.wait().unwrap();
        // Until its stderr ends: the last words are there.
        let said: Vec<String> = self.stderr.iter().collect();
        assert!(status.success(), "monitor failed: {said:?}");
        (lines, said.join("\n"))
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn events(lines: &[Value]) -> Vec<&Value> {
    lines.iter().filter(|l| l["type"] != "lost").collect()
}

#[test]
fn each_drop_and_reject_shows_up_with_its_reason_addresses_and_service() {
    let s = Sandbox::new();
    let m = s.monitor(&["--count", "4", "--seconds", "30"]);
    let client = s.cluster.client.ip;
    let cases = [
        (
            s.node_port(LOCAL_NONE),
            "drop",
            "drop_no_local_endpoint",
            Some("default/local-none:p"),
        ),
        (
            s.node_port(EMPTY),
            "reject",
            "reject_no_endpoints",
            Some("default/empty:p"),
        ),
        (
            SocketAddrV4::new(LB_IP, 53),
            "drop",
            "drop_source_range",
            Some("default/ranged:p"),
        ),
        // A ClusterIP on a port it does not serve: no Service port to name.
        (
            SocketAddrV4::new(CLUSTER_IP, 54),
            "reject",
            "reject_unknown_port",
            None,
        ),
    ];
    for (dst, ..) in &cases {
        s.send(*dst, 1);
    }
    let (lines, said) = m.lines();
    let events = events(&lines);
    assert_eq!(events.len(), 4, "{lines:?}\n{said}");
    for (dst, kind, reason, service) in cases {
        let e = events
            .iter()
            .find(|e| e["destination"] == dst.to_string())
            .unwrap_or_else(|| panic!("no event for {dst}: {lines:?}"));
        assert_eq!(e["type"], kind, "{e}");
        assert_eq!(e["reason"], reason, "{e}");
        assert_eq!(e["proto"], "UDP", "{e}");
        assert_eq!(
            e["hook"], "tc_ingress",
            "the sandbox's veth runs the TC path: {e}"
        );
        assert_eq!(e["device"], "eth0", "{e}");
        let source: SocketAddrV4 = e["source"].as_str().unwrap().parse().unwrap();
        assert_eq!(*source.ip(), client, "{e}");
        assert_eq!(e["service"].as_str(), service, "{e}");
        assert!(e["length"].as_u64().unwrap() >= 28, "{e}");
        assert!(e["time"].as_str().unwrap().ends_with('Z'), "{e}");
    }
    assert!(said.contains("4 events shown, 0 lost"), "{said}");
}

#[test]
fn filters_leave_other_events_out() {
    let s = Sandbox::new();
    let only = |args: &[&str]| {
        let m = s.monitor(&[args, &["--seconds", "3"]].concat());
        s.send(s.node_port(LOCAL_NONE), 2);
        s.send(s.node_port(EMPTY), 3);
        s.send(SocketAddrV4::new(LB_IP, 53), 1);
        let (lines, said) = m.lines();
        let reasons: Vec<String> = events(&lines)
            .iter()
            .map(|e| e["reason"].as_str().unwrap().to_owned())
            .collect();
        (reasons, said)
    };
    let (r, said) = only(&["--type", "reject"]);
    assert_eq!(r, vec!["reject_no_endpoints"; 3], "{said}");
    let (r, said) = only(&["--service", "default/local-none"]);
    assert_eq!(r, vec!["drop_no_local_endpoint"; 2], "{said}");
    let (r, said) = only(&["--address", &LB_IP.to_string()]);
    assert_eq!(r, vec!["drop_source_range"], "{said}");
    let (r, said) = only(&["--port", &EMPTY.to_string(), "--proto", "udp"]);
    assert_eq!(r.len(), 3, "{said}");
    let (r, said) = only(&["--proto", "tcp"]);
    assert!(r.is_empty(), "{r:?} {said}");
    // A bad filter is a clear error.
    let out = s.cluster.nodes[0]
        .ns()
        .command(BIN)
        .args(["monitor", "--bpffs-dir", &s.pins(), "--service", "web"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("expected NAMESPACE/NAME"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_flood_of_drops_is_cut_to_the_rate_and_the_rest_counted() {
    const FLOOD: usize = 5000;
    const RATE: u64 = 50;
    let s = Sandbox::new();
    let m = s.monitor(&["--rate", &RATE.to_string(), "--seconds", "4"]);
    let before = s.dropped("drop_no_local_endpoint");
    s.send(s.node_port(LOCAL_NONE), FLOOD);
    // The agent is not in the way of the events and keeps answering.
    let n = &s.cluster.nodes[0];
    let (status, _) = AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), HEALTH_PORT), "/healthz")
        .expect("/healthz during the flood");
    assert_eq!(status, 200);
    let (lines, said) = m.lines();
    let shown = events(&lines).len() as u64;
    let lost: u64 = lines
        .iter()
        .filter(|l| l["type"] == "lost")
        .map(|l| l["count"].as_u64().unwrap())
        .sum();
    // At most a bucket's worth a second per CPU over 4 s (and the first
    // full bucket), every other drop counted as lost.
    let dropped = s.dropped("drop_no_local_endpoint") - before;
    let cpus = std::thread::available_parallelism().unwrap().get() as u64;
    assert!(
        dropped > FLOOD as u64 / 2,
        "the flood reached the datapath: {dropped}"
    );
    assert!(shown > 0, "{said}");
    assert!(
        shown <= RATE * cpus * 5,
        "{shown} shown at {RATE}/s per CPU: {said}"
    );
    assert_eq!(shown + lost, dropped, "every drop shown or counted: {said}");
    assert!(
        said.contains(&format!("{shown} events shown, {lost} lost")),
        "{said}"
    );
}

/// The ring buffer is pinned: a `monitor` started before an agent's
/// `kill -9` and restart shows the drops after it, without a restart of
/// its own.
#[test]
fn a_monitor_keeps_following_across_an_agent_restart() {
    let mut s = Sandbox::new();
    let m = s.monitor(&["--count", "2", "--seconds", "60"]);
    s.send(s.node_port(LOCAL_NONE), 1);
    s.restart_agent(0);
    s.wait_programmed();
    s.send(s.node_port(EMPTY), 1);
    let (lines, said) = m.lines();
    let reasons: Vec<&str> = events(&lines)
        .iter()
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert_eq!(
        reasons,
        ["drop_no_local_endpoint", "reject_no_endpoints"],
        "{said}\n{}",
        s.agents[0].log_text()
    );
}

/// `--type trace`: every translated packet (`--sample 1`) shows up with
/// its addresses as node1 received it and as it left the hook, the
/// Service and the event (a new flow, then the flow's next packets);
/// drops are not in that stream; a sample of one in 2^32 shows nothing;
/// and a reader killed without releasing its lease stops the kernel's
/// sampling once the lease runs out.
#[test]
fn trace_events_show_translated_packets_before_and_after() {
    let s = Sandbox::new();
    let b = s.cluster.pod("b").ip;
    let frontend = s.node_port(OPEN);
    let m = s.monitor(&["--type", "trace", "--seconds", "3"]);
    let client = s.send_from_one(frontend, 3);
    s.send(s.node_port(EMPTY), 2);
    let (lines, said) = m.lines();
    // The endpoint answers each datagram with a port unreachable, which
    // node1 translates back too (`icmp_error_translated`): the UDP
    // packets' events are looked at here.
    let udp = |egress: bool| -> Vec<&Value> {
        events(&lines)
            .into_iter()
            .filter(|e| e["proto"] == "UDP" && (e["hook"] == "tc_egress") == egress)
            .collect()
    };
    let ingress = udp(false);
    let reasons: Vec<&str> = ingress.iter().map(|e| e["reason"].as_str().unwrap()).collect();
    assert_eq!(
        reasons,
        ["new_flow", "established", "established"],
        "{lines:?} {said}"
    );
    for e in &ingress {
        assert_eq!(e["type"], "trace", "{e}");
        assert_eq!(e["source"], client.to_string(), "{e}");
        assert_eq!(e["destination"], frontend.to_string(), "{e}");
        assert_eq!(e["after"]["destination"], format!("{b}:5353"), "{e}");
        assert_eq!(e["service"], "default/open:p", "{e}");
    }
    // The same flow leaving towards node2: masqueraded (eTP=Cluster).
    let egress = udp(true);
    assert_eq!(egress.len(), 3, "{lines:?} {said}");
    for e in &egress {
        assert_eq!(e["source"], client.to_string(), "{e}");
        assert_eq!(e["destination"], format!("{b}:5353"), "{e}");
        let after_src = e["after"]["source"].as_str().unwrap();
        assert!(
            after_src.starts_with(&format!("{}:", s.cluster.nodes[0].ip())),
            "masqueraded to node1's address: {e}"
        );
    }

    // The endpoint's port unreachable, back to the client through node1:
    // at ingress to the client (and the quote restored), at egress from
    // the frontend's address, as netfilter's NAT sends it: the client
    // never sees the pod's address.
    let icmp: Vec<&Value> = events(&lines)
        .into_iter()
        .filter(|e| e["reason"] == "icmp_error_translated")
        .collect();
    let leaving: Vec<&Value> = icmp
        .iter()
        .copied()
        .filter(|e| e["hook"] == "tc_egress")
        .collect();
    assert!(!leaving.is_empty(), "{icmp:?}");
    for e in &leaving {
        assert_eq!(e["source"], b.to_string(), "{e}");
        assert_eq!(e["after"]["source"], s.cluster.nodes[0].ip().to_string(), "{e}");
        assert_eq!(e["after"]["destination"], CLIENT_IP.to_string(), "{e}");
    }

    // One packet in 2^32 - 1: nothing in 20.
    let m = s.monitor(&[
        "--type",
        "trace",
        "--sample",
        &u32::MAX.to_string(),
        "--seconds",
        "2",
    ]);
    s.send(frontend, 20);
    let (lines, said) = m.lines();
    assert!(events(&lines).is_empty(), "{lines:?} {said}");

    // A reader killed with its lease held: once the lease has run out, the
    // first packet makes the kernel stop sampling.
    let mut m = s.monitor(&["--type", "trace"]);
    // SAFETY: a signal to our own child.
    assert_eq!(unsafe { libc::kill(m.child.id() as i32, libc::SIGKILL) }, 0);
    let _ = m.child.wait();
    let ctl = || -> dataplane_common::monitor::MonitorCtl {
        let data = aya::maps::MapData::from_pin(
            s.cluster
                .bpffs
                .path()
                .join(&s.cluster.nodes[0].name)
                .join("maps")
                .join(dataplane_common::names::MONITOR_CTL),
        )
        .expect("the pinned control");
        let map = aya::maps::Array::try_from(aya::maps::Map::Array(data)).unwrap();
        map.get(&0, 0).unwrap()
    };
    assert_eq!(ctl().sample, 1, "the killed reader's request is still there");
    // A packet every 100 ms until the kernel, the lease run out, stops.
    dataplane_tests::poll_until(
        Duration::from_nanos(dataplane_common::monitor::LEASE_NS) + Duration::from_secs(10),
        Duration::from_millis(100),
        "the kernel stops sampling for a reader long gone",
        || {
            ctl().sample == 0 || {
                s.send(frontend, 1);
                false
            }
        },
        || format!("sample {}", ctl().sample),
    );
}
