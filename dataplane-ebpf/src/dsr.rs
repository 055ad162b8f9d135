//! Direct server return: the node a client's packet reaches (the *LB
//! node*) sends it, untranslated, to the backend's node inside an outer IP
//! header of the same family (IPIP, IPv6-in-IPv6, as Katran does), from its
//! own address to the backend's; the backend's node (the *backend node*)
//! removes the outer header, translates the packet to the backend and keeps
//! the flow's frontend in conntrack, so the backend's replies leave that
//! node with the frontend as their source, straight to the client. The
//! client's address reaches the backend, as with externalTrafficPolicy
//! Local, with the Cluster policy's spread over every node's endpoints.
//!
//! Why IPIP: 20 bytes (40 for IPv6) of overhead, the least of the choices;
//! the kernel's GSO and GRO know it; the backend node needs nothing from
//! the packet beyond its outer destination (the backend) and the inner
//! frontend, which it checks against the frontends it serves by DSR
//! (`LB4_DSR_V1`: a packet to a frontend or backend it does not serve is
//! left alone). Geneve would carry the frontend in an option over UDP (50+
//! bytes) to let the backend node skip that check, which it needs anyway.
//!
//! The packet's size grows by the outer header: one that no longer fits
//! the route's MTU is answered with ICMP "fragmentation needed" ("packet too
//! big") naming the MTU left for it, so that the client's path MTU discovery
//! adapts (see docs/datapath.md).

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup,
    },
    helpers::bpf_redirect_neigh,
};
use dataplane_common::{
    addr::{Addr, Ip6},
    config::DpConfig,
    ct::ct_flags,
    lb::{DsrKey, backend_flags},
    stats::{Event, FlowStat},
};

use crate::{
    ct,
    ctx::{Ctx, load},
    family::Family,
    flow::Choice,
    hdr::{eth, ip, ip6, l4},
    maps::FORWARD,
    nat::{self, Side},
    route::{self, fib_arg},
    stats,
};

/// IPv4 "don't fragment", in the fragment field as it lies in the packet
/// (host order 0x4000).
const IP_DF_BE: u16 = 0x4000u16.to_be();

/// What [`encap`] did, packed into one register: the low byte is the
/// outcome, the verdict (sent) or the MTU left (too big) the high half.
pub const SENT: u64 = 0;
pub const UNROUTABLE: u64 = 1;
/// IPv4 without "don't fragment": too big, and we do not fragment.
pub const TOO_BIG_NO_DF: u64 = 2;
/// Too big: answer with ICMP naming the MTU in the high half.
pub const TOO_BIG: u64 = 3;

/// Sends a DSR flow's packet to the backend's node (the backend's address
/// is in the `FORWARD` scratch): an outer header from this node's address
/// to the backend's, and out through the route's device. See the module
/// docs for what is returned. The frame must be untagged (`l3` 14).
#[inline(never)]
pub fn encap<C: Ctx, F: Family>(ctx: &C, cfg: &DpConfig, l3: usize) -> u64 {
    let Some(fw) = FORWARD.get_ptr(0) else {
        return UNROUTABLE;
    };
    // SAFETY: this CPU's slot, written by the ingress path of this run;
    // its first bytes hold an address of the packet's family.
    let backend: F::A = unsafe { *(core::ptr::addr_of!((*fw).addr) as *const F::A) };
    let src = F::snat_ip(cfg);
    if l3 != eth::HLEN || src == F::A::default() {
        return UNROUTABLE;
    }
    let olen = core::mem::size_of::<F::Hdr>();
    // The inner packet's length, and its DSCP/ECN (copied to the outer
    // header, RFC 2003 / 6040) and "don't fragment".
    let (Some(first), Some(len_be)) = (
        load::<C, [u8; 2]>(ctx, l3),
        load::<C, u16>(
            ctx,
            l3 + if F::IP_CHECKSUM {
                ip::TOT_LEN
            } else {
                ip6::PAYLOAD_LEN
            },
        ),
    ) else {
        return UNROUTABLE;
    };
    let inner_len = u16::from_be(len_be) as usize + if F::IP_CHECKSUM { 0 } else { ip6::HLEN };
    let (tos, df) = if F::IP_CHECKSUM {
        let frag: u16 = load(ctx, l3 + ip::FRAG_OFF).unwrap_or(0);
        (first[1], frag & IP_DF_BE != 0)
    } else {
        // Traffic class: the low nibble of byte 0 and the high one of byte 1.
        ((first[0] << 4) | (first[1] >> 4), true)
    };
    // What each packet of an aggregated (GSO) skb will be once segmented:
    // its segments must fit, not the aggregate.
    let seg_len = segment_len(ctx, l3, inner_len);
    let mut slot;
    let p = fib_arg!(slot);
    route::fib_params::<C, F>(ctx, p, &src, &backend, (seg_len + olen).min(0xffff) as u16);
    let rc = ctx.fib(p, 0);
    let sendable = rc == BPF_FIB_LKUP_RET_SUCCESS as i64
        // TC: `bpf_redirect_neigh` resolves the neighbour itself.
        || (!C::XDP && rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64);
    if rc == BPF_FIB_LKUP_RET_FRAG_NEEDED as i64 {
        // SAFETY: the helper wrote the route's MTU into the union.
        let mtu = unsafe { p.__bindgen_anon_1.mtu_result } as u64;
        if !df {
            return TOO_BIG_NO_DF;
        }
        return TOO_BIG | (mtu.saturating_sub(olen as u64)) << 32;
    }
    if !sendable {
        stats::count_flow(route::fib_fallback(rc));
        return UNROUTABLE;
    }
    let verdict = if C::XDP {
        match route::xdp_out_index(ctx.ingress_ifindex(), p.ifindex) {
            Some(v) => v as i64,
            None => {
                stats::count_flow(FlowStat::FwdDevice);
                return UNROUTABLE;
            }
        }
    } else {
        0
    };
    if ctx.push_outer(olen as u32, !F::IP_CHECKSUM).is_none() {
        return UNROUTABLE;
    }
    let ok = if F::IP_CHECKSUM {
        write_outer4(ctx, l3, tos, (inner_len + olen) as u16, &src, &backend)
    } else {
        write_outer6(ctx, l3, tos, inner_len as u16, &src, &backend)
    };
    if ok.is_none() {
        // The frame is half made: it cannot go anywhere.
        return UNROUTABLE;
    }
    stats::count_flow(FlowStat::DsrEncapsulated);
    let verdict = if C::XDP {
        let _ = ctx.store(eth::DST, &p.dmac);
        let _ = ctx.store(eth::SRC, &p.smac);
        verdict
    } else {
        // SAFETY: no neighbour parameters: the helper looks the next hop
        // up for the packet's (outer) destination itself.
        unsafe { bpf_redirect_neigh(p.ifindex, core::ptr::null_mut(), 0, 0) }
    };
    SENT | (verdict as u32 as u64) << 32
}

/// The length of the packets an skb is sent as: itself, or for an
/// aggregate of TCP or UDP segments (GSO, as GRO builds at ingress) each
/// segment's, its headers and `gso_size` bytes of payload.
#[inline(always)]
fn segment_len<C: Ctx>(ctx: &C, l3: usize, ip_len: usize) -> usize {
    let gso = ctx.gso_size() as usize;
    if gso == 0 {
        return ip_len;
    }
    // The L4 header's start and length; past options and extension
    // headers the estimate is short, never long, of the real one by what
    // they hold (the kernel's own check then catches the rest).
    let l4 = if let Some(first) = load::<C, u8>(ctx, l3)
        && first >> 4 == 4
    {
        ((first & 0x0f) as usize) * 4
    } else {
        ip6::HLEN
    };
    let l4_hdr = match load::<C, [u8; 2]>(ctx, l3 + l4 + l4::TCP_DOFF) {
        Some([doff, _]) if doff >> 4 >= 5 => ((doff >> 4) as usize) * 4,
        _ => l4::UDP_HLEN,
    };
    (l4 + l4_hdr + gso).min(ip_len)
}

/// The outer IPv4 header: DSCP/ECN copied, "don't fragment" (the frame
/// was checked to fit, and a fragment of it would not be DSR's anyway),
/// TTL 64, protocol IPIP, checksum.
#[inline(always)]
fn write_outer4<C: Ctx, A: Addr>(ctx: &C, l3: usize, tos: u8, tot_len: u16, src: &A, dst: &A) -> Option<()> {
    // SAFETY: IPv4 here: the addresses are one word.
    let (s, d) = unsafe { (*(src as *const A as *const u32), *(dst as *const A as *const u32)) };
    let mut h = [0u16; 10];
    h[0] = u16::from_ne_bytes([0x45, tos]);
    h[1] = tot_len.to_be();
    h[3] = IP_DF_BE;
    h[4] = u16::from_ne_bytes([64, dataplane_common::proto::IPIP]);
    h[6] = s as u16;
    h[7] = (s >> 16) as u16;
    h[8] = d as u16;
    h[9] = (d >> 16) as u16;
    let mut sum = 0u32;
    let mut i = 0;
    while i < 10 {
        sum += h[i] as u32;
        i += 1;
    }
    h[5] = !crate::csum::fold(sum);
    ctx.store(l3, &h)
}

/// The outer IPv6 header: traffic class copied, flow label 0, next header
/// IPv6, hop limit 64.
#[inline(always)]
fn write_outer6<C: Ctx, A: Addr>(ctx: &C, l3: usize, tc: u8, payload: u16, src: &A, dst: &A) -> Option<()> {
    // SAFETY: IPv6 here: the addresses are four words.
    let (s, d) = unsafe { (*(src as *const A as *const Ip6), *(dst as *const A as *const Ip6)) };
    let first: [u8; 8] = [
        0x60 | (tc >> 4),
        tc << 4,
        0,
        0,
        (payload >> 8) as u8,
        payload as u8,
        dataplane_common::proto::IPV6_IN_IP,
        64,
    ];
    ctx.store(l3, &first)?;
    ctx.store(l3 + ip6::SADDR, &s)?;
    ctx.store(l3 + ip6::DADDR, &d)
}

/// The backend node: an encapsulated packet for a local backend through a
/// frontend served by DSR loses its outer header and is translated to the
/// backend, its flow's entries kept (the reply side restoring the
/// frontend); anything else passes untouched. Returns the event (`Pass`:
/// untouched) and whether it was translated.
#[inline(never)]
pub fn decap<C: Ctx, F: Family>(ctx: &C, cfg: &DpConfig, l3: usize) -> Event {
    if l3 != eth::HLEN {
        return Event::Pass;
    }
    let olen = core::mem::size_of::<F::Hdr>();
    // The outer header: no options, not a fragment (IPv4), the inner
    // packet right behind it (IPv6: no extension headers, checked by the
    // caller's parse: its protocol is the encapsulation's).
    let (Some([first, _]), Some(frag), Some(backend)) = (
        load::<C, [u8; 2]>(ctx, l3),
        load::<C, u16>(ctx, l3 + ip::FRAG_OFF),
        load::<C, F::A>(ctx, l3 + F::DADDR),
    ) else {
        return Event::Pass;
    };
    if F::IP_CHECKSUM && (first != 0x45 || frag & !IP_DF_BE != 0) {
        return Event::Pass;
    }
    let Ok(inner) = F::parse(ctx, l3 + olen) else {
        return Event::Pass;
    };
    let t = inner.tuple;
    let now = ct::now();
    // A flow this node knows (entries from an earlier packet): it must
    // translate to this backend. Else a frontend this node serves by DSR,
    // with this backend.
    let mut target = None;
    let mut service_id = 0;
    if let Some(e) = ct::lookup::<F>(cfg, &t, now) {
        let en = e.get();
        let (role, flags, daddr, dport, sid) =
            (en.role(), en.flags, en.nat_daddr, en.nat_dport, en.service_id);
        if role == ct_flags::FWD_IN && flags & (ct_flags::DSR | ct_flags::SNAT) == 0 && daddr == backend {
            target = Some((daddr, dport, 0u32));
            service_id = sid;
        }
    }
    let established = target.is_some();
    if target.is_none() {
        let mut key = DsrKey {
            address: t.daddr,
            backend,
            port: t.dport,
            proto: t.proto,
            _pad: 0,
        };
        // SAFETY (both): map values copied out.
        let v = match unsafe { F::dsr().get(&key).copied() } {
            Some(v) => Some(v),
            None => {
                // A NodePort: the client reached another node's address.
                // SAFETY: an address is plain words (see `zero`).
                unsafe { crate::zero::clear(&mut key.address) };
                unsafe { F::dsr().get(&key).copied() }
            }
        };
        let Some(v) = v else {
            return Event::Pass;
        };
        let Some(be) = F::backends().get(v.backend_id).copied() else {
            return Event::Pass;
        };
        if be.flags & backend_flags::ACTIVE == 0 || be.address != backend {
            return Event::Pass;
        }
        target = Some((be.address, be.port, v.backend_id));
        service_id = v.service_id;
    }
    let Some((daddr, dport, backend_id)) = target else {
        return Event::Pass;
    };
    if !established {
        let mut slot = core::mem::MaybeUninit::<Choice<F::A>>::uninit();
        // SAFETY: integers and booleans: all zeroes is a valid `Choice`
        // (zeroed without `memset`, see `zero`).
        let choice = unsafe { crate::zero::zeroed(&mut slot) };
        choice.backend_id = backend_id;
        choice.backend.address = daddr;
        choice.backend.port = dport;
        choice.backend.proto = t.proto;
        choice.backend.flags = backend_flags::ACTIVE | backend_flags::LOCAL;
        choice.service_id = service_id;
        let mut event = ct::clear_tuple::<F>(cfg, &t, choice, now);
        if event == Event::NewFlow {
            event = ct::create::<F>(cfg, &t, choice, now);
        }
        if event != Event::NewFlow {
            return event;
        }
    }
    if ctx.pop_outer(olen as u32, !F::IP_CHECKSUM).is_none() {
        return Event::Malformed;
    }
    // Pointers moved: the inner packet, parsed where it now lies.
    let Ok(pkt) = F::parse(ctx, l3) else {
        return Event::Malformed;
    };
    if nat::rewrite::<C, F>(ctx, &pkt, Side::Dst, &daddr, dport).is_none() {
        return Event::Malformed;
    }
    if established && let Some(e) = ct::lookup::<F>(cfg, &t, now) {
        ct::touch::<F>(&t, e, now, pkt.tcp_flags);
    }
    stats::count_service(service_id, pkt.tot_len as u64);
    stats::count_flow(FlowStat::DsrDecapsulated);
    // Nothing for the egress hook to rewrite in this packet (XDP host
    // routing delivers it as it is).
    route::leave::<C, F::A>(cfg, crate::maps::forward::NONE, &daddr, 0);
    if established {
        Event::Established
    } else {
        Event::NewFlow
    }
}
