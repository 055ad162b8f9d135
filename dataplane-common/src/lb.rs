//! Load-balancing maps: services (frontend + backend slots), backends,
//! session affinity, source ranges; one set per address family, with the
//! same shapes (keys generic over [`Addr`]: `Lb4*` and `Lb6*` name the
//! instances). Values without addresses are shared.
//!
//! A frontend is (address, port, protocol). Its entries in the services map:
//! slot 0 holds the frontend ([`LbService::count`], service id, flags);
//! slots `1..=count` hold backend ids. A frontend may have two backend sets,
//! selected by [`scope`]: eTP=Local external destinations keep the local set
//! in [`scope::EXTERNAL`] and the cluster set (for in-cluster sources, which
//! kube-proxy short-circuits) in [`scope::INTERNAL`].

/// Which backend set of a frontend a lookup wants.
pub mod scope {
    /// The set every source uses, unless the frontend has
    /// [`super::service_flags::TWO_SCOPES`] and the source is in the cluster.
    pub const EXTERNAL: u8 = 0;
    /// The cluster set of an eTP=Local external destination, used by
    /// in-cluster sources.
    pub const INTERNAL: u8 = 1;
}

use crate::addr::{Addr, Ip6};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LbServiceKey<A> {
    /// Frontend address (network order).
    pub address: A,
    /// Frontend port (network order); 0 with proto 0 for the wildcard entry.
    pub port: u16,
    /// 0 = frontend, 1..=count = backend slots.
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}
pub type Lb4ServiceKey = LbServiceKey<u32>;
pub type Lb6ServiceKey = LbServiceKey<Ip6>;
crate::assert_layout!(Lb4ServiceKey, 12, 4);
crate::assert_layout!(Lb6ServiceKey, 24, 4);

/// Value of the services map. For slot 0 (the frontend) every field is
/// meaningful; for backend slots only `backend_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbService {
    /// Backend slots: the backend id. Frontend: its Maglev table
    /// ([`MaglevKey::table`]) with [`service_flags::MAGLEV`], else 0.
    pub backend_id: u32,
    /// Identifies the Service port (shared by all its frontends): stats,
    /// affinity and source ranges are keyed by it.
    pub service_id: u32,
    /// Frontend: number of backend slots in this scope.
    pub count: u16,
    /// Frontend: [`service_flags`].
    pub flags: u16,
    /// Frontend: ClientIP affinity timeout in seconds (with `AFFINITY`).
    pub affinity_timeout_s: u32,
}
crate::assert_layout!(LbService, 16, 4);

pub mod service_flags {
    /// Kind of frontend (exactly one of the four).
    pub const CLUSTER_IP: u16 = 1 << 0;
    pub const NODE_PORT: u16 = 1 << 1;
    pub const EXTERNAL_IP: u16 = 1 << 2;
    pub const LOAD_BALANCER: u16 = 1 << 3;
    pub const KIND_MASK: u16 = CLUSTER_IP | NODE_PORT | EXTERNAL_IP | LOAD_BALANCER;
    /// eTP=Local external destination: [`super::scope::EXTERNAL`] holds the
    /// local set, [`super::scope::INTERNAL`] the cluster set for in-cluster
    /// sources (pods: no SNAT; the node itself: SNAT).
    pub const TWO_SCOPES: u16 = 1 << 4;
    /// SNAT new flows to the node (eTP=Cluster external destinations).
    pub const MASQUERADE: u16 = 1 << 5;
    /// `sessionAffinity: ClientIP`.
    pub const AFFINITY: u16 = 1 << 6;
    /// `loadBalancerSourceRanges`: new flows from other sources are dropped.
    pub const SOURCE_RANGES: u16 = 1 << 7;
    /// With count 0: answer new flows with ICMP port-unreachable (the
    /// service has no usable endpoint at all). Without: drop (a Local policy
    /// without local endpoints).
    pub const REJECT_EMPTY: u16 = 1 << 8;
    /// The wildcard entry (port 0, proto 0) of a ClusterIP: the address is a
    /// Service, so a port it does not serve is rejected.
    pub const WILDCARD: u16 = 1 << 9;
    /// iTP=Local (informational: the set already is the local one).
    pub const INTERNAL_LOCAL: u16 = 1 << 10;
    /// eTP=Local (informational for inspect).
    pub const EXTERNAL_LOCAL: u16 = 1 << 11;
    /// New flows take the backend the frontend's Maglev table names for
    /// their hash ([`super::MaglevKey`]; the table id is slot 0's
    /// `backend_id`) instead of a random slot: every node with the same
    /// backends and seed picks the same one.
    pub const MAGLEV: u16 = 1 << 12;
    /// Direct server return (with [`MASQUERADE`]'s place: an eTP=Cluster
    /// external destination): a new flow from outside whose backend runs on
    /// another node is sent there encapsulated (IPIP, IPv6-in-IPv6) and
    /// untranslated, keeping the client's address; that node translates it
    /// and its replies go to the client straight from there. A local
    /// backend gets the flow unmasqueraded.
    pub const DSR: u16 = 1 << 13;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbBackend<A> {
    /// Network order.
    pub address: A,
    /// Network order.
    pub port: u16,
    pub proto: u8,
    /// [`backend_flags`]; 0 means the slot is free (id not in use).
    pub flags: u8,
}
pub type Lb4Backend = LbBackend<u32>;
pub type Lb6Backend = LbBackend<Ip6>;
crate::assert_layout!(Lb4Backend, 8, 4);
crate::assert_layout!(Lb6Backend, 20, 4);

pub mod backend_flags {
    /// The id is in use.
    pub const ACTIVE: u8 = 1 << 0;
    /// The endpoint is terminating.
    pub const TERMINATING: u8 = 1 << 1;
    /// The endpoint runs on this node.
    pub const LOCAL: u8 = 1 << 2;
    /// The endpoint is serving (ready, or terminating but still serving).
    pub const SERVING: u8 = 1 << 3;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey<A> {
    /// Client address (network order).
    pub client: A,
    pub service_id: u32,
}
pub type Lb4AffinityKey = AffinityKey<u32>;
pub type Lb6AffinityKey = AffinityKey<Ip6>;
crate::assert_layout!(Lb4AffinityKey, 8, 4);
crate::assert_layout!(Lb6AffinityKey, 20, 4);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbAffinityValue {
    /// The datapath clock (`ct::now`) of the last new flow that used it.
    pub last_used_ns: u64,
    pub backend_id: u32,
    /// Slot the backend had when chosen: a still-valid affinity must find
    /// the same backend id in that slot of the frontend (O(1) membership).
    pub slot: u32,
}
crate::assert_layout!(LbAffinityValue, 16, 8);

/// Data part of the source-ranges LPM trie key (the prefix length precedes
/// it): the service id must match fully (32 bits), then `prefix` bits of the
/// address. Both in network order, so the trie compares them MSB first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRangeData<A> {
    /// Service id, big-endian.
    pub service_id_be: u32,
    /// Network order.
    pub address: A,
}
pub type Lb4SourceRangeData = SourceRangeData<u32>;
pub type Lb6SourceRangeData = SourceRangeData<Ip6>;
crate::assert_layout!(Lb4SourceRangeData, 8, 4);
crate::assert_layout!(Lb6SourceRangeData, 20, 4);

impl<A: Addr> SourceRangeData<A> {
    /// Bits of the LPM key: the service id fully, then the address.
    pub const BITS: u32 = 32 + 8 * core::mem::size_of::<A>() as u32;
}

/// Backend ids per Maglev table chunk: a table of M entries is stored as
/// `ceil(M / MAGLEV_CHUNK)` values of a hash map (allocated as they are
/// written: a node pays for the tables it uses), each written whole.
pub const MAGLEV_CHUNK: usize = 1024;
/// The largest table (Katran's ring size): 65 chunks.
pub const MAGLEV_MAX_SIZE: u32 = 65_537;

/// Key of the Maglev tables map: entry `i` of table `table` is entry
/// `i % MAGLEV_CHUNK` of chunk `i / MAGLEV_CHUNK`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaglevKey {
    /// A backend set of one service port: `service_id * 2`, plus 1 for its
    /// local set (see the agent's `state::maglev`).
    pub table: u32,
    pub chunk: u32,
}
crate::assert_layout!(MaglevKey, 8, 4);

/// One chunk of a Maglev table: backend ids (0: unfilled, past the end).
pub type MaglevChunk = [u32; MAGLEV_CHUNK];

/// Key of the DSR map on the backend's node: which local backend an
/// encapsulated packet to `backend` through frontend `address:port` is for.
/// NodePorts are keyed with `address` zero: the client reached another
/// node's address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DsrKey<A> {
    /// Frontend address (network order); zero for a NodePort.
    pub address: A,
    /// The backend the packet was sent to (its outer destination).
    pub backend: A,
    /// Frontend port (network order).
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}
pub type Dsr4Key = DsrKey<u32>;
pub type Dsr6Key = DsrKey<Ip6>;
crate::assert_layout!(Dsr4Key, 12, 4);
crate::assert_layout!(Dsr6Key, 36, 4);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DsrValue {
    pub backend_id: u32,
    pub service_id: u32,
}
crate::assert_layout!(DsrValue, 8, 4);

crate::impl_pod!(LbService, LbAffinityValue, MaglevKey, DsrValue);
crate::impl_pod_generic!(LbServiceKey, LbBackend, AffinityKey, SourceRangeData, DsrKey);

/// Who a service id belongs to, for `inspect` and for a restarted agent to
/// keep ids stable. Written by the agent only; NUL-padded UTF-8.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbServiceName {
    pub namespace: [u8; 64],
    pub name: [u8; 64],
    /// Service port names are at most 15 characters (IANA service names).
    pub port_name: [u8; 16],
    pub proto: u8,
    /// The Service port's IP family: 6 for IPv6, else IPv4 (0 in names
    /// written before dual-stack, which were all IPv4).
    pub family: u8,
    pub _pad: [u8; 2],
}
crate::assert_layout!(LbServiceName, 148, 1);
crate::impl_pod!(LbServiceName);
