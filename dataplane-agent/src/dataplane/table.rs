//! The service table in the maps: [`crate::state::table`] types converted to
//! the kernel ABI (network byte order, flags, slots) and back, for both IP
//! families: every entry goes to the maps of its address's family, through
//! code written once over [`AbiAddr`].
//!
//! A frontend is written make-before-break: backend slots first, then slot 0
//! (which makes them reachable); slots the new set no longer uses are deleted
//! last; removal goes slot 0 first. [`LbMaps`] implements the programmer's
//! [`MapWriter`]: runs of operations of one kind and one family go to the
//! kernel in batches (`BPF_MAP_UPDATE_BATCH` / `DELETE_BATCH`), phase by
//! phase in the same order, so a run cut short leaves only whole, consistent
//! frontends.

use std::{collections::HashMap, net::IpAddr, time::Duration};

use aya::maps::{MapError, lpm_trie::Key};
use dataplane_common::{
    lb::{
        LbBackend, LbService, LbServiceKey, LbServiceName, SourceRangeData, backend_flags, scope,
        service_flags,
    },
    limits, names,
};

use super::{
    DatapathError, batch, err,
    family::{AbiAddr, FamilyMaps, abi},
    filter::{AddressFilter, Holder},
    maps::{LbMaps, RETIRE_GRACE},
    removed,
};
use crate::{
    net::{IpCidr, IpFamily, Protocol},
    state::{
        diff::{MapWriter, Op},
        table::{
            Backend, BackendId, BackendSet, EmptyVerdict, Frontend, FrontendEntry, FrontendKind, MapTable,
            ServicePortName, SlotCounts, StraySlot, intern,
        },
    },
};

fn backend_to_abi<A: AbiAddr>(b: &Backend) -> LbBackend<A> {
    let mut flags = backend_flags::ACTIVE;
    for (on, flag) in [
        (b.serving, backend_flags::SERVING),
        (b.terminating, backend_flags::TERMINATING),
        (b.local, backend_flags::LOCAL),
    ] {
        if on {
            flags |= flag;
        }
    }
    LbBackend {
        address: abi(b.addr),
        port: b.port.to_be(),
        proto: b.proto.number(),
        flags,
    }
}

fn backend_from_abi<A: AbiAddr>(b: &LbBackend<A>) -> Option<Backend> {
    (b.flags & backend_flags::ACTIVE != 0).then(|| Backend {
        addr: b.address.to_ip(),
        port: u16::from_be(b.port),
        proto: Protocol::from_number(b.proto).unwrap_or(Protocol::Tcp),
        serving: b.flags & backend_flags::SERVING != 0,
        terminating: b.flags & backend_flags::TERMINATING != 0,
        local: b.flags & backend_flags::LOCAL != 0,
    })
}

fn service_key<A: AbiAddr>(fe: &Frontend, scope: u8, slot: u16) -> LbServiceKey<A> {
    LbServiceKey {
        address: abi(fe.addr),
        port: fe.port.to_be(),
        slot,
        proto: fe.proto.number(),
        scope,
        _pad: [0; 2],
    }
}

fn frontend_of<A: AbiAddr>(k: &LbServiceKey<A>) -> Option<Frontend> {
    Protocol::from_number(k.proto).map(|proto| Frontend {
        addr: k.address.to_ip(),
        port: u16::from_be(k.port),
        proto,
    })
}

fn kind_flag(kind: FrontendKind) -> u16 {
    match kind {
        FrontendKind::ClusterIp => service_flags::CLUSTER_IP,
        FrontendKind::NodePort => service_flags::NODE_PORT,
        FrontendKind::ExternalIp => service_flags::EXTERNAL_IP,
        FrontendKind::LoadBalancer => service_flags::LOAD_BALANCER,
    }
}

fn wildcard_key<A: AbiAddr>(addr: IpAddr) -> LbServiceKey<A> {
    LbServiceKey {
        address: abi(addr),
        ..Default::default()
    }
}

fn wildcard_value() -> LbService {
    LbService {
        flags: service_flags::WILDCARD,
        ..Default::default()
    }
}

fn source_range_key<A: AbiAddr>(service_id: u32, range: IpCidr) -> Key<SourceRangeData<A>> {
    Key::new(
        32 + range.prefix_len() as u32,
        SourceRangeData {
            service_id_be: service_id.to_be(),
            address: abi(range.addr()),
        },
    )
}

/// `family` byte of [`LbServiceName`].
const NAME_FAMILY_V6: u8 = 6;

fn name_to_abi(n: &ServicePortName) -> LbServiceName {
    let mut v = LbServiceName {
        namespace: [0; 64],
        name: [0; 64],
        port_name: [0; 16],
        proto: n.proto.number(),
        family: match n.family {
            IpFamily::V4 => 4,
            IpFamily::V6 => NAME_FAMILY_V6,
        },
        _pad: [0; 2],
    };
    fn fill(dst: &mut [u8], src: &str) {
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src.as_bytes()[..n]);
    }
    fill(&mut v.namespace, &n.namespace);
    fill(&mut v.name, &n.name);
    fill(&mut v.port_name, &n.port_name);
    v
}

fn name_from_abi(v: &LbServiceName) -> ServicePortName {
    let text =
        |b: &[u8]| String::from_utf8_lossy(b.split(|c| *c == 0).next().unwrap_or_default()).into_owned();
    ServicePortName {
        namespace: intern(&text(&v.namespace)),
        name: text(&v.name).into(),
        port_name: intern(&text(&v.port_name)),
        proto: Protocol::from_number(v.proto).unwrap_or(Protocol::Tcp),
        family: if v.family == NAME_FAMILY_V6 {
            IpFamily::V6
        } else {
            IpFamily::V4
        },
    }
}

/// Services-map entries to write: keys and values side by side, as the
/// batch syscall takes them.
struct Entries<A: AbiAddr> {
    keys: Vec<LbServiceKey<A>>,
    values: Vec<LbService>,
}

impl<A: AbiAddr> Default for Entries<A> {
    fn default() -> Self {
        Self {
            keys: Vec::new(),
            values: Vec::new(),
        }
    }
}

impl<A: AbiAddr> Entries<A> {
    fn push(&mut self, k: LbServiceKey<A>, v: LbService) {
        self.keys.push(k);
        self.values.push(v);
    }

    fn len(&self) -> usize {
        self.keys.len()
    }
}

/// How many operations of a run are done, and why the next one failed.
type RunError = Box<(usize, DatapathError)>;

fn batch_err(name: &'static str) -> impl Fn(std::io::Error) -> DatapathError {
    move |source| DatapathError::Batch { name, source }
}

/// What a family's writes need besides its own maps: the address filter,
/// the retired backends, the limits.
struct Shared<'a> {
    filter: &'a mut AddressFilter,
    retired: &'a mut Vec<(std::time::Instant, IpAddr)>,
    max_services: u32,
    max_backends: u32,
}

impl Shared<'_> {
    /// The address filter (see `filter`) holds a frontend's address while
    /// the frontend exists: held before it is written, released after it
    /// is removed; the filter reaches the kernel at the end of a sync.
    fn hold_frontend(&mut self, fe: &Frontend) {
        self.filter.hold(
            Holder::Frontend(fe.addr, fe.port.to_be(), fe.proto.number()),
            super::family::fold(fe.addr),
        );
    }

    fn release_frontend(&mut self, fe: &Frontend) {
        self.filter
            .release(Holder::Frontend(fe.addr, fe.port.to_be(), fe.proto.number()));
    }

    fn hold_service_address(&mut self, addr: IpAddr) {
        self.filter
            .hold(Holder::ServiceAddress(addr), super::family::fold(addr));
    }

    fn hold_backend(&mut self, id: BackendId, addr: IpAddr) {
        self.filter
            .hold(Holder::Backend(id.get()), super::family::fold(addr));
    }

    /// A removed backend's established flows keep going and their packets
    /// still need the egress hooks: its address stays in the filter until
    /// no conntrack entry names it (`expire_retired_backends`).
    fn retire_backend(&mut self, id: BackendId, addr: IpAddr) {
        if let Some(fold) = self.filter.held(Holder::Backend(id.get())) {
            self.filter.hold(Holder::Retired(addr), fold);
            self.retired
                .push((std::time::Instant::now() + RETIRE_GRACE, addr));
        }
        self.filter.release(Holder::Backend(id.get()));
    }

    fn check_backend_id(&self, id: BackendId) -> Result<(), DatapathError> {
        if id.get() >= self.max_backends {
            return Err(DatapathError::BackendIdOutOfRange {
                id: id.get(),
                capacity: self.max_backends,
            });
        }
        Ok(())
    }

    /// A frontend's entries: slots of each set into `slots`, slot 0 of each
    /// set into `heads` (the in-cluster set's before the external one that
    /// points at it).
    fn frontend_write<A: AbiAddr>(
        &self,
        fe: &Frontend,
        entry: &FrontendEntry,
        slots: &mut Entries<A>,
        heads: &mut Entries<A>,
    ) -> Result<(), DatapathError> {
        if entry.service_id >= self.max_services {
            return Err(DatapathError::ServiceIdOutOfRange {
                id: entry.service_id,
                capacity: self.max_services,
            });
        }
        let too_many = |s: &BackendSet| s.backends.len() > limits::MAX_BACKENDS_PER_SERVICE as usize;
        if too_many(&entry.backends) || entry.internal_backends.as_ref().is_some_and(too_many) {
            return Err(DatapathError::TooManyBackends {
                frontend: fe.to_string(),
                max: limits::MAX_BACKENDS_PER_SERVICE,
            });
        }
        let mut flags = kind_flag(entry.kind);
        for (on, flag) in [
            (entry.masquerade, service_flags::MASQUERADE),
            (entry.affinity_timeout.is_some(), service_flags::AFFINITY),
            (entry.source_ranges, service_flags::SOURCE_RANGES),
            (entry.external_local, service_flags::EXTERNAL_LOCAL),
            (entry.internal_local, service_flags::INTERNAL_LOCAL),
            (entry.dsr, service_flags::DSR),
            (entry.maglev, service_flags::MAGLEV),
        ] {
            if on {
                flags |= flag;
            }
        }
        let affinity_timeout_s = entry
            .affinity_timeout
            .map_or(0, |d| d.as_secs().clamp(1, u32::MAX as u64) as u32);
        // A Maglev set's table (`state::maglev::table_id`): the local set's
        // or the cluster set's of the service port.
        let head = |set: &BackendSet, flags: u16, local: bool| LbService {
            backend_id: if entry.maglev {
                crate::state::maglev::table_id(entry.service_id, local)
            } else {
                0
            },
            service_id: entry.service_id,
            count: set.backends.len() as u16,
            flags: flags
                | if set.when_empty == EmptyVerdict::Reject {
                    service_flags::REJECT_EMPTY
                } else {
                    0
                },
            affinity_timeout_s,
        };
        let mut set_slots = |scope: u8, set: &BackendSet| {
            for (i, id) in set.backends.iter().enumerate() {
                let slot = LbService {
                    backend_id: id.get(),
                    ..Default::default()
                };
                slots.push(service_key(fe, scope, i as u16 + 1), slot);
            }
        };
        // The internal set is complete before the external frontend points
        // at it (TWO_SCOPES), and removed only after it no longer does.
        match &entry.internal_backends {
            Some(internal) => {
                set_slots(scope::INTERNAL, internal);
                set_slots(scope::EXTERNAL, &entry.backends);
                heads.push(service_key(fe, scope::INTERNAL, 0), head(internal, flags, false));
                let ext = head(&entry.backends, flags | service_flags::TWO_SCOPES, true);
                heads.push(service_key(fe, scope::EXTERNAL, 0), ext);
            }
            None => {
                let local = entry.uses_local_set();
                set_slots(scope::EXTERNAL, &entry.backends);
                heads.push(
                    service_key(fe, scope::EXTERNAL, 0),
                    head(&entry.backends, flags, local),
                );
            }
        }
        Ok(())
    }
}

/// Keys to delete after `entry` replaced a frontend that had `previous`
/// slots: slots it no longer uses, and the in-cluster set if it has none
/// now (slot 0 first).
fn stale_keys<A: AbiAddr>(
    fe: &Frontend,
    entry: &FrontendEntry,
    previous: SlotCounts,
    out: &mut Vec<LbServiceKey<A>>,
) {
    let now = SlotCounts::of(entry);
    out.extend((now.external + 1..=previous.external).map(|s| service_key(fe, scope::EXTERNAL, s)));
    match (previous.internal, now.internal) {
        (Some(old), Some(new)) => {
            out.extend((new + 1..=old).map(|s| service_key(fe, scope::INTERNAL, s)));
        }
        (Some(old), None) => {
            out.extend((0..=old).map(|s| service_key(fe, scope::INTERNAL, s)));
        }
        _ => {}
    }
}

/// Keys of a frontend with `counts` slots, slot 0 of each set first.
fn frontend_keys<A: AbiAddr>(
    fe: &Frontend,
    counts: SlotCounts,
    heads: &mut Vec<LbServiceKey<A>>,
    slots: &mut Vec<LbServiceKey<A>>,
) {
    heads.push(service_key(fe, scope::EXTERNAL, 0));
    slots.extend((1..=counts.external).map(|s| service_key(fe, scope::EXTERNAL, s)));
    if let Some(n) = counts.internal {
        heads.push(service_key(fe, scope::INTERNAL, 0));
        slots.extend((1..=n).map(|s| service_key(fe, scope::INTERNAL, s)));
    }
}

impl<A: AbiAddr> FamilyMaps<A> {
    /// All backends in use, by id (read in batches).
    fn read_backends(&self, out: &mut Vec<(BackendId, Backend)>) -> Result<(), DatapathError> {
        batch::for_each(self.backends_fd(), |i: &u32, b: &LbBackend<A>| {
            if let (Some(id), Some(backend)) = (BackendId::new(*i), backend_from_abi(b)) {
                out.push((id, backend));
            }
        })
        .map_err(batch_err(A::BACKENDS))
    }

    fn write_frontend(
        &mut self,
        shared: &mut Shared<'_>,
        fe: &Frontend,
        entry: &FrontendEntry,
        previous: Option<SlotCounts>,
    ) -> Result<(), DatapathError> {
        let (mut slots, mut heads) = (Entries::<A>::default(), Entries::<A>::default());
        shared.frontend_write(fe, entry, &mut slots, &mut heads)?;
        shared.hold_frontend(fe);
        let all = slots.keys.iter().zip(&slots.values);
        for (k, v) in all.chain(heads.keys.iter().zip(&heads.values)) {
            self.services.insert(k, v, 0).map_err(err(A::SERVICES))?;
        }
        let mut stale = Vec::new();
        if let Some(previous) = previous {
            stale_keys(fe, entry, previous, &mut stale);
        }
        for k in &stale {
            removed(self.services.remove(k), A::SERVICES)?;
        }
        Ok(())
    }

    fn previous_counts(&self, fe: &Frontend) -> Option<SlotCounts> {
        let count = |scope| {
            self.services
                .get(&service_key::<A>(fe, scope, 0), 0)
                .ok()
                .map(|h| h.count)
        };
        count(scope::EXTERNAL).map(|external| SlotCounts {
            external,
            internal: count(scope::INTERNAL),
        })
    }

    /// Removes a frontend: slot 0 first (packets stop matching), then slots.
    fn remove_frontend(&mut self, fe: &Frontend) -> Result<(), DatapathError> {
        for scope in [scope::EXTERNAL, scope::INTERNAL] {
            let Ok(head) = self.services.get(&service_key::<A>(fe, scope, 0), 0) else {
                continue;
            };
            removed(self.services.remove(&service_key(fe, scope, 0)), A::SERVICES)?;
            for slot in 1..=head.count {
                removed(self.services.remove(&service_key(fe, scope, slot)), A::SERVICES)?;
            }
        }
        Ok(())
    }

    /// The frontend's slot-0 entry and backend ids of one scope, as stored.
    fn frontend(&self, fe: &Frontend, scope: u8) -> Result<Option<(LbService, Vec<u32>)>, DatapathError> {
        let head = match self.services.get(&service_key::<A>(fe, scope, 0), 0) {
            Ok(h) => h,
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(err(A::SERVICES)(e)),
        };
        let mut ids = Vec::with_capacity(head.count as usize);
        for slot in 1..=head.count {
            let s = self
                .services
                .get(&service_key::<A>(fe, scope, slot), 0)
                .map_err(err(A::SERVICES))?;
            ids.push(s.backend_id);
        }
        Ok(Some((head, ids)))
    }

    /// Reads this family's part of the table (frontends, ClusterIPs, stray
    /// and damaged entries, source ranges) into `table`, in batches (a few
    /// hundred syscalls for a million entries).
    fn read_into(&self, table: &mut MapTable) -> Result<(), DatapathError> {
        let mut entries: HashMap<LbServiceKey<A>, LbService> = HashMap::new();
        batch::for_each(self.services_fd(), |k: &LbServiceKey<A>, v: &LbService| {
            entries.insert(*k, *v);
        })
        .map_err(batch_err(A::SERVICES))?;
        // Which entries the frontends account for.
        let mut used: std::collections::HashSet<LbServiceKey<A>> = std::collections::HashSet::new();
        let set_of = |key: &LbServiceKey<A>,
                      head: &LbService,
                      used: &mut std::collections::HashSet<LbServiceKey<A>>| {
            let mut complete = true;
            let mut ids = Vec::with_capacity(head.count as usize);
            for slot in 1..=head.count {
                let k = LbServiceKey { slot, ..*key };
                match entries.get(&k).and_then(|s| BackendId::new(s.backend_id)) {
                    Some(id) => {
                        used.insert(k);
                        ids.push(id);
                    }
                    None => complete = false,
                }
            }
            let set = BackendSet {
                backends: ids,
                when_empty: if head.flags & service_flags::REJECT_EMPTY != 0 {
                    EmptyVerdict::Reject
                } else {
                    EmptyVerdict::Drop
                },
            };
            (set, complete)
        };
        for (key, head) in &entries {
            if key.slot != 0 || key.scope != scope::EXTERNAL {
                continue;
            }
            if head.flags & service_flags::WILDCARD != 0 {
                used.insert(*key);
                table.service_addresses.push(key.address.to_ip());
                continue;
            }
            let Some(fe) = frontend_of(key) else { continue };
            used.insert(*key);
            let kind = match head.flags & service_flags::KIND_MASK {
                service_flags::NODE_PORT => FrontendKind::NodePort,
                service_flags::EXTERNAL_IP => FrontendKind::ExternalIp,
                service_flags::LOAD_BALANCER => FrontendKind::LoadBalancer,
                _ => FrontendKind::ClusterIp,
            };
            let (backends, mut complete) = set_of(key, head, &mut used);
            let mut counts = SlotCounts {
                external: head.count,
                internal: None,
            };
            let internal_key = LbServiceKey {
                scope: scope::INTERNAL,
                ..*key
            };
            let internal_backends = if head.flags & service_flags::TWO_SCOPES != 0 {
                match entries.get(&internal_key) {
                    Some(h) => {
                        used.insert(internal_key);
                        counts.internal = Some(h.count);
                        let (set, ok) = set_of(&internal_key, h, &mut used);
                        complete &= ok;
                        Some(set)
                    }
                    None => {
                        complete = false;
                        None
                    }
                }
            } else {
                None
            };
            let flag = |f: u16| head.flags & f != 0;
            if !complete {
                table.damaged.push((fe, counts));
            }
            table.frontends.push((
                fe,
                FrontendEntry {
                    service_id: head.service_id,
                    kind,
                    backends,
                    internal_backends,
                    masquerade: flag(service_flags::MASQUERADE),
                    affinity_timeout: flag(service_flags::AFFINITY)
                        .then(|| Duration::from_secs(head.affinity_timeout_s as u64)),
                    source_ranges: flag(service_flags::SOURCE_RANGES),
                    external_local: flag(service_flags::EXTERNAL_LOCAL),
                    internal_local: flag(service_flags::INTERNAL_LOCAL),
                    dsr: flag(service_flags::DSR),
                    maglev: flag(service_flags::MAGLEV),
                },
            ));
        }
        for key in entries.keys().filter(|k| !used.contains(k)) {
            if let Some(frontend) = frontend_of(key) {
                table.stray_slots.push(StraySlot {
                    frontend,
                    internal: key.scope == scope::INTERNAL,
                    slot: key.slot,
                });
            }
        }
        for key in self.source_ranges.keys() {
            let key = key.map_err(err(A::SOURCE_RANGES))?;
            let data = key.data();
            let prefix = key.prefix_len().saturating_sub(32).min(A::BITS as u32) as u8;
            if let Some(c) = IpCidr::new(data.address.to_ip(), prefix) {
                table.source_ranges.push((u32::from_be(data.service_id_be), c));
            }
        }
        Ok(())
    }

    /// One operation (the map writer's unbatched path) of this family.
    fn apply_one(&mut self, shared: &mut Shared<'_>, op: &Op) -> Result<(), DatapathError> {
        match op {
            Op::SetBackend(id, b) => {
                shared.check_backend_id(*id)?;
                shared.hold_backend(*id, b.addr);
                self.backends
                    .set(id.get(), backend_to_abi::<A>(b), 0)
                    .map_err(err(A::BACKENDS))
            }
            Op::RemoveBackend(id, addr) => {
                shared.check_backend_id(*id)?;
                self.backends
                    .set(id.get(), LbBackend::<A>::default(), 0)
                    .map_err(err(A::BACKENDS))?;
                shared.retire_backend(*id, *addr);
                Ok(())
            }
            Op::AddSourceRange(id, r) => self
                .source_ranges
                .insert(&source_range_key::<A>(*id, *r), 1, 0)
                .map_err(err(A::SOURCE_RANGES)),
            Op::RemoveSourceRange(id, r) => removed(
                self.source_ranges.remove(&source_range_key::<A>(*id, *r)),
                A::SOURCE_RANGES,
            ),
            Op::SetServiceAddress(a) => {
                shared.hold_service_address(*a);
                self.services
                    .insert(wildcard_key::<A>(*a), wildcard_value(), 0)
                    .map_err(err(A::SERVICES))
            }
            Op::RemoveServiceAddress(a) => {
                removed(self.services.remove(&wildcard_key::<A>(*a)), A::SERVICES)?;
                shared.filter.release(Holder::ServiceAddress(*a));
                Ok(())
            }
            Op::SetFrontend {
                frontend,
                entry,
                previous,
            } => self.write_frontend(shared, frontend, entry, *previous),
            Op::RemoveFrontend { frontend, previous } => {
                let (mut heads, mut slots) = (Vec::new(), Vec::new());
                frontend_keys::<A>(frontend, *previous, &mut heads, &mut slots);
                for k in heads.iter().chain(&slots) {
                    removed(self.services.remove(k), A::SERVICES)?;
                }
                shared.release_frontend(frontend);
                Ok(())
            }
            Op::RemoveStraySlot(s) => {
                let scope = if s.internal {
                    scope::INTERNAL
                } else {
                    scope::EXTERNAL
                };
                removed(
                    self.services
                        .remove(&service_key::<A>(&s.frontend, scope, s.slot)),
                    A::SERVICES,
                )
            }
            Op::SetServiceName(..) | Op::RemoveServiceName(_) | Op::PurgeUdpFlows(_) => {
                unreachable!("not a per-family operation: {op:?}")
            }
        }
    }

    /// A run of operations of one kind (of this family), batched;
    /// `Err((n, e))`: the first `n` of the run are done.
    fn apply_run(&mut self, shared: &mut Shared<'_>, run: &[Op]) -> Result<(), RunError> {
        let services = A::SERVICES;
        match &run[0] {
            Op::SetBackend(..) | Op::RemoveBackend(..) => {
                let (mut ids, mut values) = (Vec::with_capacity(run.len()), Vec::with_capacity(run.len()));
                let mut invalid = None;
                for (i, op) in run.iter().enumerate() {
                    let id = match op {
                        Op::SetBackend(id, _) | Op::RemoveBackend(id, _) => *id,
                        _ => unreachable!("a run has one kind"),
                    };
                    if let Err(e) = shared.check_backend_id(id) {
                        // Write what precedes it, then report it.
                        invalid = Some(Box::new((i, e)));
                        break;
                    }
                    let value = match op {
                        Op::SetBackend(_, b) => {
                            shared.hold_backend(id, b.addr);
                            backend_to_abi::<A>(b)
                        }
                        _ => LbBackend::default(),
                    };
                    ids.push(id);
                    values.push(value);
                }
                let raw: Vec<u32> = ids.iter().map(|id| id.get()).collect();
                let written = batch::update_pairs(self.backends_fd(), &raw, &values);
                let done = match &written {
                    Ok(()) => ids.len(),
                    Err((n, _)) => *n,
                };
                for op in &run[..done] {
                    if let Op::RemoveBackend(id, addr) = op {
                        shared.retire_backend(*id, *addr);
                    }
                }
                written.map_err(|(n, e)| Box::new((n, batch_err(A::BACKENDS)(e))))?;
                invalid.map_or(Ok(()), Err)
            }
            Op::SetServiceAddress(..) => {
                let entries: Vec<(LbServiceKey<A>, LbService)> = run
                    .iter()
                    .map(|op| match op {
                        Op::SetServiceAddress(a) => {
                            shared.hold_service_address(*a);
                            (wildcard_key::<A>(*a), wildcard_value())
                        }
                        _ => unreachable!("a run has one kind"),
                    })
                    .collect();
                batch::update(self.services_fd(), &entries)
                    .map_err(|(n, e)| Box::new((n, batch_err(services)(e))))
            }
            Op::RemoveServiceAddress(..) => {
                let addrs: Vec<IpAddr> = run
                    .iter()
                    .map(|op| match op {
                        Op::RemoveServiceAddress(a) => *a,
                        _ => unreachable!("a run has one kind"),
                    })
                    .collect();
                let keys: Vec<LbServiceKey<A>> = addrs.iter().map(|a| wildcard_key(*a)).collect();
                let deleted = batch::delete(self.services_fd(), &keys);
                let done = deleted.as_ref().map_or_else(|(n, _)| *n, |()| keys.len());
                for a in &addrs[..done] {
                    shared.filter.release(Holder::ServiceAddress(*a));
                }
                deleted.map_err(|(n, e)| Box::new((n, batch_err(services)(e))))
            }
            Op::SetFrontend { .. } => self.set_frontends(shared, run),
            Op::RemoveFrontend { .. } => {
                // Slot 0 of every frontend first: none matches any more;
                // then their slots.
                let (mut heads, mut slots) = (Vec::new(), Vec::new());
                let mut done_at = Vec::with_capacity(run.len());
                for op in run {
                    let Op::RemoveFrontend { frontend, previous } = op else {
                        unreachable!("a run has one kind")
                    };
                    frontend_keys::<A>(frontend, *previous, &mut heads, &mut slots);
                    done_at.push(slots.len());
                }
                batch::delete(self.services_fd(), &heads)
                    .map_err(|(_, e)| Box::new((0, batch_err(services)(e))))?;
                // No packet matches them any more.
                for op in run {
                    if let Op::RemoveFrontend { frontend, .. } = op {
                        shared.release_frontend(frontend);
                    }
                }
                batch::delete(self.services_fd(), &slots).map_err(|(n, e)| {
                    Box::new((done_at.partition_point(|end| *end <= n), batch_err(services)(e)))
                })
            }
            _ => {
                for (i, op) in run.iter().enumerate() {
                    self.apply_one(shared, op).map_err(|e| Box::new((i, e)))?;
                }
                Ok(())
            }
        }
    }

    /// A run of frontend writes: every slot, then every slot 0, then the
    /// slots they no longer use. A frontend is done once its slot 0 is.
    fn set_frontends(&mut self, shared: &mut Shared<'_>, run: &[Op]) -> Result<(), RunError> {
        let services = A::SERVICES;
        let mut slots = Entries::<A>::default();
        let mut heads = Entries::<A>::default();
        let mut heads_end = Vec::with_capacity(run.len());
        let mut stale: Vec<LbServiceKey<A>> = Vec::new();
        let mut stale_end = Vec::with_capacity(run.len());
        let mut valid = run.len();
        let mut invalid = None;
        for (i, op) in run.iter().enumerate() {
            let Op::SetFrontend {
                frontend,
                entry,
                previous,
            } = op
            else {
                unreachable!("a run has one kind")
            };
            match shared.frontend_write(frontend, entry, &mut slots, &mut heads) {
                Ok(()) => {
                    shared.hold_frontend(frontend);
                    heads_end.push(heads.len());
                    if let Some(p) = previous {
                        stale_keys(frontend, entry, *p, &mut stale);
                    }
                    stale_end.push(stale.len());
                }
                Err(e) => {
                    valid = i;
                    invalid = Some(e);
                    break;
                }
            }
        }
        batch::update_pairs(self.services_fd(), &slots.keys, &slots.values)
            .map_err(|(_, e)| Box::new((0, batch_err(services)(e))))?;
        batch::update_pairs(self.services_fd(), &heads.keys, &heads.values).map_err(|(n, e)| {
            Box::new((heads_end.partition_point(|end| *end <= n), batch_err(services)(e)))
        })?;
        batch::delete(self.services_fd(), &stale).map_err(|(n, e)| {
            Box::new((stale_end.partition_point(|end| *end <= n), batch_err(services)(e)))
        })?;
        match invalid {
            Some(e) => Err(Box::new((valid, e))),
            None => Ok(()),
        }
    }
}

/// Calls `$f` with the maps of `$family` (`IpFamily`) and the shared state.
macro_rules! with_family {
    ($self:ident, $family:expr, |$m:ident, $shared:ident| $body:expr) => {{
        let mut $shared = Shared {
            filter: &mut $self.filter,
            retired: &mut $self.retired,
            max_services: $self.max_services,
            max_backends: $self.max_backends,
        };
        match $family {
            IpFamily::V4 => {
                let $m = &mut $self.v4;
                $body
            }
            IpFamily::V6 => {
                let $m = &mut $self.v6;
                $body
            }
        }
    }};
}

impl LbMaps {
    pub fn set_backend(&mut self, id: BackendId, backend: &Backend) -> Result<(), DatapathError> {
        self.apply_one(&Op::SetBackend(id, *backend))
    }

    /// Frees the id, which held `addr`. Established flows to the backend
    /// keep going (conntrack names backends by address), as with
    /// kube-proxy.
    pub fn remove_backend(&mut self, id: BackendId, addr: IpAddr) -> Result<(), DatapathError> {
        self.apply_one(&Op::RemoveBackend(id, addr))
    }

    /// The backend an id names, in either family's map.
    pub fn backend(&self, id: BackendId) -> Result<Option<Backend>, DatapathError> {
        let v4 = self.v4.backends.get(&id.get(), 0).ok();
        if let Some(b) = v4.as_ref().and_then(backend_from_abi) {
            return Ok(Some(b));
        }
        let v6 = self.v6.backends.get(&id.get(), 0).ok();
        Ok(v6.as_ref().and_then(backend_from_abi))
    }

    /// All backends in use, by id, both families (read in batches).
    pub fn backends(&self) -> Result<Vec<(BackendId, Backend)>, DatapathError> {
        let mut out = Vec::new();
        self.v4.read_backends(&mut out)?;
        self.v6.read_backends(&mut out)?;
        out.sort_by_key(|(id, _)| *id);
        Ok(out)
    }

    /// Creates or updates a frontend, make-before-break (see the module
    /// documentation). The backends must already be written.
    pub fn set_frontend(&mut self, fe: &Frontend, entry: &FrontendEntry) -> Result<(), DatapathError> {
        with_family!(self, fe.family(), |m, shared| {
            let previous = m.previous_counts(fe);
            m.write_frontend(&mut shared, fe, entry, previous)
        })
    }

    /// Removes a frontend: slot 0 first (packets stop matching), then slots.
    pub fn remove_frontend(&mut self, fe: &Frontend) -> Result<(), DatapathError> {
        match fe.family() {
            IpFamily::V4 => self.v4.remove_frontend(fe),
            IpFamily::V6 => self.v6.remove_frontend(fe),
        }
    }

    /// The frontend's slot-0 entry and backend ids of one scope, as stored.
    pub fn frontend(&self, fe: &Frontend, scope: u8) -> Result<Option<(LbService, Vec<u32>)>, DatapathError> {
        match fe.family() {
            IpFamily::V4 => self.v4.frontend(fe, scope),
            IpFamily::V6 => self.v6.frontend(fe, scope),
        }
    }

    /// Marks `addr` as a Service address (ClusterIP): ports it does not
    /// serve are rejected rather than passed.
    pub fn set_service_address(&mut self, addr: IpAddr) -> Result<(), DatapathError> {
        self.apply_one(&Op::SetServiceAddress(addr))
    }

    pub fn remove_service_address(&mut self, addr: IpAddr) -> Result<(), DatapathError> {
        self.apply_one(&Op::RemoveServiceAddress(addr))
    }

    pub fn add_source_range(&mut self, service_id: u32, range: IpCidr) -> Result<(), DatapathError> {
        self.apply_one(&Op::AddSourceRange(service_id, range))
    }

    pub fn remove_source_range(&mut self, service_id: u32, range: IpCidr) -> Result<(), DatapathError> {
        self.apply_one(&Op::RemoveSourceRange(service_id, range))
    }

    /// Records who a service id belongs to.
    pub fn set_service_name(&mut self, id: u32, name: &ServicePortName) -> Result<(), DatapathError> {
        self.service_names
            .insert(id, name_to_abi(name), 0)
            .map_err(err(names::LB4_SERVICE_NAMES))
    }

    pub fn remove_service_name(&mut self, id: u32) -> Result<(), DatapathError> {
        removed(self.service_names.remove(&id), names::LB4_SERVICE_NAMES)
    }

    fn names_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd as _;
        aya::maps::IterableMap::<u32, LbServiceName>::map(&self.service_names)
            .fd()
            .as_fd()
    }

    /// The Service port a service id names in the maps.
    pub fn service_name(&self, id: u32) -> Result<Option<ServicePortName>, DatapathError> {
        match self.service_names.get(&id, 0) {
            Ok(v) => Ok(Some(name_from_abi(&v))),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(err(names::LB4_SERVICE_NAMES)(e)),
        }
    }

    /// service id → its Service port (read in batches).
    pub fn service_names(&self) -> Result<Vec<(u32, ServicePortName)>, DatapathError> {
        let mut out = Vec::new();
        batch::for_each(self.names_fd(), |id: &u32, v: &LbServiceName| {
            out.push((*id, name_from_abi(v)))
        })
        .map_err(batch_err(names::LB4_SERVICE_NAMES))?;
        Ok(out)
    }

    /// Reads the whole service table back from the maps of both families,
    /// in batches.
    pub fn read_table(&self) -> Result<MapTable, DatapathError> {
        let mut table = MapTable {
            backends: self.backends()?,
            ..Default::default()
        };
        self.v4.read_into(&mut table)?;
        self.v6.read_into(&mut table)?;
        table.service_names = self.service_names()?;
        table.sort();
        Ok(table)
    }

    /// One operation (the map writer's unbatched path).
    fn apply_one(&mut self, op: &Op) -> Result<(), DatapathError> {
        match op {
            Op::SetServiceName(id, name) => self.set_service_name(*id, name),
            Op::RemoveServiceName(id) => self.remove_service_name(*id),
            Op::PurgeUdpFlows(backends) => self.purge_udp_flows_to(backends).map(|_| ()),
            op => {
                let family = op.family().expect("a per-family operation");
                with_family!(self, family, |m, shared| m.apply_one(&mut shared, op))
            }
        }
    }

    /// Writes what the frontend operations among `ops` (all applied) imply
    /// for the derived maps (see `state::derived`).
    fn derive(&mut self, ops: &[Op]) -> Result<(), DatapathError> {
        let mut derived = Vec::new();
        for op in ops {
            match op {
                Op::SetFrontend { frontend, entry, .. } => {
                    if !(entry.maglev || entry.dsr || self.derived.state.has(frontend)) {
                        continue;
                    }
                    // Taken out while the lookup reads the backends maps.
                    let mut state = std::mem::take(&mut self.derived.state);
                    let maps = &*self;
                    let lookup = |id: BackendId| maps.backend(id).ok().flatten();
                    state.set_frontend(frontend, entry, &lookup, &mut derived);
                    self.derived.state = state;
                }
                Op::RemoveFrontend { frontend, .. } => {
                    self.derived.state.remove_frontend(frontend, &mut derived);
                }
                _ => {}
            }
        }
        for op in &derived {
            self.derived.apply(op)?;
        }
        Ok(())
    }

    /// A run of operations of one kind and family, batched; `Err((n, e))`:
    /// the first `n` of the run are done.
    fn apply_run(&mut self, run: &[Op]) -> Result<(), RunError> {
        match &run[0] {
            Op::SetServiceName(..) => {
                let entries: Vec<(u32, LbServiceName)> = run
                    .iter()
                    .map(|op| match op {
                        Op::SetServiceName(id, n) => (*id, name_to_abi(n)),
                        _ => unreachable!("a run has one kind"),
                    })
                    .collect();
                batch::update(self.names_fd(), &entries)
                    .map_err(|(n, e)| Box::new((n, batch_err(names::LB4_SERVICE_NAMES)(e))))
            }
            Op::RemoveServiceName(..) => {
                let keys: Vec<u32> = run
                    .iter()
                    .map(|op| match op {
                        Op::RemoveServiceName(id) => *id,
                        _ => unreachable!("a run has one kind"),
                    })
                    .collect();
                batch::delete(self.names_fd(), &keys)
                    .map_err(|(n, e)| Box::new((n, batch_err(names::LB4_SERVICE_NAMES)(e))))
            }
            Op::PurgeUdpFlows(_) => {
                for (i, op) in run.iter().enumerate() {
                    self.apply_one(op).map_err(|e| Box::new((i, e)))?;
                }
                Ok(())
            }
            op => {
                let family = op.family().expect("a per-family operation");
                with_family!(self, family, |m, shared| m.apply_run(&mut shared, run))
            }
        }
    }
}

/// Whether two operations can share a batch: the same kind, in the same
/// family's maps.
fn same_run(a: &Op, b: &Op) -> bool {
    let batched = |op: &Op| {
        !matches!(
            op,
            Op::AddSourceRange(..)
                | Op::RemoveSourceRange(..)
                | Op::RemoveStraySlot(_)
                | Op::PurgeUdpFlows(_)
        )
    };
    std::mem::discriminant(a) == std::mem::discriminant(b)
        && a.family() == b.family()
        && batched(a)
        && batched(b)
}

impl MapWriter for LbMaps {
    type Error = DatapathError;

    fn apply(&mut self, op: &Op) -> Result<(), DatapathError> {
        self.apply_one(op)?;
        self.derive(std::slice::from_ref(op))
    }

    fn apply_all(&mut self, ops: &[Op]) -> Result<(), (usize, DatapathError)> {
        let mut start = 0;
        while start < ops.len() {
            let mut end = start + 1;
            while end < ops.len() && same_run(&ops[start], &ops[end]) {
                end += 1;
            }
            let run = self.apply_run(&ops[start..end]);
            // What the frontends written imply, for those that were.
            let done = match &run {
                Ok(()) => end,
                Err(failed) => start + failed.0,
            };
            if let Err(e) = self.derive(&ops[start..done]) {
                // The run is in the maps; what follows it is not: the
                // programmer re-reads the maps, and `adopt` repairs this.
                return Err((done, e));
            }
            run.map_err(|failed| (start + failed.0, failed.1))?;
            start = end;
        }
        Ok(())
    }

    fn adopt(&mut self, table: &MapTable) -> Result<(), DatapathError> {
        let backends: HashMap<BackendId, Backend> = table.backends.iter().copied().collect();
        let (tables, dsr) = self.derived.adopt(table, &|id| backends.get(&id).copied())?;
        if tables + dsr > 0 {
            tracing::info!(
                maglev_chunks = tables,
                dsr_entries = dsr,
                "removed derived entries no frontend needs any more"
            );
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), DatapathError> {
        self.flush_filter().map(drop)
    }

    fn read_table(&self) -> Result<MapTable, DatapathError> {
        LbMaps::read_table(self)
    }
}
