//! Forwarding in the datapath, through BPF_PROG_TEST_RUN: XDP that sends
//! translated frames on itself (`--host-routing`), DSR (the LB node's
//! encapsulation, the backend node's decapsulation) and Maglev. The
//! programs run as if their packet came in on the uplink of a network
//! namespace this test builds, so that `bpf_fib_lookup` answers from its
//! routes and neighbours:
//!
//! ```text
//!   up0 198.18.0.11/24 (node1)       client .100 (neighbour known)
//!                                    node2 .12 (neighbour known): 10.244.2.0/24 via it
//!                                    .13 (no neighbour entry):   10.244.3.0/24 via it
//!   pods0 10.244.1.1/24              pod 10.244.1.20 (neighbour known)
//! ```
//! End to end (real packets between namespaces): `forwarding.rs`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use dataplane_agent::{dataplane::Datapath, net::Protocol, state::inputs::LbMode};
use dataplane_common::{
    names,
    stats::{Event, FlowStat},
};
use dataplane_tests::{
    fixture::flow_stat,
    netns::NetNs,
    packet::{Frame, TCP_ACK, TCP_SYN, parse_and_verify},
    services::{TestEndpoint, TestService},
    testrun::{fixture_datapath_of_node, run_on_device, run_xdp_on_device},
};

const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const NODE2: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 12);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11);
const NODE2_6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x12);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100);
/// A pod on node2, one behind a gateway without a neighbour entry, one on
/// this node.
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 10);
const REMOTE_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 0x10);
const UNRESOLVED_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 3, 10);
const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 20);
const UP0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x11];
const NODE2_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x12];
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x64];
const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x20];

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

const WEB: u16 = 30080;
const UNRESOLVED: u16 = 30081;
const LOCAL: u16 = 30082;
const DSR: u16 = 30083;
const DSR_LOCAL: u16 = 30084;
const MAGLEV: u16 = 30090;

fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

/// eTP=Cluster NodePorts (masqueraded, or DSR) in both families.
fn services() -> Vec<TestService> {
    vec![
        TestService::new(1, "web", Protocol::Tcp, 80)
            .node_port(WEB)
            .endpoint(TestEndpoint::ready(REMOTE_POD, 8080, 1)),
        TestService::new(2, "web6", Protocol::Tcp, 80)
            .cluster_ip(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10))
            .node_port(WEB)
            .endpoint(TestEndpoint::ready(REMOTE_POD6, 8080, 1)),
        TestService::new(3, "unresolved", Protocol::Tcp, 80)
            .node_port(UNRESOLVED)
            .endpoint(TestEndpoint::ready(UNRESOLVED_POD, 8080, 1)),
        TestService::new(4, "local", Protocol::Tcp, 80)
            .node_port(LOCAL)
            .endpoint(TestEndpoint::ready(LOCAL_POD, 8080, 0)),
        TestService::new(5, "dsr", Protocol::Tcp, 80)
            .node_port(DSR)
            .lb_mode(LbMode::Dsr)
            .endpoint(TestEndpoint::ready(REMOTE_POD, 8080, 1)),
        TestService::new(6, "dsr6", Protocol::Tcp, 80)
            .cluster_ip(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x11))
            .node_port(DSR)
            .lb_mode(LbMode::Dsr)
            .endpoint(TestEndpoint::ready(REMOTE_POD6, 8080, 1)),
        TestService::new(7, "dsr-local", Protocol::Tcp, 80)
            .node_port(DSR_LOCAL)
            .lb_mode(LbMode::Dsr)
            .endpoint(TestEndpoint::ready(LOCAL_POD, 8080, 0)),
        TestService::new(8, "dsr-udp", Protocol::Udp, 53)
            .node_port(DSR)
            .lb_mode(LbMode::Hybrid)
            .endpoint(TestEndpoint::ready(REMOTE_POD, 5353, 1)),
    ]
}

/// Node `node`'s datapath (0: the LB node, this namespace's; 1: the
/// backend's node), host routing as said.
fn datapath(node: usize, host_routing: bool) -> Datapath {
    let ips: Vec<IpAddr> = if node == 0 {
        vec![NODE.into(), NODE6.into()]
    } else {
        vec![NODE2.into(), NODE2_6.into()]
    };
    fixture_datapath_of_node(node, &ips, &services(), |c| c.host_routing = host_routing)
}

fn mac(m: [u8; 6]) -> String {
    m.map(|b| format!("{b:02x}")).join(":")
}

/// The namespace (see the module docs); returns it with the ifindexes of
/// `up0` and `pods0`.
fn node_namespace(tag: &str) -> (NetNs, u32, u32) {
    let ns = NetNs::new(&format!("dp-fw{tag}-{}", std::process::id()));
    ns.ip_batch(&format!(
        "link add up0 address {up0} type veth peer name up1
link add pods0 type veth peer name pods1
link set up0 up
link set up1 up
link set pods0 up
link set pods1 up
addr add {NODE}/24 dev up0
addr add {NODE6}/64 dev up0 nodad
addr add 10.244.1.1/24 dev pods0
neigh add {CLIENT} lladdr {client} dev up0 nud permanent
neigh add {NODE2} lladdr {node2} dev up0 nud permanent
neigh add {CLIENT6} lladdr {client} dev up0 nud permanent
neigh add {NODE2_6} lladdr {node2} dev up0 nud permanent
neigh add {LOCAL_POD} lladdr {pod} dev pods0 nud permanent
route add 10.244.2.0/24 via {NODE2}
route add fd00:10:244:2::/64 via {NODE2_6}
route add 10.244.3.0/24 via 198.18.0.13
",
        up0 = mac(UP0_MAC),
        client = mac(CLIENT_MAC),
        node2 = mac(NODE2_MAC),
        pod = mac(POD_MAC),
    ));
    ns.sysctl("net/ipv4/ip_forward", "1");
    ns.sysctl("net/ipv6/conf/all/forwarding", "1");
    let index = |dev: &str| {
        ns.run(|| {
            let name = std::ffi::CString::new(dev).unwrap();
            // SAFETY: a NUL-terminated name; returns 0 when unknown.
            unsafe { libc::if_nametoindex(name.as_ptr()) }
        })
    };
    let (up0, pods0) = (index("up0"), index("pods0"));
    assert!(up0 != 0 && pods0 != 0, "devices of {}", ns.name());
    (ns, up0, pods0)
}

fn from_client(src: SocketAddr, dst: SocketAddr, flags: u8) -> Frame {
    let mut f = Frame::tcp(src, dst, flags);
    f.src_mac = CLIENT_MAC;
    f.dst_mac = UP0_MAC;
    f
}

/// XDP forwards a masqueraded flow's packets itself, both ways: the SNAT
/// the egress hook would have made is made here, the frame leaves out of
/// the device it came in on with the next hop's MAC and its TTL
/// decremented.
#[test]
fn xdp_forwards_masqueraded_flows_both_ways() {
    let (ns, up0, _) = node_namespace("fwd");
    let dp = datapath(0, true);
    let xdp = dp.xdp().unwrap();
    ns.run(|| {
        for (client, node, pod, node_ip) in [
            (
                sa(CLIENT, 40000),
                sa(NODE, WEB),
                sa(REMOTE_POD, 8080),
                IpAddr::from(NODE),
            ),
            (
                sa(CLIENT6, 40000),
                sa(NODE6, WEB),
                sa(REMOTE_POD6, 8080),
                IpAddr::from(NODE6),
            ),
        ] {
            let mut snat = None;
            for flags in [TCP_SYN, TCP_ACK] {
                let f = from_client(client, node, flags);
                let (v, out) = run_xdp_on_device(xdp, &f.build(), up0);
                assert_eq!(v, XDP_TX, "{client} -> {node} flags {flags:#x}");
                let o = parse_and_verify(&out);
                assert_eq!(o.dst_addr(), pod, "DNAT");
                assert_eq!(o.src, node_ip, "SNAT to the node");
                assert!(o.sport < 32768, "a SNAT port: {}", o.sport);
                assert_eq!(*snat.get_or_insert(o.sport), o.sport, "one port per flow");
                assert_eq!((o.src_mac, o.dst_mac, o.ttl), (UP0_MAC, NODE2_MAC, 63));
            }
            // The reply, from node2: un-SNATed, the frontend restored, back
            // to the client.
            let mut r = Frame::tcp(pod, sa(node_ip, snat.unwrap()), TCP_ACK);
            r.src_mac = NODE2_MAC;
            r.dst_mac = UP0_MAC;
            let (v, out) = run_xdp_on_device(xdp, &r.build(), up0);
            assert_eq!(v, XDP_TX, "reply to {client}");
            let o = parse_and_verify(&out);
            assert_eq!((o.src_addr(), o.dst_addr()), (node, client), "reply translated");
            assert_eq!((o.src_mac, o.dst_mac, o.ttl), (UP0_MAC, CLIENT_MAC, 63));
        }
    });
    assert_eq!(flow_stat(&dp, FlowStat::XdpForwarded), 6);
}

/// What XDP cannot send completely goes to the stack translated as far as
/// ingress translates (the egress hook does the rest), counted by reason;
/// a device in `DP_XDP_DEVICES_V1` gets the frame redirected.
#[test]
fn xdp_leaves_to_the_stack_what_it_cannot_forward() {
    let (ns, up0, pods0) = node_namespace("fallback");
    let mut dp = datapath(0, true);
    ns.run(|| {
        let xdp = dp.xdp().unwrap();
        let dnat_only = |f: &Frame, out: &[u8], to: SocketAddr| {
            let (i, o) = (parse_and_verify(&f.build()), parse_and_verify(out));
            assert_eq!(o.dst_addr(), to);
            assert_eq!(o.src_addr(), i.src_addr(), "no SNAT: egress makes it");
            assert_eq!((o.ttl, o.dst_mac), (i.ttl, i.dst_mac));
        };
        // No neighbour entry for the next hop.
        let f = from_client(sa(CLIENT, 41000), sa(NODE, UNRESOLVED), TCP_SYN);
        let (v, out) = run_xdp_on_device(xdp, &f.build(), up0);
        assert_eq!(v, XDP_PASS, "unresolved neighbour");
        dnat_only(&f, &out, sa(UNRESOLVED_POD, 8080));
        assert_eq!(flow_stat(&dp, FlowStat::FwdNoNeighbour), 1);
        // A TTL about to expire.
        let mut f = from_client(sa(CLIENT, 41001), sa(NODE, WEB), TCP_SYN);
        f.ttl = 1;
        let (v, out) = run_xdp_on_device(xdp, &f.build(), up0);
        assert_eq!(v, XDP_PASS, "TTL 1");
        dnat_only(&f, &out, sa(REMOTE_POD, 8080));
        assert_eq!(flow_stat(&dp, FlowStat::FwdTtl), 1);
        // A local pod behind a device XDP cannot send to.
        let f = from_client(sa(CLIENT, 41002), sa(NODE, LOCAL), TCP_SYN);
        let (v, out) = run_xdp_on_device(xdp, &f.build(), up0);
        assert_eq!(v, XDP_PASS, "a device not in DP_XDP_DEVICES_V1");
        dnat_only(&f, &out, sa(LOCAL_POD, 8080));
        assert_eq!(flow_stat(&dp, FlowStat::FwdDevice), 1);
    });
    // Once it is listed, the frame is redirected there (the kernel takes
    // the index in the caller's namespace: listed from inside it).
    ns.run(|| {
        dp.maps_mut().set_xdp_device(pods0, true).unwrap();
        let xdp = dp.xdp().unwrap();
        let f = from_client(sa(CLIENT, 41002), sa(NODE, LOCAL), TCP_ACK);
        let (v, out) = run_xdp_on_device(xdp, &f.build(), up0);
        assert_eq!(v, XDP_REDIRECT, "listed device");
        let o = parse_and_verify(&out);
        assert_eq!(
            (o.dst_addr(), o.dst_mac, o.ttl),
            (sa(LOCAL_POD, 8080), POD_MAC, 63)
        );
    });
    assert_eq!(dp.maps().derived().xdp_devices(), vec![pods0]);
}

/// Without host routing XDP translates and passes, as before.
#[test]
fn without_host_routing_xdp_passes_translated_frames() {
    let (ns, up0, _) = node_namespace("off");
    let dp = datapath(0, false);
    ns.run(|| {
        let f = from_client(sa(CLIENT, 40000), sa(NODE, WEB), TCP_SYN);
        let (v, out) = run_xdp_on_device(dp.xdp().unwrap(), &f.build(), up0);
        assert_eq!(v, XDP_PASS);
        let o = parse_and_verify(&out);
        assert_eq!(
            (o.src_addr(), o.dst_addr()),
            (sa(CLIENT, 40000), sa(REMOTE_POD, 8080))
        );
    });
    assert_eq!(flow_stat(&dp, FlowStat::XdpForwarded), 0);
}

/// The outer header of an encapsulated frame: (source, destination,
/// protocol, TTL) and the inner IP packet.
fn outer(out: &[u8]) -> (IpAddr, IpAddr, u8, u8, Vec<u8>) {
    let o = parse_and_verify(out);
    (o.src, o.dst, o.proto, o.ttl, o.l4)
}

/// DSR on the LB node: a new flow to a remote backend goes out in an
/// outer header from the node to the backend, untranslated inside, from
/// XDP (sent on itself, whatever host routing says) and from TC
/// (`bpf_redirect_neigh`); later packets follow the flow's entry.
#[test]
fn dsr_encapsulates_to_the_backend_untranslated() {
    let (ns, up0, _) = node_namespace("dsr");
    let dp = datapath(0, false);
    ns.run(|| {
        for (client, node, pod, node_ip, proto) in [
            (
                sa(CLIENT, 42000),
                sa(NODE, DSR),
                IpAddr::from(REMOTE_POD),
                IpAddr::from(NODE),
                4,
            ),
            (
                sa(CLIENT6, 42000),
                sa(NODE6, DSR),
                IpAddr::from(REMOTE_POD6),
                IpAddr::from(NODE6),
                41,
            ),
        ] {
            for flags in [TCP_SYN, TCP_ACK] {
                let f = from_client(client, node, flags);
                let input = f.build();
                let (v, out) = run_xdp_on_device(dp.xdp().unwrap(), &input, up0);
                assert_eq!(v, XDP_TX, "{client} flags {flags:#x}");
                let (src, dst, p, ttl, inner) = outer(&out);
                assert_eq!((src, dst, p, ttl), (node_ip, pod, proto, 64), "outer header");
                assert_eq!(inner, input[14..].to_vec(), "the client's packet, untouched");
                assert_eq!(&out[..12], &[NODE2_MAC, UP0_MAC].concat()[..], "next hop's MAC");
            }
        }
        // TC: redirected through the neighbour helper (which writes the
        // MAC addresses itself).
        let f = from_client(sa(CLIENT, 42001), sa(NODE, DSR), TCP_SYN);
        let input = f.build();
        let (v, out) = run_on_device(dp.tc(names::TC_INGRESS).unwrap(), &input, up0);
        assert_eq!(v, TC_ACT_REDIRECT, "TC");
        let (src, dst, p, _, inner) = outer(&out);
        assert_eq!((src, dst, p), (IpAddr::from(NODE), IpAddr::from(REMOTE_POD), 4));
        assert_eq!(inner, input[14..].to_vec());
        // UDP in hybrid mode: masqueraded, not DSR.
        let mut u = Frame::udp(sa(CLIENT, 42002), sa(NODE, DSR));
        u.src_mac = CLIENT_MAC;
        let (v, out) = run_xdp_on_device(dp.xdp().unwrap(), &u.build(), up0);
        assert_eq!(v, XDP_PASS, "hybrid UDP takes the stack");
        assert_eq!(parse_and_verify(&out).dst_addr(), sa(REMOTE_POD, 5353));
        // A local backend: translated here, unmasqueraded (the client's
        // address reaches the pod).
        let f = from_client(sa(CLIENT, 42003), sa(NODE, DSR_LOCAL), TCP_SYN);
        let (v, out) = run_xdp_on_device(dp.xdp().unwrap(), &f.build(), up0);
        assert_eq!(v, XDP_PASS);
        let o = parse_and_verify(&out);
        assert_eq!(
            (o.src_addr(), o.dst_addr()),
            (sa(CLIENT, 42003), sa(LOCAL_POD, 8080))
        );
    });
    assert_eq!(flow_stat(&dp, FlowStat::DsrEncapsulated), 5);
    // The LB node keeps one entry per DSR flow, marked answered once the
    // client acknowledged.
    let dsr_entries: Vec<_> = dp
        .maps()
        .conntrack()
        .unwrap()
        .into_iter()
        .filter(|(k, _)| k.dport == DSR.to_be() && k.proto == 6)
        .collect();
    assert_eq!(dsr_entries.len(), 2, "{dsr_entries:?}");
    assert!(
        dsr_entries.iter().any(|(_, e)| e.state[3] == 1),
        "answered: {dsr_entries:?}"
    );
}

/// A DSR packet that no longer fits the path once encapsulated is answered
/// with ICMP "fragmentation needed" naming the MTU left (so that the
/// client's path MTU discovery adapts); without "don't fragment" it is
/// dropped, counted (XDP does not fragment).
#[test]
fn dsr_answers_packets_too_big_for_the_tunnel() {
    let (ns, up0, _) = node_namespace("big");
    let dp = datapath(0, false);
    ns.run(|| {
        let mut f = from_client(sa(CLIENT, 43000), sa(NODE, DSR), TCP_ACK);
        f.payload = vec![0x5a; 1460];
        f.frag = 0x4000;
        let input = f.build();
        let (v, out) = run_xdp_on_device(dp.xdp().unwrap(), &input, up0);
        assert_eq!(v, XDP_TX, "sent back");
        let o = parse_and_verify(&out);
        assert_eq!(
            (o.src, o.dst, o.proto),
            (IpAddr::from(NODE), IpAddr::from(CLIENT), 1)
        );
        assert_eq!(&o.l4[..2], &[3, 4], "fragmentation needed");
        assert_eq!(u16::from_be_bytes([o.l4[6], o.l4[7]]), 1480, "the MTU left");
        assert_eq!(&o.l4[8..36], &input[14..42], "quoting the client's packet");
        f.frag = 0;
        let (v, _) = run_xdp_on_device(dp.xdp().unwrap(), &f.build(), up0);
        assert_eq!(v, XDP_DROP, "no DF");
    });
    let count = |e: Event| {
        dp.maps()
            .hook_counter(dataplane_common::stats::Hook::XdpIngress, e)
            .unwrap()
            .packets
    };
    assert_eq!((count(Event::RejectTooBig), count(Event::DropDsrTooBig)), (1, 1));
}

/// The backend node: an encapsulated packet through a DSR frontend for a
/// local backend loses its outer header and is translated to the backend;
/// the backend's reply leaves with the frontend (the LB node's address and
/// NodePort) as its source. An encapsulated packet for anything else passes
/// untouched.
#[test]
fn dsr_backend_node_decapsulates_and_replies_as_the_frontend() {
    for program in [names::XDP_INGRESS, names::TC_INGRESS] {
        let dp = datapath(1, false);
        let client = sa(CLIENT, 44000);
        let inner = from_client(client, sa(NODE, DSR), TCP_SYN).build();
        let encapsulated = |inner: &[u8], to: Ipv4Addr| {
            let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 4, 0, 0];
            ip[2..4].copy_from_slice(&((20 + inner.len() - 14) as u16).to_be_bytes());
            ip.extend_from_slice(&NODE.octets());
            ip.extend_from_slice(&to.octets());
            let c = dataplane_tests::packet::internet_checksum(&[&ip]);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            [&inner[..14], &ip[..], &inner[14..]].concat()
        };
        let run = |frame: &[u8]| match program {
            names::XDP_INGRESS => {
                let (v, out, _) = dataplane_tests::testrun::run(dp.xdp().unwrap(), frame, 1);
                (v == XDP_PASS, out)
            }
            _ => {
                let (v, out, _) = dataplane_tests::testrun::run(dp.tc(program).unwrap(), frame, 1);
                (v == TC_ACT_OK, out)
            }
        };
        let (passed, out) = run(&encapsulated(&inner, REMOTE_POD));
        assert!(passed, "{program}");
        let o = parse_and_verify(&out);
        assert_eq!(o.proto, 6, "{program}: decapsulated");
        assert_eq!(
            (o.src_addr(), o.dst_addr()),
            (client, sa(REMOTE_POD, 8080)),
            "{program}: to the backend, the client's address kept"
        );
        // The backend's reply, at the node's egress: the frontend restored.
        let reply = Frame::tcp(sa(REMOTE_POD, 8080), client, TCP_ACK | TCP_SYN).build();
        let (v, out, _) = dataplane_tests::testrun::run(dp.tc(names::TC_EGRESS).unwrap(), &reply, 1);
        assert_eq!(v, TC_ACT_OK);
        let o = parse_and_verify(&out);
        assert_eq!(
            (o.src_addr(), o.dst_addr()),
            (sa(NODE, DSR), client),
            "{program}: reply"
        );
        // Later packets of the flow follow its entries.
        let ack = from_client(client, sa(NODE, DSR), TCP_ACK).build();
        let (_, out) = run(&encapsulated(&ack, REMOTE_POD));
        assert_eq!(
            parse_and_verify(&out).dst_addr(),
            sa(REMOTE_POD, 8080),
            "{program}"
        );
        // Not ours: another backend, another frontend port.
        for (frame, what) in [
            (
                encapsulated(&inner, Ipv4Addr::new(10, 244, 2, 99)),
                "another backend",
            ),
            (
                encapsulated(&from_client(client, sa(NODE, 31999), TCP_SYN).build(), REMOTE_POD),
                "a port no DSR frontend has",
            ),
        ] {
            let (passed, out) = run(&frame);
            assert!(passed && out == frame, "{program}: {what}: untouched");
        }
        assert_eq!(flow_stat(&dp, FlowStat::DsrDecapsulated), 2, "{program}");
        // From a pod, an encapsulated packet is the pod's business: never
        // taken apart there (DSR arrives through external devices).
        let pod_frame = encapsulated(&from_client(client, sa(NODE, DSR), TCP_ACK).build(), REMOTE_POD);
        let (v, out, _) = dataplane_tests::testrun::run(dp.tc(names::TC_POD_INGRESS).unwrap(), &pod_frame, 1);
        assert_eq!((v, out), (TC_ACT_OK, pod_frame), "{program}: from a pod");
    }
    let _ = TC_ACT_SHOT;
}

/// Maglev: two nodes with the same backends and seed send every flow to
/// the same backend, and spread flows over all of them.
#[test]
fn maglev_nodes_agree_on_every_flow() {
    let svc = |node_ip| {
        let mut s = TestService::new(9, "maglev", Protocol::Tcp, 80)
            .node_port(MAGLEV)
            .maglev();
        for i in 0..5u8 {
            s = s.endpoint(TestEndpoint::ready(Ipv4Addr::new(10, 244, 2, 30 + i), 8080, 1));
        }
        let _: Ipv4Addr = node_ip;
        s
    };
    let a = fixture_datapath_of_node(0, &[NODE.into()], &[svc(NODE)], |_| {});
    let b = fixture_datapath_of_node(2, &[NODE2.into()], &[svc(NODE2)], |_| {});
    let mut seen = std::collections::BTreeMap::new();
    for port in 0..300u16 {
        let client = sa(Ipv4Addr::new(203, 0, 113, (port % 7) as u8 + 1), 40000 + port);
        let pick = |dp: &Datapath, node| {
            let f = Frame::tcp(client, sa(node, MAGLEV), TCP_SYN).build();
            let (_, out, _) = dataplane_tests::testrun::run(dp.xdp().unwrap(), &f, 1);
            parse_and_verify(&out).dst_addr()
        };
        let (x, y) = (pick(&a, NODE), pick(&b, NODE2));
        assert_eq!(x, y, "{client}: both nodes pick the same backend");
        *seen.entry(x).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 5, "every backend gets flows: {seen:?}");
    assert!(seen.values().all(|n| *n > 30), "spread: {seen:?}");
    // The table in the map is the one the agent built.
    let table = a
        .maps()
        .derived()
        .read_table(dataplane_agent::state::maglev::table_id(9, false))
        .unwrap()
        .expect("written");
    assert_eq!(table.len(), dataplane_common::maglev::DEFAULT_TABLE_SIZE as usize);
    assert!(table.iter().all(|id| *id != 0), "every entry names a backend");
}
