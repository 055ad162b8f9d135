//! L2 announcements: for every address in the ingress of a LoadBalancer
//! Service of our class, exactly one node answers ARP/NDP for it, chosen
//! through one Lease per address (`dataplane-l2-<address>` in the lease
//! namespace). Every eligible node is a candidate; the holder renews, the
//! others watch the Leases and take over once the holder has stopped
//! renewing for a lease duration, then send gratuitous ARP / unsolicited NA
//! so that the segment's neighbour caches move to them at once.
//!
//! Addresses from a pool with `l2Announce: false` are left to BGP.
//!
//! Eligible: the node is not labelled
//! `node.kubernetes.io/exclude-from-external-load-balancers`, and for every
//! Service on the address with externalTrafficPolicy Local, one of its
//! ready endpoints is on this node. A holder that stops being eligible
//! stops answering and releases the Lease (another node takes over without
//! waiting); when the address is no longer used at all it deletes it.

use std::{
    collections::{BTreeMap, BTreeSet},
    hash::{Hash as _, Hasher as _},
    net::IpAddr,
    time::{Duration, Instant},
};

use futures::StreamExt as _;
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Api, Client};
use tracing::{info, warn};

use super::{
    EXCLUDE_LABEL, L2_IP_ANNOTATION, L2_LEASE_LABEL, L2_LEASE_PREFIX,
    cache::Shared,
    lease::{Action, Candidate, Intent, LeaseTiming, execute},
    metrics::SharedLbMetrics,
    pool::PoolIndex,
    request::{ClassFilter, ingress_ips, with_ready_endpoint_on},
    responder::Responder,
};

/// At most this many Lease requests in flight.
const CONCURRENCY: usize = 16;
/// Longest extra wait before taking a free Lease (spreads addresses over
/// nodes when all see a new address at once).
const MAX_ACQUIRE_DELAY: Duration = Duration::from_millis(250);

/// The Lease of an address: `dataplane-l2-198-18-0-240`,
/// `dataplane-l2-fd00-0-0-0-0-0-0-1` (every group, so names are unique).
pub fn lease_name(ip: &IpAddr) -> String {
    let body = match ip {
        IpAddr::V4(a) => a.octets().map(|o| o.to_string()).join("-"),
        IpAddr::V6(a) => a.segments().map(|s| format!("{s:x}")).join("-"),
    };
    format!("{L2_LEASE_PREFIX}{body}")
}

/// A delay in [0, min(renew period, 250 ms)) that differs between nodes and
/// addresses, so that the first node to see an address does not take all.
pub fn acquire_delay(identity: &str, ip: &IpAddr, renew_period: Duration) -> Duration {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    identity.hash(&mut h);
    ip.hash(&mut h);
    let span = renew_period.min(MAX_ACQUIRE_DELAY).as_millis().max(1) as u64;
    Duration::from_millis(h.finish() % span)
}

/// Every address in use by our Services → whether this node may announce it.
pub fn eligibility<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    node: Option<&Node>,
    node_name: &str,
    classes: &ClassFilter,
) -> BTreeMap<IpAddr, bool> {
    let excluded = node
        .and_then(|n| n.metadata.labels.as_ref())
        .is_some_and(|l| l.contains_key(EXCLUDE_LABEL));
    let local = with_ready_endpoint_on(slices, node_name);
    let mut out: BTreeMap<IpAddr, bool> = BTreeMap::new();
    for svc in services.into_iter().filter(|s| classes.owns(s)) {
        let local_only = svc
            .spec
            .as_ref()
            .and_then(|s| s.external_traffic_policy.as_deref())
            == Some("Local");
        let id = (
            svc.metadata.namespace.clone().unwrap_or_default(),
            svc.metadata.name.clone().unwrap_or_default(),
        );
        let ok = !excluded && (!local_only || local.contains(&id));
        for ip in ingress_ips(svc) {
            *out.entry(ip).or_insert(true) &= ok;
        }
    }
    out
}

struct Entry {
    candidate: Candidate,
    /// resourceVersion of the watched Lease last fed to the candidate (so
    /// that only changes are observed, never an older copy after a write).
    watched_rv: Option<String>,
}

pub struct Announcer {
    api: Api<Lease>,
    identity: String,
    namespace: String,
    classes: ClassFilter,
    timing: LeaseTiming,
    shared: Shared,
    responder: Responder,
    metrics: SharedLbMetrics,
    entries: BTreeMap<IpAddr, Entry>,
    announced: BTreeSet<IpAddr>,
}

impl Announcer {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: Client,
        identity: &str,
        namespace: &str,
        classes: ClassFilter,
        timing: LeaseTiming,
        shared: Shared,
        responder: Responder,
        metrics: SharedLbMetrics,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            identity: identity.to_owned(),
            namespace: namespace.to_owned(),
            classes,
            timing,
            shared,
            responder,
            metrics,
            entries: BTreeMap::new(),
            announced: BTreeSet::new(),
        }
    }

    fn candidate(&self, ip: &IpAddr) -> Candidate {
        let meta = ObjectMeta {
            name: Some(lease_name(ip)),
            namespace: Some(self.namespace.clone()),
            labels: Some([(L2_LEASE_LABEL.to_owned(), "true".to_owned())].into()),
            annotations: Some([(L2_IP_ANNOTATION.to_owned(), ip.to_string())].into()),
            ..Default::default()
        };
        Candidate::new(&self.identity, meta, self.timing, false).with_acquire_delay(acquire_delay(
            &self.identity,
            ip,
            self.timing.renew_period,
        ))
    }

    /// Runs until `stop` fires, then releases every Lease it holds.
    pub async fn run(
        mut self,
        mut changes: tokio::sync::watch::Receiver<u64>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            let (wanted, next) = self.round().await;
            let wake = next.min(Instant::now() + Duration::from_secs(5));
            if wanted {
                // Something was done: decide again at once (a read follows
                // a conflict, a renewal is due after an acquisition).
                continue;
            }
            tokio::select! {
                _ = stop.changed() => break,
                r = changes.changed() => if r.is_err() { break },
                _ = tokio::time::sleep_until(wake.into()) => {}
            }
        }
        self.shutdown().await;
    }

    /// One round; returns (whether requests were made, next deadline).
    async fn round(&mut self) -> (bool, Instant) {
        let now = Instant::now();
        let eligible = {
            let w = self.shared.lock().expect("lb cache");
            // Nothing is decided on a partial picture (a holder would
            // release what it cannot yet see it may keep).
            if !(w.services.synced && w.slices.synced && w.nodes.synced && w.pools.synced) {
                return (false, now + Duration::from_millis(100));
            }
            let node = w
                .nodes
                .objects
                .values()
                .find(|n| n.metadata.name.as_deref() == Some(&self.identity));
            let mut eligible = eligibility(
                w.services.objects.values(),
                w.slices.objects.values(),
                node,
                &self.identity,
                &self.classes,
            );
            // Pools with `l2Announce: false` are BGP's alone.
            let pools = PoolIndex::new(w.pools.objects.values());
            eligible.retain(|ip, _| pools.l2_announced(*ip));
            for ip in eligible.keys() {
                if !self.entries.contains_key(ip) {
                    let c = self.candidate(ip);
                    self.entries.insert(
                        *ip,
                        Entry {
                            candidate: c,
                            watched_rv: None,
                        },
                    );
                }
            }
            if w.leases.synced {
                for (ip, e) in &mut self.entries {
                    let key = format!("{}/{}", self.namespace, lease_name(ip));
                    let lease = w.leases.objects.get(&key);
                    let rv = lease.and_then(|l| l.metadata.resource_version.clone());
                    if rv != e.watched_rv {
                        e.candidate.observe(lease.cloned(), now);
                        e.watched_rv = rv;
                    }
                }
            }
            eligible
        };
        let mut next = now + Duration::from_secs(3600);
        let mut actions = Vec::new();
        for (ip, e) in &self.entries {
            let intent = match eligible.get(ip) {
                None => Intent::Remove,
                Some(true) => Intent::Lead,
                Some(false) => Intent::Follow,
            };
            match e.candidate.next(intent, now) {
                Action::Wait(t) => next = next.min(t),
                Action::Idle => {}
                a => actions.push((*ip, a)),
            }
        }
        let acted = !actions.is_empty();
        let api = &self.api;
        let results: Vec<_> = futures::stream::iter(actions)
            .map(|(ip, a)| async move { (ip, execute(api, &lease_name(&ip), a).await) })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let done_at = Instant::now();
        for (ip, done) in results {
            if let Some(e) = self.entries.get_mut(&ip)
                && let Some(err) = e.candidate.apply(done, done_at)
            {
                warn!(address = %ip, lease = %lease_name(&ip), error = %err, "lease request failed; retrying");
                self.metrics.lock().expect("lb metrics").lease_errors += 1;
            }
        }
        // Forget addresses nobody uses once we do not hold their Lease.
        let me = self.identity.clone();
        self.entries
            .retain(|ip, e| eligible.contains_key(ip) || e.candidate.holder() == Some(me.as_str()));
        self.update_responder(&eligible, done_at);
        (acted, next)
    }

    fn update_responder(&mut self, eligible: &BTreeMap<IpAddr, bool>, now: Instant) {
        let leading: BTreeSet<IpAddr> = self
            .entries
            .iter()
            .filter(|(ip, e)| eligible.get(ip) == Some(&true) && e.candidate.leading(now))
            .map(|(ip, _)| *ip)
            .collect();
        if leading == self.announced {
            return;
        }
        self.responder.set_addresses(&leading);
        let mut m = self.metrics.lock().expect("lb metrics");
        for ip in leading.difference(&self.announced) {
            info!(address = %ip, "announcing (ARP/NDP) from this node");
            self.responder.announce(*ip);
            m.l2_takeovers += 1;
        }
        for ip in self.announced.difference(&leading) {
            info!(address = %ip, "stopped announcing from this node");
            m.l2_releases += 1;
        }
        m.l2_addresses = leading.len() as u64;
        drop(m);
        self.announced = leading;
    }

    /// Stops answering and releases the held Leases (bounded: a stopping
    /// agent must not hang on an unreachable API server).
    async fn shutdown(&mut self) {
        self.responder.set_addresses(&BTreeSet::new());
        let now = Instant::now();
        let releases: Vec<_> = self
            .entries
            .iter()
            .filter_map(|(ip, e)| match e.candidate.next(Intent::Follow, now) {
                a @ Action::Update(_) => Some((*ip, a)),
                _ => None,
            })
            .collect();
        let api = &self.api;
        let n = releases.len();
        let release = futures::stream::iter(releases)
            .map(|(ip, a)| async move { execute(api, &lease_name(&ip), a).await })
            .buffer_unordered(CONCURRENCY)
            .collect::<Vec<_>>();
        if tokio::time::timeout(Duration::from_secs(2), release)
            .await
            .is_err()
        {
            warn!("could not release every L2 lease within 2 s; other nodes take over when they expire");
        } else if n > 0 {
            info!(leases = n, "released the L2 leases");
        }
        self.metrics.lock().expect("lb metrics").l2_addresses = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse<T: serde::de::DeserializeOwned>(yaml: &str) -> T {
        serde_json::from_value(serde_saphyr::from_str::<serde_json::Value>(yaml).unwrap()).unwrap()
    }

    fn svc(name: &str, class: &str, etp: &str, ips: &[&str]) -> Service {
        let ingress: Vec<String> = ips.iter().map(|i| format!("{{ip: \"{i}\"}}")).collect();
        parse(&format!(
            "metadata: {{name: {name}, namespace: ns}}\nspec: {{type: LoadBalancer, loadBalancerClass: {class}, externalTrafficPolicy: {etp}}}\nstatus: {{loadBalancer: {{ingress: [{}]}}}}",
            ingress.join(",")
        ))
    }

    fn slice(service: &str, node: &str, ready: bool) -> EndpointSlice {
        parse(&format!(
            "metadata: {{name: {service}-x, namespace: ns, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nendpoints: [{{addresses: [10.244.1.5], nodeName: {node}, conditions: {{ready: {ready}}}}}]"
        ))
    }

    const OURS: &str = "dataplane.example.com/lb";

    fn classes() -> ClassFilter {
        ClassFilter {
            class: OURS.into(),
            default_class: false,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn lease_names_are_valid_and_distinct() {
        assert_eq!(lease_name(&ip("198.18.0.240")), "dataplane-l2-198-18-0-240");
        assert_eq!(lease_name(&ip("fd00::1")), "dataplane-l2-fd00-0-0-0-0-0-0-1");
        assert_ne!(lease_name(&ip("fd00::1:0")), lease_name(&ip("fd00:0:0:0:0:1::")));
    }

    #[test]
    fn acquire_delays_are_bounded_and_spread() {
        let delays: BTreeSet<Duration> = ["node1", "node2", "node3", "node4"]
            .iter()
            .map(|n| acquire_delay(n, &ip("10.0.0.1"), Duration::from_secs(2)))
            .collect();
        assert!(delays.iter().all(|d| *d < MAX_ACQUIRE_DELAY));
        assert!(delays.len() > 1, "{delays:?}");
        assert!(acquire_delay("n", &ip("10.0.0.1"), Duration::from_millis(100)) < Duration::from_millis(100));
    }

    #[test]
    fn eligibility_follows_class_traffic_policy_local_endpoints_and_exclusion() {
        let services = [
            svc("cluster", OURS, "Cluster", &["10.0.0.1"]),
            svc("local-here", OURS, "Local", &["10.0.0.2", "fd00::2"]),
            svc("local-elsewhere", OURS, "Local", &["10.0.0.3"]),
            svc("local-not-ready", OURS, "Local", &["10.0.0.4"]),
            svc("ccm", "cloud.example/lb", "Cluster", &["10.0.0.5"]),
            // Shares 10.0.0.1 with "cluster" but has no local endpoint.
            svc("shared-local", OURS, "Local", &["10.0.0.1"]),
        ];
        let slices = [
            slice("local-here", "node1", true),
            slice("local-elsewhere", "node2", true),
            slice("local-not-ready", "node1", false),
        ];
        let e = eligibility(&services, &slices, None, "node1", &classes());
        assert_eq!(
            e,
            BTreeMap::from([
                (ip("10.0.0.1"), false),
                (ip("10.0.0.2"), true),
                (ip("fd00::2"), true),
                (ip("10.0.0.3"), false),
                (ip("10.0.0.4"), false),
            ]),
            "another class's address is not ours to announce"
        );
        let node: Node = parse(&format!(
            "metadata: {{name: node1, labels: {{{EXCLUDE_LABEL}: \"\"}}}}"
        ));
        let e = eligibility(&services, &slices, Some(&node), "node1", &classes());
        assert!(e.values().all(|ok| !ok), "an excluded node announces nothing");
    }
}
