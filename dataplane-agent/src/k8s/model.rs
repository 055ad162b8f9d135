//! Kubernetes objects → Service ports with resolved endpoints, following
//! kube-proxy (pkg/proxy: servicechangetracker, endpointslicecache,
//! topology). Everything here is pure.

use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use crate::{
    net::{Ipv4Cidr, Protocol},
    state::model::{Endpoint, ServicePort},
};

/// Label a Service or EndpointSlice carries when another proxy owns it.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label of headless Services' EndpointSlices.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label tying an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
pub const ANNOTATION_TOPOLOGY_MODE: &str = "service.kubernetes.io/topology-mode";
pub const ANNOTATION_TOPOLOGY_HINTS: &str = "service.kubernetes.io/topology-aware-hints";
/// Default ClientIP affinity timeout (3 hours), as the API server defaults it.
pub const DEFAULT_AFFINITY_TIMEOUT: Duration = Duration::from_secs(10_800);

/// What the node contributes to the model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    pub zone: Option<String>,
}

impl NodeInfo {
    pub fn from_node(node: &Node) -> Self {
        Self {
            name: node.metadata.name.clone().unwrap_or_default(),
            zone: node
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(LABEL_ZONE).cloned()),
        }
    }
}

/// A part of an object that was skipped, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// `namespace/name` of the object.
    pub object: String,
    pub reason: String,
}

/// Whether the watch (and the manifests source) takes an object with these
/// labels: kube-proxy's label selectors.
pub fn proxied(labels: Option<&BTreeMap<String, String>>) -> bool {
    labels.is_none_or(|l| !l.contains_key(LABEL_SERVICE_PROXY_NAME) && !l.contains_key(LABEL_HEADLESS))
}

fn object_name(ns: &Option<String>, name: &Option<String>) -> String {
    format!(
        "{}/{}",
        ns.as_deref().unwrap_or("default"),
        name.as_deref().unwrap_or("")
    )
}

fn protocol(p: Option<&str>) -> Result<Protocol, String> {
    match p.unwrap_or("TCP") {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        other => Err(format!("unknown protocol {other:?}")),
    }
}

fn port_number(n: i32, what: &str) -> Result<u16, String> {
    u16::try_from(n)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{what} {n} is out of range 1-65535"))
}

/// The IPv4 addresses among `ips` (IPv6 ones belong to the other family's
/// table; unparsable ones are reported).
fn ipv4s<'a>(
    ips: impl IntoIterator<Item = &'a String>,
    what: &str,
    skipped: &mut Vec<String>,
) -> Vec<Ipv4Addr> {
    let mut out = Vec::new();
    for ip in ips {
        match ip.parse::<std::net::IpAddr>() {
            Ok(std::net::IpAddr::V4(v4)) => out.push(v4),
            Ok(std::net::IpAddr::V6(_)) => {}
            Err(_) => skipped.push(format!("{what} {ip:?} is not an IP address")),
        }
    }
    out
}

/// The Service ports of `svc` for this node, with their endpoints from
/// `slices` (the Service's EndpointSlices). Problems with parts of the
/// object are returned alongside; the rest is still used.
pub fn service_ports(
    svc: &Service,
    slices: &[&EndpointSlice],
    node: &NodeInfo,
) -> (Vec<ServicePort>, Vec<Skipped>) {
    let object = object_name(&svc.metadata.namespace, &svc.metadata.name);
    let mut reasons = Vec::new();
    let ports = service_ports_inner(svc, slices, node, &mut reasons);
    let skipped = reasons
        .into_iter()
        .map(|reason| Skipped {
            object: object.clone(),
            reason,
        })
        .collect();
    (ports, skipped)
}

fn service_ports_inner(
    svc: &Service,
    slices: &[&EndpointSlice],
    node: &NodeInfo,
    skipped: &mut Vec<String>,
) -> Vec<ServicePort> {
    let Some(spec) = &svc.spec else {
        return Vec::new();
    };
    if !proxied(svc.metadata.labels.as_ref()) || spec.type_.as_deref() == Some("ExternalName") {
        return Vec::new();
    }
    // Headless (None) or not yet allocated: nothing to proxy.
    let cluster_ip = spec.cluster_ip.as_deref().unwrap_or("");
    if cluster_ip.is_empty() || cluster_ip == "None" {
        return Vec::new();
    }
    let cluster_ip_list: Vec<String> = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.clone(),
        _ => vec![cluster_ip.to_owned()],
    };
    let cluster_ips = ipv4s(&cluster_ip_list, "clusterIP", skipped);
    let external_ips = ipv4s(spec.external_ips.iter().flatten(), "externalIP", skipped);
    let lb_ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    // ipMode Proxy: the load balancer proxies, the node gets no rules.
    let lb_ips = ipv4s(
        lb_ingress
            .into_iter()
            .flatten()
            .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
            .filter_map(|i| i.ip.as_ref()),
        "load balancer ingress IP",
        skipped,
    );
    let mut source_ranges = Vec::new();
    for r in spec.load_balancer_source_ranges.iter().flatten() {
        let r = r.trim();
        if r.contains(':') {
            continue; // IPv6: the other family's table
        }
        match r.parse::<Ipv4Cidr>() {
            Ok(c) => source_ranges.push(c),
            Err(e) => skipped.push(format!("loadBalancerSourceRanges: {e}")),
        }
    }
    let affinity_timeout = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .map_or(DEFAULT_AFFINITY_TIMEOUT, Duration::from_secs)
    });
    let is_node_port_type = matches!(spec.type_.as_deref(), Some("NodePort") | Some("LoadBalancer"));
    let endpoints = collect_endpoints(svc, slices, node);

    let mut out = Vec::new();
    for port in spec.ports.iter().flatten() {
        let port_name = port.name.clone().unwrap_or_default();
        let proto = match protocol(port.protocol.as_deref()) {
            Ok(p) => p,
            Err(e) => {
                skipped.push(format!("port {port_name:?}: {e}"));
                continue;
            }
        };
        let number = match port_number(port.port, "port") {
            Ok(n) => n,
            Err(e) => {
                skipped.push(format!("port {port_name:?}: {e}"));
                continue;
            }
        };
        let node_port = match port.node_port.filter(|_| is_node_port_type) {
            Some(n) => match port_number(n, "nodePort") {
                Ok(n) => Some(n),
                Err(e) => {
                    skipped.push(format!("port {port_name:?}: {e}"));
                    None
                }
            },
            None => None,
        };
        let eps = endpoints
            .get(&(port_name.clone(), proto))
            .cloned()
            .unwrap_or_default();
        out.push(ServicePort {
            namespace: svc.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            name: svc.metadata.name.clone().unwrap_or_default(),
            port_name,
            proto,
            port: number,
            cluster_ips: cluster_ips.clone(),
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: lb_ips.clone(),
            load_balancer_source_ranges: source_ranges.clone(),
            external_policy_local: spec.external_traffic_policy.as_deref() == Some("Local"),
            internal_policy_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            affinity_timeout,
            endpoints: eps,
        });
    }
    out
}

/// One endpoint as the slices describe it, before set selection.
#[derive(Clone, Debug)]
struct SliceEndpoint {
    endpoint: Endpoint,
    zone_hints: Option<Vec<String>>,
    node_hints: Option<Vec<String>>,
}

/// Endpoints per (port name, protocol), deduplicated and topology-marked.
fn collect_endpoints(
    svc: &Service,
    slices: &[&EndpointSlice],
    node: &NodeInfo,
) -> BTreeMap<(String, Protocol), Vec<Endpoint>> {
    let mut by_port: BTreeMap<(String, Protocol), BTreeMap<(Ipv4Addr, u16), SliceEndpoint>> = BTreeMap::new();
    for slice in slices {
        if slice.address_type != "IPv4" || !proxied(slice.metadata.labels.as_ref()) {
            continue;
        }
        for sp in slice.ports.iter().flatten() {
            // A port without a number is ignored; no name matches the empty name.
            let Some(Ok(number)) = sp.port.map(|p| port_number(p, "port")) else {
                continue;
            };
            let Ok(proto) = protocol(sp.protocol.as_deref()) else {
                continue;
            };
            let entries = by_port
                .entry((sp.name.clone().unwrap_or_default(), proto))
                .or_default();
            for e in &slice.endpoints {
                // Only the first address of an endpoint is used.
                let Some(Ok(addr)) = e.addresses.first().map(|a| a.parse::<Ipv4Addr>()) else {
                    continue;
                };
                let c = e.conditions.as_ref();
                let ready = c.and_then(|c| c.ready).unwrap_or(true);
                let serving = c.and_then(|c| c.serving).unwrap_or(ready);
                let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
                let candidate = SliceEndpoint {
                    endpoint: Endpoint {
                        addr,
                        port: number,
                        ready,
                        serving,
                        terminating,
                        local: e.node_name.as_deref() == Some(node.name.as_str()) && !node.name.is_empty(),
                        in_topology: true,
                    },
                    zone_hints: e
                        .hints
                        .as_ref()
                        .and_then(|h| h.for_zones.as_ref())
                        .map(|z| z.iter().map(|z| z.name.clone()).collect()),
                    node_hints: e
                        .hints
                        .as_ref()
                        .and_then(|h| h.for_nodes.as_ref())
                        .map(|n| n.iter().map(|n| n.name.clone()).collect()),
                };
                // Duplicate IP:port across slices: the non-terminating copy wins.
                match entries.get(&(addr, number)) {
                    Some(existing) if !existing.endpoint.terminating || candidate.endpoint.terminating => {}
                    _ => {
                        entries.insert((addr, number), candidate);
                    }
                }
            }
        }
    }
    by_port
        .into_iter()
        .map(|(key, eps)| {
            let mut eps: Vec<SliceEndpoint> = eps.into_values().collect();
            apply_topology(svc, node, &mut eps);
            (key, eps.into_iter().map(|e| e.endpoint).collect())
        })
        .collect()
}

/// Topology-aware routing: hints are used only if the Service asks for them
/// (trafficDistribution, or the topology-mode annotation), EVERY ready
/// endpoint carries one, and at least one matches this node (PreferSameNode)
/// or its zone; otherwise nothing is filtered. Filtered-out endpoints stay
/// backends (established flows) but leave the cluster set.
fn apply_topology(svc: &Service, node: &NodeInfo, eps: &mut [SliceEndpoint]) {
    let spec = svc.spec.as_ref();
    let distribution = spec.and_then(|s| s.traffic_distribution.as_deref());
    let annotations = svc.metadata.annotations.as_ref();
    let annotated = annotations.is_some_and(|a| {
        a.get(ANNOTATION_TOPOLOGY_MODE)
            .or_else(|| a.get(ANNOTATION_TOPOLOGY_HINTS))
            .is_some_and(|v| !v.is_empty() && !v.eq_ignore_ascii_case("disabled"))
    });
    if !annotated
        && !matches!(
            distribution,
            Some("PreferClose") | Some("PreferSameZone") | Some("PreferSameNode")
        )
    {
        return;
    }
    let ready = || eps.iter().filter(|e| e.endpoint.ready);
    let by_node = distribution == Some("PreferSameNode")
        && ready().all(|e| e.node_hints.as_ref().is_some_and(|h| !h.is_empty()))
        && ready().any(|e| e.node_hints.as_ref().is_some_and(|h| h.contains(&node.name)));
    if by_node {
        for e in eps.iter_mut() {
            e.endpoint.in_topology = e.node_hints.as_ref().is_some_and(|h| h.contains(&node.name));
        }
        return;
    }
    let Some(zone) = node.zone.as_ref() else {
        return;
    };
    let by_zone = ready().all(|e| e.zone_hints.as_ref().is_some_and(|h| !h.is_empty()))
        && ready().any(|e| e.zone_hints.as_ref().is_some_and(|h| h.contains(zone)));
    if by_zone {
        for e in eps.iter_mut() {
            e.endpoint.in_topology = e.zone_hints.as_ref().is_some_and(|h| h.contains(zone));
        }
    }
}

#[cfg(test)]
mod tests {
    //! One test per kube-proxy rule about which objects and endpoints count.
    use super::*;
    use crate::k8s::manifests::{Objects, load_text};

    fn objects(yaml: &str) -> Objects {
        let mut o = Objects::default();
        load_text(yaml, "test", &mut o);
        assert!(o.problems.is_empty(), "{:?}", o.problems);
        o
    }

    fn node() -> NodeInfo {
        NodeInfo {
            name: "node-a".into(),
            zone: Some("zone-a".into()),
        }
    }

    fn ports(yaml: &str) -> (Vec<ServicePort>, Vec<Skipped>) {
        let o = objects(yaml);
        let slices: Vec<&EndpointSlice> = o.slices.iter().collect();
        service_ports(&o.services[0], &slices, &node())
    }

    const SVC: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP}]
"#;

    fn slice(endpoints: &str) -> String {
        format!(
            r#"
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints: {endpoints}
"#
        )
    }

    fn addrs(p: &ServicePort) -> Vec<String> {
        p.endpoints.iter().map(|e| e.addr.to_string()).collect()
    }

    #[test]
    fn headless_external_name_and_foreign_proxy_services_are_skipped() {
        for spec in [
            "clusterIP: None",
            "type: ExternalName\n  externalName: example.com",
            "clusterIP: \"\"",
        ] {
            let yaml =
                format!("kind: Service\nmetadata: {{name: x}}\nspec:\n  {spec}\n  ports: [{{port: 80}}]\n");
            assert!(ports(&yaml).0.is_empty(), "{spec}");
        }
        let labelled = SVC.replace(
            "metadata: {name: web, namespace: default}",
            "metadata: {name: web, namespace: default, labels: {service.kubernetes.io/service-proxy-name: other}}",
        );
        assert!(ports(&labelled).0.is_empty());
    }

    #[test]
    fn endpoint_conditions_default_ready_serving_true_terminating_false() {
        let (p, _) = ports(&(SVC.to_owned() + &slice("[{addresses: [10.0.0.1]}]")));
        let e = p[0].endpoints[0];
        assert!(e.ready && e.serving && !e.terminating);
        let (p, _) =
            ports(&(SVC.to_owned() + &slice("[{addresses: [10.0.0.1], conditions: {ready: false}}]")));
        let e = p[0].endpoints[0];
        assert!(!e.ready && !e.serving, "serving unset follows ready");
    }

    #[test]
    fn an_endpoint_is_local_when_its_node_name_is_this_node() {
        let (p, _) = ports(
            &(SVC.to_owned()
                + &slice(
                    "[{addresses: [10.0.0.1], nodeName: node-a}, {addresses: [10.0.0.2], nodeName: node-b}]",
                )),
        );
        let local: Vec<bool> = p[0].endpoints.iter().map(|e| e.local).collect();
        assert_eq!(local, [true, false]);
    }

    #[test]
    fn only_the_first_address_of_an_endpoint_is_used() {
        let (p, _) = ports(&(SVC.to_owned() + &slice("[{addresses: [10.0.0.1, 10.0.0.9]}]")));
        assert_eq!(addrs(&p[0]), ["10.0.0.1"]);
    }

    #[test]
    fn duplicate_endpoints_across_slices_keep_the_non_terminating_copy() {
        let second = slice("[{addresses: [10.0.0.1], conditions: {ready: true}}]").replace("web-1", "web-2");
        let yaml = SVC.to_owned()
            + &slice(
                "[{addresses: [10.0.0.1], conditions: {ready: false, serving: true, terminating: true}}]",
            )
            + &second;
        let (p, _) = ports(&yaml);
        assert_eq!(p[0].endpoints.len(), 1);
        assert!(!p[0].endpoints[0].terminating);
    }

    #[test]
    fn slice_ports_are_matched_by_name_and_carry_the_target_port() {
        // Two slices with different numbers for the named port (named target
        // ports resolve per pod).
        let other = slice("[{addresses: [10.0.0.2]}]")
            .replace("web-1", "web-2")
            .replace("port: 8080", "port: 9090");
        let (p, _) = ports(&(SVC.to_owned() + &slice("[{addresses: [10.0.0.1]}]") + &other));
        let got: Vec<(String, u16)> = p[0]
            .endpoints
            .iter()
            .map(|e| (e.addr.to_string(), e.port))
            .collect();
        assert_eq!(got, [("10.0.0.1".into(), 8080), ("10.0.0.2".into(), 9090)]);
        let unnamed = slice("[{addresses: [10.0.0.3]}]").replace("{name: http, port: 8080", "{port: 8080");
        let (p, _) = ports(&(SVC.to_owned() + &unnamed));
        assert!(
            p[0].endpoints.is_empty(),
            "an unnamed slice port matches only the unnamed service port"
        );
    }

    #[test]
    fn a_slice_port_without_a_number_is_ignored() {
        let s = slice("[{addresses: [10.0.0.1]}]").replace("port: 8080, ", "");
        let (p, _) = ports(&(SVC.to_owned() + &s));
        assert!(p[0].endpoints.is_empty());
    }

    #[test]
    fn load_balancer_ingress_with_ip_mode_proxy_gets_no_rules() {
        let yaml = SVC.replace(
            "clusterIP: 10.96.0.10",
            "type: LoadBalancer\n  clusterIP: 10.96.0.10",
        ) + "status: {loadBalancer: {ingress: [{ip: 203.0.113.1}, {ip: 203.0.113.2, ipMode: Proxy}, {ip: 203.0.113.3, ipMode: VIP}]}}\n";
        let (p, _) = ports(&yaml);
        let lbs: Vec<String> = p[0].load_balancer_ips.iter().map(|i| i.to_string()).collect();
        assert_eq!(lbs, ["203.0.113.1", "203.0.113.3"]);
    }

    #[test]
    fn addresses_are_split_by_family_and_bad_ones_reported() {
        let yaml = SVC.replace(
            "clusterIP: 10.96.0.10",
            "clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, fd00::10]\n  externalIPs: [203.0.113.9, 2001:db8::1, nonsense]",
        );
        let (p, skipped) = ports(&yaml);
        assert_eq!(p[0].cluster_ips.len(), 1);
        assert_eq!(p[0].external_ips.len(), 1);
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(skipped[0].reason.contains("nonsense"));
    }

    #[test]
    fn node_ports_count_only_for_node_port_and_load_balancer_services() {
        let with_np = SVC.replace("protocol: TCP}", "protocol: TCP, nodePort: 30080}");
        assert_eq!(ports(&with_np).0[0].node_port, None, "ClusterIP type");
        let np = with_np.replace("clusterIP: 10.96.0.10", "type: NodePort\n  clusterIP: 10.96.0.10");
        assert_eq!(ports(&np).0[0].node_port, Some(30080));
    }

    #[test]
    fn client_ip_affinity_defaults_to_three_hours() {
        let yaml = SVC.replace(
            "clusterIP: 10.96.0.10",
            "clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP",
        );
        assert_eq!(
            ports(&yaml).0[0].affinity_timeout,
            Some(Duration::from_secs(10800))
        );
        let yaml = SVC.replace(
            "clusterIP: 10.96.0.10",
            "clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}",
        );
        assert_eq!(ports(&yaml).0[0].affinity_timeout, Some(Duration::from_secs(60)));
    }

    #[test]
    fn bad_ports_are_skipped_with_a_reason_and_the_rest_kept() {
        let yaml = SVC.replace(
            "ports: [{name: http, port: 80, protocol: TCP}]",
            "ports: [{name: http, port: 80, protocol: TCP}, {name: bad, port: 70000}, {name: odd, port: 81, protocol: QUIC}]",
        );
        let (p, skipped) = ports(&yaml);
        assert_eq!(p.len(), 1);
        assert_eq!(skipped.len(), 2, "{skipped:?}");
    }

    fn in_topology(p: &ServicePort) -> Vec<bool> {
        p.endpoints.iter().map(|e| e.in_topology).collect()
    }

    #[test]
    fn topology_hints_apply_only_when_every_ready_endpoint_has_one_and_one_matches() {
        let svc = SVC.replace(
            "clusterIP: 10.96.0.10",
            "clusterIP: 10.96.0.10\n  trafficDistribution: PreferClose",
        );
        let hinted = "[{addresses: [10.0.0.1], hints: {forZones: [{name: zone-a}]}}, {addresses: [10.0.0.2], hints: {forZones: [{name: zone-b}]}}]";
        assert_eq!(
            in_topology(&ports(&(svc.clone() + &slice(hinted))).0[0]),
            [true, false]
        );
        // One ready endpoint without a hint: no filtering at all.
        let partial =
            "[{addresses: [10.0.0.1], hints: {forZones: [{name: zone-a}]}}, {addresses: [10.0.0.2]}]";
        assert_eq!(
            in_topology(&ports(&(svc.clone() + &slice(partial))).0[0]),
            [true, true]
        );
        // No hint for this zone: no filtering.
        let elsewhere = "[{addresses: [10.0.0.1], hints: {forZones: [{name: zone-c}]}}]";
        assert_eq!(
            in_topology(&ports(&(svc.clone() + &slice(elsewhere))).0[0]),
            [true]
        );
        // Without trafficDistribution or the annotation, hints are ignored.
        assert_eq!(
            in_topology(&ports(&(SVC.to_owned() + &slice(hinted))).0[0]),
            [true, true]
        );
    }

    #[test]
    fn prefer_same_node_uses_node_hints() {
        let svc = SVC.replace(
            "clusterIP: 10.96.0.10",
            "clusterIP: 10.96.0.10\n  trafficDistribution: PreferSameNode",
        );
        let hinted = "[{addresses: [10.0.0.1], hints: {forNodes: [{name: node-a}], forZones: [{name: zone-a}]}}, {addresses: [10.0.0.2], hints: {forNodes: [{name: node-b}], forZones: [{name: zone-a}]}}]";
        assert_eq!(in_topology(&ports(&(svc + &slice(hinted))).0[0]), [true, false]);
    }
}
