//! Connection tracking (see `dataplane_common::ct` for the entries and their
//! roles): lookups with state-dependent expiry, the flow's state kept on its
//! two state entries, and entry creation.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns},
};
use dataplane_common::{
    addr::Addr,
    config::DpConfig,
    ct::{CtEntry, CtKey, SnatClosed, ct_flags, snat_port_hash, state},
    proto,
    stats::{Event, FlowStat},
};

use crate::{
    family::Family,
    flow::Choice,
    hdr::{TCP_FIN, TCP_RST, TCP_SYN},
    maps::CtScratch,
};

const NS_PER_S: u64 = 1_000_000_000;

/// Nanoseconds per jiffy (10^9 / the kernel's HZ), set by the agent at load
/// time; 0 when it could not tell HZ (see the agent's `dataplane::clock`).
/// In `.rodata`: frozen before the programs load, so the verifier knows the
/// value and drops the branch `now` does not take.
#[unsafe(no_mangle)]
static JIFFY_NS: u64 = 0;
/// CLOCK_MONOTONIC minus `jiffies * JIFFY_NS` when the agent loaded the
/// programs (wrapping): makes `now` the monotonic clock at tick resolution.
#[unsafe(no_mangle)]
static JIFFIES_OFFSET_NS: u64 = 0;

/// Monotonic time in ns at tick resolution: timeouts are seconds. Read from
/// jiffies (`bpf_jiffies64`, which the verifier inlines: one load), else
/// from `bpf_ktime_get_coarse_ns` (a helper call: about a tenth of an
/// established packet's time in a profile). The two agree to within a few ticks,
/// so entries written by programs on either clock stay valid across a
/// restart; ages are taken with saturating subtractions for that skew.
///
/// [`now_inline`] as a subprogram, for the new-flow and ICMP paths: inlined
/// there, its two constants stay live in registers the largest frames need.
#[inline(never)]
pub fn now() -> u64 {
    now_inline()
}

/// The clock itself, inline in the per-packet lookup paths: a subprogram's
/// return is a mispredicted branch where the kernel returns through a
/// thunk (about 5 ns of an established packet's time on such a machine).
#[inline(always)]
pub fn now_inline() -> u64 {
    // SAFETY: reads of load-time constants.
    let (tick, offset) = unsafe {
        (
            core::ptr::read_volatile(&JIFFY_NS),
            core::ptr::read_volatile(&JIFFIES_OFFSET_NS),
        )
    };
    if tick != 0 {
        // SAFETY: helper without arguments.
        unsafe { bpf_jiffies64() }.wrapping_mul(tick).wrapping_add(offset)
    } else {
        // SAFETY: helper without arguments.
        unsafe { bpf_ktime_get_coarse_ns() }
    }
}

/// Idle timeout of an entry in its flow's current state.
#[inline(always)]
fn timeout_ns<A: Addr>(cfg: &DpConfig, proto: u8, e: &CtEntry<A>) -> u64 {
    e.timeout_s(proto, &cfg.timeouts) as u64 * NS_PER_S
}

#[inline(always)]
pub fn expired<A: Addr>(cfg: &DpConfig, proto: u8, e: &CtEntry<A>, now: u64) -> bool {
    now.saturating_sub(e.last_seen_ns) > timeout_ns(cfg, proto, e)
}

/// How long a port whose TCP flow its backend closed first is not given to
/// another client: netfilter's TIME_WAIT timeout. The backend holds the
/// tuple (backend ↔ node : port) in TIME_WAIT (60 s on Linux),
/// and a SYN from another client on that tuple, whose sequence numbers and
/// timestamps bear no relation to the old ones, is then answered with an
/// ACK of the old connection instead of a SYN-ACK: the new connection
/// stalls until the client retransmits past it, or fails.
pub const TCP_TIME_WAIT_NS: u64 = 120 * NS_PER_S;

/// Whether a new flow may take the entry's tuple over: it expired, or its
/// TCP connection has ended.
#[inline(always)]
pub fn reusable<A: Addr>(cfg: &DpConfig, proto: u8, e: &CtEntry<A>, now: u64) -> bool {
    (proto == proto::TCP && e.tcp_closed()) || expired(cfg, proto, e, now)
}

/// The entry for `key`, expired or not: from the conntrack LRU or, for an
/// assured flow's entry the LRU evicted, put back there from its copy
/// ([`restore`]). Every pointer this returns points into the LRU: the
/// verifier follows one kind of entry, whatever its origin.
#[inline(always)]
fn get<F: Family>(key: &CtKey<F::A>) -> Option<*mut CtEntry<F::A>> {
    match F::ct().get_ptr_mut(key) {
        Some(e) => Some(e),
        None if restore::<F>(key) => F::ct().get_ptr_mut(key),
        None => None,
    }
}

/// Puts an assured flow's entry the LRU evicted back from its copy in the
/// assured table (counted `ct_restored`); `false` when `key` has no copy
/// either (a new flow). Of CPUs restoring one entry at once, one inserts
/// the copy; all return `true`. It returns no pointer: one from this
/// frame would keep the verifier from pruning the established path after
/// it against the LRU hit's (measured: the budget test's `xdp_ingress`
/// past a million instructions).
#[inline(never)]
fn restore<F: Family>(key: &CtKey<F::A>) -> bool {
    let Some(c) = F::ct_assured().get_ptr(key) else {
        return false;
    };
    // SAFETY: a map value pointer, valid for this run; the helper copies it.
    if F::ct().insert(key, unsafe { &*c }, BPF_NOEXIST as u64).is_ok() {
        crate::stats::count_flow(FlowStat::CtRestored);
    }
    true
}

/// A copy of the entry for `key`, from the LRU or, for an assured flow's
/// entry the LRU evicted, from its copy; `None` when there is neither.
/// For the checks of who holds a key (`clear_tuple`, `claim`): nothing is
/// put back. The copy is this CPU's (`DP_CT_PEEK*`), valid until the next
/// peek: callers see one kind of pointer, never one that could be into
/// either table (which would keep the verifier from pruning the paths
/// after it).
#[inline(never)]
fn peek<F: Family>(key: &CtKey<F::A>) -> Option<&'static CtEntry<F::A>> {
    let out = F::ct_peek().get_ptr_mut(0)?;
    let e = match F::ct().get_ptr(key) {
        Some(e) => e,
        None => F::ct_assured().get_ptr(key)?,
    };
    // SAFETY: `out` is this CPU's slot of a per-CPU array (packet programs
    // never nest on a CPU), `e` a map value pointer valid for this run.
    unsafe {
        copy_entry(&mut *out, e);
        Some(&*out)
    }
}

/// Removes `key`'s entry and its assured copy.
#[inline(always)]
pub fn remove<F: Family>(key: &CtKey<F::A>) {
    let _ = F::ct_assured().remove(key);
    if F::ct().remove(key).is_ok() {
        crate::stats::count_flow(FlowStat::CtRemoved);
    }
}

/// Writes a new entry into the LRU, counted (what the LRU evicted is told
/// from these counts: see `FlowStat::CtInserted`). An entry that replaces
/// whatever the key held (`BPF_ANY`) drops that one's assured copy too,
/// which would otherwise come back if the new entry were evicted.
#[inline(always)]
fn insert<F: Family>(key: &CtKey<F::A>, e: &CtEntry<F::A>, flags: u32) -> Result<(), ()> {
    if flags == BPF_ANY {
        let _ = F::ct_assured().remove(key);
    }
    F::ct().insert(key, e, flags as u64).map_err(|_| ())?;
    // A lookup marks the new node referenced. The kernel's LRU files an
    // unreferenced node on its inactive list, whose tail it evicts first;
    // under churn that list holds little but new nodes, and an entry that
    // is not looked up until the flow's next packet (a SYN's `FWD_IN` until
    // the handshake's ACK, an explicit flow's `REP_IN` and `REP_OUT` until
    // the SYN-ACK) was evicted within the round trip: 1 connection in 200
    // stalled a second (its SYN-ACK left untranslated, or its ACK found no
    // flow) in `agent.rs`'s 100k test once a fifth of the flows were
    // explicit.
    let _ = F::ct().get_ptr(key);
    crate::stats::count_flow(FlowStat::CtInserted);
    Ok(())
}

/// A conntrack entry found in its map, valid for this program run. Outside
/// `ct`, entries are read only through it: the one place a value pointer of
/// the conntrack maps is dereferenced for them.
#[derive(Clone, Copy)]
pub struct Entry<A>(*mut CtEntry<A>);

impl<A: Copy> Entry<A> {
    /// The entry's fields. Other CPUs may update them meanwhile: read what
    /// is needed once, and keep no reference across [`touch`].
    #[inline(always)]
    pub fn get(&self) -> &CtEntry<A> {
        // SAFETY: a value pointer the map returned during this run (the
        // kernel keeps a looked-up element alive until the program
        // returns); plain-old-data.
        unsafe { &*self.0 }
    }
}

/// The live entry for `key` in the LRU, if any (expired entries are
/// ignored: the LRU reclaims them, the agent collects their assured
/// copies). Where an assured flow must not be missed because the LRU
/// evicted its entry, [`lookup_restoring`].
#[inline(always)]
pub fn lookup<F: Family>(cfg: &DpConfig, key: &CtKey<F::A>, now: u64) -> Option<Entry<F::A>> {
    live(cfg, key, F::ct().get_ptr_mut(key)?, now).map(Entry)
}

/// [`lookup`], restoring an assured flow's evicted entry from its copy:
/// for the lookups that tell an established flow from a new one (the
/// packet path's, each direction). Not everywhere: each call site costs
/// the verifier the restore's paths again.
#[inline(always)]
pub fn lookup_restoring<F: Family>(cfg: &DpConfig, key: &CtKey<F::A>, now: u64) -> Option<Entry<F::A>> {
    live(cfg, key, get::<F>(key)?, now).map(Entry)
}

#[inline(always)]
fn live<A: Addr>(cfg: &DpConfig, key: &CtKey<A>, e: *mut CtEntry<A>, now: u64) -> Option<*mut CtEntry<A>> {
    // SAFETY: a map value pointer, valid for the program's run.
    if expired(cfg, key.proto, unsafe { &*e }, now) {
        return None;
    }
    Some(e)
}

/// Called for every packet that uses one of a flow's two state entries
/// (`FWD_IN`, or the owner): notes TCP teardown and the first reply, and
/// refreshes the entry at most once a second. Changes are written to the
/// other state entry too (and refreshes to explicit egress entries), each
/// checked to still belong to the flow: its translated tuple must be the
/// reverse of this entry's key. The common case (nothing new, refreshed
/// within the second) is a few compares inline; the rest is a subprogram.
#[inline(always)]
pub fn touch<F: Family>(key: &CtKey<F::A>, e: Entry<F::A>, now: u64, tcp_flags: u8) {
    let e = e.0;
    // SAFETY: a map value pointer, valid for this run; plain reads.
    let (last, flags, replied) = unsafe { ((*e).last_seen_ns, (*e).flags, (*e).state[state::REPLIED]) };
    let tcp = key.proto == proto::TCP;
    let teardown = tcp && tcp_flags & (TCP_FIN | TCP_RST) != 0;
    let first_reply = flags & ct_flags::ROLE_MASK != ct_flags::FWD_IN && replied == 0;
    let refresh = now.saturating_sub(last) > NS_PER_S;
    // Assured now (see `dataplane_common::ct::assured`): the TCP
    // handshake's last ACK (the client's first segment after a reply that
    // is not a SYN, FIN or RST), a UDP or SCTP flow answered and still
    // flowing after a second.
    let assured_now = flags & ct_flags::ASSURED == 0
        && replied != 0
        && if tcp {
            flags & ct_flags::ROLE_MASK == ct_flags::FWD_IN && tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
        } else {
            refresh
        };
    if teardown || first_reply || assured_now || refresh {
        touch_flow::<F>(key, e, now, tcp_flags);
        // An assured flow's copies follow its entries (its state, and its
        // last packet to within the second, which the agent's collector
        // reads).
        if assured_now || flags & ct_flags::ASSURED != 0 {
            assure::<F>(key, e);
        }
    }
}

/// A DSR flow's replies never come through this node: a TCP segment from
/// the client that is not a SYN shows that the backend answered (the
/// client acknowledges its SYN-ACK), which is as good a sign of an
/// established connection as the reply itself.
#[inline(always)]
fn dsr_answered(proto: u8, flags: u8, tcp_flags: u8) -> bool {
    flags & ct_flags::DSR != 0 && proto == proto::TCP && tcp_flags & TCP_SYN == 0
}

#[inline(never)]
fn touch_flow<F: Family>(key: &CtKey<F::A>, e: *mut CtEntry<F::A>, now: u64, tcp_flags: u8) {
    // Keys are built in the scratch space: an IPv6 key on the stack of this
    // subprogram would add up with the egress path's.
    let Some(s) = scratch::<F>() else {
        return;
    };
    copy_entry(&mut s.a, e);
    let forward = s.a.role() == ct_flags::FWD_IN;
    // The facts this packet establishes, as state bytes.
    let mut facts = [0u8; 4];
    if !forward {
        facts[state::REPLIED] = 1;
    }
    if key.proto == proto::TCP {
        if tcp_flags & TCP_FIN != 0 {
            facts[if forward { state::FIN_FWD } else { state::FIN_REP }] = 1;
        }
        if tcp_flags & TCP_RST != 0 {
            facts[state::RST] = 1;
        }
    }
    let news = (facts[0] > s.a.state[0]) as u8
        | ((facts[1] > s.a.state[1]) as u8) << 1
        | ((facts[2] > s.a.state[2]) as u8) << 2
        | ((facts[3] > s.a.state[3]) as u8) << 3;
    let refresh = now.saturating_sub(s.a.last_seen_ns) > NS_PER_S;
    if news == 0 && !refresh {
        return;
    }
    update(e, news, refresh, now);
    // The other state entry: keyed by the reverse of this one's translated
    // tuple, and translating to the reverse of this one's key. Restored
    // if the LRU evicted it: a FIN or RST must reach both state entries and
    // their copies, or the copy of the one missed would hold the flow's key
    // (an SNAT port) as a live, half-closed connection until the
    // established timeout.
    s.key = CtKey::new(
        s.a.nat_daddr,
        s.a.nat_saddr,
        s.a.nat_dport,
        s.a.nat_sport,
        key.proto,
    );
    // A masqueraded TCP flow the client's FIN closed after the backend's
    // (no RST): the backend closed first and holds the tuple in TIME_WAIT,
    // so its closure is remembered by the `REP_IN` key (the other state
    // entry's, `s.key`). A backend that closed second holds nothing.
    if forward
        && news & (1 << state::FIN_FWD) != 0
        && s.a.flags & ct_flags::SNAT != 0
        && s.a.state[state::FIN_REP] != 0
        && (s.a.state[state::RST] | facts[state::RST]) == 0
    {
        remember_closed::<F>(&s.key, key.saddr.fold(), key.sport, now);
    }
    if let Some(o) = get::<F>(&s.key)
        // SAFETY: a map value pointer, valid for this run.
        && translates_to(unsafe { &*o }, &key.daddr, key.dport, &key.saddr, key.sport)
    {
        update(o, news, refresh, now);
    }
    if refresh && s.a.flags & ct_flags::EXPLICIT != 0 {
        // FWD_OUT (from FWD_IN) or REP_OUT (from REP_IN): keyed by this
        // entry's source towards its translated destination, holding the
        // same translated tuple.
        s.key = CtKey::new(key.saddr, s.a.nat_daddr, key.sport, s.a.nat_dport, key.proto);
        if let Some(sub) = F::ct().get_ptr_mut(&s.key)
            // SAFETY: as above.
            && translates_to(unsafe { &*sub }, &s.a.nat_saddr, s.a.nat_sport, &s.a.nat_daddr, s.a.nat_dport)
        {
            update(sub, 0, true, now);
        }
    }
}

/// Remembers that the masqueraded TCP flow whose `REP_IN` key is `rep_in`
/// (backend → node : SNAT port), from `client` (folded) : `client_port`,
/// was closed by its backend first, at `now` (`SNAT*_CLOSED`, see
/// [`closed_recently`]).
#[inline(never)]
fn remember_closed<F: Family>(rep_in: &CtKey<F::A>, client: u32, client_port: u16, now: u64) {
    let closed = SnatClosed {
        closed_ns: now,
        client,
        client_port,
        _pad: 0,
    };
    let _ = F::snat_closed().insert(rep_in, &closed, BPF_ANY as u64);
}

/// Whether the SNAT tuple `key` (a `REP_IN` key) belonged to a TCP flow of
/// another client than `flow`'s (any client when `None`) whose backend
/// closed it first, less than [`TCP_TIME_WAIT_NS`] ago: remembered apart
/// from conntrack, whose LRU may have evicted that flow's entries long
/// before.
#[inline(never)]
fn closed_recently<F: Family>(key: &CtKey<F::A>, flow: Option<&CtKey<F::A>>, now: u64) -> bool {
    if key.proto != proto::TCP {
        return false;
    }
    let Some(c) = F::snat_closed().get_ptr(key) else {
        return false;
    };
    // SAFETY: a map value pointer, valid for this run; plain reads.
    let (closed_ns, client, client_port) = unsafe { ((*c).closed_ns, (*c).client, (*c).client_port) };
    if let Some(t) = flow
        && t.saddr.fold() == client
        && t.sport == client_port
    {
        return false;
    }
    now.saturating_sub(closed_ns) < TCP_TIME_WAIT_NS
}

/// Assures the flow of `e` (keyed `key`), assured now or before: each of
/// its entries in the LRU (`e`, the other state entry, the explicit
/// sub-entries of both) gets its copy, or its copy is brought up to date.
/// A sibling of `touch_flow`, not inside it: there its frame added up with
/// the egress path's past the stack's 512 bytes.
#[inline(never)]
fn assure<F: Family>(key: &CtKey<F::A>, e: *mut CtEntry<F::A>) {
    let Some(s) = scratch::<F>() else {
        return;
    };
    copy_entry(&mut s.a, e);
    // A flow closing before it was assured stays unprotected.
    if s.a.flags & ct_flags::ASSURED == 0
        && (s.a.has(state::FIN_FWD) || s.a.has(state::FIN_REP) || s.a.has(state::RST))
    {
        return;
    }
    s.key = CtKey::new(
        s.a.nat_daddr,
        s.a.nat_saddr,
        s.a.nat_dport,
        s.a.nat_sport,
        key.proto,
    );
    if let Some(o) = F::ct().get_ptr_mut(&s.key)
        // SAFETY: a map value pointer, valid for this run.
        && translates_to(unsafe { &*o }, &key.daddr, key.dport, &key.saddr, key.sport)
    {
        assure_entry::<F>(s, o);
    }
    s.key = *key;
    assure_entry::<F>(s, e);
}

/// Assures the entry at `s.key` (`e`) and, if it has one, its explicit
/// sub-entry (`FWD_OUT` from `FWD_IN`, `REP_OUT` from `REP_IN`: keyed by
/// the entry's source towards its translated destination, holding the
/// same translated tuple).
#[inline(always)]
fn assure_entry<F: Family>(s: &mut CtScratch<F::A>, e: *mut CtEntry<F::A>) {
    promote_entry::<F>(s, e);
    // `promote_entry` left its copy of `e` in `s.b`.
    if s.b.flags & ct_flags::EXPLICIT == 0 {
        return;
    }
    s.key = CtKey::new(
        s.key.saddr,
        s.b.nat_daddr,
        s.key.sport,
        s.b.nat_dport,
        s.key.proto,
    );
    // A closed connection's sub-entry copy goes with its entry's (the
    // sub-entry has no state of its own to close it: left alone, every
    // closed explicit flow would keep two copies until they expired, and
    // filled the table).
    if s.b.tcp_closed() {
        if let Some(c) = F::ct_assured().get_ptr(&s.key)
            // SAFETY: a map value pointer, valid for this run.
            && translates_to(unsafe { &*c }, &s.b.nat_saddr, s.b.nat_sport, &s.b.nat_daddr, s.b.nat_dport)
        {
            let _ = F::ct_assured().remove(&s.key);
        }
        return;
    }
    if let Some(sub) = F::ct().get_ptr_mut(&s.key)
        // SAFETY: a map value pointer, valid for this run.
        && translates_to(unsafe { &*sub }, &s.b.nat_saddr, s.b.nat_sport, &s.b.nat_daddr, s.b.nat_dport)
    {
        promote_entry::<F>(s, sub);
    }
}

/// Copies the entry at `s.key` (`e`) into the assured table, which never
/// evicts, marked assured, leaving the copy in `s.b` (a closed TCP
/// connection's copy is removed instead); the first time, marks
/// the entry itself assured (counted `ct_assured`). A full assured table
/// leaves a new one unmarked, counted (`ct_assured_table_full`): it keeps
/// working, unprotected.
#[inline(never)]
fn promote_entry<F: Family>(s: &mut CtScratch<F::A>, e: *mut CtEntry<F::A>) {
    copy_entry(&mut s.b, e);
    // A closed TCP connection needs no protection any more: its copy goes
    // (the entry stays in the LRU, closed, for a reopening client; the SNAT
    // port's TIME_WAIT hold is `SNAT*_CLOSED`'s), so that the assured table
    // holds live connections only and a closed flow is never put back.
    if s.b.tcp_closed() {
        let _ = F::ct_assured().remove(&s.key);
        return;
    }
    let new = s.b.flags & ct_flags::ASSURED == 0;
    s.b.flags |= ct_flags::ASSURED;
    if F::ct_assured().insert(&s.key, &s.b, BPF_ANY as u64).is_err() {
        if new {
            crate::stats::count_flow(FlowStat::CtAssuredFull);
        }
        return;
    }
    if new {
        // SAFETY: a map value pointer valid for this run; the flags byte is
        // written alone (other CPUs write other bytes, or this same value).
        unsafe { core::ptr::addr_of_mut!((*e).flags).write_volatile(s.b.flags) };
        crate::stats::count_flow(FlowStat::CtAssured);
    }
}

/// Whether `e` translates packets to `saddr:sport → daddr:dport`.
#[inline(always)]
pub fn translates_to<A: Addr>(e: &CtEntry<A>, saddr: &A, sport: u16, daddr: &A, dport: u16) -> bool {
    e.nat_saddr == *saddr && e.nat_sport == sport && e.nat_daddr == *daddr && e.nat_dport == dport
}

/// Sets the state bytes whose bit is in `news` (bit i: `state[i]`), each
/// with a byte store, and refreshes `last_seen_ns`.
#[inline(always)]
fn update<A: Addr>(e: *mut CtEntry<A>, news: u8, refresh: bool, now: u64) {
    // SAFETY: a map value pointer valid for this run. Other CPUs may write
    // other bytes of the entry at the same time: each fact is its own byte,
    // and racing writers of one byte or of the timestamp store equivalent
    // values.
    unsafe {
        let s = core::ptr::addr_of_mut!((*e).state) as *mut u8;
        let mut i = 0;
        while i < 4 {
            if news & (1 << i) != 0 {
                s.add(i).write_volatile(1);
            }
            i += 1;
        }
        if refresh {
            (*e).last_seen_ns = now;
        }
    }
}

/// Copies a map value into the scratch space. `*e` would compile to a
/// `memmove` call (the compiler cannot tell the two apart); a
/// non-overlapping copy is expanded inline.
#[inline(always)]
fn copy_entry<A: Addr>(dst: &mut CtEntry<A>, e: *const CtEntry<A>) {
    // SAFETY: `e` is a map value pointer valid for this run; `dst` is this
    // CPU's scratch slot, never a map value of the conntrack map.
    unsafe { core::ptr::copy_nonoverlapping(e, dst, 1) }
}

/// This CPU's scratch space for building a new flow's keys and entries.
#[inline(always)]
pub fn scratch<F: Family>() -> Option<&'static mut CtScratch<F::A>> {
    let p = F::ct_scratch().get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU map; packet programs never nest
    // on a CPU, so nothing else uses it while this program runs, and the
    // returned reference does not outlive the run.
    Some(unsafe { &mut *p })
}

/// Fills `s.a` with a new flow's `FWD_IN` entry (as the backend sees the
/// flow: from the client to the backend; the source is replaced for a
/// masqueraded flow) and `s.b` with its reply side (as the client sees the
/// replies: from the frontend to the client), with an unmasqueraded flow's
/// owner role.
#[inline(always)]
pub fn entries<A: Addr>(s: &mut CtScratch<A>, t: &CtKey<A>, choice: &Choice<A>, now: u64) {
    s.a = CtEntry {
        last_seen_ns: now,
        nat_saddr: t.saddr,
        nat_daddr: choice.backend.address,
        nat_sport: t.sport,
        nat_dport: choice.backend.port,
        service_id: choice.service_id,
        flags: ct_flags::FWD_IN,
        state: [0; 4],
        _pad0: 0,
        _pad1: 0,
    };
    s.b = CtEntry {
        nat_saddr: t.daddr,
        nat_daddr: t.saddr,
        nat_sport: t.dport,
        nat_dport: t.sport,
        flags: ct_flags::REP_OUT,
        ..s.a
    };
}

/// Creates the entries of a new flow `t` (client → frontend) as `choice`
/// says — for a masqueraded flow, after `snat::claim` wrote its `REP_IN`
/// entry and chose its port — and returns [`Event::NewFlow`] or why the
/// flow cannot be made. `FWD_IN` is written last: until it exists, another
/// packet of the flow takes the new-flow path again. Entries name their
/// backend by address, so established flows outlive its id. Keys and
/// entries are built in the per-CPU scratch space, not on the stack.
#[inline(never)]
pub fn create<F: Family>(cfg: &DpConfig, t: &CtKey<F::A>, choice: &Choice<F::A>, now: u64) -> Event {
    let Some(s) = scratch::<F>() else {
        return Event::DropCtFull;
    };
    entries(s, t, choice, now);
    // backend → client: the unmasqueraded owner's key, and the explicit
    // REP_OUT's.
    s.key = CtKey::new(
        choice.backend.address,
        t.saddr,
        choice.backend.port,
        t.sport,
        t.proto,
    );
    if !choice.snat {
        if insert::<F>(&s.key, &s.b, BPF_ANY).is_err() {
            return Event::DropCtFull;
        }
    } else {
        s.a.nat_saddr = F::snat_ip(cfg);
        s.a.nat_sport = choice.snat_port;
        if choice.explicit {
            // Explicit egress entries (the port is not the hashed one),
            // refreshed by the state entries and marked replied (the long
            // timeout), so that only those decide the flow's lifetime:
            // REP_OUT (backend → client), translating like REP_IN...
            s.b.flags = ct_flags::REP_OUT | ct_flags::SNAT | ct_flags::EXPLICIT;
            s.b.state[state::REPLIED] = 1;
            if insert::<F>(&s.key, &s.b, BPF_ANY).is_err() {
                return Event::DropCtFull;
            }
            // ... and FWD_OUT (client → backend), translating like FWD_IN.
            s.key = CtKey {
                daddr: choice.backend.address,
                dport: choice.backend.port,
                ..*t
            };
            s.a.flags = ct_flags::FWD_OUT | ct_flags::SNAT | ct_flags::EXPLICIT;
            s.a.state[state::REPLIED] = 1;
            if insert::<F>(&s.key, &s.a, BPF_ANY).is_err() {
                return Event::DropCtFull;
            }
            s.a.state[state::REPLIED] = 0;
        }
        s.a.flags = ct_flags::FWD_IN | ct_flags::SNAT | if choice.explicit { ct_flags::EXPLICIT } else { 0 };
    }
    if insert::<F>(t, &s.a, BPF_ANY).is_err() {
        return Event::DropCtFull;
    }
    Event::NewFlow
}

/// Creates a new DSR flow's entry: its `FWD_IN`, the only one on this node
/// (the replies go from the backend's node to the client), naming the
/// backend its packets are sent to, untranslated.
#[inline(always)]
pub fn create_dsr<F: Family>(t: &CtKey<F::A>, choice: &Choice<F::A>, now: u64) -> Event {
    let Some(s) = scratch::<F>() else {
        return Event::DropCtFull;
    };
    entries(s, t, choice, now);
    s.a.flags = ct_flags::FWD_IN | ct_flags::DSR;
    if insert::<F>(t, &s.a, BPF_ANY).is_err() {
        return Event::DropCtFull;
    }
    Event::NewFlow
}

/// A DSR flow's `FWD_IN` (see [`create_dsr`]) for a packet of its: the
/// flow's whole state on this node. Notes TCP teardown and that the client
/// got an answer (see [`dsr_answered`]), and refreshes it at most once a
/// second; no other entry to keep in step.
#[inline(always)]
pub fn touch_dsr<F: Family>(key: &CtKey<F::A>, e: Entry<F::A>, now: u64, tcp_flags: u8) {
    let e = e.0;
    // SAFETY: a map value pointer, valid for this run; plain reads.
    let (last, flags, state) = unsafe { ((*e).last_seen_ns, (*e).flags, (*e).state) };
    let tcp = key.proto == proto::TCP;
    let mut news = 0u8;
    if state[state::REPLIED] == 0 && dsr_answered(key.proto, flags, tcp_flags) {
        news |= 1 << state::REPLIED;
    }
    if tcp && tcp_flags & TCP_FIN != 0 && state[state::FIN_FWD] == 0 {
        news |= 1 << state::FIN_FWD;
    }
    if tcp && tcp_flags & TCP_RST != 0 && state[state::RST] == 0 {
        news |= 1 << state::RST;
    }
    let refresh = now.saturating_sub(last) > NS_PER_S;
    if news != 0 || refresh {
        update(e, news, refresh, now);
    }
    // Answered, not closing: assured (its one entry); once assured, its
    // copy follows it.
    let assured_now =
        news & (1 << state::REPLIED) != 0 && news & (1 << state::RST | 1 << state::FIN_FWD) == 0;
    let follow = flags & ct_flags::ASSURED != 0 && (news != 0 || refresh);
    if (assured_now || follow)
        && let Some(s) = scratch::<F>()
    {
        s.key = *key;
        promote_entry::<F>(s, e);
    }
}

/// Makes room for a new flow `t` to `choice`'s backend, or returns
/// [`Event::DropTupleClash`]. Egress hooks know a flow by the tuple between
/// its client and its backend alone (the hashed `REP_IN` that tuple leads
/// to, else the explicit `REP_OUT`/`FWD_OUT` keyed by it), so at most one
/// flow may hold a (client address and port, backend) pair. Another flow
/// holding it, through another frontend, is taken over when it has closed
/// or expired (its entries that egress would find are removed) and
/// otherwise makes the new flow a clash: translating it would rewrite it as
/// the other one. A holder through the same frontend is this very tuple
/// again (its `FWD_IN` lost, or a SYN racing its twin): taken over too.
/// A subprogram beside `flow::decide` and `ct::create`.
#[inline(never)]
pub fn clear_tuple<F: Family>(cfg: &DpConfig, t: &CtKey<F::A>, choice: &Choice<F::A>, now: u64) -> Event {
    let Some(s) = scratch::<F>() else {
        return Event::DropCtFull;
    };
    let (backend, backend_port) = (choice.backend.address, choice.backend.port);
    // A flow kept unmasqueraded (its owner) or masqueraded with an explicit
    // port: a REP_OUT keyed backend → client.
    s.key = CtKey::new(backend, t.saddr, backend_port, t.sport, t.proto);
    if let Some(e) = F::ct().get_ptr(&s.key) {
        copy_entry(&mut s.a, e);
        if s.a.role() == ct_flags::REP_OUT && !expired(cfg, t.proto, &s.a, now) {
            let explicit = s.a.flags & ct_flags::EXPLICIT != 0;
            // An explicit REP_OUT carries no state: the flow's FWD_IN does
            // (keyed by the reverse of the translated tuple).
            let live = if explicit {
                s.key = s.a.nat_key(t.proto).reversed();
                // SAFETY: a map value pointer, valid for this run.
                F::ct()
                    .get_ptr(&s.key)
                    .is_some_and(|f| !reusable(cfg, t.proto, unsafe { &*f }, now))
            } else {
                !reusable(cfg, t.proto, &s.a, now)
            };
            if live && !same_frontend(&s.a, t) {
                return Event::DropTupleClash;
            }
            s.key = CtKey::new(backend, t.saddr, backend_port, t.sport, t.proto);
            remove::<F>(&s.key);
            if explicit {
                // Its FWD_OUT: client → backend.
                s.key = CtKey {
                    daddr: backend,
                    dport: backend_port,
                    ..*t
                };
                remove::<F>(&s.key);
            }
            crate::stats::count_flow(FlowStat::TupleTakeover);
        }
    }
    // A masqueraded flow with its hashed port: the REP_IN egress hooks
    // compute from the client's address and port. A masqueraded newcomer
    // looks there itself when it claims that port (`claim` with the flow).
    if choice.snat {
        return Event::NewFlow;
    }
    let port = hashed_port(cfg, t.saddr, t.sport);
    s.key = CtKey::new(backend, F::snat_ip(cfg), backend_port, port.to_be(), t.proto);
    if let Some(e) = F::ct().get_ptr(&s.key) {
        copy_entry(&mut s.a, e);
        if s.a.role() == ct_flags::REP_IN
            && s.a.nat_daddr == t.saddr
            && s.a.nat_dport == t.sport
            && !expired(cfg, t.proto, &s.a, now)
        {
            if !reusable(cfg, t.proto, &s.a, now) && !same_frontend(&s.a, t) {
                return Event::DropTupleClash;
            }
            remove::<F>(&s.key);
            crate::stats::count_flow(FlowStat::TupleTakeover);
        }
    }
    Event::NewFlow
}

/// Whether a reply-side entry translates to `t`'s frontend: it belongs to
/// the tuple `t` itself.
#[inline(always)]
fn same_frontend<A: Addr>(e: &CtEntry<A>, t: &CtKey<A>) -> bool {
    e.nat_saddr == t.daddr && e.nat_sport == t.dport
}

/// Inserts `value` at `key` unless a live flow holds it; a closed or
/// expired one is taken over (removed, then inserted with `BPF_NOEXIST`:
/// of two CPUs racing for a free key exactly one wins; of two taking over
/// the same closed holder, the later remove can delete the earlier one's
/// fresh claim, since a map delete cannot be made conditional: both
/// lookups and both claims must then fall within about a microsecond, for
/// two clients whose ports hash alike). With `flow`
/// (a masqueraded flow claiming its hashed port), a holder from the same
/// client address and port is that flow's tuple (see [`clear_tuple`]):
/// taken over if closed or through the same frontend, a clash otherwise.
/// With `hold_time_wait`, a key whose last flow (another client's) its
/// backend closed first less than [`TCP_TIME_WAIT_NS`] ago stays with it
/// ([`Claim::TimeWait`]), whether conntrack still holds that flow or not
/// ([`closed_recently`]).
#[inline(always)]
pub fn claim<F: Family>(
    cfg: &DpConfig,
    key: &CtKey<F::A>,
    value: &CtEntry<F::A>,
    now: u64,
    flow: Option<&CtKey<F::A>>,
    hold_time_wait: bool,
) -> Claim {
    // Look before inserting: an insert that fails on an existing key costs
    // the LRU a node taken and given back, several times a lookup.
    let taken = if let Some(old) = peek::<F>(key) {
        let free = reusable(cfg, key.proto, old, now);
        let tuple = flow.filter(|t| {
            old.role() == ct_flags::REP_IN
                && old.nat_daddr == t.saddr
                && old.nat_dport == t.sport
                && !expired(cfg, key.proto, old, now)
        });
        match tuple {
            Some(t) if !free && !same_frontend(old, t) => return Claim::Clash,
            None if !free => return Claim::Busy,
            // Another client's flow, closed moments ago by its backend
            // first: the backend holds the tuple in TIME_WAIT (unless the
            // caller gives up on finding another port).
            None if hold_time_wait && closed_recently::<F>(key, flow, now) => return Claim::TimeWait,
            _ => {}
        }
        remove::<F>(key);
        if tuple.is_some() {
            Claim::TupleTakenOver
        } else {
            Claim::TakenOver
        }
    } else if hold_time_wait && closed_recently::<F>(key, flow, now) {
        // Conntrack forgot the flow, not its closure.
        return Claim::TimeWait;
    } else {
        Claim::Free
    };
    // BPF_NOEXIST: of CPUs racing for a free key, exactly one wins.
    if insert::<F>(key, value, BPF_NOEXIST).is_err() {
        return Claim::Busy;
    }
    taken
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    Free,
    /// From a closed or expired flow of another client port.
    TakenOver,
    /// From a closed flow of the same client port (or its own stale tuple).
    TupleTakenOver,
    Busy,
    /// A live flow of the same client port through another frontend.
    Clash,
    /// Another client's flow that its backend closed first, less than
    /// [`TCP_TIME_WAIT_NS`] ago (see [`closed_recently`]).
    TimeWait,
}

impl Claim {
    #[inline(always)]
    pub fn won(self) -> bool {
        matches!(self, Claim::Free | Claim::TakenOver | Claim::TupleTakenOver)
    }
}

/// The SNAT port a masqueraded flow from `client:client_port` takes when it
/// is free (network order in the packet: callers convert), from the
/// agent's seed and port range: the one formula the agent computes too.
#[inline(always)]
pub fn hashed_port<A: Addr>(cfg: &DpConfig, client: A, client_port: u16) -> u16 {
    snat_port_hash(
        client,
        client_port,
        cfg.snat_hash_seed,
        cfg.snat_port_min,
        cfg.snat_port_max,
    )
}

/// A hashed SNAT flow's `REP_IN` entry between `backend` and `client` (its
/// key is built in the scratch space); with `RESTORE`, put back from its
/// assured copy if the LRU evicted it ([`lookup_restoring`]: the packet
/// path's lookups, not the ICMP errors').
#[inline(always)]
pub fn hashed_rep_in<F: Family, const RESTORE: bool>(
    cfg: &DpConfig,
    backend: F::A,
    backend_port: u16,
    client: F::A,
    client_port: u16,
    proto: u8,
    now: u64,
) -> Option<Entry<F::A>> {
    let port = hashed_port(cfg, client, client_port);
    let s = scratch::<F>()?;
    s.key = CtKey::new(backend, F::snat_ip(cfg), backend_port, port.to_be(), proto);
    let e = if RESTORE {
        lookup_restoring::<F>(cfg, &s.key, now)?
    } else {
        lookup::<F>(cfg, &s.key, now)?
    };
    let en = e.get();
    (en.role() == ct_flags::REP_IN && en.nat_daddr == client && en.nat_dport == client_port).then_some(e)
}
