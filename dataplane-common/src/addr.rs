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
        // Four words of at most 0x3fffe each: no overflow.
        diff32(self[0], new[0]) + diff32(self[1], new[1]) + diff32(self[2], new[2]) + diff32(self[3], new[3])
    }
}
