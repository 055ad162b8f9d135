//! One sync: store → Service ports → desired table → map operations.
//! Level-triggered: it recomputes everything and writes only differences.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use crate::{
    dataplane::{LbMaps, MapTable},
    k8s::store::{HealthCheck, PortKey, ServiceIds, Store},
    state::{
        desired,
        diff::{MapWriter, Op, PlanSummary, Programmer},
        model::NodeContext,
    },
};

/// What one sync did, for logs, metrics and health.
#[derive(Clone, Debug, Default)]
pub struct SyncReport {
    pub duration: Duration,
    pub service_ports: usize,
    pub frontends: usize,
    pub backends: usize,
    pub summary: PlanSummary,
    /// Objects or parts skipped, and operations that failed (with why).
    pub problems: Vec<String>,
    /// (namespace/name of the Service, why): the problems an event can be
    /// attached to.
    pub object_problems: Vec<(String, String)>,
    pub failed_ops: usize,
    pub health_checks: Vec<HealthCheck>,
    /// Service ports whose Local policy has no local endpoint.
    pub no_local_endpoints: usize,
}

pub struct Syncer {
    programmer: Programmer,
    ids: ServiceIds,
    names: BTreeMap<u32, PortKey>,
    node_name: String,
}

impl Syncer {
    /// Starts from what the maps hold (empty on a first start).
    pub fn adopt(table: &MapTable, node_name: &str, max_services: u32, max_backends: u32) -> Self {
        let mut ids = ServiceIds::new(max_services);
        let mut names = BTreeMap::new();
        for (id, key) in &table.service_names {
            ids.adopt(key.clone(), *id);
            names.insert(*id, key.clone());
        }
        Self {
            programmer: Programmer::adopt(max_backends, table),
            ids,
            names,
            node_name: node_name.to_owned(),
        }
    }

    pub fn sync(&mut self, store: &Store, node: &NodeContext, maps: &mut LbMaps) -> SyncReport {
        let started = Instant::now();
        let (ports, skipped) = store.service_ports(&self.node_name);
        let mut problems: Vec<String> = skipped
            .iter()
            .map(|s| format!("{}: {}", s.object, s.reason))
            .collect();
        let mut object_problems: Vec<(String, String)> = skipped
            .iter()
            .map(|s| (s.object.clone(), s.reason.clone()))
            .collect();
        let ids = self.ids.assign(&ports);
        let mut numbered = Vec::new();
        let mut live_names = BTreeMap::new();
        for (port, id) in ports.iter().zip(&ids) {
            match id {
                Some(id) => {
                    numbered.push((*id, port));
                    live_names.insert(
                        *id,
                        (
                            port.namespace.clone(),
                            port.name.clone(),
                            port.port_name.clone(),
                            port.proto,
                        ),
                    );
                }
                None => problems.push(format!(
                    "{}: no free service id (raise --max-services)",
                    port.id()
                )),
            }
        }
        let table = desired::compute(numbered.iter().copied(), node);
        object_problems.extend(table.problems.iter().map(|p| {
            // `namespace/name:port` → the Service object.
            let object = p.service.rsplit_once(':').map_or(p.service.as_str(), |(o, _)| o);
            (object.to_owned(), p.message.clone())
        }));
        problems.extend(
            table
                .problems
                .iter()
                .map(|p| format!("{}: {}", p.service, p.message)),
        );

        // Names first: inspect can name a frontend as soon as it exists.
        for (id, key) in &live_names {
            if self.names.get(id) != Some(key)
                && let Err(e) = maps.set_service_name(*id, (&key.0, &key.1, &key.2, key.3))
            {
                problems.push(format!("{}/{}:{}: {e}", key.0, key.1, key.2));
            }
        }
        let (ops, summary) = self.programmer.plan(&table);
        let mut failed_ops = 0;
        for op in &ops {
            if let Err(e) = maps.apply(op) {
                failed_ops += 1;
                problems.push(format!("{}: {e}", describe(op, &table)));
                self.programmer.forget(op);
            }
        }
        for id in self.names.keys().filter(|id| !live_names.contains_key(id)) {
            let _ = maps.remove_service_name(*id);
        }
        self.names = live_names;

        let no_local_endpoints = ports
            .iter()
            .filter(|p| {
                let sets = desired::endpoint_sets(&p.endpoints);
                ((p.external_policy_local && p.externally_accessible()) || p.internal_policy_local)
                    && sets.local.is_empty()
            })
            .count();
        SyncReport {
            duration: started.elapsed(),
            service_ports: ports.len(),
            frontends: table.frontends.len(),
            backends: table.backends.len(),
            summary,
            problems,
            object_problems,
            failed_ops,
            health_checks: store.health_checks(&ports),
            no_local_endpoints,
        }
    }
}

fn describe(op: &Op, table: &desired::DesiredTable) -> String {
    match op {
        Op::SetFrontend(fe, e) => format!(
            "{} {}:{}/{} of {}",
            e.kind.as_str(),
            fe.addr,
            fe.port,
            fe.proto,
            table
                .service_names
                .get(&e.service_id)
                .cloned()
                .unwrap_or_default()
        ),
        Op::SetBackend(_, b) => format!("backend {}:{}/{}", b.addr, b.port, b.proto),
        other => format!("{other:?}"),
    }
}

/// The node's view for the desired table: NodePort addresses from
/// nodePortAddresses, among the local addresses.
pub fn node_context(
    node_ips: &[Ipv4Addr],
    choice: &super::config::NodePortAddresses,
    local: &[(String, Ipv4Addr)],
) -> NodeContext {
    use super::config::NodePortAddresses;
    let non_loopback = || local.iter().map(|(_, a)| *a).filter(|a| !a.is_loopback());
    let mut addrs: BTreeSet<Ipv4Addr> = match choice {
        NodePortAddresses::All => non_loopback().collect(),
        NodePortAddresses::Primary => node_ips.iter().copied().collect(),
        NodePortAddresses::Cidrs(cidrs) => non_loopback()
            .filter(|a| cidrs.iter().any(|c| c.contains(*a)))
            .collect(),
    };
    if addrs.is_empty() && matches!(choice, NodePortAddresses::All) {
        addrs.extend(node_ips.iter().copied());
    }
    NodeContext {
        node_port_addresses: addrs.into_iter().collect(),
        node_ips: node_ips.to_vec(),
    }
}
