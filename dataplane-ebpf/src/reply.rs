//! TC programs: the conntrack half of translation that XDP cannot do.
//!
//! `tc_egress` (external devices and pod-facing host interfaces, egress)
//! rewrites sources of packets leaving the node's stack: SNAT of forward
//! packets, restoring the frontend address on replies. `tc_pod_ingress`
//! (pod-facing host interfaces, ingress) rewrites destinations of packets
//! from pods before the host routes them: replies to a SNATed flow go back
//! to the client. See `ct::create` for the four entries of a flow.

use aya_ebpf::{bindings::TC_ACT_OK, programs::TcContext};
use dataplane_common::{config::config_flags, ct::ct_flags, proto, stats::Event};

use crate::{
    ct,
    maps::CONFIG,
    nat::{self, Side},
    packet::{ETH_HLEN, Parsed, parse},
    stats,
};

/// Enough linear data for L2 (two tags), IP with options and a TCP header.
const PULL_LEN: u32 = (ETH_HLEN + 8 + 60 + 20) as u32;

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
    if pkt.tuple.proto != proto::TCP && pkt.tuple.proto != proto::UDP {
        return (TC_ACT_OK, Event::Pass);
    }
    let now = ct::now();
    let Some(e) = ct::lookup(cfg, &pkt.tuple, now) else {
        return (TC_ACT_OK, Event::Pass);
    };
    // SAFETY: map value pointer, valid for this run.
    let entry = unsafe { &*e };
    let reply = entry.flags & ct_flags::REPLY != 0;
    if !reply && !ct::backend_valid(entry) {
        return (TC_ACT_OK, Event::Pass);
    }
    let (addr, port) = nat::target(entry, side);
    match nat::rewrite_tc(ctx, &pkt, side, addr, port) {
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
    }
}
