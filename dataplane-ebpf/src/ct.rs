//! Connection tracking: lookups with expiry, entry creation with
//! collision-safe SNAT port allocation.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
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

#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_ns() }
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

/// Creates both entries of a new flow `t` → `be` and returns the forward
/// one. With `snat`, the source becomes `cfg.snat_ip` and a source port no
/// other flow to the same backend uses (claimed atomically with
/// `BPF_NOEXIST` on the reply entry).
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
    let reply = Ct4Entry {
        last_seen_ns: now,
        nat_saddr: t.daddr,
        nat_daddr: t.saddr,
        nat_sport: t.dport,
        nat_dport: t.sport,
        backend_id,
        service_id: svc.service_id,
        flags: flags | ct_flags::REPLY,
        _pad: 0,
    };
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
    let mut rkey = Ct4Key {
        saddr: be.address,
        daddr: t.saddr,
        sport: be.port,
        dport: t.sport,
        proto: t.proto,
        _pad: [0; 3],
    };
    if snat {
        rkey.daddr = cfg.snat_ip;
        forward.nat_saddr = cfg.snat_ip;
        let (min, max) = (cfg.snat_port_min as u32, cfg.snat_port_max as u32);
        if max < min {
            return Err(Event::DropSnatExhausted);
        }
        // SAFETY: helper without arguments.
        let mut port = min + unsafe { bpf_get_prandom_u32() }.checked_rem(max - min + 1).unwrap_or(0);
        let mut claimed = false;
        let mut i = 0;
        while i < limits::SNAT_ATTEMPTS {
            rkey.dport = (port as u16).to_be();
            if CT4.insert(&rkey, &reply, BPF_NOEXIST as u64).is_ok() {
                claimed = true;
                break;
            }
            // A port held by an expired flow may be taken over.
            if let Some(old) = CT4.get_ptr(&rkey)
                // SAFETY: map value pointer.
                && expired(cfg, t.proto, unsafe { &*old }, now)
                && CT4.insert(&rkey, &reply, BPF_ANY as u64).is_ok()
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
        forward.nat_sport = rkey.dport;
    } else if CT4.insert(&rkey, &reply, BPF_ANY as u64).is_err() {
        return Err(Event::DropCtFull);
    }
    if CT4.insert(t, &forward, BPF_ANY as u64).is_err() {
        return Err(Event::DropCtFull);
    }
    Ok(forward)
}
