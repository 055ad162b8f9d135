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
    servers: Vec<EchoServer>,
    nodes: Vec<NodeDatapath>,
    cluster: Cluster,
}

impl Sandbox {
    fn new() -> Self {
        let mut cluster = Cluster::new();
        cluster.add_pod(0, "a");
        cluster.add_pod(1, "b");
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
            servers,
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
