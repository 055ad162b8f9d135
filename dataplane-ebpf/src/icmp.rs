//! ICMP: the port-unreachable reject built in XDP, and ICMP errors about
//! translated flows rewritten so that they reach the client.

use aya_ebpf::{
    bindings::{
        TC_ACT_REDIRECT, TC_ACT_SHOT,
        xdp_action::{XDP_DROP, XDP_PASS, XDP_TX},
    },
    helpers::{bpf_redirect, bpf_skb_change_tail, bpf_xdp_adjust_head, bpf_xdp_adjust_tail},
    programs::{TcContext, XdpContext},
};
use dataplane_common::{config::DpConfig, ct::ct_flags, proto, stats::Event};

use crate::{
    csum, ct,
    packet::{Ipv4, ip, load, ptr_at, store},
};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;
/// What an ICMP error quotes: the IP header (no options) and 8 bytes of L4.
const QUOTE: usize = ip::HLEN + 8;
/// IP header + ICMP header + quote.
const REJECT_LEN: usize = ip::HLEN + 8 + QUOTE;

/// Internet checksum of `len` bytes at `p` (even length).
///
/// # Safety
/// `p..p+len` must be inside the packet.
#[inline(always)]
unsafe fn checksum_at(p: *const u8, len: usize) -> u16 {
    let mut sum = 0u32;
    let mut i = 0;
    while i + 1 < len {
        // SAFETY: in bounds per the caller.
        sum += unsafe { (p.add(i) as *const u16).read_unaligned() } as u32;
        i += 2;
    }
    !csum::fold(sum)
}

/// Turns the frame into an ICMP port-unreachable from the destination back
/// to the source and transmits it on the receiving device. Only frames
/// whose IP header has no options are answered; others are dropped.
#[inline(always)]
pub fn reject_xdp(ctx: &XdpContext, pkt: &Ipv4, event: Event) -> (u32, Event) {
    if build_reject(ctx, pkt.l3, pkt.l4) == 0 {
        (XDP_TX, event)
    } else {
        (XDP_DROP, Event::DropRejectFailed)
    }
}

/// Returns 0 on success (a subprogram: its stack is its own).
#[inline(never)]
fn build_reject(ctx: &XdpContext, l3: usize, l4: usize) -> u32 {
    match try_build_reject(ctx, l3, l4) {
        Some(()) => 0,
        None => 1,
    }
}

#[inline(always)]
fn try_build_reject(ctx: &XdpContext, l3: usize, l4: usize) -> Option<()> {
    if l4 != l3 + ip::HLEN || l3 > 22 {
        return None;
    }
    let macs: [u8; 12] = load(ctx, 0)?;
    // Ethertype and VLAN tags: the first l3 - 12 of these bytes.
    let l2_rest: [u8; 10] = load(ctx, 12)?;
    let quote: [u8; QUOTE] = load(ctx, l3)?;
    let delta = (l3 + REJECT_LEN) as i32 - (ctx.data_end() - ctx.data()) as i32;
    if delta < 0 {
        // SAFETY: helper on our own context; pointers are re-derived after.
        if unsafe { bpf_xdp_adjust_tail(ctx.ctx, delta) } != 0 {
            return None;
        }
    } else if delta > 0 {
        // At most 48 (a 42-byte frame grows to 90); the mask keeps the
        // bound visible to the verifier.
        if delta > 63 {
            return None;
        }
        let grow = (delta as u32 & 0x3f) as usize;
        // Grow at the head, which every driver supports (tail growth fails
        // on some, veth among them), and move the ethertype and VLAN tags
        // to the new start.
        // SAFETY: as above.
        if unsafe { bpf_xdp_adjust_head(ctx.ctx, -(grow as i32)) } != 0 {
            return None;
        }
        let r = l2_rest;
        match l3 {
            14 => store(ctx, 12, [r[0], r[1]])?,
            18 => store(ctx, 12, [r[0], r[1], r[2], r[3], r[4], r[5]])?,
            _ => store(ctx, 12, r)?,
        }
    }
    let eth = ptr_at::<_, [u8; 12]>(ctx, 0)? as *mut u8;
    let p = ptr_at::<_, [u8; REJECT_LEN]>(ctx, l3)? as *mut u8;
    // SAFETY: 12 bytes at eth and REJECT_LEN bytes at p checked above.
    unsafe {
        core::ptr::copy_nonoverlapping(macs.as_ptr().add(6), eth, 6);
        core::ptr::copy_nonoverlapping(macs.as_ptr(), eth.add(6), 6);
        core::ptr::write_bytes(p, 0, ip::HLEN + 8);
        p.write(0x45);
        p.add(1).write(0xc0); // internetwork control, as Linux sends ICMP errors
        (p.add(ip::TOT_LEN) as *mut u16).write_unaligned((REJECT_LEN as u16).to_be());
        p.add(ip::TTL).write(64);
        p.add(ip::PROTO).write(proto::ICMP);
        // From the address the client tried, to the client.
        core::ptr::copy_nonoverlapping(quote.as_ptr().add(ip::DADDR), p.add(ip::SADDR), 4);
        core::ptr::copy_nonoverlapping(quote.as_ptr().add(ip::SADDR), p.add(ip::DADDR), 4);
        (p.add(ip::CHECK) as *mut u16).write_unaligned(checksum_at(p, ip::HLEN));
        let icmp = p.add(ip::HLEN);
        icmp.write(ICMP_DEST_UNREACH);
        icmp.add(1).write(ICMP_PORT_UNREACH);
        core::ptr::copy_nonoverlapping(quote.as_ptr(), icmp.add(8), QUOTE);
        (icmp.add(2) as *mut u16).write_unaligned(checksum_at(icmp, 8 + QUOTE));
    }
    Some(())
}

/// An ICMP error (destination unreachable, time exceeded, parameter
/// problem) that quotes a packet of a translated flow, arriving from the
/// backend side: rewrites the quote back to what the client sent and the
/// outer destination to the client. Anything else passes untouched.
#[inline(always)]
pub fn translate_error_xdp(ctx: &XdpContext, cfg: &DpConfig, pkt: &Ipv4, now: u64) -> (u32, Event) {
    match translate_error(ctx, cfg, pkt, now) {
        Some(true) => (XDP_PASS, Event::IcmpErrorTranslated),
        Some(false) => (XDP_PASS, Event::Pass),
        None => (XDP_PASS, Event::Malformed),
    }
}

#[inline(never)]
fn translate_error(ctx: &XdpContext, cfg: &DpConfig, pkt: &Ipv4, now: u64) -> Option<bool> {
    let icmp_type: u8 = load(ctx, pkt.l4)?;
    if !matches!(
        icmp_type,
        ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETERPROB
    ) {
        return Some(false);
    }
    let inner = pkt.l4 + 8;
    let Some(quote) = load::<_, [u8; QUOTE]>(ctx, inner) else {
        return Some(false);
    };
    let inner_proto = quote[ip::PROTO];
    if quote[0] != 0x45 || !(inner_proto == proto::TCP || inner_proto == proto::UDP) {
        return Some(false);
    }
    let word = |o: usize| u32::from_ne_bytes([quote[o], quote[o + 1], quote[o + 2], quote[o + 3]]);
    let half = |o: usize| u16::from_ne_bytes([quote[o], quote[o + 1]]);
    let (i_saddr, i_daddr, i_sport, i_dport) = (word(12), word(16), half(20), half(22));
    // The quoted packet went client-side → backend; its reverse is the key of
    // the flow's reply entry.
    let key = dataplane_common::ct::Ct4Key {
        saddr: i_daddr,
        daddr: i_saddr,
        sport: i_dport,
        dport: i_sport,
        proto: inner_proto,
        _pad: [0; 3],
    };
    let e = ct::lookup(cfg, &key, now)?;
    // SAFETY: map value pointer.
    let e = unsafe { *e };
    if e.flags & ct_flags::REPLY == 0 {
        return Some(false);
    }
    // Quote as the client sent it: client → VIP.
    let (n_saddr, n_sport, n_daddr, n_dport) = (e.nat_daddr, e.nat_dport, e.nat_saddr, e.nat_sport);
    // The outer source stays: the client accepts an error from any hop, and
    // a node address as source would make the packet look martian here.
    let new_o_daddr = e.nat_daddr;

    let in_addr = csum::diff32(i_saddr, n_saddr) + csum::diff32(i_daddr, n_daddr);
    let in_ports = csum::diff16(i_sport, n_sport) + csum::diff16(i_dport, n_dport);
    let old_in_check = half(ip::CHECK);
    let new_in_check = csum::apply(old_in_check, in_addr);
    let mut icmp_diff = in_addr + in_ports + csum::diff16(old_in_check, new_in_check);
    let udp_check_at = inner + ip::HLEN + 6;
    let old_udp = half(ip::HLEN + 6);
    if inner_proto == proto::UDP && old_udp != 0 {
        let mut new_udp = csum::apply(old_udp, in_addr + in_ports);
        if new_udp == 0 {
            new_udp = 0xffff;
        }
        icmp_diff += csum::diff16(old_udp, new_udp);
        store(ctx, udp_check_at, new_udp)?;
    }
    let icmp_check: u16 = load(ctx, pkt.l4 + 2)?;
    let outer_diff = csum::diff32(pkt.tuple.daddr, new_o_daddr);
    let outer_check: u16 = load(ctx, pkt.l3 + ip::CHECK)?;
    store(ctx, inner + ip::SADDR, n_saddr)?;
    store(ctx, inner + ip::DADDR, n_daddr)?;
    store(ctx, inner + ip::CHECK, new_in_check)?;
    store(ctx, inner + ip::HLEN, [n_sport, n_dport])?;
    store(ctx, pkt.l4 + 2, csum::apply(icmp_check, icmp_diff))?;
    store(ctx, pkt.l3 + ip::DADDR, new_o_daddr)?;
    store(ctx, pkt.l3 + ip::CHECK, csum::apply(outer_check, outer_diff))?;
    Some(true)
}

/// The TC twin of [`reject_xdp`] for a pod's packet: the frame becomes an
/// ICMP port-unreachable from the address the pod tried, sent back out of
/// the interface it came in on (towards the pod).
#[inline(always)]
pub fn reject_tc(ctx: &TcContext, pkt: &Ipv4, event: Event) -> (i32, Event) {
    if build_reject_tc(ctx, pkt.l3, pkt.l4) == 0 {
        // SAFETY: reading the context's ifindex; helper without pointers.
        let ifindex = unsafe { (*ctx.skb.skb).ifindex };
        (unsafe { bpf_redirect(ifindex, 0) } as i32, event)
    } else {
        (TC_ACT_SHOT, Event::DropRejectFailed)
    }
}

#[inline(never)]
fn build_reject_tc(ctx: &TcContext, l3: usize, l4: usize) -> u32 {
    match try_build_reject_tc(ctx, l3, l4) {
        Some(()) => 0,
        None => 1,
    }
}

#[inline(always)]
fn try_build_reject_tc(ctx: &TcContext, l3: usize, l4: usize) -> Option<()> {
    // Pod interfaces carry untagged Ethernet.
    if l3 != crate::packet::ETH_HLEN || l4 != l3 + ip::HLEN {
        return None;
    }
    let macs: [u8; 12] = load(ctx, 0)?;
    let quote: [u8; QUOTE] = load(ctx, l3)?;
    const LEN: usize = crate::packet::ETH_HLEN + REJECT_LEN;
    // SAFETY: helper on our own context.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, LEN as u32, 0) } != 0 {
        return None;
    }
    let mut f = [0u8; LEN];
    f[..6].copy_from_slice(&macs[6..12]);
    f[6..12].copy_from_slice(&macs[..6]);
    f[12] = 0x08; // IPv4
    let p = &mut f[crate::packet::ETH_HLEN..];
    p[0] = 0x45;
    p[1] = 0xc0;
    p[2..4].copy_from_slice(&(REJECT_LEN as u16).to_be_bytes());
    p[ip::TTL] = 64;
    p[ip::PROTO] = proto::ICMP;
    p[12..16].copy_from_slice(&quote[16..20]);
    p[16..20].copy_from_slice(&quote[12..16]);
    // SAFETY: the pointers cover the stack buffer.
    let c = unsafe { checksum_at(p.as_ptr(), ip::HLEN) };
    p[10..12].copy_from_slice(&c.to_ne_bytes());
    p[20] = ICMP_DEST_UNREACH;
    p[21] = ICMP_PORT_UNREACH;
    p[28..].copy_from_slice(&quote);
    let c = unsafe { checksum_at(p.as_ptr().add(ip::HLEN), 8 + QUOTE) };
    p[22..24].copy_from_slice(&c.to_ne_bytes());
    ctx.store(0, &f, 0).ok()?;
    let _ = TC_ACT_REDIRECT;
    Some(())
}
