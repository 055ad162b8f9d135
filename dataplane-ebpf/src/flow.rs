//! The new-flow decision, shared by every hook that sees a flow's first
//! packet (ingress on external devices in XDP or TC, TC on pod interfaces)
//! and, for its frontend and backend-set part, by connect-time translation:
//! which frontend, which backend set, source ranges, Local policies, reject
//! or drop, backend choice, SNAT, conntrack entries. Packet-independent:
//! hooks apply the result their own way.

use dataplane_common::{
    addr::Addr,
    config::{DpConfig, config_flags},
    ct::CtKey,
    lb::{LbBackend, LbService, LbServiceKey, backend_flags, scope, service_flags},
    maglev,
    stats::Event,
};

use crate::{family::Family, lb};

/// What a hook does with the first packet of a flow, by the event the
/// decision returns.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Rewrite the destination to `out.nat_daddr:nat_dport`.
    Forward,
    /// Answer with ICMP port-unreachable (a socket: ECONNREFUSED).
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

/// The frontend a new flow to `daddr:dport` uses and its backend set (the
/// cluster set of an eTP=Local external destination when `in_cluster`), or
/// what happens instead: a ClusterIP on a port it does not serve is
/// rejected, an unallocated address in a service CIDR dropped, a Local
/// policy without local endpoint dropped, a service without endpoints
/// rejected, a source outside loadBalancerSourceRanges dropped; anything else
/// is not ours.
#[inline(always)]
pub fn resolve<F: Family>(
    cfg: &DpConfig,
    daddr: F::A,
    dport: u16,
    proto: u8,
    saddr: F::A,
    in_cluster: bool,
) -> Result<(LbServiceKey<F::A>, LbService), Event> {
    let mut key = LbServiceKey {
        address: daddr,
        port: dport,
        slot: 0,
        proto,
        scope: scope::EXTERNAL,
        _pad: [0; 2],
    };
    let Some(mut svc) = lb::frontend::<F>(&key) else {
        if lb::is_service_address::<F>(daddr) {
            return Err(Event::RejectUnknownPort);
        }
        if F::in_service_cidr(cfg, &daddr) {
            return Err(Event::DropUnallocatedServiceIp);
        }
        return Err(Event::Pass);
    };
    if svc.flags & service_flags::TWO_SCOPES != 0 && in_cluster {
        // eTP=Local, source in the cluster: kube-proxy short-circuits to the
        // cluster set.
        key.scope = scope::INTERNAL;
        svc = lb::frontend::<F>(&key).ok_or(Event::DropNoBackend)?;
    }
    if svc.flags & service_flags::SOURCE_RANGES != 0 && !lb::source_allowed::<F>(svc.service_id, saddr) {
        return Err(Event::DropSourceRange);
    }
    if svc.count == 0 {
        return Err(if svc.flags & service_flags::REJECT_EMPTY != 0 {
            Event::RejectNoEndpoints
        } else {
            Event::DropNoLocalEndpoint
        });
    }
    Ok((key, svc))
}

/// What [`decide`] chose for a new flow.
#[derive(Clone, Copy, Default)]
pub struct Choice<A> {
    pub backend_id: u32,
    pub backend: LbBackend<A>,
    pub service_id: u32,
    /// Masquerade the flow (SNAT to the node).
    pub snat: bool,
    /// Filled by `snat::claim`: the SNAT port (network order), and whether
    /// it is not the flow's hashed port.
    pub snat_port: u16,
    pub explicit: bool,
    /// Direct server return: the backend runs on another node, which gets
    /// the packet encapsulated and untranslated (see `dsr`).
    pub dsr: bool,
}

/// Decides the flow `t`: for [`Event::NewFlow`], fills `out` with the
/// backend, the service, whether to masquerade and whether to send it by
/// DSR (only for packets that came in through an external device,
/// `external`); any other event is the verdict. A subprogram; the caller
/// creates the flow's entries with `ct::create` next to it (not below it:
/// BPF stack frames add up along a call chain).
#[inline(never)]
pub fn decide<F: Family>(
    cfg: &DpConfig,
    t: &CtKey<F::A>,
    now: u64,
    out: &mut Choice<F::A>,
    external: bool,
) -> Event {
    let from_cluster = F::in_cluster(cfg, &t.saddr);
    let (key, svc) = match resolve::<F>(cfg, t.daddr, t.dport, t.proto, t.saddr, from_cluster) {
        Ok(found) => found,
        Err(event) => return event,
    };
    // Maglev: the client's address and port (an affinity frontend: its
    // address alone, so that all its flows meet one backend).
    let hash = if svc.flags & service_flags::AFFINITY != 0 {
        maglev::flow_hash(t.saddr.fold(), 0, 0, cfg.maglev_seed)
    } else {
        maglev::flow_hash(t.saddr.fold(), t.sport, t.proto, cfg.maglev_seed)
    };
    let Some((backend_id, be)) = lb::select::<F>(cfg, &key, &svc, t.saddr, Some(hash), now) else {
        return Event::DropNoBackend;
    };
    // kube-proxy's masquerade rules: masqueradeAll applies to ClusterIPs
    // only; eTP=Cluster external destinations; a ClusterIP reached from
    // outside the cluster CIDR; hairpin (a pod reaching itself through its
    // Service). Never towards a host-network backend on this node: its
    // replies leave through tc_egress, which restores the frontend.
    let cluster_ip = svc.flags & service_flags::CLUSTER_IP != 0;
    let hairpin = be.address == t.saddr;
    // DSR (an external destination that kube-proxy would masquerade): a
    // remote backend gets the packet encapsulated, a local one
    // unmasqueraded; the client's address is kept either way.
    let dsr_frontend = external && svc.flags & service_flags::DSR != 0 && !hairpin;
    let snat = !dsr_frontend
        && ((cfg.flags & config_flags::MASQUERADE_ALL != 0 && cluster_ip)
            || svc.flags & service_flags::MASQUERADE != 0
            || (cluster_ip && F::cluster_cidr_set(cfg) && !from_cluster)
            || hairpin)
        && be.address != F::snat_ip(cfg);
    *out = Choice {
        backend_id,
        backend: be,
        service_id: svc.service_id,
        snat,
        snat_port: 0,
        explicit: false,
        dsr: dsr_frontend && be.flags & backend_flags::LOCAL == 0,
    };
    Event::NewFlow
}
