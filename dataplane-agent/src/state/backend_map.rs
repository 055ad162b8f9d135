//! A hash map keyed by [`BackendKey`], for the two maps that hold every
//! backend (a million at 100k Services × 10 endpoints): the desired table's
//! claims and the programmer's ids.
//!
//! An IPv4 backend's key is packed into 8 bytes (address, port, protocol)
//! instead of the 20 of a `BackendKey` (an `IpAddr` takes 17): the tables
//! are a third smaller, hash one word, and miss the cache less often. IPv6
//! backends keep the whole key in a map of their own.

use foldhash::{HashMap, HashMapExt as _};
use std::{
    collections::hash_map::Entry as MapEntry,
    hash::BuildHasher as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use super::table::{Backend, BackendId, BackendKey};
use crate::net::Protocol;

/// An IPv4 backend key: the address, then the port and protocol number.
type PackedV4 = (u32, u32);

fn pack(key: &BackendKey) -> Option<PackedV4> {
    match key.addr {
        IpAddr::V4(a) => Some((u32::from(a), (key.port as u32) << 8 | key.proto.number() as u32)),
        IpAddr::V6(_) => None,
    }
}

fn unpack(k: PackedV4) -> BackendKey {
    BackendKey {
        addr: IpAddr::V4(Ipv4Addr::from(k.0)),
        port: (k.1 >> 8) as u16,
        proto: Protocol::from_number(k.1 as u8).expect("packed from a Protocol"),
    }
}

#[derive(Clone, Debug)]
pub struct BackendMap<V> {
    v4: HashMap<PackedV4, V>,
    v6: HashMap<BackendKey, V>,
}

/// Every backend map hashes alike (one random seed per process): a full
/// plan walks one (the desired claims) and fills another (the ids) in that
/// order, and with the same hash and the same size (both are reserved for
/// every backend first) that fills it bucket after bucket instead of at
/// random, a cache miss saved per backend. (Filling a *smaller* table in
/// another's bucket order would cluster; the reservation rules that out.)
fn shared_hasher() -> foldhash::fast::RandomState {
    static SHARED: std::sync::OnceLock<foldhash::fast::RandomState> = std::sync::OnceLock::new();
    SHARED.get_or_init(Default::default).clone()
}

impl<V> Default for BackendMap<V> {
    fn default() -> Self {
        Self {
            v4: HashMap::with_hasher(shared_hasher()),
            v6: HashMap::with_hasher(shared_hasher()),
        }
    }
}

/// A place in a [`BackendMap`], filled or not.
pub enum Entry<'a, V> {
    V4(MapEntry<'a, PackedV4, V>),
    V6(MapEntry<'a, BackendKey, V>),
}

impl<'a, V> Entry<'a, V> {
    /// The value, if the key is there.
    pub fn get(&self) -> Option<&V> {
        match self {
            Entry::V4(MapEntry::Occupied(e)) => Some(e.get()),
            Entry::V6(MapEntry::Occupied(e)) => Some(e.get()),
            _ => None,
        }
    }

    pub fn or_insert_with(self, f: impl FnOnce() -> V) -> &'a mut V {
        match self {
            Entry::V4(e) => e.or_insert_with(f),
            Entry::V6(e) => e.or_insert_with(f),
        }
    }

    pub fn or_default(self) -> &'a mut V
    where
        V: Default,
    {
        self.or_insert_with(V::default)
    }
}

impl<V> BackendMap<V> {
    pub fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Room for `additional` more IPv4 backends.
    pub fn reserve(&mut self, additional: usize) {
        self.v4.reserve(additional);
    }

    pub fn get(&self, key: &BackendKey) -> Option<&V> {
        match pack(key) {
            Some(k) => self.v4.get(&k),
            None => self.v6.get(key),
        }
    }

    pub fn get_mut(&mut self, key: &BackendKey) -> Option<&mut V> {
        match pack(key) {
            Some(k) => self.v4.get_mut(&k),
            None => self.v6.get_mut(key),
        }
    }

    pub fn contains_key(&self, key: &BackendKey) -> bool {
        self.get(key).is_some()
    }

    pub fn insert(&mut self, key: BackendKey, value: V) -> Option<V> {
        match pack(&key) {
            Some(k) => self.v4.insert(k, value),
            None => self.v6.insert(key, value),
        }
    }

    pub fn remove(&mut self, key: &BackendKey) -> Option<V> {
        match pack(key) {
            Some(k) => self.v4.remove(&k),
            None => self.v6.remove(key),
        }
    }

    pub fn entry(&mut self, key: BackendKey) -> Entry<'_, V> {
        match pack(&key) {
            Some(k) => Entry::V4(self.v4.entry(k)),
            None => Entry::V6(self.v6.entry(key)),
        }
    }

    /// Calls `update` with the entry of every key of `items` (inserted as
    /// `V::default()` when absent) and the item's value, in the order of
    /// the table's buckets: a million keys written in order instead of at
    /// random, a cache miss saved on each. The order depends on the table's
    /// size and hash only; `update` must not care about it.
    pub fn update_all<T: Copy>(
        &mut self,
        items: &[(BackendKey, T)],
        mut update: impl FnMut(&BackendKey, &mut V, T),
    ) where
        V: Default,
    {
        self.v4.reserve(items.len());
        // The table's bucket of a key: the low bits of its hash (hashbrown's
        // layout: a power of two of buckets, at most 7/8 of them full).
        let mask = (self.v4.capacity() * 8 / 7).next_power_of_two().max(1) - 1;
        let hasher = self.v4.hasher().clone();
        let mut v4: Vec<(u32, PackedV4, T)> = Vec::with_capacity(items.len());
        for (k, t) in items {
            match pack(k) {
                Some(p) => v4.push(((hasher.hash_one(p) as usize & mask) as u32, p, *t)),
                None => update(k, self.v6.entry(*k).or_default(), *t),
            }
        }
        v4.sort_unstable_by_key(|(bucket, ..)| *bucket);
        for (_, p, t) in v4 {
            update(&unpack(p), self.v4.entry(p).or_default(), t);
        }
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&BackendKey, &mut V) -> bool) {
        self.v4.retain(|k, v| keep(&unpack(*k), v));
        self.v6.retain(|k, v| keep(k, v));
    }

    /// Every entry (keys by value: IPv4 ones are unpacked on the way).
    pub fn iter(&self) -> impl Iterator<Item = (BackendKey, &V)> {
        let v4 = self.v4.iter().map(|(k, v)| (unpack(*k), v));
        v4.chain(self.v6.iter().map(|(k, v)| (*k, v)))
    }

    pub fn keys(&self) -> impl Iterator<Item = BackendKey> + '_ {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.v4.values().chain(self.v6.values())
    }
}

impl<V> FromIterator<(BackendKey, V)> for BackendMap<V> {
    fn from_iter<I: IntoIterator<Item = (BackendKey, V)>>(iter: I) -> Self {
        let mut m = Self::default();
        for (k, v) in iter {
            m.insert(k, v);
        }
        m
    }
}

/// A hash map by address: an IPv4 key in 4 bytes instead of 17 (for the
/// ClusterIPs, a hundred thousand of them).
#[derive(Clone, Debug)]
pub struct AddrMap<V> {
    v4: HashMap<u32, V>,
    v6: HashMap<Ipv6Addr, V>,
}

impl<V> Default for AddrMap<V> {
    fn default() -> Self {
        Self {
            v4: HashMap::new(),
            v6: HashMap::new(),
        }
    }
}

impl<V> AddrMap<V> {
    pub fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Room for `additional` more IPv4 addresses.
    pub fn reserve(&mut self, additional: usize) {
        self.v4.reserve(additional);
    }

    pub fn get_mut(&mut self, a: &IpAddr) -> Option<&mut V> {
        match a {
            IpAddr::V4(a) => self.v4.get_mut(&u32::from(*a)),
            IpAddr::V6(a) => self.v6.get_mut(a),
        }
    }

    pub fn contains(&self, a: &IpAddr) -> bool {
        match a {
            IpAddr::V4(a) => self.v4.contains_key(&u32::from(*a)),
            IpAddr::V6(a) => self.v6.contains_key(a),
        }
    }

    pub fn insert(&mut self, a: IpAddr, v: V) -> Option<V> {
        match a {
            IpAddr::V4(a) => self.v4.insert(a.into(), v),
            IpAddr::V6(a) => self.v6.insert(a, v),
        }
    }

    pub fn remove(&mut self, a: &IpAddr) -> Option<V> {
        match a {
            IpAddr::V4(a) => self.v4.remove(&u32::from(*a)),
            IpAddr::V6(a) => self.v6.remove(a),
        }
    }

    /// The value of `a`, inserted with `f` if it has none.
    pub fn get_or_insert_with(&mut self, a: IpAddr, f: impl FnOnce() -> V) -> &mut V {
        match a {
            IpAddr::V4(a) => self.v4.entry(a.into()).or_insert_with(f),
            IpAddr::V6(a) => self.v6.entry(a).or_insert_with(f),
        }
    }

    pub fn keys(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let v4 = self.v4.keys().map(|a| IpAddr::V4(Ipv4Addr::from(*a)));
        v4.chain(self.v6.keys().map(|a| IpAddr::V6(*a)))
    }
}

impl FromIterator<IpAddr> for AddrMap<()> {
    fn from_iter<I: IntoIterator<Item = IpAddr>>(iter: I) -> Self {
        let mut m = Self::default();
        for a in iter {
            m.insert(a, ());
        }
        m
    }
}

/// Backends by id (the programmer's mirror of the backends map): an IPv4
/// backend in 8 bytes instead of 24, IPv6 ones in a map of their own.
#[derive(Clone, Debug, Default)]
pub struct BackendSlots {
    slots: Vec<Slot>,
    v6: HashMap<u32, Backend>,
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    addr: u32,
    port: u16,
    proto: u8,
    flags: u8,
}

const PRESENT: u8 = 1;
const V6: u8 = 2;
const SERVING: u8 = 4;
const TERMINATING: u8 = 8;
const LOCAL: u8 = 16;

impl BackendSlots {
    pub fn get(&self, id: BackendId) -> Option<Backend> {
        let i = id.get() as usize;
        let s = self.slots.get(i)?;
        if s.flags & PRESENT == 0 {
            return None;
        }
        if s.flags & V6 != 0 {
            return self.v6.get(&id.get()).copied();
        }
        Some(Backend {
            addr: IpAddr::V4(Ipv4Addr::from(s.addr)),
            port: s.port,
            proto: Protocol::from_number(s.proto).expect("packed from a Protocol"),
            serving: s.flags & SERVING != 0,
            terminating: s.flags & TERMINATING != 0,
            local: s.flags & LOCAL != 0,
        })
    }

    /// Sets (or clears) what id `id` holds; returns what it held.
    pub fn set(&mut self, id: BackendId, backend: Option<Backend>) -> Option<Backend> {
        let old = self.get(id);
        let i = id.get() as usize;
        if self.slots.len() <= i {
            if backend.is_none() {
                return old;
            }
            self.slots.resize(i + 1, Slot::default());
        }
        if old.is_some_and(|b| b.addr.is_ipv6()) {
            self.v6.remove(&id.get());
        }
        self.slots[i] = match backend {
            None => Slot::default(),
            Some(b) => {
                let flags = PRESENT
                    | (b.serving as u8 * SERVING)
                    | (b.terminating as u8 * TERMINATING)
                    | (b.local as u8 * LOCAL);
                match b.addr {
                    IpAddr::V4(a) => Slot {
                        addr: a.into(),
                        port: b.port,
                        proto: b.proto.number(),
                        flags,
                    },
                    IpAddr::V6(_) => {
                        self.v6.insert(id.get(), b);
                        Slot {
                            flags: PRESENT | V6,
                            ..Slot::default()
                        }
                    }
                }
            }
        };
        old
    }

    /// The ids that hold a backend, in order.
    pub fn ids(&self) -> impl Iterator<Item = BackendId> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.flags & PRESENT != 0)
            .filter_map(|(i, _)| BackendId::new(i as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_both_families_and_every_protocol_round_trip() {
        let keys = [
            BackendKey {
                addr: IpAddr::from([10, 0, 0, 1]),
                port: 65535,
                proto: Protocol::Sctp,
            },
            BackendKey {
                addr: IpAddr::from([255, 255, 255, 255]),
                port: 1,
                proto: Protocol::Udp,
            },
            BackendKey {
                addr: IpAddr::from([10, 0, 0, 1]),
                port: 65535,
                proto: Protocol::Tcp,
            },
            BackendKey {
                addr: "fd00::1".parse().unwrap(),
                port: 80,
                proto: Protocol::Tcp,
            },
        ];
        let mut m: BackendMap<usize> = keys.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        assert_eq!(m.len(), 4);
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(m.get(k), Some(&i), "{k:?}");
        }
        let mut back: Vec<(BackendKey, usize)> = m.iter().map(|(k, v)| (k, *v)).collect();
        back.sort_by_key(|(_, v)| *v);
        assert_eq!(back.iter().map(|(k, _)| *k).collect::<Vec<_>>(), keys);
        *m.entry(keys[3]).or_default() += 10;
        assert_eq!(m.remove(&keys[3]), Some(13));
        m.retain(|k, _| k.proto != Protocol::Udp);
        assert_eq!(m.len(), 2);
        assert!(m.contains_key(&keys[0]) && !m.contains_key(&keys[1]));
    }

    #[test]
    fn updating_all_at_once_is_updating_one_by_one() {
        let key = |i: u32| BackendKey {
            addr: if i.is_multiple_of(7) {
                IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, (i % 50) as u16])
            } else {
                IpAddr::from(u32::to_be_bytes(0x0a00_0000 + i % 3000))
            },
            port: 80 + (i % 2) as u16,
            proto: Protocol::Tcp,
        };
        let items: Vec<(BackendKey, u32)> = (0..10_000).map(|i| (key(i), i)).collect();
        let mut at_once: BackendMap<Vec<u32>> = BackendMap::default();
        at_once.update_all(&items, |_, v, i| v.push(i));
        let mut one_by_one: BackendMap<Vec<u32>> = BackendMap::default();
        for (k, i) in &items {
            one_by_one.entry(*k).or_default().push(*i);
        }
        assert_eq!(at_once.len(), one_by_one.len());
        for (k, v) in one_by_one.iter() {
            let mut got = at_once.get(&k).cloned().unwrap_or_default();
            got.sort();
            assert_eq!(&got, v, "{k:?}");
        }
    }

    #[test]
    fn backend_slots_keep_what_was_set_in_either_family() {
        let mut s = BackendSlots::default();
        let id = |n| BackendId::new(n).unwrap();
        let v4 = Backend {
            addr: IpAddr::from([10, 0, 0, 1]),
            port: 8080,
            proto: Protocol::Sctp,
            serving: true,
            terminating: true,
            local: false,
        };
        let v6 = Backend {
            addr: "fd00::1".parse().unwrap(),
            port: 53,
            proto: Protocol::Udp,
            serving: false,
            terminating: false,
            local: true,
        };
        assert_eq!(s.set(id(7), Some(v4)), None);
        assert_eq!(s.set(id(3), Some(v6)), None);
        assert_eq!(
            (s.get(id(7)), s.get(id(3)), s.get(id(5))),
            (Some(v4), Some(v6), None)
        );
        assert_eq!(s.ids().map(|i| i.get()).collect::<Vec<_>>(), [3, 7]);
        // An id changing family.
        assert_eq!(s.set(id(3), Some(v4)), Some(v6));
        assert!(s.v6.is_empty());
        assert_eq!(s.set(id(7), Some(v6)), Some(v4));
        assert_eq!(s.set(id(7), None), Some(v6));
        assert_eq!(s.set(id(99), None), None);
        assert_eq!(s.ids().map(|i| i.get()).collect::<Vec<_>>(), [3]);
        assert!(s.v6.is_empty());
    }
}
