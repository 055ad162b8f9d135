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

mod kube_proxy;

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

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes: Vec<u32> = if quick {
        vec![1, 1_000]
    } else {
        vec![1, 1_000, 10_000, 100_000]
    };
    let (e2e_sizes, e2e_rounds, e2e_duration) = if quick {
        (vec![100], 1, Duration::from_secs(1))
    } else {
        (vec![100, 1_000, 10_000], 3, Duration::from_secs(3))
    };
    let control_sizes: Vec<u32> = if quick {
        vec![1_000]
    } else {
        vec![1_000, 10_000, 100_000]
    };
    dataplane_tests::require_privileges();
    let mut rows = Vec::new();
    for &n in &sizes {
        eprintln!("bench: {n} services: programming the maps");
        rows.push(measure(n));
    }
    let connect: Vec<ConnectRow> = [1, *sizes.last().unwrap()]
        .into_iter()
        .map(|n| {
            eprintln!("bench: connect-time translation with {n} services");
            measure_connect(n)
        })
        .collect();
    let e2e = kube_proxy::e2e(&e2e_sizes, e2e_rounds, e2e_duration);
    let control: Vec<kube_proxy::ControlRow> = control_sizes
        .iter()
        .map(|&n| {
            eprintln!("bench: control plane, {n} services x 10 endpoints");
            // 100k Services x 10 endpoints is 1.1M chains for the rule sets.
            kube_proxy::control(n, n <= 10_000)
        })
        .collect();
    let machine = machine();
    let mut md = render(&machine, &rows);
    render_connect(&mut md, &connect);
    kube_proxy::render(&mut md, &e2e, &control, e2e_duration, e2e_rounds);
    print!("{md}");
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    std::fs::write(out.join("benchmarks.md"), &md).expect("write docs/benchmarks.md");
    let mut results = json(&machine, &rows);
    results.truncate(results.trim_end().len() - 1);
    results.push_str(&kube_proxy::json(&e2e, &control));
    results.push_str("}\n");
    std::fs::write(out.join("bench-results.json"), results).expect("write results");
    eprintln!("bench: wrote docs/benchmarks.md and docs/bench-results.json");
}

struct Row {
    services: u32,
    program_s: f64,
    floor_repeat: Stat,
    floor_single: Stat,
    non_service: Stat,
    established: Stat,
    new_flow: Stat,
    tc_floor: Stat,
    tc_floor_single: Stat,
    ew_established: Stat,
    ew_new_flow: Stat,
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

fn measure(n: u32) -> Row {
    let opts = LoadOptions {
        max_services: n + 16,
        max_backends: 2 * n + 16,
        // Per ClusterIP service: frontend, 2 slots and the wildcard entry.
        max_service_entries: 4 * n + 64,
        ct_entries: 262_144,
        affinity_entries: 1024,
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
        node_port_addresses: vec![NODE],
        node_ips: vec![NODE],
    };
    let started = Instant::now();
    let table = desired::compute(ports.iter().map(|(id, p)| (*id, p)), &node);
    Programmer::new(opts.max_backends)
        .sync(dp.maps_mut(), &table)
        .expect("program");
    let program_s = started.elapsed().as_secs_f64();

    let floor = program(&dp, dataplane_common::names::XDP_FLOOR);
    let ingress = dp.xdp().unwrap();
    let non_service = Frame::tcp(
        SocketAddrV4::new(CLIENT, 40000),
        SocketAddrV4::new(Ipv4Addr::new(1, 1, 1, 1), 80),
        TCP_ACK,
    )
    .build();
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
    let (mut tf, mut te, mut tfs, mut tn) = (vec![], vec![], vec![], vec![]);
    let (mut fr, mut fs, mut ns, mut es, mut nf) = (vec![], vec![], vec![], vec![], vec![]);
    let mut next_port: u16 = 1024;
    for _ in 0..ROUNDS {
        fr.push(run(floor, &non_service, REPEAT));
        ns.push(run(ingress, &non_service, REPEAT));
        es.push(run(ingress, &established, REPEAT));
        let (floor_ns, new_ns) = new_flows(floor, &non_service, ingress, &mut next_port, |port| {
            Frame::tcp(
                SocketAddrV4::new(CLIENT, port),
                SocketAddrV4::new(NODE, 30081),
                TCP_SYN,
            )
            .build()
        });
        fs.push(floor_ns);
        nf.push(new_ns);
        // East-west (TC on the pod's interface), its own floor.
        tf.push(run(tc_floor, &ew_established, REPEAT));
        te.push(run(pod_in, &ew_established, REPEAT));
        let (floor_ns, new_ns) = new_flows(tc_floor, &ew_established, pod_in, &mut next_port, |port| {
            Frame::tcp(
                SocketAddrV4::new(POD, port),
                SocketAddrV4::new(EW_NEW, 80),
                TCP_SYN,
            )
            .build()
        });
        tfs.push(floor_ns);
        tn.push(new_ns);
    }
    Row {
        services: n,
        program_s,
        floor_repeat: stat(fr),
        floor_single: stat(fs),
        non_service: stat(ns),
        established: stat(es),
        new_flow: stat(nf),
        tc_floor: stat(tf),
        tc_floor_single: stat(tfs),
        ew_established: stat(te),
        ew_new_flow: stat(tn),
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
        },
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

/// (floor, program) mean ns over NEW_FLOWS_PER_ROUND alternating single
/// runs (repeat = 1), each program run a new flow from a fresh source port.
fn new_flows<P>(
    floor: &P,
    floor_input: &[u8],
    prog: &P,
    next_port: &mut u16,
    frame: impl Fn(u16) -> Vec<u8>,
) -> (f64, f64)
where
    P: for<'a> aya::programs::TestRun<
            Opts<'a> = aya::programs::TestRunOptions<'a>,
            Result = aya::programs::TestRunResult,
        >,
{
    let (mut floor_sum, mut new_sum) = (0.0, 0.0);
    for _ in 0..NEW_FLOWS_PER_ROUND {
        floor_sum += run(floor, floor_input, 1);
        new_sum += run(prog, &frame(*next_port), 1);
        *next_port = next_port.wrapping_add(1).max(1024);
    }
    (
        floor_sum / NEW_FLOWS_PER_ROUND as f64,
        new_sum / NEW_FLOWS_PER_ROUND as f64,
    )
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

fn render(machine: &str, rows: &[Row]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Benchmarks\n");
    let _ = writeln!(md, "Generated by `cargo xtask bench` on: {machine}.\n");
    let _ = writeln!(md, "## Datapath per packet (BPF_PROG_TEST_RUN, `xdp_ingress`)\n");
    let _ = writeln!(
        md,
        "ns per packet, median of {ROUNDS} interleaved rounds (min–max). Each service has 2 backends. \
         *floor* is `xdp_floor` (parse + XDP_PASS) on the same frame. Repeat-{REPEAT} figures: the kernel's \
         average over {REPEAT} runs of an input the program leaves unchanged (the established fixture's backend \
         is the frontend itself, so its DNAT is the identity but does all the work). New flows: one call per \
         flow ({NEW_FLOWS_PER_ROUND} per round, each a new source port), repeat = 1, shown minus the floor \
         measured the same way (≈ the fixed cost of a single test run).\n"
    );
    let _ = writeln!(
        md,
        "| services | floor | non-service packet | NodePort established | established / floor | NodePort new flow (minus floor) | floor, repeat = 1 | programming time |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.2}× | {:.0} | {} | {:.2} s |",
            r.services,
            cell(r.floor_repeat),
            cell(r.non_service),
            cell(r.established),
            r.established.median / r.floor_repeat.median,
            r.new_flow.median - r.floor_single.median,
            cell(r.floor_single),
            r.program_s,
        );
    }
    let _ = writeln!(
        md,
        "\nReading the table: the established path is one conntrack lookup (LRU hash, 16-byte key), a backend \
         check (array), the rewrite and per-CPU counters; it does not grow with the number of services. A \
         non-service packet pays the conntrack miss plus the frontend and ClusterIP-wildcard misses. A new \
         NodePort flow with SNAT inserts four conntrack entries (two without SNAT); LRU inserts dominate its cost. \
         The absolute times are from a shared 2-vCPU VM: compare ratios within one run."
    );
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        let _ = writeln!(
            md,
            "\nEstablished flow at {} services vs {}: {:.2}× (constant-time lookups: target ≤ 1.15×). \
             Established at {} services vs the floor: {:.2}× (target ≤ 3×).",
            last.services,
            first.services,
            last.established.median / first.established.median,
            last.services,
            last.established.median / last.floor_repeat.median,
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
        "| services | TC floor | pod → ClusterIP established | established / floor | pod → ClusterIP new flow (minus floor) | TC floor, repeat = 1 |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.2}× | {:.0} | {} |",
            r.services,
            cell(r.tc_floor),
            cell(r.ew_established),
            r.ew_established.median / r.tc_floor.median,
            r.ew_new_flow.median - r.tc_floor_single.median,
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
                "{{\"services\":{},\"programming_s\":{:.3},\"floor_ns\":{},\"floor_single_ns\":{},\"non_service_ns\":{},\"established_ns\":{},\"new_flow_ns\":{},\"tc_floor_ns\":{},\"tc_floor_single_ns\":{},\"ew_established_ns\":{},\"ew_new_flow_ns\":{}}}",
                r.services,
                r.program_s,
                s(r.floor_repeat),
                s(r.floor_single),
                s(r.non_service),
                s(r.established),
                s(r.new_flow),
                s(r.tc_floor),
                s(r.tc_floor_single),
                s(r.ew_established),
                s(r.ew_new_flow)
            )
        })
        .collect();
    format!("{{\"machine\":{machine:?},\"datapath\":[{}]}}\n", rows.join(","))
}
