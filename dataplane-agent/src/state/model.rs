//! Inputs of the desired-state computation.

use std::{net::Ipv4Addr, time::Duration};

use crate::net::{Ipv4Cidr, Protocol};

/// One port of one Service, for one IP family (IPv4), with its endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub namespace: String,
    pub name: String,
    /// The port's name (may be empty).
    pub port_name: String,
    pub proto: Protocol,
    pub port: u16,
    pub cluster_ips: Vec<Ipv4Addr>,
    pub node_port: Option<u16>,
    pub external_ips: Vec<Ipv4Addr>,
    /// LoadBalancer ingress IPs with ipMode VIP (or unset); ipMode Proxy
    /// ones are left out before this point.
    pub load_balancer_ips: Vec<Ipv4Addr>,
    pub load_balancer_source_ranges: Vec<Ipv4Cidr>,
    /// externalTrafficPolicy: Local.
    pub external_policy_local: bool,
    /// internalTrafficPolicy: Local.
    pub internal_policy_local: bool,
    /// sessionAffinity: ClientIP, with its timeout.
    pub affinity_timeout: Option<Duration>,
    /// After topology filtering and duplicate resolution.
    pub endpoints: Vec<Endpoint>,
}

impl ServicePort {
    /// `namespace/name:port_name`, as logs and `inspect` show it.
    pub fn id(&self) -> String {
        format!("{}/{}:{}", self.namespace, self.name, self.port_name)
    }

    /// kube-proxy's "externally accessible": a NodePort, an external IP or
    /// a LoadBalancer ingress IP.
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub addr: Ipv4Addr,
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

/// What the node contributes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeContext {
    /// Addresses NodePorts are served on (from nodePortAddresses).
    pub node_port_addresses: Vec<Ipv4Addr>,
    /// The node's own IPs (source ranges: a node inside a range lets the LB
    /// IPs in as sources too).
    pub node_ips: Vec<Ipv4Addr>,
}
