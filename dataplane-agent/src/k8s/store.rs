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
use crate::{net::Protocol, state::model::ServicePort};

/// `namespace/name`.
pub type ObjectKey = (String, String);

fn key_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> ObjectKey {
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

/// Identity of a Service port across syncs.
pub type PortKey = (String, String, String, Protocol);

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
