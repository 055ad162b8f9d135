//! SCTP's checksum is a CRC32c over the whole SCTP packet, with no
//! pseudo-header: rewriting an address leaves it valid, rewriting a port
//! does not. A CRC is linear over GF(2), so the change of two bytes at a
//! known offset changes the CRC by the CRC of a message that is zero
//! everywhere else: the CRC of the two changed bits, carried through the
//! rest of the message by multiplying with x^(8·remaining) modulo the
//! polynomial (zlib's `crc32_combine` idea). That costs about a hundred
//! shifts whatever the packet's length, instead of a pass over its bytes.

/// CRC32c (Castagnoli), reflected.
const POLY: u32 = 0x82f6_3b78;

/// All ones if the low bit of `x` is set, else zero: selects without a
/// branch (the BPF verifier walks every branch of every iteration).
#[inline(always)]
const fn mask(x: u32) -> u32 {
    0u32.wrapping_sub(x & 1)
}

/// One bit of reflected CRC division.
#[inline(always)]
const fn shift(c: u32) -> u32 {
    (c >> 1) ^ (POLY & mask(c))
}

/// `a(x)·b(x) mod p(x)`, both reflected (bit 31 is x^0). Branch-free.
#[inline(always)]
pub const fn mul_mod(a: u32, b: u32) -> u32 {
    let mut p = 0u32;
    let mut b = b;
    let mut i = 0;
    while i < 32 {
        p ^= b & mask(a >> (31 - i));
        b = shift(b);
        i += 1;
    }
    p
}

/// `x^(8n) mod p(x)` for `n = 2^k`, k = 0..16.
const X8_POW2: [u32; 16] = {
    let mut t = [0u32; 16];
    // x^8, then squared.
    let mut p = 1u32 << 31;
    let mut i = 0;
    while i < 8 {
        p = shift(p);
        i += 1;
    }
    let mut k = 0;
    while k < 16 {
        t[k] = p;
        p = mul_mod(p, p);
        k += 1;
    }
    t
};

/// Multiplication by each `x^(8·2^k)` as four byte tables:
/// `c·K = T[k][0][c & 0xff] ^ T[k][1][(c >> 8) & 0xff] ^ ...` (the product
/// is linear in `c`). 64 KiB of read-only data, computed at compile time.
static ADVANCE: [[[u32; 256]; 4]; 16] = {
    let mut t = [[[0u32; 256]; 4]; 16];
    let mut k = 0;
    while k < 16 {
        let mut j = 0;
        while j < 4 {
            // Linear in v: one product per bit, the rest by XOR.
            let mut v: usize = 1;
            while v < 256 {
                let low = v & v.wrapping_neg();
                t[k][j][v] = if low == v {
                    mul_mod((v as u32) << (8 * j), X8_POW2[k])
                } else {
                    t[k][j][v ^ low] ^ t[k][j][low]
                };
                v += 1;
            }
            j += 1;
        }
        k += 1;
    }
    t
};

/// `c·x^(8n) mod p(x)`: the raw CRC `c` carried through `n` zero bytes,
/// `n < 2^16` (an IP packet's length). No loop over data and no branch:
/// sixteen table multiplications, each kept or not by a mask (the BPF
/// verifier walks every branch, and verifies a call once per call site).
#[inline(always)]
pub fn advance(c: u32, n: u32) -> u32 {
    let mut c = c;
    let mut k = 0;
    while k < 16 {
        let t = &ADVANCE[k];
        let p = t[0][(c & 0xff) as usize]
            ^ t[1][((c >> 8) & 0xff) as usize]
            ^ t[2][((c >> 16) & 0xff) as usize]
            ^ t[3][(c >> 24) as usize];
        let m = mask(n >> k);
        c = (p & m) | (c & !m);
        k += 1;
    }
    c
}

/// How the CRC32c of a `len`-byte message changes when its 16-bit word at
/// byte `offset` goes from `old` to `new` (both as they lie in the packet):
/// XOR it into the CRC value (the stored checksum, read little-endian, as
/// SCTP stores it). The raw CRC (no initial value, no final XOR: those
/// cancel between two messages of the same length) of a message that is
/// zero but for the two changed bytes `d0 d1` is `(d0 | d1 << 8)` (bit 31
/// is x^0) carried through the `len - offset` bytes from there to the end.
#[inline(always)]
pub fn crc32c_delta16(len: u32, offset: u32, old: u16, new: u16) -> u32 {
    let d = (old ^ new).to_ne_bytes();
    advance(d[0] as u32 | (d[1] as u32) << 8, len.saturating_sub(offset))
}

/// The stored checksum after a port rewrite whose CRC change is `delta`.
///
/// Zero means the CRC is not computed yet: the kernel's SCTP stack leaves
/// the field zeroed when the device offloads it (`CHECKSUM_PARTIAL` with a
/// CRC32c offset, as on veth), and the device or `skb_crc32c_csum_help`
/// later computes it over the bytes as they are then, with the field taken
/// as zero. Adding the delta there would corrupt that computation, so a zero
/// stays zero. The cost: a packet whose real CRC is zero (one in 2^32) is
/// forwarded with a wrong one, and SCTP retransmits it.
#[inline(always)]
pub fn rewritten_crc(stored: u32, delta: u32) -> u32 {
    if stored == 0 { 0 } else { stored ^ delta }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    /// Advancing by n agrees with feeding n zero bytes through the bytewise
    /// CRC.
    #[test]
    fn advance_is_n_zero_bytes() {
        for n in [0u32, 1, 2, 3, 7, 100, 255, 256, 1499, 9000, 65535] {
            let mut c = 0xdead_beefu32;
            for _ in 0..n {
                for _ in 0..8 {
                    c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
                }
            }
            assert_eq!(advance(0xdead_beef, n), c, "n = {n}");
        }
    }

    #[test]
    fn an_offloaded_crc_stays_zero() {
        assert_eq!(rewritten_crc(0, 0x1234_5678), 0);
        assert_eq!(rewritten_crc(0xffff_0000, 0x0000_ffff), u32::MAX);
    }

    #[test]
    fn port_rewrite_delta_matches_a_full_recompute() {
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for len in [4usize, 12, 28, 100, 1452, 4000, 65000] {
            for _ in 0..50 {
                let msg: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                let offset = (next() as usize) % (len - 1);
                let old = u16::from_ne_bytes([msg[offset], msg[offset + 1]]);
                let new = next() as u16;
                let mut changed = msg.clone();
                changed[offset..offset + 2].copy_from_slice(&new.to_ne_bytes());
                assert_eq!(
                    crc32c::crc32c(&msg) ^ crc32c_delta16(len as u32, offset as u32, old, new),
                    crc32c::crc32c(&changed),
                    "len {len} offset {offset}"
                );
            }
        }
    }
}
