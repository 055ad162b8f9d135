//! The ABI between the kernel programs (`dataplane-ebpf`) and the agent.
//!
//! Everything here is `#[repr(C)]`, has explicit padding, and has its size
//! asserted at compile time: a layout change must be a deliberate, versioned
//! change (new map name suffix), never a silent reinterpretation of a pinned
//! map. Addresses and ports inside map keys and values are in network byte
//! order (stored as the raw `u32`/`u16` read from the packet); the agent
//! converts once when it writes. Slots, ids, counts, flags and timestamps are
//! in host order.
#![no_std]

pub mod addr;
pub mod bench;
pub mod config;
pub mod ct;
pub mod filter;
pub mod hint;
pub mod lb;
pub mod maglev;
pub mod monitor;
pub mod sctp;
pub mod stats;

/// The IPv4 names of [`lb`] (`Lb4ServiceKey`, ...), where they always were.
pub use lb as lb4;

/// Names of the maps and programs, as they appear in the object file and
/// under the pin directory. The `_V<n>` suffix is bumped on layout changes.
pub mod names {
    pub const LB4_SERVICES: &str = "LB4_SERVICES_V1";
    pub const LB4_BACKENDS: &str = "LB4_BACKENDS_V1";
    pub const LB4_AFFINITY: &str = "LB4_AFFINITY_V1";
    pub const LB4_SOURCE_RANGES: &str = "LB4_SOURCE_RANGES_V1";
    /// Conntrack (LRU: a flood of new flows evicts from it).
    pub const CT4: &str = "CT4_V2";
    /// Copies of assured flows' conntrack entries, restored into `CT4` when
    /// it evicted them (a hash map that never evicts; the agent collects
    /// its expired copies): see [`crate::ct::assured`].
    pub const CT4_ASSURED: &str = "CT4_ASSURED_V1";
    pub const CONFIG: &str = "DP_CONFIG_V4";
    /// Bitmaps of the addresses the hooks act on ([`crate::filter`]).
    pub const ADDR_FILTER: &str = "DP_ADDR_FILTER_V2";
    /// Bitmap of the devices whose ingress word egress may trust
    /// ([`crate::hint::device_slot`]).
    pub const HINT_DEVICES: &str = "DP_HINT_DEVICES_V1";
    /// Per-CPU SNAT port search state per backend id
    /// ([`crate::ct::SnatCursor`]: where the fallback search resumes, and
    /// until when a backend found exhausted is not searched again).
    pub const SNAT_CURSORS: &str = "DP_SNAT_CURSORS_V2";
    /// SNAT tuples whose TCP flow the backend closed first, and when
    /// ([`crate::ct::SnatClosed`]): the backend holds such a tuple in
    /// TIME_WAIT, so the port is not given to another client for a while,
    /// even after conntrack evicted the flow (an LRU).
    pub const SNAT4_CLOSED: &str = "SNAT4_CLOSED_V1";
    /// Per-CPU array of [`crate::stats::Counter`] indexed by
    /// [`crate::stats::FlowStat`]: what new flows needed.
    pub const FLOW_STATS: &str = "DP_FLOW_STATS_V2";
    /// Per-CPU array of [`crate::stats::Counter`] indexed by [`crate::stats::Event`].
    pub const COUNTERS: &str = "DP_COUNTERS_V1";
    /// Per-CPU array of [`crate::stats::Counter`] indexed by service id.
    pub const SERVICE_STATS: &str = "LB4_SERVICE_STATS_V1";

    /// Service id → namespace/name/port (agent-written, kernel-unused).
    pub const LB4_SERVICE_NAMES: &str = "LB4_SERVICE_NAMES_V1";

    /// Socket cookie + backend → Service address (connect-time LB).
    pub const SOCK4_REVNAT: &str = "SOCK4_REVNAT_V1";

    /// Maglev tables ([`crate::lb::MaglevKey`] → a chunk of backend ids),
    /// for both families (tables are per service port).
    pub const LB_MAGLEV: &str = "LB_MAGLEV_V1";
    /// The backend's node of a DSR flow: which local backend an
    /// encapsulated packet is for ([`crate::lb::DsrKey`]).
    pub const LB4_DSR: &str = "LB4_DSR_V1";
    /// Devices XDP may forward translated packets to (`XDP_REDIRECT`), by
    /// ifindex: the external devices that run our XDP natively.
    pub const XDP_DEVICES: &str = "DP_XDP_DEVICES_V1";

    /// IPv6 twins of the maps above.
    pub const LB6_SERVICES: &str = "LB6_SERVICES_V1";
    pub const LB6_BACKENDS: &str = "LB6_BACKENDS_V1";
    pub const LB6_AFFINITY: &str = "LB6_AFFINITY_V1";
    pub const LB6_SOURCE_RANGES: &str = "LB6_SOURCE_RANGES_V1";
    pub const CT6: &str = "CT6_V1";
    pub const CT6_ASSURED: &str = "CT6_ASSURED_V1";
    pub const SNAT6_CLOSED: &str = "SNAT6_CLOSED_V1";
    pub const SOCK6_REVNAT: &str = "SOCK6_REVNAT_V1";
    pub const LB6_DSR: &str = "LB6_DSR_V1";

    /// Live drop and reject events (a ring buffer of
    /// [`crate::monitor::MonitorEvent`]), whether anyone reads them
    /// ([`crate::monitor::MonitorCtl`]) and the per-CPU rate limit
    /// ([`crate::monitor::MonitorRate`]), and each CPU's sampled packet
    /// ([`crate::monitor::MonitorSample`]).
    pub const MONITOR_EVENTS: &str = "DP_MONITOR_EVENTS_V1";
    pub const MONITOR_CTL: &str = "DP_MONITOR_CTL_V1";
    pub const MONITOR_RATE: &str = "DP_MONITOR_RATE_V1";
    pub const MONITOR_SAMPLE: &str = "DP_MONITOR_SAMPLE_V1";

    /// The fewest entries `map` can be created with: one, or for the ring
    /// buffer its own size (a power-of-two number of pages, whatever the
    /// page size).
    pub fn min_entries(map: &str) -> u32 {
        if map == MONITOR_EVENTS {
            crate::monitor::RING_BYTES
        } else {
            1
        }
    }

    /// Every map the agent pins, in the order it creates them.
    pub const ALL_MAPS: [&str; 32] = [
        CONFIG,
        ADDR_FILTER,
        HINT_DEVICES,
        SNAT_CURSORS,
        FLOW_STATS,
        LB4_BACKENDS,
        LB4_SERVICES,
        LB4_AFFINITY,
        LB4_SOURCE_RANGES,
        CT4,
        COUNTERS,
        SERVICE_STATS,
        LB4_SERVICE_NAMES,
        SOCK4_REVNAT,
        LB6_BACKENDS,
        LB6_SERVICES,
        LB6_AFFINITY,
        LB6_SOURCE_RANGES,
        CT6,
        SOCK6_REVNAT,
        LB_MAGLEV,
        LB4_DSR,
        LB6_DSR,
        XDP_DEVICES,
        CT4_ASSURED,
        CT6_ASSURED,
        MONITOR_EVENTS,
        MONITOR_CTL,
        MONITOR_RATE,
        MONITOR_SAMPLE,
        SNAT4_CLOSED,
        SNAT6_CLOSED,
    ];

    /// XDP on the node's external devices: north-south translation.
    pub const XDP_INGRESS: &str = "xdp_ingress";
    /// The same translation in TC ingress, for devices without (fast) XDP:
    /// veth, or `--xdp-mode off`.
    pub const TC_INGRESS: &str = "tc_ingress";
    /// cgroup connect4/sendmsg4/recvmsg4/getpeername4: connect-time
    /// translation for the node's own processes (host-network pods, daemons).
    pub const SOCK_CONNECT4: &str = "sock_connect4";
    pub const SOCK_SENDMSG4: &str = "sock_sendmsg4";
    pub const SOCK_RECVMSG4: &str = "sock_recvmsg4";
    pub const SOCK_GETPEERNAME4: &str = "sock_getpeername4";
    /// The same for IPv6 sockets.
    pub const SOCK_CONNECT6: &str = "sock_connect6";
    pub const SOCK_SENDMSG6: &str = "sock_sendmsg6";
    pub const SOCK_RECVMSG6: &str = "sock_recvmsg6";
    pub const SOCK_GETPEERNAME6: &str = "sock_getpeername6";
    /// Parse and pass: the benchmarks' floor, and a pass-through for veth
    /// peers (which receive XDP_TX frames only when they run XDP).
    pub const XDP_FLOOR: &str = "xdp_floor";
    /// The TC floor of the benchmarks.
    pub const TC_FLOOR: &str = "tc_floor";
    /// Writes CLOCK_MONOTONIC and jiffies into a test run's frame: how the
    /// agent tells the kernel's HZ (`dataplane::clock`).
    pub const XDP_CLOCK: &str = "xdp_clock";
    /// The forwarding benchmark's generator, floor and sink, and their
    /// configuration map (never pinned).
    pub const XDP_BENCH_GEN: &str = "xdp_bench_gen";
    pub const XDP_BENCH_REDIRECT: &str = "xdp_bench_redirect";
    pub const XDP_BENCH_DROP: &str = "xdp_bench_drop";
    pub const BENCH: &str = "DP_BENCH_V1";
    /// TC egress on external devices and pod-facing host interfaces:
    /// source rewrites (SNAT; the frontend address on replies).
    pub const TC_EGRESS: &str = "tc_egress";
    /// TC ingress on pod-facing host interfaces: destination rewrites of
    /// packets from pods (replies of SNATed flows back to the client).
    pub const TC_POD_INGRESS: &str = "tc_pod_ingress";
}

/// IP protocol numbers the datapath handles.
pub mod proto {
    pub const ICMP: u8 = 1;
    pub const ICMPV6: u8 = 58;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const SCTP: u8 = 132;
    /// IPv4 in IPv4 (DSR's encapsulation).
    pub const IPIP: u8 = 4;
    /// IPv6 in IPv6 (DSR's encapsulation).
    pub const IPV6_IN_IP: u8 = 41;
}

/// Default map capacities; the agent may size maps at load time.
pub mod limits {
    /// Service ports (service ids); also the size of the per-service stats.
    pub const MAX_SERVICES: u32 = 65_536;
    /// Backends (endpoint ip:port:proto), ids 1..MAX_BACKENDS.
    pub const MAX_BACKENDS: u32 = 131_072;
    /// Frontend + backend slot entries in the services map.
    pub const MAX_SERVICE_ENTRIES: u32 = 524_288;
    /// Backend slots one frontend may have (larger sets are rejected by the agent).
    pub const MAX_BACKENDS_PER_SERVICE: u16 = 4096;
    pub const CT_ENTRIES: u32 = 262_144;
    pub const AFFINITY_ENTRIES: u32 = 65_536;
    pub const SOURCE_RANGE_ENTRIES: u32 = 16_384;
    /// Connect-time translations remembered for getpeername/recvmsg.
    pub const SOCK_REVNAT_ENTRIES: u32 = 65_536;
    /// Ports tried (after the flow's hashed port) before a new flow is
    /// dropped for want of a SNAT port; after such a drop, new flows to that
    /// backend on that CPU try only their hashed port for
    /// [`SNAT_BACKOFF_MS`] (see `ct::SnatCursor`).
    pub const SNAT_ATTEMPTS: u32 = 8;
    /// How long a CPU spares a backend whose SNAT ports it found all held
    /// the full search, in ms of the datapath clock.
    pub const SNAT_BACKOFF_MS: u32 = 100;
    /// Recently closed SNAT tuples remembered per family (an LRU): at least
    /// the flows a busy node closes in `TCP_TIME_WAIT` (120 s at about 500
    /// masqueraded connections a second).
    pub const SNAT_CLOSED_ENTRIES: u32 = 65_536;
    /// Chunks of Maglev tables (allocated as written): 1024 tables of the
    /// default size (16 chunks each).
    pub const MAGLEV_CHUNKS: u32 = 16_384;
    /// DSR map entries (frontend, local backend) per family.
    pub const DSR_ENTRIES: u32 = 65_536;
    /// Devices XDP may redirect to (ifindexes, hashed).
    pub const XDP_DEVICES: u32 = 64;
}

/// Compile-time layout check: `assert_layout!(Type, size, align)`.
#[macro_export]
macro_rules! assert_layout {
    ($t:ty, $size:expr, $align:expr) => {
        const _: () = {
            assert!(core::mem::size_of::<$t>() == $size);
            assert!(core::mem::align_of::<$t>() == $align);
        };
    };
}

/// `unsafe impl aya::Pod` for the family-generic ABI structs, for both
/// families at once (userspace only): `Addr` is sealed to `u32` and `Ip6`,
/// and every instance's layout is asserted next to its definition.
#[macro_export]
macro_rules! impl_pod_generic {
    ($($t:ident),+ $(,)?) => {
        $(
            #[cfg(feature = "user")]
            // SAFETY: repr(C) with explicit padding for both instances
            // (sizes asserted), every bit pattern valid.
            unsafe impl<A: $crate::addr::Addr + aya::Pod> aya::Pod for $t<A> {}
        )+
    };
}

/// `unsafe impl aya::Pod` for ABI structs (userspace only).
#[macro_export]
macro_rules! impl_pod {
    ($($t:ty),+ $(,)?) => {
        $(
            #[cfg(feature = "user")]
            // SAFETY: repr(C), no padding holes, every bit pattern valid.
            unsafe impl aya::Pod for $t {}
        )+
    };
}
