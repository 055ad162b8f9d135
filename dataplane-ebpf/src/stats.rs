//! Per-CPU counters. No atomics needed: each CPU owns its slot.

use dataplane_common::stats::{Counter, Event};

use crate::maps::{COUNTERS, SERVICE_STATS};

#[inline(always)]
fn bump(c: Option<*mut Counter>, bytes: u64) {
    if let Some(c) = c {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += bytes;
        }
    }
}

#[inline(always)]
pub fn count(event: Event, bytes: u64) {
    bump(COUNTERS.get_ptr_mut(event as u32), bytes);
}

#[inline(always)]
pub fn count_service(service_id: u32, bytes: u64) {
    bump(SERVICE_STATS.get_ptr_mut(service_id), bytes);
}
