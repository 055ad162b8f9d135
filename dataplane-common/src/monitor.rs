//! Live events of the datapath (`dataplane-agent monitor`): the kernel
//! writes one [`MonitorEvent`] per dropped or rejected packet into the
//! ring buffer [`crate::names::MONITOR_EVENTS`], only while a reader keeps
//! [`MonitorCtl::until_ns`] in the future, and at most
//! [`MonitorCtl::rate`] events a second per CPU (a token bucket in
//! [`crate::names::MONITOR_RATE`]); the rest are counted as lost there.

/// Written by the reader ([`crate::names::MONITOR_CTL`], one entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorCtl {
    /// CLOCK_MONOTONIC ns until which events are written; a reader moves
    /// it forward while it runs (0: nobody listens).
    pub until_ns: u64,
    /// Events per second per CPU; also the bucket's depth.
    pub rate: u32,
    pub _pad: u32,
}
crate::assert_layout!(MonitorCtl, 16, 8);
crate::impl_pod!(MonitorCtl);

/// Per CPU ([`crate::names::MONITOR_RATE`]): the token bucket and what
/// it, or a full ring, kept out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorRate {
    /// When the bucket was last refilled (CLOCK_MONOTONIC ns).
    pub last_ns: u64,
    pub tokens: u64,
    /// Events not written: over the rate, or the ring was full.
    pub lost: u64,
    /// Events written.
    pub sent: u64,
}
crate::assert_layout!(MonitorRate, 32, 8);
crate::impl_pod!(MonitorRate);

/// How many bytes of a packet an event carries: L2 (two tags), IPv6 with
/// room for extension headers, and the L4 ports.
pub const CAPTURE: usize = 128;

/// One dropped or rejected packet: its first [`CAPTURE`] bytes, as the
/// hook saw them (drops and rejects are decided before any rewrite). The
/// reader decodes the headers and names the Service from the pinned maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MonitorEvent {
    /// CLOCK_MONOTONIC ns.
    pub ts_ns: u64,
    /// The device the packet came in on.
    pub ifindex: u32,
    /// [`crate::stats::Hook`] and [`crate::stats::Event`] numbers.
    pub hook: u8,
    pub event: u8,
    /// Bytes of `data` that hold the packet's.
    pub captured: u16,
    /// Bytes of the whole packet.
    pub len: u32,
    pub _pad: u32,
    pub data: [u8; CAPTURE],
}
crate::assert_layout!(MonitorEvent, 24 + CAPTURE, 8);
crate::impl_pod!(MonitorEvent);

/// Default [`MonitorCtl::rate`].
pub const DEFAULT_RATE: u32 = 1000;
/// Bytes of the ring buffer (a power of two of pages, 4 KiB to 64 KiB):
/// 1638 events (each 152 bytes behind an 8-byte header).
pub const RING_BYTES: u32 = 256 * 1024;
/// How far ahead a reader sets [`MonitorCtl::until_ns`], and renews it
/// every half of that.
pub const LEASE_NS: u64 = 2_000_000_000;

/// Whether a packet counted under `event` is reported: drops and rejects.
#[inline(always)]
pub const fn reported(event: u32) -> bool {
    event < 32 && REPORTED & (1 << event) != 0
}

const REPORTED: u32 = {
    use crate::stats::Event;
    let mut m = 0u32;
    let mut i = 0;
    while i < Event::ALL.len() {
        let e = Event::ALL[i];
        let reject = matches!(
            e,
            Event::RejectNoEndpoints | Event::RejectUnknownPort | Event::RejectTooBig
        );
        if e.is_drop() || reject {
            m |= 1 << e as u32;
        }
        i += 1;
    }
    m
};
