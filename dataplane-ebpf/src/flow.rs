//! The new-flow decision, shared by every hook that sees a flow's first
//! packet (XDP on external devices, TC on pod interfaces): which frontend,
//! which backend set, source ranges, Local policies, reject or drop, backend
//! choice, SNAT, conntrack entries. Packet-independent: hooks apply the
//! result their own way.

use dataplane_common::{
    config::{DpConfig, config_flags},
    ct::{Ct4Entry, Ct4Key},
    lb4::{Lb4ServiceKey, scope, service_flags},
    stats::Event,
};

use crate::{ct, lb};

/// What a hook does with the first packet of a flow, by the event the
/// decision returns.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Rewrite the destination to `out.nat_daddr:nat_dport`.
    Forward,
    /// Answer with ICMP port-unreachable.
    Reject,
    Drop,
    Pass,
}

#[inline(always)]
pub fn action(event: Event) -> Action {
    match event {
        Event::NewFlow => Action::Forward,
        Event::RejectNoEndpoints | Event::RejectUnknownPort => Action::Reject,
        e if e.is_drop() => Action::Drop,
        _ => Action::Pass,
    }
}

/// Decides the flow `t` and, for [`Event::NewFlow`], creates its conntrack
/// entries and fills `out` with the forward entry. A subprogram: its stack
/// is its own, apart from the hooks' fast paths.
#[inline(never)]
pub fn decide(cfg: &DpConfig, t: &Ct4Key, now: u64, out: &mut Ct4Entry) -> Event {
    let mut key = Lb4ServiceKey {
        address: t.daddr,
        port: t.dport,
        slot: 0,
        proto: t.proto,
        scope: scope::EXTERNAL,
        _pad: [0; 2],
    };
    let Some(mut svc) = lb::frontend(&key) else {
        return not_a_frontend(cfg, t.daddr);
    };
    let from_cluster = cfg.cluster_cidr.contains(t.saddr);
    if svc.flags & service_flags::TWO_SCOPES != 0 && from_cluster {
        // eTP=Local, source in the cluster: kube-proxy short-circuits to the
        // cluster set, without SNAT.
        key.scope = scope::INTERNAL;
        match lb::frontend(&key) {
            Some(s) => svc = s,
            None => return Event::DropNoBackend,
        }
    }
    if svc.flags & service_flags::SOURCE_RANGES != 0 && !lb::source_allowed(svc.service_id, t.saddr) {
        return Event::DropSourceRange;
    }
    if svc.count == 0 {
        return if svc.flags & service_flags::REJECT_EMPTY != 0 {
            Event::RejectNoEndpoints
        } else {
            Event::DropNoLocalEndpoint
        };
    }
    let Some((backend_id, be)) = lb::select(&key, &svc, t.saddr, now) else {
        return Event::DropNoBackend;
    };
    let snat = (cfg.flags & config_flags::MASQUERADE_ALL != 0
        || svc.flags & service_flags::MASQUERADE != 0
        || (svc.flags & service_flags::CLUSTER_IP != 0 && cfg.cluster_cidr.is_set() && !from_cluster)
        // Hairpin: a pod reaching itself through its Service.
        || be.address == t.saddr)
        // A host-network backend on this node: its replies leave through
        // tc_egress, which restores the service address.
        && be.address != cfg.snat_ip;
    match ct::create(cfg, t, &svc, backend_id, &be, snat, now) {
        Ok(f) => {
            *out = f;
            Event::NewFlow
        }
        Err(event) => event,
    }
}

/// No frontend for (address, port, proto): a ClusterIP on a port it does not
/// serve is rejected, an unallocated address in a service CIDR dropped,
/// anything else is not ours.
#[inline(always)]
fn not_a_frontend(cfg: &DpConfig, daddr: u32) -> Event {
    if lb::is_service_address(daddr) {
        return Event::RejectUnknownPort;
    }
    let mut i = 0;
    while i < cfg.service_cidrs.len() {
        if cfg.service_cidrs[i].contains(daddr) {
            return Event::DropUnallocatedServiceIp;
        }
        i += 1;
    }
    Event::Pass
}
