//! Metrics of the allocator and the announcers, exported with the agent's
//! (`agent::metrics`, which holds a [`SharedLbMetrics`] and encodes it on
//! every scrape): the controllers update the [`LbMetrics`] behind it.

use std::{
    collections::BTreeMap,
    sync::{Arc, atomic::Ordering},
};

use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{
        MetricType,
        histogram::{Histogram, exponential_buckets},
    },
};

use super::{pool::Usage, responder::Counters};
use crate::prom::{Fmt, const_counter, const_gauge, counter, family, gauge};

/// What the controllers update and scrapes encode.
pub type SharedLbMetrics = Arc<std::sync::Mutex<LbMetrics>>;

#[derive(Clone, Debug)]
pub struct LbMetrics {
    /// This agent is the active allocator.
    pub ipam_leader: bool,
    /// pool → usage (the leader's view).
    pub pools: BTreeMap<String, Usage>,
    /// condition reason (`Assigned`, `PoolExhausted`, ...) → Services.
    pub services: BTreeMap<&'static str, u64>,
    /// From the allocator seeing a Service without its address to the
    /// status write that gives it one.
    pub allocation_seconds: Histogram,
    pub status_writes: u64,
    pub status_conflicts: u64,
    pub status_write_failures: u64,
    /// Addresses this node answers ARP/NDP for.
    pub l2_addresses: u64,
    pub l2_takeovers: u64,
    pub l2_releases: u64,
    pub lease_errors: u64,
    pub responder: Option<Arc<Counters>>,
    /// The BGP speaker's state, when BGP is on.
    pub bgp: Option<super::bgp::SharedStatus>,
}

impl Default for LbMetrics {
    fn default() -> Self {
        Self {
            ipam_leader: false,
            pools: BTreeMap::new(),
            services: BTreeMap::new(),
            // 1 ms · 2^i, up to ~16 s.
            allocation_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            status_writes: 0,
            status_conflicts: 0,
            status_write_failures: 0,
            l2_addresses: 0,
            l2_takeovers: 0,
            l2_releases: 0,
            lease_errors: 0,
            responder: None,
            bgp: None,
        }
    }
}

fn saturate(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

impl LbMetrics {
    pub(crate) fn encode(&self, enc: &mut DescriptorEncoder) -> Fmt {
        gauge(
            enc,
            "dataplane_lb_ipam_leader",
            "1 when this agent is the active LoadBalancer address allocator",
            u64::from(self.ipam_leader),
        )?;
        family(
            enc,
            "dataplane_lb_pool_addresses",
            "Addresses of a LoadBalancerIPPool by state (total, used, available; saturates at 2^64-1)",
            MetricType::Gauge,
            self.pools.iter().flat_map(|(pool, u)| {
                [("total", u.total), ("used", u.used), ("available", u.available())]
                    .map(|(state, v)| (vec![("pool", pool.as_str()), ("state", state)], saturate(v)))
            }),
            const_gauge,
        )?;
        family(
            enc,
            "dataplane_lb_services",
            "LoadBalancer Services of our class by the reason of their address condition",
            MetricType::Gauge,
            self.services.iter().map(|(r, n)| (vec![("reason", *r)], *n)),
            const_gauge,
        )?;
        self.allocation_seconds.encode(enc.encode_descriptor(
            "dataplane_lb_allocation_duration_seconds",
            "From the allocator seeing a Service without an address to the status write that gives it one",
            None,
            MetricType::Histogram,
        )?)?;
        counter(
            enc,
            "dataplane_lb_status_writes",
            "Status writes to Services and pools",
            self.status_writes,
        )?;
        counter(
            enc,
            "dataplane_lb_status_conflicts",
            "Status writes refused with 409 Conflict (re-read and retried)",
            self.status_conflicts,
        )?;
        counter(
            enc,
            "dataplane_lb_status_write_failures",
            "Status writes that failed (retried at the next reconcile)",
            self.status_write_failures,
        )?;
        gauge(
            enc,
            "dataplane_l2_announced_addresses",
            "Addresses this node answers ARP and neighbour solicitations for",
            self.l2_addresses,
        )?;
        counter(
            enc,
            "dataplane_l2_takeovers",
            "Addresses this node started announcing (lease acquired)",
            self.l2_takeovers,
        )?;
        counter(
            enc,
            "dataplane_l2_releases",
            "Addresses this node stopped announcing (released, lost, or no longer eligible)",
            self.l2_releases,
        )?;
        counter(
            enc,
            "dataplane_lb_lease_errors",
            "Lease requests that failed (API server unreachable or erroring)",
            self.lease_errors,
        )?;
        let r = self.responder.as_deref();
        let load =
            |f: fn(&Counters) -> &std::sync::atomic::AtomicU64| r.map_or(0, |c| f(c).load(Ordering::Relaxed));
        family(
            enc,
            "dataplane_l2_replies",
            "ARP replies and neighbour advertisements sent for announced addresses",
            MetricType::Counter,
            [
                (vec![("protocol", "arp")], load(|c| &c.arp_replies)),
                (vec![("protocol", "ndp")], load(|c| &c.na_replies)),
            ],
            const_counter,
        )?;
        counter(
            enc,
            "dataplane_l2_gratuitous",
            "Gratuitous ARP and unsolicited neighbour advertisements sent (takeovers)",
            load(|c| &c.gratuitous),
        )?;
        counter(
            enc,
            "dataplane_l2_send_errors",
            "ARP/NDP frames that could not be sent",
            load(|c| &c.send_errors),
        )?;
        match &self.bgp {
            Some(s) => encode_bgp(enc, &s.lock().expect("bgp status")),
            None => Ok(()),
        }
    }
}

fn encode_bgp(enc: &mut DescriptorEncoder, s: &super::bgp::Status) -> Fmt {
    gauge(
        enc,
        "dataplane_bgp_speaker_up",
        "1 when the BGP speaker (BIRD) answered the last poll on its control socket",
        u64::from(s.speaker_up),
    )?;
    family(
        enc,
        "dataplane_bgp_session_up",
        "1 when the BGP session with the peer is established",
        MetricType::Gauge,
        s.sessions.iter().map(|x| {
            (
                vec![("peer", x.peer.as_str()), ("state", x.state.as_str())],
                u64::from(x.up()),
            )
        }),
        const_gauge,
    )?;
    family(
        enc,
        "dataplane_bgp_routes_exported",
        "Prefixes the speaker exports to the peer",
        MetricType::Gauge,
        s.sessions
            .iter()
            .map(|x| (vec![("peer", x.peer.as_str())], x.exported)),
        const_gauge,
    )?;
    gauge(
        enc,
        "dataplane_bgp_announced_prefixes",
        "Prefixes this node announces (to at least one peer)",
        s.announced,
    )?;
    gauge(
        enc,
        "dataplane_bgp_peers",
        "BGPPeers this node sessions with",
        s.peers,
    )?;
    counter(
        enc,
        "dataplane_bgp_reconfigurations",
        "Configurations the speaker accepted",
        s.reconfigurations,
    )?;
    counter(
        enc,
        "dataplane_bgp_reconfiguration_failures",
        "Configurations that could not be applied (speaker unreachable or refusing; retried)",
        s.reconfiguration_failures,
    )?;
    let mut invalid: BTreeMap<&str, u64> = BTreeMap::new();
    for k in s.invalid.keys() {
        *invalid.entry(k.split('/').next().unwrap_or("")).or_default() += 1;
    }
    family(
        enc,
        "dataplane_bgp_invalid_objects",
        "BGPPeer and BGPAdvertisement objects left out because they cannot be used",
        MetricType::Gauge,
        [
            crate::lb::crd::BGP_PEER_KIND,
            crate::lb::crd::BGP_ADVERTISEMENT_KIND,
        ]
        .map(|k| (vec![("kind", k)], invalid.get(k).copied().unwrap_or(0))),
        const_gauge,
    )
}
