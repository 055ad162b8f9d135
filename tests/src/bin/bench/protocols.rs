//! Per-packet cost by protocol and address family, as ratios to TCP over
//! IPv4 measured in the same run: the same NodePort (eTP=Cluster, port
//! translated, masqueraded) in `xdp_ingress`, for a packet of an
//! established flow and for a new flow.
//!
//! A port-translating fixture changes the packet, so the kernel cannot rerun
//! the program on its own output: both figures are single runs (repeat = 1)
//! alternated with the floor measured the same way, which is subtracted.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv6Addr, SocketAddr},
};

use dataplane_agent::{
    dataplane::{Datapath, DatapathConfig, LoadOptions},
    net::Protocol,
    state::{desired, diff::Programmer, model::NodeContext},
};
use dataplane_tests::{
    packet::{Frame, TCP_ACK, TCP_SYN},
    services::{TestEndpoint, TestService},
};

use crate::{CLIENT, NEW_FLOWS_PER_ROUND, NODE, ROUNDS, Stat, cell, run, stat, unstalled_mean};

pub struct ProtoRow {
    pub name: &'static str,
    /// Established packet, minus the floor.
    pub established: Stat,
    /// New flow, minus the floor.
    pub new_flow: Stat,
}

struct Variant {
    name: &'static str,
    node_port: u16,
    ipv6: bool,
    frame: fn(SocketAddr, SocketAddr, u8) -> Frame,
}

fn tcp(src: SocketAddr, dst: SocketAddr, flags: u8) -> Frame {
    Frame::tcp(src, dst, flags)
}

fn sctp(src: SocketAddr, dst: SocketAddr, _flags: u8) -> Frame {
    let mut f = Frame::sctp(src, dst);
    f.payload = vec![0; 64];
    f
}

/// The node's and the client's IPv6 addresses.
const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100);

const VARIANTS: [Variant; 4] = [
    Variant {
        name: "TCP, IPv4 (baseline)",
        node_port: 30081,
        ipv6: false,
        frame: tcp,
    },
    Variant {
        name: "SCTP, IPv4 (CRC32c updated for the port rewrites)",
        node_port: 30082,
        ipv6: false,
        frame: sctp,
    },
    Variant {
        name: "TCP, IPv6",
        node_port: 30081,
        ipv6: true,
        frame: tcp,
    },
    Variant {
        name: "SCTP, IPv6",
        node_port: 30082,
        ipv6: true,
        frame: sctp,
    },
];

pub fn measure() -> Vec<ProtoRow> {
    let opts = LoadOptions {
        max_services: 64,
        max_backends: 64,
        max_service_entries: 256,
        ct_entries: dataplane_common::limits::CT_ENTRIES,
        affinity_entries: 1024,
        ipv6: true,
    };
    let mut dp = Datapath::load_with(&opts).expect("load datapath");
    let node_ips = [IpAddr::from(NODE), IpAddr::from(NODE6)];
    dp.maps_mut()
        .set_config(&DatapathConfig::for_node(&node_ips))
        .unwrap();
    let backend = |i| TestEndpoint::ready(std::net::Ipv4Addr::new(10, 128, 0, i), 8080, 1);
    let backend6 = |i| TestEndpoint::ready(Ipv6Addr::new(0xfd00, 0x10, 0x128, 0, 0, 0, 0, i), 8080, 1);
    // The same two NodePorts in each family (a Service port per family).
    let services = [
        TestService::new(1, "tcp", Protocol::Tcp, 80)
            .node_port(30081)
            .endpoint(backend(1))
            .endpoint(backend(2)),
        TestService::new(2, "sctp", Protocol::Sctp, 80)
            .node_port(30082)
            .endpoint(backend(1))
            .endpoint(backend(2)),
        TestService::new(3, "tcp", Protocol::Tcp, 80)
            .cluster_ip(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 1))
            .node_port(30081)
            .endpoint(backend6(1))
            .endpoint(backend6(2)),
        TestService::new(4, "sctp", Protocol::Sctp, 80)
            .cluster_ip(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 2))
            .node_port(30082)
            .endpoint(backend6(1))
            .endpoint(backend6(2)),
    ];
    let ports: Vec<_> = services.iter().map(|s| (s.id, s.for_node(0))).collect();
    let node = NodeContext {
        node_port_addresses: node_ips.to_vec(),
        node_ips: node_ips.to_vec(),
    };
    let table = desired::compute(ports.iter().map(|(id, p)| (*id, p)), &node);
    Programmer::new(opts.max_backends)
        .sync(dp.maps_mut(), &table)
        .expect("program");
    let floor = dp.xdp_program(dataplane_common::names::XDP_FLOOR).unwrap();
    let ingress = dp.xdp().unwrap();

    let mut next_port: u16 = 1024;
    let mut samples: Vec<(Vec<f64>, Vec<f64>)> = VARIANTS.iter().map(|_| (vec![], vec![])).collect();
    for _ in 0..ROUNDS {
        for (v, (est, new)) in VARIANTS.iter().zip(&mut samples) {
            let (node, client): (IpAddr, IpAddr) = if v.ipv6 {
                (NODE6.into(), CLIENT6.into())
            } else {
                (NODE.into(), CLIENT.into())
            };
            let dst = SocketAddr::new(node, v.node_port);
            let established = (v.frame)(SocketAddr::new(client, 1000), dst, TCP_ACK).build();
            let floor_input = established.clone();
            run(ingress, &established, 1);
            let (mut f, mut e, mut n) = (vec![], vec![], vec![]);
            for _ in 0..NEW_FLOWS_PER_ROUND {
                f.push(run(floor, &floor_input, 1));
                e.push(run(ingress, &established, 1));
                n.push(run(
                    ingress,
                    &(v.frame)(SocketAddr::new(client, next_port), dst, TCP_SYN).build(),
                    1,
                ));
                next_port = next_port.wrapping_add(1).max(1024);
            }
            let f = unstalled_mean(&f);
            est.push(unstalled_mean(&e) - f);
            new.push(unstalled_mean(&n) - f);
        }
    }
    VARIANTS
        .iter()
        .zip(samples)
        .map(|(v, (est, new))| ProtoRow {
            name: v.name,
            established: stat(est),
            new_flow: stat(new),
        })
        .collect()
}

pub fn render(md: &mut String, rows: &[ProtoRow]) {
    let _ = writeln!(
        md,
        "\n## Per packet by protocol and address family (`xdp_ingress`)\n"
    );
    let _ = writeln!(
        md,
        "One NodePort per row (eTP=Cluster: DNAT with port translation and masquerade), ns per packet minus the \
         floor, single runs alternated with the floor ({NEW_FLOWS_PER_ROUND} per round, median of {ROUNDS} rounds, \
         min–max; means without the stalled runs, as above): a translated packet cannot be rerun on the program's \
         own output. Ratios against the first row of the same run.\n"
    );
    let _ = writeln!(md, "| variant | established | ratio | new flow | ratio |");
    let _ = writeln!(md, "|---|---:|---:|---:|---:|");
    let Some(base) = rows.first() else { return };
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {:.2}× | {} | {:.2}× |",
            r.name,
            cell(r.established),
            r.established.median / base.established.median,
            cell(r.new_flow),
            r.new_flow.median / base.new_flow.median,
        );
    }
}

pub fn json(rows: &[ProtoRow]) -> String {
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"variant\":{:?},\"established_ns\":{:.1},\"new_flow_ns\":{:.1}}}",
                r.name, r.established.median, r.new_flow.median
            )
        })
        .collect();
    format!(",\"protocols\":[{}]", rows.join(","))
}
