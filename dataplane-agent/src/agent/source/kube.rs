//! The Kubernetes API source: kube-rs watchers for Services, EndpointSlices
//! (with kube-proxy's label selectors), this Node and the ServiceCIDRs, on a tokio runtime of
//! their own; changes reach the sync loop through its event channel, each
//! waking it. Objects are parsed into the store's compact form on the
//! watchers' thread, so full objects never pile up (an initial list of
//! 100k EndpointSlices would otherwise take gigabytes). Also publishes
//! Warning events for what the agent had to skip.

use std::sync::mpsc;

use futures::{StreamExt as _, stream::BoxStream};
use k8s_openapi::api::{
    core::v1::{Node, ObjectReference, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use kube::{
    Api,
    runtime::{
        WatchStreamExt as _,
        events::{Event as KubeEvent, EventType, Recorder, Reporter},
        watcher,
    },
};
use tracing::{info, warn};

use super::Event;
use crate::k8s::{
    model::{ServiceInfo, SliceInfo, proxied},
    service_cidrs::ServiceCidrInfo,
    store::{ObjectKey, Store},
};

/// kube-proxy's selector: objects another proxy owns, and headless
/// Services' slices, are not watched at all.
pub const LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// One change to the store.
pub enum Change {
    Services(Delta<ServiceInfo>),
    Slices(Delta<SliceInfo>),
    Node(Delta<Node>),
    ServiceCidrs(Delta<ServiceCidrInfo>),
}

// Objects travel boxed: the variants' sizes differ by hundreds of bytes.
type Boxed<K> = Box<K>;

pub enum Delta<K> {
    /// A complete list (initial, or after a relist such as 410 Gone).
    Replace(Vec<K>),
    Apply(Boxed<K>),
    /// Deleted, or no longer selected (e.g. labelled for another proxy).
    Delete(ObjectKey),
}

/// How a watched kind is kept: parsed, or dropped when not proxied.
trait Parse: Sized + kube::Resource {
    type Kept;
    fn parse(self) -> Result<Self::Kept, ObjectKey>;
    fn key(&self) -> ObjectKey {
        ObjectKey::of(self.meta())
    }
}

impl Parse for Service {
    type Kept = ServiceInfo;
    fn parse(self) -> Result<ServiceInfo, ObjectKey> {
        if proxied(self.metadata.labels.as_ref()) {
            Ok(ServiceInfo::parse(&self))
        } else {
            Err(ObjectKey::of(&self.metadata))
        }
    }
}

impl Parse for EndpointSlice {
    type Kept = SliceInfo;
    fn parse(self) -> Result<SliceInfo, ObjectKey> {
        if proxied(self.metadata.labels.as_ref()) {
            Ok(SliceInfo::parse(&self))
        } else {
            Err(ObjectKey::of(&self.metadata))
        }
    }
}

impl Parse for Node {
    type Kept = Node;
    fn parse(mut self) -> Result<Node, ObjectKey> {
        self.metadata.managed_fields = None;
        self.status = None;
        Ok(self)
    }
}

impl Parse for ServiceCIDR {
    type Kept = ServiceCidrInfo;
    fn parse(self) -> Result<ServiceCidrInfo, ObjectKey> {
        Ok(ServiceCidrInfo::parse(&self))
    }
}

/// A Warning event to publish on an object.
pub struct WarningEvent {
    pub reference: ObjectReference,
    pub reason: String,
    pub note: String,
}

pub struct KubeSource {
    events: tokio::sync::mpsc::UnboundedSender<WarningEvent>,
}

#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error(transparent)]
    Client(#[from] crate::k8s::client::ClientError),
    #[error("cannot start the Kubernetes watch runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

async fn forward<K: Parse>(
    name: &'static str,
    stream: BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>,
    tx: mpsc::Sender<Event>,
    wrap: fn(Delta<K::Kept>) -> Change,
) {
    let mut stream = stream;
    let mut buffer: Option<Vec<K::Kept>> = None;
    while let Some(ev) = stream.next().await {
        let change = match ev {
            Ok(watcher::Event::Init) => {
                buffer = Some(Vec::new());
                continue;
            }
            Ok(watcher::Event::InitApply(obj)) => {
                if let Ok(kept) = obj.parse() {
                    buffer.get_or_insert_with(Vec::new).push(kept);
                }
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                let items = buffer.take().unwrap_or_default();
                info!(resource = name, objects = items.len(), "listed");
                Delta::Replace(items)
            }
            Ok(watcher::Event::Apply(obj)) => match obj.parse() {
                Ok(kept) => Delta::Apply(Box::new(kept)),
                Err(key) => Delta::Delete(key),
            },
            Ok(watcher::Event::Delete(obj)) => Delta::Delete(obj.key()),
            Err(e) => {
                warn!(resource = name, error = %e, "watch failed; retrying with backoff");
                continue;
            }
        };
        if tx.send(Event::Kube(wrap(change))).is_err() {
            return;
        }
    }
}

impl KubeSource {
    /// Starts the watchers; their changes go to `tx`.
    pub fn start(
        api_server: Option<String>,
        kubeconfig: Option<std::path::PathBuf>,
        node_name: &str,
        tx: mpsc::Sender<Event>,
    ) -> Result<Self, KubeSourceError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (events_tx, mut events_rx) = tokio::sync::mpsc::unbounded_channel::<WarningEvent>();
        let node_name = node_name.to_owned();
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("kube-source".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let client = match crate::k8s::client::client(api_server, kubeconfig).await {
                        Ok(c) => {
                            let _ = ready_tx.send(Ok(()));
                            c
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let cfg = watcher::Config::default().labels(LABEL_SELECTOR);
                    let services = watcher(Api::<Service>::all(client.clone()), cfg.clone())
                        .default_backoff()
                        .boxed();
                    let slices = watcher(Api::<EndpointSlice>::all(client.clone()), cfg)
                        .default_backoff()
                        .boxed();
                    let node_cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
                    let nodes = watcher(Api::<Node>::all(client.clone()), node_cfg)
                        .default_backoff()
                        .boxed();
                    // Cluster-scoped, every one (kube-proxy's ServiceCIDR
                    // informer): an API server without them (before 1.33)
                    // or missing RBAC leaves only --service-cidr in force.
                    let service_cidrs = watcher(
                        Api::<ServiceCIDR>::all(client.clone()),
                        watcher::Config::default(),
                    )
                    .default_backoff()
                    .boxed();
                    let recorder = Recorder::new(
                        client,
                        Reporter {
                            controller: "dataplane-agent".into(),
                            instance: Some(node_name.clone()),
                        },
                    );
                    let publish = async move {
                        while let Some(ev) = events_rx.recv().await {
                            let event = KubeEvent {
                                type_: EventType::Warning,
                                reason: ev.reason.clone(),
                                note: Some(ev.note.clone()),
                                action: "Program".into(),
                                secondary: None,
                            };
                            if let Err(e) = recorder.publish(&event, &ev.reference).await {
                                warn!(reason = %ev.reason, error = %e, "cannot publish event");
                            }
                        }
                    };
                    futures::join!(
                        forward("services", services, tx.clone(), Change::Services),
                        forward("endpointslices", slices, tx.clone(), Change::Slices),
                        forward("node", nodes, tx.clone(), Change::Node),
                        forward("servicecidrs", service_cidrs, tx, Change::ServiceCidrs),
                        publish,
                    );
                });
            })?;
        if let Ok(Err(e)) = ready_rx.recv() {
            return Err(e.into());
        }
        Ok(Self { events: events_tx })
    }

    /// Applies one change to `store`.
    pub fn apply(change: Change, store: &mut Store, node_name: &str) {
        match change {
            Change::Services(d) => match d {
                Delta::Replace(items) => store.replace_service_infos(items),
                Delta::Apply(s) => store.upsert_service_info(*s),
                Delta::Delete(key) => store.remove_service(&key),
            },
            Change::Slices(d) => match d {
                Delta::Replace(items) => store.replace_slice_infos(items),
                Delta::Apply(s) => store.upsert_slice_info(*s),
                Delta::Delete(key) => store.remove_slice(&key),
            },
            Change::Node(d) => match d {
                Delta::Replace(mut items) => store.set_node(items.pop()),
                Delta::Apply(n) if n.metadata.name.as_deref() == Some(node_name) => store.set_node(Some(*n)),
                Delta::Apply(_) => {}
                Delta::Delete(_) => store.set_node(None),
            },
            Change::ServiceCidrs(d) => match d {
                Delta::Replace(items) => store.service_cidrs_mut().replace(items),
                Delta::Apply(i) => store.service_cidrs_mut().upsert(*i),
                Delta::Delete(key) => store.service_cidrs_mut().remove(&key.name),
            },
        }
    }

    pub fn warn(&self, event: WarningEvent) {
        let _ = self.events.send(event);
    }
}
