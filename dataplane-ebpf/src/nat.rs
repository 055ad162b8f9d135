//! Rewriting a packet's addresses and ports, with checksums.
//!
//! XDP sees frames as they came off the wire, with complete checksums: they
//! are updated incrementally here. TC sees skbs whose L4 checksum may be
//! CHECKSUM_PARTIAL (a pseudo-header sum awaiting offload): only the kernel's
//! csum helpers know the skb's state, so TC rewrites go through them.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::{TcContext, XdpContext},
};
use dataplane_common::{ct::Ct4Entry, proto};

use crate::{
    csum,
    packet::{Ipv4, ip, ptr_at},
};

/// Which half of the tuple a hook rewrites: destinations where packets
/// enter the node, sources where they leave it (see `ct::create`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Src,
    Dst,
}

/// The new address and port of one side, from a conntrack entry.
#[inline(always)]
pub fn target(e: &Ct4Entry, side: Side) -> (u32, u16) {
    match side {
        Side::Src => (e.nat_saddr, e.nat_sport),
        Side::Dst => (e.nat_daddr, e.nat_dport),
    }
}

/// Rewrites an XDP frame's destination. Every pointer is checked before
/// the first write, so the frame is either fully rewritten or untouched.
#[inline(always)]
pub fn rewrite_xdp_dst(ctx: &XdpContext, pkt: &Ipv4, daddr: u32, dport: u16) -> Option<()> {
    let t = &pkt.tuple;
    let iph = ptr_at::<_, [u8; ip::HLEN]>(ctx, pkt.l3)? as usize;
    let l4 = ptr_at::<_, [u8; 8]>(ctx, pkt.l4)? as usize;
    let l4_check = match t.proto {
        proto::TCP => ptr_at::<_, u16>(ctx, pkt.l4 + 16)?,
        proto::UDP => (l4 + 6) as *mut u16,
        _ => return None,
    };
    let addr_diff = csum::diff32(t.daddr, daddr);
    // SAFETY: all pointers are inside the packet (checked above).
    unsafe {
        let check = (iph + ip::CHECK) as *mut u16;
        check.write_unaligned(csum::apply(check.read_unaligned(), addr_diff));
        ((iph + ip::DADDR) as *mut u32).write_unaligned(daddr);
        let old = l4_check.read_unaligned();
        // A zero UDP checksum means "none": it stays zero.
        if !(t.proto == proto::UDP && old == 0) {
            let mut new = csum::apply(old, addr_diff + csum::diff16(t.dport, dport));
            if t.proto == proto::UDP && new == 0 {
                new = 0xffff;
            }
            l4_check.write_unaligned(new);
        }
        ((l4 + 2) as *mut u16).write_unaligned(dport);
    }
    Some(())
}

/// Rewrites one side of an skb through the kernel's store and csum helpers.
#[inline(always)]
pub fn rewrite_tc(ctx: &TcContext, pkt: &Ipv4, side: Side, addr: u32, port: u16) -> Result<(), i64> {
    let t = &pkt.tuple;
    let (addr_off, port_off, old_addr, old_port) = match side {
        Side::Src => (ip::SADDR, 0, t.saddr, t.sport),
        Side::Dst => (ip::DADDR, 2, t.daddr, t.dport),
    };
    let l4_check = pkt.l4_check();
    let mangled = if t.proto == proto::UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    } as u64;
    if old_addr != addr {
        ctx.l4_csum_replace(
            l4_check,
            old_addr as u64,
            addr as u64,
            BPF_F_PSEUDO_HDR as u64 | mangled | 4,
        )?;
        ctx.l3_csum_replace(pkt.l3 + ip::CHECK, old_addr as u64, addr as u64, 4)?;
        ctx.store(pkt.l3 + addr_off, &addr, 0)?;
    }
    if old_port != port {
        ctx.l4_csum_replace(l4_check, old_port as u64, port as u64, mangled | 2)?;
        ctx.store(pkt.l4 + port_off, &port, 0)?;
    }
    Ok(())
}
