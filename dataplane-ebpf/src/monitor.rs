//! Live drop and reject events (`dataplane-agent monitor`): see
//! `dataplane_common::monitor`. Called from the packet path's one exit for
//! a packet counted as a drop or a reject, before anything rewrote it;
//! one map read (is anyone listening?) when nobody is. The packet's first
//! bytes are copied as they are, by one helper call, and decoded by the
//! reader: nothing to parse, a small program for the verifier to walk.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use dataplane_common::{
    monitor::{CAPTURE, MonitorEvent},
    stats::Hook,
};

use crate::{
    ctx::Ctx,
    maps::{MONITOR_CTL, MONITOR_EVENTS, MONITOR_RATE},
};

/// Reports a packet counted under `event` (a drop or a reject) by `hook`,
/// if a reader listens and this CPU's rate allows. A subprogram: its frame
/// does not add to the lookup path's.
#[inline(never)]
pub fn report<C: Ctx>(ctx: &C, hook: Hook, event: u32) {
    let Some(ctl) = MONITOR_CTL.get(0) else { return };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if ctl.until_ns <= now {
        return;
    }
    let rate = ctl.rate as u64;
    if rate == 0 {
        return;
    }
    let Some(bucket) = MONITOR_RATE.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot; packet programs do not nest on a CPU.
    let bucket = unsafe { &mut *bucket };
    // Refill: `rate` tokens a second, at most `rate` held. The clock moves
    // by the whole tokens credited only, so that no fraction is lost.
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
        return;
    }
    let Some(mut entry) = MONITOR_EVENTS.reserve::<MonitorEvent>(0) else {
        bucket.lost += 1;
        return;
    };
    bucket.tokens = bucket.tokens.saturating_sub(1);
    let len = ctx.packet_len() as u32;
    // 1..=CAPTURE, in a shape the verifier follows (a helper refuses 0).
    let captured = ((len.clamp(1, CAPTURE as u32) - 1) & (CAPTURE as u32 - 1)) + 1;
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points at the reserved, writable record; every header
    // field is written, one by one (a whole-struct write is a memset
    // call), and `captured` bytes of `data`, before it is submitted.
    unsafe {
        (*ev).ts_ns = now;
        (*ev).ifindex = ctx.ingress_ifindex();
        (*ev).hook = hook as u8;
        (*ev).event = event as u8;
        (*ev).len = len;
        (*ev)._pad = 0;
        let ok = len > 0 && ctx.load_bytes((&raw mut (*ev).data).cast(), captured);
        (*ev).captured = if ok { captured as u16 } else { 0 };
    }
    entry.submit(0);
    bucket.sent += 1;
}
