//! Host routing (`--host-routing`) through BPF_PROG_TEST_RUN: `tc_ingress`
//! runs as if its packet came in on the uplink of a network namespace this
//! test builds (an uplink, a pod-facing device with a permanent neighbour
//! entry for the backend, forwarding on), so that `bpf_fib_lookup` answers
//! from that namespace's routes and neighbours. A translated packet leaves
//! for the backend's device with the neighbour's MAC addresses and its TTL
//! or hop limit decremented; what the FIB cannot route completely goes to
//! the stack unchanged beyond the translation. End to end: `cni.rs`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use dataplane_agent::{dataplane::Datapath, net::Protocol};
use dataplane_common::names;
use dataplane_tests::{
    netns::NetNs,
    packet::{Frame, TCP_ACK, TCP_SYN},
    services::{TestEndpoint, TestService},
    testrun::{fixture_datapath_configured, run_on_device},
};

const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100);
/// A pod behind `pods0` whose neighbour entry is known, and one whose is not.
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 20);
const POD_UNRESOLVED: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 21);
const POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x20);
const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x20];
const PODS_DEV_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xa1];
const TC_ACT_OK: u32 = 0;
const TC_ACT_REDIRECT: u32 = 7;

/// NodePorts (eTP=Cluster, in both families) to `POD`/`POD6`, and one to
/// the pod without a neighbour entry.
fn services() -> Vec<TestService> {
    vec![
        TestService::new(1, "web", Protocol::Tcp, 80)
            .node_port(30080)
            .endpoint(TestEndpoint::ready(POD, 8080, 0)),
        TestService::new(2, "web6", Protocol::Tcp, 80)
            .cluster_ip(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10))
            .node_port(30080)
            .endpoint(TestEndpoint::ready(POD6, 8080, 0)),
        TestService::new(3, "unresolved", Protocol::Tcp, 80)
            .node_port(30081)
            .endpoint(TestEndpoint::ready(POD_UNRESOLVED, 8080, 0)),
    ]
}

fn datapath(host_routing: bool) -> Datapath {
    fixture_datapath_configured(&[NODE.into(), NODE6.into()], &services(), |c| {
        c.host_routing = host_routing;
    })
}

/// The namespace: `up0` (the node's addresses) and `pods0` (the pods'
/// gateway, with permanent neighbour entries for `POD` and `POD6`), both
/// veth devices with their peers up, forwarding on. Returns it with
/// `up0`'s ifindex.
fn node_namespace(tag: &str) -> (NetNs, u32) {
    let ns = NetNs::new(&format!("dp-hr{tag}-{}", std::process::id()));
    let mac = |m: [u8; 6]| m.map(|b| format!("{b:02x}")).join(":");
    ns.ip_batch(&format!(
        "link add up0 type veth peer name up1
link add pods0 address {} type veth peer name pods1
link set up0 up
link set up1 up
link set pods0 up
link set pods1 up
addr add {NODE}/24 dev up0
addr add {NODE6}/64 dev up0 nodad
addr add 10.244.1.1/24 dev pods0
addr add fd00:10:244:1::1/64 dev pods0 nodad
neigh add {POD} lladdr {} dev pods0 nud permanent
neigh add {POD6} lladdr {} dev pods0 nud permanent
",
        mac(PODS_DEV_MAC),
        mac(POD_MAC),
        mac(POD_MAC)
    ));
    ns.sysctl("net/ipv4/ip_forward", "1");
    ns.sysctl("net/ipv6/conf/all/forwarding", "1");
    let ifindex = ns.run(|| {
        let name = std::ffi::CString::new("up0").unwrap();
        // SAFETY: a NUL-terminated name; returns 0 when unknown.
        unsafe { libc::if_nametoindex(name.as_ptr()) }
    });
    assert_ne!(ifindex, 0, "up0 in {}", ns.name());
    (ns, ifindex)
}

fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

/// The frame `tc_ingress` should send to `to` when it routes it.
fn routed(mut f: Frame, to: SocketAddr) -> Vec<u8> {
    f.dst = to;
    f.ttl -= 1;
    f.src_mac = PODS_DEV_MAC;
    f.dst_mac = POD_MAC;
    f.build()
}

#[test]
fn translated_packets_go_to_their_routes_device() {
    let (ns, up0) = node_namespace("on");
    let dp = datapath(true);
    let tc = dp.tc(names::TC_INGRESS).unwrap();
    ns.run(|| {
        for (client, node, pod) in [
            (sa(CLIENT, 40000), sa(NODE, 30080), sa(POD, 8080)),
            (sa(CLIENT6, 40000), sa(NODE6, 30080), sa(POD6, 8080)),
        ] {
            // A new flow and a packet of it, each DNATed and routed.
            for flags in [TCP_SYN, TCP_ACK] {
                let f = Frame::tcp(client, node, flags);
                let (v, out) = run_on_device(tc, &f.build(), up0);
                assert_eq!(v, TC_ACT_REDIRECT, "{client} -> {node} flags {flags:#x}");
                assert_eq!(out, routed(f, pod), "{client} -> {node} flags {flags:#x}");
            }
            // A TTL about to expire: translated, left to the stack (which
            // sends "time exceeded").
            let mut f = Frame::tcp(client, node, TCP_ACK);
            f.ttl = 1;
            let (v, out) = run_on_device(tc, &f.build(), up0);
            assert_eq!(v, TC_ACT_OK, "{client}: TTL 1");
            f.dst = pod;
            assert_eq!(out, f.build(), "{client}: TTL 1 is only translated");
        }
        // No neighbour entry yet: the stack resolves it.
        let f = Frame::tcp(sa(CLIENT, 40001), sa(NODE, 30081), TCP_SYN);
        let (v, out) = run_on_device(tc, &f.build(), up0);
        assert_eq!(v, TC_ACT_OK, "unresolved neighbour");
        let mut want = f;
        want.dst = sa(POD_UNRESOLVED, 8080);
        assert_eq!(out, want.build(), "unresolved neighbour: only translated");
        // Not translated (not a Service): never routed by us.
        let f = Frame::tcp(sa(CLIENT, 40002), sa(POD, 8080), TCP_SYN);
        let (v, out) = run_on_device(tc, &f.build(), up0);
        assert_eq!((v, out), (TC_ACT_OK, f.build()), "non-service packet");
    });
}

#[test]
fn without_host_routing_translated_packets_go_to_the_stack() {
    let (ns, up0) = node_namespace("off");
    let dp = datapath(false);
    let tc = dp.tc(names::TC_INGRESS).unwrap();
    ns.run(|| {
        let f = Frame::tcp(sa(CLIENT, 40000), sa(NODE, 30080), TCP_SYN);
        let (v, out) = run_on_device(tc, &f.build(), up0);
        let mut want = f;
        want.dst = sa(POD, 8080);
        assert_eq!((v, out), (TC_ACT_OK, want.build()));
    });
}
