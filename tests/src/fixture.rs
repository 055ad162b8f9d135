//! Fixture tables for the ingress path: an input frame, the expected verdict
//! and output, the counter it moves; run through both of the path's program
//! types (`xdp_ingress` and `tc_ingress`: one path, two contexts), each
//! frame's output checked by the harness's own packet code.

use std::net::SocketAddr;

use dataplane_agent::dataplane::Datapath;
use dataplane_common::{
    names,
    stats::{Event, FlowStat},
};

use crate::{
    packet::{Frame, ICMP, ICMPV6, TCP_ACK, TCP_FIN, TCP_SYN, parse_and_verify},
    testrun,
};

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;

/// A program type's verdicts.
#[derive(Clone, Copy, Debug)]
pub struct Verdicts {
    pub program: &'static str,
    pub pass: u32,
    pub drop: u32,
    /// Sent back out of the receiving device.
    pub back: u32,
}

pub const XDP: Verdicts = Verdicts {
    program: names::XDP_INGRESS,
    pass: XDP_PASS,
    drop: XDP_DROP,
    back: XDP_TX,
};
pub const TC: Verdicts = Verdicts {
    program: names::TC_INGRESS,
    pass: 0, // TC_ACT_OK
    drop: 2, // TC_ACT_SHOT
    back: 7, // TC_ACT_REDIRECT (to the receiving device's egress)
};

/// Runs one frame through `xdp_ingress`: (verdict, output frame).
pub fn run(dp: &Datapath, input: &[u8]) -> (u32, Vec<u8>) {
    let (v, out, _) = testrun::run(dp.xdp().unwrap(), input, 1);
    (v, out)
}

/// Runs one frame through the ingress path of program type `p`.
pub fn run_as(dp: &Datapath, p: Verdicts, input: &[u8]) -> (u32, Vec<u8>) {
    if p.program == XDP.program {
        return run(dp, input);
    }
    let (v, out, _) = testrun::run(dp.tc(p.program).unwrap(), input, 1);
    (v, out)
}

/// What [`reopen_connections`] saw: the backends chosen, and the source
/// the backends saw (the same for every connection).
pub struct Reopened {
    pub backends: std::collections::BTreeSet<SocketAddr>,
    pub source: SocketAddr,
}

/// Opens and closes `n` TCP connections from one client port to
/// `frontend` through `p`'s ingress program and `tc_egress`: the second and
/// later ones reopen the closed one's tuple. Asserts for each that the SYN
/// goes to one of `backends`, from one source every time (the hashed SNAT
/// port, or the client), that replies come back from the frontend, and that
/// the connection is open (a retransmitted SYN and an ACK keep its
/// backend); and that `n - 1` were counted as reopened and, when the source
/// is not the client, `n` as masqueraded with their hashed port.
pub fn reopen_connections(
    dp: &Datapath,
    p: Verdicts,
    client: SocketAddr,
    frontend: SocketAddr,
    backends: &[SocketAddr],
    n: u64,
) -> Reopened {
    let egress = |input: &[u8]| {
        let (v, out, _) = testrun::run(dp.tc(names::TC_EGRESS).unwrap(), input, 1);
        assert_eq!(v, 0, "TC_ACT_OK");
        parse_and_verify(&out)
    };
    let ingress = |frame: Frame| {
        let (v, out) = run_as(dp, p, &frame.build());
        assert_eq!(v, p.pass, "{}", p.program);
        out
    };
    assert!(n > 0, "at least one connection");
    let before = (
        flow_stat(dp, FlowStat::Reopened),
        flow_stat(dp, FlowStat::SnatHashed),
    );
    let mut chosen = std::collections::BTreeSet::new();
    let mut source = None;
    for i in 0..n {
        let what = format!("{}, {frontend}, connection {i}", p.program);
        let out = ingress(Frame::tcp(client, frontend, TCP_SYN));
        let backend = parse_and_verify(&out).dst_addr();
        assert!(backends.contains(&backend), "{what}: SYN to {backend}");
        chosen.insert(backend);
        let seen = egress(&out).src_addr();
        assert_eq!(*source.get_or_insert(seen), seen, "{what}: one source");
        let reply = |flags: u8| {
            let o = egress(&ingress(Frame::tcp(backend, seen, flags)));
            assert_eq!((o.src_addr(), o.dst_addr()), (frontend, client), "{what}: reply");
        };
        reply(TCP_SYN | TCP_ACK);
        for flags in [TCP_SYN, TCP_ACK] {
            let out = ingress(Frame::tcp(client, frontend, flags));
            assert_eq!(parse_and_verify(&out).dst_addr(), backend, "{what}: {flags:#x}");
            assert_eq!(egress(&out).src_addr(), seen, "{what}");
        }
        // Closed: a FIN each way.
        ingress(Frame::tcp(client, frontend, TCP_FIN | TCP_ACK));
        reply(TCP_FIN | TCP_ACK);
    }
    let source = source.expect("n > 0");
    let reopened = flow_stat(dp, FlowStat::Reopened) - before.0;
    assert_eq!(reopened, n - 1, "{}, {frontend}: reopened", p.program);
    // Masqueraded: the hashed port, claimed again by each connection.
    let hashed = if source == client { 0 } else { n };
    let claimed = flow_stat(dp, FlowStat::SnatHashed) - before.1;
    assert_eq!(claimed, hashed, "{}, {frontend}: hashed port", p.program);
    Reopened {
        backends: chosen,
        source,
    }
}

/// A flow statistic's count (`inspect stats`' `flows`).
pub fn flow_stat(dp: &Datapath, which: FlowStat) -> u64 {
    let stats = dp.maps().flow_stats().unwrap();
    stats.into_iter().find(|(s, _)| *s == which).unwrap().1
}

/// What a fixture expects.
pub enum Expect {
    /// Passed with the frame untouched.
    Untouched,
    /// Passed with exactly these bytes.
    Bytes(Vec<u8>),
    /// Passed with this destination, source kept, checksums valid.
    Dnat(SocketAddr),
    Drop,
    /// Sent back: an ICMP (ICMPv6) port-unreachable for the input.
    Reject,
}

pub struct Fixture {
    pub name: &'static str,
    pub input: Vec<u8>,
    pub expect: Expect,
    pub event: Event,
}

/// Collects fixtures: `f(name, frame, expect, event)`.
#[derive(Default)]
pub struct Table(pub Vec<Fixture>);

impl Table {
    pub fn add(&mut self, name: &'static str, input: Vec<u8>, expect: Expect, event: Event) {
        self.0.push(Fixture {
            name,
            input,
            expect,
            event,
        });
    }
}

/// Runs every fixture through XDP and TC, each program type on a fresh
/// datapath from `datapath` (no conntrack state carried over); returns one
/// line per failure.
pub fn run_table(datapath: impl Fn() -> Datapath, fixtures: impl Fn() -> Vec<Fixture>) -> Vec<String> {
    let mut failures = Vec::new();
    for p in [XDP, TC] {
        let dp = datapath();
        for fx in fixtures() {
            let before = dp.maps().counter(fx.event).unwrap().packets;
            let (verdict, out) = run_as(&dp, p, &fx.input);
            let result = std::panic::catch_unwind(|| check(&fx, p, verdict, &out));
            let after = dp.maps().counter(fx.event).unwrap().packets;
            if let Err(e) = result {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
                failures.push(format!("{}: {}: {}", p.program, fx.name, msg.unwrap_or_default()));
            } else if after != before + 1 {
                failures.push(format!(
                    "{}: {}: counter {} did not count the packet",
                    p.program,
                    fx.name,
                    fx.event.name()
                ));
            }
        }
    }
    failures
}

/// Checks one fixture's outcome (panics with what differs).
pub fn check(fx: &Fixture, p: Verdicts, verdict: u32, out: &[u8]) {
    match &fx.expect {
        Expect::Untouched => {
            assert_eq!(verdict, p.pass, "verdict");
            assert_eq!(out, &fx.input[..], "frame must be untouched");
        }
        Expect::Bytes(want) => {
            assert_eq!(verdict, p.pass, "verdict");
            parse_and_verify(out);
            assert_eq!(out, &want[..], "output bytes");
        }
        Expect::Dnat(to) => {
            assert_eq!(verdict, p.pass, "verdict");
            let (i, o) = (parse_and_verify(&fx.input), parse_and_verify(out));
            assert_eq!(o.dst_addr(), *to, "destination");
            assert_eq!(
                o.src_addr(),
                i.src_addr(),
                "the source is rewritten at egress, not here"
            );
        }
        Expect::Drop => assert_eq!(verdict, p.drop, "verdict"),
        Expect::Reject => {
            assert_eq!(verdict, p.back, "verdict");
            let i = parse_and_verify(&fx.input);
            let o = parse_and_verify(out);
            assert_eq!((o.src_mac, o.dst_mac), (i.dst_mac, i.src_mac), "MACs swapped");
            // The IP header and 8 bytes of the segment are quoted, after
            // the ICMP header (type, code, checksum, 4 unused bytes).
            let (proto, unreachable, ip_len) = if i.src.is_ipv4() {
                (ICMP, [3, 3], 20)
            } else {
                (ICMPV6, [1, 4], 40)
            };
            assert_eq!(
                (o.src, o.dst, o.proto),
                (i.dst, i.src, proto),
                "an ICMP error from the address tried to the client"
            );
            assert_eq!(
                &o.l4[..2],
                &unreachable,
                "destination unreachable / port unreachable"
            );
            assert_eq!(
                &o.l4[8..],
                &fx.input[i.l3..i.l3 + ip_len + 8],
                "quotes the IP header and 8 bytes of the segment"
            );
        }
    }
}
