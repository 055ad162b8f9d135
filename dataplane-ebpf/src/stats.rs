//! Per-CPU counters. No atomics needed: each CPU owns its slot.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use dataplane_common::stats::{Counter, CounterIndex, XDP_COUNTER_SLOTS};

#[map(name = "XDP_COUNTERS_V1")]
static XDP_COUNTERS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(XDP_COUNTER_SLOTS, 0);

#[inline(always)]
pub fn count(index: CounterIndex, bytes: u64) {
    if let Some(c) = XDP_COUNTERS.get_ptr_mut(index as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += bytes;
        }
    }
}
