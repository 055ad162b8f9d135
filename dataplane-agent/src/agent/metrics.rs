//! Prometheus metrics: kube-proxy's names where the meaning is the same;
//! `dataplane_*` for what only this datapath has. Histograms and the text
//! exposition (format 0.0.4, as kube-proxy serves by default) come from the
//! `prometheus-client` crate; the run loop updates a plain [`Metrics`] value
//! and every scrape encodes it through a collector, which also keeps the help
//! texts exactly kube-proxy's (the crate's registry would append a period).

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{
        MetricType,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use super::http::{Handler, Limits, Response, Server, ServerRuntime};
use crate::prom::{Fmt, const_counter, const_gauge, counter, family, gauge};

/// Everything exported. The run loop updates it; scrapes encode it.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// kube-proxy's sync buckets (1 ms · 2^i).
    pub sync_duration: Histogram,
    pub network_programming: Histogram,
    pub last_sync_timestamp: f64,
    pub service_changes: u64,
    pub endpoint_changes: u64,
    /// traffic_policy ("internal" | "external") → service ports without a
    /// local endpoint.
    pub no_local_endpoints: BTreeMap<&'static str, u64>,
    pub sync_problems: u64,
    pub failed_operations: u64,
    /// Map entries found differing from what the agent wrote, repaired.
    pub map_drift: u64,
    pub health_bind_failures: u64,
    /// reason → manifest files or objects not applied.
    pub skipped_objects: BTreeMap<&'static str, u64>,
    /// Manifest files whose current content is not in use.
    pub manifest_files_refused: u64,
    /// map → (entries, capacity).
    pub map_occupancy: BTreeMap<&'static str, (u64, u64)>,
    /// (hook, event) → (packets, bytes).
    pub datapath_events: Vec<(String, String, u64, u64)>,
    /// service → (packets, bytes).
    pub service_traffic: Vec<(String, u64, u64)>,
    /// What new flows needed and how packets were forwarded
    /// (`dataplane_common::stats::FlowStat`): name → count.
    pub flow_events: Vec<(&'static str, u64)>,
    /// Conntrack entries the LRU evicted (estimated: see
    /// `LbMaps::ct_evictions`), never decreasing.
    pub conntrack_evictions: u64,
    /// Of those, per second between the last two reads.
    pub conntrack_pressure: f64,
    /// The last sweep of the assured conntrack copies, and the period.
    pub conntrack_gc_seconds: f64,
    pub conntrack_gc_interval_seconds: f64,
    /// Service CIDRs the datapath enforces, by family ("ipv4", "ipv6").
    pub service_cidrs: BTreeMap<&'static str, u64>,
    /// Service CIDRs beyond what the datapath holds: not enforced.
    pub service_cidrs_over_limit: u64,
    /// ServiceCIDR objects skipped as invalid.
    pub invalid_service_cidrs: u64,
    /// Pod-facing interfaces the datapath is attached to.
    pub pod_interfaces: u64,
    /// Local endpoints that no attached pod interface leads to.
    pub unreachable_local_endpoints: u64,
    /// LoadBalancer address allocation and L2 announcements.
    /// The load balancers' metrics, shared with their controllers.
    pub lb: crate::lb::metrics::SharedLbMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            sync_duration: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            network_programming: Histogram::new(exponential_buckets(0.001, 2.0, 20)),
            last_sync_timestamp: 0.0,
            service_changes: 0,
            endpoint_changes: 0,
            no_local_endpoints: BTreeMap::new(),
            sync_problems: 0,
            failed_operations: 0,
            map_drift: 0,
            health_bind_failures: 0,
            skipped_objects: BTreeMap::new(),
            manifest_files_refused: 0,
            map_occupancy: BTreeMap::new(),
            datapath_events: Vec::new(),
            service_traffic: Vec::new(),
            flow_events: Vec::new(),
            conntrack_evictions: 0,
            conntrack_pressure: 0.0,
            conntrack_gc_seconds: 0.0,
            conntrack_gc_interval_seconds: 0.0,
            service_cidrs: BTreeMap::new(),
            service_cidrs_over_limit: 0,
            invalid_service_cidrs: 0,
            pod_interfaces: 0,
            unreachable_local_endpoints: 0,
            lb: Default::default(),
        }
    }
}

pub type SharedMetrics = Arc<Mutex<Metrics>>;

/// The reasons `dataplane_skipped_objects_total` always shows (0 until one
/// happens), so alerts need no absent() dance.
const SKIP_REASONS: [&str; 6] = [
    "syntax",
    "invalid_object",
    "unsupported_kind",
    "empty_file",
    "unreadable",
    "too_large",
];

impl Metrics {
    fn encode(&self, enc: &mut DescriptorEncoder) -> Fmt {
        self.lb.lock().expect("lb metrics").encode(enc)?;
        self.sync_duration.encode(enc.encode_descriptor(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            None,
            MetricType::Histogram,
        )?)?;
        self.network_programming.encode(enc.encode_descriptor(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            None,
            MetricType::Histogram,
        )?)?;
        gauge(
            enc,
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            self.last_sync_timestamp,
        )?;
        // Counters are named without `_total`: the encoder appends it.
        counter(
            enc,
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            self.service_changes,
        )?;
        counter(
            enc,
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            self.endpoint_changes,
        )?;
        family(
            enc,
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            MetricType::Gauge,
            ["internal", "external"].map(|policy| {
                (
                    vec![("traffic_policy", policy)],
                    self.no_local_endpoints.get(policy).copied().unwrap_or(0),
                )
            }),
            const_gauge,
        )?;
        gauge(
            enc,
            "dataplane_sync_problems",
            "Objects or parts of objects the current table skips (see the agent's log)",
            self.sync_problems,
        )?;
        counter(
            enc,
            "dataplane_failed_map_operations",
            "Map writes that failed (full map, bad input); the maps are re-read and the write retried",
            self.failed_operations,
        )?;
        counter(
            enc,
            "dataplane_map_drift_entries",
            "Map entries found differing from what the agent wrote (changed behind its back, or a failed write), repaired",
            self.map_drift,
        )?;
        counter(
            enc,
            "dataplane_health_check_bind_failures",
            "healthCheckNodePort servers that could not be bound",
            self.health_bind_failures,
        )?;
        family(
            enc,
            "dataplane_skipped_objects",
            "Manifest files or objects not applied, by reason (a file's last good version stays in force; see the agent's log)",
            MetricType::Counter,
            SKIP_REASONS.map(|reason| {
                (
                    vec![("reason", reason)],
                    self.skipped_objects.get(reason).copied().unwrap_or(0),
                )
            }),
            const_counter,
        )?;
        family(
            enc,
            "dataplane_service_cidrs",
            "Service CIDRs the datapath enforces (--service-cidr and ServiceCIDR objects): traffic to an address in them that no Service holds is dropped",
            MetricType::Gauge,
            ["ipv4", "ipv6"].map(|family| {
                (
                    vec![("family", family)],
                    self.service_cidrs.get(family).copied().unwrap_or(0),
                )
            }),
            const_gauge,
        )?;
        gauge(
            enc,
            "dataplane_service_cidrs_over_limit",
            "Service CIDRs beyond the datapath's limit per family, not enforced (see the agent's log)",
            self.service_cidrs_over_limit,
        )?;
        counter(
            enc,
            "dataplane_invalid_service_cidrs",
            "ServiceCIDR objects skipped because a CIDR of theirs does not parse",
            self.invalid_service_cidrs,
        )?;
        gauge(
            enc,
            "dataplane_pod_interfaces",
            "Pod-facing host interfaces the datapath is attached to",
            self.pod_interfaces,
        )?;
        gauge(
            enc,
            "dataplane_unreachable_local_endpoints",
            "Local endpoints whose route leads through no attached pod interface (their Services' traffic from this node is not translated; see the agent's log)",
            self.unreachable_local_endpoints,
        )?;
        gauge(
            enc,
            "dataplane_manifest_files_refused",
            "Manifest files whose current content is not in use (their last good version is)",
            self.manifest_files_refused,
        )?;
        family(
            enc,
            "dataplane_map_entries",
            "Entries in a datapath map",
            MetricType::Gauge,
            self.map_occupancy
                .iter()
                .map(|(map, (n, _))| (vec![("map", *map)], *n)),
            const_gauge,
        )?;
        family(
            enc,
            "dataplane_map_capacity",
            "Capacity of a datapath map",
            MetricType::Gauge,
            self.map_occupancy
                .iter()
                .map(|(map, (_, cap))| (vec![("map", *map)], *cap)),
            const_gauge,
        )?;
        fn events(e: &(String, String, u64, u64)) -> Vec<(&str, &str)> {
            vec![("hook", e.0.as_str()), ("event", e.1.as_str())]
        }
        family(
            enc,
            "dataplane_packets",
            "Packets by program and outcome (drops and rejects by reason)",
            MetricType::Counter,
            self.datapath_events.iter().map(|e| (events(e), e.2)),
            const_counter,
        )?;
        family(
            enc,
            "dataplane_bytes",
            "Bytes by program and outcome",
            MetricType::Counter,
            self.datapath_events.iter().map(|e| (events(e), e.3)),
            const_counter,
        )?;
        family(
            enc,
            "dataplane_flow_events",
            "What new flows needed (SNAT ports, takeovers) and how packets were forwarded (XDP, host routing, \
             DSR, and why the stack got a packet instead), by event",
            MetricType::Counter,
            self.flow_events.iter().map(|(e, n)| (vec![("event", *e)], *n)),
            const_counter,
        )?;
        counter(
            enc,
            "dataplane_conntrack_evictions",
            "Conntrack entries the LRU evicted to make room for new flows (told from the datapath's counts); \
             assured flows' entries come back from their copies (ct_restored), others are lost",
            self.conntrack_evictions,
        )?;
        gauge(
            enc,
            "dataplane_conntrack_pressure",
            "Conntrack entries evicted per second between the last two reads: above 0, new flows arrive \
             faster than the table holds flows for their timeouts (a flood, or a table too small)",
            self.conntrack_pressure,
        )?;
        gauge(
            enc,
            "dataplane_conntrack_gc_duration_seconds",
            "How long the last sweep of the assured conntrack copies (collecting expired ones) took",
            self.conntrack_gc_seconds,
        )?;
        gauge(
            enc,
            "dataplane_conntrack_gc_interval_seconds",
            "The period of the sweeps of the assured conntrack copies (adapts to what they find)",
            self.conntrack_gc_interval_seconds,
        )?;
        family(
            enc,
            "dataplane_service_packets",
            "Packets translated to a Service port",
            MetricType::Counter,
            self.service_traffic
                .iter()
                .map(|(svc, p, _)| (vec![("service", svc.as_str())], *p)),
            const_counter,
        )?;
        family(
            enc,
            "dataplane_service_bytes",
            "Bytes translated to a Service port",
            MetricType::Counter,
            self.service_traffic
                .iter()
                .map(|(svc, _, b)| (vec![("service", svc.as_str())], *b)),
            const_counter,
        )
    }
}

/// Encodes the shared metrics at each scrape.
#[derive(Debug)]
struct Exposition(SharedMetrics);

impl Collector for Exposition {
    fn encode(&self, mut enc: DescriptorEncoder) -> Fmt {
        self.0.lock().expect("metrics").encode(&mut enc)
    }
}

/// The registry a scrape encodes.
pub fn registry(metrics: SharedMetrics) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Exposition(metrics)));
    registry
}

/// The text exposition (format 0.0.4) of `registry`.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, registry)
        .expect("writing to a String cannot fail");
    out
}

/// Serves `/metrics`; `refresh` brings what is read on demand (the
/// datapath's counters) up to date before each scrape is encoded.
pub fn server(
    runtime: &ServerRuntime,
    addr: &str,
    metrics: SharedMetrics,
    refresh: impl Fn(&SharedMetrics) + Send + Sync + 'static,
) -> std::io::Result<Server> {
    let registry = registry(metrics.clone());
    let handler: Handler = Arc::new(move |path: &str| {
        if path.split('?').next() != Some("/metrics") {
            return Response::json(404, "{}".into());
        }
        refresh(&metrics);
        Response {
            status: 200,
            content_type: prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            headers: Vec::new(),
            body: render(&registry),
        }
    });
    Server::bind(&runtime.handle(), addr, Limits::default(), handler)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_keeps_kube_proxys_names_types_and_help_texts() {
        let metrics = Arc::new(Mutex::new(Metrics::default()));
        {
            let mut m = metrics.lock().unwrap();
            m.sync_duration.observe(0.003);
            m.service_changes = 7;
            m.service_traffic.push(("ns/we\"b:80/TCP".into(), 3, 120));
            *m.skipped_objects.entry("syntax").or_default() += 1;
        }
        let text = render(&registry(metrics));
        for line in [
            "# HELP kubeproxy_sync_proxy_rules_duration_seconds SyncProxyRules latency in seconds",
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.002\"} 0",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"+Inf\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_count 1",
            "# HELP kubeproxy_sync_proxy_rules_service_changes_total Cumulative proxy rules Service changes",
            "# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter",
            "kubeproxy_sync_proxy_rules_service_changes_total 7",
            "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"} 0",
            "dataplane_service_packets_total{service=\"ns/we\\\"b:80/TCP\"} 3",
            "dataplane_skipped_objects_total{reason=\"syntax\"} 1",
            "dataplane_skipped_objects_total{reason=\"empty_file\"} 0",
            "# TYPE dataplane_failed_map_operations_total counter",
            "dataplane_map_drift_entries_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
    }
}
