//! The word an ingress hook leaves on a packet for the egress hook that
//! sees it next on this node: the skb's `tc_index`. A TC program sets it
//! through `tc_classid`, which the kernel copies into `tc_index` when the
//! program passes the packet (TCX; clsact copies its low 16 bits), and
//! directly for a packet it redirects. XDP has no skb to write to.
//!
//! The egress path needs conntrack lookups only for the packets it may have
//! to rewrite: forward packets of masqueraded flows (SNAT) and replies
//! (their frontend restored). Ingress knows more than egress about most
//! packets: whether it translated one, and whether its source may be a
//! backend. The word tells egress which lookups cannot apply.
//!
//! The word is a hint, never a command: a packet that carries no valid
//! word takes the full egress path. Valid means: the device the packet
//! last came in through (`skb_iif`) is one the agent marked in
//! [`crate::names::HINT_DEVICES`] (our TC ingress runs on it, writing a word
//! on every packet, and no other ingress hook of ours can have seen the
//! packet before: see docs/datapath.md), and the word's low 12 bits, a
//! check over the addresses ([`encode`]), still match (netfilter NAT in
//! between fails it). A packet received again after our hook (a tunnel's
//! decapsulation, a bridge passing it up, another namespace) has another
//! `skb_iif`, whose bit is clear unless our hook runs there too. The egress
//! hook zeroes the word (through `tc_classid`) as it passes an IP packet.

/// What ingress learnt about a packet, in the word's top 4 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Hint {
    /// No word, or one written for other addresses: the full egress path.
    Unknown = 0,
    /// Nothing for egress to do: the packet is not a translated flow's
    /// forward packet needing SNAT (ingress did not translate it, or
    /// translated it for a flow kept unmasqueraded), and not a reply
    /// (ingress did not translate it, and its source is no backend).
    None = 0xa,
    /// Only a reply of a flow kept unmasqueraded (or an explicit entry) can
    /// apply: ingress did not translate the packet, so it is neither a
    /// masqueraded flow's forward packet nor its un-SNATed reply, but its
    /// source may be a backend.
    ExplicitOnly = 0x5,
}

/// The 12-bit check over the packet's addresses (as folded by
/// [`crate::addr::Addr::fold`]).
#[inline(always)]
pub const fn check(saddr: u32, daddr: u32) -> u16 {
    let x = (saddr ^ daddr.rotate_left(16)).wrapping_mul(0x9e37_79b1);
    (x >> 20) as u16
}

/// The word for `hint` on a packet with these (folded) addresses.
#[inline(always)]
pub const fn encode(hint: Hint, saddr: u32, daddr: u32) -> u16 {
    match hint {
        Hint::Unknown => 0,
        _ => (hint as u16) << 12 | check(saddr, daddr),
    }
}

/// Words of [`crate::names::HINT_DEVICES`]: one bit per device index
/// below 2^20 (device indexes grow as pods come and go; a device above
/// that leaves no word egress trusts).
pub const DEVICE_WORDS: u32 = 1 << 14;

/// The word and bit of `ifindex` in [`crate::names::HINT_DEVICES`];
/// `None` beyond the bitmap (and for 0, no device).
#[inline(always)]
pub const fn device_slot(ifindex: u32) -> Option<(u32, u64)> {
    if ifindex == 0 || ifindex >= DEVICE_WORDS * 64 {
        return None;
    }
    Some((ifindex / 64, 1 << (ifindex % 64)))
}

/// The hint `word` carries for a packet with these (folded) addresses.
#[inline(always)]
pub const fn decode(word: u16, saddr: u32, daddr: u32) -> Hint {
    if word & 0xfff != check(saddr, daddr) {
        return Hint::Unknown;
    }
    match word >> 12 {
        0xa => Hint::None,
        0x5 => Hint::ExplicitOnly,
        _ => Hint::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for (s, d) in [(0x0a00_0001, 0x0a00_0002), (0, 0), (u32::MAX, 7)] {
            for h in [Hint::None, Hint::ExplicitOnly] {
                assert_eq!(decode(encode(h, s, d), s, d), h);
            }
            assert_eq!(decode(encode(Hint::Unknown, s, d), s, d), Hint::Unknown);
        }
    }

    #[test]
    fn other_addresses_or_foreign_words_are_unknown() {
        let (s, d) = (0xc612_0064, 0x0af4_0114);
        let w = encode(Hint::None, s, d);
        // Another source (netfilter SNAT), the addresses swapped, another
        // destination: the check fails (not a coincidence for these).
        assert_eq!(decode(w, 0xc612_000b, d), Hint::Unknown);
        assert_eq!(decode(w, d, s), Hint::Unknown);
        assert_eq!(decode(w, s, d + 1), Hint::Unknown);
        // A word someone else wrote: at most 1 in 4096 of random words with
        // a valid kind passes; count over all words of this tuple.
        let valid = (0..=u16::MAX)
            .filter(|w| decode(*w, s, d) != Hint::Unknown)
            .count();
        assert_eq!(valid, 2);
    }

    #[test]
    fn device_slots_cover_the_bitmap_only() {
        assert_eq!(device_slot(0), None);
        assert_eq!(device_slot(1), Some((0, 2)));
        assert_eq!(device_slot(64), Some((1, 1)));
        assert_eq!(
            device_slot(DEVICE_WORDS * 64 - 1),
            Some((DEVICE_WORDS - 1, 1 << 63))
        );
        assert_eq!(device_slot(DEVICE_WORDS * 64), None);
    }

    #[test]
    fn check_spreads_single_bit_changes() {
        // Every single-bit change of either address changes the check.
        let (s, d) = (0x0a00_0001u32, 0x0a60_0001u32);
        let base = check(s, d);
        for bit in 0..32 {
            assert_ne!(check(s ^ 1 << bit, d), base, "saddr bit {bit}");
            assert_ne!(check(s, d ^ 1 << bit), base, "daddr bit {bit}");
        }
    }
}
