//! What the datapath needs beyond the frontends' own entries, derived from
//! them: Maglev tables (one per backend set of a service port that uses
//! Maglev, shared by its frontends) and the DSR entries of the backend
//! node (which local backend an encapsulated packet through a DSR frontend
//! is for). Pure: [`Derived`] follows the frontends as they are written and
//! removed, and says what to write ([`DerivedOp`]); the map layer writes
//! it.
//!
//! The frontends' entries come first: a frontend whose table is not
//! written yet has its new flows balanced at random by the datapath (no
//! table chunk), and a table naming a backend removed meanwhile is skipped
//! there (the backend is inactive) — both for the moment between two
//! writes of one sync.

use std::{collections::BTreeMap, net::IpAddr};

use foldhash::HashMap;

use super::{
    maglev,
    table::{Backend, BackendId, Frontend, FrontendEntry, FrontendKind},
};
use crate::net::Protocol;

/// A DSR entry: which local backend an encapsulated packet to `backend`
/// through frontend `address:port` (`None` for a NodePort: the client
/// reached another node's address) is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DsrEntry {
    pub address: Option<IpAddr>,
    pub port: u16,
    pub proto: Protocol,
    pub backend: IpAddr,
}

/// What a DSR entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DsrTarget {
    pub backend_id: BackendId,
    pub service_id: u32,
}

/// A Maglev table's backends: identities (address, port) and ids, side by
/// side, sorted by identity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableSet {
    pub identities: Vec<(IpAddr, u16)>,
    pub ids: Vec<BackendId>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DerivedOp {
    /// Write table `table` for `set` (`previous`: the set it was built for
    /// before, whose table tells which chunks change).
    SetTable {
        table: u32,
        set: TableSet,
        previous: Option<TableSet>,
    },
    RemoveTable(u32),
    SetDsr(DsrEntry, DsrTarget),
    RemoveDsr(DsrEntry),
}

/// What one frontend derives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct FrontendDerived {
    tables: Vec<(u32, TableSet)>,
    dsr: Vec<(DsrEntry, DsrTarget)>,
}

/// The derived state the maps hold, by the frontends that derive it.
#[derive(Clone, Debug, Default)]
pub struct Derived {
    frontends: HashMap<Frontend, FrontendDerived>,
    /// Tables written: their set and how many frontends use them.
    tables: BTreeMap<u32, (TableSet, u32)>,
    /// DSR entries written, and how many frontends derive each (a NodePort
    /// on two node addresses derives the same entry twice).
    dsr: BTreeMap<DsrEntry, (DsrTarget, u32)>,
}

impl Derived {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `fe` derives anything.
    pub fn has(&self, fe: &Frontend) -> bool {
        self.frontends.contains_key(fe)
    }

    /// How many tables and DSR entries it holds.
    pub fn counts(&self) -> (usize, usize) {
        (self.tables.len(), self.dsr.len())
    }

    /// The operations that follow `fe` being written as `entry`
    /// (`backend`: what an id names now).
    pub fn set_frontend(
        &mut self,
        fe: &Frontend,
        entry: &FrontendEntry,
        backend: &dyn Fn(BackendId) -> Option<Backend>,
        out: &mut Vec<DerivedOp>,
    ) {
        let new = derive(fe, entry, backend);
        let old = self.frontends.remove(fe).unwrap_or_default();
        self.replace(old, &new, out);
        if new != FrontendDerived::default() {
            self.frontends.insert(*fe, new);
        }
    }

    /// The operations that follow `fe` being removed.
    pub fn remove_frontend(&mut self, fe: &Frontend, out: &mut Vec<DerivedOp>) {
        let old = self.frontends.remove(fe).unwrap_or_default();
        self.replace(old, &FrontendDerived::default(), out);
    }

    /// Moves one frontend's share from `old` to `new`: tables and entries
    /// it takes are written when their content changes, those it leaves
    /// are removed when no frontend uses them.
    fn replace(&mut self, old: FrontendDerived, new: &FrontendDerived, out: &mut Vec<DerivedOp>) {
        for (table, set) in &new.tables {
            match self.tables.get_mut(table) {
                Some((have, users)) => {
                    if !old.tables.iter().any(|(t, _)| t == table) {
                        *users += 1;
                    }
                    if have != set {
                        out.push(DerivedOp::SetTable {
                            table: *table,
                            set: set.clone(),
                            previous: Some(std::mem::replace(have, set.clone())),
                        });
                    }
                }
                None => {
                    self.tables.insert(*table, (set.clone(), 1));
                    out.push(DerivedOp::SetTable {
                        table: *table,
                        set: set.clone(),
                        previous: None,
                    });
                }
            }
        }
        for (table, _) in &old.tables {
            if new.tables.iter().any(|(t, _)| t == table) {
                continue;
            }
            if let Some((_, users)) = self.tables.get_mut(table) {
                *users -= 1;
                if *users == 0 {
                    self.tables.remove(table);
                    out.push(DerivedOp::RemoveTable(*table));
                }
            }
        }
        for (entry, target) in &new.dsr {
            let had = old.dsr.iter().any(|(e, _)| e == entry);
            match self.dsr.get_mut(entry) {
                Some((have, users)) => {
                    if !had {
                        *users += 1;
                    }
                    if have != target {
                        *have = *target;
                        out.push(DerivedOp::SetDsr(*entry, *target));
                    }
                }
                None => {
                    self.dsr.insert(*entry, (*target, 1));
                    out.push(DerivedOp::SetDsr(*entry, *target));
                }
            }
        }
        for (entry, _) in &old.dsr {
            if new.dsr.iter().any(|(e, _)| e == entry) {
                continue;
            }
            if let Some((_, users)) = self.dsr.get_mut(entry) {
                *users -= 1;
                if *users == 0 {
                    self.dsr.remove(entry);
                    out.push(DerivedOp::RemoveDsr(*entry));
                }
            }
        }
    }
}

/// What `fe` written as `entry` derives.
fn derive(
    fe: &Frontend,
    entry: &FrontendEntry,
    backend: &dyn Fn(BackendId) -> Option<Backend>,
) -> FrontendDerived {
    let mut d = FrontendDerived::default();
    if entry.maglev {
        let mut sets = vec![(
            maglev::table_id(entry.service_id, entry.uses_local_set()),
            &entry.backends,
        )];
        if let Some(internal) = &entry.internal_backends {
            sets.push((maglev::table_id(entry.service_id, false), internal));
        }
        for (table, set) in sets {
            let mut named: Vec<((IpAddr, u16), BackendId)> = set
                .backends
                .iter()
                .filter_map(|id| backend(*id).map(|b| ((b.addr, b.port), *id)))
                .collect();
            named.sort();
            named.dedup_by_key(|(identity, _)| *identity);
            d.tables.push((
                table,
                TableSet {
                    identities: named.iter().map(|(i, _)| *i).collect(),
                    ids: named.iter().map(|(_, id)| *id).collect(),
                },
            ));
        }
    }
    // The backend node's half of DSR: the frontend's local backends accept
    // encapsulated packets through it (from any node that chose them).
    if entry.dsr {
        let address = (entry.kind != FrontendKind::NodePort).then_some(fe.addr);
        for id in &entry.backends.backends {
            if let Some(b) = backend(*id).filter(|b| b.local) {
                d.dsr.push((
                    DsrEntry {
                        address,
                        port: fe.port,
                        proto: fe.proto,
                        backend: b.addr,
                    },
                    DsrTarget {
                        backend_id: *id,
                        service_id: entry.service_id,
                    },
                ));
            }
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::state::table::{BackendSet, EmptyVerdict};

    fn id(n: u32) -> BackendId {
        BackendId::new(n).unwrap()
    }

    fn backend(n: u32) -> Option<Backend> {
        Some(Backend {
            addr: IpAddr::V4(Ipv4Addr::new(10, 244, (n % 2) as u8 + 1, n as u8)),
            port: 8080,
            proto: Protocol::Tcp,
            serving: true,
            terminating: false,
            // Even ids run on this node.
            local: n.is_multiple_of(2),
        })
    }

    fn by_id(id: BackendId) -> Option<Backend> {
        backend(id.get())
    }

    fn fe(last: u8, port: u16) -> Frontend {
        Frontend {
            addr: IpAddr::V4(Ipv4Addr::new(198, 18, 0, last)),
            port,
            proto: Protocol::Tcp,
        }
    }

    fn entry(kind: FrontendKind, ids: &[u32], maglev: bool, dsr: bool) -> FrontendEntry {
        FrontendEntry {
            service_id: 3,
            kind,
            backends: BackendSet {
                backends: ids.iter().map(|n| id(*n)).collect(),
                when_empty: EmptyVerdict::Reject,
            },
            internal_backends: None,
            masquerade: true,
            affinity_timeout: None,
            source_ranges: false,
            external_local: false,
            internal_local: false,
            dsr,
            maglev,
        }
    }

    fn tables(ops: &[DerivedOp]) -> Vec<u32> {
        ops.iter()
            .filter_map(|o| match o {
                DerivedOp::SetTable { table, .. } => Some(*table),
                _ => None,
            })
            .collect()
    }

    /// Two frontends of one port share its table: written once, rewritten
    /// when its set changes, removed with the last frontend using it.
    #[test]
    fn a_table_is_shared_and_goes_with_its_last_frontend() {
        let mut d = Derived::new();
        let mut ops = Vec::new();
        let np = entry(FrontendKind::NodePort, &[1, 2], true, false);
        let lb = entry(FrontendKind::LoadBalancer, &[1, 2], true, false);
        d.set_frontend(&fe(11, 30080), &np, &by_id, &mut ops);
        d.set_frontend(&fe(200, 80), &lb, &by_id, &mut ops);
        assert_eq!(tables(&ops), vec![6], "one table, written once: {ops:?}");
        ops.clear();
        let np3 = entry(FrontendKind::NodePort, &[1, 2, 3], true, false);
        d.set_frontend(&fe(11, 30080), &np3, &by_id, &mut ops);
        assert!(
            matches!(&ops[..], [DerivedOp::SetTable { table: 6, previous: Some(p), set }]
                if p.ids.len() == 2 && set.ids.len() == 3),
            "{ops:?}"
        );
        ops.clear();
        d.remove_frontend(&fe(11, 30080), &mut ops);
        assert!(ops.is_empty(), "still used by the LB IP: {ops:?}");
        d.remove_frontend(&fe(200, 80), &mut ops);
        assert_eq!(ops, vec![DerivedOp::RemoveTable(6)]);
        assert_eq!(d.counts(), (0, 0));
    }

    /// A DSR frontend derives entries for its local backends only; a
    /// NodePort's are keyed without an address; an entry two frontends
    /// derive stays until both are gone.
    #[test]
    fn dsr_entries_follow_the_local_backends() {
        let mut d = Derived::new();
        let mut ops = Vec::new();
        d.set_frontend(
            &fe(11, 30080),
            &entry(FrontendKind::NodePort, &[1, 2, 4], false, true),
            &by_id,
            &mut ops,
        );
        d.set_frontend(
            &fe(12, 30080),
            &entry(FrontendKind::NodePort, &[1, 2, 4], false, true),
            &by_id,
            &mut ops,
        );
        let set: Vec<_> = ops
            .iter()
            .filter_map(|o| match o {
                DerivedOp::SetDsr(e, t) => Some((e.address, e.backend, t.backend_id.get())),
                _ => None,
            })
            .collect();
        assert_eq!(
            set,
            vec![
                (None, backend(2).unwrap().addr, 2),
                (None, backend(4).unwrap().addr, 4)
            ]
        );
        ops.clear();
        d.remove_frontend(&fe(11, 30080), &mut ops);
        assert!(ops.is_empty(), "{ops:?}");
        // Backend 4 leaves the set.
        d.set_frontend(
            &fe(12, 30080),
            &entry(FrontendKind::NodePort, &[1, 2], false, true),
            &by_id,
            &mut ops,
        );
        assert!(matches!(&ops[..], [DerivedOp::RemoveDsr(e)] if e.backend == backend(4).unwrap().addr));
        ops.clear();
        // An LB IP's entries carry its address; DSR off removes them.
        d.set_frontend(
            &fe(200, 80),
            &entry(FrontendKind::LoadBalancer, &[2], false, true),
            &by_id,
            &mut ops,
        );
        assert!(matches!(&ops[..], [DerivedOp::SetDsr(e, _)] if e.address == Some(fe(200, 80).addr)));
        ops.clear();
        d.set_frontend(
            &fe(200, 80),
            &entry(FrontendKind::LoadBalancer, &[2], false, false),
            &by_id,
            &mut ops,
        );
        assert!(matches!(&ops[..], [DerivedOp::RemoveDsr(_)]), "{ops:?}");
    }
}
