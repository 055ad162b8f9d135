//! Connection tracking under pressure, through BPF_PROG_TEST_RUN: a flood
//! of new flows that fills conntrack leaves established connections alone
//! (their entries have copies in a table that never evicts, put back when
//! the LRU evicted them), expired copies are collected, and the work a new
//! flow costs when its backend's SNAT ports are exhausted stays bounded.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use dataplane_agent::{
    dataplane::{Datapath, clock::monotonic_ns, family::CtTable},
    net::Protocol,
};
use dataplane_common::{
    ct::ct_flags,
    names,
    stats::{Event, FlowStat, Hook},
};
use dataplane_tests::{
    fixture::{XDP, flow_stat, run_as},
    packet::{Frame, TCP_ACK, TCP_FIN, TCP_SYN, parse_and_verify},
    services::{TestEndpoint, TestService},
    testrun::{self, fixture_datapath_configured},
};

const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 10);
const POD2: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 11);
const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
/// The fixtures' conntrack tables: 4096 entries each.
const CT_ENTRIES: usize = 4096;

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

/// The services of the flood tests: a masqueraded NodePort with two remote
/// endpoints (the established connections), a UDP NodePort with
/// externalTrafficPolicy Local and a local endpoint (the flood).
fn flood_datapath() -> Datapath {
    let web = TestService::new(1, "web", Protocol::Tcp, 80)
        .node_port(30080)
        .endpoint(TestEndpoint::ready(POD, 8080, 1))
        .endpoint(TestEndpoint::ready(POD2, 8080, 1));
    let dns = TestService::new(2, "dns", Protocol::Udp, 53)
        .node_port(30053)
        .external_local()
        .endpoint(TestEndpoint::ready(LOCAL_POD, 5353, 0));
    fixture_datapath_configured(&[NODE.into()], &[web, dns], |_| {})
}

/// An open connection through the fixtures' datapath: the client, the
/// backend it was balanced to and the source the backend sees.
struct Conn {
    client: SocketAddr,
    backend: SocketAddr,
    seen_as: SocketAddr,
}

fn egress(dp: &Datapath, frame: &[u8]) -> Vec<u8> {
    let (v, out, _) = testrun::run(dp.tc(names::TC_EGRESS).unwrap(), frame, 1);
    assert_eq!(v, 0, "TC_ACT_OK");
    out
}

/// Ingress then egress, as a packet crossing the node: (verdict, frame out).
fn through(dp: &Datapath, frame: &[u8]) -> (u32, Vec<u8>) {
    let (v, out) = run_as(dp, XDP, frame);
    (v, if v == XDP.pass { egress(dp, &out) } else { out })
}

/// The TCP handshake of `client` with the NodePort, through ingress and
/// egress both ways.
fn connect(dp: &Datapath, client: SocketAddr) -> Conn {
    let frontend = sa(NODE, 30080);
    let (v, out) = through(dp, &Frame::tcp(client, frontend, TCP_SYN).build());
    assert_eq!(v, XDP.pass);
    let o = parse_and_verify(&out);
    let (backend, seen_as) = (o.dst_addr(), o.src_addr());
    assert_eq!(seen_as.ip(), IpAddr::from(NODE), "masqueraded");
    let (_, out) = through(dp, &Frame::tcp(backend, seen_as, TCP_SYN | TCP_ACK).build());
    let o = parse_and_verify(&out);
    assert_eq!((o.src_addr(), o.dst_addr()), (frontend, client), "SYN-ACK");
    let conn = Conn {
        client,
        backend,
        seen_as,
    };
    exchange(dp, &conn, "handshake");
    conn
}

/// A data segment each way on an open connection: to its backend, from its
/// source; the answer back to the client from the frontend; both counted
/// as established.
fn exchange(dp: &Datapath, c: &Conn, what: &str) {
    let frontend = sa(NODE, 30080);
    let established = || {
        dp.maps()
            .hook_counter(Hook::XdpIngress, Event::Established)
            .unwrap()
            .packets
    };
    let before = established();
    let (v, out) = through(dp, &Frame::tcp(c.client, frontend, TCP_ACK).build());
    assert_eq!(v, XDP.pass, "{what}");
    let o = parse_and_verify(&out);
    assert_eq!(
        (o.src_addr(), o.dst_addr()),
        (c.seen_as, c.backend),
        "{what}: {} kept its backend and source",
        c.client
    );
    assert_eq!(established(), before + 1, "{what}: {} is a known flow", c.client);
    let (_, out) = through(dp, &Frame::tcp(c.backend, c.seen_as, TCP_ACK).build());
    let o = parse_and_verify(&out);
    assert_eq!(
        (o.src_addr(), o.dst_addr()),
        (frontend, c.client),
        "{what}: reply"
    );
}

fn client(i: u32, port: u16) -> SocketAddr {
    sa(Ipv4Addr::from(u32::from(Ipv4Addr::new(203, 0, 113, 0)) + i), port)
}

/// Entries of the flows of `conns` in each table: (LRU, assured copies).
fn tables_holding(dp: &Datapath, conns: &[Conn]) -> (usize, usize) {
    let count = |table| {
        dp.maps()
            .v4()
            .conntrack_table(table)
            .unwrap()
            .iter()
            .filter(|(k, e)| {
                conns.iter().any(|c| {
                    let client =
                        <u32 as dataplane_agent::dataplane::family::AbiAddr>::from_ip(c.client.ip()).unwrap();
                    (k.saddr == client && k.sport == c.client.port().to_be()) || e.nat_daddr == client
                })
            })
            .count()
    };
    (count(CtTable::Lru), count(CtTable::Assured))
}

/// A flood of new flows, three packets each from a new source every
/// flow, several times what conntrack holds: the established connections
/// all keep their backend and their replies, as under netfilter (which
/// evicts unassured entries first); the LRU evicts their entries among
/// the flood's, their copies put them back, and the evictions are
/// counted.
#[test]
fn a_flood_that_fills_conntrack_breaks_no_established_connection() {
    let dp = flood_datapath();
    let conns: Vec<Conn> = (0..20).map(|i| connect(&dp, client(i, 40_000))).collect();
    let backends: std::collections::BTreeSet<_> = conns.iter().map(|c| c.backend).collect();
    assert_eq!(backends.len(), 2, "both endpoints in use");
    // The handshake's last ACK assured each flow: its two entries (FWD_IN,
    // the SNAT port's REP_IN) have copies in the assured table.
    assert_eq!(tables_holding(&dp, &conns), (40, 40));
    assert_eq!(flow_stat(&dp, FlowStat::CtAssured), 40);
    for (_, e) in dp.maps().v4().conntrack_table(CtTable::Assured).unwrap() {
        assert_ne!(e.flags & ct_flags::ASSURED, 0);
    }
    // The flood: 3 × the LRU's capacity in flows (two entries each),
    // three packets apiece, none answered.
    let flows = (3 * CT_ENTRIES / 2) as u32;
    for i in 0..flows {
        let frame = Frame::udp(client(1_000 + i, 5_000), sa(NODE, 30053)).build();
        for _ in 0..3 {
            let (v, out) = run_as(&dp, XDP, &frame);
            assert_eq!(v, XDP.pass);
            assert_eq!(parse_and_verify(&out).dst_addr(), sa(LOCAL_POD, 5353));
        }
    }
    let lru = dp.maps().v4().conntrack_table(CtTable::Lru).unwrap().len();
    assert!(lru > CT_ENTRIES * 9 / 10, "the LRU is full: {lru} entries");
    assert_eq!(flow_stat(&dp, FlowStat::CtAssured), 40, "no flood flow assured");
    let evicted = dp.maps().ct_evictions().unwrap();
    assert!(
        evicted >= (2 * flows as usize - CT_ENTRIES) as u64,
        "{evicted} evictions counted for {} entries written into {CT_ENTRIES}",
        2 * flows
    );
    // The flood evicted the connections' entries (they were the least
    // recently used); every connection answers as before, through the same
    // backend, its entries restored from their copies.
    let (lru, copies) = tables_holding(&dp, &conns);
    assert_eq!(copies, 40);
    assert!(
        lru < 40,
        "the flood evicted established entries: {lru} of 40 left"
    );
    for c in &conns {
        exchange(&dp, c, "after the flood");
    }
    assert_eq!(tables_holding(&dp, &conns), (40, 40));
    assert_eq!(flow_stat(&dp, FlowStat::CtRestored), (40 - lru) as u64);
    assert_eq!(
        flow_stat(&dp, FlowStat::CtMidstream),
        0,
        "no connection picked up anew"
    );
    let drops: u64 = Event::ALL
        .iter()
        .filter(|e| e.is_drop())
        .map(|e| dp.maps().hook_counter(Hook::XdpIngress, *e).unwrap().packets)
        .sum();
    assert_eq!(drops, 0, "the flood was served, not dropped");
}

/// A closed connection's copies (a FIN each way) stay in the assured table
/// until the agent's collector finds them expired (its closed timeout),
/// while an open one's stay; a new connection on the closed one's tuple
/// starts anew, not shadowed by the old entries.
#[test]
fn expired_established_entries_are_collected_and_never_shadow_a_new_flow() {
    let mut dp = flood_datapath();
    let open = connect(&dp, client(1, 40_000));
    let closed = connect(&dp, client(2, 40_000));
    let frontend = sa(NODE, 30080);
    through(
        &dp,
        &Frame::tcp(closed.client, frontend, TCP_FIN | TCP_ACK).build(),
    );
    through(
        &dp,
        &Frame::tcp(closed.backend, closed.seen_as, TCP_FIN | TCP_ACK).build(),
    );
    // A closed connection's copies go at once; its LRU entries stay (a
    // reopening client finds them) until its closed timeout.
    assert_eq!(tables_holding(&dp, std::slice::from_ref(&closed)), (2, 0));
    let timeouts = dp.maps().config().unwrap().timeouts;
    let s = 1_000_000_000u64;
    // Now: nothing expired.
    assert_eq!(
        dp.maps_mut().collect_expired_conntrack(monotonic_ns()).unwrap(),
        (2, 0)
    );
    // Past the closed timeout: nothing of the open flow goes.
    let later = monotonic_ns() + (timeouts.tcp_closed as u64 + 2) * s;
    assert_eq!(dp.maps_mut().collect_expired_conntrack(later).unwrap(), (2, 0));
    assert_eq!(tables_holding(&dp, std::slice::from_ref(&open)), (2, 2));
    exchange(&dp, &open, "after the collection");

    // Closed again, not collected: a SYN on its tuple reopens it.
    let again = connect(&dp, client(3, 40_000));
    through(
        &dp,
        &Frame::tcp(again.client, frontend, TCP_FIN | TCP_ACK).build(),
    );
    through(
        &dp,
        &Frame::tcp(again.backend, again.seen_as, TCP_FIN | TCP_ACK).build(),
    );
    let reopened = connect(&dp, again.client);
    exchange(&dp, &reopened, "reopened");
    // The reopened flow's FWD_IN and its copy replaced the closed one's;
    // the closed flow's REP_IN stays (without a copy) when the new flow
    // went to the other backend, until its closed timeout.
    let (lru, copies) = tables_holding(&dp, std::slice::from_ref(&reopened));
    let stale = usize::from(reopened.backend != again.backend);
    assert_eq!((lru, copies), (2 + stale, 2));
    let later = monotonic_ns() + (timeouts.tcp_closed as u64 + 2) * s;
    dp.maps_mut().collect_expired_conntrack(later).unwrap();
    assert_eq!(tables_holding(&dp, std::slice::from_ref(&reopened)).1, 2);
    exchange(&dp, &reopened, "reopened, after the collection");
    // Past the established timeout everything goes.
    let much_later = monotonic_ns() + (timeouts.tcp_established as u64 + 2) * s;
    let (left, _) = dp.maps_mut().collect_expired_conntrack(much_later).unwrap();
    assert_eq!(left, 0);
}

/// UDP flows are assured once answered and still flowing after a second
/// (netfilter: a stream); an unanswered one is not.
#[test]
fn udp_flows_are_assured_once_answered_and_still_flowing() {
    let dp = flood_datapath();
    let frontend = sa(NODE, 30053);
    let answered = client(1, 5_000);
    let unanswered = client(2, 5_000);
    let to_pod = |c: SocketAddr| {
        let (v, out) = run_as(&dp, XDP, &Frame::udp(c, frontend).build());
        assert_eq!(v, XDP.pass);
        assert_eq!(parse_and_verify(&out).dst_addr(), sa(LOCAL_POD, 5353));
    };
    to_pod(answered);
    to_pod(unanswered);
    // The reply, from the local pod (egress restores the frontend).
    let out = egress(&dp, &Frame::udp(sa(LOCAL_POD, 5353), answered).build());
    assert_eq!(parse_and_verify(&out).src_addr(), frontend);
    assert_eq!(flow_stat(&dp, FlowStat::CtAssured), 0, "not before a second");
    // Entries are refreshed at most once a second: the flow's first refresh
    // with a reply seen assures it.
    std::thread::sleep(std::time::Duration::from_millis(1_200));
    to_pod(answered);
    to_pod(unanswered);
    let assured: Vec<_> = dp.maps().v4().conntrack_table(CtTable::Assured).unwrap();
    assert_eq!(assured.len(), 2, "the answered flow's two entries: {assured:?}");
    let client_of =
        |c: SocketAddr| <u32 as dataplane_agent::dataplane::family::AbiAddr>::from_ip(c.ip()).unwrap();
    assert!(assured.iter().all(|(k, e)| k.saddr == client_of(answered)
        || e.nat_daddr == client_of(answered)
        || k.daddr == client_of(answered)));
    // Both flows still translate.
    to_pod(answered);
    let out = egress(&dp, &Frame::udp(sa(LOCAL_POD, 5353), answered).build());
    assert_eq!(parse_and_verify(&out).src_addr(), frontend);
}

/// The masqueraded connection of `c` closed with a FIN each way, through
/// ingress and egress: the backend's first (it then holds the tuple in
/// TIME_WAIT) or the client's.
fn close(dp: &Datapath, c: &Conn, backend_first: bool) {
    let frontend = sa(NODE, 30080);
    let client_fin = || {
        let (v, _) = through(dp, &Frame::tcp(c.client, frontend, TCP_FIN | TCP_ACK).build());
        assert_eq!(v, XDP.pass, "{}: FIN", c.client);
    };
    if !backend_first {
        client_fin();
    }
    let (_, out) = through(dp, &Frame::tcp(c.backend, c.seen_as, TCP_FIN | TCP_ACK).build());
    let o = parse_and_verify(&out);
    assert_eq!((o.src_addr(), o.dst_addr()), (frontend, c.client), "FIN back");
    if backend_first {
        client_fin();
    }
}

/// A masqueraded connection its backend closed first holds its SNAT port
/// for TIME_WAIT (the backend would answer another client's SYN on that
/// tuple with an ACK of the old connection): another client whose hashed
/// port it is gets another port, also once conntrack forgot the closed
/// flow (as a busy node's LRU does within seconds); the same client port
/// reopening its tuple gets it back; when every other port is held by a
/// live flow, the held port is taken after all instead of dropping the
/// flow. A connection the client closed first holds nothing.
#[test]
fn a_port_whose_backend_closed_first_is_held_for_time_wait() {
    let svc = TestService::new(1, "web", Protocol::Tcp, 80)
        .node_port(30080)
        .endpoint(TestEndpoint::ready(POD, 8080, 1));
    // Four ports: the range is easily filled.
    let mut dp = fixture_datapath_configured(&[NODE.into()], &[svc], |c| c.snat_ports = (20_000, 20_003));
    let cfg = dp.maps().config().unwrap();
    let hashed = |c: SocketAddr| {
        let ip = <u32 as dataplane_agent::dataplane::family::AbiAddr>::from_ip(c.ip()).unwrap();
        dataplane_common::ct::snat_port_hash(
            ip,
            c.port().to_be(),
            cfg.snat_hash_seed,
            cfg.snat_port_min,
            cfg.snat_port_max,
        )
    };
    // A client port among 1000 of host `i` whose SNAT port hashes to `port`.
    let hashing_to = |i: u32, port: u16| {
        (40_000..41_000)
            .map(|p| client(i, p))
            .find(|c| hashed(*c) == port)
            .expect("a client port hashing alike among 1000")
    };
    let stat = |dp: &Datapath, s| flow_stat(dp, s);
    let drops = |dp: &Datapath| {
        dp.maps()
            .hook_counter(Hook::XdpIngress, Event::DropSnatExhausted)
            .unwrap()
            .packets
    };
    // Conntrack forgets every flow (the LRU would evict them).
    let forget = |dp: &mut Datapath| dp.maps_mut().v4_mut().purge_conntrack(|_, _| true).unwrap();

    // Closed by the client first: the port is free for another client.
    let a = connect(&dp, client(1, 40_000));
    let port = hashed(a.client);
    assert_eq!(a.seen_as.port(), port, "a free hashed port");
    close(&dp, &a, false);
    forget(&mut dp);
    let b = connect(&dp, hashing_to(2, port));
    assert_eq!(b.seen_as.port(), port, "the client closed first: not held");
    assert_eq!(stat(&dp, FlowStat::SnatTimeWaitHeld), 0);

    // Closed by the backend first: held from another client.
    close(&dp, &b, true);
    forget(&mut dp);
    let c = connect(&dp, hashing_to(3, port));
    assert_ne!(
        c.seen_as.port(),
        port,
        "held for TIME_WAIT after conntrack forgot it"
    );
    assert_eq!(stat(&dp, FlowStat::SnatTimeWaitHeld), 1);

    // The same client port reopens its own tuple (TIME_WAIT accepts it).
    let b = connect(&dp, b.client);
    assert_eq!(b.seen_as.port(), port, "the closed flow's own client");
    close(&dp, &b, true);

    // The two other ports taken by live flows (held while conntrack has
    // the closed flow too); then a new client finds only the held port and
    // takes it.
    let live: Vec<Conn> = (4..6).map(|i| connect(&dp, client(i, 40_000))).collect();
    for l in &live {
        assert_ne!(l.seen_as.port(), port, "{}: a free port first", l.client);
    }
    let reused = stat(&dp, FlowStat::SnatTimeWaitReuse);
    let d = connect(&dp, client(6, 40_000));
    assert_eq!(d.seen_as.port(), port, "the held port after all");
    assert_eq!(stat(&dp, FlowStat::SnatTimeWaitReuse), reused + 1);
    assert_eq!(drops(&dp), 0, "not a drop");
    // Live flows only: exhausted, as before.
    let (v, _) = run_as(
        &dp,
        XDP,
        &Frame::tcp(client(7, 40_000), sa(NODE, 30080), TCP_SYN).build(),
    );
    assert_eq!(v, XDP.drop, "every port held by a live flow");
    assert_eq!(drops(&dp), 1);
}
