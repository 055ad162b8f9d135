//! The allocator: one active instance in the cluster (a Lease), which gives
//! LoadBalancer Services of our class addresses from the pools and writes
//! them into `status.loadBalancer.ingress` through the status subresource.
//!
//! Level-triggered: on every change (and at every lease renewal) it plans
//! the whole cluster ([`super::pool::plan`]) and writes only the statuses
//! that differ. Every write carries the resourceVersion it was based on; a
//! 409 makes it re-read the object and write again if what it planned from
//! has not changed (otherwise the next round plans with the new object).
//! Its memory of what it wrote keeps a write that the watch has not
//! delivered yet from being undone; after a restart or a change of leader,
//! the Services' statuses are the memory (addresses are re-learned, never
//! reassigned).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Instant,
};

use k8s_openapi::{
    api::core::v1::{ObjectReference, Service},
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
};
use kube::{
    Api, Client, Resource as _,
    api::PostParams,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tracing::{debug, info, warn};

use super::{
    cache::{Shared, Watched},
    crd::{LoadBalancerIPPool, PoolStatus},
    lease::{Elector, Intent},
    metrics::SharedLbMetrics,
    pool::{self, Outcome, Pool, Pools, Usage},
    request::{self, ClassFilter},
};

/// How many times a status write is retried after 409 Conflict within one
/// round (each after a fresh read).
const CONFLICT_RETRIES: usize = 5;

pub struct Allocator {
    client: Client,
    classes: ClassFilter,
    shared: Shared,
    metrics: SharedLbMetrics,
    recorder: Recorder,
    /// Service uid → the addresses last written.
    written: BTreeMap<String, Vec<IpAddr>>,
    /// Service key → when this leader first saw it without an address.
    waiting: BTreeMap<String, Instant>,
}

/// What a status write did.
enum Write<K> {
    Written(Box<K>),
    /// Already as wanted (found so after a re-read).
    Unchanged(Box<K>),
    /// The object changed in a way that changes the plan: plan again.
    Stale,
    Gone,
    Failed(String),
}

fn code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// Replaces `obj`'s status with `desired(obj)` (`None`: already right),
/// re-reading on 409 while `same_plan(fresh)` holds.
async fn update_status<K>(
    api: &Api<K>,
    mut obj: K,
    conflicts: &mut u64,
    same_plan: impl Fn(&K) -> bool,
    desired: impl Fn(&K) -> Option<K>,
) -> Write<K>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let uid = obj.meta().uid.clone();
    for _ in 0..=CONFLICT_RETRIES {
        let Some(new) = desired(&obj) else {
            return Write::Unchanged(Box::new(obj));
        };
        match api.replace_status(&name, &PostParams::default(), &new).await {
            Ok(o) => return Write::Written(Box::new(o)),
            Err(e) if code(&e) == Some(409) => {
                *conflicts += 1;
                match api.get_opt(&name).await {
                    Ok(Some(fresh)) if fresh.meta().uid == uid => {
                        if !same_plan(&fresh) {
                            return Write::Stale;
                        }
                        obj = fresh;
                    }
                    Ok(_) => return Write::Gone,
                    Err(e) => return Write::Failed(e.to_string()),
                }
            }
            Err(e) if code(&e) == Some(404) => return Write::Gone,
            Err(e) => return Write::Failed(e.to_string()),
        }
    }
    Write::Failed(format!("still conflicting after {CONFLICT_RETRIES} re-reads"))
}

/// The parts of a Service the plan depends on.
fn plan_inputs(svc: &Service) -> impl PartialEq + use<> {
    let ann = |k: &str| svc.metadata.annotations.as_ref().and_then(|a| a.get(k)).cloned();
    (
        svc.spec.clone(),
        svc.metadata.labels.clone(),
        ann(super::IPS_ANNOTATION),
        ann(super::SHARING_KEY_ANNOTATION),
    )
}

fn saturate(v: u128) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn condition(
    previous: &[Condition],
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: jiff::Timestamp,
) -> Condition {
    let status = if status { "True" } else { "False" };
    let since = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map_or(Time(now), |c| c.last_transition_time.clone());
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

/// A pool's status: counts, `Valid` (blocks, selector, no overlap) and
/// `Exhausted`.
pub fn pool_status(
    pool: &Pool,
    usage: Usage,
    previous: Option<&PoolStatus>,
    generation: Option<i64>,
) -> PoolStatus {
    let now = jiff::Timestamp::now();
    let prev = previous.map(|p| p.conditions.as_slice()).unwrap_or_default();
    let mut problems = pool.problems.clone();
    problems.extend(pool.conflict.clone());
    let valid = if problems.is_empty() {
        condition(prev, "Valid", true, "Valid", String::new(), generation, now)
    } else {
        let reason = if pool.conflict.is_some() && pool.problems.is_empty() {
            "Overlap"
        } else {
            "InvalidSpec"
        };
        condition(prev, "Valid", false, reason, problems.join("; "), generation, now)
    };
    let exhausted = if usage.available() == 0 {
        condition(
            prev,
            "Exhausted",
            true,
            "NoFreeAddress",
            format!("all {} usable addresses are in use", usage.total),
            generation,
            now,
        )
    } else {
        condition(
            prev,
            "Exhausted",
            false,
            "FreeAddresses",
            String::new(),
            generation,
            now,
        )
    };
    PoolStatus {
        ips_total: saturate(usage.total),
        ips_used: saturate(usage.used),
        ips_available: saturate(usage.available()),
        conditions: vec![valid, exhausted],
    }
}

/// Services the allocator must look at: ours, and ones that carry its
/// condition but stopped being LoadBalancers (their address is released).
fn relevant(w: &Watched, classes: &ClassFilter) -> (Vec<Service>, Vec<Service>) {
    let mut ours = Vec::new();
    let mut released = Vec::new();
    for s in w.services.objects.values() {
        if classes.owns(s) {
            ours.push(s.clone());
        } else if request::has_our_condition(s)
            && !classes.foreign(s)
            && s.spec.as_ref().and_then(|x| x.type_.as_deref()) != Some("LoadBalancer")
        {
            released.push(s.clone());
        }
    }
    (ours, released)
}

impl Allocator {
    pub fn new(
        client: Client,
        identity: &str,
        classes: ClassFilter,
        shared: Shared,
        metrics: SharedLbMetrics,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "dataplane-lb-ipam".into(),
                instance: Some(identity.to_owned()),
            },
        );
        Self {
            client,
            classes,
            shared,
            metrics,
            recorder,
            written: BTreeMap::new(),
            waiting: BTreeMap::new(),
        }
    }

    /// Runs until `stop` fires, then releases the Lease.
    pub async fn run(
        mut self,
        mut elector: Elector,
        mut changes: tokio::sync::watch::Receiver<u64>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut next_election = Instant::now();
        let mut was_leading = false;
        loop {
            if Instant::now() >= next_election {
                next_election = elector.step(Intent::Lead).await;
            }
            let leading = elector.leading(Instant::now());
            if leading != was_leading {
                if leading {
                    info!("this agent is now the LoadBalancer address allocator");
                } else {
                    info!(holder = ?elector.holder(), "this agent is no longer the LoadBalancer address allocator");
                    // A new term starts from the Services' statuses.
                    self.written.clear();
                    self.waiting.clear();
                }
                let mut m = self.metrics.lock().expect("lb metrics");
                m.ipam_leader = leading;
                if !leading {
                    // Only the leader's view is exported.
                    m.pools.clear();
                    m.services.clear();
                }
                drop(m);
                was_leading = leading;
            }
            if leading {
                self.reconcile().await;
            }
            tokio::select! {
                _ = stop.changed() => break,
                r = changes.changed() => if r.is_err() { break },
                _ = tokio::time::sleep_until(next_election.into()) => {}
            }
        }
        elector.step(Intent::Follow).await;
        self.metrics.lock().expect("lb metrics").ipam_leader = false;
    }

    /// Counts a status write and the conflicts it met.
    fn count<K>(&self, conflicts: u64, result: &Write<K>) {
        let mut m = self.metrics.lock().expect("lb metrics");
        m.status_conflicts += conflicts;
        match result {
            Write::Written(_) => m.status_writes += 1,
            Write::Failed(_) => m.status_write_failures += 1,
            _ => {}
        }
    }

    async fn publish(&self, reference: ObjectReference, type_: EventType, reason: &str, note: String) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "AllocateLoadBalancerIP".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            warn!(reason, error = %e, "cannot publish event");
        }
    }

    /// One round: plan everything, write what differs.
    pub async fn reconcile(&mut self) {
        let (ours, released, pool_objs) = {
            let w = self.shared.lock().expect("lb cache");
            if !w.services.synced || !w.pools.synced {
                return;
            }
            let (ours, released) = relevant(&w, &self.classes);
            (
                ours,
                released,
                w.pools.objects.values().cloned().collect::<Vec<_>>(),
            )
        };
        let pools = Pools::new(pool_objs.iter().map(Pool::parse).collect());
        let requests: Vec<pool::Request> = ours
            .iter()
            .map(|s| {
                let uid = s.metadata.uid.clone().unwrap_or_default();
                let current = self
                    .written
                    .get(&uid)
                    .cloned()
                    .unwrap_or_else(|| request::ingress_ips(s));
                request::request(s, current)
            })
            .collect();
        let plan = pool::plan(&pools, &requests);
        let now = Instant::now();
        let uids: BTreeSet<String> = ours.iter().filter_map(|s| s.metadata.uid.clone()).collect();
        self.written.retain(|uid, _| uids.contains(uid));
        let keys: BTreeSet<String> = ours.iter().map(request::key).collect();
        self.waiting.retain(|k, _| keys.contains(k));

        let mut by_reason: BTreeMap<&'static str, u64> = BTreeMap::new();
        for svc in &ours {
            let key = request::key(svc);
            let outcome = plan.services.get(&key).cloned().unwrap_or_default();
            let (_, reason, _) = request::condition_of(&outcome);
            *by_reason.entry(reason).or_default() += 1;
            if outcome.ips.is_empty() {
                self.waiting.entry(key.clone()).or_insert(now);
            }
            self.write_service(svc, Some(&outcome)).await;
        }
        for svc in &released {
            self.write_service(svc, None).await;
        }
        for obj in &pool_objs {
            let parsed = pools.iter().find(|p| p.name == obj.name());
            let usage = plan.pools.get(obj.name()).copied().unwrap_or_default();
            if let Some(parsed) = parsed {
                self.write_pool(obj, parsed, usage).await;
            }
        }
        let mut m = self.metrics.lock().expect("lb metrics");
        m.services = by_reason;
        m.pools = plan.pools.clone();
    }

    /// Writes `svc`'s status for `outcome` (`None`: release), with Events
    /// when its condition changes.
    async fn write_service(&mut self, svc: &Service, outcome: Option<&Outcome>) {
        let key = request::key(svc);
        let ns = svc.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let api: Api<Service> = Api::namespaced(self.client.clone(), &ns);
        let ips = outcome.map(|o| o.ips.clone()).unwrap_or_default();
        let cond = outcome.map(request::condition_of);
        let desired = |s: &Service| {
            let status = request::with_assignment(s, &ips, cond.clone(), jiff::Timestamp::now());
            if request::same_status(s.status.as_ref(), &status) {
                return None;
            }
            let mut s = s.clone();
            s.status = Some(status);
            Some(s)
        };
        if desired(svc).is_none() {
            return;
        }
        let previous =
            request::our_condition(svc).map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()));
        let planned = plan_inputs(svc);
        let mut conflicts = 0;
        let result = update_status(
            &api,
            svc.clone(),
            &mut conflicts,
            |f| plan_inputs(f) == planned,
            desired,
        )
        .await;
        self.count(conflicts, &result);
        let written = match result {
            Write::Written(s) => s,
            Write::Unchanged(s) => {
                self.shared.lock().expect("lb cache").services.wrote(*s);
                return;
            }
            Write::Stale => {
                debug!(service = %key, "changed while its status was written; planning again");
                return;
            }
            Write::Gone => return,
            Write::Failed(e) => {
                warn!(service = %key, error = %e, "cannot write the LoadBalancer status; retrying at the next round");
                return;
            }
        };
        if let Some(uid) = &svc.metadata.uid {
            if outcome.is_some() {
                self.written.insert(uid.clone(), ips.clone());
            } else {
                self.written.remove(uid);
            }
        }
        let reference = written.object_ref(&());
        self.shared.lock().expect("lb cache").services.wrote(*written);
        let ip_list: Vec<String> = ips.iter().map(|i| i.to_string()).collect();
        match (outcome, cond) {
            (Some(_), Some((state, reason, message)))
                if previous == Some((state.to_owned(), reason.to_owned(), message.clone())) => {}
            (Some(o), Some((state, reason, message))) => {
                if !o.ips.is_empty()
                    && let Some(since) = self.waiting.remove(&key)
                {
                    self.metrics
                        .lock()
                        .expect("lb metrics")
                        .allocation_seconds
                        .observe(since.elapsed().as_secs_f64());
                }
                if state == "True" {
                    info!(service = %key, addresses = %ip_list.join(","), "assigned LoadBalancer address");
                    self.publish(reference, EventType::Normal, "IPAllocated", message)
                        .await;
                } else {
                    warn!(service = %key, reason, problem = %message, "LoadBalancer address request not satisfied");
                    self.publish(reference, EventType::Warning, reason, message).await;
                }
            }
            _ => {
                info!(service = %key, "released LoadBalancer address (no longer a LoadBalancer)");
                self.publish(
                    reference,
                    EventType::Normal,
                    "IPReleased",
                    "the Service is no longer of type LoadBalancer".into(),
                )
                .await;
            }
        }
    }

    async fn write_pool(&mut self, obj: &LoadBalancerIPPool, parsed: &Pool, usage: Usage) {
        let api: Api<LoadBalancerIPPool> = Api::all(self.client.clone());
        let desired = |p: &LoadBalancerIPPool| {
            let status = pool_status(parsed, usage, p.status.as_ref(), p.metadata.generation);
            let same = p.status.as_ref().is_some_and(|old| {
                let strip = |s: &PoolStatus| {
                    let mut s = s.clone();
                    s.conditions
                        .iter_mut()
                        .for_each(|c| c.last_transition_time = Time(jiff::Timestamp::UNIX_EPOCH));
                    s
                };
                strip(old) == strip(&status)
            });
            if same {
                return None;
            }
            let mut p = p.clone();
            p.status = Some(status);
            Some(p)
        };
        if desired(obj).is_none() {
            return;
        }
        let was_exhausted = obj.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "Exhausted" && c.status == "True")
        });
        let spec = obj.spec.clone();
        let mut conflicts = 0;
        let result = update_status(&api, obj.clone(), &mut conflicts, |f| f.spec == spec, desired).await;
        self.count(conflicts, &result);
        match result {
            Write::Written(p) => {
                let exhausted = usage.available() == 0;
                let reference = p.object_ref(&());
                self.shared.lock().expect("lb cache").pools.wrote(*p);
                if exhausted && !was_exhausted {
                    warn!(pool = %obj.name(), total = %usage.total, "LoadBalancer address pool exhausted");
                    self.publish(
                        reference,
                        EventType::Warning,
                        "PoolExhausted",
                        format!("all {} usable addresses are in use", usage.total),
                    )
                    .await;
                }
            }
            Write::Failed(e) => {
                warn!(pool = %obj.name(), error = %e, "cannot write the pool status; retrying at the next round");
            }
            _ => {}
        }
    }
}
