//! The objects the sources deliver, parsed, and which Services changed.
//!
//! Level-triggered and incremental at once: the store always holds the
//! whole truth (a lost event costs nothing once the next one or a relist
//! arrives), and it remembers which Services changed since the last sync
//! (kube-proxy's change trackers and their `checkoutChanges`), so a sync
//! recomputes only those. A Service changes when it, one of its
//! EndpointSlices, or the node's name or zone changes (the last one changes
//! them all).

use foldhash::{HashMap, HashSet, HashSetExt as _};
use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

pub use super::model::ObjectKey;
use super::model::{NodeInfo, ServiceInfo, Skipped, SliceInfo, ports_of, proxied, skipped_of};
use super::service_cidrs::ServiceCidrObjects;
use crate::state::inputs::ServicePort;

/// The key of an object's metadata.
pub fn key_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> ObjectKey {
    ObjectKey::of(meta)
}

/// What changed since the last [`Store::checkout_changes`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Everything may have changed (the node's name or zone): recompute all.
    pub all: bool,
    /// Services whose ports may differ: the Service itself or one of its
    /// slices changed (including Services that are gone).
    pub services: BTreeSet<ObjectKey>,
    /// Service objects added, changed or removed (kube-proxy's
    /// `sync_proxy_rules_service_changes_total`).
    pub service_changes: u64,
    /// EndpointSlices added, changed or removed.
    pub slice_changes: u64,
    /// `last-change-trigger-time` of the slice changes, for the network
    /// programming latency.
    pub trigger_times: Vec<String>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        !self.all && self.services.is_empty()
    }
}

/// A Service as the store keeps it.
#[derive(Clone, Debug)]
struct Stored {
    info: ServiceInfo,
    /// When it was first seen (a sequence number, kept across updates): of
    /// two Services claiming one frontend with the same creation time, or
    /// none (manifests), the one seen first keeps it.
    seen: u64,
}

/// Everything the agent knows about the cluster.
#[derive(Clone, Debug, Default)]
pub struct Store {
    /// Boxed: the table stays small (most of its buckets are empty, and a
    /// Service takes a few hundred bytes).
    services: HashMap<ObjectKey, Box<Stored>>,
    /// EndpointSlices by the Service they feed (`kubernetes.io/service-name`;
    /// slices without it feed nothing and are not kept).
    slices: HashMap<ObjectKey, Vec<SliceInfo>>,
    /// Slice → its Service.
    slice_owner: HashMap<ObjectKey, ObjectKey>,
    /// Endpoints over all slices.
    endpoints: usize,
    node: Option<Node>,
    node_info: Option<NodeInfo>,
    services_synced: bool,
    slices_synced: bool,
    changes: Changes,
    /// The last first-seen sequence number given.
    seen: u64,
    /// ServiceCIDR objects (they change the datapath's config, not the
    /// service table: no Service is recomputed for them).
    service_cidrs: ServiceCidrObjects,
}

/// One Service as a sync needs it: see [`Store::service_for_sync`].
pub struct ServiceForSync<'a> {
    pub info: &'a ServiceInfo,
    pub ports: Vec<ServicePort>,
    pub skipped: Vec<Skipped>,
    /// As [`Store::age`].
    pub age: (Option<i64>, u64),
}

impl Store {
    /// Nothing is programmed (and nothing pruned) before both Services and
    /// EndpointSlices have been listed once.
    pub fn synced(&self) -> bool {
        self.services_synced && self.slices_synced
    }

    /// The ServiceCIDR objects delivered so far.
    pub fn service_cidrs(&self) -> &ServiceCidrObjects {
        &self.service_cidrs
    }

    pub fn service_cidrs_mut(&mut self) -> &mut ServiceCidrObjects {
        &mut self.service_cidrs
    }

    pub fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    pub fn slice_count(&self) -> usize {
        self.slice_owner.len()
    }

    /// Endpoints over all slices (a sizing hint).
    pub fn endpoint_count(&self) -> usize {
        self.endpoints
    }

    pub fn service(&self, key: &ObjectKey) -> Option<&ServiceInfo> {
        self.services.get(key).map(|s| &s.info)
    }

    pub fn service_keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.services.keys()
    }

    /// The uid of a Service, for event references.
    pub fn service_uid(&self, namespace: &str, name: &str) -> Option<String> {
        self.services
            .get(&ObjectKey::new(namespace, name))
            .and_then(|s| s.info.uid.clone())
    }

    /// Whether anything changed since the last checkout.
    pub fn has_changes(&self) -> bool {
        !self.changes.is_empty()
    }

    /// The changes since the last call, and a fresh tracker.
    pub fn checkout_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    pub fn upsert_service(&mut self, svc: Service) {
        if !proxied(svc.metadata.labels.as_ref()) {
            return self.remove_service(&key_of(&svc.metadata));
        }
        self.upsert_service_info(ServiceInfo::parse(&svc));
    }

    /// As [`Store::upsert_service`], already parsed (sources parse on their
    /// own thread, so full objects never pile up).
    pub fn upsert_service_info(&mut self, info: ServiceInfo) {
        match self.services.get_mut(&info.key) {
            Some(s) if s.info == info => return,
            Some(s) => {
                self.changes.services.insert(info.key.clone());
                s.info = info;
            }
            None => {
                self.changes.services.insert(info.key.clone());
                self.seen += 1;
                let seen = self.seen;
                self.services
                    .insert(info.key.clone(), Box::new(Stored { info, seen }));
            }
        }
        self.changes.service_changes += 1;
    }

    pub fn remove_service(&mut self, key: &ObjectKey) {
        if self.services.remove(key).is_some() {
            self.changes.services.insert(key.clone());
            self.changes.service_changes += 1;
        }
    }

    /// How old a Service is, for frontend conflicts: its creation time
    /// (seconds; `None` for objects without one, which count as newer than
    /// any with one), then when this agent first saw it.
    pub fn age(&self, key: &ObjectKey) -> (Option<i64>, u64) {
        self.services
            .get(key)
            .map_or((None, u64::MAX), |s| (s.info.created, s.seen))
    }

    /// What a sync needs of one Service (one lookup): its ports for this
    /// node and what had to be skipped (as [`Store::ports_for`]), and its age
    /// (as [`Store::age`]). `None` when it is gone.
    pub fn service_for_sync(&self, key: &ObjectKey, node: &NodeInfo) -> Option<ServiceForSync<'_>> {
        let s = self.services.get(key)?;
        let (ports, skipped) = self.ports_of_info(&s.info, node);
        Some(ServiceForSync {
            info: &s.info,
            ports,
            skipped,
            age: (s.info.created, s.seen),
        })
    }

    pub fn upsert_slice(&mut self, slice: EndpointSlice) {
        if !proxied(slice.metadata.labels.as_ref()) {
            return self.remove_slice(&key_of(&slice.metadata));
        }
        self.upsert_slice_info(SliceInfo::parse(&slice));
    }

    /// As [`Store::upsert_slice`], already parsed.
    pub fn upsert_slice_info(&mut self, mut info: SliceInfo) {
        // The Service's name is its key's (one copy for both).
        if let Some(name) = &info.service
            && let Some((key, _)) = self.services.get_key_value(&ObjectKey {
                namespace: info.key.namespace.clone(),
                name: name.clone(),
            })
        {
            info.service = Some(key.name.clone());
        }
        let Some(service) = info.service_key() else {
            // Feeds no Service (any more).
            return self.remove_slice(&info.key);
        };
        let old = self.slice_owner.get(&info.key).and_then(|owner| {
            self.slices
                .get(owner)
                .and_then(|v| v.iter().find(|s| s.key == info.key))
        });
        if old == Some(&info) {
            return;
        }
        if let Some(t) = &info.trigger_time
            && old.and_then(|o| o.trigger_time.as_ref()) != Some(t)
        {
            self.changes.trigger_times.push(t.clone());
        }
        self.unlink_slice(&info.key);
        self.changes.services.insert(service.clone());
        self.changes.slice_changes += 1;
        self.endpoints += info.endpoint_count();
        self.slice_owner.insert(info.key.clone(), service.clone());
        // Most Services have one slice: no room for more until needed.
        self.slices
            .entry(service)
            .or_insert_with(|| Vec::with_capacity(1))
            .push(info);
    }

    pub fn remove_slice(&mut self, key: &ObjectKey) {
        if self.unlink_slice(key) {
            self.changes.slice_changes += 1;
        }
    }

    /// Takes a slice out of the store (marking its Service changed); false
    /// if it is unknown.
    fn unlink_slice(&mut self, key: &ObjectKey) -> bool {
        let Some(owner) = self.slice_owner.remove(key) else {
            return false;
        };
        if let Some(group) = self.slices.get_mut(&owner) {
            if let Some(at) = group.iter().position(|s| s.key == *key) {
                self.endpoints -= group[at].endpoint_count();
                group.swap_remove(at);
            }
            if group.is_empty() {
                self.slices.remove(&owner);
            }
        }
        self.changes.services.insert(owner);
        true
    }

    /// A full list (initial sync or relist): replaces every Service. Only
    /// what really differs counts as a change.
    pub fn replace_services(&mut self, services: impl IntoIterator<Item = Service>) {
        self.replace_service_infos(
            services
                .into_iter()
                .filter(|s| proxied(s.metadata.labels.as_ref()))
                .map(|s| ServiceInfo::parse(&s)),
        );
    }

    pub fn replace_service_infos(&mut self, services: impl IntoIterator<Item = ServiceInfo>) {
        let mut seen = HashSet::new();
        for s in services {
            seen.insert(s.key.clone());
            self.upsert_service_info(s);
        }
        let gone: Vec<ObjectKey> = self
            .services
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        for k in gone {
            self.remove_service(&k);
        }
        self.services_synced = true;
    }

    pub fn replace_slices(&mut self, slices: impl IntoIterator<Item = EndpointSlice>) {
        self.replace_slice_infos(
            slices
                .into_iter()
                .filter(|s| proxied(s.metadata.labels.as_ref()))
                .map(|s| SliceInfo::parse(&s)),
        );
    }

    pub fn replace_slice_infos(&mut self, slices: impl IntoIterator<Item = SliceInfo>) {
        let mut seen = HashSet::new();
        for s in slices {
            seen.insert(s.key.clone());
            self.upsert_slice_info(s);
        }
        // Slices are filed under their Service; `slice_owner` is the one
        // index by slice name.
        let gone: Vec<ObjectKey> = self
            .slice_owner
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        for k in gone {
            self.remove_slice(&k);
        }
        self.slices_synced = true;
    }

    /// This node. Its status is not kept (it can be large and is not used);
    /// a change of its name or zone changes every Service.
    pub fn set_node(&mut self, node: Option<Node>) {
        let node = node.map(|mut n| {
            n.metadata.managed_fields = None;
            n.status = None;
            n
        });
        let info = node.as_ref().map(NodeInfo::from_node);
        if info != self.node_info {
            self.changes.all = true;
        }
        self.node_info = info;
        self.node = node;
    }

    /// This node's name and zone (its Node object, or just `node_name`).
    pub fn node_info(&self, node_name: &str) -> NodeInfo {
        self.node_info.clone().unwrap_or_else(|| NodeInfo {
            name: node_name.to_owned(),
            zone: None,
        })
    }

    /// The Service ports of one Service for the node named `node_name`
    /// (empty when the Service is gone), and what had to be skipped.
    pub fn ports_of(&self, key: &ObjectKey, node_name: &str) -> (Vec<ServicePort>, Vec<Skipped>) {
        self.ports_for(key, &self.node_info(node_name))
    }

    /// As [`Store::ports_of`], with the node's info at hand (one lookup per
    /// sync, not per Service).
    pub fn ports_for(&self, key: &ObjectKey, node: &NodeInfo) -> (Vec<ServicePort>, Vec<Skipped>) {
        match self.services.get(key) {
            Some(s) => self.ports_of_info(&s.info, node),
            None => (Vec::new(), Vec::new()),
        }
    }

    fn ports_of_info(&self, svc: &ServiceInfo, node: &NodeInfo) -> (Vec<ServicePort>, Vec<Skipped>) {
        let group = self.slices.get(&svc.key).map(Vec::as_slice).unwrap_or_default();
        if let [one] = group {
            // The usual case: one slice, nothing to order.
            return (ports_of(svc, &[one], node), skipped_of(svc, &[one]));
        }
        // Slices in name order: which copy of a duplicate endpoint is kept
        // must not depend on arrival order.
        let mut slices: Vec<&SliceInfo> = group.iter().collect();
        slices.sort_by(|a, b| a.key.name.cmp(&b.key.name));
        (ports_of(svc, &slices, node), skipped_of(svc, &slices))
    }

    /// Every Service port of the store, ordered by Service.
    pub fn service_ports(&self, node_name: &str) -> (Vec<ServicePort>, Vec<Skipped>) {
        let keys: BTreeSet<&ObjectKey> = self.services.keys().collect();
        let mut ports = Vec::new();
        let mut skipped = Vec::new();
        for key in keys {
            let (p, s) = self.ports_of(key, node_name);
            ports.extend(p);
            skipped.extend(s);
        }
        (ports, skipped)
    }

    /// The health check a Service needs on this node, if any, computed from
    /// its ports (as [`Store::ports_of`] gives them).
    pub fn health_check(&self, key: &ObjectKey, ports: &[ServicePort]) -> Option<HealthCheck> {
        health_check_of(self.service(key)?, ports)
    }

    /// The health checks of every Service (pass the result of
    /// [`Store::service_ports`]).
    pub fn health_checks(&self, ports: &[ServicePort]) -> Vec<HealthCheck> {
        let mut by_service: BTreeMap<ObjectKey, Vec<ServicePort>> = BTreeMap::new();
        for p in ports {
            by_service
                .entry(ObjectKey::new(&p.namespace, &p.name))
                .or_default()
                .push(p.clone());
        }
        let keys: BTreeSet<&ObjectKey> = self.services.keys().collect();
        keys.into_iter()
            .filter_map(|k| {
                let ports = by_service.get(k).map(Vec::as_slice).unwrap_or_default();
                self.health_check(k, ports)
            })
            .collect()
    }
}

/// The health check a Service needs on this node, if any, computed from
/// its ports (as [`Store::ports_of`] gives them).
pub fn health_check_of(svc: &ServiceInfo, ports: &[ServicePort]) -> Option<HealthCheck> {
    let key = &svc.key;
    let port = svc.spec.as_ref()?.health_check_node_port?;
    // Distinct local ready endpoint IPs, per family as each of
    // kube-proxy's per-family proxiers counts them; a dual-stack pod is
    // one endpoint of each family, so the larger count is the pods'.
    let local_endpoints = crate::net::IpFamily::BOTH
        .into_iter()
        .map(|family| {
            ports
                .iter()
                .filter(|p| p.family == family)
                .flat_map(|p| &p.endpoints)
                .filter(|e| e.local && e.ready)
                .map(|e| e.addr)
                .collect::<BTreeSet<_>>()
                .len()
        })
        .max()
        .unwrap_or(0);
    Some(HealthCheck {
        namespace: key.namespace.to_string(),
        name: key.name.to_string(),
        port,
        local_endpoints,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::manifests::{Objects, load_text};

    fn objects(yaml: &str) -> Objects {
        let mut o = Objects::default();
        load_text(yaml, "test", &mut o);
        assert!(o.problems.is_empty(), "{:?}", o.problems);
        o
    }

    fn svc(name: &str, ip: &str) -> Service {
        objects(&format!(
            "kind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n"
        ))
        .services
        .remove(0)
    }

    fn slice(name: &str, service: &str, ip: &str) -> EndpointSlice {
        objects(&format!(
            "kind: EndpointSlice\nmetadata: {{name: {name}, namespace: ns, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{{addresses: [{ip}]}}]\n"
        ))
        .slices
        .remove(0)
    }

    fn changed(store: &mut Store) -> Vec<String> {
        store
            .checkout_changes()
            .services
            .iter()
            .map(|k| k.name.to_string())
            .collect()
    }

    #[test]
    fn changes_name_the_services_whose_objects_changed_and_only_those() {
        let mut s = Store::default();
        s.replace_services([svc("a", "10.96.0.1"), svc("b", "10.96.0.2")]);
        s.replace_slices([slice("a-1", "a", "10.0.0.1")]);
        assert_eq!(changed(&mut s), ["a", "b"]);
        // The same objects again (a relist): nothing changed.
        s.replace_services([svc("a", "10.96.0.1"), svc("b", "10.96.0.2")]);
        s.upsert_slice(slice("a-1", "a", "10.0.0.1"));
        assert!(!s.has_changes());
        // A slice moves from a to b: both change.
        s.upsert_slice(slice("a-1", "b", "10.0.0.1"));
        assert_eq!(changed(&mut s), ["a", "b"]);
        s.remove_slice(&ObjectKey::new("ns", "a-1"));
        assert_eq!(changed(&mut s), ["b"]);
        s.remove_service(&ObjectKey::new("ns", "a"));
        assert_eq!(changed(&mut s), ["a"]);
        // A relist without b removes it.
        s.replace_services([]);
        assert_eq!(changed(&mut s), ["b"]);
    }

    #[test]
    fn a_relist_without_a_slice_removes_its_endpoints() {
        // A slice deleted while the watch was down (410 Gone, then a
        // relist) must go with the relist.
        let mut s = Store::default();
        s.replace_services([svc("a", "10.96.0.1")]);
        s.replace_slices([slice("a-1", "a", "10.0.0.1"), slice("a-2", "a", "10.0.0.2")]);
        changed(&mut s);
        s.replace_slices([slice("a-2", "a", "10.0.0.2")]);
        assert_eq!(changed(&mut s), ["a"]);
        let (ports, _) = s.ports_of(&ObjectKey::new("ns", "a"), "n1");
        let addrs: Vec<String> = ports[0].endpoints.iter().map(|e| e.addr.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.2"]);
        assert_eq!(s.slice_count(), 1);
        s.replace_slices([]);
        assert_eq!(changed(&mut s), ["a"]);
        assert!(
            s.ports_of(&ObjectKey::new("ns", "a"), "n1").0[0]
                .endpoints
                .is_empty()
        );
    }

    #[test]
    fn a_new_node_zone_changes_everything_and_a_status_update_nothing() {
        let mut s = Store::default();
        let node = |zone: &str| {
            objects(&format!(
                "kind: Node\nmetadata: {{name: n1, labels: {{topology.kubernetes.io/zone: {zone}}}}}\nstatus: {{nodeInfo: {{kubeletVersion: v1}}}}\n"
            ))
            .nodes
            .remove(0)
        };
        s.set_node(Some(node("z1")));
        assert!(s.checkout_changes().all);
        s.set_node(Some(node("z1")));
        assert!(!s.checkout_changes().all, "same name and zone");
        assert!(s.node().unwrap().status.is_none(), "status is not kept");
        s.set_node(Some(node("z2")));
        assert!(s.checkout_changes().all);
    }

    #[test]
    fn ports_of_one_service_use_only_its_slices() {
        let mut s = Store::default();
        s.replace_services([svc("a", "10.96.0.1"), svc("b", "10.96.0.2")]);
        s.replace_slices([slice("a-1", "a", "10.0.0.1"), slice("b-1", "b", "10.0.0.2")]);
        let (ports, skipped) = s.ports_of(&ObjectKey::new("ns", "a"), "n1");
        assert!(skipped.is_empty());
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].endpoints.len(), 1);
        assert_eq!(ports[0].endpoints[0].addr.to_string(), "10.0.0.1");
    }
}
