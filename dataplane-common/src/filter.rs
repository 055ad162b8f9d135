//! Address pre-filters: bitmaps the agent keeps of the addresses a hook can
//! act on, so that a packet that is none of ours costs one array read before
//! any hash lookup.
//!
//! One array map of `2 * FILTER_WORDS` 64-bit words: set [`FRONTENDS`]
//! (words `0..FILTER_WORDS`) holds every frontend address (ClusterIPs, node
//! addresses with NodePorts, LoadBalancer IPs, externalIPs) and the SNAT
//! addresses, set [`BACKENDS`] every backend address. An address maps to one
//! bit by a multiplicative hash; a set bit means "maybe" (false positives take the
//! full path), a clear bit means "certainly not".
//!
//! 2^21 bits (256 KiB) per set: with 100k addresses in a set, about 4.7 %
//! of the other addresses hit a set bit (1 - e^(-n/2^21)); 0.5 % at 10k.

/// Words per set.
pub const FILTER_WORDS: u32 = 1 << (BITS_LOG2 - 6);
/// Bits per set: 2^21.
const BITS_LOG2: u32 = 21;

/// Destinations an ingress hook translates: frontends and SNAT addresses.
pub const FRONTENDS: u32 = 0;
/// Sources and destinations an egress hook translates: backends.
pub const BACKENDS: u32 = 1;

/// (word index in the map, bit mask) of `addr` (network order) in `set`.
#[inline(always)]
pub fn slot(set: u32, addr: u32) -> (u32, u64) {
    // Fibonacci hashing: consecutive addresses (ClusterIPs allocated in a
    // range) land on distinct bits.
    let h = addr.wrapping_mul(0x9e37_79b1) >> (32 - BITS_LOG2);
    (set * FILTER_WORDS + (h >> 6), 1u64 << (h & 63))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_stay_in_their_set() {
        for a in [0u32, 1, 0xffff_ffff, 0x0a60_000a, 0xc612_000b] {
            for set in [FRONTENDS, BACKENDS] {
                let (w, _) = slot(set, a);
                assert!(w >= set * FILTER_WORDS && w < (set + 1) * FILTER_WORDS);
            }
        }
    }

    /// Consecutive addresses (a range of ClusterIPs, in network order) do
    /// not pile up on shared bits.
    #[test]
    fn consecutive_addresses_spread_over_the_set() {
        let n = 10_000u32;
        // One set's words (256 KiB), off the stack.
        static mut WORDS: [u64; FILTER_WORDS as usize] = [0; FILTER_WORDS as usize];
        // SAFETY: this test is the only user of WORDS.
        let words = unsafe { &mut *core::ptr::addr_of_mut!(WORDS) };
        let mut distinct = 0u32;
        for i in 0..n {
            let (w, bit) = slot(FRONTENDS, (0x0a60_0000 + i).to_be());
            if words[w as usize] & bit == 0 {
                distinct += 1;
                words[w as usize] |= bit;
            }
        }
        // Random addresses would set 2^21 (1 - e^(-n/2^21)) ≈ n - 24 bits.
        assert!(distinct > n - 100, "{distinct} distinct bits of {n}");
    }
}
