//! Typed access to the datapath's maps: the one place that knows the byte
//! order and layout of every key and value. The service table's entries
//! (frontends, backends, ranges, names) are in [`super::table`]; the maps
//! of each IP family in [`super::family`].

use std::{net::IpAddr, os::fd::AsFd as _};

use aya::maps::{Array, HashMap, IterableMap, MapData, PerCpuArray};
use dataplane_common::{
    addr::{Addr, Ip6},
    config::{DpConfig, config_flags},
    ct::{Ct4Entry, Ct4Key, Ct6Entry, Ct6Key},
    hint,
    lb::{LbAffinityValue, LbService, LbServiceKey, LbServiceName},
    names,
    stats::{Counter, Event, FlowStat, Hook, counter_index},
};

use super::{
    DatapathConfig, DatapathError, batch, err,
    family::{AbiAddr, FamilyMaps, fold},
    filter::{AddressFilter, Holder},
};
use crate::net::IpFamily;

/// How long a removed backend's address stays in the filter before the
/// agent checks whether conntrack still names it.
pub const RETIRE_GRACE: std::time::Duration = std::time::Duration::from_secs(300);

type Map<K, V> = HashMap<MapData, K, V>;

/// The datapath's maps, typed: those both families share (config, counters,
/// service names and stats, the address filter) and one [`FamilyMaps`] per
/// family.
pub struct LbMaps {
    pub(super) config: Array<MapData, DpConfig>,
    pub(super) v4: FamilyMaps<u32>,
    pub(super) v6: FamilyMaps<Ip6>,
    pub(super) counters: PerCpuArray<MapData, Counter>,
    pub(super) service_stats: PerCpuArray<MapData, Counter>,
    pub(super) service_names: Map<u32, LbServiceName>,
    pub(super) sock_revnat: Map<dataplane_common::ct::Sock4RevKey, dataplane_common::ct::Sock4RevValue>,
    pub(super) sock_revnat6: Map<dataplane_common::ct::Sock6RevKey, dataplane_common::ct::Sock6RevValue>,
    pub(super) addr_filter: Array<MapData, u64>,
    pub(super) hint_devices: Array<MapData, u64>,
    /// What `hint_devices` holds, once read (see `set_hint_devices`).
    pub(super) hint_shadow: Option<Vec<u64>>,
    pub(super) flow_stats: PerCpuArray<MapData, Counter>,
    /// Maglev tables, DSR entries, the devices XDP may redirect to.
    pub(super) derived: super::derived::DerivedMaps,
    /// The SNAT hash seed of a pinned config map of the previous layout
    /// (an upgrade): kept, as a configured map's is.
    pub(super) inherited_snat_seed: Option<u32>,
    /// The filter's shadow copy and reference counts (see `filter`).
    pub(super) filter: AddressFilter,
    /// Addresses of removed backends, kept in the filter until their flows
    /// are gone: (when to check again, address).
    pub(super) retired: Vec<(std::time::Instant, IpAddr)>,
    pub(super) max_services: u32,
    /// Backend ids are `1..` this (one id space for both families).
    pub(super) max_backends: u32,
}

impl LbMaps {
    /// The IPv4 maps.
    pub fn v4(&self) -> &FamilyMaps<u32> {
        &self.v4
    }

    /// The IPv6 maps.
    pub fn v6(&self) -> &FamilyMaps<Ip6> {
        &self.v6
    }

    pub fn v4_mut(&mut self) -> &mut FamilyMaps<u32> {
        &mut self.v4
    }

    pub fn v6_mut(&mut self) -> &mut FamilyMaps<Ip6> {
        &mut self.v6
    }

    /// Writes the node-wide settings; until then the datapath passes
    /// everything untouched.
    pub fn set_config(&mut self, config: &DatapathConfig) -> Result<(), DatapathError> {
        let mut previous = self.config.get(&0, 0).map_err(err(names::CONFIG))?;
        if previous.flags & config_flags::CONFIGURED == 0
            && let Some(seed) = self.inherited_snat_seed
        {
            previous.snat_hash_seed = seed;
            previous.flags |= config_flags::CONFIGURED;
        }
        let abi = config.to_abi(&previous)?;
        for (family, ip) in [
            (IpFamily::V4, config.snat_ip.map(IpAddr::V4)),
            (IpFamily::V6, config.snat_ip6.map(IpAddr::V6)),
        ] {
            match ip {
                Some(ip) => self.filter.hold(Holder::Snat(family), fold(ip)),
                None => self.filter.release(Holder::Snat(family)),
            }
        }
        self.flush_filter()?;
        let abi = DpConfig {
            flags: abi.flags | config_flags::FILTER_READY,
            ..abi
        };
        self.derived.size = abi.maglev_size;
        self.derived.seed = abi.maglev_seed;
        self.config.set(0, abi, 0).map_err(err(names::CONFIG))
    }

    /// Maglev tables, DSR entries and the devices XDP may redirect to.
    pub fn derived(&self) -> &super::derived::DerivedMaps {
        &self.derived
    }

    /// Lets XDP redirect forwarded packets to `ifindex`, or no longer.
    pub fn set_xdp_device(&mut self, ifindex: u32, on: bool) -> Result<(), DatapathError> {
        self.derived.set_xdp_device(ifindex, on)
    }

    /// Makes `devices` (indexes) exactly the devices whose ingress word
    /// egress trusts (see `dataplane_common::hint`); devices beyond the
    /// bitmap are left out. Writes only the words that change (the map is
    /// read once). Returns how many it wrote.
    pub fn set_hint_devices(
        &mut self,
        devices: &std::collections::BTreeSet<u32>,
    ) -> Result<usize, DatapathError> {
        let name = names::HINT_DEVICES;
        let shadow = match self.hint_shadow.take() {
            Some(s) => s,
            None => (0..hint::DEVICE_WORDS)
                .map(|i| self.hint_devices.get(&i, 0).map_err(err(name)))
                .collect::<Result<Vec<u64>, _>>()?,
        };
        let mut want = vec![0u64; hint::DEVICE_WORDS as usize];
        for (w, bit) in devices.iter().filter_map(|d| hint::device_slot(*d)) {
            want[w as usize] |= bit;
        }
        let mut written = 0;
        let mut result = Ok(());
        let mut now = shadow;
        for (i, (have, want)) in now.iter_mut().zip(&want).enumerate() {
            if have != want {
                if let Err(e) = self.hint_devices.set(i as u32, *want, 0) {
                    result = Err(err(name)(e));
                    break;
                }
                *have = *want;
                written += 1;
            }
        }
        self.hint_shadow = Some(now);
        result.map(|()| written)
    }

    /// The node-wide settings as the datapath holds them.
    pub fn config(&self) -> Result<DpConfig, DatapathError> {
        self.config.get(&0, 0).map_err(err(names::CONFIG))
    }

    /// Writes the address filter's changed words. Called after each batch
    /// of writes (a sync); a frontend written before its filter bit is
    /// unreachable only until then, and a bit outliving its frontend only
    /// costs the full path.
    pub fn flush_filter(&mut self) -> Result<usize, DatapathError> {
        self.filter
            .flush(&mut self.addr_filter, false)
            .map_err(|source| DatapathError::Batch {
                name: names::ADDR_FILTER,
                source,
            })
    }

    /// Rebuilds the filter from what the maps hold (after adopting pinned
    /// maps) and writes whatever differs.
    pub(super) fn rebuild_filter(&mut self) -> Result<(), DatapathError> {
        self.filter = AddressFilter::default();
        let config = self.config()?;
        if config.flags & config_flags::CONFIGURED != 0 {
            if config.snat_ip != 0 {
                self.filter.hold(Holder::Snat(IpFamily::V4), config.snat_ip);
            }
            if config.snat_ip6 != [0; 4] {
                self.filter
                    .hold(Holder::Snat(IpFamily::V6), config.snat_ip6.fold());
            }
        }
        for (id, b) in self.backends()? {
            self.filter.hold(Holder::Backend(id.get()), fold(b.addr));
        }
        hold_heads(&mut self.filter, &self.v4)?;
        hold_heads(&mut self.filter, &self.v6)?;
        self.filter
            .flush(&mut self.addr_filter, true)
            .map_err(|source| DatapathError::Batch {
                name: names::ADDR_FILTER,
                source,
            })?;
        Ok(())
    }

    /// removal is older than [`RETIRE_GRACE`]. Returns how many went.
    pub fn expire_retired_backends(&mut self) -> Result<usize, DatapathError> {
        let now = std::time::Instant::now();
        if !self.retired.iter().any(|(due, _)| *due <= now) {
            return Ok(0);
        }
        let mut in_use = self.v4.addresses_in_use()?;
        in_use.extend(self.v6.addresses_in_use()?);
        let mut released = 0;
        let (due, mut keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retired)
            .into_iter()
            .partition(|(d, _)| *d <= now);
        for (_, addr) in due {
            if in_use.contains(&addr) {
                keep.push((now + RETIRE_GRACE, addr));
            } else if !keep.iter().any(|(_, a)| *a == addr) {
                self.filter.release(Holder::Retired(addr));
                released += 1;
            }
        }
        self.retired = keep;
        self.flush_filter()?;
        Ok(released)
    }

    /// Every IPv4 conntrack entry (see [`FamilyMaps::conntrack`]).
    pub fn conntrack(&self) -> Result<Vec<(Ct4Key, Ct4Entry)>, DatapathError> {
        self.v4.conntrack()
    }

    /// Every IPv6 conntrack entry.
    pub fn conntrack6(&self) -> Result<Vec<(Ct6Key, Ct6Entry)>, DatapathError> {
        self.v6.conntrack()
    }

    /// Deletes the UDP conntrack entries of flows translated to `backends`
    /// (kube-proxy clears these when an endpoint stops serving, so that
    /// e.g. DNS clients move on at once): every entry whose flow goes to
    /// one of them, both directions, in both families.
    pub fn purge_udp_flows_to(&mut self, backends: &[(IpAddr, u16)]) -> Result<usize, DatapathError> {
        fn of<A: AbiAddr>(backends: &[(IpAddr, u16)]) -> Vec<(A, u16)> {
            backends
                .iter()
                .filter_map(|(a, p)| Some((A::from_ip(*a)?, p.to_be())))
                .collect()
        }
        let (y4, a4) = self.v4.purge_udp_flows_to(&of::<u32>(backends))?;
        let (y6, a6) = self.v6.purge_udp_flows_to(&of::<Ip6>(backends))?;
        self.add_flow_stat(FlowStat::CtDeleted, (y4 + y6) as u64)?;
        Ok(y4 + y6 + a4 + a6)
    }

    /// Collects the expired copies of both families' assured conntrack
    /// tables (see [`FamilyMaps::collect_expired`]) at `now_ns`
    /// on the datapath's clock; returns (entries left, entries collected).
    pub fn collect_expired_conntrack(&mut self, now_ns: u64) -> Result<(usize, usize), DatapathError> {
        let timeouts = self.config()?.timeouts;
        let (l4, c4) = self.v4.collect_expired(&timeouts, now_ns)?;
        let (l6, c6) = self.v6.collect_expired(&timeouts, now_ns)?;
        self.add_flow_stat(FlowStat::CtCollected, (c4 + c6) as u64)?;
        Ok((l4 + l6, c4 + c6))
    }

    /// Entries of each conntrack table of one family (`--conntrack-entries`).
    pub fn conntrack_capacity(&self) -> u32 {
        self.v4.ct_capacity
    }

    /// Adds `n` to a flow counter only the agent writes (its first CPU's
    /// slot: the datapath never touches these).
    fn add_flow_stat(&mut self, stat: FlowStat, n: u64) -> Result<(), DatapathError> {
        debug_assert!(matches!(stat, FlowStat::CtDeleted | FlowStat::CtCollected));
        if n == 0 {
            return Ok(());
        }
        let mut per_cpu: Vec<Counter> = self
            .flow_stats
            .get(&(stat as u32), 0)
            .map_err(err(names::FLOW_STATS))?
            .to_vec();
        if let Some(first) = per_cpu.first_mut() {
            first.packets += n;
        }
        let values = aya::maps::PerCpuValues::try_from(per_cpu).map_err(|source| DatapathError::Batch {
            name: names::FLOW_STATS,
            source,
        })?;
        self.flow_stats
            .set(stat as u32, values, 0)
            .map_err(err(names::FLOW_STATS))
    }

    /// Entries the conntrack LRUs evicted so far (both families), told
    /// from the datapath's counts (see `FlowStat::CtInserted`):
    /// exact when nothing writes meanwhile, within the entries written
    /// during the read otherwise.
    pub fn ct_evictions(&self) -> Result<u64, DatapathError> {
        let stat =
            |s: FlowStat| sum_per_cpu(&self.flow_stats, s as u32, names::FLOW_STATS).map(|c| c.packets);
        let inserted = stat(FlowStat::CtInserted)? + stat(FlowStat::CtRestored)?;
        let gone = stat(FlowStat::CtRemoved)? + stat(FlowStat::CtDeleted)?;
        let held = (self.v4.counts().0 + self.v6.counts().0) as u64;
        Ok(inserted.saturating_sub(gone).saturating_sub(held))
    }

    /// Flow statistics ([`FlowStat`]), summed over CPUs.
    pub fn flow_stats(&self) -> Result<Vec<(FlowStat, u64)>, DatapathError> {
        FlowStat::ALL
            .iter()
            .map(|&s| {
                Ok((
                    s,
                    sum_per_cpu(&self.flow_stats, s as u32, names::FLOW_STATS)?.packets,
                ))
            })
            .collect()
    }

    /// The ClientIP affinity entry of `client` for a service port.
    pub fn affinity(&self, service_id: u32, client: IpAddr) -> Option<LbAffinityValue> {
        match client {
            IpAddr::V4(_) => self.v4.affinity(service_id, super::family::abi(client)),
            IpAddr::V6(_) => self.v6.affinity(service_id, super::family::abi(client)),
        }
    }

    /// One hook's count of one event, summed over CPUs.
    pub fn hook_counter(&self, hook: Hook, event: Event) -> Result<Counter, DatapathError> {
        sum_per_cpu(&self.counters, counter_index(hook, event), names::COUNTERS)
    }

    /// An event summed over hooks and CPUs.
    pub fn counter(&self, event: Event) -> Result<Counter, DatapathError> {
        let mut total = Counter::default();
        for hook in Hook::ALL {
            total.merge(&self.hook_counter(hook, event)?);
        }
        Ok(total)
    }

    /// Every packet a hook saw (each is counted under exactly one event).
    pub fn received(&self, hook: Hook) -> Result<Counter, DatapathError> {
        let mut total = Counter::default();
        for event in Event::ALL {
            total.merge(&self.hook_counter(hook, event)?);
        }
        Ok(total)
    }

    /// Every event, summed over hooks.
    pub fn counters(&self) -> Result<Vec<(Event, Counter)>, DatapathError> {
        Event::ALL.iter().map(|&e| Ok((e, self.counter(e)?))).collect()
    }

    /// Packets and bytes translated for a service port, summed over CPUs.
    pub fn service_stats(&self, service_id: u32) -> Result<Counter, DatapathError> {
        sum_per_cpu(&self.service_stats, service_id, names::SERVICE_STATS)
    }
    /// Packets and bytes of every service id below `below` that saw
    /// traffic, read in batches (one syscall per few thousand ids).
    pub fn all_service_stats(&self, below: u32) -> Result<Vec<(u32, Counter)>, DatapathError> {
        let mut out = Vec::new();
        let ncpus = aya::util::nr_cpus().map_err(|(_, e)| DatapathError::Batch {
            name: names::SERVICE_STATS,
            source: e,
        })?;
        let fd = IterableMap::<u32, _>::map(&self.service_stats).fd().as_fd();
        batch::for_each_per_cpu(fd, ncpus, |id: &u32, per_cpu: &[Counter]| {
            if *id < below {
                let mut total = Counter::default();
                per_cpu.iter().for_each(|c| total.merge(c));
                if total.packets > 0 {
                    out.push((*id, total));
                }
            }
        })
        .map_err(|source| DatapathError::Batch {
            name: names::SERVICE_STATS,
            source,
        })?;
        Ok(out)
    }
}

impl LbMaps {
    /// (entries, capacity) of the maps worth watching. The services and
    /// backends maps hold what the agent wrote (it knows their occupancy
    /// without reading them, see `agent::sync`); conntrack and affinity are
    /// counted here, in batches: O(live entries) in a few syscalls.
    pub fn occupancy(&self) -> std::collections::BTreeMap<&'static str, (u64, u64)> {
        fn of<A: AbiAddr>(m: &FamilyMaps<A>, out: &mut std::collections::BTreeMap<&'static str, (u64, u64)>) {
            let (ct, assured, affinity) = m.counts();
            out.insert(A::CT, (ct as u64, m.ct_capacity as u64));
            out.insert(A::CT_ASSURED, (assured as u64, m.ct_capacity as u64));
            out.insert(A::AFFINITY, (affinity as u64, m.affinity_capacity as u64));
        }
        let mut out = std::collections::BTreeMap::new();
        of(&self.v4, &mut out);
        // An IPv4-only node's IPv6 maps have one entry: not worth a gauge.
        if self.v6.ct_capacity > 1 {
            of(&self.v6, &mut out);
        }
        out
    }

    /// Capacities of the maps the agent writes: service ports, backend ids
    /// (`1..` this), services-map entries (of one family's map).
    pub fn capacities(&self) -> (u32, u32, u32) {
        (
            self.max_services,
            self.max_backends,
            self.v4.service_entries_capacity,
        )
    }

    /// Entries of the services maps (frontends and their slots) of the
    /// family that has more of them, counted in batches.
    pub fn service_entries(&self) -> Result<usize, DatapathError> {
        Ok(self.v4.service_entries()?.max(self.v6.service_entries()?))
    }

    /// Backends chosen at connect() time, as the connect-time programs
    /// recorded them (both families).
    pub fn sock_translations(&self) -> Result<Vec<std::net::SocketAddr>, DatapathError> {
        let mut out = Vec::new();
        for k in self.sock_revnat.keys() {
            let k = k.map_err(err(names::SOCK4_REVNAT))?;
            out.push(std::net::SocketAddr::new(k.addr.to_ip(), u16::from_be(k.port)));
        }
        for k in self.sock_revnat6.keys() {
            let k = k.map_err(err(names::SOCK6_REVNAT))?;
            out.push(std::net::SocketAddr::new(k.addr.to_ip(), u16::from_be(k.port)));
        }
        Ok(out)
    }
}

fn sum_per_cpu(
    map: &PerCpuArray<MapData, Counter>,
    index: u32,
    name: &'static str,
) -> Result<Counter, DatapathError> {
    let per_cpu = map.get(&index, 0).map_err(err(name))?;
    let mut total = Counter::default();
    per_cpu.iter().for_each(|c| total.merge(c));
    Ok(total)
}

/// Holds every frontend and ClusterIP of one family's services map in the
/// filter (slot 0 of every frontend, read in batches: a million entries at
/// 100k Services).
fn hold_heads<A: AbiAddr>(filter: &mut AddressFilter, m: &FamilyMaps<A>) -> Result<(), DatapathError> {
    let mut heads = Vec::new();
    batch::for_each(m.services_fd(), |k: &LbServiceKey<A>, _: &LbService| {
        if k.slot == 0 {
            heads.push(*k);
        }
    })
    .map_err(|source| DatapathError::Batch {
        name: A::SERVICES,
        source,
    })?;
    for k in heads {
        let ip = k.address.to_ip();
        if k.port == 0 && k.proto == 0 {
            filter.hold(Holder::ServiceAddress(ip), k.address.fold());
        } else {
            filter.hold(Holder::Frontend(ip, k.port, k.proto), k.address.fold());
        }
    }
    Ok(())
}
