//! TC programs.
//!
//! `tc_pod_ingress` (pod-facing host interfaces, ingress) sees packets from
//! pods before the host routes them: the first packet of a pod's flow to a
//! Service goes through the same decision as north-south (`flow::decide`),
//! later packets follow conntrack, and replies of SNATed flows go back to
//! their client. Destinations are rewritten here.
//!
//! `tc_egress` (external devices and pod-facing host interfaces, egress)
//! rewrites sources of packets leaving the node's stack: SNAT of forward
//! packets, the frontend address restored on replies. See `ct::create` for
//! the four entries of a flow.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use dataplane_common::{
    config::config_flags,
    ct::{Ct4Entry, ct_flags},
    proto,
    stats::Event,
};

use crate::{
    ct,
    flow::{self, Action},
    icmp,
    maps::{CONFIG, CT4},
    nat::{self, Side},
    packet::{ETH_HLEN, Parsed, parse},
    stats,
};

/// Enough linear data for L2 (two tags), IP with options and a TCP header.
const PULL_LEN: u32 = (ETH_HLEN + 8 + 60 + 20) as u32;

// Inlined into each entry point: a subprogram cannot return a pair (it
// would return a pointer to its own stack).
#[inline(always)]
pub fn run(ctx: &TcContext, side: Side) -> (i32, Event) {
    let Some(cfg) = CONFIG.get(0) else {
        return (TC_ACT_OK, Event::Pass);
    };
    if cfg.flags & config_flags::CONFIGURED == 0 {
        return (TC_ACT_OK, Event::Pass);
    }
    let len = ctx.len();
    let _ = ctx.pull_data(if len < PULL_LEN { len } else { PULL_LEN });
    let pkt = match parse(ctx) {
        Parsed::Ipv4(p) => p,
        Parsed::Other => return (TC_ACT_OK, Event::Pass),
        Parsed::Fragment => return (TC_ACT_OK, Event::Fragment),
        Parsed::Malformed => return (TC_ACT_OK, Event::Malformed),
    };
    match pkt.tuple.proto {
        proto::TCP | proto::UDP => {}
        proto::SCTP => return (TC_ACT_OK, Event::UnsupportedProto),
        _ => return (TC_ACT_OK, Event::Pass),
    }
    let now = ct::now();
    if let Some(e) = ct::lookup(cfg, &pkt.tuple, now) {
        // SAFETY: map value pointer, valid for this run.
        let entry = unsafe { &*e };
        let reply = entry.flags & ct_flags::REPLY != 0;
        if reply || ct::backend_valid(entry) {
            let (addr, port) = nat::target(entry, side);
            return match nat::rewrite_tc(ctx, &pkt, side, addr, port) {
                Ok(()) => {
                    ct::touch(e, now, pkt.tcp_flags);
                    if reply {
                        (TC_ACT_OK, Event::Reply)
                    } else {
                        stats::count_service(entry.service_id, pkt.tot_len as u64);
                        (TC_ACT_OK, Event::Established)
                    }
                }
                Err(_) => (TC_ACT_OK, Event::Malformed),
            };
        }
        if side == Side::Src {
            return (TC_ACT_OK, Event::Pass);
        }
        // Its backend is gone: the flow gets a new one.
        let _ = CT4.remove(&pkt.tuple);
    }
    if side == Side::Src {
        return (TC_ACT_OK, Event::Pass);
    }
    // A pod's new flow.
    let mut forward = Ct4Entry::default();
    let event = flow::decide(cfg, &pkt.tuple, now, &mut forward);
    match flow::action(event) {
        Action::Forward => {
            match nat::rewrite_tc(ctx, &pkt, Side::Dst, forward.nat_daddr, forward.nat_dport) {
                Ok(()) => {
                    stats::count_service(forward.service_id, pkt.tot_len as u64);
                    (TC_ACT_OK, event)
                }
                Err(_) => (TC_ACT_OK, Event::Malformed),
            }
        }
        Action::Reject => icmp::reject_tc(ctx, &pkt, event),
        Action::Drop => (TC_ACT_SHOT, event),
        Action::Pass => (TC_ACT_OK, event),
    }
}
