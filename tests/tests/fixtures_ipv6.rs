//! BPF_PROG_TEST_RUN fixtures only IPv6 has, on the dual-stack node of the
//! IPv6 address plan ([`dataplane_tests::plan::V6`]: 198.18.0.11 and
//! 2001:db8::11, IPv6 Service ports programmed through the agent's own
//! code path beside IPv4 ones), through both of the ingress path's program
//! types: extension headers, fragments, malformed IPv6 headers, ICMPv6 that
//! is not ours, and a dual-stack Service's IPv4 half beside its IPv6 one.
//!
//! Every verdict both families share (the ingress table, masqueraded flows
//! and replies, reused and reopened tuples, ICMPv6 errors about translated
//! flows both ways, session affinity) is written once and run for IPv6 too
//! in `fixtures_north_south.rs`; pods reaching IPv6 Services in
//! `fixtures_east_west.rs`.

use std::net::IpAddr;

use dataplane_common::stats::Event;
use dataplane_tests::{
    fixture::{Expect, Fixture, Table, run_table},
    packet::{Ext, Frame, TCP_SYN, icmp6_echo_request},
    plan::{V4, V6, datapath},
};

fn fixtures() -> Vec<Fixture> {
    let p = &V6;
    let sa = |ip, port| p.sa(ip, port);
    let c = |port| sa(p.client, port);
    let syn = |src, dst| Frame::tcp(src, dst, TCP_SYN);
    let (IpAddr::V6(client), IpAddr::V6(node)) = (p.client, p.node) else {
        unreachable!()
    };
    let mut t = Table::default();
    let mut f = |name, frame: Vec<u8>, expect, event| t.add(name, frame, expect, event);

    f(
        "ICMPv6 echo request to the node: not ours",
        icmp6_echo_request(client, node),
        Expect::Untouched,
        Event::Pass,
    );
    let ext = vec![
        Ext::Options { kind: 0, units: 0 },
        Ext::Routing,
        Ext::Options { kind: 60, units: 1 },
    ];
    let mut ext_in = syn(c(40003), sa(p.lb_local, 80));
    ext_in.ext = ext.clone();
    let mut ext_out = syn(c(40003), sa(p.local_pod, 8080));
    ext_out.ext = ext;
    f(
        "hop-by-hop, routing and destination options: translated after them",
        ext_in.build(),
        Expect::Bytes(ext_out.build()),
        Event::NewFlow,
    );
    let mut ah = syn(c(40004), sa(p.lb_local, 80));
    ah.ext = vec![Ext::Auth];
    f(
        "IPsec AH: passed untouched (a rewrite would break it)",
        ah.build(),
        Expect::Untouched,
        Event::Pass,
    );
    f(
        "the dual-stack Service's IPv4 ClusterIP beside it: DNAT to its IPv4 endpoint",
        Frame::tcp(V4.sa(V4.client, 40011), V4.sa(V4.cluster_ip, 80), TCP_SYN).build(),
        Expect::Dnat(V4.sa(V4.remote_pod, 8080)),
        Event::NewFlow,
    );
    for (name, offset, more) in [
        ("first fragment: passed untouched, never half-translated", 0, true),
        ("non-first fragment: passed untouched", 185, false),
    ] {
        let mut frag = syn(c(40014), sa(p.lb_local, 80));
        frag.ext = vec![Ext::Fragment { offset, more }];
        f(name, frag.build(), Expect::Untouched, Event::Fragment);
    }
    let mut lying = syn(c(40016), sa(p.lb_local, 80)).build();
    lying[18..20].copy_from_slice(&2000u16.to_be_bytes()); // payload length beyond the frame
    f(
        "payload length beyond the frame: passed untouched",
        lying,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut jumbo = syn(c(40017), sa(p.lb_local, 80)).build();
    jumbo[18..20].fill(0);
    f(
        "payload length 0 (a jumbogram): passed untouched",
        jumbo,
        Expect::Untouched,
        Event::Malformed,
    );
    let mut bad_ext = syn(c(40018), sa(p.lb_local, 80));
    bad_ext.ext = vec![Ext::Options { kind: 0, units: 0 }];
    let mut bad_ext = bad_ext.build();
    bad_ext[14 + 40 + 1] = 200; // an extension header longer than the packet
    f(
        "extension header beyond the packet: passed untouched",
        bad_ext,
        Expect::Untouched,
        Event::Pass,
    );
    t.0
}

#[test]
fn ipv6_only_fixture_table_in_xdp_and_tc() {
    let failures = run_table(|| datapath(&V6), fixtures);
    assert!(failures.is_empty(), "fixtures failed:\n{}", failures.join("\n"));
}
