//! One packet path, two program types: what differs between XDP and TC is
//! behind [`Ctx`] (as Cilium's `bpf/ctx/{xdp,skb}.h`), so the translation
//! logic (`path`, `icmp`, the rewrite in `nat`) is written once over a few
//! primitive operations: loads and stores, checksum updates, room for headers.
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
use dataplane_common::{hint, sctp};

use crate::{csum, maps::HINT_DEVICES, unaligned};

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
    /// Stores `value` at `offset`; the caller keeps the checksums right
    /// (a change every checksum covering it is updated for, with
    /// [`Ctx::l3_csum_add`] and [`Ctx::l4_csum_add`]).
    fn store<T: Copy>(&self, offset: usize, value: &T) -> Option<()>;
    /// Stores a change no one's-complement update balances (SCTP's ports
    /// and CRC): an skb's CHECKSUM_COMPLETE sum is recomputed.
    fn store_unbalanced<T: Copy>(&self, offset: usize, value: &T) -> Option<()>;
    /// Adds the one's-complement delta `diff` (see `csum`) to the IPv4
    /// header checksum at `offset`.
    fn l3_csum_add(&self, offset: usize, diff: u32) -> Option<()>;
    /// Updates the TCP or UDP (`udp`) checksum at `offset` for a change of
    /// `pseudo` in the pseudo-header (an address) and of `l4` in the L4
    /// header (a port), each a one's-complement delta (see `csum`). A UDP
    /// checksum of zero ("none", IPv4) stays zero, and a computed zero is
    /// sent as 0xffff.
    fn l4_csum_add(&self, offset: usize, pseudo: u32, l4: u32, udp: bool) -> Option<()>;
    /// Replaces the SCTP CRC32c at `offset` by the one a change of `delta`
    /// makes (see `dataplane_common::sctp`).
    fn sctp_crc_set(&self, offset: usize, delta: u32) -> Option<()>;

    /// XDP: forwards translated packets itself under host routing, and
    /// cannot hand an encapsulated packet to the stack (`route`, `dsr`).
    const XDP: bool;

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
    fn l3_csum_add(&self, offset: usize, diff: u32) -> Option<()> {
        let p = ptr_at::<_, u16>(self, offset)?;
        // SAFETY: bounds checked by ptr_at.
        unsafe { unaligned::write(p, csum::apply(unaligned::read(p), diff)) };
        Some(())
    }

    #[inline(always)]
    fn l4_csum_add(&self, offset: usize, pseudo: u32, l4: u32, udp: bool) -> Option<()> {
        let p = ptr_at::<_, u16>(self, offset)?;
        // SAFETY: bounds checked by ptr_at.
        let old = unsafe { unaligned::read(p) };
        if udp && old == 0 {
            return Some(());
        }
        let mut new = csum::apply(old, pseudo + l4);
        if udp && new == 0 {
            new = 0xffff;
        }
        // SAFETY: as above.
        unsafe { unaligned::write(p, new) };
        Some(())
    }

    #[inline(always)]
    fn sctp_crc_set(&self, offset: usize, delta: u32) -> Option<()> {
        let p = ptr_at::<_, u32>(self, offset)?;
        // SAFETY: bounds checked by ptr_at; the CRC is stored little-endian,
        // the value as read on this little-endian target.
        unsafe { unaligned::write(p, sctp::rewritten_crc(unaligned::read(p), delta)) };
        Some(())
    }

    #[inline(always)]
    fn store_unbalanced<T: Copy>(&self, offset: usize, value: &T) -> Option<()> {
        // Frames carry no checksum state beside their headers.
        Ctx::store(self, offset, value)
    }

    const XDP: bool = true;

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
    fn l3_csum_add(&self, offset: usize, diff: u32) -> Option<()> {
        // The helpers' "by difference" form (field size 0) takes a checksum
        // delta, whatever the changed field's size.
        self.l3_csum_replace(offset, 0, diff as u64, 0).ok()
    }

    #[inline(always)]
    fn l4_csum_add(&self, offset: usize, pseudo: u32, l4: u32, udp: bool) -> Option<()> {
        // The kernel knows whether the checksum is CHECKSUM_PARTIAL (a
        // pseudo-header sum awaiting offload: only the pseudo-header's
        // change touches it) or covered by a CHECKSUM_COMPLETE sum, which
        // only the pseudo-header's change leaves uncompensated: two calls.
        // MANGLED_0 keeps UDP's "no checksum" and its zero rule.
        let mangled = if udp { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
        self.l4_csum_replace(offset, 0, pseudo as u64, BPF_F_PSEUDO_HDR as u64 | mangled)
            .ok()?;
        self.l4_csum_replace(offset, 0, l4 as u64, mangled).ok()
    }

    #[inline(always)]
    fn sctp_crc_set(&self, offset: usize, delta: u32) -> Option<()> {
        // Through the load helper: offsets past variable-length headers.
        let crc: u32 = TcContext::load(self, offset).ok()?;
        self.store_unbalanced(offset, &sctp::rewritten_crc(crc, delta))
    }

    #[inline(always)]
    fn store_unbalanced<T: Copy>(&self, offset: usize, value: &T) -> Option<()> {
        // Not compensated within the one's-complement sums: a
        // CHECKSUM_COMPLETE skb's sum is recomputed.
        TcContext::store(self, offset, value, BPF_F_RECOMPUTE_CSUM as u64).ok()
    }

    const XDP: bool = false;

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
        hint::device_slot(iif).is_some_and(|(w, bit)| HINT_DEVICES.get(w).is_some_and(|v| *v & bit != 0))
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
