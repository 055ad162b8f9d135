//! BPF_PROG_TEST_RUN fixtures for the north-south ingress path, run through
//! both of its program types (`xdp_ingress` and `tc_ingress`: one path, two
//! contexts): maps programmed through the agent's own code path, an input
//! frame, the expected verdict and output. Output checksums are verified by
//! the test's own implementation.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use dataplane_agent::{
    dataplane::{Clock, Datapath},
    net::Protocol,
};
use dataplane_common::{
    names,
    stats::{Event, FlowStat},
};
use dataplane_tests::{
    fixture::{
        Expect, Fixture, TC, Table, XDP, XDP_PASS, flow_stat, reopen_connections, run, run_as, run_table,
    },
    packet::{Frame, TCP_ACK, TCP_FIN, TCP_SYN, icmp_error, parse_and_verify},
    services::{TestEndpoint, TestService},
    testrun::{self, fixture_datapath},
};

const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 10);
const LB_LOCAL: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const EXT_UDP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 20);
const LB_RANGED: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 30);
const LB_CLUSTER_LOCAL: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 40);
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddrV4::new(ip, port).into()
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
        // The lb-local backend behind a masqueraded frontend as well.
        TestService::new(10, "np-cluster-local", Protocol::Tcp, 80)
            .node_port(30084)
            .load_balancer_ip(LB_CLUSTER_LOCAL)
            .endpoint(local(8080)),
        TestService::new(9, "sctp", Protocol::Sctp, 9999)
            .node_port(30090)
            .external_local()
            .endpoint(local(9090)),
        (1..=4).fold(
            TestService::new(8, "spread", Protocol::Tcp, 80).node_port(30083),
            |svc, i| svc.endpoint(TestEndpoint::ready(Ipv4Addr::new(10, 244, 2, 20 + i), 8080, 1)),
        ),
    ];
    fixture_datapath(NODE, &services)
}

fn fixtures() -> Vec<Fixture> {
    let c = |port| sa(CLIENT, port);
    let syn = |src, dst| Frame::tcp(src, dst, TCP_SYN);
    let mut t = Table::default();
    let mut f = |name, frame: Vec<u8>, expect, event| t.add(name, frame, expect, event);

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
        "TCP from the wire to a localhost NodePort: never translated (only the node's sockets use those)",
        syn(c(40000), sa(Ipv4Addr::LOCALHOST, 30080)).build(),
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
    f(
        "SCTP to an address without SCTP ports: not ours",
        Frame::sctp(c(40018), sa(LB_LOCAL, 80)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "SCTP NodePort, eTP=Local: DNAT with port translation, CRC32c updated",
        Frame::sctp(c(40019), sa(NODE, 30090)).build(),
        Expect::Bytes(Frame::sctp(c(40019), sa(LOCAL_POD, 9090)).build()),
        Event::NewFlow,
    );
    let mut sctp_opts = Frame::sctp(c(40020), sa(NODE, 30090));
    sctp_opts.ip_options = vec![1, 1, 1, 0];
    sctp_opts.payload = vec![7; 301];
    let mut sctp_opts_out = Frame::sctp(c(40020), sa(LOCAL_POD, 9090));
    sctp_opts_out.ip_options = vec![1, 1, 1, 0];
    sctp_opts_out.payload = vec![7; 301];
    f(
        "SCTP with IP options and a longer chunk: CRC32c updated",
        sctp_opts.build(),
        Expect::Bytes(sctp_opts_out.build()),
        Event::NewFlow,
    );
    // The kernel's SCTP leaves the CRC zero when the device computes it
    // (CHECKSUM_PARTIAL, as veth offers): it must stay zero.
    let offloaded = |frame: Vec<u8>| {
        let mut frame = frame;
        frame[14 + 20 + 8..14 + 20 + 12].fill(0);
        frame
    };
    f(
        "SCTP with its CRC32c left to the device: the zero field stays zero",
        offloaded(Frame::sctp(c(40021), sa(NODE, 30090)).build()),
        Expect::Bytes(offloaded(Frame::sctp(c(40021), sa(LOCAL_POD, 9090)).build())),
        Event::NewFlow,
    );
    t.0
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
fn ingress_fixture_table_in_xdp_and_tc() {
    let failures = run_table(datapath, fixtures);
    assert!(failures.is_empty(), "fixtures failed:\n{}", failures.join("\n"));
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

/// Entries are stamped with the monotonic clock read from jiffies (the
/// agent tells HZ from /proc/timer_list): within a second of
/// CLOCK_MONOTONIC, so that entries stamped by programs on the coarse ktime
/// clock (before an upgrade, or where HZ is unknown) keep their ages.
#[test]
fn entries_are_stamped_with_the_monotonic_clock() {
    let dp = datapath();
    assert!(
        matches!(dp.clock(), Clock::Jiffies { .. }),
        "this kernel's HZ was not told: {:?}",
        dp.clock()
    );
    let monotonic = || {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: writes the local timespec.
        assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) }, 0);
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    };
    let before = monotonic();
    let client = sa(CLIENT, 41500);
    let (v, _) = run(&dp, &Frame::tcp(client, sa(NODE, 30080), TCP_SYN).build());
    assert_eq!(v, XDP_PASS);
    let after = monotonic();
    let ct = dp.maps().conntrack().unwrap();
    let (_, fwd) = ct
        .iter()
        .find(|(k, _)| k.saddr == u32::from(CLIENT).to_be() && k.sport == 41500u16.to_be())
        .expect("forward entry");
    let stamp = fwd.last_seen_ns;
    assert!(
        stamp + 1_000_000_000 >= before && stamp <= after + 1_000_000_000,
        "stamp {stamp} ns, CLOCK_MONOTONIC {before}..{after} ns"
    );
}

/// Egress hooks know a flow by the tuple between client and backend alone.
/// Two flows from one client address and port to one backend through
/// different frontends (a masqueraded NodePort and an eTP=Local LB IP, or
/// two masqueraded ones) have the same such tuple: once the first has closed, the second takes the
/// tuple over and is translated as its own (it was masqueraded as the old
/// one, its replies given the old one's frontend); while the first is live,
/// the second cannot be told apart from it and is dropped, counted, instead
/// of being mistranslated. Both program types, both orders.
#[test]
fn a_client_port_reused_through_another_frontend_of_the_same_backend() {
    for p in [XDP, TC] {
        let dp = datapath();
        let egress = |input: &[u8]| {
            let (v, out, _) = testrun::run(dp.tc(names::TC_EGRESS).unwrap(), input, 1);
            assert_eq!(v, 0, "TC_ACT_OK");
            parse_and_verify(&out)
        };
        let ingress = |input: &[u8]| {
            let (v, out) = run_as(&dp, p, input);
            (v, out)
        };
        let backend = sa(LOCAL_POD, 8080);
        let node_port = sa(NODE, 30084);
        let lb = sa(LB_LOCAL, 80);
        // (forward packet as it leaves towards the backend, SNAT source).
        let open = |client: SocketAddr, frontend: SocketAddr| {
            let (v, out) = ingress(&Frame::tcp(client, frontend, TCP_SYN).build());
            assert_eq!(v, p.pass, "{}: SYN {client} -> {frontend}", p.program);
            assert_eq!(parse_and_verify(&out).dst_addr(), backend);
            egress(&out).src_addr()
        };
        // The backend's packet to `seen` (its view of the client), as the
        // client receives it.
        let reply = |seen: SocketAddr, flags: u8| {
            let (v, out) = ingress(&Frame::tcp(backend, seen, flags).build());
            assert_eq!(v, p.pass);
            let o = egress(&out);
            (o.src_addr(), o.dst_addr())
        };

        // 1. Masqueraded, then closed (FIN each way).
        let client = sa(CLIENT, 43000);
        let snat = open(client, node_port);
        assert_eq!(snat.ip(), NODE, "{}: masqueraded", p.program);
        assert_eq!(reply(snat, TCP_SYN | TCP_ACK), (node_port, client));
        let (v, _) = ingress(&Frame::tcp(client, node_port, TCP_FIN | TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(reply(snat, TCP_FIN | TCP_ACK), (node_port, client));
        // The same client port to the LB IP (eTP=Local: client kept): not
        // masqueraded, replies from the LB IP.
        assert_eq!(
            open(client, lb),
            client,
            "{}: not masqueraded as the closed flow",
            p.program
        );
        assert_eq!(reply(client, TCP_SYN | TCP_ACK), (lb, client), "{}", p.program);

        // 2. The other order: unmasqueraded and closed, then masqueraded.
        let client = sa(CLIENT, 43001);
        assert_eq!(open(client, lb), client);
        let (v, _) = ingress(&Frame::tcp(client, lb, TCP_FIN | TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(reply(client, TCP_FIN | TCP_ACK), (lb, client));
        let snat = open(client, node_port);
        assert_eq!(snat.ip(), NODE, "{}: masqueraded", p.program);
        assert_eq!(
            reply(snat, TCP_SYN | TCP_ACK),
            (node_port, client),
            "{}",
            p.program
        );

        // 3. While the first flow is live, either way round: the second is
        // dropped, the first keeps its translation.
        let dropped = || dp.maps().counter(Event::DropTupleClash).unwrap().packets;
        let client = sa(CLIENT, 43002);
        let snat = open(client, node_port);
        let (v, _) = ingress(&Frame::tcp(client, lb, TCP_SYN).build());
        assert_eq!(v, p.drop, "{}: a live flow holds the tuple", p.program);
        assert_eq!(dropped(), 1);
        assert_eq!(reply(snat, TCP_SYN | TCP_ACK), (node_port, client));
        let (v, out) = ingress(&Frame::tcp(client, node_port, TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(egress(&out).src_addr(), snat);

        let client = sa(CLIENT, 43003);
        assert_eq!(open(client, lb), client);
        let (v, _) = ingress(&Frame::tcp(client, node_port, TCP_SYN).build());
        assert_eq!(v, p.drop, "{}: a live flow holds the tuple", p.program);
        assert_eq!(dropped(), 2);
        assert_eq!(reply(client, TCP_SYN | TCP_ACK), (lb, client));

        // 4. Both masqueraded (NodePort, then the LB IP of the same
        // Service): closed, the tuple is taken over; live, a clash.
        let lb_cluster = sa(LB_CLUSTER_LOCAL, 80);
        let client = sa(CLIENT, 43004);
        let snat = open(client, node_port);
        let (v, _) = ingress(&Frame::tcp(client, lb_cluster, TCP_SYN).build());
        assert_eq!(v, p.drop, "{}: a live flow holds the tuple", p.program);
        assert_eq!(dropped(), 3);
        assert_eq!(reply(snat, TCP_SYN | TCP_ACK), (node_port, client));
        let (v, _) = ingress(&Frame::tcp(client, node_port, TCP_FIN | TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(reply(snat, TCP_FIN | TCP_ACK), (node_port, client));
        let snat = open(client, lb_cluster);
        assert_eq!(snat.ip(), NODE);
        assert_eq!(
            reply(snat, TCP_SYN | TCP_ACK),
            (lb_cluster, client),
            "{}",
            p.program
        );

        let taken_over = flow_stat(&dp, FlowStat::TupleTakeover);
        assert_eq!(taken_over, 3, "{}: the closed flows' tuples", p.program);
    }
}

/// A SYN on the tuple of a closed connection opens a new one, with a
/// fresh backend choice, as netfilter reopens a TIME_WAIT entry: each
/// connection is translated both ways, a masqueraded one keeps its hashed
/// SNAT port, and the new connection is open (a retransmitted SYN stays on
/// its backend instead of reopening again). Masqueraded over four backends
/// (the choice is made again: more than one is used) and unmasqueraded to
/// one; both program types.
#[test]
fn a_closed_connection_s_tuple_reopens_with_a_fresh_choice() {
    const CONNECTIONS: u64 = 60;
    for p in [XDP, TC] {
        let dp = datapath();
        let spread: Vec<SocketAddr> = (1..=4)
            .map(|i| sa(Ipv4Addr::new(10, 244, 2, 20 + i), 8080))
            .collect();
        let r = reopen_connections(&dp, p, sa(CLIENT, 44000), sa(NODE, 30083), &spread, CONNECTIONS);
        assert_eq!(r.source.ip(), NODE, "{}: masqueraded", p.program);
        // All 60 on one of 4 backends: a chance of 4^-59.
        assert!(
            r.backends.len() > 1,
            "{}: chosen again: {:?}",
            p.program,
            r.backends
        );
        let client = sa(CLIENT, 44001);
        let r = reopen_connections(&dp, p, client, sa(LB_LOCAL, 80), &[sa(LOCAL_POD, 8080)], 20);
        assert_eq!(r.source, client, "{}: eTP=Local keeps the client", p.program);
    }
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
    let purged = dp
        .maps_mut()
        .purge_udp_flows_to(&[(LOCAL_POD.into(), 5353)])
        .unwrap();
    assert_eq!(purged, 6);
    assert_eq!(udp_entries(&dp), 0);
}

/// ICMP errors about translated flows reach the endpoint whose packet they
/// quote, quoting it as that endpoint sent it, through every hook that can
/// see them: `xdp_ingress`/`tc_ingress` (errors from beyond the node, both
/// ways), `tc_pod_ingress` (a local backend's error) and `tc_egress` (the
/// node's own, e.g. "fragmentation needed" when a pod's MTU is smaller).
/// As with netfilter's NAT, they leave from the address the endpoint sent
/// to (`tc_egress`, POSTROUTING's half): the client never sees a backend's
/// or a router's address, whoever answered.
#[test]
fn icmp_errors_about_translated_flows_reach_their_sender() {
    use dataplane_common::names;
    const ROUTER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
    for p in [XDP, TC] {
        let dp = datapath();
        let ingress = |input: &[u8]| run_as(&dp, p, input);
        let tc = |name: &'static str, input: &[u8]| {
            let (v, out, _) = testrun::run(dp.tc(name).unwrap(), input, 1);
            (v, out)
        };
        let translated = || dp.maps().counter(Event::IcmpErrorTranslated).unwrap().packets;

        // A masqueraded flow to the remote backend: its SNAT port.
        let client = sa(CLIENT, 41100);
        let (v, _) = ingress(&Frame::tcp(client, sa(NODE, 30080), TCP_SYN).build());
        assert_eq!(v, p.pass);
        let ct = dp.maps().conntrack().unwrap();
        let (_, fwd) = ct
            .iter()
            .find(|(k, _)| k.saddr == u32::from(CLIENT).to_be() && k.sport == 41100u16.to_be())
            .expect("FWD_IN entry");
        let snat = sa(NODE, u16::from_be(fwd.nat_sport));

        // 1. A router between the node and the backend cannot forward a
        //    masqueraded packet: back to the client, about what it sent.
        let sent = Frame::tcp(snat, sa(REMOTE_POD, 8080), TCP_ACK).build();
        let error = icmp_error(ROUTER, NODE, 3, 4, 1400, &sent);
        let want = icmp_error(
            ROUTER,
            CLIENT,
            3,
            4,
            1400,
            &Frame::tcp(client, sa(NODE, 30080), TCP_ACK).build(),
        );
        let before = translated();
        let (v, out) = ingress(&error);
        assert_eq!(v, p.pass, "{}", p.program);
        parse_and_verify(&out);
        assert_eq!(out, want, "{}: error about a forward packet", p.program);
        assert_eq!(translated(), before + 1);
        // The same behind Ethernet padding (bytes after the IP packet): they
        // are not the quote's, and stay as they are.
        let padded = |f: &[u8]| [f, &[0u8; 12][..]].concat();
        let (v, out) = ingress(&padded(&error));
        assert_eq!(v, p.pass);
        parse_and_verify(&out);
        assert_eq!(out, padded(&want), "{}: a padded error", p.program);
        // On its way out to the client (POSTROUTING's half): from the
        // address the client sent to, as netfilter's NAT makes it.
        let (v, out) = tc(names::TC_EGRESS, &want);
        assert_eq!(v, 0, "TC_ACT_OK");
        parse_and_verify(&out);
        let from_frontend = icmp_error(
            NODE,
            CLIENT,
            3,
            4,
            1400,
            &Frame::tcp(client, sa(NODE, 30080), TCP_ACK).build(),
        );
        assert_eq!(out, from_frontend, "{}: the outer source at egress", p.program);
        assert_eq!(translated(), before + 3);

        // 2. A router on the client's side cannot forward a reply: to the
        //    backend, about what it sent (to the node's SNAT address).
        let reply = Frame::tcp(sa(NODE, 30080), client, TCP_ACK).build();
        let error = icmp_error(ROUTER, NODE, 3, 4, 1280, &reply);
        let want = icmp_error(
            ROUTER,
            REMOTE_POD,
            3,
            4,
            1280,
            &Frame::tcp(sa(REMOTE_POD, 8080), snat, TCP_ACK).build(),
        );
        let (v, out) = ingress(&error);
        assert_eq!(v, p.pass);
        parse_and_verify(&out);
        assert_eq!(out, want, "{}: error about a reply", p.program);
        // Out to the backend: from the node's SNAT address, where the
        // backend sent its reply.
        let (_, out) = tc(names::TC_EGRESS, &want);
        parse_and_verify(&out);
        let from_snat = icmp_error(
            NODE,
            REMOTE_POD,
            3,
            4,
            1280,
            &Frame::tcp(sa(REMOTE_POD, 8080), snat, TCP_ACK).build(),
        );
        assert_eq!(out, from_snat, "{}: error about a reply, at egress", p.program);

        // 3. A local backend of an eTP=Local UDP external IP answers
        //    port-unreachable: the client learns about the address it tried.
        let client2 = sa(CLIENT, 41101);
        let (v, _) = ingress(&Frame::udp(client2, sa(EXT_UDP, 53)).build());
        assert_eq!(v, p.pass);
        let error = icmp_error(
            LOCAL_POD,
            CLIENT,
            3,
            3,
            0,
            &Frame::udp(client2, sa(LOCAL_POD, 5353)).build(),
        );
        let want = icmp_error(
            LOCAL_POD,
            CLIENT,
            3,
            3,
            0,
            &Frame::udp(client2, sa(EXT_UDP, 53)).build(),
        );
        let (v, out) = tc(names::TC_POD_INGRESS, &error);
        assert_eq!(v, 0, "TC_ACT_OK");
        parse_and_verify(&out);
        assert_eq!(out, want, "a local backend's error (UDP quote checksum too)");
        // Out to the client: from the external IP it tried.
        let (_, out) = tc(names::TC_EGRESS, &want);
        parse_and_verify(&out);
        let from_frontend = icmp_error(
            EXT_UDP,
            CLIENT,
            3,
            3,
            0,
            &Frame::udp(client2, sa(EXT_UDP, 53)).build(),
        );
        assert_eq!(out, from_frontend, "a local backend's error, at egress");

        // 4. The node cannot forward a client's packet into a local pod
        //    (smaller MTU): its own error leaves through tc_egress.
        let client3 = sa(CLIENT, 41102);
        let (v, _) = ingress(&Frame::tcp(client3, sa(LB_LOCAL, 80), TCP_SYN).build());
        assert_eq!(v, p.pass);
        let error = icmp_error(
            NODE,
            CLIENT,
            3,
            4,
            1450,
            &Frame::tcp(client3, sa(LOCAL_POD, 8080), TCP_ACK).build(),
        );
        // From the address the client sent to (netfilter: the node's
        // error is related to the flow, and POSTROUTING sets its source).
        let want = icmp_error(
            LB_LOCAL,
            CLIENT,
            3,
            4,
            1450,
            &Frame::tcp(client3, sa(LB_LOCAL, 80), TCP_ACK).build(),
        );
        let (v, out) = tc(names::TC_EGRESS, &error);
        assert_eq!(v, 0, "TC_ACT_OK");
        parse_and_verify(&out);
        assert_eq!(out, want, "the node's own error, at egress");

        // 5. An error about no flow of ours: untouched.
        let error = icmp_error(
            ROUTER,
            CLIENT,
            3,
            4,
            1400,
            &Frame::tcp(client, sa(Ipv4Addr::new(1, 1, 1, 1), 443), TCP_ACK).build(),
        );
        let (v, out) = ingress(&error);
        assert_eq!((v, out), (p.pass, error), "not ours");
    }
}
