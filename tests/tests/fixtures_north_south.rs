//! BPF_PROG_TEST_RUN fixtures for `xdp_ingress`: maps programmed through the
//! agent's own code path, an input frame, the expected verdict and output.
//! Output checksums are verified by the test's own implementation.

use std::net::{Ipv4Addr, SocketAddrV4};

use dataplane_agent::{dataplane::Datapath, net::Protocol};
use dataplane_common::stats::Event;
use dataplane_tests::{
    packet::{Frame, ICMP, TCP_ACK, TCP_SYN, parse_and_verify},
    services::{TestEndpoint, TestService},
    testrun::{self, fixture_datapath},
};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;

const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 10);
const LB_LOCAL: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const EXT_UDP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 20);
const LB_RANGED: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 30);
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// A datapath (nothing attached) holding the fixture services, as node1.
fn datapath() -> Datapath {
    let local = |port| TestEndpoint::ready(LOCAL_POD, port, 0);
    let remote = |port| TestEndpoint::ready(REMOTE_POD, port, 1);
    let services = [
        TestService::new(1, "np-cluster", Protocol::Tcp, 80)
            .node_port(30080)
            .endpoint(remote(8080)),
        TestService::new(2, "lb-local", Protocol::Tcp, 80)
            .load_balancer_ip(LB_LOCAL)
            .external_local()
            .endpoint(local(8080)),
        TestService::new(3, "ext-udp", Protocol::Udp, 53)
            .external_ip(EXT_UDP)
            .external_local()
            .endpoint(local(5353)),
        TestService::new(4, "empty", Protocol::Tcp, 80).node_port(30081),
        TestService::new(5, "local-none", Protocol::Tcp, 80)
            .node_port(30082)
            .external_local()
            .endpoint(remote(8080)),
        TestService::new(6, "ranged", Protocol::Tcp, 80)
            .load_balancer_ip(LB_RANGED)
            .source_range("203.0.113.0/24")
            .endpoint(remote(8080)),
        TestService::new(7, "cip", Protocol::Tcp, 80)
            .cluster_ip(CLUSTER_IP)
            .endpoint(remote(8080)),
        (1..=4).fold(
            TestService::new(8, "spread", Protocol::Tcp, 80).node_port(30083),
            |svc, i| svc.endpoint(TestEndpoint::ready(Ipv4Addr::new(10, 244, 2, 20 + i), 8080, 1)),
        ),
    ];
    fixture_datapath(NODE, &services)
}

/// Runs one frame through `xdp_ingress`: (verdict, output frame).
fn run(dp: &Datapath, input: &[u8]) -> (u32, Vec<u8>) {
    let (v, out, _) = testrun::run(dp.xdp().unwrap(), input, 1);
    (v, out)
}

/// What a fixture expects.
enum Expect {
    /// XDP_PASS with the frame untouched.
    Untouched,
    /// XDP_PASS with exactly these bytes.
    Bytes(Vec<u8>),
    /// XDP_PASS with this destination, source kept, checksums valid.
    Dnat(SocketAddrV4),
    Drop,
    /// XDP_TX with an ICMP port-unreachable for the input.
    Reject,
}

struct Fixture {
    name: &'static str,
    input: Vec<u8>,
    expect: Expect,
    event: Event,
}

fn fixtures() -> Vec<Fixture> {
    let c = |port| sa(CLIENT, port);
    let syn = |src, dst| Frame::tcp(src, dst, TCP_SYN);
    let mut v = Vec::new();
    let mut f = |name, frame: Vec<u8>, expect, event| {
        v.push(Fixture {
            name,
            input: frame,
            expect,
            event,
        })
    };

    f("ARP frame: not ours", arp(), Expect::Untouched, Event::Pass);
    f(
        "TCP to a non-service address",
        syn(c(40000), sa(Ipv4Addr::new(1, 1, 1, 1), 80)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "TCP to the node on a non-NodePort port",
        syn(c(40000), sa(NODE, 22)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "LB IP, eTP=Local: DNAT to the local backend, client kept",
        syn(c(40001), sa(LB_LOCAL, 80)).build(),
        Expect::Bytes(syn(c(40001), sa(LOCAL_POD, 8080)).build()),
        Event::NewFlow,
    );
    let mut vlan_in = syn(c(40002), sa(LB_LOCAL, 80));
    vlan_in.vlans = vec![100];
    let mut vlan_out = syn(c(40002), sa(LOCAL_POD, 8080));
    vlan_out.vlans = vec![100];
    f(
        "VLAN-tagged frame: translated, tag kept",
        vlan_in.build(),
        Expect::Bytes(vlan_out.build()),
        Event::NewFlow,
    );
    let mut qinq_in = syn(c(40003), sa(LB_LOCAL, 80));
    qinq_in.vlans = vec![200, 100];
    let mut qinq_out = syn(c(40003), sa(LOCAL_POD, 8080));
    qinq_out.vlans = vec![200, 100];
    f(
        "double-tagged frame: translated",
        qinq_in.build(),
        Expect::Bytes(qinq_out.build()),
        Event::NewFlow,
    );
    let mut opts_in = syn(c(40004), sa(LB_LOCAL, 80));
    opts_in.ip_options = vec![1, 1, 1, 0]; // NOP, NOP, NOP, EOL
    let mut opts_out = syn(c(40004), sa(LOCAL_POD, 8080));
    opts_out.ip_options = vec![1, 1, 1, 0];
    f(
        "IP options: translated after them",
        opts_in.build(),
        Expect::Bytes(opts_out.build()),
        Event::NewFlow,
    );
    f(
        "UDP external IP, eTP=Local",
        Frame::udp(c(40005), sa(EXT_UDP, 53)).build(),
        Expect::Bytes(Frame::udp(c(40005), sa(LOCAL_POD, 5353)).build()),
        Event::NewFlow,
    );
    let mut zero_in = Frame::udp(c(40006), sa(EXT_UDP, 53));
    zero_in.udp_zero_checksum = true;
    let mut zero_out = Frame::udp(c(40006), sa(LOCAL_POD, 5353));
    zero_out.udp_zero_checksum = true;
    f(
        "UDP zero checksum stays zero",
        zero_in.build(),
        Expect::Bytes(zero_out.build()),
        Event::NewFlow,
    );
    f(
        "NodePort eTP=Cluster: DNAT to the remote backend",
        syn(c(40007), sa(NODE, 30080)).build(),
        Expect::Dnat(sa(REMOTE_POD, 8080)),
        Event::NewFlow,
    );
    f(
        "no endpoints: ICMP port-unreachable",
        syn(c(40008), sa(NODE, 30081)).build(),
        Expect::Reject,
        Event::RejectNoEndpoints,
    );
    f(
        "UDP to a TCP-only NodePort: not ours",
        Frame::udp(c(40008), sa(NODE, 30081)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "eTP=Local without a local endpoint: drop",
        syn(c(40009), sa(NODE, 30082)).build(),
        Expect::Drop,
        Event::DropNoLocalEndpoint,
    );
    f(
        "source outside loadBalancerSourceRanges: drop",
        syn(c(40010), sa(LB_RANGED, 80)).build(),
        Expect::Drop,
        Event::DropSourceRange,
    );
    f(
        "ClusterIP from off-node: DNAT",
        syn(c(40011), sa(CLUSTER_IP, 80)).build(),
        Expect::Dnat(sa(REMOTE_POD, 8080)),
        Event::NewFlow,
    );
    f(
        "ClusterIP on a port it does not serve: reject",
        syn(c(40012), sa(CLUSTER_IP, 81)).build(),
        Expect::Reject,
        Event::RejectUnknownPort,
    );
    f(
        "unallocated address in the service CIDR: drop",
        syn(c(40013), sa(Ipv4Addr::new(10, 96, 9, 9), 80)).build(),
        Expect::Drop,
        Event::DropUnallocatedServiceIp,
    );
    let mut frag = syn(c(40014), sa(LB_LOCAL, 80));
    frag.frag = 0x2000; // MF: first fragment
    f(
        "first fragment: passed untouched, never half-translated",
        frag.build(),
        Expect::Untouched,
        Event::Fragment,
    );
    let mut frag2 = syn(c(40014), sa(LB_LOCAL, 80));
    frag2.frag = 185; // offset 1480: no L4 header at all
    f(
        "non-first fragment: passed untouched",
        frag2.build(),
        Expect::Untouched,
        Event::Fragment,
    );
    let mut truncated = syn(c(40015), sa(LB_LOCAL, 80)).build();
    truncated.truncate(14 + 20 + 10);
    f(
        "truncated TCP header: passed untouched",
        truncated,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut lying = syn(c(40016), sa(LB_LOCAL, 80)).build();
    lying[16..18].copy_from_slice(&2000u16.to_be_bytes()); // IP total length beyond the frame
    f(
        "IP total length beyond the frame: passed untouched",
        lying,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut bad_ihl = syn(c(40017), sa(LB_LOCAL, 80)).build();
    bad_ihl[14] = 0x43;
    f(
        "IHL below 5: passed untouched",
        bad_ihl,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut sctp = syn(c(40018), sa(LB_LOCAL, 80)).build();
    sctp[23] = 132;
    f(
        "SCTP: not translated",
        sctp,
        Expect::Untouched,
        Event::UnsupportedProto,
    );
    v
}

fn arp() -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 1, 0x08, 0x06]);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&[
        0x02, 0, 0, 0, 0, 1, 198, 18, 0, 100, 0, 0, 0, 0, 0, 0, 198, 18, 0, 11,
    ]);
    f
}

#[test]
fn xdp_ingress_fixture_table() {
    let dp = datapath();
    let mut failures = Vec::new();
    for fx in fixtures() {
        let before = dp.maps().counter(fx.event).unwrap().packets;
        let (verdict, out) = run(&dp, &fx.input);
        let result = std::panic::catch_unwind(|| check(&fx, verdict, &out));
        let after = dp.maps().counter(fx.event).unwrap().packets;
        if let Err(e) = result {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
            failures.push(format!("{}: {}", fx.name, msg.unwrap_or_default()));
        } else if after != before + 1 {
            failures.push(format!(
                "{}: counter {} did not count the packet",
                fx.name,
                fx.event.name()
            ));
        }
    }
    assert!(failures.is_empty(), "fixtures failed:\n{}", failures.join("\n"));
}

fn check(fx: &Fixture, verdict: u32, out: &[u8]) {
    match &fx.expect {
        Expect::Untouched => {
            assert_eq!(verdict, XDP_PASS, "verdict");
            assert_eq!(out, &fx.input[..], "frame must be untouched");
        }
        Expect::Bytes(want) => {
            assert_eq!(verdict, XDP_PASS, "verdict");
            parse_and_verify(out);
            assert_eq!(out, &want[..], "output bytes");
        }
        Expect::Dnat(to) => {
            assert_eq!(verdict, XDP_PASS, "verdict");
            let (i, o) = (parse_and_verify(&fx.input), parse_and_verify(out));
            assert_eq!(o.dst_addr(), *to, "destination");
            assert_eq!(
                o.src_addr(),
                i.src_addr(),
                "the source is rewritten at egress, not here"
            );
        }
        Expect::Drop => assert_eq!(verdict, XDP_DROP, "verdict"),
        Expect::Reject => {
            assert_eq!(verdict, XDP_TX, "verdict");
            let i = parse_and_verify(&fx.input);
            let o = parse_and_verify(out);
            assert_eq!((o.src_mac, o.dst_mac), (i.dst_mac, i.src_mac), "MACs swapped");
            assert_eq!(
                (o.src, o.dst, o.proto),
                (i.dst, i.src, ICMP),
                "ICMP from the address tried to the client"
            );
            assert_eq!(&o.l4[..2], &[3, 3], "destination unreachable / port unreachable");
            let quoted = &o.l4[8..];
            assert_eq!(
                quoted,
                &fx.input[i.l3..i.l3 + 28],
                "quotes the IP header and 8 bytes of the segment"
            );
        }
    }
}

#[test]
fn established_flow_and_replies_follow_conntrack() {
    let dp = datapath();
    // NodePort eTP=Cluster: new flow, then the next packet of the same flow.
    let client = sa(CLIENT, 41000);
    let (v, out) = run(&dp, &Frame::tcp(client, sa(NODE, 30080), TCP_SYN).build());
    assert_eq!(v, XDP_PASS);
    assert_eq!(parse_and_verify(&out).dst_addr(), sa(REMOTE_POD, 8080));
    let (v, out) = run(&dp, &Frame::tcp(client, sa(NODE, 30080), TCP_ACK).build());
    assert_eq!(v, XDP_PASS);
    assert_eq!(parse_and_verify(&out).dst_addr(), sa(REMOTE_POD, 8080));
    assert_eq!(dp.maps().counter(Event::Established).unwrap().packets, 1);

    // The flow is SNATed: the reply from the remote backend comes back to
    // node:port, and XDP sends it on to the client.
    let ct = dp.maps().conntrack().unwrap();
    let (_, fwd) = ct
        .iter()
        .find(|(k, _)| k.saddr == u32::from(CLIENT).to_be() && k.dport == 30080u16.to_be())
        .expect("forward entry");
    let snat_port = u16::from_be(fwd.nat_sport);
    assert_eq!(
        Ipv4Addr::from(u32::from_be(fwd.nat_saddr)),
        NODE,
        "SNAT to the node"
    );
    assert!(
        (1024..=32767).contains(&snat_port),
        "SNAT port {snat_port} in the configured range"
    );
    let reply = Frame::tcp(sa(REMOTE_POD, 8080), sa(NODE, snat_port), TCP_SYN | TCP_ACK).build();
    let (v, out) = run(&dp, &reply);
    assert_eq!(v, XDP_PASS);
    let o = parse_and_verify(&out);
    assert_eq!(o.dst_addr(), client, "un-SNAT: back to the client");
    assert_eq!(
        o.src_addr(),
        sa(REMOTE_POD, 8080),
        "the source is restored at egress (tc_egress)"
    );
}

#[test]
fn new_flows_spread_uniformly_over_backends() {
    let dp = datapath();
    const FLOWS: u16 = 2000;
    let mut per_backend = std::collections::BTreeMap::new();
    for i in 0..FLOWS {
        let (v, out) = run(
            &dp,
            &Frame::tcp(sa(CLIENT, 10000 + i), sa(NODE, 30083), TCP_SYN).build(),
        );
        assert_eq!(v, XDP_PASS);
        *per_backend.entry(parse_and_verify(&out).dst).or_insert(0u32) += 1;
    }
    assert_eq!(per_backend.len(), 4, "every backend is chosen: {per_backend:?}");
    // Expected 500 each; a binomial standard deviation is ~19, so 350..650
    // only fails if selection is biased, not by chance (> 7 sigma).
    for (backend, n) in &per_backend {
        assert!(
            (350..=650).contains(n),
            "{backend} got {n} of {FLOWS} flows: {per_backend:?}"
        );
    }
}

#[test]
fn udp_flows_to_a_backend_can_be_purged() {
    let mut dp = datapath();
    for port in [42000, 42001, 42002] {
        let (v, _) = run(&dp, &Frame::udp(sa(CLIENT, port), sa(EXT_UDP, 53)).build());
        assert_eq!(v, XDP_PASS);
    }
    let udp_entries = |dp: &Datapath| {
        dp.maps()
            .conntrack()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.proto == 17)
            .count()
    };
    assert_eq!(udp_entries(&dp), 6, "two entries per flow (no SNAT)");
    let backend = dp
        .maps()
        .backends()
        .unwrap()
        .into_iter()
        .find(|(_, b)| b.addr == LOCAL_POD && b.port == 5353)
        .map(|(id, _)| id)
        .expect("backend id");
    let purged = dp.maps_mut().purge_udp_flows_to(&[backend]).unwrap();
    assert_eq!(purged, 6);
    assert_eq!(udp_entries(&dp), 0);
}
