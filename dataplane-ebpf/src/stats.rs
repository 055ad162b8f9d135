//! Per-CPU counters. No atomics needed: each CPU owns its slot.

use dataplane_common::stats::{Counter, Event, Hook, counter_index};

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

/// Counts a packet's outcome: once per packet per hook.
#[inline(always)]
pub fn count(hook: Hook, event: Event, bytes: u64) {
    bump(COUNTERS.get_ptr_mut(counter_index(hook, event)), bytes);
}

#[inline(always)]
pub fn count_service(service_id: u32, bytes: u64) {
    bump(SERVICE_STATS.get_ptr_mut(service_id), bytes);
}
