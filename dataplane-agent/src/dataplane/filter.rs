//! The address pre-filters (`DP_ADDR_FILTER_V2`, see
//! `dataplane_common::filter`), kept exact by reference counts: a bit is set
//! while at least one holder (a frontend, a backend or the config's SNAT
//! address) holds an address mapping to it, and cleared when the last goes.
//! Changes collect in a shadow copy and reach the map in [`AddressFilter::flush`],
//! once per sync and in batches, so programming a large table costs one
//! write per changed word, not per address.
//!
//! Sized for a million backends: holders are counted per bit (a flat array,
//! no per-address index); backend holders, whose ids are dense, are kept in
//! a vector indexed by id; a holder named by its address (a frontend, a
//! ClusterIP, a removed backend) holds that address's fold, so only that it
//! holds is kept (an IPv4 one packed in 8 bytes).

use std::{net::IpAddr, os::fd::AsFd as _};

use aya::maps::{Array, IterableMap as _, MapData};
use dataplane_common::filter::{BACKENDS, FILTER_WORDS, FRONTENDS, slot};
use foldhash::{HashMap, HashMapExt as _, HashSet, HashSetExt as _};

use super::batch;
use crate::net::IpFamily;

/// Who holds an address in a set. The address each holds is given as its
/// 32-bit fold (`Addr::fold`: an IPv4 address itself in network order), which
/// is all the bit depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Holder {
    /// A frontend (address, port in network order, protocol) of a services
    /// map.
    Frontend(IpAddr, u16, u8),
    /// The wildcard entry of a ClusterIP.
    ServiceAddress(IpAddr),
    /// A backend id.
    Backend(u32),
    /// The SNAT address of one family in the config.
    Snat(IpFamily),
    /// A removed backend's address, while its flows may live on.
    Retired(IpAddr),
}

/// Bits of both sets.
const BITS: usize = 2 * FILTER_WORDS as usize * 64;

#[derive(Debug)]
pub struct AddressFilter {
    /// The fold each backend id holds (valid where `backend_held` is set).
    backends: Vec<u32>,
    backend_held: Vec<u64>,
    /// Holders named by an IPv4 address (see [`packed`]) that hold it.
    by_v4_address: HashSet<u64>,
    /// Other holders named by an address (IPv6).
    by_address: HashSet<Holder>,
    /// The SNAT addresses' folds (IPv4, IPv6).
    snat: [Option<u32>; 2],
    /// Holders per bit (both sets); a count that reaches `u8::MAX` goes on
    /// in `large` (thousands of NodePorts share the node's address).
    counts: Vec<u8>,
    large: HashMap<u32, u32>,
    words: Vec<u64>,
    /// Words changed since the last flush (a bit per word).
    dirty: Vec<u64>,
}

impl Default for AddressFilter {
    fn default() -> Self {
        let words = 2 * FILTER_WORDS as usize;
        Self {
            backends: Vec::new(),
            backend_held: Vec::new(),
            by_v4_address: HashSet::new(),
            by_address: HashSet::new(),
            snat: [None; 2],
            counts: vec![0; BITS],
            large: HashMap::new(),
            words: vec![0; words],
            dirty: vec![0; words.div_ceil(64)],
        }
    }
}

/// The address a holder is named by, if any: it holds that address's fold.
fn address_of(holder: Holder) -> Option<IpAddr> {
    match holder {
        Holder::Frontend(a, ..) | Holder::ServiceAddress(a) | Holder::Retired(a) => Some(a),
        Holder::Backend(_) | Holder::Snat(_) => None,
    }
}

/// An IPv4-addressed holder in 8 bytes: the address, then the port and
/// protocol of a frontend, and which kind of holder.
fn packed(holder: Holder) -> Option<u64> {
    let (addr, low) = match holder {
        Holder::Frontend(IpAddr::V4(a), port, proto) => (a, (port as u32) << 16 | (proto as u32) << 8),
        Holder::ServiceAddress(IpAddr::V4(a)) => (a, 1),
        Holder::Retired(IpAddr::V4(a)) => (a, 2),
        _ => return None,
    };
    Some((u32::from(addr) as u64) << 32 | low as u64)
}

fn snat_slot(family: IpFamily) -> usize {
    match family {
        IpFamily::V4 => 0,
        IpFamily::V6 => 1,
    }
}

fn set_of(holder: Holder) -> u32 {
    match holder {
        Holder::Backend(_) | Holder::Retired(_) => BACKENDS,
        _ => FRONTENDS,
    }
}

impl AddressFilter {
    /// `holder` now holds `addr` (network order); a holder holds one
    /// address at a time.
    pub fn hold(&mut self, holder: Holder, addr: u32) {
        let old = match holder {
            Holder::Backend(id) => {
                let i = id as usize;
                if self.backends.len() <= i {
                    let len = (i + 1).next_power_of_two();
                    self.backends.resize(len, 0);
                    self.backend_held.resize(len.div_ceil(64), 0);
                }
                let held = self.backend_held[i / 64] & (1 << (i % 64)) != 0;
                self.backend_held[i / 64] |= 1 << (i % 64);
                let old = held.then_some(self.backends[i]);
                self.backends[i] = addr;
                old
            }
            Holder::Snat(family) => self.snat[snat_slot(family)].replace(addr),
            _ => {
                debug_assert_eq!(
                    Some(addr),
                    address_of(holder).map(super::family::fold),
                    "{holder:?} holds its own address"
                );
                let new = match packed(holder) {
                    Some(k) => self.by_v4_address.insert(k),
                    None => self.by_address.insert(holder),
                };
                (!new).then_some(addr)
            }
        };
        match old {
            Some(old) if old == addr => return,
            Some(old) => self.drop_bit(set_of(holder), old),
            None => {}
        }
        let (word, bit) = slot(set_of(holder), addr);
        let i = word as usize * 64 + bit.trailing_zeros() as usize;
        match self.counts[i] {
            0 => {
                self.counts[i] = 1;
                self.words[word as usize] |= bit;
                self.mark(word);
            }
            u8::MAX => *self.large.entry(i as u32).or_insert(u8::MAX as u32) += 1,
            n => self.counts[i] = n + 1,
        }
    }

    /// The address `holder` holds.
    pub fn held(&self, holder: Holder) -> Option<u32> {
        match holder {
            Holder::Backend(id) => {
                let i = id as usize;
                let held = self
                    .backend_held
                    .get(i / 64)
                    .is_some_and(|w| w & (1 << (i % 64)) != 0);
                held.then(|| self.backends[i])
            }
            Holder::Snat(family) => self.snat[snat_slot(family)],
            _ => {
                let held = match packed(holder) {
                    Some(k) => self.by_v4_address.contains(&k),
                    None => self.by_address.contains(&holder),
                };
                held.then(|| address_of(holder).map(super::family::fold))
                    .flatten()
            }
        }
    }

    pub fn release(&mut self, holder: Holder) {
        let old = match holder {
            Holder::Backend(id) => {
                let old = self.held(holder);
                let i = id as usize;
                if old.is_some() {
                    self.backend_held[i / 64] &= !(1 << (i % 64));
                }
                old
            }
            Holder::Snat(family) => self.snat[snat_slot(family)].take(),
            _ => {
                let held = match packed(holder) {
                    Some(k) => self.by_v4_address.remove(&k),
                    None => self.by_address.remove(&holder),
                };
                held.then(|| address_of(holder).map(super::family::fold))
                    .flatten()
            }
        };
        if let Some(addr) = old {
            self.drop_bit(set_of(holder), addr);
        }
    }

    fn drop_bit(&mut self, set: u32, addr: u32) {
        let (word, bit) = slot(set, addr);
        let i = word as usize * 64 + bit.trailing_zeros() as usize;
        match self.counts[i] {
            0 => {}
            1 => {
                self.counts[i] = 0;
                self.words[word as usize] &= !bit;
                self.mark(word);
            }
            u8::MAX => {
                let n = self.large.get_mut(&(i as u32)).expect("a large count");
                *n -= 1;
                if *n < u8::MAX as u32 {
                    self.large.remove(&(i as u32));
                    self.counts[i] = u8::MAX - 1;
                }
            }
            n => self.counts[i] = n - 1,
        }
    }

    fn mark(&mut self, word: u32) {
        self.dirty[word as usize / 64] |= 1 << (word % 64);
    }

    /// Writes the words that changed since the last flush (in one batch);
    /// with `all`, every word that differs from the map (after adopting
    /// pinned maps). Returns how many were written.
    pub fn flush(&mut self, map: &mut Array<MapData, u64>, all: bool) -> Result<usize, std::io::Error> {
        let fd = map.map().fd().as_fd();
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        if all {
            let mut have = vec![0u64; self.words.len()];
            batch::for_each(fd, |w: &u32, v: &u64| {
                if let Some(h) = have.get_mut(*w as usize) {
                    *h = *v;
                }
            })?;
            for (w, want) in self.words.iter().enumerate() {
                if have[w] != *want {
                    keys.push(w as u32);
                    values.push(*want);
                }
            }
        } else {
            for (i, bits) in self.dirty.iter().enumerate() {
                let mut bits = *bits;
                while bits != 0 {
                    let w = i * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    keys.push(w as u32);
                    values.push(self.words[w]);
                }
            }
        }
        batch::update_pairs(fd, &keys, &values).map_err(|(_, e)| e)?;
        self.dirty.fill(0);
        Ok(keys.len())
    }

    /// Whether `addr` is in the filter's `set`, as the kernel would see it.
    #[cfg(test)]
    pub fn maybe(&self, set: u32, addr: u32) -> bool {
        let (word, bit) = slot(set, addr);
        self.words[word as usize] & bit != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_follow_their_last_holder() {
        let mut f = AddressFilter::default();
        let ip = IpAddr::from([10, 96, 0, 1]);
        let a = u32::from(std::net::Ipv4Addr::new(10, 96, 0, 1)).to_be();
        f.hold(Holder::Frontend(ip, 80, 6), a);
        f.hold(Holder::Frontend(ip, 443, 6), a);
        assert!(f.maybe(FRONTENDS, a));
        f.release(Holder::Frontend(ip, 80, 6));
        assert!(f.maybe(FRONTENDS, a), "still held by :443");
        f.release(Holder::Frontend(ip, 443, 6));
        assert!(!f.maybe(FRONTENDS, a));
        // A backend id moving to another address releases the old one.
        let (b1, b2) = (0x0a00_0001u32.to_be(), 0x0a00_0002u32.to_be());
        f.hold(Holder::Backend(7), b1);
        f.hold(Holder::Backend(7), b2);
        assert!(!f.maybe(BACKENDS, b1) && f.maybe(BACKENDS, b2));
        // Addresses sharing a bit keep it until both are gone.
        let other = (1..1u32 << 24)
            .map(|k| b2.wrapping_add(k))
            .find(|a| slot(BACKENDS, *a) == slot(BACKENDS, b2))
            .expect("2^21 bits: a colliding address within 2^24 tries");
        f.hold(Holder::Backend(8), other);
        f.release(Holder::Backend(7));
        assert!(f.maybe(BACKENDS, b2), "bit shared with {other:#x}");
        f.release(Holder::Backend(8));
        assert!(!f.maybe(BACKENDS, b2));
        assert!(f.words.iter().all(|w| *w == 0));
    }

    #[test]
    fn a_bit_held_by_more_holders_than_a_count_holds_is_counted_exactly() {
        let mut f = AddressFilter::default();
        let ip = IpAddr::from([198, 18, 0, 11]);
        let a = u32::from(std::net::Ipv4Addr::new(198, 18, 0, 11)).to_be();
        let n = u16::MAX as u32 + 10;
        for k in 0..n {
            f.hold(Holder::Frontend(ip, k as u16, (k >> 16) as u8), a);
        }
        for k in 0..n - 1 {
            f.release(Holder::Frontend(ip, k as u16, (k >> 16) as u8));
            assert!(f.maybe(FRONTENDS, a), "{} holders left", n - 1 - k);
        }
        f.release(Holder::Frontend(ip, (n - 1) as u16, ((n - 1) >> 16) as u8));
        assert!(!f.maybe(FRONTENDS, a));
        assert!(f.large.is_empty() && f.counts.iter().all(|c| *c == 0));
    }
}
