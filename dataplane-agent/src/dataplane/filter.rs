//! The address pre-filters (`DP_ADDR_FILTER_V2`, see
//! `dataplane_common::filter`), kept exact by reference counts: a bit is set
//! while at least one address mapping to it is held by a frontend, a
//! backend or the config (SNAT address), and cleared when the last goes.
//! Changes collect in a shadow copy and reach the map in [`AddressFilter::flush`],
//! once per sync, so programming a large table costs one write per changed
//! word, not per address.

use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
};

use aya::maps::{Array, MapData};
use dataplane_common::filter::{BACKENDS, FILTER_WORDS, FRONTENDS, slot};

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

#[derive(Debug)]
pub struct AddressFilter {
    /// Address fold each holder holds, per holder.
    holders: HashMap<Holder, u32>,
    /// Holders per (set, address fold).
    addresses: HashMap<(u32, u32), u32>,
    /// Addresses per (set, bit).
    bits: HashMap<(u32, u32), u32>,
    words: Vec<u64>,
    dirty: BTreeSet<u32>,
}

impl Default for AddressFilter {
    fn default() -> Self {
        Self {
            holders: HashMap::new(),
            addresses: HashMap::new(),
            bits: HashMap::new(),
            words: vec![0; 2 * FILTER_WORDS as usize],
            dirty: BTreeSet::new(),
        }
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
        match self.holders.insert(holder, addr) {
            Some(old) if old == addr => return,
            Some(old) => self.drop_address(set_of(holder), old),
            None => {}
        }
        let set = set_of(holder);
        let n = self.addresses.entry((set, addr)).or_insert(0);
        *n += 1;
        if *n == 1 {
            let (word, bit) = slot(set, addr);
            let b = bit.trailing_zeros();
            let count = self.bits.entry((word, b)).or_insert(0);
            *count += 1;
            if *count == 1 {
                self.words[word as usize] |= bit;
                self.dirty.insert(word);
            }
        }
    }

    /// The address `holder` holds.
    pub fn held(&self, holder: Holder) -> Option<u32> {
        self.holders.get(&holder).copied()
    }

    pub fn release(&mut self, holder: Holder) {
        if let Some(addr) = self.holders.remove(&holder) {
            self.drop_address(set_of(holder), addr);
        }
    }

    fn drop_address(&mut self, set: u32, addr: u32) {
        let Some(n) = self.addresses.get_mut(&(set, addr)) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        self.addresses.remove(&(set, addr));
        let (word, bit) = slot(set, addr);
        let key = (word, bit.trailing_zeros());
        if let Some(count) = self.bits.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                self.bits.remove(&key);
                self.words[word as usize] &= !bit;
                self.dirty.insert(word);
            }
        }
    }

    /// Writes the words that changed since the last flush; with `all`,
    /// every word that differs from the map (after adopting pinned maps).
    pub fn flush(&mut self, map: &mut Array<MapData, u64>, all: bool) -> Result<usize, aya::maps::MapError> {
        let words: Vec<u32> = if all {
            (0..2 * FILTER_WORDS).collect()
        } else {
            std::mem::take(&mut self.dirty).into_iter().collect()
        };
        let mut written = 0;
        for w in words {
            let want = self.words[w as usize];
            if all && map.get(&w, 0).is_ok_and(|have| have == want) {
                continue;
            }
            map.set(w, want, 0)?;
            written += 1;
        }
        self.dirty.clear();
        Ok(written)
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
}
