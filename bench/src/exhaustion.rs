//! New flows when SNAT ports run out: what a new masqueraded flow costs once
//! every SNAT port towards its backend is taken, against an ordinary new
//! masqueraded flow, both through `xdp_ingress` with BPF_PROG_TEST_RUN.
//!
//! Two NodePorts (externalTrafficPolicy Cluster: DNAT and masquerade from
//! outside the cluster CIDR): `full` has one backend whose SNAT ports are
//! first all taken by SYNs from distinct clients (unanswered, so they hold
//! their ports); `ordinary` has eight backends, whose ports stay mostly free.
//! Then, round by round, single runs alternate: the floor, a new flow to
//! `full` and a new flow to `ordinary`, each from a fresh client port. A
//! `full` flow tries its hashed port and a bounded number of fallback ports
//! (then backs off, per CPU and backend, for 100 ms, trying its hashed port
//! alone) and is dropped as `drop_snat_exhausted`; the counters say how many
//! ports each one tried.

use std::net::{Ipv4Addr, SocketAddrV4};

use dataplane_agent::{
    dataplane::{Datapath, DatapathConfig, LoadOptions},
    net::Protocol,
    state::{desired, diff::Programmer, inputs::NodeContext},
};
use dataplane_common::stats::{Event, FlowStat};
use dataplane_tests::{
    packet::{Frame, TCP_SYN},
    services::{TestEndpoint, TestService},
};

use crate::{
    datapath::{CT_ENTRIES, NEW_FLOWS_PER_ROUND, NODE, unstalled_mean},
    stat::{Stat, stat},
};

const FULL_PORT: u16 = 30_090;
const ORDINARY_PORT: u16 = 30_091;
const FULL_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 128, 2, 1);

pub struct Row {
    pub rounds: usize,
    /// ns above the floor, per round: means (without stalled runs) and
    /// medians.
    pub ordinary_mean: Stat,
    pub ordinary_median: Stat,
    pub full_mean: Stat,
    pub full_median: Stat,
    /// Median over rounds of the per-round ratio of medians.
    pub ratio: Stat,
    /// Flows sent to `full` while measuring, and what they came to.
    pub full_flows: u64,
    pub exhausted_drops: u64,
    pub ports_busy: u64,
    pub backoff: u64,
    /// Flows sent to fill `full`'s ports, and the ports they took.
    pub fill_flows: u64,
    pub ports: u32,
    /// Drops of any reason among the `ordinary` flows' runs: none expected.
    pub ordinary_drops: u64,
}

/// A client address and port for the `i`th flow: 60000 ports per address.
fn client(i: u64) -> SocketAddrV4 {
    let ip = u32::from(Ipv4Addr::new(198, 18, 64, 0)) + (i / 60_000) as u32;
    SocketAddrV4::new(Ipv4Addr::from(ip), 1_024 + (i % 60_000) as u16)
}

fn syn(i: u64, port: u16) -> Vec<u8> {
    Frame::tcp(client(i), SocketAddrV4::new(NODE, port), TCP_SYN).build()
}

pub fn measure(rounds: usize) -> Row {
    let opts = LoadOptions {
        max_services: 16,
        max_backends: 32,
        max_service_entries: 64,
        ct_entries: CT_ENTRIES,
        affinity_entries: 1024,
        ipv6: true,
    };
    let mut dp = Datapath::load_with(&opts).expect("load datapath");
    let mut config = DatapathConfig::new(NODE);
    config.cluster_cidr = Some("10.0.0.0/8".parse().unwrap());
    dp.maps_mut().set_config(&config).unwrap();
    let ports = u32::from(config.snat_ports.1 - config.snat_ports.0) + 1;
    let mut ordinary = TestService::new(1, "ordinary", Protocol::Tcp, 80).node_port(ORDINARY_PORT);
    for b in 1..=8 {
        ordinary = ordinary.endpoint(TestEndpoint::ready(Ipv4Addr::new(10, 128, 3, b), 8080, 1));
    }
    let services = [
        TestService::new(0, "full", Protocol::Tcp, 80)
            .node_port(FULL_PORT)
            .endpoint(TestEndpoint::ready(FULL_BACKEND, 8080, 1)),
        ordinary,
    ];
    let table_ports: Vec<_> = services.iter().map(|s| (s.id, s.for_node(0))).collect();
    let node = NodeContext {
        node_port_addresses: vec![NODE.into()],
        node_ips: vec![NODE.into()],
        lb: Default::default(),
    };
    let table = desired::compute(table_ports.iter().map(|(id, p)| (*id, p)), &node);
    Programmer::new(opts.max_backends)
        .sync(dp.maps_mut(), &table)
        .expect("program");
    let ingress = dp.xdp().unwrap();
    let floor = crate::datapath::program(&dp, dataplane_common::names::XDP_FLOOR);
    let floor_input = Frame::tcp(
        SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 100), 40000),
        SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 1), 80),
        TCP_SYN,
    )
    .build();

    let exhausted = |dp: &Datapath| dp.maps().counter(Event::DropSnatExhausted).unwrap().packets;
    let flow = |dp: &Datapath, s: FlowStat| {
        dp.maps()
            .flow_stats()
            .unwrap()
            .into_iter()
            .find(|(f, _)| *f == s)
            .map_or(0, |(_, n)| n)
    };
    let drops = |dp: &Datapath| -> u64 {
        dp.maps()
            .counters()
            .unwrap()
            .iter()
            .filter(|(e, _)| e.is_drop())
            .map(|(_, c)| c.packets)
            .sum()
    };

    // Take every port: hashed ports collide, so more flows than ports are
    // sent, until a whole batch is dropped for want of a port.
    let mut next: u64 = 0;
    loop {
        let before = exhausted(&dp);
        for _ in 0..1_000 {
            crate::datapath::run(ingress, &syn(next, FULL_PORT), 1);
            next += 1;
        }
        if exhausted(&dp) - before == 1_000 {
            break;
        }
        assert!(
            next < 8 * u64::from(ports),
            "the backend's SNAT ports never ran out"
        );
    }
    let fill_flows = next;

    let (mut om, mut omed, mut fm, mut fmed, mut ratio) = (vec![], vec![], vec![], vec![], vec![]);
    let (e0, busy0, backoff0) = (
        exhausted(&dp),
        flow(&dp, FlowStat::SnatPortsBusy),
        flow(&dp, FlowStat::SnatBackoff),
    );
    let mut ordinary_drops = 0;
    let mut full_flows = 0;
    for _ in 0..rounds {
        let (mut floors, mut full, mut ord) = (vec![], vec![], vec![]);
        for _ in 0..NEW_FLOWS_PER_ROUND {
            floors.push(crate::datapath::run(floor, &floor_input, 1));
            full.push(crate::datapath::run(ingress, &syn(next, FULL_PORT), 1));
            full_flows += 1;
            let d = drops(&dp);
            ord.push(crate::datapath::run(ingress, &syn(next, ORDINARY_PORT), 1));
            ordinary_drops += drops(&dp) - d;
            next += 1;
        }
        let floor_mean = unstalled_mean(&floors);
        let floor_median = stat(floors).median;
        om.push(unstalled_mean(&ord) - floor_mean);
        fm.push(unstalled_mean(&full) - floor_mean);
        let (o, f) = (stat(ord).median - floor_median, stat(full).median - floor_median);
        omed.push(o);
        fmed.push(f);
        ratio.push(f / o);
    }
    Row {
        rounds,
        ordinary_mean: stat(om),
        ordinary_median: stat(omed),
        full_mean: stat(fm),
        full_median: stat(fmed),
        ratio: stat(ratio),
        full_flows,
        exhausted_drops: exhausted(&dp) - e0,
        ports_busy: flow(&dp, FlowStat::SnatPortsBusy) - busy0,
        backoff: flow(&dp, FlowStat::SnatBackoff) - backoff0,
        fill_flows,
        ports,
        ordinary_drops,
    }
}
