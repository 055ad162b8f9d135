//! Maglev consistent hashing (Eisenbud et al., NSDI 2016), the hashes both
//! sides compute: the kernel hashes a new flow to an entry of its
//! frontend's table ([`flow_hash`]); the agent builds the table from each
//! backend's permutation ([`backend_hashes`]). Every node with the same
//! backend set, table size and seed builds the same table, so every node
//! sends a flow to the same backend: flows that a router moves from one
//! node to another keep their backend.
//!
//! The hashes are defined here, once, and are part of the ABI between
//! nodes (not only between a node's agent and its kernel): changing them
//! changes which backend every flow is sent to.

/// Default table size: a prime, about 16 entries per backend at 1000
/// backends (Cilium's default).
pub const DEFAULT_TABLE_SIZE: u32 = 16_381;

/// murmur3's 32-bit finaliser: every input bit affects every output bit.
#[inline(always)]
pub const fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// murmur3's 64-bit finaliser.
#[inline(always)]
pub const fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

/// The hash that places a new flow in a table: over the client's address
/// (its 32-bit fold for IPv6), its port and the protocol, not over the
/// frontend address, so that one client port reaching a service through
/// any node's NodePort, or through a LoadBalancer address that routers
/// spread over the nodes, maps to the same entry on every node. Addresses
/// and ports as they lie in the packet (network order).
#[inline(always)]
pub fn flow_hash(client_fold: u32, client_port: u16, proto: u8, seed: u32) -> u32 {
    let h = fmix32(client_fold ^ seed);
    fmix32(h ^ ((client_port as u32) << 8 | proto as u32).wrapping_mul(0x9e37_79b1))
}

/// Entry of a table of `size` entries for a flow hash.
#[inline(always)]
pub fn slot(hash: u32, size: u32) -> u32 {
    if size == 0 { 0 } else { hash % size }
}

/// A backend's place in the tables: (offset, skip) of its permutation of a
/// table of `size` entries (`size` prime), from its identity — the bytes
/// of its address (network order) and its port (big-endian) — and the seed.
/// Entry `j` of its permutation is `(offset + j * skip) % size`.
pub fn backend_hashes(identity: &[u8], seed: u32, size: u32) -> (u32, u32) {
    // FNV-1a over the identity, then finalised twice with different salts.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in identity {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let h1 = fmix64(h ^ (seed as u64) ^ 0x6d61_676c_6576_3031);
    let h2 = fmix64(h.rotate_left(29) ^ (seed as u64).rotate_left(32) ^ 0x736b_6970_7374_6570);
    let size = size.max(2) as u64;
    ((h1 % size) as u32, (h2 % (size - 1) + 1) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flow hash spreads consecutive client ports and addresses evenly
    /// over a table (what a load balancer sees from many clients).
    #[test]
    fn flow_hashes_spread_evenly() {
        let size = 101u32;
        let mut counts = [0u32; 101];
        for addr in 0..100u32 {
            for port in 0..1000u16 {
                let h = flow_hash((0x0a00_0000 + addr).to_be(), (30000 + port).to_be(), 6, 7);
                counts[slot(h, size) as usize] += 1;
            }
        }
        let mean = 100_000 / 101;
        for c in counts {
            assert!(c.abs_diff(mean) < mean / 10, "{c} vs {mean}");
        }
    }

    #[test]
    fn skips_are_nonzero_and_below_the_size() {
        for i in 0..10_000u32 {
            let (offset, skip) = backend_hashes(&i.to_be_bytes(), 1, 13);
            assert!(offset < 13 && (1..13).contains(&skip), "{offset} {skip}");
        }
    }
}
