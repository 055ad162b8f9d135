//! The ABI between the kernel programs (`dataplane-ebpf`) and the agent.
//!
//! Everything here is `#[repr(C)]`, has explicit padding, and has its size
//! asserted at compile time: a layout change must be a deliberate, versioned
//! change (new map name suffix), never a silent reinterpretation of a pinned
//! map. Addresses and ports inside map keys and values are in network byte
//! order; the agent converts once when it writes.
#![no_std]

pub mod stats;

/// Names of the maps and programs, as they appear in the object file and
/// under the pin directory. The `_V<n>` suffix is bumped on layout changes.
pub mod names {
    /// Per-CPU array of [`crate::stats::Counter`], indexed by
    /// [`crate::stats::CounterIndex`].
    pub const XDP_COUNTERS: &str = "XDP_COUNTERS_V1";
    /// The XDP entry point attached to a node's external devices.
    pub const XDP_PROG: &str = "xdp_ingress";
}

/// Compile-time layout check: `assert_layout!(Type, size, align)`.
#[macro_export]
macro_rules! assert_layout {
    ($t:ty, $size:expr, $align:expr) => {
        const _: () = {
            assert!(core::mem::size_of::<$t>() == $size);
            assert!(core::mem::align_of::<$t>() == $align);
        };
    };
}
