//! Connect-time translation for the node's own processes (host-network
//! pods, node daemons): cgroup hooks rewrite the destination a socket
//! connects (or sends) to, once, instead of every packet. `getpeername` and
//! `recvmsg` show the Service address back. Same semantics as the packet
//! path, with the source being the node itself: eTP=Local external
//! destinations use the cluster set (kube-proxy masquerades the node's own
//! traffic), source ranges see the node's address.

use aya_ebpf::{
    bindings::{BPF_ANY, bpf_sock_addr},
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use dataplane_common::{
    config::config_flags,
    ct::{Sock4RevKey, Sock4RevValue},
    lb4::{Lb4ServiceKey, scope, service_flags},
    stats::{Event, Hook},
};

use crate::{
    ct, lb,
    maps::{CONFIG, SOCK_REVNAT},
    stats,
};

/// cgroup hook verdicts.
pub const ALLOW: i32 = 1;
pub const DENY: i32 = 0;
const ECONNREFUSED: i32 = 111;
const ETIMEDOUT: i32 = 110;

/// connect4 and sendmsg4: translate the destination. Returns the hook's
/// verdict; rejects set the error the caller sees.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext) -> i32 {
    let event = try_translate(ctx);
    stats::count(Hook::Socket, event, 0);
    match event {
        Event::RejectNoEndpoints | Event::RejectUnknownPort => deny(ECONNREFUSED),
        // A drop in the packet path; a socket cannot wait for it to time out.
        e if e.is_drop() => deny(ETIMEDOUT),
        _ => ALLOW,
    }
}

#[inline(always)]
fn deny(errno: i32) -> i32 {
    // SAFETY: helper with a plain argument.
    unsafe { bpf_set_retval(-errno) };
    DENY
}

#[inline(always)]
fn try_translate(ctx: &SockAddrContext) -> Event {
    let Some(cfg) = CONFIG.get(0) else {
        return Event::Pass;
    };
    if cfg.flags & config_flags::CONFIGURED == 0 {
        return Event::Pass;
    }
    // SAFETY: helper on our own context.
    if cfg.flags & config_flags::SOCKET_LB_HOST_ONLY != 0
        && unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) } != cfg.host_netns_cookie
    {
        return Event::Pass;
    }
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: the context is valid for the program's run.
    let (daddr, dport, proto) = unsafe { ((*sa).user_ip4, (*sa).user_port as u16, (*sa).protocol as u8) };
    let mut key = Lb4ServiceKey {
        address: daddr,
        port: dport,
        slot: 0,
        proto,
        scope: scope::EXTERNAL,
        _pad: [0; 2],
    };
    let Some(mut svc) = lb::frontend(&key) else {
        if lb::is_service_address(daddr) {
            return Event::RejectUnknownPort;
        }
        return Event::Pass;
    };
    if svc.flags & service_flags::TWO_SCOPES != 0 {
        key.scope = scope::INTERNAL;
        match lb::frontend(&key) {
            Some(s) => svc = s,
            None => return Event::DropNoBackend,
        }
    }
    let source = cfg.snat_ip;
    if svc.flags & service_flags::SOURCE_RANGES != 0 && !lb::source_allowed(svc.service_id, source) {
        return Event::DropSourceRange;
    }
    if svc.count == 0 {
        return if svc.flags & service_flags::REJECT_EMPTY != 0 {
            Event::RejectNoEndpoints
        } else {
            Event::DropNoLocalEndpoint
        };
    }
    let Some((_, be)) = lb::select(&key, &svc, source, ct::now()) else {
        return Event::DropNoBackend;
    };
    // SAFETY: helper on our own context; writes to writable context fields.
    unsafe {
        let rev = Sock4RevKey {
            cookie: bpf_get_socket_cookie(ctx.sock_addr.cast()),
            addr: be.address,
            port: be.port,
            _pad: 0,
        };
        let value = Sock4RevValue {
            addr: daddr,
            port: dport,
            _pad: 0,
        };
        let _ = SOCK_REVNAT.insert(&rev, &value, BPF_ANY as u64);
        (*sa).user_ip4 = be.address;
        (*sa).user_port = be.port as u32;
    }
    stats::count_service(svc.service_id, 0);
    Event::NewFlow
}

/// recvmsg4 and getpeername4: show the Service address for a translated
/// socket's backend.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext) -> i32 {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: the context is valid for the program's run; helper on it.
    unsafe {
        let key = Sock4RevKey {
            cookie: bpf_get_socket_cookie(ctx.sock_addr.cast()),
            addr: (*sa).user_ip4,
            port: (*sa).user_port as u16,
            _pad: 0,
        };
        if let Some(v) = SOCK_REVNAT.get(&key) {
            (*sa).user_ip4 = v.addr;
            (*sa).user_port = v.port as u32;
        }
    }
    ALLOW
}
