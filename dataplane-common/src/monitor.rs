//! Live events of the datapath (`dataplane-agent monitor`): the kernel
//! writes one [`MonitorEvent`] per dropped or rejected packet into the
//! ring buffer [`crate::names::MONITOR_EVENTS`], only while a reader keeps
//! [`MonitorCtl::until_ns`] in the future, and at most
//! [`MonitorCtl::rate`] events a second per CPU (a token bucket in
//! [`crate::names::MONITOR_RATE`]); the rest are counted as lost there.
//!
//! While a reader also asks for trace events ([`MonitorCtl::sample`]), one
//! packet in `sample` that gets past a hook's pre-filter has its first
//! bytes kept before anything rewrites it ([`MonitorSample`], per CPU) and, when the hook translated it
//! ([`traced`]), a [`MonitorTrace`] carries it before and after, through
//! the same rate limit and ring.

use crate::stats::{Event, EventKind};

/// Written by the reader ([`crate::names::MONITOR_CTL`], one entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorCtl {
    /// CLOCK_MONOTONIC ns until which events are written; a reader moves
    /// it forward while it runs (0: nobody listens).
    pub until_ns: u64,
    /// Events per second per CPU; also the bucket's depth.
    pub rate: u32,
    /// Trace events: one packet in `sample` (drawn at random) that a hook
    /// translates is reported before and after; 0: none. The kernel sets it
    /// to 0 when it finds the lease expired (a reader that was killed), so
    /// that nobody pays for samples nobody reads.
    pub sample: u32,
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

/// The first bytes of a sampled packet as it entered the hook, per CPU
/// ([`crate::names::MONITOR_SAMPLE`]): kept until the hook's verdict, when
/// they become a [`MonitorTrace`] if the packet was translated. Packet
/// programs do not nest on a CPU, so one slot is enough. 8-byte aligned,
/// so that `data` is copied as words.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MonitorSample {
    /// When the packet was sampled (CLOCK_MONOTONIC ns); 0 once reported,
    /// or when the last packet was not sampled.
    pub ts_ns: u64,
    /// Bytes of the packet, and of them in `data`.
    pub len: u32,
    pub captured: u32,
    pub data: [u8; CAPTURE],
}
crate::assert_layout!(MonitorSample, 16 + CAPTURE, 8);
crate::impl_pod!(MonitorSample);

/// A sampled packet that a hook translated: `before` as it entered (its
/// `event` is [`crate::stats::Event::NewFlow`], `Established`, `Reply` or
/// `IcmpErrorTranslated`), and its first bytes as it left.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MonitorTrace {
    pub before: MonitorEvent,
    pub after_len: u32,
    pub after_captured: u16,
    pub _pad: u16,
    pub after: [u8; CAPTURE],
}
crate::assert_layout!(MonitorTrace, 24 + CAPTURE + 8 + CAPTURE, 8);
crate::impl_pod!(MonitorTrace);

/// Whether a packet counted under `event` is a translation a trace event
/// reports (a packet the hook rewrote: [`EventKind::Translate`]).
#[inline(always)]
pub const fn traced(event: u32) -> bool {
    event < 32 && TRACED & (1 << event) != 0
}

const TRACED: u32 = kinds(&[EventKind::Translate]);

/// Default [`MonitorCtl::rate`].
pub const DEFAULT_RATE: u32 = 1000;
/// Bytes of the ring buffer (a power of two of pages, 4 KiB to 64 KiB):
/// 1638 drop events (each 152 bytes behind an 8-byte header), or 885
/// trace events (296).
pub const RING_BYTES: u32 = 256 * 1024;
/// How far ahead a reader sets [`MonitorCtl::until_ns`], and renews it
/// every half of that.
pub const LEASE_NS: u64 = 2_000_000_000;

/// Whether a packet counted under `event` is reported: drops and rejects.
#[inline(always)]
pub const fn reported(event: u32) -> bool {
    event < 32 && REPORTED & (1 << event) != 0
}

const REPORTED: u32 = kinds(&[EventKind::Drop, EventKind::Reject]);

/// The bitmask of the events of these kinds.
const fn kinds(of: &[EventKind]) -> u32 {
    let mut m = 0u32;
    let mut i = 0;
    while i < Event::ALL.len() {
        let e = Event::ALL[i];
        let mut k = 0;
        while k < of.len() {
            if e.kind() as u8 == of[k] as u8 {
                m |= 1 << e as u32;
            }
            k += 1;
        }
        i += 1;
    }
    m
}
