//! The objects the sources deliver, and stable service ids.
//!
//! Level-triggered: every sync recomputes the whole table from the store,
//! so a lost event costs nothing once the next one (or a relist) arrives.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use super::model::{LABEL_SERVICE_NAME, NodeInfo, Skipped, proxied, service_ports};
use crate::state::model::ServicePort;

/// `namespace/name`.
pub type ObjectKey = (String, String);

pub fn key_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> ObjectKey {
    (
        meta.namespace.clone().unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Everything the agent knows about the cluster.
#[derive(Clone, Debug, Default)]
pub struct Store {
    services: BTreeMap<ObjectKey, Service>,
    slices: BTreeMap<ObjectKey, EndpointSlice>,
    node: Option<Node>,
    services_synced: bool,
    slices_synced: bool,
}

impl Store {
    /// Nothing is programmed (and nothing pruned) before both Services and
    /// EndpointSlices have been listed once.
    pub fn synced(&self) -> bool {
        self.services_synced && self.slices_synced
    }

    pub fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// The uid of a Service, for event references.
    pub fn service_uid(&self, namespace: &str, name: &str) -> Option<String> {
        self.services
            .get(&(namespace.to_owned(), name.to_owned()))
            .and_then(|s| s.metadata.uid.clone())
    }

    pub fn upsert_service(&mut self, mut svc: Service) {
        if !proxied(svc.metadata.labels.as_ref()) {
            return self.remove_service(&key_of(&svc.metadata));
        }
        svc.metadata.managed_fields = None;
        self.services.insert(key_of(&svc.metadata), svc);
    }

    pub fn remove_service(&mut self, key: &ObjectKey) {
        self.services.remove(key);
    }

    pub fn upsert_slice(&mut self, mut slice: EndpointSlice) {
        if !proxied(slice.metadata.labels.as_ref()) {
            return self.remove_slice(&key_of(&slice.metadata));
        }
        slice.metadata.managed_fields = None;
        self.slices.insert(key_of(&slice.metadata), slice);
    }

    pub fn remove_slice(&mut self, key: &ObjectKey) {
        self.slices.remove(key);
    }

    /// A full list (initial sync or relist): replaces every Service.
    pub fn replace_services(&mut self, services: impl IntoIterator<Item = Service>) {
        self.services.clear();
        for s in services {
            self.upsert_service(s);
        }
        self.services_synced = true;
    }

    pub fn replace_slices(&mut self, slices: impl IntoIterator<Item = EndpointSlice>) {
        self.slices.clear();
        for s in slices {
            self.upsert_slice(s);
        }
        self.slices_synced = true;
    }

    pub fn set_node(&mut self, node: Option<Node>) {
        self.node = node.map(|mut n| {
            n.metadata.managed_fields = None;
            n
        });
    }

    /// Every Service port of the store, for the node named `node_name`.
    pub fn service_ports(&self, node_name: &str) -> (Vec<ServicePort>, Vec<Skipped>) {
        let node = match &self.node {
            Some(n) => NodeInfo::from_node(n),
            None => NodeInfo {
                name: node_name.to_owned(),
                zone: None,
            },
        };
        // EndpointSlices by (namespace, kubernetes.io/service-name).
        let mut by_service: BTreeMap<ObjectKey, Vec<&EndpointSlice>> = BTreeMap::new();
        for ((ns, _), slice) in &self.slices {
            if let Some(svc) = slice
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(LABEL_SERVICE_NAME))
            {
                by_service
                    .entry((ns.clone(), svc.clone()))
                    .or_default()
                    .push(slice);
            }
        }
        let mut ports = Vec::new();
        let mut skipped = Vec::new();
        for (key, svc) in &self.services {
            let slices = by_service.get(key).map(Vec::as_slice).unwrap_or_default();
            let (p, s) = service_ports(svc, slices, &node);
            ports.extend(p);
            skipped.extend(s);
        }
        (ports, skipped)
    }
}

/// One healthCheckNodePort server to run (eTP=Local LoadBalancer Services).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub namespace: String,
    pub name: String,
    pub port: u16,
    /// Distinct local ready endpoint IPs across the Service's ports
    /// (terminating ones do not count), as kube-proxy reports.
    pub local_endpoints: usize,
}

impl Store {
    /// The health checks this node serves, computed from the same ports the
    /// table is (pass the result of [`Store::service_ports`]).
    pub fn health_checks(&self, ports: &[ServicePort]) -> Vec<HealthCheck> {
        let mut out = Vec::new();
        for ((ns, name), svc) in &self.services {
            let Some(spec) = &svc.spec else { continue };
            let Some(port) = spec
                .health_check_node_port
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0)
            else {
                continue;
            };
            if spec.external_traffic_policy.as_deref() != Some("Local") {
                continue;
            }
            let local: BTreeSet<std::net::Ipv4Addr> = ports
                .iter()
                .filter(|p| &p.namespace == ns && &p.name == name)
                .flat_map(|p| &p.endpoints)
                .filter(|e| e.local && e.ready)
                .map(|e| e.addr)
                .collect();
            out.push(HealthCheck {
                namespace: ns.clone(),
                name: name.clone(),
                port,
                local_endpoints: local.len(),
            });
        }
        out
    }

    /// `endpoints.kubernetes.io/last-change-trigger-time` of every slice,
    /// for the network programming latency metric.
    pub fn trigger_times(&self) -> Vec<String> {
        self.slices
            .values()
            .filter_map(|s| {
                s.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("endpoints.kubernetes.io/last-change-trigger-time").cloned())
            })
            .collect()
    }
}

/// Identity of a Service port across syncs.
pub type PortKey = crate::dataplane::ServicePortName;

/// Service ids that stay the same while a Service port exists (stats,
/// affinity and source ranges are keyed by them) and are reused after.
#[derive(Clone, Debug)]
pub struct ServiceIds {
    ids: BTreeMap<PortKey, u32>,
    free: BTreeSet<u32>,
    next: u32,
    capacity: u32,
}

impl ServiceIds {
    pub fn new(capacity: u32) -> Self {
        Self {
            ids: BTreeMap::new(),
            free: BTreeSet::new(),
            next: 0,
            capacity,
        }
    }

    /// Adopts ids found in the maps after a restart.
    pub fn adopt(&mut self, key: PortKey, id: u32) {
        self.ids.insert(key, id);
        self.next = self.next.max(id + 1);
    }

    /// Ids for `ports` (in order); ports beyond capacity get `None`. Ids of
    /// ports that are gone are released.
    pub fn assign(&mut self, ports: &[ServicePort]) -> Vec<Option<u32>> {
        let keys: Vec<PortKey> = ports
            .iter()
            .map(|p| (p.namespace.clone(), p.name.clone(), p.port_name.clone(), p.proto))
            .collect();
        let live: BTreeSet<&PortKey> = keys.iter().collect();
        let gone: Vec<PortKey> = self.ids.keys().filter(|k| !live.contains(k)).cloned().collect();
        for k in gone {
            if let Some(id) = self.ids.remove(&k) {
                self.free.insert(id);
            }
        }
        keys.into_iter()
            .map(|k| {
                if let Some(id) = self.ids.get(&k) {
                    return Some(*id);
                }
                let id = match self.free.pop_first() {
                    Some(id) => id,
                    None if self.next < self.capacity => {
                        self.next += 1;
                        self.next - 1
                    }
                    None => return None,
                };
                self.ids.insert(k, id);
                Some(id)
            })
            .collect()
    }
}
