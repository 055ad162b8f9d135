//! Packets per second to a backend on another node, through one node:
//! UDP to 64 NodePorts whose endpoint is behind a second node, one client
//! port each (or, for the floor and plain forwarding, to that endpoint
//! directly).
//!
//! ```text
//!   gen: g0 ──veth── n0a  node  n0b ──veth── b0: be (counts, drops)
//!        198.18.0.100    .0.11   .1.11         198.18.1.12 (10.244.2.0/24 behind it)
//! ```
//!
//! The generator is our `xdp_bench_gen`, run with BPF_PROG_TEST_RUN in
//! live-frame mode on `g0` (`XDP_TX`: the frames arrive at `n0a`), which
//! writes the whole frame on every run (live frames are recycled as the
//! receiving stack left them). In that mode the sending CPU runs the whole
//! receive path inline, so the rate it sustains is the path's. What arrives
//! at `be` is dropped by `xdp_bench_drop` on `b0` and counted by the veth
//! (`ethtool -S`: `rx_queue_0_xdp_drops`). A veth takes redirected frames
//! only when its peer runs XDP or has GRO on: `n0a` runs our XDP or has GRO
//! on (as a NIC would), `b0` runs the sink. Each variant gets fresh
//! namespaces; variants are interleaved, round by round.

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
    time::Instant,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{TestRun as _, TestRunAttrs, TestRunOptions, Xdp},
};
use dataplane_agent::{
    dataplane::{Datapath, DatapathConfig, LoadOptions, XdpMode},
    net::Protocol,
    state::{desired, diff::Programmer, inputs::LbMode, inputs::NodeContext},
};
use dataplane_common::{
    bench::{BenchConfig, TEMPLATE_LEN},
    names,
    stats::FlowStat,
};
use dataplane_tests::{
    netns::NetNs,
    packet::Frame,
    services::{TestEndpoint, TestService},
    unique_prefix,
};

use crate::stat::{Stat, stat};

const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const NODE_B: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 11);
const BACKEND_NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 12);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 10);
const POD_PORT: u16 = 8080;
const FIRST_NODE_PORT: u16 = 30_000;
pub(crate) const SERVICES: u16 = 64;
const G0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0f, 0x01];
const N0A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0f, 0x02];
const N0B_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0f, 0x03];
const B0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0f, 0x04];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// `xdp_bench_redirect` on n0a: every frame to n0b untouched.
    Floor,
    /// No program, no rule: the kernel forwards to the pod's address.
    Kernel,
    Nftables,
    IptablesLegacy,
    /// Ours in native XDP, translating and passing (no host routing).
    OursXdpPass,
    /// Ours in native XDP with host routing: XDP forwards the frames.
    OursXdp,
    /// The same Services by DSR: XDP encapsulates to the backend's node.
    OursXdpDsr,
    /// Ours in TC with host routing.
    OursTc,
}

impl Variant {
    pub const ALL: [Variant; 8] = [
        Variant::Floor,
        Variant::Kernel,
        Variant::Nftables,
        Variant::IptablesLegacy,
        Variant::OursXdpPass,
        Variant::OursXdp,
        Variant::OursXdpDsr,
        Variant::OursTc,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Variant::Floor => "XDP redirect n0a → n0b, no other work (the floor)",
            Variant::Kernel => "kernel forwarding to the pod address, no NAT",
            Variant::Nftables => "kube-proxy nftables rules (DNAT + masquerade)",
            Variant::IptablesLegacy => "kube-proxy iptables-legacy rules (DNAT + masquerade)",
            Variant::OursXdpPass => "ours, native XDP, translated and passed to the stack",
            Variant::OursXdp => "ours, native XDP, host routing (XDP forwards)",
            Variant::OursXdpDsr => "ours, native XDP, DSR (encapsulated to the backend's node)",
            Variant::OursTc => "ours, TC, host routing",
        }
    }
}

pub struct Row {
    pub variant: Variant,
    pub pps: Stat,
    /// Our programs' (or the floor's) own ns per frame (BPF_ENABLE_STATS).
    pub program_ns: Stat,
    /// The datapath's drops over the rounds.
    pub drops: u64,
    pub flows: Vec<(FlowStat, u64)>,
}

/// The three namespaces of one measurement; removed on drop.
struct Sandbox {
    client: NetNs,
    node: NetNs,
    be: NetNs,
    g0: u32,
}

fn mac(m: [u8; 6]) -> String {
    m.map(|b| format!("{b:02x}")).join(":")
}

impl Sandbox {
    fn new() -> Self {
        let p = unique_prefix();
        let (client, node, be) = (
            NetNs::new(&format!("{p}-gen")),
            NetNs::new(&format!("{p}-node")),
            NetNs::new(&format!("{p}-be")),
        );
        for ns in [&client, &node, &be] {
            ns.sysctl("net/ipv6/conf/all/disable_ipv6", "1");
            ns.sysctl("net/ipv4/conf/all/rp_filter", "0");
            ns.sysctl("net/ipv4/conf/default/rp_filter", "0");
        }
        node.ip_batch(&format!(
            "link add n0a address {} type veth peer name g0 address {} netns {}\n\
             link add n0b address {} type veth peer name b0 address {} netns {}\n\
             addr add {NODE}/24 dev n0a\naddr add {NODE_B}/24 dev n0b\n\
             link set n0a up\nlink set n0b up\n\
             neigh add {CLIENT} lladdr {} dev n0a nud permanent\n\
             neigh add {BACKEND_NODE} lladdr {} dev n0b nud permanent\n\
             route add 10.244.2.0/24 via {BACKEND_NODE}\n",
            mac(N0A_MAC),
            mac(G0_MAC),
            client.name(),
            mac(N0B_MAC),
            mac(B0_MAC),
            be.name(),
            mac(G0_MAC),
            mac(B0_MAC),
        ));
        node.sysctl("net/ipv4/ip_forward", "1");
        for key in ["all", "default", "n0a", "n0b"] {
            node.sysctl(&format!("net/ipv4/conf/{key}/send_redirects"), "0");
        }
        client.ip_batch(&format!("addr add {CLIENT}/24 dev g0\nlink set g0 up\n"));
        be.ip_batch(&format!("addr add {BACKEND_NODE}/24 dev b0\nlink set b0 up\n"));
        let g0 = client.run(|| dataplane_tests::netns::ifindex("g0"));
        Self { client, node, be, g0 }
    }

    /// Frames `b0`'s XDP program dropped (the sink's count).
    fn delivered(&self) -> u64 {
        let out = self
            .be
            .command("ethtool")
            .args(["-S", "b0"])
            .output()
            .expect("ethtool -S b0");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().strip_prefix("rx_queue_0_xdp_drops:"))
            .filter_map(|v| v.trim().parse::<u64>().ok())
            .sum()
    }
}

/// The benchmark's own programs (generator, floor, sink), loaded from our
/// object with every map at its smallest.
fn bench_object() -> Ebpf {
    let mut loader = EbpfLoader::new();
    for map in names::ALL_MAPS {
        loader.map_max_entries(map, names::min_entries(map));
    }
    let mut ebpf = loader
        .load(dataplane_agent::dataplane::EBPF_OBJECT)
        .expect("load the eBPF object for the benchmark's programs");
    for name in [
        names::XDP_BENCH_GEN,
        names::XDP_BENCH_REDIRECT,
        names::XDP_BENCH_DROP,
    ] {
        let p: &mut Xdp = ebpf.program_mut(name).expect(name).try_into().expect("XDP");
        p.load().unwrap_or_else(|e| panic!("load {name}: {e}"));
    }
    ebpf
}

fn attach(ebpf: &mut Ebpf, ns: &NetNs, name: &str, device: &str) {
    let p: &mut Xdp = ebpf.program_mut(name).expect(name).try_into().expect("XDP");
    ns.run(|| p.attach(device, aya::programs::XdpMode::Driver))
        .unwrap_or_else(|e| panic!("attach {name} to {device}: {e}"));
}

/// 64 NodePorts to one pod behind the backend node (eTP=Cluster:
/// masqueraded, or sent by DSR).
fn services(dsr: bool) -> Vec<TestService> {
    (0..SERVICES)
        .map(|i| {
            let s = TestService::new(i as u32, "pps", Protocol::Udp, 53)
                .cluster_ip(Ipv4Addr::new(10, 96, 0, 10 + i as u8))
                .node_port(FIRST_NODE_PORT + i)
                .endpoint(TestEndpoint::ready(POD, POD_PORT, 1));
            if dsr { s.lb_mode(LbMode::Dsr) } else { s }
        })
        .collect()
}

/// kube-proxy's nftables rules for the NodePorts (its `service-nodeports`
/// map, an external chain masquerading, a service chain, an endpoint chain
/// DNATing), as kube-proxy 1.3x writes them.
fn nft_nodeports() -> String {
    let mut out = String::from(
        "table ip kube-proxy {\n\
         chain mark-for-masquerade {\n meta mark set meta mark | 0x4000\n}\n\
         chain masquerading {\n meta mark & 0x4000 == 0 return\n meta mark set meta mark ^ 0x4000\n masquerade fully-random\n}\n\
         chain nat-prerouting {\n type nat hook prerouting priority dstnat; policy accept;\n jump services\n}\n\
         chain nat-postrouting {\n type nat hook postrouting priority srcnat; policy accept;\n jump masquerading\n}\n\
         chain filter-forward {\n type filter hook forward priority -110; policy accept;\n ct state new jump service-endpoints-check\n}\n\
         chain service-endpoints-check {\n}\n",
    );
    let mut elements = Vec::new();
    for i in 0..SERVICES {
        let port = FIRST_NODE_PORT + i;
        let _ = write!(
            out,
            "chain external-{i} {{\n jump mark-for-masquerade\n goto service-{i}\n}}\n\
             chain service-{i} {{\n numgen random mod 1 vmap {{ 0 : goto endpoint-{i} }}\n}}\n\
             chain endpoint-{i} {{\n ip saddr {POD} jump mark-for-masquerade\n meta l4proto udp dnat to {POD}:{POD_PORT}\n}}\n"
        );
        elements.push(format!("udp . {port} : goto external-{i}"));
    }
    let _ = write!(
        out,
        "map service-nodeports {{\n type inet_proto . inet_service : verdict\n elements = {{ {} }}\n}}\n\
         chain nodeports {{\n meta l4proto . th dport vmap @service-nodeports\n}}\n\
         chain services {{\n fib daddr type local ip daddr != 127.0.0.0/8 jump nodeports\n}}\n}}\n",
        elements.join(", ")
    );
    out
}

/// kube-proxy's iptables (legacy) rules for the NodePorts.
fn iptables_nodeports() -> String {
    let mut chains = String::new();
    let mut rules = String::new();
    for i in 0..SERVICES {
        let port = FIRST_NODE_PORT + i;
        let _ = writeln!(
            chains,
            ":KUBE-EXT-{i} - [0:0]\n:KUBE-SVC-{i} - [0:0]\n:KUBE-SEP-{i} - [0:0]"
        );
        let _ = writeln!(
            rules,
            "-A KUBE-NODEPORTS -p udp -m comment --comment \"default/pps{i}:udp\" -m udp --dport {port} -j KUBE-EXT-{i}\n\
             -A KUBE-EXT-{i} -m comment --comment \"masquerade traffic for default/pps{i}:udp external destinations\" -j KUBE-MARK-MASQ\n\
             -A KUBE-EXT-{i} -j KUBE-SVC-{i}\n\
             -A KUBE-SVC-{i} -m comment --comment \"default/pps{i}:udp -> {POD}:{POD_PORT}\" -j KUBE-SEP-{i}\n\
             -A KUBE-SEP-{i} -s {POD}/32 -j KUBE-MARK-MASQ\n\
             -A KUBE-SEP-{i} -p udp -m udp -j DNAT --to-destination {POD}:{POD_PORT}"
        );
    }
    format!(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
         :KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n{chains}\
         -A PREROUTING -j KUBE-SERVICES\n-A POSTROUTING -j KUBE-POSTROUTING\n\
         -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n\
         -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
         -A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n\
         -A KUBE-POSTROUTING -j MASQUERADE --random-fully\n\
         {rules}-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\nCOMMIT\n"
    )
}

/// Our datapath on the node: both devices attached as `mode` says, the
/// Services programmed.
fn ours(s: &Sandbox, mode: XdpMode, host_routing: bool, dsr: bool) -> Datapath {
    let opts = LoadOptions {
        max_services: 256,
        max_backends: 256,
        max_service_entries: 4096,
        ct_entries: dataplane_common::limits::CT_ENTRIES,
        affinity_entries: 64,
        ipv6: false,
    };
    let mut dp = Datapath::load_with(&opts).expect("load the datapath");
    s.node.run(|| {
        for dev in ["n0a", "n0b"] {
            dp.attach_external(dev, mode)
                .unwrap_or_else(|e| panic!("attach to {dev}: {e}"));
        }
    });
    let mut config = DatapathConfig::new(NODE);
    config.cluster_cidr = Some("10.244.0.0/16".parse().unwrap());
    config.host_routing = host_routing;
    dp.maps_mut().set_config(&config).expect("config");
    let svcs = services(dsr);
    let ports: Vec<_> = svcs.iter().map(|s| (s.id, s.for_node(0))).collect();
    let node = NodeContext {
        node_port_addresses: vec![NODE.into()],
        node_ips: vec![NODE.into()],
        lb: Default::default(),
    };
    let table = desired::compute(ports.iter().map(|(id, p)| (*id, p)), &node);
    Programmer::new(opts.max_backends)
        .sync(dp.maps_mut(), &table)
        .expect("program the Services");
    dp
}

/// One measurement: `packets` frames through a fresh sandbox set up for
/// `v`; the rate that reached the backend node.
fn once(v: Variant, bench: &mut Ebpf, packets: u32) -> (f64, f64, u64, Vec<(FlowStat, u64)>) {
    let s = Sandbox::new();
    attach(bench, &s.be, names::XDP_BENCH_DROP, "b0");
    let mut dp = None;
    match v {
        Variant::Floor => {}
        Variant::Kernel | Variant::Nftables | Variant::IptablesLegacy => {
            // As a NIC: GRO on, so the veth takes the generator's frames.
            s.node.ethtool_features("n0a", &["gro", "on"]);
            if v == Variant::Nftables {
                crate::kube_proxy::run_stdin(s.node.name(), "nft", &["-f", "-"], &nft_nodeports());
            }
            if v == Variant::IptablesLegacy {
                crate::kube_proxy::run_stdin(
                    s.node.name(),
                    "iptables-legacy-restore",
                    &[],
                    &iptables_nodeports(),
                );
            }
        }
        Variant::OursXdpPass => dp = Some(ours(&s, XdpMode::Native, false, false)),
        Variant::OursXdp => dp = Some(ours(&s, XdpMode::Native, true, false)),
        Variant::OursXdpDsr => dp = Some(ours(&s, XdpMode::Native, false, true)),
        Variant::OursTc => {
            s.node.ethtool_features("n0a", &["gro", "on"]);
            dp = Some(ours(&s, XdpMode::Off, true, false));
        }
    }
    let n0b = s.node.run(|| dataplane_tests::netns::ifindex("n0b"));
    if v == Variant::Floor {
        attach(bench, &s.node, names::XDP_BENCH_REDIRECT, "n0a");
    }
    // The frame: UDP from the client to the node's NodePorts (the pod's
    // port, directly, when nothing translates), zero UDP checksum (the
    // port varies).
    let (dst, first) = match v {
        Variant::Floor | Variant::Kernel => (POD, POD_PORT),
        _ => (NODE, FIRST_NODE_PORT),
    };
    let mut f = Frame::udp(SocketAddrV4::new(CLIENT, 40_000), SocketAddrV4::new(dst, first));
    f.src_mac = G0_MAC;
    f.dst_mac = N0A_MAC;
    f.udp_zero_checksum = true;
    f.payload = vec![0x42; TEMPLATE_LEN - 42];
    let frame = f.build();
    let mut config = BenchConfig::default();
    config.template.copy_from_slice(&frame[..TEMPLATE_LEN]);
    config.ports = SERVICES as u32;
    config.first_port = first;
    config.port_offset = 14 + 20 + 2;
    // One client port per NodePort: 64 flows (one client port towards
    // several frontends of one backend is one flow here, see
    // docs/datapath.md, "One flow per (client address and port, backend)").
    config.second_port = 40_000;
    config.second_offset = 14 + 20;
    config.redirect_ifindex = n0b;
    let mut map: Array<_, BenchConfig> =
        Array::try_from(bench.map_mut(names::BENCH).expect("DP_BENCH_V1")).expect("array");
    map.set(0, config, 0).expect("bench config");
    let generator: &Xdp = bench
        .program(names::XDP_BENCH_GEN)
        .expect("generator")
        .try_into()
        .expect("XDP");
    // `struct xdp_md` with the sending device as the ingress one.
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&s.g0.to_ne_bytes());
    let run = |n: u32| {
        s.client.run(|| {
            generator
                .test_run(TestRunOptions {
                    data_in: Some(&frame),
                    ctx_in: Some(&ctx),
                    repeat: n,
                    attrs: TestRunAttrs::new().xdp_live_frames(64),
                    ..Default::default()
                })
                .expect("live-frame generator")
        })
    };
    // Warm-up: flows created, caches warm.
    run(20_000);
    let drops_before = dp.as_ref().map(drops).unwrap_or(0);
    let flows_before = dp.as_ref().map(flow_stats).unwrap_or_default();
    let before = s.delivered();
    // The kernel clocks every BPF program run while this fd is open: our
    // programs' own ns per packet, which the machine's load inflates less
    // than the rate.
    const CLOCKED: [&str; 4] = ["xdp_ingress", "tc_ingress", "tc_egress", "xdp_bench_redir"];
    let clock = aya::sys::enable_stats(aya::sys::Stats::RunTime).ok();
    let times = crate::e2e::programs_named(&CLOCKED);
    let started = Instant::now();
    run(packets);
    let elapsed = started.elapsed();
    let programs = crate::e2e::program_deltas(&times, crate::e2e::programs_named(&CLOCKED));
    drop(clock);
    let delivered = s.delivered() - before;
    // ns per forwarded frame of the node's programs (all hooks that ran).
    let ns_per_frame = programs.iter().map(|p| p.2).sum::<u64>() as f64 / delivered.max(1) as f64;
    let flows = dp
        .as_ref()
        .map(flow_stats)
        .unwrap_or_default()
        .into_iter()
        .zip(flows_before.iter().map(|(_, n)| *n).chain(std::iter::repeat(0)))
        .map(|((k, a), b)| (k, a - b))
        .filter(|(_, n)| *n > 0)
        .collect();
    let drops = dp.as_ref().map(drops).unwrap_or(0) - drops_before;
    (
        delivered as f64 / elapsed.as_secs_f64(),
        ns_per_frame,
        drops,
        flows,
    )
}

fn drops(dp: &Datapath) -> u64 {
    dp.maps()
        .counters()
        .unwrap()
        .into_iter()
        .filter(|(e, _)| e.is_drop())
        .map(|(_, c)| c.packets)
        .sum()
}

fn flow_stats(dp: &Datapath) -> Vec<(FlowStat, u64)> {
    dp.maps().flow_stats().unwrap()
}

/// `only`: the variants to run (their names in `Variant`, any case), or
/// all.
pub fn measure(rounds: usize, packets: u32, only: Option<&str>) -> Vec<Row> {
    let variants: Vec<Variant> = Variant::ALL
        .into_iter()
        .filter(|v| only.is_none_or(|o| o.split(',').any(|n| format!("{v:?}").eq_ignore_ascii_case(n))))
        .collect();
    let mut bench = bench_object();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut last: Vec<(u64, Vec<(FlowStat, u64)>)> = vec![(0, Vec::new()); variants.len()];
    for round in 0..rounds {
        for (i, v) in variants.iter().enumerate() {
            eprintln!("bench: forwarding round {}/{rounds}: {}", round + 1, v.name());
            let (pps, program_ns, drops, flows) = once(*v, &mut bench, packets);
            samples[i].push(pps);
            ns[i].push(program_ns);
            last[i].0 += drops;
            last[i].1 = flows;
        }
    }
    variants
        .iter()
        .zip(samples.into_iter().zip(ns))
        .zip(last)
        .map(|((v, (s, ns)), (drops, flows))| Row {
            variant: *v,
            pps: stat(s),
            program_ns: stat(ns),
            drops,
            flows,
        })
        .collect()
}

/// New connections per second through a node to a backend on another node,
/// SNAT against DSR, with the direct path (client → pod, routed by the
/// backend's node) as the baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnVariant {
    Direct,
    Snat,
    Dsr,
}

impl ConnVariant {
    const ALL: [ConnVariant; 3] = [ConnVariant::Direct, ConnVariant::Snat, ConnVariant::Dsr];

    pub(crate) fn name(self) -> &'static str {
        match self {
            ConnVariant::Direct => "direct to the pod (via its node)",
            ConnVariant::Snat => "ours: NodePort on node1, backend on node2, SNAT (TC)",
            ConnVariant::Dsr => "ours: NodePort on node1, backend on node2, DSR (TC)",
        }
    }
}

pub struct ConnRow {
    pub variant: ConnVariant,
    pub rate: Stat,
    pub errors: u64,
    pub drops: u64,
}

/// One run: a fresh two-node sandbox, nginx in a pod on node2 (CPU 1), wrk
/// in the client (CPU 0) with `Connection: close`, our datapath on both
/// nodes (DSR needs the backend's node's half).
fn connections_once(v: ConnVariant, duration: std::time::Duration) -> (f64, u64, u64) {
    use dataplane_tests::cluster::{Cluster, Wiring};
    let mut cluster = Cluster::with_nodes(2, Wiring::Wire);
    cluster.add_pod(1, "b");
    let pod = cluster.pod("b");
    let pod_addr = SocketAddrV4::new(pod.ip, POD_PORT);
    pod.ns.sysctl("net/ipv4/tcp_max_tw_buckets", "0");
    let server = crate::e2e::Nginx::start(pod.ns.name(), &[pod_addr], 1);
    let mut nodes: Vec<_> = (0..2)
        .map(|i| {
            cluster.start_datapath_with(
                i,
                &LoadOptions {
                    max_services: 64,
                    max_backends: 64,
                    max_service_entries: 1024,
                    ct_entries: dataplane_common::limits::CT_ENTRIES,
                    affinity_entries: 64,
                    ipv6: false,
                },
                XdpMode::Auto,
            )
        })
        .collect();
    let svc = TestService::new(1, "web", Protocol::Tcp, 80)
        .cluster_ip(Ipv4Addr::new(10, 96, 0, 10))
        .node_port(FIRST_NODE_PORT)
        .endpoint(TestEndpoint::ready(pod.ip, POD_PORT, 1))
        .lb_mode(if v == ConnVariant::Dsr {
            LbMode::Dsr
        } else {
            LbMode::Snat
        });
    for n in &mut nodes {
        n.program(&[&svc]);
    }
    cluster.route_from_client("10.244.2.0/24", 1);
    let dst = match v {
        ConnVariant::Direct => pod_addr,
        _ => SocketAddrV4::new(cluster.nodes[0].ip(), FIRST_NODE_PORT),
    };
    let from = cluster.client.ns.name().to_owned();
    let pid = server.child.id();
    let mode = crate::e2e::Mode::Close;
    let _ = crate::e2e::wrk(&from, dst, mode, std::time::Duration::from_secs(1), pid);
    let before: u64 = nodes.iter().map(|n| drops(&n.datapath)).sum();
    let s = crate::e2e::wrk(&from, dst, mode, duration, pid);
    let after: u64 = nodes.iter().map(|n| drops(&n.datapath)).sum();
    (s.requests_per_s, s.errors, after - before)
}

pub fn connections(rounds: usize, duration: std::time::Duration) -> Vec<ConnRow> {
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); ConnVariant::ALL.len()];
    let mut errors = vec![0u64; ConnVariant::ALL.len()];
    let mut dropped = vec![0u64; ConnVariant::ALL.len()];
    for round in 0..rounds {
        for (i, v) in ConnVariant::ALL.iter().enumerate() {
            eprintln!("bench: connections round {}/{rounds}: {}", round + 1, v.name());
            let (rate, e, d) = connections_once(*v, duration);
            rates[i].push(rate);
            errors[i] += e;
            dropped[i] += d;
        }
    }
    ConnVariant::ALL
        .iter()
        .enumerate()
        .map(|(i, v)| ConnRow {
            variant: *v,
            rate: stat(rates[i].clone()),
            errors: errors[i],
            drops: dropped[i],
        })
        .collect()
}

/// Maglev table builds (the agent's, `state::maglev::build`): median ms per
/// build of a table for `backends` backends, per table size.
pub fn maglev_builds(rounds: usize) -> Vec<(usize, u32, Stat)> {
    use dataplane_agent::state::maglev;
    let mut out = Vec::new();
    for (n, size) in [
        (10usize, 16_381u32),
        (100, 16_381),
        (1_000, 16_381),
        (1_000, 65_537),
    ] {
        let set: Vec<(std::net::IpAddr, u16)> = (0..n)
            .map(|i| (Ipv4Addr::from(0x0af4_0000 + i as u32).into(), 8080))
            .collect();
        let times: Vec<f64> = (0..rounds.max(5))
            .map(|r| {
                let started = Instant::now();
                let t = maglev::build(&set, size, r as u32);
                assert_eq!(t.len(), size as usize);
                started.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        out.push((n, size, stat(times)));
    }
    out
}
