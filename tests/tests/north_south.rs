//! North-south end to end: an external client reaches Services through the
//! XDP/TC datapath on the sandbox's nodes, with real TCP connections and UDP
//! request/response.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use dataplane_agent::{
    dataplane::{LoadOptions, XdpMode},
    net::Protocol,
};
use dataplane_common::stats::Event;
use dataplane_tests::{
    cluster::{Cluster, Wiring},
    echo::{TcpClient, UdpClient, tcp_request, udp_request},
    sctp::{SctpEcho, sctp_request},
    services::{EXTERNAL_VIP_RANGE, TestEndpoint, TestService},
};

const BACKEND_TCP: u16 = 8080;
const BACKEND_UDP: u16 = 5353;
const NODE_PORT: u16 = 30080;
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 20);

/// Two pods ("a" on node1, "b" on node2) with TCP and UDP echo servers, the
/// datapath on both nodes, the client routing the VIP range via node1.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

impl Sandbox {
    fn new() -> Self {
        Self::with_pods(&[("a", 0), ("b", 1)])
    }

    fn with_pods(pods: &[(&str, usize)]) -> Self {
        Self::wired(pods, Wiring::Wire, XdpMode::Auto)
    }

    /// Pods, servers and datapaths on a cluster wired as `wiring`, the
    /// ingress path attached as `mode` says.
    fn wired(pods: &[(&str, usize)], wiring: Wiring, mode: XdpMode) -> Self {
        let s = dataplane_tests::sandbox::Sandbox::builder(Cluster::with_wiring(wiring))
            .pods(pods)
            .tcp_echo(BACKEND_TCP)
            .udp_echo(BACKEND_UDP)
            .datapaths(|c, i| c.start_datapath_with(i, &small_maps(), mode));
        s.cluster.route_from_client(EXTERNAL_VIP_RANGE, 0);
        Self(s)
    }

    fn ep(&self, pod: &str, port: u16) -> TestEndpoint {
        let p = self.cluster.pod(pod);
        TestEndpoint::ready(p.ip, port, p.node)
    }

    fn program_all(&mut self, services: &[&TestService]) {
        for n in &mut self.datapaths {
            n.program(services);
        }
    }

    fn node_ip(&self, i: usize) -> Ipv4Addr {
        self.cluster.nodes[i].ip()
    }

    /// Every non-zero counter of both nodes, for failure messages.
    fn report(&self) -> String {
        let mut out = String::new();
        for (i, n) in self.datapaths.iter().enumerate() {
            for (e, c) in n.datapath.maps().counters().unwrap() {
                if c.packets > 0 {
                    out.push_str(&format!("node{} {}={} ", i + 1, e.name(), c.packets));
                }
            }
        }
        out
    }

    fn counter(&self, node: usize, e: Event) -> u64 {
        self.datapaths[node].datapath.maps().counter(e).unwrap().packets
    }
}

fn small_maps() -> LoadOptions {
    LoadOptions {
        max_services: 1024,
        max_backends: 1024,
        max_service_entries: 8192,
        ct_entries: 8192,
        affinity_entries: 1024,
        ipv6: true,
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
            r.peer.ip(),
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
    // Each request from a fresh socket, on a port the kernel picks at
    // random: two of the 40 share one in about 3% of runs, and a datagram
    // on a live flow's tuple is that flow's (as in netfilter), not new.
    let mut udp_ports = BTreeSet::new();
    for i in 0..40 {
        let client = UdpClient::connect(&s.cluster.client.ns, dst)
            .unwrap_or_else(|e| panic!("UDP socket {i} to NodePort {dst}: {e}"));
        udp_ports.insert(client.local_addr().port());
        let r = client
            .request(&format!("q{i}"))
            .unwrap_or_else(|e| panic!("UDP request {i} to NodePort {dst}: {e}"));
        assert_eq!(r.peer.ip(), s.node_ip(0));
        *seen.entry(r.server).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 2, "UDP: both backends served: {seen:?}");
    let flows = 40 + udp_ports.len() as u64;
    let new_flows = s.counter(0, Event::NewFlow);
    assert!(
        new_flows >= flows,
        "{new_flows} new flows counted, {flows} opened (40 TCP, UDP from {} ports)",
        udp_ports.len()
    );
    assert!(s.counter(0, Event::Reply) >= 80, "replies reverse-translated");
}

#[test]
fn sctp_ports_are_translated_both_ways_with_crcs_a_receiver_accepts() {
    const BACKEND_SCTP: u16 = 9000;
    let mut s = Sandbox::new();
    let servers: Vec<SctpEcho> = ["a", "b"]
        .iter()
        .map(|p| {
            SctpEcho::start(
                &s.cluster.pod(p).ns,
                p,
                SocketAddrV4::new(s.cluster.pod(p).ip, BACKEND_SCTP),
            )
        })
        .collect();
    let cluster = TestService::new(1, "sctp", Protocol::Sctp, 7000)
        .node_port(NODE_PORT)
        .endpoint(s.ep("a", BACKEND_SCTP))
        .endpoint(s.ep("b", BACKEND_SCTP));
    let local = TestService::new(2, "sctp-local", Protocol::Sctp, 7000)
        .load_balancer_ip(LB_IP)
        .external_local()
        .endpoint(s.ep("a", BACKEND_SCTP));
    s.program_all(&[&cluster, &local]);
    let client = s.cluster.client.ip;

    // eTP=Cluster NodePort: DNAT and masquerade, both ports rewritten.
    let dst = SocketAddrV4::new(s.node_ip(0), NODE_PORT);
    let mut seen = BTreeMap::new();
    for i in 0..40u16 {
        let src = SocketAddrV4::new(client, 41000 + i);
        let a = sctp_request(&s.cluster.client.ns, src, dst, &format!("req{i}"))
            .unwrap_or_else(|e| panic!("SCTP request {i} to NodePort {dst}: {e}; {}", s.report()));
        assert_eq!(a.from, dst, "the answer comes from the NodePort");
        assert_eq!(
            a.reply.peer.ip(),
            s.node_ip(0),
            "eTP=Cluster: the backend sees node1"
        );
        assert_eq!(a.reply.payload, format!("req{i}"));
        *seen.entry(a.reply.server).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 2, "local and remote backends served: {seen:?}");

    // eTP=Local LoadBalancer IP: DNAT only, the client's address and port kept.
    let dst = SocketAddrV4::new(LB_IP, 7000);
    for i in 0..10u16 {
        let src = SocketAddrV4::new(client, 42000 + i);
        let a = sctp_request(&s.cluster.client.ns, src, dst, "hi")
            .unwrap_or_else(|e| panic!("SCTP request {i} to {dst}: {e}; {}", s.report()));
        assert_eq!(
            (a.from, a.reply.server.as_str(), a.reply.peer),
            (dst, "a", src.into())
        );
    }
    for server in &servers {
        assert_eq!(
            server.bad_crc(),
            0,
            "packets to {} with a wrong CRC32c",
            server.addr
        );
    }
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
            r.peer.ip(),
            s.cluster.client.ip,
            "eTP=Local: the backend sees the client's address"
        );
    }
    // Forward packets of these unmasqueraded flows left node1 on the word
    // its TC ingress left them: no SNAT, so no egress lookup.
    let passed = s.counter(0, Event::PassByIngress);
    assert!(passed >= 10, "{}", s.report());
    // Trusting no device's word (what the agent writes while external
    // devices' programs change, and for devices stacked with another hook),
    // egress looks again: the same flows, no fewer served.
    s.datapaths[0]
        .datapath
        .maps_mut()
        .set_hint_devices(&Default::default())
        .unwrap();
    for i in 0..5 {
        let r = tcp_request(
            &s.cluster.client.ns,
            SocketAddrV4::new(s.node_ip(0), NODE_PORT),
            "hi",
        )
        .unwrap_or_else(|e| panic!("request {i} without external words: {e}; {}", s.report()));
        assert_eq!(r.peer.ip(), s.cluster.client.ip);
    }
    assert_eq!(s.counter(0, Event::PassByIngress), passed, "{}", s.report());
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
            assert_eq!(r.peer.ip(), s.node_ip(0), "eTP=Cluster masquerades to the node");
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
    assert_eq!(
        (r.server.as_str(), r.peer.ip()),
        ("a", s.cluster.client.ip.into())
    );
}

#[test]
fn service_without_endpoints_is_rejected_with_icmp_at_once() {
    let mut s = Sandbox::new();
    let tcp = TestService::new(1, "empty", Protocol::Tcp, 80).node_port(NODE_PORT);
    let udp = TestService::new(2, "empty-dns", Protocol::Udp, 53).node_port(NODE_PORT);
    s.program_all(&[&tcp, &udp]);
    let dst = SocketAddrV4::new(s.node_ip(0), NODE_PORT);

    // The client's kernel turns the ICMP error into ECONNREFUSED on the first
    // SYN; a drop would show as a timeout instead.
    let err = TcpClient::connect(&s.cluster.client.ns, dst).expect_err("no endpoints");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}; {}", s.report());

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
        r.peer.ip(),
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

/// Every north-south verdict through `s` (pods "a" on node1, "b" on node2):
/// NodePort eTP=Cluster to the local and the remote backend (SNAT), TCP
/// and UDP; an eTP=Local LoadBalancer IP keeping the client address;
/// rejects without endpoints (ICMP sent back out of the node's device) and
/// for a ClusterIP's unknown port; a drop without local endpoint.
fn every_verdict(mut s: Sandbox) {
    let np = tcp_service(&s, 1, &["a", "b"]).node_port(NODE_PORT);
    let dns = TestService::new(2, "dns", Protocol::Udp, 53)
        .node_port(NODE_PORT)
        .endpoint(s.ep("a", BACKEND_UDP))
        .endpoint(s.ep("b", BACKEND_UDP));
    let lb = tcp_service(&s, 3, &["a"])
        .load_balancer_ip(LB_IP)
        .external_local();
    let empty = TestService::new(4, "empty", Protocol::Tcp, 80).node_port(NODE_PORT + 1);
    let empty_udp = TestService::new(5, "empty-dns", Protocol::Udp, 53).node_port(NODE_PORT + 1);
    let local_none = tcp_service(&s, 6, &["b"])
        .node_port(NODE_PORT + 2)
        .external_local();
    let cip = tcp_service(&s, 7, &["b"]).cluster_ip(Ipv4Addr::new(10, 96, 0, 10));
    s.program_all(&[&np, &dns, &lb, &empty, &empty_udp, &local_none, &cip]);
    s.cluster.route_from_client("10.96.0.0/16", 0);
    let client = &s.cluster.client.ns;
    let node = |port| SocketAddrV4::new(s.node_ip(0), port);

    let mut seen = BTreeMap::new();
    for i in 0..30 {
        let r = tcp_request(client, node(NODE_PORT), &format!("t{i}"))
            .unwrap_or_else(|e| panic!("NodePort TCP {i}: {e}; {}", s.report()));
        assert_eq!(r.peer.ip(), s.node_ip(0), "masqueraded");
        *seen.entry(r.server).or_insert(0) += 1;
        let r = udp_request(client, node(NODE_PORT), &format!("u{i}"))
            .unwrap_or_else(|e| panic!("NodePort UDP {i}: {e}; {}", s.report()));
        assert_eq!(r.peer.ip(), s.node_ip(0), "masqueraded");
    }
    assert_eq!(seen.len(), 2, "the local and the remote backend: {seen:?}");
    let r = tcp_request(client, SocketAddrV4::new(LB_IP, 80), "lb").expect("eTP=Local LB IP");
    assert_eq!(
        (r.server.as_str(), r.peer.ip()),
        ("a", s.cluster.client.ip.into())
    );

    // Refused by the ICMP errors the node sent back (a drop would be a
    // timeout), and counted as rejects.
    let err = TcpClient::connect(client, node(NODE_PORT + 1)).expect_err("no endpoints");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}; {}", s.report());
    let err = udp_request(client, node(NODE_PORT + 1), "q").expect_err("no endpoints");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}; {}", s.report());
    let err = TcpClient::connect(client, SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 81))
        .expect_err("unknown port");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}; {}", s.report());
    assert!(s.counter(0, Event::RejectNoEndpoints) >= 2, "{}", s.report());
    assert!(s.counter(0, Event::RejectUnknownPort) >= 1, "{}", s.report());
    assert_eq!(s.counter(0, Event::DropRejectFailed), 0, "{}", s.report());

    assert_tcp_dropped(&s, node(NODE_PORT + 2));
    assert!(s.counter(0, Event::DropNoLocalEndpoint) >= 1, "{}", s.report());
}

/// kind, k3d and containerlab nodes: the node's device is a veth whose peer
/// runs no XDP program and whose skbs carry partial checksums. `auto` runs
/// the ingress path in TC there, which sends rejects back as skbs.
#[test]
fn veth_nodes_without_xdp_on_the_peer_get_every_verdict() {
    let s = Sandbox::wired(&[("a", 0), ("b", 1)], Wiring::VethNode, XdpMode::Auto);
    every_verdict(s);
}

/// Nodes on a wire, with the ingress path in native XDP.
#[test]
fn native_xdp_gets_every_verdict() {
    let s = Sandbox::wired(&[("a", 0), ("b", 1)], Wiring::Wire, XdpMode::Native);
    assert_eq!(
        s.datapaths[0]
            .datapath
            .maps()
            .received(dataplane_common::stats::Hook::TcIngress)
            .unwrap()
            .packets,
        0
    );
    every_verdict(s);
}
