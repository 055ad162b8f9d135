//! TC programs: reverse translation of replies from backends on this node.
//!
//! `tc_pod_ingress` (pod-facing host interfaces) sees a local backend's reply
//! before the host routes it, which matters when the flow was SNATed to the
//! node: the reply is addressed to the node and would otherwise be delivered
//! to it. `tc_egress` (external devices) catches replies of host-network
//! backends. A packet already reverse-translated no longer matches any
//! entry, so a reply seen by both is translated once.

use aya_ebpf::{bindings::TC_ACT_OK, programs::TcContext};
use dataplane_common::{
    config::config_flags,
    ct::ct_flags,
    proto,
    stats::Event,
};

use crate::{
    ct,
    maps::CONFIG,
    nat::{self, Nat},
    packet::{ETH_HLEN, Parsed, parse},
};

/// Enough linear data for L2 (two tags), IP with options and a TCP header.
const PULL_LEN: u32 = (ETH_HLEN + 8 + 60 + 20) as u32;

pub fn run(ctx: &TcContext) -> (i32, Event) {
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
    // SAFETY: map value pointer.
    let entry = unsafe { *e };
    if entry.flags & ct_flags::REPLY == 0 {
        return (TC_ACT_OK, Event::Pass);
    }
    match nat::rewrite_tc(ctx, &pkt, &Nat::of(&entry)) {
        Ok(()) => {
            ct::touch(e, now, pkt.tcp_flags);
            (TC_ACT_OK, Event::Reply)
        }
        Err(_) => (TC_ACT_OK, Event::Malformed),
    }
}
