//! Frontend lookup and backend selection (uniform random, Maglev, ClientIP
//! affinity), source ranges.

use aya_ebpf::{bindings::BPF_ANY, helpers::bpf_get_prandom_u32, maps::lpm_trie::Key};
use dataplane_common::{
    config::DpConfig,
    lb::{
        AffinityKey, LbAffinityValue, LbBackend, LbService, LbServiceKey, MAGLEV_CHUNK, MaglevKey,
        SourceRangeData, backend_flags, service_flags,
    },
    maglev,
};

use crate::{family::Family, maps::MAGLEV};

#[inline(always)]
pub fn frontend<F: Family>(key: &LbServiceKey<F::A>) -> Option<LbService> {
    // SAFETY: map value copied out.
    unsafe { F::services().get(key).copied() }
}

/// Is the address a ClusterIP (its wildcard entry exists)?
#[inline(always)]
pub fn is_service_address<F: Family>(address: F::A) -> bool {
    let key = LbServiceKey {
        address,
        ..Default::default()
    };
    frontend::<F>(&key).is_some_and(|f| f.flags & service_flags::WILDCARD != 0)
}

#[inline(always)]
pub fn source_allowed<F: Family>(service_id: u32, saddr: F::A) -> bool {
    let key = Key::new(
        SourceRangeData::<F::A>::BITS,
        SourceRangeData {
            service_id_be: service_id.to_be(),
            address: saddr,
        },
    );
    F::source_ranges().get(&key).is_some()
}

#[inline(always)]
fn backend_in_slot<F: Family>(key: &LbServiceKey<F::A>, slot: u32) -> Option<(u32, LbBackend<F::A>)> {
    let mut k = *key;
    k.slot = slot as u16;
    let id = frontend::<F>(&k)?.backend_id;
    let be = *F::backends().get(id)?;
    (be.flags & backend_flags::ACTIVE != 0).then_some((id, be))
}

/// The backend a Maglev frontend's table names for a flow hash, if the
/// table has it (a frontend written before its table, or a table size
/// changed under it: the caller picks at random).
#[inline(always)]
fn maglev_backend<F: Family>(cfg: &DpConfig, svc: &LbService, hash: u32) -> Option<(u32, LbBackend<F::A>)> {
    let entry = maglev::slot(hash, cfg.maglev_size);
    let key = MaglevKey {
        table: svc.backend_id,
        chunk: entry / MAGLEV_CHUNK as u32,
    };
    let chunk = MAGLEV.get_ptr(&key)?;
    // SAFETY: a map value pointer valid for this run; the index is masked
    // into the chunk (MAGLEV_CHUNK is a power of two).
    let id = unsafe { (*chunk)[entry as usize & (MAGLEV_CHUNK - 1)] };
    let be = *F::backends().get(id)?;
    (id != 0 && be.flags & backend_flags::ACTIVE != 0).then_some((id, be))
}

/// Picks the backend of a new flow from `client` to the frontend at `key`
/// (slot 0, the scope chosen): the affinity backend while it is fresh and
/// still in the set; else, for a Maglev frontend with the flow's hash
/// (`flow_hash`: packet paths; connect-time translation has no source
/// port yet and picks at random), the one its table names; else uniformly
/// at random over slots `1..=count`.
#[inline(always)]
pub fn select<F: Family>(
    cfg: &DpConfig,
    key: &LbServiceKey<F::A>,
    svc: &LbService,
    client: F::A,
    flow_hash: Option<u32>,
    now: u64,
) -> Option<(u32, LbBackend<F::A>)> {
    const _: () = assert!(MAGLEV_CHUNK.is_power_of_two());
    let count = svc.count as u32;
    if count == 0 {
        return None;
    }
    let affinity = svc.flags & service_flags::AFFINITY != 0;
    let akey = AffinityKey {
        client,
        service_id: svc.service_id,
    };
    if affinity && let Some(a) = F::affinity().get_ptr_mut(&akey) {
        // SAFETY: map value pointer.
        let (last, id, slot) = unsafe { ((*a).last_used_ns, (*a).backend_id, (*a).slot) };
        let fresh = now.saturating_sub(last) <= svc.affinity_timeout_s as u64 * 1_000_000_000;
        if fresh
            && slot >= 1
            && slot <= count
            && let Some((sid, be)) = backend_in_slot::<F>(key, slot)
            && sid == id
        {
            // SAFETY: map value pointer; racing writers store equivalent values.
            unsafe { (*a).last_used_ns = now };
            return Some((id, be));
        }
    }
    if svc.flags & service_flags::MAGLEV != 0
        && let Some(hash) = flow_hash
        && let Some(found) = maglev_backend::<F>(cfg, svc, hash)
    {
        // Maglev's own stickiness stands for affinity (the flow hash of an
        // affinity frontend is the client address's alone): no slot to
        // remember.
        return Some(found);
    }
    // SAFETY: helper without arguments.
    let slot = unsafe { bpf_get_prandom_u32() }.checked_rem(count).unwrap_or(0) + 1;
    let (id, be) = backend_in_slot::<F>(key, slot)?;
    if affinity {
        let value = LbAffinityValue {
            last_used_ns: now,
            backend_id: id,
            slot,
        };
        let _ = F::affinity().insert(&akey, &value, BPF_ANY as u64);
    }
    Some((id, be))
}
