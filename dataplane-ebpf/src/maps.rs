//! Every map of the datapath. Sizes are defaults; the agent may resize at
//! load time. Only per-CPU and LRU maps are written from the kernel.

use aya_ebpf::{
    macros::map,
    maps::{Array, DevMapHash, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
};
use dataplane_common::{
    config::DpConfig,
    ct::{
        Ct4Entry, Ct4Key, Ct6Entry, Ct6Key, CtEntry, CtKey, SnatClosed, Sock4RevKey, Sock4RevValue,
        Sock6RevKey, Sock6RevValue,
    },
    filter::FILTER_WORDS,
    hint::DEVICE_WORDS,
    lb::{
        Dsr4Key, Dsr6Key, DsrValue, Lb4AffinityKey, Lb4Backend, Lb4ServiceKey, Lb4SourceRangeData,
        Lb6AffinityKey, Lb6Backend, Lb6ServiceKey, Lb6SourceRangeData, LbAffinityValue, LbService,
        LbServiceName, MaglevChunk, MaglevKey,
    },
    limits,
    stats::{COUNTER_SLOTS, Counter, FLOW_STAT_SLOTS},
};

/// Live drop, reject and trace events (`monitor`), whether anyone reads
/// them, each CPU's rate limit and sampled packet
/// (`dataplane_common::monitor`).
#[map(name = "DP_MONITOR_EVENTS_V1")]
pub static MONITOR_EVENTS: RingBuf = RingBuf::with_byte_size(dataplane_common::monitor::RING_BYTES, 0);

#[map(name = "DP_MONITOR_CTL_V1")]
pub static MONITOR_CTL: Array<dataplane_common::monitor::MonitorCtl> = Array::with_max_entries(1, 0);

#[map(name = "DP_MONITOR_RATE_V1")]
pub static MONITOR_RATE: PerCpuArray<dataplane_common::monitor::MonitorRate> =
    PerCpuArray::with_max_entries(1, 0);

#[map(name = "DP_MONITOR_SAMPLE_V1")]
pub static MONITOR_SAMPLE: PerCpuArray<dataplane_common::monitor::MonitorSample> =
    PerCpuArray::with_max_entries(1, 0);

#[map(name = "DP_CONFIG_V4")]
pub static CONFIG: Array<DpConfig> = Array::with_max_entries(1, 0);

/// Agent-written bitmaps of the addresses the hooks act on.
#[map(name = "DP_ADDR_FILTER_V2")]
pub static ADDR_FILTER: Array<u64> = Array::with_max_entries(2 * FILTER_WORDS, 0);

/// Agent-written bitmap of the devices whose ingress word egress trusts.
#[map(name = "DP_HINT_DEVICES_V1")]
pub static HINT_DEVICES: Array<u64> = Array::with_max_entries(DEVICE_WORDS, 0);

#[map(name = "LB4_SERVICES_V1")]
pub static SERVICES: HashMap<Lb4ServiceKey, LbService> =
    HashMap::with_max_entries(limits::MAX_SERVICE_ENTRIES, 0);

/// Indexed by backend id; id 0 and entries without `ACTIVE` are unused.
#[map(name = "LB4_BACKENDS_V1")]
pub static BACKENDS: Array<Lb4Backend> = Array::with_max_entries(limits::MAX_BACKENDS, 0);

#[map(name = "LB4_AFFINITY_V1")]
pub static AFFINITY: LruHashMap<Lb4AffinityKey, LbAffinityValue> =
    LruHashMap::with_max_entries(limits::AFFINITY_ENTRIES, 0);

#[map(name = "LB4_SOURCE_RANGES_V1")]
pub static SOURCE_RANGES: LpmTrie<Lb4SourceRangeData, u8> =
    LpmTrie::with_max_entries(limits::SOURCE_RANGE_ENTRIES, 0);

/// Conntrack: an LRU, which a flood of new flows evicts from.
#[map(name = "CT4_V2")]
pub static CT4: LruHashMap<Ct4Key, Ct4Entry> = LruHashMap::with_max_entries(limits::CT_ENTRIES, 0);

/// Copies of assured flows' entries (`dataplane_common::ct::assured`),
/// restored into `CT4` when it evicted them: a hash map, which never
/// evicts (a full one refuses, and the flow goes unprotected); the agent
/// collects its expired copies. Not preallocated: it costs what it holds.
#[map(name = "CT4_ASSURED_V1")]
pub static CT4_ASSURED: HashMap<Ct4Key, Ct4Entry> =
    HashMap::with_max_entries(limits::CT_ENTRIES, aya_ebpf::bindings::BPF_F_NO_PREALLOC);

/// Masqueraded TCP flows their backend closed first, by their `REP_IN`
/// key: their SNAT ports are held back from other clients for TIME_WAIT
/// (`snat`).
/// An LRU: the oldest closures go first, and a port whose closure was
/// forgotten is simply free again.
#[map(name = "SNAT4_CLOSED_V1")]
pub static SNAT4_CLOSED: LruHashMap<Ct4Key, SnatClosed> =
    LruHashMap::with_max_entries(limits::SNAT_CLOSED_ENTRIES, 0);

/// Per CPU and backend id: the SNAT port search's state.
#[map(name = "DP_SNAT_CURSORS_V2")]
pub static SNAT_CURSORS: PerCpuArray<dataplane_common::ct::SnatCursor> =
    PerCpuArray::with_max_entries(limits::MAX_BACKENDS, 0);

#[map(name = "DP_COUNTERS_V1")]
pub static COUNTERS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// Indexed by [`dataplane_common::stats::FlowStat`].
#[map(name = "DP_FLOW_STATS_V2")]
pub static FLOW_STATS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(FLOW_STAT_SLOTS, 0);

/// Indexed by service id.
#[map(name = "LB4_SERVICE_STATS_V1")]
pub static SERVICE_STATS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(limits::MAX_SERVICES, 0);

/// Service id → its Kubernetes name. Only the agent (and `inspect`) use it;
/// it lives in the object so that it is created and pinned with the rest.
#[map(name = "LB4_SERVICE_NAMES_V1")]
pub static SERVICE_NAMES: HashMap<u32, LbServiceName> =
    HashMap::with_max_entries(limits::MAX_SERVICES, aya_ebpf::bindings::BPF_F_NO_PREALLOC);

/// Connect-time translations: socket cookie + backend → Service address.
#[map(name = "SOCK4_REVNAT_V1")]
pub static SOCK_REVNAT: LruHashMap<Sock4RevKey, Sock4RevValue> =
    LruHashMap::with_max_entries(limits::SOCK_REVNAT_ENTRIES, 0);

/// Maglev tables, in chunks, for both families (see
/// `dataplane_common::maglev`). Chunks are allocated as the agent writes
/// them, and each is replaced whole: a lookup sees an old or a new chunk,
/// both naming backends that exist.
#[map(name = "LB_MAGLEV_V1")]
pub static MAGLEV: HashMap<MaglevKey, MaglevChunk> =
    HashMap::with_max_entries(limits::MAGLEV_CHUNKS, aya_ebpf::bindings::BPF_F_NO_PREALLOC);

/// On a backend's node: which local backend an encapsulated DSR packet is
/// for.
#[map(name = "LB4_DSR_V1")]
pub static DSR4: HashMap<Dsr4Key, DsrValue> = HashMap::with_max_entries(limits::DSR_ENTRIES, 0);

/// Devices XDP may redirect forwarded packets to (the external devices in
/// native XDP mode), by ifindex; written by the agent.
#[map(name = "DP_XDP_DEVICES_V1")]
pub static XDP_DEVICES: DevMapHash = DevMapHash::with_max_entries(limits::XDP_DEVICES, 0);

// IPv6: the same shapes, keyed by 128-bit addresses (see `family`).

#[map(name = "LB6_SERVICES_V1")]
pub static SERVICES6: HashMap<Lb6ServiceKey, LbService> =
    HashMap::with_max_entries(limits::MAX_SERVICE_ENTRIES, 0);

#[map(name = "LB6_BACKENDS_V1")]
pub static BACKENDS6: Array<Lb6Backend> = Array::with_max_entries(limits::MAX_BACKENDS, 0);

#[map(name = "LB6_AFFINITY_V1")]
pub static AFFINITY6: LruHashMap<Lb6AffinityKey, LbAffinityValue> =
    LruHashMap::with_max_entries(limits::AFFINITY_ENTRIES, 0);

#[map(name = "LB6_SOURCE_RANGES_V1")]
pub static SOURCE_RANGES6: LpmTrie<Lb6SourceRangeData, u8> =
    LpmTrie::with_max_entries(limits::SOURCE_RANGE_ENTRIES, 0);

#[map(name = "CT6_V1")]
pub static CT6: LruHashMap<Ct6Key, Ct6Entry> = LruHashMap::with_max_entries(limits::CT_ENTRIES, 0);

#[map(name = "CT6_ASSURED_V1")]
pub static CT6_ASSURED: HashMap<Ct6Key, Ct6Entry> =
    HashMap::with_max_entries(limits::CT_ENTRIES, aya_ebpf::bindings::BPF_F_NO_PREALLOC);

#[map(name = "SNAT6_CLOSED_V1")]
pub static SNAT6_CLOSED: LruHashMap<Ct6Key, SnatClosed> =
    LruHashMap::with_max_entries(limits::SNAT_CLOSED_ENTRIES, 0);

#[map(name = "SOCK6_REVNAT_V1")]
pub static SOCK_REVNAT6: LruHashMap<Sock6RevKey, Sock6RevValue> =
    LruHashMap::with_max_entries(limits::SOCK_REVNAT_ENTRIES, 0);

#[map(name = "LB6_DSR_V1")]
pub static DSR6: HashMap<Dsr6Key, DsrValue> = HashMap::with_max_entries(limits::DSR_ENTRIES, 0);

/// What the ingress path leaves for the forwarding step that follows it in
/// the same run (`route`): the source rewrite the egress hook would have
/// made, or the backend a DSR packet is encapsulated to. Per CPU; written
/// and read within one run.
#[repr(C)]
pub struct Forward {
    /// An address of the packet's family (IPv4: the first word).
    pub addr: dataplane_common::addr::Ip6,
    /// Network order.
    pub port: u16,
    /// [`forward`].
    pub what: u8,
    pub _pad: u8,
}

pub mod forward {
    /// Nothing to rewrite (a flow kept unmasqueraded).
    pub const NONE: u8 = 0;
    /// The source becomes `addr:port` (a reply's frontend).
    pub const SRC: u8 = 1;
    /// The source becomes `addr:port`, the node's SNAT address and port,
    /// once the port's `REP_IN` is checked to still name this client.
    pub const SNAT: u8 = 2;
    /// Encapsulate towards `addr` (DSR).
    pub const ENCAP: u8 = 3;
}

/// The forwarding benchmark's configuration (see `bench`).
#[map(name = "DP_BENCH_V1")]
pub static BENCH: Array<dataplane_common::bench::BenchConfig> = Array::with_max_entries(1, 0);

#[map(name = "DP_FORWARD_SCRATCH")]
pub static FORWARD: PerCpuArray<Forward> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU scratch space where new flows' conntrack keys and entries are
/// built (IPv6's are 40 and 56 bytes: on the 512-byte stack they would not
/// fit beside the rest of the path). Only packet programs use it; they never
/// nest on a CPU (softirq, or process context with bottom halves off).
#[repr(C)]
pub struct CtScratch<A> {
    pub key: CtKey<A>,
    pub a: CtEntry<A>,
    pub b: CtEntry<A>,
    /// The SNAT port search's first port held for TIME_WAIT (host order;
    /// 0: none), here rather than in a register: the verifier does not
    /// follow map memory, so it does not explore the search once per value.
    pub spare: u32,
}

#[map(name = "DP_CT_SCRATCH4")]
pub static CT_SCRATCH4: PerCpuArray<CtScratch<u32>> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "DP_CT_SCRATCH6")]
pub static CT_SCRATCH6: PerCpuArray<CtScratch<dataplane_common::addr::Ip6>> =
    PerCpuArray::with_max_entries(1, 0);

/// This CPU's copy of the conntrack entry `ct::peek` read, from either
/// conntrack table: its callers see one kind of pointer (off the stack,
/// which the SNAT port search's frames fill).
#[map(name = "DP_CT_PEEK4")]
pub static CT_PEEK4: PerCpuArray<CtEntry<u32>> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "DP_CT_PEEK6")]
pub static CT_PEEK6: PerCpuArray<CtEntry<dataplane_common::addr::Ip6>> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's space for building an ICMP reject (`icmp::reject`), off the
/// BPF stack: the entry point's frame and the builder's add up.
#[map(name = "DP_REJECT_SCRATCH")]
pub static REJECT_SCRATCH: PerCpuArray<[u32; 32]> = PerCpuArray::with_max_entries(1, 0);
