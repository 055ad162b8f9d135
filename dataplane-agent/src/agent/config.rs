//! Settings of `run`, from flags and an optional config file (flags win).
//! Names follow kube-proxy's options where the meaning is the same.

use std::{net::IpAddr, path::PathBuf, time::Duration};

use serde::Deserialize;

use crate::{
    dataplane::XdpMode,
    net::{IpCidr, IpFamily, NodePortAddresses},
};

/// Where Services and EndpointSlices come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// YAML/JSON files (a file or a directory), reloaded when they change.
    Manifests(Vec<PathBuf>),
    /// The Kubernetes API.
    Kubernetes,
}

impl std::str::FromStr for Source {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "kubernetes" {
            return Ok(Source::Kubernetes);
        }
        match s.strip_prefix("manifests:") {
            Some(paths) if !paths.is_empty() => {
                Ok(Source::Manifests(paths.split(',').map(PathBuf::from).collect()))
            }
            _ => Err(format!(
                "`{s}`: expected `kubernetes` or `manifests:PATH[,PATH...]`"
            )),
        }
    }
}

/// The optional config file (YAML). Every key mirrors a flag. Keys that
/// take several values (addresses, devices, CIDRs) take them as a YAML list
/// or, as the flag does, as one comma-separated string.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConfigFile {
    pub node_name: Option<String>,
    #[serde(default, deserialize_with = "list::parsed")]
    pub node_ip: Option<Vec<IpAddr>>,
    #[serde(default, deserialize_with = "list::parsed")]
    pub devices: Option<Vec<String>>,
    #[serde(default, deserialize_with = "list::parsed")]
    pub pod_interfaces: Option<Vec<String>>,
    pub bpffs_dir: Option<PathBuf>,
    pub source: Option<String>,
    /// One CIDR, or one per family (kube-proxy's `clusterCIDR`).
    #[serde(default, deserialize_with = "list::joined")]
    pub cluster_cidr: Option<String>,
    #[serde(default, deserialize_with = "list::parsed")]
    pub service_cidr: Option<Vec<String>>,
    /// `all`, `primary`, or CIDRs.
    #[serde(default, deserialize_with = "list::joined")]
    pub node_port_addresses: Option<String>,
    pub masquerade_all: Option<bool>,
    /// kube-proxy's spelling (`iptables.localhostNodePorts`).
    #[serde(rename = "localhostNodePorts")]
    pub localhost_nodeports: Option<bool>,
    pub health_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub sync_period_seconds: Option<u64>,
    pub min_sync_period_ms: Option<u64>,
    pub k8s_api_server: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub log_format: Option<String>,
    pub max_services: Option<u32>,
    pub max_backends: Option<u32>,
    pub conntrack_entries: Option<u32>,
    pub cgroup_path: Option<String>,
    pub socket_lb_host_only: Option<bool>,
    pub host_routing: Option<bool>,
    pub xdp_mode: Option<String>,
    /// `snat`, `dsr` or `hybrid`.
    pub lb_mode: Option<String>,
    /// `random` or `maglev`.
    pub lb_algorithm: Option<String>,
    pub maglev_table_size: Option<u32>,
    pub maglev_seed: Option<u32>,
    /// LoadBalancer address allocation and L2 announcements.
    pub load_balancer: Option<crate::lb::config::LbConfigFile>,
}

/// Everything `run` needs, resolved.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub node_name: String,
    /// Both families allowed; the first of each family is its SNAT address,
    /// and the families present are those the node serves.
    pub node_ips: Vec<IpAddr>,
    pub devices: Vec<String>,
    /// `--pod-interfaces` patterns; empty: pod interfaces are discovered
    /// (see `agent::pod_interfaces`).
    pub pod_interfaces: Vec<String>,
    pub bpffs_dir: PathBuf,
    pub source: Source,
    /// At most one per family.
    pub cluster_cidrs: Vec<IpCidr>,
    pub service_cidrs: Vec<IpCidr>,
    pub node_port_addresses: NodePortAddresses,
    pub masquerade_all: bool,
    /// NodePorts on 127.0.0.1 and ::1 for the node's own sockets
    /// (connect-time translation), as kube-proxy's iptables mode serves them.
    pub localhost_nodeports: bool,
    pub health_bind_address: String,
    pub metrics_bind_address: String,
    pub sync_period: Duration,
    /// At most one sync per this; the bound on how long a change waits to
    /// be coalesced with others (kube-proxy's minSyncPeriod).
    pub min_sync_period: Duration,
    pub k8s_api_server: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub max_services: u32,
    pub max_backends: u32,
    pub conntrack_entries: u32,
    /// cgroup v2 directory for connect-time translation of the node's own
    /// processes; `None`: off.
    pub cgroup_path: Option<PathBuf>,
    /// Where `cgroup_path` comes from: given, or chosen among the mounts
    /// (see `os::cgroup_mount`), or why there is none.
    pub cgroup_origin: CgroupOrigin,
    pub socket_lb_host_only: bool,
    /// Translated packets skip the node's IP stack (TC paths).
    pub host_routing: bool,
    /// Where the north-south ingress path runs on external devices.
    pub xdp_mode: XdpMode,
    /// `--lb-mode` and `--lb-algorithm`: for Services without annotations.
    pub lb_defaults: crate::state::inputs::LbDefaults,
    /// Maglev's table size (a prime) and hash seed: the same on every node.
    pub maglev_size: u32,
    pub maglev_seed: u32,
    /// LoadBalancer address allocation and L2 announcements.
    pub lb: crate::lb::LbConfig,
}

impl RunConfig {
    /// The families the node serves: those of its IPs, IPv4 first (kube-proxy
    /// runs one proxier per family the node has).
    pub fn families(&self) -> Vec<IpFamily> {
        families_of(&self.node_ips)
    }
}

/// The families of `ips`, IPv4 first.
pub fn families_of(ips: &[IpAddr]) -> Vec<IpFamily> {
    IpFamily::BOTH
        .into_iter()
        .filter(|f| ips.iter().any(|ip| IpFamily::of(ip) == *f))
        .collect()
}

/// Checks a list of cluster CIDRs (one per family at most).
pub fn check_cluster_cidrs(cidrs: &[IpCidr]) -> Result<(), String> {
    for f in IpFamily::BOTH {
        if cidrs.iter().filter(|c| c.family() == f).count() > 1 {
            return Err(format!(
                "at most one {f} cluster CIDR (got {})",
                cidrs
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ));
        }
    }
    Ok(())
}

/// Where the cgroup of connect-time translation comes from.
#[derive(Clone, Debug)]
pub enum CgroupOrigin {
    /// `--cgroup-path` / `cgroupPath` named a directory.
    Given,
    /// `none`: connect-time translation is off, as asked.
    Off,
    /// Not given: the system's cgroup v2 mount.
    Chosen(crate::os::cgroup_mount::Cgroup2Mount),
    /// Not given and no mount fits: off, without having been asked to be.
    NotFound(String),
}

/// `cgroupPath` resolved: the directory (`None`: off) and where it comes from.
pub fn resolve_cgroup_path(setting: Option<&str>) -> (Option<PathBuf>, CgroupOrigin) {
    match setting {
        Some("none") | Some("") => (None, CgroupOrigin::Off),
        Some(p) => (Some(PathBuf::from(p)), CgroupOrigin::Given),
        None => match crate::os::cgroup_mount::system_cgroup2_mount() {
            Ok(m) => (Some(m.path.clone()), CgroupOrigin::Chosen(m)),
            Err(e) => (None, CgroupOrigin::NotFound(e.to_string())),
        },
    }
}

/// Config-file values that are lists: a YAML sequence, or one string with
/// the items separated by commas (as the flags take them).
mod list {
    use std::{fmt, marker::PhantomData, str::FromStr};

    use serde::de::{self, Deserializer, SeqAccess, Visitor};

    /// The items as strings, from either form.
    fn items<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        struct Items(PhantomData<()>);
        impl<'de> Visitor<'de> for Items {
            type Value = Vec<String>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list, or a comma-separated string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(item) = seq.next_element::<String>()? {
                    out.push(item.trim().to_owned());
                }
                Ok(out)
            }
        }
        d.deserialize_any(Items(PhantomData))
    }

    /// Each item parsed as `T`.
    pub fn parsed<'de, D, T>(d: D) -> Result<Option<Vec<T>>, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr,
        T::Err: fmt::Display,
    {
        items(d)?
            .into_iter()
            .map(|s| {
                s.parse::<T>()
                    .map_err(|e| de::Error::custom(format!("`{s}`: {e}")))
            })
            .collect::<Result<Vec<T>, _>>()
            .map(Some)
    }

    /// The items joined with commas, as the flag takes them.
    pub fn joined<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        Ok(Some(items(d)?.join(",")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> ConfigFile {
        serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn list_keys_take_a_list_or_a_comma_separated_string() {
        let as_lists = file(
            "nodeIp: [198.18.0.11, 2001:db8::11]\ndevices: [eth0, eth1]\npodInterfaces: ['veth*']\n\
             clusterCidr: [10.244.0.0/16, 'fd00:10:244::/56']\nserviceCidr: [10.96.0.0/16]\n\
             nodePortAddresses: [198.18.0.0/24]\n",
        );
        let as_strings = file(
            "nodeIp: 198.18.0.11,2001:db8::11\ndevices: eth0, eth1\npodInterfaces: 'veth*'\n\
             clusterCidr: 10.244.0.0/16,fd00:10:244::/56\nserviceCidr: 10.96.0.0/16\n\
             nodePortAddresses: 198.18.0.0/24\n",
        );
        for f in [&as_lists, &as_strings] {
            assert_eq!(
                f.node_ip.as_deref(),
                Some(&["198.18.0.11".parse().unwrap(), "2001:db8::11".parse().unwrap()][..])
            );
            assert_eq!(
                f.devices.as_deref(),
                Some(&["eth0".to_owned(), "eth1".to_owned()][..])
            );
            assert_eq!(f.pod_interfaces.as_deref(), Some(&["veth*".to_owned()][..]));
            assert_eq!(f.cluster_cidr.as_deref(), Some("10.244.0.0/16,fd00:10:244::/56"));
            assert_eq!(f.service_cidr.as_deref(), Some(&["10.96.0.0/16".to_owned()][..]));
            assert_eq!(f.node_port_addresses.as_deref(), Some("198.18.0.0/24"));
        }
        assert!(file("nodeName: n\n").node_ip.is_none());
    }

    #[test]
    fn a_bad_list_item_is_named() {
        let e = serde_saphyr::from_str::<ConfigFile>("nodeIp: [198.18.0.11, not-an-ip]\n").unwrap_err();
        assert!(e.to_string().contains("not-an-ip"), "{e}");
    }
}
