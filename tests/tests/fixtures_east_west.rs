//! BPF_PROG_TEST_RUN fixtures for the east-west programs (`tc_pod_ingress`,
//! `tc_egress`) and for affinity shared across a Service port's addresses,
//! written once on a family's address plan ([`dataplane_tests::plan`]) and
//! run for both (`<test>::ipv4` on a single-stack node, `<test>::ipv6` on a
//! dual-stack one). Output checksums are verified by the test's own
//! implementation.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use aya::programs::{SchedClassifier, Xdp};
use dataplane_agent::{dataplane::Datapath, net::Protocol};
use dataplane_common::names;
use dataplane_tests::{
    for_both_families,
    packet::{Frame, ICMP, ICMPV6, TCP_ACK, TCP_SYN, parse_and_verify},
    plan::{self, Family, Plan},
    services::{TestEndpoint, TestService},
    testrun::{fixture_datapath_configured, run},
};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

for_both_families! {
    fn tc_pod_ingress_translates_pod_flows_and_answers_their_rejects => pod_flows_and_rejects;
    fn hairpin_is_snated_by_tc_egress_and_replies_restored => hairpin;
    fn session_affinity_is_shared_across_a_service_ports_addresses => affinity_across_addresses;
    fn pods_reach_the_ingress_fixtures_services => pods_reach_services;
}

/// This suite's ClusterIPs: 10.96.0.`n`, fd00:10:96::`n` (`web`'s is the
/// plan's `cluster_ip`).
fn cip(p: &Plan, n: u8) -> IpAddr {
    match p.family {
        Family::V4 => Ipv4Addr::new(10, 96, 0, n).into(),
        Family::V6 => Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, n.into()).into(),
    }
}

const EMPTY: u8 = 11;
const ITP: u8 = 12;
const HAIRPIN: u8 = 13;
const AFF: u8 = 14;

fn datapath(p: &Plan) -> Datapath {
    let services = [
        TestService::new(1, "web", Protocol::Tcp, 80)
            .cluster_ip(p.cluster_ip)
            .endpoint(TestEndpoint::ready(p.remote_pod, 8080, 1)),
        TestService::new(2, "empty", Protocol::Tcp, 80).cluster_ip(cip(p, EMPTY)),
        TestService::new(3, "itp", Protocol::Tcp, 80)
            .cluster_ip(cip(p, ITP))
            .internal_local()
            .endpoint(TestEndpoint::ready(p.remote_pod, 8080, 1)),
        TestService::new(4, "hairpin", Protocol::Tcp, 80)
            .cluster_ip(cip(p, HAIRPIN))
            .endpoint(TestEndpoint::ready(p.other_local_pod, 8080, 0)),
        p.sticky_pods().into_iter().fold(
            TestService::new(5, "sticky", Protocol::Tcp, 80)
                .cluster_ip(cip(p, AFF))
                .node_port(30080)
                .affinity(Duration::from_secs(600)),
            |s, ip| s.endpoint(TestEndpoint::ready(ip, 8080, 1)),
        ),
    ];
    fixture_datapath_configured(p.node_ips, &services, |_| {})
}

fn run_tc(prog: &SchedClassifier, input: &[u8]) -> (u32, Vec<u8>) {
    let (v, out, _) = run(prog, input, 1);
    (v, out)
}

fn run_xdp(prog: &Xdp, input: &[u8]) -> (u32, Vec<u8>) {
    let (v, out, _) = run(prog, input, 1);
    (v, out)
}

fn pod_flows_and_rejects(p: &Plan) {
    let sa = |ip, port| p.sa(ip, port);
    let (pod, remote) = (p.other_local_pod, p.remote_pod);
    let dp = datapath(p);
    let pod_in = dp.tc(names::TC_POD_INGRESS).unwrap();
    let syn = |src: u16, dst| Frame::tcp(sa(pod, src), dst, TCP_SYN).build();

    // Pod -> ClusterIP: DNAT, source kept (in-cluster).
    let (v, out) = run_tc(pod_in, &syn(40000, sa(p.cluster_ip, 80)));
    assert_eq!(v, TC_ACT_OK);
    let o = parse_and_verify(&out);
    assert_eq!((o.src_addr(), o.dst_addr()), (sa(pod, 40000), sa(remote, 8080)));
    // The next packet of the flow follows conntrack.
    let (v, out) = run_tc(
        pod_in,
        &Frame::tcp(sa(pod, 40000), sa(p.cluster_ip, 80), TCP_ACK).build(),
    );
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(parse_and_verify(&out).dst_addr(), sa(remote, 8080));

    // No endpoints: the frame becomes an ICMP (ICMPv6) port-unreachable
    // redirected back to the pod.
    let input = syn(40001, sa(cip(p, EMPTY), 80));
    let (v, out) = run_tc(pod_in, &input);
    assert_eq!(v, TC_ACT_REDIRECT);
    let (i, o) = (parse_and_verify(&input), parse_and_verify(&out));
    let (proto, unreachable) = match p.family {
        Family::V4 => (ICMP, [3, 3]),
        Family::V6 => (ICMPV6, [1, 4]),
    };
    assert_eq!((o.src, o.dst, o.proto), (cip(p, EMPTY), pod, proto));
    assert_eq!((o.src_mac, o.dst_mac), (i.dst_mac, i.src_mac));
    assert_eq!(&o.l4[..2], &unreachable);
    assert_eq!(
        &o.l4[8..],
        &input[14..14 + p.ip_header_len + 8],
        "quotes the pod's packet"
    );

    // iTP=Local without a local endpoint: dropped.
    let (v, _) = run_tc(pod_in, &syn(40002, sa(cip(p, ITP), 80)));
    assert_eq!(v, TC_ACT_SHOT);

    // Not a Service: untouched.
    let input = syn(40003, sa(remote, 8080));
    let (v, out) = run_tc(pod_in, &input);
    assert_eq!((v, out), (TC_ACT_OK, input));
}

fn hairpin(p: &Plan) {
    let sa = |ip, port| p.sa(ip, port);
    let pod = p.other_local_pod;
    let dp = datapath(p);
    let (pod_in, egress) = (
        dp.tc(names::TC_POD_INGRESS).unwrap(),
        dp.tc(names::TC_EGRESS).unwrap(),
    );
    // The pod reaches itself through its Service.
    let (v, out) = run_tc(
        pod_in,
        &Frame::tcp(sa(pod, 41000), sa(cip(p, HAIRPIN), 80), TCP_SYN).build(),
    );
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(parse_and_verify(&out).dst_addr(), sa(pod, 8080));
    // Routed back to its own interface: tc_egress masquerades the source.
    let (v, out) = run_tc(egress, &out);
    assert_eq!(v, TC_ACT_OK);
    let o = parse_and_verify(&out);
    assert_eq!(o.src, p.node, "hairpin: SNAT to the node");
    let snat = o.src_addr();
    // The reply: back to the pod's original socket, from the Service address.
    let reply = Frame::tcp(sa(pod, 8080), snat, TCP_SYN | TCP_ACK).build();
    let (v, out) = run_tc(pod_in, &reply);
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(parse_and_verify(&out).dst_addr(), sa(pod, 41000), "un-SNAT");
    let (v, out) = run_tc(egress, &out);
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(
        parse_and_verify(&out).src_addr(),
        sa(cip(p, HAIRPIN), 80),
        "un-DNAT"
    );
}

fn affinity_across_addresses(p: &Plan) {
    let sa = |ip, port| p.sa(ip, port);
    let pod = p.other_local_pod;
    let dp = datapath(p);
    let (xdp, pod_in) = (dp.xdp().unwrap(), dp.tc(names::TC_POD_INGRESS).unwrap());
    // A client outside the cluster: first through the NodePort (XDP)...
    let client = p.client;
    let (_, out) = run_xdp(
        xdp,
        &Frame::tcp(sa(client, 42000), sa(p.node, 30080), TCP_SYN).build(),
    );
    let backend = parse_and_verify(&out).dst;
    // ...then, from new connections, through the NodePort and the ClusterIP
    // alike: always the same backend (8 candidates).
    for i in 0..10u16 {
        let dst = if i % 2 == 0 {
            sa(cip(p, AFF), 80)
        } else {
            sa(p.node, 30080)
        };
        let (_, out) = run_xdp(xdp, &Frame::tcp(sa(client, 42001 + i), dst, TCP_SYN).build());
        assert_eq!(parse_and_verify(&out).dst, backend, "connection {i} to {dst}");
    }
    // A pod has its own affinity, kept across the port's addresses too.
    let (_, out) = run_tc(
        pod_in,
        &Frame::tcp(sa(pod, 43000), sa(cip(p, AFF), 80), TCP_SYN).build(),
    );
    let pod_backend = parse_and_verify(&out).dst;
    for i in 0..10u16 {
        let dst = if i % 2 == 0 {
            sa(p.node, 30080)
        } else {
            sa(cip(p, AFF), 80)
        };
        let (_, out) = run_tc(pod_in, &Frame::tcp(sa(pod, 43001 + i), dst, TCP_SYN).build());
        assert_eq!(
            parse_and_verify(&out).dst,
            pod_backend,
            "pod connection {i} to {dst}"
        );
    }
}

/// Pods reach the ingress fixtures' Services ([`dataplane_tests::plan`],
/// IPv4 and IPv6) through `tc_pod_ingress`: ClusterIP without SNAT,
/// hairpin (the backend is the pod itself) masqueraded to the node, an
/// eTP=Local external destination short-circuited to the cluster set.
fn pods_reach_services(p: &Plan) {
    let dp = plan::datapath(p);
    let pod = |name: &'static str, input: &[u8]| {
        let (v, out, _) = run(dp.tc(name).unwrap(), input, 1);
        (v, parse_and_verify(&out))
    };
    let other_pod = p.sa(p.other_local_pod, 42000);
    let (v, o) = pod(
        names::TC_POD_INGRESS,
        &Frame::tcp(other_pod, p.sa(p.cluster_ip, 80), TCP_SYN).build(),
    );
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(o.dst_addr(), p.sa(p.remote_pod, 8080));
    assert_eq!(o.src_addr(), other_pod, "pod → ClusterIP: the pod's address kept");

    // Hairpin: the only backend is the pod itself.
    let me = p.sa(p.local_pod, 42001);
    let (v, o) = pod(
        names::TC_POD_INGRESS,
        &Frame::tcp(me, p.sa(p.service_ip(10), 80), TCP_SYN).build(),
    );
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(o.dst_addr(), p.sa(p.local_pod, 8080));
    let (v, out, _) = run(
        dp.tc(names::TC_EGRESS).unwrap(),
        &Frame::tcp(me, p.sa(p.local_pod, 8080), TCP_SYN).build(),
        1,
    );
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(
        parse_and_verify(&out).src,
        p.node,
        "hairpin: masqueraded to the node"
    );

    // eTP=Local external destination from a pod: the cluster set, no SNAT.
    // (Another client port: from 42000 the backend would see the live
    // ClusterIP flow's tuple again, a clash.)
    let other_pod2 = p.sa(p.other_local_pod, 42002);
    let (v, o) = pod(
        names::TC_POD_INGRESS,
        &Frame::tcp(other_pod2, p.sa(p.node, 30082), TCP_SYN).build(),
    );
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(
        o.dst_addr(),
        p.sa(p.remote_pod, 8080),
        "short-circuit to the cluster set"
    );
}
