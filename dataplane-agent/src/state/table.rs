//! The service table's vocabulary: what a node's datapath holds, in domain
//! terms. `dataplane/` converts these to the kernel ABI (byte order, flags,
//! slots); nothing here knows about maps.

use std::{
    fmt,
    net::IpAddr,
    num::NonZeroU32,
    sync::{Arc, Mutex},
    time::Duration,
};

use foldhash::{HashSet, HashSetExt as _};

use crate::net::{IpCidr, IpFamily, Protocol};

/// kube-proxy's `ServicePortName`: one port of one Service, in one IP
/// family (kube-proxy runs one proxier per family; a dual-stack Service is
/// two Service ports here, with two service ids). Stats, affinity and source
/// ranges are per service port (and keyed by its service id).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    /// Shared strings: a hundred thousand of these are kept, and the
    /// namespace and name are the Service key's own.
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    /// The port's name (may be empty).
    pub port_name: Arc<str>,
    pub proto: Protocol,
    pub family: IpFamily,
}

impl ServicePortName {
    /// `namespace/name`: the Service object.
    pub fn object(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A name many objects share (a namespace, a port name), interned: one
/// allocation for all of them. What is interned is bounded by the cluster's
/// namespaces and port names, and kept for the agent's life.
pub fn intern(name: &str) -> Arc<str> {
    static NAMES: Mutex<Option<HashSet<Arc<str>>>> = Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let set = names.get_or_insert_with(HashSet::new);
    if let Some(n) = set.get(name) {
        return n.clone();
    }
    let n: Arc<str> = Arc::from(name);
    set.insert(n.clone());
    n
}

/// `namespace/name:port`, as logs, events and `inspect` show it; the IPv6
/// half of a Service port says so (`namespace/name:port (IPv6)`).
impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.namespace, self.name, self.port_name)?;
        if self.family == IpFamily::V6 {
            f.write_str(" (IPv6)")?;
        }
        Ok(())
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

/// A backend as the desired state names it: by address, not by id (ids are
/// assigned when it is programmed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendKey {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Protocol,
}

/// An endpoint address as the datapath translates to it. A backend exists
/// as long as its endpoint does (whatever its conditions), so established
/// flows keep it; only the frontends' sets decide where new flows go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backend {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Protocol,
    pub serving: bool,
    pub terminating: bool,
    pub local: bool,
}

impl Backend {
    pub fn key(&self) -> BackendKey {
        BackendKey {
            addr: self.addr,
            port: self.port,
            proto: self.proto,
        }
    }
}

/// Where a frontend listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Protocol,
}

impl Frontend {
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.addr)
    }
}

/// `10.96.0.10:80/TCP`, `[fd00:10:96::a]:80/TCP`.
impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            crate::net::host_port(self.addr, self.port),
            self.proto
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
/// [`BackendKey`] in the desired state (ids are assigned by the diff).
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
    /// Check `loadBalancerSourceRanges` (the ranges are entries of their own).
    pub source_ranges: bool,
    pub external_local: bool,
    pub internal_local: bool,
    /// Direct server return for new flows from outside to a backend on
    /// another node (an eTP=Cluster external destination in `dsr` or
    /// `hybrid` mode): replaces `masquerade` there.
    pub dsr: bool,
    /// Maglev: backends picked by consistent hashing (one table per set:
    /// [`crate::state::maglev`]).
    pub maglev: bool,
}

impl<B> FrontendEntry<B> {
    /// Whether `backends` is the service port's local set (iTP=Local for a
    /// ClusterIP, eTP=Local for an external destination); the in-cluster
    /// set of a two-set entry is the cluster set.
    pub fn uses_local_set(&self) -> bool {
        if self.kind == FrontendKind::ClusterIp {
            self.internal_local
        } else {
            self.external_local
        }
    }

    /// Every backend the entry names (both sets).
    pub fn all_backends(&self) -> impl Iterator<Item = &B> {
        std::iter::once(&self.backends)
            .chain(self.internal_backends.as_ref())
            .flat_map(|s| &s.backends)
    }

    /// The same entry with its backends named differently, leaving out
    /// those `f` cannot name.
    pub fn filter_map_backends<C>(&self, mut f: impl FnMut(&B) -> Option<C>) -> FrontendEntry<C> {
        let mut set = |s: &BackendSet<B>| BackendSet {
            backends: s.backends.iter().filter_map(&mut f).collect(),
            when_empty: s.when_empty,
        };
        FrontendEntry {
            service_id: self.service_id,
            kind: self.kind,
            backends: set(&self.backends),
            internal_backends: self.internal_backends.as_ref().map(&mut set),
            masquerade: self.masquerade,
            affinity_timeout: self.affinity_timeout,
            source_ranges: self.source_ranges,
            external_local: self.external_local,
            internal_local: self.internal_local,
            dsr: self.dsr,
            maglev: self.maglev,
        }
    }

    /// The same entry with its backends named differently (`None` if one
    /// cannot be).
    pub fn map_backends<C>(&self, mut f: impl FnMut(&B) -> Option<C>) -> Option<FrontendEntry<C>> {
        let mut set = |s: &BackendSet<B>| -> Option<BackendSet<C>> {
            Some(BackendSet {
                backends: s.backends.iter().map(&mut f).collect::<Option<Vec<C>>>()?,
                when_empty: s.when_empty,
            })
        };
        Some(FrontendEntry {
            service_id: self.service_id,
            kind: self.kind,
            backends: set(&self.backends)?,
            internal_backends: match &self.internal_backends {
                Some(s) => Some(set(s)?),
                None => None,
            },
            masquerade: self.masquerade,
            affinity_timeout: self.affinity_timeout,
            source_ranges: self.source_ranges,
            external_local: self.external_local,
            internal_local: self.internal_local,
            dsr: self.dsr,
            maglev: self.maglev,
        })
    }
}

/// Everything the maps hold about services, as typed values: what a
/// restarted agent adopts, what the periodic resync compares with what it
/// believes it wrote, and what `inspect` shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapTable {
    pub backends: Vec<(BackendId, Backend)>,
    pub frontends: Vec<(Frontend, FrontendEntry)>,
    pub service_addresses: Vec<IpAddr>,
    pub source_ranges: Vec<(u32, IpCidr)>,
    pub service_names: Vec<(u32, ServicePortName)>,
    /// Entries of the services map no frontend accounts for (a slot beyond
    /// its frontend's count, or without a frontend): left by an interrupted
    /// write or written by someone else, removed by the next resync.
    pub stray_slots: Vec<StraySlot>,
    /// Frontends whose slot 0 promises slots that are missing (an
    /// interrupted write, or tampering), with the counts slot 0 claims: the
    /// next plan rewrites them.
    pub damaged: Vec<(Frontend, SlotCounts)>,
}

impl MapTable {
    /// Stable order for people and diffs: frontends by kind, then address
    /// and port; everything else by key.
    pub fn sort(&mut self) {
        self.frontends
            .sort_by_key(|(f, e)| (e.kind, f.addr, f.port, f.proto));
        self.backends.sort_by_key(|(id, _)| *id);
        self.service_addresses.sort();
        self.source_ranges.sort();
        self.service_names.sort_by_key(|(id, _)| *id);
        self.stray_slots.sort();
        self.damaged.sort_by_key(|(f, _)| *f);
    }
}

/// How many backend slots a frontend has, per set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotCounts {
    pub external: u16,
    /// The in-cluster set of an eTP=Local external destination.
    pub internal: Option<u16>,
}

impl SlotCounts {
    pub fn of<B>(entry: &FrontendEntry<B>) -> Self {
        Self {
            external: entry.backends.backends.len() as u16,
            internal: entry.internal_backends.as_ref().map(|s| s.backends.len() as u16),
        }
    }
}

/// A services-map entry that is not part of any frontend, named by its key
/// fields (the map layer knows how to delete it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StraySlot {
    pub frontend: Frontend,
    /// The in-cluster set of a two-set frontend (else the external one).
    pub internal: bool,
    pub slot: u16,
}
