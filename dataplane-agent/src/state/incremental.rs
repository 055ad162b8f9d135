//! The desired table kept up to date one Service port at a time.
//!
//! Each port's [`Contribution`] is kept; setting a port withdraws its old
//! contribution and adds the new one, and records which keys (frontends,
//! backends, addresses, ranges, names) that touched. The diff then looks
//! only at those keys, so one EndpointSlice change costs what it touches,
//! not the size of the table.
//!
//! Two things involve more than one port and are kept exact:
//! - Ownership of every frontend: all its claimants, ordered by [`Rank`];
//!   the first holds it. When the holder goes, the next one takes over.
//! - Claims on every backend: a backend stays while any port names it, with
//!   the merged view of all of them ([`BackendClaims`]).
//!
//! The result is the same as [`super::desired::compute`] over all ports in
//! rank order (the property test in `agent::sync` checks it).

use foldhash::{HashMap, HashSet};
use std::{collections::BTreeMap, net::IpAddr};

use super::{
    backend_map::{AddrMap, BackendMap},
    desired::{BackendClaims, Contribution, Rank},
    stored::StoredContribution,
    table::{Backend, BackendKey, Frontend, FrontendEntry, FrontendKind, ServicePortName},
};
use crate::net::IpCidr;

/// Keys whose desired state may have changed since the last plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dirty {
    /// Every key (a full plan).
    pub all: bool,
    pub frontends: HashSet<Frontend>,
    pub backends: HashSet<BackendKey>,
    pub service_addresses: HashSet<IpAddr>,
    pub source_ranges: HashSet<(u32, IpCidr)>,
    /// Service ids whose name may have changed.
    pub names: HashSet<u32>,
}

impl Dirty {
    pub fn all() -> Self {
        Self {
            all: true,
            ..Default::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        !self.all
            && self.frontends.is_empty()
            && self.backends.is_empty()
            && self.service_addresses.is_empty()
            && self.source_ranges.is_empty()
            && self.names.is_empty()
    }
}

struct PortRecord {
    rank: Rank,
    contribution: StoredContribution,
}

/// [`BackendClaims`] in 8 bytes (a million are kept): counts up to
/// `u16::MAX - 1`; beyond (that many ports naming one backend), the claims
/// go on in the table's `many_claims`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PackedClaims([u16; 4]);

impl PackedClaims {
    const MANY: Self = Self([u16::MAX; 4]);

    fn of(c: &BackendClaims) -> Option<Self> {
        let n = |v: u32| u16::try_from(v).ok().filter(|v| *v < u16::MAX);
        Some(Self([
            n(c.claims)?,
            n(c.serving)?,
            n(c.terminating)?,
            n(c.local)?,
        ]))
    }

    fn is_many(&self) -> bool {
        *self == Self::MANY
    }

    fn unpack(&self) -> BackendClaims {
        let [claims, serving, terminating, local] = self.0.map(u32::from);
        BackendClaims {
            claims,
            serving,
            terminating,
            local,
        }
    }

    /// As [`BackendClaims::remove`] (not for `MANY`).
    fn remove(&mut self, b: &Backend) -> bool {
        let mut c = self.unpack();
        let left = c.remove(b);
        *self = Self::of(&c).expect("fewer than before");
        left
    }
}

/// One port's claim on a backend: how that port sees it (a byte: a
/// million are gathered when an empty table is filled).
#[derive(Clone, Copy, Debug)]
struct Claim {
    serving: bool,
    terminating: bool,
    local: bool,
}

impl Claim {
    fn of(b: &Backend) -> Self {
        Claim {
            serving: b.serving,
            terminating: b.terminating,
            local: b.local,
        }
    }

    fn backend(self, key: &BackendKey) -> Backend {
        Backend {
            addr: key.addr,
            port: key.port,
            proto: key.proto,
            serving: self.serving,
            terminating: self.terminating,
            local: self.local,
        }
    }
}

/// Adds a claim to `packed` (the claims map's entry of `key`).
fn add_claim(
    key: &BackendKey,
    packed: &mut PackedClaims,
    many: &mut HashMap<BackendKey, BackendClaims>,
    claim: Claim,
) {
    let b = claim.backend(key);
    if packed.is_many() {
        many.get_mut(key).expect("many claims").add(&b);
        return;
    }
    let mut claims = packed.unpack();
    claims.add(&b);
    match PackedClaims::of(&claims) {
        Some(fits) => *packed = fits,
        None => {
            *packed = PackedClaims::MANY;
            many.insert(*key, claims);
        }
    }
}

/// Claimants of a frontend in rank order (the first holds it); one, almost
/// always, kept without an allocation.
#[derive(Clone, Debug)]
struct Claimants {
    first: u32,
    rest: Vec<u32>,
}

impl Claimants {
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.first).chain(self.rest.iter().copied())
    }
}

/// The desired table, by Service port (keyed by service id).
#[derive(Default)]
pub struct ServiceTable {
    /// By service id (ids are dense).
    ports: Vec<Option<PortRecord>>,
    port_count: usize,
    /// Claimants of each frontend.
    frontends: HashMap<Frontend, Claimants>,
    /// Frontends with more than one claimant.
    contested: HashSet<Frontend>,
    /// The holders the pinned maps named when the agent started (frontend →
    /// service id; ids are adopted with their names): kept first among the
    /// claimants of a frontend whatever their rank, so that a restart does
    /// not hand a contested frontend to another Service (the existing holder
    /// keeps it). Left only for contested frontends they still hold, after
    /// each sync ([`ServiceTable::settle_incumbents`]).
    incumbents: HashMap<Frontend, u32>,
    backends: BackendMap<PackedClaims>,
    /// Claims of backends named by more ports than a `PackedClaims` counts.
    many_claims: HashMap<BackendKey, BackendClaims>,
    /// ClusterIPs, with the number of ports that have them.
    service_addresses: AddrMap<u32>,
    source_ranges: HashSet<(u32, IpCidr)>,
    /// Endpoints on this node: (address, service id) → how many of the
    /// port's backends have that address (one per target port).
    local: BTreeMap<(IpAddr, u32), u32>,
    dirty: Dirty,
    /// Record touched keys (off while every key is planned anyway).
    tracking: bool,
    /// While an empty table is filled with tracking off: the backends whose
    /// claims are still to be counted (all at once, in the claims map's
    /// order, when tracking turns on again).
    pending_claims: Option<Vec<(BackendKey, Claim)>>,
}

impl ServiceTable {
    pub fn new() -> Self {
        Self {
            tracking: true,
            ..Default::default()
        }
    }

    /// Whether to record the keys changes touch. Off while recomputing
    /// everything for a full plan (which looks at every key): a million
    /// touched backends need not be remembered.
    ///
    /// Filling an empty table (the first sync) with tracking off, the
    /// backends' claims are counted all at once when it turns on again:
    /// table queries are for after that.
    pub fn track(&mut self, on: bool) {
        self.tracking = on;
        if !on && self.backends.is_empty() && self.pending_claims.is_none() {
            self.pending_claims = Some(Vec::new());
        }
        if on {
            self.count_pending_claims();
        }
    }

    fn count_pending_claims(&mut self) {
        let Some(pending) = self.pending_claims.take() else {
            return;
        };
        let many = &mut self.many_claims;
        self.backends
            .update_all(&pending, |key, packed, claim| add_claim(key, packed, many, claim));
    }

    /// Room for `ports` ports and `backends` backends (before a full
    /// recompute: no rehashing on the way).
    pub fn reserve(&mut self, ports: usize, backends: usize) {
        self.frontends.reserve(ports.saturating_sub(self.frontends.len()));
        self.backends
            .reserve(backends.saturating_sub(self.backends.len()));
        self.service_addresses
            .reserve(ports.saturating_sub(self.service_addresses.len()));
    }

    pub fn port_count(&self) -> usize {
        self.port_count
    }

    fn port(&self, id: u32) -> Option<&PortRecord> {
        self.ports.get(id as usize).and_then(Option::as_ref)
    }

    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    pub fn backend_count(&self) -> usize {
        self.backends.len()
    }

    /// Sets what the port with service id `id` adds to the table (a new
    /// port, or a changed one). Nothing happens if it is unchanged.
    pub fn set_port(&mut self, id: u32, rank: Rank, contribution: Contribution) {
        let contribution = StoredContribution::new(contribution);
        if let Some(old) = self.port(id)
            && old.rank == rank
            && old.contribution == contribution
        {
            return;
        }
        self.remove_port(id);
        if self.tracking {
            self.dirty.names.insert(id);
        }
        let i = id as usize;
        if self.ports.len() <= i {
            self.ports.resize_with(i + 1, || None);
        }
        let record = self.ports[i].insert(PortRecord { rank, contribution });
        self.port_count += 1;
        let c = &record.contribution;
        for b in c.backends() {
            match &mut self.pending_claims {
                Some(pending) => pending.push((b.key(), Claim::of(&b))),
                None => add_claim(
                    &b.key(),
                    self.backends.entry(b.key()).or_default(),
                    &mut self.many_claims,
                    Claim::of(&b),
                ),
            }
            if b.local {
                *self.local.entry((b.addr, id)).or_default() += 1;
            }
            if self.tracking {
                self.dirty.backends.insert(b.key());
            }
        }
        for a in c.service_addresses() {
            *self.service_addresses.get_or_insert_with(a, || 0) += 1;
            if self.tracking {
                self.dirty.service_addresses.insert(a);
            }
        }
        for r in c.source_ranges() {
            self.source_ranges.insert((id, *r));
            if self.tracking {
                self.dirty.source_ranges.insert((id, *r));
            }
        }
        for at in 0.. {
            let record = self.ports[i].as_ref().expect("just set");
            let Some(fe) = record.contribution.frontend_at(at) else {
                break;
            };
            self.claim(fe, id);
        }
    }

    /// Withdraws everything the port added.
    pub fn remove_port(&mut self, id: u32) {
        let Some(old) = self.ports.get_mut(id as usize).and_then(Option::take) else {
            return;
        };
        // (Claims are counted before any is withdrawn.)
        self.count_pending_claims();
        self.port_count -= 1;
        let tracking = self.tracking;
        if tracking {
            self.dirty.names.insert(id);
        }
        let c = &old.contribution;
        for b in c.backends() {
            let key = b.key();
            let left = match self.backends.get_mut(&key) {
                Some(packed) if packed.is_many() => {
                    let many = self.many_claims.get_mut(&key).expect("many claims");
                    let left = many.remove(&b);
                    if let Some(fits) = PackedClaims::of(many) {
                        *packed = fits;
                        self.many_claims.remove(&key);
                    }
                    left
                }
                Some(packed) => packed.remove(&b),
                None => true,
            };
            if !left {
                self.backends.remove(&key);
            }
            if b.local
                && let Some(n) = self.local.get_mut(&(b.addr, id))
            {
                *n -= 1;
                if *n == 0 {
                    self.local.remove(&(b.addr, id));
                }
            }
            if tracking {
                self.dirty.backends.insert(key);
            }
        }
        for a in c.service_addresses() {
            if let Some(n) = self.service_addresses.get_mut(&a) {
                *n -= 1;
                if *n == 0 {
                    self.service_addresses.remove(&a);
                }
            }
            if tracking {
                self.dirty.service_addresses.insert(a);
            }
        }
        for r in c.source_ranges() {
            self.source_ranges.remove(&(id, *r));
            if tracking {
                self.dirty.source_ranges.insert((id, *r));
            }
        }
        for fe in c.frontends() {
            self.unclaim(fe, id);
        }
    }

    fn rank(&self, id: u32) -> &Rank {
        &self.port(id).expect("a claimant has a record").rank
    }

    fn claim(&mut self, fe: Frontend, id: u32) {
        if self.tracking {
            self.dirty.frontends.insert(fe);
        }
        let Some(claimants) = self.frontends.get(&fe) else {
            self.frontends.insert(
                fe,
                Claimants {
                    first: id,
                    rest: Vec::new(),
                },
            );
            return;
        };
        let mut all: Vec<u32> = claimants.iter().collect();
        let incumbent = self.incumbents.get(&fe).copied();
        let at = if incumbent == Some(id) {
            0
        } else {
            let rank = self.rank(id);
            all.partition_point(|other| Some(*other) == incumbent || self.rank(*other) < rank)
        };
        all.insert(at, id);
        self.frontends.insert(
            fe,
            Claimants {
                first: all[0],
                rest: all[1..].to_vec(),
            },
        );
        self.contested.insert(fe);
    }

    fn unclaim(&mut self, fe: Frontend, id: u32) {
        if self.tracking {
            self.dirty.frontends.insert(fe);
        }
        let Some(claimants) = self.frontends.get(&fe) else {
            return;
        };
        let rest: Vec<u32> = claimants.iter().filter(|c| *c != id).collect();
        match rest.split_first() {
            None => {
                self.frontends.remove(&fe);
            }
            Some((first, others)) => {
                self.frontends.insert(
                    fe,
                    Claimants {
                        first: *first,
                        rest: others.to_vec(),
                    },
                );
            }
        }
        if rest.len() <= 1 {
            self.contested.remove(&fe);
        }
    }

    /// Records the holders of frontends found in the pinned maps (before
    /// the first sync): see the `incumbents` field.
    pub fn set_incumbents(&mut self, holders: impl IntoIterator<Item = (Frontend, u32)>) {
        self.incumbents = holders.into_iter().collect();
    }

    /// Forgets the incumbents that no longer matter: those not holding a
    /// contested frontend (uncontested, or no longer claiming it). After
    /// the first sync what is left is a handful at most.
    pub fn settle_incumbents(&mut self) {
        if self.incumbents.is_empty() {
            return;
        }
        let (frontends, contested) = (&self.frontends, &self.contested);
        self.incumbents
            .retain(|fe, id| contested.contains(fe) && frontends.get(fe).is_some_and(|c| c.first == *id));
        self.incumbents.shrink_to_fit();
    }

    /// The keys touched since the last call.
    pub fn take_dirty(&mut self) -> Dirty {
        std::mem::take(&mut self.dirty)
    }

    /// Every frontend claimed by more than one port: (frontend, holder,
    /// the others).
    pub fn conflicts(&self) -> impl Iterator<Item = (Frontend, u32, &[u32])> {
        self.contested.iter().map(|fe| {
            let c = &self.frontends[fe];
            (*fe, c.first, &c.rest[..])
        })
    }

    /// The kind of frontend port `id` claims `fe` as (whether or not it
    /// holds it).
    pub fn claim_kind(&self, id: u32, fe: &Frontend) -> Option<FrontendKind> {
        self.port(id)?.contribution.kind_of(fe)
    }

    /// The Service port a service id is programmed for.
    pub fn name(&self, id: u32) -> Option<&std::sync::Arc<ServicePortName>> {
        self.port(id).map(|p| p.rank.name())
    }

    /// What the diff needs to know about each key: the entry of the
    /// frontend's holder, its backends named by `name` (those it cannot
    /// name are left out).
    pub fn frontend<C>(
        &self,
        fe: &Frontend,
        name: &mut dyn FnMut(&BackendKey) -> Option<C>,
    ) -> Option<FrontendEntry<C>> {
        let holder = self.frontends.get(fe)?.first;
        self.port(holder)?.contribution.entry(fe, name)
    }

    pub fn has_frontend(&self, fe: &Frontend) -> bool {
        self.frontends.contains_key(fe)
    }

    fn claims(&self, key: &BackendKey, packed: &PackedClaims) -> BackendClaims {
        if packed.is_many() {
            self.many_claims[key]
        } else {
            packed.unpack()
        }
    }

    pub fn backend(&self, key: &BackendKey) -> Option<Backend> {
        self.backends.get(key).map(|c| self.claims(key, c).merged(key))
    }

    pub fn has_service_address(&self, addr: IpAddr) -> bool {
        self.service_addresses.contains(&addr)
    }

    pub fn has_source_range(&self, id: u32, range: IpCidr) -> bool {
        self.source_ranges.contains(&(id, range))
    }

    pub fn frontend_keys(&self) -> impl Iterator<Item = &Frontend> {
        self.frontends.keys()
    }

    pub fn backend_keys(&self) -> impl Iterator<Item = BackendKey> + '_ {
        self.backends.keys()
    }

    /// Every backend with its merged view.
    pub fn backends(&self) -> impl Iterator<Item = (BackendKey, Backend)> + '_ {
        self.backends
            .iter()
            .map(|(k, c)| (k, self.claims(&k, c).merged(&k)))
    }

    /// Addresses of the endpoints on this node, each with the lowest
    /// service id of the ports it backs; O(local endpoints).
    pub fn local_endpoints(&self) -> impl Iterator<Item = (IpAddr, u32)> + '_ {
        let mut last = None;
        self.local
            .keys()
            .filter_map(move |&(addr, id)| (last.replace(addr) != Some(addr)).then_some((addr, id)))
    }

    pub fn service_address_keys(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.service_addresses.keys()
    }

    pub fn source_range_keys(&self) -> impl Iterator<Item = &(u32, IpCidr)> {
        self.source_ranges.iter()
    }

    pub fn port_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.ports
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_some())
            .map(|(i, _)| i as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        net::{IpFamily, Protocol},
        state::table::ServicePortName,
    };

    fn name(i: u32) -> ServicePortName {
        ServicePortName {
            namespace: "ns".into(),
            name: format!("s{i}").into(),
            port_name: "".into(),
            proto: Protocol::Tcp,
            family: IpFamily::V4,
        }
    }

    /// Port `i` names one shared backend (serving when `i` is even).
    fn sharing(i: u32, shared: &Backend) -> Contribution {
        Contribution {
            backends: vec![Backend {
                serving: i.is_multiple_of(2),
                ..*shared
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_backend_more_ports_name_than_the_packed_counts_hold_is_counted_exactly() {
        let shared = Backend {
            addr: IpAddr::from([10, 0, 0, 1]),
            port: 80,
            proto: Protocol::Tcp,
            serving: true,
            terminating: false,
            local: false,
        };
        let mut t = ServiceTable::new();
        t.track(false);
        let n = u16::MAX as u32 + 3;
        for i in 0..n {
            t.set_port(i, Rank::new((None, i as u64), name(i)), sharing(i, &shared));
        }
        // (Filling an empty table untracked counts the claims at the end.)
        t.track(true);
        assert_eq!(t.backend(&shared.key()), Some(shared));
        assert!(!t.many_claims.is_empty());
        // The even (serving) ones go first: the rest see it not serving.
        for i in (0..n).step_by(2) {
            t.remove_port(i);
        }
        assert_eq!(
            t.backend(&shared.key()),
            Some(Backend {
                serving: false,
                ..shared
            })
        );
        assert!(t.many_claims.is_empty(), "back in the packed counts");
        for i in (1..n).step_by(2) {
            t.remove_port(i);
        }
        assert_eq!(t.backend(&shared.key()), None);
        assert_eq!(t.backend_count(), 0);
    }
}
