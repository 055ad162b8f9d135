//! Bare-metal LoadBalancers end to end: agents on both sandbox nodes run the
//! allocator and the L2 announcer against the fake API server (on the LAN,
//! at 198.18.0.1); the client has the pool's subnet on-link (the LAN /24),
//! so it ARPs for the Service's address, reaches it through the elected
//! node, and again through the other node after the announcing agent is
//! killed (`kill -9`) and its node leaves the segment. Also: the responder on
//! its own (ARP, NDP, gratuitous announcements), and eTP=Local moving the
//! announcement with the endpoint.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4, UdpSocket},
    sync::Arc,
    time::{Duration, Instant},
};

use dataplane_agent::lb::responder::{Counters, Responder};
use dataplane_tests::{
    agent::{AgentProcess, METRICS_PORT},
    cluster::{Cluster, EXTERNAL_DEVICE},
    eventually,
    lb::{CLASS, endpoint_slice, mac_of, neighbour, pool, quick_request, service},
    netns::NetNs,
    require_privileges, unique_prefix,
};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
/// The fake API server: a host on the LAN (the switch's bridge address).
const API_ADDR: &str = "198.18.0.1";
/// The first address of the pool 198.18.0.240/29 (its network address is
/// spared), on the LAN's subnet.
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 241);
/// The first address of the pool 2001:db8::240/124 (its subnet-router
/// anycast address is spared), on the LAN's /64.
const LB_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x241);
const LEASE_NS: &str = "kube-dataplane";
/// Short leases so the test is quick: failover ≈ 2 s.
const LEASE_SECONDS: &str = "2";
const RENEW_MS: &str = "500";
const TARGET: u16 = 8080;

/// The shared sandbox (agents on both nodes against the fake API server),
/// the address the allocator gives `web`, and its Lease.
struct Sandbox {
    sb: dataplane_tests::sandbox::Sandbox,
    lb_ip: IpAddr,
    lease: String,
}

dataplane_tests::deref_sandbox!(Sandbox, sb);

/// The LoadBalancer Service `web` of our class on port 80 (NodePort 30080)
/// with `policy` and endpoints (pod, ready).
fn web(c: &Cluster, policy: &str, endpoints: &[(&str, bool)]) -> Vec<Value> {
    let mut svc = service("default/web", Some(CLASS), &[80]);
    svc["spec"]["clusterIP"] = json!("10.96.0.30");
    svc["spec"]["ports"][0]["nodePort"] = json!(30080);
    svc["spec"]["externalTrafficPolicy"] = json!(policy);
    let eps: Vec<(IpAddr, &str, bool)> = endpoints
        .iter()
        .map(|(pod, ready)| {
            let p = c.pod(pod);
            (p.ip.into(), c.nodes[p.node].name.as_str(), *ready)
        })
        .collect();
    vec![svc, endpoint_slice("default/web", 80, TARGET as i32, &eps)]
}

/// The IPv6 LoadBalancer Service `web6` of our class (single-stack IPv6)
/// with eTP=Cluster and the pods' IPv6 endpoints (pod, ready).
fn web6(c: &Cluster, endpoints: &[(&str, bool)]) -> Vec<Value> {
    let mut svc = service("default/web6", Some(CLASS), &[80]);
    svc["spec"]["clusterIP"] = json!("fd00:10:96::30");
    svc["spec"]["clusterIPs"] = json!(["fd00:10:96::30"]);
    svc["spec"]["ipFamilies"] = json!(["IPv6"]);
    svc["spec"]["ports"][0]["nodePort"] = json!(30081);
    let eps: Vec<(IpAddr, &str, bool)> = endpoints
        .iter()
        .map(|(pod, ready)| {
            let p = c.pod(pod);
            (p.ip6.unwrap().into(), c.nodes[p.node].name.as_str(), *ready)
        })
        .collect();
    vec![svc, endpoint_slice("default/web6", 80, TARGET as i32, &eps)]
}

impl Sandbox {
    fn new(objects: impl Fn(&Cluster) -> Vec<Value>) -> Self {
        Self::build(Cluster::new(), "198.18.0.240/29", LB_IP.into(), objects)
    }

    /// A dual-stack sandbox whose pool is IPv6 (on the LAN's /64): the
    /// address is resolved with NDP.
    fn dual_stack(objects: impl Fn(&Cluster) -> Vec<Value>) -> Self {
        Self::build(
            Cluster::dual_stack(
                dataplane_tests::cluster::Wiring::Wire,
                dataplane_tests::cluster::PodLayout::Routed,
            ),
            "2001:db8::240/124",
            LB_IP6.into(),
            objects,
        )
    }

    fn build(
        cluster: Cluster,
        pool_block: &str,
        lb_ip: IpAddr,
        objects: impl Fn(&Cluster) -> Vec<Value>,
    ) -> Self {
        let sb = dataplane_tests::sandbox::Sandbox::builder(cluster)
            .pods(&[("a", 0), ("b", 1)])
            .tcp_echo_every_address(TARGET)
            .api_on_switch(API_ADDR)
            .apply(|_| vec![pool("lan", &[pool_block])])
            .apply(objects)
            .agents(2, |s, i| {
                s.start_agent_on_api(
                    BIN,
                    i,
                    &[
                        "--lb-ipam",
                        "--l2-announce",
                        "--lb-lease-namespace",
                        LEASE_NS,
                        "--l2-lease-duration-seconds",
                        LEASE_SECONDS,
                        "--l2-lease-renew-ms",
                        RENEW_MS,
                    ],
                )
            });
        Self {
            sb,
            lease: dataplane_agent::lb::announce::lease_name(&lb_ip),
            lb_ip,
        }
    }

    fn wait(&self, what: &str, check: impl Fn() -> bool) {
        eventually(what, check, || {
            format!(
                "lease: {:?}\nweb: {:?}\n{}",
                self.api().get("Lease", LEASE_NS, &self.lease),
                self.api()
                    .get("Service", "default", "web")
                    .map(|s| s["status"].clone()),
                self.logs()
            )
        });
    }

    /// The node (index) holding the address's Lease.
    fn holder(&self) -> Option<usize> {
        let lease = self.api().get("Lease", LEASE_NS, &self.lease)?;
        let name = lease["spec"]["holderIdentity"].as_str()?;
        self.cluster.nodes.iter().position(|n| n.name == name)
    }

    fn request(&self, timeout: Duration) -> std::io::Result<(String, IpAddr)> {
        quick_request(&self.cluster.client.ns, (self.lb_ip, 80), timeout)
    }

    fn client_neighbour(&self) -> Option<String> {
        neighbour(&self.cluster.client.ns, &self.lb_ip.to_string())
    }

    /// Node `node`'s address of the LB IP's family (what masqueraded flows
    /// come from).
    fn node_ip(&self, node: usize) -> IpAddr {
        match self.lb_ip {
            IpAddr::V4(_) => self.cluster.nodes[node].ip().into(),
            IpAddr::V6(_) => self.cluster.nodes[node].ip6().into(),
        }
    }

    fn node_mac(&self, node: usize) -> String {
        mac_of(self.cluster.nodes[node].ns(), EXTERNAL_DEVICE)
    }

    /// A counter from node `node`'s agent's /metrics.
    fn metric(&self, node: usize, name: &str) -> u64 {
        let n = &self.cluster.nodes[node];
        let (_, body) = AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), METRICS_PORT), "/metrics")
            .expect("scrape /metrics");
        body.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{body}"))
    }

    /// Polls new connections every 50 ms until one is answered through node
    /// `node` (eTP=Cluster: masqueraded to its address); how long it took.
    fn until_served_through(&self, node: usize, since: Instant) -> Duration {
        let through = self.node_ip(node);
        dataplane_tests::poll_until(
            Duration::from_secs(15).saturating_sub(since.elapsed()),
            Duration::from_millis(50),
            &format!("served through node{}", node + 1),
            || matches!(self.request(Duration::from_millis(200)), Ok((_, peer)) if peer == through),
            || self.logs(),
        );
        since.elapsed()
    }
}

#[test]
fn a_client_on_the_segment_reaches_the_lb_ip_through_the_elected_node_and_after_it_dies() {
    let mut s = Sandbox::new(|c| web(c, "Cluster", &[("a", true), ("b", true)]));
    s.wait("address assigned and announced", || {
        s.api()
            .get("Service", "default", "web")
            .is_some_and(|w| w["status"]["loadBalancer"]["ingress"][0]["ip"] == LB_IP.to_string())
            && s.holder().is_some()
    });
    let x = s.holder().unwrap();
    let y = 1 - x;
    // Reachable (the agents program the address once they see the status),
    // through the elected node: the client resolved the address to its MAC.
    s.wait("the LB IP answers", || s.request(Duration::from_secs(1)).is_ok());
    for _ in 0..5 {
        let (_, peer) = s.request(Duration::from_secs(1)).expect("request");
        assert_eq!(peer, s.cluster.nodes[x].ip(), "served through the elected node");
    }
    assert_eq!(
        s.client_neighbour(),
        Some(s.node_mac(x)),
        "ARP answered by the elected node"
    );
    assert_eq!(s.metric(y, "dataplane_l2_announced_addresses"), 0);
    assert_eq!(s.metric(x, "dataplane_l2_announced_addresses"), 1);

    // Only the other node's pod serves from now on, so that what is measured
    // below is the L2 failover, not connections to a dead node's pod (whose
    // endpoint stays ready until the node controller notices).
    let survivor = ["a", "b"][y];
    for o in web(&s.cluster, "Cluster", &[(survivor, true)]) {
        s.api().apply(&o);
    }
    s.wait("only the surviving node's pod serves", || {
        (0..4).all(|_| {
            s.request(Duration::from_secs(1))
                .is_ok_and(|(server, _)| server == survivor)
        })
    });

    // The announcer dies with its node: no release, no forwarding.
    let killed = Instant::now();
    s.agents[x].kill9();
    s.cluster.nodes[x]
        .ns()
        .ip_batch(&format!("link set {EXTERNAL_DEVICE} down\n"));
    let failover = s.until_served_through(y, killed);
    eprintln!(
        "L2 failover (kill -9 of the announcing agent and its node off the segment → a new connection \
         served through the other node): {:.0} ms (lease {LEASE_SECONDS} s, renewed every {RENEW_MS} ms)",
        failover.as_secs_f64() * 1000.0
    );
    assert_eq!(s.holder(), Some(y));
    let lease = s.api().get("Lease", LEASE_NS, &s.lease).unwrap();
    assert_eq!(
        lease["spec"]["leaseTransitions"], 1,
        "taken over on expiry: {lease}"
    );
    assert_eq!(
        s.client_neighbour(),
        Some(s.node_mac(y)),
        "the client's neighbour entry moved"
    );
    assert!(
        s.metric(y, "dataplane_l2_gratuitous_total") >= 1,
        "the new announcer sent gratuitous ARP"
    );
    assert_eq!(s.metric(y, "dataplane_l2_takeovers_total"), 1);

    // The node comes back; then the other agent stops gracefully: it
    // releases the Lease and the returning node takes over without waiting.
    // (Taking the link down removed the route to the other node's pods.)
    let other = &s.cluster.nodes[y];
    s.cluster.nodes[x].ns().ip_batch(&format!(
        "link set {EXTERNAL_DEVICE} up\nroute replace {} via {}\n",
        other.pod_cidr(),
        other.ip()
    ));
    s.restart_agent(x);
    let stopped = Instant::now();
    s.agents[y].stop();
    let handover = s.until_served_through(x, stopped);
    eprintln!(
        "L2 hand-over on a graceful stop (SIGTERM → served through the other node): {:.0} ms",
        handover.as_secs_f64() * 1000.0
    );
    assert_eq!(s.holder(), Some(x));
    assert_eq!(s.client_neighbour(), Some(s.node_mac(x)));
}

/// The same with an IPv6 address: the client resolves it with neighbour
/// discovery to the elected node, reaches the Service through it
/// (masqueraded to that node's IPv6 address), and through the other node
/// once the announcer is killed and its node is off the segment (the new
/// holder's unsolicited neighbour advertisement moves the client's entry).
#[test]
fn an_ipv6_lb_ip_is_resolved_with_ndp_served_and_failed_over() {
    let mut s = Sandbox::dual_stack(|c| web6(c, &[("a", true), ("b", true)]));
    s.wait("address assigned and announced", || {
        s.api()
            .get("Service", "default", "web6")
            .is_some_and(|w| w["status"]["loadBalancer"]["ingress"][0]["ip"] == LB_IP6.to_string())
            && s.holder().is_some()
    });
    let x = s.holder().unwrap();
    let y = 1 - x;
    s.wait("the IPv6 LB IP answers", || {
        s.request(Duration::from_secs(1)).is_ok()
    });
    for _ in 0..5 {
        let (_, peer) = s.request(Duration::from_secs(1)).expect("request");
        assert_eq!(peer, s.node_ip(x), "served through the elected node");
    }
    assert_eq!(
        s.client_neighbour(),
        Some(s.node_mac(x)),
        "the neighbour solicitation answered by the elected node"
    );
    assert!(s.metric(x, "dataplane_l2_replies_total{protocol=\"ndp\"}") >= 1);
    for o in web6(&s.cluster, &[(["a", "b"][y], true)]) {
        s.api().apply(&o);
    }
    let survivor = ["a", "b"][y];
    s.wait("only the surviving node's pod serves", || {
        (0..4).all(|_| {
            s.request(Duration::from_secs(1))
                .is_ok_and(|(server, _)| server == survivor)
        })
    });
    let killed = Instant::now();
    s.agents[x].kill9();
    s.cluster.nodes[x]
        .ns()
        .ip_batch(&format!("link set {EXTERNAL_DEVICE} down\n"));
    let failover = s.until_served_through(y, killed);
    eprintln!(
        "L2 failover of an IPv6 address (kill -9, node off the segment → served through the other node): {:.0} ms",
        failover.as_secs_f64() * 1000.0
    );
    assert_eq!(s.holder(), Some(y));
    assert_eq!(
        s.client_neighbour(),
        Some(s.node_mac(y)),
        "the client's neighbour entry moved"
    );
    assert!(
        s.metric(y, "dataplane_l2_gratuitous_total") >= 1,
        "unsolicited NA sent"
    );
}

#[test]
fn with_local_traffic_policy_only_a_node_with_a_ready_endpoint_announces() {
    let s = Sandbox::new(|c| web(c, "Local", &[("a", true), ("b", false)]));
    s.wait("announced by node1, the one with a ready endpoint", || {
        s.holder() == Some(0)
    });
    s.wait("the LB IP answers", || s.request(Duration::from_secs(1)).is_ok());
    let (server, peer) = s.request(Duration::from_secs(1)).unwrap();
    assert_eq!(
        (server.as_str(), peer),
        ("a", s.cluster.client.ip.into()),
        "eTP=Local keeps the client address"
    );
    assert_eq!(s.client_neighbour(), Some(s.node_mac(0)));

    // The endpoint moves to node2: node1 stops and releases, node2 takes
    // over (no lease expiry to wait for) and announces itself.
    for o in web(&s.cluster, "Local", &[("a", false), ("b", true)]) {
        s.api().apply(&o);
    }
    s.wait("announced by node2", || s.holder() == Some(1));
    s.wait("served by b through node2", || {
        s.request(Duration::from_millis(500))
            .is_ok_and(|(server, peer)| server == "b" && peer == s.cluster.client.ip)
    });
    assert_eq!(s.client_neighbour(), Some(s.node_mac(1)));
    let lease = s.api().get("Lease", LEASE_NS, &s.lease).unwrap();
    assert_eq!(
        lease["spec"]["leaseTransitions"], 0,
        "released, not expired: {lease}"
    );
    assert_eq!(s.metric(0, "dataplane_l2_releases_total"), 1);
    assert_eq!(s.metric(0, "dataplane_l2_announced_addresses"), 0);
}

/// Sends one UDP datagram from `ns` to `dst` (the kernel resolves the
/// neighbour first).
fn poke(ns: &NetNs, dst: &str) {
    let dst = dst.to_owned();
    ns.run(move || {
        let any = if dst.starts_with('[') {
            "[::]:0"
        } else {
            "0.0.0.0:0"
        };
        let sock = UdpSocket::bind(any).expect("bind");
        let _ = sock.send_to(b"x", &dst);
    });
}

#[test]
fn the_responder_answers_arp_and_neighbour_solicitations_and_announces_takeovers() {
    require_privileges();
    let prefix = unique_prefix();
    let node = NetNs::new(&format!("{prefix}-rn"));
    let client = NetNs::new(&format!("{prefix}-rc"));
    for ns in [&node, &client] {
        ns.sysctl("net/ipv6/conf/all/disable_ipv6", "0");
        ns.sysctl("net/ipv6/conf/default/disable_ipv6", "0");
    }
    node.ip_batch(&format!(
        "link add eth0 type veth peer name eth0 netns {}\nlink set eth0 up\naddr add 10.50.0.1/24 dev eth0\naddr add fd00::1/64 dev eth0 nodad\n",
        client.name()
    ));
    client.ip_batch(
        "link set eth0 up\naddr add 10.50.0.100/24 dev eth0\naddr add fd00::100/64 dev eth0 nodad\n",
    );
    let counters = Arc::new(Counters::default());
    let c = counters.clone();
    let responder = node
        .run(move || Responder::start(&["eth0".to_string()], c))
        .expect("start the responder");
    let mac = mac_of(&node, "eth0");
    let announced: BTreeSet<IpAddr> = ["10.50.0.10", "fd00::10"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    responder.set_addresses(&announced);
    let context = || {
        format!(
            "client neighbours:\n{}",
            String::from_utf8_lossy(&client.command("ip").args(["neigh"]).output().unwrap().stdout)
        )
    };

    // The client resolves announced addresses to the node's MAC.
    poke(&client, "10.50.0.10:9");
    poke(&client, "[fd00::10]:9");
    eventually(
        "ARP and NDP answered",
        || {
            neighbour(&client, "10.50.0.10").as_deref() == Some(mac.as_str())
                && neighbour(&client, "fd00::10").as_deref() == Some(mac.as_str())
        },
        context,
    );
    let replies = |c: &Counters| {
        (
            c.arp_replies.load(std::sync::atomic::Ordering::Relaxed),
            c.na_replies.load(std::sync::atomic::Ordering::Relaxed),
        )
    };
    let (arp, na) = replies(&counters);
    assert!(arp >= 1 && na >= 1, "arp {arp}, na {na}");

    // Another address is not answered.
    poke(&client, "10.50.0.11:9");
    poke(&client, "[fd00::11]:9");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        replies(&counters),
        (arp, na),
        "nothing answered for addresses not announced"
    );
    assert_eq!(neighbour(&client, "10.50.0.11"), None);

    // A takeover: the client's entries still point at the previous
    // announcer; gratuitous ARP and an unsolicited advertisement move them.
    client.ip_batch(
        "neigh replace 10.50.0.10 lladdr 02:00:00:00:00:99 dev eth0 nud stale\n\
         neigh replace fd00::10 lladdr 02:00:00:00:00:99 dev eth0 nud stale\n",
    );
    assert_eq!(
        neighbour(&client, "10.50.0.10").as_deref(),
        Some("02:00:00:00:00:99")
    );
    for ip in &announced {
        responder.announce(*ip);
    }
    eventually(
        "gratuitous announcements update the client",
        || {
            neighbour(&client, "10.50.0.10").as_deref() == Some(mac.as_str())
                && neighbour(&client, "fd00::10").as_deref() == Some(mac.as_str())
        },
        context,
    );
    assert!(counters.gratuitous.load(std::sync::atomic::Ordering::Relaxed) >= 2);
    drop(responder);
}
