//! Remote backends end to end, on a three-node sandbox with an agent per
//! node and real packets: NodePorts and a LoadBalancer IP whose backend runs
//! on another node, in `snat`, `dsr` and `hybrid` modes (per Service, by
//! annotation), TCP and UDP, IPv4 and IPv6; the backend sees the client's
//! address in DSR and the node the client reached never sees the replies;
//! path MTU discovery through the encapsulation; Maglev sending one flow to
//! the same backend whichever node it reaches. Run with the ingress path in
//! native XDP with host routing (XDP forwards frames itself) and in TC.
//!
//! ```text
//!   client ── switch ── node1 .11 (the node the client reaches)
//!                    ├─ node2 .12 ── pod b (10.244.2.10, fd00:10:244:2::10)
//!                    └─ node3 .13 ── pod c
//! ```

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4},
};

use dataplane_agent::dataplane::LbMaps;
use dataplane_common::stats::{Event, FlowStat, Hook};
use dataplane_tests::{
    cluster::{Cluster, Wiring},
    echo::{TcpClient, tcp_request, udp_request},
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
const SNAT: u16 = 30080;
const DSR: u16 = 30081;
const HYBRID: u16 = 30082;
const MAGLEV: u16 = 30090;
const LB4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const LB6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x19, 0, 0, 0, 0, 0x10);

/// A Service of both families with a TCP and a UDP port (same NodePort),
/// its annotations, and its endpoints `(pod, node)` of both families.
fn service(
    name: &str,
    annotations: &[(&str, &str)],
    node_port: u16,
    lb: bool,
    eps: &[(IpAddr, IpAddr, &str)],
) -> String {
    let ann: Vec<String> = annotations.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    let n = node_port - 30000;
    let kind = if lb { "LoadBalancer" } else { "NodePort" };
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default, annotations: {{{ann}}}}}\n\
         spec:\n  type: {kind}\n  clusterIP: 10.96.1.{n}\n  clusterIPs: [10.96.1.{n}, 'fd00:10:96::1:{n}']\n  \
         ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  externalTrafficPolicy: Cluster\n  \
         ports:\n  - {{name: tcp, port: 80, protocol: TCP, nodePort: {node_port}}}\n  \
         - {{name: udp, port: 53, protocol: UDP, nodePort: {node_port}}}\n",
        ann = ann.join(", ")
    );
    if lb {
        y.push_str(&format!(
            "status:\n  loadBalancer:\n    ingress: [{{ip: {LB4}}}, {{ip: '{LB6}'}}]\n"
        ));
    }
    for (family, pick) in [("IPv4", 0), ("IPv6", 1)] {
        y.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-{f}, \
             namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: {family}\n\
             ports: [{{name: tcp, port: {TCP_PORT}, protocol: TCP}}, {{name: udp, port: {UDP_PORT}, protocol: UDP}}]\n\
             endpoints:\n",
            f = family.to_lowercase()
        ));
        for (v4, v6, node) in eps {
            let ip = if pick == 0 { v4 } else { v6 };
            y.push_str(&format!(
                "  - {{addresses: [\"{ip}\"], nodeName: {node}, conditions: {{ready: true}}}}\n"
            ));
        }
    }
    y
}

/// Pod `name`'s addresses and node name, for [`service`].
fn pod<'a>(c: &'a Cluster, name: &str) -> (IpAddr, IpAddr, &'a str) {
    let p = c.pod(name);
    (
        IpAddr::V4(p.ip),
        IpAddr::V6(p.ip6.unwrap()),
        c.nodes[p.node].name.as_str(),
    )
}

/// The shared sandbox, with this file's helpers.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

impl Sandbox {
    /// Three nodes, pods "b" on node2 and "c" on node3, the Services, an
    /// agent per node with `extra` flags.
    fn new(extra: &[&str]) -> Self {
        let mode = "dataplane.example.com/lb-mode";
        Self(
            dataplane_tests::sandbox::Sandbox::builder(Cluster::with_nodes(3, Wiring::Wire))
                .pods(&[("b", 1), ("c", 2)])
                .tcp_echo_every_address(TCP_PORT)
                .udp_echo_every_address(UDP_PORT)
                .manifest("snat.yaml", |c| {
                    service("snat", &[(mode, "snat")], SNAT, false, &[pod(c, "b")])
                })
                .manifest("dsr.yaml", |c| {
                    service("dsr", &[(mode, "dsr")], DSR, true, &[pod(c, "b")])
                })
                .manifest("hybrid.yaml", |c| {
                    service("hybrid", &[(mode, "hybrid")], HYBRID, false, &[pod(c, "b")])
                })
                .manifest("maglev.yaml", |c| {
                    service(
                        "maglev",
                        &[("dataplane.example.com/lb-algorithm", "maglev")],
                        MAGLEV,
                        false,
                        &[pod(c, "b"), pod(c, "c")],
                    )
                })
                .route_from_client("198.19.0.0/24", 0)
                .route_from_client("2001:db8:19::/64", 0)
                .agents(3, |s, i| s.start_agent(BIN, i, extra)),
        )
    }

    fn node(&self, i: usize, v6: bool) -> IpAddr {
        let n = &self.cluster.nodes[i];
        if v6 {
            IpAddr::V6(n.ip6())
        } else {
            IpAddr::V4(n.ip())
        }
    }

    fn client(&self, v6: bool) -> IpAddr {
        if v6 {
            IpAddr::V6(self.cluster.client.ip6.unwrap())
        } else {
            IpAddr::V4(self.cluster.client.ip)
        }
    }

    /// Node `i`'s maps (its agent's pins), read-only.
    fn maps(&self, i: usize) -> LbMaps {
        LbMaps::open_pins(&self.agents[i].pin_dir)
            .expect("open the pins")
            .0
    }

    fn flow_stat(&self, i: usize, which: FlowStat) -> u64 {
        let stats = self.maps(i).flow_stats().unwrap();
        stats.into_iter().find(|(s, _)| *s == which).map_or(0, |(_, n)| n)
    }
}

/// Each mode, TCP and UDP, both families: who the backend saw, and where
/// the replies went.
fn modes_work(s: &Sandbox) {
    let ns = &s.cluster.client.ns;
    for v6 in [false, true] {
        let client = s.client(v6);
        let node1 = s.node(0, v6);
        let lb = if v6 { IpAddr::V6(LB6) } else { IpAddr::V4(LB4) };
        // (destination, protocol, the source the backend must see)
        let cases = [
            (SocketAddr::new(node1, SNAT), "tcp", node1),
            (SocketAddr::new(node1, SNAT), "udp", node1),
            (SocketAddr::new(node1, DSR), "tcp", client),
            (SocketAddr::new(node1, DSR), "udp", client),
            (SocketAddr::new(lb, 80), "tcp", client),
            (SocketAddr::new(node1, HYBRID), "tcp", client),
            (SocketAddr::new(node1, HYBRID), "udp", node1),
        ];
        for (dst, proto, seen) in cases {
            for round in 0..3 {
                let reply = match proto {
                    "tcp" => tcp_request(ns, dst, "hello"),
                    _ => udp_request(ns, dst, "hello"),
                }
                .unwrap_or_else(|e| panic!("{proto} {dst} round {round}: {e}\n{}", s.logs()));
                assert_eq!(reply.server, "b", "{proto} {dst}");
                assert_eq!(reply.peer.ip(), seen, "{proto} {dst}: the source the backend saw");
            }
        }
    }
}

/// DSR's replies leave node2 for the client: node1 translates none, node2
/// decapsulated what node1 encapsulated.
fn dsr_replies_skip_the_lb_node(s: &Sandbox) {
    let before: Vec<(u64, u64)> = (0..2)
        .map(|i| {
            let m = s.maps(i);
            let replies: u64 = Hook::ALL
                .iter()
                .map(|h| m.hook_counter(*h, Event::Reply).unwrap().packets)
                .sum();
            (replies, 0)
        })
        .collect();
    let encapsulated = s.flow_stat(0, FlowStat::DsrEncapsulated);
    let decapsulated = s.flow_stat(1, FlowStat::DsrDecapsulated);
    let ns = &s.cluster.client.ns;
    let dst = SocketAddr::new(s.node(0, false), DSR);
    let mut c = TcpClient::connect(ns, dst).expect("connect");
    for i in 0..20 {
        let r = c.request(&format!("r{i}")).expect("request");
        assert_eq!(r.peer, c.local_addr(), "the client's own address and port");
    }
    drop(c);
    let m = s.maps(0);
    let replies: u64 = Hook::ALL
        .iter()
        .map(|h| m.hook_counter(*h, Event::Reply).unwrap().packets)
        .sum();
    assert_eq!(replies, before[0].0, "node1 translated no reply of a DSR flow");
    assert!(
        s.flow_stat(0, FlowStat::DsrEncapsulated) >= encapsulated + 20,
        "node1 encapsulated"
    );
    assert!(
        s.flow_stat(1, FlowStat::DsrDecapsulated) >= decapsulated + 20,
        "node2 decapsulated"
    );
}

/// A request bigger than the path once encapsulated: node1 answers the
/// client's full-size segments with "fragmentation needed", the client's
/// TCP adapts, the request gets through whole.
fn path_mtu_through_dsr(s: &Sandbox) {
    let ns = &s.cluster.client.ns;
    for v6 in [false, true] {
        let dst = SocketAddr::new(s.node(0, v6), DSR);
        let big = "x".repeat(20_000);
        let reply = tcp_request(ns, dst, &big)
            .unwrap_or_else(|e| panic!("{dst}: a 20 kB request through DSR: {e}\n{}", s.logs()));
        assert_eq!(reply.payload.len(), big.len(), "{dst}: echoed whole");
    }
    let m = s.maps(0);
    let too_big: u64 = Hook::ALL
        .iter()
        .map(|h| m.hook_counter(*h, Event::RejectTooBig).unwrap().packets)
        .sum();
    assert!(too_big > 0, "node1 sent fragmentation needed");
}

/// One client port reaching the Maglev Service through node1 and then
/// through node2 gets the same backend (b or c), for every port tried;
/// random choices would agree on 20 ports once in a million.
fn maglev_agrees_across_nodes(s: &Sandbox) {
    let ns = &s.cluster.client.ns;
    let mut seen = BTreeMap::new();
    for i in 0..20u16 {
        let port = 20_000 + i * 7;
        let mut picks = Vec::new();
        for node in [0, 1] {
            let IpAddr::V4(ip) = s.node(node, false) else {
                unreachable!()
            };
            let mut c = TcpClient::connect_from_port(ns, port, SocketAddrV4::new(ip, MAGLEV))
                .unwrap_or_else(|e| panic!("port {port} via node{}: {e}", node + 1));
            picks.push(c.request("who").expect("request").server);
        }
        assert_eq!(picks[0], picks[1], "client port {port}: node1 and node2 agree");
        *seen.entry(picks[0].clone()).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 2, "both backends get flows: {seen:?}");
}

/// Native XDP with host routing: node1's XDP forwards the masqueraded
/// flows' frames (both ways) and encapsulates DSR's, without the stack.
#[test]
fn remote_backends_in_native_xdp_with_host_routing() {
    let s = Sandbox::new(&["--xdp-mode", "native", "--host-routing"]);
    let forwarded = s.flow_stat(0, FlowStat::XdpForwarded);
    modes_work(&s);
    assert!(
        s.flow_stat(0, FlowStat::XdpForwarded) > forwarded,
        "node1's XDP forwarded the SNAT flows' frames\n{}",
        s.logs()
    );
    dsr_replies_skip_the_lb_node(&s);
    path_mtu_through_dsr(&s);
    maglev_agrees_across_nodes(&s);
}

/// The same through TC (veth: `--xdp-mode auto`), without host routing.
#[test]
fn remote_backends_in_tc() {
    let s = Sandbox::new(&[]);
    modes_work(&s);
    dsr_replies_skip_the_lb_node(&s);
    path_mtu_through_dsr(&s);
    maglev_agrees_across_nodes(&s);
    assert_eq!(s.flow_stat(0, FlowStat::XdpForwarded), 0);
}
