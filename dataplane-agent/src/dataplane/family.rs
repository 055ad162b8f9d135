//! The maps each IP family has for itself, and the one trait that tells the
//! map layer how a family's addresses are stored ([`AbiAddr`]: `u32` for
//! IPv4, [`Ip6`] for IPv6). Everything that writes or reads a family's maps
//! is written once, generic over it; [`super::LbMaps`] holds one
//! [`FamilyMaps`] per family and picks by the address at hand.

use std::{
    net::{IpAddr, Ipv4Addr},
    os::fd::{AsFd as _, BorrowedFd},
};

use aya::maps::{Array, HashMap, IterableMap, LpmTrie, MapData};
use dataplane_common::{
    addr::{Addr, Ip6},
    ct::{CtEntry, CtKey, ct_flags},
    lb::{AffinityKey, LbAffinityValue, LbBackend, LbService, LbServiceKey, SourceRangeData},
    names, proto,
};

use super::{DatapathError, batch};
use crate::net::{IpFamily, ip6_from_words, ip6_words};

/// An address as one family's maps store it (network order).
pub trait AbiAddr: Addr + aya::Pod + Send + Sync + 'static {
    const IP_FAMILY: IpFamily;
    /// Bits of an address (a host prefix).
    const BITS: u8;
    const SERVICES: &'static str;
    const BACKENDS: &'static str;
    const AFFINITY: &'static str;
    const SOURCE_RANGES: &'static str;
    const CT: &'static str;
    const CT_ASSURED: &'static str;

    /// `None` when `ip` is of the other family.
    fn from_ip(ip: IpAddr) -> Option<Self>;
    fn to_ip(self) -> IpAddr;
}

impl AbiAddr for u32 {
    const IP_FAMILY: IpFamily = IpFamily::V4;
    const BITS: u8 = 32;
    const SERVICES: &'static str = names::LB4_SERVICES;
    const BACKENDS: &'static str = names::LB4_BACKENDS;
    const AFFINITY: &'static str = names::LB4_AFFINITY;
    const SOURCE_RANGES: &'static str = names::LB4_SOURCE_RANGES;
    const CT: &'static str = names::CT4;
    const CT_ASSURED: &'static str = names::CT4_ASSURED;

    fn from_ip(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V4(a) => Some(u32::from(a).to_be()),
            IpAddr::V6(_) => None,
        }
    }
    fn to_ip(self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(u32::from_be(self)))
    }
}

impl AbiAddr for Ip6 {
    const IP_FAMILY: IpFamily = IpFamily::V6;
    const BITS: u8 = 128;
    const SERVICES: &'static str = names::LB6_SERVICES;
    const BACKENDS: &'static str = names::LB6_BACKENDS;
    const AFFINITY: &'static str = names::LB6_AFFINITY;
    const SOURCE_RANGES: &'static str = names::LB6_SOURCE_RANGES;
    const CT: &'static str = names::CT6;
    const CT_ASSURED: &'static str = names::CT6_ASSURED;

    fn from_ip(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V6(a) => Some(ip6_words(a)),
            IpAddr::V4(_) => None,
        }
    }
    fn to_ip(self) -> IpAddr {
        IpAddr::V6(ip6_from_words(self))
    }
}

/// `ip` in family `A`'s layout; callers dispatch on the family first, so a
/// mismatch is a bug of the map layer.
pub(super) fn abi<A: AbiAddr>(ip: IpAddr) -> A {
    A::from_ip(ip).unwrap_or_else(|| panic!("{ip} reached the {} maps", A::IP_FAMILY))
}

type Map<K, V> = HashMap<MapData, K, V>;

/// Conntrack entries as read: (key, entry).
pub type CtEntries<A> = Vec<(CtKey<A>, CtEntry<A>)>;

/// One family's maps: services (frontends and slots), backends, affinity,
/// source ranges, conntrack.
pub struct FamilyMaps<A: AbiAddr> {
    pub(super) services: Map<LbServiceKey<A>, LbService>,
    pub(super) backends: Array<MapData, LbBackend<A>>,
    pub(super) affinity: Map<AffinityKey<A>, LbAffinityValue>,
    pub(super) source_ranges: LpmTrie<MapData, SourceRangeData<A>, u8>,
    /// Conntrack (an LRU).
    pub(super) ct: Map<CtKey<A>, CtEntry<A>>,
    /// Copies of assured flows' entries (never evicts; expired ones are
    /// collected by [`FamilyMaps::collect_expired`]).
    pub(super) ct_assured: Map<CtKey<A>, CtEntry<A>>,
    /// Of each conntrack table.
    pub(super) ct_capacity: u32,
    pub(super) affinity_capacity: u32,
    pub(super) service_entries_capacity: u32,
    /// Entries of the backends array: ids `1..` this.
    pub(super) backends_capacity: u32,
}

impl<A: AbiAddr> FamilyMaps<A> {
    pub(super) fn services_fd(&self) -> BorrowedFd<'_> {
        IterableMap::<LbServiceKey<A>, LbService>::map(&self.services)
            .fd()
            .as_fd()
    }

    pub(super) fn backends_fd(&self) -> BorrowedFd<'_> {
        IterableMap::<u32, LbBackend<A>>::map(&self.backends).fd().as_fd()
    }

    pub(super) fn ct_fd(&self) -> BorrowedFd<'_> {
        IterableMap::<CtKey<A>, _>::map(&self.ct).fd().as_fd()
    }

    fn affinity_fd(&self) -> BorrowedFd<'_> {
        IterableMap::<AffinityKey<A>, _>::map(&self.affinity).fd().as_fd()
    }

    fn ct_assured_fd(&self) -> BorrowedFd<'_> {
        IterableMap::<CtKey<A>, _>::map(&self.ct_assured).fd().as_fd()
    }

    /// The fd and name of one conntrack table.
    fn ct_table(&self, table: CtTable) -> (BorrowedFd<'_>, &'static str) {
        match table {
            CtTable::Lru => (self.ct_fd(), A::CT),
            CtTable::Assured => (self.ct_assured_fd(), A::CT_ASSURED),
        }
    }

    /// The entries of one conntrack table, read in batches: O(live
    /// entries) in a few syscalls.
    pub fn conntrack_table(&self, table: CtTable) -> Result<CtEntries<A>, DatapathError> {
        let (fd, name) = self.ct_table(table);
        let mut out = Vec::new();
        batch::for_each(fd, |k: &CtKey<A>, e: &CtEntry<A>| out.push((*k, *e)))
            .map_err(|source| DatapathError::Batch { name, source })?;
        Ok(out)
    }

    /// Every conntrack entry (both directions of every flow): the LRU's,
    /// and the assured copies of those it evicted (the datapath restores
    /// them at their flow's next packet).
    pub fn conntrack(&self) -> Result<CtEntries<A>, DatapathError> {
        let mut out = self.conntrack_table(CtTable::Lru)?;
        let held: std::collections::HashSet<CtKey<A>> = out.iter().map(|(k, _)| *k).collect();
        out.extend(
            self.conntrack_table(CtTable::Assured)?
                .into_iter()
                .filter(|(k, _)| !held.contains(k)),
        );
        Ok(out)
    }

    /// Deletes the entries `victims` from one table (entries the datapath
    /// removed meanwhile are skipped).
    fn delete_entries(&mut self, table: CtTable, victims: &[CtKey<A>]) -> Result<(), DatapathError> {
        let (fd, name) = self.ct_table(table);
        batch::delete(fd, victims).map_err(|(_, source)| DatapathError::Batch { name, source })
    }

    /// Deletes the conntrack entries `stale` selects, from both tables;
    /// returns how many, (LRU entries, assured copies).
    pub fn purge_conntrack(
        &mut self,
        stale: impl Fn(&CtKey<A>, &CtEntry<A>) -> bool,
    ) -> Result<(usize, usize), DatapathError> {
        let mut n = [0; 2];
        for (i, table) in [CtTable::Lru, CtTable::Assured].into_iter().enumerate() {
            let victims: Vec<CtKey<A>> = self
                .conntrack_table(table)?
                .into_iter()
                .filter(|(k, e)| stale(k, e))
                .map(|(k, _)| k)
                .collect();
            self.delete_entries(table, &victims)?;
            n[i] = victims.len();
        }
        Ok((n[0], n[1]))
    }

    /// Collects the expired copies of the assured table (the LRU reclaims
    /// its own entries): those idle for longer than their flow's state
    /// allows (`timeouts`), as the datapath judges them, at `now_ns` on its
    /// clock. Returns (copies left, copies collected).
    pub fn collect_expired(
        &mut self,
        timeouts: &dataplane_common::config::CtTimeouts,
        now_ns: u64,
    ) -> Result<(usize, usize), DatapathError> {
        let entries = self.conntrack_table(CtTable::Assured)?;
        let total = entries.len();
        let victims: Vec<CtKey<A>> = entries
            .into_iter()
            .filter(|(k, e)| expired(k, e, timeouts, now_ns))
            .map(|(k, _)| k)
            .collect();
        self.delete_entries(CtTable::Assured, &victims)?;
        Ok((total - victims.len(), victims.len()))
    }

    /// Deletes the UDP conntrack entries of flows translated to `backends`
    /// (address, port in network order): every entry whose flow goes to
    /// one of them, both directions. Returns how many, (LRU entries, assured
    /// copies).
    pub fn purge_udp_flows_to(&mut self, backends: &[(A, u16)]) -> Result<(usize, usize), DatapathError> {
        if backends.is_empty() {
            return Ok((0, 0));
        }
        let targets: std::collections::HashSet<(A, u16)> = backends.iter().copied().collect();
        self.purge_conntrack(|k, e| {
            k.proto == proto::UDP
                && match e.role() {
                    ct_flags::FWD_IN | ct_flags::FWD_OUT => targets.contains(&(e.nat_daddr, e.nat_dport)),
                    _ => targets.contains(&(k.saddr, k.sport)),
                }
        })
    }

    /// Backend addresses some conntrack entry still translates to or from.
    pub(super) fn addresses_in_use(&self) -> Result<std::collections::HashSet<IpAddr>, DatapathError> {
        let mut in_use = std::collections::HashSet::new();
        for (k, e) in self.conntrack()? {
            match e.role() {
                ct_flags::FWD_IN | ct_flags::FWD_OUT => in_use.insert(e.nat_daddr.to_ip()),
                _ => in_use.insert(k.saddr.to_ip()),
            };
        }
        Ok(in_use)
    }

    /// The ClientIP affinity entry of `client` for a service port.
    pub fn affinity(&self, service_id: u32, client: A) -> Option<LbAffinityValue> {
        self.affinity.get(&AffinityKey { client, service_id }, 0).ok()
    }

    /// Entries of the services map (frontends and their slots).
    pub(super) fn service_entries(&self) -> Result<usize, DatapathError> {
        let fd = IterableMap::<LbServiceKey<A>, _>::map(&self.services)
            .fd()
            .as_fd();
        batch::count::<LbServiceKey<A>, LbService>(fd).map_err(|source| DatapathError::Batch {
            name: A::SERVICES,
            source,
        })
    }

    /// (conntrack LRU, assured copies, affinity) entries, counted in
    /// batches.
    pub(super) fn counts(&self) -> (usize, usize, usize) {
        let ct = batch::count::<CtKey<A>, CtEntry<A>>(self.ct_fd()).unwrap_or(0);
        let assured = batch::count::<CtKey<A>, CtEntry<A>>(self.ct_assured_fd()).unwrap_or(0);
        let affinity = batch::count::<AffinityKey<A>, LbAffinityValue>(self.affinity_fd()).unwrap_or(0);
        (ct, assured, affinity)
    }
}

/// The two conntrack tables (see `dataplane_common::ct::assured`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtTable {
    /// Every flow's entries: an LRU map, which a flood of new flows evicts
    /// from.
    Lru,
    /// Copies of assured flows' entries: a hash map that never evicts.
    Assured,
}

/// Whether the datapath ignores `e` at `now_ns` (its `ct::expired`).
pub fn expired<A: Addr>(
    k: &CtKey<A>,
    e: &CtEntry<A>,
    timeouts: &dataplane_common::config::CtTimeouts,
    now_ns: u64,
) -> bool {
    now_ns.saturating_sub(e.last_seen_ns) > e.timeout_s(k.proto, timeouts) as u64 * 1_000_000_000
}

/// The bit an address takes in the filter (see `dataplane_common::filter`).
pub(super) fn fold(ip: IpAddr) -> u32 {
    match ip {
        IpAddr::V4(_) => abi::<u32>(ip).fold(),
        IpAddr::V6(_) => abi::<Ip6>(ip).fold(),
    }
}
