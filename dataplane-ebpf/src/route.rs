//! Host routing (`--host-routing`): a packet the ingress path translated
//! (DNAT of a flow's packets, un-SNAT of a masqueraded flow's replies)
//! leaves at once through the device that the kernel's FIB names for its
//! new destination, with the neighbour's MAC addresses and its TTL (hop
//! limit) decremented, as the kernel's forwarding would have sent it.
//! What it skips is the node's IP stack on the way: the routing decision
//! made again, netfilter's PREROUTING/FORWARD/POSTROUTING hooks and
//! connection tracking, the neighbour layer's output.
//!
//! - TC redirects the packet to the device's egress, where our egress
//!   program still runs (SNAT, the frontend restored).
//! - XDP sends the frame itself, before the kernel allocates an skb:
//!   `XDP_TX` out of the device it came in on (a one-armed node), or
//!   `XDP_REDIRECT` to another device the agent lists in
//!   `DP_XDP_DEVICES_V1` (those that run our XDP natively: a veth to a pod
//!   takes no XDP frames unless its peer runs XDP). No egress program runs
//!   after it, so it applies the source rewrite the egress hook would have
//!   made (SNAT of a masqueraded flow's packets, the frontend on a reply),
//!   left in the `FORWARD` scratch by the ingress path; a SNAT port is used
//!   only after its `REP_IN` entry is checked to name this client still, as
//!   the egress hook checks it.
//!
//! Opt-in: rules in the FORWARD chain (a network policy engine's, a
//! firewall's), qdiscs on the way out and captures on the node's stack do
//! not see these packets. Everything the FIB does not answer with a
//! complete route goes through the stack as before, counted by reason
//! (`FlowStat::Fwd*`): a local destination, a neighbour not resolved yet,
//! a packet over the route's MTU (the stack sends "fragmentation needed"),
//! forwarding disabled on the device, a TTL about to expire (the stack
//! sends "time exceeded"), VLAN-tagged frames, and in XDP a device that
//! takes no XDP frames.

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup,
        xdp_action::{XDP_PASS, XDP_TX},
    },
    helpers::bpf_redirect,
    programs::{TcContext, XdpContext},
};
use dataplane_common::{
    addr::{Addr, Ip6},
    config::DpConfig,
    ct::{CtKey, ct_flags},
    stats::FlowStat,
};

use crate::{
    csum, ct,
    ctx::{Ctx, load},
    family::{Family, V4, V6},
    hdr::{eth, ip, ip6},
    maps::{FORWARD, XDP_DEVICES, forward},
    nat::{self, Side},
    parse::{Kind, kind},
    stats,
};

pub const AF_INET: u8 = 2;
pub const AF_INET6: u8 = 10;
/// "Not sent by us": let the stack have the packet.
const STACK: i64 = -1;

/// Sending a translated packet on without the stack, per program type.
pub trait Forward: Ctx {
    /// Host routing: sends a translated packet straight to its route's
    /// device; `None` leaves it to the stack.
    fn route(&self, cfg: &DpConfig) -> Option<Self::Verdict>;
    /// Whether a new DSR flow's packets can be sent to `backend`'s node
    /// from this hook: TC always can (`bpf_redirect_neigh` resolves the
    /// next hop); XDP when the FIB names a complete route through a device
    /// it can send to.
    fn dsr_sendable<F: Family>(&self, cfg: &DpConfig, backend: &F::A) -> bool;
}

impl Forward for XdpContext {
    #[inline(always)]
    fn route(&self, cfg: &DpConfig) -> Option<u32> {
        xdp(self, cfg)
    }

    #[inline(always)]
    fn dsr_sendable<F: Family>(&self, cfg: &DpConfig, backend: &F::A) -> bool {
        reachable_xdp::<F>(self, cfg, backend)
    }
}

impl Forward for TcContext {
    #[inline(always)]
    fn route(&self, _cfg: &DpConfig) -> Option<i32> {
        tc(self)
    }

    #[inline(always)]
    fn dsr_sendable<F: Family>(&self, _cfg: &DpConfig, _backend: &F::A) -> bool {
        true
    }
}

/// Fills the FIB lookup's addresses, family and ingress device for a
/// packet of family `F` from `src` to `dst`, `tot_len` bytes long (0: no
/// MTU check). The rest of `p` must be zero.
#[inline(always)]
pub fn fib_params<C: Ctx, F: Family>(ctx: &C, p: &mut bpf_fib_lookup, src: &F::A, dst: &F::A, tot_len: u16) {
    let (s, d) = (src as *const F::A as *const u32, dst as *const F::A as *const u32);
    if F::IP_CHECKSUM {
        p.family = AF_INET;
        // SAFETY: an IPv4 address is one word.
        unsafe {
            p.__bindgen_anon_3.ipv4_src = *s;
            p.__bindgen_anon_4.ipv4_dst = *d;
        }
    } else {
        p.family = AF_INET6;
        // SAFETY: an IPv6 address is four words.
        unsafe {
            p.__bindgen_anon_3.ipv6_src = *(s as *const Ip6);
            p.__bindgen_anon_4.ipv6_dst = *(d as *const Ip6);
        }
    }
    p.__bindgen_anon_1.tot_len = tot_len;
    p.ifindex = ctx.ingress_ifindex();
}

/// The fallback a FIB lookup's return code stands for.
#[inline(always)]
pub fn fib_fallback(rc: i64) -> FlowStat {
    match rc as u32 {
        BPF_FIB_LKUP_RET_NO_NEIGH => FlowStat::FwdNoNeighbour,
        BPF_FIB_LKUP_RET_FRAG_NEEDED => FlowStat::FwdFragNeeded,
        _ => FlowStat::FwdNotForwarded,
    }
}

#[inline(always)]
fn fallback(why: FlowStat) -> i64 {
    stats::count_flow(why);
    STACK
}

/// A zeroed FIB lookup argument on the stack.
macro_rules! fib_arg {
    ($slot:ident) => {{
        $slot = core::mem::MaybeUninit::<bpf_fib_lookup>::uninit();
        // SAFETY: a plain-old-data struct of integers, unions of integers
        // and byte arrays: all zeroes is a valid value.
        unsafe { crate::zero::zeroed(&mut $slot) }
    }};
}
pub(crate) use fib_arg;

/// Sends the translated packet to its route's device: the redirect's
/// verdict, or `None` to let the stack forward it.
#[inline(always)]
pub fn tc(ctx: &TcContext) -> Option<i32> {
    let v = route_tc(ctx);
    (v >= 0).then_some(v as i32)
}

/// A subprogram of its own: the FIB lookup's 64-byte parameters stay off
/// the lookup path's stack. Returns the verdict, or -1.
#[inline(never)]
fn route_tc(ctx: &TcContext) -> i64 {
    let l3 = eth::HLEN;
    let mut slot;
    let p = fib_arg!(slot);
    // (the offset of the TTL or hop limit, the 16-bit word holding it
    // (IPv4: with the protocol, under the header checksum))
    let (ttl_off, word) = match kind(ctx) {
        Kind::V4(l3_off) if l3_off == l3 => {
            let (Some(word), Some(src), Some(dst)) = (
                load::<_, u16>(ctx, l3 + ip::TTL),
                load::<_, u32>(ctx, l3 + ip::SADDR),
                load::<_, u32>(ctx, l3 + ip::DADDR),
            ) else {
                return fallback(FlowStat::FwdOther);
            };
            fib_params::<_, V4>(ctx, p, &src, &dst, 0);
            (l3 + ip::TTL, word)
        }
        Kind::V6(l3_off) if l3_off == l3 => {
            let (Some(hop), Some(src), Some(dst)) = (
                load::<_, u8>(ctx, l3 + ip6::HOP_LIMIT),
                load::<_, Ip6>(ctx, l3 + ip6::SADDR),
                load::<_, Ip6>(ctx, l3 + ip6::DADDR),
            ) else {
                return fallback(FlowStat::FwdOther);
            };
            fib_params::<_, V6>(ctx, p, &src, &dst, 0);
            (l3 + ip6::HOP_LIMIT, hop as u16)
        }
        _ => return fallback(FlowStat::FwdOther),
    };
    // The TTL is the low byte of the word as read (little-endian target).
    if word & 0xff <= 1 {
        return fallback(FlowStat::FwdTtl);
    }
    // tot_len 0: the kernel checks the skb itself against the egress
    // device's MTU, GSO packets included.
    let rc = ctx.fib(p, 0);
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return fallback(fib_fallback(rc));
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
        // it: dropped (the caller counts it `drop_forward_failed`), and
        // among flows as a translated packet that could not be sent on.
        stats::count_flow(FlowStat::FwdOther);
        return aya_ebpf::bindings::TC_ACT_SHOT as i64;
    }
    stats::count_flow(FlowStat::HostRouted);
    // SAFETY: helper without pointers.
    unsafe { bpf_redirect(p.ifindex, 0) }
}

/// XDP host routing: sends the translated frame on itself (see the module
/// docs); `None` lets the stack have it, translated as far as the ingress
/// path translated it (the egress hook does the rest, as without host
/// routing).
#[inline(always)]
pub fn xdp(ctx: &XdpContext, cfg: &DpConfig) -> Option<u32> {
    let v = forward_xdp(ctx, cfg);
    (v >= 0).then_some(v as u32)
}

#[inline(never)]
fn forward_xdp(ctx: &XdpContext, cfg: &DpConfig) -> i64 {
    match kind(ctx) {
        Kind::V4(l3) if l3 == eth::HLEN => forward_family::<V4>(ctx, cfg),
        Kind::V6(l3) if l3 == eth::HLEN => forward_family::<V6>(ctx, cfg),
        _ => fallback(FlowStat::FwdOther),
    }
}

/// The device a frame leaves through: `XDP_TX` back out of the device it
/// came in on, `XDP_REDIRECT` to a device XDP may send to; `None` for any
/// other device.
#[inline(always)]
pub fn xdp_out_index(ingress: u32, ifindex: u32) -> Option<u32> {
    if ifindex == ingress {
        return Some(XDP_TX);
    }
    XDP_DEVICES.redirect(ifindex, XDP_PASS as u64).ok()
}

/// Whether XDP can send a frame out of `ifindex` (see [`xdp_out_index`]),
/// without choosing it yet.
#[inline(always)]
pub fn xdp_out_known(ifindex: u32, ingress: u32) -> bool {
    ifindex == ingress || XDP_DEVICES.get_ifindex(ifindex).is_some()
}

#[inline(always)]
fn forward_family<F: Family>(ctx: &XdpContext, cfg: &DpConfig) -> i64 {
    let l3 = eth::HLEN;
    let Ok(pkt) = F::parse(ctx, l3) else {
        return fallback(FlowStat::FwdOther);
    };
    let t = pkt.tuple;
    let Some(fw) = FORWARD.get_ptr(0) else {
        return fallback(FlowStat::FwdOther);
    };
    // SAFETY: this CPU's slot, written by the ingress path of this run.
    let (what, addr, port) = unsafe { ((*fw).what, (*fw).addr, (*fw).port) };
    // SAFETY: the scratch holds an address of the packet's family in its
    // first bytes.
    let addr: F::A = unsafe { *(&addr as *const Ip6 as *const F::A) };
    let (src, sport) = if what == forward::SRC || what == forward::SNAT {
        (addr, port)
    } else {
        (t.saddr, t.sport)
    };
    if what == forward::SNAT && !snat_port_names_client::<F>(cfg, &t, &src, sport) {
        return fallback(FlowStat::FwdOther);
    }
    // The TTL (IPv4: with the protocol, the word under the checksum) or
    // the hop limit (IPv6: a byte of its own; the next one is the source
    // address, which the rewrite below may change).
    let ttl_off = if F::IP_CHECKSUM {
        l3 + ip::TTL
    } else {
        l3 + ip6::HOP_LIMIT
    };
    let word = if F::IP_CHECKSUM {
        load::<_, u16>(ctx, ttl_off)
    } else {
        load::<_, u8>(ctx, ttl_off).map(u16::from)
    };
    let Some(word) = word else {
        return fallback(FlowStat::FwdOther);
    };
    // Little-endian target: the TTL is the word's low byte.
    if word & 0xff <= 1 {
        return fallback(FlowStat::FwdTtl);
    }
    let mut slot;
    let p = fib_arg!(slot);
    fib_params::<_, F>(ctx, p, &src, &t.daddr, pkt.tot_len);
    p.l4_protocol = t.proto;
    p.sport = sport;
    p.dport = t.dport;
    let rc = ctx.fib(p, 0);
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return fallback(fib_fallback(rc));
    }
    let Some(verdict) = xdp_out_index(Ctx::ingress_ifindex(ctx), p.ifindex) else {
        return fallback(FlowStat::FwdDevice);
    };
    // Every pointer is checked before a byte is written: a rewrite either
    // happens whole or not at all, and then the stack gets the frame.
    if (what == forward::SRC || what == forward::SNAT)
        && nat::rewrite::<_, F>(ctx, &pkt, Side::Src, &src, sport).is_none()
    {
        return fallback(FlowStat::FwdOther);
    }
    // No borrow: the TTL byte is at least 2.
    let new = word - 1;
    if F::IP_CHECKSUM {
        let Some(check) = load::<_, u16>(ctx, l3 + ip::CHECK) else {
            return fallback(FlowStat::FwdOther);
        };
        let _ = ctx.store(l3 + ip::CHECK, &csum::apply(check, csum::diff16(word, new)));
        let _ = ctx.store(ttl_off, &new);
    } else {
        let _ = ctx.store(ttl_off, &(new as u8));
    }
    let _ = ctx.store(eth::DST, &p.dmac);
    let _ = ctx.store(eth::SRC, &p.smac);
    stats::count_flow(FlowStat::XdpForwarded);
    verdict as i64
}

/// Whether a packet to `backend` can be sent from here by the XDP program
/// (a new DSR flow's first packet in XDP: a flow that cannot be is served
/// masqueraded instead, through the stack, which resolves the neighbour
/// meanwhile). TC sends through `bpf_redirect_neigh`, which resolves it
/// itself.
#[inline(never)]
fn reachable_xdp<F: Family>(ctx: &XdpContext, cfg: &DpConfig, backend: &F::A) -> bool {
    let mut slot;
    let p = fib_arg!(slot);
    fib_params::<_, F>(ctx, p, &F::snat_ip(cfg), backend, 0);
    ctx.fib(p, 0) == BPF_FIB_LKUP_RET_SUCCESS as i64 && xdp_out_known(p.ifindex, Ctx::ingress_ifindex(ctx))
}

/// Whether the masqueraded flow `t` (client → backend, DNATed) still owns
/// its SNAT port: the port's `REP_IN` names this client (the conntrack map
/// is an LRU: a live flow's `REP_IN` may be evicted and its port claimed
/// by another client; the egress hook makes the same check).
#[inline(always)]
fn snat_port_names_client<F: Family>(cfg: &DpConfig, t: &CtKey<F::A>, snat: &F::A, port: u16) -> bool {
    let key = CtKey::new(t.daddr, *snat, t.dport, port, t.proto);
    let Some(e) = ct::lookup::<F>(cfg, &key, ct::now_inline()) else {
        return false;
    };
    let e = e.get();
    e.role() == ct_flags::REP_IN && e.nat_daddr == t.saddr && e.nat_dport == t.sport
}

/// Leaves the forwarding step what the egress hook would have done to the
/// packet (XDP under host routing only: elsewhere egress does it).
#[inline(always)]
pub fn leave<C: Ctx, A: Addr>(cfg: &DpConfig, what: u8, addr: &A, port: u16) {
    if !C::XDP || cfg.flags & dataplane_common::config::config_flags::HOST_ROUTING == 0 {
        return;
    }
    leave_always(what, addr, port);
}

/// Writes the `FORWARD` scratch.
#[inline(always)]
pub fn leave_always<A: Addr>(what: u8, addr: &A, port: u16) {
    if let Some(fw) = FORWARD.get_ptr_mut(0) {
        // SAFETY: this CPU's slot; an address is at most the slot's 16
        // bytes.
        unsafe {
            (*fw).what = what;
            (*fw).port = port;
            *(core::ptr::addr_of_mut!((*fw).addr) as *mut A) = *addr;
        }
    }
}
