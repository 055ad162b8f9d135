//! Settings of `run`, from flags and an optional config file (flags win).
//! Names follow kube-proxy's options where the meaning is the same.

use std::{net::Ipv4Addr, path::PathBuf, time::Duration};

use serde::Deserialize;

use crate::net::Ipv4Cidr;

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

/// kube-proxy's nodePortAddresses.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum NodePortAddresses {
    /// Every local IPv4 address of the node except loopback.
    #[default]
    All,
    /// The node's primary IPs (`--node-ip`).
    Primary,
    /// Local addresses inside these prefixes.
    Cidrs(Vec<Ipv4Cidr>),
}

impl std::str::FromStr for NodePortAddresses {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "all" | "" => Ok(Self::All),
            "primary" => Ok(Self::Primary),
            list => list
                .split(',')
                .map(|c| c.trim().parse::<Ipv4Cidr>().map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()
                .map(Self::Cidrs),
        }
    }
}

/// The optional config file (YAML). Every key mirrors a flag.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConfigFile {
    pub node_name: Option<String>,
    pub node_ip: Option<Vec<Ipv4Addr>>,
    pub devices: Option<Vec<String>>,
    pub pod_interfaces: Option<Vec<String>>,
    pub bpffs_dir: Option<PathBuf>,
    pub source: Option<String>,
    pub cluster_cidr: Option<String>,
    pub service_cidr: Option<Vec<String>>,
    pub node_port_addresses: Option<String>,
    pub masquerade_all: Option<bool>,
    pub health_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub sync_period_seconds: Option<u64>,
    pub k8s_api_server: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub log_format: Option<String>,
    pub max_services: Option<u32>,
    pub max_backends: Option<u32>,
    pub conntrack_entries: Option<u32>,
    pub cgroup_path: Option<String>,
    pub socket_lb_host_only: Option<bool>,
}

/// Everything `run` needs, resolved.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub node_name: String,
    pub node_ips: Vec<Ipv4Addr>,
    pub devices: Vec<String>,
    pub pod_interfaces: Vec<String>,
    pub bpffs_dir: PathBuf,
    pub source: Source,
    pub cluster_cidr: Option<Ipv4Cidr>,
    pub service_cidrs: Vec<Ipv4Cidr>,
    pub node_port_addresses: NodePortAddresses,
    pub masquerade_all: bool,
    pub health_bind_address: String,
    pub metrics_bind_address: String,
    pub sync_period: Duration,
    pub k8s_api_server: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub max_services: u32,
    pub max_backends: u32,
    pub conntrack_entries: u32,
    /// cgroup v2 directory for connect-time translation of the node's own
    /// processes; `None`: off.
    pub cgroup_path: Option<PathBuf>,
    pub socket_lb_host_only: bool,
}

/// The cgroup v2 mount point (the root cgroup of the node's processes).
pub fn cgroup2_root() -> Option<PathBuf> {
    std::fs::read_to_string("/proc/mounts")
        .ok()?
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace().skip(1);
            let (path, fstype) = (f.next()?, f.next()?);
            (fstype == "cgroup2").then(|| PathBuf::from(path))
        })
}

/// Default pod-facing interface patterns: the host ends of common CNIs.
pub const DEFAULT_POD_INTERFACES: &[&str] = &[
    "veth*", "cali*", "lxc*", "cni*", "gke*", "eni*", "azv*", "vnet*", "tap*",
];

/// `*` at the end matches any suffix; otherwise exact.
pub fn interface_matches(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == p,
    })
}
