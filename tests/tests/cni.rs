//! The agent on the nodes people have: CNI layouts found without
//! configuration. Each test builds a sandbox whose nodes' external device is
//! a veth with no XDP on its peer (kind-like, [`Wiring::VethNode`]) and whose
//! pods are wired as one CNI would ([`PodLayout`]); the agents run with no
//! `--pod-interfaces`, and every Service path must work: ClusterIP from a pod
//! and from the host, NodePort, LoadBalancer with eTP=Local and
//! eTP=Cluster, reject without endpoints, hairpin. A local endpoint that no
//! pod interface reaches is named in the log, a metric and /healthz.

use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddrV4},
};

use dataplane_tests::{
    agent::{AgentProcess, HEALTH_PORT, METRICS_PORT, ManifestDir, ManifestEndpoint as Ep, service_yaml},
    cgroup::{CgroupDir, MountPoint, at_system_mount, cgroup2_root, mount_cgroup2_command},
    cluster::{Cluster, EXTERNAL_DEVICE, POD_BRIDGE, PodLayout, Wiring},
    echo::{TcpClient, sockclient, tcp_request},
    services::EXTERNAL_VIP_RANGE,
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const TARGET: u16 = 8080;
const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const HAIRPIN: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 12);
const WEB_NODE_PORT: u16 = 30080;
const EMPTY_NODE_PORT: u16 = 30081;
const LB_LOCAL: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const LB_CLUSTER: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
/// A local endpoint (nodeName node1) to which node1 has no route.
const NOWHERE: Ipv4Addr = Ipv4Addr::new(10, 244, 3, 7);

fn with_lb_ip(yaml: String, ip: Ipv4Addr) -> String {
    yaml.replacen(
        "---\n",
        &format!("status: {{loadBalancer: {{ingress: [{{ip: {ip}}}]}}}}\n---\n"),
        1,
    )
}

fn manifests(c: &Cluster) -> String {
    let ep = |pod: &str| {
        let p = c.pod(pod);
        Ep::ready(p.ip, &c.nodes[p.node].name)
    };
    let np = |ip: Ipv4Addr| format!("  type: NodePort\n  clusterIP: {ip}\n");
    let lb = |ip: Ipv4Addr, etp: &str| {
        format!("  type: LoadBalancer\n  clusterIP: {ip}\n  externalTrafficPolicy: {etp}\n")
    };
    [
        service_yaml(
            "web",
            &np(WEB),
            80,
            Some(WEB_NODE_PORT),
            TARGET,
            &[ep("a"), ep("b")],
        ),
        service_yaml("empty", &np(EMPTY), 80, Some(EMPTY_NODE_PORT), TARGET, &[]),
        service_yaml(
            "self",
            &format!("  clusterIP: {HAIRPIN}\n"),
            80,
            None,
            TARGET,
            &[ep("client")],
        ),
        with_lb_ip(
            service_yaml(
                "lb-local",
                &lb(Ipv4Addr::new(10, 96, 0, 20), "Local"),
                80,
                Some(30090),
                TARGET,
                &[ep("a"), ep("b")],
            ),
            LB_LOCAL,
        ),
        // Only a local backend: every flow's replies come back through a
        // pod interface (untranslated replies would time out).
        with_lb_ip(
            service_yaml(
                "lb-cluster",
                &lb(Ipv4Addr::new(10, 96, 0, 21), "Cluster"),
                80,
                Some(30091),
                TARGET,
                &[ep("a")],
            ),
            LB_CLUSTER,
        ),
        service_yaml(
            "ghost",
            "  clusterIP: 10.96.0.13\n",
            80,
            None,
            TARGET,
            &[Ep::ready(NOWHERE, "node1")],
        ),
    ]
    .join("---\n")
}

/// The shared sandbox, with this file's helpers.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

impl Sandbox {
    /// Pods "client" and "a" on node1, "b" on node2, echo servers on all
    /// three, an agent per node with no `--pod-interfaces`, connect-time
    /// translation on the node's cgroup, and `extra` flags.
    fn with_args(layout: PodLayout, extra: &[&str]) -> Self {
        Self::with_agents(layout, 2, |cluster, i, dir| {
            let cgroup = cluster.nodes[i].cgroup.path();
            let mut args = vec!["--cgroup-path", cgroup.to_str().unwrap()];
            args.extend(extra);
            cluster.start_agent(BIN, i, dir, &args)
        })
    }

    /// The same sandbox with agents on the first `agents` nodes, each
    /// started by `start`.
    fn with_agents(
        layout: PodLayout,
        agents: usize,
        start: impl Fn(&Cluster, usize, &ManifestDir) -> AgentProcess,
    ) -> Self {
        Self(
            dataplane_tests::sandbox::Sandbox::builder(Cluster::with_layout(Wiring::VethNode, layout))
                .pods(&[("client", 0), ("a", 0), ("b", 1)])
                .tcp_echo(TARGET)
                .manifest("services.yaml", manifests)
                .route_from_client(EXTERNAL_VIP_RANGE, 0)
                .agents(agents, |s, i| start(&s.cluster, i, s.manifests())),
        )
    }

    fn ip(&self, pod: &str) -> Ipv4Addr {
        self.cluster.pod(pod).ip
    }

    /// (server, source address it saw) of `n` requests from `pod` (or the
    /// external client when `None`) to `dst`.
    fn seen(&self, from: Option<&str>, dst: SocketAddrV4, n: usize) -> BTreeSet<(String, std::net::IpAddr)> {
        let ns = from.map_or(&self.cluster.client.ns, |p| &self.cluster.pod(p).ns);
        (0..n)
            .map(|i| {
                let r = tcp_request(ns, dst, "x").unwrap_or_else(|e| {
                    panic!(
                        "request {i} from {from:?} to {dst}: {e}\n{}\n{}\n{}",
                        self.stats(),
                        self.inspect("conntrack"),
                        self.logs()
                    )
                });
                (r.server, r.peer.ip())
            })
            .collect()
    }

    fn refused(&self, from: Option<&str>, dst: SocketAddrV4) {
        let ns = from.map_or(&self.cluster.client.ns, |p| &self.cluster.pod(p).ns);
        let err = tcp_request(ns, dst, "x").expect_err("a Service without endpoints");
        assert_eq!(
            err.kind(),
            ErrorKind::ConnectionRefused,
            "rejected (ICMP port unreachable), from {from:?} to {dst}: {err}\n{}",
            self.logs()
        );
    }

    /// A host process of node1 (its network namespace and cgroup) to `dst`:
    /// (peer its socket reports, reply).
    fn host_request(&self, dst: SocketAddrV4) -> (String, String) {
        let n = &self.cluster.nodes[0];
        sockclient(
            env!("CARGO_BIN_EXE_sockclient"),
            &n.ns().path(),
            &n.cgroup.procs(),
            "tcp",
            dst,
        )
        .unwrap_or_else(|e| panic!("host process to {dst}: {e}\n{}\n{}", self.stats(), self.logs()))
    }

    /// node1's `inspect stats`, for failure messages.
    fn stats(&self) -> String {
        self.inspect("stats")
    }

    /// One of node1's flow counters (`inspect -o json stats`).
    fn flow_stat(&self, name: &str) -> u64 {
        let stats: serde_json::Value = serde_json::from_str(&self.inspect_args(&["-o", "json", "stats"]))
            .unwrap_or_else(|e| panic!("inspect stats: {e}"));
        stats["flows"]
            .as_array()
            .unwrap_or_else(|| panic!("no flows in {stats}"))
            .iter()
            .find(|f| f["stat"] == name)
            .and_then(|f| f["count"].as_u64())
            .unwrap_or_else(|| panic!("no {name} in {stats}"))
    }

    /// node1's packets translated where they entered (DNAT, un-SNAT).
    fn ingress_translated(&self) -> u64 {
        let stats: serde_json::Value = serde_json::from_str(&self.inspect_args(&["-o", "json", "stats"]))
            .unwrap_or_else(|e| panic!("inspect stats: {e}"));
        stats["events"]
            .as_array()
            .unwrap_or_else(|| panic!("no events in {stats}"))
            .iter()
            .filter(|e| {
                ["tc_ingress", "tc_pod_ingress"].contains(&e["hook"].as_str().unwrap_or(""))
                    && ["new_flow", "established", "reply"].contains(&e["event"].as_str().unwrap_or(""))
            })
            .map(|e| e["packets"].as_u64().unwrap_or(0))
            .sum()
    }

    /// node1's `inspect <what>`, for failure messages.
    fn inspect(&self, what: &str) -> String {
        self.inspect_args(&[what])
    }

    fn inspect_args(&self, args: &[&str]) -> String {
        let out = std::process::Command::new(BIN)
            .arg("inspect")
            .arg("--bpffs-dir")
            .arg(self.cluster.bpffs.path().join("node1"))
            .args(args)
            .output()
            .expect("run inspect");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn node_get(&self, port: u16, path: &str) -> (u16, String) {
        let n = &self.cluster.nodes[0];
        AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), port), path).expect("agent's HTTP server")
    }
}

fn pairs(v: &[(&str, Ipv4Addr)]) -> BTreeSet<(String, std::net::IpAddr)> {
    v.iter().map(|(s, ip)| (s.to_string(), (*ip).into())).collect()
}

fn every_service_path_works(layout: PodLayout) -> Sandbox {
    every_service_path_works_with(layout, &[])
}

fn every_service_path_works_with(layout: PodLayout, extra: &[&str]) -> Sandbox {
    let s = Sandbox::with_args(layout, extra);
    let node1 = s.cluster.nodes[0].ip();
    let client_pod = s.ip("client");

    // ClusterIP from a pod: both backends, the pod's own address kept.
    let web = SocketAddrV4::new(WEB, 80);
    assert_eq!(
        s.seen(Some("client"), web, 30),
        pairs(&[("a", client_pod), ("b", client_pod)])
    );
    // ClusterIP from the host: translated at connect(); the socket sees
    // the Service address.
    let (peer, reply) = s.host_request(web);
    assert_eq!(peer, web.to_string());
    assert!(reply.starts_with('a') || reply.starts_with('b'), "{reply}");
    // NodePort (eTP=Cluster): both backends, masqueraded to the node.
    assert_eq!(
        s.seen(None, SocketAddrV4::new(node1, WEB_NODE_PORT), 30),
        pairs(&[("a", node1), ("b", node1)])
    );
    // LB eTP=Local: the local backend only, the client's address kept.
    assert_eq!(
        s.seen(None, SocketAddrV4::new(LB_LOCAL, 80), 10),
        pairs(&[("a", s.cluster.client.ip)])
    );
    // LB eTP=Cluster to a local backend: masqueraded, replies come back
    // through the pod interface.
    assert_eq!(
        s.seen(None, SocketAddrV4::new(LB_CLUSTER, 80), 10),
        pairs(&[("a", node1)])
    );
    // One client port to two frontends of backend a, one flow masqueraded
    // and one not, the first closed (its tuple lingers) when the second
    // opens: each is translated as itself, in either order.
    // The ports are below the ephemeral range (32768-60999), so no earlier
    // connection of this test can hold them: bind(2) would refuse a port
    // whose earlier socket (in TIME_WAIT, say) did not set SO_REUSEADDR.
    let client = s.cluster.client.ip;
    let (masqueraded, kept) = ((LB_CLUSTER, node1), (LB_LOCAL, client));
    for (port, flows) in [(27000, [masqueraded, kept]), (27001, [kept, masqueraded])] {
        for (dst, seen) in flows {
            let r = TcpClient::connect_from_port(&s.cluster.client.ns, port, SocketAddrV4::new(dst, 80))
                .and_then(|mut c| c.request("x"))
                .unwrap_or_else(|e| panic!("from port {port} to {dst}: {e}\n{}\n{}", s.stats(), s.logs()));
            assert_eq!(
                (r.server.as_str(), r.peer.ip()),
                ("a", seen.into()),
                "port {port} to {dst}"
            );
        }
    }
    // No endpoints: rejected, from a pod and from outside.
    s.refused(Some("client"), SocketAddrV4::new(EMPTY, 80));
    s.refused(None, SocketAddrV4::new(node1, EMPTY_NODE_PORT));
    // Hairpin: the client reaches itself through its Service, masqueraded.
    let hairpin = s.seen(Some("client"), SocketAddrV4::new(HAIRPIN, 80), 5);
    assert_eq!(hairpin.len(), 1, "{hairpin:?}");
    let (server, peer) = hairpin.into_iter().next().unwrap();
    assert_eq!(server, "client");
    assert_ne!(peer, client_pod, "hairpin flows are masqueraded");

    // Why each pod interface was attached, in the log and in `inspect`.
    let log = s.agents[0].log_text();
    let ours: Vec<&str> = s
        .cluster
        .pods
        .iter()
        .filter(|p| p.node == 0)
        .map(|p| p.host_veth.as_str())
        .collect();
    for veth in &ours {
        let line = log
            .lines()
            .find(|l| l.contains("attached to pod interface") && l.contains(&format!("interface={veth} ")))
            .unwrap_or_else(|| panic!("no attach line for {veth}:\n{log}"));
        let why = match layout {
            PodLayout::Bridge => format!("port of bridge {POD_BRIDGE}, which holds 10.244.1.1/24"),
            _ => format!(
                "route {}/32 leads through it",
                s.cluster.pods.iter().find(|p| p.host_veth == *veth).unwrap().ip
            ),
        };
        assert!(line.contains(&why), "{line}");
    }
    let n = &s.cluster.nodes[0];
    let out = n
        .ns()
        .command(BIN)
        .arg("inspect")
        .arg("--bpffs-dir")
        .arg(s.cluster.bpffs.path().join(&n.name))
        .args([
            "-o",
            "json",
            "interfaces",
            "--health-address",
            &format!("{}:{HEALTH_PORT}", n.ip()),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let devices = v["devices"].as_array().unwrap();
    let device = |name: &str| {
        devices
            .iter()
            .find(|d| d["device"] == name)
            .unwrap_or_else(|| panic!("{name} in {v}"))
    };
    let eth0 = device(EXTERNAL_DEVICE);
    assert_eq!(eth0["role"], "external");
    assert_eq!(eth0["why"], format!("holds node IP {node1}").as_str());
    let hooks: Vec<&str> = eth0["hooks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["hook"].as_str().unwrap())
        .collect();
    assert_eq!(
        hooks,
        ["tc_egress", "tc_ingress"],
        "a veth node: the ingress path runs in TC"
    );
    for veth in &ours {
        let d = device(veth);
        assert_eq!(d["role"], "pod", "{d}");
        assert!(d["ifindex"].as_u64().is_some(), "{d}");
        let hooks = d["hooks"].as_array().unwrap();
        assert_eq!(hooks.len(), 2, "{d}");
        assert!(
            hooks
                .iter()
                .all(|h| h["linkId"].as_u64().is_some() && h["mode"] == "TC (TCX)"),
            "{d}"
        );
        assert!(d["why"].as_str().is_some_and(|w| !w.is_empty()), "{d}");
    }
    assert_eq!(v["discovery"], "routes and bridges");
    let out = n
        .ns()
        .command(BIN)
        .arg("inspect")
        .arg("--bpffs-dir")
        .arg(s.cluster.bpffs.path().join(&n.name))
        .args([
            "interfaces",
            "--health-address",
            &format!("{}:{HEALTH_PORT}", n.ip()),
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    for veth in &ours {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(veth) && l.contains(" pod ") && l.contains("TC (TCX)")),
            "{table}"
        );
    }
    assert!(
        table.contains(&format!("WARNING: local endpoint {NOWHERE} (default/ghost:p)")),
        "{table}"
    );

    // The local endpoint node1 has no route to: log, metric, /healthz.
    assert!(
        log.contains(&format!("endpoint={NOWHERE}"))
            && log.contains("local endpoint is not reachable through any pod interface"),
        "{log}"
    );
    let (status, body) = s.node_get(HEALTH_PORT, "/healthz");
    assert_eq!(status, 200, "kube-proxy's status code: {body}");
    let h: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        h["unreachableLocalEndpoints"][0]["address"],
        NOWHERE.to_string().as_str(),
        "{body}"
    );
    assert_eq!(
        h["unreachableLocalEndpoints"].as_array().unwrap().len(),
        1,
        "{body}"
    );
    let (_, metrics) = s.node_get(METRICS_PORT, "/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l == "dataplane_unreachable_local_endpoints 1"),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l == format!("dataplane_pod_interfaces {}", ours.len())),
        "{metrics}"
    );
    assert_eq!(
        v["unreachableLocalEndpoints"][0]["address"],
        NOWHERE.to_string().as_str()
    );
    // node2's only local endpoint (b) is reachable.
    let n2 = &s.cluster.nodes[1];
    let (_, body) =
        AgentProcess::http_get(n2.ns(), SocketAddrV4::new(n2.ip(), HEALTH_PORT), "/healthz").unwrap();
    assert!(!body.contains("unreachable"), "{body}");
    s
}

#[test]
fn routed_cni_with_unusual_interface_names() {
    let s = every_service_path_works(PodLayout::RoutedUnusualNames);
    assert_eq!(s.flow_stat("host_routed"), 0, "host routing is opt-in");
}

#[test]
fn bridge_cni() {
    every_service_path_works(PodLayout::Bridge);
}

/// Host routing: every path works as through the stack, and the translated
/// packets went straight to their route's device (the pod's interface, the
/// bridge, the node's uplink).
#[test]
fn host_routing_serves_every_path() {
    for layout in [PodLayout::RoutedUnusualNames, PodLayout::Bridge] {
        let s = every_service_path_works_with(layout, &["--host-routing"]);
        // Every packet translated on its way in, but for the few that met
        // an unresolved neighbour or a local destination.
        let translated = s.ingress_translated();
        let routed = s.flow_stat("host_routed");
        assert!(
            routed <= translated && routed * 10 >= translated * 9,
            "{layout:?}: {routed} of {translated} routed\n{}",
            s.stats()
        );
    }
}

/// The old default patterns on a CNI whose names they miss: nothing is
/// attached, and the miswiring names itself (log, /healthz, metric) instead
/// of silently leaving pods' Service traffic untranslated.
#[test]
fn a_pattern_that_misses_the_pods_names_itself() {
    let s = Sandbox::with_args(
        PodLayout::RoutedUnusualNames,
        &["--pod-interfaces", "veth*,cali*"],
    );
    let log = s.agents[0].log_text();
    assert!(!log.contains("attached to pod interface"), "{log}");
    assert!(log.contains("--pod-interfaces given, discovery is off"), "{log}");
    let (status, body) = s.node_get(HEALTH_PORT, "/healthz");
    assert_eq!(status, 200, "{body}");
    let h: serde_json::Value = serde_json::from_str(&body).unwrap();
    let unreachable: BTreeSet<&str> = h["unreachableLocalEndpoints"]
        .as_array()
        .unwrap_or_else(|| panic!("{body}"))
        .iter()
        .map(|u| u["address"].as_str().unwrap())
        .collect();
    let (client, a) = (s.ip("client").to_string(), s.ip("a").to_string());
    let nowhere = NOWHERE.to_string();
    assert_eq!(
        unreachable,
        BTreeSet::from([client.as_str(), a.as_str(), nowhere.as_str()]),
        "every local endpoint: {body}"
    );
    for pod in [&client, &a] {
        assert!(
            log.lines()
                .any(|l| l.contains("local endpoint is not reachable")
                    && l.contains(&format!("endpoint={pod} "))),
            "{log}"
        );
    }
    let (_, metrics) = s.node_get(METRICS_PORT, "/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l == "dataplane_unreachable_local_endpoints 3"),
        "{metrics}"
    );
    assert!(
        metrics.lines().any(|l| l == "dataplane_pod_interfaces 0"),
        "{metrics}"
    );
}

/// A node where a stray cgroup2 mount (a test harness's leftover, say) comes
/// before the system's in /proc/mounts: the agent, given no `--cgroup-path`,
/// chooses the system's, says so, and host processes in it are translated
/// at connect(). Both mounts exist only in the agent's private mount
/// namespace and neither is the machine's root cgroup: the system's place
/// holds node1's cgroup, the stray mount a sibling cgroup (bind mounts).
#[test]
fn without_a_cgroup_path_the_agent_passes_over_a_stray_cgroup2_mount() {
    let stray_cgroup = CgroupDir::new(&format!("{}-stray", dataplane_tests::unique_prefix()));
    let stray = std::cell::OnceCell::new();
    let s = Sandbox::with_agents(PodLayout::RoutedUnusualNames, 1, |cluster, i, dir| {
        let whole = MountPoint::new(cluster.prefix(), "cgroup2-whole");
        let stray = stray.get_or_init(|| MountPoint::new(cluster.prefix(), "stray-cgroup2"));
        let root = cgroup2_root();
        let within =
            |cg: &std::path::Path| whole.path().join(cg.strip_prefix(&root).expect("under the root"));
        let node_cgroup = within(cluster.nodes[i].cgroup.path());
        let mounts = [
            // The whole hierarchy, to bind cgroups from; gone before the
            // agent starts.
            mount_cgroup2_command(whole.path()),
            format!(
                "mount --bind '{}' '{}'",
                within(stray_cgroup.path()).display(),
                stray.path().display()
            ),
            at_system_mount(|at| format!("mount --bind '{}' '{}'", node_cgroup.display(), at.display())),
            format!("umount '{}'", whole.path().display()),
        ]
        .join("\n");
        cluster.start_agent_with_mounts(BIN, i, dir, &[], &mounts)
    });
    let log = s.logs();
    let root = cgroup2_root();
    let stray = stray.get().expect("the agent was started");
    let chose = log
        .lines()
        .find(|l| l.contains("chose the cgroup v2 mount"))
        .unwrap_or_else(|| panic!("no line on the cgroup v2 mount chosen:\n{log}"));
    assert!(
        chose.contains(&format!("cgroup={}", root.display()))
            && chose.contains(&stray.path().display().to_string()),
        "{} chosen, the stray {} passed over: {chose}",
        root.display(),
        stray.path().display()
    );
    assert!(
        log.contains(&format!("cgroup={} ", root.display()))
            && log.contains("attached connect-time translation"),
        "{log}"
    );
    // Attached where the system's mount is (node1's cgroup here): a host
    // process there reaches the Service and sees its address.
    let web = SocketAddrV4::new(WEB, 80);
    let (peer, reply) = s.host_request(web);
    assert_eq!(peer, web.to_string());
    assert!(reply.starts_with('a') || reply.starts_with('b'), "{reply}");
}
