//! The sandbox demo behind `cargo xtask demo`: a two-node cluster in network
//! namespaces, the agent running on each node from example manifests, and
//! real requests showing what the dataplane does. Nothing outside the
//! sandbox is touched; everything is removed on exit or Ctrl-C.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Instant,
};

use dataplane_tests::{
    agent::{ManifestDir, ManifestEndpoint as Ep, service_yaml},
    cleanup_on_signal,
    cluster::Cluster,
    echo::{HttpServer, TcpClient, http_get},
    services::EXTERNAL_VIP_RANGE,
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("usage: cargo xtask demo [-- --keep]\n");
        println!("Builds a two-node cluster in network namespaces, runs the agent on each node, sends real");
        println!(
            "requests through the dataplane and prints what happened. Needs root. Leaves nothing behind,"
        );
        println!("unless --keep: then the sandbox stays up until Ctrl-C, with commands to poke at it.");
        return;
    }
    let keep = args.iter().any(|a| a == "--keep");
    let agent_bin = std::env::current_exe().expect("own path").with_file_name("agent");
    assert!(
        agent_bin.exists(),
        "{} is missing: run through `cargo xtask demo`",
        agent_bin.display()
    );
    let agent_bin = agent_bin.to_str().unwrap().to_owned();
    cleanup_on_signal();

    let mut cluster = Cluster::new();
    for (name, node) in [("web-a", 0), ("web-b", 1), ("tester", 0)] {
        cluster.add_pod(node, name);
    }
    let servers: Vec<HttpServer> = ["web-a", "web-b"]
        .iter()
        .map(|n| {
            let p = cluster.pod(n);
            HttpServer::start(&p.ns, n, SocketAddrV4::new(p.ip, 8080))
        })
        .collect();
    cluster.route_from_client(EXTERNAL_VIP_RANGE, 0);
    let ep = |pod: &str| {
        let p = cluster.pod(pod);
        Ep::ready(p.ip, &cluster.nodes[p.node].name)
    };
    let manifests = ManifestDir::new(cluster.prefix());
    manifests.write(
        "web.yaml",
        &service_yaml(
            "web",
            &format!("  type: NodePort\n  clusterIP: {CLUSTER_IP}\n"),
            80,
            Some(30080),
            8080,
            &[ep("web-a"), ep("web-b")],
        ),
    );
    // The LoadBalancer's ingress IP goes in the Service's status.
    let web_local = service_yaml(
        "web-local",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.11\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n",
        80,
        Some(30081),
        8080,
        &[ep("web-a")],
    )
    .replacen(
        "---\n",
        &format!("status: {{loadBalancer: {{ingress: [{{ip: {LB_IP}}}]}}}}\n---\n"),
        1,
    );
    manifests.write("web-local.yaml", &web_local);
    manifests.write(
        "empty.yaml",
        &service_yaml(
            "empty",
            &format!("  clusterIP: {EMPTY_IP}\n"),
            80,
            None,
            8080,
            &[],
        ),
    );
    println!(
        "sandbox {} (network namespaces; the machine's own network is untouched)",
        cluster.prefix()
    );
    println!(
        "  external client {}   node1 {}   node2 {}",
        cluster.client.ip,
        cluster.nodes[0].ip(),
        cluster.nodes[1].ip()
    );
    for p in &cluster.pods {
        println!(
            "  pod {:<7} {:<12} on {}",
            p.name, p.ip, cluster.nodes[p.node].name
        );
    }
    let started = Instant::now();
    let agents: Vec<_> = (0..2)
        .map(|i| cluster.start_agent(&agent_bin, i, &manifests, &[]))
        .collect();
    println!(
        "agents running on node1 and node2, synced in {:.1} s (Services: web, web-local, empty)\n",
        started.elapsed().as_secs_f64()
    );

    let tester = &cluster.pod("tester").ns;
    let show = |what: &str, r: std::io::Result<String>| match r {
        Ok(body) => println!("  {what:<46} -> {body}"),
        Err(e) => println!("  {what:<46} -> error: {e}"),
    };
    println!("ClusterIP {CLUSTER_IP}:80 from pod tester (no SNAT: the backend sees the pod):");
    for _ in 0..4 {
        show(
            "GET http://10.96.0.10/",
            http_get(tester, SocketAddrV4::new(CLUSTER_IP, 80)),
        );
    }
    println!("NodePort 30080 from the external client (eTP=Cluster: SNAT to the node):");
    for node in &cluster.nodes {
        let dst = SocketAddrV4::new(node.ip(), 30080);
        show(&format!("GET http://{dst}/"), http_get(&cluster.client.ns, dst));
    }
    println!("LoadBalancer {LB_IP} with externalTrafficPolicy: Local (the client address is kept):");
    show(
        &format!("GET http://{LB_IP}/"),
        http_get(&cluster.client.ns, SocketAddrV4::new(LB_IP, 80)),
    );
    println!("Service without endpoints ({EMPTY_IP}:80), from pod tester:");
    let t = Instant::now();
    match TcpClient::connect(tester, SocketAddrV4::new(EMPTY_IP, 80)) {
        Ok(_) => println!("  connect                                        -> unexpectedly connected"),
        Err(e) => println!(
            "  connect                                        -> {e} after {:.1} ms (ICMP port-unreachable)",
            t.elapsed().as_secs_f64() * 1000.0
        ),
    }
    let inspect = std::process::Command::new(&agent_bin)
        .arg("inspect")
        .arg("--bpffs-dir")
        .arg(cluster.bpffs.path().join("node1"))
        .arg("services")
        .output()
        .expect("inspect");
    println!(
        "\ndataplane-agent inspect services (node1):\n{}",
        String::from_utf8_lossy(&inspect.stdout)
    );

    if keep {
        let n1 = cluster.nodes[0].ns().name().to_owned();
        println!("The sandbox stays up; Ctrl-C removes it. Try:");
        println!(
            "  ip netns exec {} {agent_bin} inspect --bpffs-dir {}/node1 conntrack",
            n1,
            cluster.bpffs.path().display()
        );
        println!(
            "  {agent_bin} trace --live --bpffs-dir {}/node1 --node-name node1 --node-ip {} \\",
            cluster.bpffs.path().display(),
            cluster.nodes[0].ip()
        );
        println!(
            "      --cluster-cidr 10.244.0.0/16 --from external --src 203.0.113.9 --dst {LB_IP}:80 --proto tcp"
        );
        println!(
            "  edit the manifests in {} (the agents reload them)",
            manifests.path().display()
        );
        println!(
            "  ip netns exec {} bash   # a shell on the external client",
            cluster.client.ns.name()
        );
        loop {
            std::thread::park();
        }
    }
    drop(agents);
    drop(servers);
    drop(cluster);
    println!("done: sandbox removed");
}
