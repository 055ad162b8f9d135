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
    desired::{BackendClaims, Contribution, Rank},
    table::{Backend, BackendKey, Frontend, FrontendEntry, ServicePortName},
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
    contribution: Contribution,
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
    backends: HashMap<BackendKey, BackendClaims>,
    /// ClusterIPs, with the number of ports that have them.
    service_addresses: HashMap<IpAddr, u32>,
    source_ranges: HashSet<(u32, IpCidr)>,
    /// Endpoints on this node: (address, service id) → how many of the
    /// port's backends have that address (one per target port).
    local: BTreeMap<(IpAddr, u32), u32>,
    dirty: Dirty,
    /// Record touched keys (off while every key is planned anyway).
    tracking: bool,
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
    pub fn track(&mut self, on: bool) {
        self.tracking = on;
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
        for b in &c.backends {
            self.backends.entry(b.key()).or_default().add(b);
            if b.local {
                *self.local.entry((b.addr, id)).or_default() += 1;
            }
            if self.tracking {
                self.dirty.backends.insert(b.key());
            }
        }
        for a in &c.service_addresses {
            *self.service_addresses.entry(*a).or_default() += 1;
            if self.tracking {
                self.dirty.service_addresses.insert(*a);
            }
        }
        for r in &c.source_ranges {
            self.source_ranges.insert((id, *r));
            if self.tracking {
                self.dirty.source_ranges.insert((id, *r));
            }
        }
        for at in 0..c.frontends.len() {
            let fe = self.ports[i].as_ref().expect("just set").contribution.frontends[at].0;
            self.claim(fe, id);
        }
    }

    /// Withdraws everything the port added.
    pub fn remove_port(&mut self, id: u32) {
        let Some(old) = self.ports.get_mut(id as usize).and_then(Option::take) else {
            return;
        };
        self.port_count -= 1;
        let tracking = self.tracking;
        if tracking {
            self.dirty.names.insert(id);
        }
        let c = &old.contribution;
        for b in &c.backends {
            let key = b.key();
            if let Some(claims) = self.backends.get_mut(&key)
                && !claims.remove(b)
            {
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
        for a in &c.service_addresses {
            if let Some(n) = self.service_addresses.get_mut(a) {
                *n -= 1;
                if *n == 0 {
                    self.service_addresses.remove(a);
                }
            }
            if tracking {
                self.dirty.service_addresses.insert(*a);
            }
        }
        for r in &c.source_ranges {
            self.source_ranges.remove(&(id, *r));
            if tracking {
                self.dirty.source_ranges.insert((id, *r));
            }
        }
        for (fe, _) in &c.frontends {
            self.unclaim(*fe, id);
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
        let rank = self.rank(id);
        let at = all.partition_point(|other| self.rank(*other) < rank);
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

    /// The entry port `id` wants for `fe` (whether or not it holds it).
    pub fn claim_of(&self, id: u32, fe: &Frontend) -> Option<&FrontendEntry<BackendKey>> {
        self.port(id)?
            .contribution
            .frontends
            .iter()
            .find(|(f, _)| f == fe)
            .map(|(_, e)| e)
    }

    /// The Service port a service id is programmed for.
    pub fn name(&self, id: u32) -> Option<&std::sync::Arc<ServicePortName>> {
        self.port(id).map(|p| p.rank.name())
    }

    /// What the diff needs to know about each key.
    pub fn frontend(&self, fe: &Frontend) -> Option<&FrontendEntry<BackendKey>> {
        let holder = self.frontends.get(fe)?.first;
        self.claim_of(holder, fe)
    }

    pub fn backend(&self, key: &BackendKey) -> Option<Backend> {
        self.backends.get(key).map(|c| c.merged(key))
    }

    pub fn has_service_address(&self, addr: IpAddr) -> bool {
        self.service_addresses.contains_key(&addr)
    }

    pub fn has_source_range(&self, id: u32, range: IpCidr) -> bool {
        self.source_ranges.contains(&(id, range))
    }

    pub fn frontend_keys(&self) -> impl Iterator<Item = &Frontend> {
        self.frontends.keys()
    }

    pub fn backend_keys(&self) -> impl Iterator<Item = &BackendKey> {
        self.backends.keys()
    }

    /// Every backend with its merged view.
    pub fn backends(&self) -> impl Iterator<Item = (&BackendKey, Backend)> {
        self.backends.iter().map(|(k, c)| (k, c.merged(k)))
    }

    /// Addresses of the endpoints on this node, each with the lowest
    /// service id of the ports it backs; O(local endpoints).
    pub fn local_endpoints(&self) -> impl Iterator<Item = (IpAddr, u32)> + '_ {
        let mut last = None;
        self.local
            .keys()
            .filter_map(move |&(addr, id)| (last.replace(addr) != Some(addr)).then_some((addr, id)))
    }

    pub fn service_address_keys(&self) -> impl Iterator<Item = &IpAddr> {
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
