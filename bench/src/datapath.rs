//! The datapath per packet: ns per run of the real programs through
//! BPF_PROG_TEST_RUN at 1 to 100k services, against a floor program in the
//! same run, and the per-connect cost of connect-time translation.
//!
//! With `repeat > 1` the kernel reruns a program on its own output, so each
//! figure measures the path it names:
//! - floor, non-service, established: the input is unchanged by the program
//!   (the established fixture's backend is the frontend itself, a
//!   host-network endpoint, so its DNAT is the identity but does all the
//!   work); measured with a large repeat.
//! - new flow: every call is a new flow (a new source port), repeat = 1; the
//!   floor measured the same way (repeat = 1) is subtracted.
//!
//! Variants are interleaved, rounds repeated; medians with min–max.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Instant,
};

use aya::programs::Xdp;
use dataplane_agent::{
    dataplane::{Datapath, DatapathConfig, LoadOptions},
    net::Protocol,
    state::{desired, diff::Programmer, inputs::NodeContext},
};
use dataplane_tests::{
    packet::{Frame, TCP_ACK, TCP_SYN},
    services::{TestEndpoint, TestService},
};

use crate::stat::{Stat, stat};

pub(crate) const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
pub(crate) const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
pub(crate) const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 20);
pub(crate) const EW_IDENTITY: Ipv4Addr = Ipv4Addr::new(10, 95, 0, 1);
pub(crate) const EW_NEW: Ipv4Addr = Ipv4Addr::new(10, 95, 0, 2);
pub(crate) const ROUNDS: usize = 5;
pub(crate) const REPEAT: u32 = 200_000;
pub(crate) const NEW_FLOWS_PER_ROUND: u16 = 3_000;
pub(crate) const NON_SERVICE_DESTINATIONS: u32 = 100;
/// The agent's default conntrack size.
pub(crate) const CT_ENTRIES: u32 = dataplane_common::limits::CT_ENTRIES;
pub(crate) const SMALL_CT_ENTRIES: u32 = 4_096;

pub(crate) struct Row {
    pub services: u32,
    pub program_s: f64,
    pub floor_repeat: Stat,
    pub floor_single: Stat,
    pub non_service: Stat,
    pub established: Stat,
    /// Per flow, minus the floor: mean, and median.
    pub new_flow: Stat,
    pub new_flow_median: Stat,
    /// Share of new-flow runs that stalled (see [`STALL_NS`]).
    pub new_flow_stalled: f64,
    pub tc_floor: Stat,
    pub tc_floor_single: Stat,
    pub ew_established: Stat,
    pub ew_new_flow: Stat,
    pub ew_new_flow_median: Stat,
    pub ew_new_flow_stalled: f64,
}

pub(crate) fn measure(n: u32, ct_entries: u32) -> Row {
    let opts = LoadOptions {
        max_services: n + 16,
        max_backends: 2 * n + 16,
        // Per ClusterIP service: frontend, 2 slots and the wildcard entry.
        max_service_entries: 4 * n + 64,
        ct_entries,
        affinity_entries: 1024,
        ipv6: true,
    };
    let mut dp = Datapath::load_with(&opts).expect("load datapath");
    let mut config = DatapathConfig::new(NODE);
    config.cluster_cidr = Some("10.0.0.0/8".parse().unwrap());
    dp.maps_mut().set_config(&config).unwrap();

    // The two measured NodePorts, then n - 2 ClusterIP services filling the
    // maps (at least the measured ones exist at n = 1).
    let mut services = vec![
        // Identity DNAT: the endpoint is the frontend itself (host network).
        TestService::new(0, "established", Protocol::Tcp, 80)
            .node_port(30080)
            .endpoint(TestEndpoint::ready(NODE, 30080, 0))
            .endpoint(TestEndpoint::ready(NODE, 30080, 0)),
        TestService::new(1, "new-flow", Protocol::Tcp, 80)
            .node_port(30081)
            .endpoint(TestEndpoint::ready(Ipv4Addr::new(10, 128, 0, 1), 8080, 1))
            .endpoint(TestEndpoint::ready(Ipv4Addr::new(10, 128, 0, 2), 8080, 1)),
    ];
    // East-west: a ClusterIP whose endpoint is the ClusterIP itself (identity
    // DNAT, for repeat runs), and one with two pod endpoints (new flows).
    services.push(
        TestService::new(n + 1, "ew-established", Protocol::Tcp, 80)
            .cluster_ip(EW_IDENTITY)
            .endpoint(TestEndpoint::ready(EW_IDENTITY, 80, 0)),
    );
    services.push(
        TestService::new(n + 2, "ew-new", Protocol::Tcp, 80)
            .cluster_ip(EW_NEW)
            .endpoint(TestEndpoint::ready(Ipv4Addr::new(10, 128, 1, 1), 8080, 1))
            .endpoint(TestEndpoint::ready(Ipv4Addr::new(10, 128, 1, 2), 8080, 1)),
    );
    for i in 2..n.max(2) {
        let ip = |base: u32| Ipv4Addr::from(base + i);
        services.push(
            TestService::new(i, "filler", Protocol::Tcp, 80)
                .cluster_ip(ip(u32::from(Ipv4Addr::new(10, 96, 0, 0))))
                .endpoint(TestEndpoint::ready(
                    ip(u32::from(Ipv4Addr::new(10, 160, 0, 0))),
                    8080,
                    1,
                ))
                .endpoint(TestEndpoint::ready(
                    ip(u32::from(Ipv4Addr::new(10, 192, 0, 0))),
                    8080,
                    1,
                )),
        );
    }
    let ports: Vec<_> = services.iter().map(|s| (s.id, s.for_node(0))).collect();
    let node = NodeContext {
        node_port_addresses: vec![NODE.into()],
        node_ips: vec![NODE.into()],
        lb: Default::default(),
    };
    let started = Instant::now();
    let table = desired::compute(ports.iter().map(|(id, p)| (*id, p)), &node);
    Programmer::new(opts.max_backends)
        .sync(dp.maps_mut(), &table)
        .expect("program");
    let program_s = started.elapsed().as_secs_f64();

    let floor = program(&dp, dataplane_common::names::XDP_FLOOR);
    let ingress = dp.xdp().unwrap();
    // Non-service packets to NON_SERVICE_DESTINATIONS addresses spread over
    // the public space: their mean includes the filter's false positives at
    // their real rate, not one address's luck.
    let non_services: Vec<Vec<u8>> = (0u32..)
        .map(|i| Ipv4Addr::from(0x2d00_0000u32.wrapping_add(i.wrapping_mul(0x0135_7b2f))))
        .filter(|a| {
            // Public unicast, away from the fixtures' own ranges.
            let o = a.octets()[0];
            !(a.is_loopback()
                || a.is_private()
                || a.is_link_local()
                || o == 0
                || o == 100
                || o == 198
                || o >= 224)
        })
        .take(NON_SERVICE_DESTINATIONS as usize)
        .map(|dst| {
            Frame::tcp(
                SocketAddrV4::new(CLIENT, 40000),
                SocketAddrV4::new(dst, 80),
                TCP_ACK,
            )
            .build()
        })
        .collect();
    let non_service = non_services[0].clone();
    let established = Frame::tcp(
        SocketAddrV4::new(CLIENT, 40000),
        SocketAddrV4::new(NODE, 30080),
        TCP_ACK,
    )
    .build();
    // Create the established flow's conntrack entries.
    run(ingress, &established, 1);

    let tc_floor = dp.tc(dataplane_common::names::TC_FLOOR).unwrap();
    let pod_in = dp.tc(dataplane_common::names::TC_POD_INGRESS).unwrap();
    let ew_established = Frame::tcp(
        SocketAddrV4::new(POD, 40000),
        SocketAddrV4::new(EW_IDENTITY, 80),
        TCP_ACK,
    )
    .build();
    run(pod_in, &ew_established, 1);
    let (mut tf, mut te, mut tfs, mut tn, mut tm) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut stalled, mut ew_stalled) = (0.0, 0.0);
    let (mut fr, mut fs, mut ns, mut es, mut nf, mut nm) = (vec![], vec![], vec![], vec![], vec![], vec![]);
    let mut next_port: u16 = 1024;
    for _ in 0..ROUNDS {
        let per = REPEAT / NON_SERVICE_DESTINATIONS;
        // Each destination's first run touches its filter word (and, for a
        // false positive, its lookups) once, unmeasured, as the other
        // repeat figures are measured warm.
        let warm = |f: &Vec<u8>| {
            run(ingress, f, 1);
            run(ingress, f, per)
        };
        ns.push(non_services.iter().map(warm).sum::<f64>() / non_services.len() as f64);
        fr.push(run(floor, &non_service, REPEAT));
        es.push(run(ingress, &established, REPEAT));
        let flows = new_flows(floor, &non_service, ingress, &mut next_port, |port| {
            Frame::tcp(
                SocketAddrV4::new(CLIENT, port),
                SocketAddrV4::new(NODE, 30081),
                TCP_SYN,
            )
            .build()
        });
        fs.push(flows.floor);
        nf.push(flows.mean);
        nm.push(flows.median);
        stalled += flows.stalled / ROUNDS as f64;
        // East-west (TC on the pod's interface), its own floor.
        tf.push(run(tc_floor, &ew_established, REPEAT));
        te.push(run(pod_in, &ew_established, REPEAT));
        let flows = new_flows(tc_floor, &ew_established, pod_in, &mut next_port, |port| {
            Frame::tcp(
                SocketAddrV4::new(POD, port),
                SocketAddrV4::new(EW_NEW, 80),
                TCP_SYN,
            )
            .build()
        });
        tfs.push(flows.floor);
        tn.push(flows.mean);
        tm.push(flows.median);
        ew_stalled += flows.stalled / ROUNDS as f64;
    }
    Row {
        services: n,
        program_s,
        floor_repeat: stat(fr),
        floor_single: stat(fs),
        non_service: stat(ns),
        established: stat(es),
        new_flow: stat(nf),
        new_flow_median: stat(nm),
        new_flow_stalled: stalled,
        tc_floor: stat(tf),
        tc_floor_single: stat(tfs),
        ew_established: stat(te),
        ew_new_flow: stat(tn),
        ew_new_flow_median: stat(tm),
        ew_new_flow_stalled: ew_stalled,
    }
}

pub(crate) struct ConnectRow {
    pub services: u32,
    pub direct_us: Stat,
    pub translated_us: Stat,
}

pub(crate) const CONNECTS_PER_ROUND: usize = 1500;

/// Per-connect cost of connect-time translation: a host process of a sandbox
/// node connects (and closes) to a pod directly from outside the node's
/// cgroup, and to a ClusterIP from inside it (connect4 picks the backend),
/// interleaved.
pub(crate) fn measure_connect(n: u32) -> ConnectRow {
    use dataplane_tests::{cgroup::cgroup2_root, cluster::Cluster};
    let mut cluster = Cluster::new();
    cluster.add_pod(0, "a");
    let pod = cluster.pod("a");
    // Thousands of short connections: TIME_WAIT sockets would make port
    // selection and SYN handling the cost measured (see BENCHMARKING.md).
    for ns in [&pod.ns, cluster.nodes[0].ns()] {
        ns.sysctl("net/ipv4/tcp_max_tw_buckets", "0");
    }
    // An acceptor that only accepts and closes: the figure is the connect.
    let listener = pod
        .ns
        .run(|| std::net::TcpListener::bind(SocketAddrV4::new(pod.ip, 8080)))
        .expect("bind");
    std::thread::spawn(move || {
        for c in listener.incoming() {
            drop(c);
        }
    });
    let mut node = cluster.start_datapath_with(
        0,
        &LoadOptions {
            max_services: n + 16,
            max_backends: n + 16,
            max_service_entries: 4 * n + 64,
            ct_entries: 65_536,
            affinity_entries: 1024,
            ipv6: true,
        },
        dataplane_agent::dataplane::XdpMode::Native,
    );
    let cip = Ipv4Addr::new(10, 96, 0, 1);
    let mut services = vec![
        TestService::new(0, "web", Protocol::Tcp, 80)
            .cluster_ip(cip)
            .endpoint(TestEndpoint::ready(pod.ip, 8080, 0)),
    ];
    for i in 1..n {
        services.push(
            TestService::new(i, "filler", Protocol::Tcp, 80)
                .cluster_ip(Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 97, 0, 0)) + i))
                .endpoint(TestEndpoint::ready(
                    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 160, 0, 0)) + i),
                    8080,
                    1,
                )),
        );
    }
    let refs: Vec<&TestService> = services.iter().collect();
    node.program(&refs);
    let pid = std::process::id().to_string();
    let join =
        |procs: std::path::PathBuf| std::fs::write(&procs, &pid).expect("move the bench into a cgroup");
    let inside = cluster.nodes[0].cgroup.procs();
    let outside = cgroup2_root().join("cgroup.procs");
    let ns = cluster.nodes[0].ns();
    // Median of the round's individual connects: a few slow ones (the VM
    // being descheduled) do not move it.
    let time_connects = |dst: SocketAddrV4| -> f64 {
        ns.run(|| {
            let mut us: Vec<f64> = (0..CONNECTS_PER_ROUND)
                .map(|_| {
                    let started = Instant::now();
                    drop(std::net::TcpStream::connect(dst).expect("connect"));
                    started.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            us.sort_by(|a, b| a.partial_cmp(b).unwrap());
            us[us.len() / 2]
        })
    };
    let (mut direct, mut translated) = (vec![], vec![]);
    for _ in 0..ROUNDS {
        join(outside.clone());
        direct.push(time_connects(SocketAddrV4::new(pod.ip, 8080)));
        join(inside.clone());
        translated.push(time_connects(SocketAddrV4::new(cip, 80)));
    }
    join(outside);
    drop(node);
    ConnectRow {
        services: n,
        direct_us: stat(direct),
        translated_us: stat(translated),
    }
}

pub(crate) fn program<'a>(dp: &'a Datapath, name: &'static str) -> &'a Xdp {
    dp.xdp_program(name).expect("program")
}

/// One round of new flows: NEW_FLOWS_PER_ROUND single runs (repeat = 1),
/// each a new flow from a fresh source port, alternated with single runs of
/// the floor.
struct NewFlows {
    /// The floor's mean: the fixed cost of one test run.
    floor: f64,
    /// Mean minus the floor's mean over the runs that did not stall: what a
    /// flow costs on average, the LRU map's periodic refills included.
    mean: f64,
    /// Median minus the floor's median: the typical flow.
    median: f64,
    /// Share of the runs that took over [`STALL_NS`].
    stalled: f64,
}

/// The mean of the runs that did not stall.
pub(crate) fn unstalled_mean(v: &[f64]) -> f64 {
    let kept: Vec<f64> = v.iter().copied().filter(|x| *x <= STALL_NS).collect();
    kept.iter().sum::<f64>() / kept.len().max(1) as f64
}

/// A run this long (no new flow's work comes near it) stalled on the
/// machine: on this kind of VM, touching memory left alone for a while
/// (a cold page of the conntrack map) can take 100 µs or more.
pub(crate) const STALL_NS: f64 = 50_000.0;

fn new_flows<P>(
    floor: &P,
    floor_input: &[u8],
    prog: &P,
    next_port: &mut u16,
    frame: impl Fn(u16) -> Vec<u8>,
) -> NewFlows
where
    P: for<'a> aya::programs::TestRun<
            Opts<'a> = aya::programs::TestRunOptions<'a>,
            Result = aya::programs::TestRunResult,
        >,
{
    let mut floors = Vec::with_capacity(NEW_FLOWS_PER_ROUND as usize);
    let mut flows = Vec::with_capacity(NEW_FLOWS_PER_ROUND as usize);
    for _ in 0..NEW_FLOWS_PER_ROUND {
        floors.push(run(floor, floor_input, 1));
        flows.push(run(prog, &frame(*next_port), 1));
        *next_port = next_port.wrapping_add(1).max(1024);
    }
    let mean = unstalled_mean;
    let stalled = flows.iter().filter(|x| **x > STALL_NS).count() as f64 / flows.len() as f64;
    let (floor_mean, flow_mean) = (mean(&floors), mean(&flows));
    let (floor_median, flow_median) = (stat(floors).median, stat(flows).median);
    NewFlows {
        floor: floor_mean,
        mean: flow_mean - floor_mean,
        median: flow_median - floor_median,
        stalled,
    }
}

/// Average ns per run as the kernel measured it (XDP or TC: for TC the
/// kernel builds an skb from the frame).
pub(crate) fn run<P>(prog: &P, input: &[u8], repeat: u32) -> f64
where
    P: for<'a> aya::programs::TestRun<
            Opts<'a> = aya::programs::TestRunOptions<'a>,
            Result = aya::programs::TestRunResult,
        >,
{
    dataplane_tests::testrun::run(prog, input, repeat).2.as_nanos() as f64
}

pub(crate) fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    format!("{cpus} × {cpu}, Linux {}", kernel.trim())
}
