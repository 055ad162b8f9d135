//! ICMP and ICMPv6, for every hook through [`Ctx`]: the port-unreachable
//! reject, and errors about translated flows rewritten so that they reach the
//! endpoint whose packet they are about, quoting that packet as it was sent.

use dataplane_common::{
    addr::Addr,
    config::DpConfig,
    ct::{CtEntry, CtKey, ct_flags},
    proto,
    stats::Event,
};

use crate::{
    csum, ct,
    ctx::{Ctx, load},
    family::Family,
    hdr::{ip, ip6, l4},
    maps::REJECT_SCRATCH,
};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;
const ICMP6_DST_UNREACH: u8 = 1;
const ICMP6_PORT_UNREACH: u8 = 4;
const ICMP6_PACKET_TOO_BIG: u8 = 2;
const ICMP6_TIME_EXCEEDED: u8 = 3;
const ICMP6_PARAM_PROB: u8 = 4;
/// What an ICMP error quotes at least: the IP header (no options) and 8
/// bytes of L4.
const QUOTE: usize = ip::HLEN + 8;
/// IP header + ICMP header + quote.
const REJECT_LEN: usize = ip::HLEN + l4::ICMP_HLEN + QUOTE;
/// IPv6: the quote (header and 8 bytes), and the whole reject.
const QUOTE6: usize = ip6::HLEN + 8;
const REJECT6_LEN: usize = ip6::HLEN + l4::ICMP_HLEN + QUOTE6;

/// Internet checksum of `bytes` (even length), starting from `sum`.
#[inline(always)]
fn checksum(sum: u32, bytes: &[u8]) -> u16 {
    let mut sum = sum;
    let mut i = 0;
    while i + 1 < bytes.len() {
        sum += u16::from_ne_bytes([bytes[i], bytes[i + 1]]) as u32;
        i += 2;
    }
    !csum::fold(sum)
}

/// Turns the packet into an ICMP error from the destination it tried back
/// to its source, and sends it out of the device it came in on: with `mtu`
/// 0 a port-unreachable, else "fragmentation needed" (ICMPv6: "packet too
/// big") naming `mtu`. IPv4: only packets whose header has no options are
/// answered; others are dropped (counted).
#[inline(always)]
pub fn reject<C: Ctx>(ctx: &C, v6: bool, l3: usize, l4: usize, mtu: u32) -> (C::Verdict, Event) {
    // The ICMP header's first two bytes and its second word (as it lies
    // in the packet), in one register: BPF functions take five arguments.
    let sent = if v6 {
        let header = if mtu == 0 {
            icmp_header(ICMP6_DST_UNREACH, ICMP6_PORT_UNREACH, 0)
        } else {
            icmp_header(ICMP6_PACKET_TOO_BIG, 0, mtu.to_be())
        };
        build_reject6(ctx, l3, header)
    } else {
        let header = if mtu == 0 {
            icmp_header(ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, 0)
        } else {
            // The next-hop MTU is the header's last 16 bits.
            icmp_header(ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, ((mtu as u16) as u32).to_be())
        };
        build_reject4(ctx, l3, l4, header)
    };
    match sent {
        Some(v) => (v, Event::Pass),
        None => (C::DROP, Event::DropRejectFailed),
    }
}

/// Type, code and the header's second word (as it lies in the packet).
#[inline(always)]
fn icmp_header(icmp_type: u8, code: u8, rest: u32) -> u64 {
    icmp_type as u64 | (code as u64) << 8 | (rest as u64) << 32
}

/// Writes [`icmp_header`]'s fields at `f[at..at + 8]` (checksum zero).
#[inline(always)]
fn put_header(f: &mut [u8], at: usize, header: u64) {
    f[at] = header as u8;
    f[at + 1] = (header >> 8) as u8;
    f[at + 4..at + 8].copy_from_slice(&((header >> 32) as u32).to_ne_bytes());
}

/// This CPU's reject scratch space as an `N`-byte frame, zeroed.
#[inline(always)]
fn frame<const N: usize>() -> Option<&'static mut [u8; N]> {
    const { assert!(N <= 128 && N.is_multiple_of(4)) };
    let words = REJECT_SCRATCH.get_ptr_mut(0)? as *mut u32;
    let mut i = 0;
    while i < N / 4 {
        // SAFETY: within this CPU's 128-byte slot; packet programs never
        // nest on a CPU, so nothing else uses it during this run.
        unsafe { words.add(i).write_volatile(0) };
        i += 1;
    }
    // SAFETY: as above; `N` bytes, all written.
    Some(unsafe { &mut *(words as *mut [u8; N]) })
}

#[inline(never)]
fn build_reject4<C: Ctx>(ctx: &C, l3: usize, l4: usize, header: u64) -> Option<C::Verdict> {
    if l4 != l3 + ip::HLEN {
        return None;
    }
    let quote: [u8; QUOTE] = load(ctx, l3)?;
    let f = frame::<REJECT_LEN>()?;
    f[0] = 0x45;
    f[1] = 0xc0; // internetwork control, as Linux sends ICMP errors
    f[ip::TOT_LEN..ip::TOT_LEN + 2].copy_from_slice(&(REJECT_LEN as u16).to_be_bytes());
    f[ip::TTL] = 64;
    f[ip::PROTO] = proto::ICMP;
    // From the address the client tried, to the client.
    f[ip::SADDR..ip::SADDR + 4].copy_from_slice(&quote[ip::DADDR..ip::DADDR + 4]);
    f[ip::DADDR..ip::DADDR + 4].copy_from_slice(&quote[ip::SADDR..ip::SADDR + 4]);
    let c = checksum(0, &f[..ip::HLEN]);
    f[ip::CHECK..ip::CHECK + 2].copy_from_slice(&c.to_ne_bytes());
    put_header(f, ip::HLEN, header);
    f[ip::HLEN + l4::ICMP_HLEN..].copy_from_slice(&quote);
    let c = checksum(0, &f[ip::HLEN..]);
    f[ip::HLEN + l4::ICMP_CHECK..ip::HLEN + l4::ICMP_CHECK + 2].copy_from_slice(&c.to_ne_bytes());
    ctx.send_back(l3, f)
}

#[inline(never)]
fn build_reject6<C: Ctx>(ctx: &C, l3: usize, header: u64) -> Option<C::Verdict> {
    let quote: [u8; QUOTE6] = load(ctx, l3)?;
    let f = frame::<REJECT6_LEN>()?;
    f[0] = 0x60;
    let payload = (REJECT6_LEN - ip6::HLEN) as u16;
    f[ip6::PAYLOAD_LEN..ip6::PAYLOAD_LEN + 2].copy_from_slice(&payload.to_be_bytes());
    f[ip6::NEXT_HDR] = proto::ICMPV6;
    f[ip6::NEXT_HDR + 1] = 64; // hop limit
    f[ip6::SADDR..ip6::SADDR + 16].copy_from_slice(&quote[ip6::DADDR..ip6::DADDR + 16]);
    f[ip6::DADDR..ip6::DADDR + 16].copy_from_slice(&quote[ip6::SADDR..ip6::SADDR + 16]);
    put_header(f, ip6::HLEN, header);
    f[ip6::HLEN + l4::ICMP_HLEN..].copy_from_slice(&quote);
    let c = icmp6_checksum(f);
    f[ip6::HLEN + l4::ICMP_CHECK..ip6::HLEN + l4::ICMP_CHECK + 2].copy_from_slice(&c.to_ne_bytes());
    ctx.send_back(l3, f)
}

/// ICMPv6 checksum of a whole IPv6 packet `f` whose checksum field is zero:
/// the pseudo-header (both addresses, the upper-layer length, the next
/// header) and the message.
#[inline(always)]
fn icmp6_checksum(f: &[u8; REJECT6_LEN]) -> u16 {
    let mut sum = 0u32;
    // Source and destination addresses.
    let mut i = ip6::SADDR;
    while i < ip6::HLEN {
        sum += u16::from_ne_bytes([f[i], f[i + 1]]) as u32;
        i += 2;
    }
    // Upper-layer length (32 bits) and next header, in network order.
    let len = (REJECT6_LEN - ip6::HLEN) as u32;
    sum += u16::from_ne_bytes((len as u16).to_be_bytes()) as u32;
    sum += u16::from_ne_bytes((proto::ICMPV6 as u16).to_be_bytes()) as u32;
    checksum(sum, &f[ip6::HLEN..])
}

/// An ICMP error (destination unreachable including "too big", time
/// exceeded, parameter problem) quoting a packet of a translated flow, seen
/// by any hook: rewrites the quote to the packet as its sender sent it, and
/// the outer destination to that sender; at egress (`!ingress`), the outer
/// source to the address that sender addressed ([`restore_source`]), as
/// netfilter's NAT does in PREROUTING and POSTROUTING. Anything else
/// passes untouched.
#[inline(always)]
pub fn translate_error<C: Ctx, F: Family>(
    ctx: &C,
    cfg: &DpConfig,
    l3: usize,
    l4: usize,
    ingress: bool,
) -> (C::Verdict, Event) {
    let out = match translate::<C, F>(ctx, cfg, l3, l4, ct::now()) {
        Some(true) => (C::PASS, Event::IcmpErrorTranslated),
        Some(false) => (C::PASS, Event::Pass),
        None => return (C::PASS, Event::Malformed),
    };
    if !ingress && restore_source::<C, F>(ctx, cfg, l3, l4) == Some(true) {
        return (C::PASS, Event::IcmpErrorTranslated);
    }
    out
}

/// The entry that tells how to rewrite a quoted packet `q`, and whether the
/// outer destination follows (it does not for an error about a reply that
/// this node sent towards the backend after un-SNAT: the backend already is
/// the destination). The quote becomes the reverse of the entry's
/// translated tuple in every case:
/// - `q` as forwarded towards a backend (from the client, or the node's
///   SNAT address): the reply-side entry, keyed by the reverse of `q`, or a
///   hashed SNAT flow's `REP_IN`; the quote becomes client → frontend;
/// - `q` as a client saw a reply (frontend → client): `FWD_IN`, keyed by its
///   reverse; the quote becomes backend → client or node : SNAT port;
/// - `q` as a reply after un-SNAT (backend → client): `FWD_OUT` (explicit),
///   or a hashed flow's `REP_IN`; the quote becomes backend → node : port.
#[inline(always)]
fn flow_of<F: Family>(cfg: &DpConfig, q: &CtKey<F::A>, now: u64) -> Option<(CtEntry<F::A>, bool)> {
    let rev = q.reversed();
    if let Some(e) = ct::lookup::<F>(cfg, &rev, now) {
        let e = *e.get();
        return Some((e, e.role() != ct_flags::FWD_OUT));
    }
    // Hashed SNAT flows: `q` forwarded from the client (backend's REP_IN
    // names the client) ...
    let as_forward = ct::hashed_rep_in::<F, false>(cfg, q.daddr, q.dport, q.saddr, q.sport, q.proto, now);
    if let Some(e) = as_forward {
        return Some((*e.get(), true));
    }
    // ... or a reply after un-SNAT: its quote becomes REP_IN's key.
    let e = ct::hashed_rep_in::<F, false>(cfg, q.saddr, q.sport, q.daddr, q.dport, q.proto, now)?;
    let e = *e.get();
    let port = ct::hashed_port(cfg, q.daddr, q.dport);
    Some((
        CtEntry {
            // Reversed below: backend → node : port.
            nat_saddr: F::snat_ip(cfg),
            nat_sport: port.to_be(),
            nat_daddr: q.saddr,
            nat_dport: q.sport,
            ..e
        },
        false,
    ))
}

/// The error types worth translating, and the offset of the quoted
/// header's protocol field.
#[inline(always)]
fn is_error<F: Family>(icmp_type: u8) -> bool {
    if F::IP_CHECKSUM {
        matches!(
            icmp_type,
            ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETERPROB
        )
    } else {
        matches!(
            icmp_type,
            ICMP6_DST_UNREACH | ICMP6_PACKET_TOO_BIG | ICMP6_TIME_EXCEEDED | ICMP6_PARAM_PROB
        )
    }
}

/// The quote of an ICMP error at `l4` that the datapath translates: its IP
/// header's and L4 header's offsets and its protocol (TCP, UDP or SCTP);
/// `Some(None)` for another ICMP message or quote, `None` when the packet
/// is cut short.
#[inline(always)]
fn quote<C: Ctx, F: Family>(ctx: &C, l4: usize) -> Option<Option<(usize, usize, u8)>> {
    // Type and code together: a one-byte read at a variable offset compiles
    // to a bounds check the verifier cannot use.
    let [icmp_type, _code]: [u8; 2] = load(ctx, l4)?;
    if !is_error::<F>(icmp_type) {
        return Some(None);
    }
    let inner = l4 + l4::ICMP_HLEN;
    // The quoted header: IPv4 without options (version and IHL 0x45), or
    // IPv6 with TCP or UDP right after it.
    let (inner_l4, inner_proto) = if F::IP_CHECKSUM {
        let [vihl, _tos]: [u8; 2] = load(ctx, inner)?;
        let [_ttl, p]: [u8; 2] = load(ctx, inner + ip::TTL)?;
        if vihl != 0x45 {
            return Some(None);
        }
        (inner + ip::HLEN, p)
    } else {
        let [vtc, _]: [u8; 2] = load(ctx, inner)?;
        let [p, _hop]: [u8; 2] = load(ctx, inner + ip6::NEXT_HDR)?;
        if vtc >> 4 != 6 {
            return Some(None);
        }
        (inner + ip6::HLEN, p)
    };
    // (An SCTP quote's CRC32c lies beyond the 8 bytes quoted at least, and
    // covers the whole packet, which a quote rarely holds: it is left as it
    // is; nobody checks a quote's L4 checksum.)
    if !(inner_proto == proto::TCP || inner_proto == proto::UDP || inner_proto == proto::SCTP) {
        return Some(None);
    }
    Some(Some((inner, inner_l4, inner_proto)))
}

#[inline(never)]
fn translate<C: Ctx, F: Family>(ctx: &C, cfg: &DpConfig, l3: usize, l4: usize, now: u64) -> Option<bool> {
    let Some((inner, inner_l4, inner_proto)) = quote::<C, F>(ctx, l4)? else {
        return Some(false);
    };
    let end = if F::IP_CHECKSUM {
        let tot: u16 = load(ctx, l3 + ip::TOT_LEN)?;
        l3 + u16::from_be(tot) as usize
    } else {
        let plen: u16 = load(ctx, l3 + ip6::PAYLOAD_LEN)?;
        l3 + ip6::HLEN + u16::from_be(plen) as usize
    };
    if inner_l4 + 4 > end {
        return Some(false);
    }
    let (Some(saddr), Some(daddr), Some(ports)) = (
        load::<_, F::A>(ctx, inner + F::SADDR),
        load::<_, F::A>(ctx, inner + F::DADDR),
        load::<_, [u16; 2]>(ctx, inner_l4),
    ) else {
        return Some(false);
    };
    let q = CtKey::new(saddr, daddr, ports[0], ports[1], inner_proto);
    let Some((e, outer_follows)) = flow_of::<F>(cfg, &q, now) else {
        return Some(false);
    };
    // The quote as its sender sent it: the reverse of the translated tuple.
    let n = e.nat_key(inner_proto).reversed();
    let in_addr = q.saddr.csum_diff(&n.saddr) + q.daddr.csum_diff(&n.daddr);
    let in_ports = csum::diff16(q.sport, n.sport) + csum::diff16(q.dport, n.dport);
    let mut icmp_diff = in_addr + in_ports;
    if F::IP_CHECKSUM {
        let old_in_check: u16 = load(ctx, inner + ip::CHECK)?;
        let new_in_check = csum::apply(old_in_check, in_addr);
        icmp_diff += csum::diff16(old_in_check, new_in_check);
        ctx.store(inner + ip::CHECK, &new_in_check)?;
    }
    if inner_proto == proto::UDP
        && inner_l4 + l4::UDP_HLEN <= end
        && let Some(old_udp) = load::<_, u16>(ctx, inner_l4 + l4::UDP_CHECK)
        && old_udp != 0
    {
        let mut new_udp = csum::apply(old_udp, in_addr + in_ports);
        if new_udp == 0 {
            new_udp = 0xffff;
        }
        icmp_diff += csum::diff16(old_udp, new_udp);
        ctx.store(inner_l4 + l4::UDP_CHECK, &new_udp)?;
    }
    // TCP's checksum lies beyond the 8 bytes an error must quote, but most
    // errors quote more (Linux: as much as fits; ICMPv6 up to 1280 bytes):
    // when it is there, it is kept true to the quote.
    if inner_proto == proto::TCP
        && inner_l4 + l4::TCP_CHECK + 2 <= end
        && let Some(old_tcp) = load::<_, u16>(ctx, inner_l4 + l4::TCP_CHECK)
    {
        let new_tcp = csum::apply(old_tcp, in_addr + in_ports);
        icmp_diff += csum::diff16(old_tcp, new_tcp);
        ctx.store(inner_l4 + l4::TCP_CHECK, &new_tcp)?;
    }
    let outer: F::A = load(ctx, l3 + F::DADDR)?;
    let new_outer = e.nat_daddr;
    let outer_changes = outer_follows && new_outer != outer;
    if outer_changes && !F::IP_CHECKSUM {
        // ICMPv6's checksum covers the pseudo-header's destination.
        icmp_diff += outer.csum_diff(&new_outer);
    }
    let icmp_check: u16 = load(ctx, l4 + l4::ICMP_CHECK)?;
    ctx.store(inner + F::SADDR, &n.saddr)?;
    ctx.store(inner + F::DADDR, &n.daddr)?;
    ctx.store(inner_l4, &[n.sport, n.dport])?;
    ctx.store(l4 + l4::ICMP_CHECK, &csum::apply(icmp_check, icmp_diff))?;
    if outer_changes {
        // The outer source is egress's (`restore_source`): at ingress the
        // frontend may be a local address, which routing would refuse as
        // a martian source.
        ctx.store(l3 + F::DADDR, &new_outer)?;
        if F::IP_CHECKSUM {
            let outer_check: u16 = load(ctx, l3 + ip::CHECK)?;
            ctx.store(
                l3 + ip::CHECK,
                &csum::apply(outer_check, outer.csum_diff(&new_outer)),
            )?;
        }
    }
    Some(true)
}

/// Egress (POSTROUTING's half of `nf_nat_icmp_reply_translation`): an ICMP
/// error whose quote is now a flow's packet as its sender sent it (the key
/// of its `FWD_IN`: client → frontend; or of its `REP_IN`: backend → node :
/// SNAT port) and which goes to that sender leaves from the address the
/// sender addressed (the frontend, the node's SNAT address).
#[inline(never)]
fn restore_source<C: Ctx, F: Family>(ctx: &C, cfg: &DpConfig, l3: usize, l4: usize) -> Option<bool> {
    let Some((inner, inner_l4, inner_proto)) = quote::<C, F>(ctx, l4)? else {
        return Some(false);
    };
    let saddr: F::A = load(ctx, inner + F::SADDR)?;
    let daddr: F::A = load(ctx, inner + F::DADDR)?;
    let ports: [u16; 2] = load(ctx, inner_l4)?;
    let q = CtKey::new(saddr, daddr, ports[0], ports[1], inner_proto);
    let e = ct::lookup::<F>(cfg, &q, ct::now())?;
    let (role, flags) = (e.get().role(), e.get().flags);
    if !((role == ct_flags::FWD_IN && flags & ct_flags::DSR == 0) || role == ct_flags::REP_IN) {
        return Some(false);
    }
    let outer_src: F::A = load(ctx, l3 + F::SADDR)?;
    let outer_dst: F::A = load(ctx, l3 + F::DADDR)?;
    if outer_dst != q.saddr || outer_src == q.daddr {
        return Some(false);
    }
    let diff = outer_src.csum_diff(&q.daddr);
    ctx.store(l3 + F::SADDR, &q.daddr)?;
    if F::IP_CHECKSUM {
        let c: u16 = load(ctx, l3 + ip::CHECK)?;
        ctx.store(l3 + ip::CHECK, &csum::apply(c, diff))?;
    } else {
        let c: u16 = load(ctx, l4 + l4::ICMP_CHECK)?;
        ctx.store(l4 + l4::ICMP_CHECK, &csum::apply(c, diff))?;
    }
    Some(true)
}
