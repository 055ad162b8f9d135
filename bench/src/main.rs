//! `cargo xtask bench`: ns/packet through the real programs with
//! BPF_PROG_TEST_RUN, at 1, 1k, 10k and 100k services (2 backends each),
//! side by side with a floor program measured in the same run.
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
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
    time::{Duration, Instant},
};

mod control;
mod e2e;
mod exhaustion;
mod forwarding;
mod kube_proxy;
mod notes;
mod probes;
mod protocols;

use aya::programs::Xdp;
use dataplane_agent::{
    dataplane::{Datapath, DatapathConfig, LoadOptions},
    net::Protocol,
    state::{desired, diff::Programmer, model::NodeContext},
};
use dataplane_tests::{
    packet::{Frame, TCP_ACK, TCP_SYN},
    services::{TestEndpoint, TestService},
};

const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 20);
const EW_IDENTITY: Ipv4Addr = Ipv4Addr::new(10, 95, 0, 1);
const EW_NEW: Ipv4Addr = Ipv4Addr::new(10, 95, 0, 2);
const ROUNDS: usize = 5;
const REPEAT: u32 = 200_000;
const NEW_FLOWS_PER_ROUND: u16 = 3_000;
const NON_SERVICE_DESTINATIONS: u32 = 100;
/// The agent's default conntrack size.
const CT_ENTRIES: u32 = dataplane_common::limits::CT_ENTRIES;
const SMALL_CT_ENTRIES: u32 = 4_096;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes: Vec<u32> = if quick {
        vec![1, 1_000]
    } else {
        vec![1, 1_000, 10_000, 100_000]
    };
    let (e2e_rounds, e2e_duration, sustained_duration) = if quick {
        (1, Duration::from_secs(2), Duration::from_secs(5))
    } else {
        (3, Duration::from_secs(5), Duration::from_secs(60))
    };
    let control_sizes: Vec<u32> = if quick {
        vec![1_000]
    } else {
        vec![1_000, 10_000, 100_000]
    };
    dataplane_tests::require_privileges();
    // `--only SECTION` runs one section and prints it (docs untouched).
    let only = std::env::args().skip_while(|a| a != "--only").nth(1);
    if only.as_deref() == Some("control") {
        let (ours, agents) = control::measure(&control_sizes);
        let mut md = String::new();
        control::render(&mut md, &ours, &agents);
        print!("{md}");
        return;
    }
    if only.as_deref() == Some("e2e") {
        // `--variants a,b`: only these variants (names as in `e2e::Variant`,
        // lowercase), without the sustained pair: for profiling one path.
        let pick = std::env::args().skip_while(|a| a != "--variants").nth(1);
        let cases = e2e::cases(quick)
            .into_iter()
            .filter(|c| {
                pick.as_deref()
                    .is_none_or(|p| p.split(',').any(|v| c.variant.is(v)))
            })
            .collect::<Vec<_>>();
        let rows = e2e::run(&cases, e2e_rounds, e2e_duration);
        let (sustained, costs) = if pick.is_some() {
            (Vec::new(), Vec::new())
        } else {
            let services = if quick { 1_000 } else { 10_000 };
            (
                e2e::sustained(sustained_duration, services),
                e2e::program_costs(e2e_duration, services),
            )
        };
        let mut md = String::new();
        e2e::render(
            &mut md,
            &rows,
            &sustained,
            e2e_duration,
            sustained_duration,
            e2e_rounds,
        );
        e2e::render_costs(&mut md, &costs);
        print!("{md}");
        return;
    }
    let (fwd_rounds, fwd_packets) = if quick { (1, 1_000_000) } else { (3, 4_000_000) };
    if only.as_deref() == Some("forwarding") {
        let pick = std::env::args().skip_while(|a| a != "--variants").nth(1);
        let rows = forwarding::measure(fwd_rounds, fwd_packets, pick.as_deref());
        let mut md = String::new();
        forwarding::render(&mut md, &rows, fwd_rounds);
        if pick.is_none() {
            let conns = forwarding::connections(e2e_rounds, e2e_duration);
            forwarding::render_connections(&mut md, &conns, e2e_rounds, e2e_duration);
            forwarding::render_maglev(&mut md, &forwarding::maglev_builds(ROUNDS));
        }
        print!("{md}");
        return;
    }
    if only.as_deref() == Some("exhaustion") {
        let mut md = String::new();
        exhaustion::render(&mut md, &exhaustion::measure(ROUNDS));
        print!("{md}");
        return;
    }
    if only.as_deref() == Some("protocols") {
        let mut md = String::new();
        protocols::render(&mut md, &protocols::measure());
        print!("{md}");
        return;
    }
    let mut rows = Vec::new();
    for &n in &sizes {
        eprintln!("bench: {n} services: programming the maps");
        rows.push(measure(n, CT_ENTRIES));
    }
    // The same fixture with a conntrack map that fits the caches: what a new
    // flow costs besides the kernel's inserts into a large LRU hash.
    eprintln!("bench: new flows with a small conntrack map");
    let small_ct = measure(1, SMALL_CT_ENTRIES);
    eprintln!("bench: per packet by protocol and address family");
    let protocol_rows = protocols::measure();
    eprintln!("bench: new flows when SNAT ports run out");
    let exhaustion_row = exhaustion::measure(ROUNDS);
    if only.as_deref() == Some("datapath") {
        let mut md = render(&machine(), &rows, &small_ct);
        protocols::render(&mut md, &protocol_rows);
        exhaustion::render(&mut md, &exhaustion_row);
        print!("{md}");
        return;
    }
    let connect: Vec<ConnectRow> = [1, *sizes.last().unwrap()]
        .into_iter()
        .map(|n| {
            eprintln!("bench: connect-time translation with {n} services");
            measure_connect(n)
        })
        .collect();
    let e2e_rows = e2e::run(&e2e::cases(quick), e2e_rounds, e2e_duration);
    eprintln!("bench: forwarding to a remote backend");
    let fwd_rows = forwarding::measure(fwd_rounds, fwd_packets, None);
    let conn_rows = forwarding::connections(e2e_rounds, e2e_duration);
    eprintln!("bench: sustained masquerading");
    let big = if quick { 1_000 } else { 10_000 };
    let sustained = e2e::sustained(sustained_duration, big);
    let costs = e2e::program_costs(e2e_duration, big);
    eprintln!("bench: control plane (in-process syncer, then agents through their sources)");
    let (ours, agents) = control::measure(&control_sizes);
    let control: Vec<kube_proxy::ControlRow> = control_sizes
        .iter()
        .zip(&ours)
        .map(|(&n, ours)| {
            eprintln!("bench: rule sets for {n} services x 10 endpoints");
            // 100k Services x 10 endpoints is 1.1M chains for the rule sets.
            kube_proxy::control(n, n <= 10_000, ours)
        })
        .collect();
    let (probe_rounds, probes_per_round) = if quick { (1, 100) } else { (ROUNDS, 300) };
    let probe_rows = probes::measure(probe_rounds, probes_per_round);
    let machine = machine();
    let mut md = render(&machine, &rows, &small_ct);
    protocols::render(&mut md, &protocol_rows);
    exhaustion::render(&mut md, &exhaustion_row);
    render_connect(&mut md, &connect);
    e2e::render(
        &mut md,
        &e2e_rows,
        &sustained,
        e2e_duration,
        sustained_duration,
        e2e_rounds,
    );
    e2e::render_costs(&mut md, &costs);
    forwarding::render(&mut md, &fwd_rows, fwd_rounds);
    forwarding::render_connections(&mut md, &conn_rows, e2e_rounds, e2e_duration);
    forwarding::render_maglev(&mut md, &forwarding::maglev_builds(ROUNDS));
    // A blank line before the slot; kube_proxy::render begins with the one
    // after it.
    md.push('\n');
    notes::slot(&mut md, "where-the-time-goes");
    kube_proxy::render(&mut md, &control);
    control::render(&mut md, &ours, &agents);
    probes::render(&mut md, &probe_rows, probe_rounds);
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    // Hand-written notes of the file being replaced are kept (see `notes`);
    // when they cannot all be, the file is left alone.
    let path = out.join("benchmarks.md");
    let old = match std::fs::read_to_string(&path) {
        Ok(old) => old,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => panic!("read docs/benchmarks.md: {e}"),
    };
    let refused = match notes::keep(&old, &md) {
        Ok(notes::Kept { md, kept }) => {
            print!("{md}");
            std::fs::write(&path, &md).expect("write docs/benchmarks.md");
            if !kept.is_empty() {
                eprintln!(
                    "bench: kept the hand-written notes {kept:?} of docs/benchmarks.md: they quote the previous \
                     run's figures, read them again against this run's"
                );
            }
            false
        }
        Err(why) => {
            print!("{md}");
            std::fs::write(out.join("benchmarks.md.new"), &md).expect("write docs/benchmarks.md.new");
            eprintln!(
                "bench: docs/benchmarks.md left alone, its notes could not all be kept ({why}); this run is in \
                 docs/benchmarks.md.new"
            );
            true
        }
    };
    let mut results = json(&machine, &rows);
    results.truncate(results.trim_end().len() - 1);
    results.push_str(&protocols::json(&protocol_rows));
    results.push_str(&exhaustion::json(&exhaustion_row));
    results.push_str(&e2e::json(&e2e_rows, &sustained));
    results.push_str(&forwarding::json(&fwd_rows, &conn_rows));
    results.push_str(&kube_proxy::json(&control));
    results.push_str(&control::json(&ours, &agents));
    results.push_str(&probes::json(&probe_rows));
    results.push_str("}\n");
    std::fs::write(out.join("bench-results.json"), results).expect("write results");
    if refused {
        eprintln!("bench: wrote docs/benchmarks.md.new and docs/bench-results.json");
        std::process::exit(1);
    }
    eprintln!("bench: wrote docs/benchmarks.md and docs/bench-results.json");
}

struct Row {
    services: u32,
    program_s: f64,
    floor_repeat: Stat,
    floor_single: Stat,
    non_service: Stat,
    established: Stat,
    /// Per flow, minus the floor: mean, and median.
    new_flow: Stat,
    new_flow_median: Stat,
    /// Share of new-flow runs that stalled (see [`STALL_NS`]).
    new_flow_stalled: f64,
    tc_floor: Stat,
    tc_floor_single: Stat,
    ew_established: Stat,
    ew_new_flow: Stat,
    ew_new_flow_median: Stat,
    ew_new_flow_stalled: f64,
}

#[derive(Clone, Copy)]
struct Stat {
    median: f64,
    min: f64,
    max: f64,
}

fn stat(mut v: Vec<f64>) -> Stat {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Stat {
        median: v[v.len() / 2],
        min: v[0],
        max: v[v.len() - 1],
    }
}

fn measure(n: u32, ct_entries: u32) -> Row {
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

struct ConnectRow {
    services: u32,
    direct_us: Stat,
    translated_us: Stat,
}

const CONNECTS_PER_ROUND: usize = 1500;

/// Per-connect cost of connect-time translation: a host process of a sandbox
/// node connects (and closes) to a pod directly from outside the node's
/// cgroup, and to a ClusterIP from inside it (connect4 picks the backend),
/// interleaved.
fn measure_connect(n: u32) -> ConnectRow {
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

fn render_connect(md: &mut String, rows: &[ConnectRow]) {
    let _ = writeln!(
        md,
        "\n## East-west per connect (connect-time translation of host processes)\n"
    );
    let _ = writeln!(
        md,
        "A host process of a sandbox node opens and closes TCP connections ({CONNECTS_PER_ROUND} per round, \
         sequential) to a pod on the same node: directly to the pod's IP from outside the node's cgroup, and to a \
         ClusterIP from inside it, where `sock_connect4` picks the backend; µs per connect (each round's median \
         connect), median of {ROUNDS} interleaved rounds (min–max); `tcp_max_tw_buckets=0` in both namespaces. Every later packet of such a \
         connection bypasses translation.\n"
    );
    let _ = writeln!(
        md,
        "| services | direct to the pod | to the ClusterIP (connect-time) | ratio |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {:.1} ({:.1}–{:.1}) | {:.1} ({:.1}–{:.1}) | {:.2}× |",
            r.services,
            r.direct_us.median,
            r.direct_us.min,
            r.direct_us.max,
            r.translated_us.median,
            r.translated_us.min,
            r.translated_us.max,
            r.translated_us.median / r.direct_us.median
        );
    }
}

fn program<'a>(dp: &'a Datapath, name: &'static str) -> &'a Xdp {
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
const STALL_NS: f64 = 50_000.0;

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
fn run<P>(prog: &P, input: &[u8], repeat: u32) -> f64
where
    P: for<'a> aya::programs::TestRun<
            Opts<'a> = aya::programs::TestRunOptions<'a>,
            Result = aya::programs::TestRunResult,
        >,
{
    dataplane_tests::testrun::run(prog, input, repeat).2.as_nanos() as f64
}

fn machine() -> String {
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

fn cell(s: Stat) -> String {
    format!("{:.0} ({:.0}–{:.0})", s.median, s.min, s.max)
}

fn render(machine: &str, rows: &[Row], small_ct: &Row) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Benchmarks\n");
    let _ = writeln!(md, "Generated by `cargo xtask bench` on: {machine}.\n");
    notes::slot(&mut md, "about-this-run");
    md.push('\n');
    let _ = writeln!(md, "## Datapath per packet (BPF_PROG_TEST_RUN, `xdp_ingress`)\n");
    let _ = writeln!(
        md,
        "ns per packet, median of {ROUNDS} interleaved rounds (min–max). Each service has 2 backends. \
         *floor* is `xdp_floor` (parse + XDP_PASS) on the same frame. Repeat-{REPEAT} figures: the kernel's \
         average over {REPEAT} runs of an input the program leaves unchanged (the established fixture's backend \
         is the frontend itself, so its DNAT is the identity but does all the work). New flows: one call per \
         flow ({NEW_FLOWS_PER_ROUND} per round, each a new source port), repeat = 1, minus the floor measured \
         the same way (≈ the fixed cost of a single test run): the mean (what flows cost on average, the LRU \
         map's periodic refills included) and the median (the typical flow). Runs over {stall_us} µs are left \
         out of the mean and counted as *stalled*: no new flow's work comes near that; they are this VM stalling \
         when the datapath touches memory it had left alone for a while, such as a page of the conntrack map \
         (measured separately: 3000 new flows have a p99 of 6 µs back to back, of 150 µs after 20 s idle; the \
         profile puts those runs in the conntrack bucket reads).\n",
        stall_us = STALL_NS / 1000.0,
    );
    notes::slot(&mut md, "per-packet");
    md.push('\n');
    let _ = writeln!(
        md,
        "| services | floor | non-service packet | NodePort established | established / floor | NodePort new flow, mean | median | stalled | floor, repeat = 1 | programming time |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.2}× | {} | {} | {:.1} % | {} | {:.2} s |",
            r.services,
            cell(r.floor_repeat),
            cell(r.non_service),
            cell(r.established),
            r.established.median / r.floor_repeat.median,
            cell(r.new_flow),
            cell(r.new_flow_median),
            100.0 * r.new_flow_stalled,
            cell(r.floor_single),
            r.program_s,
        );
    }
    let _ = writeln!(
        md,
        "\nReading the table: the established path is one conntrack lookup (LRU hash, 16-byte key), a backend \
         check (array), the rewrite and per-CPU counters; it does not grow with the number of services. A \
         non-service packet (the mean over {NON_SERVICE_DESTINATIONS} public destinations) is one read of the \
         address filter, plus the full lookups for the few the filter lets through (its false positives grow \
         with the addresses it holds). A new masqueraded NodePort flow writes two conntrack entries: the SNAT \
         port claim, which is the reply entry, and the forward entry (four when the hashed port is taken and \
         the fallback port needs explicit egress entries). With a {SMALL_CT_ENTRIES}-entry conntrack map, \
         which fits the caches, the same new flow costs {:.0} ns above the floor (median): the rest is the \
         kernel's LRU hash lookups and inserts into a {CT_ENTRIES}-entry map, each touching a random, cold \
         bucket.",
        small_ct.new_flow_median.median,
    );
    let _ = writeln!(
        md,
        "The absolute times are from a shared 2-vCPU VM: compare ratios within one run."
    );
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        // Issue 11's goals are ns above the floor, flat from 1 to 100k
        // Services: the worst row's median.
        let worst = |f: &dyn Fn(&Row) -> f64| rows.iter().map(f).fold(f64::MIN, f64::max);
        let _ = writeln!(
            md,
            "\nEstablished flow at {} services vs {}: {:.2}× (constant-time lookups: target ≤ 1.15×). \
             Per-packet goals (issue 11), ns above the floor, the worst of the {} to {} services rows (medians): \
             non-service packet {:.0} (goal ≤ 20), established {:.0} (goal ≤ 40), new masqueraded flow {:.0} \
             (goal ≤ 300; {:.0} with the {SMALL_CT_ENTRIES}-entry conntrack map).",
            last.services,
            first.services,
            last.established.median / first.established.median,
            first.services,
            last.services,
            worst(&|r| r.non_service.median - r.floor_repeat.median),
            worst(&|r| r.established.median - r.floor_repeat.median),
            worst(&|r| r.new_flow_median.median),
            small_ct.new_flow_median.median,
        );
    }
    let _ = writeln!(
        md,
        "\n## East-west per packet (BPF_PROG_TEST_RUN, `tc_pod_ingress`)\n"
    );
    let _ = writeln!(
        md,
        "A pod's packets to a ClusterIP, through TC on the pod's host interface. The kernel builds an skb for each \
         TC test run, so these figures compare with the TC floor (`tc_floor`: parse, TC_ACT_OK), not with XDP's. \
         Same method as above: repeat {REPEAT} on an identity-DNAT fixture for established flows; one call per new \
         flow, minus the TC floor measured the same way.\n"
    );
    let _ = writeln!(
        md,
        "| services | TC floor | pod → ClusterIP established | established / floor | pod → ClusterIP new flow, mean | median | stalled | TC floor, repeat = 1 |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.2}× | {} | {} | {:.1} % | {} |",
            r.services,
            cell(r.tc_floor),
            cell(r.ew_established),
            r.ew_established.median / r.tc_floor.median,
            cell(r.ew_new_flow),
            cell(r.ew_new_flow_median),
            100.0 * r.ew_new_flow_stalled,
            cell(r.tc_floor_single),
        );
    }
    md
}

fn json(machine: &str, rows: &[Row]) -> String {
    let s = |x: Stat| {
        format!(
            "{{\"median\":{:.1},\"min\":{:.1},\"max\":{:.1}}}",
            x.median, x.min, x.max
        )
    };
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"services\":{},\"programming_s\":{:.3},\"floor_ns\":{},\"floor_single_ns\":{},\"non_service_ns\":{},\"established_ns\":{},\"new_flow_ns\":{},\"new_flow_median_ns\":{},\"tc_floor_ns\":{},\"tc_floor_single_ns\":{},\"ew_established_ns\":{},\"ew_new_flow_ns\":{},\"ew_new_flow_median_ns\":{}}}",
                r.services,
                r.program_s,
                s(r.floor_repeat),
                s(r.floor_single),
                s(r.non_service),
                s(r.established),
                s(r.new_flow),
                s(r.new_flow_median),
                s(r.tc_floor),
                s(r.tc_floor_single),
                s(r.ew_established),
                s(r.ew_new_flow),
                s(r.ew_new_flow_median)
            )
        })
        .collect();
    format!("{{\"machine\":{machine:?},\"datapath\":[{}]}}\n", rows.join(","))
}
