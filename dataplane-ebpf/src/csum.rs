//! Internet checksum arithmetic (RFC 1071/1624) on raw memory values.
//!
//! One's-complement sums are byte-order independent as long as every operand
//! is taken the same way, so addresses and ports are used exactly as they lie
//! in the packet (and in the maps): no byte swapping.

/// Folds a 32-bit accumulator to 16 bits.
#[inline(always)]
pub fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// Accumulator delta for replacing the 16-bit word `old` by `new`.
#[inline(always)]
pub fn diff16(old: u16, new: u16) -> u32 {
    (!old) as u32 + new as u32
}

/// Applies an accumulated delta to a stored checksum (RFC 1624 eq. 3).
#[inline(always)]
pub fn apply(check: u16, diff: u32) -> u16 {
    !fold((!check) as u32 + fold(diff) as u32)
}
