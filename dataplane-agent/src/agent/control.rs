//! The control loop, event-driven: it sleeps until a source reports a
//! change (a watch event, a manifest file written), a link comes or goes, a
//! signal arrives, or a timer is due; nothing polls.
//!
//! - **Coalescing** (kube-proxy's minSyncPeriod): a change after a quiet
//!   spell is synced at once; changes arriving within `min_sync_period` of
//!   the last sync's start wait for it to pass and go together. That bounds
//!   both the delay (at most `min_sync_period`) and the sync rate under
//!   churn.
//! - **Incremental syncs** recompute only the Services that changed.
//! - **A periodic sync** every `sync_period` even without changes (it
//!   retries what failed and refreshes `/healthz`, as kube-proxy's).
//! - **Reconcile**: every Service recomputed and the maps re-read, so a lost
//!   event or a map changed behind the agent's back is repaired (and
//!   counted). Every `sync_period`, or less often when re-reading the maps
//!   takes long: it may use at most [`RECONCILE_BUDGET`] of a core.
//! - **Service CIDRs**: once the store has synced, a change of the
//!   ServiceCIDR objects rewrites the datapath's config at once (the union
//!   with `--service-cidr`; [`crate::k8s::service_cidrs`]); no Service is
//!   recomputed for it.
//! - **Housekeeping** every second: pod interfaces (also at once on a
//!   link, address or route notification), the node's addresses
//!   (NodePort addresses follow them). The datapath's counters are not read
//!   here: a scrape reads them ([`super::counters`]).

use std::{
    collections::BTreeSet,
    sync::{
        Mutex,
        mpsc::{Receiver, RecvTimeoutError},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use crate::os::interfaces;
use tracing::{info, warn};

use super::{
    metrics::Metrics,
    source::{Event, Feed},
    sync::{SyncKind, SyncReport, Syncer, node_context},
};
use crate::{
    dataplane::{Datapath, DatapathConfig},
    k8s::{
        service_cidrs::{self, MAX_SERVICE_CIDRS},
        store::Store,
    },
    net::NodePortAddresses,
    net::{IpCidr, IpFamily},
    state::inputs::NodeContext,
};
use dataplane_common::names;

/// The loop's clocks.
#[derive(Clone, Debug)]
pub struct Timing {
    /// At most one sync per this (start to start); the bound on how long a
    /// change waits.
    pub min_sync_period: Duration,
    /// Reconcile (full sync, maps re-read) this often.
    pub sync_period: Duration,
    pub housekeeping: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            min_sync_period: Duration::from_millis(100),
            sync_period: Duration::from_secs(30),
            housekeeping: Duration::from_secs(1),
        }
    }
}

/// What the loop asks of the rest of the agent.
pub trait Callbacks {
    /// After every sync (health state, health-check servers, events, the
    /// local endpoints pod interfaces must reach).
    fn synced(&mut self, report: &SyncReport, store: &Store, feed: &Feed, syncer: &Syncer, dp: &mut Datapath);
    /// Every housekeeping tick and on link changes (pod interfaces).
    fn interfaces(&mut self, dp: &mut Datapath);
}

/// The share of a core the periodic reconcile may take: its period is at
/// least `sync_period`, and longer when re-reading the maps takes long (about
/// three minutes at 100k Services × 10 endpoints).
const RECONCILE_BUDGET: f64 = 0.005;

/// When the loop has something to do.
struct Schedule {
    /// When the last sync started.
    last_sync: Option<Instant>,
    /// A sync even without changes (`/healthz` counts on one per period).
    next_periodic: Instant,
    next_reconcile: Instant,
    next_housekeeping: Instant,
    /// A sync that left the maps unsettled: when to try again, and the
    /// backoff.
    retry: Option<(Instant, Duration)>,
    node_changed: bool,
}

impl Schedule {
    /// Whether anything asks for a sync.
    fn wanted(&self, store: &Store, now: Instant) -> bool {
        store.has_changes()
            || self.node_changed
            || self.last_sync.is_none()
            || now >= self.next_periodic
            || self.retry.is_some_and(|(at, _)| now >= at)
    }

    /// Whether a sync is wanted and coalescing lets it run now.
    fn sync_due(&self, store: &Store, t: &Timing, now: Instant) -> bool {
        self.wanted(store, now) && self.last_sync.is_none_or(|t0| now >= t0 + t.min_sync_period)
    }

    /// The next moment something may be due.
    fn deadline(&self, store: &Store, t: &Timing, now: Instant) -> Instant {
        let mut d = self.next_housekeeping;
        if store.synced() {
            d = d.min(self.next_reconcile).min(self.next_periodic);
            if self.wanted(store, now) {
                d = d.min(self.last_sync.map_or(now, |t0| t0 + t.min_sync_period));
            }
            if let Some((at, _)) = self.retry {
                d = d.min(at);
            }
        }
        d
    }
}

/// Gives freed heap back to the system after a large sync (glibc keeps it
/// otherwise, and the agent's resident size would show its peak forever).
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Why the loop ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(
        "the pin directory {0} was removed under the running agent (`cleanup --force`?); exiting so that a \
         restart pins and attaches the datapath again"
    )]
    PinsRemoved(String),
}

pub struct ControlLoop {
    pub node_name: String,
    pub node_ips: Vec<std::net::IpAddr>,
    pub node_port_addresses: NodePortAddresses,
    /// `--lb-mode`, `--lb-algorithm`.
    pub lb_defaults: crate::state::inputs::LbDefaults,
    pub bpffs_dir: String,
    pub timing: Timing,
    pub events: Receiver<Event>,
    pub feed: Feed,
    pub syncer: Syncer,
    pub dp: Datapath,
    pub metrics: std::sync::Arc<Mutex<Metrics>>,
    /// The datapath's config as written at start (from the flags); the
    /// service CIDRs of ServiceCIDR objects are added to it.
    pub dp_config: DatapathConfig,
    /// `--cluster-cidr` and `--service-cidr`.
    pub cluster_cidrs: Vec<IpCidr>,
    pub service_cidr_flags: Vec<IpCidr>,
}

/// The service CIDRs the datapath's config holds.
struct CidrsInForce {
    applied: Vec<IpCidr>,
    /// The CIDRs over the limit last warned about.
    warned: Vec<IpCidr>,
    /// A write failed: try again.
    pending: bool,
    /// The metrics show them.
    reported: bool,
}

impl ControlLoop {
    fn node(&self) -> NodeContext {
        NodeContext {
            lb: self.lb_defaults,
            ..node_context(
                &self.node_ips,
                &self.node_port_addresses,
                &interfaces::ip_addresses(),
            )
        }
    }

    /// Runs until SIGTERM/SIGINT (Ok) or until the agent cannot go on.
    pub fn run(mut self, callbacks: &mut dyn Callbacks) -> Result<(), ControlError> {
        let t = self.timing.clone();
        let mut store = Store::default();
        let mut node = self.node();
        let now = Instant::now();
        let mut clock = Schedule {
            last_sync: None,
            next_periodic: now + t.sync_period,
            next_reconcile: now + t.sync_period,
            next_housekeeping: now,
            retry: None,
            node_changed: false,
        };
        let mut seen_triggers = BTreeSet::new();
        let mut cidrs = CidrsInForce {
            // What the start wrote (the flags alone).
            applied: self.service_cidrs_for(&Default::default()).kept,
            warned: Vec::new(),
            pending: false,
            reported: false,
        };
        loop {
            let now = Instant::now();
            let deadline = clock.deadline(&store, &t, now);
            if deadline > now {
                match self.events.recv_timeout(deadline - now) {
                    Ok(ev) => {
                        if !self.handle(ev, &mut store, callbacks) {
                            break;
                        }
                        // Everything already queued goes into this round.
                        while let Ok(ev) = self.events.try_recv() {
                            if !self.handle(ev, &mut store, callbacks) {
                                return Ok(());
                            }
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            let now = Instant::now();
            if now >= clock.next_housekeeping {
                if !self.dp.pins_intact() {
                    return Err(ControlError::PinsRemoved(self.bpffs_dir.clone()));
                }
                callbacks.interfaces(&mut self.dp);
                // Removed backends leave the address filter once no flow
                // uses them (a conntrack walk, only when one is due).
                if let Err(e) = self.dp.maps_mut().expire_retired_backends() {
                    warn!(error = %e, "cannot check removed backends' flows");
                }
                let current = self.node();
                if current != node {
                    info!(node_port_addresses = ?current.node_port_addresses, "the node's addresses changed");
                    // The next sync sees another node context: a full one.
                    node = current;
                    clock.node_changed = true;
                }
                clock.next_housekeeping = now + t.housekeeping;
            }
            if !store.synced() {
                continue;
            }
            self.apply_service_cidrs(&mut store, &mut cidrs);
            let kind = if now >= clock.next_reconcile {
                self.feed.resync();
                SyncKind::Reconcile
            } else if clock.sync_due(&store, &t, now) {
                SyncKind::Incremental
            } else {
                continue;
            };
            clock.last_sync = Some(now);
            clock.node_changed = false;
            clock.next_periodic = now + t.sync_period;
            let report = match kind {
                SyncKind::Reconcile => self.syncer.reconcile(&mut store, &node, self.dp.maps_mut()),
                _ => self.syncer.sync(&mut store, &node, self.dp.maps_mut()),
            };
            if report.kind != Some(SyncKind::Incremental) {
                // A full sync costs about what a reconcile does (O(entries)):
                // the next reconcile keeps them within RECONCILE_BUDGET.
                let spacing = report.duration.mul_f64(1.0 / RECONCILE_BUDGET);
                clock.next_reconcile = now + spacing.max(t.sync_period);
            }
            clock.retry = if report.unsettled {
                let backoff = clock
                    .retry
                    .map_or(Duration::from_secs(1), |(_, b)| (b * 2).min(t.sync_period));
                Some((now + backoff, backoff))
            } else {
                None
            };
            log_sync(&report, &store);
            self.record_sync(&report, &mut seen_triggers);
            callbacks.synced(&report, &store, &self.feed, &self.syncer, &mut self.dp);
            if kind != SyncKind::Incremental || report.summary.ops > 10_000 {
                trim_heap();
            }
        }
        Ok(())
    }

    /// The families the node serves (those with a SNAT address).
    fn families(&self) -> Vec<IpFamily> {
        let mut f = Vec::new();
        if self.dp_config.snat_ip.is_some() {
            f.push(IpFamily::V4);
        }
        if self.dp_config.snat_ip6.is_some() {
            f.push(IpFamily::V6);
        }
        f
    }

    /// What the datapath enforces of the flags and `objects`.
    fn service_cidrs_for(&self, objects: &service_cidrs::ServiceCidrObjects) -> service_cidrs::Limited {
        let all = service_cidrs::union(&self.service_cidr_flags, objects.cidrs());
        service_cidrs::limit(&all, &self.families(), MAX_SERVICE_CIDRS)
    }

    /// Rewrites the datapath's config when the ServiceCIDR objects changed
    /// the service CIDRs in force; reports invalid objects and CIDRs over
    /// the datapath's limit.
    fn apply_service_cidrs(&mut self, store: &mut Store, state: &mut CidrsInForce) {
        let problems = store.service_cidrs_mut().take_problems();
        for (name, why) in &problems {
            warn!(service_cidr = %name, problem = %why, "ServiceCIDR skipped; the other service CIDRs are in force");
        }
        let changed = store.service_cidrs_mut().take_changed();
        if problems.is_empty() && !changed && !state.pending && state.reported {
            return;
        }
        let limited = self.service_cidrs_for(store.service_cidrs());
        if !limited.over_limit.is_empty() && limited.over_limit != state.warned {
            warn!(
                enforced = %list(&limited.kept),
                not_enforced = %list(&limited.over_limit),
                max_per_family = MAX_SERVICE_CIDRS,
                "more service CIDRs than the datapath holds: traffic to unallocated addresses of the rest is not dropped"
            );
        }
        state.warned = limited.over_limit.clone();
        if limited.kept != state.applied || state.pending {
            let mut c = self.dp_config.clone();
            c.set_cidrs(&self.cluster_cidrs, &limited.kept);
            match self.dp.maps_mut().set_config(&c) {
                Ok(()) => {
                    info!(service_cidrs = %list(&limited.kept), service_cidr_objects = store.service_cidrs().len(), "service CIDRs in force");
                    state.applied = limited.kept.clone();
                    state.pending = false;
                }
                Err(e) => {
                    warn!(error = %e, "cannot write the service CIDRs to the datapath's config; retrying");
                    state.pending = true;
                }
            }
        }
        state.reported = true;
        let mut m = self.metrics.lock().expect("metrics");
        m.invalid_service_cidrs += problems.len() as u64;
        m.service_cidrs_over_limit = limited.over_limit.len() as u64;
        for (family, label) in [(IpFamily::V4, "ipv4"), (IpFamily::V6, "ipv6")] {
            let n = state.applied.iter().filter(|c| c.family() == family).count();
            m.service_cidrs.insert(label, n as u64);
        }
    }

    /// Applies one event; false on Stop.
    fn handle(&mut self, event: Event, store: &mut Store, callbacks: &mut dyn Callbacks) -> bool {
        match event {
            Event::Stop => return false,
            Event::Links => callbacks.interfaces(&mut self.dp),
            ev => self.feed.handle(ev, store, &self.node_name),
        }
        true
    }

    fn record_sync(&self, report: &SyncReport, seen_triggers: &mut BTreeSet<String>) {
        let now = SystemTime::now();
        let mut m = self.metrics.lock().expect("metrics");
        m.sync_duration.observe(report.duration.as_secs_f64());
        m.last_sync_timestamp = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        m.sync_problems = report.problem_count as u64;
        m.failed_operations += report.failed_ops as u64;
        m.map_drift += report.drift as u64;
        m.service_changes += report.service_changes;
        m.endpoint_changes += report.endpoint_changes;
        m.no_local_endpoints
            .insert("external", report.no_local_endpoints as u64);
        let (_, max_backends, service_entries) = self.dp.maps().capacities();
        m.map_occupancy.insert(
            names::LB4_SERVICES,
            (report.service_entries as u64, service_entries as u64),
        );
        m.map_occupancy.insert(
            names::LB4_BACKENDS,
            (
                report.backends_in_use as u64,
                max_backends.saturating_sub(1) as u64,
            ),
        );
        // Network programming latency: from each new trigger time to now
        // (a relist repeats old ones: each is counted once).
        for t in &report.trigger_times {
            if seen_triggers.insert(t.clone())
                && let Some(at) = super::health::parse_rfc3339(t)
                && let Ok(d) = now.duration_since(at)
            {
                m.network_programming.observe(d.as_secs_f64());
            }
        }
        if seen_triggers.len() > 100_000 {
            seen_triggers.clear();
        }
    }
}

fn list(cidrs: &[IpCidr]) -> String {
    cidrs.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",")
}

fn log_sync(report: &SyncReport, store: &Store) {
    info!(
        kind = report.kind.map_or("", SyncKind::as_str),
        services = store.service_count(),
        endpoint_slices = store.slice_count(),
        recomputed = report.services_recomputed,
        service_ports = report.service_ports,
        frontends = report.frontends,
        backends = report.backends,
        ops = report.summary.ops,
        frontends_set = report.summary.frontends_set,
        frontends_removed = report.summary.frontends_removed,
        backends_set = report.summary.backends_set,
        backends_removed = report.summary.backends_removed,
        failed = report.failed_ops,
        drift = report.drift,
        problems = report.problem_count,
        duration_ms = report.duration.as_secs_f64() * 1000.0,
        recompute_ms = report.recompute_time.as_secs_f64() * 1000.0,
        plan_ms = report.plan_time.as_secs_f64() * 1000.0,
        write_ms = report.write_time.as_secs_f64() * 1000.0,
        "synced"
    );
    if report.drift > 0 {
        warn!(
            entries = report.drift,
            "the maps differed from what the agent wrote (changed behind its back, or a write failed); repaired"
        );
    }
    for p in &report.problems {
        warn!(problem = %p, "skipped; every other Service is programmed");
    }
}
