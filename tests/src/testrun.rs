//! BPF_PROG_TEST_RUN helpers shared by the fixture suites and the benchmarks.

use std::{net::Ipv4Addr, time::Duration};

use aya::programs::{TestRun, TestRunOptions, TestRunResult};
use dataplane_agent::{
    dataplane::{Datapath, DatapathConfig, LoadOptions},
    state::{desired, diff::Programmer, model::NodeContext},
};

use crate::services::TestService;

/// Runs `input` through `prog` (XDP or TC) `repeat` times: (verdict, output
/// frame, the kernel's average run time).
pub fn run<P>(prog: &P, input: &[u8], repeat: u32) -> (u32, Vec<u8>, Duration)
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = TestRunResult>,
{
    let mut out = vec![0u8; input.len() + 512];
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            repeat,
            ..Default::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    out.truncate(r.data_size_out as usize);
    (r.return_value, out, r.duration)
}

/// A private datapath (nothing attached) as node `node` of the sandbox's
/// addressing (cluster CIDR 10.244.0.0/16, service CIDR 10.96.0.0/16), with
/// `services` programmed through the agent's code path.
pub fn fixture_datapath(node: Ipv4Addr, services: &[TestService]) -> Datapath {
    crate::require_privileges();
    let opts = LoadOptions {
        max_services: 64,
        max_backends: 64,
        max_service_entries: 1024,
        ct_entries: 4096,
        affinity_entries: 64,
    };
    let mut dp = Datapath::load_with(&opts).expect("load datapath");
    let mut config = DatapathConfig::new(node);
    config.cluster_cidr = Some(crate::cluster::CLUSTER_CIDR.parse().unwrap());
    config.service_cidrs = vec![crate::services::SERVICE_CIDR.parse().unwrap()];
    dp.maps_mut().set_config(&config).unwrap();
    let ports: Vec<_> = services.iter().map(|s| (s.id, s.for_node(0))).collect();
    let ctx = NodeContext {
        node_port_addresses: vec![node],
        node_ips: vec![node],
    };
    let table = desired::compute(ports.iter().map(|(id, p)| (*id, p)), &ctx);
    assert!(table.problems.is_empty(), "{:?}", table.problems);
    Programmer::new(opts.max_backends)
        .sync(dp.maps_mut(), &table)
        .unwrap();
    dp
}
