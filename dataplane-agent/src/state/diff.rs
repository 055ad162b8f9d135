//! From (current, desired) to ordered map operations.
//!
//! [`Programmer`] remembers what it wrote (the current table) and turns each
//! new desired table into the minimal list of [`Op`]s, ordered so that a
//! packet never sees a half-written service: backends and source ranges
//! first, then frontends (each written slots-then-slot-0 by the map layer),
//! removals last and in reverse. Backend ids come from a free list and are
//! released only once no frontend refers to them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use super::desired::{BackendKey, DesiredTable};
use crate::{
    dataplane::{Backend, BackendId, BackendSet, DatapathError, Frontend, FrontendEntry, LbMaps},
    net::Ipv4Cidr,
};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    SetBackend(BackendId, Backend),
    AddSourceRange(u32, Ipv4Cidr),
    SetServiceAddress(Ipv4Addr),
    SetFrontend(Frontend, FrontendEntry),
    RemoveFrontend(Frontend),
    RemoveServiceAddress(Ipv4Addr),
    RemoveSourceRange(u32, Ipv4Cidr),
    RemoveBackend(BackendId),
    /// Clear UDP conntrack entries pinned to backends that are gone.
    PurgeUdpFlows(Vec<BackendId>),
}

/// Applies operations: the real maps, or a fake in tests.
pub trait MapWriter {
    fn apply(&mut self, op: &Op) -> Result<(), DatapathError>;
}

impl MapWriter for LbMaps {
    fn apply(&mut self, op: &Op) -> Result<(), DatapathError> {
        match op {
            Op::SetBackend(id, b) => self.set_backend(*id, b),
            Op::AddSourceRange(id, r) => self.add_source_range(*id, *r),
            Op::SetServiceAddress(a) => self.set_service_address(*a),
            Op::SetFrontend(fe, e) => self.set_frontend(fe, e),
            Op::RemoveFrontend(fe) => self.remove_frontend(fe),
            Op::RemoveServiceAddress(a) => self.remove_service_address(*a),
            Op::RemoveSourceRange(id, r) => self.remove_source_range(*id, *r),
            Op::RemoveBackend(id) => self.remove_backend(*id),
            Op::PurgeUdpFlows(ids) => self.purge_udp_flows_to(ids).map(|_| ()),
        }
    }
}

/// Backend ids: lowest free first, never 0, never beyond `capacity - 1`.
#[derive(Clone, Debug)]
pub struct IdAllocator {
    free: BTreeSet<u32>,
    next: u32,
    capacity: u32,
}

impl IdAllocator {
    pub fn new(capacity: u32) -> Self {
        Self {
            free: BTreeSet::new(),
            next: 1,
            capacity,
        }
    }

    pub fn allocate(&mut self) -> Option<BackendId> {
        if let Some(id) = self.free.pop_first() {
            return BackendId::new(id);
        }
        if self.next >= self.capacity {
            return None;
        }
        self.next += 1;
        BackendId::new(self.next - 1)
    }

    pub fn release(&mut self, id: BackendId) {
        self.free.insert(id.get());
    }

    /// Rebuilds the allocator around ids found in use (after a restart).
    pub fn adopt(capacity: u32, in_use: impl IntoIterator<Item = BackendId>) -> Self {
        let used: BTreeSet<u32> = in_use.into_iter().map(BackendId::get).collect();
        let next = used.last().map_or(1, |m| m + 1);
        Self {
            free: (1..next).filter(|i| !used.contains(i)).collect(),
            next,
            capacity,
        }
    }
}

/// What the maps hold (as far as this process wrote them) and how to move
/// them to a desired table.
#[derive(Clone, Debug)]
pub struct Programmer {
    ids: IdAllocator,
    backend_ids: BTreeMap<BackendKey, BackendId>,
    backends: BTreeMap<BackendKey, Backend>,
    frontends: BTreeMap<Frontend, FrontendEntry>,
    service_addresses: BTreeSet<Ipv4Addr>,
    source_ranges: BTreeSet<(u32, Ipv4Cidr)>,
}

/// Counts of one plan, for logs and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanSummary {
    pub ops: usize,
    pub frontends_set: usize,
    pub frontends_removed: usize,
    pub backends_set: usize,
    pub backends_removed: usize,
    /// Frontends skipped because a backend id could not be allocated.
    pub skipped: usize,
}

impl Programmer {
    pub fn new(backend_capacity: u32) -> Self {
        Self {
            ids: IdAllocator::new(backend_capacity),
            backend_ids: BTreeMap::new(),
            backends: BTreeMap::new(),
            frontends: BTreeMap::new(),
            service_addresses: BTreeSet::new(),
            source_ranges: BTreeSet::new(),
        }
    }

    /// Takes what the maps already hold as the current table (a restarted
    /// agent): the first plan then only changes what really differs, and
    /// removes nothing that is still desired.
    pub fn adopt(backend_capacity: u32, table: &crate::dataplane::MapTable) -> Self {
        let key = |b: &Backend| BackendKey {
            addr: b.addr,
            port: b.port,
            proto: b.proto,
        };
        Self {
            ids: IdAllocator::adopt(backend_capacity, table.backends.iter().map(|(id, _)| *id)),
            backend_ids: table.backends.iter().map(|(id, b)| (key(b), *id)).collect(),
            backends: table.backends.iter().map(|(_, b)| (key(b), *b)).collect(),
            frontends: table.frontends.iter().cloned().collect(),
            service_addresses: table.service_addresses.iter().copied().collect(),
            source_ranges: table.source_ranges.iter().copied().collect(),
        }
    }

    /// The id a backend has in the maps.
    pub fn backend_id(&self, key: &BackendKey) -> Option<BackendId> {
        self.backend_ids.get(key).copied()
    }

    /// The ordered operations that turn the current table into `desired`;
    /// the programmer then considers them done.
    pub fn plan(&mut self, desired: &DesiredTable) -> (Vec<Op>, PlanSummary) {
        let mut ops = Vec::new();
        let mut summary = PlanSummary::default();
        // UDP flows pinned to an endpoint that stops serving (or goes) are
        // cleared, as kube-proxy does, so that e.g. DNS clients move on.
        let mut purged = Vec::new();

        // 1. Backends: new ones get ids; changed ones (e.g. now terminating)
        //    are rewritten in place.
        for (key, backend) in &desired.backends {
            let id = match self.backend_ids.get(key) {
                Some(id) => *id,
                None => match self.ids.allocate() {
                    Some(id) => {
                        self.backend_ids.insert(*key, id);
                        id
                    }
                    None => continue, // frontends using it are skipped below
                },
            };
            if self.backends.get(key) != Some(backend) {
                if key.proto == crate::net::Protocol::Udp
                    && !backend.serving
                    && self.backends.get(key).is_some_and(|old| old.serving)
                {
                    purged.push(id);
                }
                self.backends.insert(*key, *backend);
                ops.push(Op::SetBackend(id, *backend));
                summary.backends_set += 1;
            }
        }
        // 2. Source ranges and service addresses before the frontends that
        //    rely on them.
        for r in desired.source_ranges.difference(&self.source_ranges) {
            ops.push(Op::AddSourceRange(r.0, r.1));
        }
        for a in desired.service_addresses.difference(&self.service_addresses) {
            ops.push(Op::SetServiceAddress(*a));
        }
        // 3. Frontends, created or changed.
        let mut frontends = BTreeMap::new();
        for (fe, entry) in &desired.frontends {
            let Some(entry) = self.resolve(entry) else {
                summary.skipped += 1;
                continue;
            };
            if self.frontends.get(fe) != Some(&entry) {
                ops.push(Op::SetFrontend(*fe, entry.clone()));
                summary.frontends_set += 1;
            }
            frontends.insert(*fe, entry);
        }
        // 4. Removals, in reverse order of dependence.
        for fe in self.frontends.keys().filter(|fe| !frontends.contains_key(fe)) {
            ops.push(Op::RemoveFrontend(*fe));
            summary.frontends_removed += 1;
        }
        self.frontends = frontends;
        for a in self.service_addresses.difference(&desired.service_addresses) {
            ops.push(Op::RemoveServiceAddress(*a));
        }
        for r in self.source_ranges.difference(&desired.source_ranges) {
            ops.push(Op::RemoveSourceRange(r.0, r.1));
        }
        self.service_addresses = desired.service_addresses.clone();
        self.source_ranges = desired.source_ranges.clone();
        let gone: Vec<BackendKey> = self
            .backend_ids
            .keys()
            .filter(|k| !desired.backends.contains_key(k))
            .copied()
            .collect();
        for key in gone {
            let id = self.backend_ids.remove(&key).expect("listed above");
            self.backends.remove(&key);
            ops.push(Op::RemoveBackend(id));
            self.ids.release(id);
            summary.backends_removed += 1;
            if key.proto == crate::net::Protocol::Udp {
                purged.push(id);
            }
        }
        if !purged.is_empty() {
            ops.push(Op::PurgeUdpFlows(purged));
        }
        summary.ops = ops.len();
        (ops, summary)
    }

    fn resolve(&self, entry: &FrontendEntry<BackendKey>) -> Option<FrontendEntry> {
        let set = |s: &BackendSet<BackendKey>| -> Option<BackendSet> {
            Some(BackendSet {
                backends: s
                    .backends
                    .iter()
                    .map(|k| self.backend_ids.get(k).copied())
                    .collect::<Option<Vec<_>>>()?,
                when_empty: s.when_empty,
            })
        };
        Some(FrontendEntry {
            service_id: entry.service_id,
            kind: entry.kind,
            backends: set(&entry.backends)?,
            internal_backends: match &entry.internal_backends {
                Some(s) => Some(set(s)?),
                None => None,
            },
            masquerade: entry.masquerade,
            affinity_timeout: entry.affinity_timeout,
            source_ranges: entry.source_ranges,
            external_local: entry.external_local,
            internal_local: entry.internal_local,
        })
    }

    /// Forgets that an operation was done (it failed), so the next plan
    /// tries it again. Frontends and backends are the ops that can fail on
    /// bad input or full maps.
    pub fn forget(&mut self, op: &Op) {
        match op {
            Op::SetFrontend(fe, _) => {
                self.frontends.remove(fe);
            }
            Op::SetBackend(id, _) => {
                if let Some(key) = self.backend_ids.iter().find(|(_, v)| *v == id).map(|(k, _)| *k) {
                    self.backends.remove(&key);
                }
            }
            Op::SetServiceAddress(a) => {
                self.service_addresses.remove(a);
            }
            Op::AddSourceRange(id, r) => {
                self.source_ranges.remove(&(*id, *r));
            }
            _ => {}
        }
    }

    /// Plans and applies; stops at the first failing operation.
    pub fn sync(
        &mut self,
        writer: &mut impl MapWriter,
        desired: &DesiredTable,
    ) -> Result<PlanSummary, DatapathError> {
        let (ops, summary) = self.plan(desired);
        for op in &ops {
            writer.apply(op)?;
        }
        Ok(summary)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        dataplane::{EmptyVerdict, FrontendKind},
        net::Protocol,
    };

    /// The maps as a fake: checks make-before-break after every operation.
    #[derive(Default)]
    struct FakeMaps {
        backends: BTreeMap<BackendId, Backend>,
        frontends: BTreeMap<Frontend, FrontendEntry>,
        addresses: BTreeSet<Ipv4Addr>,
        ranges: BTreeSet<(u32, Ipv4Cidr)>,
        purged: Vec<BackendId>,
    }

    impl MapWriter for FakeMaps {
        fn apply(&mut self, op: &Op) -> Result<(), DatapathError> {
            match op {
                Op::SetBackend(id, b) => {
                    self.backends.insert(*id, *b);
                }
                Op::AddSourceRange(id, r) => {
                    self.ranges.insert((*id, *r));
                }
                Op::SetServiceAddress(a) => {
                    self.addresses.insert(*a);
                }
                Op::SetFrontend(f, e) => {
                    self.frontends.insert(*f, e.clone());
                }
                Op::RemoveFrontend(f) => {
                    self.frontends.remove(f);
                }
                Op::RemoveServiceAddress(a) => {
                    self.addresses.remove(a);
                }
                Op::RemoveSourceRange(id, r) => {
                    self.ranges.remove(&(*id, *r));
                }
                Op::RemoveBackend(id) => {
                    self.backends.remove(id);
                }
                Op::PurgeUdpFlows(ids) => self.purged.extend(ids),
            }
            // No packet may ever see a frontend pointing at a missing backend.
            for (f, e) in &self.frontends {
                let sets = std::iter::once(&e.backends).chain(e.internal_backends.as_ref());
                for id in sets.flat_map(|s| &s.backends) {
                    assert!(
                        self.backends.contains_key(id),
                        "{f:?} refers to missing backend {id:?} after {op:?}"
                    );
                }
                if e.source_ranges {
                    assert!(
                        self.ranges.iter().any(|(sid, _)| *sid == e.service_id),
                        "{f:?} ranges missing"
                    );
                }
            }
            Ok(())
        }
    }

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
            addr: Ipv4Addr::new(10, 0, 0, last),
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
            let addr = Ipv4Addr::new(10, 96, 0, svc as u8);
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
                        key(b.addr.octets()[3], b.proto)
                    })
                    .collect();
                assert_eq!(names, e.backends.backends, "round {round}");
            }
            assert_eq!(maps.backends.len(), desired.backends.len(), "round {round}");
            assert_eq!(maps.addresses, desired.service_addresses);
            assert_eq!(maps.ranges, desired.source_ranges);
            // A second plan of the same table changes nothing.
            assert!(p.plan(&desired).0.is_empty(), "round {round}: not minimal");
        }
    }

    #[test]
    fn ids_are_not_reused_while_referenced_and_are_reused_after_release() {
        let mut ids = IdAllocator::new(4);
        let a = ids.allocate().unwrap();
        let b = ids.allocate().unwrap();
        let c = ids.allocate().unwrap();
        assert_eq!([a.get(), b.get(), c.get()], [1, 2, 3]);
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
        let (id1, id2) = (p.backend_id(&k1).unwrap(), p.backend_id(&k2).unwrap());
        assert!(maps.purged.is_empty());

        t.backends.insert(k1, backend(k1, false)); // stops serving
        p.sync(&mut maps, &t).unwrap();
        assert_eq!(maps.purged, [id1]);

        t.backends.remove(&k2); // goes
        p.sync(&mut maps, &t).unwrap();
        assert_eq!(maps.purged, [id1, id2]);
    }

    #[test]
    fn tcp_backends_are_never_purged() {
        let mut p = Programmer::new(64);
        let k = key(1, Protocol::Tcp);
        let mut t = DesiredTable::default();
        t.backends.insert(k, backend(k, true));
        p.plan(&t);
        t.backends.clear();
        let (ops, _) = p.plan(&t);
        assert!(
            !ops.iter().any(|op| matches!(op, Op::PurgeUdpFlows(_))),
            "{ops:?}"
        );
    }
}
