//! Address families: the one packet path runs for IPv4 and IPv6 through
//! this trait, which names each family's maps, header offsets and config.
//! Everything else (conntrack, SNAT, the new-flow decision, rewrites) is
//! written once, generic over [`Family`].

use aya_ebpf::maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray};
use dataplane_common::{
    addr::{Addr, Ip6},
    config::DpConfig,
    ct::{CtEntry, CtKey, SnatClosed},
    lb::{
        AffinityKey, DsrKey, DsrValue, LbAffinityValue, LbBackend, LbService, LbServiceKey, SourceRangeData,
    },
    proto,
};

use crate::{
    ctx::Ctx,
    hdr::Pkt,
    maps::{
        AFFINITY, AFFINITY6, BACKENDS, BACKENDS6, CT_PEEK4, CT_PEEK6, CT_SCRATCH4, CT_SCRATCH6, CT4,
        CT4_ASSURED, CT6, CT6_ASSURED, CtScratch, DSR4, DSR6, SERVICES, SERVICES6, SNAT4_CLOSED,
        SNAT6_CLOSED, SOURCE_RANGES, SOURCE_RANGES6,
    },
    parse::{Parsed, parse4, parse6},
};

pub trait Family: 'static {
    type A: Addr;
    /// Offsets of the addresses in the IP header, and of the (first) next
    /// protocol.
    const SADDR: usize;
    const DADDR: usize;
    const PROTO: usize;
    /// The fixed IP header, whose size bounds the reads at those offsets.
    type Hdr;
    /// Whether the IP header carries a checksum (IPv4) or only the L4
    /// pseudo-header covers the addresses (IPv6).
    const IP_CHECKSUM: bool;
    /// ICMP's protocol number in this family.
    const ICMP: u8;
    /// The protocol number of this family's packets carried in an outer
    /// header of the same family (DSR): IPIP (4), IPv6-in-IPv6 (41).
    const ENCAP: u8;

    /// Parses the packet whose IP header of this family starts at `l3`;
    /// anything but a packet we may translate comes back as `Err`.
    fn parse<C: Ctx>(ctx: &C, l3: usize) -> Result<Pkt<Self::A>, Parsed>;

    /// Conntrack (LRU).
    fn ct() -> &'static LruHashMap<CtKey<Self::A>, CtEntry<Self::A>>;
    /// Copies of assured flows' entries (never evicts).
    fn ct_assured() -> &'static HashMap<CtKey<Self::A>, CtEntry<Self::A>>;
    /// Masqueraded TCP flows their backend closed first, by `REP_IN` key
    /// (LRU).
    fn snat_closed() -> &'static LruHashMap<CtKey<Self::A>, SnatClosed>;
    fn ct_scratch() -> &'static PerCpuArray<CtScratch<Self::A>>;
    fn ct_peek() -> &'static PerCpuArray<CtEntry<Self::A>>;
    fn services() -> &'static HashMap<LbServiceKey<Self::A>, LbService>;
    fn backends() -> &'static Array<LbBackend<Self::A>>;
    fn affinity() -> &'static LruHashMap<AffinityKey<Self::A>, LbAffinityValue>;
    fn source_ranges() -> &'static LpmTrie<SourceRangeData<Self::A>, u8>;
    fn dsr() -> &'static HashMap<DsrKey<Self::A>, DsrValue>;

    /// The node's SNAT address in this family (zero: none).
    fn snat_ip(cfg: &DpConfig) -> Self::A;
    /// `a` is in the cluster CIDR ("local traffic").
    fn in_cluster(cfg: &DpConfig, a: &Self::A) -> bool;
    fn cluster_cidr_set(cfg: &DpConfig) -> bool;
    fn in_service_cidr(cfg: &DpConfig, a: &Self::A) -> bool;
    /// `a` is a loopback address (127.0.0.0/8, ::1): only the node's own
    /// sockets may use one as a Service address (`--localhost-nodeports`).
    fn is_loopback(a: &Self::A) -> bool;
}

pub struct V4;
pub struct V6;

impl Family for V4 {
    type A = u32;
    const SADDR: usize = crate::hdr::ip::SADDR;
    const DADDR: usize = crate::hdr::ip::DADDR;
    const PROTO: usize = crate::hdr::ip::PROTO;
    type Hdr = network_types::ip::Ipv4Hdr;
    const IP_CHECKSUM: bool = true;
    const ICMP: u8 = proto::ICMP;
    const ENCAP: u8 = proto::IPIP;

    #[inline(always)]
    fn parse<C: Ctx>(ctx: &C, l3: usize) -> Result<Pkt<u32>, Parsed> {
        match parse4(ctx, l3) {
            Parsed::V4(p) => Ok(p),
            other => Err(other),
        }
    }
    #[inline(always)]
    fn ct() -> &'static LruHashMap<CtKey<u32>, CtEntry<u32>> {
        &CT4
    }
    #[inline(always)]
    fn ct_assured() -> &'static HashMap<CtKey<u32>, CtEntry<u32>> {
        &CT4_ASSURED
    }
    #[inline(always)]
    fn snat_closed() -> &'static LruHashMap<CtKey<u32>, SnatClosed> {
        &SNAT4_CLOSED
    }
    #[inline(always)]
    fn ct_scratch() -> &'static PerCpuArray<CtScratch<u32>> {
        &CT_SCRATCH4
    }
    #[inline(always)]
    fn ct_peek() -> &'static PerCpuArray<CtEntry<u32>> {
        &CT_PEEK4
    }
    #[inline(always)]
    fn services() -> &'static HashMap<LbServiceKey<u32>, LbService> {
        &SERVICES
    }
    #[inline(always)]
    fn backends() -> &'static Array<LbBackend<u32>> {
        &BACKENDS
    }
    #[inline(always)]
    fn affinity() -> &'static LruHashMap<AffinityKey<u32>, LbAffinityValue> {
        &AFFINITY
    }
    #[inline(always)]
    fn source_ranges() -> &'static LpmTrie<SourceRangeData<u32>, u8> {
        &SOURCE_RANGES
    }
    #[inline(always)]
    fn dsr() -> &'static HashMap<DsrKey<u32>, DsrValue> {
        &DSR4
    }
    #[inline(always)]
    fn snat_ip(cfg: &DpConfig) -> u32 {
        cfg.snat_ip
    }
    #[inline(always)]
    fn in_cluster(cfg: &DpConfig, a: &u32) -> bool {
        cfg.cluster_cidr.contains(*a)
    }
    #[inline(always)]
    fn cluster_cidr_set(cfg: &DpConfig) -> bool {
        cfg.cluster_cidr.is_set()
    }
    #[inline(always)]
    fn in_service_cidr(cfg: &DpConfig, a: &u32) -> bool {
        cfg.in_service_cidr(*a)
    }
    #[inline(always)]
    fn is_loopback(a: &u32) -> bool {
        // Network order: the first octet is the lowest-addressed byte.
        u32::from_be(*a) >> 24 == 127
    }
}

impl Family for V6 {
    type A = Ip6;
    const SADDR: usize = crate::hdr::ip6::SADDR;
    const DADDR: usize = crate::hdr::ip6::DADDR;
    const PROTO: usize = crate::hdr::ip6::NEXT_HDR;
    type Hdr = network_types::ip::Ipv6Hdr;
    const IP_CHECKSUM: bool = false;
    const ICMP: u8 = proto::ICMPV6;
    const ENCAP: u8 = proto::IPV6_IN_IP;

    #[inline(always)]
    fn parse<C: Ctx>(ctx: &C, l3: usize) -> Result<Pkt<Ip6>, Parsed> {
        match parse6(ctx, l3) {
            Parsed::V6(p) => Ok(p),
            other => Err(other),
        }
    }
    #[inline(always)]
    fn ct() -> &'static LruHashMap<CtKey<Ip6>, CtEntry<Ip6>> {
        &CT6
    }
    #[inline(always)]
    fn ct_assured() -> &'static HashMap<CtKey<Ip6>, CtEntry<Ip6>> {
        &CT6_ASSURED
    }
    #[inline(always)]
    fn snat_closed() -> &'static LruHashMap<CtKey<Ip6>, SnatClosed> {
        &SNAT6_CLOSED
    }
    #[inline(always)]
    fn ct_scratch() -> &'static PerCpuArray<CtScratch<Ip6>> {
        &CT_SCRATCH6
    }
    #[inline(always)]
    fn ct_peek() -> &'static PerCpuArray<CtEntry<Ip6>> {
        &CT_PEEK6
    }
    #[inline(always)]
    fn services() -> &'static HashMap<LbServiceKey<Ip6>, LbService> {
        &SERVICES6
    }
    #[inline(always)]
    fn backends() -> &'static Array<LbBackend<Ip6>> {
        &BACKENDS6
    }
    #[inline(always)]
    fn affinity() -> &'static LruHashMap<AffinityKey<Ip6>, LbAffinityValue> {
        &AFFINITY6
    }
    #[inline(always)]
    fn source_ranges() -> &'static LpmTrie<SourceRangeData<Ip6>, u8> {
        &SOURCE_RANGES6
    }
    #[inline(always)]
    fn dsr() -> &'static HashMap<DsrKey<Ip6>, DsrValue> {
        &DSR6
    }
    #[inline(always)]
    fn snat_ip(cfg: &DpConfig) -> Ip6 {
        cfg.snat_ip6
    }
    #[inline(always)]
    fn in_cluster(cfg: &DpConfig, a: &Ip6) -> bool {
        cfg.cluster_cidr6.contains(a)
    }
    #[inline(always)]
    fn cluster_cidr_set(cfg: &DpConfig) -> bool {
        cfg.cluster_cidr6.is_set()
    }
    #[inline(always)]
    fn in_service_cidr(cfg: &DpConfig, a: &Ip6) -> bool {
        cfg.in_service_cidr6(a)
    }
    #[inline(always)]
    fn is_loopback(a: &Ip6) -> bool {
        a[0] == 0 && a[1] == 0 && a[2] == 0 && u32::from_be(a[3]) == 1
    }
}
