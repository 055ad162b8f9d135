//! One sync: changed Services → their ports → the desired table → map
//! operations for what they touched.
//!
//! Incremental: a sync recomputes only the Services the store reports
//! changed ([`Store::checkout_changes`]) and writes only the differences
//! of the keys they touched. A full sync recomputes every Service (the node
//! or the options changed, or as a periodic safety net); a reconciling sync
//! also re-reads the maps, so anything changed behind the agent's back is
//! repaired and counted. Any failed write makes the syncer re-read the maps
//! at once and plan everything against what they really hold.

use foldhash::{HashMap, HashMapExt as _, HashSet};
use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use crate::{
    k8s::{
        model::NodeInfo,
        store::{HealthCheck, ObjectKey, Store, health_check_of},
    },
    state::{
        desired::{self, Rank, conflict_message},
        diff::{MapWriter, Op, PlanSummary, Programmer},
        ids::ServiceIds,
        incremental::{Dirty, ServiceTable},
        inputs::NodeContext,
        table::{Frontend, MapTable},
    },
};

/// How much a sync recomputes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncKind {
    /// The Services that changed.
    Incremental,
    /// Every Service.
    Full,
    /// Every Service, and the maps re-read and repaired.
    Reconcile,
}

impl SyncKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SyncKind::Incremental => "incremental",
            SyncKind::Full => "full",
            SyncKind::Reconcile => "reconcile",
        }
    }
}

/// What one sync did, for logs, metrics and health.
#[derive(Clone, Debug, Default)]
pub struct SyncReport {
    pub duration: Duration,
    /// Of which: recomputing Services, planning, writing the maps (with
    /// reading them back when reconciling).
    pub recompute_time: Duration,
    pub plan_time: Duration,
    pub write_time: Duration,
    pub kind: Option<SyncKind>,
    /// Services recomputed.
    pub services_recomputed: usize,
    pub service_ports: usize,
    pub frontends: usize,
    pub backends: usize,
    pub summary: PlanSummary,
    /// Problems that are new in this sync (skipped objects or parts,
    /// conflicts, failed writes), with why.
    pub problems: Vec<String>,
    /// (namespace/name of the Service, why): the new problems an event can
    /// be attached to.
    pub object_problems: Vec<(String, String)>,
    /// Every current problem (new or not).
    pub problem_count: usize,
    pub failed_ops: usize,
    /// Map entries that differed from what the agent had written (repaired).
    pub drift: usize,
    /// Whether the maps still differ from the desired table (a write
    /// failed even after re-reading them): the next sync retries.
    pub unsettled: bool,
    pub health_checks: Vec<HealthCheck>,
    /// Service ports whose Local policy has no local endpoint.
    pub no_local_endpoints: usize,
    /// Services and EndpointSlices that changed.
    pub service_changes: u64,
    pub endpoint_changes: u64,
    /// `last-change-trigger-time` of the slice changes programmed.
    pub trigger_times: Vec<String>,
    /// Entries the services map holds and backends in use (the agent's own
    /// accounting: the maps are not walked for it).
    pub service_entries: usize,
    pub backends_in_use: usize,
}

/// What the syncer remembers of one Service object.
#[derive(Clone, Debug, Default)]
struct ServiceRecord {
    /// Service ids of its ports.
    ports: PortIds,
    /// Parts that could not be used.
    problems: Box<[String]>,
    no_local: u32,
}

/// Service ids of a Service's ports: one, almost always, kept without an
/// allocation.
#[derive(Clone, Debug, Default)]
enum PortIds {
    #[default]
    None,
    One(u32),
    Many(Box<[u32]>),
}

impl PortIds {
    fn push(&mut self, id: u32) {
        *self = match std::mem::take(self) {
            PortIds::None => PortIds::One(id),
            PortIds::One(first) => PortIds::Many([first, id].into()),
            PortIds::Many(ids) => PortIds::Many(ids.iter().copied().chain([id]).collect()),
        };
    }

    fn as_slice(&self) -> &[u32] {
        match self {
            PortIds::None => &[],
            PortIds::One(id) => std::slice::from_ref(id),
            PortIds::Many(ids) => ids,
        }
    }
}

pub struct Syncer {
    node_name: String,
    ids: ServiceIds,
    table: ServiceTable,
    programmer: Programmer,
    services: HashMap<ObjectKey, ServiceRecord>,
    health: BTreeMap<ObjectKey, HealthCheck>,
    /// The node's view the table was computed with; another one recomputes
    /// everything.
    node: Option<NodeContext>,
    /// The mirror may not match the maps (a write failed and re-reading
    /// them failed too): re-read before the next plan.
    needs_reset: bool,
    /// Conflicts reported: (frontend, claimant that lost it) → holder.
    conflicts: HashMap<(Frontend, u32), u32>,
    no_local: usize,
    /// Problems of all Services (the sum over `services`).
    problems: usize,
}

impl Syncer {
    /// Starts from what the maps hold (empty on a first start): service and
    /// backend ids are kept, and the first sync writes only what differs.
    pub fn adopt(table: &MapTable, node_name: &str, max_services: u32, max_backends: u32) -> Self {
        let mut ids = ServiceIds::new(max_services);
        for (id, name) in &table.service_names {
            ids.adopt(name.clone(), *id);
        }
        let mut service_table = ServiceTable::new();
        service_table.set_incumbents(table.frontends.iter().map(|(fe, e)| (*fe, e.service_id)));
        Self {
            node_name: node_name.to_owned(),
            ids,
            table: service_table,
            programmer: Programmer::adopt(max_backends, table),
            services: HashMap::new(),
            health: BTreeMap::new(),
            node: None,
            needs_reset: false,
            conflicts: HashMap::new(),
            no_local: 0,
            problems: 0,
        }
    }

    /// The endpoints on this node (address → a Service port it backs), from
    /// the table: what pod-interface discovery checks routes to.
    pub fn local_endpoints(&self) -> BTreeMap<IpAddr, String> {
        self.table
            .local_endpoints()
            .filter_map(|(addr, id)| Some((addr, self.table.name(id)?.to_string())))
            .collect()
    }

    /// The programmer's view of the maps (tests, inspection).
    pub fn programmer(&self) -> &Programmer {
        &self.programmer
    }

    /// Whether the last sync left the maps differing from the table.
    pub fn unsettled(&self) -> bool {
        self.needs_reset || self.programmer.has_retries()
    }

    /// Brings the maps up to date with the store's changes (everything, the
    /// first time or when `node` changed).
    pub fn sync<W: MapWriter>(&mut self, store: &mut Store, node: &NodeContext, maps: &mut W) -> SyncReport {
        self.run(store, node, maps, SyncKind::Incremental)
    }

    /// Recomputes every Service and writes what differs.
    pub fn full_sync<W: MapWriter>(
        &mut self,
        store: &mut Store,
        node: &NodeContext,
        maps: &mut W,
    ) -> SyncReport {
        self.run(store, node, maps, SyncKind::Full)
    }

    /// As [`Syncer::full_sync`], and re-reads the maps first: entries
    /// changed, added or removed behind the agent's back are repaired and
    /// counted in [`SyncReport::drift`].
    pub fn reconcile<W: MapWriter>(
        &mut self,
        store: &mut Store,
        node: &NodeContext,
        maps: &mut W,
    ) -> SyncReport {
        self.run(store, node, maps, SyncKind::Reconcile)
    }

    fn run<W: MapWriter>(
        &mut self,
        store: &mut Store,
        node: &NodeContext,
        maps: &mut W,
        asked: SyncKind,
    ) -> SyncReport {
        let started = Instant::now();
        let changes = store.checkout_changes();
        let kind = match asked {
            SyncKind::Incremental if changes.all || self.node.as_ref() != Some(node) => SyncKind::Full,
            k => k,
        };
        let mut report = SyncReport {
            kind: Some(kind),
            service_changes: changes.service_changes,
            endpoint_changes: changes.slice_changes,
            trigger_times: changes.trigger_times,
            ..Default::default()
        };
        // In name order (ids are handed out in it).
        let keys: Vec<ObjectKey> = if kind == SyncKind::Incremental {
            changes.services.into_iter().collect()
        } else {
            let mut keys: Vec<ObjectKey> = store
                .service_keys()
                .chain(self.services.keys().filter(|k| store.service(k).is_none()))
                .cloned()
                .collect();
            keys.sort_unstable();
            keys
        };
        self.node = Some(node.clone());
        if kind == SyncKind::Full {
            // Every key is planned anyway: no need to record which ones
            // the recompute touches.
            self.table.track(false);
            self.table.reserve(keys.len(), store.endpoint_count());
        }
        let node_info = store.node_info(&self.node_name);
        for key in &keys {
            self.recompute(store, key, &node_info, node, &mut report);
        }
        self.table.track(true);
        report.services_recomputed = keys.len();
        report.recompute_time = started.elapsed();
        if kind != SyncKind::Incremental {
            // Ids adopted from the maps for ports that are gone.
            let live: HashSet<u32> = self
                .services
                .values()
                .flat_map(|r| r.ports.as_slice().iter().copied())
                .collect();
            self.ids.retain(|id| live.contains(&id));
        }
        self.report_conflicts(&mut report);
        self.table.settle_incumbents();

        let mut dirty = self.table.take_dirty();
        if kind == SyncKind::Reconcile || self.needs_reset {
            let read = Instant::now();
            let table = maps.read_table();
            report.write_time += read.elapsed();
            match table {
                Ok(kernel) => {
                    // What the maps hold is what the mirror says (the usual
                    // case): only the recompute's changes are written.
                    report.drift = self.programmer.drift(&kernel);
                    if report.drift > 0 || self.needs_reset {
                        self.programmer.reset(&kernel);
                        if let Err(e) = maps.adopt(&kernel) {
                            report
                                .problems
                                .push(format!("Maglev tables and DSR entries: {e}"));
                        }
                        dirty = Dirty::all();
                    }
                    self.needs_reset = false;
                }
                Err(e) => report.problems.push(format!("cannot read the maps back: {e}")),
            }
        } else if kind == SyncKind::Full {
            dirty = Dirty::all();
        }
        if !self.needs_reset {
            self.write(maps, &dirty, &mut report);
        }
        // What the writer deferred (the address filter), whatever happened.
        if let Err(e) = maps.flush() {
            report.failed_ops += 1;
            report.problems.push(format!("address filter: {e}"));
        }
        report.unsettled = self.needs_reset || self.programmer.has_retries();
        for u in self.programmer.unprogrammable() {
            let name = self
                .table
                .name(u.service_id)
                .map(|n| n.to_string())
                .unwrap_or_default();
            report.problems.push(format!(
                "{name}: {} is left as it was: no backend id is free (raise --max-backends)",
                u.frontend
            ));
        }
        report.service_ports = self.table.port_count();
        report.frontends = self.programmer.frontend_count();
        report.backends = self.table.backend_count();
        report.problem_count = self.problems + self.conflicts.len() + self.programmer.unprogrammable().len();
        report.health_checks = self.health.values().cloned().collect();
        report.no_local_endpoints = self.no_local;
        report.service_entries = self.programmer.service_entries();
        report.backends_in_use = self.programmer.backend_count();
        report.duration = started.elapsed();
        report
    }

    /// Plans `dirty` and applies it; on a failed write, re-reads the maps
    /// and plans everything against them (once; if that fails too, the next
    /// sync starts with it).
    fn write<W: MapWriter>(&mut self, maps: &mut W, dirty: &Dirty, report: &mut SyncReport) {
        let planning = Instant::now();
        let (ops, summary) = self.programmer.plan(&self.table, dirty);
        report.plan_time += planning.elapsed();
        report.summary.add(&summary);
        let writing = Instant::now();
        let result = self.programmer.execute(maps, &ops);
        report.write_time += writing.elapsed();
        let Err((at, e)) = result else {
            return;
        };
        report.failed_ops += 1;
        report
            .problems
            .push(format!("{}: {e}; re-reading the maps", self.describe(&ops[at])));
        let kernel = match maps.read_table() {
            Ok(k) => k,
            Err(e) => {
                report.problems.push(format!("cannot read the maps back: {e}"));
                self.needs_reset = true;
                return;
            }
        };
        report.drift += self.programmer.reset(&kernel);
        if let Err(e) = maps.adopt(&kernel) {
            report
                .problems
                .push(format!("Maglev tables and DSR entries: {e}"));
        }
        let (ops, summary) = self.programmer.plan(&self.table, &Dirty::all());
        report.summary.add(&summary);
        if let Err((at, e)) = self.programmer.execute(maps, &ops) {
            report.failed_ops += 1;
            report.problems.push(format!(
                "{}: {e}; retried at the next sync",
                self.describe(&ops[at])
            ));
            self.needs_reset = true;
        }
    }

    /// Recomputes one Service's ports and updates the table.
    fn recompute(
        &mut self,
        store: &Store,
        key: &ObjectKey,
        node_info: &NodeInfo,
        node: &NodeContext,
        report: &mut SyncReport,
    ) {
        let current = store.service_for_sync(key, node_info);
        let (svc, mut ports, skipped, age) = match current {
            Some(s) => (Some(s.info), s.ports, s.skipped, s.age),
            None => (None, Vec::new(), Vec::new(), (None, u64::MAX)),
        };
        // A family the node does not serve (no node IP of it) is left out,
        // as kube-proxy runs no proxier for it.
        ports.retain(|p| node.serves(p.family));
        let old = self.services.get_mut(key).map(std::mem::take).unwrap_or_default();
        let mut problems: Vec<String> = skipped.into_iter().map(|s| s.reason).collect();
        let mut record = ServiceRecord::default();
        for p in &ports {
            let Some((id, name)) = self.ids.assign_owned(p.name()) else {
                problems.push(format!(
                    "port {:?}: no free service id (raise --max-services)",
                    p.port_name
                ));
                continue;
            };
            let c = desired::contribution(id, p, node);
            record.no_local += desired::lacks_local_endpoints(p) as u32;
            self.table.set_port(id, Rank::new(age, name), c);
            record.ports.push(id);
        }
        let kept = record.ports.as_slice();
        for id in old.ports.as_slice().iter().filter(|id| !kept.contains(id)) {
            self.table.remove_port(*id);
            if let Some(name) = self.ids.name(*id).map(|n| (**n).clone()) {
                self.ids.release(&name);
            }
        }
        record.problems = problems.into();
        for p in record.problems.iter().filter(|p| !old.problems.contains(p)) {
            report.problems.push(format!("{key}: {p}"));
            report.object_problems.push((key.to_string(), p.clone()));
        }
        self.no_local = self.no_local - old.no_local as usize + record.no_local as usize;
        self.problems = self.problems - old.problems.len() + record.problems.len();
        match svc.and_then(|s| health_check_of(s, &ports)) {
            Some(h) => self.health.insert(key.clone(), h),
            None => self.health.remove(key),
        };
        match (svc, self.services.get_mut(key)) {
            (Some(_), Some(slot)) => *slot = record,
            (Some(_), None) => {
                self.services.insert(key.clone(), record);
            }
            (None, _) => {
                self.services.remove(key);
            }
        }
    }

    /// Reports frontends claimed by more than one port: the holder keeps
    /// it, the others are skipped with a problem naming both.
    fn report_conflicts(&mut self, report: &mut SyncReport) {
        let mut now = HashMap::new();
        for (fe, holder, losers) in self.table.conflicts() {
            for loser in losers {
                now.insert((fe, *loser), holder);
            }
        }
        for ((fe, loser), holder) in &now {
            if self.conflicts.get(&(*fe, *loser)) == Some(holder) {
                continue;
            }
            let (Some(loser_name), Some(holder_name), Some(kind)) = (
                self.table.name(*loser),
                self.table.name(*holder),
                self.table.claim_kind(*loser, fe),
            ) else {
                continue;
            };
            let message = conflict_message(kind, fe, holder_name);
            report.problems.push(format!("{loser_name}: {message}"));
            report.object_problems.push((loser_name.object(), message));
        }
        self.conflicts = now;
    }

    fn describe(&self, op: &Op) -> String {
        match op {
            Op::SetFrontend { frontend, entry, .. } => format!(
                "{} {frontend} of {}",
                entry.kind.as_str(),
                self.table
                    .name(entry.service_id)
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ),
            Op::SetBackend(_, b) => format!("backend {}:{}/{}", b.addr, b.port, b.proto),
            Op::SetServiceName(_, n) => format!("name of {n}"),
            other => format!("{other:?}"),
        }
    }
}

/// The node's view for the desired table: NodePort addresses from
/// nodePortAddresses, among the local addresses (both families; see
/// [`NodePortAddresses::select`](crate::net::NodePortAddresses::select)).
pub fn node_context(
    node_ips: &[IpAddr],
    choice: &crate::net::NodePortAddresses,
    local: &[(String, IpAddr)],
) -> NodeContext {
    let local: Vec<IpAddr> = local.iter().map(|(_, a)| *a).collect();
    NodeContext {
        node_port_addresses: choice.select(node_ips, &local).into_iter().collect(),
        node_ips: node_ips.to_vec(),
        lb: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    //! The incremental syncer against the whole-table reference: random
    //! change sequences, failed writes at every position of a sync, and
    //! conflicts resolved by rank.
    use std::collections::{BTreeMap, BTreeSet};

    use k8s_openapi::api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    };
    use serde_json::json;

    use super::*;
    use crate::{
        net::{IpCidr, Protocol},
        state::{
            desired::DesiredTable,
            fake::FakeMaps,
            table::{Backend, BackendKey, FrontendEntry, ServicePortName},
        },
    };

    const NODE: &str = "node-a";

    /// xorshift: deterministic pseudo-random sequences without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn chance(&mut self, one_in: u64) -> bool {
            self.below(one_in) == 0
        }
        fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
            &v[self.below(v.len() as u64) as usize]
        }
    }

    /// A random Service from small pools, so that frontends collide
    /// (same ClusterIP and port, same NodePort, same external IP).
    fn random_service(rng: &mut Rng, name: &str) -> Service {
        let ty = *rng.pick(&["ClusterIP", "ClusterIP", "NodePort", "LoadBalancer"]);
        let mut ports = Vec::new();
        for p in 0..1 + rng.below(2) {
            let proto = *rng.pick(&["TCP", "TCP", "UDP", "SCTP"]);
            let mut port = json!({"name": format!("p{p}"), "port": 80 + rng.below(2), "protocol": proto});
            if ty != "ClusterIP" {
                port["nodePort"] = json!(30000 + rng.below(3));
            }
            ports.push(port);
        }
        let mut spec = json!({
            "type": ty,
            "clusterIP": format!("10.96.0.{}", 1 + rng.below(4)),
            "ports": ports,
        });
        if rng.chance(3) {
            spec["externalIPs"] = json!([format!("203.0.113.{}", 1 + rng.below(2))]);
        }
        if rng.chance(3) {
            spec["externalTrafficPolicy"] = json!("Local");
            spec["healthCheckNodePort"] = json!(32000 + rng.below(100));
        }
        if rng.chance(4) {
            spec["internalTrafficPolicy"] = json!("Local");
        }
        if rng.chance(4) {
            spec["sessionAffinity"] = json!("ClientIP");
        }
        if rng.chance(4) {
            spec["loadBalancerSourceRanges"] = json!(["198.51.100.0/24", "192.0.2.0/24"]);
        }
        if rng.chance(4) {
            spec["trafficDistribution"] = json!("PreferClose");
        }
        let mut meta = json!({"name": name, "namespace": "ns"});
        if !rng.chance(4) {
            meta["creationTimestamp"] = json!(format!("2024-01-0{}T00:00:00Z", 1 + rng.below(3)));
        }
        let mut svc = json!({"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec});
        if ty == "LoadBalancer" {
            svc["status"] =
                json!({"loadBalancer": {"ingress": [{"ip": format!("198.18.1.{}", 1 + rng.below(2))}]}});
        }
        serde_json::from_value(svc).unwrap()
    }

    fn random_slice(rng: &mut Rng, name: &str, service: &str) -> EndpointSlice {
        let endpoints: Vec<serde_json::Value> = (0..rng.below(4))
            .map(|_| {
                let ready = !rng.chance(3);
                let mut e = json!({
                    "addresses": [format!("10.0.0.{}", 1 + rng.below(6))],
                    "conditions": {"ready": ready, "serving": ready || rng.chance(2), "terminating": !ready && rng.chance(2)},
                    "nodeName": *rng.pick(&["node-a", "node-b"]),
                });
                if rng.chance(2) {
                    e["hints"] = json!({"forZones": [{"name": *rng.pick(&["z1", "z2"])}]});
                }
                e
            })
            .collect();
        let ports: Vec<serde_json::Value> = (0..2)
            .map(|p| json!({"name": format!("p{p}"), "port": 8080 + rng.below(2), "protocol": *rng.pick(&["TCP", "UDP"])}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "ns", "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": ports, "endpoints": endpoints,
        }))
        .unwrap()
    }

    fn node_object(zone: &str) -> Node {
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": zone}}}))
        .unwrap()
    }

    fn node_context(two: bool) -> NodeContext {
        let a = IpAddr::from([192, 168, 0, 1]);
        let b = IpAddr::from([192, 168, 1, 1]);
        NodeContext {
            node_port_addresses: if two { vec![a, b] } else { vec![a] },
            node_ips: vec![a],
            lb: Default::default(),
        }
    }

    /// A table as names and addresses, so that two tables with other ids
    /// compare equal.
    #[derive(Debug, PartialEq, Eq)]
    struct Resolved {
        frontends: BTreeMap<Frontend, (ServicePortName, String)>,
        backends: BTreeMap<BackendKey, (bool, bool, bool)>,
        addresses: BTreeSet<IpAddr>,
        ranges: BTreeSet<(ServicePortName, IpCidr)>,
        names: BTreeSet<ServicePortName>,
    }

    fn entry_text<B>(e: &FrontendEntry<B>, name: impl Fn(&B) -> BackendKey) -> String {
        let set = |s: &crate::state::table::BackendSet<B>| {
            let keys: Vec<String> = s.backends.iter().map(|b| format!("{:?}", name(b))).collect();
            format!("{keys:?}/{:?}", s.when_empty)
        };
        format!(
            "{:?} {} {:?} m={} a={:?} r={} el={} il={}",
            e.kind,
            set(&e.backends),
            e.internal_backends.as_ref().map(set),
            e.masquerade,
            e.affinity_timeout,
            e.source_ranges,
            e.external_local,
            e.internal_local
        )
    }

    fn flags(b: &Backend) -> (bool, bool, bool) {
        (b.serving, b.terminating, b.local)
    }

    fn resolve_fake(m: &FakeMaps) -> Resolved {
        let name = |id: &u32| m.names[id].clone();
        Resolved {
            frontends: m
                .frontends
                .iter()
                .map(|(f, e)| {
                    (
                        *f,
                        (name(&e.service_id), entry_text(e, |id| m.backends[id].key())),
                    )
                })
                .collect(),
            backends: m.backends.values().map(|b| (b.key(), flags(b))).collect(),
            addresses: m.addresses.clone(),
            ranges: m.ranges.iter().map(|(id, r)| (name(id), *r)).collect(),
            names: m.names.values().cloned().collect(),
        }
    }

    fn resolve_desired(t: &DesiredTable) -> Resolved {
        let name = |id: &u32| (*t.service_names[id]).clone();
        Resolved {
            frontends: t
                .frontends
                .iter()
                .map(|(f, e)| (*f, (name(&e.service_id), entry_text(e, |k| *k))))
                .collect(),
            backends: t.backends.values().map(|b| (b.key(), flags(b))).collect(),
            addresses: t.service_addresses.clone(),
            ranges: t.source_ranges.iter().map(|(id, r)| (name(id), *r)).collect(),
            names: t.service_names.values().map(|n| (**n).clone()).collect(),
        }
    }

    /// The whole table computed at once from the store, ports in rank order
    /// (with the ids the syncer gave them).
    fn reference(store: &Store, syncer: &Syncer, node: &NodeContext) -> DesiredTable {
        let (ports, _) = store.service_ports(NODE);
        let mut ranked: Vec<(Rank, u32, &crate::state::inputs::ServicePort)> = ports
            .iter()
            .map(|p| {
                let key = ObjectKey::new(&p.namespace, &p.name);
                let id = syncer.ids.get(&p.name()).expect("every port has an id");
                (Rank::new(store.age(&key), p.name()), id, p)
            })
            .collect();
        ranked.sort_by(|a, b| a.0.cmp(&b.0));
        desired::compute(ranked.iter().map(|(_, id, p)| (*id, *p)), node)
    }

    /// One random change to the store (or to the node's view).
    fn random_change(rng: &mut Rng, store: &mut Store, node: &mut NodeContext) {
        let svc = format!("s{}", rng.below(5));
        match rng.below(12) {
            0..=3 => store.upsert_service(random_service(rng, &svc)),
            4 => store.remove_service(&ObjectKey::new("ns", &svc)),
            5..=8 => {
                let slice = format!("{svc}-{}", rng.below(2));
                // Sometimes a slice moves to another Service.
                let owner = if rng.chance(6) {
                    format!("s{}", rng.below(5))
                } else {
                    svc
                };
                store.upsert_slice(random_slice(rng, &slice, &owner));
            }
            9 => store.remove_slice(&ObjectKey::new("ns", &format!("{svc}-{}", rng.below(2)))),
            10 => {
                let zone = if rng.chance(2) { "z1" } else { "z2" };
                store.set_node(Some(node_object(zone)))
            }
            _ => *node = node_context(rng.chance(2)),
        }
    }

    fn check(store: &Store, syncer: &Syncer, maps: &FakeMaps, node: &NodeContext, what: &str) {
        let want = resolve_desired(&reference(store, syncer, node));
        let got = resolve_fake(maps);
        assert_eq!(got, want, "{what}");
    }

    #[test]
    fn incremental_syncs_give_the_same_maps_as_the_whole_table_over_random_change_sequences() {
        let mut rng = Rng(0x2545f4914f6cdd1d);
        let mut failures = 0;
        for sequence in 0..1200 {
            let mut store = Store::default();
            store.replace_services([]);
            store.replace_slices([]);
            let mut node = node_context(false);
            let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 64, 64);
            let mut maps = FakeMaps::default();
            for step in 0..1 + rng.below(20) {
                for _ in 0..1 + rng.below(3) {
                    random_change(&mut rng, &mut store, &mut node);
                }
                // Now and then a write fails somewhere in the sync.
                if rng.chance(5) {
                    maps.fail_at = Some(maps.ops + rng.below(12) as usize);
                }
                let report = syncer.sync(&mut store, &node, &mut maps);
                failures += report.failed_ops;
                let what = format!("sequence {sequence}, step {step}");
                assert!(
                    !report.unsettled,
                    "{what}: one failure is recovered within the sync"
                );
                check(&store, &syncer, &maps, &node, &what);
                if rng.chance(4) {
                    // A reconcile finds nothing to repair and nothing to write.
                    let r = syncer.reconcile(&mut store, &node, &mut maps);
                    assert_eq!((r.drift, r.summary.ops), (0, 0), "{what}: reconcile");
                }
            }
        }
        assert!(failures > 100, "failed writes were exercised ({failures})");
    }

    /// A sync with adds, changes and removals of frontends, backends,
    /// ranges and names, failed at every operation in turn.
    #[test]
    fn a_write_failing_at_any_point_of_a_sync_ends_with_the_desired_maps_and_no_dangling_reference() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        let before: Vec<(Service, Vec<EndpointSlice>)> = (0..5)
            .map(|i| {
                let name = format!("s{i}");
                let slices = (0..2)
                    .map(|k| random_slice(&mut rng, &format!("{name}-{k}"), &name))
                    .collect();
                (random_service(&mut rng, &name), slices)
            })
            .collect();
        let after: Vec<(Service, Vec<EndpointSlice>)> = (0..5)
            .map(|i| {
                let name = format!("s{}", i + 2);
                let slices = (0..2)
                    .map(|k| random_slice(&mut rng, &format!("{name}-{k}"), &name))
                    .collect();
                (random_service(&mut rng, &name), slices)
            })
            .collect();
        let load = |store: &mut Store, objects: &[(Service, Vec<EndpointSlice>)]| {
            store.replace_services(objects.iter().map(|(s, _)| s.clone()));
            store.replace_slices(objects.iter().flat_map(|(_, s)| s.clone()));
        };
        let node = node_context(true);
        let start = || {
            let mut store = Store::default();
            load(&mut store, &before);
            let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 64, 64);
            let mut maps = FakeMaps::default();
            let r = syncer.sync(&mut store, &node, &mut maps);
            assert_eq!(r.failed_ops, 0);
            load(&mut store, &after);
            (store, syncer, maps)
        };
        // How many operations the change takes.
        let (mut store, mut syncer, mut maps) = start();
        let first = maps.ops;
        syncer.sync(&mut store, &node, &mut maps);
        let total = maps.ops - first;
        assert!(total > 20, "a sync worth failing ({total} operations)");
        for n in 0..total {
            let (mut store, mut syncer, mut maps) = start();
            maps.fail_at = Some(maps.ops + n);
            let report = syncer.sync(&mut store, &node, &mut maps);
            assert_eq!(report.failed_ops, 1, "operation {n}");
            assert!(!report.unsettled, "operation {n}");
            check(
                &store,
                &syncer,
                &maps,
                &node,
                &format!("failed at operation {n} of {total}"),
            );
        }
        // Two failures in a row (the recovery's replan fails too): the maps
        // stay consistent and the next sync settles them.
        for n in [0, total / 2, total - 1] {
            let (mut store, mut syncer, mut maps) = start();
            let at = maps.ops + n;
            maps.fail_at = Some(at);
            let mut report = syncer.sync(&mut store, &node, &mut maps);
            if report.failed_ops == 1 {
                // Fail the first operation of the recovery as well.
                let (mut s2, mut y2, mut m2) = start();
                m2.fail_at = Some(m2.ops + n);
                let mut failing = FailTwice {
                    maps: &mut m2,
                    second: None,
                };
                report = y2.sync(&mut s2, &node, &mut failing);
                assert!(report.unsettled || report.failed_ops < 2);
                let report = y2.sync(&mut s2, &node, &mut m2);
                assert!(!report.unsettled);
                check(&s2, &y2, &m2, &node, &format!("two failures from operation {n}"));
            }
            check(&store, &syncer, &maps, &node, &format!("failed at operation {n}"));
        }
    }

    /// Fails the first operation after the first failure too.
    struct FailTwice<'a> {
        maps: &'a mut FakeMaps,
        second: Option<usize>,
    }

    impl MapWriter for FailTwice<'_> {
        type Error = crate::state::fake::FakeError;
        fn apply(&mut self, op: &Op) -> Result<(), Self::Error> {
            let before = self.maps.fail_at;
            let r = self.maps.apply(op);
            if r.is_err() && before.is_some() && self.second.is_none() {
                self.second = Some(self.maps.ops);
                self.maps.fail_at = Some(self.maps.ops);
            }
            r
        }
        fn read_table(&self) -> Result<MapTable, Self::Error> {
            self.maps.read_table()
        }
    }

    fn objects_with_conflict(b_created: &str) -> (Vec<Service>, Vec<EndpointSlice>) {
        let svc = |name: &str, created: &str| -> Service {
            serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
                "spec": {"type": "NodePort", "clusterIP": if name == "a" {"10.96.0.1"} else {"10.96.0.2"},
                         "ports": [{"name": "p0", "port": 80, "nodePort": 30000}]}}))
            .unwrap()
        };
        let mut rng = Rng(7);
        (
            vec![svc("a", "2024-01-02T00:00:00Z"), svc("b", b_created)],
            vec![
                random_slice(&mut rng, "a-0", "a"),
                random_slice(&mut rng, "b-0", "b"),
            ],
        )
    }

    #[test]
    fn a_frontend_two_services_claim_stays_with_the_one_created_first_and_the_other_is_told_whom() {
        let node = node_context(false);
        let np = Frontend {
            addr: IpAddr::from([192, 168, 0, 1]),
            port: 30000,
            proto: Protocol::Tcp,
        };
        // b is older than a, though its name sorts after.
        let (services, slices) = objects_with_conflict("2024-01-01T00:00:00Z");
        let mut store = Store::default();
        store.replace_services(services.clone());
        store.replace_slices(slices);
        let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 64, 64);
        let mut maps = FakeMaps::default();
        let report = syncer.sync(&mut store, &node, &mut maps);
        let holder = &maps.names[&maps.frontends[&np].service_id];
        assert_eq!(&*holder.name, "b", "the Service created first keeps the NodePort");
        assert_eq!(report.object_problems.len(), 1, "{:?}", report.problems);
        let (object, message) = &report.object_problems[0];
        assert_eq!(object, "ns/a");
        assert!(
            message.contains("ns/b:p0"),
            "the warning names the holder: {message}"
        );
        assert!(message.contains("30000"), "{message}");
        // A later update of a changes nothing: b still holds it; a is not
        // reported again.
        store.upsert_service(services[0].clone());
        let report = syncer.sync(&mut store, &node, &mut maps);
        assert!(report.object_problems.is_empty());
        assert_eq!(&*maps.names[&maps.frontends[&np].service_id].name, "b");
        // b goes: a takes the NodePort over.
        store.remove_service(&ObjectKey::new("ns", "b"));
        syncer.sync(&mut store, &node, &mut maps);
        assert_eq!(&*maps.names[&maps.frontends[&np].service_id].name, "a");
        check(&store, &syncer, &maps, &node, "after the holder left");
    }

    /// The NodePort `objects_with_conflict`'s Services both claim.
    const CONFLICTED: Frontend = Frontend {
        addr: IpAddr::V4(std::net::Ipv4Addr::new(192, 168, 0, 1)),
        port: 30000,
        proto: Protocol::Tcp,
    };

    fn holder(maps: &FakeMaps) -> String {
        maps.names[&maps.frontends[&CONFLICTED].service_id]
            .name
            .to_string()
    }

    /// Manifests (no creation times): b arrives first, then a, whose name
    /// sorts first, claims b's NodePort. The objects, and the agent after
    /// the second sync with its report.
    fn b_then_a_without_creation_times(
        node: &NodeContext,
    ) -> (
        Vec<Service>,
        Vec<EndpointSlice>,
        Store,
        Syncer,
        FakeMaps,
        SyncReport,
    ) {
        let (mut services, slices) = objects_with_conflict("2024-01-01T00:00:00Z");
        for s in &mut services {
            s.metadata.creation_timestamp = None;
        }
        let mut store = Store::default();
        store.replace_services([services[1].clone()]);
        store.replace_slices(slices.clone());
        let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 64, 64);
        let mut maps = FakeMaps::default();
        syncer.sync(&mut store, node, &mut maps);
        store.upsert_service(services[0].clone());
        let report = syncer.sync(&mut store, node, &mut maps);
        (services, slices, store, syncer, maps, report)
    }

    #[test]
    fn without_creation_times_the_service_seen_first_keeps_a_frontend() {
        // kube-proxy's rule is that the existing holder keeps it.
        let node = node_context(false);
        let (services, _, mut store, mut syncer, mut maps, report) = b_then_a_without_creation_times(&node);
        assert_eq!(holder(&maps), "b", "the holder keeps it");
        let (object, message) = &report.object_problems[0];
        assert_eq!(object, "ns/a", "the newcomer is told");
        assert!(message.contains("ns/b:p0"), "{message}");
        // An update of the holder does not make it a newcomer.
        store.upsert_service({
            let mut b = services[1].clone();
            b.metadata.labels = Some([("x".to_owned(), "y".to_owned())].into());
            b
        });
        syncer.sync(&mut store, &node, &mut maps);
        assert_eq!(holder(&maps), "b");
        check(&store, &syncer, &maps, &node, "after the conflict");
    }

    #[test]
    fn after_a_restart_the_holder_keeps_a_frontend_whatever_order_the_objects_come_in() {
        // b holds the NodePort a also claims. A new process reads both at
        // once, a first: the pinned maps say b holds it, and b keeps it.
        let node = node_context(false);
        let (services, slices, _, _, mut maps, _) = b_then_a_without_creation_times(&node);
        assert_eq!(holder(&maps), "b");
        let before = maps.clone();

        let mut store = Store::default();
        store.replace_services(services.clone());
        store.replace_slices(slices);
        let mut syncer = Syncer::adopt(&maps.read_table().unwrap(), NODE, 64, 64);
        let report = syncer.sync(&mut store, &node, &mut maps);
        assert_eq!(holder(&maps), "b", "the holder keeps it");
        assert_eq!(report.summary.ops, 0, "nothing to write after a restart");
        assert_eq!(maps.frontends, before.frontends);
        let (object, message) = &report.object_problems[0];
        assert_eq!(object, "ns/a", "the other one is told");
        assert!(message.contains("ns/b:p0"), "{message}");
        // Once b goes, a takes it; b back is a newcomer and waits.
        store.remove_service(&ObjectKey::new("ns", "b"));
        syncer.sync(&mut store, &node, &mut maps);
        assert_eq!(holder(&maps), "a");
        store.upsert_service(services[1].clone());
        syncer.sync(&mut store, &node, &mut maps);
        assert_eq!(holder(&maps), "a");
    }

    #[test]
    fn a_restart_adopts_the_maps_writes_nothing_and_keeps_the_holders() {
        let node = node_context(true);
        let (services, slices) = objects_with_conflict("2024-01-03T00:00:00Z");
        let mut store = Store::default();
        store.replace_services(services.clone());
        store.replace_slices(slices.clone());
        let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 64, 64);
        let mut maps = FakeMaps::default();
        syncer.sync(&mut store, &node, &mut maps);
        let before = maps.clone();
        // A new process: same objects, the maps as they are.
        let mut store = Store::default();
        store.replace_services(services);
        store.replace_slices(slices);
        let mut syncer = Syncer::adopt(&maps.read_table().unwrap(), NODE, 64, 64);
        let report = syncer.sync(&mut store, &node, &mut maps);
        assert_eq!(report.summary.ops, 0, "nothing to write after a restart");
        assert_eq!(maps.backends, before.backends);
        assert_eq!(maps.frontends, before.frontends);
    }

    #[test]
    fn one_endpoint_change_touches_only_its_service() {
        let node = node_context(false);
        let mut rng = Rng(11);
        let mut store = Store::default();
        store.replace_services((0..50).map(|i| {
            let mut s = random_service(&mut rng, &format!("s{i}"));
            // Distinct addresses: no conflicts in this one.
            s.spec.as_mut().unwrap().cluster_ip = Some(format!("10.97.0.{i}"));
            s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
            s
        }));
        store.replace_slices((0..50).map(|i| random_slice(&mut rng, &format!("s{i}-0"), &format!("s{i}"))));
        let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 256, 256);
        let mut maps = FakeMaps::default();
        syncer.sync(&mut store, &node, &mut maps);
        let mut slice = random_slice(&mut rng, "s7-0", "s7");
        slice.endpoints = vec![serde_json::from_value(json!({"addresses": ["10.0.9.9"]})).unwrap()];
        store.upsert_slice(slice);
        let report = syncer.sync(&mut store, &node, &mut maps);
        assert_eq!(report.kind, Some(SyncKind::Incremental));
        assert_eq!(report.services_recomputed, 1);
        assert!(report.summary.frontends_set <= 2, "{:?}", report.summary);
        check(&store, &syncer, &maps, &node, "after one slice change");
    }

    #[test]
    fn a_reconcile_repairs_and_counts_what_changed_behind_the_agents_back() {
        let node = node_context(false);
        let mut rng = Rng(5);
        let mut store = Store::default();
        store.replace_services((0..4).map(|i| random_service(&mut rng, &format!("s{i}"))));
        store.replace_slices((0..4).map(|i| random_slice(&mut rng, &format!("s{i}-0"), &format!("s{i}"))));
        let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 64, 64);
        let mut maps = FakeMaps::default();
        syncer.sync(&mut store, &node, &mut maps);
        // Another writer wipes the frontends and adds a backend.
        maps.check = false;
        maps.frontends.clear();
        maps.backends.insert(
            crate::state::table::BackendId::new(60).unwrap(),
            Backend {
                addr: IpAddr::from([10, 9, 9, 9]),
                port: 1,
                proto: Protocol::Tcp,
                serving: true,
                terminating: false,
                local: false,
            },
        );
        maps.check = true;
        let report = syncer.reconcile(&mut store, &node, &mut maps);
        assert!(report.drift > 1, "{report:?}");
        check(&store, &syncer, &maps, &node, "after the reconcile");
        let report = syncer.reconcile(&mut store, &node, &mut maps);
        assert_eq!(report.drift, 0);
    }
}
