//! Counters kept by the kernel programs in per-CPU arrays.

/// One packets/bytes pair. Per-CPU, so the kernel increments without atomics
/// and userspace sums the CPUs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}
crate::assert_layout!(Counter, 16, 8);

#[cfg(feature = "user")]
unsafe impl aya::Pod for Counter {}

impl Counter {
    /// Adds another CPU's share.
    pub fn merge(&mut self, other: &Counter) {
        self.packets = self.packets.wrapping_add(other.packets);
        self.bytes = self.bytes.wrapping_add(other.bytes);
    }
}

/// Slots of [`crate::names::XDP_COUNTERS`]. Append-only: indices are ABI.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CounterIndex {
    /// Every frame the XDP entry point saw.
    Rx = 0,
    /// Frames passed to the kernel stack untouched.
    Pass = 1,
}

impl CounterIndex {
    pub const ALL: [CounterIndex; 2] = [CounterIndex::Rx, CounterIndex::Pass];

    pub const fn name(self) -> &'static str {
        match self {
            CounterIndex::Rx => "rx",
            CounterIndex::Pass => "pass",
        }
    }
}

/// Number of slots in [`crate::names::XDP_COUNTERS`]; room to append.
pub const XDP_COUNTER_SLOTS: u32 = 16;
