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
/// terminating endpoints when it has no ready one.
pub struct EndpointSets<'a> {
    pub cluster: Vec<&'a Endpoint>,
    pub local: Vec<&'a Endpoint>,
}

pub fn endpoint_sets(endpoints: &[Endpoint]) -> EndpointSets<'_> {
    let pick = |only_local: bool| -> Vec<&Endpoint> {
        let candidates = endpoints.iter().filter(|e| !only_local || e.local);
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
    for eps in [&sets.cluster, &sets.local] {
        for e in eps.iter() {
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
                    terminating: e.terminating,
                    local: e.local,
                },
            );
        }
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
    if let Some(node_port) = sp.node_port {
        for &addr in &node.node_port_addresses {
            let entry = FrontendEntry {
                kind: FrontendKind::NodePort,
                ..external.clone()
            };
            insert(
                table,
                sp,
                Frontend {
                    addr,
                    port: node_port,
                    proto: sp.proto,
                },
                entry,
            );
        }
    }
    for &addr in &sp.external_ips {
        let entry = FrontendEntry {
            kind: FrontendKind::ExternalIp,
            ..external.clone()
        };
        insert(
            table,
            sp,
            Frontend {
                addr,
                port: sp.port,
                proto: sp.proto,
            },
            entry,
        );
    }
    let ranges = &sp.load_balancer_source_ranges;
    for &addr in &sp.load_balancer_ips {
        let entry = FrontendEntry {
            kind: FrontendKind::LoadBalancer,
            source_ranges: !ranges.is_empty(),
            ..external.clone()
        };
        insert(
            table,
            sp,
            Frontend {
                addr,
                port: sp.port,
                proto: sp.proto,
            },
            entry,
        );
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
