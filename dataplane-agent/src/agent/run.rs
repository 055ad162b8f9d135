//! The daemon loop.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::ObjectReference;
use tracing::{info, warn};

use super::{
    config::{RunConfig, Source, interface_matches},
    health::{self, HealthState, ServiceHealthServers},
    interfaces,
    kube_source::{KubeSource, WarningEvent},
    metrics::{self, Metrics},
    sync::{SyncReport, Syncer, node_context},
};
use crate::{
    dataplane::{Attached, Datapath, DatapathConfig, LoadOptions},
    k8s::{manifests, store::Store},
};
use dataplane_common::stats::{Event, Hook};

/// How often interfaces are rescanned (besides link notifications) and
/// counters exported.
const HOUSEKEEPING: Duration = Duration::from_secs(1);

pub fn load_options(cfg: &RunConfig) -> LoadOptions {
    LoadOptions {
        max_services: cfg.max_services,
        max_backends: cfg.max_backends,
        // A frontend per address plus a slot per backend, two scopes at most.
        max_service_entries: (cfg.max_services.saturating_mul(8)).max(cfg.max_backends.saturating_mul(4)),
        ct_entries: cfg.conntrack_entries,
        affinity_entries: 65_536,
    }
}

pub fn datapath_config(cfg: &RunConfig) -> DatapathConfig {
    let mut c = DatapathConfig::new(cfg.node_ips[0]);
    c.cluster_cidr = cfg.cluster_cidr;
    c.service_cidrs = cfg.service_cidrs.clone();
    c.masquerade_all = cfg.masquerade_all;
    c.socket_lb_host_only = cfg.socket_lb_host_only;
    c
}

/// Stops the loop on SIGINT/SIGTERM. The pins stay: the datapath keeps
/// forwarding until the next agent adopts it.
fn stop_on_signal() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
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
            flag.store(true, Ordering::Relaxed);
        });
    }
    stop
}

/// Where the store's objects come from.
enum Feed {
    Manifests {
        paths: Vec<std::path::PathBuf>,
        fingerprint: Option<Vec<(std::path::PathBuf, Option<SystemTime>, u64)>>,
        previous: ObjectVersions,
    },
    Kube(KubeSource),
}

impl Feed {
    /// Brings `store` up to date; true when anything changed.
    fn poll(&mut self, store: &mut Store, metrics: &Mutex<Metrics>, node_name: &str) -> bool {
        match self {
            Feed::Kube(source) => {
                let (svc, eps, any) = source.drain(store, node_name);
                let mut m = metrics.lock().expect("metrics");
                m.service_changes += svc;
                m.endpoint_changes += eps;
                any
            }
            Feed::Manifests {
                paths,
                fingerprint,
                previous,
            } => {
                let fp = manifests::fingerprint(paths);
                if fingerprint.as_ref() == Some(&fp) {
                    return false;
                }
                *fingerprint = Some(fp);
                match manifests::load(paths) {
                    Ok(objects) => {
                        for p in &objects.problems {
                            warn!(problem = %p, "manifest skipped");
                        }
                        let versions = ObjectVersions::of(&objects);
                        let (svc_changes, ep_changes) = versions.changes_since(previous);
                        *previous = versions;
                        {
                            let mut m = metrics.lock().expect("metrics");
                            m.service_changes += svc_changes;
                            m.endpoint_changes += ep_changes;
                        }
                        store.replace_services(objects.services);
                        store.replace_slices(objects.slices);
                        store.set_node(
                            objects
                                .nodes
                                .into_iter()
                                .find(|n| n.metadata.name.as_deref() == Some(node_name)),
                        );
                        true
                    }
                    Err(e) => {
                        warn!(error = %e, "cannot load manifests; keeping the last good set");
                        false
                    }
                }
            }
        }
    }

    /// A Warning event on a Service (API source only; logs cover the rest).
    fn warn(&self, store: &Store, object: &str, reason: &str, note: &str) {
        let Feed::Kube(source) = self else { return };
        let (ns, name) = object.split_once('/').unwrap_or(("default", object));
        source.warn(WarningEvent {
            reference: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Service".into()),
                namespace: Some(ns.into()),
                name: Some(name.into()),
                uid: store.service_uid(ns, name),
                ..Default::default()
            },
            reason: reason.into(),
            note: note.into(),
        });
    }
}

pub fn run(mut cfg: RunConfig) -> anyhow::Result<()> {
    if cfg.devices.is_empty() {
        let mut devices: Vec<String> = interfaces::ipv4_addresses()
            .into_iter()
            .filter(|(_, a)| cfg.node_ips.contains(a))
            .map(|(d, _)| d)
            .collect();
        devices.dedup();
        if devices.is_empty() {
            anyhow::bail!(
                "no device holds the node IPs {:?} in this network namespace; pass --devices",
                cfg.node_ips
            );
        }
        cfg.devices = devices;
    }
    let stop = stop_on_signal();
    let mut feed = match &cfg.source {
        Source::Manifests(paths) => Feed::Manifests {
            paths: paths.clone(),
            fingerprint: None,
            previous: ObjectVersions::default(),
        },
        Source::Kubernetes => Feed::Kube(
            KubeSource::start(cfg.k8s_api_server.clone(), cfg.kubeconfig.clone(), &cfg.node_name)
                .context("starting the Kubernetes source")?,
        ),
    };
    let opts = load_options(&cfg);
    let mut dp = Datapath::open_pinned(&opts, &cfg.bpffs_dir)
        .with_context(|| format!("opening the datapath pinned under {}", cfg.bpffs_dir.display()))?;
    dp.maps_mut()
        .set_config(&datapath_config(&cfg))
        .context("writing the datapath config")?;
    let adopted = dp.maps().read_table().context("reading the pinned maps")?;
    info!(
        frontends = adopted.frontends.len(),
        backends = adopted.backends.len(),
        "adopted the pinned service table"
    );
    let mut syncer = Syncer::adopt(&adopted, &cfg.node_name, cfg.max_services, cfg.max_backends);
    for dev in &cfg.devices {
        let how = dp
            .attach_external(dev)
            .with_context(|| format!("attaching to external device {dev}"))?;
        info!(device = %dev, replaced = how == Attached::Replaced, "attached xdp_ingress and tc_egress");
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
    let mut pod_interfaces = BTreeMap::<String, ()>::new();
    let links = interfaces::LinkWatch::open()
        .map_err(|e| warn!(error = %e, "no link notifications; pod interfaces are found by rescanning every second"))
        .ok();
    attach_pod_interfaces(&mut dp, &cfg, &mut pod_interfaces);
    if let Some(pins) = dp.pins() {
        for m in pins.remove_foreign_maps() {
            info!(map = %m, "removed a pinned map this version does not use");
        }
        for l in pins.remove_stale_links() {
            info!(link = %l, "removed the pin of a link whose device is gone");
        }
    }

    let health = Arc::new(Mutex::new(HealthState {
        node_eligible: true,
        ..Default::default()
    }));
    let metrics = Arc::new(Mutex::new(Metrics::default()));
    let _health_server = health::proxy_server(&cfg.health_bind_address, health.clone(), cfg.sync_period)
        .with_context(|| format!("binding the health server on {}", cfg.health_bind_address))?;
    let _metrics_server = metrics::server(&cfg.metrics_bind_address, metrics.clone())
        .with_context(|| format!("binding the metrics server on {}", cfg.metrics_bind_address))?;
    let bind_ip = cfg
        .health_bind_address
        .rsplit_once(':')
        .map_or("0.0.0.0", |(ip, _)| ip)
        .trim_matches(|c| c == '[' || c == ']');
    let bind_ip = if bind_ip.is_empty() { "0.0.0.0" } else { bind_ip };
    let mut service_health = ServiceHealthServers::new(bind_ip, health.clone(), cfg.sync_period);
    info!(node = %cfg.node_name, health = %cfg.health_bind_address, metrics = %cfg.metrics_bind_address, "agent running");

    let mut store = Store::default();
    let mut dirty = false;
    let mut last_sync: Option<Instant> = None;
    let mut last_housekeeping = Instant::now() - HOUSEKEEPING;
    let mut seen_triggers = std::collections::BTreeSet::new();
    let mut reported = std::collections::BTreeSet::new();
    while !stop.load(Ordering::Relaxed) {
        dirty |= feed.poll(&mut store, &metrics, &cfg.node_name);
        let due = last_sync.is_none_or(|t| t.elapsed() >= cfg.sync_period);
        if (dirty || due) && store.synced() {
            let node = node_context(
                &cfg.node_ips,
                &cfg.node_port_addresses,
                &interfaces::ipv4_addresses(),
            );
            let report = syncer.sync(&store, &node, dp.maps_mut());
            log_sync(&report, &store);
            let bind_failures = service_health.update(&report.health_checks);
            for (svc, port, e) in &bind_failures {
                warn!(service = %svc, port, error = %e, reason = "FailedToStartServiceHealthcheck", "cannot serve healthCheckNodePort");
                if reported.insert(format!("{svc} health {port}")) {
                    let note = format!(
                        "node {} cannot listen on healthCheckNodePort {port}: {e}",
                        cfg.node_name
                    );
                    feed.warn(&store, svc, "FailedToStartServiceHealthcheck", &note);
                }
            }
            for (object, why) in &report.object_problems {
                if reported.insert(format!("{object} {why}")) {
                    feed.warn(&store, object, "FailedToProgramService", why);
                }
            }
            {
                let mut h = health.lock().expect("health");
                h.last_sync = Some(SystemTime::now());
                h.node_eligible = node_eligible(&store);
            }
            record_sync(
                &metrics,
                &report,
                bind_failures.len() as u64,
                &store,
                &mut seen_triggers,
            );
            dirty = false;
            last_sync = Some(Instant::now());
        }
        if links.as_ref().is_some_and(|l| l.changed()) {
            attach_pod_interfaces(&mut dp, &cfg, &mut pod_interfaces);
        }
        if last_housekeeping.elapsed() >= HOUSEKEEPING {
            attach_pod_interfaces(&mut dp, &cfg, &mut pod_interfaces);
            export_counters(&dp, &metrics, &syncer);
            last_housekeeping = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    info!(
        "stopping; the datapath stays attached (pinned under {})",
        cfg.bpffs_dir.display()
    );
    Ok(())
}

fn attach_pod_interfaces(dp: &mut Datapath, cfg: &RunConfig, known: &mut BTreeMap<String, ()>) {
    let present = interfaces::interface_names();
    known.retain(|name, _| present.contains(name));
    for name in present {
        if known.contains_key(&name)
            || cfg.devices.contains(&name)
            || !interface_matches(&cfg.pod_interfaces, &name)
        {
            continue;
        }
        match dp.attach_pod_interface(&name) {
            Ok(how) => {
                info!(interface = %name, replaced = how == Attached::Replaced, "attached to pod interface");
                known.insert(name, ());
            }
            Err(e) => warn!(interface = %name, error = %e, "cannot attach to pod interface; will retry"),
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

fn log_sync(report: &SyncReport, store: &Store) {
    info!(
        services = store.service_count(),
        endpoint_slices = store.slice_count(),
        service_ports = report.service_ports,
        frontends = report.frontends,
        backends = report.backends,
        ops = report.summary.ops,
        frontends_set = report.summary.frontends_set,
        frontends_removed = report.summary.frontends_removed,
        backends_set = report.summary.backends_set,
        backends_removed = report.summary.backends_removed,
        failed = report.failed_ops,
        problems = report.problems.len(),
        duration_ms = report.duration.as_secs_f64() * 1000.0,
        "synced"
    );
    for p in &report.problems {
        warn!(problem = %p, "skipped; every other Service is programmed");
    }
}

fn record_sync(
    metrics: &Mutex<Metrics>,
    report: &SyncReport,
    bind_failures: u64,
    store: &Store,
    seen_triggers: &mut std::collections::BTreeSet<String>,
) {
    let now = SystemTime::now();
    let mut m = metrics.lock().expect("metrics");
    m.sync_duration.observe(report.duration.as_secs_f64());
    m.last_sync_timestamp = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
    m.sync_problems = report.problems.len() as u64;
    m.failed_operations += report.failed_ops as u64;
    m.health_bind_failures += bind_failures;
    m.no_local_endpoints
        .insert("external", report.no_local_endpoints as u64);
    // Network programming latency: from each new trigger time to now.
    let triggers: std::collections::BTreeSet<String> = store.trigger_times().into_iter().collect();
    for t in triggers.difference(seen_triggers) {
        if let Some(at) = parse_rfc3339(t)
            && let Ok(d) = now.duration_since(at)
        {
            m.network_programming.observe(d.as_secs_f64());
        }
    }
    *seen_triggers = triggers;
}

fn export_counters(dp: &Datapath, metrics: &Mutex<Metrics>, _syncer: &Syncer) {
    let maps = dp.maps();
    let mut events = Vec::new();
    for hook in Hook::ALL {
        for event in Event::ALL {
            if let Ok(c) = maps.hook_counter(hook, event)
                && c.packets > 0
            {
                events.push((
                    hook.name().to_owned(),
                    event.name().to_owned(),
                    c.packets,
                    c.bytes,
                ));
            }
        }
    }
    let mut traffic = Vec::new();
    if let Ok(names) = maps.service_names() {
        for (id, (ns, name, port, proto)) in names {
            if let Ok(c) = maps.service_stats(id) {
                traffic.push((format!("{ns}/{name}:{port}/{proto}"), c.packets, c.bytes));
            }
        }
    }
    let occupancy = maps.occupancy();
    let mut m = metrics.lock().expect("metrics");
    m.datapath_events = events;
    m.service_traffic = traffic;
    m.map_occupancy = occupancy;
}

/// (namespace/name → content) of Services and EndpointSlices, to count
/// changes between loads as kube-proxy counts watch events.
#[derive(Default)]
struct ObjectVersions {
    services: BTreeMap<String, String>,
    slices: BTreeMap<String, String>,
}

impl ObjectVersions {
    fn of(objects: &manifests::Objects) -> Self {
        let key = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
            format!(
                "{}/{}",
                m.namespace.as_deref().unwrap_or("default"),
                m.name.as_deref().unwrap_or("")
            )
        };
        Self {
            services: objects
                .services
                .iter()
                .map(|s| (key(&s.metadata), serde_json::to_string(s).unwrap_or_default()))
                .collect(),
            slices: objects
                .slices
                .iter()
                .map(|s| (key(&s.metadata), serde_json::to_string(s).unwrap_or_default()))
                .collect(),
        }
    }

    fn changes_since(&self, old: &Self) -> (u64, u64) {
        let diff = |a: &BTreeMap<String, String>, b: &BTreeMap<String, String>| {
            let changed = a.iter().filter(|(k, v)| b.get(*k) != Some(v)).count();
            let removed = b.keys().filter(|k| !a.contains_key(*k)).count();
            (changed + removed) as u64
        };
        (
            diff(&self.services, &old.services),
            diff(&self.slices, &old.slices),
        )
    }
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.frac]Z` (UTC, as the API server writes).
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, mo, da) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<i64>());
    let (h, mi, se) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let nanos: u32 = format!("{frac:0<9}")[..9].parse().ok()?;
    // Days from civil (H. Hinnant's algorithm).
    let y2 = if mo <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * (if mo > 2 { mo - 3 } else { mo + 9 }) + 2) / 5 + da - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + se;
    Some(UNIX_EPOCH + Duration::new(u64::try_from(secs).ok()?, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trips_through_the_health_formatter() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123_000_000);
        assert_eq!(parse_rfc3339(&health::rfc3339(t)), Some(t));
        assert_eq!(
            parse_rfc3339("2023-11-14T22:13:20Z"),
            Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        assert_eq!(parse_rfc3339("not a time"), None);
    }
}
