//! East-west end to end: pods reach Services (ClusterIP, NodePort of any
//! node, LB IPs) through `tc_pod_ingress` on their host interface, with
//! kube-proxy's semantics: iTP=Local, the eTP=Local short-circuit, hairpin,
//! rejects, and UDP flows that move with their backend.

use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddrV4},
};

use dataplane_agent::net::Protocol;
use dataplane_common::stats::Event;
use dataplane_tests::{
    cluster::Cluster,
    echo::{EchoServer, TcpClient, UdpClient, sockclient, tcp_request},
    services::{TestEndpoint, TestService},
};

const SOCKCLIENT: &str = env!("CARGO_BIN_EXE_sockclient");
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
const CIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);

/// Pods: "client" and "a" on node1, "b" and "c" on node2; TCP and UDP echo
/// servers on a, b, c (and on client, for hairpin).
/// The shared sandbox, with this file's helpers.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

impl Sandbox {
    /// Pods "client" and "a" on node1, "b" and "c" on node2 with TCP and
    /// UDP echo servers, the datapath on both nodes.
    fn new() -> Self {
        Self(
            dataplane_tests::sandbox::Sandbox::builder(Cluster::new())
                .pods(&[("client", 0), ("a", 0), ("b", 1), ("c", 1)])
                .tcp_echo(TCP_PORT)
                .udp_echo(UDP_PORT)
                .datapaths(|c, i| c.start_datapath(i)),
        )
    }

    fn ep(&self, pod: &str, port: u16) -> TestEndpoint {
        let p = self.cluster.pod(pod);
        TestEndpoint::ready(p.ip, port, p.node)
    }

    fn svc(&self, id: u32, pods: &[&str]) -> TestService {
        pods.iter().fold(
            TestService::new(id, "web", Protocol::Tcp, 80).cluster_ip(CIP),
            |s, p| s.endpoint(self.ep(p, TCP_PORT)),
        )
    }

    fn program(&mut self, services: &[&TestService]) {
        for n in &mut self.datapaths {
            n.program(services);
        }
    }

    fn request_from(
        &self,
        pod: &str,
        dst: SocketAddrV4,
    ) -> std::io::Result<dataplane_tests::echo::EchoReply> {
        tcp_request(&self.cluster.pod(pod).ns, dst, "x")
    }

    fn seen(&self, pod: &str, dst: SocketAddrV4, n: usize) -> BTreeSet<String> {
        (0..n)
            .map(|i| {
                self.request_from(pod, dst)
                    .unwrap_or_else(|e| panic!("request {i} from {pod} to {dst}: {e}; {}", self.report()))
                    .server
            })
            .collect()
    }

    /// Packets node `node`'s egress passed on the ingress hook's word,
    /// without a conntrack lookup.
    fn passed_by_ingress(&self, node: usize) -> u64 {
        self.datapaths[node]
            .datapath
            .maps()
            .counter(Event::PassByIngress)
            .unwrap()
            .packets
    }

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
}

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn pod_reaches_cluster_ip_with_local_and_remote_backends_without_snat() {
    let mut s = Sandbox::new();
    let svc = s.svc(1, &["a", "b"]);
    s.program(&[&svc]);
    let dst = SocketAddrV4::new(CIP, 80);
    let mut seen = BTreeSet::new();
    for i in 0..30 {
        let r = s
            .request_from("client", dst)
            .unwrap_or_else(|e| panic!("request {i}: {e}; {}", s.report()));
        assert_eq!(
            r.peer.ip(),
            s.cluster.pod("client").ip,
            "in-cluster source: no SNAT"
        );
        seen.insert(r.server);
    }
    assert_eq!(seen, set(&["a", "b"]), "local (a) and remote (b) backends");
    // The forward packets of these unmasqueraded flows left node1 (to a's
    // interface, or out to node2) on the word `tc_pod_ingress` left: no
    // SNAT to look for. a's replies reached the client through egress's
    // explicit lookup alone (the word says they were not un-SNATed), and
    // got their frontend back: the requests above would fail otherwise.
    assert!(s.passed_by_ingress(0) >= 30, "{}", s.report());
    // The pod sees the Service address it used.
    let c = TcpClient::connect(&s.cluster.pod("client").ns, dst).unwrap();
    drop(c);
}

#[test]
fn traffic_straight_to_backend_pods_is_untouched_and_spared_egress_lookups() {
    let mut s = Sandbox::new();
    // a and b back a Service, so egress's address filter cannot pass their
    // traffic on its own: the ingress hook's word does.
    let svc = s.svc(1, &["a", "b"]);
    s.program(&[&svc]);
    // A flow through the Service first: its entries must not capture the
    // direct traffic beside it.
    let r = s.request_from("client", SocketAddrV4::new(CIP, 80)).unwrap();
    assert_eq!(r.peer.ip(), s.cluster.pod("client").ip);
    let before = (s.passed_by_ingress(0), s.passed_by_ingress(1));
    for pod in ["a", "b"] {
        let dst = SocketAddrV4::new(s.cluster.pod(pod).ip, TCP_PORT);
        for i in 0..10 {
            let r = s
                .request_from("client", dst)
                .unwrap_or_else(|e| panic!("request {i} to {pod}: {e}; {}", s.report()));
            assert_eq!(r.server, pod);
            assert_eq!(r.peer.ip(), s.cluster.pod("client").ip, "untranslated");
        }
    }
    // Every request's forward packets: on node1 (to a, and out to node2
    // for b) and on node2 (from its external device to b).
    let after = (s.passed_by_ingress(0), s.passed_by_ingress(1));
    assert!(after.0 - before.0 >= 20, "{before:?} {after:?}; {}", s.report());
    assert!(after.1 - before.1 >= 10, "{before:?} {after:?}; {}", s.report());
}

#[test]
fn pod_reaches_node_ports_of_its_node_and_the_other_node() {
    let mut s = Sandbox::new();
    let svc = s.svc(1, &["a", "b"]).node_port(30080);
    s.program(&[&svc]);
    for node in 0..2 {
        let dst = SocketAddrV4::new(s.cluster.nodes[node].ip(), 30080);
        assert_eq!(
            s.seen("client", dst, 30),
            set(&["a", "b"]),
            "NodePort of node{}",
            node + 1
        );
    }
}

#[test]
fn pod_reaches_lb_ip_of_local_policy_service_without_local_backend() {
    let mut s = Sandbox::new();
    // Only b and c, both on node2; eTP=Local. The client pod is on node1.
    let svc = s.svc(1, &["b", "c"]).load_balancer_ip(LB_IP).external_local();
    s.program(&[&svc]);
    let seen = s.seen("client", SocketAddrV4::new(LB_IP, 80), 30);
    assert_eq!(seen, set(&["b", "c"]), "short-circuit to the cluster set");
}

#[test]
fn hairpin_a_pod_reaches_itself_through_its_service() {
    let mut s = Sandbox::new();
    let svc = s.svc(1, &["a"]);
    s.program(&[&svc]);
    let r = s
        .request_from("a", SocketAddrV4::new(CIP, 80))
        .unwrap_or_else(|e| panic!("hairpin: {e}; {}", s.report()));
    assert_eq!(r.server, "a");
    assert_eq!(
        r.peer.ip(),
        s.cluster.nodes[0].ip(),
        "hairpin is masqueraded to the node"
    );
}

#[test]
fn internal_traffic_policy_local_uses_local_endpoints_and_drops_without() {
    let mut s = Sandbox::new();
    let svc = s.svc(1, &["a", "b"]).internal_local();
    s.program(&[&svc]);
    assert_eq!(
        s.seen("client", SocketAddrV4::new(CIP, 80), 20),
        set(&["a"]),
        "node1's local endpoint only"
    );

    let svc = s.svc(1, &["b", "c"]).internal_local();
    s.program(&[&svc]);
    let err = s
        .request_from("client", SocketAddrV4::new(CIP, 80))
        .expect_err("no local endpoint");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "dropped: {err}");
    assert!(
        s.datapaths[0]
            .datapath
            .maps()
            .counter(Event::DropNoLocalEndpoint)
            .unwrap()
            .packets
            > 0
    );
}

#[test]
fn pod_gets_an_immediate_error_from_a_service_without_endpoints() {
    let mut s = Sandbox::new();
    let tcp = s.svc(1, &[]);
    let udp = TestService::new(2, "dns", Protocol::Udp, 53).cluster_ip(CIP);
    s.program(&[&tcp, &udp]);
    // Refused (the ICMP reject), not timed out (a drop): the error says it.
    let err = TcpClient::connect(&s.cluster.pod("client").ns, SocketAddrV4::new(CIP, 80))
        .expect_err("no endpoints");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}; {}", s.report());
    let err = UdpClient::connect(&s.cluster.pod("client").ns, SocketAddrV4::new(CIP, 53))
        .unwrap()
        .request("q")
        .expect_err("no endpoints");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
}

#[test]
fn udp_queries_follow_the_backend_when_it_moves() {
    let mut s = Sandbox::new();
    let dns = |s: &Sandbox, pod: &str| {
        TestService::new(2, "dns", Protocol::Udp, 53)
            .cluster_ip(CIP)
            .endpoint(s.ep(pod, UDP_PORT))
    };
    let first = dns(&s, "b");
    s.program(&[&first]);
    // One socket, as a resolver keeps: same 5-tuple for every query.
    let client = UdpClient::connect(&s.cluster.pod("client").ns, SocketAddrV4::new(CIP, 53)).unwrap();
    for i in 0..5 {
        assert_eq!(client.request(&format!("q{i}")).unwrap().server, "b");
    }
    // CoreDNS moves from b to c: b is gone from the slice.
    let moved = dns(&s, "c");
    s.program(&[&moved]);
    for i in 0..10 {
        let r = client
            .request(&format!("after {i}"))
            .unwrap_or_else(|e| panic!("query {i} after the move: {e}; {}", s.report()));
        assert_eq!(r.server, "c", "query {i} went to the old backend");
    }
}

/// Runs the `sockclient` helper as a host process of `node` (in its network
/// namespace and its cgroup): (peer its socket reports, reply) or the error.
fn host_client(s: &Sandbox, node: usize, mode: &str, dst: SocketAddrV4) -> Result<(String, String), String> {
    let n = &s.cluster.nodes[node];
    sockclient(SOCKCLIENT, &n.ns().path(), &n.cgroup.procs(), mode, dst)
}

#[test]
fn host_processes_reach_services_at_connect_time_and_see_the_service_address() {
    let mut s = Sandbox::new();
    let tcp = s.svc(1, &["a", "b"]);
    let udp = TestService::new(2, "dns", Protocol::Udp, 53)
        .cluster_ip(CIP)
        .endpoint(s.ep("a", UDP_PORT))
        .endpoint(s.ep("b", UDP_PORT));
    s.program(&[&tcp, &udp]);
    for (mode, port) in [("tcp", 80), ("udp-connected", 53), ("udp-unconnected", 53)] {
        let mut servers = BTreeSet::new();
        for i in 0..12 {
            let (peer, reply) = host_client(&s, 0, mode, SocketAddrV4::new(CIP, port))
                .unwrap_or_else(|e| panic!("{mode} {i}: {e}; {}", s.report()));
            assert_eq!(
                peer,
                format!("{CIP}:{port}"),
                "{mode}: the socket shows the Service address"
            );
            servers.insert(reply.split(' ').next().unwrap().to_owned());
        }
        assert_eq!(servers, set(&["a", "b"]), "{mode}: local and remote backends");
    }
    assert!(
        s.datapaths[0]
            .datapath
            .maps()
            .hook_counter(dataplane_common::stats::Hook::Socket, Event::NewFlow)
            .unwrap()
            .packets
            >= 36
    );

    // No endpoints: an immediate ECONNREFUSED, as the ICMP reject gives.
    let empty = TestService::new(3, "empty", Protocol::Tcp, 81).cluster_ip(CIP);
    s.program(&[&tcp, &udp, &empty]);
    let err = host_client(&s, 0, "tcp", SocketAddrV4::new(CIP, 81)).expect_err("no endpoints");
    assert_eq!(err, "ConnectionRefused");
}

#[test]
fn large_segments_whose_payload_is_not_linear_are_translated() {
    // Replies larger than the part of the skb TC can read directly: the
    // datapath must judge a packet by its full length, not the linear part.
    let mut s = Sandbox::new();
    let svc = s.svc(1, &["a", "b"]);
    s.program(&[&svc]);
    let mut c = TcpClient::connect(&s.cluster.pod("client").ns, SocketAddrV4::new(CIP, 80)).unwrap();
    for size in [100, 1000, 1400, 4000] {
        let payload = "y".repeat(size);
        let r = c
            .request(&payload)
            .unwrap_or_else(|e| panic!("{size}-byte request: {e}; {}", s.report()));
        assert_eq!(r.payload.len(), size);
    }
    for n in &s.datapaths {
        assert_eq!(
            n.datapath.maps().counter(Event::Malformed).unwrap().packets,
            0,
            "{}",
            s.report()
        );
    }
}

/// Like `host_client`, for a process in `pod`'s network namespace that is in
/// node `node`'s cgroup (a pod whose cgroup is under the node's, as on a
/// real node where connect-time hooks sit at the cgroup root).
fn pod_process_in_node_cgroup(
    s: &Sandbox,
    pod: &str,
    node: usize,
    dst: SocketAddrV4,
) -> Result<(String, String), String> {
    sockclient(
        SOCKCLIENT,
        &s.cluster.pod(pod).ns.path(),
        &s.cluster.nodes[node].cgroup.procs(),
        "tcp",
        dst,
    )
}

#[test]
fn socket_lb_host_only_leaves_pods_to_per_packet_translation() {
    use dataplane_common::stats::Hook;
    let mut s = Sandbox::new();
    let svc = s.svc(1, &["a", "b"]);
    s.program(&[&svc]);
    let dst = SocketAddrV4::new(CIP, 80);
    let count = |s: &Sandbox, hook| {
        s.datapaths[0]
            .datapath
            .maps()
            .hook_counter(hook, Event::NewFlow)
            .unwrap()
            .packets
    };

    // Without the flag, a pod's socket in the cgroup is translated at connect().
    let before = count(&s, Hook::Socket);
    pod_process_in_node_cgroup(&s, "client", 0, dst).expect("pod, connect-time");
    assert_eq!(count(&s, Hook::Socket), before + 1);

    // With it, only the node's own sockets are; the pod's flow is translated
    // per packet by tc_pod_ingress (what service meshes that redirect per
    // packet need), and still works.
    s.datapaths[0].config.socket_lb_host_only = true;
    s.datapaths[0].reconfigure();
    let (sock, tc) = (count(&s, Hook::Socket), count(&s, Hook::TcPodIngress));
    let (peer, _) = pod_process_in_node_cgroup(&s, "client", 0, dst).expect("pod, per packet");
    assert_eq!(peer, dst.to_string());
    assert_eq!(count(&s, Hook::Socket), sock, "not translated at connect()");
    assert_eq!(count(&s, Hook::TcPodIngress), tc + 1, "translated per packet");
    // The node's own processes still are.
    host_client(&s, 0, "tcp", dst).expect("host, connect-time");
    assert_eq!(count(&s, Hook::Socket), sock + 1);
}

/// A namespace in the node's cgroup that routes Service addresses to the
/// node but has no route to pods (a VRF, a VPN namespace, a test client):
/// connect-time translation would send its connections to a pod address it
/// cannot reach, so `connect()` fails at once with ENETUNREACH; with
/// `--socket-lb-host-only` its sockets are left alone and the node
/// translates its packets, and the connection works.
#[test]
fn socket_lb_host_only_serves_a_namespace_without_a_route_to_pods() {
    let mut s = Sandbox::new();
    let svc = s.svc(1, &["a", "b"]);
    s.program(&[&svc]);
    let dst = SocketAddrV4::new(CIP, 80);
    let gw = s.cluster.nodes[0].pod_gateway();
    s.cluster.pod("client").ns.ip_batch(&format!(
        "route del default\nroute add 10.96.0.0/12 via {gw} dev eth0\n"
    ));

    let err = pod_process_in_node_cgroup(&s, "client", 0, dst).expect_err("no route to the chosen pod");
    assert_eq!(
        err, "NetworkUnreachable",
        "connect() to {dst} rewritten to a pod address the namespace has no route to"
    );

    s.datapaths[0].config.socket_lb_host_only = true;
    s.datapaths[0].reconfigure();
    let (peer, _) =
        pod_process_in_node_cgroup(&s, "client", 0, dst).expect("per-packet translation at the node");
    assert_eq!(peer, dst.to_string());
}

/// `--localhost-nodeports`: the node's own processes reach a NodePort on
/// 127.0.0.1 (TCP and UDP), translated at connect time to the cluster-wide
/// set even for eTP=Local (kube-proxy's iptables mode sends the node's own
/// traffic there and masquerades it): the backend sees the node's address
/// on the route to it, the socket shows 127.0.0.1:NODEPORT. Without the flag nothing listens
/// there; a pod's 127.0.0.1 is its own, never translated; a port that is no
/// NodePort is left to the node's own listeners.
#[test]
fn localhost_node_ports_serve_the_nodes_own_processes_only() {
    let mut s = Sandbox::new();
    // eTP=Local with its one endpoint on node1: from node2's loopback the
    // cluster set is used.
    let tcp = s.svc(1, &["a"]).node_port(30080).external_local();
    let udp = TestService::new(2, "dns", Protocol::Udp, 53)
        .cluster_ip(CIP)
        .node_port(30053)
        .endpoint(s.ep("a", UDP_PORT));
    // An externalIP that is node2's own address, on the port node2's own
    // listener has on 127.0.0.1: not a NodePort, so loopback keeps it.
    let ext = TestService::new(3, "ext", Protocol::Tcp, 9999)
        .cluster_ip(Ipv4Addr::new(10, 96, 0, 11))
        .external_ip(s.cluster.nodes[1].ip())
        .endpoint(s.ep("a", TCP_PORT));
    s.program(&[&tcp, &udp, &ext]);
    let local_tcp = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 30080);
    let local_udp = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 30053);
    assert_eq!(
        host_client(&s, 1, "tcp", local_tcp).expect_err("off by default"),
        "ConnectionRefused"
    );

    for n in &mut s.datapaths {
        n.config.localhost_nodeports = true;
        n.reconfigure();
    }
    let node2 = s.datapaths[1].node_ip;
    for (mode, dst) in [
        ("tcp", local_tcp),
        ("udp-connected", local_udp),
        ("udp-unconnected", local_udp),
    ] {
        let (peer, reply) =
            host_client(&s, 1, mode, dst).unwrap_or_else(|e| panic!("{mode}: {e}; {}", s.report()));
        assert_eq!(
            peer,
            dst.to_string(),
            "{mode}: the socket shows the localhost NodePort"
        );
        let mut words = reply.split(' ');
        assert_eq!(words.next(), Some("a"), "{mode}: {reply}");
        let seen: SocketAddrV4 = words.next().unwrap().parse().unwrap();
        assert_eq!(
            *seen.ip(),
            node2,
            "{mode}: the backend sees the node's address: {reply}"
        );
    }

    // A port that is no NodePort (an externalIP of the node's address
    // there): the node's own listener on 127.0.0.1.
    let _own = EchoServer::tcp(
        s.cluster.nodes[1].ns(),
        "node2-own",
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9999),
    );
    let (_, reply) =
        host_client(&s, 1, "tcp", SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9999)).expect("own listener");
    assert!(reply.starts_with("node2-own "), "{reply}");

    // A pod in the node's cgroup: its loopback is its own.
    assert_eq!(
        pod_process_in_node_cgroup(&s, "client", 0, local_tcp).expect_err("the pod's own 127.0.0.1"),
        "ConnectionRefused"
    );
}
