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
    config::{DpConfig, config_flags},
    ct::{Sock4RevKey, Sock4RevValue, Sock6RevKey, Sock6RevValue},
    lb::{LbBackend, LbServiceKey, service_flags},
    stats::{Event, Hook},
};

use crate::{
    ct,
    family::{Family, V4, V6},
    flow, lb,
    maps::{CONFIG, SOCK_REVNAT, SOCK_REVNAT6},
    stats,
};

/// cgroup hook verdicts.
pub const ALLOW: i32 = 1;
pub const DENY: i32 = 0;
const ECONNREFUSED: i32 = 111;
const ETIMEDOUT: i32 = 110;

/// connect and sendmsg, both families: translate the destination. Returns
/// the hook's verdict; rejects set the error the caller sees.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext, v6: bool) -> i32 {
    let event = if v6 {
        try_translate6(ctx)
    } else {
        try_translate4(ctx)
    };
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

/// The config, if connect-time translation applies to this socket: any
/// network namespace in the cgroup, or the node's alone with
/// `--socket-lb-host-only` and always for a loopback destination (a pod's
/// 127.0.0.1 is its own; localhost NodePorts are the node's).
#[inline(always)]
fn applies<F: Family>(ctx: &SockAddrContext, daddr: &F::A) -> Option<&'static DpConfig> {
    let cfg = CONFIG.get(0)?;
    if cfg.flags & config_flags::CONFIGURED == 0 {
        return None;
    }
    let loopback = F::is_loopback(daddr);
    if loopback && cfg.flags & config_flags::LOCALHOST_NODEPORTS == 0 {
        return None;
    }
    // SAFETY: helper on our own context.
    if (cfg.flags & config_flags::SOCKET_LB_HOST_ONLY != 0 || loopback)
        && unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) } != cfg.host_netns_cookie
    {
        return None;
    }
    Some(cfg)
}

/// The backend a socket to `daddr:dport` gets, as the packet path would
/// choose it for the node itself as the source: in the cluster (eTP=Local
/// external destinations use the cluster set), its own address for source
/// ranges. A loopback destination (`applies` let it through: localhost
/// NodePorts are on) is a localhost NodePort: the NodePort of the node's
/// primary address of the family, and nothing else found there (an
/// externalIP or a LoadBalancer IP equal to the node's address is not
/// reachable on loopback, as with kube-proxy). The socket then picks its
/// source for the backend's route: an address of the node, never
/// 127.0.0.1, as kube-proxy's MASQUERADE of localhost NodePorts gives.
#[inline(always)]
fn pick<F: Family>(cfg: &DpConfig, daddr: F::A, dport: u16, proto: u8) -> Result<LbBackend<F::A>, Event> {
    let source = F::snat_ip(cfg);
    let frontend = if F::is_loopback(&daddr) {
        let key = LbServiceKey {
            address: source,
            port: dport,
            proto,
            ..Default::default()
        };
        match lb::frontend::<F>(&key) {
            Some(svc) if svc.flags & service_flags::KIND_MASK == service_flags::NODE_PORT => source,
            _ => return Err(Event::Pass),
        }
    } else {
        daddr
    };
    let (key, svc) = flow::resolve::<F>(cfg, frontend, dport, proto, source, true)?;
    let (_, be) = lb::select::<F>(cfg, &key, &svc, source, None, ct::now()).ok_or(Event::DropNoBackend)?;
    stats::count_service(svc.service_id, 0);
    Ok(be)
}

#[inline(always)]
fn try_translate4(ctx: &SockAddrContext) -> Event {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: the context is valid for the program's run.
    let (daddr, dport, proto) = unsafe { ((*sa).user_ip4, (*sa).user_port as u16, (*sa).protocol as u8) };
    let Some(cfg) = applies::<V4>(ctx, &daddr) else {
        return Event::Pass;
    };
    let be = match pick::<V4>(cfg, daddr, dport, proto) {
        Ok(be) => be,
        Err(event) => return event,
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
    Event::NewFlow
}

#[inline(always)]
fn try_translate6(ctx: &SockAddrContext) -> Event {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: the context is valid for the program's run; the verifier
    // wants `user_ip6` read and written a word at a time.
    let (daddr, dport, proto) = unsafe {
        (
            [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ],
            (*sa).user_port as u16,
            (*sa).protocol as u8,
        )
    };
    let Some(cfg) = applies::<V6>(ctx, &daddr) else {
        return Event::Pass;
    };
    let be = match pick::<V6>(cfg, daddr, dport, proto) {
        Ok(be) => be,
        Err(event) => return event,
    };
    // SAFETY: as above; writes to writable context fields.
    unsafe {
        let rev = Sock6RevKey {
            cookie: bpf_get_socket_cookie(ctx.sock_addr.cast()),
            addr: be.address,
            port: be.port,
            _pad0: 0,
            _pad1: 0,
        };
        let value = Sock6RevValue {
            addr: daddr,
            port: dport,
            _pad: 0,
        };
        let _ = SOCK_REVNAT6.insert(&rev, &value, BPF_ANY as u64);
        (*sa).user_ip6[0] = be.address[0];
        (*sa).user_ip6[1] = be.address[1];
        (*sa).user_ip6[2] = be.address[2];
        (*sa).user_ip6[3] = be.address[3];
        (*sa).user_port = be.port as u32;
    }
    Event::NewFlow
}

/// recvmsg and getpeername: show the Service address for a translated
/// socket's backend.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext, v6: bool) -> i32 {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: the context is valid for the program's run; helper on it;
    // `user_ip6` a word at a time.
    unsafe {
        let cookie = bpf_get_socket_cookie(ctx.sock_addr.cast());
        if v6 {
            let key = Sock6RevKey {
                cookie,
                addr: [
                    (*sa).user_ip6[0],
                    (*sa).user_ip6[1],
                    (*sa).user_ip6[2],
                    (*sa).user_ip6[3],
                ],
                port: (*sa).user_port as u16,
                _pad0: 0,
                _pad1: 0,
            };
            if let Some(v) = SOCK_REVNAT6.get(&key) {
                let addr = v.addr;
                (*sa).user_ip6[0] = addr[0];
                (*sa).user_ip6[1] = addr[1];
                (*sa).user_ip6[2] = addr[2];
                (*sa).user_ip6[3] = addr[3];
                (*sa).user_port = v.port as u32;
            }
        } else {
            let key = Sock4RevKey {
                cookie,
                addr: (*sa).user_ip4,
                port: (*sa).user_port as u16,
                _pad: 0,
            };
            if let Some(v) = SOCK_REVNAT.get(&key) {
                (*sa).user_ip4 = v.addr;
                (*sa).user_port = v.port as u32;
            }
        }
    }
    ALLOW
}
