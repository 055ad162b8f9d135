//! Addresses as the datapath stores them, in network order: `u32` for IPv4,
//! [`Ip6`] (four `u32` words as they lie in the packet) for IPv6. Keys and
//! values that hold addresses are generic over [`Addr`]; `lb4`/`ct` name the
//! IPv4 instances (`Ct4Key`...), `lb6`/`ct` the IPv6 ones, with the same
//! layout rules (explicit padding, sizes asserted).

/// An IPv6 address: four words, each as it lies in the packet.
pub type Ip6 = [u32; 4];

mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for super::Ip6 {}
}

/// Implemented for `u32` (IPv4) and [`Ip6`] only (sealed): the ABI's generic
/// keys and values are laid out, and asserted, for exactly these two.
pub trait Addr:
    sealed::Sealed + Copy + Default + PartialEq + Eq + core::hash::Hash + core::fmt::Debug + Ord
{
    /// 4 or 6.
    const FAMILY: u8;
    /// 32 bits that depend on every bit of the address (hash input).
    fn fold(&self) -> u32;
    /// Internet-checksum delta (RFC 1624 accumulator) of replacing `self` by
    /// `new`: every 16-bit half of every word.
    fn csum_diff(&self, new: &Self) -> u32;
}

/// Accumulator delta for replacing the 32-bit word `old` by `new`.
#[inline(always)]
pub fn diff32(old: u32, new: u32) -> u32 {
    let o = !old;
    (o & 0xffff) + (o >> 16) + (new & 0xffff) + (new >> 16)
}

impl Addr for u32 {
    const FAMILY: u8 = 4;
    #[inline(always)]
    fn fold(&self) -> u32 {
        *self
    }
    #[inline(always)]
    fn csum_diff(&self, new: &Self) -> u32 {
        diff32(*self, *new)
    }
}

impl Addr for Ip6 {
    const FAMILY: u8 = 6;
    #[inline(always)]
    fn fold(&self) -> u32 {
        self[0] ^ self[1].rotate_left(8) ^ self[2].rotate_left(16) ^ self[3].rotate_left(24)
    }
    #[inline(always)]
    fn csum_diff(&self, new: &Self) -> u32 {
        // Whole words summed in 64 bits, then folded (2^32 and 2^16 are both
        // 1 modulo 0xffff, so the folds keep the one's-complement value):
        // 16 operations where splitting every word into halves took 32.
        let s = (!self[0]) as u64
            + (!self[1]) as u64
            + (!self[2]) as u64
            + (!self[3]) as u64
            + new[0] as u64
            + new[1] as u64
            + new[2] as u64
            + new[3] as u64;
        let s = (s & 0xffff_ffff) + (s >> 32);
        let s = ((s & 0xffff_ffff) + (s >> 32)) as u32;
        // At most 0x1fffe, as the IPv4 delta's callers expect.
        (s & 0xffff) + (s >> 16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Internet checksum of 16-bit words (RFC 1071), folded.
    fn checksum(words: &[u16]) -> u16 {
        let mut s: u32 = words.iter().map(|&w| w as u32).sum();
        while s > 0xffff {
            s = (s & 0xffff) + (s >> 16);
        }
        !(s as u16)
    }

    fn halves(a: &Ip6) -> [u16; 8] {
        let mut h = [0u16; 8];
        for (i, w) in a.iter().enumerate() {
            h[2 * i] = *w as u16;
            h[2 * i + 1] = (*w >> 16) as u16;
        }
        h
    }

    /// Applying the delta to a checksum over an IPv6 address gives the
    /// checksum over the new address, and the delta stays in the range the
    /// callers add to (as the per-half reference).
    #[test]
    fn ipv6_delta_updates_a_checksum_as_recomputing_it() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u32
        };
        let edge = [0, 0xffff_ffff, 0x0000_ffff, 0xffff_0000];
        for i in 0..100_000 {
            let mut old: Ip6 = [next(), next(), next(), next()];
            let mut new: Ip6 = [next(), next(), next(), next()];
            if i < 256 {
                for k in 0..4 {
                    old[k] = edge[(i >> k) & 3];
                    new[k] = edge[(i >> (k + 4)) & 3];
                }
            }
            let d = old.csum_diff(&new);
            assert!(d <= 0x1fffe, "{d:#x}");
            let reference: u32 = (0..4).map(|k| diff32(old[k], new[k])).sum();
            assert_eq!(d % 0xffff, reference % 0xffff, "{old:x?} -> {new:x?}");
            // RFC 1624 eq. 3 on a checksum over the address alone.
            let check = checksum(&halves(&old));
            let mut s = (!check) as u32 + d;
            while s > 0xffff {
                s = (s & 0xffff) + (s >> 16);
            }
            let updated = !(s as u16);
            let expected = checksum(&halves(&new));
            // 0x0000 and 0xffff are the same one's-complement value.
            assert!(
                updated == expected || updated ^ expected == 0xffff && (updated == 0 || expected == 0),
                "{old:x?} -> {new:x?}: {updated:#x} != {expected:#x}"
            );
        }
    }
}
