//! Running the datapath on the sandbox's nodes and programming Services into
//! it through the agent's own code path (desired state → diff → maps).

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use dataplane_agent::{
    dataplane::{Datapath, DatapathConfig, LoadOptions, XdpMode},
    net::{IpFamily, Ipv4Cidr, Protocol},
    state::{
        desired,
        diff::Programmer,
        inputs::{Endpoint, LbAlgorithm, LbMode, NodeContext, ServicePort},
    },
};

use crate::cluster::{CLUSTER_CIDR, Cluster, EXTERNAL_DEVICE};

/// Service CIDR of the sandbox.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The IPv6 service CIDR of a dual-stack sandbox.
pub const SERVICE_CIDR6: &str = "fd00:10:96::/112";
/// Where the sandbox's LoadBalancer and external IPs live; the client routes
/// it through node1 (like an upstream router would).
pub const EXTERNAL_VIP_RANGE: &str = "198.19.0.0/24";

/// A Service port with endpoints placed on nodes; turned into each node's
/// [`ServicePort`] (which endpoints are local depends on the node).
#[derive(Clone, Debug)]
pub struct TestService {
    pub id: u32,
    pub port: ServicePort,
    pub endpoints: Vec<TestEndpoint>,
}

#[derive(Clone, Copy, Debug)]
pub struct TestEndpoint {
    pub addr: IpAddr,
    pub port: u16,
    pub node: usize,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl TestEndpoint {
    pub fn ready(addr: impl Into<IpAddr>, port: u16, node: usize) -> Self {
        Self {
            addr: addr.into(),
            port,
            node,
            ready: true,
            serving: true,
            terminating: false,
        }
    }
    pub fn terminating(mut self) -> Self {
        self.ready = false;
        self.terminating = true;
        self
    }
}

impl TestService {
    pub fn new(id: u32, name: &str, proto: Protocol, port: u16) -> Self {
        Self {
            id,
            port: ServicePort {
                namespace: "default".into(),
                name: name.into(),
                port_name: "".into(),
                proto,
                family: IpFamily::V4,
                port,
                cluster_ips: Vec::new(),
                node_port: None,
                external_ips: Vec::new(),
                load_balancer_ips: Vec::new(),
                load_balancer_source_ranges: Vec::new(),
                external_policy_local: false,
                internal_policy_local: false,
                affinity_timeout: None,
                endpoints: Vec::new(),
                lb: Default::default(),
            },
            endpoints: Vec::new(),
        }
    }
    /// A ClusterIP; the first one's family is the Service port's.
    pub fn cluster_ip(mut self, ip: impl Into<IpAddr>) -> Self {
        let ip = ip.into();
        if self.port.cluster_ips.is_empty() {
            self.port.family = IpFamily::of(&ip);
        }
        self.port.cluster_ips.push(ip);
        self
    }
    pub fn node_port(mut self, port: u16) -> Self {
        self.port.node_port = Some(port);
        self
    }
    pub fn external_ip(mut self, ip: impl Into<IpAddr>) -> Self {
        self.port.external_ips.push(ip.into());
        self
    }
    pub fn load_balancer_ip(mut self, ip: impl Into<IpAddr>) -> Self {
        self.port.load_balancer_ips.push(ip.into());
        self
    }
    pub fn source_range(mut self, cidr: &str) -> Self {
        self.port
            .load_balancer_source_ranges
            .push(cidr.parse().expect("cidr"));
        self
    }
    pub fn external_local(mut self) -> Self {
        self.port.external_policy_local = true;
        self
    }
    pub fn internal_local(mut self) -> Self {
        self.port.internal_policy_local = true;
        self
    }
    pub fn affinity(mut self, timeout: Duration) -> Self {
        self.port.affinity_timeout = Some(timeout);
        self
    }
    /// Its own `--lb-mode` (the annotation's way).
    pub fn lb_mode(mut self, mode: LbMode) -> Self {
        self.port.lb.mode = Some(mode);
        self
    }
    /// Maglev for it (the annotation's way).
    pub fn maglev(mut self) -> Self {
        self.port.lb.algorithm = Some(LbAlgorithm::Maglev);
        self
    }
    pub fn endpoint(mut self, ep: TestEndpoint) -> Self {
        self.endpoints.push(ep);
        self
    }

    /// The Service port as node `node` sees it.
    pub fn for_node(&self, node: usize) -> ServicePort {
        let mut port = self.port.clone();
        port.endpoints = self
            .endpoints
            .iter()
            .map(|e| Endpoint {
                addr: e.addr,
                port: e.port,
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                local: e.node == node,
                in_topology: true,
            })
            .collect();
        port
    }
}

/// The datapath of one sandbox node, with the agent's programmer.
pub struct NodeDatapath {
    pub datapath: Datapath,
    /// The config written at start; change it and [`NodeDatapath::reconfigure`].
    pub config: DatapathConfig,
    pub programmer: Programmer,
    pub node: usize,
    pub node_ip: Ipv4Addr,
    /// The node's IPv6 address on a dual-stack sandbox.
    pub node_ip6: Option<std::net::Ipv6Addr>,
}

impl NodeDatapath {
    /// Writes `self.config` again (after a change).
    pub fn reconfigure(&mut self) {
        self.datapath
            .maps_mut()
            .set_config(&self.config)
            .expect("write config");
    }

    /// Programs exactly `services` (anything else programmed before is
    /// removed), as the agent's sync does.
    pub fn program(&mut self, services: &[&TestService]) {
        let ports: Vec<(u32, ServicePort)> = services.iter().map(|s| (s.id, s.for_node(self.node))).collect();
        let ips: Vec<IpAddr> = std::iter::once(IpAddr::V4(self.node_ip))
            .chain(self.node_ip6.map(IpAddr::V6))
            .collect();
        let node = NodeContext {
            node_port_addresses: ips.clone(),
            node_ips: ips,
            lb: Default::default(),
        };
        let table = desired::compute(ports.iter().map(|(id, p)| (*id, p)), &node);
        assert!(
            table.problems.is_empty(),
            "unexpected problems: {:?}",
            table.problems
        );
        self.programmer
            .sync(self.datapath.maps_mut(), &table)
            .expect("programming the maps");
    }
}

impl Cluster {
    /// Loads the datapath for node `node`, attaches it to the node's
    /// external device and to the host side of every pod on the node, and
    /// writes the node's config.
    pub fn start_datapath(&self, node: usize) -> NodeDatapath {
        let opts = LoadOptions {
            max_services: 1024,
            max_backends: 1024,
            max_service_entries: 8192,
            ct_entries: 8192,
            affinity_entries: 1024,
            ipv6: true,
        };
        self.start_datapath_with(node, &opts, XdpMode::Auto)
    }

    /// As [`Cluster::start_datapath`], with chosen map sizes and XDP mode
    /// (`Auto` runs the ingress path in TC on the sandbox's veth devices).
    pub fn start_datapath_with(&self, node: usize, opts: &LoadOptions, xdp_mode: XdpMode) -> NodeDatapath {
        let mut datapath = Datapath::load_with(opts).expect("load the datapath");
        let n = &self.nodes[node];
        datapath
            .attach_cgroup(n.cgroup.path())
            .expect("attach the connect-time programs to the node's cgroup");
        let pod_veths: Vec<String> = self
            .pods
            .iter()
            .filter(|p| p.node == node)
            .map(|p| p.host_veth.clone())
            .collect();
        let trusted = n
            .ns()
            .run(|| -> Result<_, dataplane_agent::dataplane::DatapathError> {
                let external = datapath.attach_external(EXTERNAL_DEVICE, xdp_mode)?;
                for veth in &pod_veths {
                    datapath.attach_pod_interface(veth)?;
                }
                // As the agent: egress trusts the ingress word of the devices
                // where our TC ingress runs (none of them stacked here).
                let tc_external = (external.ingress == dataplane_common::names::TC_INGRESS)
                    .then_some(EXTERNAL_DEVICE.to_owned());
                Ok(pod_veths
                    .iter()
                    .cloned()
                    .chain(tc_external)
                    .map(|d| crate::netns::ifindex(&d))
                    .collect::<std::collections::BTreeSet<u32>>())
            })
            .expect("attach the datapath");
        datapath
            .maps_mut()
            .set_hint_devices(&trusted)
            .expect("write the trusted devices");
        let mut config = DatapathConfig::new(n.ip());
        config.cluster_cidr = Some(CLUSTER_CIDR.parse::<Ipv4Cidr>().unwrap());
        config.service_cidrs = vec![SERVICE_CIDR.parse().unwrap()];
        // The node's own namespace is the "host" of connect-time translation.
        config.host_netns_cookie = n.ns().run(dataplane_agent::dataplane::current_netns_cookie);
        datapath.maps_mut().set_config(&config).expect("write config");
        NodeDatapath {
            config,
            datapath,
            programmer: Programmer::new(opts.max_backends),
            node,
            node_ip: n.ip(),
            node_ip6: None,
        }
    }
}
