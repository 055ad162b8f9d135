//! Inputs of the desired-state computation.

use std::{net::IpAddr, sync::Arc, time::Duration};

use super::table::ServicePortName;
use crate::net::{IpCidr, IpFamily, Protocol};

/// One port of one Service, for one IP family, with its endpoints: every
/// address and range below is of `family` (a dual-stack Service is one
/// `ServicePort` per family, as kube-proxy runs one proxier per family).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    /// The port's name (may be empty).
    pub port_name: Arc<str>,
    pub proto: Protocol,
    pub family: IpFamily,
    pub port: u16,
    pub cluster_ips: Vec<IpAddr>,
    pub node_port: Option<u16>,
    pub external_ips: Vec<IpAddr>,
    /// LoadBalancer ingress IPs with ipMode VIP (or unset); ipMode Proxy
    /// ones are left out before this point.
    pub load_balancer_ips: Vec<IpAddr>,
    pub load_balancer_source_ranges: Vec<IpCidr>,
    /// externalTrafficPolicy: Local.
    pub external_policy_local: bool,
    /// internalTrafficPolicy: Local.
    pub internal_policy_local: bool,
    /// sessionAffinity: ClientIP, with its timeout.
    pub affinity_timeout: Option<Duration>,
    /// After topology filtering and duplicate resolution.
    pub endpoints: Vec<Endpoint>,
    /// How the Service asks to be balanced (its annotations); unset parts
    /// take the node's defaults ([`NodeContext::lb`]).
    pub lb: LbChoice,
}

/// How new flows to an external destination that kube-proxy would
/// masquerade reach a backend on another node (`--lb-mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LbMode {
    /// Masqueraded to this node (kube-proxy's behaviour).
    #[default]
    Snat,
    /// Direct server return: sent encapsulated, replies straight from the
    /// backend's node; the client's address is kept.
    Dsr,
    /// DSR for TCP, SNAT for everything else.
    Hybrid,
}

impl LbMode {
    pub fn as_str(self) -> &'static str {
        match self {
            LbMode::Snat => "snat",
            LbMode::Dsr => "dsr",
            LbMode::Hybrid => "hybrid",
        }
    }

    /// Whether flows of `proto` go by DSR in this mode (SCTP never does:
    /// its associations may span addresses the backend's node does not
    /// translate).
    pub fn dsr_for(self, proto: crate::net::Protocol) -> bool {
        use crate::net::Protocol;
        match self {
            LbMode::Snat => false,
            LbMode::Dsr => matches!(proto, Protocol::Tcp | Protocol::Udp),
            LbMode::Hybrid => proto == Protocol::Tcp,
        }
    }
}

impl std::str::FromStr for LbMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "snat" => Ok(LbMode::Snat),
            "dsr" => Ok(LbMode::Dsr),
            "hybrid" => Ok(LbMode::Hybrid),
            other => Err(format!("`{other}`: expected snat, dsr or hybrid")),
        }
    }
}

/// How a backend is picked for a new flow (`--lb-algorithm`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LbAlgorithm {
    /// Uniformly at random (kube-proxy's behaviour).
    #[default]
    Random,
    /// Maglev consistent hashing: every node picks the same backend for a
    /// flow (see `state::maglev`).
    Maglev,
}

impl LbAlgorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            LbAlgorithm::Random => "random",
            LbAlgorithm::Maglev => "maglev",
        }
    }
}

impl std::str::FromStr for LbAlgorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "random" => Ok(LbAlgorithm::Random),
            "maglev" => Ok(LbAlgorithm::Maglev),
            other => Err(format!("`{other}`: expected random or maglev")),
        }
    }
}

/// A Service's own choice (annotations), each part optional.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbChoice {
    pub mode: Option<LbMode>,
    pub algorithm: Option<LbAlgorithm>,
}

/// The node's defaults for Services that do not choose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbDefaults {
    pub mode: LbMode,
    pub algorithm: LbAlgorithm,
}

impl ServicePort {
    /// `namespace/name:port_name`, as logs and `inspect` show it.
    pub fn id(&self) -> String {
        format!("{}/{}:{}", self.namespace, self.name, self.port_name)
    }

    /// Its identity across syncs.
    pub fn name(&self) -> ServicePortName {
        ServicePortName {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            port_name: self.port_name.clone(),
            proto: self.proto,
            family: self.family,
        }
    }

    /// kube-proxy's "externally accessible": a NodePort, an external IP or
    /// a LoadBalancer ingress IP.
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Runs on this node.
    pub local: bool,
    /// Kept by topology-aware routing (true when it does not apply). Only
    /// these form the cluster set; the local set ignores topology.
    pub in_topology: bool,
}

/// What the node contributes (addresses of both families; a Service port
/// uses those of its own).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    /// Addresses NodePorts are served on (from nodePortAddresses).
    pub node_port_addresses: Vec<IpAddr>,
    /// The node's own IPs (source ranges: a node inside a range lets the LB
    /// IPs in as sources too). The node serves the families they have.
    pub node_ips: Vec<IpAddr>,
    /// Load-balancing defaults (`--lb-mode`, `--lb-algorithm`).
    pub lb: LbDefaults,
}

impl NodeContext {
    /// Whether the node serves `family` (has an IP of it): Service ports of
    /// another family are not programmed, as kube-proxy runs no proxier for
    /// a family the node lacks.
    pub fn serves(&self, family: IpFamily) -> bool {
        self.node_ips.iter().any(|ip| IpFamily::of(ip) == family)
    }
}
