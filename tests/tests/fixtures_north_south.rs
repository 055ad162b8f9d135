//! BPF_PROG_TEST_RUN fixtures for the north-south ingress path, run through
//! both of its program types (`xdp_ingress` and `tc_ingress`: one path, two
//! contexts): maps programmed through the agent's own code path, an input
//! frame, the expected verdict and output. Output checksums are verified by
//! the test's own implementation.
//!
//! Written once on a family's address plan ([`dataplane_tests::plan`]) and
//! run for both: IPv4 on a single-stack node, IPv6 on a dual-stack one
//! (`<test>::ipv4`, `<test>::ipv6`). What only one family has is here for
//! IPv4 (ARP, IP options, IPv4 fragments and header checks, the zero UDP
//! checksum, conntrack entries read back) and in `fixtures_ipv6.rs` for
//! IPv6 (extension headers, fragments, ICMPv6, dual-stack Services).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use dataplane_agent::dataplane::{Clock, Datapath};
use dataplane_common::{
    names,
    stats::{Event, FlowStat},
};
use dataplane_tests::{
    fixture::{
        Expect, Fixture, TC, Table, Verdicts, XDP, XDP_PASS, flow_stat, reopen_connections, run, run_as,
        run_table,
    },
    for_both_families,
    packet::{Frame, Parsed, TCP_ACK, TCP_FIN, TCP_SYN, parse_and_verify},
    plan::{Family, IcmpError, Plan, V4, datapath},
    testrun,
};

for_both_families! {
    fn ingress_fixture_table_in_xdp_and_tc => ingress_fixture_table;
    fn masqueraded_flows_and_replies_in_both_program_types => masqueraded_flows_and_replies;
    fn a_client_port_reused_through_another_frontend_of_the_same_backend => client_port_reused;
    fn a_client_port_reused_through_a_cluster_ip_and_an_lb_ip => client_port_reused_through_a_cluster_ip;
    fn a_closed_connection_s_tuple_reopens_with_a_fresh_choice => closed_tuple_reopens;
    fn new_flows_spread_uniformly_over_backends => new_flows_spread_uniformly;
    fn udp_flows_to_a_backend_can_be_purged => udp_flows_purged;
    fn icmp_errors_about_translated_flows_reach_their_sender => icmp_errors_reach_their_sender;
    fn session_affinity_holds_for_clients => session_affinity_holds;
}

/// The rows of both families; `p`'s address in each.
fn fixtures(p: &Plan) -> Vec<Fixture> {
    let sa = |ip, port| p.sa(ip, port);
    let c = |port| sa(p.client, port);
    let syn = |src, dst| Frame::tcp(src, dst, TCP_SYN);
    let v4 = p.family == Family::V4;
    let mut t = Table::default();
    let mut f = |name, frame: Vec<u8>, expect, event| t.add(name, frame, expect, event);

    f(
        "TCP to a non-service address",
        syn(c(40000), sa(p.elsewhere, 80)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "TCP to the node on a non-NodePort port",
        syn(c(40000), sa(p.node, 22)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "TCP from the wire to a localhost NodePort: never translated (only the node's sockets use those)",
        syn(c(40000), sa(p.localhost(), 30080)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "LB IP, eTP=Local: DNAT to the local backend, client kept",
        syn(c(40001), sa(p.lb_local, 80)).build(),
        Expect::Bytes(syn(c(40001), sa(p.local_pod, 8080)).build()),
        Event::NewFlow,
    );
    let mut vlan_in = syn(c(40002), sa(p.lb_local, 80));
    vlan_in.vlans = vec![100];
    let mut vlan_out = syn(c(40002), sa(p.local_pod, 8080));
    vlan_out.vlans = vec![100];
    f(
        "VLAN-tagged frame: translated, tag kept",
        vlan_in.build(),
        Expect::Bytes(vlan_out.build()),
        Event::NewFlow,
    );
    let mut qinq_in = syn(c(40003), sa(p.lb_local, 80));
    qinq_in.vlans = vec![200, 100];
    let mut qinq_out = syn(c(40003), sa(p.local_pod, 8080));
    qinq_out.vlans = vec![200, 100];
    f(
        "double-tagged frame: translated",
        qinq_in.build(),
        Expect::Bytes(qinq_out.build()),
        Event::NewFlow,
    );
    f(
        "UDP external IP, eTP=Local",
        Frame::udp(c(40005), sa(p.ext_udp, 53)).build(),
        Expect::Bytes(Frame::udp(c(40005), sa(p.local_pod, 5353)).build()),
        Event::NewFlow,
    );
    f(
        "NodePort eTP=Cluster: DNAT to the remote backend",
        syn(c(40007), sa(p.node, 30080)).build(),
        Expect::Dnat(sa(p.remote_pod, 8080)),
        Event::NewFlow,
    );
    f(
        if v4 {
            "no endpoints: ICMP port-unreachable"
        } else {
            "no endpoints: ICMPv6 port-unreachable"
        },
        syn(c(40008), sa(p.node, 30081)).build(),
        Expect::Reject,
        Event::RejectNoEndpoints,
    );
    f(
        "UDP to a TCP-only NodePort: not ours",
        Frame::udp(c(40008), sa(p.node, 30081)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "eTP=Local without a local endpoint: drop",
        syn(c(40009), sa(p.node, 30082)).build(),
        Expect::Drop,
        Event::DropNoLocalEndpoint,
    );
    f(
        "source outside loadBalancerSourceRanges: drop",
        syn(c(40010), sa(p.lb_ranged, 80)).build(),
        Expect::Drop,
        Event::DropSourceRange,
    );
    f(
        "source inside loadBalancerSourceRanges: DNAT",
        syn(sa(p.in_range, 40010), sa(p.lb_ranged, 80)).build(),
        Expect::Dnat(sa(p.remote_pod, 8080)),
        Event::NewFlow,
    );
    f(
        "ClusterIP from off-node: DNAT",
        syn(c(40011), sa(p.cluster_ip, 80)).build(),
        Expect::Dnat(sa(p.remote_pod, 8080)),
        Event::NewFlow,
    );
    f(
        "ClusterIP on a port it does not serve: reject",
        syn(c(40012), sa(p.cluster_ip, 81)).build(),
        Expect::Reject,
        Event::RejectUnknownPort,
    );
    f(
        "unallocated address in the service CIDR: drop",
        syn(c(40013), sa(p.unallocated, 80)).build(),
        Expect::Drop,
        Event::DropUnallocatedServiceIp,
    );
    let mut truncated = syn(c(40015), sa(p.lb_local, 80)).build();
    truncated.truncate(14 + p.ip_header_len + 10);
    f(
        "truncated TCP header: passed untouched",
        truncated,
        Expect::Untouched,
        Event::Malformed,
    );
    f(
        "SCTP to an address without SCTP ports: not ours",
        Frame::sctp(c(40018), sa(p.lb_local, 80)).build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "SCTP NodePort, eTP=Local: DNAT with port translation, CRC32c updated",
        Frame::sctp(c(40019), sa(p.node, 30090)).build(),
        Expect::Bytes(Frame::sctp(c(40019), sa(p.local_pod, 9090)).build()),
        Event::NewFlow,
    );
    // The kernel's SCTP leaves the CRC zero when the device computes it
    // (CHECKSUM_PARTIAL, as veth offers): it must stay zero.
    let crc = 14 + p.ip_header_len + 8;
    let offloaded = |frame: Vec<u8>| {
        let mut frame = frame;
        frame[crc..crc + 4].fill(0);
        frame
    };
    f(
        "SCTP with its CRC32c left to the device: the zero field stays zero",
        offloaded(Frame::sctp(c(40021), sa(p.node, 30090)).build()),
        Expect::Bytes(offloaded(Frame::sctp(c(40021), sa(p.local_pod, 9090)).build())),
        Event::NewFlow,
    );
    t.0
}

/// The IPv4 rows no IPv6 packet has (IPv6's: `fixtures_ipv6.rs`).
fn ipv4_fixtures() -> Vec<Fixture> {
    let sa = |ip, port| V4.sa(ip, port);
    let c = |port| sa(V4.client, port);
    let syn = |src, dst| Frame::tcp(src, dst, TCP_SYN);
    let mut t = Table::default();
    let mut f = |name, frame: Vec<u8>, expect, event| t.add(name, frame, expect, event);

    f("ARP frame: not ours", arp(), Expect::Untouched, Event::Pass);
    let mut opts_in = syn(c(40004), sa(V4.lb_local, 80));
    opts_in.ip_options = vec![1, 1, 1, 0]; // NOP, NOP, NOP, EOL
    let mut opts_out = syn(c(40004), sa(V4.local_pod, 8080));
    opts_out.ip_options = vec![1, 1, 1, 0];
    f(
        "IP options: translated after them",
        opts_in.build(),
        Expect::Bytes(opts_out.build()),
        Event::NewFlow,
    );
    let mut zero_in = Frame::udp(c(40006), sa(V4.ext_udp, 53));
    zero_in.udp_zero_checksum = true;
    let mut zero_out = Frame::udp(c(40006), sa(V4.local_pod, 5353));
    zero_out.udp_zero_checksum = true;
    f(
        "UDP zero checksum stays zero",
        zero_in.build(),
        Expect::Bytes(zero_out.build()),
        Event::NewFlow,
    );
    let mut frag = syn(c(40014), sa(V4.lb_local, 80));
    frag.frag = 0x2000; // MF: first fragment
    f(
        "first fragment: passed untouched, never half-translated",
        frag.build(),
        Expect::Untouched,
        Event::Fragment,
    );
    let mut frag2 = syn(c(40014), sa(V4.lb_local, 80));
    frag2.frag = 185; // offset 1480: no L4 header at all
    f(
        "non-first fragment: passed untouched",
        frag2.build(),
        Expect::Untouched,
        Event::Fragment,
    );
    let mut lying = syn(c(40016), sa(V4.lb_local, 80)).build();
    lying[16..18].copy_from_slice(&2000u16.to_be_bytes()); // IP total length beyond the frame
    f(
        "IP total length beyond the frame: passed untouched",
        lying,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut bad_ihl = syn(c(40017), sa(V4.lb_local, 80)).build();
    bad_ihl[14] = 0x43;
    f(
        "IHL below 5: passed untouched",
        bad_ihl,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut sctp_opts = Frame::sctp(c(40020), sa(V4.node, 30090));
    sctp_opts.ip_options = vec![1, 1, 1, 0];
    sctp_opts.payload = vec![7; 301];
    let mut sctp_opts_out = Frame::sctp(c(40020), sa(V4.local_pod, 9090));
    sctp_opts_out.ip_options = vec![1, 1, 1, 0];
    sctp_opts_out.payload = vec![7; 301];
    f(
        "SCTP with IP options and a longer chunk: CRC32c updated",
        sctp_opts.build(),
        Expect::Bytes(sctp_opts_out.build()),
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

/// Every row of both families (IPv4 also its own rows), in XDP and TC.
fn ingress_fixture_table(p: &Plan) {
    let rows = || match p.family {
        Family::V4 => fixtures(p).into_iter().chain(ipv4_fixtures()).collect(),
        Family::V6 => fixtures(p),
    };
    let failures = run_table(|| datapath(p), rows);
    assert!(failures.is_empty(), "fixtures failed:\n{}", failures.join("\n"));
}

/// The IPv4 conntrack entries of a masqueraded flow, read back: XDP
/// alone, established packets follow the entry, SNAT to the node from the
/// configured port range, the reply sent on to the client.
#[test]
fn established_flow_and_replies_follow_conntrack() {
    let sa = |ip, port| V4.sa(ip, port);
    let dp = datapath(&V4);
    // NodePort eTP=Cluster: new flow, then the next packet of the same flow.
    let client = sa(V4.client, 41000);
    let (v, out) = run(&dp, &Frame::tcp(client, sa(V4.node, 30080), TCP_SYN).build());
    assert_eq!(v, XDP_PASS);
    assert_eq!(parse_and_verify(&out).dst_addr(), sa(V4.remote_pod, 8080));
    let (v, out) = run(&dp, &Frame::tcp(client, sa(V4.node, 30080), TCP_ACK).build());
    assert_eq!(v, XDP_PASS);
    assert_eq!(parse_and_verify(&out).dst_addr(), sa(V4.remote_pod, 8080));
    assert_eq!(dp.maps().counter(Event::Established).unwrap().packets, 1);

    // The flow is SNATed: the reply from the remote backend comes back to
    // node:port, and XDP sends it on to the client.
    let ct = dp.maps().conntrack().unwrap();
    let IpAddr::V4(client_ip) = V4.client else {
        unreachable!()
    };
    let (_, fwd) = ct
        .iter()
        .find(|(k, _)| k.saddr == u32::from(client_ip).to_be() && k.dport == 30080u16.to_be())
        .expect("forward entry");
    let snat_port = u16::from_be(fwd.nat_sport);
    assert_eq!(
        IpAddr::from(Ipv4Addr::from(u32::from_be(fwd.nat_saddr))),
        V4.node,
        "SNAT to the node"
    );
    assert!(
        (1024..=32767).contains(&snat_port),
        "SNAT port {snat_port} in the configured range"
    );
    let reply = Frame::tcp(sa(V4.remote_pod, 8080), sa(V4.node, snat_port), TCP_SYN | TCP_ACK).build();
    let (v, out) = run(&dp, &reply);
    assert_eq!(v, XDP_PASS);
    let o = parse_and_verify(&out);
    assert_eq!(o.dst_addr(), client, "un-SNAT: back to the client");
    assert_eq!(
        o.src_addr(),
        sa(V4.remote_pod, 8080),
        "the source is restored at egress (tc_egress)"
    );
}

/// Entries are stamped with the monotonic clock read from jiffies (the
/// agent tells HZ from /proc/timer_list): within a second of
/// CLOCK_MONOTONIC, so that entries stamped by programs on the coarse ktime
/// clock (before an upgrade, or where HZ is unknown) keep their ages.
#[test]
fn entries_are_stamped_with_the_monotonic_clock() {
    let sa = |ip, port| V4.sa(ip, port);
    let dp = datapath(&V4);
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
    let client = sa(V4.client, 41500);
    let (v, _) = run(&dp, &Frame::tcp(client, sa(V4.node, 30080), TCP_SYN).build());
    assert_eq!(v, XDP_PASS);
    let after = monotonic();
    let ct = dp.maps().conntrack().unwrap();
    let IpAddr::V4(client_ip) = V4.client else {
        unreachable!()
    };
    let (_, fwd) = ct
        .iter()
        .find(|(k, _)| k.saddr == u32::from(client_ip).to_be() && k.sport == 41500u16.to_be())
        .expect("forward entry");
    let stamp = fwd.last_seen_ns;
    assert!(
        stamp + 1_000_000_000 >= before && stamp <= after + 1_000_000_000,
        "stamp {stamp} ns, CLOCK_MONOTONIC {before}..{after} ns"
    );
}

/// A masqueraded flow (NodePort, eTP=Cluster): established packets follow
/// the conntrack entry, the SNAT address is the node's (of the flow's
/// family), and the backend's reply to it goes back to the client with the
/// frontend as its source, through both program types.
fn masqueraded_flows_and_replies(p: &Plan) {
    let sa = |ip, port| p.sa(ip, port);
    for prog in [XDP, TC] {
        let dp = datapath(p);
        let tc = |name: &'static str, input: &[u8]| {
            let (v, out, _) = testrun::run(dp.tc(name).unwrap(), input, 1);
            (v, out)
        };
        let client = sa(p.client, 41000);
        let node_port = sa(p.node, 30080);
        let (v, out) = run_as(&dp, prog, &Frame::tcp(client, node_port, TCP_SYN).build());
        assert_eq!(v, prog.pass);
        let fwd = parse_and_verify(&out);
        assert_eq!(fwd.dst_addr(), sa(p.remote_pod, 8080), "{}: DNAT", prog.program);
        let (v, out) = run_as(&dp, prog, &Frame::tcp(client, node_port, TCP_ACK).build());
        assert_eq!(v, prog.pass);
        assert_eq!(parse_and_verify(&out).dst_addr(), sa(p.remote_pod, 8080));
        assert_eq!(dp.maps().counter(Event::Established).unwrap().packets, 1);

        // On its way to the remote backend, tc_egress masquerades it to the
        // node's address.
        let (v, out) = tc(names::TC_EGRESS, &out);
        assert_eq!(v, 0, "TC_ACT_OK");
        let snat = parse_and_verify(&out).src_addr();
        assert_eq!(snat.ip(), p.node, "{}: SNAT to the node's address", prog.program);
        assert!((1024..=32767).contains(&snat.port()), "SNAT port {}", snat.port());

        // The reply comes back to node:port: un-SNAT at ingress, the
        // frontend restored at egress.
        let reply = Frame::tcp(sa(p.remote_pod, 8080), snat, TCP_SYN | TCP_ACK).build();
        let (v, out) = run_as(&dp, prog, &reply);
        assert_eq!(v, prog.pass);
        let o = parse_and_verify(&out);
        assert_eq!(o.dst_addr(), client, "un-SNAT: back to the client");
        let (v, out) = tc(names::TC_EGRESS, &out);
        assert_eq!(v, 0);
        let o = parse_and_verify(&out);
        assert_eq!(
            (o.src_addr(), o.dst_addr()),
            (node_port, client),
            "{}: the client sees the frontend",
            prog.program
        );
    }
}

/// Egress hooks know a flow by the tuple between client and backend alone.
/// One backend's flows through the ingress program `p` and TC egress, as
/// the client-port reuse tests open and answer them.
struct Flows<'a> {
    dp: &'a Datapath,
    p: Verdicts,
    backend: SocketAddr,
}

impl<'a> Flows<'a> {
    fn new(dp: &'a Datapath, p: Verdicts, backend: SocketAddr) -> Self {
        Self { dp, p, backend }
    }

    fn ingress(&self, input: &[u8]) -> (u32, Vec<u8>) {
        run_as(self.dp, self.p, input)
    }

    fn egress(&self, input: &[u8]) -> Parsed {
        let (v, out, _) = testrun::run(self.dp.tc(names::TC_EGRESS).unwrap(), input, 1);
        assert_eq!(v, 0, "TC_ACT_OK");
        parse_and_verify(&out)
    }

    /// A SYN from `client` to `frontend`: the source the backend sees (the
    /// SNAT address and port when masqueraded).
    fn open(&self, client: SocketAddr, frontend: SocketAddr) -> SocketAddr {
        let (v, out) = self.ingress(&Frame::tcp(client, frontend, TCP_SYN).build());
        assert_eq!(v, self.p.pass, "{}: SYN {client} -> {frontend}", self.p.program);
        assert_eq!(parse_and_verify(&out).dst_addr(), self.backend);
        self.egress(&out).src_addr()
    }

    /// The backend's packet to `seen` (its view of the client), as the
    /// client receives it: (source, destination).
    fn reply(&self, seen: SocketAddr, flags: u8) -> (SocketAddr, SocketAddr) {
        let (v, out) = self.ingress(&Frame::tcp(self.backend, seen, flags).build());
        assert_eq!(v, self.p.pass);
        let o = self.egress(&out);
        (o.src_addr(), o.dst_addr())
    }
}

/// Two flows from one client address and port to one backend through
/// different frontends (a masqueraded NodePort and an eTP=Local LB IP, or
/// two masqueraded ones) have the same such tuple: once the first has closed, the second takes the
/// tuple over and is translated as its own (it was masqueraded as the old
/// one, its replies given the old one's frontend); while the first is live,
/// the second cannot be told apart from it and is dropped, counted, instead
/// of being mistranslated. Both program types, both orders.
fn client_port_reused(pl: &Plan) {
    let sa = |ip, port| pl.sa(ip, port);
    for p in [XDP, TC] {
        let dp = datapath(pl);
        let flows = Flows::new(&dp, p, sa(pl.local_pod, 8080));
        let node_port = sa(pl.node, 30084);
        let lb = sa(pl.lb_local, 80);

        // 1. Masqueraded, then closed (FIN each way).
        let client = sa(pl.client, 43000);
        let snat = flows.open(client, node_port);
        assert_eq!(snat.ip(), pl.node, "{}: masqueraded", p.program);
        assert_eq!(flows.reply(snat, TCP_SYN | TCP_ACK), (node_port, client));
        let (v, _) = flows.ingress(&Frame::tcp(client, node_port, TCP_FIN | TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(flows.reply(snat, TCP_FIN | TCP_ACK), (node_port, client));
        // The same client port to the LB IP (eTP=Local: client kept): not
        // masqueraded, replies from the LB IP.
        assert_eq!(
            flows.open(client, lb),
            client,
            "{}: not masqueraded as the closed flow",
            p.program
        );
        assert_eq!(
            flows.reply(client, TCP_SYN | TCP_ACK),
            (lb, client),
            "{}",
            p.program
        );

        // 2. The other order: unmasqueraded and closed, then masqueraded.
        let client = sa(pl.client, 43001);
        assert_eq!(flows.open(client, lb), client);
        let (v, _) = flows.ingress(&Frame::tcp(client, lb, TCP_FIN | TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(flows.reply(client, TCP_FIN | TCP_ACK), (lb, client));
        let snat = flows.open(client, node_port);
        assert_eq!(snat.ip(), pl.node, "{}: masqueraded", p.program);
        assert_eq!(
            flows.reply(snat, TCP_SYN | TCP_ACK),
            (node_port, client),
            "{}",
            p.program
        );

        // 3. While the first flow is live, either way round: the second is
        // dropped, the first keeps its translation.
        let dropped = || dp.maps().counter(Event::DropTupleClash).unwrap().packets;
        let client = sa(pl.client, 43002);
        let snat = flows.open(client, node_port);
        let (v, _) = flows.ingress(&Frame::tcp(client, lb, TCP_SYN).build());
        assert_eq!(v, p.drop, "{}: a live flow holds the tuple", p.program);
        assert_eq!(dropped(), 1);
        assert_eq!(flows.reply(snat, TCP_SYN | TCP_ACK), (node_port, client));
        let (v, out) = flows.ingress(&Frame::tcp(client, node_port, TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(flows.egress(&out).src_addr(), snat);

        let client = sa(pl.client, 43003);
        assert_eq!(flows.open(client, lb), client);
        let (v, _) = flows.ingress(&Frame::tcp(client, node_port, TCP_SYN).build());
        assert_eq!(v, p.drop, "{}: a live flow holds the tuple", p.program);
        assert_eq!(dropped(), 2);
        assert_eq!(flows.reply(client, TCP_SYN | TCP_ACK), (lb, client));

        // 4. Both masqueraded (NodePort, then the LB IP of the same
        // Service): closed, the tuple is taken over; live, a clash.
        let lb_cluster = sa(pl.lb_cluster_local, 80);
        let client = sa(pl.client, 43004);
        let snat = flows.open(client, node_port);
        let (v, _) = flows.ingress(&Frame::tcp(client, lb_cluster, TCP_SYN).build());
        assert_eq!(v, p.drop, "{}: a live flow holds the tuple", p.program);
        assert_eq!(dropped(), 3);
        assert_eq!(flows.reply(snat, TCP_SYN | TCP_ACK), (node_port, client));
        let (v, _) = flows.ingress(&Frame::tcp(client, node_port, TCP_FIN | TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(flows.reply(snat, TCP_FIN | TCP_ACK), (node_port, client));
        let snat = flows.open(client, lb_cluster);
        assert_eq!(snat.ip(), pl.node);
        assert_eq!(
            flows.reply(snat, TCP_SYN | TCP_ACK),
            (lb_cluster, client),
            "{}",
            p.program
        );

        let taken_over = flow_stat(&dp, FlowStat::TupleTakeover);
        assert_eq!(taken_over, 3, "{}: the closed flows' tuples", p.program);
    }
}

/// One client port to two frontends of one backend (a ClusterIP reached
/// from outside, masqueraded, and an eTP=Local LB IP, not): while the
/// first flow is live, the second is dropped as a clash; once it has
/// closed, the second is translated as itself (see
/// [`client_port_reused`]).
fn client_port_reused_through_a_cluster_ip(pl: &Plan) {
    let sa = |ip, port| pl.sa(ip, port);
    for p in [XDP, TC] {
        let dp = datapath(pl);
        let flows = Flows::new(&dp, p, sa(pl.local_pod, 8080));
        let (cip, lb) = (sa(pl.service_ip(10), 80), sa(pl.lb_local, 80));
        let client = sa(pl.client, 43100);
        let snat = flows.open(client, cip);
        assert_eq!(snat.ip(), pl.node, "{}: masqueraded", p.program);
        // Live: the LB IP from the same port is a clash.
        let (v, _) = flows.ingress(&Frame::tcp(client, lb, TCP_SYN).build());
        assert_eq!(v, p.drop, "{}", p.program);
        assert_eq!(dp.maps().counter(Event::DropTupleClash).unwrap().packets, 1);
        assert_eq!(flows.reply(snat, TCP_SYN | TCP_ACK), (cip, client));
        // Closed: the LB IP flow takes the tuple over.
        let (v, _) = flows.ingress(&Frame::tcp(client, cip, TCP_FIN | TCP_ACK).build());
        assert_eq!(v, p.pass);
        assert_eq!(flows.reply(snat, TCP_FIN | TCP_ACK), (cip, client));
        assert_eq!(
            flows.open(client, lb),
            client,
            "{}: not masqueraded as the closed flow",
            p.program
        );
        assert_eq!(
            flows.reply(client, TCP_SYN | TCP_ACK),
            (lb, client),
            "{}",
            p.program
        );
    }
}

/// A SYN on the tuple of a closed connection opens a new one, with a
/// fresh backend choice, as netfilter reopens a TIME_WAIT entry: each
/// connection is translated both ways, a masqueraded one keeps its hashed
/// SNAT port, and the new connection is open (a retransmitted SYN stays on
/// its backend instead of reopening again). Masqueraded over four backends
/// (the choice is made again: more than one is used) and to one, and
/// unmasqueraded to one; both program types.
fn closed_tuple_reopens(pl: &Plan) {
    const CONNECTIONS: u64 = 60;
    let sa = |ip, port| pl.sa(ip, port);
    for p in [XDP, TC] {
        let dp = datapath(pl);
        let spread: Vec<SocketAddr> = pl.spread_pods().into_iter().map(|ip| sa(ip, 8080)).collect();
        let r = reopen_connections(
            &dp,
            p,
            sa(pl.client, 44000),
            sa(pl.node, 30083),
            &spread,
            CONNECTIONS,
        );
        assert_eq!(r.source.ip(), pl.node, "{}: masqueraded", p.program);
        // All 60 on one of 4 backends: a chance of 4^-59.
        assert!(
            r.backends.len() > 1,
            "{}: chosen again: {:?}",
            p.program,
            r.backends
        );
        let client = sa(pl.client, 44001);
        let r = reopen_connections(&dp, p, client, sa(pl.lb_local, 80), &[sa(pl.local_pod, 8080)], 20);
        assert_eq!(r.source, client, "{}: eTP=Local keeps the client", p.program);
        let backend = [sa(pl.remote_pod, 8080)];
        let r = reopen_connections(&dp, p, sa(pl.client, 44100), sa(pl.node, 30080), &backend, 20);
        assert_eq!(r.source.ip(), pl.node, "{}: masqueraded", p.program);
    }
}

fn new_flows_spread_uniformly(p: &Plan) {
    let dp = datapath(p);
    const FLOWS: u16 = 2000;
    let mut per_backend = std::collections::BTreeMap::new();
    for i in 0..FLOWS {
        let (v, out) = run(
            &dp,
            &Frame::tcp(p.sa(p.client, 10000 + i), p.sa(p.node, 30083), TCP_SYN).build(),
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

fn udp_flows_purged(p: &Plan) {
    let mut dp = datapath(p);
    for port in [42000, 42001, 42002] {
        let (v, _) = run(
            &dp,
            &Frame::udp(p.sa(p.client, port), p.sa(p.ext_udp, 53)).build(),
        );
        assert_eq!(v, XDP_PASS);
    }
    let udp_entries = |dp: &Datapath| match p.family {
        Family::V4 => (dp.maps().conntrack().unwrap().iter())
            .filter(|(k, _)| k.proto == 17)
            .count(),
        Family::V6 => (dp.maps().conntrack6().unwrap().iter())
            .filter(|(k, _)| k.proto == 17)
            .count(),
    };
    assert_eq!(udp_entries(&dp), 6, "two entries per flow (no SNAT)");
    let purged = dp.maps_mut().purge_udp_flows_to(&[(p.local_pod, 5353)]).unwrap();
    assert_eq!(purged, 6);
    assert_eq!(udp_entries(&dp), 0);
}

/// ICMP (ICMPv6) errors about translated flows reach the endpoint whose
/// packet they quote, quoting it as that endpoint sent it, through every
/// hook that can see them: `xdp_ingress`/`tc_ingress` (errors from beyond
/// the node, both ways: path MTU discovery through Services), `tc_pod_ingress`
/// (a local backend's error) and `tc_egress` (the node's own, e.g.
/// "fragmentation needed" or "packet too big" when a pod's MTU is smaller).
/// As with netfilter's NAT, they leave from the address the endpoint sent
/// to (`tc_egress`, POSTROUTING's half; the ICMPv6 checksum covers it):
/// the client never sees a backend's or a router's address, whoever
/// answered.
fn icmp_errors_reach_their_sender(pl: &Plan) {
    use IcmpError::{PortUnreachable, TooBig};
    let sa = |ip, port| pl.sa(ip, port);
    let error = |src, dst, e, about: &[u8]| pl.icmp_error(src, dst, e, about);
    for p in [XDP, TC] {
        let dp = datapath(pl);
        let ingress = |input: &[u8]| run_as(&dp, p, input);
        let tc = |name: &'static str, input: &[u8]| {
            let (v, out, _) = testrun::run(dp.tc(name).unwrap(), input, 1);
            (v, out)
        };
        let translated = || dp.maps().counter(Event::IcmpErrorTranslated).unwrap().packets;

        // A masqueraded flow to the remote backend: its SNAT address, as
        // tc_egress makes it.
        let client = sa(pl.client, 41100);
        let node_port = sa(pl.node, 30080);
        let (v, out) = ingress(&Frame::tcp(client, node_port, TCP_SYN).build());
        assert_eq!(v, p.pass);
        let (_, out) = tc(names::TC_EGRESS, &out);
        let snat = parse_and_verify(&out).src_addr();
        assert_eq!(snat.ip(), pl.node, "{}: masqueraded", p.program);

        // 1. A router between the node and the backend cannot forward a
        //    masqueraded packet: back to the client, about what it sent.
        let sent = Frame::tcp(snat, sa(pl.remote_pod, 8080), TCP_ACK).build();
        let err = error(pl.router, pl.node, TooBig(1400), &sent);
        let about_client = Frame::tcp(client, node_port, TCP_ACK).build();
        let want = error(pl.router, pl.client, TooBig(1400), &about_client);
        let before = translated();
        let (v, out) = ingress(&err);
        assert_eq!(v, p.pass, "{}", p.program);
        parse_and_verify(&out);
        assert_eq!(out, want, "{}: error about a forward packet", p.program);
        assert_eq!(translated(), before + 1);
        // The same behind Ethernet padding (bytes after the IP packet): they
        // are not the quote's, and stay as they are.
        let padded = |f: &[u8]| [f, &[0u8; 12][..]].concat();
        let (v, out) = ingress(&padded(&err));
        assert_eq!(v, p.pass);
        parse_and_verify(&out);
        assert_eq!(out, padded(&want), "{}: a padded error", p.program);
        // On its way out to the client (POSTROUTING's half): from the
        // address the client sent to, as netfilter's NAT makes it.
        let (v, out) = tc(names::TC_EGRESS, &want);
        assert_eq!(v, 0, "TC_ACT_OK");
        parse_and_verify(&out);
        let from_frontend = error(pl.node, pl.client, TooBig(1400), &about_client);
        assert_eq!(out, from_frontend, "{}: the outer source at egress", p.program);
        assert_eq!(translated(), before + 3);

        // 2. A router on the client's side cannot forward a reply: to the
        //    backend, about what it sent (to the node's SNAT address).
        let reply = Frame::tcp(node_port, client, TCP_ACK).build();
        let err = error(pl.router, pl.node, TooBig(1280), &reply);
        let about_backend = Frame::tcp(sa(pl.remote_pod, 8080), snat, TCP_ACK).build();
        let want = error(pl.router, pl.remote_pod, TooBig(1280), &about_backend);
        let (v, out) = ingress(&err);
        assert_eq!(v, p.pass);
        parse_and_verify(&out);
        assert_eq!(out, want, "{}: error about a reply", p.program);
        // Out to the backend: from the node's SNAT address, where the
        // backend sent its reply.
        let (_, out) = tc(names::TC_EGRESS, &want);
        parse_and_verify(&out);
        let from_snat = error(snat.ip(), pl.remote_pod, TooBig(1280), &about_backend);
        assert_eq!(out, from_snat, "{}: error about a reply, at egress", p.program);

        // 3. A local backend of an eTP=Local UDP external IP answers
        //    port-unreachable: the client learns about the address it tried.
        let client2 = sa(pl.client, 41101);
        let (v, _) = ingress(&Frame::udp(client2, sa(pl.ext_udp, 53)).build());
        assert_eq!(v, p.pass);
        let about_pod = Frame::udp(client2, sa(pl.local_pod, 5353)).build();
        let err = error(pl.local_pod, pl.client, PortUnreachable, &about_pod);
        let about_frontend = Frame::udp(client2, sa(pl.ext_udp, 53)).build();
        let want = error(pl.local_pod, pl.client, PortUnreachable, &about_frontend);
        let (v, out) = tc(names::TC_POD_INGRESS, &err);
        assert_eq!(v, 0, "TC_ACT_OK");
        parse_and_verify(&out);
        assert_eq!(out, want, "a local backend's error (UDP quote checksum too)");
        // Out to the client: from the external IP it tried.
        let (_, out) = tc(names::TC_EGRESS, &want);
        parse_and_verify(&out);
        let from_frontend = error(pl.ext_udp, pl.client, PortUnreachable, &about_frontend);
        assert_eq!(out, from_frontend, "a local backend's error, at egress");

        // 4. The node cannot forward a client's packet into a local pod
        //    (smaller MTU): its own error leaves through tc_egress.
        let client3 = sa(pl.client, 41102);
        let (v, _) = ingress(&Frame::tcp(client3, sa(pl.lb_local, 80), TCP_SYN).build());
        assert_eq!(v, p.pass);
        let about_pod = Frame::tcp(client3, sa(pl.local_pod, 8080), TCP_ACK).build();
        let err = error(pl.node, pl.client, TooBig(1450), &about_pod);
        // From the address the client sent to (netfilter: the node's
        // error is related to the flow, and POSTROUTING sets its source).
        let about_frontend = Frame::tcp(client3, sa(pl.lb_local, 80), TCP_ACK).build();
        let want = error(pl.lb_local, pl.client, TooBig(1450), &about_frontend);
        let (v, out) = tc(names::TC_EGRESS, &err);
        assert_eq!(v, 0, "TC_ACT_OK");
        parse_and_verify(&out);
        assert_eq!(out, want, "the node's own error, at egress");

        // 5. An error about no flow of ours: untouched.
        let elsewhere = Frame::tcp(client, sa(pl.elsewhere, 443), TCP_ACK).build();
        let err = error(pl.router, pl.client, TooBig(1400), &elsewhere);
        let (v, out) = ingress(&err);
        assert_eq!((v, out), (p.pass, err), "not ours");
    }
}

/// ClientIP session affinity: every new connection of a client goes to
/// the backend its first one got (8 candidates), through the NodePort and
/// the ClusterIP alike; other clients spread over the backends.
fn session_affinity_holds(p: &Plan) {
    let dp = datapath(p);
    let first = |client: IpAddr, port: u16, dst: SocketAddr| {
        let (v, out) = run_as(&dp, XDP, &Frame::tcp(p.sa(client, port), dst, TCP_SYN).build());
        assert_eq!(v, XDP.pass);
        parse_and_verify(&out).dst
    };
    let node_port = p.sa(p.node, 30111);
    let backend = first(p.client, 43000, node_port);
    for i in 1..=10u16 {
        let dst = if i % 2 == 0 {
            p.sa(p.service_ip(11), 80)
        } else {
            node_port
        };
        assert_eq!(
            first(p.client, 43000 + i, dst),
            backend,
            "connection {i} to {dst}"
        );
    }
    // Many other clients spread over the backends (affinity is per client).
    let others: std::collections::BTreeSet<_> = (1..=64u16)
        .map(|i| first(p.range_client(i), 44000, node_port))
        .collect();
    assert!(
        others.len() > 1,
        "other clients are not all pinned to one backend: {others:?}"
    );
}
