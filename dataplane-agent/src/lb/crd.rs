//! The `LoadBalancerIPPool` custom resource (cluster-scoped,
//! `dataplane.example.com/v1alpha1`), as `deploy/crd-loadbalancerippool.yaml`
//! defines it. Written by hand with `kube::Resource` implemented directly:
//! kube's derive would pull in kube-derive and schemars for one type, and the
//! schema users apply is the YAML file (a test checks both agree).

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, ObjectMeta};
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "dataplane.example.com";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "LoadBalancerIPPool";
pub const PLURAL: &str = "loadbalancerippools";

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

fn api_version() -> String {
    format!("{GROUP}/{VERSION}")
}

fn kind() -> String {
    KIND.to_owned()
}

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

impl kube::Resource for LoadBalancerIPPool {
    type DynamicType = ();
    type Scope = k8s_openapi::ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        PLURAL.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
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
