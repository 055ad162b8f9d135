//! Every map of the datapath. Sizes are defaults; the agent may resize at
//! load time. Only per-CPU and LRU maps are written from the kernel.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use dataplane_common::{
    config::DpConfig,
    ct::{Ct4Entry, Ct4Key, Sock4RevKey, Sock4RevValue},
    lb4::{
        Lb4AffinityKey, Lb4AffinityValue, Lb4Backend, Lb4Service, Lb4ServiceKey, Lb4ServiceName,
        Lb4SourceRangeData,
    },
    limits,
    stats::{COUNTER_SLOTS, Counter},
};

#[map(name = "DP_CONFIG_V1")]
pub static CONFIG: Array<DpConfig> = Array::with_max_entries(1, 0);

#[map(name = "LB4_SERVICES_V1")]
pub static SERVICES: HashMap<Lb4ServiceKey, Lb4Service> =
    HashMap::with_max_entries(limits::MAX_SERVICE_ENTRIES, 0);

/// Indexed by backend id; id 0 and entries without `ACTIVE` are unused.
#[map(name = "LB4_BACKENDS_V1")]
pub static BACKENDS: Array<Lb4Backend> = Array::with_max_entries(limits::MAX_BACKENDS, 0);

#[map(name = "LB4_AFFINITY_V1")]
pub static AFFINITY: LruHashMap<Lb4AffinityKey, Lb4AffinityValue> =
    LruHashMap::with_max_entries(limits::AFFINITY_ENTRIES, 0);

#[map(name = "LB4_SOURCE_RANGES_V1")]
pub static SOURCE_RANGES: LpmTrie<Lb4SourceRangeData, u8> =
    LpmTrie::with_max_entries(limits::SOURCE_RANGE_ENTRIES, 0);

#[map(name = "CT4_V1")]
pub static CT4: LruHashMap<Ct4Key, Ct4Entry> =
    LruHashMap::with_max_entries(limits::CT_ENTRIES, aya_ebpf::bindings::BPF_F_NO_COMMON_LRU);

#[map(name = "DP_COUNTERS_V1")]
pub static COUNTERS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// Indexed by service id.
#[map(name = "LB4_SERVICE_STATS_V1")]
pub static SERVICE_STATS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(limits::MAX_SERVICES, 0);

/// Service id → its Kubernetes name. Only the agent (and `inspect`) use it;
/// it lives in the object so that it is created and pinned with the rest.
#[map(name = "LB4_SERVICE_NAMES_V1")]
pub static SERVICE_NAMES: HashMap<u32, Lb4ServiceName> =
    HashMap::with_max_entries(limits::MAX_SERVICES, aya_ebpf::bindings::BPF_F_NO_PREALLOC);

/// Connect-time translations: socket cookie + backend → Service address.
#[map(name = "SOCK4_REVNAT_V1")]
pub static SOCK_REVNAT: LruHashMap<Sock4RevKey, Sock4RevValue> =
    LruHashMap::with_max_entries(limits::SOCK_REVNAT_ENTRIES, 0);
