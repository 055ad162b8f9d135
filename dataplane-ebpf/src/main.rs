//! Entry points of the kernel programs. Only thin wrappers live here: each one
//! calls the real function, counts what happened, and returns its verdict.
#![no_std]
#![no_main]
// Map keys and values are passed by reference on purpose: by value they
// would be copied onto the 512-byte BPF stack first.
#![allow(clippy::needless_borrows_for_generic_args)]

mod csum;
mod ct;
mod flow;
mod icmp;
mod ingress;
mod lb;
mod maps;
mod nat;
mod packet;
mod reply;
mod sock;
mod stats;

use aya_ebpf::{
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};
use dataplane_common::stats::Hook;
use nat::Side;

/// North-south translation on the node's external devices.
#[xdp]
pub fn xdp_ingress(ctx: XdpContext) -> u32 {
    let len = (ctx.data_end() - ctx.data()) as u64;
    let (action, event) = ingress::run(&ctx);
    stats::count(Hook::XdpIngress, event, len);
    action
}

/// Parses like `xdp_ingress` and passes: the floor that benchmarks measure
/// against, and a pass-through for veth peers (veth delivers XDP_TX frames
/// only to a peer that runs an XDP program).
#[xdp]
pub fn xdp_floor(ctx: XdpContext) -> u32 {
    match packet::parse(&ctx) {
        packet::Parsed::Ipv4(p) if p.tuple.proto == 0xff => aya_ebpf::bindings::xdp_action::XDP_DROP,
        _ => aya_ebpf::bindings::xdp_action::XDP_PASS,
    }
}

/// The TC twin of `xdp_floor`: parses and lets the packet go; the floor of
/// the TC benchmarks.
#[classifier]
pub fn tc_floor(ctx: TcContext) -> i32 {
    match packet::parse(&ctx) {
        packet::Parsed::Ipv4(p) if p.tuple.proto == 0xff => aya_ebpf::bindings::TC_ACT_SHOT,
        _ => aya_ebpf::bindings::TC_ACT_OK,
    }
}

/// Packets leaving through an external device or towards a pod: SNAT, and
/// the frontend address restored on replies.
#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    tc_run(ctx, Hook::TcEgress, Side::Src)
}

/// Packets from pods, before the host routes them: replies of SNATed flows
/// sent back to the client.
#[classifier]
pub fn tc_pod_ingress(ctx: TcContext) -> i32 {
    tc_run(ctx, Hook::TcPodIngress, Side::Dst)
}

#[inline(always)]
fn tc_run(ctx: TcContext, hook: Hook, side: Side) -> i32 {
    let len = ctx.len() as u64;
    let (action, event) = reply::run(&ctx, side);
    stats::count(hook, event, len);
    action
}

/// Connect-time translation of the node's own connections to Services.
#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx)
}

/// Per-datagram translation of unconnected UDP sends to Services.
#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx)
}

/// The Service address, not the backend, as the source of received datagrams.
#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

/// The Service address, not the backend, as a connected socket's peer.
#[cgroup_sock_addr(getpeername4)]
pub fn sock_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
