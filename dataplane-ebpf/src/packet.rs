//! Header parsing shared by the XDP and TC programs (direct packet access).
//!
//! Every read is bounds-checked against `data_end`; anything that does not
//! parse cleanly is reported as such and never translated.

use core::mem::size_of;

use aya_ebpf::programs::{TcContext, XdpContext};
use dataplane_common::{ct::Ct4Key, proto};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
/// IPv4 "more fragments" flag and fragment offset, in host order.
const IP_MF: u16 = 0x2000;
const IP_OFFSET: u16 = 0x1fff;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_RST: u8 = 0x04;

/// Offsets (from the frame start) of fields we read and rewrite.
pub mod ip {
    pub const TOT_LEN: usize = 2;
    pub const FRAG_OFF: usize = 6;
    pub const TTL: usize = 8;
    pub const PROTO: usize = 9;
    pub const CHECK: usize = 10;
    pub const SADDR: usize = 12;
    pub const DADDR: usize = 16;
    pub const HLEN: usize = 20;
}

/// Packet memory of either program type.
pub trait PacketCtx {
    /// Start and end of the directly readable bytes.
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
    /// The whole packet's length. For an skb it can exceed the directly
    /// readable (linear) part: the payload may sit in fragments.
    fn packet_len(&self) -> usize;
}

impl PacketCtx for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }
    #[inline(always)]
    fn packet_len(&self) -> usize {
        XdpContext::data_end(self) - XdpContext::data(self)
    }
}

impl PacketCtx for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }
    #[inline(always)]
    fn packet_len(&self) -> usize {
        self.len() as usize
    }
}

/// Pointer to a `T` at `offset`, if the whole `T` lies inside the packet.
#[inline(always)]
pub fn ptr_at<C: PacketCtx, T>(ctx: &C, offset: usize) -> Option<*mut T> {
    let start = ctx.data();
    if start + offset + size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some((start + offset) as *mut T)
}

#[inline(always)]
pub fn load<C: PacketCtx, T: Copy>(ctx: &C, offset: usize) -> Option<T> {
    // SAFETY: bounds checked by ptr_at; headers are not aligned in general.
    ptr_at::<C, T>(ctx, offset).map(|p| unsafe { p.read_unaligned() })
}

#[inline(always)]
pub fn store<C: PacketCtx, T: Copy>(ctx: &C, offset: usize, value: T) -> Option<()> {
    // SAFETY: bounds checked by ptr_at.
    ptr_at::<C, T>(ctx, offset).map(|p| unsafe { p.write_unaligned(value) })
}

/// An IPv4 packet whose L4 header (TCP, UDP or the first 8 bytes of ICMP) is
/// inside the buffer. Offsets are from the frame start.
#[derive(Clone, Copy)]
pub struct Ipv4 {
    pub l3: usize,
    pub l4: usize,
    /// saddr, daddr, ports (ICMP: 0), proto; as they lie in the packet.
    pub tuple: Ct4Key,
    /// TCP flags byte (0 for other protocols).
    pub tcp_flags: u8,
    /// IP total length (host order).
    pub tot_len: u16,
}

impl Ipv4 {
    /// Offset of the L4 checksum field, for the protocols we rewrite.
    #[inline(always)]
    pub fn l4_check(&self) -> usize {
        if self.tuple.proto == proto::TCP {
            self.l4 + 16
        } else {
            self.l4 + 6
        }
    }
}

pub enum Parsed {
    Ipv4(Ipv4),
    /// Not IPv4 (ARP, IPv6, ...): not ours.
    Other,
    /// A fragment: its L4 header is absent or alone; never translated.
    Fragment,
    /// A header that does not parse: never translated.
    Malformed,
}

/// Length of the L2 header (Ethernet plus up to two VLAN tags) and the inner
/// ethertype, host order.
#[inline(always)]
fn l2<C: PacketCtx>(ctx: &C) -> Option<(usize, u16)> {
    let mut off = ETH_HLEN;
    let mut ethertype = u16::from_be(load::<C, u16>(ctx, 12)?);
    // Two tags at most (802.1ad + 802.1Q); unrolled for the verifier.
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        ethertype = u16::from_be(load::<C, u16>(ctx, off + 2)?);
        off += 4;
        if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
            ethertype = u16::from_be(load::<C, u16>(ctx, off + 2)?);
            off += 4;
        }
    }
    Some((off, ethertype))
}

#[inline(always)]
pub fn parse<C: PacketCtx>(ctx: &C) -> Parsed {
    let Some((l3, ethertype)) = l2(ctx) else {
        return Parsed::Malformed;
    };
    if ethertype != ETH_P_IP {
        return Parsed::Other;
    }
    let Some(ver_ihl) = load::<C, u8>(ctx, l3) else {
        return Parsed::Malformed;
    };
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < ip::HLEN || ptr_at::<C, [u8; ip::HLEN]>(ctx, l3).is_none() {
        return Parsed::Malformed;
    }
    let (Some(tot_len), Some(frag), Some(proto), Some(saddr), Some(daddr)) = (
        load::<C, u16>(ctx, l3 + ip::TOT_LEN),
        load::<C, u16>(ctx, l3 + ip::FRAG_OFF),
        load::<C, u8>(ctx, l3 + ip::PROTO),
        load::<C, u32>(ctx, l3 + ip::SADDR),
        load::<C, u32>(ctx, l3 + ip::DADDR),
    ) else {
        return Parsed::Malformed;
    };
    let tot_len = u16::from_be(tot_len);
    // Truncated: the IP header claims more than the frame holds.
    if (tot_len as usize) < ihl || l3 + tot_len as usize > ctx.packet_len() {
        return Parsed::Malformed;
    }
    if u16::from_be(frag) & (IP_MF | IP_OFFSET) != 0 {
        return Parsed::Fragment;
    }
    let l4 = l3 + ihl;
    let mut tuple = Ct4Key {
        saddr,
        daddr,
        sport: 0,
        dport: 0,
        proto,
        _pad: [0; 3],
    };
    let mut tcp_flags = 0;
    let l4_len = (tot_len as usize) - ihl;
    match proto {
        proto::TCP => {
            let (Some(ports), Some(doff), Some(flags)) = (
                load::<C, [u16; 2]>(ctx, l4),
                load::<C, u8>(ctx, l4 + 12),
                load::<C, u8>(ctx, l4 + 13),
            ) else {
                return Parsed::Malformed;
            };
            if l4_len < 20 || ((doff >> 4) as usize) < 5 || ptr_at::<C, [u8; 20]>(ctx, l4).is_none() {
                return Parsed::Malformed;
            }
            (tuple.sport, tuple.dport, tcp_flags) = (ports[0], ports[1], flags);
        }
        proto::UDP | proto::SCTP => {
            let Some(ports) = load::<C, [u16; 2]>(ctx, l4) else {
                return Parsed::Malformed;
            };
            if l4_len < 8 || ptr_at::<C, [u8; 8]>(ctx, l4).is_none() {
                return Parsed::Malformed;
            }
            (tuple.sport, tuple.dport) = (ports[0], ports[1]);
        }
        proto::ICMP if l4_len < 8 || ptr_at::<C, [u8; 8]>(ctx, l4).is_none() => {
            return Parsed::Malformed;
        }
        _ => {}
    }
    Parsed::Ipv4(Ipv4 {
        l3,
        l4,
        tuple,
        tcp_flags,
        tot_len,
    })
}
