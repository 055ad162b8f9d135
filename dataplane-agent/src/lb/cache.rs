//! What the load-balancer controllers watch, kept apart from the agent's
//! store (the sync loop's): Services, pools, EndpointSlices, this Node, the
//! L2 Leases and the BGP objects, each a kube-rs watcher feeding a [`Cache`]. Every change
//! bumps a `tokio::sync::watch` counter the controllers wait on; they read
//! the whole picture each time (level-triggered).

use std::{
    collections::BTreeMap,
    fmt::Debug,
    sync::{Arc, Mutex},
};

use futures::StreamExt as _;
use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Resource,
    runtime::{WatchStreamExt as _, watcher},
};
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use super::crd::{BgpAdvertisement, BgpPeer, LoadBalancerIPPool};

/// The objects of one watch, by namespace/name (`/name` when
/// cluster-scoped).
#[derive(Debug)]
pub struct Cache<K> {
    pub objects: BTreeMap<String, K>,
    /// The first list has arrived.
    pub synced: bool,
    /// A (re)list in progress.
    relist: Option<BTreeMap<String, K>>,
}

impl<K> Default for Cache<K> {
    fn default() -> Self {
        Self {
            objects: BTreeMap::new(),
            synced: false,
            relist: None,
        }
    }
}

pub fn object_key<K: Resource>(o: &K) -> String {
    let m = o.meta();
    format!(
        "{}/{}",
        m.namespace.as_deref().unwrap_or(""),
        m.name.as_deref().unwrap_or("")
    )
}

impl<K: Resource> Cache<K> {
    /// Applies a watch event; true when the objects changed.
    pub fn apply(&mut self, event: watcher::Event<K>) -> bool {
        let strip = |mut o: K| {
            o.meta_mut().managed_fields = None;
            o
        };
        match event {
            watcher::Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(o) => {
                let o = strip(o);
                self.relist
                    .get_or_insert_with(BTreeMap::new)
                    .insert(object_key(&o), o);
                false
            }
            watcher::Event::InitDone => {
                self.objects = self.relist.take().unwrap_or_default();
                self.synced = true;
                true
            }
            watcher::Event::Apply(o) => {
                let o = strip(o);
                self.objects.insert(object_key(&o), o);
                true
            }
            watcher::Event::Delete(o) => self.objects.remove(&object_key(&o)).is_some(),
        }
    }

    /// Puts in an object a write returned (newer than what the watch has
    /// delivered so far; the watch's own event for it follows).
    pub fn wrote(&mut self, o: K) {
        self.objects.insert(object_key(&o), o);
    }
}

#[derive(Debug, Default)]
pub struct Watched {
    pub services: Cache<Service>,
    pub pools: Cache<LoadBalancerIPPool>,
    pub slices: Cache<EndpointSlice>,
    pub nodes: Cache<Node>,
    pub leases: Cache<Lease>,
    pub bgp_peers: Cache<BgpPeer>,
    pub bgp_advertisements: Cache<BgpAdvertisement>,
}

pub type Shared = Arc<Mutex<Watched>>;

/// Feeds `api`'s watch into the cache `pick` selects, bumping `changed` on
/// every change; runs until dropped. `hint` is added to watch errors.
pub async fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    shared: Shared,
    changed: tokio::sync::watch::Sender<u64>,
    pick: fn(&mut Watched) -> &mut Cache<K>,
    what: &'static str,
    hint: &'static str,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let mut stream = watcher(api, config).default_backoff().boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                let done = matches!(event, watcher::Event::InitDone);
                let any = pick(&mut shared.lock().expect("lb cache")).apply(event);
                if done {
                    info!(resource = what, "listed");
                }
                if any {
                    changed.send_modify(|v| *v = v.wrapping_add(1));
                }
            }
            Err(e) => warn!(resource = what, error = %e, "watch failed; retrying with backoff{hint}"),
        }
    }
}
