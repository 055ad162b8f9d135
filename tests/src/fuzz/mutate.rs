//! Mutations of a seed frame: bit flips, truncations, appended bytes,
//! stacked VLAN tags, and the header fields the datapath reads (IPv4's IHL,
//! lengths and fragment field; IPv6's payload length, next headers, hop
//! limit, flow label and extension header lengths; TCP's flags and data
//! offset).

use super::{rng::Rng, view::view};
use crate::packet::{TCP, ethertype};

pub(super) fn mutate(rng: &mut Rng, f: &mut Vec<u8>) {
    if f.is_empty() {
        return;
    }
    // An IPv6 frame (after up to two VLAN tags).
    if let Some((0x86dd, l3)) = ethertype(f) {
        return mutate6(rng, f, l3);
    }
    let l3 = 14;
    match rng.below(9) {
        0 => {
            let i = rng.below(f.len() as u64) as usize;
            f[i] ^= 1 << rng.below(8);
        }
        1 => {
            let i = rng.below(f.len() as u64) as usize;
            f[i] = rng.next_u64() as u8;
        }
        2 => f.truncate(rng.below(f.len() as u64 + 1) as usize),
        3 => f.extend((0..rng.below(32)).map(|_| rng.next_u64() as u8)),
        // IHL.
        4 if f.len() > l3 => f[l3] = 0x40 | rng.below(16) as u8,
        // Total length.
        5 if f.len() > l3 + 4 => {
            let v = rng.below(2000) as u16;
            f[l3 + 2..l3 + 4].copy_from_slice(&v.to_be_bytes());
        }
        // Fragment field.
        6 if f.len() > l3 + 8 => {
            let any = rng.next_u64() as u16;
            let v = *rng.pick(&[0x2000u16, 0x0001, 0x20b9, 0x4000, any]);
            f[l3 + 6..l3 + 8].copy_from_slice(&v.to_be_bytes());
        }
        // TCP flags and data offset (no IP options in the seed's fast case).
        7 if f.len() > l3 + 34 => {
            f[l3 + 32] = (rng.below(16) as u8) << 4;
            f[l3 + 33] = rng.next_u64() as u8;
        }
        // Stack a VLAN tag.
        8 => push_vlan(rng, f),
        _ => {}
    }
}

fn push_vlan(rng: &mut Rng, f: &mut Vec<u8>) {
    if f.len() >= 14 {
        let tag = [0x81, 0x00, rng.next_u64() as u8 & 0x0f, rng.next_u64() as u8];
        let mut v = f[..12].to_vec();
        v.extend_from_slice(&tag);
        v.extend_from_slice(&f[12..]);
        *f = v;
    }
}

/// IPv6 mutations: the payload length, next headers, hop limit and flow
/// label, an extension header's length, TCP's flags and data offset,
/// truncations within the headers; and the generic ones.
fn mutate6(rng: &mut Rng, f: &mut Vec<u8>, l3: usize) {
    let len = f.len();
    match rng.below(11) {
        0 => {
            let i = rng.below(len as u64) as usize;
            f[i] ^= 1 << rng.below(8);
        }
        1 => {
            let i = rng.below(len as u64) as usize;
            f[i] = rng.next_u64() as u8;
        }
        2 => f.truncate(rng.below(len as u64 + 1) as usize),
        3 => f.extend((0..rng.below(32)).map(|_| rng.next_u64() as u8)),
        // Payload length: none (a jumbogram), about right, beyond the frame.
        4 if len >= l3 + 6 => {
            let actual = len.saturating_sub(l3 + 40) as u64;
            let (less, more, any) = (rng.below(16), rng.below(16), rng.below(2000));
            let v = *rng.pick(&[0, actual.saturating_sub(less), actual + more, any]) as u16;
            f[l3 + 4..l3 + 6].copy_from_slice(&v.to_be_bytes());
        }
        // The IPv6 header's next header, or the first extension header's.
        5 if len > l3 + 6 => {
            let at = if len > l3 + 40 && rng.chance(30) {
                l3 + 40
            } else {
                l3 + 6
            };
            let any = rng.next_u64() as u8;
            f[at] = *rng.pick(&[0, 6, 17, 43, 44, 50, 51, 58, 59, 60, 132, any]);
        }
        // Hop limit, traffic class and flow label (never rewritten).
        6 if len >= l3 + 8 => {
            if rng.chance(50) {
                f[l3 + 7] = rng.next_u64() as u8;
            } else {
                f[l3 + 1 + rng.below(3) as usize] = rng.next_u64() as u8;
            }
        }
        // The first extension header's length (whatever lies there).
        7 if len > l3 + 41 => {
            let any = rng.next_u64() as u8;
            f[l3 + 41] = *rng.pick(&[0, 1, 2, 3, 25, 200, any]);
        }
        // TCP flags and data offset.
        8 => {
            if let Some(v) = view(f)
                && v.proto == TCP
                && len > v.l4 + 13
            {
                f[v.l4 + 12] = (rng.below(16) as u8) << 4;
                f[v.l4 + 13] = rng.next_u64() as u8;
            }
        }
        // Truncated within the headers.
        9 => f.truncate((l3 + rng.below(80) as usize).min(len)),
        _ => push_vlan(rng, f),
    }
}
