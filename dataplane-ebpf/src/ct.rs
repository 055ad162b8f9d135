//! Connection tracking: lookups with expiry, entry creation with
//! collision-safe SNAT port allocation.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns},
};
use dataplane_common::{
    config::DpConfig,
    ct::{Ct4Entry, Ct4Key, ct_flags},
    lb4::{Lb4Backend, Lb4Service, backend_flags},
    limits, proto,
    stats::Event,
};

use crate::{
    maps::{BACKENDS, CT4},
    packet::{TCP_FIN, TCP_RST},
};

const NS_PER_S: u64 = 1_000_000_000;

/// Coarse monotonic time (jiffies resolution): timeouts are seconds, and the
/// precise clock costs ~20 ns per packet in a VM.
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_coarse_ns() }
}

#[inline(always)]
fn timeout_ns(cfg: &DpConfig, proto: u8, flags: u16) -> u64 {
    let s = if proto == proto::TCP {
        if flags & ct_flags::CLOSING != 0 {
            cfg.ct_tcp_close_timeout_s
        } else {
            cfg.ct_tcp_timeout_s
        }
    } else {
        cfg.ct_udp_timeout_s
    };
    s as u64 * NS_PER_S
}

#[inline(always)]
fn expired(cfg: &DpConfig, proto: u8, e: &Ct4Entry, now: u64) -> bool {
    now.wrapping_sub(e.last_seen_ns) > timeout_ns(cfg, proto, e.flags)
}

/// The live entry for `key`, if any (expired entries are ignored; the LRU
/// reclaims them).
#[inline(always)]
pub fn lookup(cfg: &DpConfig, key: &Ct4Key, now: u64) -> Option<*mut Ct4Entry> {
    let e = CT4.get_ptr_mut(key)?;
    // SAFETY: map value pointer, valid for the program's run.
    if expired(cfg, key.proto, unsafe { &*e }, now) {
        return None;
    }
    Some(e)
}

/// Refreshes the entry (at most once a second, to spare the cache line) and
/// notes TCP connection teardown.
#[inline(always)]
pub fn touch(e: *mut Ct4Entry, now: u64, tcp_flags: u8) {
    // SAFETY: map value pointer; racing writers store equivalent values.
    unsafe {
        if now.wrapping_sub((*e).last_seen_ns) > NS_PER_S {
            (*e).last_seen_ns = now;
        }
        if tcp_flags & (TCP_FIN | TCP_RST) != 0 && (*e).flags & ct_flags::CLOSING == 0 {
            (*e).flags |= ct_flags::CLOSING;
        }
    }
}

/// A forward entry may only be used while its backend still exists with the
/// address it was translated to (ids are reused after removal).
#[inline(always)]
pub fn backend_valid(e: &Ct4Entry) -> bool {
    BACKENDS.get(e.backend_id).is_some_and(|b| {
        b.flags & backend_flags::ACTIVE != 0 && b.address == e.nat_daddr && b.port == e.nat_dport
    })
}

/// Creates the entries of a new flow `t` (client → frontend) to `be`, and
/// returns the one the ingress hook applies now.
///
/// Destinations are rewritten where packets enter the node (XDP, TC ingress
/// on pod interfaces) and sources where they leave it (TC egress), as
/// netfilter does in PREROUTING and POSTROUTING: the kernel routes every
/// packet in between with a non-local source, so nothing looks martian. Each
/// entry is keyed by the tuple its hook sees:
///
/// | entry | key (as seen)            | hook    | rewrites                  |
/// |-------|--------------------------|---------|---------------------------|
/// | A     | client → frontend        | ingress | dst → backend             |
/// | B     | client → backend         | egress  | src → node:snat (SNAT)    |
/// | C     | backend → node:snat      | ingress | dst → client (SNAT)       |
/// | D     | backend → client         | egress  | src → frontend            |
///
/// Every entry carries the full tuple the packet ends up with, so ICMP
/// error translation and `inspect` can read the whole flow from any of them.
/// With `snat`, the port is claimed atomically (`BPF_NOEXIST` on C's key).
#[inline(always)]
pub fn create(
    cfg: &DpConfig,
    t: &Ct4Key,
    svc: &Lb4Service,
    backend_id: u32,
    be: &Lb4Backend,
    snat: bool,
    now: u64,
) -> Result<Ct4Entry, Event> {
    let flags = if snat { ct_flags::SNAT } else { 0 };
    // As the backend sees the flow: from (client or node:snat) to backend.
    let mut forward = Ct4Entry {
        last_seen_ns: now,
        nat_saddr: t.saddr,
        nat_daddr: be.address,
        nat_sport: t.sport,
        nat_dport: be.port,
        backend_id,
        service_id: svc.service_id,
        flags,
        _pad: 0,
    };
    // As the client sees the replies: from frontend to client.
    let reply = Ct4Entry {
        nat_saddr: t.daddr,
        nat_daddr: t.saddr,
        nat_sport: t.dport,
        nat_dport: t.sport,
        flags: flags | ct_flags::REPLY,
        ..forward
    };
    let key_d = Ct4Key {
        saddr: be.address,
        daddr: t.saddr,
        sport: be.port,
        dport: t.sport,
        proto: t.proto,
        _pad: [0; 3],
    };
    if snat {
        let mut key_c = Ct4Key {
            daddr: cfg.snat_ip,
            ..key_d
        };
        let (min, max) = (cfg.snat_port_min as u32, cfg.snat_port_max as u32);
        if max < min {
            return Err(Event::DropSnatExhausted);
        }
        // SAFETY: helper without arguments.
        let mut port = min
            + unsafe { bpf_get_prandom_u32() }
                .checked_rem(max - min + 1)
                .unwrap_or(0);
        let mut claimed = false;
        let mut i = 0;
        while i < limits::SNAT_ATTEMPTS {
            key_c.dport = (port as u16).to_be();
            if CT4.insert(&key_c, &reply, BPF_NOEXIST as u64).is_ok() {
                claimed = true;
                break;
            }
            // A port held by an expired flow may be taken over.
            if let Some(old) = CT4.get_ptr(&key_c)
                // SAFETY: map value pointer.
                && expired(cfg, t.proto, unsafe { &*old }, now)
                && CT4.insert(&key_c, &reply, BPF_ANY as u64).is_ok()
            {
                claimed = true;
                break;
            }
            port = if port >= max { min } else { port + 1 };
            i += 1;
        }
        if !claimed {
            return Err(Event::DropSnatExhausted);
        }
        forward.nat_saddr = cfg.snat_ip;
        forward.nat_sport = key_c.dport;
        let key_b = Ct4Key {
            daddr: be.address,
            dport: be.port,
            ..*t
        };
        if CT4.insert(&key_b, &forward, BPF_ANY as u64).is_err() {
            return Err(Event::DropCtFull);
        }
    }
    if CT4.insert(&key_d, &reply, BPF_ANY as u64).is_err() || CT4.insert(t, &forward, BPF_ANY as u64).is_err()
    {
        return Err(Event::DropCtFull);
    }
    Ok(forward)
}
