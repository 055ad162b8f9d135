//! Prometheus metrics, text exposition format. kube-proxy's names where the
//! meaning is the same; `dataplane_*` for what only this datapath has.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{Arc, Mutex},
};

use super::http::{Handler, Response, Server};

/// A histogram with kube-proxy's sync buckets (1 ms · 2^i).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn exponential(start: f64, factor: f64, n: usize) -> Self {
        let bounds: Vec<f64> = (0..n).map(|i| start * factor.powi(i as i32)).collect();
        Self {
            counts: vec![0; bounds.len()],
            bounds,
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

/// Everything exported. The run loop updates it; scrapes render it.
#[derive(Clone, Debug)]
pub struct Metrics {
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
    pub health_bind_failures: u64,
    /// map → (entries, capacity).
    pub map_occupancy: BTreeMap<&'static str, (u64, u64)>,
    /// (hook, event) → (packets, bytes).
    pub datapath_events: Vec<(String, String, u64, u64)>,
    /// service → (packets, bytes).
    pub service_traffic: Vec<(String, u64, u64)>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            sync_duration: Histogram::exponential(0.001, 2.0, 15),
            network_programming: Histogram::exponential(0.001, 2.0, 20),
            last_sync_timestamp: 0.0,
            service_changes: 0,
            endpoint_changes: 0,
            no_local_endpoints: BTreeMap::new(),
            sync_problems: 0,
            failed_operations: 0,
            health_bind_failures: 0,
            map_occupancy: BTreeMap::new(),
            datapath_events: Vec::new(),
            service_traffic: Vec::new(),
        }
    }
}

pub type SharedMetrics = Arc<Mutex<Metrics>>;

fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    pub fn render(&self) -> String {
        let mut o = String::new();
        self.sync_duration.render(
            &mut o,
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
        );
        self.network_programming.render(
            &mut o,
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
        );
        let gauge = |o: &mut String, name: &str, help: &str, kind: &str, v: String| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        gauge(
            &mut o,
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            "gauge",
            format!("{}", self.last_sync_timestamp),
        );
        gauge(
            &mut o,
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "Cumulative proxy rules Service changes",
            "counter",
            self.service_changes.to_string(),
        );
        gauge(
            &mut o,
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "Cumulative proxy rules Endpoint changes",
            "counter",
            self.endpoint_changes.to_string(),
        );
        let _ = writeln!(
            o,
            "# HELP kubeproxy_sync_proxy_rules_no_local_endpoints_total Number of services with a Local traffic policy and no endpoints\n# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge"
        );
        for policy in ["internal", "external"] {
            let v = self.no_local_endpoints.get(policy).copied().unwrap_or(0);
            let _ = writeln!(
                o,
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total{{traffic_policy=\"{policy}\"}} {v}"
            );
        }
        gauge(
            &mut o,
            "dataplane_sync_problems",
            "Objects or parts of objects skipped in the last sync (see the agent's log)",
            "gauge",
            self.sync_problems.to_string(),
        );
        gauge(
            &mut o,
            "dataplane_failed_map_operations_total",
            "Map writes that failed (full map, bad input); retried at the next sync",
            "counter",
            self.failed_operations.to_string(),
        );
        gauge(
            &mut o,
            "dataplane_health_check_bind_failures_total",
            "healthCheckNodePort servers that could not be bound",
            "counter",
            self.health_bind_failures.to_string(),
        );
        let _ = writeln!(
            o,
            "# HELP dataplane_map_entries Entries in a datapath map\n# TYPE dataplane_map_entries gauge"
        );
        for (map, (n, _)) in &self.map_occupancy {
            let _ = writeln!(o, "dataplane_map_entries{{map=\"{map}\"}} {n}");
        }
        let _ = writeln!(
            o,
            "# HELP dataplane_map_capacity Capacity of a datapath map\n# TYPE dataplane_map_capacity gauge"
        );
        for (map, (_, cap)) in &self.map_occupancy {
            let _ = writeln!(o, "dataplane_map_capacity{{map=\"{map}\"}} {cap}");
        }
        let _ = writeln!(
            o,
            "# HELP dataplane_packets_total Packets by program and outcome (drops and rejects by reason)\n# TYPE dataplane_packets_total counter"
        );
        for (hook, event, p, _) in &self.datapath_events {
            let _ = writeln!(
                o,
                "dataplane_packets_total{{hook=\"{hook}\",event=\"{event}\"}} {p}"
            );
        }
        let _ = writeln!(
            o,
            "# HELP dataplane_bytes_total Bytes by program and outcome\n# TYPE dataplane_bytes_total counter"
        );
        for (hook, event, _, b) in &self.datapath_events {
            let _ = writeln!(
                o,
                "dataplane_bytes_total{{hook=\"{hook}\",event=\"{event}\"}} {b}"
            );
        }
        let _ = writeln!(
            o,
            "# HELP dataplane_service_packets_total Packets translated to a Service port\n# TYPE dataplane_service_packets_total counter"
        );
        for (svc, p, _) in &self.service_traffic {
            let _ = writeln!(
                o,
                "dataplane_service_packets_total{{service=\"{}\"}} {p}",
                label(svc)
            );
        }
        let _ = writeln!(
            o,
            "# HELP dataplane_service_bytes_total Bytes translated to a Service port\n# TYPE dataplane_service_bytes_total counter"
        );
        for (svc, _, b) in &self.service_traffic {
            let _ = writeln!(
                o,
                "dataplane_service_bytes_total{{service=\"{}\"}} {b}",
                label(svc)
            );
        }
        o
    }
}

pub fn server(addr: &str, metrics: SharedMetrics) -> std::io::Result<Server> {
    let handler: Handler = Arc::new(move |path: &str| {
        if path.split('?').next() != Some("/metrics") {
            return Response::json(404, "{}".into());
        }
        Response {
            status: 200,
            content_type: "text/plain; version=0.0.4",
            headers: Vec::new(),
            body: metrics.lock().expect("metrics").render(),
        }
    });
    Server::bind(addr, handler)
}
