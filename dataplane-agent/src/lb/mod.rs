//! Bare-metal LoadBalancers inside the agent (docs/loadbalancer.md):
//!
//! - [`allocator`]: one active instance in the cluster (a Lease) gives
//!   Services of type LoadBalancer of our `loadBalancerClass` addresses from
//!   [`crd::LoadBalancerIPPool`]s and writes their status. The decisions are
//!   [`pool::plan`], pure; [`request`] reads Services and builds statuses.
//! - [`announce`]: for each assigned address one node, elected through a
//!   Lease per address ([`lease`]), answers ARP and neighbour solicitations
//!   for it ([`responder`]) and announces takeovers.
//! - [`bgp`]: every eligible node announces the addresses to BGP routers
//!   through a BIRD speaker beside the agent, as `BGPPeer`s and
//!   `BGPAdvertisement`s ([`crd`]) say.
//!
//! They run on a thread and tokio runtime of their own, with their own
//! watches ([`cache`]), beside the agent's sync loop; they only need the
//! API server. The datapath serves the addresses once they are in the
//! Services' status, like any LoadBalancer ingress IP.

pub mod allocator;
pub mod announce;
pub mod bgp;
pub mod cache;
pub mod config;
pub mod crd;
pub mod lease;
pub mod metrics;
pub mod pool;
pub mod request;
pub mod responder;

use std::{
    sync::{Arc, mpsc},
    thread::JoinHandle,
    time::Duration,
};

use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{Api, api::ObjectMeta, runtime::watcher};
use tracing::info;

use self::metrics::SharedLbMetrics;

/// The default `spec.loadBalancerClass` the agent serves.
pub const DEFAULT_CLASS: &str = "dataplane.example.com/lb";
/// Requested addresses, comma-separated (at most one per family), as
/// MetalLB's `metallb.io/loadBalancerIPs` and Cilium's `lbipam.cilium.io/ips`.
pub const IPS_ANNOTATION: &str = "lbipam.dataplane.example.com/ips";
/// Services with the same key (in one namespace) may share an address.
pub const SHARING_KEY_ANNOTATION: &str = "lbipam.dataplane.example.com/sharing-key";
/// The condition the allocator keeps on Services it serves.
pub const CONDITION_TYPE: &str = "dataplane.example.com/LoadBalancerIPAssigned";
/// The allocator's Lease.
pub const IPAM_LEASE: &str = "dataplane-lb-ipam";
/// L2 announcement Leases: `dataplane-l2-<address>`, labelled.
pub const L2_LEASE_PREFIX: &str = "dataplane-l2-";
pub const L2_LEASE_LABEL: &str = "dataplane.example.com/l2-announcement";
pub const L2_IP_ANNOTATION: &str = "dataplane.example.com/address";
/// Nodes with this label announce nothing (as cloud load balancers leave
/// them out).
pub const EXCLUDE_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
/// Where the Leases go when nothing says otherwise.
pub const DEFAULT_LEASE_NAMESPACE: &str = "kube-dataplane";

/// The load-balancer settings of `run`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LbConfig {
    /// Run an allocator candidate.
    pub ipam: bool,
    pub classes: request::ClassFilter,
    pub lease_namespace: String,
    pub ipam_lease: lease::LeaseTiming,
    /// Answer ARP/NDP for the addresses this node is elected for.
    pub l2_announce: bool,
    /// Empty: the agent's external devices.
    pub l2_interfaces: Vec<String>,
    pub l2_lease: lease::LeaseTiming,
    /// Announce through a BGP speaker (`None`: no BGP).
    pub bgp: Option<bgp::BgpConfig>,
}

impl Default for LbConfig {
    fn default() -> Self {
        Self {
            ipam: false,
            classes: request::ClassFilter {
                class: DEFAULT_CLASS.into(),
                default_class: false,
            },
            lease_namespace: DEFAULT_LEASE_NAMESPACE.into(),
            // client-go's defaults.
            ipam_lease: lease::LeaseTiming {
                duration: Duration::from_secs(15),
                renew_period: Duration::from_secs(2),
                renew_deadline: Some(Duration::from_secs(10)),
            },
            l2_announce: false,
            l2_interfaces: Vec::new(),
            l2_lease: lease::LeaseTiming {
                duration: Duration::from_secs(10),
                renew_period: Duration::from_secs(2),
                renew_deadline: None,
            },
            bgp: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LbError {
    #[error("{0}")]
    Responder(#[from] responder::ResponderError),
    #[error(transparent)]
    Client(#[from] crate::k8s::client::ClientError),
    #[error("cannot start the load-balancer controllers' thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// The running allocator and/or announcer; [`LbController::stop`] (or drop)
/// releases their Leases and stops them.
pub struct LbController {
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
    bgp: Option<bgp::SharedStatus>,
}

/// Where the controllers reach the API server.
#[derive(Clone, Debug, Default)]
pub struct ApiAccess {
    pub api_server: Option<String>,
    pub kubeconfig: Option<std::path::PathBuf>,
}

impl LbController {
    /// Starts what `cfg` enables, as `identity` (the node name), answering
    /// on `interfaces` (the resolved L2 interfaces). `None` when nothing is
    /// enabled.
    pub fn start(
        access: ApiAccess,
        identity: &str,
        cfg: &LbConfig,
        interfaces: &[String],
        metrics: SharedLbMetrics,
    ) -> Result<Option<Self>, LbError> {
        if !cfg.ipam && !cfg.l2_announce && cfg.bgp.is_none() {
            return Ok(None);
        }
        let bgp_status = cfg.bgp.as_ref().map(|_| bgp::SharedStatus::default());
        metrics.lock().expect("lb metrics").bgp = bgp_status.clone();
        // Sockets first: a bad interface is an error at start.
        let responder = if cfg.l2_announce {
            let counters = Arc::new(responder::Counters::default());
            metrics.lock().expect("lb metrics").responder = Some(counters.clone());
            Some(responder::Responder::start(interfaces, counters)?)
        } else {
            None
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let (ready_tx, ready_rx) = mpsc::channel();
        let cfg = cfg.clone();
        let identity = identity.to_owned();
        let status = bgp_status.clone();
        let thread = std::thread::Builder::new()
            .name("lb-controllers".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let client = match crate::k8s::client::client(access.api_server, access.kubeconfig).await
                    {
                        Ok(c) => {
                            let _ = ready_tx.send(Ok(()));
                            c
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    run(client, identity, cfg, responder, metrics, status, stop_rx).await;
                });
            })?;
        if let Ok(Err(e)) = ready_rx.recv() {
            return Err(e.into());
        }
        Ok(Some(Self {
            stop,
            thread: Some(thread),
            bgp: bgp_status,
        }))
    }

    /// The BGP speaker's state, when BGP is on (for `/healthz`).
    pub fn bgp_status(&self) -> Option<bgp::SharedStatus> {
        self.bgp.clone()
    }

    /// Releases the Leases (bounded by a few seconds) and stops.
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for LbController {
    fn drop(&mut self) {
        self.shut_down();
    }
}

async fn run(
    client: kube::Client,
    identity: String,
    cfg: LbConfig,
    responder: Option<responder::Responder>,
    metrics: SharedLbMetrics,
    bgp_status: Option<bgp::SharedStatus>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    use futures::FutureExt as _;
    let shared = cache::Shared::default();
    let (changed, changes) = tokio::sync::watch::channel(0u64);
    let mut watches = vec![
        cache::follow(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
            shared.clone(),
            changed.clone(),
            |w| &mut w.services,
            "services",
            "",
        )
        .boxed(),
    ];
    // The allocator hands out the pools' addresses; the announcers read
    // which pool an address is from.
    {
        watches.push(
            cache::follow(
                Api::<crd::LoadBalancerIPPool>::all(client.clone()),
                watcher::Config::default(),
                shared.clone(),
                changed.clone(),
                |w| &mut w.pools,
                "loadbalancerippools",
                " (is the LoadBalancerIPPool CRD installed? deploy/crd-loadbalancerippool.yaml)",
            )
            .boxed(),
        );
    }
    if cfg.bgp.is_some() {
        watches.push(
            cache::follow(
                Api::<crd::BgpPeer>::all(client.clone()),
                watcher::Config::default(),
                shared.clone(),
                changed.clone(),
                |w| &mut w.bgp_peers,
                "bgppeers",
                " (is the BGPPeer CRD installed? deploy/crd-bgp.yaml)",
            )
            .boxed(),
        );
        watches.push(
            cache::follow(
                Api::<crd::BgpAdvertisement>::all(client.clone()),
                watcher::Config::default(),
                shared.clone(),
                changed.clone(),
                |w| &mut w.bgp_advertisements,
                "bgpadvertisements",
                " (is the BGPAdvertisement CRD installed? deploy/crd-bgp.yaml)",
            )
            .boxed(),
        );
    }
    if cfg.l2_announce || cfg.bgp.is_some() {
        watches.push(
            cache::follow(
                Api::<EndpointSlice>::all(client.clone()),
                watcher::Config::default(),
                shared.clone(),
                changed.clone(),
                |w| &mut w.slices,
                "endpointslices",
                "",
            )
            .boxed(),
        );
        watches.push(
            cache::follow(
                Api::<Node>::all(client.clone()),
                watcher::Config::default().fields(&format!("metadata.name={identity}")),
                shared.clone(),
                changed.clone(),
                |w| &mut w.nodes,
                "node",
                "",
            )
            .boxed(),
        );
    }
    if cfg.l2_announce {
        watches.push(
            cache::follow(
                Api::<Lease>::namespaced(client.clone(), &cfg.lease_namespace),
                watcher::Config::default().labels(&format!("{L2_LEASE_LABEL}=true")),
                shared.clone(),
                changed.clone(),
                |w| &mut w.leases,
                "leases",
                "",
            )
            .boxed(),
        );
    }
    drop(changed);
    let allocator = cfg.ipam.then(|| {
        let elector = lease::Elector::new(
            Api::namespaced(client.clone(), &cfg.lease_namespace),
            lease::Candidate::new(
                &identity,
                ObjectMeta {
                    name: Some(IPAM_LEASE.into()),
                    namespace: Some(cfg.lease_namespace.clone()),
                    ..Default::default()
                },
                cfg.ipam_lease,
                true,
            ),
        );
        allocator::Allocator::new(
            client.clone(),
            &identity,
            cfg.classes.clone(),
            shared.clone(),
            metrics.clone(),
        )
        .run(elector, changes.clone(), stop.clone())
    });
    let announcer = responder.map(|r| {
        announce::Announcer::new(
            client.clone(),
            &identity,
            &cfg.lease_namespace,
            cfg.classes.clone(),
            cfg.l2_lease,
            shared.clone(),
            r,
            metrics.clone(),
        )
        .run(changes.clone(), stop.clone())
    });
    let speaker = cfg.bgp.clone().zip(bgp_status).map(|(bgp_cfg, status)| {
        bgp::Speaker::new(
            client.clone(),
            &identity,
            cfg.classes.clone(),
            bgp_cfg,
            shared.clone(),
            status,
        )
        .run(changes.clone(), stop.clone())
    });
    info!(
        ipam = cfg.ipam,
        bgp = cfg.bgp.is_some(),
        l2_announce = cfg.l2_announce,
        class = %cfg.classes.class,
        default_class = cfg.classes.default_class,
        lease_namespace = %cfg.lease_namespace,
        "load-balancer controllers running"
    );
    let workers = async {
        futures::join!(
            async {
                if let Some(a) = allocator {
                    a.await
                }
            },
            async {
                if let Some(a) = announcer {
                    a.await
                }
            },
            async {
                if let Some(s) = speaker {
                    s.await
                }
            }
        )
    };
    // The watches run until the workers are done.
    tokio::select! {
        _ = workers => {}
        _ = futures::future::join_all(watches) => {}
    }
}
