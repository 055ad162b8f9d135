//! Entry points of the kernel programs. Only thin wrappers live here: each one
//! calls the real function, counts what happened, and returns its verdict.
#![no_std]
// Inline assembly for single-instruction packet accesses (`unaligned`).
#![feature(asm_experimental_arch)]
#![no_main]
// Map keys and values are passed by reference on purpose: by value they
// would be copied onto the 512-byte BPF stack first.
#![allow(clippy::needless_borrows_for_generic_args)]

mod bench;
mod csum;
mod ct;
mod ctx;
mod dsr;
mod family;
mod filter;
mod flow;
mod hdr;
mod icmp;
mod lb;
mod maps;
mod monitor;
mod nat;
mod parse;
mod path;
mod route;
mod snat;
mod sock;
mod stats;
mod unaligned;
mod zero;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};
use dataplane_common::stats::Hook;

/// North-south translation on the node's external devices, in XDP.
#[xdp]
pub fn xdp_ingress(ctx: XdpContext) -> u32 {
    path::ingress(&ctx, Hook::XdpIngress)
}

/// The same, in TC ingress: devices where XDP is slower or cannot send
/// packets back (veth), and `--xdp-mode off`.
#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    path::ingress(&ctx, Hook::TcIngress)
}

/// Packets from pods, before the host routes them: new flows to Services,
/// established ones, replies of masqueraded flows.
#[classifier]
pub fn tc_pod_ingress(ctx: TcContext) -> i32 {
    path::ingress(&ctx, Hook::TcPodIngress)
}

/// Packets leaving through an external device or towards a pod: SNAT, and
/// the frontend address restored on replies.
#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    path::egress(&ctx, Hook::TcEgress)
}

/// Parses like the translating programs and passes: the floor that
/// benchmarks measure against, and a pass-through for veth peers (veth
/// delivers XDP_TX frames only to a peer that runs an XDP program).
#[xdp]
pub fn xdp_floor(ctx: XdpContext) -> u32 {
    match parse::parse(&ctx) {
        parse::Parsed::V4(p) if p.tuple.proto == 0xff => xdp_action::XDP_DROP,
        _ => xdp_action::XDP_PASS,
    }
}

/// CLOCK_MONOTONIC (ns) and jiffies, read one after the other, written
/// into the first 16 bytes of the frame: run once or twice by the agent
/// (BPF_PROG_TEST_RUN, never attached) to tell the kernel's HZ, which the
/// datapath clock (`ct::now`) needs.
#[xdp]
pub fn xdp_clock(ctx: XdpContext) -> u32 {
    // SAFETY: helpers without arguments.
    let (now, jiffies) = unsafe {
        (
            aya_ebpf::helpers::bpf_ktime_get_ns(),
            aya_ebpf::helpers::bpf_jiffies64(),
        )
    };
    use ctx::Ctx;
    if ctx.store(0, &now).is_none() || ctx.store(8, &jiffies).is_none() {
        return xdp_action::XDP_ABORTED;
    }
    xdp_action::XDP_PASS
}

/// The forwarding benchmark's generator (`cargo xtask bench`, never
/// attached): run with BPF_PROG_TEST_RUN in live-frame mode on the sending
/// veth, it writes the whole frame from the template in `DP_BENCH_V1` on
/// every run (live frames are recycled as the receiving stack left them),
/// the UDP destination port cycling over `ports` consecutive ports, and
/// sends it with `XDP_TX` (to the veth's peer).
#[xdp]
pub fn xdp_bench_gen(ctx: XdpContext) -> u32 {
    bench::generate(&ctx)
}

/// The forwarding benchmark's floor: every frame redirected, untouched, to
/// the device in `DP_BENCH_V1`.
#[xdp]
pub fn xdp_bench_redirect(ctx: XdpContext) -> u32 {
    bench::redirect(&ctx)
}

/// The forwarding benchmark's sink: drops every frame (the receiving
/// veth's `xdp_drops` counter counts them).
#[xdp]
pub fn xdp_bench_drop(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

/// The TC twin of `xdp_floor`: the floor of the TC benchmarks.
#[classifier]
pub fn tc_floor(ctx: TcContext) -> i32 {
    match parse::parse(&ctx) {
        parse::Parsed::V4(p) if p.tuple.proto == 0xff => TC_ACT_SHOT,
        _ => TC_ACT_OK,
    }
}

/// Connect-time translation of the node's own connections to Services.
#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, false)
}

/// Per-datagram translation of unconnected UDP sends to Services.
#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, false)
}

/// The Service address, not the backend, as the source of received datagrams.
#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, false)
}

/// The Service address, not the backend, as a connected socket's peer.
#[cgroup_sock_addr(getpeername4)]
pub fn sock_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, false)
}

/// The four above for IPv6 sockets.
#[cgroup_sock_addr(connect6)]
pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, true)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, true)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, true)
}

#[cgroup_sock_addr(getpeername6)]
pub fn sock_getpeername6(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, true)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
