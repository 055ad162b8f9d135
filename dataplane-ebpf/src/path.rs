//! The packet path, written once for XDP and TC (see `ctx`) and for IPv4
//! and IPv6 (see `family`).
//!
//! [`ingress`] runs where packets enter the node (external devices in XDP
//! or TC, pod-facing host interfaces in TC): destination rewrites (DNAT of
//! new and established flows, un-SNAT of replies), rejects and drops.
//! [`egress`] runs where packets leave it (TC egress on both): source
//! rewrites (SNAT of forward packets, the frontend restored on replies).
//! Both translate ICMP errors about translated flows.

use dataplane_common::{
    addr::Addr,
    config::{DpConfig, config_flags},
    ct::ct_flags,
    filter::{BACKENDS, FRONTENDS},
    hint::{self, Hint},
    proto,
    stats::{Event, FlowStat, Hook},
};

use crate::{
    ct,
    ctx::{FromVerdict, ptr_at},
    dsr,
    family::{Family, V4, V6},
    filter,
    flow::{self, Action, Choice},
    hdr::{Pkt, TCP_SYN},
    icmp,
    maps::{CONFIG, forward},
    nat::{self, Side},
    parse::{Kind, Parsed, kind},
    route::{self, Forward},
    snat, stats, unaligned,
};

#[inline(always)]
fn config() -> Option<&'static DpConfig> {
    let cfg = CONFIG.get(0)?;
    (cfg.flags & config_flags::CONFIGURED != 0).then_some(cfg)
}

/// What a side's path decided, packed into one register (a subprogram
/// cannot return a struct: it would return a pointer into its own stack):
/// the verdict, and either the event or what the entry point does next
/// (with the family and the header offsets), and for a done ingress step
/// the word it leaves for egress (see `dataplane_common::hint`). Rejects,
/// ICMP error
/// translation and new flows run from the entry point, so that their stack
/// frames do not add to the lookup path's.
#[derive(Clone, Copy)]
struct Step(u64);

const REJECT: u64 = 1;
const ICMP_ERROR: u64 = 2;
const NEW_FLOW: u64 = 3;
/// A DSR flow's packet, sent to the backend's node encapsulated (`dsr`).
const ENCAP: u64 = 4;
/// An encapsulated packet: one for a local backend of a DSR flow?
const DECAP: u64 = 5;

impl Step {
    #[inline(always)]
    fn done<V: Into<i64>>(verdict: V, event: Event) -> Self {
        Self((verdict.into() as u32 as u64) << 32 | event as u64)
    }
    /// As [`Step::done`], leaving `word` for egress.
    #[inline(always)]
    fn done_hint<V: Into<i64>>(verdict: V, event: Event, word: u16) -> Self {
        Self((verdict.into() as u32 as u64) << 32 | (word as u64) << 16 | event as u64)
    }
    #[inline(always)]
    fn next<A: Addr>(what: u64, pkt: &Pkt<A>, event: Event) -> Self {
        let v6 = (A::FAMILY == 6) as u64;
        Self(
            v6 << 32 | what << 8 | (pkt.l3 as u64 & 0xff) << 16 | (pkt.l4 as u64 & 0xff) << 24 | event as u64,
        )
    }
    #[inline(always)]
    fn what(self) -> u64 {
        (self.0 >> 8) & 0xff
    }
    #[inline(always)]
    fn v6(self) -> bool {
        (self.0 >> 32) & 1 != 0
    }
    #[inline(always)]
    fn event(self) -> u32 {
        self.0 as u32 & 0xff
    }
    #[inline(always)]
    fn l3(self) -> usize {
        ((self.0 >> 16) & 0xff) as usize
    }
    #[inline(always)]
    fn l4(self) -> usize {
        ((self.0 >> 24) & 0xff) as usize
    }
    /// The word for egress (0 for a step that is not done).
    #[inline(always)]
    fn hint(self) -> u16 {
        if self.what() == 0 {
            (self.0 >> 16) as u16
        } else {
            0
        }
    }
}

/// The word telling egress that it has nothing to do for a packet going
/// from `saddr` to `daddr` (`Hint::None`), or, when `saddr` may be a
/// backend, that only a reply's explicit entry can apply to it
/// (`Hint::ExplicitOnly`). 0 where no word reaches egress (XDP).
#[inline(always)]
fn untranslated_hint<C: Forward, A: Addr>(cfg: &DpConfig, saddr: &A, daddr: &A) -> u16 {
    if !C::HINTS {
        return 0;
    }
    let h = if filter::maybe(cfg, BACKENDS, saddr) {
        Hint::ExplicitOnly
    } else {
        Hint::None
    };
    hint::encode(h, saddr.fold(), daddr.fold())
}

/// The word for a forward packet translated for a flow kept unmasqueraded:
/// egress has nothing to do (no SNAT; a reply it is not).
#[inline(always)]
fn dnat_only_hint<C: Forward, A: Addr>(saddr: &A, daddr: &A) -> u16 {
    if !C::HINTS {
        return 0;
    }
    hint::encode(Hint::None, saddr.fold(), daddr.fold())
}

/// Runs the rest of a step from the entry point, counts the outcome and
/// returns the verdict.
#[inline(always)]
fn finish<C: Forward>(ctx: &C, cfg: &DpConfig, hook: Hook, step: Step, ingress: bool) -> C::Verdict {
    let len = ctx.packet_len() as u64;
    // External devices: where DSR flows start and end.
    let external = hook != Hook::TcPodIngress;
    // A new flow's decision is a subprogram of its own, called from here:
    // its stack and the lookup path's do not add up.
    let step = if step.what() == NEW_FLOW {
        new_flow(ctx, cfg, step.v6(), step.l3(), external)
    } else {
        step
    };
    // Drops and rejects decided by the lookup, before anything rewrites
    // the packet: to `monitor` readers (one map read when there are none).
    if matches!(step.what(), 0 | REJECT) && dataplane_common::monitor::reported(step.event()) {
        crate::monitor::report(ctx, hook, step.event());
    }
    // A reject and an ICMP error's translation read well beyond the
    // headers parsed so far (the packet to quote, the quote).
    if matches!(step.what(), REJECT | ICMP_ERROR) {
        ctx.pull_headers();
    }
    // Whether the packet left already (DSR): host routing has nothing to
    // add.
    let mut sent = false;
    let (verdict, event) = match step.what() {
        REJECT => {
            let (v, e) = icmp::reject(ctx, step.v6(), step.l3(), step.l4(), 0);
            (
                v,
                if e == Event::DropRejectFailed {
                    e as u32
                } else {
                    step.event()
                },
            )
        }
        ICMP_ERROR => {
            let (v, e) = if step.v6() {
                icmp::translate_error::<C, V6>(ctx, cfg, step.l3(), step.l4(), ingress)
            } else {
                icmp::translate_error::<C, V4>(ctx, cfg, step.l3(), step.l4(), ingress)
            };
            (v, e as u32)
        }
        ENCAP => {
            let out = if step.v6() {
                dsr::encap::<C, V6>(ctx, cfg, step.l3())
            } else {
                dsr::encap::<C, V4>(ctx, cfg, step.l3())
            };
            match out & 0xff {
                dsr::SENT => {
                    sent = true;
                    (C::Verdict::from_packed(out), step.event())
                }
                dsr::TOO_BIG => {
                    ctx.pull_headers();
                    let (v, e) = icmp::reject(ctx, step.v6(), step.l3(), step.l4(), (out >> 32) as u32);
                    let e = if e == Event::DropRejectFailed {
                        e
                    } else {
                        Event::RejectTooBig
                    };
                    (v, e as u32)
                }
                dsr::TOO_BIG_NO_DF => (C::DROP, Event::DropDsrTooBig as u32),
                _ => (C::DROP, Event::DropDsrUnroutable as u32),
            }
        }
        DECAP => {
            let e = if !external {
                Event::Pass
            } else if step.v6() {
                dsr::decap::<C, V6>(ctx, cfg, step.l3())
            } else {
                dsr::decap::<C, V4>(ctx, cfg, step.l3())
            };
            (if e.is_drop() { C::DROP } else { C::PASS }, e as u32)
        }
        _ => (C::Verdict::from_packed(step.0), step.event()),
    };
    // Always written: a word the packet brought from elsewhere must not
    // reach egress. (Whether egress trusts it is the agent's call, per
    // device: see `dataplane_common::hint`.)
    if ingress {
        ctx.leave_hint(step.hint());
    }
    // Host routing: a packet translated on its way in (DNAT, or un-SNAT of
    // a reply) goes straight to its route's device; one it found a route
    // for but could not send on (TC) is a drop, counted as such.
    let (verdict, event) = if ingress
        && !sent
        && cfg.flags & config_flags::HOST_ROUTING != 0
        && (event == Event::NewFlow as u32
            || event == Event::Established as u32
            || event == Event::Reply as u32)
        && let Some(v) = ctx.route(cfg)
    {
        if v.into() == C::DROP.into() {
            (v, Event::DropForwardFailed as u32)
        } else {
            (v, event)
        }
    } else {
        (verdict, event)
    };
    stats::count_raw(hook, event, len);
    // A translated packet, as it leaves the hook: to `monitor` readers of
    // trace events if it was sampled (a bit test on a register for the
    // others).
    if dataplane_common::monitor::traced(event) {
        crate::monitor::finish(ctx, hook, event);
    }
    verdict
}

/// What is common to both sides once a family is known: ICMP errors are
/// handed to the entry point, and at ingress encapsulated packets (DSR's),
/// protocols we do not translate pass.
#[inline(always)]
fn triage<C: Forward, F: Family>(pkt: &Pkt<F::A>, ingress: bool) -> Option<Step> {
    match pkt.tuple.proto {
        proto::TCP | proto::UDP | proto::SCTP => None,
        p if p == F::ICMP => Some(Step::next(ICMP_ERROR, pkt, Event::Pass)),
        p if ingress && p == F::ENCAP => Some(Step::next(DECAP, pkt, Event::Pass)),
        _ => Some(Step::done(C::PASS, Event::Pass)),
    }
}

/// The verdict of a frame that is not an IP packet we parse.
#[inline(always)]
fn unparsed<C: Forward>(p: Parsed) -> Step {
    match p {
        Parsed::Fragment => Step::done(C::PASS, Event::Fragment),
        Parsed::Malformed => Step::done(C::PASS, Event::Malformed),
        _ => Step::done(C::PASS, Event::Pass),
    }
}

/// Ingress: destination rewrites, rejects and drops. Returns the verdict.
#[inline(always)]
pub fn ingress<C: Forward>(ctx: &C, hook: Hook) -> C::Verdict {
    match config() {
        Some(cfg) => finish(ctx, cfg, hook, ingress_inner(ctx, cfg), true),
        None => unconfigured(ctx, hook),
    }
}

/// Before the agent configured the datapath every packet passes, counted.
#[inline(always)]
fn unconfigured<C: Forward>(ctx: &C, hook: Hook) -> C::Verdict {
    stats::count(hook, Event::Pass, ctx.packet_len() as u64);
    C::PASS
}

/// Dispatches on the family: each family's path is a subprogram of its
/// own, so that their stacks do not add up (nor to the entry point's).
#[inline(always)]
fn ingress_inner<C: Forward>(ctx: &C, cfg: &DpConfig) -> Step {
    let step = ingress_parsed(ctx, cfg);
    // Headers beyond the linear area (TC): pulled, and parsed again, only
    // when the parse ran short.
    if step.event() == Event::Malformed as u32 && ctx.pull_headers() {
        return ingress_parsed(ctx, cfg);
    }
    step
}

#[inline(always)]
fn ingress_parsed<C: Forward>(ctx: &C, cfg: &DpConfig) -> Step {
    match kind(ctx) {
        Kind::V4(l3) => ingress_prefilter::<C, V4>(ctx, cfg, l3),
        Kind::V6(l3) => ingress_prefilter::<C, V6>(ctx, cfg, l3),
        Kind::Other => Step::done(C::PASS, Event::Pass),
        Kind::Malformed => Step::done(C::PASS, Event::Malformed),
    }
}

/// The pre-filter, inline in the entry point before the family's
/// subprogram: a TCP, UDP or SCTP packet (IPv6: without extension headers)
/// whose destination is certainly not ours passes on two loads and one
/// read of the address filter, before it is parsed further. Anything else
/// (ICMP, extension headers, a header cut short) takes the full path. Not
/// calling a subprogram matters: a subprogram's return is a mispredicted
/// branch where the kernel returns through a thunk (AMD's SRSO "safe RET",
/// retbleed), which was the largest part of a passed packet's time.
#[inline(always)]
fn ingress_prefilter<C: Forward, F: Family>(ctx: &C, cfg: &DpConfig, l3: usize) -> Step {
    if let Some((saddr, daddr)) = fixed_addrs::<C, F>(ctx, l3)
        // Not a frontend, not a SNAT address, not in a service CIDR.
        && !filter::maybe(cfg, FRONTENDS, &daddr)
        && !F::in_service_cidr(cfg, &daddr)
    {
        let word = untranslated_hint::<C, F::A>(cfg, &saddr, &daddr);
        return Step::done_hint(C::PASS, Event::Pass, word);
    }
    ingress_family::<C, F>(ctx, cfg, l3)
}

/// A packet the pre-filter let through.
#[inline(never)]
fn ingress_family<C: Forward, F: Family>(ctx: &C, cfg: &DpConfig, l3: usize) -> Step {
    // Before anything rewrites the packet; past the pre-filter, which
    // passes packets that are certainly not translated.
    crate::monitor::start(ctx);
    let pkt = &match F::parse(ctx, l3) {
        Ok(p) => p,
        Err(other) => return unparsed::<C>(other),
    };
    if let Some(step) = triage::<C, F>(pkt, true) {
        return step;
    }
    let t = &pkt.tuple;
    // Not a frontend, not a SNAT address, not in a service CIDR: not ours.
    // The pre-filter has judged the packet already unless IPv6 extension
    // headers hid its protocol.
    let judged = pkt.l4 == l3 + core::mem::size_of::<F::Hdr>() || F::A::FAMILY == 4;
    if !judged && !filter::maybe(cfg, FRONTENDS, &t.daddr) && !F::in_service_cidr(cfg, &t.daddr) {
        return Step::done(C::PASS, Event::Pass);
    }
    let now = ct::now_inline();
    if let Some(e) = ct::lookup_restoring::<F>(cfg, t, now) {
        // The fields the path needs, copied out: no reference outlives
        // this (touch writes the entry below).
        let (role, closed, daddr, dport, service_id, flags) = {
            let en = e.get();
            (
                en.role(),
                en.tcp_closed(),
                en.nat_daddr,
                en.nat_dport,
                en.service_id,
                en.flags,
            )
        };
        let snat = flags & ct_flags::SNAT != 0;
        match role {
            // A SYN on a closed connection's tuple opens a new one, as
            // netfilter reopens a TIME_WAIT entry.
            ct_flags::FWD_IN if pkt.is_syn() && closed => {
                stats::count_flow(FlowStat::Reopened);
            }
            // DSR: to the backend's node, untranslated. Its state is its own
            // entry's (no reply side here): kept inline, not through
            // `touch`'s subprogram (the verifier walks a subprogram once per
            // call site).
            ct_flags::FWD_IN if flags & ct_flags::DSR != 0 => {
                ct::touch_dsr::<F>(t, e, now, pkt.tcp_flags);
                stats::count_service(service_id, pkt.tot_len as u64);
                route::leave_always(forward::ENCAP, &daddr, dport);
                return Step::next(ENCAP, pkt, Event::Established);
            }
            ct_flags::FWD_IN | ct_flags::REP_IN => {
                if nat::rewrite::<C, F>(ctx, pkt, Side::Dst, &daddr, dport).is_none() {
                    return Step::done(C::PASS, Event::Malformed);
                }
                if C::XDP && cfg.flags & config_flags::HOST_ROUTING != 0 {
                    // What egress would do next, for XDP to do it: the
                    // frontend on a reply, the SNAT address and port on a
                    // masqueraded flow's packet.
                    let (saddr, sport) = (e.get().nat_saddr, e.get().nat_sport);
                    let what = if role == ct_flags::REP_IN {
                        forward::SRC
                    } else if snat {
                        forward::SNAT
                    } else {
                        forward::NONE
                    };
                    route::leave_always(what, &saddr, sport);
                }
                ct::touch::<F>(t, e, now, pkt.tcp_flags);
                if role == ct_flags::REP_IN {
                    return Step::done(C::PASS, Event::Reply);
                }
                stats::count_service(service_id, pkt.tot_len as u64);
                let word = if snat {
                    0
                } else {
                    dnat_only_hint::<C, F::A>(&t.saddr, &daddr)
                };
                return Step::done_hint(C::PASS, Event::Established, word);
            }
            // The tuple is a known flow's, the other way round: not a new
            // flow of its own.
            _ => return Step::done(C::PASS, Event::Pass),
        }
    }
    Step::next(NEW_FLOW, pkt, Event::Pass)
}

/// The first packet of a flow (parsed again: cheaper than carrying the
/// tuple through the stack of the lookup path). `external`: it came in
/// through an external device (where DSR flows start).
#[inline(always)]
fn new_flow<C: Forward>(ctx: &C, cfg: &DpConfig, v6: bool, l3: usize, external: bool) -> Step {
    if v6 {
        new_flow_family::<C, V6>(ctx, cfg, l3, external)
    } else {
        new_flow_family::<C, V4>(ctx, cfg, l3, external)
    }
}

#[inline(never)]
fn new_flow_family<C: Forward, F: Family>(ctx: &C, cfg: &DpConfig, l3: usize, external: bool) -> Step {
    let pkt = &match F::parse(ctx, l3) {
        Ok(p) => p,
        Err(other) => return unparsed::<C>(other),
    };
    let now = ct::now();
    let mut slot = core::mem::MaybeUninit::<Choice<F::A>>::uninit();
    // SAFETY: integers and booleans: all zeroes is a valid `Choice`.
    let choice = unsafe { crate::zero::zeroed(&mut slot) };
    // Subprograms side by side (their stacks do not add up): the decision,
    // the tuple cleared of closed flows, the SNAT port's claim, the entries.
    let mut event = flow::decide::<F>(cfg, &pkt.tuple, now, choice, external);
    // DSR: its own short way (one fork, not one per step below: the
    // verifier walks what follows once per distinct state).
    if event == Event::NewFlow && choice.dsr {
        if ctx.dsr_sendable::<F>(cfg, &choice.backend.address) {
            return dsr_new_flow::<C, F>(cfg, pkt, choice, now);
        }
        // XDP cannot send it to the backend's node yet: this flow is
        // masqueraded through the stack instead (its backend stays).
        choice.dsr = false;
        choice.snat = true;
        stats::count_flow(FlowStat::DsrFallbackSnat);
    }
    if event == Event::NewFlow {
        event = ct::clear_tuple::<F>(cfg, &pkt.tuple, choice, now);
    }
    if event == Event::NewFlow && choice.snat {
        event = snat::claim::<F>(cfg, &pkt.tuple, choice, now);
    }
    if event == Event::NewFlow {
        event = ct::create::<F>(cfg, &pkt.tuple, choice, now);
        count_midstream(pkt, event);
    }
    match flow::action(event) {
        // DNAT to the backend chosen.
        Action::Forward => {
            match nat::rewrite::<C, F>(ctx, pkt, Side::Dst, &choice.backend.address, choice.backend.port) {
                Some(()) => {
                    stats::count_service(choice.service_id, pkt.tot_len as u64);
                    let (what, src) = if choice.snat {
                        (forward::SNAT, F::snat_ip(cfg))
                    } else {
                        (forward::NONE, pkt.tuple.saddr)
                    };
                    route::leave::<C, F::A>(cfg, what, &src, choice.snat_port);
                    let word = if choice.snat {
                        0
                    } else {
                        dnat_only_hint::<C, F::A>(&pkt.tuple.saddr, &choice.backend.address)
                    };
                    Step::done_hint(C::PASS, event, word)
                }
                None => Step::done(C::PASS, Event::Malformed),
            }
        }
        Action::Reject => Step::next(REJECT, pkt, event),
        Action::Drop => Step::done(C::DROP, event),
        Action::Pass => Step::done(C::PASS, event),
    }
}

/// Counts a new TCP flow its first packet shows to be an old one (not a
/// SYN): its entries were evicted, expired or collected.
#[inline(always)]
fn count_midstream<A: Addr>(pkt: &Pkt<A>, event: Event) {
    if event == Event::NewFlow && pkt.tuple.proto == proto::TCP && pkt.tcp_flags & TCP_SYN == 0 {
        stats::count_flow(FlowStat::CtMidstream);
    }
}

/// A new DSR flow: its entry (the only one on this node), then the packet
/// goes to the backend's node (`dsr::encap`, from the entry point).
#[inline(always)]
fn dsr_new_flow<C: Forward, F: Family>(
    cfg: &DpConfig,
    pkt: &Pkt<F::A>,
    choice: &Choice<F::A>,
    now: u64,
) -> Step {
    let event = ct::create_dsr::<F>(&pkt.tuple, choice, now);
    if event != Event::NewFlow {
        return Step::done(C::DROP, event);
    }
    count_midstream(pkt, event);
    let _ = cfg;
    stats::count_service(choice.service_id, pkt.tot_len as u64);
    route::leave_always(forward::ENCAP, &choice.backend.address, choice.backend.port);
    Step::next(ENCAP, pkt, event)
}

/// Egress: source rewrites. Returns the verdict.
#[inline(always)]
pub fn egress<C: Forward>(ctx: &C, hook: Hook) -> C::Verdict {
    match config() {
        Some(cfg) => finish(ctx, cfg, hook, egress_inner(ctx, cfg), false),
        None => unconfigured(ctx, hook),
    }
}

#[inline(always)]
fn egress_inner<C: Forward>(ctx: &C, cfg: &DpConfig) -> Step {
    let step = egress_parsed(ctx, cfg);
    if step.event() == Event::Malformed as u32 && ctx.pull_headers() {
        return egress_parsed(ctx, cfg);
    }
    step
}

#[inline(always)]
fn egress_parsed<C: Forward>(ctx: &C, cfg: &DpConfig) -> Step {
    match kind(ctx) {
        Kind::V4(l3) => egress_prefilter::<C, V4>(ctx, cfg, l3),
        Kind::V6(l3) => egress_prefilter::<C, V6>(ctx, cfg, l3),
        Kind::Other => Step::done(C::PASS, Event::Pass),
        Kind::Malformed => Step::done(C::PASS, Event::Malformed),
    }
}

/// The addresses (source, destination) of a TCP, UDP or SCTP packet, read
/// from its fixed header under one bounds check (the verifier does not carry
/// one failed check over to a longer one); `None` for any other packet.
/// Not a closure: LLVM outlined one (a subprogram again) in the TC programs.
#[inline(always)]
fn fixed_addrs<C: Forward, F: Family>(ctx: &C, l3: usize) -> Option<(F::A, F::A)> {
    let h = ptr_at::<C, F::Hdr>(ctx, l3)? as *const u8;
    // SAFETY: offsets within the fixed header, whose bounds were checked.
    let (p, saddr, daddr) = unsafe {
        (
            unaligned::read(h.add(F::PROTO)),
            unaligned::read(h.add(F::SADDR) as *const F::A),
            unaligned::read(h.add(F::DADDR) as *const F::A),
        )
    };
    matches!(p, proto::TCP | proto::UDP | proto::SCTP).then_some((saddr, daddr))
}

/// As [`ingress_prefilter`], for egress: forward packets go to a backend,
/// replies come from one; anything else passes here. Then the word ingress
/// left (see `dataplane_common::hint`): nothing to do, or only the explicit
/// entries to look at.
#[inline(always)]
fn egress_prefilter<C: Forward, F: Family>(ctx: &C, cfg: &DpConfig, l3: usize) -> Step {
    let word = ctx.take_hint();
    let mut explicit_only = false;
    if let Some((saddr, daddr)) = fixed_addrs::<C, F>(ctx, l3) {
        if !filter::maybe(cfg, BACKENDS, &daddr) && !filter::maybe(cfg, BACKENDS, &saddr) {
            return Step::done(C::PASS, Event::Pass);
        }
        if word != 0 && ctx.hint_trusted() {
            match hint::decode(word, saddr.fold(), daddr.fold()) {
                Hint::None => return Step::done(C::PASS, Event::PassByIngress),
                Hint::ExplicitOnly => explicit_only = true,
                Hint::Unknown => {}
            }
        }
    }
    egress_family::<C, F>(ctx, cfg, l3, explicit_only)
}

/// `explicit_only`: ingress did not translate the packet (see
/// `Hint::ExplicitOnly`), so the hashed `REP_IN` entries cannot apply.
#[inline(never)]
fn egress_family<C: Forward, F: Family>(ctx: &C, cfg: &DpConfig, l3: usize, explicit_only: bool) -> Step {
    // As at ingress.
    crate::monitor::start(ctx);
    let pkt = &match F::parse(ctx, l3) {
        Ok(p) => p,
        Err(other) => return unparsed::<C>(other),
    };
    if let Some(step) = triage::<C, F>(pkt, false) {
        return step;
    }
    let t = &pkt.tuple;
    // Forward packets go to a backend, replies come from one.
    let to_backend = filter::maybe(cfg, BACKENDS, &t.daddr);
    let from_backend = filter::maybe(cfg, BACKENDS, &t.saddr);
    if !to_backend && !from_backend {
        return Step::done(C::PASS, Event::Pass);
    }
    // Ingress did not translate it: the hashed REP_IN entries cannot apply
    // (their forward packets were DNATed, their replies un-SNATed there).
    let (to_backend, from_backend) = (to_backend && !explicit_only, from_backend && !explicit_only);
    let now = ct::now_inline();
    // A masqueraded flow with its hashed port: found through its REP_IN
    // entry, from the packet alone. Forward: source → node : port (it
    // counted for its service where it entered).
    if to_backend
        && ct::hashed_rep_in::<F, true>(cfg, t.daddr, t.dport, t.saddr, t.sport, t.proto, now).is_some()
    {
        let port = ct::hashed_port(cfg, t.saddr, t.sport);
        return match nat::rewrite::<C, F>(ctx, pkt, Side::Src, &F::snat_ip(cfg), port.to_be()) {
            Some(()) => Step::done(C::PASS, Event::Established),
            None => Step::done(C::PASS, Event::Malformed),
        };
    }
    // Reply: source → frontend.
    if from_backend
        && let Some(e) = ct::hashed_rep_in::<F, true>(cfg, t.saddr, t.sport, t.daddr, t.dport, t.proto, now)
    {
        let (saddr, sport) = (e.get().nat_saddr, e.get().nat_sport);
        return match nat::rewrite::<C, F>(ctx, pkt, Side::Src, &saddr, sport) {
            Some(()) => Step::done(C::PASS, Event::Reply),
            None => Step::done(C::PASS, Event::Malformed),
        };
    }
    // Explicit entries: REP_OUT (flows kept unmasqueraded, and masqueraded
    // ones with another port) and FWD_OUT.
    let Some(e) = ct::lookup_restoring::<F>(cfg, t, now) else {
        return Step::done(C::PASS, Event::Pass);
    };
    // Copied out: touch writes the entry below.
    let (role, flags, saddr, sport) = {
        let en = e.get();
        (en.role(), en.flags, en.nat_saddr, en.nat_sport)
    };
    if role != ct_flags::REP_OUT && role != ct_flags::FWD_OUT {
        return Step::done(C::PASS, Event::Pass);
    }
    if nat::rewrite::<C, F>(ctx, pkt, Side::Src, &saddr, sport).is_none() {
        return Step::done(C::PASS, Event::Malformed);
    }
    if role == ct_flags::FWD_OUT {
        return Step::done(C::PASS, Event::Established);
    }
    // An unmasqueraded flow's REP_OUT is its owner: replies reach it first.
    if flags & ct_flags::SNAT == 0 {
        ct::touch::<F>(t, e, now, pkt.tcp_flags);
    }
    Step::done(C::PASS, Event::Reply)
}
