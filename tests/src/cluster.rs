//! A small cluster in network namespaces: one L2 segment (a bridge in its own
//! namespace) joining an external client and two nodes; pods hang off the
//! nodes on veth pairs.
//!
//! ```text
//!                 switch (br0)                       198.18.0.0/24 ("LAN")
//!        ┌────────────┼────────────┐
//!   client .100    node1 .11     node2 .12           eth0 in each
//!                  │  pods          │  pods          10.244.1.0/24, 10.244.2.0/24
//! ```
//! Pods have a /32 on `eth0` and a default route via the node's gateway
//! address (10.244.N.1, held by every host-side veth of that node); the node
//! has a /32 route per pod and routes the other node's pod CIDR via the other
//! node's LAN address. IPv6 is disabled everywhere so counters only see what a
//! test sends. Nothing here touches the root network namespace.
//!
//! Like frames from a physical wire, frames here carry complete checksums:
//! transmit checksum offload is off on every veth (XDP sees raw frames and
//! cannot know an skb's CHECKSUM_PARTIAL state). The switch ports run a
//! pass-through XDP program (`xdp_floor`): veth delivers XDP_TX frames (the
//! datapath's ICMP rejects) only to a peer that runs XDP.

use std::net::Ipv4Addr;

use crate::{
    bpffs::BpffsDir,
    netns::{NetNs, ip_batch},
    unique_prefix,
};

pub const LAN_PREFIX_LEN: u8 = 24;
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
pub const NODE_IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(198, 18, 0, 11), Ipv4Addr::new(198, 18, 0, 12)];
/// Pod CIDR of node `i` is 10.244.(i+1).0/24.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// Name of the external device inside every host namespace.
pub const EXTERNAL_DEVICE: &str = "eth0";

/// A host on the LAN: the external client or a node.
#[derive(Debug)]
pub struct Host {
    pub ns: NetNs,
    pub ip: Ipv4Addr,
}

/// A node: a host that forwards, with pods.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub host: Host,
    /// The node's own processes for connect-time translation (a dedicated
    /// cgroup: never the root one).
    pub cgroup: crate::cgroup::CgroupDir,
    pub index: usize,
    next_pod: u8,
}

impl Node {
    pub fn ns(&self) -> &NetNs {
        &self.host.ns
    }
    pub fn ip(&self) -> Ipv4Addr {
        self.host.ip
    }
    pub fn pod_cidr(&self) -> String {
        format!("10.244.{}.0/24", self.index + 1)
    }
    pub fn pod_gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 244, self.index as u8 + 1, 1)
    }
}

/// A pod: its own namespace, `eth0` with a /32, host-side veth on its node.
#[derive(Debug)]
pub struct Pod {
    pub name: String,
    pub ns: NetNs,
    pub ip: Ipv4Addr,
    pub node: usize,
    /// Host-side veth name in the node namespace.
    pub host_veth: String,
}

/// The whole sandbox. Dropping it deletes every namespace (and so every
/// device and attachment in them) and its bpffs directory; fields drop in
/// declaration order, pods before nodes before the switch.
pub struct Cluster {
    /// The switch ports' pass-through XDP (dropped, so detached, first).
    _port_xdp: aya::Ebpf,
    pub pods: Vec<Pod>,
    pub nodes: Vec<Node>,
    pub client: Host,
    switch: NetNs,
    pub bpffs: BpffsDir,
    prefix: String,
}

impl Cluster {
    /// Builds client, switch and two nodes. Panics with a clear message when
    /// the machine cannot (not root, no network namespaces).
    pub fn new() -> Self {
        crate::require_privileges();
        let prefix = unique_prefix();
        let switch = NetNs::new(&format!("{prefix}-sw"));
        quiet_ipv6(&switch);
        switch.ip_batch("link add br0 type bridge\nlink set br0 up\n");

        let client = Host {
            ns: NetNs::new(&format!("{prefix}-client")),
            ip: CLIENT_IP,
        };
        plug_into_lan(&client, &switch, "client");

        let nodes: Vec<Node> = NODE_IPS
            .iter()
            .enumerate()
            .map(|(index, &ip)| {
                let name = format!("node{}", index + 1);
                let host = Host {
                    ns: NetNs::new(&format!("{prefix}-{name}")),
                    ip,
                };
                plug_into_lan(&host, &switch, &name);
                host.ns.sysctl("net/ipv4/ip_forward", "1");
                // Translated flows are forwarded out the device they came in
                // on; redirects to the client would only be noise.
                for key in ["all", "default", EXTERNAL_DEVICE] {
                    host.ns
                        .sysctl(&format!("net/ipv4/conf/{key}/send_redirects"), "0");
                }
                Node {
                    cgroup: crate::cgroup::CgroupDir::new(&format!("{prefix}-{name}")),
                    name,
                    host,
                    index,
                    next_pod: 10,
                }
            })
            .collect();
        // Each node reaches the other node's pods through the other node.
        for node in &nodes {
            let other = &nodes[1 - node.index];
            node.ns()
                .ip_batch(&format!("route add {} via {}\n", other.pod_cidr(), other.ip()));
        }

        let port_xdp = switch.run(|| pass_through_xdp(&["client", "node1", "node2"]));
        let bpffs = BpffsDir::new(&prefix);
        Self {
            _port_xdp: port_xdp,
            pods: Vec::new(),
            nodes,
            client,
            switch,
            bpffs,
            prefix,
        }
    }

    /// Adds a pod named `name` on node `node` (0 or 1) and returns its index
    /// in [`Cluster::pods`].
    pub fn add_pod(&mut self, node: usize, name: &str) -> usize {
        let index = self.pods.len();
        let n = &mut self.nodes[node];
        let host_byte = n.next_pod;
        n.next_pod += 1;
        let ip = Ipv4Addr::new(10, 244, node as u8 + 1, host_byte);
        let gw = n.pod_gateway();
        let ns = NetNs::new(&format!("{}-p{index}", self.prefix));
        quiet_ipv6(&ns);
        // Host-side name: unique per node, at most 15 bytes.
        let host_veth = format!("veth{index}{}", &name[..name.len().min(9)]);
        n.ns().ip_batch(&format!(
            "link add {host_veth} type veth peer name eth0 netns {pod}\n\
             addr add {gw}/32 dev {host_veth}\n\
             link set {host_veth} up\n\
             route add {ip}/32 dev {host_veth} scope link\n",
            pod = ns.name(),
        ));
        n.ns()
            .sysctl(&format!("net/ipv4/conf/{host_veth}/rp_filter"), "0");
        n.ns().ethtool_features(&host_veth, &["tx", "off"]);
        ns.ethtool_features("eth0", &["tx", "off"]);
        ns.ip_batch(&format!(
            "addr add {ip}/32 dev eth0\n\
             link set eth0 up\n\
             route add {gw} dev eth0 scope link\n\
             route add default via {gw} dev eth0\n"
        ));
        self.pods.push(Pod {
            name: name.to_owned(),
            ns,
            ip,
            node,
            host_veth,
        });
        index
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod named {name}"))
    }

    /// The external client reaches `prefix` (e.g. an LB IP range) through
    /// node `node`, as an upstream router would route it.
    pub fn route_from_client(&self, prefix: &str, node: usize) {
        self.client
            .ns
            .ip_batch(&format!("route replace {prefix} via {}\n", self.nodes[node].ip()));
    }

    /// Prefix of every name this sandbox owns (namespaces, bpffs directory).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The switch namespace (for tests that need to watch the wire).
    pub fn switch(&self) -> &NetNs {
        &self.switch
    }
}

impl Default for Cluster {
    fn default() -> Self {
        Self::new()
    }
}

fn quiet_ipv6(ns: &NetNs) {
    ns.sysctl("net/ipv6/conf/all/disable_ipv6", "1");
    ns.sysctl("net/ipv6/conf/default/disable_ipv6", "1");
}

/// Gives `host` an `eth0` on the LAN bridge with its address.
fn plug_into_lan(host: &Host, switch: &NetNs, port: &str) {
    quiet_ipv6(&host.ns);
    for key in ["all", "default"] {
        host.ns.sysctl(&format!("net/ipv4/conf/{key}/rp_filter"), "0");
    }
    host.ns.ip_batch(&format!(
        "link add {EXTERNAL_DEVICE} type veth peer name {port} netns {sw}\n\
         addr add {ip}/{LAN_PREFIX_LEN} dev {EXTERNAL_DEVICE}\n\
         link set {EXTERNAL_DEVICE} up\n",
        sw = switch.name(),
        ip = host.ip,
    ));
    ip_batch(
        switch.name(),
        &format!("link set {port} master br0\nlink set {port} up\n"),
    );
    host.ns.ethtool_features(EXTERNAL_DEVICE, &["tx", "off"]);
    switch.ethtool_features(port, &["tx", "off"]);
}

/// Loads the datapath object with minimal maps and attaches its
/// `xdp_floor` (parse, pass) to `ports` of the calling thread's namespace.
fn pass_through_xdp(ports: &[&str]) -> aya::Ebpf {
    use dataplane_common::names;
    let mut loader = aya::EbpfLoader::new();
    for map in names::ALL_MAPS {
        loader.map_max_entries(map, 1);
    }
    let mut ebpf = loader
        .load(dataplane_agent::dataplane::EBPF_OBJECT)
        .expect("load the eBPF object for the switch ports");
    let prog: &mut aya::programs::Xdp = ebpf
        .program_mut(names::XDP_FLOOR)
        .expect("xdp_floor")
        .try_into()
        .expect("xdp program");
    prog.load().expect("load xdp_floor");
    for port in ports {
        prog.attach(port, aya::programs::XdpMode::default())
            .unwrap_or_else(|e| panic!("attach xdp_floor to switch port {port}: {e}"));
    }
    ebpf
}
