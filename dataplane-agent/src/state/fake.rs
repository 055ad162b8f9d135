//! The maps as an in-memory fake for tests: it checks after every operation
//! that no frontend names a backend that is not there, that no backend id
//! is reused while a frontend names it, and that source-range frontends
//! have their ranges; and it can fail the Nth operation.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::{
    diff::{MapWriter, Op},
    table::{Backend, BackendId, Frontend, FrontendEntry, MapTable, ServicePortName, StraySlot},
};
use crate::net::IpCidr;

#[derive(Debug, thiserror::Error)]
#[error("fake map write failed: {0}")]
pub struct FakeError(pub String);

#[derive(Clone, Debug)]
pub struct FakeMaps {
    pub backends: BTreeMap<BackendId, Backend>,
    pub frontends: BTreeMap<Frontend, FrontendEntry>,
    pub addresses: BTreeSet<IpAddr>,
    pub ranges: BTreeSet<(u32, IpCidr)>,
    pub names: BTreeMap<u32, ServicePortName>,
    pub strays: BTreeSet<StraySlot>,
    pub purged: Vec<(IpAddr, u16)>,
    /// Check the invariants after every operation.
    pub check: bool,
    /// Fail the operation with this number (counted from 0 over the
    /// fake's life), once.
    pub fail_at: Option<usize>,
    /// Operations attempted so far.
    pub ops: usize,
}

impl Default for FakeMaps {
    fn default() -> Self {
        Self {
            backends: BTreeMap::new(),
            frontends: BTreeMap::new(),
            addresses: BTreeSet::new(),
            ranges: BTreeSet::new(),
            names: BTreeMap::new(),
            strays: BTreeSet::new(),
            purged: Vec::new(),
            check: true,
            fail_at: None,
            ops: 0,
        }
    }
}

impl FakeMaps {
    fn referenced(&self, id: BackendId) -> bool {
        self.frontends
            .values()
            .any(|e| e.all_backends().any(|b| *b == id))
    }

    pub fn check_invariants(&self, op: &Op) {
        for (f, e) in &self.frontends {
            for id in e.all_backends() {
                assert!(
                    self.backends.contains_key(id),
                    "{f:?} refers to missing backend {id:?} after {op:?}"
                );
            }
            if e.source_ranges {
                assert!(
                    self.ranges.iter().any(|(sid, _)| *sid == e.service_id),
                    "{f:?} ranges missing after {op:?}"
                );
            }
        }
    }
}

impl MapWriter for FakeMaps {
    type Error = FakeError;

    fn apply(&mut self, op: &Op) -> Result<(), FakeError> {
        let n = self.ops;
        self.ops += 1;
        if self.fail_at == Some(n) {
            self.fail_at = None;
            return Err(FakeError(format!("operation {n} ({op:?})")));
        }
        match op {
            Op::SetServiceName(id, name) => {
                self.names.insert(*id, (**name).clone());
            }
            Op::SetBackend(id, b) => {
                if self.check
                    && let Some(old) = self.backends.get(id)
                {
                    assert!(
                        old.key() == b.key() || !self.referenced(*id),
                        "backend id {id:?} reused for {b:?} while a frontend names it ({old:?})"
                    );
                }
                self.backends.insert(*id, *b);
            }
            Op::AddSourceRange(id, r) => {
                self.ranges.insert((*id, *r));
            }
            Op::SetServiceAddress(a) => {
                self.addresses.insert(*a);
            }
            Op::SetFrontend { frontend, entry, .. } => {
                self.frontends.insert(*frontend, (**entry).clone());
            }
            Op::RemoveFrontend { frontend, .. } => {
                self.frontends.remove(frontend);
            }
            Op::RemoveServiceAddress(a) => {
                self.addresses.remove(a);
            }
            Op::RemoveSourceRange(id, r) => {
                self.ranges.remove(&(*id, *r));
            }
            Op::RemoveStraySlot(s) => {
                self.strays.remove(s);
            }
            Op::RemoveBackend(id, _) => {
                self.backends.remove(id);
            }
            Op::RemoveServiceName(id) => {
                self.names.remove(id);
            }
            Op::PurgeUdpFlows(ids) => self.purged.extend(ids),
        }
        if self.check {
            self.check_invariants(op);
        }
        Ok(())
    }

    fn read_table(&self) -> Result<MapTable, FakeError> {
        Ok(MapTable {
            backends: self.backends.iter().map(|(i, b)| (*i, *b)).collect(),
            frontends: self.frontends.iter().map(|(f, e)| (*f, e.clone())).collect(),
            service_addresses: self.addresses.iter().copied().collect(),
            source_ranges: self.ranges.iter().copied().collect(),
            service_names: self.names.iter().map(|(i, n)| (*i, n.clone())).collect(),
            stray_slots: self.strays.iter().copied().collect(),
            damaged: Vec::new(),
        })
    }
}
