//! `xdp_ingress`: north-south translation on the node's external devices.
//!
//! Per packet: one conntrack lookup. A hit translates the packet (original
//! direction, or a reply from a backend on another node); a miss goes to the
//! new-flow decision (`flow::decide`). Everything else passes untouched.

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    programs::XdpContext,
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
    packet::{Parsed, parse},
    stats,
};

#[inline(always)]
pub fn run(ctx: &XdpContext) -> (u32, Event) {
    let Some(cfg) = CONFIG.get(0) else {
        return (XDP_PASS, Event::Pass);
    };
    if cfg.flags & config_flags::CONFIGURED == 0 {
        return (XDP_PASS, Event::Pass);
    }
    let pkt = match parse(ctx) {
        Parsed::Ipv4(p) => p,
        Parsed::Other => return (XDP_PASS, Event::Pass),
        Parsed::Fragment => return (XDP_PASS, Event::Fragment),
        Parsed::Malformed => return (XDP_PASS, Event::Malformed),
    };
    let now = ct::now();
    match pkt.tuple.proto {
        proto::TCP | proto::UDP => {}
        proto::ICMP => return icmp::translate_error_xdp(ctx, cfg, &pkt, now),
        // SCTP port rewrite needs a CRC32c recompute: not translated.
        proto::SCTP => return (XDP_PASS, Event::UnsupportedProto),
        _ => return (XDP_PASS, Event::Pass),
    }
    if let Some(e) = ct::lookup(cfg, &pkt.tuple, now) {
        // SAFETY: map value pointer, valid for this run.
        let entry = unsafe { &*e };
        let reply = entry.flags & ct_flags::REPLY != 0;
        if reply || ct::backend_valid(entry) {
            let (daddr, dport) = nat::target(entry, Side::Dst);
            return match nat::rewrite_xdp_dst(ctx, &pkt, daddr, dport) {
                Some(()) => {
                    ct::touch(e, now, pkt.tcp_flags);
                    if reply {
                        (XDP_PASS, Event::Reply)
                    } else {
                        stats::count_service(entry.service_id, pkt.tot_len as u64);
                        (XDP_PASS, Event::Established)
                    }
                }
                None => (XDP_PASS, Event::Malformed),
            };
        }
        // Its backend is gone: the flow gets a new one.
        let _ = CT4.remove(&pkt.tuple);
    }
    // The reject is built here, not inside the decision: each subprogram's
    // stack adds to its caller's, and both together exceed the 512 bytes.
    let mut forward = Ct4Entry::default();
    let event = flow::decide(cfg, &pkt.tuple, now, &mut forward);
    match flow::action(event) {
        Action::Forward => match nat::rewrite_xdp_dst(ctx, &pkt, forward.nat_daddr, forward.nat_dport) {
            Some(()) => {
                stats::count_service(forward.service_id, pkt.tot_len as u64);
                (XDP_PASS, event)
            }
            None => (XDP_PASS, Event::Malformed),
        },
        Action::Reject => icmp::reject_xdp(ctx, &pkt, event),
        Action::Drop => (XDP_DROP, event),
        Action::Pass => (XDP_PASS, event),
    }
}
