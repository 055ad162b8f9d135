//! Programs of the forwarding benchmark (`bench/src/forwarding.rs`),
//! in this object so that the benchmark needs no other toolchain; never
//! attached by the agent, and loaded (verified) only by the benchmark.

use aya_ebpf::{
    bindings::xdp_action::{XDP_ABORTED, XDP_TX},
    helpers::bpf_redirect,
    programs::XdpContext,
};
use dataplane_common::bench::{BenchConfig, TEMPLATE_LEN};

use crate::{ctx::Ctx, maps::BENCH};

/// Writes the template into the frame, its UDP destination port
/// `port + (run % ports)`, and sends it back out.
#[inline(always)]
pub fn generate(ctx: &XdpContext) -> u32 {
    let Some(cfg) = BENCH.get_ptr_mut(0) else {
        return XDP_ABORTED;
    };
    // SAFETY: the benchmark's one-entry map; the generator runs on one CPU
    // (BPF_PROG_TEST_RUN), so the counter has one writer.
    let c: &mut BenchConfig = unsafe { &mut *cfg };
    if ctx.packet_len() < TEMPLATE_LEN {
        return XDP_ABORTED;
    }
    if ctx.store(0, &c.template).is_none() {
        return XDP_ABORTED;
    }
    let ports = if c.ports == 0 { 1 } else { c.ports };
    let i = (c.sent % ports) as u16;
    c.sent = c.sent.wrapping_add(1);
    if ctx
        .store(
            c.port_offset as usize & 0x3f,
            &c.first_port.wrapping_add(i).to_be(),
        )
        .is_none()
    {
        return XDP_ABORTED;
    }
    if c.second_offset != 0
        && ctx
            .store(
                c.second_offset as usize & 0x3f,
                &c.second_port.wrapping_add(i).to_be(),
            )
            .is_none()
    {
        return XDP_ABORTED;
    }
    XDP_TX
}

/// Redirects to the configured device.
#[inline(always)]
pub fn redirect(_ctx: &XdpContext) -> u32 {
    let Some(cfg) = BENCH.get(0) else {
        return XDP_ABORTED;
    };
    // SAFETY: helper without pointers.
    unsafe { bpf_redirect(cfg.redirect_ifindex, 0) as u32 }
}
