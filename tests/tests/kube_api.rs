//! The agent against an in-process API server speaking list/watch: the maps
//! follow watch events, relists after 410 Gone, resumes after dropped
//! connections, and Warning events are posted for what cannot be done.

use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddrV4, TcpListener},
    time::Duration,
};

use dataplane_agent::k8s::manifests::{Objects, load_text};
use dataplane_tests::{
    agent::{AgentProcess, METRICS_PORT, ManifestEndpoint as Ep, service_yaml},
    cluster::Cluster,
    echo::{TcpClient, tcp_request},
    fake_api::FakeApiServer,
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const NODE_PORT: u16 = 30080;

fn objects(yaml: &str) -> Objects {
    let mut o = Objects::default();
    load_text(yaml, "test", &mut o);
    assert!(o.problems.is_empty(), "{:?}", o.problems);
    o
}

/// The shared sandbox, with this file's helpers.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

fn web(cluster: &Cluster, pods: &[&str]) -> Objects {
    let eps: Vec<Ep> = pods
        .iter()
        .map(|p| {
            let pod = cluster.pod(p);
            Ep::ready(pod.ip, &cluster.nodes[pod.node].name)
        })
        .collect();
    objects(&service_yaml(
        "web",
        "  type: NodePort\n  clusterIP: 10.96.0.10\n",
        80,
        Some(NODE_PORT),
        8080,
        &eps,
    ))
}

fn apply(api: &FakeApiServer, o: &Objects) {
    o.services.iter().for_each(|x| api.apply(x));
    o.slices.iter().for_each(|x| api.apply(x));
    o.nodes.iter().for_each(|x| api.apply(x));
}

impl Sandbox {
    fn web(&self, pods: &[&str]) -> Objects {
        web(&self.cluster, pods)
    }

    fn apply(&self, o: &Objects) {
        apply(self.api(), o);
    }

    fn seen(&self, n: usize) -> BTreeSet<String> {
        let dst = SocketAddrV4::new(self.cluster.nodes[0].ip(), NODE_PORT);
        (0..n)
            .filter_map(|_| {
                tcp_request(&self.cluster.client.ns, dst, "x")
                    .ok()
                    .map(|r| r.server)
            })
            .collect()
    }

    fn eventually(&self, what: &str, check: impl Fn() -> bool) {
        dataplane_tests::poll_until(
            Duration::from_secs(15),
            Duration::from_millis(100),
            what,
            check,
            || self.agents[0].log_text(),
        );
    }
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[test]
fn agent_follows_the_api_through_watch_events_relists_and_reconnects() {
    let s = Sandbox(
        dataplane_tests::sandbox::Sandbox::builder(Cluster::new())
            .pods(&[("a", 0), ("b", 1), ("c", 1)])
            .tcp_echo(8080)
            // The API server listens inside node1, as a real one is reachable from it.
            .api_in_node(0)
            .then(|s| {
                let node = objects(
                    "apiVersion: v1\nkind: Node\nmetadata: {name: node1, labels: {topology.kubernetes.io/zone: z1}}\n",
                );
                apply(s.api(), &node);
                apply(s.api(), &web(&s.cluster, &["a", "b"]));
            })
            .agents(1, |s, i| s.start_agent_on_api(BIN, i, &[])),
    );
    assert_eq!(s.seen(30), set(&["a", "b"]), "programmed from the initial lists");

    // A watch event.
    s.apply(&s.web(&["a"]));
    s.eventually("only a after a MODIFIED event", || s.seen(8) == set(&["a"]));

    // 410 Gone: the agent must relist; the change made meanwhile shows up.
    let lists_before = s.api().lists("endpointslices");
    s.api().expire_watches();
    s.apply(&s.web(&["a", "c"]));
    s.eventually("c after the relist", || s.seen(20).contains("c"));
    assert!(
        s.api().lists("endpointslices") > lists_before,
        "410 made the agent relist"
    );

    // A dropped connection: the agent resumes the watch.
    s.api().bookmark();
    s.api().drop_connections();
    s.apply(&s.web(&["b"]));
    s.eventually("only b after the watch resumed", || s.seen(8) == set(&["b"]));

    // Something that cannot be done gets a Warning event; the rest works.
    let port_taken = s.cluster.nodes[0]
        .ns()
        .run(|| TcpListener::bind("0.0.0.0:32000"))
        .expect("occupy the health check port");
    let lb = objects(
        "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: default}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.20\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  externalIPs: [not-an-ip]\n  ports: [{name: p, port: 80, nodePort: 30090}]\n",
    );
    s.apply(&lb);
    s.eventually("Warning events posted", || {
        let reasons: BTreeSet<String> = s
            .api()
            .events()
            .iter()
            .filter_map(|e| e["reason"].as_str().map(str::to_owned))
            .collect();
        reasons.contains("FailedToStartServiceHealthcheck") && reasons.contains("FailedToProgramService")
    });
    let event = s
        .api()
        .events()
        .into_iter()
        .find(|e| e["reason"] == "FailedToStartServiceHealthcheck")
        .unwrap();
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["regarding"]["name"], "lb");
    assert_eq!(s.seen(8), set(&["b"]), "the other Service keeps working");
    drop(port_taken);

    // Deleted through the API: gone from the datapath.
    s.api().delete("Service", "default", "web");
    let dst = SocketAddrV4::new(s.cluster.nodes[0].ip(), NODE_PORT);
    s.eventually("the deleted Service is gone", || {
        TcpClient::connect(&s.cluster.client.ns, dst).is_err_and(|e| e.kind() == ErrorKind::ConnectionRefused)
    });
}

/// The sum of agent `node`'s `dataplane_packets_total` samples for `event`
/// (every hook).
fn packets(cluster: &Cluster, node: usize, event: &str) -> u64 {
    metric_lines(cluster, node)
        .iter()
        .filter(|l| l.starts_with("dataplane_packets_total{") && l.contains(&format!("event=\"{event}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Agent `node`'s `/metrics` lines.
fn metric_lines(cluster: &Cluster, node: usize) -> Vec<String> {
    let n = &cluster.nodes[node];
    let (status, body) = AgentProcess::http_get(n.ns(), SocketAddrV4::new(n.ip(), METRICS_PORT), "/metrics")
        .unwrap_or_else(|e| panic!("metrics of node {node}: {e}"));
    assert_eq!(status, 200, "metrics of node {node}: {body}");
    body.lines().map(str::to_owned).collect()
}

/// The sample `name` (with its labels) of agent `node` (0 when absent).
fn metric(cluster: &Cluster, node: usize, name: &str) -> u64 {
    metric_lines(cluster, node)
        .iter()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// The IPv4 service CIDRs agent `node` enforces.
fn ipv4_service_cidrs(cluster: &Cluster, node: usize) -> u64 {
    metric(cluster, node, "dataplane_service_cidrs{family=\"ipv4\"}")
}

fn service_cidr(name: &str, cidrs: &str) -> k8s_openapi::api::networking::v1::ServiceCIDR {
    let mut o = objects(&format!(
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: {name}}}\nspec: {{cidrs: [{cidrs}]}}\n"
    ));
    o.service_cidrs.pop().expect("a ServiceCIDR")
}

#[test]
fn service_cidr_objects_added_and_deleted_at_run_time_drop_unallocated_addresses() {
    let s = Sandbox(
        dataplane_tests::sandbox::Sandbox::builder(Cluster::new())
            .pods(&[("a", 0)])
            .tcp_echo(8080)
            .api_in_node(0)
            .then(|s| {
                apply(
                    s.api(),
                    &objects("apiVersion: v1\nkind: Node\nmetadata: {name: node1}\n"),
                );
                apply(s.api(), &web(&s.cluster, &["a"]));
            })
            // No --service-cidr: the ServiceCIDR objects are all there is.
            .agents(1, |s, i| {
                s.cluster.start_agent_omitting(
                    BIN,
                    i,
                    "kubernetes",
                    &["--k8s-api-server", &s.api().url()],
                    &["--service-cidr"],
                )
            }),
    );
    // The client reaches the service range through node1, as an upstream
    // router would route it.
    s.cluster.route_from_client("10.96.0.0/16", 0);
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
    let unallocated = SocketAddrV4::new(Ipv4Addr::new(10, 96, 9, 9), 80);
    let dropped = || packets(&s.cluster, 0, "drop_unallocated_service_ip");
    let answered = || tcp_request(&s.cluster.client.ns, cluster_ip, "x").map(|r| r.server);

    // Not in a service CIDR yet: the node's stack has the packet, and no
    // route for it (it says so at once).
    assert_eq!(answered().expect("the ClusterIP answers"), "a");
    assert_eq!(ipv4_service_cidrs(&s.cluster, 0), 0);
    let before = dropped();
    let err = TcpClient::connect(&s.cluster.client.ns, unallocated).expect_err("nothing listens there");
    assert_ne!(err.kind(), ErrorKind::TimedOut, "not dropped: {err}");
    assert_eq!(dropped(), before, "not counted as unallocated");

    // A ServiceCIDR added at run time: its unallocated addresses are dropped.
    s.api().apply(&service_cidr("kubernetes", "10.96.0.0/16"));
    s.eventually("the ServiceCIDR in force", || {
        ipv4_service_cidrs(&s.cluster, 0) == 1
    });
    let err = TcpClient::connect(&s.cluster.client.ns, unallocated).expect_err("dropped");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "dropped: {err}");
    assert!(dropped() > before, "counted as an unallocated service address");
    assert_eq!(answered().expect("the allocated ClusterIP keeps answering"), "a");

    // An invalid object is skipped and counted; more CIDRs than the
    // datapath holds: the first 4 by name are kept (kubernetes < more-*),
    // the rest counted. The drops go on.
    s.api().apply(&service_cidr("bad", "not-a-cidr"));
    for i in 1..=4 {
        s.api().apply(&service_cidr(
            &format!("more-{i}"),
            &format!("10.{}.0.0/16", 96 + i),
        ));
    }
    s.eventually("4 in force, 1 over the limit, 1 invalid", || {
        ipv4_service_cidrs(&s.cluster, 0) == 4
            && metric(&s.cluster, 0, "dataplane_service_cidrs_over_limit") == 1
            && metric(&s.cluster, 0, "dataplane_invalid_service_cidrs_total") == 1
    });
    let before = dropped();
    let err = TcpClient::connect(&s.cluster.client.ns, unallocated).expect_err("dropped");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "dropped: {err}");
    assert!(dropped() > before);
    for name in ["bad", "more-1", "more-2", "more-3", "more-4"] {
        s.api().delete("ServiceCIDR", "", name);
    }

    // Deleted: the address is no longer dropped as unallocated.
    s.api().delete("ServiceCIDR", "", "kubernetes");
    s.eventually("the ServiceCIDR gone", || ipv4_service_cidrs(&s.cluster, 0) == 0);
    let before = dropped();
    let err = TcpClient::connect(&s.cluster.client.ns, unallocated).expect_err("nothing listens there");
    assert_ne!(err.kind(), ErrorKind::TimedOut, "not dropped: {err}");
    assert_eq!(dropped(), before, "not counted as unallocated");
    assert_eq!(answered().expect("the ClusterIP answers"), "a");
}
