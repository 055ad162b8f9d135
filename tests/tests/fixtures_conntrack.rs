//! Connection tracking under pressure, through BPF_PROG_TEST_RUN: the work a
//! new flow costs when its backend's SNAT ports are exhausted stays bounded.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use dataplane_agent::net::Protocol;
use dataplane_common::stats::{Event, FlowStat};
use dataplane_tests::{
    fixture::{XDP, flow_stat, run_as},
    packet::{Frame, TCP_SYN},
    services::{TestEndpoint, TestService},
    testrun::fixture_datapath_configured,
};

const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 10);

fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

/// With a backend's SNAT ports all held by live flows, a new flow is
/// dropped after `SNAT_ATTEMPTS` tries; for the next `SNAT_BACKOFF_MS` that
/// CPU's new flows to the backend try their hashed port alone (counted as
/// `snat_backoff`, no fallback port tried), then the full search resumes.
#[test]
fn snat_exhaustion_costs_a_bounded_search() {
    let svc = TestService::new(1, "web", Protocol::Tcp, 80)
        .node_port(30080)
        .endpoint(TestEndpoint::ready(POD, 8080, 1));
    // Eight ports: a handful of flows exhausts them.
    let dp = fixture_datapath_configured(&[NODE.into()], &[svc], |c| c.snat_ports = (20_000, 20_007));
    let syn = |i: u32| {
        let client = Ipv4Addr::from(u32::from(Ipv4Addr::new(203, 0, 113, 0)) + i);
        Frame::tcp(sa(client, 40_000), sa(NODE, 30080), TCP_SYN).build()
    };
    let drops = || {
        dp.maps()
            .hook_counter(
                dataplane_common::stats::Hook::XdpIngress,
                Event::DropSnatExhausted,
            )
            .unwrap()
            .packets
    };
    // Open flows until the first one finds no port.
    let mut i = 0;
    while drops() == 0 {
        assert!(i < 64, "8 ports never ran out");
        run_as(&dp, XDP, &syn(i));
        i += 1;
    }
    let opened = i - 1;
    assert!((6..=8).contains(&opened), "{opened} flows took the 8 ports");
    // Exhausted: the next flows cost their hashed port only.
    let (busy, backoff) = (
        flow_stat(&dp, FlowStat::SnatPortsBusy),
        flow_stat(&dp, FlowStat::SnatBackoff),
    );
    for k in 0..100 {
        let (v, _) = run_as(&dp, XDP, &syn(1_000 + k));
        assert_eq!(v, XDP.drop, "flow {k} while exhausted");
    }
    assert_eq!(
        flow_stat(&dp, FlowStat::SnatPortsBusy),
        busy,
        "no fallback port tried"
    );
    assert_eq!(flow_stat(&dp, FlowStat::SnatBackoff), backoff + 100);
    assert_eq!(drops(), 101);
    // Once the backoff is over, the search runs again (and finds the ports
    // still held).
    std::thread::sleep(std::time::Duration::from_millis(
        dataplane_common::limits::SNAT_BACKOFF_MS as u64 + 20,
    ));
    run_as(&dp, XDP, &syn(5_000));
    assert!(
        flow_stat(&dp, FlowStat::SnatPortsBusy) > busy,
        "searched again after the backoff"
    );
}
