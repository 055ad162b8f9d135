//! From (what the maps hold, what is desired) to ordered map operations.
//!
//! [`Programmer`] mirrors the maps: every frontend, backend (by id),
//! ClusterIP, source range and service name it knows to be there, and how
//! many frontend slots name each backend id. [`Programmer::plan`] compares
//! the mirror with the desired table for the keys that may have changed
//! ([`Dirty`]; all of them for a full plan) and returns the operations that
//! make the maps match, in an order where **every prefix is safe**: names,
//! backends, source ranges and ClusterIPs first, then frontends (each written
//! slots-then-slot-0 by the map layer), then removals in reverse. A packet
//! never sees a frontend naming a backend that is not written, and a plan
//! cut short by a failed write leaves the maps consistent.
//!
//! The mirror changes only when an operation is reported done
//! ([`Programmer::applied`]); after a failure the caller re-reads the maps
//! ([`Programmer::reset`]) and plans everything again. Backend ids come from
//! a free list; an id is released only once its removal is written and no
//! frontend slot names it, so an id is never reused while referenced.

use foldhash::{HashMap, HashMapExt as _, HashSet, HashSetExt as _};
use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use super::{
    backend_map::{AddrMap, BackendMap, BackendSlots},
    desired::DesiredTable,
    ids::{DenseMap, IdAllocator},
    incremental::{Dirty, ServiceTable},
    table::{
        Backend, BackendId, BackendKey, BackendSet, EmptyVerdict, Frontend, FrontendEntry, FrontendKind,
        MapTable, ServicePortName, SlotCounts, StraySlot,
    },
};
use crate::net::{IpCidr, IpFamily, Protocol};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    SetServiceName(u32, Arc<ServicePortName>),
    SetBackend(BackendId, Backend),
    AddSourceRange(u32, IpCidr),
    SetServiceAddress(IpAddr),
    SetFrontend {
        frontend: Frontend,
        /// Boxed: a million-op plan holds mostly small operations.
        entry: Box<FrontendEntry>,
        /// What it replaces, if anything.
        previous: Option<SlotCounts>,
    },
    RemoveFrontend {
        frontend: Frontend,
        previous: SlotCounts,
    },
    RemoveServiceAddress(IpAddr),
    RemoveSourceRange(u32, IpCidr),
    RemoveStraySlot(StraySlot),
    /// With the address the id held: its family says which backends map
    /// holds the id, and the address stays in the egress filter while
    /// established flows to it live on.
    RemoveBackend(BackendId, IpAddr),
    RemoveServiceName(u32),
    /// Clear UDP conntrack entries of flows to these backends (address,
    /// port), which stopped serving or are gone (kube-proxy does, so that
    /// e.g. DNS clients move on).
    PurgeUdpFlows(Vec<(IpAddr, u16)>),
}

impl Op {
    /// The family whose maps the operation writes (`None`: maps both
    /// families share, such as service names).
    pub fn family(&self) -> Option<IpFamily> {
        match self {
            Op::SetServiceName(..) | Op::RemoveServiceName(_) => None,
            Op::SetBackend(_, b) => Some(IpFamily::of(&b.addr)),
            Op::AddSourceRange(_, r) | Op::RemoveSourceRange(_, r) => Some(r.family()),
            Op::SetServiceAddress(a) | Op::RemoveServiceAddress(a) => Some(IpFamily::of(a)),
            Op::SetFrontend { frontend, .. } | Op::RemoveFrontend { frontend, .. } => Some(frontend.family()),
            Op::RemoveStraySlot(s) => Some(s.frontend.family()),
            Op::RemoveBackend(_, a) => Some(IpFamily::of(a)),
            Op::PurgeUdpFlows(_) => None,
        }
    }
}

/// The maps, as the programmer sees them: the real ones, or a fake in
/// tests.
pub trait MapWriter {
    type Error: std::error::Error + Send + Sync + 'static;

    fn apply(&mut self, op: &Op) -> Result<(), Self::Error>;

    /// Applies `ops` in order and stops at the first failure, returning how
    /// many were applied completely (an implementation may batch).
    fn apply_all(&mut self, ops: &[Op]) -> Result<(), (usize, Self::Error)> {
        for (i, op) in ops.iter().enumerate() {
            self.apply(op).map_err(|e| (i, e))?;
        }
        Ok(())
    }

    /// Called after the operations of one sync: writes what the writer
    /// deferred (the address filter).
    fn flush(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Everything the maps hold about services.
    fn read_table(&self) -> Result<MapTable, Self::Error>;

    /// Takes `table` (what the maps hold, just read) as the starting point
    /// of what the writer derives from frontends on its own (Maglev tables,
    /// DSR entries: see `state::derived`), repairing those maps.
    fn adopt(&mut self, _table: &MapTable) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// The desired state as the diff reads it: the whole table
/// ([`DesiredTable`]) or the incremental one ([`ServiceTable`]).
pub trait Desired {
    fn has_frontend(&self, fe: &Frontend) -> bool;
    /// The desired entry of `fe`, its backends named by `name` (those it
    /// cannot name are left out).
    fn frontend<C>(
        &self,
        fe: &Frontend,
        name: &mut dyn FnMut(&BackendKey) -> Option<C>,
    ) -> Option<FrontendEntry<C>>;
    fn backend(&self, key: &BackendKey) -> Option<Backend>;
    fn has_service_address(&self, addr: IpAddr) -> bool;
    fn has_source_range(&self, id: u32, range: IpCidr) -> bool;
    fn service_name(&self, id: u32) -> Option<&Arc<ServicePortName>>;
    /// Every desired key but the backends (for a full plan).
    fn keys(&self) -> KeyLists;
    /// How many backends are desired.
    fn backend_count(&self) -> usize;
    /// Calls `f` with every desired backend (a full plan walks a million of
    /// them: no list is made).
    fn for_each_backend(&self, f: &mut dyn FnMut(&BackendKey, Backend));
}

/// Keys a plan looks at, listed (a full plan lists a hundred thousand
/// frontends: vectors, no hashing).
#[derive(Clone, Debug, Default)]
pub struct KeyLists {
    pub frontends: Vec<Frontend>,
    /// Only for an incremental plan (a full one walks the desired backends).
    pub backends: Vec<BackendKey>,
    pub service_addresses: Vec<IpAddr>,
    pub source_ranges: Vec<(u32, IpCidr)>,
    pub names: Vec<u32>,
}

impl KeyLists {
    fn of(dirty: &Dirty) -> Self {
        Self {
            frontends: dirty.frontends.iter().copied().collect(),
            backends: dirty.backends.iter().copied().collect(),
            service_addresses: dirty.service_addresses.iter().copied().collect(),
            source_ranges: dirty.source_ranges.iter().copied().collect(),
            names: dirty.names.iter().copied().collect(),
        }
    }
}

impl Desired for DesiredTable {
    fn has_frontend(&self, fe: &Frontend) -> bool {
        self.frontends.contains_key(fe)
    }
    fn frontend<C>(
        &self,
        fe: &Frontend,
        name: &mut dyn FnMut(&BackendKey) -> Option<C>,
    ) -> Option<FrontendEntry<C>> {
        self.frontends.get(fe).map(|e| e.filter_map_backends(|k| name(k)))
    }
    fn backend(&self, key: &BackendKey) -> Option<Backend> {
        self.backends.get(key).copied()
    }
    fn has_service_address(&self, addr: IpAddr) -> bool {
        self.service_addresses.contains(&addr)
    }
    fn has_source_range(&self, id: u32, range: IpCidr) -> bool {
        self.source_ranges.contains(&(id, range))
    }
    fn service_name(&self, id: u32) -> Option<&Arc<ServicePortName>> {
        self.service_names.get(&id)
    }
    fn keys(&self) -> KeyLists {
        KeyLists {
            frontends: self.frontends.keys().copied().collect(),
            backends: Vec::new(),
            service_addresses: self.service_addresses.iter().copied().collect(),
            source_ranges: self.source_ranges.iter().copied().collect(),
            names: self.service_names.keys().copied().collect(),
        }
    }
    fn backend_count(&self) -> usize {
        self.backends.len()
    }
    fn for_each_backend(&self, f: &mut dyn FnMut(&BackendKey, Backend)) {
        for (k, b) in &self.backends {
            f(k, *b);
        }
    }
}

impl Desired for ServiceTable {
    fn has_frontend(&self, fe: &Frontend) -> bool {
        ServiceTable::has_frontend(self, fe)
    }
    fn frontend<C>(
        &self,
        fe: &Frontend,
        name: &mut dyn FnMut(&BackendKey) -> Option<C>,
    ) -> Option<FrontendEntry<C>> {
        ServiceTable::frontend(self, fe, name)
    }
    fn backend(&self, key: &BackendKey) -> Option<Backend> {
        ServiceTable::backend(self, key)
    }
    fn has_service_address(&self, addr: IpAddr) -> bool {
        ServiceTable::has_service_address(self, addr)
    }
    fn has_source_range(&self, id: u32, range: IpCidr) -> bool {
        ServiceTable::has_source_range(self, id, range)
    }
    fn service_name(&self, id: u32) -> Option<&Arc<ServicePortName>> {
        ServiceTable::name(self, id)
    }
    fn keys(&self) -> KeyLists {
        KeyLists {
            frontends: self.frontend_keys().copied().collect(),
            backends: Vec::new(),
            service_addresses: self.service_address_keys().collect(),
            source_ranges: self.source_range_keys().copied().collect(),
            names: self.port_ids().collect(),
        }
    }
    fn backend_count(&self) -> usize {
        ServiceTable::backend_count(self)
    }
    fn for_each_backend(&self, f: &mut dyn FnMut(&BackendKey, Backend)) {
        for (k, b) in self.backends() {
            f(&k, b);
        }
    }
}

/// A plan's operations, by phase: every prefix of their concatenation is
/// safe to apply.
#[derive(Default)]
struct Plan {
    names: Vec<Op>,
    set_backends: Vec<Op>,
    adds: Vec<Op>,
    set_frontends: Vec<Op>,
    removals: Vec<Op>,
    remove_backends: Vec<Op>,
    remove_names: Vec<Op>,
    purged: Vec<(IpAddr, u16)>,
    /// The backends map has no free id left.
    no_ids_left: bool,
}

impl Plan {
    fn into_ops(mut self) -> Vec<Op> {
        let phases = [
            self.names,
            self.set_backends,
            self.adds,
            self.set_frontends,
            self.removals,
            self.remove_backends,
            self.remove_names,
        ];
        let mut ops = Vec::with_capacity(phases.iter().map(Vec::len).sum::<usize>() + 1);
        for mut phase in phases {
            // Each family's maps are written in runs of their own: within a
            // phase (whose operations do not depend on each other), IPv4
            // first, then IPv6 (a stable sort keeps each family's order).
            if !phase.is_sorted_by_key(Op::family) {
                phase.sort_by_key(Op::family);
            }
            ops.extend(phase);
        }
        if !self.purged.is_empty() {
            self.purged.sort();
            self.purged.dedup();
            ops.push(Op::PurgeUdpFlows(self.purged));
        }
        ops
    }
}

/// Counts of one plan, for logs and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanSummary {
    pub ops: usize,
    pub frontends_set: usize,
    pub frontends_removed: usize,
    pub backends_set: usize,
    pub backends_removed: usize,
    /// Frontends written without some backends: no backend id was free
    /// (the backends map is full).
    pub skipped: usize,
}

impl PlanSummary {
    pub fn add(&mut self, other: &PlanSummary) {
        self.ops += other.ops;
        self.frontends_set += other.frontends_set;
        self.frontends_removed += other.frontends_removed;
        self.backends_set += other.backends_set;
        self.backends_removed += other.backends_removed;
        self.skipped += other.skipped;
    }
}

/// A frontend written without some of its backends (no id was free).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unprogrammable {
    pub frontend: Frontend,
    pub service_id: u32,
}

/// What the maps hold, as far as this process knows, and how to move them
/// to a desired table.
#[derive(Clone, Debug)]
pub struct Programmer {
    ids: IdAllocator,
    /// The id of each backend key (programmed, or allocated by a plan).
    backend_ids: BackendMap<BackendId>,
    /// Programmed backends, by id.
    backends: BackendSlots,
    /// How many programmed frontend slots name each id.
    refs: Vec<u32>,
    /// Ids allocated by a plan whose backend is not written yet (by id).
    pending: Vec<bool>,
    /// Programmed backends to remove once no frontend names them.
    deferred: BTreeSet<BackendId>,
    frontends: HashMap<Frontend, Mirrored>,
    service_addresses: AddrMap<()>,
    source_ranges: HashSet<(u32, IpCidr)>,
    names: DenseMap<Arc<ServicePortName>>,
    strays: BTreeSet<StraySlot>,
    /// Frontends the maps hold incompletely, with the slot counts their
    /// slot 0 claims: rewritten (or removed) by the next plan.
    damaged: HashMap<Frontend, SlotCounts>,
    /// Services-map entries of the frontends (slot 0 and slots, per set).
    frontend_entries: usize,
    /// Frontends the last plan could not write.
    unprogrammable: Vec<Unprogrammable>,
    /// Frontends the next plan looks at whatever is dirty (written without
    /// some backends for want of ids).
    retry: HashSet<Frontend>,
}

impl Programmer {
    /// Empty maps; backend ids `1..backend_capacity`.
    pub fn new(backend_capacity: u32) -> Self {
        Self {
            ids: IdAllocator::new(1, backend_capacity),
            backend_ids: BackendMap::default(),
            backends: BackendSlots::default(),
            refs: Vec::new(),
            pending: Vec::new(),
            deferred: BTreeSet::new(),
            frontends: HashMap::new(),
            service_addresses: AddrMap::default(),
            source_ranges: HashSet::new(),
            names: DenseMap::default(),
            strays: BTreeSet::new(),
            damaged: HashMap::new(),
            frontend_entries: 0,
            unprogrammable: Vec::new(),
            retry: HashSet::new(),
        }
    }

    /// Takes what the maps already hold as the current table (a restarted
    /// agent): the first plan then only changes what really differs, and
    /// removes nothing that is still desired.
    pub fn adopt(backend_capacity: u32, table: &MapTable) -> Self {
        let mut p = Self::new(backend_capacity);
        p.reset(table);
        p
    }

    /// Replaces the mirror with what the maps really hold (after a failed
    /// write, or to repair what changed behind the agent's back); returns
    /// how many entries differed from what the mirror said. Follow it with
    /// a full plan.
    pub fn reset(&mut self, table: &MapTable) -> usize {
        let drift = self.drift(table);
        self.reset_to(table);
        drift
    }

    /// As [`Programmer::reset`], without counting.
    fn reset_to(&mut self, table: &MapTable) {
        let capacity = self.ids.capacity();
        let mut backends = BackendSlots::default();
        let mut backend_ids = BackendMap::default();
        for (id, b) in &table.backends {
            if id.get() >= capacity {
                continue;
            }
            backends.set(*id, Some(*b));
            // The lowest id is a key's own; others are duplicates to remove.
            backend_ids.entry(b.key()).or_insert_with(|| *id);
        }
        let mut refs: Vec<u32> = Vec::new();
        for (_, e) in &table.frontends {
            // An id beyond the map (a slot someone else wrote) was never
            // handed out: nothing to count (and no vector that long).
            for id in e.all_backends().filter(|id| id.get() < capacity) {
                *slot(&mut refs, *id) += 1;
            }
        }
        let referenced = refs
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(i, _)| i as u32);
        let programmed = table.backends.iter().map(|(id, _)| id.get());
        self.ids = IdAllocator::adopt(1, capacity, programmed.chain(referenced));
        self.backend_ids = backend_ids;
        self.backends = backends;
        self.refs = refs;
        self.pending.clear();
        self.deferred.clear();
        self.frontends = table
            .frontends
            .iter()
            .map(|(f, e)| (*f, Mirrored::of(e)))
            .collect();
        self.frontend_entries = self.frontends.values().map(Mirrored::entries).sum();
        self.service_addresses = table.service_addresses.iter().copied().collect();
        self.source_ranges = table.source_ranges.iter().copied().collect();
        self.names = table
            .service_names
            .iter()
            .map(|(id, n)| (*id, Arc::new(n.clone())))
            .collect();
        self.strays = table.stray_slots.iter().copied().collect();
        self.damaged = table.damaged.iter().copied().collect();
    }

    /// How many entries of `table` differ from the mirror.
    pub fn drift(&self, table: &MapTable) -> usize {
        // Entries of `table` the mirror holds alike, and the rest on either
        // side: no temporary index of a million entries.
        let mut n = table.stray_slots.len() + table.damaged.len();
        let same = table
            .frontends
            .iter()
            .filter(|(f, e)| self.frontends.get(f).is_some_and(|m| m.matches(e)))
            .count();
        n += (table.frontends.len() - same) + (self.frontends.len() - same);
        let same = table
            .backends
            .iter()
            .filter(|(id, b)| self.backend(*id) == Some(*b))
            .count();
        n += (table.backends.len() - same) + (self.programmed_ids().count() - same);
        let same = table
            .service_addresses
            .iter()
            .filter(|a| self.service_addresses.contains(a))
            .count();
        n += (table.service_addresses.len() - same) + (self.service_addresses.len() - same);
        let same = table
            .source_ranges
            .iter()
            .filter(|r| self.source_ranges.contains(r))
            .count();
        n += (table.source_ranges.len() - same) + (self.source_ranges.len() - same);
        let same = table
            .service_names
            .iter()
            .filter(|(id, nm)| self.names.get(*id).is_some_and(|n| **n == *nm))
            .count();
        n += (table.service_names.len() - same) + (self.names.len() - same);
        n
    }

    /// The name the mirror holds for a service id.
    pub fn service_name(&self, id: u32) -> Option<&ServicePortName> {
        self.names.get(id).map(|n| &**n)
    }

    /// The id a backend has in the maps (or was given by the last plan).
    pub fn backend_id(&self, key: &BackendKey) -> Option<BackendId> {
        self.backend_ids.get(key).copied()
    }

    fn backend(&self, id: BackendId) -> Option<Backend> {
        self.backends.get(id)
    }

    fn refs(&self, id: BackendId) -> u32 {
        self.refs.get(id.get() as usize).copied().unwrap_or(0)
    }

    fn programmed_ids(&self) -> impl Iterator<Item = BackendId> + '_ {
        self.backends.ids()
    }

    /// How many frontends the mirror holds.
    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    /// How many backends the mirror holds.
    pub fn backend_count(&self) -> usize {
        self.ids.used()
    }

    /// Entries of the services map the mirror accounts for (a frontend and
    /// its slots per set, and one per ClusterIP): its occupancy, without
    /// walking the map.
    pub fn service_entries(&self) -> usize {
        self.frontend_entries + self.service_addresses.len() + self.strays.len()
    }

    /// The service ids the mirror names.
    pub fn service_names(&self) -> impl Iterator<Item = (u32, &ServicePortName)> {
        self.names.iter().map(|(id, n)| (id, &**n))
    }

    /// Frontends the last plan wrote without some of their backends (no
    /// backend id was left for them).
    pub fn unprogrammable(&self) -> &[Unprogrammable] {
        &self.unprogrammable
    }

    /// Whether the next plan has work of its own (frontends to complete).
    pub fn has_retries(&self) -> bool {
        !self.retry.is_empty()
    }

    /// The ordered operations that bring the keys in `dirty` (every key if
    /// `dirty.all`) to `desired`. Only backend ids are taken here; the
    /// mirror follows [`Programmer::applied`].
    pub fn plan(&mut self, desired: &impl Desired, dirty: &Dirty) -> (Vec<Op>, PlanSummary) {
        let keys = if dirty.all {
            // What is desired, and what is programmed but not desired.
            let mut k = desired.keys();
            k.frontends
                .extend(self.frontends.keys().filter(|f| !desired.has_frontend(f)));
            k.service_addresses.extend(
                self.service_addresses
                    .keys()
                    .filter(|a| !desired.has_service_address(*a)),
            );
            k.source_ranges.extend(
                self.source_ranges
                    .iter()
                    .filter(|(id, r)| !desired.has_source_range(*id, *r)),
            );
            k.names
                .extend(self.names.keys().filter(|id| desired.service_name(*id).is_none()));
            // Programmed backends that are not desired: the scan of
            // programmed ids below.
            k
        } else {
            let mut k = KeyLists::of(dirty);
            k.frontends
                .extend(self.retry.iter().filter(|f| !dirty.frontends.contains(*f)));
            k
        };
        self.retry.clear();
        self.unprogrammable.clear();
        let mut summary = PlanSummary::default();
        let mut plan = Plan::default();

        for id in &keys.names {
            match (desired.service_name(*id), self.names.get(*id)) {
                (Some(want), have) if have != Some(want) => {
                    plan.names.push(Op::SetServiceName(*id, want.clone()))
                }
                (None, Some(_)) => plan.remove_names.push(Op::RemoveServiceName(*id)),
                _ => {}
            }
        }
        // Backends: new ones get ids; changed ones (e.g. now terminating)
        // are rewritten in place.
        if dirty.all {
            let n = desired.backend_count();
            self.backend_ids.reserve(n.saturating_sub(self.backend_ids.len()));
            plan.set_backends.reserve(n);
            desired.for_each_backend(&mut |key, want| self.plan_backend(key, want, &mut plan, &mut summary));
        } else {
            plan.set_backends.reserve(keys.backends.len());
            for key in &keys.backends {
                if let Some(want) = desired.backend(key) {
                    self.plan_backend(key, want, &mut plan, &mut summary);
                }
            }
        }
        for r in &keys.source_ranges {
            if desired.has_source_range(r.0, r.1) && !self.source_ranges.contains(r) {
                plan.adds.push(Op::AddSourceRange(r.0, r.1));
            }
        }
        for a in &keys.service_addresses {
            if desired.has_service_address(*a) && !self.service_addresses.contains(a) {
                plan.adds.push(Op::SetServiceAddress(*a));
            }
        }
        // Backends that may go: no longer desired (or duplicates, or
        // waiting for frontends to stop naming them). They go once no
        // frontend slot names them after this plan's frontend writes.
        let mut candidates: BTreeSet<BackendId> = std::mem::take(&mut self.deferred);
        if !dirty.all {
            for key in &keys.backends {
                if desired.backend(key).is_none()
                    && let Some(id) = self.backend_ids.get(key)
                {
                    candidates.insert(*id);
                }
            }
        } else {
            for id in self.programmed_ids() {
                let b = self.backend(id).expect("programmed");
                if self.backend_ids.get(&b.key()) != Some(&id) || desired.backend(&b.key()).is_none() {
                    candidates.insert(id);
                }
            }
        }
        // Frontends, created, changed or removed.
        let mut refs_delta: HashMap<BackendId, i64> = HashMap::new();
        let mut count_refs = |ids: &mut dyn Iterator<Item = &BackendId>, by: i64| {
            if !candidates.is_empty() {
                for id in ids.filter(|id| candidates.contains(id)) {
                    *refs_delta.entry(*id).or_default() += by;
                }
            }
        };
        plan.set_frontends.reserve(keys.frontends.len());
        for fe in &keys.frontends {
            let mut unresolved = false;
            // What has no id is left out (the rest is served) and retried
            // by the next plan: the ids of backends this plan removes are
            // free then.
            let want = desired.frontend(fe, &mut |k| {
                let id = self.backend_ids.get(k).copied().or_else(|| {
                    // A backend no dirty key named (its id could not be
                    // allocated before): try now.
                    let want = desired.backend(k)?;
                    self.plan_backend(k, want, &mut plan, &mut summary);
                    self.backend_ids.get(k).copied()
                });
                unresolved |= id.is_none();
                id
            });
            let want = want.inspect(|entry| {
                if unresolved {
                    self.unprogrammable.push(Unprogrammable {
                        frontend: *fe,
                        service_id: entry.service_id,
                    });
                    self.retry.insert(*fe);
                    summary.skipped += 1;
                }
            });
            let have = self.frontends.get(fe);
            // A damaged frontend is rewritten whatever it looks like, and
            // its stale slots are those its slot 0 claims.
            let damaged = self.damaged.get(fe).copied();
            let previous = damaged.or(have.map(Mirrored::slot_counts));
            match (want, have) {
                (Some(want), have) if !have.is_some_and(|h| h.matches(&want)) || damaged.is_some() => {
                    if let Some(h) = have {
                        count_refs(&mut h.all_backends(), -1);
                    }
                    count_refs(&mut want.all_backends(), 1);
                    plan.set_frontends.push(Op::SetFrontend {
                        frontend: *fe,
                        previous,
                        entry: Box::new(want),
                    });
                    summary.frontends_set += 1;
                }
                (None, Some(h)) => {
                    count_refs(&mut h.all_backends(), -1);
                    plan.removals.push(Op::RemoveFrontend {
                        frontend: *fe,
                        previous: previous.unwrap_or(h.slot_counts()),
                    });
                    summary.frontends_removed += 1;
                }
                _ => {}
            }
        }
        for a in &keys.service_addresses {
            if !desired.has_service_address(*a) && self.service_addresses.contains(a) {
                plan.removals.push(Op::RemoveServiceAddress(*a));
            }
        }
        for r in &keys.source_ranges {
            if !desired.has_source_range(r.0, r.1) && self.source_ranges.contains(r) {
                plan.removals.push(Op::RemoveSourceRange(r.0, r.1));
            }
        }
        plan.removals
            .extend(self.strays.iter().map(|s| Op::RemoveStraySlot(*s)));
        for id in candidates {
            let still = self.refs(id) as i64 + refs_delta.get(&id).copied().unwrap_or(0);
            if still > 0 {
                self.deferred.insert(id);
                continue;
            }
            match self.backend(id) {
                Some(b) => {
                    plan.remove_backends.push(Op::RemoveBackend(id, b.addr));
                    summary.backends_removed += 1;
                    if b.proto == Protocol::Udp {
                        plan.purged.push((b.addr, b.port));
                    }
                }
                None => {
                    // Allocated by a plan, never written: just forget it.
                    self.forget_id(id);
                }
            }
        }
        let ops = plan.into_ops();
        summary.ops = ops.len();
        (ops, summary)
    }

    /// Gives `key` an id if it has none and plans its write if the maps do
    /// not hold it as `want`.
    fn plan_backend(&mut self, key: &BackendKey, want: Backend, plan: &mut Plan, summary: &mut PlanSummary) {
        let entry = self.backend_ids.entry(*key);
        let id = match entry.get() {
            Some(id) => *id,
            None => {
                if plan.no_ids_left {
                    return;
                }
                let Some(id) = self.ids.allocate().and_then(BackendId::new) else {
                    plan.no_ids_left = true;
                    return;
                };
                entry.or_insert_with(|| id);
                *slot(&mut self.pending, id) = true;
                id
            }
        };
        let have = self.backend(id);
        if have == Some(want) {
            return;
        }
        // A UDP endpoint that stops serving: its flows move on.
        if want.proto == Protocol::Udp && !want.serving && have.is_some_and(|h| h.serving) {
            plan.purged.push((want.addr, want.port));
        }
        plan.set_backends.push(Op::SetBackend(id, want));
        summary.backends_set += 1;
    }

    fn forget_id(&mut self, id: BackendId) {
        *slot(&mut self.pending, id) = false;
        self.backend_ids.retain(|_, v| *v != id);
        if self.refs(id) == 0 {
            self.ids.release(id.get());
        }
    }

    /// Records that `op` is in the maps.
    pub fn applied(&mut self, op: &Op) {
        match op {
            Op::SetServiceName(id, name) => {
                self.names.insert(*id, name.clone());
            }
            Op::SetBackend(id, b) => {
                self.backends.set(*id, Some(*b));
                *slot(&mut self.pending, *id) = false;
            }
            Op::AddSourceRange(id, r) => {
                self.source_ranges.insert((*id, *r));
            }
            Op::SetServiceAddress(a) => {
                self.service_addresses.insert(*a, ());
            }
            Op::SetFrontend { frontend, entry, .. } => {
                self.damaged.remove(frontend);
                for id in entry.all_backends() {
                    *slot(&mut self.refs, *id) += 1;
                }
                self.frontend_entries += entries_of(entry);
                if let Some(old) = self.frontends.insert(*frontend, Mirrored::of(entry)) {
                    self.frontend_entries -= old.entries();
                    self.unref(&old);
                }
            }
            Op::RemoveFrontend { frontend, .. } => {
                self.damaged.remove(frontend);
                if let Some(old) = self.frontends.remove(frontend) {
                    self.frontend_entries -= old.entries();
                    self.unref(&old);
                }
            }
            Op::RemoveServiceAddress(a) => {
                self.service_addresses.remove(a);
            }
            Op::RemoveSourceRange(id, r) => {
                self.source_ranges.remove(&(*id, *r));
            }
            Op::RemoveStraySlot(s) => {
                self.strays.remove(s);
            }
            Op::RemoveBackend(id, _) => {
                if let Some(b) = self.backends.set(*id, None)
                    && self.backend_ids.get(&b.key()) == Some(id)
                {
                    self.backend_ids.remove(&b.key());
                }
                self.deferred.remove(id);
                if self.refs(*id) == 0 {
                    self.ids.release(id.get());
                }
            }
            Op::RemoveServiceName(id) => {
                self.names.remove(*id);
            }
            Op::PurgeUdpFlows(_) => {}
        }
    }

    /// Drops the slot references of a replaced or removed entry; an id that
    /// nothing owns any more (it was only referenced) goes back to the free
    /// list.
    fn unref(&mut self, old: &Mirrored) {
        let capacity = self.ids.capacity();
        for id in old.all_backends().filter(|id| id.get() < capacity) {
            let r = slot(&mut self.refs, *id);
            *r = r.saturating_sub(1);
            if *r == 0
                && self.backend(*id).is_none()
                && !self.pending.get(id.get() as usize).copied().unwrap_or(false)
            {
                let owned = self.backend_ids.values().any(|v| v == id);
                if !owned {
                    self.ids.release(id.get());
                }
            }
        }
    }

    /// Applies `ops` through `writer` and records the ones done; on failure
    /// returns the index of the op that failed and its error (everything
    /// before it is done and recorded).
    pub fn execute<W: MapWriter>(&mut self, writer: &mut W, ops: &[Op]) -> Result<(), (usize, W::Error)> {
        let result = writer.apply_all(ops);
        let done = match &result {
            Ok(()) => ops.len(),
            Err((n, _)) => *n,
        };
        for op in &ops[..done] {
            self.applied(op);
        }
        result
    }

    /// Plans every key against a whole table and applies it: what tests and
    /// benchmarks use to program a table directly. Stops at the first
    /// failure.
    pub fn sync<W: MapWriter>(
        &mut self,
        writer: &mut W,
        desired: &DesiredTable,
    ) -> Result<PlanSummary, W::Error> {
        let (ops, summary) = self.plan(desired, &Dirty::all());
        self.execute(writer, &ops).map_err(|(_, e)| e)?;
        writer.flush()?;
        Ok(summary)
    }
}

/// A frontend entry as the mirror keeps it (a hundred thousand are): the
/// ids of both sets in one slice, the flags in a word; 48 bytes and one
/// allocation instead of 96 and one or two.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Mirrored {
    service_id: u32,
    /// How many of `ids` are the external set's (the in-cluster set's
    /// follow).
    split: u32,
    flags: u16,
    affinity_timeout: Option<std::time::Duration>,
    ids: Box<[BackendId]>,
}

// The low two bits: the kind.
const M_MASQUERADE: u16 = 1 << 2;
const M_SOURCE_RANGES: u16 = 1 << 3;
const M_EXTERNAL_LOCAL: u16 = 1 << 4;
const M_INTERNAL_LOCAL: u16 = 1 << 5;
const M_TWO_SETS: u16 = 1 << 6;
const M_REJECT: u16 = 1 << 7;
const M_INTERNAL_REJECT: u16 = 1 << 8;
const M_DSR: u16 = 1 << 9;
const M_MAGLEV: u16 = 1 << 10;

fn kind_bits(kind: FrontendKind) -> u16 {
    match kind {
        FrontendKind::ClusterIp => 0,
        FrontendKind::NodePort => 1,
        FrontendKind::ExternalIp => 2,
        FrontendKind::LoadBalancer => 3,
    }
}

fn reject(set: &BackendSet) -> bool {
    set.when_empty == EmptyVerdict::Reject
}

impl Mirrored {
    fn flags_of(e: &FrontendEntry) -> u16 {
        let mut flags = kind_bits(e.kind);
        for (on, flag) in [
            (e.masquerade, M_MASQUERADE),
            (e.source_ranges, M_SOURCE_RANGES),
            (e.external_local, M_EXTERNAL_LOCAL),
            (e.internal_local, M_INTERNAL_LOCAL),
            (e.internal_backends.is_some(), M_TWO_SETS),
            (reject(&e.backends), M_REJECT),
            (
                e.internal_backends.as_ref().is_some_and(reject),
                M_INTERNAL_REJECT,
            ),
            (e.dsr, M_DSR),
            (e.maglev, M_MAGLEV),
        ] {
            if on {
                flags |= flag;
            }
        }
        flags
    }

    fn of(e: &FrontendEntry) -> Self {
        Self {
            service_id: e.service_id,
            split: e.backends.backends.len() as u32,
            flags: Self::flags_of(e),
            affinity_timeout: e.affinity_timeout,
            ids: e.all_backends().copied().collect(),
        }
    }

    /// Whether it is `e`.
    fn matches(&self, e: &FrontendEntry) -> bool {
        self.service_id == e.service_id
            && self.flags == Self::flags_of(e)
            && self.affinity_timeout == e.affinity_timeout
            && self.split as usize == e.backends.backends.len()
            && self.ids.iter().eq(e.all_backends())
    }

    /// Every backend it names (both sets).
    fn all_backends(&self) -> impl Iterator<Item = &BackendId> {
        self.ids.iter()
    }

    fn slot_counts(&self) -> SlotCounts {
        SlotCounts {
            external: self.split as u16,
            internal: (self.flags & M_TWO_SETS != 0).then_some((self.ids.len() - self.split as usize) as u16),
        }
    }

    /// Services-map entries: slot 0 and the slots of each set.
    fn entries(&self) -> usize {
        1 + self.ids.len() + (self.flags & M_TWO_SETS != 0) as usize
    }
}

/// Services-map entries of a frontend: slot 0 and the slots of each set.
fn entries_of(e: &FrontendEntry) -> usize {
    1 + e.backends.backends.len() + e.internal_backends.as_ref().map_or(0, |s| 1 + s.backends.len())
}

/// The element of a vector indexed by backend id, growing it as needed.
fn slot<T: Default>(v: &mut Vec<T>, id: BackendId) -> &mut T {
    let i = id.get() as usize;
    if v.len() <= i {
        v.resize_with(i + 1, T::default);
    }
    &mut v[i]
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        net::Protocol,
        state::{
            fake::FakeMaps,
            table::{BackendSet, EmptyVerdict, FrontendKind},
        },
    };

    /// xorshift: deterministic pseudo-random tables without a dependency.
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
    }

    fn key(last: u8, proto: Protocol) -> BackendKey {
        BackendKey {
            addr: IpAddr::from([10, 0, 0, last]),
            port: 8080,
            proto,
        }
    }

    fn backend(k: BackendKey, serving: bool) -> Backend {
        Backend {
            addr: k.addr,
            port: k.port,
            proto: k.proto,
            serving,
            terminating: !serving,
            local: false,
        }
    }

    fn random_table(rng: &mut Rng) -> DesiredTable {
        let mut t = DesiredTable::default();
        for svc in 0..rng.below(6) as u32 {
            let proto = if rng.below(2) == 0 {
                Protocol::Tcp
            } else {
                Protocol::Udp
            };
            let keys: Vec<BackendKey> = (0..rng.below(5))
                .map(|_| key(rng.below(12) as u8, proto))
                .collect();
            for k in &keys {
                t.backends.insert(*k, backend(*k, rng.below(4) != 0));
            }
            let set = BackendSet {
                backends: keys.clone(),
                when_empty: EmptyVerdict::Reject,
            };
            let ranged = rng.below(3) == 0;
            if ranged {
                t.source_ranges.insert((svc, "198.51.100.0/24".parse().unwrap()));
            }
            let addr = IpAddr::from([10, 96, 0, svc as u8]);
            t.service_addresses.insert(addr);
            t.frontends.insert(
                Frontend {
                    addr,
                    port: 80,
                    proto,
                },
                FrontendEntry {
                    service_id: svc,
                    kind: FrontendKind::LoadBalancer,
                    backends: set.clone(),
                    internal_backends: (rng.below(2) == 0).then_some(set),
                    masquerade: false,
                    affinity_timeout: None,
                    source_ranges: ranged,
                    external_local: false,
                    internal_local: false,
                    dsr: false,
                    maglev: false,
                },
            );
        }
        t
    }

    #[test]
    fn applying_the_plan_yields_the_desired_table_and_never_a_dangling_reference() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        let mut p = Programmer::new(64);
        let mut maps = FakeMaps::default();
        for round in 0..500 {
            let desired = random_table(&mut rng);
            p.sync(&mut maps, &desired).unwrap();
            // The fake now holds exactly the desired table, ids resolved.
            assert_eq!(maps.frontends.len(), desired.frontends.len(), "round {round}");
            for (f, e) in &desired.frontends {
                let got = &maps.frontends[f];
                let names: Vec<BackendKey> = got
                    .backends
                    .backends
                    .iter()
                    .map(|id| {
                        let b = maps.backends[id];
                        key(
                            match b.addr {
                                IpAddr::V4(a) => a.octets()[3],
                                IpAddr::V6(a) => a.octets()[15],
                            },
                            b.proto,
                        )
                    })
                    .collect();
                assert_eq!(names, e.backends.backends, "round {round}");
            }
            assert_eq!(maps.backends.len(), desired.backends.len(), "round {round}");
            assert_eq!(maps.addresses, desired.service_addresses);
            assert_eq!(maps.ranges, desired.source_ranges);
            // A second plan of the same table changes nothing.
            assert!(
                p.plan(&desired, &Dirty::all()).0.is_empty(),
                "round {round}: not minimal"
            );
        }
    }

    #[test]
    fn ids_are_not_reused_while_referenced_and_are_reused_after_release() {
        let mut ids = IdAllocator::new(1, 4);
        let a = ids.allocate().unwrap();
        let b = ids.allocate().unwrap();
        let c = ids.allocate().unwrap();
        assert_eq!([a, b, c], [1, 2, 3]);
        assert!(ids.allocate().is_none(), "capacity 4 holds ids 1..=3");
        ids.release(b);
        assert_eq!(ids.allocate(), Some(b));
    }

    #[test]
    fn udp_flows_are_purged_when_their_endpoint_stops_serving_or_goes() {
        let mut p = Programmer::new(64);
        let mut maps = FakeMaps::default();
        let (k1, k2) = (key(1, Protocol::Udp), key(2, Protocol::Udp));
        let mut t = DesiredTable::default();
        t.backends.insert(k1, backend(k1, true));
        t.backends.insert(k2, backend(k2, true));
        p.sync(&mut maps, &t).unwrap();
        assert!(maps.purged.is_empty());

        t.backends.insert(k1, backend(k1, false)); // stops serving
        p.sync(&mut maps, &t).unwrap();
        assert_eq!(maps.purged, [(k1.addr, k1.port)]);

        t.backends.remove(&k2); // goes
        p.sync(&mut maps, &t).unwrap();
        assert_eq!(maps.purged, [(k1.addr, k1.port), (k2.addr, k2.port)]);
    }

    #[test]
    fn tcp_backends_are_never_purged() {
        let mut p = Programmer::new(64);
        let mut maps = FakeMaps::default();
        let k = key(1, Protocol::Tcp);
        let mut t = DesiredTable::default();
        t.backends.insert(k, backend(k, true));
        p.sync(&mut maps, &t).unwrap();
        t.backends.clear();
        let (ops, _) = p.plan(&t, &Dirty::all());
        assert!(
            !ops.iter().any(|op| matches!(op, Op::PurgeUdpFlows(_))),
            "{ops:?}"
        );
    }

    fn one_frontend(keys: &[BackendKey]) -> DesiredTable {
        let mut t = DesiredTable::default();
        for k in keys {
            t.backends.insert(*k, backend(*k, true));
        }
        t.frontends.insert(
            Frontend {
                addr: IpAddr::from([10, 96, 0, 1]),
                port: 80,
                proto: Protocol::Tcp,
            },
            FrontendEntry {
                service_id: 0,
                kind: FrontendKind::ClusterIp,
                backends: BackendSet {
                    backends: keys.to_vec(),
                    when_empty: EmptyVerdict::Reject,
                },
                internal_backends: None,
                masquerade: false,
                affinity_timeout: None,
                source_ranges: false,
                external_local: false,
                internal_local: false,
                dsr: false,
                maglev: false,
            },
        );
        t
    }

    #[test]
    fn a_full_backends_map_programs_what_fits_and_converges_once_ids_are_free() {
        // Ids 1..=2 only.
        let mut p = Programmer::new(3);
        let mut maps = FakeMaps::default();
        let (a, b, c) = (
            key(1, Protocol::Tcp),
            key(2, Protocol::Tcp),
            key(3, Protocol::Tcp),
        );
        let backends = |maps: &FakeMaps| -> Vec<BackendKey> {
            let e = maps.frontends.values().next().unwrap();
            e.backends
                .backends
                .iter()
                .map(|id| maps.backends[id].key())
                .collect()
        };
        p.sync(&mut maps, &one_frontend(&[a, b])).unwrap();
        let summary = p.sync(&mut maps, &one_frontend(&[a, b, c])).unwrap();
        assert_eq!(summary.skipped, 1);
        assert_eq!(p.unprogrammable().len(), 1);
        assert_eq!(backends(&maps), [a, b], "what has an id is served");
        // c alone: a and b go first, which frees ids for the next plan.
        let t = one_frontend(&[c]);
        p.sync(&mut maps, &t).unwrap();
        assert!(p.has_retries());
        assert_eq!(maps.backends.len(), 0);
        let (ops, summary) = p.plan(&t, &Dirty::default());
        assert_eq!(summary.skipped, 0);
        p.execute(&mut maps, &ops).unwrap();
        assert_eq!(backends(&maps), [c]);
        assert!(!p.has_retries());
    }

    #[test]
    fn after_a_reset_the_plan_repairs_what_changed_behind_the_mirror() {
        let mut p = Programmer::new(64);
        let mut maps = FakeMaps::default();
        let (a, b) = (key(1, Protocol::Tcp), key(2, Protocol::Tcp));
        let t = one_frontend(&[a, b]);
        p.sync(&mut maps, &t).unwrap();
        // Someone deletes a backend the frontend names, and adds a stray
        // backend and a duplicate of b.
        let id_a = p.backend_id(&a).unwrap();
        maps.backends.remove(&id_a);
        let stray = BackendId::new(40).unwrap();
        maps.backends.insert(stray, backend(key(9, Protocol::Tcp), true));
        let dup = BackendId::new(41).unwrap();
        maps.backends.insert(dup, backend(b, true));
        maps.check = false;
        let kernel = maps.read_table().unwrap();
        let drift = p.reset(&kernel);
        assert_eq!(drift, 3);
        let (ops, _) = p.plan(&t, &Dirty::all());
        p.execute(&mut maps, &ops).unwrap();
        // The frontend names backends that are there again, and the id it
        // named while its backend was gone was not reused meanwhile.
        maps.check = true;
        maps.check_invariants(&Op::PurgeUdpFlows(Vec::new()));
        let resolved: BTreeMap<u32, BackendKey> =
            maps.backends.iter().map(|(i, b)| (i.get(), b.key())).collect();
        assert_eq!(resolved.len(), 2, "{resolved:?}");
        assert!(p.plan(&t, &Dirty::all()).0.is_empty());
    }
}
