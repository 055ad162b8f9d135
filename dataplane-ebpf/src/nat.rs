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

/// The tuple a packet is rewritten to.
#[derive(Clone, Copy)]
pub struct Nat {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
}

impl Nat {
    #[inline(always)]
    pub fn of(e: &Ct4Entry) -> Self {
        Self {
            saddr: e.nat_saddr,
            daddr: e.nat_daddr,
            sport: e.nat_sport,
            dport: e.nat_dport,
        }
    }
}

/// Rewrites an XDP frame. Every pointer is checked before the first write,
/// so the frame is either fully rewritten or untouched.
#[inline(always)]
pub fn rewrite_xdp(ctx: &XdpContext, pkt: &Ipv4, to: &Nat) -> Option<()> {
    let t = &pkt.tuple;
    let iph = ptr_at::<_, [u8; ip::HLEN]>(ctx, pkt.l3)? as usize;
    let l4 = ptr_at::<_, [u8; 8]>(ctx, pkt.l4)? as usize;
    let l4_check = match t.proto {
        proto::TCP => Some(ptr_at::<_, u16>(ctx, pkt.l4 + 16)?),
        proto::UDP => Some((l4 + 6) as *mut u16),
        _ => None,
    };
    let addr_diff = csum::diff32(t.saddr, to.saddr) + csum::diff32(t.daddr, to.daddr);
    // SAFETY: all pointers are inside the packet (checked above).
    unsafe {
        let check = (iph + ip::CHECK) as *mut u16;
        check.write_unaligned(csum::apply(check.read_unaligned(), addr_diff));
        ((iph + ip::SADDR) as *mut u32).write_unaligned(to.saddr);
        ((iph + ip::DADDR) as *mut u32).write_unaligned(to.daddr);
        if let Some(p) = l4_check {
            let old = p.read_unaligned();
            // A zero UDP checksum means "none": it stays zero.
            if !(t.proto == proto::UDP && old == 0) {
                let diff = addr_diff + csum::diff16(t.sport, to.sport) + csum::diff16(t.dport, to.dport);
                let mut new = csum::apply(old, diff);
                if t.proto == proto::UDP && new == 0 {
                    new = 0xffff;
                }
                p.write_unaligned(new);
            }
            (l4 as *mut u16).write_unaligned(to.sport);
            ((l4 + 2) as *mut u16).write_unaligned(to.dport);
        }
    }
    Some(())
}

/// Rewrites an skb through the kernel's store and csum helpers.
#[inline(always)]
pub fn rewrite_tc(ctx: &TcContext, pkt: &Ipv4, to: &Nat) -> Result<(), i64> {
    let t = &pkt.tuple;
    let ports = t.proto == proto::TCP || t.proto == proto::UDP;
    let l4_check = pkt.l4_check();
    let mangled = if t.proto == proto::UDP { BPF_F_MARK_MANGLED_0 } else { 0 } as u64;
    let pseudo = BPF_F_PSEUDO_HDR as u64 | mangled | 4;
    for (offset, old, new) in [(ip::SADDR, t.saddr, to.saddr), (ip::DADDR, t.daddr, to.daddr)] {
        if old != new {
            if ports {
                ctx.l4_csum_replace(l4_check, old as u64, new as u64, pseudo)?;
            }
            ctx.l3_csum_replace(pkt.l3 + ip::CHECK, old as u64, new as u64, 4)?;
            ctx.store(pkt.l3 + offset, &new, 0)?;
        }
    }
    if ports {
        for (offset, old, new) in [(0, t.sport, to.sport), (2, t.dport, to.dport)] {
            if old != new {
                ctx.l4_csum_replace(l4_check, old as u64, new as u64, mangled | 2)?;
                ctx.store(pkt.l4 + offset, &new, 0)?;
            }
        }
    }
    Ok(())
}
