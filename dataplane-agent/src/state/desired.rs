//! kube-proxy's semantics as a pure function: Service ports and the node's
//! view in, frontends and backend sets out.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use super::model::{Endpoint, NodeContext, ServicePort};
use crate::{
    dataplane::{Backend, BackendSet, EmptyVerdict, Frontend, FrontendEntry, FrontendKind},
    net::{Ipv4Cidr, Protocol},
};

/// A backend as the desired state names it: by address, not by id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendKey {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
}

/// Why part of a Service port could not be programmed. The rest of it, and
/// every other Service, still is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub service: String,
    pub message: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredTable {
    pub frontends: BTreeMap<Frontend, FrontendEntry<BackendKey>>,
    pub backends: BTreeMap<BackendKey, Backend>,
    /// ClusterIPs: ports they do not serve are rejected.
    pub service_addresses: BTreeSet<Ipv4Addr>,
    /// (service id, allowed source prefix).
    pub source_ranges: BTreeSet<(u32, Ipv4Cidr)>,
    /// service id → `namespace/name:port`.
    pub service_names: BTreeMap<u32, String>,
    pub problems: Vec<Problem>,
}

/// Computes the table for `ports` (each with its stable service id).
pub fn compute<'a>(
    ports: impl IntoIterator<Item = (u32, &'a ServicePort)>,
    node: &NodeContext,
) -> DesiredTable {
    let mut table = DesiredTable::default();
    for (id, port) in ports {
        add_service_port(&mut table, id, port, node);
    }
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

fn add_service_port(table: &mut DesiredTable, id: u32, sp: &ServicePort, node: &NodeContext) {
    if sp.proto == Protocol::Sctp {
        table.problems.push(Problem {
            service: sp.id(),
            message: "SCTP ports are not translated by this datapath (port rewrite needs a CRC32c \
                      recompute); the port is skipped"
                .into(),
        });
        return;
    }
    table.service_names.insert(id, sp.id());
    let sets = endpoint_sets(&sp.endpoints);
    // No usable endpoint at all: every destination rejects. Otherwise an
    // empty (Local) set drops.
    let when_empty = if sets.cluster.is_empty() {
        EmptyVerdict::Reject
    } else {
        EmptyVerdict::Drop
    };
    let set = |eps: &[&Endpoint]| BackendSet {
        backends: eps
            .iter()
            .map(|e| BackendKey {
                addr: e.addr,
                port: e.port,
                proto: sp.proto,
            })
            .collect(),
        when_empty,
    };
    // Every endpoint of the port is a backend, whatever its conditions:
    // established flows keep their backend until the endpoint is gone.
    for e in &sp.endpoints {
        let key = BackendKey {
            addr: e.addr,
            port: e.port,
            proto: sp.proto,
        };
        table.backends.insert(
            key,
            Backend {
                addr: e.addr,
                port: e.port,
                proto: sp.proto,
                serving: e.serving,
                terminating: e.terminating,
                local: e.local,
            },
        );
    }
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
    };
    for &ip in &sp.cluster_ips {
        insert(
            table,
            sp,
            Frontend {
                addr: ip,
                port: sp.port,
                proto: sp.proto,
            },
            base.clone(),
        );
        table.service_addresses.insert(ip);
    }
    if !sp.externally_accessible() {
        return;
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
        FrontendEntry {
            backends: set(&sets.cluster),
            masquerade: true,
            ..base.clone()
        }
    };
    let ranges = &sp.load_balancer_source_ranges;
    let node_ports = sp
        .node_port
        .map(|p| (FrontendKind::NodePort, &node.node_port_addresses, p));
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
            insert(table, sp, fe, entry);
        }
    }
    if !ranges.is_empty() && !sp.load_balancer_ips.is_empty() {
        table.source_ranges.extend(ranges.iter().map(|r| (id, *r)));
        // A node inside the ranges may also reach the LB IPs from them.
        if node
            .node_ips
            .iter()
            .any(|ip| ranges.iter().any(|r| r.contains(*ip)))
        {
            for &lb in &sp.load_balancer_ips {
                table
                    .source_ranges
                    .insert((id, Ipv4Cidr::new(lb, 32).expect("/32")));
            }
        }
    }
}

/// First come, first served: a frontend two Service ports claim stays with
/// the first (in the iteration order the caller gives), the other is
/// reported.
fn insert(table: &mut DesiredTable, sp: &ServicePort, fe: Frontend, entry: FrontendEntry<BackendKey>) {
    if let Some(existing) = table.frontends.get(&fe) {
        let owner = table
            .service_names
            .get(&existing.service_id)
            .cloned()
            .unwrap_or_default();
        table.problems.push(Problem {
            service: sp.id(),
            message: format!(
                "{} {}:{}/{} is already used by {owner}; this one is skipped",
                entry.kind.as_str(),
                fe.addr,
                fe.port,
                fe.proto
            ),
        });
        return;
    }
    table.frontends.insert(fe, entry);
}

#[cfg(test)]
mod tests {
    //! One test per kube-proxy rule (see shared kube-proxy-semantics.md).
    use std::time::Duration;

    use super::*;

    const NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 1);

    fn node() -> NodeContext {
        NodeContext {
            node_port_addresses: vec![NODE, Ipv4Addr::new(192, 168, 1, 1)],
            node_ips: vec![NODE],
        }
    }

    fn ep(last: u8, ready: bool, serving: bool, terminating: bool, local: bool) -> Endpoint {
        Endpoint {
            addr: Ipv4Addr::new(10, 0, 0, last),
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
            port: 80,
            cluster_ips: vec![Ipv4Addr::new(10, 96, 0, 1)],
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            external_policy_local: false,
            internal_policy_local: false,
            affinity_timeout: None,
            endpoints,
        }
    }

    fn table(sp: &ServicePort) -> DesiredTable {
        compute([(7, sp)], &node())
    }

    fn fe(addr: Ipv4Addr, port: u16) -> Frontend {
        Frontend {
            addr,
            port,
            proto: Protocol::Tcp,
        }
    }

    fn addrs(set: &BackendSet<BackendKey>) -> Vec<u8> {
        set.backends.iter().map(|k| k.addr.octets()[3]).collect()
    }

    fn cluster_ip_entry(t: &DesiredTable) -> &FrontendEntry<BackendKey> {
        &t.frontends[&fe(Ipv4Addr::new(10, 96, 0, 1), 80)]
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
        sp.external_ips = vec![Ipv4Addr::new(203, 0, 113, 1)];
        sp.load_balancer_ips = vec![Ipv4Addr::new(203, 0, 113, 2)];
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
        sp.load_balancer_ips = vec![Ipv4Addr::new(203, 0, 113, 2)];
        sp.external_policy_local = true;
        let t = table(&sp);
        let lb = &t.frontends[&fe(Ipv4Addr::new(203, 0, 113, 2), 80)];
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
        let lb = &t.frontends[&fe(Ipv4Addr::new(203, 0, 113, 2), 80)];
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
        sp.external_ips = vec![Ipv4Addr::new(203, 0, 113, 1)];
        sp.load_balancer_ips = vec![Ipv4Addr::new(203, 0, 113, 2)];
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
        assert!(t.service_addresses.contains(&Ipv4Addr::new(10, 96, 0, 1)));
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
                .find(|b| b.addr.octets()[3] == 2)
                .unwrap()
                .serving
        );
    }

    #[test]
    fn sctp_ports_are_reported_and_skipped() {
        let mut sp = port(vec![ready(1, true)]);
        sp.proto = Protocol::Sctp;
        let t = table(&sp);
        assert!(t.frontends.is_empty());
        assert_eq!(t.problems.len(), 1);
    }

    #[test]
    fn a_frontend_claimed_twice_stays_with_the_first_and_the_second_is_reported() {
        let mut a = port(vec![ready(1, true)]);
        a.node_port = Some(30000);
        let mut b = port(vec![ready(2, true)]);
        b.name = "other".into();
        b.cluster_ips = vec![Ipv4Addr::new(10, 96, 0, 2)];
        b.node_port = Some(30000);
        let t = compute([(1, &a), (2, &b)], &node());
        assert_eq!(t.frontends[&fe(NODE, 30000)].service_id, 1);
        assert_eq!(t.problems.len(), 2, "one per node-port address");
        assert!(
            t.frontends.contains_key(&fe(Ipv4Addr::new(10, 96, 0, 2), 80)),
            "the rest of b stays"
        );
    }
}
