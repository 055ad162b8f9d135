//! North-south end to end: an external client reaches Services through the
//! XDP/TC datapath on the sandbox's nodes, with real TCP connections and UDP
//! request/response.

use std::{
    collections::BTreeMap,
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddrV4},
    time::{Duration, Instant},
};

use dataplane_agent::net::Protocol;
use dataplane_common::stats::Event;
use dataplane_tests::{
    cluster::Cluster,
    echo::{EchoServer, TcpClient, tcp_request, udp_request},
    services::{EXTERNAL_VIP_RANGE, NodeDatapath, TestEndpoint, TestService},
};

const BACKEND_TCP: u16 = 8080;
const BACKEND_UDP: u16 = 5353;
const NODE_PORT: u16 = 30080;
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 20);

/// Two pods ("a" on node1, "b" on node2) with TCP and UDP echo servers, the
/// datapath on both nodes, the client routing the VIP range via node1.
struct Sandbox {
    _servers: Vec<EchoServer>,
    nodes: Vec<NodeDatapath>,
    cluster: Cluster,
}

impl Sandbox {
    fn new() -> Self {
        Self::with_pods(&[("a", 0), ("b", 1)])
    }

    fn with_pods(pods: &[(&str, usize)]) -> Self {
        let mut cluster = Cluster::new();
        for (name, node) in pods {
            cluster.add_pod(*node, name);
        }
        let mut servers = Vec::new();
        for p in &cluster.pods {
            servers.push(EchoServer::tcp(
                &p.ns,
                &p.name,
                SocketAddrV4::new(p.ip, BACKEND_TCP),
            ));
            servers.push(EchoServer::udp(
                &p.ns,
                &p.name,
                SocketAddrV4::new(p.ip, BACKEND_UDP),
            ));
        }
        let nodes = (0..2).map(|i| cluster.start_datapath(i)).collect();
        cluster.route_from_client(EXTERNAL_VIP_RANGE, 0);
        Self {
            _servers: servers,
            nodes,
            cluster,
        }
    }

    fn ep(&self, pod: &str, port: u16) -> TestEndpoint {
        let p = self.cluster.pod(pod);
        TestEndpoint::ready(p.ip, port, p.node)
    }

    fn program_all(&mut self, services: &[&TestService]) {
        for n in &mut self.nodes {
            n.program(services);
        }
    }

    fn node_ip(&self, i: usize) -> Ipv4Addr {
        self.cluster.nodes[i].ip()
    }

    /// Every non-zero counter of both nodes, for failure messages.
    fn report(&self) -> String {
        let mut out = String::new();
        for (i, n) in self.nodes.iter().enumerate() {
            for (e, c) in n.datapath.maps().counters().unwrap() {
                if c.packets > 0 {
                    out.push_str(&format!("node{} {}={} ", i + 1, e.name(), c.packets));
                }
            }
        }
        out
    }

    fn counter(&self, node: usize, e: Event) -> u64 {
        self.nodes[node].datapath.maps().counter(e).unwrap().packets
    }
}

fn tcp_service(s: &Sandbox, id: u32, pods: &[&str]) -> TestService {
    pods.iter()
        .fold(TestService::new(id, "web", Protocol::Tcp, 80), |svc, p| {
            svc.endpoint(s.ep(p, BACKEND_TCP))
        })
}

#[test]
fn nodeport_cluster_policy_reaches_local_and_remote_backends_with_snat() {
    let mut s = Sandbox::new();
    let svc = tcp_service(&s, 1, &["a", "b"]).node_port(NODE_PORT);
    let udp = TestService::new(2, "dns", Protocol::Udp, 53)
        .node_port(NODE_PORT)
        .endpoint(s.ep("a", BACKEND_UDP))
        .endpoint(s.ep("b", BACKEND_UDP));
    s.program_all(&[&svc, &udp]);

    let dst = SocketAddrV4::new(s.node_ip(0), NODE_PORT);
    let mut seen = BTreeMap::new();
    for i in 0..40 {
        let r = tcp_request(&s.cluster.client.ns, dst, &format!("req{i}"))
            .unwrap_or_else(|e| panic!("TCP request {i} to NodePort {dst}: {e}; {}", s.report()));
        assert_eq!(
            *r.peer.ip(),
            s.node_ip(0),
            "eTP=Cluster: the backend sees node1 (SNAT)"
        );
        assert_eq!(r.payload, format!("req{i}"));
        *seen.entry(r.server).or_insert(0) += 1;
    }
    assert_eq!(
        seen.len(),
        2,
        "both the local and the remote backend served: {seen:?}"
    );

    let mut seen = BTreeMap::new();
    for i in 0..40 {
        let r = udp_request(&s.cluster.client.ns, dst, &format!("q{i}"))
            .unwrap_or_else(|e| panic!("UDP request {i} to NodePort {dst}: {e}"));
        assert_eq!(*r.peer.ip(), s.node_ip(0));
        *seen.entry(r.server).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 2, "UDP: both backends served: {seen:?}");
    assert!(s.counter(0, Event::NewFlow) >= 80);
    assert!(s.counter(0, Event::Reply) >= 80, "replies reverse-translated");
}

/// Asserts that a TCP connect to `dst` gets no answer (dropped), quickly.
fn assert_tcp_dropped(s: &Sandbox, dst: SocketAddrV4) {
    let err = tcp_request(&s.cluster.client.ns, dst, "x").expect_err("must not connect");
    assert_eq!(
        err.kind(),
        ErrorKind::TimedOut,
        "dropped, not refused: {err}; {}",
        s.report()
    );
}

#[test]
fn nodeport_local_policy_preserves_client_ip_and_drops_without_local_backend() {
    let mut s = Sandbox::new();
    // Only pod "a" (node1) backs the service.
    let svc = tcp_service(&s, 1, &["a"]).node_port(NODE_PORT).external_local();
    s.program_all(&[&svc]);

    for i in 0..10 {
        let r = tcp_request(
            &s.cluster.client.ns,
            SocketAddrV4::new(s.node_ip(0), NODE_PORT),
            "hi",
        )
        .unwrap_or_else(|e| panic!("request {i} to node1 (local backend): {e}; {}", s.report()));
        assert_eq!(r.server, "a");
        assert_eq!(
            *r.peer.ip(),
            s.cluster.client.ip,
            "eTP=Local: the backend sees the client's address"
        );
    }
    // node2 has no local endpoint: new connections are dropped there.
    assert_tcp_dropped(&s, SocketAddrV4::new(s.node_ip(1), NODE_PORT));
    assert!(s.counter(1, Event::DropNoLocalEndpoint) >= 1, "{}", s.report());
}

#[test]
fn load_balancer_ip_and_external_ip_are_served() {
    let mut s = Sandbox::new();
    let svc = tcp_service(&s, 1, &["a", "b"])
        .load_balancer_ip(LB_IP)
        .external_ip(EXTERNAL_IP);
    s.program_all(&[&svc]);
    for dst in [SocketAddrV4::new(LB_IP, 80), SocketAddrV4::new(EXTERNAL_IP, 80)] {
        for i in 0..6 {
            let r = tcp_request(&s.cluster.client.ns, dst, "hi")
                .unwrap_or_else(|e| panic!("request {i} to {dst}: {e}; {}", s.report()));
            assert_eq!(*r.peer.ip(), s.node_ip(0), "eTP=Cluster masquerades to the node");
        }
    }
}

#[test]
fn load_balancer_ip_with_local_policy_keeps_the_client_address() {
    let mut s = Sandbox::new();
    let svc = tcp_service(&s, 1, &["a"])
        .load_balancer_ip(LB_IP)
        .external_local();
    s.program_all(&[&svc]);
    let r = tcp_request(&s.cluster.client.ns, SocketAddrV4::new(LB_IP, 80), "hi").expect("LB IP, eTP=Local");
    assert_eq!((r.server.as_str(), *r.peer.ip()), ("a", s.cluster.client.ip));
}

#[test]
fn service_without_endpoints_is_rejected_with_icmp_at_once() {
    let mut s = Sandbox::new();
    let tcp = TestService::new(1, "empty", Protocol::Tcp, 80).node_port(NODE_PORT);
    let udp = TestService::new(2, "empty-dns", Protocol::Udp, 53).node_port(NODE_PORT);
    s.program_all(&[&tcp, &udp]);
    let dst = SocketAddrV4::new(s.node_ip(0), NODE_PORT);

    let started = Instant::now();
    let err = TcpClient::connect(&s.cluster.client.ns, dst).expect_err("no endpoints");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}; {}", s.report());
    // The client's kernel turns the ICMP error into ECONNREFUSED on the first
    // SYN; a drop would only show after the connect timeout.
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "rejected immediately, not timed out"
    );

    let err = udp_request(&s.cluster.client.ns, dst, "q").expect_err("no endpoints");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    assert!(s.counter(0, Event::RejectNoEndpoints) >= 2, "{}", s.report());
}

#[test]
fn source_ranges_drop_other_sources_on_the_lb_ip_only() {
    let mut s = Sandbox::new();
    // The client (198.18.0.100) is outside 203.0.113.0/24.
    let svc = tcp_service(&s, 1, &["a", "b"])
        .load_balancer_ip(LB_IP)
        .node_port(NODE_PORT)
        .source_range("203.0.113.0/24");
    s.program_all(&[&svc]);
    assert_tcp_dropped(&s, SocketAddrV4::new(LB_IP, 80));
    assert!(s.counter(0, Event::DropSourceRange) >= 1);
    // As in kube-proxy, the ranges guard the LB IPs, not the NodePort.
    tcp_request(
        &s.cluster.client.ns,
        SocketAddrV4::new(s.node_ip(0), NODE_PORT),
        "x",
    )
    .expect("NodePort is not subject to loadBalancerSourceRanges");

    // Once the client's network is allowed, the LB IP answers.
    let svc = svc.source_range("198.18.0.0/24");
    s.program_all(&[&svc]);
    tcp_request(&s.cluster.client.ns, SocketAddrV4::new(LB_IP, 80), "x").expect("client now in range");
}

#[test]
fn session_affinity_pins_a_client_to_one_backend() {
    let mut s = Sandbox::new();
    let svc = tcp_service(&s, 1, &["a", "b"])
        .node_port(NODE_PORT)
        .affinity(Duration::from_secs(10800));
    s.program_all(&[&svc]);
    let dst = SocketAddrV4::new(s.node_ip(0), NODE_PORT);
    let first = tcp_request(&s.cluster.client.ns, dst, "x").unwrap().server;
    for i in 0..20 {
        let r = tcp_request(&s.cluster.client.ns, dst, "x").unwrap();
        assert_eq!(
            r.server, first,
            "connection {i} went elsewhere despite ClientIP affinity"
        );
    }
}

#[test]
fn established_connection_survives_backend_set_changes() {
    let mut s = Sandbox::with_pods(&[("a", 0), ("b", 1), ("c", 1)]);
    let svc = tcp_service(&s, 1, &["a", "b"]).node_port(NODE_PORT);
    s.program_all(&[&svc]);
    let dst = SocketAddrV4::new(s.node_ip(0), NODE_PORT);
    let mut conn = TcpClient::connect(&s.cluster.client.ns, dst).unwrap();
    let backend = conn.request("hello").unwrap().server;

    // Scale: add c, then make the long connection's backend terminating
    // (it stays serving) while the other one remains ready.
    let grown = tcp_service(&s, 1, &["a", "b", "c"]).node_port(NODE_PORT);
    s.program_all(&[&grown]);
    assert_eq!(conn.request("after scale-up").unwrap().server, backend);

    let others: Vec<&str> = ["a", "b", "c"].into_iter().filter(|p| *p != backend).collect();
    let mut changed = tcp_service(&s, 1, &others).node_port(NODE_PORT);
    changed = changed.endpoint(s.ep(&backend, BACKEND_TCP).terminating());
    s.program_all(&[&changed]);
    for i in 0..5 {
        let r = conn
            .request(&format!("still here {i}"))
            .unwrap_or_else(|e| panic!("long connection broke after the change: {e}; {}", s.report()));
        assert_eq!(r.server, backend, "the established flow keeps its backend");
    }
    // New connections follow the new set: never the terminating backend
    // while ready ones exist.
    for _ in 0..20 {
        let r = tcp_request(&s.cluster.client.ns, dst, "new").unwrap();
        assert_ne!(r.server, backend, "a new flow went to the terminating endpoint");
    }
}

#[test]
fn cluster_ip_from_off_node_is_masqueraded_and_unknown_ports_rejected() {
    let mut s = Sandbox::new();
    let cluster_ip = Ipv4Addr::new(10, 96, 0, 10);
    s.cluster.route_from_client("10.96.0.0/16", 0);
    let svc = tcp_service(&s, 1, &["a", "b"]).cluster_ip(cluster_ip);
    s.program_all(&[&svc]);
    let r = tcp_request(&s.cluster.client.ns, SocketAddrV4::new(cluster_ip, 80), "x")
        .expect("ClusterIP from off-node");
    assert_eq!(
        *r.peer.ip(),
        s.node_ip(0),
        "a source outside the cluster CIDR is masqueraded"
    );

    let err =
        TcpClient::connect(&s.cluster.client.ns, SocketAddrV4::new(cluster_ip, 81)).expect_err("port 81");
    assert_eq!(
        err.kind(),
        ErrorKind::ConnectionRefused,
        "unknown port on a ClusterIP: {err}"
    );
    assert!(s.counter(0, Event::RejectUnknownPort) >= 1);

    // An address in the service CIDR that no Service holds: dropped.
    let err = TcpClient::connect(
        &s.cluster.client.ns,
        SocketAddrV4::new(Ipv4Addr::new(10, 96, 9, 9), 80),
    )
    .expect_err("unallocated");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    assert!(s.counter(0, Event::DropUnallocatedServiceIp) >= 1);
}
