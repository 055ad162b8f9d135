//! Dense ids from a free list: service ids (stats, affinity and source
//! ranges are keyed by them) and backend ids (indexes of the backends
//! array). One allocator for both; adopting ids found in the maps after a
//! restart rebuilds the free list, so nothing leaks across restarts.

use foldhash::{HashMap, HashMapExt as _};
use std::{collections::BTreeSet, sync::Arc};

use super::table::ServicePortName;

/// Ids `first..capacity`, lowest free first.
#[derive(Clone, Debug)]
pub struct IdAllocator {
    first: u32,
    capacity: u32,
    /// Every id below `next` is in use unless it is in `free`.
    next: u32,
    free: BTreeSet<u32>,
}

impl IdAllocator {
    pub fn new(first: u32, capacity: u32) -> Self {
        Self {
            first,
            capacity,
            next: first,
            free: BTreeSet::new(),
        }
    }

    /// An allocator where exactly `in_use` is taken (ids out of range are
    /// ignored: the caller treats their owners as not programmed).
    pub fn adopt(first: u32, capacity: u32, in_use: impl IntoIterator<Item = u32>) -> Self {
        let mut ids = Self::new(first, capacity);
        for id in in_use {
            ids.reserve(id);
        }
        ids
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// How many ids are taken.
    pub fn used(&self) -> usize {
        (self.next - self.first) as usize - self.free.len()
    }

    pub fn allocate(&mut self) -> Option<u32> {
        if let Some(id) = self.free.pop_first() {
            return Some(id);
        }
        if self.next >= self.capacity {
            return None;
        }
        self.next += 1;
        Some(self.next - 1)
    }

    /// Marks `id` taken; false if it is out of range or already taken.
    pub fn reserve(&mut self, id: u32) -> bool {
        if id < self.first || id >= self.capacity {
            return false;
        }
        if id >= self.next {
            self.free.extend(self.next..id);
            self.next = id + 1;
            return true;
        }
        self.free.remove(&id)
    }

    pub fn is_taken(&self, id: u32) -> bool {
        id >= self.first && id < self.next && !self.free.contains(&id)
    }

    pub fn release(&mut self, id: u32) {
        if !self.is_taken(id) {
            return;
        }
        if id + 1 == self.next {
            // Keep the free list short: give back the top of the range.
            self.next = id;
            while self.next > self.first && self.free.remove(&(self.next - 1)) {
                self.next -= 1;
            }
        } else {
            self.free.insert(id);
        }
    }
}

/// Service ids by Service port: stable while the port exists, released
/// when it goes (and reused after).
#[derive(Clone, Debug)]
pub struct ServiceIds {
    alloc: IdAllocator,
    ids: HashMap<Arc<ServicePortName>, u32>,
    names: HashMap<u32, Arc<ServicePortName>>,
}

impl ServiceIds {
    /// Ids `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        Self {
            alloc: IdAllocator::new(0, capacity),
            ids: HashMap::new(),
            names: HashMap::new(),
        }
    }

    /// Takes over an id found in the maps after a restart; false if it is
    /// out of range or the port or the id already has another.
    pub fn adopt(&mut self, name: ServicePortName, id: u32) -> bool {
        if self.ids.contains_key(&name) || !self.alloc.reserve(id) {
            return false;
        }
        let name = Arc::new(name);
        self.ids.insert(name.clone(), id);
        self.names.insert(id, name);
        true
    }

    pub fn get(&self, name: &ServicePortName) -> Option<u32> {
        self.ids.get(name).copied()
    }

    pub fn name(&self, id: u32) -> Option<&Arc<ServicePortName>> {
        self.names.get(&id)
    }

    /// The port's id, allocated if it has none; `None` when every id is
    /// taken.
    pub fn assign(&mut self, name: &ServicePortName) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return Some(*id);
        }
        let id = self.alloc.allocate()?;
        let name = Arc::new(name.clone());
        self.ids.insert(name.clone(), id);
        self.names.insert(id, name);
        Some(id)
    }

    pub fn release(&mut self, name: &ServicePortName) {
        if let Some(id) = self.ids.remove(name) {
            self.names.remove(&id);
            self.alloc.release(id);
        }
    }

    /// Keeps only the ids `keep` accepts (e.g. after a restart, the ids of
    /// ports that are gone).
    pub fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
        let gone: Vec<u32> = self.names.keys().copied().filter(|id| !keep(*id)).collect();
        for id in gone {
            if let Some(name) = self.names.remove(&id) {
                self.ids.remove(&name);
                self.alloc.release(id);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &Arc<ServicePortName>)> {
        self.names.iter().map(|(id, n)| (*id, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::Protocol;

    fn port(name: &str) -> ServicePortName {
        ServicePortName {
            family: crate::net::IpFamily::V4,
            namespace: "ns".into(),
            name: name.into(),
            port_name: "p".into(),
            proto: Protocol::Tcp,
        }
    }

    #[test]
    fn ids_are_lowest_free_first_within_capacity_and_reused_after_release() {
        let mut ids = IdAllocator::new(1, 4);
        assert_eq!(
            [ids.allocate(), ids.allocate(), ids.allocate()],
            [Some(1), Some(2), Some(3)]
        );
        assert_eq!(ids.allocate(), None, "capacity 4 holds ids 1..=3");
        ids.release(2);
        assert_eq!(ids.allocate(), Some(2));
        ids.release(3);
        ids.release(2);
        assert_eq!(ids.used(), 1);
        assert_eq!(ids.allocate(), Some(2));
    }

    #[test]
    fn adopting_ids_rebuilds_the_free_list() {
        // Ids 2 and 5 survived a restart: 1, 3 and 4 are free again.
        let mut ids = IdAllocator::adopt(1, 8, [5, 2, 99]);
        assert!(ids.is_taken(2) && ids.is_taken(5) && !ids.is_taken(99));
        let got: Vec<u32> = std::iter::from_fn(|| ids.allocate()).collect();
        assert_eq!(got, [1, 3, 4, 6, 7]);
        assert!(!ids.reserve(5), "taken twice");
    }

    #[test]
    fn service_ids_survive_a_restart_without_leaking() {
        let mut ids = ServiceIds::new(4);
        assert!(ids.adopt(port("b"), 2));
        assert!(!ids.adopt(port("b"), 3), "one id per port");
        assert_eq!(ids.assign(&port("a")), Some(0));
        assert_eq!(ids.assign(&port("c")), Some(1));
        assert_eq!(ids.assign(&port("d")), Some(3));
        assert_eq!(ids.assign(&port("e")), None);
        ids.release(&port("b"));
        assert_eq!(ids.assign(&port("e")), Some(2));
        assert_eq!(ids.get(&port("b")), None);
        assert_eq!(ids.name(2).map(|n| n.name.as_str()), Some("e"));
    }
}
