//! Kubernetes objects → Service ports with resolved endpoints, following
//! kube-proxy (pkg/proxy: servicechangetracker, endpointslicecache,
//! topology). Everything here is pure.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use crate::{
    net::{IpCidr, IpFamily, Protocol},
    state::{
        inputs::{Endpoint, LbChoice, ServicePort},
        table::intern,
    },
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
/// When the EndpointSlice controller saw the change behind a slice update
/// (kube-proxy's network programming latency starts there).
pub const ANNOTATION_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// A Service's own load-balancing mode (`snat`, `dsr`, `hybrid`): overrides
/// `--lb-mode` for it.
pub const ANNOTATION_LB_MODE: &str = "dataplane.example.com/lb-mode";
/// A Service's own backend choice (`random`, `maglev`): overrides
/// `--lb-algorithm` for it.
pub const ANNOTATION_LB_ALGORITHM: &str = "dataplane.example.com/lb-algorithm";
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

/// The addresses among `ips`, of both families (each Service port of a
/// family takes its own); unparsable ones are reported.
fn ips<'a>(ips: impl IntoIterator<Item = &'a String>, what: &str, skipped: &mut Vec<String>) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for ip in ips {
        match ip.parse::<IpAddr>() {
            Ok(a) => out.push(a),
            Err(_) => skipped.push(format!("{what} {ip:?} is not an IP address")),
        }
    }
    out
}

/// The addresses of `family` among `ips`.
fn of_family(ips: &[IpAddr], family: IpFamily) -> Vec<IpAddr> {
    ips.iter()
        .copied()
        .filter(|ip| IpFamily::of(ip) == family)
        .collect()
}

/// `namespace/name` of an object. Shared strings: the store keeps every key
/// in two or three places, and namespaces are interned.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ObjectKey {
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: intern(namespace),
            name: Arc::from(name),
        }
    }

    /// The key of an object's metadata (namespace `default` when unset).
    pub fn of(meta: &ObjectMeta) -> Self {
        Self::new(
            meta.namespace.as_deref().unwrap_or("default"),
            meta.name.as_deref().unwrap_or_default(),
        )
    }

    /// The object named `name` in the same namespace.
    pub fn sibling(&self, name: &str) -> Self {
        Self {
            namespace: self.namespace.clone(),
            name: Arc::from(name),
        }
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A Service as the agent keeps it: only what the table needs, parsed once
/// when the object arrives (a full object costs kilobytes; at 100k Services
/// that matters).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceInfo {
    pub key: ObjectKey,
    pub uid: Option<String>,
    /// `metadata.creationTimestamp` (seconds): of two Services claiming one
    /// frontend, the one created first keeps it.
    pub created: Option<i64>,
    /// `None`: nothing to proxy (ExternalName, headless, no clusterIP yet,
    /// owned by another proxy).
    pub spec: Option<ServiceSpecInfo>,
    /// Parts that could not be used, and why.
    pub problems: Vec<String>,
}

/// Addresses and ranges of both families: the Service ports of a family
/// take that family's (see [`ports_of`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceSpecInfo {
    /// `spec.clusterIPs` (or `clusterIP`): one per family the Service has
    /// (`ipFamilies`, as the API server allocated them).
    pub cluster_ips: OneOrMore<IpAddr>,
    pub external_ips: Vec<IpAddr>,
    /// LoadBalancer ingress IPs with ipMode VIP or unset.
    pub load_balancer_ips: Vec<IpAddr>,
    pub load_balancer_source_ranges: Vec<IpCidr>,
    pub external_policy_local: bool,
    pub internal_policy_local: bool,
    pub affinity_timeout: Option<Duration>,
    pub topology: Topology,
    /// The healthCheckNodePort of an eTP=Local Service.
    pub health_check_node_port: Option<u16>,
    pub ports: OneOrMore<PortSpec>,
    /// Its load-balancing annotations.
    pub lb: LbChoice,
}

/// A list that is almost always one element long (a Service's ClusterIPs
/// and ports, a slice's ports): that one is kept inline, without an
/// allocation (a hundred thousand of each are kept). Reads as a slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OneOrMore<T> {
    One(T),
    More(Box<[T]>),
}

impl<T> Default for OneOrMore<T> {
    fn default() -> Self {
        OneOrMore::More(Box::default())
    }
}

impl<T> std::ops::Deref for OneOrMore<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            OneOrMore::One(t) => std::slice::from_ref(t),
            OneOrMore::More(l) => l,
        }
    }
}

impl<'a, T> IntoIterator for &'a OneOrMore<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T> From<Vec<T>> for OneOrMore<T> {
    fn from(mut v: Vec<T>) -> Self {
        match v.len() {
            1 => OneOrMore::One(v.pop().expect("one")),
            _ => OneOrMore::More(v.into_boxed_slice()),
        }
    }
}

impl<T> FromIterator<T> for OneOrMore<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        iter.into_iter().collect::<Vec<T>>().into()
    }
}

/// One valid port of a Service spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSpec {
    /// Interned.
    pub name: Arc<str>,
    pub proto: Protocol,
    pub port: u16,
    /// Only for NodePort and LoadBalancer Services.
    pub node_port: Option<u16>,
}

/// Whether and how topology hints are used (kube-proxy's topology filter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// Hints are ignored.
    Off,
    /// Zone hints (trafficDistribution PreferClose / PreferSameZone, or the
    /// topology-mode annotation).
    Zone,
    /// PreferSameNode: node hints, else zone hints.
    Node,
}

impl ServiceInfo {
    pub fn parse(svc: &Service) -> Self {
        let mut problems = Vec::new();
        let spec = parse_spec(svc, &mut problems);
        Self {
            key: ObjectKey::of(&svc.metadata),
            uid: svc.metadata.uid.clone(),
            created: svc.metadata.creation_timestamp.as_ref().map(|t| t.0.as_second()),
            spec,
            problems,
        }
    }
}

fn parse_spec(svc: &Service, skipped: &mut Vec<String>) -> Option<ServiceSpecInfo> {
    let spec = svc.spec.as_ref()?;
    if !proxied(svc.metadata.labels.as_ref()) || spec.type_.as_deref() == Some("ExternalName") {
        return None;
    }
    // Headless (None) or not yet allocated: nothing to proxy.
    let cluster_ip = spec.cluster_ip.as_deref().unwrap_or("");
    if cluster_ip.is_empty() || cluster_ip == "None" {
        return None;
    }
    let cluster_ip_list: Vec<String> = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.clone(),
        _ => vec![cluster_ip.to_owned()],
    };
    let cluster_ips = ips(&cluster_ip_list, "clusterIP", skipped);
    let external_ips = ips(spec.external_ips.iter().flatten(), "externalIP", skipped);
    let lb_ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    // ipMode Proxy: the load balancer proxies, the node gets no rules.
    let load_balancer_ips = ips(
        lb_ingress
            .into_iter()
            .flatten()
            .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
            .filter_map(|i| i.ip.as_ref()),
        "load balancer ingress IP",
        skipped,
    );
    let mut load_balancer_source_ranges = Vec::new();
    for r in spec.load_balancer_source_ranges.iter().flatten() {
        match r.trim().parse::<IpCidr>() {
            Ok(c) => load_balancer_source_ranges.push(c),
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
    let external_policy_local = spec.external_traffic_policy.as_deref() == Some("Local");
    let is_node_port_type = matches!(spec.type_.as_deref(), Some("NodePort") | Some("LoadBalancer"));
    let mut ports = Vec::new();
    for port in spec.ports.iter().flatten() {
        let name = port.name.clone().unwrap_or_default();
        let proto = match protocol(port.protocol.as_deref()) {
            Ok(p) => p,
            Err(e) => {
                skipped.push(format!("port {name:?}: {e}"));
                continue;
            }
        };
        let number = match port_number(port.port, "port") {
            Ok(n) => n,
            Err(e) => {
                skipped.push(format!("port {name:?}: {e}"));
                continue;
            }
        };
        let node_port = match port.node_port.filter(|_| is_node_port_type) {
            Some(n) => match port_number(n, "nodePort") {
                Ok(n) => Some(n),
                Err(e) => {
                    skipped.push(format!("port {name:?}: {e}"));
                    None
                }
            },
            None => None,
        };
        ports.push(PortSpec {
            name: intern(&name),
            proto,
            port: number,
            node_port,
        });
    }
    Some(ServiceSpecInfo {
        cluster_ips: cluster_ips.into(),
        external_ips,
        load_balancer_ips,
        load_balancer_source_ranges,
        external_policy_local,
        internal_policy_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
        affinity_timeout,
        topology: topology(svc),
        health_check_node_port: spec
            .health_check_node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0 && external_policy_local),
        ports: ports.into(),
        lb: lb_choice(svc, skipped),
    })
}

/// The Service's load-balancing annotations; a value that does not parse
/// is reported and the node's default used.
fn lb_choice(svc: &Service, skipped: &mut Vec<String>) -> LbChoice {
    fn parse<T: std::str::FromStr<Err = String>>(
        svc: &Service,
        key: &str,
        skipped: &mut Vec<String>,
    ) -> Option<T> {
        let value = svc.metadata.annotations.as_ref()?.get(key)?;
        value
            .trim()
            .parse()
            .map_err(|e| skipped.push(format!("annotation {key}: {e}; the node's default is used")))
            .ok()
    }
    LbChoice {
        mode: parse(svc, ANNOTATION_LB_MODE, skipped),
        algorithm: parse(svc, ANNOTATION_LB_ALGORITHM, skipped),
    }
}

/// Whether the Service asks for topology-aware routing: trafficDistribution,
/// or the topology-mode annotation.
fn topology(svc: &Service) -> Topology {
    let distribution = svc.spec.as_ref().and_then(|s| s.traffic_distribution.as_deref());
    let annotated = svc.metadata.annotations.as_ref().is_some_and(|a| {
        a.get(ANNOTATION_TOPOLOGY_MODE)
            .or_else(|| a.get(ANNOTATION_TOPOLOGY_HINTS))
            .is_some_and(|v| !v.is_empty() && !v.eq_ignore_ascii_case("disabled"))
    });
    match distribution {
        Some("PreferSameNode") => Topology::Node,
        Some("PreferClose") | Some("PreferSameZone") => Topology::Zone,
        _ if annotated => Topology::Zone,
        _ => Topology::Off,
    }
}

/// An EndpointSlice as the agent keeps it, parsed once when it arrives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceInfo {
    pub key: ObjectKey,
    /// `kubernetes.io/service-name`: the Service (same namespace) it feeds.
    pub service: Option<Arc<str>>,
    /// addressType IPv4 or IPv6 (`None`: FQDN, which kube-proxy ignores).
    pub family: Option<IpFamily>,
    /// Valid ports (named or not); a port without a number is ignored.
    pub ports: OneOrMore<SlicePort>,
    pub endpoints: SliceEndpoints,
    /// `endpoints.kubernetes.io/last-change-trigger-time`.
    pub trigger_time: Option<String>,
    /// Parts that could not be used, and why.
    pub problems: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    /// Interned.
    pub name: Arc<str>,
    pub proto: Protocol,
    pub port: u16,
}

/// One endpoint: its first address (the only one used) and conditions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceEndpoint {
    pub addr: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node: Option<NodeId>,
    pub hints: Option<HintsId>,
}

/// A slice's endpoints, as the store keeps them (a million at 100k
/// Services): an IPv4 one in 16 bytes instead of 28.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SliceEndpoints {
    V4(Box<[PackedEndpoint]>),
    Any(Box<[SliceEndpoint]>),
}

/// An IPv4 [`SliceEndpoint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedEndpoint {
    addr: u32,
    /// Ready, serving, terminating.
    flags: u8,
    node: Option<NodeId>,
    hints: Option<HintsId>,
}

impl PackedEndpoint {
    fn of(e: &SliceEndpoint) -> Option<Self> {
        let IpAddr::V4(a) = e.addr else { return None };
        Some(Self {
            addr: a.into(),
            flags: e.ready as u8 | (e.serving as u8) << 1 | (e.terminating as u8) << 2,
            node: e.node,
            hints: e.hints,
        })
    }

    fn unpack(&self) -> SliceEndpoint {
        SliceEndpoint {
            addr: IpAddr::V4(self.addr.into()),
            ready: self.flags & 1 != 0,
            serving: self.flags & 2 != 0,
            terminating: self.flags & 4 != 0,
            node: self.node,
            hints: self.hints,
        }
    }
}

impl Default for SliceEndpoints {
    fn default() -> Self {
        SliceEndpoints::V4(Box::default())
    }
}

impl SliceEndpoints {
    pub fn len(&self) -> usize {
        match self {
            SliceEndpoints::V4(l) => l.len(),
            SliceEndpoints::Any(l) => l.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = SliceEndpoint> + '_ {
        let (v4, any) = match self {
            SliceEndpoints::V4(l) => (&l[..], &[][..]),
            SliceEndpoints::Any(l) => (&[][..], &l[..]),
        };
        v4.iter().map(PackedEndpoint::unpack).chain(any.iter().copied())
    }
}

impl FromIterator<SliceEndpoint> for SliceEndpoints {
    fn from_iter<I: IntoIterator<Item = SliceEndpoint>>(iter: I) -> Self {
        let all: Vec<SliceEndpoint> = iter.into_iter().collect();
        match all.iter().map(PackedEndpoint::of).collect::<Option<Vec<_>>>() {
            Some(packed) => SliceEndpoints::V4(packed.into_boxed_slice()),
            None => SliceEndpoints::Any(all.into_boxed_slice()),
        }
    }
}

/// A node name, interned: a million endpoints share a few hundred.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeId(std::num::NonZeroU32);

/// A set of topology hints, interned (endpoints of a zone share one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HintsId(std::num::NonZeroU32);

/// Values interned for the agent's life, by index (1-based). What is
/// interned is bounded by the cluster (node names, zone and node hint sets).
struct Interner<T: Eq + std::hash::Hash> {
    values: Vec<Arc<T>>,
    index: foldhash::HashMap<Arc<T>, std::num::NonZeroU32>,
}

impl<T: Eq + std::hash::Hash> Interner<T> {
    fn id(&mut self, v: T) -> std::num::NonZeroU32 {
        if let Some(id) = self.index.get(&v) {
            return *id;
        }
        let v = Arc::new(v);
        self.values.push(v.clone());
        let id = std::num::NonZeroU32::new(self.values.len() as u32).expect("1-based");
        self.index.insert(v, id);
        id
    }

    fn get(&self, id: std::num::NonZeroU32) -> Arc<T> {
        self.values[id.get() as usize - 1].clone()
    }
}

fn interned<T: Eq + std::hash::Hash, R>(
    table: &'static Mutex<Option<Interner<T>>>,
    f: impl FnOnce(&mut Interner<T>) -> R,
) -> R {
    let mut guard = table.lock().unwrap_or_else(|e| e.into_inner());
    let interner = guard.get_or_insert_with(|| Interner {
        values: Vec::new(),
        index: foldhash::HashMap::default(),
    });
    f(interner)
}

static NODE_NAMES: Mutex<Option<Interner<String>>> = Mutex::new(None);
static HINT_SETS: Mutex<Option<Interner<Hints>>> = Mutex::new(None);

impl NodeId {
    pub fn of(name: &str) -> Self {
        Self(interned(&NODE_NAMES, |i| i.id(name.to_owned())))
    }

    /// The id of `name` if any endpoint names it (nothing is interned).
    pub fn lookup(name: &str) -> Option<Self> {
        // The index is keyed by `Arc<String>`, which borrows as `String`
        // only (clippy's suggestion to pass `name` does not compile).
        #[allow(clippy::unnecessary_to_owned)]
        interned(&NODE_NAMES, |i| i.index.get(&name.to_owned()).copied().map(Self))
    }

    pub fn name(self) -> Arc<String> {
        interned(&NODE_NAMES, |i| i.get(self.0))
    }
}

impl HintsId {
    pub fn of(hints: Hints) -> Self {
        Self(interned(&HINT_SETS, |i| i.id(hints)))
    }

    pub fn get(self) -> Arc<Hints> {
        interned(&HINT_SETS, |i| i.get(self.0))
    }
}

/// Topology hints of an endpoint (empty lists when absent).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Hints {
    pub zones: Vec<String>,
    pub nodes: Vec<String>,
}

impl SliceInfo {
    pub fn parse(slice: &EndpointSlice) -> Self {
        let meta = &slice.metadata;
        let mut problems = Vec::new();
        let family = IpFamily::from_address_type(&slice.address_type);
        let mut ports = Vec::new();
        let mut endpoints = Vec::new();
        // FQDN slices are not proxied: nothing of them is used or reported.
        // Any other address type is a mistake (kube-proxy's spelling is
        // exact: "IPv4", "IPv6"): reported, since its endpoints are lost.
        if family.is_none() && slice.address_type != "FQDN" && !slice.endpoints.is_empty() {
            let what = match slice.address_type.as_str() {
                "" => "addressType is missing".to_owned(),
                t => format!("addressType {t:?} is none of \"IPv4\", \"IPv6\", \"FQDN\""),
            };
            problems.push(format!(
                "{what}; the slice's {} endpoints are not used",
                slice.endpoints.len()
            ));
        }
        if let Some(family) = family {
            for e in &slice.endpoints {
                // Only the first address of an endpoint is used; one that is
                // not an address of the slice's family is reported once and
                // skipped.
                let Some(first) = e.addresses.first() else {
                    continue;
                };
                let addr = match first.parse::<IpAddr>() {
                    Ok(a) if IpFamily::of(&a) == family => a,
                    Ok(a) => {
                        problems.push(format!(
                            "endpoint address {first:?} is an {} address in an {family} slice; endpoint skipped",
                            IpFamily::of(&a)
                        ));
                        continue;
                    }
                    Err(_) => {
                        problems.push(format!(
                            "endpoint address {first:?} is not an {family} address; endpoint skipped"
                        ));
                        continue;
                    }
                };
                let c = e.conditions.as_ref();
                let ready = c.and_then(|c| c.ready).unwrap_or(true);
                let hints = e.hints.as_ref().map(|h| Hints {
                    zones: h.for_zones.iter().flatten().map(|z| z.name.clone()).collect(),
                    nodes: h.for_nodes.iter().flatten().map(|n| n.name.clone()).collect(),
                });
                endpoints.push(SliceEndpoint {
                    addr,
                    ready,
                    serving: c.and_then(|c| c.serving).unwrap_or(ready),
                    terminating: c.and_then(|c| c.terminating).unwrap_or(false),
                    node: e.node_name.as_deref().map(NodeId::of),
                    hints: hints
                        .filter(|h| !h.zones.is_empty() || !h.nodes.is_empty())
                        .map(HintsId::of),
                });
            }
            for sp in slice.ports.iter().flatten() {
                let name = sp.name.clone().unwrap_or_default();
                // A port without a number is ignored (kube-proxy); no name
                // matches the empty name.
                let Some(number) = sp.port else {
                    continue;
                };
                match (port_number(number, "port"), protocol(sp.protocol.as_deref())) {
                    (Ok(port), Ok(proto)) => ports.push(SlicePort {
                        name: intern(&name),
                        proto,
                        port,
                    }),
                    (Err(e), _) | (_, Err(e)) => problems.push(format!("port {name:?}: {e}; skipped")),
                }
            }
        }
        Self {
            key: ObjectKey::of(meta),
            service: meta
                .labels
                .as_ref()
                .and_then(|l| l.get(LABEL_SERVICE_NAME))
                .map(|s| Arc::from(s.as_str())),
            family,
            ports: ports.into(),
            endpoints: endpoints.into_iter().collect(),
            trigger_time: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_TRIGGER_TIME))
                .cloned(),
            problems,
        }
    }

    /// The Service this slice feeds.
    pub fn service_key(&self) -> Option<ObjectKey> {
        self.service.as_ref().map(|s| ObjectKey {
            namespace: self.key.namespace.clone(),
            name: s.clone(),
        })
    }

    /// Endpoints (counted once per slice, whatever its ports).
    pub fn endpoint_count(&self) -> usize {
        self.endpoints.len()
    }
}

/// The Service ports of `svc` for this node, with their endpoints from
/// `slices` (the Service's EndpointSlices). Problems with parts of the
/// objects are returned alongside; the rest is still used.
pub fn service_ports(
    svc: &Service,
    slices: &[&EndpointSlice],
    node: &NodeInfo,
) -> (Vec<ServicePort>, Vec<Skipped>) {
    let info = ServiceInfo::parse(svc);
    let slices: Vec<SliceInfo> = slices.iter().map(|s| SliceInfo::parse(s)).collect();
    let refs: Vec<&SliceInfo> = slices.iter().collect();
    let ports = ports_of(&info, &refs, node);
    (ports, skipped_of(&info, &refs))
}

/// The problems of a Service and its slices, attached to the Service.
pub fn skipped_of(svc: &ServiceInfo, slices: &[&SliceInfo]) -> Vec<Skipped> {
    if svc.problems.is_empty() && slices.iter().all(|s| s.problems.is_empty()) {
        return Vec::new();
    }
    let object = svc.key.to_string();
    let own = svc.problems.iter().map(|reason| Skipped {
        object: object.clone(),
        reason: reason.clone(),
    });
    let of_slices = slices.iter().flat_map(|s| {
        s.problems.iter().map(|p| Skipped {
            object: object.clone(),
            reason: format!("EndpointSlice {}: {p}", s.key.name),
        })
    });
    own.chain(of_slices).collect()
}

/// The Service ports of a parsed Service for this node, endpoints resolved
/// from its parsed slices: for each family the Service has a ClusterIP of
/// (kube-proxy's per-family proxiers skip a Service without one), each port
/// with that family's addresses, ranges and EndpointSlices. IPv4 first.
pub fn ports_of(svc: &ServiceInfo, slices: &[&SliceInfo], node: &NodeInfo) -> Vec<ServicePort> {
    let Some(spec) = &svc.spec else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for family in IpFamily::BOTH {
        let cluster_ips = of_family(&spec.cluster_ips, family);
        if cluster_ips.is_empty() {
            continue;
        }
        let endpoints = collect_endpoints(spec.topology, slices, node, family);
        let external_ips = of_family(&spec.external_ips, family);
        let load_balancer_ips = of_family(&spec.load_balancer_ips, family);
        let ranges: Vec<IpCidr> = spec
            .load_balancer_source_ranges
            .iter()
            .copied()
            .filter(|r| r.family() == family)
            .collect();
        out.extend(spec.ports.iter().map(|p| {
            ServicePort {
                namespace: svc.key.namespace.clone(),
                name: svc.key.name.clone(),
                port_name: p.name.clone(),
                proto: p.proto,
                family,
                port: p.port,
                cluster_ips: cluster_ips.clone(),
                node_port: p.node_port,
                external_ips: external_ips.clone(),
                load_balancer_ips: load_balancer_ips.clone(),
                load_balancer_source_ranges: ranges.clone(),
                external_policy_local: spec.external_policy_local,
                internal_policy_local: spec.internal_policy_local,
                affinity_timeout: spec.affinity_timeout,
                endpoints: endpoints
                    .iter()
                    .find(|(name, proto, _)| *name == &*p.name && *proto == p.proto)
                    .map(|(_, _, eps)| eps.clone())
                    .unwrap_or_default(),
                lb: spec.lb,
            }
        }));
    }
    out
}

/// Endpoints of `family`'s slices per (port name, protocol), deduplicated
/// and topology-marked, ordered by address and port.
fn collect_endpoints<'a>(
    topology: Topology,
    slices: &[&'a SliceInfo],
    node: &NodeInfo,
    family: IpFamily,
) -> Vec<(&'a str, Protocol, Vec<Endpoint>)> {
    // (port name, protocol, address, port, terminating) → endpoint: sorted,
    // the first copy of a duplicate IP:port is the non-terminating one.
    let mut all: Vec<(&str, Protocol, Endpoint, Option<HintsId>)> = Vec::new();
    let here = (!node.name.is_empty())
        .then(|| NodeId::lookup(&node.name))
        .flatten();
    for slice in slices {
        if slice.family != Some(family) {
            continue;
        }
        for sp in &slice.ports {
            for e in slice.endpoints.iter() {
                let endpoint = Endpoint {
                    addr: e.addr,
                    port: sp.port,
                    ready: e.ready,
                    serving: e.serving,
                    terminating: e.terminating,
                    local: here.is_some() && e.node == here,
                    in_topology: true,
                };
                all.push((&*sp.name, sp.proto, endpoint, e.hints));
            }
        }
    }
    // Stable: among equal copies, the first slice's wins (as before).
    all.sort_by(|a, b| {
        (a.0, a.1, a.2.addr, a.2.port, a.2.terminating).cmp(&(b.0, b.1, b.2.addr, b.2.port, b.2.terminating))
    });
    // Duplicate IP:port across slices: the non-terminating copy wins.
    all.dedup_by(|later, first| {
        first.0 == later.0
            && first.1 == later.1
            && first.2.addr == later.2.addr
            && first.2.port == later.2.port
    });
    let mut out: Vec<(&str, Protocol, Vec<Endpoint>)> = Vec::new();
    let mut start = 0;
    while start < all.len() {
        let (name, proto) = (all[start].0, all[start].1);
        let end = start
            + all[start..]
                .iter()
                .take_while(|e| e.0 == name && e.1 == proto)
                .count();
        let group = &mut all[start..end];
        apply_topology(topology, node, group);
        out.push((name, proto, group.iter().map(|e| e.2).collect()));
        start = end;
    }
    out
}

/// Topology-aware routing: hints are used only if the Service asks for them
/// (trafficDistribution, or the topology-mode annotation), EVERY ready
/// endpoint carries one, and at least one matches this node (PreferSameNode)
/// or its zone; otherwise nothing is filtered. Filtered-out endpoints stay
/// backends (established flows) but leave the cluster set.
fn apply_topology(
    topology: Topology,
    node: &NodeInfo,
    eps: &mut [(&str, Protocol, Endpoint, Option<HintsId>)],
) {
    if topology == Topology::Off {
        return;
    }
    let hints: Vec<Option<Arc<Hints>>> = eps.iter().map(|e| e.3.map(HintsId::get)).collect();
    let zones = |i: usize| hints[i].as_ref().map_or(&[][..], |h| &h.zones[..]);
    let nodes = |i: usize| hints[i].as_ref().map_or(&[][..], |h| &h.nodes[..]);
    let ready: Vec<usize> = (0..eps.len()).filter(|i| eps[*i].2.ready).collect();
    let by_node = topology == Topology::Node
        && ready.iter().all(|i| !nodes(*i).is_empty())
        && ready.iter().any(|i| nodes(*i).contains(&node.name));
    if by_node {
        for (i, e) in eps.iter_mut().enumerate() {
            e.2.in_topology = nodes(i).contains(&node.name);
        }
        return;
    }
    let Some(zone) = node.zone.as_ref() else {
        return;
    };
    let by_zone =
        ready.iter().all(|i| !zones(*i).is_empty()) && ready.iter().any(|i| zones(*i).contains(zone));
    if by_zone {
        for (i, e) in eps.iter_mut().enumerate() {
            e.2.in_topology = zones(i).contains(zone);
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
    fn a_misspelled_address_type_is_reported_and_fqdn_is_not() {
        for (t, reported) in [
            ("ipv4", true),
            ("IP", true),
            ("", true),
            ("FQDN", false),
            ("IPv4", false),
        ] {
            let yaml = SVC.to_owned()
                + &slice("[{addresses: [10.0.0.1]}]").replace(
                    "addressType: IPv4\n",
                    &if t.is_empty() {
                        String::new()
                    } else {
                        format!("addressType: {t}\n")
                    },
                );
            let o = objects(&yaml);
            let info = SliceInfo::parse(&o.slices[0]);
            assert_eq!(info.problems.len(), reported as usize, "{t}: {:?}", info.problems);
            if reported {
                let named = match t {
                    "" => "addressType is missing".to_owned(),
                    t => format!("addressType {t:?}"),
                };
                assert!(info.problems[0].contains(&named), "{:?}", info.problems);
                assert!(
                    info.problems[0].contains("1 endpoints are not used"),
                    "{:?}",
                    info.problems
                );
            }
        }
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
    fn malformed_endpoint_addresses_and_slice_ports_are_reported_and_the_rest_kept() {
        let eps = "[{addresses: [not-an-ip]}, {addresses: [10.244.0.999]}, {addresses: [\"fd00::1\"]}, {addresses: [10.0.0.1]}]";
        let (p, skipped) = ports(&(SVC.to_owned() + &slice(eps)));
        assert_eq!(addrs(&p[0]), ["10.0.0.1"]);
        let reasons: Vec<&str> = skipped.iter().map(|s| s.reason.as_str()).collect();
        assert_eq!(reasons.len(), 3, "{reasons:?}");
        assert!(
            reasons[0].contains("\"not-an-ip\" is not an IPv4 address"),
            "{reasons:?}"
        );
        assert!(reasons[1].contains("10.244.0.999"), "{reasons:?}");
        assert!(
            reasons[2].contains("IPv6 address in an IPv4 slice"),
            "{reasons:?}"
        );
        assert!(skipped.iter().all(|s| s.object == "default/web"));
        // Reported once per endpoint, not once per slice port.
        let two_ports = slice("[{addresses: [nope]}]").replace(
            "ports: [{name: http, port: 8080, protocol: TCP}]",
            "ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 53, protocol: UDP}, {name: bad, port: 70000}]",
        );
        let (_, skipped) = ports(&(SVC.to_owned() + &two_ports));
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert!(skipped[1].reason.contains("70000"), "{skipped:?}");
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
