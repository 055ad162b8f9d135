//! Dual-stack and IPv6, end to end: a sandbox where every host and pod has
//! an IPv4 and an IPv6 address, an agent per node described by both
//! families (`--node-ip 198.18.0.1N,2001:db8::1N`, a cluster and a service
//! CIDR of each), Services of every `ipFamilyPolicy` from manifests, real
//! packets both ways: NodePorts on each family's node address (masqueraded
//! to that family's node address), an eTP=Local LoadBalancer IP of each
//! family (client address kept), ClusterIPs from pods (no SNAT) and from the
//! node's own processes (connect6), rejects with ICMPv6, a single-stack
//! IPv6 Service beside IPv4 ones; and an IPv6-only node, which leaves IPv4
//! Services alone as kube-proxy's single-stack proxier does.

use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use dataplane_tests::{
    agent::AgentProcess,
    cluster::{Cluster, NODE_IPS, NODE_IPS6, PodLayout, Wiring},
    echo::{sockclient, tcp_request, udp_request},
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const TARGET: u16 = 8080;
const WEB4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const WEB6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10);
const WEB_NODE_PORT: u16 = 30080;
const LOCAL6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x20);
const LB_LOCAL4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const LB_LOCAL6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x19, 0, 0, 0, 0, 0x10);
const ONLY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x30);
const EMPTY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x40);
const DNS6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x53);

/// A Service and one EndpointSlice per family with endpoints, as YAML.
/// `families` is the Service's `ipFamilies` (with one ClusterIP each),
/// `eps` the endpoints as (pod name, node name, address).
fn service(
    name: &str,
    extra_spec: &str,
    families: &[(&str, IpAddr)],
    proto: &str,
    node_port: Option<u16>,
    eps: &[(&str, IpAddr)],
) -> String {
    let policy = if families.len() == 2 {
        "RequireDualStack"
    } else {
        "SingleStack"
    };
    let ips: Vec<String> = families.iter().map(|(_, ip)| ip.to_string()).collect();
    let fams: Vec<&str> = families.iter().map(|(f, _)| *f).collect();
    let node_port = node_port.map(|p| format!(", nodePort: {p}")).unwrap_or_default();
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n{extra_spec}  \
         clusterIP: {}\n  clusterIPs: [{}]\n  ipFamilies: [{}]\n  ipFamilyPolicy: {policy}\n  \
         ports: [{{name: p, port: 80, protocol: {proto}{node_port}}}]\n",
        ips[0],
        ips.join(", "),
        fams.join(", ")
    );
    for family in ["IPv4", "IPv6"] {
        let of: Vec<&(&str, IpAddr)> = eps
            .iter()
            .filter(|(_, ip)| (family == "IPv4") == ip.is_ipv4())
            .collect();
        let slice = format!("{name}-{}", family.to_lowercase());
        y.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {slice}, namespace: default, \
             labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: {family}\n\
             ports: [{{name: p, port: {TARGET}, protocol: {proto}}}]\nendpoints:\n"
        ));
        if of.is_empty() {
            y.push_str("  []\n");
        }
        for (node, ip) in of {
            y.push_str(&format!(
                "  - {{addresses: [\"{ip}\"], nodeName: {node}, conditions: {{ready: true}}}}\n"
            ));
        }
    }
    y
}

fn with_lb_ips(yaml: String, ips: &[IpAddr]) -> String {
    let ingress: Vec<String> = ips.iter().map(|ip| format!("{{ip: \"{ip}\"}}")).collect();
    yaml.replacen(
        "---\n",
        &format!(
            "status: {{loadBalancer: {{ingress: [{}]}}}}\n---\n",
            ingress.join(", ")
        ),
        1,
    )
}

fn manifests(c: &Cluster) -> String {
    // (node, address) of a pod, per family.
    let v4 = |pod: &str| {
        let p = c.pod(pod);
        (c.nodes[p.node].name.as_str(), IpAddr::V4(p.ip))
    };
    let v6 = |pod: &str| {
        let p = c.pod(pod);
        (c.nodes[p.node].name.as_str(), IpAddr::V6(p.ip6.unwrap()))
    };
    let dual = |a: Ipv4Addr, b: Ipv6Addr| [("IPv4", a.into()), ("IPv6", b.into())];
    [
        service(
            "web",
            "  type: NodePort\n",
            &dual(WEB4, WEB6),
            "TCP",
            Some(WEB_NODE_PORT),
            &[v4("a"), v4("b"), v6("a"), v6("b")],
        ),
        // IPv6 first: a Service whose primary family is IPv6.
        with_lb_ips(
            service(
                "local",
                "  type: LoadBalancer\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32190\n",
                &[
                    ("IPv6", LOCAL6.into()),
                    ("IPv4", Ipv4Addr::new(10, 96, 0, 20).into()),
                ],
                "TCP",
                Some(30090),
                &[v4("a"), v4("b"), v6("a"), v6("b")],
            ),
            &[LB_LOCAL4.into(), LB_LOCAL6.into()],
        ),
        service("only6", "", &[("IPv6", ONLY6.into())], "TCP", None, &[v6("b")]),
        service("empty6", "", &[("IPv6", EMPTY6.into())], "TCP", None, &[]),
        service("dns6", "", &[("IPv6", DNS6.into())], "UDP", None, &[v6("b")]),
    ]
    .join("---\n")
}

/// The shared sandbox, with this file's helpers.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

impl Sandbox {
    /// Pods "client" and "a" on node1, "b" on node2, TCP and UDP echo
    /// servers on each pod's IPv4 and IPv6 address, an agent per node.
    fn new() -> Self {
        Self(
            dataplane_tests::sandbox::Sandbox::builder(Cluster::dual_stack(Wiring::Wire, PodLayout::Routed))
                .pods(&[("client", 0), ("a", 0), ("b", 1)])
                .tcp_echo_every_address(TARGET)
                .udp_echo_every_address(TARGET)
                .manifest("services.yaml", manifests)
                .route_from_client("198.19.0.0/24", 0)
                .route_from_client("2001:db8:19::/64", 0)
                .agents(2, |s, i| {
                    let cgroup = s.cluster.nodes[i].cgroup.path();
                    s.start_agent(
                        BIN,
                        i,
                        &["--cgroup-path", cgroup.to_str().unwrap(), "--localhost-nodeports"],
                    )
                }),
        )
    }

    /// (server, source address it saw) of `n` TCP requests from `pod` (or
    /// the external client when `None`) to `dst`.
    fn seen(&self, from: Option<&str>, dst: SocketAddr, n: usize) -> BTreeSet<(String, IpAddr)> {
        let ns = from.map_or(&self.cluster.client.ns, |p| &self.cluster.pod(p).ns);
        (0..n)
            .map(|i| {
                let r = tcp_request(ns, dst, "x")
                    .unwrap_or_else(|e| panic!("request {i} from {from:?} to {dst}: {e}\n{}", self.logs()));
                (r.server, r.peer.ip())
            })
            .collect()
    }

    /// A host process of node1 (its network namespace and cgroup) to `dst`:
    /// (peer its socket reports, reply).
    fn host_request(&self, dst: SocketAddr) -> (String, String) {
        let n = &self.cluster.nodes[0];
        sockclient(
            env!("CARGO_BIN_EXE_sockclient"),
            &n.ns().path(),
            &n.cgroup.procs(),
            "tcp",
            dst,
        )
        .unwrap_or_else(|e| panic!("host process to {dst}: {e}\n{}", self.logs()))
    }
}

fn set(v: &[(&str, IpAddr)]) -> BTreeSet<(String, IpAddr)> {
    v.iter().map(|(s, ip)| (s.to_string(), *ip)).collect()
}

#[test]
fn dual_stack_services_serve_both_families_end_to_end() {
    let s = Sandbox::new();
    let c = &s.cluster;
    let (node1, node1_6) = (IpAddr::V4(c.nodes[0].ip()), IpAddr::V6(c.nodes[0].ip6()));
    let client6 = IpAddr::V6(c.client.ip6.unwrap());
    let pod6 = |name: &str| IpAddr::V6(c.pod(name).ip6.unwrap());

    // NodePort on each family's node address: eTP=Cluster, masqueraded to
    // the node's address of that family, both endpoints of that family.
    assert_eq!(
        s.seen(None, (node1, WEB_NODE_PORT).into(), 40),
        set(&[("a", node1), ("b", node1)]),
        "NodePort over IPv4"
    );
    assert_eq!(
        s.seen(None, (node1_6, WEB_NODE_PORT).into(), 40),
        set(&[("a", node1_6), ("b", node1_6)]),
        "NodePort over IPv6: masqueraded to node1's IPv6 address\n{}",
        s.logs()
    );

    // An eTP=Local LoadBalancer IP of each family: only node1's endpoint,
    // the client's own address kept.
    assert_eq!(
        s.seen(None, (LB_LOCAL6, 80).into(), 10),
        set(&[("a", client6)]),
        "eTP=Local over IPv6 keeps the client address"
    );
    assert_eq!(
        s.seen(None, (LB_LOCAL4, 80).into(), 10),
        set(&[("a", IpAddr::V4(c.client.ip))]),
        "eTP=Local over IPv4 keeps the client address"
    );

    // Pods to IPv6 ClusterIPs: no SNAT, both endpoints; a single-stack IPv6
    // Service; UDP.
    assert_eq!(
        s.seen(Some("client"), (WEB6, 80).into(), 40),
        set(&[("a", pod6("client")), ("b", pod6("client"))]),
        "pod → IPv6 ClusterIP"
    );
    assert_eq!(
        s.seen(Some("client"), (ONLY6, 80).into(), 5),
        set(&[("b", pod6("client"))]),
        "pod → single-stack IPv6 Service on the other node"
    );
    let r = udp_request(&c.pod("client").ns, (DNS6, 80), "q")
        .unwrap_or_else(|e| panic!("UDP to an IPv6 ClusterIP: {e}\n{}", s.logs()));
    assert_eq!((r.server.as_str(), r.peer.ip()), ("b", pod6("client")));

    // The external client to an IPv6 ClusterIP (routed through node1):
    // masqueraded, as for IPv4 (it is outside the cluster CIDR).
    c.route_from_client("fd00:10:96::/112", 0);
    assert_eq!(
        s.seen(None, (ONLY6, 80).into(), 5),
        set(&[("b", node1_6)]),
        "client → IPv6 ClusterIP from off the cluster: masqueraded"
    );

    // A host process of node1: connect6 picks the backend; getpeername
    // shows the Service.
    let (peer, reply) = s.host_request((WEB6, 80).into());
    assert_eq!(
        peer,
        SocketAddr::from((WEB6, 80)).to_string(),
        "getpeername shows the ClusterIP"
    );
    assert!(reply.starts_with("a ") || reply.starts_with("b "), "{reply}");
    // Localhost NodePorts (--localhost-nodeports) of both families: the
    // socket shows the loopback address; the backend sees the node's
    // address on the route to it (as MASQUERADE picks it), never loopback.
    let node1_addresses = [
        node1,
        node1_6,
        c.nodes[0].pod_gateway().into(),
        c.nodes[0].pod_gateway6().into(),
    ];
    for lo in [IpAddr::from(Ipv4Addr::LOCALHOST), Ipv6Addr::LOCALHOST.into()] {
        let dst = SocketAddr::from((lo, WEB_NODE_PORT));
        let (peer, reply) = s.host_request(dst);
        assert_eq!(peer, dst.to_string(), "getpeername shows the localhost NodePort");
        let seen: SocketAddr = reply.split(' ').nth(1).unwrap().parse().unwrap();
        assert!(
            node1_addresses.contains(&seen.ip()) && seen.is_ipv4() == lo.is_ipv4(),
            "{dst}: the backend sees an address of node1: {reply}"
        );
    }

    // No endpoints: the connection is refused at once (ICMPv6
    // port-unreachable), from outside and from a pod.
    c.route_from_client("fd00:10:96::/112", 0);
    for (who, ns) in [("pod", &c.pod("client").ns), ("client", &c.client.ns)] {
        let err = tcp_request(ns, (EMPTY6, 80), "x").expect_err("a Service without endpoints");
        assert_eq!(
            err.kind(),
            ErrorKind::ConnectionRefused,
            "{who}: rejected with ICMPv6: {err}\n{}",
            s.logs()
        );
    }
    // A port the IPv6 ClusterIP does not serve: refused too.
    let err = tcp_request(&c.pod("client").ns, (WEB6, 81), "x").expect_err("an unserved port");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");

    // kube-proxy's health servers answer over both families (load
    // balancers probe healthCheckNodePorts over either): a pod of `local`
    // on each node.
    for ip in [node1, node1_6] {
        let (status, body) = AgentProcess::http_get(&c.client.ns, (ip, 32190), "/")
            .unwrap_or_else(|e| panic!("healthCheckNodePort over {ip}: {e}"));
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v["localEndpoints"], 1,
            "one pod (an endpoint of each family): {body}"
        );
        let (status, body) = AgentProcess::http_get(
            &c.client.ns,
            (ip, dataplane_tests::agent::HEALTH_PORT),
            "/healthz",
        )
        .unwrap_or_else(|e| panic!("/healthz over {ip}: {e}"));
        assert_eq!(status, 200);
        // Every local endpoint of both families is reachable through a pod
        // interface (IPv6 routes included).
        assert!(!body.contains("unreachableLocalEndpoints"), "{body}");
    }

    // `inspect services` shows the IPv6 frontends, in brackets.
    let out = std::process::Command::new(BIN)
        .arg("inspect")
        .arg("--bpffs-dir")
        .arg(&s.agents[0].pin_dir)
        .arg("services")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for fe in [
        format!("[{WEB6}]:80/TCP"),
        format!("[{node1_6}]:{WEB_NODE_PORT}/TCP"),
        format!("[{LB_LOCAL6}]:80/TCP"),
        format!("{WEB4}:80/TCP"),
    ] {
        assert!(text.contains(&fe), "inspect services shows {fe}:\n{text}");
    }
}

/// Pod "a" on node1 serving TCP on both its addresses, the dual-stack
/// NodePort `web` to it, an agent on node1 with `args`.
fn one_pod(args: &[&str]) -> dataplane_tests::sandbox::Sandbox {
    dataplane_tests::sandbox::Sandbox::builder(Cluster::dual_stack(Wiring::Wire, PodLayout::Routed))
        .pods(&[("a", 0)])
        .tcp_echo_every_address(TARGET)
        .manifest("services.yaml", |c| {
            let a = c.pod("a");
            service(
                "web",
                "  type: NodePort\n",
                &[("IPv4", WEB4.into()), ("IPv6", WEB6.into())],
                "TCP",
                Some(WEB_NODE_PORT),
                &[("node1", a.ip.into()), ("node1", IpAddr::V6(a.ip6.unwrap()))],
            )
        })
        .agents(1, |s, i| s.start_agent(BIN, i, args))
}

/// An IPv6-only node (`--node-ip` of IPv6 only): IPv6 Service ports are
/// served, the IPv4 ones are not programmed at all (kube-proxy runs no
/// IPv4 proxier there), and the agent is healthy.
#[test]
fn an_ipv6_only_node_serves_ipv6_and_leaves_ipv4_alone() {
    let node6 = NODE_IPS6[0].to_string();
    let s = one_pod(&[
        "--node-ip",
        &node6,
        "--cluster-cidr",
        "fd00:10:244::/56",
        "--service-cidr",
        "fd00:10:96::/112",
    ]);
    let (cluster, agent) = (&s.cluster, &s.agents[0]);
    let node6 = cluster.nodes[0].ip6();
    let r = tcp_request(&cluster.client.ns, (node6, WEB_NODE_PORT), "x")
        .unwrap_or_else(|e| panic!("IPv6 NodePort on an IPv6-only node: {e}\n{}", agent.log_text()));
    assert_eq!((r.server.as_str(), r.peer.ip()), ("a", IpAddr::V6(node6)));
    let out = std::process::Command::new(BIN)
        .arg("inspect")
        .arg("--bpffs-dir")
        .arg(&agent.pin_dir)
        .args(["services", "-o", "json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let frontends: Vec<String> = v["services"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["frontend"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        frontends.iter().all(|f| f.starts_with('[')),
        "only IPv6 frontends on an IPv6-only node: {frontends:?}"
    );
    assert!(frontends.contains(&format!("[{WEB6}]:80/TCP")), "{frontends:?}");
}

/// A node that gains an IPv6 address: its agent, restarted with both
/// `--node-ip`s on the pins an IPv4-only run left (IPv6 maps of one entry),
/// grows the IPv6 maps and serves IPv6, with IPv4 flows kept throughout.
#[test]
fn a_node_that_gains_an_ipv6_address_grows_its_ipv6_maps_on_restart() {
    let mut s = one_pod(&[
        "--node-ip",
        &NODE_IPS[0].to_string(),
        "--cluster-cidr",
        "10.244.0.0/16",
        "--service-cidr",
        "10.96.0.0/16",
    ]);
    let (ip, ip6) = (s.cluster.nodes[0].ip(), s.cluster.nodes[0].ip6());
    let client = &s.cluster.client.ns;
    let mut long =
        dataplane_tests::echo::TcpClient::connect(client, (ip, WEB_NODE_PORT)).expect("IPv4 NodePort");
    assert_eq!(long.request("v4").unwrap().server, "a");
    assert!(
        tcp_request(client, (ip6, WEB_NODE_PORT), "x").is_err(),
        "no IPv6 NodePort on an IPv4-only node"
    );
    s.agents[0].set_flag("--node-ip", &format!("{},{}", ip, ip6));
    s.agents[0].set_flag("--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56");
    s.agents[0].set_flag("--service-cidr", "10.96.0.0/16,fd00:10:96::/112");
    s.agents[0].restart(s.cluster.nodes[0].ns());
    let r = tcp_request(client, (ip6, WEB_NODE_PORT), "x")
        .unwrap_or_else(|e| panic!("IPv6 NodePort after the restart: {e}\n{}", s.agents[0].log_text()));
    assert_eq!((r.server.as_str(), r.peer.ip()), ("a", IpAddr::V6(ip6)));
    assert_eq!(
        long.request("after").unwrap().server,
        "a",
        "the IPv4 connection lived through the restart"
    );
    let log = s.agents[0].log_text();
    for map in ["LB6_SERVICES_V1", "LB6_BACKENDS_V1", "CT6_V1"] {
        assert!(
            log.lines()
                .any(|l| l.contains("resized a pinned map") && l.contains(map)),
            "{map} grown: {log}"
        );
    }
}
