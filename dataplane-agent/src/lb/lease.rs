//! Leader election over `coordination.k8s.io/v1` Leases (kube 5.0 has no
//! elector): a pure [`Candidate`] state machine that says what to do next,
//! and [`execute`] that does it against the API with optimistic concurrency
//! (every write carries the resourceVersion it was based on; a 409 means
//! someone else wrote first, so read again and decide again).
//!
//! The rules are client-go's: a Lease is free when nobody holds it or when
//! its holder has not renewed it for `leaseDurationSeconds`, measured on
//! *this* node's monotonic clock from the moment this candidate saw the
//! record change (so clock skew between nodes does not matter, and a
//! candidate that starts up waits a full duration before taking over a
//! Lease whose holder may be alive). The holder renews every renew period.
//! A holder that stops leading (shutdown, no longer eligible) writes the
//! Lease with no holder, so that others take over at once.
//!
//! Two ways of losing: with a renew deadline (the allocator), a holder that
//! has not renewed for that long stops acting as leader even if the API
//! server is unreachable, before anyone else may take over (deadline <
//! duration); without one (L2 announcements), a holder keeps leading until
//! it sees someone else hold the Lease: an unreachable API server then does
//! not stop the traffic (see docs/loadbalancer.md for the trade-off).

use std::time::{Duration, Instant};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{
    Api,
    api::{DeleteParams, PostParams, Preconditions},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTiming {
    /// `leaseDurationSeconds` written into the Lease (whole seconds, ≥ 1):
    /// how long others wait after the last renewal they saw.
    pub duration: Duration,
    /// How often the holder renews (and a polling candidate re-reads).
    pub renew_period: Duration,
    /// Stop leading when no renewal succeeded for this long; `None`: lead
    /// until someone else is seen holding the Lease.
    pub renew_deadline: Option<Duration>,
}

impl LeaseTiming {
    fn duration_seconds(&self) -> i32 {
        self.duration.as_secs().clamp(1, i32::MAX as u64) as i32
    }
}

/// What the caller wants from the Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intent {
    /// Hold it.
    Lead,
    /// Not hold it: release it if held.
    Follow,
    /// It is no longer needed: delete it if held.
    Remove,
}

/// The next thing to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Read,
    Create(Box<Lease>),
    /// Replace (acquire, renew or release) based on the Lease's
    /// resourceVersion.
    Update(Box<Lease>),
    /// Delete if still at this resourceVersion.
    Delete(String),
    /// Nothing before this instant (unless something is observed).
    Wait(Instant),
    /// Nothing to do until the intent changes or something is observed.
    Idle,
}

#[derive(Clone, Debug)]
enum Seen {
    /// Not read yet, or a write conflicted: read before acting.
    Unknown,
    /// Not there (since this instant).
    Absent(Instant),
    Present {
        lease: Box<Lease>,
        /// When this candidate saw the spec change (the holder's renewal).
        changed: Instant,
        /// When this candidate last read or was told about it.
        read: Instant,
    },
}

/// One candidate for one Lease.
#[derive(Clone, Debug)]
pub struct Candidate {
    identity: String,
    /// Name, namespace and labels of the Lease when it is created.
    meta: ObjectMeta,
    timing: LeaseTiming,
    /// Re-read every renew period (no watch feeds [`Candidate::observe`]).
    poll: bool,
    /// Extra wait before taking a free Lease: spreads Leases over nodes.
    acquire_delay: Duration,
    seen: Seen,
    /// Our last successful acquire or renew.
    renewed: Option<Instant>,
    /// No action before this after a failed request.
    backoff_until: Option<Instant>,
}

fn holder(lease: &Lease) -> Option<&str> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .filter(|h| !h.is_empty())
}

fn now_micro() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

impl Candidate {
    pub fn new(identity: &str, meta: ObjectMeta, timing: LeaseTiming, poll: bool) -> Self {
        Self {
            identity: identity.to_owned(),
            meta,
            timing,
            poll,
            acquire_delay: Duration::ZERO,
            seen: Seen::Unknown,
            renewed: None,
            backoff_until: None,
        }
    }

    pub fn with_acquire_delay(mut self, delay: Duration) -> Self {
        self.acquire_delay = delay;
        self
    }

    pub fn name(&self) -> &str {
        self.meta.name.as_deref().unwrap_or("")
    }

    /// The holder as last seen.
    pub fn holder(&self) -> Option<&str> {
        match &self.seen {
            Seen::Present { lease, .. } => holder(lease),
            _ => None,
        }
    }

    /// The Lease as last seen.
    pub fn lease(&self) -> Option<&Lease> {
        match &self.seen {
            Seen::Present { lease, .. } => Some(lease),
            _ => None,
        }
    }

    /// Whether this candidate may act as the leader now.
    pub fn leading(&self, now: Instant) -> bool {
        self.holder() == Some(self.identity.as_str())
            && self
                .renewed
                .is_some_and(|t| self.timing.renew_deadline.is_none_or(|d| now < t + d))
    }

    /// The Lease as read or watched (`None`: it does not exist).
    pub fn observe(&mut self, lease: Option<Lease>, now: Instant) {
        let Some(lease) = lease else {
            if !matches!(self.seen, Seen::Absent(_)) {
                self.seen = Seen::Absent(now);
            }
            return;
        };
        let changed = match &self.seen {
            Seen::Present {
                lease: old, changed, ..
            } if old.spec == lease.spec => *changed,
            _ => now,
        };
        self.seen = Seen::Present {
            lease: Box::new(lease),
            changed,
            read: now,
        };
    }

    /// What a successful write returned (`None`: deleted).
    pub fn wrote(&mut self, lease: Option<Lease>, now: Instant) {
        self.backoff_until = None;
        let mine = lease
            .as_ref()
            .is_some_and(|l| holder(l) == Some(self.identity.as_str()));
        self.renewed = mine.then_some(now);
        self.observe(lease, now);
    }

    /// A write lost a race: read before deciding again.
    pub fn conflicted(&mut self) {
        self.seen = Seen::Unknown;
    }

    /// A request failed (API server unreachable, 5xx): retry later.
    pub fn failed(&mut self, now: Instant) {
        self.backoff_until = Some(now + self.timing.renew_period.min(Duration::from_secs(1)));
    }

    fn spec(&self, previous: Option<&LeaseSpec>, acquired: bool) -> LeaseSpec {
        let now = now_micro();
        let previous = previous.cloned().unwrap_or_default();
        let transitions = previous.lease_transitions.unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.timing.duration_seconds()),
            acquire_time: if acquired {
                Some(now.clone())
            } else {
                previous.acquire_time.clone()
            },
            renew_time: Some(now),
            lease_transitions: Some(if acquired && previous.holder_identity.is_some() {
                transitions.saturating_add(1)
            } else {
                transitions
            }),
            ..previous
        }
    }

    pub fn next(&self, intent: Intent, now: Instant) -> Action {
        if let Some(t) = self.backoff_until
            && now < t
        {
            return Action::Wait(t);
        }
        match &self.seen {
            Seen::Unknown if intent == Intent::Lead || self.renewed.is_some() => Action::Read,
            Seen::Unknown => Action::Idle,
            Seen::Absent(since) if intent == Intent::Lead => {
                let at = *since + self.acquire_delay;
                if now < at {
                    return Action::Wait(at);
                }
                Action::Create(Box::new(Lease {
                    metadata: self.meta.clone(),
                    spec: Some(self.spec(None, true)),
                }))
            }
            Seen::Absent(_) => Action::Idle,
            Seen::Present { lease, changed, read } => {
                let spec = lease.spec.as_ref();
                if holder(lease) == Some(self.identity.as_str()) {
                    match intent {
                        Intent::Lead => {
                            let due = self.renewed.map_or(now, |t| t + self.timing.renew_period);
                            if now >= due {
                                let mut l = (**lease).clone();
                                l.spec = Some(self.spec(spec, false));
                                Action::Update(Box::new(l))
                            } else {
                                Action::Wait(due)
                            }
                        }
                        Intent::Follow => {
                            let mut l = (**lease).clone();
                            l.spec = Some(LeaseSpec {
                                holder_identity: None,
                                lease_duration_seconds: Some(1),
                                renew_time: Some(now_micro()),
                                ..spec.cloned().unwrap_or_default()
                            });
                            Action::Update(Box::new(l))
                        }
                        Intent::Remove => {
                            Action::Delete(lease.metadata.resource_version.clone().unwrap_or_default())
                        }
                    }
                } else if intent != Intent::Lead {
                    Action::Idle
                } else {
                    let expiry = match holder(lease) {
                        None => *changed,
                        Some(_) => {
                            let secs = spec
                                .and_then(|s| s.lease_duration_seconds)
                                .filter(|s| *s > 0)
                                .map_or(self.timing.duration, |s| Duration::from_secs(s as u64));
                            *changed + secs
                        }
                    };
                    let take_at = expiry + self.acquire_delay;
                    let reread_at = *read + self.timing.renew_period;
                    if now >= take_at {
                        let mut l = (**lease).clone();
                        l.spec = Some(self.spec(spec, true));
                        Action::Update(Box::new(l))
                    } else if self.poll && now >= reread_at {
                        Action::Read
                    } else if self.poll {
                        Action::Wait(take_at.min(reread_at))
                    } else {
                        Action::Wait(take_at)
                    }
                }
            }
        }
    }

    /// Takes in what [`execute`] reported; returns the error of a failed
    /// request for the caller to log.
    pub fn apply(&mut self, done: Done, now: Instant) -> Option<kube::Error> {
        match done {
            Done::Observed(lease) => {
                self.backoff_until = None;
                self.observe(lease, now);
                None
            }
            Done::Wrote(lease) => {
                self.wrote(lease, now);
                None
            }
            Done::Conflict => {
                self.conflicted();
                None
            }
            Done::Failed(e) => {
                self.failed(now);
                Some(e)
            }
        }
    }
}

/// What a request against the API did.
#[derive(Debug)]
pub enum Done {
    Observed(Option<Lease>),
    Wrote(Option<Lease>),
    Conflict,
    Failed(kube::Error),
}

fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// Performs `action` (not `Wait` or `Idle`) on the Lease `name`.
pub async fn execute(api: &Api<Lease>, name: &str, action: Action) -> Done {
    let pp = PostParams::default();
    let result = match action {
        Action::Read => {
            return match api.get_opt(name).await {
                Ok(l) => Done::Observed(l),
                Err(e) => Done::Failed(e),
            };
        }
        Action::Create(l) => api.create(&pp, &l).await.map(Some),
        Action::Update(l) => api.replace(name, &pp, &l).await.map(Some),
        Action::Delete(rv) => {
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: Some(rv),
                    uid: None,
                }),
                ..Default::default()
            };
            match api.delete(name, &dp).await {
                Ok(_) => Ok(None),
                Err(e) if status_code(&e) == Some(404) => Ok(None),
                Err(e) => Err(e),
            }
        }
        Action::Wait(_) | Action::Idle => return Done::Observed(None),
    };
    match result {
        Ok(l) => Done::Wrote(l),
        Err(e) if status_code(&e) == Some(409) => Done::Conflict,
        Err(e) if status_code(&e) == Some(404) => Done::Observed(None),
        Err(e) => Done::Failed(e),
    }
}

/// One Lease, polled: the allocator's election.
pub struct Elector {
    api: Api<Lease>,
    candidate: Candidate,
}

impl Elector {
    pub fn new(api: Api<Lease>, candidate: Candidate) -> Self {
        Self { api, candidate }
    }

    pub fn leading(&self, now: Instant) -> bool {
        self.candidate.leading(now)
    }

    pub fn holder(&self) -> Option<&str> {
        self.candidate.holder()
    }

    /// Does what is due; returns when to call again.
    pub async fn step(&mut self, intent: Intent) -> Instant {
        // A few rounds: a conflict is followed by a read and a new decision.
        for _ in 0..4 {
            let now = Instant::now();
            match self.candidate.next(intent, now) {
                Action::Wait(t) => return t,
                Action::Idle => return now + self.candidate.timing.renew_period,
                action => {
                    let name = self.candidate.name().to_owned();
                    let done = execute(&self.api, &name, action).await;
                    if let Some(e) = self.candidate.apply(done, Instant::now()) {
                        tracing::warn!(lease = %name, error = %e, "lease request failed; retrying");
                    }
                }
            }
        }
        Instant::now() + Duration::from_millis(50)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMING: LeaseTiming = LeaseTiming {
        duration: Duration::from_secs(10),
        renew_period: Duration::from_secs(2),
        renew_deadline: Some(Duration::from_secs(7)),
    };

    fn meta() -> ObjectMeta {
        ObjectMeta {
            name: Some("l".into()),
            namespace: Some("ns".into()),
            ..Default::default()
        }
    }

    fn held_by(who: Option<&str>, rv: &str, renewals: i32) -> Lease {
        Lease {
            metadata: ObjectMeta {
                resource_version: Some(rv.into()),
                ..meta()
            },
            spec: Some(LeaseSpec {
                holder_identity: who.map(Into::into),
                lease_duration_seconds: Some(10),
                lease_transitions: Some(3),
                // Stands for renewTime: a renewal changes the spec.
                strategy: Some(format!("renewal-{renewals}")),
                ..Default::default()
            }),
        }
    }

    fn updated(a: Action) -> Lease {
        match a {
            Action::Update(l) | Action::Create(l) => *l,
            other => panic!("expected a write, got {other:?}"),
        }
    }

    #[test]
    fn creates_an_absent_lease_then_renews_it_every_period() {
        let t0 = Instant::now();
        let mut c = Candidate::new("a", meta(), TIMING, false);
        assert_eq!(c.next(Intent::Lead, t0), Action::Read, "reads before acting");
        c.observe(None, t0);
        let l = updated(c.next(Intent::Lead, t0));
        let spec = l.spec.clone().unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        assert_eq!(spec.lease_duration_seconds, Some(10));
        assert!(spec.acquire_time.is_some() && spec.renew_time.is_some());
        assert_eq!(l.metadata.name.as_deref(), Some("l"));
        assert!(!c.leading(t0));
        c.wrote(Some(l), t0);
        assert!(c.leading(t0));
        assert_eq!(
            c.next(Intent::Lead, t0),
            Action::Wait(t0 + Duration::from_secs(2))
        );
        let t2 = t0 + Duration::from_secs(2);
        let renewed = updated(c.next(Intent::Lead, t2));
        assert_eq!(renewed.spec.unwrap().lease_transitions, Some(0));
    }

    #[test]
    fn takes_over_only_after_the_holder_stopped_renewing_for_a_lease_duration() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut c = Candidate::new("b", meta(), TIMING, false);
        c.observe(Some(held_by(Some("a"), "5", 0)), t0);
        assert_eq!(c.next(Intent::Lead, t0), Action::Wait(t0 + s(10)));
        // The holder renews at t0+4: the clock restarts from when b saw it.
        c.observe(Some(held_by(Some("a"), "6", 1)), t0 + s(4));
        // The same record seen again (a relist) does not restart it.
        c.observe(Some(held_by(Some("a"), "6", 1)), t0 + s(8));
        assert_eq!(c.next(Intent::Lead, t0 + s(9)), Action::Wait(t0 + s(14)));
        let l = updated(c.next(Intent::Lead, t0 + s(14)));
        assert_eq!(
            l.metadata.resource_version.as_deref(),
            Some("6"),
            "based on what was seen"
        );
        let spec = l.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("b"));
        assert_eq!(spec.lease_transitions, Some(4));
        assert!(!c.leading(t0 + s(14)));
    }

    #[test]
    fn a_released_lease_is_taken_at_once_after_the_acquire_delay() {
        let t0 = Instant::now();
        let mut c = Candidate::new("b", meta(), TIMING, false).with_acquire_delay(Duration::from_millis(300));
        // A missing Lease too is created after the delay.
        c.observe(None, t0);
        c.observe(None, t0 + Duration::from_millis(100));
        assert_eq!(
            c.next(Intent::Lead, t0),
            Action::Wait(t0 + Duration::from_millis(300))
        );
        assert!(matches!(
            c.next(Intent::Lead, t0 + Duration::from_millis(300)),
            Action::Create(_)
        ));
        c.observe(Some(held_by(None, "7", 2)), t0);
        assert_eq!(
            c.next(Intent::Lead, t0),
            Action::Wait(t0 + Duration::from_millis(300))
        );
        assert!(matches!(
            c.next(Intent::Lead, t0 + Duration::from_millis(300)),
            Action::Update(_)
        ));
        assert_eq!(c.next(Intent::Follow, t0 + Duration::from_secs(1)), Action::Idle);
    }

    #[test]
    fn a_holder_that_cannot_renew_stops_leading_at_the_deadline_or_never() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut strict = Candidate::new("a", meta(), TIMING, false);
        strict.wrote(Some(held_by(Some("a"), "1", 0)), t0);
        let mut lenient = Candidate::new(
            "a",
            meta(),
            LeaseTiming {
                renew_deadline: None,
                ..TIMING
            },
            false,
        );
        lenient.wrote(Some(held_by(Some("a"), "1", 0)), t0);
        for c in [&mut strict, &mut lenient] {
            c.failed(t0 + s(2));
            assert_eq!(
                c.next(Intent::Lead, t0 + s(2)),
                Action::Wait(t0 + s(3)),
                "backs off"
            );
            assert!(matches!(c.next(Intent::Lead, t0 + s(3)), Action::Update(_)));
        }
        assert!(strict.leading(t0 + s(6)));
        assert!(!strict.leading(t0 + s(7)), "renew deadline passed");
        assert!(
            lenient.leading(t0 + s(60)),
            "no deadline: leads until it sees another holder"
        );
        lenient.observe(Some(held_by(Some("b"), "9", 5)), t0 + s(61));
        assert!(!lenient.leading(t0 + s(61)));
    }

    #[test]
    fn following_releases_and_removing_deletes_a_held_lease() {
        let t0 = Instant::now();
        let mut c = Candidate::new("a", meta(), TIMING, false);
        c.wrote(Some(held_by(Some("a"), "3", 0)), t0);
        let released = updated(c.next(Intent::Follow, t0));
        let spec = released.spec.clone().unwrap();
        assert_eq!(spec.holder_identity, None);
        assert_eq!(spec.lease_duration_seconds, Some(1));
        assert_eq!(released.metadata.resource_version.as_deref(), Some("3"));
        assert_eq!(c.next(Intent::Remove, t0), Action::Delete("3".into()));
        c.wrote(Some(released), t0);
        assert!(!c.leading(t0));
        assert_eq!(c.next(Intent::Follow, t0), Action::Idle);
        assert_eq!(
            c.next(Intent::Remove, t0),
            Action::Idle,
            "only the holder deletes"
        );
    }

    #[test]
    fn a_conflict_makes_it_read_again_and_a_restarted_holder_renews_at_once() {
        let t0 = Instant::now();
        let mut c = Candidate::new("a", meta(), TIMING, false);
        c.observe(Some(held_by(Some("a"), "3", 0)), t0);
        assert!(!c.leading(t0), "not leading before its own renewal");
        assert!(matches!(c.next(Intent::Lead, t0), Action::Update(_)));
        c.conflicted();
        assert_eq!(c.next(Intent::Lead, t0), Action::Read);
        assert_eq!(c.next(Intent::Follow, t0), Action::Idle);
    }

    #[test]
    fn a_polling_candidate_rereads_every_renew_period() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut c = Candidate::new("b", meta(), TIMING, true);
        c.observe(Some(held_by(Some("a"), "5", 0)), t0);
        assert_eq!(c.next(Intent::Lead, t0), Action::Wait(t0 + s(2)));
        assert_eq!(c.next(Intent::Lead, t0 + s(2)), Action::Read);
    }
}
