//! Header parsing shared by every packet program: every read is
//! bounds-checked against the end of the directly readable data, and
//! anything that does not parse cleanly is reported as such and never
//! translated. The layouts it reads are in `hdr`.

use dataplane_common::{addr::Ip6, ct::CtKey, proto};

use crate::{
    ctx::{Ctx, load, ptr_at},
    hdr::{Pkt, eth, ip, ip6, l4},
};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
/// IPv4 "more fragments" flag and fragment offset, host order.
const IP_MF: u16 = 0x2000;
const IP_OFFSET: u16 = 0x1fff;

pub enum Parsed {
    V4(Pkt<u32>),
    V6(Pkt<Ip6>),
    /// Not IP (ARP, ...), or IP we do not translate (IPsec): not ours.
    Other,
    /// A fragment: its L4 header is absent or alone; never translated.
    Fragment,
    /// A header that does not parse: never translated.
    Malformed,
}

/// Length of the L2 header (Ethernet plus up to two VLAN tags) and the inner
/// ethertype, host order.
#[inline(always)]
fn l2<C: Ctx>(ctx: &C) -> Option<(usize, u16)> {
    let mut off = eth::HLEN;
    let mut ethertype = u16::from_be(load::<C, u16>(ctx, eth::ETHERTYPE)?);
    // Two tags at most (802.1ad + 802.1Q); unrolled for the verifier.
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        ethertype = u16::from_be(load::<C, u16>(ctx, off + eth::VLAN_ETHERTYPE)?);
        off += eth::VLAN_HLEN;
        if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
            ethertype = u16::from_be(load::<C, u16>(ctx, off + eth::VLAN_ETHERTYPE)?);
            off += eth::VLAN_HLEN;
        }
    }
    Some((off, ethertype))
}

#[inline(always)]
pub fn parse<C: Ctx>(ctx: &C) -> Parsed {
    let Some((l3, ethertype)) = l2(ctx) else {
        return Parsed::Malformed;
    };
    match ethertype {
        ETH_P_IP => parse4(ctx, l3),
        ETH_P_IPV6 => parse6(ctx, l3),
        _ => Parsed::Other,
    }
}

/// Which family a frame carries, and where its IP header starts: what the
/// paths dispatch on before parsing (each family's parse and path is a
/// subprogram of its own).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    V4(usize),
    V6(usize),
    Other,
    Malformed,
}

#[inline(always)]
pub fn kind<C: Ctx>(ctx: &C) -> Kind {
    match l2(ctx) {
        Some((l3, ETH_P_IP)) => Kind::V4(l3),
        Some((l3, ETH_P_IPV6)) => Kind::V6(l3),
        Some(_) => Kind::Other,
        None => Kind::Malformed,
    }
}

#[inline(always)]
pub fn parse4<C: Ctx>(ctx: &C, l3: usize) -> Parsed {
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
    match l4_header(ctx, proto, proto::ICMP, l4, (tot_len as usize) - ihl) {
        Some((sport, dport, tcp_flags)) => Parsed::V4(Pkt {
            l3,
            l4,
            tuple: CtKey::new(saddr, daddr, sport, dport, proto),
            tcp_flags,
            tot_len,
        }),
        None => Parsed::Malformed,
    }
}

/// IPv6, its extension headers followed (a bounded number: a packet whose
/// L4 header we cannot reach is passed untouched, never translated).
#[inline(always)]
pub fn parse6<C: Ctx>(ctx: &C, l3: usize) -> Parsed {
    if ptr_at::<C, [u8; ip6::HLEN]>(ctx, l3).is_none() {
        return Parsed::Malformed;
    }
    let (Some(vtc), Some(payload_len), Some(next), Some(saddr), Some(daddr)) = (
        load::<C, u8>(ctx, l3),
        load::<C, u16>(ctx, l3 + ip6::PAYLOAD_LEN),
        load::<C, u8>(ctx, l3 + ip6::NEXT_HDR),
        load::<C, Ip6>(ctx, l3 + ip6::SADDR),
        load::<C, Ip6>(ctx, l3 + ip6::DADDR),
    ) else {
        return Parsed::Malformed;
    };
    let payload_len = u16::from_be(payload_len) as usize;
    // A jumbogram (payload length 0) or a truncated packet: not ours.
    if vtc >> 4 != 6 || payload_len == 0 || l3 + ip6::HLEN + payload_len > ctx.packet_len() {
        return Parsed::Malformed;
    }
    let end = l3 + ip6::HLEN + payload_len;
    let mut proto = next;
    let mut off = l3 + ip6::HLEN;
    let mut i = 0;
    while i < ip6::MAX_EXT {
        match proto {
            ip6::HOPOPTS | ip6::ROUTING | ip6::DSTOPTS => {
                let Some([nh, len]) = load::<C, [u8; 2]>(ctx, off) else {
                    return Parsed::Malformed;
                };
                proto = nh;
                off += (len as usize + 1) * 8;
                if off > ip6::MAX_L4 {
                    return Parsed::Other;
                }
            }
            ip6::FRAGMENT => return Parsed::Fragment,
            _ => break,
        }
        i += 1;
    }
    match proto {
        // Still an extension header, IPsec (rewriting would break it), or
        // nothing at all: not ours.
        ip6::HOPOPTS | ip6::ROUTING | ip6::DSTOPTS | ip6::FRAGMENT | ip6::ESP | ip6::AUTH | ip6::NONE => {
            return Parsed::Other;
        }
        _ => {}
    }
    if off > end {
        return Parsed::Malformed;
    }
    // The verifier needs the offset bounded (checked above).
    let l4 = off & 0xff;
    match l4_header(ctx, proto, proto::ICMPV6, l4, end - off) {
        Some((sport, dport, tcp_flags)) => Parsed::V6(Pkt {
            l3,
            l4,
            tuple: CtKey::new(saddr, daddr, sport, dport, proto),
            tcp_flags,
            tot_len: (ip6::HLEN + payload_len) as u16,
        }),
        None => Parsed::Malformed,
    }
}

/// Ports and TCP flags of the L4 header at `l4` (`l4_len` bytes of L4
/// header and payload), checked to be whole; zeros for ICMP and other
/// protocols. `None`: truncated.
#[inline(always)]
fn l4_header<C: Ctx>(ctx: &C, proto: u8, icmp: u8, l4: usize, l4_len: usize) -> Option<(u16, u16, u8)> {
    match proto {
        proto::TCP => {
            let (ports, doff, flags) = (
                load::<C, [u16; 2]>(ctx, l4 + l4::SPORT)?,
                load::<C, u8>(ctx, l4 + l4::TCP_DOFF)?,
                load::<C, u8>(ctx, l4 + l4::TCP_FLAGS)?,
            );
            if l4_len < l4::TCP_HLEN
                || ((doff >> 4) as usize) * 4 < l4::TCP_HLEN
                || ptr_at::<C, [u8; l4::TCP_HLEN]>(ctx, l4).is_none()
            {
                return None;
            }
            Some((ports[0], ports[1], flags))
        }
        proto::UDP => {
            let ports = load::<C, [u16; 2]>(ctx, l4 + l4::SPORT)?;
            if l4_len < l4::UDP_HLEN || ptr_at::<C, [u8; l4::UDP_HLEN]>(ctx, l4).is_none() {
                return None;
            }
            Some((ports[0], ports[1], 0))
        }
        proto::SCTP => {
            let ports = load::<C, [u16; 2]>(ctx, l4 + l4::SPORT)?;
            if l4_len < l4::SCTP_HLEN || ptr_at::<C, [u8; l4::SCTP_HLEN]>(ctx, l4).is_none() {
                return None;
            }
            Some((ports[0], ports[1], 0))
        }
        p if p == icmp => {
            if l4_len < l4::ICMP_HLEN || ptr_at::<C, [u8; l4::ICMP_HLEN]>(ctx, l4).is_none() {
                return None;
            }
            Some((0, 0, 0))
        }
        _ => Some((0, 0, 0)),
    }
}
