//! Metrics of the allocator and the L2 announcer, exported with the agent's
//! (`agent::metrics`): the controllers update an [`LbMetrics`] inside the
//! agent's shared metrics; scrapes encode it.

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
        )
    }
}
