//! BGP announcements end to end with real daemons: three sandbox nodes run
//! the agent (`--bgp`, and the allocator) beside BIRD 2, which the agent
//! configures; the client's namespace is the router: BIRD peers with the
//! three nodes and installs what it learns into its kernel table with ECMP
//! (L4 hashing). Covers ECMP over every node (eTP=Cluster), eTP=Local
//! following the endpoints, bad peers and a crashed speaker, a node's loss
//! with and without BFD, and how many established connections survive one
//! node's withdrawal with Maglev + DSR against SNAT.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddrV4, TcpStream},
    time::{Duration, Instant},
};

use dataplane_tests::{
    agent::{AgentProcess, METRICS_PORT},
    bgp::{Bird, BirdDir, NODE_ASN, ROUTER_ASN, next_hops, router_config},
    cluster::{CLIENT_IP, Cluster, Wiring},
    lb::{CLASS, endpoint_slice, pool, quick_request, service},
    poll_until, require_privileges, unique_prefix,
};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const API_ADDR: &str = "198.18.0.1";
/// The pool is off the LAN: the router reaches it only through BGP.
const POOL: &str = "203.0.113.0/28";
const LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const LB_ROUTE: &str = "203.0.113.1/32";
const TARGET: u16 = 8080;
/// Hold time of the sessions (BGP's minimum): the failure detection
/// without BFD.
const HOLD_TIME: u32 = 3;

/// The shared sandbox (three nodes, agents against the fake API server),
/// BIRD beside each agent, and the router's BIRD.
struct Sandbox {
    sb: dataplane_tests::sandbox::Sandbox,
    birds: Vec<Bird>,
    router: Bird,
    _dir: BirdDir,
}

/// The agents withdraw while BIRD still runs; then the BIRDs stop, then
/// the rest of the sandbox goes.
impl Drop for Sandbox {
    fn drop(&mut self) {
        self.sb.stop_agents();
    }
}

dataplane_tests::deref_sandbox!(Sandbox, sb);

/// `web`: LoadBalancer of our class, port 80 (NodePort 30080), `policy`,
/// endpoints on `pods`.
fn web(c: &Cluster, policy: &str, pods: &[&str]) -> Vec<Value> {
    let mut svc = service("default/web", Some(CLASS), &[80]);
    svc["spec"]["clusterIP"] = json!("10.96.0.30");
    svc["spec"]["ports"][0]["nodePort"] = json!(30080);
    svc["spec"]["externalTrafficPolicy"] = json!(policy);
    if policy == "Local" {
        svc["spec"]["healthCheckNodePort"] = json!(32000);
    }
    let eps: Vec<(IpAddr, &str, bool)> = pods
        .iter()
        .map(|pod| {
            let p = c.pod(pod);
            (p.ip.into(), c.nodes[p.node].name.as_str(), true)
        })
        .collect();
    vec![svc, endpoint_slice("default/web", 80, TARGET as i32, &eps)]
}

fn peer(name: &str, address: &str, peer_asn: u32, bfd: bool) -> Value {
    let mut spec =
        json!({"peerAddress": address, "peerASN": peer_asn, "myASN": NODE_ASN, "holdTimeSeconds": HOLD_TIME});
    if bfd {
        spec["bfd"] = json!({"minRxMs": 100, "minTxMs": 100, "multiplier": 3});
    }
    json!({"apiVersion": "dataplane.example.com/v1alpha1", "kind": "BGPPeer", "metadata": {"name": name}, "spec": spec})
}

impl Sandbox {
    fn new(bfd: bool, agent_args: &[&str]) -> Self {
        require_privileges();
        let mut sb = dataplane_tests::sandbox::Sandbox::builder(Cluster::with_nodes(3, Wiring::Wire))
            .pods(&[("a", 0), ("b", 1), ("c", 2)])
            .tcp_echo(TARGET)
            .api_on_switch(API_ADDR)
            .apply(|c| {
                let mut objects = vec![pool("bgp", &[POOL])];
                objects.extend(web(c, "Cluster", &["a", "b", "c"]));
                objects.push(peer("tor", &CLIENT_IP.to_string(), ROUTER_ASN, bfd));
                objects.push(
                    json!({"apiVersion": "dataplane.example.com/v1alpha1", "kind": "BGPAdvertisement",
                          "metadata": {"name": "lb"}, "spec": {"communities": ["64512:100"]}}),
                );
                objects
            })
            .build();
        let dir = BirdDir::new(&unique_prefix());
        // The router: the client's namespace, hashing flows over next hops
        // by their ports too.
        let client = &sb.cluster.client.ns;
        client.sysctl("net/ipv4/fib_multipath_hash_policy", "1");
        let router_conf = dir.path().join("router.conf");
        let node_ips: Vec<Ipv4Addr> = sb.cluster.nodes.iter().map(|n| n.ip()).collect();
        std::fs::write(&router_conf, router_config(CLIENT_IP, &node_ips, bfd, HOLD_TIME)).unwrap();
        let router = Bird::start(client, &router_conf);
        let mut birds = Vec::new();
        for i in 0..3 {
            let conf = dir.path().join(format!("node{}.conf", i + 1));
            let sock = conf.with_extension("ctl");
            let (conf_s, sock_s) = (conf.display().to_string(), sock.display().to_string());
            let mut args = vec![
                "--lb-ipam",
                "--bgp",
                "--bgp-config",
                conf_s.as_str(),
                "--bgp-socket",
                sock_s.as_str(),
            ];
            args.extend_from_slice(agent_args);
            let agent = sb.start_agent_on_api(BIN, i, &args);
            sb.agents.push(agent);
            // The sidecar starts on what the agent rendered.
            poll_until(
                Duration::from_secs(20),
                POLL,
                "the agent renders BIRD's configuration",
                || conf.exists(),
                || sb.agents[i].log_text(),
            );
            birds.push(Bird::start(sb.cluster.nodes[i].ns(), &conf));
        }
        Self {
            sb,
            birds,
            router,
            _dir: dir,
        }
    }

    fn node_ips(&self, nodes: &[usize]) -> Vec<Ipv4Addr> {
        let mut v: Vec<Ipv4Addr> = nodes.iter().map(|&n| self.cluster.nodes[n].ip()).collect();
        v.sort();
        v
    }

    fn hops(&self) -> Vec<Ipv4Addr> {
        next_hops(&self.cluster.client.ns, LB_ROUTE)
    }

    fn context(&self) -> String {
        let mut s = format!(
            "router:\n{}\n{}\n",
            self.router.birdc("show protocols"),
            self.router.log_text()
        );
        for (i, a) in self.agents.iter().enumerate() {
            s.push_str(&format!("--- node{}:\n{}\n", i + 1, a.log_text()));
        }
        s.push_str(&format!(
            "web: {:?}\n",
            self.api()
                .get("Service", "default", "web")
                .map(|w| w["status"].clone())
        ));
        s
    }

    /// Waits until the router's route to the LB IP has exactly `nodes`'
    /// addresses as next hops.
    fn wait_hops(&self, nodes: &[usize], within: Duration) -> Duration {
        let want = self.node_ips(nodes);
        let start = Instant::now();
        poll_until(
            within,
            POLL,
            &format!("next hops {want:?}"),
            || self.hops() == want,
            || format!("hops: {:?}\n{}", self.hops(), self.context()),
        );
        start.elapsed()
    }

    fn http(&self, node: usize, path: &str) -> (u16, String) {
        let n = &self.cluster.nodes[node];
        let port = if path == "/metrics" { METRICS_PORT } else { 10256 };
        AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), port), path).expect("agent's HTTP server")
    }

    /// `dataplane-agent inspect bgp -o <output>` on node `node`.
    fn inspect_bgp(&self, node: usize, output: &str) -> String {
        let health = format!("{}:10256", self.cluster.nodes[node].ip());
        let args: Vec<String> = ["inspect", "bgp", "--health-address", &health, "-o", output]
            .map(String::from)
            .to_vec();
        let out = self.agents[node].run_in_node(&args, Duration::from_secs(10));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A flow statistic of node `node`'s datapath (`inspect stats`).
    fn flow_stat(&self, node: usize, stat: &str) -> u64 {
        let a = &self.agents[node];
        let args: Vec<String> = ["inspect", "stats", "-o", "json", "--bpffs-dir"]
            .map(String::from)
            .into_iter()
            .chain([a.pin_dir.display().to_string()])
            .collect();
        let out = a.run_in_node(&args, Duration::from_secs(10));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stats: Value = serde_json::from_slice(&out.stdout).unwrap();
        stats["flows"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|f| f["stat"] == stat)
            .and_then(|f| f["count"].as_u64())
            .unwrap_or(0)
    }

    /// A sample of node `node`'s /metrics: the line starting with `series`.
    fn metric(&self, node: usize, series: &str) -> Option<u64> {
        let (_, body) = self.http(node, "/metrics");
        body.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.parse().ok())
    }
}

const SETTLE: Duration = Duration::from_secs(30);
/// Waits poll often: some of them measure how long a router took.
const POLL: Duration = Duration::from_millis(20);

#[test]
fn routers_learn_every_node_and_etp_local_follows_the_endpoints() {
    let mut s = Sandbox::new(false, &[]);
    s.wait_hops(&[0, 1, 2], SETTLE);
    let (_, seen) =
        quick_request(&s.cluster.client.ns, (LB_IP, 80), Duration::from_secs(2)).expect("LB IP through BGP");
    assert!(
        s.cluster.nodes.iter().any(|n| IpAddr::V4(n.ip()) == seen),
        "eTP=Cluster: masqueraded ({seen})"
    );
    for n in 0..3 {
        // The agents read the sessions back every 2 s.
        poll_until(
            SETTLE,
            POLL,
            "the agent reports the session and its route",
            || {
                s.metric(n, "dataplane_bgp_routes_exported{peer=\"tor\"}") == Some(1)
                    && s.metric(n, "dataplane_bgp_session_up{peer=\"tor\",state=\"Established\"}") == Some(1)
            },
            || s.context(),
        );
        let (code, body) = s.http(n, "/healthz");
        assert_eq!(code, 200);
        let health: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(health["bgp"]["speakerUp"], true, "{body}");
        assert_eq!(health["bgp"]["sessions"][0]["state"], "Established", "{body}");
    }
    // `inspect bgp`, for people and as JSON.
    let table = s.inspect_bgp(0, "table");
    assert!(
        table.contains("speaker: up") && table.contains("Established"),
        "{table}"
    );
    let json: Value = serde_json::from_str(&s.inspect_bgp(0, "json")).unwrap();
    assert_eq!(json["sessions"][0]["peer"], "tor");
    assert_eq!(json["sessions"][0]["exported"], 1);
    // The router carries the advertisement's community.
    let route = s.router.birdc(&format!("show route {LB_ROUTE} all"));
    assert!(route.contains("BGP.community: (64512,100)"), "{route}");

    // eTP=Local: only the node with the endpoint announces; the client's
    // address reaches the pod.
    for o in web(&s.cluster, "Local", &["b"]) {
        s.api().apply(&o);
    }
    s.wait_hops(&[1], SETTLE);
    let (pod, seen) =
        quick_request(&s.cluster.client.ns, (LB_IP, 80), Duration::from_secs(2)).expect("eTP=Local");
    assert_eq!((pod.as_str(), seen), ("b", IpAddr::V4(CLIENT_IP)));
    for o in web(&s.cluster, "Local", &["c"]) {
        s.api().apply(&o);
    }
    s.wait_hops(&[2], SETTLE);
    for o in web(&s.cluster, "Cluster", &["a", "b", "c"]) {
        s.api().apply(&o);
    }
    s.wait_hops(&[0, 1, 2], SETTLE);

    // A peer nobody answers and one that cannot be used: reported, and the
    // good session keeps its routes.
    s.api().apply(&peer("nowhere", "198.18.0.99", ROUTER_ASN, false));
    s.api().apply(&peer("bad", "198.18.0.98", 0, false));
    poll_until(
        SETTLE,
        POLL,
        "the bad peers reported",
        || {
            s.metric(0, "dataplane_bgp_invalid_objects{kind=\"BGPPeer\"}") == Some(1)
                && s.metric(0, "dataplane_bgp_peers") == Some(2)
                && s.http(0, "/healthz").1.contains("\"peer\":\"nowhere\"")
        },
        || s.context(),
    );
    assert!(
        s.api()
            .events()
            .iter()
            .any(|e| e["reason"] == "InvalidSpec" && e["regarding"]["name"] == "bad"),
        "{:?}",
        s.api().events()
    );
    assert_eq!(s.hops(), s.node_ips(&[0, 1, 2]), "the good session is untouched");
    let table = s.inspect_bgp(0, "table");
    assert!(
        table.contains("left out: BGPPeer/bad: peerASN and myASN must be"),
        "{table}"
    );
    assert!(table.contains("nowhere"), "{table}");
    assert_eq!(
        s.metric(0, "dataplane_bgp_session_up{peer=\"tor\",state=\"Established\"}"),
        Some(1)
    );
    s.api().delete("BGPPeer", "", "nowhere");
    s.api().delete("BGPPeer", "", "bad");

    // node3's speaker crashes: its routes go, the agent reports it and
    // keeps serving; the restarted speaker comes back with the routes.
    s.birds[2].kill();
    s.wait_hops(&[0, 1], SETTLE);
    poll_until(
        SETTLE,
        POLL,
        "speaker down reported",
        || s.metric(2, "dataplane_bgp_speaker_up") == Some(0),
        || s.context(),
    );
    let (code, body) = s.http(2, "/healthz");
    assert_eq!(
        code, 200,
        "a missing speaker does not make the node unhealthy: {body}"
    );
    assert!(body.contains("\"speakerUp\":false"), "{body}");
    let node3 = s.cluster.nodes[2].ip();
    quick_request(&s.cluster.client.ns, (node3, 30080), Duration::from_secs(2))
        .expect("node3 still serves its NodePort");
    s.birds[2].restart();
    s.wait_hops(&[0, 1, 2], SETTLE);
    poll_until(
        SETTLE,
        POLL,
        "speaker up again",
        || s.metric(2, "dataplane_bgp_speaker_up") == Some(1),
        || s.context(),
    );

    // The wrong AS for the router: every session fails with BIRD's reason,
    // in /healthz and `inspect bgp`; the right one brings them back.
    s.api()
        .apply(&peer("tor", &CLIENT_IP.to_string(), ROUTER_ASN + 1, false));
    s.wait_hops(&[], SETTLE);
    poll_until(
        SETTLE,
        POLL,
        "the refused session reported with its reason",
        || s.inspect_bgp(0, "table").contains("Bad peer AS"),
        || s.inspect_bgp(0, "table"),
    );
    s.api()
        .apply(&peer("tor", &CLIENT_IP.to_string(), ROUTER_ASN, false));
    s.wait_hops(&[0, 1, 2], SETTLE);

    // Stopping an agent (SIGTERM) withdraws its node's announcements before
    // it exits; its datapath stays attached and keeps serving.
    s.agents[0].stop();
    let log = s.agents[0].log_text();
    assert!(log.contains("BGP announcements withdrawn"), "{log}");
    s.wait_hops(&[1, 2], SETTLE);
    let node1 = s.cluster.nodes[0].ip();
    quick_request(&s.cluster.client.ns, (node1, 30080), Duration::from_secs(2))
        .expect("node1's datapath still serves after its agent stopped");
}

/// Takes node `n` off the LAN without closing anything (its link goes
/// down: no TCP reset, no BGP notification): the router notices through
/// BFD or the hold timer. Returns how long the router took to drop it.
fn lose_node(s: &Sandbox, n: usize) -> Duration {
    let rest: Vec<usize> = (0..3).filter(|&i| i != n).collect();
    s.cluster.nodes[n].ns().ip_batch("link set eth0 down\n");
    s.wait_hops(&rest, SETTLE)
}

#[test]
fn a_lost_node_is_withdrawn_within_a_second_with_bfd() {
    let s = Sandbox::new(true, &[]);
    s.wait_hops(&[0, 1, 2], SETTLE);
    // BFD sessions up on the router before the loss is measured.
    poll_until(
        SETTLE,
        POLL,
        "BFD sessions up",
        || s.router.birdc("show bfd sessions").matches(" Up ").count() == 3,
        || s.router.birdc("show bfd sessions"),
    );
    let with_bfd = lose_node(&s, 0);
    eprintln!(
        "convergence after a node's loss with BFD (100 ms x 3): {} ms",
        with_bfd.as_millis()
    );
    drop(s);
    let s = Sandbox::new(false, &[]);
    s.wait_hops(&[0, 1, 2], SETTLE);
    let without = lose_node(&s, 0);
    eprintln!(
        "convergence after a node's loss without BFD (hold time {HOLD_TIME} s): {} ms",
        without.as_millis()
    );
    assert!(
        with_bfd < without,
        "BFD detects the loss before the hold timer: {with_bfd:?} against {without:?}"
    );
}

/// Opens `n` connections to the LB IP and checks each answers; withdraws
/// node1 (its speaker stops: the router moves its flows, and with
/// hash-threshold ECMP some of the others'), then counts the connections
/// that still answer. Returns (survived, moved): moved is how many flows
/// another node picked up midstream (`ct_midstream_pickup` on node2 and
/// node3: a moved flow's first packet there has no conntrack entry).
fn survivors(s: &mut Sandbox, n: usize) -> (usize, u64) {
    let client = &s.cluster.client.ns;
    let mut conns = Vec::new();
    for _ in 0..n {
        let c = client
            .run(|| TcpStream::connect_timeout(&(LB_IP, 80).into(), Duration::from_secs(2)))
            .expect("connect to the LB IP");
        c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        assert!(exchange(&c), "a new connection answers");
        conns.push(c);
    }
    let pickups = |s: &Sandbox| -> u64 { (1..3).map(|node| s.flow_stat(node, "ct_midstream_pickup")).sum() };
    let before = pickups(s);
    // node1's speaker goes (withdrawn): the sessions close, the router
    // drops its next hop at once; node1's datapath stays.
    s.birds[0].kill();
    s.wait_hops(&[1, 2], SETTLE);
    let survived = conns.iter().filter(|c| exchange(c)).count();
    let moved = pickups(s) - before;
    assert!(
        (n - survived) as u64 <= moved,
        "only moved connections may be lost: {survived}/{n} survived, {moved} moved"
    );
    (survived, moved)
}

fn exchange(c: &TcpStream) -> bool {
    if (&*c).write_all(b"x\n").is_err() {
        return false;
    }
    let mut line = String::new();
    BufReader::new(c).read_line(&mut line).is_ok_and(|n| n > 0)
}

#[test]
fn established_connections_survive_a_node_withdrawal_with_maglev_and_dsr_not_with_snat() {
    const CONNS: usize = 200;
    let mut s = Sandbox::new(false, &["--lb-mode", "dsr", "--lb-algorithm", "maglev"]);
    s.wait_hops(&[0, 1, 2], SETTLE);
    let (dsr, dsr_moved) = survivors(&mut s, CONNS);
    drop(s);
    let mut s = Sandbox::new(false, &["--lb-mode", "snat", "--lb-algorithm", "maglev"]);
    s.wait_hops(&[0, 1, 2], SETTLE);
    let (snat, snat_moved) = survivors(&mut s, CONNS);
    eprintln!(
        "node1 withdrawn: Maglev+DSR {dsr}/{CONNS} connections survive ({dsr_moved} moved to another node); \
         SNAT {snat}/{CONNS} ({snat_moved} moved)"
    );
    assert!(dsr_moved > 0 && snat_moved > 0, "the withdrawal moved flows");
    assert!(
        dsr * 100 >= CONNS * 99,
        "Maglev+DSR: {dsr}/{CONNS} survived, {dsr_moved} moved"
    );
    assert!(
        snat as u64 + snat_moved / 2 <= CONNS as u64,
        "SNAT cannot keep moved flows: {snat}/{CONNS}, {snat_moved} moved"
    );
}

#[test]
fn l2_and_bgp_serve_different_pools_side_by_side() {
    const LEASE_NS: &str = "kube-dataplane";
    let s = Sandbox::new(
        false,
        &[
            "--l2-announce",
            "--lb-lease-namespace",
            LEASE_NS,
            "--l2-lease-duration-seconds",
            "2",
            "--l2-lease-renew-ms",
            "500",
        ],
    );
    s.wait_hops(&[0, 1, 2], SETTLE);
    // The BGP pool is BGP's alone; the LAN pool (on the client's subnet) is
    // announced by L2 and not by BGP.
    let mut bgp_pool = pool("bgp", &[POOL]);
    bgp_pool["spec"]["l2Announce"] = json!(false);
    bgp_pool["spec"]["serviceSelector"] = json!({"matchLabels": {"io.kubernetes.service.name": "web"}});
    s.api().apply(&bgp_pool);
    let mut lan_pool = pool("lan", &["198.18.0.240/29"]);
    lan_pool["spec"]["serviceSelector"] = json!({"matchLabels": {"io.kubernetes.service.name": "lan"}});
    s.api().apply(&lan_pool);
    s.api().apply(
        &json!({"apiVersion": "dataplane.example.com/v1alpha1", "kind": "BGPAdvertisement",
                        "metadata": {"name": "lb"}, "spec": {"pools": ["bgp"]}}),
    );
    let mut lan = service("default/lan", Some(CLASS), &[80]);
    lan["spec"]["clusterIP"] = json!("10.96.0.31");
    lan["spec"]["ports"][0]["nodePort"] = json!(30081);
    s.api().apply(&lan);
    let eps: Vec<(IpAddr, &str, bool)> = ["a", "b"]
        .iter()
        .map(|p| {
            let p = s.cluster.pod(p);
            (p.ip.into(), s.cluster.nodes[p.node].name.as_str(), true)
        })
        .collect();
    s.api()
        .apply(&endpoint_slice("default/lan", 80, TARGET as i32, &eps));
    let lan_ip: Ipv4Addr = "198.18.0.241".parse().unwrap();
    let lease = |ip: Ipv4Addr| {
        s.api().get(
            "Lease",
            LEASE_NS,
            &dataplane_agent::lb::announce::lease_name(&IpAddr::V4(ip)),
        )
    };
    poll_until(
        SETTLE,
        POLL,
        "the LAN address assigned and elected",
        || {
            s.api()
                .get("Service", "default", "lan")
                .is_some_and(|l| l["status"]["loadBalancer"]["ingress"][0]["ip"] == lan_ip.to_string())
                && lease(lan_ip).is_some()
        },
        || s.context(),
    );
    poll_until(
        SETTLE,
        POLL,
        "the LAN address answers through ARP",
        || quick_request(&s.cluster.client.ns, (lan_ip, 80), Duration::from_millis(500)).is_ok(),
        || s.context(),
    );
    // BGP's address is still routed, and nobody holds an L2 lease for it;
    // BGP does not announce the LAN's.
    assert_eq!(s.hops(), s.node_ips(&[0, 1, 2]));
    quick_request(&s.cluster.client.ns, (LB_IP, 80), Duration::from_secs(2)).expect("the BGP address");
    // (An announcer may have taken it before the pool said no: it deletes it.)
    poll_until(
        SETTLE,
        POLL,
        "no L2 lease for a pool with l2Announce: false",
        || lease(LB_IP).is_none(),
        || format!("{:?}", lease(LB_IP)),
    );
    assert!(next_hops(&s.cluster.client.ns, "198.18.0.241/32").is_empty());
    for n in 0..3 {
        assert_eq!(
            s.metric(n, "dataplane_bgp_announced_prefixes"),
            Some(1),
            "{}",
            s.context()
        );
    }
}

/// BIRD parses (`bird -p`) what the agent renders with every option: both
/// families, a port, a password, hold time 0, BFD timers, graceful restart,
/// standard and large communities, local preference, the withdrawal form,
/// and a node without IPv4 (the router ID derived from its name).
#[test]
fn bird_accepts_every_rendered_option() {
    use dataplane_agent::lb::{
        bgp::{bird, plan},
        crd::{BgpAdvertisement, BgpPeer},
        request::ClassFilter,
    };
    let peers: Vec<BgpPeer> = [
        json!({"metadata": {"name": "tor-1.rack-a"}, "spec": {"peerAddress": "192.0.2.1", "peerASN": 64500,
            "myASN": 64512, "port": 1179, "password": "s3cr#t!", "holdTimeSeconds": 0,
            "bfd": {"minRxMs": 50, "minTxMs": 200, "multiplier": 5}, "gracefulRestart": true}}),
        json!({"metadata": {"name": "tor6"}, "spec": {"peerAddress": "2001:db8::1", "peerASN": 4200000000u32,
            "myASN": 4200000000u32}}),
    ]
    .map(|v| serde_json::from_value(v).unwrap())
    .to_vec();
    let ads: Vec<BgpAdvertisement> = [json!({"metadata": {"name": "all"}, "spec": {
        "clusterIPs": true, "externalIPs": true,
        "serviceCIDRs": ["10.96.0.0/12", "fd00:10:96::/112"],
        "communities": ["65535:65281", "4200000000:1:2"], "localPreference": 4294967295u32}})]
    .map(|v| serde_json::from_value(v).unwrap())
    .to_vec();
    let svc = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00:10:96::a"],
                 "externalIPs": ["192.0.2.77", "2001:db8:7::7"], "ports": [{"port": 80}]}
    }))
    .unwrap();
    let classes = ClassFilter {
        class: dataplane_agent::lb::DEFAULT_CLASS.into(),
        default_class: false,
    };
    let p = plan::plan(&plan::Inputs {
        node_name: "node-without-ipv4",
        node: None,
        classes: &classes,
        services: vec![&svc],
        slices: vec![],
        peers: peers.iter().collect(),
        advertisements: ads.iter().collect(),
        pools: vec![],
    });
    assert!(p.problems.is_empty(), "{:?}", p.problems);
    assert_eq!(p.routes.len(), 6, "{:?}", p.routes.keys().collect::<Vec<_>>());
    let dir = BirdDir::new(&unique_prefix());
    for (i, withdraw) in [false, true].into_iter().enumerate() {
        let text = bird::render(&p, "node-without-ipv4", withdraw);
        let path = dir.path().join(format!("{i}.conf"));
        std::fs::write(&path, &text).unwrap();
        let out = std::process::Command::new("bird")
            .arg("-p")
            .arg("-c")
            .arg(&path)
            .output()
            .expect("bird (Debian's bird2; `cargo xtask setup`)");
        assert!(
            out.status.success(),
            "BIRD refuses the rendered configuration: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
