//! The load balancers' custom resources (cluster-scoped,
//! `dataplane.example.com/v1alpha1`): `LoadBalancerIPPool`
//! (`deploy/crd-loadbalancerippool.yaml`), `BGPPeer` and `BGPAdvertisement`
//! (`deploy/crd-bgp.yaml`). Written by hand with `kube::Resource`
//! implemented by [`cluster_resource!`]: kube's derive would pull in
//! kube-derive and schemars for three types, and the schemas users apply are
//! the YAML files (tests check both agree).

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, ObjectMeta};
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "dataplane.example.com";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "LoadBalancerIPPool";
pub const PLURAL: &str = "loadbalancerippools";

/// `kube::Resource` for a cluster-scoped type of our group with
/// `metadata`, and its `apiVersion`/`kind` defaults for serde.
macro_rules! cluster_resource {
    ($ty:ty, $kind:expr, $plural:expr, $api_version:ident, $kind_fn:ident) => {
        fn $api_version() -> String {
            format!("{GROUP}/{VERSION}")
        }
        fn $kind_fn() -> String {
            $kind.to_owned()
        }
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = k8s_openapi::ClusterResourceScope;

            fn kind(_: &()) -> Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> Cow<'_, str> {
                GROUP.into()
            }
            fn version(_: &()) -> Cow<'_, str> {
                VERSION.into()
            }
            fn plural(_: &()) -> Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

/// A pool of addresses for Services of type LoadBalancer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerIPPool {
    #[serde(default = "api_version")]
    pub api_version: String,
    #[serde(default = "kind")]
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: PoolSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PoolStatus>,
}

cluster_resource!(LoadBalancerIPPool, KIND, PLURAL, api_version, kind);

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    /// Address blocks: a CIDR, or an inclusive `start`–`stop` range.
    #[serde(default)]
    pub blocks: Vec<Block>,
    /// Services this pool serves (all when absent). Besides a Service's own
    /// labels, `io.kubernetes.service.namespace` and
    /// `io.kubernetes.service.name` can be matched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_selector: Option<LabelSelector>,
    /// Whether the first and last address of each CIDR block (IPv4 network
    /// and broadcast addresses, IPv6 subnet-router anycast) may be handed
    /// out. /31, /32, /127 and /128 blocks always give out every address.
    #[serde(default, rename = "allowFirstLastIPs")]
    pub allow_first_last_ips: bool,
    /// No new allocations; Services keep the addresses they have.
    #[serde(default)]
    pub disabled: bool,
    /// Whether L2 announcements answer for this pool's addresses (absent:
    /// yes); `false` leaves them to BGP.
    #[serde(default, rename = "l2Announce", skip_serializing_if = "Option::is_none")]
    pub l2_announce: Option<bool>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Block {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<String>,
}

/// What the allocator reports. Counts saturate at 2^63 − 1 (an IPv6 /64
/// holds more).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    #[serde(default, rename = "ipsTotal")]
    pub ips_total: i64,
    #[serde(default, rename = "ipsUsed")]
    pub ips_used: i64,
    #[serde(default, rename = "ipsAvailable")]
    pub ips_available: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl LoadBalancerIPPool {
    pub fn new(name: &str, spec: PoolSpec) -> Self {
        Self {
            api_version: api_version(),
            kind: kind(),
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..Default::default()
            },
            spec,
            status: None,
        }
    }

    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or("")
    }
}

pub const BGP_PEER_KIND: &str = "BGPPeer";
pub const BGP_PEER_PLURAL: &str = "bgppeers";
pub const BGP_ADVERTISEMENT_KIND: &str = "BGPAdvertisement";
pub const BGP_ADVERTISEMENT_PLURAL: &str = "bgpadvertisements";

/// A BGP router the nodes peer with (docs/loadbalancer.md, "BGP").
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BgpPeer {
    #[serde(default = "peer_api_version")]
    pub api_version: String,
    #[serde(default = "peer_kind")]
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: BgpPeerSpec,
}

cluster_resource!(
    BgpPeer,
    BGP_PEER_KIND,
    BGP_PEER_PLURAL,
    peer_api_version,
    peer_kind
);

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BgpPeerSpec {
    /// The router's address; an IPv4 session carries the IPv4
    /// announcements, an IPv6 one the IPv6 announcements.
    #[serde(default)]
    pub peer_address: String,
    #[serde(default, rename = "peerASN")]
    pub peer_asn: u32,
    /// The nodes' own AS number (the same as `peerASN`: internal BGP).
    #[serde(default, rename = "myASN")]
    pub my_asn: u32,
    /// The router's TCP port (179).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// TCP MD5 password (RFC 2385).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// BGP hold time (90 s; 0 or 3 to 65535).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_time_seconds: Option<u32>,
    /// Bidirectional forwarding detection on the session (sub-second
    /// failure detection); absent: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bfd: Option<BfdSpec>,
    /// Advertise graceful restart: the router keeps the routes of a node
    /// whose speaker restarts (and of a node that died, until the restart
    /// time runs out). Off by default: a lost node is withdrawn at once.
    #[serde(default)]
    pub graceful_restart: bool,
    /// The nodes that peer (all when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
}

/// BFD timers; absent fields take the defaults (300 ms, 300 ms, 3).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BfdSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_rx_ms: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tx_ms: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multiplier: Option<u32>,
}

/// What the nodes announce to their peers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BgpAdvertisement {
    #[serde(default = "advertisement_api_version")]
    pub api_version: String,
    #[serde(default = "advertisement_kind")]
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: AdvertisementSpec,
}

cluster_resource!(
    BgpAdvertisement,
    BGP_ADVERTISEMENT_KIND,
    BGP_ADVERTISEMENT_PLURAL,
    advertisement_api_version,
    advertisement_kind
);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdvertisementSpec {
    /// The ingress addresses of LoadBalancer Services of our class.
    #[serde(default = "yes", rename = "loadBalancerIPs")]
    pub load_balancer_ips: bool,
    #[serde(default, rename = "externalIPs")]
    pub external_ips: bool,
    #[serde(default, rename = "clusterIPs")]
    pub cluster_ips: bool,
    /// Prefixes every peering node announces (the service CIDRs).
    #[serde(default, rename = "serviceCIDRs", skip_serializing_if = "Vec::is_empty")]
    pub service_cidrs: Vec<String>,
    /// The Services announced (all when absent); besides a Service's own
    /// labels, `io.kubernetes.service.namespace` and
    /// `io.kubernetes.service.name` can be matched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_selector: Option<LabelSelector>,
    /// LoadBalancerIPPool names whose addresses are announced (all when
    /// empty; addresses from no pool too).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<String>,
    /// BGPPeer names to announce to (all when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<String>,
    /// `ASN:VALUE` (standard) or `ASN:VALUE1:VALUE2` (large) communities.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub communities: Vec<String>,
    /// LOCAL_PREF (internal BGP sessions only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_preference: Option<u32>,
}

fn yes() -> bool {
    true
}

impl Default for AdvertisementSpec {
    fn default() -> Self {
        Self {
            load_balancer_ips: true,
            external_ips: false,
            cluster_ips: false,
            service_cidrs: Vec::new(),
            service_selector: None,
            pools: Vec::new(),
            peers: Vec::new(),
            communities: Vec::new(),
            local_preference: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_with_the_api_field_names() {
        let json = serde_json::json!({
            "apiVersion": "dataplane.example.com/v1alpha1",
            "kind": "LoadBalancerIPPool",
            "metadata": {"name": "lan"},
            "spec": {
                "blocks": [{"cidr": "198.18.0.240/28"}, {"start": "fd00::10", "stop": "fd00::1f"}],
                "serviceSelector": {"matchLabels": {"tier": "edge"}},
                "allowFirstLastIPs": true,
                "disabled": false
            },
            "status": {"ipsTotal": 16, "ipsUsed": 1, "ipsAvailable": 15}
        });
        let pool: LoadBalancerIPPool = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(pool.name(), "lan");
        assert!(pool.spec.allow_first_last_ips);
        assert_eq!(pool.spec.blocks[1].start.as_deref(), Some("fd00::10"));
        assert_eq!(pool.status.as_ref().unwrap().ips_available, 15);
        assert_eq!(serde_json::to_value(&pool).unwrap(), json);
        use kube::Resource as _;
        assert_eq!(
            LoadBalancerIPPool::url_path(&(), None),
            "/apis/dataplane.example.com/v1alpha1/loadbalancerippools"
        );
    }
}
