//! kube-proxy's health endpoints: `/healthz` and `/livez` on the proxy's
//! health port (10256), and one server per eTP=Local LoadBalancer Service on
//! its healthCheckNodePort.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use super::http::{Handler, Limits, Response, Server, ServerRuntime};
use crate::{k8s::store::HealthCheck, os::pod_discovery::UnreachableEndpoint};

/// What the health answers are computed from.
#[derive(Debug, Default)]
pub struct HealthState {
    pub last_sync: Option<SystemTime>,
    pub node_eligible: bool,
    /// (namespace, name) → local ready endpoints.
    pub local_endpoints: BTreeMap<(String, String), usize>,
    /// (namespace, name) → healthCheckNodePort being served.
    pub ports: BTreeMap<(String, String), u16>,
    /// Local endpoints no attached pod interface leads to: a detail field
    /// of `/healthz` (the status code keeps kube-proxy's meaning).
    pub unreachable_local_endpoints: Vec<UnreachableEndpoint>,
    /// The devices the datapath is attached to and why, for
    /// `dataplane-agent inspect interfaces` (`/debug/interfaces`).
    pub interfaces: serde_json::Value,
    /// The BGP speaker's state, when BGP is on: a `bgp` detail field of
    /// `/healthz` (the status code keeps kube-proxy's meaning).
    pub bgp: Option<crate::lb::bgp::SharedStatus>,
}

pub type SharedHealth = Arc<Mutex<HealthState>>;

/// RFC 3339 UTC with nanoseconds (`2023-11-14T22:13:20.000000005Z`), the
/// fixed-width form of Go's `time.RFC3339Nano`.
pub fn rfc3339(t: SystemTime) -> String {
    let ts = jiff::Timestamp::try_from(t).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
    jiff::fmt::temporal::DateTimePrinter::new()
        .precision(Some(9))
        .timestamp_to_string(&ts)
}

/// Healthy: synced within `2 × sync_period` (and, for `/healthz`, the node
/// is eligible: not being deleted, not tainted for scale-down). The
/// `/healthz` body is kube-proxy's, plus `unreachableLocalEndpoints` when
/// some local endpoint is not behind an attached pod interface.
pub fn proxy_health(state: &HealthState, sync_period: Duration, check_node: bool) -> (bool, String) {
    let now = SystemTime::now();
    let fresh = state
        .last_sync
        .is_some_and(|t| now.duration_since(t).unwrap_or_default() <= 2 * sync_period);
    let healthy = fresh && (!check_node || state.node_eligible);
    let last = state.last_sync.map(rfc3339).unwrap_or_default();
    let body = if check_node {
        let mut detail = if state.unreachable_local_endpoints.is_empty() {
            String::new()
        } else {
            format!(
                ",\"unreachableLocalEndpoints\":{}",
                serde_json::to_string(&state.unreachable_local_endpoints).unwrap_or_default()
            )
        };
        if let Some(bgp) = &state.bgp {
            let bgp = serde_json::to_string(&*bgp.lock().expect("bgp status")).unwrap_or_default();
            detail.push_str(&format!(",\"bgp\":{bgp}"));
        }
        format!(
            "{{\"lastUpdated\":\"{last}\",\"currentTime\":\"{}\",\"nodeEligible\":{}{detail}}}",
            rfc3339(now),
            state.node_eligible
        )
    } else {
        format!(
            "{{\"lastUpdated\":\"{last}\",\"currentTime\":\"{}\"}}",
            rfc3339(now)
        )
    };
    (healthy, body)
}

/// The proxy health server: `/healthz`, `/livez`.
pub fn proxy_server(
    runtime: &ServerRuntime,
    addr: std::net::SocketAddr,
    state: SharedHealth,
    sync_period: Duration,
) -> std::io::Result<Server> {
    let handler: Handler = Arc::new(move |path: &str| {
        let state = state.lock().expect("health state");
        match path.split('?').next().unwrap_or("") {
            "/healthz" | "/livez" => {
                let (ok, body) = proxy_health(&state, sync_period, path.starts_with("/healthz"));
                Response::json(if ok { 200 } else { 503 }, body)
            }
            // For `dataplane-agent inspect health`: every healthCheckNodePort
            // server and what it answers now.
            "/debug/healthchecks" => {
                let list: Vec<String> = state
                    .ports
                    .iter()
                    .map(|((ns, name), port)| {
                        let r = service_health(&state, sync_period, ns, name);
                        let n = state.local_endpoints.get(&(ns.clone(), name.clone())).copied().unwrap_or(0);
                        format!(
                            "{{\"namespace\":\"{ns}\",\"name\":\"{name}\",\"port\":{port},\"localEndpoints\":{n},\"status\":{}}}",
                            r.status
                        )
                    })
                    .collect();
                Response::json(200, format!("[{}]", list.join(",")))
            }
            // For `dataplane-agent inspect interfaces`: why each device is
            // attached, and which local endpoints no pod interface reaches.
            "/debug/interfaces" => {
                let mut v = state.interfaces.clone();
                if let Some(o) = v.as_object_mut() {
                    o.insert(
                        "unreachableLocalEndpoints".into(),
                        serde_json::to_value(&state.unreachable_local_endpoints).unwrap_or_default(),
                    );
                }
                Response::json(200, v.to_string())
            }
            _ => Response::json(404, "{}".into()),
        }
    });
    Server::bind(&runtime.handle(), addr, Limits::default(), handler)
}

/// The answer of a healthCheckNodePort server (any path).
pub fn service_health(state: &HealthState, sync_period: Duration, ns: &str, name: &str) -> Response {
    let n = state
        .local_endpoints
        .get(&(ns.to_owned(), name.to_owned()))
        .copied()
        .unwrap_or(0);
    let (healthy, _) = proxy_health(state, sync_period, true);
    let body = format!(
        "{{\"service\":{{\"namespace\":\"{ns}\",\"name\":\"{name}\"}},\"localEndpoints\":{n},\"serviceProxyHealthy\":{healthy}}}"
    );
    Response::json(if n > 0 && healthy { 200 } else { 503 }, body)
}

/// The healthCheckNodePort servers, opened, moved and closed as Services
/// change.
pub struct ServiceHealthServers {
    runtime: tokio::runtime::Handle,
    servers: BTreeMap<(String, String), (u16, Server)>,
    bind_ip: std::net::IpAddr,
    state: SharedHealth,
    sync_period: Duration,
}

impl ServiceHealthServers {
    pub fn new(
        runtime: &ServerRuntime,
        bind_ip: std::net::IpAddr,
        state: SharedHealth,
        sync_period: Duration,
    ) -> Self {
        Self {
            runtime: runtime.handle(),
            servers: BTreeMap::new(),
            bind_ip,
            state,
            sync_period,
        }
    }

    /// Makes the running servers match `checks`; returns the ones that could
    /// not be bound (Service, port, error).
    pub fn update(&mut self, checks: &[HealthCheck]) -> Vec<(String, u16, std::io::Error)> {
        let failed = self.open(checks);
        let mut state = self.state.lock().expect("health state");
        state.ports = self.servers.iter().map(|(k, (p, _))| (k.clone(), *p)).collect();
        failed
    }

    fn open(&mut self, checks: &[HealthCheck]) -> Vec<(String, u16, std::io::Error)> {
        {
            let mut state = self.state.lock().expect("health state");
            state.local_endpoints = checks
                .iter()
                .map(|c| ((c.namespace.clone(), c.name.clone()), c.local_endpoints))
                .collect();
        }
        let wanted: BTreeMap<(String, String), u16> = checks
            .iter()
            .map(|c| ((c.namespace.clone(), c.name.clone()), c.port))
            .collect();
        // Close servers whose Service is gone or whose port moved.
        self.servers.retain(|k, (port, _)| wanted.get(k) == Some(port));
        let mut failed = Vec::new();
        for ((ns, name), port) in wanted {
            if self.servers.contains_key(&(ns.clone(), name.clone())) {
                continue;
            }
            let (state, period, n2, name2) = (self.state.clone(), self.sync_period, ns.clone(), name.clone());
            let handler: Handler = Arc::new(move |_path: &str| {
                service_health(&state.lock().expect("health state"), period, &n2, &name2)
            });
            let addr = std::net::SocketAddr::new(self.bind_ip, port);
            match Server::bind(&self.runtime, addr, Limits::default(), handler) {
                Ok(server) => {
                    self.servers.insert((ns, name), (port, server));
                }
                Err(e) => failed.push((format!("{ns}/{name}"), port, e)),
            }
        }
        failed
    }

    pub fn ports(&self) -> Vec<u16> {
        self.servers.values().map(|(p, _)| *p).collect()
    }
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.frac]Z` (UTC, as the API server writes).
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    s.parse::<jiff::Timestamp>().ok().map(SystemTime::from)
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_round_trips_through_the_formatter() {
        use std::time::{Duration, UNIX_EPOCH};
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123_000_000);
        assert_eq!(parse_rfc3339(&rfc3339(t)), Some(t));
        assert_eq!(
            parse_rfc3339("2023-11-14T22:13:20Z"),
            Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        assert_eq!(parse_rfc3339("not a time"), None);
    }

    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn rfc3339_formats_utc_like_go() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 5);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.000000005Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
    }

    #[test]
    fn healthz_needs_a_recent_sync_and_an_eligible_node_livez_only_the_sync() {
        let mut s = HealthState {
            node_eligible: true,
            ..Default::default()
        };
        let period = Duration::from_secs(30);
        assert!(!proxy_health(&s, period, true).0, "never synced");
        s.last_sync = Some(SystemTime::now());
        assert!(proxy_health(&s, period, true).0);
        s.node_eligible = false;
        assert!(!proxy_health(&s, period, true).0);
        assert!(
            proxy_health(&s, period, false).0,
            "livez ignores node eligibility"
        );
        s.last_sync = Some(SystemTime::now() - Duration::from_secs(61));
        assert!(!proxy_health(&s, period, false).0, "older than 2 x sync period");
    }

    #[test]
    fn healthz_names_unreachable_local_endpoints_without_changing_its_status() {
        let mut s = HealthState {
            node_eligible: true,
            last_sync: Some(SystemTime::now()),
            ..Default::default()
        };
        let period = Duration::from_secs(30);
        let (ok, body) = proxy_health(&s, period, true);
        assert!(ok && !body.contains("unreachable"), "{body}");
        s.unreachable_local_endpoints.push(UnreachableEndpoint {
            address: "10.244.1.99".parse().unwrap(),
            service: "default/web:p".into(),
            route: "no route".into(),
        });
        let (ok, body) = proxy_health(&s, period, true);
        assert!(ok, "kube-proxy's status code semantics");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["nodeEligible"], true);
        assert_eq!(v["unreachableLocalEndpoints"][0]["address"], "10.244.1.99");
        assert_eq!(v["unreachableLocalEndpoints"][0]["service"], "default/web:p");
    }

    #[test]
    fn service_health_is_200_with_local_endpoints_and_503_without() {
        let mut s = HealthState {
            node_eligible: true,
            last_sync: Some(SystemTime::now()),
            ..Default::default()
        };
        s.local_endpoints.insert(("ns".into(), "web".into()), 2);
        let r = service_health(&s, Duration::from_secs(30), "ns", "web");
        assert_eq!(r.status, 200);
        assert_eq!(
            r.body,
            r#"{"service":{"namespace":"ns","name":"web"},"localEndpoints":2,"serviceProxyHealthy":true}"#
        );
        assert!(
            r.headers
                .iter()
                .any(|(k, v)| *k == "X-Content-Type-Options" && v == "nosniff")
        );
        assert_eq!(
            service_health(&s, Duration::from_secs(30), "ns", "other").status,
            503
        );
    }
}
