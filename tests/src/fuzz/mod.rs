//! Packet fuzzer: random and mutated frames through every packet program
//! with BPF_PROG_TEST_RUN, each output checked against a model of what the
//! program may do with it. One Service balances with Maglev, one by DSR to
//! a local backend, and encapsulated packets (DSR's) come among the frames:
//! one taken apart must be judged as its inner packet, translated. The datapath is a dual-stack node's: every
//! Service twice, an IPv4 and an IPv6 Service port, and frames of both
//! families (IPv6 ones with extension headers now and then). The model knows
//! the programmed Services and the flows the run has opened, not the
//! programs' code:
//!
//! - a frame may pass untouched, except at ingress a clean packet (it
//!   parses as the datapath parses, every checksum valid) to a frontend
//!   whose Service translates every flow from anybody (backends, no source
//!   ranges, an eTP=Local one with a local backend), from neither the node
//!   nor a backend: nothing but a DNAT may come of it (no drop, no
//!   reject);
//! - a changed frame must be one the datapath parses (no fragment, no IPsec,
//!   an IPv6 extension header chain it follows), parse, keep its length and
//!   its L2 header, and differ only in the fields its hook rewrites
//!   (ingress: the destination address and port, un-SNAT included; egress:
//!   the source; ICMP errors: the outer destination and the quoted packet's
//!   addresses, ports and L4 checksum), and only within the IP packet:
//!   never the TTL or hop limit, flow label, lengths, next headers or
//!   extension headers. Every checksum stays exactly as valid as it was
//!   (incremental updates carry an input's error over; a valid checksum
//!   stays valid; a zero UDP checksum stays zero: "none" in IPv4, invalid
//!   in IPv6);
//! - a translation must go where the model allows, by the flows the run
//!   opened (each frontend → backend translation it saw): a frontend's
//!   destination to one of its backends; the SNAT address (the node's, per
//!   family) of a backend's reply to the client of a flow to that backend;
//!   the source of a flow's forward packet to the SNAT address (port in
//!   range), of its reply to its frontend; an ICMP error's quote to a
//!   packet of a flow as its sender sent it (client → frontend, backend →
//!   client, backend → SNAT address), the outer destination (if changed) to
//!   that sender;
//! - a reject must be a well-formed ICMP (IPv4: type 3 code 3) or ICMPv6
//!   (type 1 code 4) port-unreachable for the frame, sent back from the
//!   address tried, quoting its IP header and 8 bytes, and only for a
//!   Service address; a drop only for a Service address or one in a
//!   service CIDR (10.96.0.0/16, fd00:10:96::/112).
//!
//! One concern per module: `cluster` (the node's addresses and Services),
//! `model` (what the run has programmed and opened), `generator` and
//! `mutate` (the frames), `view` (the fuzzer's lenient reading of a frame),
//! `programs` (what runs them), `oracle` (the verdicts), `rng`.

mod cluster;
mod generator;
mod model;
mod mutate;
mod oracle;
mod programs;
mod rng;
mod view;

use dataplane_common::stats::Event;

use self::{
    cluster::services,
    generator::frame,
    oracle::check,
    programs::{PROGRAMS, run_one, verdicts},
    view::view,
};
pub use self::{
    cluster::{NODE, NODE6},
    model::Model,
    rng::Rng,
};
use crate::testrun::fixture_datapath_dual;

/// What a run found. Counts are of program runs (`packets`: of frames); the
/// `…6` ones count those of IPv6 packets among them.
#[derive(Debug, Default)]
pub struct Report {
    pub packets: u64,
    pub packets6: u64,
    pub runs: u64,
    pub untouched: u64,
    pub translated: u64,
    pub dropped: u64,
    pub rejected: u64,
    pub untouched6: u64,
    pub translated6: u64,
    pub dropped6: u64,
    pub rejected6: u64,
    /// Ingress runs of clean packets to a frontend that translates every
    /// flow (which must be translated), and the IPv6 ones.
    pub must_translate: u64,
    pub must_translate6: u64,
    /// Translated ICMP errors (included in `translated`), and the ICMPv6
    /// ones.
    pub icmp_translated: u64,
    pub icmp_translated6: u64,
    /// Frames the kernel would not run (too short to make an skb of).
    pub refused: u64,
    /// Drops of new flows whose client port and backend a live flow through
    /// another frontend holds (`drop_tuple_clash`, counted by the datapath):
    /// the fuzzer draws client ports from a small set, so it makes them.
    pub clashes: u64,
    /// Encapsulated packets taken apart (DSR's backend-node half).
    pub decapsulated: u64,
    /// Model violations: how many, and the first 20 (program, why, input
    /// frame as hex).
    pub violation_count: u64,
    pub violations: Vec<(String, String, String)>,
}

/// Runs `packets` frames (seeded by `seed`) through every packet program.
pub fn run(packets: u64, seed: u64) -> Report {
    let svcs = services();
    let dp = fixture_datapath_dual(NODE, NODE6, &svcs);
    let mut model = Model::new(&svcs);
    let mut rng = Rng::new(seed);
    let mut report = Report::default();
    let mut clashes_seen = 0;
    for _ in 0..packets {
        let input = frame(&mut rng, &model);
        let iv = view(&input);
        report.packets += 1;
        if iv.as_ref().is_some_and(|v| v.v6) {
            report.packets6 += 1;
        }
        for p in PROGRAMS {
            let Ok((verdict, out)) = run_one(&dp, p, &input) else {
                // The kernel builds no skb of a frame too short for the
                // headers it claims (no device would deliver one either).
                report.refused += 1;
                continue;
            };
            report.runs += 1;
            // Whether this run was a clash drop: the datapath's counter moved.
            let clash = verdict == verdicts(p).1 && {
                let n = dp.maps().counter(Event::DropTupleClash).map_or(0, |c| c.packets);
                let moved = n > clashes_seen;
                clashes_seen = n;
                moved
            };
            if let Err(why) = check(
                &mut model,
                p,
                &input,
                iv.as_ref(),
                (verdict, clash),
                &out,
                &mut report,
            ) {
                report.violation_count += 1;
                if report.violations.len() < 20 {
                    report.violations.push((p.name.to_owned(), why, hex(&input)));
                }
            }
        }
    }
    report
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
