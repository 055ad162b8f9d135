//! What this node announces to which peer, decided from the watched objects
//! (pure): the `BGPPeer`s whose node selector matches this Node, and for
//! every `BGPAdvertisement` the addresses of the Services it selects.
//!
//! - LoadBalancer ingress addresses (Services of our class) and external
//!   IPs: every node announces them with externalTrafficPolicy Cluster
//!   (the routers spread flows over the nodes with ECMP); with Local, only
//!   a node with a ready endpoint of the Service (the client address is
//!   kept without a second hop), and it withdraws when the last one goes.
//!   A node labelled `node.kubernetes.io/exclude-from-external-load-balancers`
//!   announces neither.
//! - ClusterIPs: every node, or with internalTrafficPolicy Local only the
//!   nodes with a ready endpoint.
//! - Service CIDRs: every peering node.
//!
//! An advertisement naming `pools` announces only LoadBalancer addresses
//! from those pools (L2 and BGP side by side on different pools).
//!
//! Objects that cannot be used are left out with a message (the speaker
//! logs it, counts it and records an event); the others still apply.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use crate::lb::{
    EXCLUDE_LABEL,
    crd::{BGP_ADVERTISEMENT_KIND, BGP_PEER_KIND, BgpAdvertisement, BgpPeer, LoadBalancerIPPool},
    pool::{NAME_LABEL, NAMESPACE_LABEL, PoolIndex, Selector, parse_cidr},
    request::{ClassFilter, ingress_ips, with_ready_endpoint_on},
};

/// BFD timers of a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bfd {
    pub min_rx_ms: u32,
    pub min_tx_ms: u32,
    pub multiplier: u32,
}

/// A valid `BGPPeer`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
    pub address: IpAddr,
    pub port: Option<u16>,
    pub peer_asn: u32,
    pub my_asn: u32,
    pub password: Option<String>,
    pub hold_time: u32,
    pub bfd: Option<Bfd>,
    pub graceful_restart: bool,
    selector: Selector,
}

/// The default hold time (RFC 4271's suggestion, BIRD's and FRR's default).
pub const DEFAULT_HOLD_TIME: u32 = 90;

impl Peer {
    pub fn parse(obj: &BgpPeer) -> Result<Self, String> {
        let s = &obj.spec;
        let address: IpAddr = s
            .peer_address
            .parse()
            .map_err(|_| format!("peerAddress `{}` is not an IP address", s.peer_address))?;
        if address.is_unspecified() || address.is_multicast() {
            return Err(format!("peerAddress {address} cannot be a peer"));
        }
        if s.peer_asn == 0 || s.my_asn == 0 {
            return Err("peerASN and myASN must be 1 to 4294967295".into());
        }
        if s.port == Some(0) {
            return Err("port must be 1 to 65535".into());
        }
        let hold_time = s.hold_time_seconds.unwrap_or(DEFAULT_HOLD_TIME);
        if hold_time != 0 && !(3..=65535).contains(&hold_time) {
            return Err(format!("holdTimeSeconds {hold_time}: 0 or 3 to 65535"));
        }
        if let Some(p) = &s.password
            && (p.is_empty()
                || p.len() > 80
                || !p.chars().all(|c| c.is_ascii_graphic() && c != '"' && c != '\\'))
        {
            // RFC 2385 keys are at most 80 bytes; the speaker's configuration
            // quotes it, so quotes and backslashes are refused.
            return Err("password: 1 to 80 printable ASCII characters without `\"` or `\\`".into());
        }
        let bfd = match &s.bfd {
            None => None,
            Some(b) => {
                let bfd = Bfd {
                    min_rx_ms: b.min_rx_ms.unwrap_or(300),
                    min_tx_ms: b.min_tx_ms.unwrap_or(300),
                    multiplier: b.multiplier.unwrap_or(3),
                };
                if !(10..=60_000).contains(&bfd.min_rx_ms) || !(10..=60_000).contains(&bfd.min_tx_ms) {
                    return Err("bfd: minRxMs and minTxMs must be 10 to 60000".into());
                }
                if !(1..=255).contains(&bfd.multiplier) {
                    return Err("bfd: multiplier must be 1 to 255".into());
                }
                Some(bfd)
            }
        };
        let selector = Selector::parse(s.node_selector.as_ref()).map_err(|e| format!("nodeSelector: {e}"))?;
        Ok(Self {
            name: name_of(&obj.metadata),
            address,
            port: s.port,
            peer_asn: s.peer_asn,
            my_asn: s.my_asn,
            password: s.password.clone(),
            hold_time,
            bfd,
            graceful_restart: s.graceful_restart,
            selector,
        })
    }
}

/// A BGP community.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Community {
    /// RFC 1997: `ASN:VALUE`, 16 bits each.
    Standard(u16, u16),
    /// RFC 8092: `ASN:VALUE1:VALUE2`, 32 bits each.
    Large(u32, u32, u32),
}

impl Community {
    pub fn parse(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let bad =
            || format!("community `{s}`: `ASN:VALUE` (16-bit numbers) or `ASN:VALUE:VALUE` (32-bit numbers)");
        match parts[..] {
            [a, b] => Ok(Self::Standard(
                a.parse().map_err(|_| bad())?,
                b.parse().map_err(|_| bad())?,
            )),
            [a, b, c] => Ok(Self::Large(
                a.parse().map_err(|_| bad())?,
                b.parse().map_err(|_| bad())?,
                c.parse().map_err(|_| bad())?,
            )),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Community {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Standard(a, b) => write!(f, "{a}:{b}"),
            Self::Large(a, b, c) => write!(f, "{a}:{b}:{c}"),
        }
    }
}

/// An announced prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Prefix {
    pub addr: IpAddr,
    pub len: u8,
}

impl Prefix {
    pub fn host(addr: IpAddr) -> Self {
        Self {
            addr,
            len: if addr.is_ipv4() { 32 } else { 128 },
        }
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// A valid `BGPAdvertisement`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertisement {
    pub name: String,
    pub load_balancer_ips: bool,
    pub external_ips: bool,
    pub cluster_ips: bool,
    pub cidrs: Vec<Prefix>,
    selector: Selector,
    /// Pool names (empty: all).
    pub pools: BTreeSet<String>,
    /// Peer names (empty: all).
    pub peers: BTreeSet<String>,
    pub communities: BTreeSet<Community>,
    pub local_preference: Option<u32>,
}

impl Advertisement {
    pub fn parse(obj: &BgpAdvertisement) -> Result<Self, String> {
        let s = &obj.spec;
        let cidrs = s
            .service_cidrs
            .iter()
            .map(|c| {
                parse_cidr(c).map(|r| Prefix {
                    addr: r.first,
                    len: c.rsplit_once('/').and_then(|(_, l)| l.parse().ok()).unwrap_or(0),
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("serviceCIDRs: {e}"))?;
        let communities = s
            .communities
            .iter()
            .map(|c| Community::parse(c))
            .collect::<Result<_, _>>()?;
        let selector =
            Selector::parse(s.service_selector.as_ref()).map_err(|e| format!("serviceSelector: {e}"))?;
        Ok(Self {
            name: name_of(&obj.metadata),
            load_balancer_ips: s.load_balancer_ips,
            external_ips: s.external_ips,
            cluster_ips: s.cluster_ips,
            cidrs,
            selector,
            pools: s.pools.iter().cloned().collect(),
            peers: s.peers.iter().cloned().collect(),
            communities,
            local_preference: s.local_preference,
        })
    }

    fn reaches(&self, peer: &str) -> bool {
        self.peers.is_empty() || self.peers.contains(peer)
    }
}

fn name_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    meta.name.clone().unwrap_or_default()
}

/// A prefix's attributes and the peers it goes to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Route {
    pub communities: BTreeSet<Community>,
    /// The highest any advertisement asks for.
    pub local_preference: Option<u32>,
    pub peers: BTreeSet<String>,
}

/// An object left out, and why.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub kind: &'static str,
    pub name: String,
    pub message: String,
}

/// What this node's speaker is configured with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub router_id: Option<std::net::Ipv4Addr>,
    /// The peers this node sessions with, by name.
    pub peers: BTreeMap<String, Peer>,
    pub routes: BTreeMap<Prefix, Route>,
    pub problems: Vec<Problem>,
}

/// The inputs of [`plan`].
pub struct Inputs<'a> {
    pub node_name: &'a str,
    pub node: Option<&'a Node>,
    pub classes: &'a ClassFilter,
    pub services: Vec<&'a Service>,
    pub slices: Vec<&'a EndpointSlice>,
    pub peers: Vec<&'a BgpPeer>,
    pub advertisements: Vec<&'a BgpAdvertisement>,
    pub pools: Vec<&'a LoadBalancerIPPool>,
}

/// The node's router ID: its first IPv4 InternalIP (any IPv4 address
/// otherwise); `None` for a node without IPv4 addresses.
pub fn router_id(node: Option<&Node>) -> Option<std::net::Ipv4Addr> {
    let addrs = node?.status.as_ref()?.addresses.as_ref()?;
    let v4 = |want_internal: bool| {
        addrs
            .iter()
            .filter(|a| !want_internal || a.type_ == "InternalIP")
            .find_map(|a| a.address.parse::<std::net::Ipv4Addr>().ok())
    };
    v4(true).or_else(|| v4(false))
}

pub fn plan(i: &Inputs) -> Plan {
    let mut out = Plan {
        router_id: router_id(i.node),
        ..Plan::default()
    };
    let labels = i.node.and_then(|n| n.metadata.labels.clone()).unwrap_or_default();
    for obj in &i.peers {
        match Peer::parse(obj) {
            Ok(p) => {
                if p.selector.matches(&labels) {
                    out.peers.insert(p.name.clone(), p);
                }
            }
            Err(message) => out.problems.push(Problem {
                kind: BGP_PEER_KIND,
                name: name_of(&obj.metadata),
                message,
            }),
        }
    }
    let advertisements: Vec<Advertisement> = i
        .advertisements
        .iter()
        .filter_map(|obj| match Advertisement::parse(obj) {
            Ok(a) => Some(a),
            Err(message) => {
                out.problems.push(Problem {
                    kind: BGP_ADVERTISEMENT_KIND,
                    name: name_of(&obj.metadata),
                    message,
                });
                None
            }
        })
        .collect();
    if out.peers.is_empty() {
        return out;
    }
    let excluded = labels.contains_key(EXCLUDE_LABEL);
    let local = with_ready_endpoint_on(i.slices.iter().copied(), i.node_name);
    let pools = PoolIndex::new(i.pools.iter().copied());
    let add = |out: &mut Plan, prefix: Prefix, adv: &Advertisement| {
        let peers: BTreeSet<String> = out
            .peers
            .values()
            .filter(|p| adv.reaches(&p.name) && p.address.is_ipv4() == prefix.addr.is_ipv4())
            .map(|p| p.name.clone())
            .collect();
        if peers.is_empty() {
            return;
        }
        let r = out.routes.entry(prefix).or_default();
        r.communities.extend(adv.communities.iter().copied());
        r.local_preference = r.local_preference.max(adv.local_preference);
        r.peers.extend(peers);
    };
    for adv in &advertisements {
        for c in &adv.cidrs {
            add(&mut out, *c, adv);
        }
    }
    for svc in &i.services {
        let Some(spec) = &svc.spec else { continue };
        if spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        let id = (
            svc.metadata.namespace.clone().unwrap_or_default(),
            svc.metadata.name.clone().unwrap_or_default(),
        );
        let mut svc_labels = svc.metadata.labels.clone().unwrap_or_default();
        svc_labels.insert(NAMESPACE_LABEL.into(), id.0.clone());
        svc_labels.insert(NAME_LABEL.into(), id.1.clone());
        let has_local = local.contains(&id);
        let external_ok =
            !excluded && (spec.external_traffic_policy.as_deref() != Some("Local") || has_local);
        let internal_ok = spec.internal_traffic_policy.as_deref() != Some("Local") || has_local;
        for adv in advertisements.iter().filter(|a| a.selector.matches(&svc_labels)) {
            let mut addrs: Vec<IpAddr> = Vec::new();
            if external_ok && adv.load_balancer_ips && i.classes.owns(svc) {
                addrs.extend(ingress_ips(svc).into_iter().filter(|ip| {
                    adv.pools.is_empty()
                        || pools
                            .pool_of(*ip)
                            .is_some_and(|p| adv.pools.contains(p.metadata.name.as_deref().unwrap_or("")))
                }));
            }
            if external_ok && adv.external_ips {
                addrs.extend(
                    spec.external_ips
                        .iter()
                        .flatten()
                        .filter_map(|a| a.parse::<IpAddr>().ok()),
                );
            }
            if internal_ok && adv.cluster_ips {
                addrs.extend(
                    spec.cluster_ips
                        .iter()
                        .flatten()
                        .chain(spec.cluster_ip.iter())
                        .filter_map(|a| a.parse::<IpAddr>().ok()),
                );
            }
            for a in addrs {
                add(&mut out, Prefix::host(a), adv);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};
    use serde_json::json;

    use super::*;

    fn classes() -> ClassFilter {
        ClassFilter {
            class: crate::lb::DEFAULT_CLASS.into(),
            default_class: false,
        }
    }

    fn node(labels: serde_json::Value) -> Node {
        let mut n: Node =
            serde_json::from_value(json!({"metadata": {"name": "n1", "labels": labels}})).unwrap();
        n.status = Some(NodeStatus {
            addresses: Some(vec![
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: "fd00::11".into(),
                },
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: "198.18.0.11".into(),
                },
            ]),
            ..Default::default()
        });
        n
    }

    fn peer(name: &str, spec: serde_json::Value) -> BgpPeer {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
    }

    fn advertisement(name: &str, spec: serde_json::Value) -> BgpAdvertisement {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
    }

    fn service(name: &str, etp: &str, lb_ip: &str) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "labels": {"tier": "edge"}},
            "spec": {
                "type": "LoadBalancer", "loadBalancerClass": crate::lb::DEFAULT_CLASS,
                "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                "externalIPs": ["192.0.2.7"], "externalTrafficPolicy": etp,
                "ports": [{"port": 80}]
            },
            "status": {"loadBalancer": {"ingress": [{"ip": lb_ip}]}}
        }))
        .unwrap()
    }

    fn slice(svc: &str, node: &str, ready: bool) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": format!("{svc}-x"), "namespace": "default",
                         "labels": {"kubernetes.io/service-name": svc}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.1.5"], "nodeName": node, "conditions": {"ready": ready}}]
        }))
        .unwrap()
    }

    fn run(
        node: &Node,
        services: &[Service],
        slices: &[EndpointSlice],
        peers: &[BgpPeer],
        ads: &[BgpAdvertisement],
    ) -> Plan {
        let classes = classes();
        plan(&Inputs {
            node_name: "n1",
            node: Some(node),
            classes: &classes,
            services: services.iter().collect(),
            slices: slices.iter().collect(),
            peers: peers.iter().collect(),
            advertisements: ads.iter().collect(),
            pools: vec![],
        })
    }

    fn prefixes(p: &Plan) -> Vec<String> {
        p.routes.keys().map(|k| k.to_string()).collect()
    }

    #[test]
    fn cluster_policy_announces_everywhere_and_local_only_with_a_ready_endpoint() {
        let peers = [peer(
            "tor",
            json!({"peerAddress": "198.18.0.254", "peerASN": 64500, "myASN": 64512}),
        )];
        let ads = [advertisement(
            "lb",
            json!({"communities": ["64512:100", "64512:1:2"], "localPreference": 200}),
        )];
        let services = [
            service("web", "Cluster", "203.0.113.1"),
            service("local", "Local", "203.0.113.2"),
        ];
        let n = node(json!({}));
        let p = run(&n, &services, &[], &peers, &ads);
        assert_eq!(p.router_id, Some("198.18.0.11".parse().unwrap()));
        assert_eq!(prefixes(&p), ["203.0.113.1/32"]);
        let r = &p.routes[&Prefix::host("203.0.113.1".parse().unwrap())];
        assert_eq!(r.peers, BTreeSet::from(["tor".to_owned()]));
        assert_eq!(r.local_preference, Some(200));
        assert_eq!(r.communities.len(), 2);
        // A ready endpoint here: announced; not ready, or on another node: not.
        let p = run(&n, &services, &[slice("local", "n1", true)], &peers, &ads);
        assert_eq!(prefixes(&p), ["203.0.113.1/32", "203.0.113.2/32"]);
        let p = run(
            &n,
            &services,
            &[slice("local", "n1", false), slice("local", "n2", true)],
            &peers,
            &ads,
        );
        assert_eq!(prefixes(&p), ["203.0.113.1/32"]);
        // An excluded node announces no LoadBalancer address.
        let excluded = node(json!({EXCLUDE_LABEL: ""}));
        assert!(run(&excluded, &services, &[], &peers, &ads).routes.is_empty());
    }

    #[test]
    fn selectors_families_and_kinds_of_address() {
        let peers = [
            peer(
                "tor4",
                json!({"peerAddress": "198.18.0.254", "peerASN": 64500, "myASN": 64512}),
            ),
            peer(
                "tor6",
                json!({"peerAddress": "2001:db8::fe", "peerASN": 64500, "myASN": 64512}),
            ),
            peer(
                "rack2",
                json!({"peerAddress": "198.18.1.254", "peerASN": 64501, "myASN": 64512,
                                 "nodeSelector": {"matchLabels": {"rack": "2"}}}),
            ),
        ];
        let ads = [
            advertisement(
                "all",
                json!({"loadBalancerIPs": false, "externalIPs": true, "clusterIPs": true,
                                        "serviceCIDRs": ["10.96.0.0/16", "fd00:10:96::/112"], "peers": ["tor4", "tor6"]}),
            ),
            advertisement(
                "edge",
                json!({"serviceSelector": {"matchLabels": {"tier": "edge"}}}),
            ),
            advertisement(
                "none",
                json!({"serviceSelector": {"matchLabels": {"io.kubernetes.service.name": "other"}}}),
            ),
        ];
        let services = [service("web", "Cluster", "2001:db8:1::1")];
        let p = run(&node(json!({})), &services, &[], &peers, &ads);
        assert_eq!(
            p.peers.keys().collect::<Vec<_>>(),
            ["tor4", "tor6"],
            "rack2 selects other nodes"
        );
        assert_eq!(
            prefixes(&p),
            [
                "10.96.0.0/16",
                "10.96.0.10/32",
                "192.0.2.7/32",
                "2001:db8:1::1/128",
                "fd00:10:96::/112"
            ]
        );
        // Each prefix goes to the peers of its family.
        assert_eq!(
            p.routes[&Prefix::host("2001:db8:1::1".parse().unwrap())].peers,
            BTreeSet::from(["tor6".into()])
        );
        let p = run(&node(json!({"rack": "2"})), &services, &[], &peers, &ads);
        assert_eq!(
            p.routes[&Prefix::host("192.0.2.7".parse().unwrap())].peers.len(),
            1,
            "`all` names its peers"
        );
        assert!(p.peers.contains_key("rack2"));
    }

    #[test]
    fn an_advertisement_naming_pools_announces_only_their_addresses() {
        let peers = [peer(
            "tor",
            json!({"peerAddress": "198.18.0.254", "peerASN": 64500, "myASN": 64512}),
        )];
        let ads = [advertisement("bgp-only", json!({"pools": ["bgp"]}))];
        let pools: Vec<LoadBalancerIPPool> = [("bgp", "203.0.113.0/28"), ("lan", "198.18.0.240/29")]
            .map(|(name, cidr)| {
                serde_json::from_value(
                    json!({"metadata": {"name": name}, "spec": {"blocks": [{"cidr": cidr}]}}),
                )
                .unwrap()
            })
            .to_vec();
        let services = [
            service("web", "Cluster", "203.0.113.1"),
            service("lan", "Cluster", "198.18.0.241"),
        ];
        let n = node(json!({}));
        let classes = classes();
        let p = plan(&Inputs {
            node_name: "n1",
            node: Some(&n),
            classes: &classes,
            services: services.iter().collect(),
            slices: vec![],
            peers: peers.iter().collect(),
            advertisements: ads.iter().collect(),
            pools: pools.iter().collect(),
        });
        assert_eq!(prefixes(&p), ["203.0.113.1/32"]);
    }

    #[test]
    fn bad_objects_are_left_out_with_a_reason() {
        let peers = [
            peer(
                "ok",
                json!({"peerAddress": "198.18.0.254", "peerASN": 64500, "myASN": 64512}),
            ),
            peer(
                "addr",
                json!({"peerAddress": "router", "peerASN": 64500, "myASN": 64512}),
            ),
            peer(
                "asn",
                json!({"peerAddress": "198.18.0.253", "peerASN": 0, "myASN": 64512}),
            ),
            peer(
                "pw",
                json!({"peerAddress": "198.18.0.252", "peerASN": 1, "myASN": 2, "password": "a\"; }"}),
            ),
            peer(
                "hold",
                json!({"peerAddress": "198.18.0.251", "peerASN": 1, "myASN": 2, "holdTimeSeconds": 2}),
            ),
            peer(
                "bfd",
                json!({"peerAddress": "198.18.0.250", "peerASN": 1, "myASN": 2, "bfd": {"multiplier": 0}}),
            ),
        ];
        let ads = [
            advertisement("cidr", json!({"serviceCIDRs": ["10.96.0.1/16"]})),
            advertisement("community", json!({"communities": ["65536:1"]})),
        ];
        let p = run(&node(json!({})), &[], &[], &peers, &ads);
        assert_eq!(p.peers.keys().collect::<Vec<_>>(), ["ok"]);
        let bad: Vec<(&str, &str)> = p.problems.iter().map(|b| (b.kind, b.name.as_str())).collect();
        assert_eq!(
            bad,
            [
                ("BGPPeer", "addr"),
                ("BGPPeer", "asn"),
                ("BGPPeer", "pw"),
                ("BGPPeer", "hold"),
                ("BGPPeer", "bfd"),
                ("BGPAdvertisement", "cidr"),
                ("BGPAdvertisement", "community")
            ]
        );
        assert!(p.problems[5].message.contains("host bits"), "{:?}", p.problems[5]);
    }
}
