//! SNAT port choice for a masqueraded flow (client → backend becomes
//! node : port → backend). The port is claimed by inserting the flow's
//! `REP_IN` entry (backend → node : port) with `BPF_NOEXIST`.
//!
//! First choice: the port hashed from the client's address and port, which
//! egress hooks recompute from the packet, so the flow needs no egress
//! entries. A live flow from the same client port to the same backend
//! through another frontend holding it is a clash (`ct::clear_tuple`): the
//! new flow is dropped. When another live flow to the same backend holds it, ports are
//! tried from a per-CPU, per-backend cursor that advances through the range:
//! consecutive flows to a backend get ports far apart in time, and a port
//! is taken again only after the whole range has gone round. A port held by
//! a closed or expired flow is taken over, but one whose flow (another
//! client's) its backend closed first less than `ct::TCP_TIME_WAIT_NS` ago
//! is held (the backend keeps the tuple in TIME_WAIT), whether conntrack
//! still has that flow or only `SNAT*_CLOSED` remembers its closure: the search
//! passes over held ports and takes one of them only when none of its
//! `SNAT_ATTEMPTS` tries found a free one. Only when every port tried is
//! held by a live flow does a new flow find nothing (after `SNAT_ATTEMPTS`
//! tries; then the backend is spared the search for `SNAT_BACKOFF_MS`).

use aya_ebpf::helpers::bpf_get_prandom_u32;
use dataplane_common::{
    config::DpConfig,
    ct::{CtKey, SnatCursor, ct_flags},
    limits,
    stats::{Event, FlowStat},
};

use crate::{
    ct::{self, Claim},
    family::Family,
    flow::Choice,
    maps::{CtScratch, SNAT_CURSORS},
    stats,
};

/// Claims a port for the masqueraded flow `t` to `choice`'s backend by
/// inserting its `REP_IN` entry; fills `choice.snat_port` (network order)
/// and `choice.explicit` (not the hashed port: the flow then needs explicit
/// egress entries). A subprogram, called beside `ct::create`, not below it.
#[inline(never)]
pub fn claim<F: Family>(cfg: &DpConfig, t: &CtKey<F::A>, choice: &mut Choice<F::A>, now: u64) -> Event {
    let Some(s) = ct::scratch::<F>() else {
        return Event::DropSnatExhausted;
    };
    ct::entries(s, t, choice, now);
    s.b.flags = ct_flags::REP_IN | ct_flags::SNAT;
    match search::<F>(cfg, t, choice.backend_id, s, now) {
        Ok((port, explicit)) => {
            choice.snat_port = port;
            choice.explicit = explicit;
            Event::NewFlow
        }
        Err(event) => event,
    }
}

/// Finds and claims the port; `s.b` holds the `REP_IN` entry to insert,
/// `s.key` is the key under construction.
#[inline(always)]
fn search<F: Family>(
    cfg: &DpConfig,
    t: &CtKey<F::A>,
    backend_id: u32,
    s: &mut CtScratch<F::A>,
    now: u64,
) -> Result<(u16, bool), Event> {
    let (min, max) = (cfg.snat_port_min, cfg.snat_port_max);
    let snat_ip = F::snat_ip(cfg);
    // No SNAT address in this family (an IPv6 flow on a node without one):
    // the flow cannot be masqueraded.
    if max < min || snat_ip == Default::default() {
        return Err(Event::DropSnatExhausted);
    }
    let hashed = ct::hashed_port(cfg, t.saddr, t.sport);
    s.key = CtKey::new(s.a.nat_daddr, snat_ip, s.a.nat_dport, hashed.to_be(), t.proto);
    let outcome = ct::claim::<F>(cfg, &s.key, &s.b, now, Some(t), true);
    match outcome {
        Claim::Clash => return Err(Event::DropTupleClash),
        Claim::TakenOver => stats::count_flow(FlowStat::SnatTakeover),
        Claim::TupleTakenOver => stats::count_flow(FlowStat::TupleTakeover),
        _ => {}
    }
    if outcome.won() {
        stats::count_flow(FlowStat::SnatHashed);
        return Ok((s.key.dport, false));
    }
    // Held ports (another client's flow closed on them moments ago) are
    // passed over, one kept in case no free one is found.
    set_spare(s, 0);
    if outcome == Claim::TimeWait {
        stats::count_flow(FlowStat::SnatTimeWaitHeld);
        set_spare(s, hashed);
    }
    s.b.flags |= ct_flags::EXPLICIT;
    let range = max as u32 - min as u32 + 1;
    let Some(cursor) = SNAT_CURSORS.get_ptr_mut(backend_id) else {
        return Err(Event::DropSnatExhausted);
    };
    // SAFETY: this CPU's slot of a per-CPU array, only written here.
    let (mut next, backoff_until) = unsafe { ((*cursor).next, (*cursor).backoff_until_ms) };
    let now_ms = (now / 1_000_000) as u32;
    // Exhausted a moment ago (0: never): spare the search (a wrapping
    // comparison: the clock in ms wraps every 49 days).
    if backoff_until != 0 && (backoff_until.wrapping_sub(now_ms) as i32) > 0 {
        stats::count_flow(FlowStat::SnatBackoff);
        return take_spare::<F>(cfg, t, s, hashed, now);
    }
    if next == 0 {
        // SAFETY: helper without arguments.
        next = unsafe { bpf_get_prandom_u32() } | 1;
    }
    let mut i = 0;
    while i < limits::SNAT_ATTEMPTS {
        let port = (min as u32 + next % range) as u16;
        next = next.wrapping_add(1);
        i += 1;
        if port == hashed {
            continue;
        }
        s.key.dport = port.to_be();
        let outcome = ct::claim::<F>(cfg, &s.key, &s.b, now, None, true);
        if outcome.won() {
            jump_if_held(s, cursor, next);
            stats::count_flow(FlowStat::SnatFallback);
            if outcome == Claim::TakenOver {
                stats::count_flow(FlowStat::SnatTakeover);
            }
            return Ok((s.key.dport, true));
        }
        if outcome == Claim::TimeWait {
            // Kept in case no free port is found (the last one held: any
            // is as good, and a store spares the verifier a branch).
            set_spare(s, port);
        } else {
            stats::count_flow(FlowStat::SnatPortsBusy);
        }
    }
    jump_if_held(s, cursor, next);
    if spare(s) == 0 {
        // Every port tried is held by a live flow: the range is exhausted.
        // SAFETY: as above.
        unsafe { (*cursor).backoff_until_ms = now_ms.wrapping_add(limits::SNAT_BACKOFF_MS).max(1) };
    }
    take_spare::<F>(cfg, t, s, hashed, now)
}

/// When no free port was found: a held port (`s.spare`) after all (0:
/// none, the range is held by live flows: exhausted), taken over and
/// counted `snat_time_wait_reuse`. The hashed port needs no explicit
/// entries.
#[inline(always)]
fn take_spare<F: Family>(
    cfg: &DpConfig,
    t: &CtKey<F::A>,
    s: &mut CtScratch<F::A>,
    hashed: u16,
    now: u64,
) -> Result<(u16, bool), Event> {
    let spare = spare(s);
    if spare == 0 {
        return Err(Event::DropSnatExhausted);
    }
    let explicit = spare != hashed;
    if !explicit {
        s.b.flags &= !ct_flags::EXPLICIT;
    }
    s.key.dport = spare.to_be();
    let flow = if explicit { None } else { Some(t) };
    if !ct::claim::<F>(cfg, &s.key, &s.b, now, flow, false).won() {
        return Err(Event::DropSnatExhausted);
    }
    stats::count_flow(FlowStat::SnatTimeWaitReuse);
    Ok((s.key.dport, explicit))
}

/// The search's held port (`CtScratch::spare`), read and written as memory
/// the verifier does not follow (volatile: not kept in a register).
#[inline(always)]
fn spare<A>(s: &CtScratch<A>) -> u16 {
    // SAFETY: a field of this CPU's scratch slot.
    unsafe { core::ptr::read_volatile(&s.spare) as u16 }
}

#[inline(always)]
fn set_spare<A>(s: &mut CtScratch<A>, port: u16) {
    // SAFETY: as above.
    unsafe { core::ptr::write_volatile(&mut s.spare, port as u32) }
}

/// Stores where the backend's search resumes: `next`, or a random place in
/// the range when this search met a held port. Held ports in a row are most
/// likely another CPU's cursor's trail (its ports, closed since), which a
/// cursor advancing at the same pace would otherwise follow for thousands
/// of flows (one run of the churn test reused 319 held ports that way).
/// Jumping within the search cost the verifier 60k instructions (the
/// random value's bounds are new to it at every probe); here it is one
/// store.
#[inline(always)]
fn jump_if_held<A>(s: &CtScratch<A>, cursor: *mut SnatCursor, next: u32) {
    let next = if spare(s) != 0 {
        // SAFETY: helper without arguments.
        unsafe { bpf_get_prandom_u32() }
    } else {
        next
    };
    // SAFETY: this CPU's slot of a per-CPU array, only written here.
    unsafe { (*cursor).next = next };
}
