//! Typed access to the datapath's maps: the one place that knows the byte
//! order and layout of every key and value.
//!
//! Writes are ordered so that a packet never sees a half-written service:
//! backends first, then backend slots, then the frontend (slot 0) that makes
//! them reachable; removal in reverse.

use std::{net::Ipv4Addr, num::NonZeroU32, time::Duration};

use aya::maps::{Array, HashMap, LpmTrie, MapData, MapError, PerCpuArray, lpm_trie::Key};
use dataplane_common::{
    config::{Cidr4, DpConfig, MAX_SERVICE_CIDRS, config_flags},
    ct::{Ct4Entry, Ct4Key},
    lb4::{
        Lb4AffinityKey, Lb4AffinityValue, Lb4Backend, Lb4Service, Lb4ServiceKey, Lb4ServiceName,
        Lb4SourceRangeData, backend_flags, scope, service_flags,
    },
    limits, names,
    stats::{Counter, Event, Hook, counter_index},
};

use super::DatapathError;
use crate::net::{Ipv4Cidr, Protocol};

/// Node-wide settings of the datapath.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatapathConfig {
    /// Source address of SNATed flows (the node's primary IP).
    pub snat_ip: Ipv4Addr,
    /// Where pods come from; `None`: no source counts as a pod.
    pub cluster_cidr: Option<Ipv4Cidr>,
    /// Traffic to an address in these that no Service holds is dropped.
    pub service_cidrs: Vec<Ipv4Cidr>,
    pub masquerade_all: bool,
    /// SNAT source ports (inclusive).
    pub snat_ports: (u16, u16),
    pub ct_tcp_timeout: Duration,
    pub ct_tcp_close_timeout: Duration,
    pub ct_udp_timeout: Duration,
    /// Connect-time translation only for sockets in this network namespace
    /// (the node's); pods keep per-packet translation.
    pub socket_lb_host_only: bool,
    /// The node's network namespace cookie (this process's, by default).
    pub host_netns_cookie: u64,
}

/// Cookie of the calling thread's network namespace (SO_NETNS_COOKIE,
/// Linux 5.14); 0 when unknown.
pub fn current_netns_cookie() -> u64 {
    const SO_NETNS_COOKIE: i32 = 71;
    // SAFETY: a throwaway socket and a getsockopt into a local u64.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        if fd < 0 {
            return 0;
        }
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        let rc = libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        );
        libc::close(fd);
        if rc == 0 { cookie } else { 0 }
    }
}

impl DatapathConfig {
    pub fn new(snat_ip: Ipv4Addr) -> Self {
        Self {
            snat_ip,
            cluster_cidr: None,
            service_cidrs: Vec::new(),
            masquerade_all: false,
            snat_ports: DpConfig::DEFAULT_SNAT_PORTS,
            ct_tcp_timeout: Duration::from_secs(DpConfig::DEFAULT_TCP_TIMEOUT_S as u64),
            ct_tcp_close_timeout: Duration::from_secs(DpConfig::DEFAULT_TCP_CLOSE_TIMEOUT_S as u64),
            ct_udp_timeout: Duration::from_secs(DpConfig::DEFAULT_UDP_TIMEOUT_S as u64),
            socket_lb_host_only: false,
            host_netns_cookie: current_netns_cookie(),
        }
    }

    fn to_abi(&self) -> Result<DpConfig, DatapathError> {
        if self.service_cidrs.len() > MAX_SERVICE_CIDRS {
            return Err(DatapathError::Invalid(format!(
                "at most {MAX_SERVICE_CIDRS} IPv4 service CIDRs are supported, got {}",
                self.service_cidrs.len()
            )));
        }
        if self.snat_ports.0 == 0 || self.snat_ports.0 > self.snat_ports.1 {
            return Err(DatapathError::Invalid(format!(
                "bad SNAT port range {:?}",
                self.snat_ports
            )));
        }
        let cidr = |c: &Ipv4Cidr| Cidr4 {
            addr: be32(c.addr()),
            mask: c.mask().to_be(),
        };
        let mut service_cidrs = [Cidr4::default(); MAX_SERVICE_CIDRS];
        for (slot, c) in service_cidrs.iter_mut().zip(&self.service_cidrs) {
            *slot = cidr(c);
        }
        let secs = |d: Duration| d.as_secs().clamp(1, u32::MAX as u64) as u32;
        let mut flags = config_flags::CONFIGURED;
        if self.masquerade_all {
            flags |= config_flags::MASQUERADE_ALL;
        }
        if self.socket_lb_host_only {
            flags |= config_flags::SOCKET_LB_HOST_ONLY;
        }
        Ok(DpConfig {
            flags,
            host_netns_cookie: self.host_netns_cookie,
            snat_ip: be32(self.snat_ip),
            cluster_cidr: self.cluster_cidr.as_ref().map(cidr).unwrap_or_default(),
            service_cidrs,
            snat_port_min: self.snat_ports.0,
            snat_port_max: self.snat_ports.1,
            ct_tcp_timeout_s: secs(self.ct_tcp_timeout),
            ct_tcp_close_timeout_s: secs(self.ct_tcp_close_timeout),
            ct_udp_timeout_s: secs(self.ct_udp_timeout),
        })
    }
}

/// Index into the backends map. 0 is never a valid id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendId(pub NonZeroU32);

impl BackendId {
    pub fn new(id: u32) -> Option<Self> {
        NonZeroU32::new(id).map(Self)
    }
    pub fn get(self) -> u32 {
        self.0.get()
    }
}

/// An endpoint address as the datapath translates to it. A backend exists
/// as long as its endpoint does (whatever its conditions), so established
/// flows keep it; only the frontends' sets decide where new flows go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backend {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
    pub serving: bool,
    pub terminating: bool,
    pub local: bool,
}

impl Backend {
    fn to_abi(self) -> Lb4Backend {
        let mut flags = backend_flags::ACTIVE;
        if self.serving {
            flags |= backend_flags::SERVING;
        }
        if self.terminating {
            flags |= backend_flags::TERMINATING;
        }
        if self.local {
            flags |= backend_flags::LOCAL;
        }
        Lb4Backend {
            address: be32(self.addr),
            port: self.port.to_be(),
            proto: self.proto.number(),
            flags,
        }
    }

    fn from_abi(b: &Lb4Backend) -> Option<Self> {
        (b.flags & backend_flags::ACTIVE != 0).then(|| Self {
            addr: Ipv4Addr::from(u32::from_be(b.address)),
            port: u16::from_be(b.port),
            proto: Protocol::from_number(b.proto).unwrap_or(Protocol::Tcp),
            serving: b.flags & backend_flags::SERVING != 0,
            terminating: b.flags & backend_flags::TERMINATING != 0,
            local: b.flags & backend_flags::LOCAL != 0,
        })
    }
}

/// Where a frontend listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
}

impl Frontend {
    fn key(&self, scope: u8, slot: u16) -> Lb4ServiceKey {
        Lb4ServiceKey {
            address: be32(self.addr),
            port: self.port.to_be(),
            slot,
            proto: self.proto.number(),
            scope,
            _pad: [0; 2],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrontendKind {
    ClusterIp,
    NodePort,
    ExternalIp,
    LoadBalancer,
}

impl FrontendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "ClusterIP",
            FrontendKind::NodePort => "NodePort",
            FrontendKind::ExternalIp => "ExternalIP",
            FrontendKind::LoadBalancer => "LoadBalancer",
        }
    }

    fn flag(self) -> u16 {
        match self {
            FrontendKind::ClusterIp => service_flags::CLUSTER_IP,
            FrontendKind::NodePort => service_flags::NODE_PORT,
            FrontendKind::ExternalIp => service_flags::EXTERNAL_IP,
            FrontendKind::LoadBalancer => service_flags::LOAD_BALANCER,
        }
    }
}

/// What a new flow gets when a backend set is empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EmptyVerdict {
    /// ICMP port-unreachable: the service has no usable endpoint at all.
    Reject,
    /// Drop: a Local policy without a local endpoint.
    Drop,
}

/// A backend set; `B` is how backends are named: [`BackendId`] in the maps,
/// an address key in the desired state (ids are assigned by the diff).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BackendSet<B = BackendId> {
    pub backends: Vec<B>,
    pub when_empty: EmptyVerdict,
}

/// Everything the datapath needs to serve one frontend.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FrontendEntry<B = BackendId> {
    /// The Service port this frontend belongs to (stats, affinity, source
    /// ranges are per service port, shared by all its frontends).
    pub service_id: u32,
    pub kind: FrontendKind,
    /// The set every source uses (for an eTP=Local external destination: the
    /// local set, used by sources outside the cluster).
    pub backends: BackendSet<B>,
    /// eTP=Local external destinations: the cluster set that in-cluster
    /// sources use (kube-proxy's short-circuit).
    pub internal_backends: Option<BackendSet<B>>,
    /// SNAT new flows to the node (eTP=Cluster external destinations).
    pub masquerade: bool,
    /// `sessionAffinity: ClientIP` timeout.
    pub affinity_timeout: Option<Duration>,
    /// Check `loadBalancerSourceRanges` (entries via [`LbMaps::add_source_range`]).
    pub source_ranges: bool,
    pub external_local: bool,
    pub internal_local: bool,
}

type Map<K, V> = HashMap<MapData, K, V>;

/// The datapath's maps, typed.
pub struct LbMaps {
    pub(super) config: Array<MapData, DpConfig>,
    pub(super) services: Map<Lb4ServiceKey, Lb4Service>,
    pub(super) backends: Array<MapData, Lb4Backend>,
    pub(super) affinity: Map<Lb4AffinityKey, Lb4AffinityValue>,
    pub(super) source_ranges: LpmTrie<MapData, Lb4SourceRangeData, u8>,
    pub(super) ct: Map<Ct4Key, Ct4Entry>,
    pub(super) counters: PerCpuArray<MapData, Counter>,
    pub(super) service_stats: PerCpuArray<MapData, Counter>,
    pub(super) service_names: Map<u32, Lb4ServiceName>,
    pub(super) sock_revnat: Map<dataplane_common::ct::Sock4RevKey, dataplane_common::ct::Sock4RevValue>,
    pub(super) max_services: u32,
    pub(super) max_backends: u32,
    pub(super) ct_capacity: u32,
    pub(super) service_entries_capacity: u32,
    pub(super) affinity_capacity: u32,
}

fn be32(ip: Ipv4Addr) -> u32 {
    u32::from(ip).to_be()
}

fn err(name: &'static str) -> impl Fn(MapError) -> DatapathError {
    move |source| DatapathError::Map { name, source }
}

/// A missing key is not an error when deleting.
fn removed(r: Result<(), MapError>, name: &'static str) -> Result<(), DatapathError> {
    match r {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err(name)(e)),
    }
}

impl LbMaps {
    /// Writes the node-wide settings; until then the datapath passes
    /// everything untouched.
    pub fn set_config(&mut self, config: &DatapathConfig) -> Result<(), DatapathError> {
        let abi = config.to_abi()?;
        self.config.set(0, abi, 0).map_err(err(names::CONFIG))
    }

    pub fn set_backend(&mut self, id: BackendId, backend: &Backend) -> Result<(), DatapathError> {
        self.check_backend_id(id)?;
        self.backends
            .set(id.get(), backend.to_abi(), 0)
            .map_err(err(names::LB4_BACKENDS))
    }

    /// Frees the id. Conntrack entries still naming it stop being used.
    pub fn remove_backend(&mut self, id: BackendId) -> Result<(), DatapathError> {
        self.check_backend_id(id)?;
        self.backends
            .set(id.get(), Lb4Backend::default(), 0)
            .map_err(err(names::LB4_BACKENDS))
    }

    pub fn backend(&self, id: BackendId) -> Result<Option<Backend>, DatapathError> {
        let b = self
            .backends
            .get(&id.get(), 0)
            .map_err(err(names::LB4_BACKENDS))?;
        Ok(Backend::from_abi(&b))
    }

    /// All backends in use, by id.
    pub fn backends(&self) -> Result<Vec<(BackendId, Backend)>, DatapathError> {
        let mut out = Vec::new();
        for (i, b) in self.backends.iter().enumerate() {
            let b = b.map_err(err(names::LB4_BACKENDS))?;
            if let (Some(id), Some(backend)) = (BackendId::new(i as u32), Backend::from_abi(&b)) {
                out.push((id, backend));
            }
        }
        Ok(out)
    }

    fn check_backend_id(&self, id: BackendId) -> Result<(), DatapathError> {
        if id.get() >= self.max_backends {
            return Err(DatapathError::Invalid(format!(
                "backend id {} is beyond the backends map capacity {}",
                id.get(),
                self.max_backends
            )));
        }
        Ok(())
    }

    /// Creates or updates a frontend, make-before-break: backend slots
    /// first, then slot 0; slots the new set no longer uses are deleted
    /// last. The backends must already be written.
    pub fn set_frontend(&mut self, fe: &Frontend, entry: &FrontendEntry) -> Result<(), DatapathError> {
        if entry.service_id >= self.max_services {
            return Err(DatapathError::Invalid(format!(
                "service id {} is beyond the capacity of {} service ports",
                entry.service_id, self.max_services
            )));
        }
        let too_many = |s: &BackendSet| s.backends.len() > limits::MAX_BACKENDS_PER_SERVICE as usize;
        if too_many(&entry.backends) || entry.internal_backends.as_ref().is_some_and(too_many) {
            return Err(DatapathError::Invalid(format!(
                "{}:{}/{} has more than {} backends",
                fe.addr,
                fe.port,
                fe.proto,
                limits::MAX_BACKENDS_PER_SERVICE
            )));
        }
        let mut flags = entry.kind.flag();
        for (on, flag) in [
            (entry.masquerade, service_flags::MASQUERADE),
            (entry.affinity_timeout.is_some(), service_flags::AFFINITY),
            (entry.source_ranges, service_flags::SOURCE_RANGES),
            (entry.external_local, service_flags::EXTERNAL_LOCAL),
            (entry.internal_local, service_flags::INTERNAL_LOCAL),
        ] {
            if on {
                flags |= flag;
            }
        }
        let affinity_timeout_s = entry
            .affinity_timeout
            .map_or(0, |d| d.as_secs().clamp(1, u32::MAX as u64) as u32);
        let head = |set: &BackendSet, flags: u16| Lb4Service {
            backend_id: 0,
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
        // The internal set is complete before the external frontend points
        // at it (TWO_SCOPES), and removed only after it no longer does.
        match &entry.internal_backends {
            Some(internal) => {
                self.write_scope(fe, scope::INTERNAL, internal, head(internal, flags))?;
                let ext = head(&entry.backends, flags | service_flags::TWO_SCOPES);
                self.write_scope(fe, scope::EXTERNAL, &entry.backends, ext)?;
            }
            None => {
                self.write_scope(fe, scope::EXTERNAL, &entry.backends, head(&entry.backends, flags))?;
                self.remove_scope(fe, scope::INTERNAL)?;
            }
        }
        Ok(())
    }

    fn write_scope(
        &mut self,
        fe: &Frontend,
        scope: u8,
        set: &BackendSet,
        head: Lb4Service,
    ) -> Result<(), DatapathError> {
        let old_count = self
            .services
            .get(&fe.key(scope, 0), 0)
            .map(|s| s.count)
            .unwrap_or(0);
        for (i, id) in set.backends.iter().enumerate() {
            let slot = Lb4Service {
                backend_id: id.get(),
                ..Default::default()
            };
            self.services
                .insert(fe.key(scope, i as u16 + 1), slot, 0)
                .map_err(err(names::LB4_SERVICES))?;
        }
        self.services
            .insert(fe.key(scope, 0), head, 0)
            .map_err(err(names::LB4_SERVICES))?;
        for slot in set.backends.len() as u16 + 1..=old_count {
            removed(self.services.remove(&fe.key(scope, slot)), names::LB4_SERVICES)?;
        }
        Ok(())
    }

    fn remove_scope(&mut self, fe: &Frontend, scope: u8) -> Result<(), DatapathError> {
        let Ok(head) = self.services.get(&fe.key(scope, 0), 0) else {
            return Ok(());
        };
        removed(self.services.remove(&fe.key(scope, 0)), names::LB4_SERVICES)?;
        for slot in 1..=head.count {
            removed(self.services.remove(&fe.key(scope, slot)), names::LB4_SERVICES)?;
        }
        Ok(())
    }

    /// Removes a frontend: slot 0 first (packets stop matching), then slots.
    pub fn remove_frontend(&mut self, fe: &Frontend) -> Result<(), DatapathError> {
        self.remove_scope(fe, scope::EXTERNAL)?;
        self.remove_scope(fe, scope::INTERNAL)
    }

    /// The frontend's slot-0 entry and backend ids of one scope, as stored.
    pub fn frontend(
        &self,
        fe: &Frontend,
        scope: u8,
    ) -> Result<Option<(Lb4Service, Vec<u32>)>, DatapathError> {
        let head = match self.services.get(&fe.key(scope, 0), 0) {
            Ok(h) => h,
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(err(names::LB4_SERVICES)(e)),
        };
        let mut ids = Vec::with_capacity(head.count as usize);
        for slot in 1..=head.count {
            let s = self
                .services
                .get(&fe.key(scope, slot), 0)
                .map_err(err(names::LB4_SERVICES))?;
            ids.push(s.backend_id);
        }
        Ok(Some((head, ids)))
    }

    /// Marks `addr` as a Service address (ClusterIP): ports it does not
    /// serve are rejected rather than passed.
    pub fn set_service_address(&mut self, addr: Ipv4Addr) -> Result<(), DatapathError> {
        let value = Lb4Service {
            flags: service_flags::WILDCARD,
            ..Default::default()
        };
        self.services
            .insert(wildcard_key(addr), value, 0)
            .map_err(err(names::LB4_SERVICES))
    }

    pub fn remove_service_address(&mut self, addr: Ipv4Addr) -> Result<(), DatapathError> {
        removed(self.services.remove(&wildcard_key(addr)), names::LB4_SERVICES)
    }

    pub fn add_source_range(&mut self, service_id: u32, range: Ipv4Cidr) -> Result<(), DatapathError> {
        self.source_ranges
            .insert(&source_range_key(service_id, range), 1, 0)
            .map_err(err(names::LB4_SOURCE_RANGES))
    }

    pub fn remove_source_range(&mut self, service_id: u32, range: Ipv4Cidr) -> Result<(), DatapathError> {
        removed(
            self.source_ranges.remove(&source_range_key(service_id, range)),
            names::LB4_SOURCE_RANGES,
        )
    }

    /// Every conntrack entry (both directions of every flow).
    pub fn conntrack(&self) -> Result<Vec<(Ct4Key, Ct4Entry)>, DatapathError> {
        self.ct
            .iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(err(names::CT4))
    }

    /// Deletes the conntrack entries `stale` selects (e.g. UDP flows pinned
    /// to a backend that stopped serving); returns how many.
    pub fn purge_conntrack(
        &mut self,
        stale: impl Fn(&Ct4Key, &Ct4Entry) -> bool,
    ) -> Result<usize, DatapathError> {
        let victims: Vec<Ct4Key> = self
            .conntrack()?
            .into_iter()
            .filter(|(k, e)| stale(k, e))
            .map(|(k, _)| k)
            .collect();
        for k in &victims {
            removed(self.ct.remove(k), names::CT4)?;
        }
        Ok(victims.len())
    }

    /// Deletes the UDP conntrack entries of flows translated to `backends`
    /// (kube-proxy clears these when an endpoint stops serving, so that
    /// e.g. DNS clients move on at once).
    pub fn purge_udp_flows_to(&mut self, backends: &[BackendId]) -> Result<usize, DatapathError> {
        self.purge_conntrack(|k, e| {
            k.proto == dataplane_common::proto::UDP && backends.iter().any(|b| b.get() == e.backend_id)
        })
    }

    /// The ClientIP affinity entry of `client` for a service port.
    pub fn affinity(&self, service_id: u32, client: Ipv4Addr) -> Option<Lb4AffinityValue> {
        let key = Lb4AffinityKey {
            client: be32(client),
            service_id,
        };
        self.affinity.get(&key, 0).ok()
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
}

/// (namespace, name, port name, protocol) of a Service port.
pub type ServicePortName = (String, String, String, Protocol);

/// Everything the maps hold about services, as typed values: what a
/// restarted agent adopts.
#[derive(Clone, Debug, Default)]
pub struct MapTable {
    pub backends: Vec<(BackendId, Backend)>,
    pub frontends: Vec<(Frontend, FrontendEntry)>,
    pub service_addresses: Vec<Ipv4Addr>,
    pub source_ranges: Vec<(u32, Ipv4Cidr)>,
    /// service id → (namespace, name, port name, protocol).
    pub service_names: Vec<(u32, ServicePortName)>,
}

impl LbMaps {
    /// Reads the whole service table back from the maps.
    pub fn read_table(&self) -> Result<MapTable, DatapathError> {
        let mut table = MapTable {
            backends: self.backends()?,
            ..Default::default()
        };
        let entries: Vec<(Lb4ServiceKey, Lb4Service)> = self
            .services
            .iter()
            .collect::<Result<_, _>>()
            .map_err(err(names::LB4_SERVICES))?;
        let slots: std::collections::HashMap<Lb4ServiceKey, Lb4Service> = entries.iter().copied().collect();
        let set = |key: &Lb4ServiceKey, head: &Lb4Service| BackendSet {
            backends: (1..=head.count)
                .filter_map(|slot| slots.get(&Lb4ServiceKey { slot, ..*key }))
                .filter_map(|s| BackendId::new(s.backend_id))
                .collect(),
            when_empty: if head.flags & service_flags::REJECT_EMPTY != 0 {
                EmptyVerdict::Reject
            } else {
                EmptyVerdict::Drop
            },
        };
        for (key, head) in &entries {
            if key.slot != 0 || key.scope != scope::EXTERNAL {
                continue;
            }
            let addr = Ipv4Addr::from(u32::from_be(key.address));
            if head.flags & service_flags::WILDCARD != 0 {
                table.service_addresses.push(addr);
                continue;
            }
            let Some(proto) = Protocol::from_number(key.proto) else {
                continue;
            };
            let kind = match head.flags & service_flags::KIND_MASK {
                service_flags::NODE_PORT => FrontendKind::NodePort,
                service_flags::EXTERNAL_IP => FrontendKind::ExternalIp,
                service_flags::LOAD_BALANCER => FrontendKind::LoadBalancer,
                _ => FrontendKind::ClusterIp,
            };
            let internal_key = Lb4ServiceKey {
                scope: scope::INTERNAL,
                ..*key
            };
            let internal_backends = (head.flags & service_flags::TWO_SCOPES != 0)
                .then(|| slots.get(&internal_key).map(|h| set(&internal_key, h)))
                .flatten();
            let flag = |f: u16| head.flags & f != 0;
            table.frontends.push((
                Frontend {
                    addr,
                    port: u16::from_be(key.port),
                    proto,
                },
                FrontendEntry {
                    service_id: head.service_id,
                    kind,
                    backends: set(key, head),
                    internal_backends,
                    masquerade: flag(service_flags::MASQUERADE),
                    affinity_timeout: flag(service_flags::AFFINITY)
                        .then(|| Duration::from_secs(head.affinity_timeout_s as u64)),
                    source_ranges: flag(service_flags::SOURCE_RANGES),
                    external_local: flag(service_flags::EXTERNAL_LOCAL),
                    internal_local: flag(service_flags::INTERNAL_LOCAL),
                },
            ));
        }
        for key in self.source_ranges.keys() {
            let key = key.map_err(err(names::LB4_SOURCE_RANGES))?;
            let data = key.data();
            let prefix = key.prefix_len().saturating_sub(32).min(32) as u8;
            if let Some(c) = Ipv4Cidr::new(Ipv4Addr::from(u32::from_be(data.address)), prefix) {
                table.source_ranges.push((u32::from_be(data.service_id_be), c));
            }
        }
        table.service_names = self.service_names()?;
        // Stable order for people and diffs: by kind, then address and port.
        table
            .frontends
            .sort_by_key(|(f, e)| (e.kind as u8, f.addr, f.port, f.proto));
        table.backends.sort_by_key(|(id, _)| *id);
        table.service_addresses.sort();
        table.source_ranges.sort();
        table.service_names.sort_by_key(|(id, _)| *id);
        Ok(table)
    }

    /// (entries, capacity) of the maps worth watching. Counting iterates the
    /// maps: call it at a housekeeping pace, not per request.
    pub fn occupancy(&self) -> std::collections::BTreeMap<&'static str, (u64, u64)> {
        let mut out = std::collections::BTreeMap::new();
        out.insert(
            names::CT4,
            (self.ct.keys().count() as u64, self.ct_capacity as u64),
        );
        out.insert(
            names::LB4_SERVICES,
            (
                self.services.keys().count() as u64,
                self.service_entries_capacity as u64,
            ),
        );
        let backends = self.backends().map_or(0, |b| b.len()) as u64;
        out.insert(
            names::LB4_BACKENDS,
            (backends, self.max_backends.saturating_sub(1) as u64),
        );
        out.insert(
            names::LB4_AFFINITY,
            (self.affinity.keys().count() as u64, self.affinity_capacity as u64),
        );
        out
    }

    /// Backends chosen at connect() time, as the connect-time programs
    /// recorded them.
    pub fn sock_translations(&self) -> Result<Vec<std::net::SocketAddrV4>, DatapathError> {
        self.sock_revnat
            .keys()
            .map(|k| {
                let k = k.map_err(err(names::SOCK4_REVNAT))?;
                Ok(std::net::SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(k.addr)),
                    u16::from_be(k.port),
                ))
            })
            .collect()
    }

    /// Records who a service id belongs to.
    pub fn set_service_name(
        &mut self,
        id: u32,
        (namespace, name, port_name, proto): (&str, &str, &str, Protocol),
    ) -> Result<(), DatapathError> {
        let mut v = Lb4ServiceName {
            namespace: [0; 64],
            name: [0; 64],
            port_name: [0; 16],
            proto: proto.number(),
            _pad: [0; 3],
        };
        fn fill(dst: &mut [u8], src: &str) {
            let n = src.len().min(dst.len());
            dst[..n].copy_from_slice(&src.as_bytes()[..n]);
        }
        fill(&mut v.namespace, namespace);
        fill(&mut v.name, name);
        fill(&mut v.port_name, port_name);
        self.service_names
            .insert(id, v, 0)
            .map_err(err(names::LB4_SERVICE_NAMES))
    }

    pub fn remove_service_name(&mut self, id: u32) -> Result<(), DatapathError> {
        removed(self.service_names.remove(&id), names::LB4_SERVICE_NAMES)
    }

    /// service id → (namespace, name, port name, protocol).
    pub fn service_names(&self) -> Result<Vec<(u32, ServicePortName)>, DatapathError> {
        let text =
            |b: &[u8]| String::from_utf8_lossy(b.split(|c| *c == 0).next().unwrap_or_default()).into_owned();
        self.service_names
            .iter()
            .map(|r| {
                let (id, v) = r.map_err(err(names::LB4_SERVICE_NAMES))?;
                let proto = Protocol::from_number(v.proto).unwrap_or(Protocol::Tcp);
                Ok((id, (text(&v.namespace), text(&v.name), text(&v.port_name), proto)))
            })
            .collect()
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

fn wildcard_key(addr: Ipv4Addr) -> Lb4ServiceKey {
    Lb4ServiceKey {
        address: be32(addr),
        ..Default::default()
    }
}

fn source_range_key(service_id: u32, range: Ipv4Cidr) -> Key<Lb4SourceRangeData> {
    Key::new(
        32 + range.prefix_len() as u32,
        Lb4SourceRangeData {
            service_id_be: service_id.to_be(),
            address: be32(range.addr()),
        },
    )
}
