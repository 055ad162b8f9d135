//! Host routing (`--host-routing`): a packet that the TC ingress path
//! translated (DNAT of a flow's packets, un-SNAT of a masqueraded flow's
//! replies) leaves at once through the device that the kernel's FIB names
//! for its new destination, with the neighbour's MAC addresses and its TTL
//! (hop limit) decremented, as the kernel's forwarding would have sent it.
//! What it skips is the node's IP stack on the way: the routing decision
//! made again, netfilter's PREROUTING/FORWARD/POSTROUTING hooks and
//! connection tracking, the neighbour layer's output. The egress programs
//! of the device it leaves through still run (SNAT, the frontend restored).
//!
//! Opt-in: rules in the FORWARD chain (a network policy engine's, a
//! firewall's) do not see these packets. Everything the FIB does not answer
//! with a complete route goes through the stack as before: a local
//! destination, a neighbour not resolved yet, a packet over the route's MTU
//! (the stack sends "fragmentation needed"), forwarding disabled on the
//! device, a TTL about to expire (the stack sends "time exceeded"), and
//! VLAN-tagged frames.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect},
    programs::TcContext,
};
use dataplane_common::{addr::Ip6, stats::FlowStat};

use crate::{
    ctx::{Ctx, load},
    parse::{Kind, eth, ip, ip6, kind},
    stats,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Sends the translated packet to its route's device: the redirect's
/// verdict, or `None` to let the stack forward it.
#[inline(always)]
pub fn tc(ctx: &TcContext) -> Option<i32> {
    let v = route(ctx);
    (v >= 0).then_some(v as i32)
}

/// A subprogram of its own: the FIB lookup's 64-byte parameters stay off
/// the lookup path's stack. Returns the verdict, or -1.
#[inline(never)]
fn route(ctx: &TcContext) -> i64 {
    const STACK: i64 = -1;
    let l3 = eth::HLEN;
    let mut slot = core::mem::MaybeUninit::<bpf_fib_lookup>::uninit();
    // SAFETY: a plain-old-data struct of integers, unions of integers and
    // byte arrays: all zeroes is a valid value.
    let p = unsafe { crate::zero::zeroed(&mut slot) };
    // (the offset of the TTL or hop limit, the 16-bit word holding it
    // (IPv4: with the protocol, under the header checksum))
    let (ttl_off, word) = match kind(ctx) {
        Kind::V4(l3_off) if l3_off == l3 => {
            let (Some(word), Some(src), Some(dst)) = (
                load::<_, u16>(ctx, l3 + ip::TTL),
                load::<_, u32>(ctx, l3 + ip::SADDR),
                load::<_, u32>(ctx, l3 + ip::DADDR),
            ) else {
                return STACK;
            };
            p.family = AF_INET;
            p.__bindgen_anon_3.ipv4_src = src;
            p.__bindgen_anon_4.ipv4_dst = dst;
            (l3 + ip::TTL, word)
        }
        Kind::V6(l3_off) if l3_off == l3 => {
            let (Some(hop), Some(src), Some(dst)) = (
                load::<_, u8>(ctx, l3 + ip6::HOP_LIMIT),
                load::<_, Ip6>(ctx, l3 + ip6::SADDR),
                load::<_, Ip6>(ctx, l3 + ip6::DADDR),
            ) else {
                return STACK;
            };
            p.family = AF_INET6;
            p.__bindgen_anon_3.ipv6_src = src;
            p.__bindgen_anon_4.ipv6_dst = dst;
            (l3 + ip6::HOP_LIMIT, hop as u16)
        }
        _ => return STACK,
    };
    // The TTL is the low byte of the word as read (little-endian target).
    if word & 0xff <= 1 {
        return STACK;
    }
    // SAFETY: reads the context's ingress device index.
    p.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // tot_len 0: the kernel checks the skb itself against the egress
    // device's MTU, GSO packets included.
    // SAFETY: the helper reads and writes `p`, whose size is passed.
    let rc = unsafe {
        fib_lookup(
            ctx.skb.skb as *mut _,
            p,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return STACK;
    }
    let ok = if p.family == AF_INET {
        // No borrow: the TTL byte is at least 2.
        let new = word - 1;
        ctx.l3_csum_replace(l3 + ip::CHECK, word as u64, new as u64, 2)
            .is_ok()
            && Ctx::store(ctx, ttl_off, &new).is_some()
    } else {
        Ctx::store(ctx, ttl_off, &(word as u8 - 1)).is_some()
    };
    if !ok || Ctx::store(ctx, eth::DST, &p.dmac).is_none() || Ctx::store(ctx, eth::SRC, &p.smac).is_none() {
        // A failed store leaves the packet as the stack would not forward
        // it: drop rather than send it on half rewritten.
        return aya_ebpf::bindings::TC_ACT_SHOT as i64;
    }
    stats::count_flow(FlowStat::HostRouted);
    // SAFETY: helper without pointers.
    unsafe { bpf_redirect(p.ifindex, 0) }
}
