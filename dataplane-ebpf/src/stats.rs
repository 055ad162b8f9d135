//! Per-CPU counters. No atomics needed: each CPU owns its slot.

use dataplane_common::stats::{Counter, Event, FlowStat, Hook, counter_index};

use crate::maps::{COUNTERS, FLOW_STATS, SERVICE_STATS};

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

/// As [`count`], with the event as its number (from a packed verdict).
#[inline(always)]
pub fn count_raw(hook: Hook, event: u32, bytes: u64) {
    bump(
        COUNTERS.get_ptr_mut(hook as u32 * dataplane_common::stats::HOOK_STRIDE + (event & 31)),
        bytes,
    );
}

#[inline(always)]
pub fn count_service(service_id: u32, bytes: u64) {
    bump(SERVICE_STATS.get_ptr_mut(service_id), bytes);
}

/// Counts what a new flow needed (`packets` only).
#[inline(always)]
pub fn count_flow(stat: FlowStat) {
    bump(FLOW_STATS.get_ptr_mut(stat as u32), 0);
}
