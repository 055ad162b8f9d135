//! One packet path, two program types: what differs between XDP and TC is
//! behind [`Ctx`] (as Cilium's `bpf/ctx/{xdp,skb}.h`), so the translation
//! logic in `path`, `icmp` and `nat` is written once.
//!
//! - Memory: both give direct packet access; an skb may hold part of the
//!   packet in fragments, so TC first pulls the headers into the linear area.
//! - Checksums: XDP sees frames as they came off the wire, with complete
//!   checksums, and updates them incrementally (RFC 1624). An skb's L4
//!   checksum may be CHECKSUM_PARTIAL (a pseudo-header sum awaiting
//!   offload) or covered by `skb->csum` (CHECKSUM_COMPLETE): only the
//!   kernel's csum helpers know, so TC rewrites go through them.
//! - Sending a packet back where it came from: `XDP_TX`, or a redirect to
//!   the ingress device's egress for TC.

use aya_ebpf::{
    bindings::{
        BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, BPF_F_ADJ_ROOM_ENCAP_L3_IPV4,
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV6, BPF_F_ADJ_ROOM_FIXED_GSO, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR,
        BPF_F_RECOMPUTE_CSUM, TC_ACT_OK, TC_ACT_SHOT,
        bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
        bpf_fib_lookup,
        xdp_action::{XDP_DROP, XDP_PASS, XDP_TX},
    },
    helpers::{
        bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_skb_adjust_room, bpf_skb_change_tail,
        bpf_xdp_adjust_head, bpf_xdp_adjust_tail,
    },
    programs::{TcContext, XdpContext},
};
use dataplane_common::{addr::Addr, config::DpConfig, hint, proto, sctp};

use crate::{
    csum,
    family::Family,
    parse::{Pkt, ip, l4},
    unaligned,
};

/// Which half of the tuple a hook rewrites: destinations where packets
/// enter the node, sources where they leave it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Src,
    Dst,
}

/// Bytes of headers the TC programs make directly readable: L2 with two
/// tags, an IPv4 header with options, and an ICMP error's quote (IP header
/// and 8 bytes of L4) behind its own 8-byte header.
pub const PULL_LEN: u32 = 14 + 8 + 60 + 8 + 20 + 8 + 10;

pub trait Ctx {
    /// The program type's return value.
    type Verdict: Copy + Into<i64> + FromVerdict;
    const PASS: Self::Verdict;
    const DROP: Self::Verdict;
    /// Whether [`Ctx::leave_hint`] reaches egress (TC), so that ingress
    /// computes a word at all.
    const HINTS: bool;

    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
    /// The whole packet's length (an skb's can exceed the linear part).
    fn packet_len(&self) -> usize;
    /// Makes the headers directly readable when they are not yet (TC: pulls
    /// up to [`PULL_LEN`] bytes into the linear area; pointers must be
    /// derived after this). Returns whether it moved anything, i.e. whether
    /// a parse that ran short may now succeed. Pulling is not free: on a
    /// cloned skb (every TCP segment a local socket sends) it copies the
    /// head, so the path pulls only when a parse ran short or before a
    /// reject or an ICMP error's quote is read.
    fn pull_headers(&self) -> bool;
    /// Rewrites one side's address and port, with the IP (IPv4) and L4
    /// checksums.
    fn rewrite<F: Family>(&self, pkt: &Pkt<F::A>, side: Side, addr: F::A, port: u16) -> Option<()>;
    /// Stores `value` at `offset`; the caller keeps the checksums right.
    fn store<T: Copy>(&self, offset: usize, value: &T) -> Option<()>;

    /// XDP: forwards translated packets itself under host routing, and
    /// cannot hand an encapsulated packet to the stack (`route`, `dsr`).
    const XDP: bool;

    /// Host routing: sends a translated packet straight to its route's
    /// device (see `route`); `None` leaves it to the stack.
    fn route(&self, cfg: &DpConfig) -> Option<Self::Verdict>;

    /// The device the packet came in on.
    fn ingress_ifindex(&self) -> u32;
    /// Copies `len` bytes of the packet from its start to `to` (through the
    /// helper: also beyond the linear part). Whether it could.
    fn load_bytes(&self, to: *mut u8, len: u32) -> bool;
    /// The payload bytes per segment of an aggregated (GSO) packet; 0 for
    /// a plain one (always, in XDP).
    fn gso_size(&self) -> u32;
    /// `bpf_fib_lookup` for this packet's context; the helper's return code.
    fn fib(&self, p: &mut bpf_fib_lookup, flags: u32) -> i64;
    /// Makes room for an outer IP header (`v6`: IPv6) of `len` bytes
    /// between the Ethernet header (untagged) and the IP packet; the
    /// Ethernet header stays in front. Pointers must be derived again.
    fn push_outer(&self, len: u32, v6: bool) -> Option<()>;
    /// Removes the `len` bytes after the Ethernet header (an outer IP
    /// header), keeping the Ethernet header in front.
    fn pop_outer(&self, len: u32, v6: bool) -> Option<()>;
    /// Whether a new DSR flow's packets can be sent to `backend`'s node
    /// from this hook: TC always can (`bpf_redirect_neigh` resolves the
    /// next hop); XDP when the FIB names a complete route through a device
    /// it can send to.
    fn dsr_sendable<F: Family>(&self, cfg: &DpConfig, backend: &F::A) -> bool;

    /// Ingress: leaves `word` on the packet for the egress hook (see
    /// `dataplane_common::hint`); XDP has nowhere to leave it.
    fn leave_hint(&self, word: u16);
    /// Egress: the word ingress left (0: none), cleared on the packet so
    /// that it does not travel on. Trust it only if [`Ctx::hint_trusted`].
    fn take_hint(&self) -> u16;
    /// Whether the device the packet came in through is one whose ingress
    /// word egress may trust (the agent's bitmap).
    fn hint_trusted(&self) -> bool;

    /// Replaces the packet by an L2 header with swapped MAC addresses (tags
    /// kept) followed by `l3_frame`, and sends it back out of the device it
    /// came in on. `l3` is the L2 header's length.
    fn send_back<const N: usize>(&self, l3: usize, l3_frame: &[u8; N]) -> Option<Self::Verdict>;
}

/// Rewrites an SCTP skb's address (IPv4: and the IP header checksum) and
/// port. SCTP's CRC32c has no pseudo-header: only a port change changes
/// it, by a delta computed from the change alone (see
/// `dataplane_common::sctp`); an skb with CRC offload pending recomputes
/// the field anyway. (XDP's twin is inline in its `rewrite`.)
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn rewrite_sctp_tc<F: Family>(
    ctx: &TcContext,
    pkt: &Pkt<F::A>,
    addr_off: usize,
    port_off: usize,
    old_addr: F::A,
    addr: F::A,
    old_port: u16,
    port: u16,
) -> Option<()> {
    let sctp_len = (pkt.tot_len as usize).checked_sub(pkt.l4 - pkt.l3)? as u32;
    // Through the load helper: offsets past variable-length headers.
    let crc: u32 = TcContext::load(ctx, pkt.l4 + l4::SCTP_CHECK).ok()?;
    if F::IP_CHECKSUM && old_addr != addr {
        ctx.l3_csum_replace(pkt.l3 + ip::CHECK, 0, old_addr.csum_diff(&addr) as u64, 0)
            .ok()?;
    }
    Ctx::store(ctx, pkt.l3 + addr_off, &addr)?;
    if old_port != port {
        // Stored little-endian: the CRC value as read on this little-endian
        // target.
        let delta = sctp_delta(sctp_len, port_off as u32, old_port, port);
        // Not compensated within the one's-complement sums: a
        // CHECKSUM_COMPLETE skb's sum is updated too.
        let recompute = BPF_F_RECOMPUTE_CSUM as u64;
        TcContext::store(
            ctx,
            pkt.l4 + l4::SCTP_CHECK,
            &sctp::rewritten_crc(crc, delta),
            recompute,
        )
        .ok()?;
        TcContext::store(ctx, pkt.l4 + port_off, &port, recompute).ok()?;
    }
    Some(())
}

/// The CRC32c change of an SCTP port rewrite (see `dataplane_common::sctp`):
/// a subprogram, so that the verifier walks its loops once and prunes the
/// later calls, instead of once per path that inlines it.
#[inline(never)]
fn sctp_delta(len: u32, offset: u32, old: u16, new: u16) -> u32 {
    sctp::crc32c_delta16(len, offset, old, new)
}

/// Pointer to a `T` at `offset`, if the whole `T` lies in the linear data.
#[inline(always)]
pub fn ptr_at<C: Ctx, T>(ctx: &C, offset: usize) -> Option<*mut T> {
    let start = ctx.data();
    if start + offset + core::mem::size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some((start + offset) as *mut T)
}

/// Reads a `T` at `offset` (headers are not aligned in general).
#[inline(always)]
pub fn load<C: Ctx, T: Copy>(ctx: &C, offset: usize) -> Option<T> {
    // SAFETY: bounds checked by ptr_at; an unaligned read of plain bytes.
    ptr_at::<C, T>(ctx, offset).map(|p| unsafe { unaligned::read(p) })
}

impl Ctx for XdpContext {
    type Verdict = u32;
    const PASS: u32 = XDP_PASS;
    const DROP: u32 = XDP_DROP;
    const HINTS: bool = false;

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
    #[inline(always)]
    fn pull_headers(&self) -> bool {
        false
    }

    #[inline(always)]
    fn rewrite<F: Family>(&self, pkt: &Pkt<F::A>, side: Side, addr: F::A, port: u16) -> Option<()> {
        let t = &pkt.tuple;
        let (addr_off, port_off, old_addr, old_port) = match side {
            Side::Src => (F::SADDR, l4::SPORT, t.saddr, t.sport),
            Side::Dst => (F::DADDR, l4::DPORT, t.daddr, t.dport),
        };
        // Every pointer is checked before the first write, so the frame is
        // either fully rewritten or untouched.
        let ip_check = ptr_at::<_, u16>(self, pkt.l3 + ip::CHECK)?;
        let addr_ptr = ptr_at::<_, F::A>(self, pkt.l3 + addr_off)?;
        let l4h = ptr_at::<_, [u8; l4::UDP_HLEN]>(self, pkt.l4)? as usize;
        if t.proto == proto::SCTP {
            let crc_ptr = ptr_at::<_, u32>(self, pkt.l4 + l4::SCTP_CHECK)?;
            let sctp_len = (pkt.tot_len as usize).checked_sub(pkt.l4 - pkt.l3)? as u32;
            // SAFETY: all pointers are inside the frame (checked above).
            unsafe {
                if F::IP_CHECKSUM {
                    unaligned::write(
                        ip_check,
                        csum::apply(unaligned::read(ip_check), old_addr.csum_diff(&addr)),
                    );
                }
                unaligned::write(addr_ptr, addr);
                if old_port != port {
                    let delta = sctp_delta(sctp_len, port_off as u32, old_port, port);
                    unaligned::write(crc_ptr, sctp::rewritten_crc(unaligned::read(crc_ptr), delta));
                    unaligned::write((l4h + port_off) as *mut u16, port);
                }
            }
            return Some(());
        }
        let l4_check = match t.proto {
            proto::TCP => ptr_at::<_, u16>(self, pkt.l4 + l4::TCP_CHECK)?,
            proto::UDP => (l4h + l4::UDP_CHECK) as *mut u16,
            _ => return None,
        };
        let addr_diff = old_addr.csum_diff(&addr);
        // SAFETY: all pointers are inside the frame (checked above); plain
        // unaligned stores of header fields.
        unsafe {
            if F::IP_CHECKSUM {
                unaligned::write(ip_check, csum::apply(unaligned::read(ip_check), addr_diff));
            }
            unaligned::write(addr_ptr, addr);
            let old = unaligned::read(l4_check);
            // A zero UDP checksum means "none" (IPv4): it stays zero.
            if !(t.proto == proto::UDP && old == 0) {
                let mut new = csum::apply(old, addr_diff + csum::diff16(old_port, port));
                if t.proto == proto::UDP && new == 0 {
                    new = 0xffff;
                }
                unaligned::write(l4_check, new);
            }
            unaligned::write((l4h + port_off) as *mut u16, port);
        }
        Some(())
    }

    const XDP: bool = true;

    #[inline(always)]
    fn route(&self, cfg: &DpConfig) -> Option<u32> {
        crate::route::xdp(self, cfg)
    }

    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        // SAFETY: reads the context's field.
        unsafe { (*self.ctx).ingress_ifindex }
    }

    #[inline(always)]
    fn load_bytes(&self, to: *mut u8, len: u32) -> bool {
        // SAFETY: helper on our own context, into `len` writable bytes.
        unsafe { aya_ebpf::helpers::bpf_xdp_load_bytes(self.ctx, 0, to.cast(), len) == 0 }
    }

    #[inline(always)]
    fn gso_size(&self) -> u32 {
        0
    }

    #[inline(always)]
    fn fib(&self, p: &mut bpf_fib_lookup, flags: u32) -> i64 {
        // SAFETY: the helper reads and writes `p`, whose size is passed.
        unsafe {
            fib_lookup(
                self.ctx as *mut _,
                p,
                core::mem::size_of::<bpf_fib_lookup>() as i32,
                flags,
            )
        }
    }

    #[inline(always)]
    fn push_outer(&self, len: u32, _v6: bool) -> Option<()> {
        let eth: [u8; 14] = load(self, 0)?;
        // SAFETY: helper on our own context; pointers are derived after it.
        if unsafe { bpf_xdp_adjust_head(self.ctx, -(len as i32)) } != 0 {
            return None;
        }
        self.store(0, &eth)
    }

    #[inline(always)]
    fn pop_outer(&self, len: u32, _v6: bool) -> Option<()> {
        let eth: [u8; 14] = load(self, 0)?;
        // SAFETY: as above.
        if unsafe { bpf_xdp_adjust_head(self.ctx, len as i32) } != 0 {
            return None;
        }
        self.store(0, &eth)
    }

    #[inline(always)]
    fn dsr_sendable<F: Family>(&self, cfg: &DpConfig, backend: &F::A) -> bool {
        crate::dsr::reachable_xdp::<F>(self, cfg, backend)
    }

    #[inline(always)]
    fn leave_hint(&self, _word: u16) {}

    #[inline(always)]
    fn take_hint(&self) -> u16 {
        0
    }

    #[inline(always)]
    fn hint_trusted(&self) -> bool {
        false
    }

    #[inline(always)]
    fn store<T: Copy>(&self, offset: usize, value: &T) -> Option<()> {
        let p = ptr_at::<_, T>(self, offset)?;
        // SAFETY: bounds checked by ptr_at.
        unsafe { unaligned::write(p, *value) };
        Some(())
    }

    #[inline(always)]
    fn send_back<const N: usize>(&self, l3: usize, l3_frame: &[u8; N]) -> Option<u32> {
        // The MAC addresses and what follows them up to L3 (tags, ethertype).
        let macs: [u8; 12] = load(self, 0)?;
        let l2_rest: [u8; 10] = load(self, 12)?;
        let delta = (l3 + N) as i32 - self.packet_len() as i32;
        if delta < 0 {
            // SAFETY: helper on our own context; pointers are re-derived
            // after it.
            if unsafe { bpf_xdp_adjust_tail(self.ctx, delta) } != 0 {
                return None;
            }
        } else if delta > 0 {
            // The mask keeps the bound visible to the verifier.
            if delta > 63 {
                return None;
            }
            let grow = (delta as u32 & 0x3f) as i32;
            // Grow at the head, which every driver supports (tail growth
            // fails on some, veth among them), and move the tags and the
            // ethertype to the new start.
            // SAFETY: as above.
            if unsafe { bpf_xdp_adjust_head(self.ctx, -grow) } != 0 {
                return None;
            }
            let r = l2_rest;
            match l3 {
                14 => self.store(12, &[r[0], r[1]])?,
                18 => self.store(12, &[r[0], r[1], r[2], r[3], r[4], r[5]])?,
                22 => self.store(12, &r)?,
                _ => return None,
            }
        }
        let mut swapped = [0u8; 12];
        swapped[..6].copy_from_slice(&macs[6..]);
        swapped[6..].copy_from_slice(&macs[..6]);
        self.store(0, &swapped)?;
        self.store(l3, l3_frame)?;
        Some(XDP_TX)
    }
}

impl Ctx for TcContext {
    type Verdict = i32;
    const PASS: i32 = TC_ACT_OK;
    const DROP: i32 = TC_ACT_SHOT;
    const HINTS: bool = true;

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

    #[inline(always)]
    fn pull_headers(&self) -> bool {
        let len = self.len();
        let want = if len < PULL_LEN { len } else { PULL_LEN };
        if (TcContext::data_end(self) - TcContext::data(self)) as u32 >= want {
            return false;
        }
        // A failure leaves the headers where they were: the bounds checks
        // of every later read then treat the packet as truncated.
        self.pull_data(want).is_ok()
    }

    #[inline(always)]
    fn rewrite<F: Family>(&self, pkt: &Pkt<F::A>, side: Side, addr: F::A, port: u16) -> Option<()> {
        let t = &pkt.tuple;
        let (addr_off, port_off, old_addr, old_port) = match side {
            Side::Src => (F::SADDR, l4::SPORT, t.saddr, t.sport),
            Side::Dst => (F::DADDR, l4::DPORT, t.daddr, t.dport),
        };
        if t.proto == proto::SCTP {
            return rewrite_sctp_tc::<F>(self, pkt, addr_off, port_off, old_addr, addr, old_port, port);
        }
        let l4_check = pkt.l4_check();
        let mangled = if t.proto == proto::UDP {
            BPF_F_MARK_MANGLED_0
        } else {
            0
        } as u64;
        if old_addr != addr {
            // The helpers' "by difference" form (field size 0) takes a
            // checksum delta, whatever the address's size.
            let diff = old_addr.csum_diff(&addr) as u64;
            self.l4_csum_replace(l4_check, 0, diff, BPF_F_PSEUDO_HDR as u64 | mangled)
                .ok()?;
            if F::IP_CHECKSUM {
                self.l3_csum_replace(pkt.l3 + ip::CHECK, 0, diff, 0).ok()?;
            }
            TcContext::store(self, pkt.l3 + addr_off, &addr, 0).ok()?;
        }
        if old_port != port {
            self.l4_csum_replace(l4_check, old_port as u64, port as u64, mangled | 2)
                .ok()?;
            TcContext::store(self, pkt.l4 + port_off, &port, 0).ok()?;
        }
        Some(())
    }

    const XDP: bool = false;

    #[inline(always)]
    fn route(&self, _cfg: &DpConfig) -> Option<i32> {
        crate::route::tc(self)
    }

    // `ifindex`, not `ingress_ifindex` (`skb_iif`): the same device at TC
    // ingress, and the one BPF_PROG_TEST_RUN lets a test set.
    #[allow(clippy::misnamed_getters)]
    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        // SAFETY: reads the context's field (at ingress, the device the
        // packet came in on).
        unsafe { (*self.skb.skb).ifindex }
    }

    #[inline(always)]
    fn load_bytes(&self, to: *mut u8, len: u32) -> bool {
        // SAFETY: helper on our own context, into `len` writable bytes.
        unsafe { aya_ebpf::helpers::bpf_skb_load_bytes(self.skb.skb.cast(), 0, to.cast(), len) == 0 }
    }

    #[inline(always)]
    fn gso_size(&self) -> u32 {
        // SAFETY: reads the context's field.
        unsafe { (*self.skb.skb).gso_size }
    }

    #[inline(always)]
    fn fib(&self, p: &mut bpf_fib_lookup, flags: u32) -> i64 {
        // SAFETY: as XDP's.
        unsafe {
            fib_lookup(
                self.skb.skb as *mut _,
                p,
                core::mem::size_of::<bpf_fib_lookup>() as i32,
                flags,
            )
        }
    }

    #[inline(always)]
    fn push_outer(&self, len: u32, v6: bool) -> Option<()> {
        // FIXED_GSO: a GSO packet's segments keep their size, each grows by
        // the outer header; the ENCAP flag makes its segmentation build
        // the outer header for each.
        let encap = if v6 {
            BPF_F_ADJ_ROOM_ENCAP_L3_IPV6
        } else {
            BPF_F_ADJ_ROOM_ENCAP_L3_IPV4
        };
        let flags = (BPF_F_ADJ_ROOM_FIXED_GSO | encap) as u64;
        // SAFETY: helper on our own context.
        let rc = unsafe { bpf_skb_adjust_room(self.skb.skb, len as i32, BPF_ADJ_ROOM_MAC, flags) };
        (rc == 0).then_some(())
    }

    #[inline(always)]
    fn dsr_sendable<F: Family>(&self, _cfg: &DpConfig, _backend: &F::A) -> bool {
        true
    }

    #[inline(always)]
    fn pop_outer(&self, len: u32, v6: bool) -> Option<()> {
        let decap = if v6 {
            BPF_F_ADJ_ROOM_DECAP_L3_IPV6
        } else {
            BPF_F_ADJ_ROOM_DECAP_L3_IPV4
        };
        let flags = (BPF_F_ADJ_ROOM_FIXED_GSO | decap) as u64;
        // SAFETY: as above.
        let rc = unsafe { bpf_skb_adjust_room(self.skb.skb, -(len as i32), BPF_ADJ_ROOM_MAC, flags) };
        (rc == 0).then_some(())
    }

    #[inline(always)]
    fn leave_hint(&self, word: u16) {
        // The kernel sets the skb's `tc_index` from `tc_classid` when a TC
        // program passes a packet (TCX: all of it; clsact: its minor half),
        // and leaves it alone when the program redirects it (host routing):
        // both are written.
        // SAFETY: the program's own context; both are fields a TC program
        // may write.
        unsafe {
            (*self.skb.skb).tc_classid = word as u32;
            (*self.skb.skb).tc_index = word as u32;
        }
    }

    #[inline(always)]
    fn take_hint(&self) -> u16 {
        // SAFETY: as above. `tc_classid` is the skb's control block, which
        // the IP layer used on the way here: cleared, so that the kernel
        // leaves `tc_index` at 0 when this program passes the packet.
        unsafe {
            let word = (*self.skb.skb).tc_index as u16;
            (*self.skb.skb).tc_classid = 0;
            word
        }
    }

    #[inline(always)]
    fn hint_trusted(&self) -> bool {
        // SAFETY: reads the context's `ingress_ifindex` (`skb_iif`).
        let iif = unsafe { (*self.skb.skb).ingress_ifindex };
        hint::device_slot(iif)
            .is_some_and(|(w, bit)| crate::maps::HINT_DEVICES.get(w).is_some_and(|v| *v & bit != 0))
    }

    #[inline(always)]
    fn store<T: Copy>(&self, offset: usize, value: &T) -> Option<()> {
        // Callers compensate every change within the covered checksums, so
        // a CHECKSUM_COMPLETE skb's sum stays right without recomputation.
        TcContext::store(self, offset, value, 0).ok()
    }

    #[inline(always)]
    fn send_back<const N: usize>(&self, l3: usize, l3_frame: &[u8; N]) -> Option<i32> {
        let macs: [u8; 12] = load(self, 0)?;
        if l3 > 22 {
            return None;
        }
        // SAFETY: helper on our own context.
        if unsafe { bpf_skb_change_tail(self.skb.skb, (l3 + N) as u32, 0) } != 0 {
            return None;
        }
        let mut swapped = [0u8; 12];
        swapped[..6].copy_from_slice(&macs[6..]);
        swapped[6..].copy_from_slice(&macs[..6]);
        Ctx::store(self, 0, &swapped)?;
        Ctx::store(self, l3, l3_frame)?;
        // SAFETY: reads the context's ifindex; helper without pointers.
        let ifindex = unsafe { (*self.skb.skb).ifindex };
        Some(unsafe { bpf_redirect(ifindex, 0) } as i32)
    }
}

/// A verdict from the high half of a packed `path::Step`.
pub trait FromVerdict {
    fn from_packed(packed: u64) -> Self;
}

impl FromVerdict for u32 {
    #[inline(always)]
    fn from_packed(packed: u64) -> Self {
        (packed >> 32) as u32
    }
}

impl FromVerdict for i32 {
    #[inline(always)]
    fn from_packed(packed: u64) -> Self {
        (packed >> 32) as u32 as i32
    }
}
