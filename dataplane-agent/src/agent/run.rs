//! The daemon, assembled in named phases that [`run`] calls in order:
//! `open_datapath` (the pins), `Servers::start` (health and metrics bind
//! before anything changes), `start_source`, `adopt_table` (the service
//! table the pins hold), `attach` and `attach_pods` (the hooks), and
//! `start_load_balancers`; then the control loop ([`super::control`]).

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex, OnceLock, mpsc},
    time::SystemTime,
};

use anyhow::Context as _;
use tracing::{info, warn};

use super::{
    config::{CgroupOrigin, RunConfig, Source},
    control::{Callbacks, ControlLoop, Timing},
    counters::DatapathCounters,
    health::{self, HealthState, ServiceHealthServers},
    http,
    metrics::{self, Metrics},
    pod_interfaces::{self, ExternalDevice, PodInterfaces},
    source::{Event, Feed, files::ManifestFeed, kube::KubeSource},
    sync::{SyncReport, Syncer},
};
use crate::{
    dataplane::{Attached, Datapath, DatapathConfig, LoadOptions},
    k8s::store::Store,
    os::interfaces::ChangeWatch,
};

pub fn load_options(cfg: &RunConfig) -> LoadOptions {
    LoadOptions {
        max_services: cfg.max_services,
        max_backends: cfg.max_backends,
        // A frontend per address plus a slot per backend, two scopes at most.
        max_service_entries: (cfg.max_services.saturating_mul(8)).max(cfg.max_backends.saturating_mul(4)),
        ct_entries: cfg.conntrack_entries,
        affinity_entries: 65_536,
        // IPv6 maps sized only on a node that serves IPv6 (an IPv6 node IP):
        // an IPv4-only node's have one entry each and cost nothing.
        ipv6: cfg.families().contains(&crate::net::IpFamily::V6),
    }
}

pub fn datapath_config(cfg: &RunConfig) -> DatapathConfig {
    let mut c = DatapathConfig::for_node(&cfg.node_ips);
    c.set_cidrs(&cfg.cluster_cidrs, &cfg.service_cidrs);
    c.masquerade_all = cfg.masquerade_all;
    c.socket_lb_host_only = cfg.socket_lb_host_only;
    c.localhost_nodeports = cfg.localhost_nodeports;
    c.host_routing = cfg.host_routing;
    c.maglev_size = cfg.maglev_size;
    c.maglev_seed = cfg.maglev_seed;
    c
}

/// Where the health servers listen: `--health-bind-address` (`IP:PORT`, or
/// `:PORT` for every address); on a node that serves IPv6, the IPv4 wildcard
/// (kube-proxy's default `0.0.0.0:10256`) becomes the IPv6 one, a socket
/// that takes both families, as Go's listener on `:10256` does: load
/// balancers probe healthCheckNodePorts over either family.
fn health_bind_address(
    text: &str,
    families: &[crate::net::IpFamily],
) -> anyhow::Result<std::net::SocketAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    let addr: SocketAddr = match text.strip_prefix(':') {
        Some(port) => (Ipv4Addr::UNSPECIFIED, port.parse()?).into(),
        None => text
            .parse()
            .with_context(|| format!("--health-bind-address {text}: expected IP:PORT"))?,
    };
    Ok(match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() && families.contains(&crate::net::IpFamily::V6) => {
            (Ipv6Addr::UNSPECIFIED, addr.port()).into()
        }
        _ => addr,
    })
}

/// Stops the loop on SIGINT/SIGTERM. The pins stay: the datapath keeps
/// forwarding until the next agent adopts it.
fn stop_on_signal(events: mpsc::Sender<Event>) {
    // SAFETY: signal mask manipulation with valid, initialised sets.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        std::thread::spawn(move || {
            let mut sig = 0;
            libc::sigwait(&set, &mut sig);
            let _ = events.send(Event::Stop);
        });
    }
}

/// Waits for link, address and route notifications and wakes the loop with
/// them (pod interfaces are rescanned then).
fn watch_links(watch: ChangeWatch, events: mpsc::Sender<Event>) {
    std::thread::spawn(move || {
        while watch.wait() {
            if events.send(Event::Links).is_err() {
                return;
            }
        }
    });
}

/// One malloc arena for the whole process (glibc; before any thread
/// starts). The sources parse objects on their own threads and the control
/// loop keeps them: with an arena per thread, a source's arena is left
/// holding the free chunks of a hundred thousand parsed objects, which glibc
/// sorts on that thread's next allocations (the first watch event after the
/// initial list waited about 10 ms for it at 100k Services). With one arena
/// the loop's own allocations after the first sync take that cost, and there
/// is one heap to trim instead of one per thread (a lower resident size).
/// The agent's threads rarely allocate at once, and each keeps a cache of
/// small chunks of its own.
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's tuning.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// The daemon, in the order its phases run: the pinned datapath, the
/// servers, the source, the service table adopted from the pins, the hooks
/// attached, the load balancers, then the control loop until a signal.
pub fn run(mut cfg: RunConfig) -> anyhow::Result<()> {
    one_malloc_arena();
    let mut external =
        pod_interfaces::external_devices(&cfg.devices, &cfg.node_ips).map_err(anyhow::Error::msg)?;
    cfg.devices = external.iter().map(|d| d.name.clone()).collect();
    let (events_tx, events) = mpsc::channel();
    stop_on_signal(events_tx.clone());
    let mut dp = open_datapath(&cfg)?;
    let servers = Servers::start(&cfg)?;
    let feed = start_source(&cfg, &servers.metrics, &events_tx)?;
    let (syncer, dp_config) = adopt_table(&cfg, &mut dp)?;
    attach(&cfg, &mut dp, &mut external)?;
    let pods = attach_pods(&cfg, &mut dp, &external, &events_tx)?;
    pods.publish(&external, &servers.health, &servers.metrics);
    // The counters read the maps in their final shape (after the resize).
    let _ = servers
        .counters
        .set(DatapathCounters::open(&cfg.bpffs_dir).context("opening the pinned maps for the counters")?);
    // Expired entries of the established conntrack tables (which never
    // evict) are collected on their own thread.
    let _conntrack_gc = super::ct_gc::ConntrackGc::start(&cfg.bpffs_dir, servers.metrics.clone())
        .context("opening the pinned maps for the conntrack collector")?;
    let service_health = ServiceHealthServers::new(
        &servers.http,
        servers.health_addr.ip(),
        servers.health.clone(),
        cfg.sync_period,
    );
    info!(node = %cfg.node_name, health = %cfg.health_bind_address, metrics = %cfg.metrics_bind_address, "agent running");
    let _lb = start_load_balancers(&cfg, &servers)?;

    let control = ControlLoop {
        node_name: cfg.node_name.clone(),
        node_ips: cfg.node_ips.clone(),
        node_port_addresses: cfg.node_port_addresses.clone(),
        lb_defaults: cfg.lb_defaults,
        bpffs_dir: cfg.bpffs_dir.display().to_string(),
        timing: Timing {
            min_sync_period: cfg.min_sync_period,
            sync_period: cfg.sync_period,
            ..Timing::default()
        },
        events,
        feed,
        syncer,
        dp,
        metrics: servers.metrics.clone(),
        dp_config,
        cluster_cidrs: cfg.cluster_cidrs.clone(),
        service_cidr_flags: cfg.service_cidrs.clone(),
    };
    let mut callbacks = DaemonCallbacks {
        cfg: &cfg,
        health: servers.health.clone(),
        metrics: servers.metrics.clone(),
        service_health,
        pods,
        external,
        reported: BTreeSet::new(),
    };
    control.run(&mut callbacks)?;
    info!(
        "stopping; the datapath stays attached (pinned under {})",
        cfg.bpffs_dir.display()
    );
    Ok(())
}

/// The pins first: a second agent on them stops here, before it touches
/// anything.
fn open_datapath(cfg: &RunConfig) -> anyhow::Result<Datapath> {
    let dp = Datapath::open_pinned(&load_options(cfg), &cfg.bpffs_dir)
        .with_context(|| format!("opening the datapath pinned under {}", cfg.bpffs_dir.display()))?;
    for r in dp.resized() {
        info!(
            map = r.map,
            from = r.from,
            to = r.to,
            "resized a pinned map to the configured capacity"
        );
    }
    Ok(dp)
}

/// The health and metrics servers, and what they read.
struct Servers {
    metrics: Arc<Mutex<Metrics>>,
    health: Arc<Mutex<HealthState>>,
    health_addr: std::net::SocketAddr,
    /// Set once the maps have their final shape.
    counters: Arc<OnceLock<DatapathCounters>>,
    http: http::ServerRuntime,
    _health_server: http::Server,
    _metrics_server: http::Server,
}

impl Servers {
    /// The servers bind before anything is attached or changed: a port in
    /// use stops a start here, with the datapath as it was.
    fn start(cfg: &RunConfig) -> anyhow::Result<Self> {
        let metrics = Arc::new(Mutex::new(Metrics::default()));
        let health = Arc::new(Mutex::new(HealthState {
            node_eligible: true,
            ..Default::default()
        }));
        let http = http::ServerRuntime::start().context("starting the HTTP servers' runtime")?;
        let health_addr = health_bind_address(&cfg.health_bind_address, &cfg.families())?;
        let health_server = health::proxy_server(&http, health_addr, health.clone(), cfg.sync_period)
            .with_context(|| format!("binding the health server on {health_addr}"))?;
        let counters = Arc::new(OnceLock::<DatapathCounters>::new());
        let metrics_server = metrics::server(&http, &cfg.metrics_bind_address, metrics.clone(), {
            let counters = counters.clone();
            move |m| {
                if let Some(c) = counters.get() {
                    c.refresh(m)
                }
            }
        })
        .with_context(|| format!("binding the metrics server on {}", cfg.metrics_bind_address))?;
        Ok(Self {
            metrics,
            health,
            health_addr,
            counters,
            http,
            _health_server: health_server,
            _metrics_server: metrics_server,
        })
    }
}

/// The Kubernetes watch or the manifest files, feeding the control loop.
fn start_source(
    cfg: &RunConfig,
    metrics: &Arc<Mutex<Metrics>>,
    events_tx: &mpsc::Sender<Event>,
) -> anyhow::Result<Feed> {
    Ok(match &cfg.source {
        Source::Manifests(paths) => Feed::Manifests(Box::new(
            ManifestFeed::start(paths.clone(), &cfg.node_name, metrics.clone(), events_tx.clone())
                .context("watching the manifests")?,
        )),
        Source::Kubernetes => Feed::Kube(
            KubeSource::start(
                cfg.k8s_api_server.clone(),
                cfg.kubeconfig.clone(),
                &cfg.node_name,
                events_tx.clone(),
            )
            .context("starting the Kubernetes source")?,
        ),
    })
}

/// Writes the config and adopts the service table the pins hold (a restart
/// changes nothing that is still right).
fn adopt_table(cfg: &RunConfig, dp: &mut Datapath) -> anyhow::Result<(Syncer, DatapathConfig)> {
    let dp_config = datapath_config(cfg);
    dp.maps_mut()
        .set_config(&dp_config)
        .context("writing the datapath config")?;
    let adopted = dp.maps().read_table().context("reading the pinned maps")?;
    info!(
        frontends = adopted.frontends.len(),
        backends = adopted.backends.len(),
        "adopted the pinned service table"
    );
    // What the frontends imply beyond their entries (Maglev tables, DSR
    // entries), rebuilt from them and written (a table's size or seed may
    // have changed across the restart).
    crate::state::diff::MapWriter::adopt(dp.maps_mut(), &adopted)
        .context("rebuilding the Maglev tables and DSR entries")?;
    let syncer = Syncer::adopt(&adopted, &cfg.node_name, cfg.max_services, cfg.max_backends);
    Ok((syncer, dp_config))
}

/// The external devices' hooks and connect-time translation.
fn attach(cfg: &RunConfig, dp: &mut Datapath, external: &mut [ExternalDevice]) -> anyhow::Result<()> {
    // Egress trusts no device's ingress word while the programs change (an
    // XDP/TC switch runs both on a device for a moment, and one could
    // translate a packet the other then judges untranslated); the pod
    // interfaces' first poll names the devices it trusts.
    dp.maps_mut()
        .set_hint_devices(&Default::default())
        .context("clearing the devices whose ingress word egress trusts")?;
    for dev in external.iter_mut() {
        let a = dp
            .attach_external(&dev.name, cfg.xdp_mode)
            .with_context(|| format!("attaching to external device {}", dev.name))?;
        if let Some(why) = &a.xdp_error {
            warn!(device = %dev.name, error = %why, "native XDP unavailable; the ingress path runs in TC");
        }
        info!(device = %dev.name, why = %dev.why, kind = ?a.kind, ingress = a.ingress, replaced = a.how == Attached::Replaced, "attached the ingress path and tc_egress");
        dev.ingress = Some(a.ingress);
    }
    match &cfg.cgroup_origin {
        CgroupOrigin::Chosen(m) => {
            let passed_over: Vec<String> = m.passed_over.iter().map(|p| p.display().to_string()).collect();
            info!(cgroup = %m.path.display(), why = %m.reason, passed_over = ?passed_over, "no --cgroup-path: chose the cgroup v2 mount");
        }
        CgroupOrigin::NotFound(why) => warn!(
            "no --cgroup-path and {why}: host processes get no connect-time translation and reach Services only if their packets pass a pod interface (under `ip netns exec`, which remounts /sys, the system's mount is hidden); pass --cgroup-path (none to silence this)"
        ),
        CgroupOrigin::Given | CgroupOrigin::Off => {}
    }
    if let Some(cgroup) = &cfg.cgroup_path {
        let how = dp.attach_cgroup(cgroup).with_context(|| {
            format!(
                "attaching connect-time translation to cgroup {}",
                cgroup.display()
            )
        })?;
        info!(cgroup = %cgroup.display(), replaced = how == Attached::Replaced, host_only = cfg.socket_lb_host_only, "attached connect-time translation");
    }
    Ok(())
}

/// The pod interfaces found and hooked, then the pins tidied (the resize
/// finished, foreign maps and stale links removed).
fn attach_pods(
    cfg: &RunConfig,
    dp: &mut Datapath,
    external: &[ExternalDevice],
    events_tx: &mpsc::Sender<Event>,
) -> anyhow::Result<PodInterfaces> {
    let mut pods = PodInterfaces::new(cfg.pod_interfaces.clone(), cfg.devices.clone());
    pods.set_external_hooks(external);
    // Notifications wake the control loop, which rescans.
    if let Some(watch) = pods.take_watch() {
        watch_links(watch, events_tx.clone());
    }
    pods.poll(dp, true);
    for (map, copied) in dp
        .finish_resize()
        .context("finishing the resize of pinned maps")?
    {
        info!(map, copied, "dropped the old copy of a resized map");
    }
    if let Some(pins) = dp.pins() {
        for m in pins.remove_foreign_maps() {
            info!(map = %m, "removed a pinned map this version does not use");
        }
        for l in pins.remove_stale_links() {
            info!(link = %l, "removed the pin of a link whose device is gone");
        }
    }
    Ok(pods)
}

/// LoadBalancer address allocation, L2 and BGP announcements: their own
/// thread and watches; stopping releases their Leases and withdraws.
fn start_load_balancers(
    cfg: &RunConfig,
    servers: &Servers,
) -> anyhow::Result<Option<crate::lb::LbController>> {
    let l2_interfaces = if cfg.lb.l2_interfaces.is_empty() {
        &cfg.devices
    } else {
        &cfg.lb.l2_interfaces
    };
    let lb = crate::lb::LbController::start(
        crate::lb::ApiAccess {
            api_server: cfg.k8s_api_server.clone(),
            kubeconfig: cfg.kubeconfig.clone(),
        },
        &cfg.node_name,
        &cfg.lb,
        l2_interfaces,
        servers.metrics.lock().expect("metrics").lb.clone(),
    )
    .context("starting the load-balancer controllers")?;
    if let Some(bgp) = lb.as_ref().and_then(|l| l.bgp_status()) {
        servers.health.lock().expect("health").bgp = Some(bgp);
    }
    Ok(lb)
}

/// What the agent does around the control loop: health, events, pod
/// interfaces.
struct DaemonCallbacks<'a> {
    cfg: &'a RunConfig,
    health: Arc<Mutex<HealthState>>,
    metrics: Arc<Mutex<Metrics>>,
    service_health: ServiceHealthServers,
    pods: PodInterfaces,
    external: Vec<ExternalDevice>,
    reported: BTreeSet<String>,
}

impl Callbacks for DaemonCallbacks<'_> {
    fn synced(
        &mut self,
        report: &SyncReport,
        store: &Store,
        feed: &Feed,
        syncer: &Syncer,
        dp: &mut Datapath,
    ) {
        let cfg = self.cfg;
        let bind_failures = self.service_health.update(&report.health_checks);
        for (svc, port, e) in &bind_failures {
            warn!(service = %svc, port, error = %e, reason = "FailedToStartServiceHealthcheck", "cannot serve healthCheckNodePort");
            if self.reported.insert(format!("{svc} health {port}")) {
                let note = format!(
                    "node {} cannot listen on healthCheckNodePort {port}: {e}",
                    cfg.node_name
                );
                feed.warn(store, svc, "FailedToStartServiceHealthcheck", &note);
            }
        }
        for (object, why) in &report.object_problems {
            feed.warn(store, object, "FailedToProgramService", why);
        }
        {
            let mut h = self.health.lock().expect("health");
            h.last_sync = Some(SystemTime::now());
            h.node_eligible = node_eligible(store);
        }
        self.metrics.lock().expect("metrics").health_bind_failures += bind_failures.len() as u64;
        // Local endpoints that came or went are checked for a route through
        // a pod interface.
        self.pods.set_local_endpoints(syncer.local_endpoints());
        if self.pods.poll(dp, false) {
            self.pods.publish(&self.external, &self.health, &self.metrics);
        }
    }

    fn interfaces(&mut self, dp: &mut Datapath) {
        if self.pods.poll(dp, true) {
            self.pods.publish(&self.external, &self.health, &self.metrics);
        }
    }
}

fn node_eligible(store: &Store) -> bool {
    let Some(node) = store.node() else {
        return true;
    };
    let deleting = node.metadata.deletion_timestamp.is_some();
    let scaling_down = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == "ToBeDeletedByClusterAutoscaler"));
    !deleting && !scaling_down
}
