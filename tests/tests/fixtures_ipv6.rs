//! BPF_PROG_TEST_RUN fixtures for IPv6 and dual-stack: a dual-stack node
//! (198.18.0.11 and 2001:db8::11) with IPv6 Service ports programmed through
//! the agent's own code path beside IPv4 ones. The IPv6 ingress path in XDP
//! and TC (every verdict, extension headers, fragments, malformed headers),
//! established flows and masqueraded replies, ICMPv6 errors about translated
//! flows both ways, and pods reaching IPv6 Services.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

use dataplane_agent::{dataplane::Datapath, net::Protocol};
use dataplane_common::{names, stats::Event};
use dataplane_tests::{
    fixture::{Expect, Fixture, TC, Table, XDP, reopen_connections, run_as, run_table},
    packet::{Ext, Frame, TCP_ACK, TCP_FIN, TCP_SYN, icmp6_echo_request, icmp6_error, parse_and_verify},
    services::{TestEndpoint, TestService},
    testrun::{self, fixture_datapath_dual},
};

const NODE4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const NODE: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11);
const CLIENT: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100);
const ROUTER: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
const LOCAL_POD: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x10);
const REMOTE_POD: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 0x10);
const LB_LOCAL: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x19, 0, 0, 0, 0, 0x10);
const EXT_UDP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x19, 0, 0, 0, 0, 0x20);
const LB_RANGED: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x19, 0, 0, 0, 0, 0x30);
const CLUSTER_IP: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10);
/// The IPv4 ClusterIP of the dual-stack Service `cip`.
const CLUSTER_IP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const REMOTE_POD4: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 10);

fn sa(ip: Ipv6Addr, port: u16) -> SocketAddr {
    SocketAddrV6::new(ip, port, 0, 0).into()
}

/// The fixture Services, IPv6 (and the IPv4 half of a dual-stack one), as
/// node1 of a dual-stack sandbox.
fn datapath() -> Datapath {
    let local = |port| TestEndpoint::ready(LOCAL_POD, port, 0);
    let remote = |port| TestEndpoint::ready(REMOTE_POD, port, 1);
    // A Service port of each family, as the model splits a dual-stack
    // Service (one ClusterIP per family, each family's endpoints).
    let v6 = |id, name, proto, port| TestService::new(id, name, proto, port).cluster_ip(cluster_ip(id));
    let services = [
        v6(1, "np-cluster", Protocol::Tcp, 80)
            .node_port(30080)
            .endpoint(remote(8080)),
        v6(2, "lb-local", Protocol::Tcp, 80)
            .load_balancer_ip(LB_LOCAL)
            .external_local()
            .endpoint(local(8080)),
        v6(3, "ext-udp", Protocol::Udp, 53)
            .external_ip(EXT_UDP)
            .external_local()
            .endpoint(local(5353)),
        v6(4, "empty", Protocol::Tcp, 80).node_port(30081),
        v6(5, "local-none", Protocol::Tcp, 80)
            .node_port(30082)
            .external_local()
            .endpoint(remote(8080)),
        v6(6, "ranged", Protocol::Tcp, 80)
            .load_balancer_ip(LB_RANGED)
            .source_range("2001:db8:203::/48")
            .endpoint(remote(8080)),
        TestService::new(7, "cip", Protocol::Tcp, 80)
            .cluster_ip(CLUSTER_IP)
            .endpoint(remote(8080)),
        TestService::new(17, "cip", Protocol::Tcp, 80)
            .cluster_ip(CLUSTER_IP4)
            .endpoint(TestEndpoint::ready(REMOTE_POD4, 8080, 1)),
        v6(9, "sctp", Protocol::Sctp, 9999)
            .node_port(30090)
            .external_local()
            .endpoint(local(9090)),
        v6(10, "hairpin", Protocol::Tcp, 80).endpoint(local(8080)),
        (1..=8).fold(
            v6(11, "sticky", Protocol::Tcp, 80)
                .node_port(30111)
                .affinity(std::time::Duration::from_secs(600)),
            |svc, i| {
                svc.endpoint(TestEndpoint::ready(
                    Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 0x100 + i),
                    8080,
                    1,
                ))
            },
        ),
    ];
    fixture_datapath_dual(NODE4, NODE, &services)
}

/// ClusterIPs fd00:10:96::100 + id of the fixture Services (other than
/// `cip`'s).
fn cluster_ip(id: u32) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x100 + id as u16)
}

fn fixtures() -> Vec<Fixture> {
    let c = |port| sa(CLIENT, port);
    let syn = |src, dst| Frame::tcp(src, dst, TCP_SYN);
    let mut t = Table::default();
    let mut f = |name, frame: Vec<u8>, expect, event| t.add(name, frame, expect, event);

    f(
        "TCP to a non-service address",
        syn(
            c(40000),
            sa(Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 1), 80),
        )
        .build(),
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
        "TCP from the wire to a localhost NodePort ([::1]): never translated",
        syn(c(40000), sa(Ipv6Addr::LOCALHOST, 30080)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "ICMPv6 echo request to the node: not ours",
        icmp6_echo_request(CLIENT, NODE),
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
    let ext = vec![
        Ext::Options { kind: 0, units: 0 },
        Ext::Routing,
        Ext::Options { kind: 60, units: 1 },
    ];
    let mut ext_in = syn(c(40003), sa(LB_LOCAL, 80));
    ext_in.ext = ext.clone();
    let mut ext_out = syn(c(40003), sa(LOCAL_POD, 8080));
    ext_out.ext = ext;
    f(
        "hop-by-hop, routing and destination options: translated after them",
        ext_in.build(),
        Expect::Bytes(ext_out.build()),
        Event::NewFlow,
    );
    let mut ah = syn(c(40004), sa(LB_LOCAL, 80));
    ah.ext = vec![Ext::Auth];
    f(
        "IPsec AH: passed untouched (a rewrite would break it)",
        ah.build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "UDP external IP, eTP=Local",
        Frame::udp(c(40005), sa(EXT_UDP, 53)).build(),
        Expect::Bytes(Frame::udp(c(40005), sa(LOCAL_POD, 5353)).build()),
        Event::NewFlow,
    );
    f(
        "NodePort eTP=Cluster: DNAT to the remote backend",
        syn(c(40007), sa(NODE, 30080)).build(),
        Expect::Dnat(sa(REMOTE_POD, 8080)),
        Event::NewFlow,
    );
    f(
        "no endpoints: ICMPv6 port-unreachable",
        syn(c(40008), sa(NODE, 30081)).build(),
        Expect::Reject,
        Event::RejectNoEndpoints,
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
        "source inside loadBalancerSourceRanges: DNAT",
        syn(
            sa(Ipv6Addr::new(0x2001, 0xdb8, 0x203, 0, 0, 0, 0, 7), 40010),
            sa(LB_RANGED, 80),
        )
        .build(),
        Expect::Dnat(sa(REMOTE_POD, 8080)),
        Event::NewFlow,
    );
    f(
        "ClusterIP from off-node: DNAT",
        syn(c(40011), sa(CLUSTER_IP, 80)).build(),
        Expect::Dnat(sa(REMOTE_POD, 8080)),
        Event::NewFlow,
    );
    f(
        "the dual-stack Service's IPv4 ClusterIP beside it: DNAT to its IPv4 endpoint",
        Frame::tcp(
            SocketAddr::from((Ipv4Addr::new(198, 18, 0, 100), 40011)),
            SocketAddr::from((CLUSTER_IP4, 80)),
            TCP_SYN,
        )
        .build(),
        Expect::Dnat(SocketAddr::from((REMOTE_POD4, 8080))),
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
        syn(
            c(40013),
            sa(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x999), 80),
        )
        .build(),
        Expect::Drop,
        Event::DropUnallocatedServiceIp,
    );
    for (name, offset, more) in [
        ("first fragment: passed untouched, never half-translated", 0, true),
        ("non-first fragment: passed untouched", 185, false),
    ] {
        let mut frag = syn(c(40014), sa(LB_LOCAL, 80));
        frag.ext = vec![Ext::Fragment { offset, more }];
        f(name, frag.build(), Expect::Untouched, Event::Fragment);
    }
    let mut truncated = syn(c(40015), sa(LB_LOCAL, 80)).build();
    truncated.truncate(14 + 40 + 10);
    f(
        "truncated TCP header: passed untouched",
        truncated,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut lying = syn(c(40016), sa(LB_LOCAL, 80)).build();
    lying[18..20].copy_from_slice(&2000u16.to_be_bytes()); // payload length beyond the frame
    f(
        "payload length beyond the frame: passed untouched",
        lying,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut jumbo = syn(c(40017), sa(LB_LOCAL, 80)).build();
    jumbo[18..20].fill(0);
    f(
        "payload length 0 (a jumbogram): passed untouched",
        jumbo,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut bad_ext = syn(c(40018), sa(LB_LOCAL, 80));
    bad_ext.ext = vec![Ext::Options { kind: 0, units: 0 }];
    let mut bad_ext = bad_ext.build();
    bad_ext[14 + 40 + 1] = 200; // an extension header longer than the packet
    f(
        "extension header beyond the packet: passed untouched",
        bad_ext,
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "SCTP NodePort, eTP=Local: DNAT with port translation, CRC32c updated",
        Frame::sctp(c(40019), sa(NODE, 30090)).build(),
        Expect::Bytes(Frame::sctp(c(40019), sa(LOCAL_POD, 9090)).build()),
        Event::NewFlow,
    );
    t.0
}

#[test]
fn ingress_fixture_table_in_xdp_and_tc() {
    let failures = run_table(datapath, fixtures);
    assert!(failures.is_empty(), "fixtures failed:\n{}", failures.join("\n"));
}

/// A masqueraded IPv6 flow (NodePort, eTP=Cluster): established packets
/// follow the conntrack entry, the SNAT address is the node's IPv6 one, and
/// the backend's reply to it goes back to the client with the frontend as
/// its source, through both program types.
#[test]
fn masqueraded_flows_and_replies_in_both_program_types() {
    for p in [XDP, TC] {
        let dp = datapath();
        let tc = |name: &'static str, input: &[u8]| {
            let (v, out, _) = testrun::run(dp.tc(name).unwrap(), input, 1);
            (v, out)
        };
        let client = sa(CLIENT, 41000);
        let (v, out) = run_as(&dp, p, &Frame::tcp(client, sa(NODE, 30080), TCP_SYN).build());
        assert_eq!(v, p.pass);
        let fwd = parse_and_verify(&out);
        assert_eq!(fwd.dst_addr(), sa(REMOTE_POD, 8080), "{}: DNAT", p.program);
        let (v, out) = run_as(&dp, p, &Frame::tcp(client, sa(NODE, 30080), TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(parse_and_verify(&out).dst_addr(), sa(REMOTE_POD, 8080));
        assert_eq!(dp.maps().counter(Event::Established).unwrap().packets, 1);

        // On its way to the remote backend, tc_egress masquerades it to the
        // node's IPv6 address.
        let (v, out) = tc(names::TC_EGRESS, &out);
        assert_eq!(v, 0, "TC_ACT_OK");
        let snat = parse_and_verify(&out).src_addr();
        assert_eq!(snat.ip(), NODE, "{}: SNAT to the node's IPv6 address", p.program);
        assert!((1024..=32767).contains(&snat.port()), "SNAT port {}", snat.port());

        // The reply comes back to node:port: un-SNAT at ingress, the
        // frontend restored at egress.
        let reply = Frame::tcp(sa(REMOTE_POD, 8080), snat, TCP_SYN | TCP_ACK).build();
        let (v, out) = run_as(&dp, p, &reply);
        assert_eq!(v, p.pass);
        let o = parse_and_verify(&out);
        assert_eq!(o.dst_addr(), client, "un-SNAT: back to the client");
        let (v, out) = tc(names::TC_EGRESS, &out);
        assert_eq!(v, 0);
        let o = parse_and_verify(&out);
        assert_eq!(
            (o.src_addr(), o.dst_addr()),
            (sa(NODE, 30080), client),
            "{}: the client sees the frontend",
            p.program
        );
    }
}

/// One client port to two frontends of one IPv6 backend (a ClusterIP
/// reached from outside, masqueraded, and an eTP=Local LB IP, not): once
/// the first flow has closed, the second is translated as itself; while it
/// is live, the second is dropped as a clash (see the IPv4 fixture).
#[test]
fn an_ipv6_client_port_reused_through_another_frontend_of_the_same_backend() {
    for p in [XDP, TC] {
        let dp = datapath();
        let egress = |input: &[u8]| {
            let (v, out, _) = testrun::run(dp.tc(names::TC_EGRESS).unwrap(), input, 1);
            assert_eq!(v, 0, "TC_ACT_OK");
            parse_and_verify(&out)
        };
        let ingress = |input: &[u8]| run_as(&dp, p, input);
        let backend = sa(LOCAL_POD, 8080);
        let (cip, lb) = (sa(cluster_ip(10), 80), sa(LB_LOCAL, 80));
        let open = |client: SocketAddr, frontend: SocketAddr| {
            let (v, out) = ingress(&Frame::tcp(client, frontend, TCP_SYN).build());
            assert_eq!(v, p.pass, "{}: SYN {client} -> {frontend}", p.program);
            assert_eq!(parse_and_verify(&out).dst_addr(), backend);
            egress(&out).src_addr()
        };
        let reply = |seen: SocketAddr, flags: u8| {
            let (v, out) = ingress(&Frame::tcp(backend, seen, flags).build());
            assert_eq!(v, p.pass);
            let o = egress(&out);
            (o.src_addr(), o.dst_addr())
        };
        let client = sa(CLIENT, 43100);
        let snat = open(client, cip);
        assert_eq!(
            snat.ip(),
            std::net::IpAddr::from(NODE),
            "{}: masqueraded",
            p.program
        );
        // Live: the LB IP from the same port is a clash.
        let (v, _) = ingress(&Frame::tcp(client, lb, TCP_SYN).build());
        assert_eq!(v, p.drop, "{}", p.program);
        assert_eq!(dp.maps().counter(Event::DropTupleClash).unwrap().packets, 1);
        assert_eq!(reply(snat, TCP_SYN | TCP_ACK), (cip, client));
        // Closed: the LB IP flow takes the tuple over.
        let (v, _) = ingress(&Frame::tcp(client, cip, TCP_FIN | TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(reply(snat, TCP_FIN | TCP_ACK), (cip, client));
        assert_eq!(
            open(client, lb),
            client,
            "{}: not masqueraded as the closed flow",
            p.program
        );
        assert_eq!(reply(client, TCP_SYN | TCP_ACK), (lb, client), "{}", p.program);
    }
}

/// A SYN on a closed IPv6 connection's tuple opens a new one, translated
/// as its own both ways (see the IPv4 fixture): masqueraded with the
/// hashed port every time, and kept unmasqueraded.
#[test]
fn a_closed_ipv6_connection_s_tuple_reopens() {
    for p in [XDP, TC] {
        let dp = datapath();
        let backend = [sa(REMOTE_POD, 8080)];
        let r = reopen_connections(&dp, p, sa(CLIENT, 44100), sa(NODE, 30080), &backend, 20);
        assert_eq!(
            r.source.ip(),
            std::net::IpAddr::from(NODE),
            "{}: masqueraded",
            p.program
        );
        let client = sa(CLIENT, 44101);
        let r = reopen_connections(&dp, p, client, sa(LB_LOCAL, 80), &[sa(LOCAL_POD, 8080)], 20);
        assert_eq!(r.source, client, "{}: eTP=Local keeps the client", p.program);
    }
}

/// ICMPv6 errors about translated flows reach the endpoint whose packet
/// they quote, quoting it as that endpoint sent it: path MTU discovery
/// through IPv6 Services ("packet too big") both ways; they leave from the
/// address the endpoint sent to (`tc_egress`, the ICMPv6 checksum covering
/// it).
#[test]
fn icmpv6_errors_about_translated_flows_reach_their_sender() {
    for p in [XDP, TC] {
        let dp = datapath();
        let ingress = |input: &[u8]| run_as(&dp, p, input);
        let tc = |name: &'static str, input: &[u8]| {
            let (v, out, _) = testrun::run(dp.tc(name).unwrap(), input, 1);
            (v, out)
        };
        let client = sa(CLIENT, 41100);
        let (v, out) = ingress(&Frame::tcp(client, sa(NODE, 30080), TCP_SYN).build());
        assert_eq!(v, p.pass);
        let (_, out) = tc(names::TC_EGRESS, &out);
        let snat = parse_and_verify(&out).src_addr();

        // 1. A router between the node and the backend: "packet too big"
        //    about a masqueraded packet goes to the client, about what it
        //    sent.
        let sent = Frame::tcp(snat, sa(REMOTE_POD, 8080), TCP_ACK).build();
        let error = icmp6_error(ROUTER, NODE, 2, 0, 1400, &sent);
        let want = icmp6_error(
            ROUTER,
            CLIENT,
            2,
            0,
            1400,
            &Frame::tcp(client, sa(NODE, 30080), TCP_ACK).build(),
        );
        let (v, out) = ingress(&error);
        assert_eq!(v, p.pass, "{}", p.program);
        parse_and_verify(&out);
        assert_eq!(out, want, "{}: error about a forward packet", p.program);
        // Bytes after the IPv6 packet (padding) are not the quote's.
        let padded = |f: &[u8]| [f, &[0u8; 12][..]].concat();
        let (v, out) = ingress(&padded(&error));
        assert_eq!(v, p.pass);
        parse_and_verify(&out);
        assert_eq!(out, padded(&want), "{}: a padded error", p.program);
        let (_, out) = tc(names::TC_EGRESS, &want);
        parse_and_verify(&out);
        let from_frontend = icmp6_error(
            NODE,
            CLIENT,
            2,
            0,
            1400,
            &Frame::tcp(client, sa(NODE, 30080), TCP_ACK).build(),
        );
        assert_eq!(out, from_frontend, "{}: the outer source at egress", p.program);

        // 2. A router on the client's side: an error about a reply goes to
        //    the backend, about what it sent (to the SNAT address).
        let reply = Frame::tcp(sa(NODE, 30080), client, TCP_ACK).build();
        let error = icmp6_error(ROUTER, NODE, 2, 0, 1280, &reply);
        let want = icmp6_error(
            ROUTER,
            REMOTE_POD,
            2,
            0,
            1280,
            &Frame::tcp(sa(REMOTE_POD, 8080), snat, TCP_ACK).build(),
        );
        let (v, out) = ingress(&error);
        assert_eq!(v, p.pass);
        parse_and_verify(&out);
        assert_eq!(out, want, "{}: error about a reply", p.program);
        let (_, out) = tc(names::TC_EGRESS, &want);
        parse_and_verify(&out);
        // Out to the backend: from the SNAT address it replied to.
        let std::net::IpAddr::V6(snat_ip) = snat.ip() else {
            panic!("{snat}")
        };
        let from_snat = icmp6_error(
            snat_ip,
            REMOTE_POD,
            2,
            0,
            1280,
            &Frame::tcp(sa(REMOTE_POD, 8080), snat, TCP_ACK).build(),
        );
        assert_eq!(out, from_snat, "{}: error about a reply, at egress", p.program);

        // 3. A local backend of an eTP=Local UDP external IP answers
        //    port-unreachable: the client learns about the address it tried.
        let client2 = sa(CLIENT, 41101);
        let (v, _) = ingress(&Frame::udp(client2, sa(EXT_UDP, 53)).build());
        assert_eq!(v, p.pass);
        let error = icmp6_error(
            LOCAL_POD,
            CLIENT,
            1,
            4,
            0,
            &Frame::udp(client2, sa(LOCAL_POD, 5353)).build(),
        );
        let want = icmp6_error(
            LOCAL_POD,
            CLIENT,
            1,
            4,
            0,
            &Frame::udp(client2, sa(EXT_UDP, 53)).build(),
        );
        let (v, out) = tc(names::TC_POD_INGRESS, &error);
        assert_eq!(v, 0, "TC_ACT_OK");
        parse_and_verify(&out);
        assert_eq!(out, want, "a local backend's error");

        // 4. An error about no flow of ours: untouched.
        let error = icmp6_error(
            ROUTER,
            CLIENT,
            2,
            0,
            1400,
            &Frame::tcp(
                client,
                sa(Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 1), 443),
                TCP_ACK,
            )
            .build(),
        );
        let (v, out) = ingress(&error);
        assert_eq!((v, out), (p.pass, error), "not ours");
    }
}

/// Pods reach IPv6 Services through `tc_pod_ingress`: ClusterIP without
/// SNAT, hairpin (the backend is the pod itself) masqueraded to the node,
/// an eTP=Local external destination short-circuited to the cluster set.
#[test]
fn pods_reach_ipv6_services() {
    let dp = datapath();
    let pod = |name: &'static str, input: &[u8]| {
        let (v, out, _) = testrun::run(dp.tc(name).unwrap(), input, 1);
        (v, parse_and_verify(&out))
    };
    let other_pod = sa(Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x20), 42000);
    let (v, o) = pod(
        names::TC_POD_INGRESS,
        &Frame::tcp(other_pod, sa(CLUSTER_IP, 80), TCP_SYN).build(),
    );
    assert_eq!(v, 0);
    assert_eq!(o.dst_addr(), sa(REMOTE_POD, 8080));
    assert_eq!(o.src_addr(), other_pod, "pod → ClusterIP: the pod's address kept");

    // Hairpin: the only backend is the pod itself.
    let me = sa(LOCAL_POD, 42001);
    let (v, o) = pod(
        names::TC_POD_INGRESS,
        &Frame::tcp(me, sa(cluster_ip(10), 80), TCP_SYN).build(),
    );
    assert_eq!(v, 0);
    assert_eq!(o.dst_addr(), sa(LOCAL_POD, 8080));
    let (v, out, _) = testrun::run(
        dp.tc(names::TC_EGRESS).unwrap(),
        &Frame::tcp(me, sa(LOCAL_POD, 8080), TCP_SYN).build(),
        1,
    );
    assert_eq!(v, 0);
    assert_eq!(
        parse_and_verify(&out).src.to_string(),
        NODE.to_string(),
        "hairpin: masqueraded to the node"
    );

    // eTP=Local external destination from a pod: the cluster set, no SNAT.
    // (Another client port: from 42000 the backend would see the live
    // ClusterIP flow's tuple again, a clash.)
    let other_pod2 = sa(Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x20), 42002);
    let (v, o) = pod(
        names::TC_POD_INGRESS,
        &Frame::tcp(other_pod2, sa(NODE, 30082), TCP_SYN).build(),
    );
    assert_eq!(v, 0);
    assert_eq!(
        o.dst_addr(),
        sa(REMOTE_POD, 8080),
        "short-circuit to the cluster set"
    );
}

/// ClientIP session affinity over IPv6: every new connection of a client
/// goes to the backend its first one got (8 candidates), through the
/// NodePort and the ClusterIP alike; another client has its own.
#[test]
fn session_affinity_holds_for_ipv6_clients() {
    let dp = datapath();
    let first = |client: Ipv6Addr, port: u16, dst: SocketAddr| {
        let (v, out) = run_as(&dp, XDP, &Frame::tcp(sa(client, port), dst, TCP_SYN).build());
        assert_eq!(v, XDP.pass);
        parse_and_verify(&out).dst
    };
    let backend = first(CLIENT, 43000, sa(NODE, 30111));
    for i in 1..=10u16 {
        let dst = if i % 2 == 0 {
            sa(cluster_ip(11), 80)
        } else {
            sa(NODE, 30111)
        };
        assert_eq!(first(CLIENT, 43000 + i, dst), backend, "connection {i} to {dst}");
    }
    // Many other clients spread over the backends (affinity is per client).
    let others: std::collections::BTreeSet<_> = (1..=64u16)
        .map(|i| {
            first(
                Ipv6Addr::new(0x2001, 0xdb8, 0x203, 0, 0, 0, 0, i),
                44000,
                sa(NODE, 30111),
            )
        })
        .collect();
    assert!(
        others.len() > 1,
        "other clients are not all pinned to one backend: {others:?}"
    );
}
