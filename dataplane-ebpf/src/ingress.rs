//! `xdp_ingress`: north-south translation on the node's external devices.
//!
//! Per packet: one conntrack lookup. A hit translates the packet (original
//! direction, or a reply from a backend on another node); a miss on a
//! frontend starts a new flow (source ranges, Local policies, reject, backend
//! choice, SNAT decision, conntrack entries). Everything else passes
//! untouched.

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    programs::XdpContext,
};
use dataplane_common::{
    config::{DpConfig, config_flags},
    ct::{Ct4Key, ct_flags},
    lb4::{Lb4ServiceKey, scope, service_flags},
    proto,
    stats::Event,
};

use crate::{
    ct, icmp, lb,
    maps::{CONFIG, CT4},
    nat::{self, Side},
    packet::{Ipv4, Parsed, parse},
    stats,
};

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
    // The reject is built here, not inside new_flow: each subprogram's stack
    // adds to its caller's, and both together exceed the 512-byte limit.
    match new_flow(ctx, cfg, &pkt, now) {
        Step::Done(action, event) => (action, event),
        Step::Reject(event) => icmp::reject_xdp(ctx, &pkt, event),
    }
}

/// What the new-flow path decided.
enum Step {
    Done(u32, Event),
    /// Answer with ICMP port-unreachable.
    Reject(Event),
}

/// A subprogram: the new-flow path keeps its stack apart from the fast path.
#[inline(never)]
fn new_flow(ctx: &XdpContext, cfg: &DpConfig, pkt: &Ipv4, now: u64) -> Step {
    let t: &Ct4Key = &pkt.tuple;
    let mut key = Lb4ServiceKey {
        address: t.daddr,
        port: t.dport,
        slot: 0,
        proto: t.proto,
        scope: scope::EXTERNAL,
        _pad: [0; 2],
    };
    let Some(mut svc) = lb::frontend(&key) else {
        return not_a_frontend(cfg, pkt);
    };
    let from_cluster = cfg.cluster_cidr.contains(t.saddr);
    if svc.flags & service_flags::TWO_SCOPES != 0 && from_cluster {
        // eTP=Local, source in the cluster: kube-proxy short-circuits to the
        // cluster set, without SNAT.
        key.scope = scope::INTERNAL;
        match lb::frontend(&key) {
            Some(s) => svc = s,
            None => return Step::Done(XDP_DROP, Event::DropNoBackend),
        }
    }
    if svc.flags & service_flags::SOURCE_RANGES != 0 && !lb::source_allowed(svc.service_id, t.saddr) {
        return Step::Done(XDP_DROP, Event::DropSourceRange);
    }
    if svc.count == 0 {
        return if svc.flags & service_flags::REJECT_EMPTY != 0 {
            Step::Reject(Event::RejectNoEndpoints)
        } else {
            Step::Done(XDP_DROP, Event::DropNoLocalEndpoint)
        };
    }
    let Some((backend_id, be)) = lb::select(&key, &svc, t.saddr, now) else {
        return Step::Done(XDP_DROP, Event::DropNoBackend);
    };
    let snat = (cfg.flags & config_flags::MASQUERADE_ALL != 0
        || svc.flags & service_flags::MASQUERADE != 0
        || (svc.flags & service_flags::CLUSTER_IP != 0 && cfg.cluster_cidr.is_set() && !from_cluster)
        || be.address == t.saddr)
        // A host-network backend on this node: its replies leave through
        // tc_egress, which restores the service address.
        && be.address != cfg.snat_ip;
    let forward = match ct::create(cfg, t, &svc, backend_id, &be, snat, now) {
        Ok(f) => f,
        Err(event) => return Step::Done(XDP_DROP, event),
    };
    match nat::rewrite_xdp_dst(ctx, pkt, forward.nat_daddr, forward.nat_dport) {
        Some(()) => {
            stats::count_service(svc.service_id, pkt.tot_len as u64);
            Step::Done(XDP_PASS, Event::NewFlow)
        }
        None => Step::Done(XDP_PASS, Event::Malformed),
    }
}

/// No frontend for (address, port, proto): a ClusterIP on a port it does not
/// serve is rejected, an unallocated address in a service CIDR dropped,
/// anything else is not ours.
#[inline(always)]
fn not_a_frontend(cfg: &DpConfig, pkt: &Ipv4) -> Step {
    let daddr = pkt.tuple.daddr;
    if lb::is_service_address(daddr) {
        return Step::Reject(Event::RejectUnknownPort);
    }
    let mut i = 0;
    while i < cfg.service_cidrs.len() {
        if cfg.service_cidrs[i].contains(daddr) {
            return Step::Done(XDP_DROP, Event::DropUnallocatedServiceIp);
        }
        i += 1;
    }
    Step::Done(XDP_PASS, Event::Pass)
}
