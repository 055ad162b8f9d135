//! Per-packet cost by protocol and address family, as ratios to TCP over
//! IPv4 measured in the same run: the same NodePort (eTP=Cluster, port
//! translated, masqueraded) in `xdp_ingress`, for a packet of an
//! established flow and for a new flow.
//!
//! A port-translating fixture changes the packet, so the kernel cannot rerun
//! the program on its own output: those figures are single runs (repeat = 1)
//! alternated with the floor measured the same way, which is subtracted. A
//! single run's ~100 ns of fixed cost varies more than the path costs, so the
//! established packet is also measured as the main table measures it: a
//! NodePort whose endpoint is the node's own address and port (identity
//! DNAT: the lookups, checksum arithmetic and stores all run, the values do
//! not change), repeated in the kernel, minus the floor repeated the same way.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use dataplane_agent::{
    dataplane::{Datapath, DatapathConfig, LoadOptions},
    net::Protocol,
    state::{desired, diff::Programmer, inputs::NodeContext},
};
use dataplane_tests::{
    packet::{Frame, TCP_ACK, TCP_SYN},
    services::{TestEndpoint, TestService},
};

use crate::{
    datapath::{CLIENT, NEW_FLOWS_PER_ROUND, NODE, REPEAT, ROUNDS, run, unstalled_mean},
    stat::{Stat, stat},
};

pub struct ProtoRow {
    pub name: &'static str,
    /// Established packet of the identity fixture, repeated, minus the floor.
    pub established_repeat: Stat,
    /// Its ratio to the first variant's in the same round.
    pub repeat_ratio: Stat,
    /// Established packet, minus the floor.
    pub established: Stat,
    /// New flow, minus the floor.
    pub new_flow: Stat,
}

struct Variant {
    name: &'static str,
    node_port: u16,
    /// The NodePort whose endpoint is the node itself (identity DNAT).
    identity_port: u16,
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
        identity_port: 30083,
        ipv6: false,
        frame: tcp,
    },
    Variant {
        name: "SCTP, IPv4 (CRC32c updated for the port rewrites)",
        node_port: 30082,
        identity_port: 30084,
        ipv6: false,
        frame: sctp,
    },
    Variant {
        name: "TCP, IPv6",
        node_port: 30081,
        identity_port: 30083,
        ipv6: true,
        frame: tcp,
    },
    Variant {
        name: "SCTP, IPv6",
        node_port: 30082,
        identity_port: 30084,
        ipv6: true,
        frame: sctp,
    },
];

/// Rounds of the repeated measurement.
pub(crate) const REPEAT_ROUNDS: usize = 21;

fn addresses(v: &Variant) -> (IpAddr, IpAddr) {
    if v.ipv6 {
        (NODE6.into(), CLIENT6.into())
    } else {
        (NODE.into(), CLIENT.into())
    }
}

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
        // Identity DNAT: the endpoints are the node's NodePorts themselves.
        TestService::new(5, "tcp-identity", Protocol::Tcp, 80)
            .node_port(30083)
            .endpoint(TestEndpoint::ready(NODE, 30083, 0)),
        TestService::new(6, "sctp-identity", Protocol::Sctp, 80)
            .node_port(30084)
            .endpoint(TestEndpoint::ready(NODE, 30084, 0)),
        TestService::new(7, "tcp-identity", Protocol::Tcp, 80)
            .cluster_ip(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 3))
            .node_port(30083)
            .endpoint(TestEndpoint::ready(NODE6, 30083, 0)),
        TestService::new(8, "sctp-identity", Protocol::Sctp, 80)
            .cluster_ip(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 4))
            .node_port(30084)
            .endpoint(TestEndpoint::ready(NODE6, 30084, 0)),
    ];
    let ports: Vec<_> = services.iter().map(|s| (s.id, s.for_node(0))).collect();
    let node = NodeContext {
        node_port_addresses: node_ips.to_vec(),
        node_ips: node_ips.to_vec(),
        lb: Default::default(),
    };
    let table = desired::compute(ports.iter().map(|(id, p)| (*id, p)), &node);
    Programmer::new(opts.max_backends)
        .sync(dp.maps_mut(), &table)
        .expect("program");
    let floor = dp.xdp_program(dataplane_common::names::XDP_FLOOR).unwrap();
    let ingress = dp.xdp().unwrap();

    let mut next_port: u16 = 1024;
    // Repeated runs are cheap (tens of ms): many rounds, each variant
    // measured right after the baseline, and the ratio taken per round, so
    // that the machine's drift between rounds cancels out.
    let identity: Vec<Vec<u8>> = VARIANTS
        .iter()
        .map(|v| {
            let (node, client) = addresses(v);
            let frame = (v.frame)(
                SocketAddr::new(client, 1000),
                SocketAddr::new(node, v.identity_port),
                TCP_ACK,
            )
            .build();
            // The first run creates the flow; the repeated ones find it.
            run(ingress, &frame, 1);
            frame
        })
        .collect();
    let mut repeat: Vec<(Vec<f64>, Vec<f64>)> = VARIANTS.iter().map(|_| (vec![], vec![])).collect();
    for _ in 0..REPEAT_ROUNDS {
        let ns: Vec<f64> = identity
            .iter()
            .map(|frame| {
                let f = run(floor, frame, REPEAT);
                run(ingress, frame, REPEAT) - f
            })
            .collect();
        for ((ns_v, ratio_v), x) in repeat.iter_mut().zip(&ns) {
            ns_v.push(*x);
            ratio_v.push(x / ns[0]);
        }
    }
    let mut samples: Vec<(Vec<f64>, Vec<f64>)> = VARIANTS.iter().map(|_| (vec![], vec![])).collect();
    for _ in 0..ROUNDS {
        for (v, (est, new)) in VARIANTS.iter().zip(&mut samples) {
            let (node, client) = addresses(v);
            let dst = SocketAddr::new(node, v.node_port);
            let established = (v.frame)(SocketAddr::new(client, 1000), dst, TCP_ACK).build();
            let floor_input = established.clone();
            run(ingress, &established, 1);
            // Established packets alternated with the floor, then new flows
            // alternated with it: a new flow's inserts between two
            // established packets would evict what the established path
            // reads, and charge that to it.
            let (mut f, mut e) = (vec![], vec![]);
            for _ in 0..NEW_FLOWS_PER_ROUND {
                f.push(run(floor, &floor_input, 1));
                e.push(run(ingress, &established, 1));
            }
            est.push(unstalled_mean(&e) - unstalled_mean(&f));
            let (mut f, mut n) = (vec![], vec![]);
            for _ in 0..NEW_FLOWS_PER_ROUND {
                f.push(run(floor, &floor_input, 1));
                n.push(run(
                    ingress,
                    &(v.frame)(SocketAddr::new(client, next_port), dst, TCP_SYN).build(),
                    1,
                ));
                next_port = next_port.wrapping_add(1).max(1024);
            }
            new.push(unstalled_mean(&n) - unstalled_mean(&f));
        }
    }
    VARIANTS
        .iter()
        .zip(samples)
        .zip(repeat)
        .map(|((v, (est, new)), (rep, ratio))| ProtoRow {
            name: v.name,
            established_repeat: stat(rep),
            repeat_ratio: stat(ratio),
            established: stat(est),
            new_flow: stat(new),
        })
        .collect()
}
