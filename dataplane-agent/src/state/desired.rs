//! kube-proxy's semantics as a pure function: Service ports and the node's
//! view in, frontends and backend sets out.
//!
//! [`contribution`] is what one Service port adds to the table; the
//! incremental table ([`super::incremental`]) keeps one per port, and
//! [`compute`] folds them into the whole table at once (the reference the
//! incremental one is tested against). Both resolve the two questions that
//! involve more than one port the same way: a frontend claimed twice goes to
//! the claimant that ranks first, and a backend named by several ports gets
//! the merge of their views ([`BackendClaims`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

pub use super::table::BackendKey;
use super::{
    inputs::{Endpoint, LbAlgorithm, NodeContext, ServicePort},
    table::{Backend, BackendSet, EmptyVerdict, Frontend, FrontendEntry, FrontendKind, ServicePortName},
};
use crate::net::{IpCidr, IpFamily};

/// Why part of a Service port could not be programmed. The rest of it, and
/// every other Service, still is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// `namespace/name:port`.
    pub service: String,
    pub message: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredTable {
    pub frontends: BTreeMap<Frontend, FrontendEntry<BackendKey>>,
    pub backends: BTreeMap<BackendKey, Backend>,
    /// ClusterIPs: ports they do not serve are rejected.
    pub service_addresses: BTreeSet<IpAddr>,
    /// (service id, allowed source prefix).
    pub source_ranges: BTreeSet<(u32, IpCidr)>,
    /// service id → its Service port.
    pub service_names: BTreeMap<u32, Arc<ServicePortName>>,
    pub problems: Vec<Problem>,
}

/// What one Service port puts into the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Contribution {
    /// Every frontend it claims (another port may hold some of them).
    pub frontends: Vec<(Frontend, FrontendEntry<BackendKey>)>,
    /// One per endpoint, whatever its conditions.
    pub backends: Vec<Backend>,
    /// Its ClusterIPs.
    pub service_addresses: Vec<IpAddr>,
    /// Its loadBalancerSourceRanges (keyed by its service id).
    pub source_ranges: BTreeSet<IpCidr>,
}

/// The views several Service ports have of one backend (the same
/// ip:port:proto), merged so that the order they come in does not matter:
/// serving if any port sees it serving, terminating if every port sees it
/// terminating, local if any sees it local (ports of one node agree on
/// that). Only the agent reads these flags; the datapath uses the sets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendClaims {
    pub claims: u32,
    pub serving: u32,
    pub terminating: u32,
    pub local: u32,
}

impl BackendClaims {
    pub fn add(&mut self, b: &Backend) {
        self.claims += 1;
        self.serving += b.serving as u32;
        self.terminating += b.terminating as u32;
        self.local += b.local as u32;
    }

    /// False when no claim is left.
    pub fn remove(&mut self, b: &Backend) -> bool {
        self.claims -= 1;
        self.serving -= b.serving as u32;
        self.terminating -= b.terminating as u32;
        self.local -= b.local as u32;
        self.claims > 0
    }

    pub fn merged(&self, key: &BackendKey) -> Backend {
        Backend {
            addr: key.addr,
            port: key.port,
            proto: key.proto,
            serving: self.serving > 0,
            terminating: self.claims > 0 && self.terminating == self.claims,
            local: self.local > 0,
        }
    }
}

/// The order in which Service ports claim frontends: the Service created
/// first keeps a frontend another one also claims (kube-proxy's "the
/// existing holder keeps it"); between equal creation times, and for
/// objects without one (manifests, which come after those with one), the
/// Service the agent saw first; then namespace/name/port.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    created: (bool, i64),
    seen: u64,
    name: Arc<ServicePortName>,
}

impl Rank {
    /// `age` as [`crate::k8s::store::Store::age`] gives it: (creation time,
    /// first-seen sequence number).
    pub fn new(age: (Option<i64>, u64), name: impl Into<Arc<ServicePortName>>) -> Self {
        let (created, seen) = age;
        Self {
            created: (created.is_none(), created.unwrap_or(0)),
            seen,
            name: name.into(),
        }
    }

    pub fn name(&self) -> &Arc<ServicePortName> {
        &self.name
    }
}

/// The message of a claimant that loses a frontend to the holder.
pub fn conflict_message(kind: FrontendKind, fe: &Frontend, holder: &ServicePortName) -> String {
    format!(
        "{} {fe} is already held by {holder} (created earlier, or seen earlier); this one is skipped until it is free",
        kind.as_str()
    )
}

/// Computes the whole table for `ports` (each with its stable service id),
/// the first claimant of a frontend in the given order keeping it (sort by
/// [`Rank`] for the agent's rule).
pub fn compute<'a>(
    ports: impl IntoIterator<Item = (u32, &'a ServicePort)>,
    node: &NodeContext,
) -> DesiredTable {
    let mut table = DesiredTable::default();
    let mut claims: BTreeMap<BackendKey, BackendClaims> = BTreeMap::new();
    for (id, port) in ports {
        let c = contribution(id, port, node);
        let name = port.name();
        for b in &c.backends {
            claims.entry(b.key()).or_default().add(b);
        }
        table.service_addresses.extend(c.service_addresses);
        table
            .source_ranges
            .extend(c.source_ranges.iter().map(|r| (id, *r)));
        for (fe, entry) in c.frontends {
            match table.frontends.get(&fe) {
                Some(held) => table.problems.push(Problem {
                    service: name.to_string(),
                    message: conflict_message(entry.kind, &fe, &table.service_names[&held.service_id]),
                }),
                None => {
                    table.frontends.insert(fe, entry);
                }
            }
        }
        table.service_names.insert(id, Arc::new(name));
    }
    table.backends = claims.iter().map(|(k, c)| (*k, c.merged(k))).collect();
    table
}

/// kube-proxy's endpoint sets, each falling back independently to serving
/// terminating endpoints when it has no ready one. The cluster set honours
/// topology (endpoints marked `in_topology`); the local set is local anyway.
pub struct EndpointSets<'a> {
    pub cluster: Vec<&'a Endpoint>,
    pub local: Vec<&'a Endpoint>,
}

pub fn endpoint_sets(endpoints: &[Endpoint]) -> EndpointSets<'_> {
    let pick = |only_local: bool| -> Vec<&Endpoint> {
        let candidates = endpoints
            .iter()
            .filter(|e| if only_local { e.local } else { e.in_topology });
        let ready: Vec<&Endpoint> = candidates.clone().filter(|e| e.ready).collect();
        if !ready.is_empty() {
            return ready;
        }
        candidates.filter(|e| e.serving && e.terminating).collect()
    };
    EndpointSets {
        cluster: pick(false),
        local: pick(true),
    }
}

/// Whether a port with a Local policy has no local endpoint (kube-proxy's
/// `sync_proxy_rules_no_local_endpoints_total`).
pub fn lacks_local_endpoints(sp: &ServicePort) -> bool {
    ((sp.external_policy_local && sp.externally_accessible()) || sp.internal_policy_local)
        && endpoint_sets(&sp.endpoints).local.is_empty()
}

/// What Service port `sp` (service id `id`) puts into the table.
pub fn contribution(id: u32, sp: &ServicePort, node: &NodeContext) -> Contribution {
    let mut c = Contribution::default();
    let sets = endpoint_sets(&sp.endpoints);
    // No usable endpoint at all: every destination rejects. Otherwise an
    // empty (Local) set drops.
    let when_empty = if sets.cluster.is_empty() {
        EmptyVerdict::Reject
    } else {
        EmptyVerdict::Drop
    };
    let key = |e: &Endpoint| BackendKey {
        addr: e.addr,
        port: e.port,
        proto: sp.proto,
    };
    let set = |eps: &[&Endpoint]| BackendSet {
        backends: eps.iter().map(|e| key(e)).collect(),
        when_empty,
    };
    // Every endpoint of the port is a backend, whatever its conditions:
    // established flows keep their backend until the endpoint is gone.
    c.backends = sp
        .endpoints
        .iter()
        .map(|e| Backend {
            addr: e.addr,
            port: e.port,
            proto: sp.proto,
            serving: e.serving,
            terminating: e.terminating,
            local: e.local,
        })
        .collect();
    let base = FrontendEntry {
        service_id: id,
        kind: FrontendKind::ClusterIp,
        backends: set(if sp.internal_policy_local {
            &sets.local
        } else {
            &sets.cluster
        }),
        internal_backends: None,
        masquerade: false,
        affinity_timeout: sp.affinity_timeout,
        source_ranges: false,
        external_local: sp.external_policy_local,
        internal_local: sp.internal_policy_local,
        dsr: false,
        maglev: sp.lb.algorithm.unwrap_or(node.lb.algorithm) == LbAlgorithm::Maglev,
    };
    // The node's addresses of the port's family (a dual-stack node serves
    // each family's NodePorts on that family's addresses).
    let same_family = |ips: &[IpAddr]| -> Vec<IpAddr> {
        ips.iter()
            .copied()
            .filter(|ip| IpFamily::of(ip) == sp.family)
            .collect()
    };
    let node_port_addresses = same_family(&node.node_port_addresses);
    // Exactly as many as it claims: a hundred thousand of these are kept.
    let external = if sp.externally_accessible() {
        sp.node_port.map_or(0, |_| node_port_addresses.len())
            + sp.external_ips.len()
            + sp.load_balancer_ips.len()
    } else {
        0
    };
    c.frontends.reserve_exact(sp.cluster_ips.len() + external);
    c.service_addresses.reserve_exact(sp.cluster_ips.len());
    let cluster_ips = sp.cluster_ips.iter().map(|&ip| {
        c.service_addresses.push(ip);
        Frontend {
            addr: ip,
            port: sp.port,
            proto: sp.proto,
        }
    });
    if !sp.externally_accessible() {
        // The last ClusterIP takes `base` itself (no copy of its sets).
        let mut cluster_ips = cluster_ips.peekable();
        while let Some(fe) = cluster_ips.next() {
            if cluster_ips.peek().is_some() {
                c.frontends.push((fe, base.clone()));
            } else {
                c.frontends.push((fe, base));
                break;
            }
        }
        return c;
    }
    for fe in cluster_ips {
        c.frontends.push((fe, base.clone()));
    }
    // External destinations: eTP=Cluster uses the cluster set and
    // masquerades; eTP=Local keeps the client address and uses the local set
    // for external sources, the cluster set for in-cluster ones.
    let external = if sp.external_policy_local {
        FrontendEntry {
            backends: set(&sets.local),
            internal_backends: Some(set(&sets.cluster)),
            ..base.clone()
        }
    } else {
        // DSR replaces the masquerade where the mode applies to the
        // protocol (the datapath still masquerades what it cannot send by
        // DSR: a hairpin, a flow XDP cannot route yet).
        let dsr = sp.lb.mode.unwrap_or(node.lb.mode).dsr_for(sp.proto);
        FrontendEntry {
            backends: set(&sets.cluster),
            masquerade: true,
            dsr,
            ..base.clone()
        }
    };
    let ranges = &sp.load_balancer_source_ranges;
    let node_ports = sp
        .node_port
        .map(|p| (FrontendKind::NodePort, &node_port_addresses, p));
    let destinations = node_ports.into_iter().chain([
        (FrontendKind::ExternalIp, &sp.external_ips, sp.port),
        (FrontendKind::LoadBalancer, &sp.load_balancer_ips, sp.port),
    ]);
    for (kind, addrs, port) in destinations {
        for &addr in addrs {
            let entry = FrontendEntry {
                kind,
                // As kube-proxy: the ranges guard LB IPs only.
                source_ranges: kind == FrontendKind::LoadBalancer && !ranges.is_empty(),
                ..external.clone()
            };
            let fe = Frontend {
                addr,
                port,
                proto: sp.proto,
            };
            c.frontends.push((fe, entry));
        }
    }
    if !ranges.is_empty() && !sp.load_balancer_ips.is_empty() {
        c.source_ranges.extend(ranges.iter().copied());
        // A node inside the ranges may also reach the LB IPs from them.
        if node
            .node_ips
            .iter()
            .any(|ip| ranges.iter().any(|r| r.contains(*ip)))
        {
            for &lb in &sp.load_balancer_ips {
                let host = if lb.is_ipv4() { 32 } else { 128 };
                c.source_ranges
                    .insert(IpCidr::new(lb, host).expect("a host prefix"));
            }
        }
    }
    // One port claiming one frontend twice (e.g. an external IP that is
    // also its LB IP): the first claim stands.
    let mut seen = BTreeSet::new();
    c.frontends.retain(|(fe, _)| seen.insert(*fe));
    c.service_addresses.sort();
    c.service_addresses.dedup();
    c
}

#[cfg(test)]
mod tests {
    //! One test per kube-proxy rule (see shared kube-proxy-semantics.md).
    use std::time::Duration;

    use super::*;
    use crate::net::Protocol;

    fn last_octet(a: IpAddr) -> u8 {
        match a {
            IpAddr::V4(a) => a.octets()[3],
            IpAddr::V6(a) => a.octets()[15],
        }
    }

    const NODE: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(192, 168, 0, 1));

    fn node() -> NodeContext {
        NodeContext {
            node_port_addresses: vec![NODE, IpAddr::from([192, 168, 1, 1])],
            node_ips: vec![NODE],
            lb: Default::default(),
        }
    }

    fn ep(last: u8, ready: bool, serving: bool, terminating: bool, local: bool) -> Endpoint {
        Endpoint {
            addr: IpAddr::from([10, 0, 0, last]),
            port: 8080,
            ready,
            serving,
            terminating,
            local,
            in_topology: true,
        }
    }
    fn ready(last: u8, local: bool) -> Endpoint {
        ep(last, true, true, false, local)
    }
    fn draining(last: u8, local: bool) -> Endpoint {
        ep(last, false, true, true, local)
    }

    fn port(endpoints: Vec<Endpoint>) -> ServicePort {
        ServicePort {
            namespace: "ns".into(),
            name: "svc".into(),
            port_name: "http".into(),
            proto: Protocol::Tcp,
            family: IpFamily::V4,
            port: 80,
            cluster_ips: vec![IpAddr::from([10, 96, 0, 1])],
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            external_policy_local: false,
            internal_policy_local: false,
            affinity_timeout: None,
            endpoints,
            lb: Default::default(),
        }
    }

    fn table(sp: &ServicePort) -> DesiredTable {
        compute([(7, sp)], &node())
    }

    fn fe(addr: IpAddr, port: u16) -> Frontend {
        Frontend {
            addr,
            port,
            proto: Protocol::Tcp,
        }
    }

    fn addrs(set: &BackendSet<BackendKey>) -> Vec<u8> {
        set.backends.iter().map(|k| last_octet(k.addr)).collect()
    }

    fn cluster_ip_entry(t: &DesiredTable) -> &FrontendEntry<BackendKey> {
        &t.frontends[&fe(IpAddr::from([10, 96, 0, 1]), 80)]
    }

    #[test]
    fn cluster_set_is_the_ready_endpoints() {
        let t = table(&port(vec![ready(1, false), draining(2, false), ready(3, true)]));
        assert_eq!(addrs(&cluster_ip_entry(&t).backends), [1, 3]);
    }

    #[test]
    fn cluster_set_falls_back_to_serving_terminating_endpoints() {
        let not_serving = ep(3, false, false, true, false);
        let t = table(&port(vec![draining(1, false), draining(2, true), not_serving]));
        assert_eq!(addrs(&cluster_ip_entry(&t).backends), [1, 2]);
    }

    #[test]
    fn local_set_falls_back_independently_of_the_cluster_set() {
        // Cluster has a ready endpoint (remote); locally only a draining one.
        let mut sp = port(vec![ready(1, false), draining(2, true)]);
        sp.internal_policy_local = true;
        let t = table(&sp);
        assert_eq!(addrs(&cluster_ip_entry(&t).backends), [2]);
    }

    #[test]
    fn condition_defaults_ready_unset_means_ready() {
        // The k8s layer maps unset conditions (ready → true, serving → true,
        // terminating → false) before this point; a default endpoint is used.
        let t = table(&port(vec![ready(1, false)]));
        assert_eq!(addrs(&cluster_ip_entry(&t).backends), [1]);
    }

    #[test]
    fn internal_traffic_policy_local_uses_local_endpoints_and_drops_without() {
        let mut sp = port(vec![ready(1, false), ready(2, true)]);
        sp.internal_policy_local = true;
        assert_eq!(addrs(&cluster_ip_entry(&table(&sp)).backends), [2]);
        sp.endpoints = vec![ready(1, false)];
        let t = table(&sp);
        let e = cluster_ip_entry(&t);
        assert!(e.backends.backends.is_empty());
        assert_eq!(
            e.backends.when_empty,
            EmptyVerdict::Drop,
            "Local without local endpoints: drop"
        );
    }

    #[test]
    fn no_usable_endpoints_rejects_every_destination() {
        let mut sp = port(vec![ep(1, false, false, true, true)]);
        sp.node_port = Some(30000);
        sp.external_ips = vec![IpAddr::from([203, 0, 113, 1])];
        sp.load_balancer_ips = vec![IpAddr::from([203, 0, 113, 2])];
        sp.external_policy_local = true;
        sp.internal_policy_local = true;
        let t = table(&sp);
        assert_eq!(t.frontends.len(), 5, "ClusterIP, 2 NodePorts, external IP, LB IP");
        for e in t.frontends.values() {
            assert!(e.backends.backends.is_empty());
            assert_eq!(e.backends.when_empty, EmptyVerdict::Reject, "{:?}", e.kind);
        }
    }

    #[test]
    fn external_traffic_policy_cluster_masquerades_external_destinations() {
        let mut sp = port(vec![ready(1, false), ready(2, true)]);
        sp.node_port = Some(30000);
        let t = table(&sp);
        let np = &t.frontends[&fe(NODE, 30000)];
        assert_eq!(np.kind, FrontendKind::NodePort);
        assert!(np.masquerade);
        assert!(np.internal_backends.is_none());
        assert_eq!(addrs(&np.backends), [1, 2]);
        assert!(
            !cluster_ip_entry(&t).masquerade,
            "ClusterIP masquerade is decided per source"
        );
    }

    #[test]
    fn external_traffic_policy_local_keeps_sources_and_short_circuits_in_cluster_traffic() {
        let mut sp = port(vec![ready(1, false), ready(2, true)]);
        sp.load_balancer_ips = vec![IpAddr::from([203, 0, 113, 2])];
        sp.external_policy_local = true;
        let t = table(&sp);
        let lb = &t.frontends[&fe(IpAddr::from([203, 0, 113, 2]), 80)];
        assert!(!lb.masquerade);
        assert_eq!(addrs(&lb.backends), [2], "external sources: local endpoints only");
        assert_eq!(
            addrs(lb.internal_backends.as_ref().unwrap()),
            [1, 2],
            "in-cluster sources: cluster set"
        );
        // And without a local endpoint: external sources are dropped.
        sp.endpoints = vec![ready(1, false)];
        let t = table(&sp);
        let lb = &t.frontends[&fe(IpAddr::from([203, 0, 113, 2]), 80)];
        assert_eq!(lb.backends.when_empty, EmptyVerdict::Drop);
    }

    #[test]
    fn node_ports_are_served_on_every_node_port_address() {
        let mut sp = port(vec![ready(1, true)]);
        sp.node_port = Some(30000);
        let t = table(&sp);
        for addr in node().node_port_addresses {
            assert!(t.frontends.contains_key(&fe(addr, 30000)), "{addr}");
        }
    }

    #[test]
    fn externally_accessible_means_node_port_external_ip_or_lb_ip() {
        let sp = port(vec![ready(1, true)]);
        assert!(!sp.externally_accessible());
        assert_eq!(table(&sp).frontends.len(), 1, "ClusterIP only");
    }

    #[test]
    fn source_ranges_apply_to_lb_ips_only_and_let_lb_ips_in_when_the_node_is_inside() {
        let mut sp = port(vec![ready(1, true)]);
        sp.node_port = Some(30000);
        sp.external_ips = vec![IpAddr::from([203, 0, 113, 1])];
        sp.load_balancer_ips = vec![IpAddr::from([203, 0, 113, 2])];
        sp.load_balancer_source_ranges = vec!["198.51.100.0/24".parse().unwrap()];
        let t = table(&sp);
        for (f, e) in &t.frontends {
            assert_eq!(e.source_ranges, e.kind == FrontendKind::LoadBalancer, "{f:?}");
        }
        assert_eq!(t.source_ranges.len(), 1, "node outside the ranges");
        sp.load_balancer_source_ranges
            .push("192.168.0.0/24".parse().unwrap());
        let t = table(&sp);
        assert!(t.source_ranges.contains(&(7, "203.0.113.2/32".parse().unwrap())));
    }

    #[test]
    fn cluster_ips_are_service_addresses_so_unknown_ports_are_rejected() {
        let t = table(&port(vec![ready(1, true)]));
        assert!(t.service_addresses.contains(&IpAddr::from([10, 96, 0, 1])));
    }

    #[test]
    fn session_affinity_applies_to_every_frontend_of_the_port() {
        let mut sp = port(vec![ready(1, true)]);
        sp.node_port = Some(30000);
        sp.affinity_timeout = Some(Duration::from_secs(10800));
        let t = table(&sp);
        assert!(
            t.frontends
                .values()
                .all(|e| e.affinity_timeout == Some(Duration::from_secs(10800)))
        );
        assert!(
            t.frontends.values().all(|e| e.service_id == 7),
            "one id: affinity shared across addresses"
        );
    }

    #[test]
    fn every_endpoint_is_a_backend_so_established_flows_keep_theirs() {
        let t = table(&port(vec![ready(1, true), ep(2, false, false, true, true)]));
        assert_eq!(
            t.backends.len(),
            2,
            "the not-serving terminating endpoint stays a backend"
        );
        assert!(
            !t.backends
                .values()
                .find(|b| last_octet(b.addr) == 2)
                .unwrap()
                .serving
        );
    }

    #[test]
    fn sctp_ports_are_programmed_like_tcp() {
        let mut sp = port(vec![ready(1, true)]);
        sp.proto = Protocol::Sctp;
        let t = table(&sp);
        assert!(t.problems.is_empty());
        assert!(!t.frontends.is_empty());
        assert!(t.frontends.keys().all(|k| k.proto == Protocol::Sctp));
    }

    #[test]
    fn a_frontend_claimed_twice_stays_with_the_first_and_the_second_is_reported() {
        let mut a = port(vec![ready(1, true)]);
        a.node_port = Some(30000);
        let mut b = port(vec![ready(2, true)]);
        b.name = "other".into();
        b.cluster_ips = vec![IpAddr::from([10, 96, 0, 2])];
        b.node_port = Some(30000);
        let t = compute([(1, &a), (2, &b)], &node());
        assert_eq!(t.frontends[&fe(NODE, 30000)].service_id, 1);
        assert_eq!(t.problems.len(), 2, "one per node-port address");
        assert!(
            t.frontends.contains_key(&fe(IpAddr::from([10, 96, 0, 2]), 80)),
            "the rest of b stays"
        );
    }
}
