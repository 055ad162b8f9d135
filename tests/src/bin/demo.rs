//! The sandbox demo behind `cargo xtask demo`: a two-node cluster in network
//! namespaces with the datapath attached to each node's external device, real
//! traffic, and what the datapath counted.

use std::net::SocketAddrV4;

use dataplane_agent::dataplane::Datapath;
use dataplane_common::stats::{Event, Hook};
use dataplane_tests::{
    cleanup_on_signal,
    cluster::{Cluster, EXTERNAL_DEVICE},
    echo::{EchoServer, tcp_request, udp_request},
};

fn main() {
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!(
            "usage: cargo xtask demo\n\nBuilds a sandbox cluster in network namespaces, attaches the datapath,"
        );
        println!("sends traffic and prints what the datapath counted. Needs root. Leaves nothing behind.");
        return;
    }
    cleanup_on_signal();
    let mut cluster = Cluster::new();
    let a = cluster.add_pod(0, "web-a");
    let b = cluster.add_pod(1, "web-b");
    println!(
        "sandbox {}: client {}, node1 {}, node2 {}",
        cluster.prefix(),
        cluster.client.ip,
        cluster.nodes[0].ip(),
        cluster.nodes[1].ip()
    );
    for p in &cluster.pods {
        println!(
            "  pod {:<6} {:<12} on {}",
            p.name, p.ip, cluster.nodes[p.node].name
        );
    }

    let mut datapaths: Vec<Datapath> = cluster
        .nodes
        .iter()
        .map(|node| {
            let mut dp = Datapath::load().expect("load the datapath (root, BTF kernel)");
            node.ns()
                .run(|| dp.attach_external(EXTERNAL_DEVICE))
                .expect("attach XDP");
            dp
        })
        .collect();
    println!("datapath attached (XDP) to {EXTERNAL_DEVICE} of node1 and node2\n");

    let (pa, pb) = (&cluster.pods[a], &cluster.pods[b]);
    let tcp_b = EchoServer::tcp(&pb.ns, &pb.name, SocketAddrV4::new(pb.ip, 8080));
    let udp_b = EchoServer::udp(&pb.ns, &pb.name, SocketAddrV4::new(pb.ip, 5353));
    let node1 = &cluster.nodes[0];
    let tcp_node1 = EchoServer::tcp(node1.ns(), &node1.name, SocketAddrV4::new(node1.ip(), 9000));

    for _ in 0..5 {
        let r = tcp_request(&cluster.client.ns, tcp_node1.addr, "hello").expect("client -> node1");
        assert_eq!(r.server, "node1");
    }
    println!(
        "client -> node1:9000/tcp        5 requests ok (node1 saw {})",
        cluster.client.ip
    );
    for _ in 0..5 {
        let r = tcp_request(&pa.ns, tcp_b.addr, "hello").expect("web-a -> web-b");
        assert_eq!(r.server, pb.name);
    }
    println!("web-a -> web-b:8080/tcp         5 requests ok, across nodes");
    for _ in 0..5 {
        udp_request(&pa.ns, udp_b.addr, "query").expect("web-a -> web-b udp");
    }
    println!("web-a -> web-b:5353/udp         5 requests ok, across nodes\n");

    println!(
        "{:<8} {:>10} {:>10} {:>10}",
        "node", "counter", "packets", "bytes"
    );
    for (node, dp) in cluster.nodes.iter().zip(&datapaths) {
        let c = dp.maps().received(Hook::XdpIngress).expect("read counters");
        println!(
            "{:<8} {:>10} {:>10} {:>10}",
            node.name, "xdp rx", c.packets, c.bytes
        );
        let c = dp
            .maps()
            .hook_counter(Hook::XdpIngress, Event::Pass)
            .expect("read counters");
        println!(
            "{:<8} {:>10} {:>10} {:>10}",
            node.name, "xdp pass", c.packets, c.bytes
        );
    }
    datapaths.clear();
    println!("\ndone: sandbox removed");
}
