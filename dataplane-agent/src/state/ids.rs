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

/// A map by dense id (service ids): a vector, no hashing. Ids from
/// [`DENSE_IDS`] on (only ever read from maps someone else wrote) go to a
/// hash map instead, so that no id can make the vector huge.
#[derive(Clone, Debug)]
pub struct DenseMap<V> {
    slots: Vec<Option<V>>,
    sparse: HashMap<u32, V>,
    len: usize,
}

/// Ids below this are kept in the vector (8 MB of `Option<Arc<_>>` at
/// most).
pub const DENSE_IDS: u32 = 1 << 20;

impl<V> Default for DenseMap<V> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            sparse: HashMap::new(),
            len: 0,
        }
    }
}

impl<V> DenseMap<V> {
    pub fn get(&self, id: u32) -> Option<&V> {
        if id >= DENSE_IDS {
            return self.sparse.get(&id);
        }
        self.slots.get(id as usize).and_then(Option::as_ref)
    }

    pub fn insert(&mut self, id: u32, v: V) -> Option<V> {
        let old = if id >= DENSE_IDS {
            self.sparse.insert(id, v)
        } else {
            let i = id as usize;
            if self.slots.len() <= i {
                self.slots.resize_with(i + 1, || None);
            }
            self.slots[i].replace(v)
        };
        self.len += old.is_none() as usize;
        old
    }

    pub fn remove(&mut self, id: u32) -> Option<V> {
        let old = if id >= DENSE_IDS {
            self.sparse.remove(&id)
        } else {
            self.slots.get_mut(id as usize).and_then(Option::take)
        };
        self.len -= old.is_some() as usize;
        old
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Dense ids in order, then the others.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &V)> {
        let dense = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(id, v)| Some((id as u32, v.as_ref()?)));
        dense.chain(self.sparse.iter().map(|(id, v)| (*id, v)))
    }

    pub fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        self.iter().map(|(id, _)| id)
    }
}

impl<V> FromIterator<(u32, V)> for DenseMap<V> {
    fn from_iter<I: IntoIterator<Item = (u32, V)>>(iter: I) -> Self {
        let mut m = Self::default();
        for (id, v) in iter {
            m.insert(id, v);
        }
        m
    }
}

/// Service ids by Service port: stable while the port exists, released
/// when it goes (and reused after).
#[derive(Clone, Debug)]
pub struct ServiceIds {
    alloc: IdAllocator,
    ids: HashMap<Arc<ServicePortName>, u32>,
    names: DenseMap<Arc<ServicePortName>>,
}

impl ServiceIds {
    /// Ids `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        Self {
            alloc: IdAllocator::new(0, capacity),
            ids: HashMap::new(),
            names: DenseMap::default(),
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
        self.names.get(id)
    }

    /// The port's id, allocated if it has none; `None` when every id is
    /// taken.
    pub fn assign(&mut self, name: &ServicePortName) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return Some(*id);
        }
        self.assign_owned(name.clone()).map(|(id, _)| id)
    }

    /// As [`ServiceIds::assign`], with the shared name (one lookup, no copy
    /// of the name).
    pub fn assign_owned(&mut self, name: ServicePortName) -> Option<(u32, Arc<ServicePortName>)> {
        if let Some((name, id)) = self.ids.get_key_value(&name) {
            return Some((*id, name.clone()));
        }
        let id = self.alloc.allocate()?;
        let name = Arc::new(name);
        self.ids.insert(name.clone(), id);
        self.names.insert(id, name.clone());
        Some((id, name))
    }

    pub fn release(&mut self, name: &ServicePortName) {
        if let Some(id) = self.ids.remove(name) {
            self.names.remove(id);
            self.alloc.release(id);
        }
    }

    /// Keeps only the ids `keep` accepts (e.g. after a restart, the ids of
    /// ports that are gone).
    pub fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
        let gone: Vec<u32> = self.iter().map(|(id, _)| id).filter(|id| !keep(*id)).collect();
        for id in gone {
            if let Some(name) = self.names.remove(id) {
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
        self.names.iter()
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
    fn a_dense_map_takes_any_id() {
        let mut m: DenseMap<u32> = [(3, 30), (u32::MAX, 1), (DENSE_IDS, 2)].into_iter().collect();
        assert_eq!(m.len(), 3);
        assert_eq!(
            (m.get(3), m.get(u32::MAX), m.get(DENSE_IDS), m.get(4)),
            (Some(&30), Some(&1), Some(&2), None)
        );
        assert!(m.slots.len() <= 4, "a huge id does not grow the vector");
        assert_eq!(m.insert(3, 31), Some(30));
        assert_eq!(m.remove(u32::MAX), Some(1));
        assert_eq!(m.remove(u32::MAX), None);
        assert_eq!(m.keys().collect::<Vec<_>>(), [3, DENSE_IDS]);
        assert_eq!(m.len(), 2);
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
        assert_eq!(ids.name(2).map(|n| &*n.name), Some("e"));
    }
}
