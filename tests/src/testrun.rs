//! BPF_PROG_TEST_RUN helpers shared by the fixture suites and the benchmarks.

use std::{net::Ipv4Addr, time::Duration};

use aya::programs::{TestRun, TestRunOptions, TestRunResult};
use dataplane_agent::{
    dataplane::{Datapath, DatapathConfig, LoadOptions},
    state::{desired, diff::Programmer, inputs::NodeContext},
};

use crate::services::TestService;

/// Runs `input` through `prog` (XDP or TC) `repeat` times: (verdict, output
/// frame, the kernel's average run time).
pub fn run<P>(prog: &P, input: &[u8], repeat: u32) -> (u32, Vec<u8>, Duration)
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = TestRunResult>,
{
    try_run(prog, input, repeat).expect("BPF_PROG_TEST_RUN")
}

/// Runs a TC program once on `input` as if it came in on device `ifindex`
/// of the calling thread's network namespace (`__sk_buff.ifindex`, which the
/// kernel resolves there: helpers such as `bpf_fib_lookup` answer from that
/// namespace). Returns the verdict and the output frame.
pub fn run_on_device<P>(prog: &P, input: &[u8], ifindex: u32) -> (u32, Vec<u8>)
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = TestRunResult>,
{
    // `struct __sk_buff` up to `ifindex` (offset 40); the rest is zero.
    let mut ctx = [0u8; 44];
    ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    let mut out = vec![0u8; input.len() + 512];
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            repeat: 1,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("test run on ifindex {ifindex}: {e}"));
    out.truncate(r.data_size_out as usize);
    (r.return_value, out)
}

/// Runs an XDP program once on `input` as if it came in on device `ifindex`
/// of the calling thread's network namespace (`xdp_md.ingress_ifindex`:
/// `bpf_fib_lookup` answers from that namespace, `XDP_TX` means that
/// device). Returns the verdict and the output frame.
pub fn run_xdp_on_device(prog: &aya::programs::Xdp, input: &[u8], ifindex: u32) -> (u32, Vec<u8>) {
    // `struct xdp_md`: data, data_end (the input's length), data_meta,
    // ingress_ifindex, rx_queue_index, egress_ifindex.
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(input.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    let mut out = vec![0u8; input.len() + 512];
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            repeat: 1,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("XDP test run on ifindex {ifindex}: {e}"));
    out.truncate(r.data_size_out as usize);
    (r.return_value, out)
}

/// As [`run`], returning the kernel's error instead of panicking.
pub fn try_run<P>(
    prog: &P,
    input: &[u8],
    repeat: u32,
) -> Result<(u32, Vec<u8>, Duration), aya::programs::ProgramError>
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = TestRunResult>,
{
    let mut out = vec![0u8; input.len() + 512];
    let r = prog.test_run(TestRunOptions {
        data_in: Some(input),
        data_out: Some(&mut out),
        repeat,
        ..Default::default()
    })?;
    out.truncate(r.data_size_out as usize);
    Ok((r.return_value, out, r.duration))
}

/// A private datapath (nothing attached) as node `node` of the sandbox's
/// addressing (cluster CIDR 10.244.0.0/16, service CIDR 10.96.0.0/16), with
/// `services` programmed through the agent's code path.
pub fn fixture_datapath(node: Ipv4Addr, services: &[TestService]) -> Datapath {
    fixture_datapath_with(&[node.into()], services)
}

/// As [`fixture_datapath`] for a dual-stack node (`node` and `node6`; IPv6
/// cluster CIDR fd00:10:244::/56, service CIDR fd00:10:96::/112): Service
/// ports of both families side by side.
pub fn fixture_datapath_dual(
    node: Ipv4Addr,
    node6: std::net::Ipv6Addr,
    services: &[TestService],
) -> Datapath {
    fixture_datapath_with(&[node.into(), node6.into()], services)
}

fn fixture_datapath_with(node_ips: &[std::net::IpAddr], services: &[TestService]) -> Datapath {
    fixture_datapath_configured(node_ips, services, |_| {})
}

/// As [`fixture_datapath_dual`] for any node addresses, with the config
/// changed by `configure` before it is written.
pub fn fixture_datapath_configured(
    node_ips: &[std::net::IpAddr],
    services: &[TestService],
    configure: impl FnOnce(&mut DatapathConfig),
) -> Datapath {
    fixture_datapath_of_node(0, node_ips, services, configure)
}

/// As [`fixture_datapath_configured`], as sandbox node `node` (whose
/// endpoints are local).
pub fn fixture_datapath_of_node(
    node: usize,
    node_ips: &[std::net::IpAddr],
    services: &[TestService],
    configure: impl FnOnce(&mut DatapathConfig),
) -> Datapath {
    crate::require_privileges();
    let opts = LoadOptions {
        max_services: 64,
        max_backends: 64,
        max_service_entries: 1024,
        ct_entries: 4096,
        affinity_entries: 64,
        ipv6: true,
    };
    let mut dp = Datapath::load_with(&opts).expect("load datapath");
    let mut config = DatapathConfig::for_node(node_ips);
    config.set_cidrs(
        &[
            crate::cluster::CLUSTER_CIDR.parse().unwrap(),
            crate::cluster::CLUSTER_CIDR6.parse().unwrap(),
        ],
        &[
            crate::services::SERVICE_CIDR.parse().unwrap(),
            crate::services::SERVICE_CIDR6.parse().unwrap(),
        ],
    );
    configure(&mut config);
    dp.maps_mut().set_config(&config).unwrap();
    let ports: Vec<_> = services.iter().map(|s| (s.id, s.for_node(node))).collect();
    let ctx = NodeContext {
        node_port_addresses: node_ips.to_vec(),
        node_ips: node_ips.to_vec(),
        lb: Default::default(),
    };
    let table = desired::compute(ports.iter().map(|(id, p)| (*id, p)), &ctx);
    assert!(table.problems.is_empty(), "{:?}", table.problems);
    Programmer::new(opts.max_backends)
        .sync(dp.maps_mut(), &table)
        .unwrap();
    dp
}
