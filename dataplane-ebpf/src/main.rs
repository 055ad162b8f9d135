//! Entry points of the kernel programs. Only thin wrappers live here: each one
//! calls the real function and turns its result into a verdict, counting what
//! happened.
#![no_std]
#![no_main]

mod stats;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use dataplane_common::stats::CounterIndex;

/// North-south entry point on the node's external devices.
#[xdp]
pub fn xdp_ingress(ctx: XdpContext) -> u32 {
    let len = (ctx.data_end() - ctx.data()) as u64;
    stats::count(CounterIndex::Rx, len);
    stats::count(CounterIndex::Pass, len);
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
