//! Live events (`dataplane-agent monitor`): see `dataplane_common::monitor`.
//!
//! Drops and rejects are reported from the packet path's one exit, before
//! anything rewrote the packet; one map read (is anyone listening?) when
//! nobody is. While nobody asks for trace events, a packet that passes the
//! pre-filter costs nothing more; one that gets past it, an array read
//! ([`start`]); a translated one, another at its verdict ([`finish`]). Packets are copied
//! as they are, by one helper call each, and decoded by the reader:
//! nothing to parse, small programs for the verifier to walk.

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns};
use dataplane_common::{
    monitor::{CAPTURE, MonitorEvent, MonitorTrace},
    stats::Hook,
};

use crate::{
    ctx::Ctx,
    maps::{MONITOR_CTL, MONITOR_EVENTS, MONITOR_RATE, MONITOR_SAMPLE},
};

/// The longest a hook holds a packet: a sample older than that was left by
/// a packet that was not translated (only those release it).
const SAMPLE_AGE_NS: u64 = 1_000_000;

/// Bytes of a packet of `len` to copy: 1..=CAPTURE, in a shape the
/// verifier follows (a helper refuses 0).
#[inline(always)]
fn captured(len: u32) -> u32 {
    ((len.clamp(1, CAPTURE as u32) - 1) & (CAPTURE as u32 - 1)) + 1
}

/// Takes one of this CPU's tokens (`rate` a second, at most `rate` held);
/// counts the event as lost when there is none.
#[inline(always)]
fn take_token(now: u64, rate: u32) -> bool {
    let rate = rate as u64;
    if rate == 0 {
        return false;
    }
    let Some(bucket) = MONITOR_RATE.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot; packet programs do not nest on a CPU.
    let bucket = unsafe { &mut *bucket };
    // Refill. The clock moves by the whole tokens credited only, so that
    // no fraction is lost.
    let elapsed = now.saturating_sub(bucket.last_ns);
    if elapsed >= 1_000_000_000 {
        bucket.tokens = rate;
        bucket.last_ns = now;
    } else {
        let refill = elapsed * rate / 1_000_000_000;
        if refill > 0 {
            bucket.tokens += refill;
            bucket.last_ns += refill * 1_000_000_000 / rate;
        }
    }
    // A lower --rate than the one that filled the bucket takes at once.
    bucket.tokens = bucket.tokens.min(rate);
    if bucket.tokens == 0 {
        bucket.lost += 1;
        return false;
    }
    bucket.tokens -= 1;
    true
}

/// Counts an event written, or one the ring had no room for.
#[inline(always)]
fn count(sent: bool) {
    if let Some(bucket) = MONITOR_RATE.get_ptr_mut(0) {
        // SAFETY: as in `take_token`.
        unsafe {
            if sent {
                (*bucket).sent += 1;
            } else {
                (*bucket).lost += 1;
            }
        }
    }
}

/// Fills an event's header and copies the packet's first bytes into its
/// `data`, as they are now.
///
/// # Safety
/// `ev` points at a writable event.
#[inline(always)]
unsafe fn fill<C: Ctx>(ctx: &C, ev: *mut MonitorEvent, now: u64, hook: Hook, event: u32) {
    let len = ctx.packet_len() as u32;
    let n = captured(len);
    // SAFETY: the caller's; every header field is written, one by one (a
    // whole-struct write is a memset call), and `n` bytes of `data`.
    unsafe {
        (*ev).ts_ns = now;
        (*ev).ifindex = ctx.ingress_ifindex();
        (*ev).hook = hook as u8;
        (*ev).event = event as u8;
        (*ev).len = len;
        (*ev)._pad = 0;
        let ok = len > 0 && ctx.load_bytes((&raw mut (*ev).data).cast(), n);
        (*ev).captured = if ok { n as u16 } else { 0 };
    }
}

/// Reports a packet counted under `event` (a drop or a reject) by `hook`,
/// if a reader listens and this CPU's rate allows. A subprogram: its frame
/// does not add to the lookup path's.
#[inline(never)]
pub fn report<C: Ctx>(ctx: &C, hook: Hook, event: u32) {
    let Some(ctl) = MONITOR_CTL.get(0) else { return };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if ctl.until_ns <= now || !take_token(now, ctl.rate) {
        return;
    }
    let Some(mut entry) = MONITOR_EVENTS.reserve::<MonitorEvent>(0) else {
        count(false);
        return;
    };
    // SAFETY: the reserved record, written whole before it is submitted.
    unsafe { fill(ctx, entry.as_mut_ptr(), now, hook, event) };
    entry.submit(0);
    count(true);
}

/// Once a packet is past the pre-filter, before anything rewrote it, while
/// a reader asks for trace events: whether this packet is sampled (kept in
/// [`MONITOR_SAMPLE`] until [`finish`]). One array read (inlined by the
/// JIT) when nobody asks. The control is read again at the verdict rather
/// than kept: the entry points' stacks and their subprograms' have no 8
/// bytes to spare.
#[inline(always)]
pub fn start<C: Ctx>(ctx: &C) {
    if MONITOR_CTL.get(0).is_some_and(|c| c.sample != 0) {
        sample(ctx);
    }
}

/// At the verdict of a packet the hook translated: [`traced`] while a
/// reader asks for trace events.
#[inline(always)]
pub fn finish<C: Ctx>(ctx: &C, hook: Hook, event: u32) {
    if MONITOR_CTL.get(0).is_some_and(|c| c.sample != 0) {
        traced(ctx, hook, event);
    }
}

#[inline(never)]
fn sample<C: Ctx>(ctx: &C) {
    let (Some(ctl), Some(s)) = (MONITOR_CTL.get_ptr_mut(0), MONITOR_SAMPLE.get_ptr_mut(0)) else {
        return;
    };
    // SAFETY: `s` is this CPU's slot (no nesting on a CPU); `ctl` the
    // shared control, read and written a field at a time.
    unsafe {
        (*s).ts_ns = 0;
        let now = bpf_ktime_get_ns();
        if (*ctl).until_ns <= now {
            // The reader is gone without releasing its lease.
            (*ctl).sample = 0;
            return;
        }
        let every = (*ctl).sample;
        if every == 0 || (every > 1 && !bpf_get_prandom_u32().is_multiple_of(every)) {
            return;
        }
        let len = ctx.packet_len() as u32;
        let n = captured(len);
        let ok = len > 0 && ctx.load_bytes((&raw mut (*s).data).cast(), n);
        (*s).len = len;
        (*s).captured = if ok { n } else { 0 };
        (*s).ts_ns = now;
    }
}

/// At a translated packet's verdict, while trace events are asked for: if
/// it was sampled, it is reported before and after, and the sample
/// released. A sample left by an earlier packet (one that was not
/// translated) is older than [`SAMPLE_AGE_NS`]: not this packet's.
#[inline(never)]
fn traced<C: Ctx>(ctx: &C, hook: Hook, event: u32) {
    let (Some(ctl), Some(s)) = (MONITOR_CTL.get(0), MONITOR_SAMPLE.get_ptr_mut(0)) else {
        return;
    };
    // SAFETY: this CPU's slot, as in `sample`.
    let s = unsafe { &mut *s };
    let sampled = s.ts_ns;
    if sampled == 0 {
        return;
    }
    s.ts_ns = 0;
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if now.wrapping_sub(sampled) > SAMPLE_AGE_NS || ctl.until_ns <= now || !take_token(now, ctl.rate) {
        return;
    }
    let Some(mut entry) = MONITOR_EVENTS.reserve::<MonitorTrace>(0) else {
        count(false);
        return;
    };
    let t = entry.as_mut_ptr();
    // SAFETY: the reserved record, written whole before it is submitted:
    // the header and `before` from the sample (copied as words: both are
    // 8-byte aligned at these offsets), `after` from the packet now.
    unsafe {
        let b = &raw mut (*t).before;
        (*b).ts_ns = now;
        (*b).ifindex = ctx.ingress_ifindex();
        (*b).hook = hook as u8;
        (*b).event = event as u8;
        (*b).len = s.len;
        (*b)._pad = 0;
        (*b).captured = s.captured as u16;
        let from = (&raw const s.data).cast::<u64>();
        let to = (&raw mut (*b).data).cast::<u64>();
        let mut i = 0;
        while i < CAPTURE / 8 {
            to.add(i).write(from.add(i).read());
            i += 1;
        }
        let len = ctx.packet_len() as u32;
        let n = captured(len);
        (*t).after_len = len;
        (*t)._pad = 0;
        let ok = len > 0 && ctx.load_bytes((&raw mut (*t).after).cast(), n);
        (*t).after_captured = if ok { n as u16 } else { 0 };
    }
    entry.submit(0);
    count(true);
}
