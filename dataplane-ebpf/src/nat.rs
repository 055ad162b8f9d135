//! The NAT rewrite: one side's address and port of a parsed packet replaced,
//! with every checksum that covers them. Written once, over the context's
//! primitive operations (`Ctx::store`, `Ctx::l3_csum_add`,
//! `Ctx::l4_csum_add`, `Ctx::sctp_crc_set`), as Cilium builds one rewrite for
//! `bpf/ctx/{xdp,skb}.h`: what differs between XDP and TC is only how a
//! checksum is updated (see `ctx`).

use dataplane_common::{addr::Addr, proto, sctp};

use crate::{
    csum,
    ctx::Ctx,
    family::Family,
    hdr::{Pkt, ip, l4},
};

/// Which half of the tuple a hook rewrites: destinations where packets
/// enter the node, sources where they leave it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Src,
    Dst,
}

/// Rewrites `side`'s address and port to `addr:port` (port in network
/// order), with the IPv4 header checksum and the L4 checksum (TCP, UDP) or
/// CRC32c (SCTP). `None` for another protocol (the packet untouched).
///
/// Every part is written whether it changed or not: a branch per part would
/// double the paths the verifier walks after each rewrite (XDP's program is
/// near its budget), and an unchanged part's checksum delta is zero.
#[inline(always)]
pub fn rewrite<C: Ctx, F: Family>(
    ctx: &C,
    pkt: &Pkt<F::A>,
    side: Side,
    addr: &F::A,
    port: u16,
) -> Option<()> {
    let addr = *addr;
    let t = &pkt.tuple;
    let (addr_off, port_off, old_addr, old_port) = match side {
        Side::Src => (F::SADDR, l4::SPORT, t.saddr, t.sport),
        Side::Dst => (F::DADDR, l4::DPORT, t.daddr, t.dport),
    };
    // Everything that can fail is decided before the first write; a
    // packet's headers are in the directly readable data (`Pkt`), so the
    // writes do not fail, and the rewrite happens whole or not at all (TC:
    // but for the first helper call, which may have to copy a cloned skb's
    // head and fail to allocate, leaving the packet untouched).
    let sctp = t.proto == proto::SCTP;
    if !(sctp || t.proto == proto::TCP || t.proto == proto::UDP) {
        return None;
    }
    let sctp_len = if sctp {
        (pkt.tot_len as usize).checked_sub(pkt.l4 - pkt.l3)? as u32
    } else {
        0
    };
    let addr_diff = old_addr.csum_diff(&addr);
    if F::IP_CHECKSUM {
        ctx.l3_csum_add(pkt.l3 + ip::CHECK, addr_diff)?;
    }
    if sctp {
        // SCTP's CRC32c has no pseudo-header: only a port change changes
        // it, by a delta computed from the change alone (see
        // `dataplane_common::sctp`).
        ctx.store(pkt.l3 + addr_off, &addr)?;
        if old_port != port {
            ctx.sctp_crc_set(
                pkt.l4 + l4::SCTP_CHECK,
                sctp_delta(sctp_len, port_off as u32, old_port, port),
            )?;
            ctx.store_unbalanced(pkt.l4 + port_off, &port)?;
        }
        return Some(());
    }
    ctx.l4_csum_add(
        pkt.l4_check(),
        addr_diff,
        csum::diff16(old_port, port),
        t.proto == proto::UDP,
    )?;
    ctx.store(pkt.l3 + addr_off, &addr)?;
    ctx.store(pkt.l4 + port_off, &port)
}

/// The CRC32c change of an SCTP port rewrite (see `dataplane_common::sctp`):
/// a subprogram, so that the verifier walks its loops once and prunes the
/// later calls, instead of once per path that inlines it.
#[inline(never)]
fn sctp_delta(len: u32, offset: u32, old: u16, new: u16) -> u32 {
    sctp::crc32c_delta16(len, offset, old, new)
}
