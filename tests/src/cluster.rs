//! A small cluster in network namespaces: one L2 segment (a bridge in its own
//! namespace) joining an external client and two nodes (three with
//! [`Cluster::with_nodes`]); pods hang off the nodes on veth pairs.
//!
//! ```text
//!                 switch (br0)                       198.18.0.0/24 ("LAN")
//!        ┌────────────┼────────────┬───────────┐
//!   client .100    node1 .11     node2 .12     (node3 .13)    eth0 in each
//!                  │  pods          │  pods       │ pods     10.244.N.0/24
//! ```
//! Pods have a /32 on `eth0` and a default route via the node's gateway
//! address (10.244.N.1, held by every host-side veth of that node); the node
//! has a /32 route per pod and routes the other node's pod CIDR via the other
//! node's LAN address. IPv6 is disabled everywhere so counters only see what a
//! test sends, except in a dual-stack sandbox ([`Cluster::dual_stack`]): there
//! every host and pod also has an IPv6 address (LAN 2001:db8::/64, node `i`'s
//! pods in fd00:10:244:(i+1)::/64, routed the same way), without router
//! advertisements, autoconfiguration or duplicate address detection. Nothing
//! here touches the root network namespace.
//!
//! Two wirings ([`Wiring`]): like hosts on a physical wire (complete
//! checksums, a pass-through XDP program on the switch ports so that a
//! node's XDP_TX frames reach the switch: native XDP works on the nodes), or
//! like kind/k3d nodes (veth as the kernel sets it up: partial checksums, no
//! XDP on the peer).
//!
//! Three pod layouts ([`PodLayout`]), as CNIs wire pods: routed with
//! `veth*` host ends (the above), routed with host ends named like no
//! common CNI's (`pod3f2a…`), or a `cni0` bridge holding the pods' gateway
//! 10.244.N.1/24 with the pods' veths as its ports (flannel, the `bridge`
//! plugin).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{
    bpffs::BpffsDir,
    netns::{NetNs, ip_batch},
    unique_prefix,
};

pub const LAN_PREFIX_LEN: u8 = 24;
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
/// The nodes' addresses (a sandbox has two, or three).
pub const NODE_IPS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(198, 18, 0, 11),
    Ipv4Addr::new(198, 18, 0, 12),
    Ipv4Addr::new(198, 18, 0, 13),
];
/// The LAN's IPv6 prefix length (2001:db8::/64) in a dual-stack sandbox.
pub const LAN6_PREFIX_LEN: u8 = 64;
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100);
pub const NODE_IPS6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11),
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x12),
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x13),
];
/// Pod CIDR of node `i` is 10.244.(i+1).0/24.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The IPv6 cluster CIDR of a dual-stack sandbox: node `i`'s pods are in
/// fd00:10:244:(i+1)::/64.
pub const CLUSTER_CIDR6: &str = "fd00:10:244::/56";
/// Name of the external device inside every host namespace.
pub const EXTERNAL_DEVICE: &str = "eth0";

/// A host on the LAN: the external client or a node.
#[derive(Debug)]
pub struct Host {
    pub ns: NetNs,
    pub ip: Ipv4Addr,
    /// Its IPv6 address in a dual-stack sandbox.
    pub ip6: Option<Ipv6Addr>,
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
    /// Its IPv6 address (dual-stack sandboxes only).
    pub fn ip6(&self) -> Ipv6Addr {
        self.host.ip6.expect("a dual-stack sandbox")
    }
    pub fn pod_cidr6(&self) -> String {
        format!("fd00:10:244:{}::/64", self.index + 1)
    }
    pub fn pod_gateway6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x10, 0x244, self.index as u16 + 1, 0, 0, 0, 1)
    }
    /// Its addresses, IPv4 first.
    pub fn ips(&self) -> Vec<IpAddr> {
        std::iter::once(IpAddr::V4(self.ip()))
            .chain(self.host.ip6.map(IpAddr::V6))
            .collect()
    }
}

/// A pod: its own namespace, `eth0` with a /32, host-side veth on its node.
#[derive(Debug)]
pub struct Pod {
    pub name: String,
    pub ns: NetNs,
    pub ip: Ipv4Addr,
    /// Its IPv6 address in a dual-stack sandbox.
    pub ip6: Option<Ipv6Addr>,
    pub node: usize,
    /// Host-side veth name in the node namespace.
    pub host_veth: String,
}

/// How the LAN and the pods are wired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wiring {
    /// Like hosts on a wire: frames carry complete checksums (transmit
    /// checksum offload off on every veth) and the switch ports run a
    /// pass-through XDP program, so a node's XDP_TX frames reach the
    /// switch. Native XDP works on the nodes' devices.
    Wire,
    /// Like kind, k3d or containerlab nodes: veth devices as the kernel
    /// sets them up (checksum offload on: skbs arrive CHECKSUM_PARTIAL)
    /// and no XDP program on the switch side, which drops XDP_TX frames.
    VethNode,
}

/// How pods are wired to their node (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodLayout {
    /// A /32 route per pod through its veth, host ends named `veth…`; the
    /// gateway address on every host end (kindnet- or Calico-like).
    Routed,
    /// As `Routed`, host ends named `pod3f2a…` (no common CNI's prefix).
    RoutedUnusualNames,
    /// A `cni0` bridge holding the gateway 10.244.N.1/24; pods on its
    /// subnet, their veths its ports.
    Bridge,
}

/// Name of the pod bridge in [`PodLayout::Bridge`].
pub const POD_BRIDGE: &str = "cni0";

/// The whole sandbox. Dropping it deletes every namespace (and so every
/// device and attachment in them) and its bpffs directory; fields drop in
/// declaration order, pods before nodes before the switch.
pub struct Cluster {
    /// The switch ports' pass-through XDP (dropped, so detached, first).
    _port_xdp: Option<aya::Ebpf>,
    pub wiring: Wiring,
    pub layout: PodLayout,
    /// Every host and pod also has an IPv6 address.
    pub dual_stack: bool,
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
        Self::with_wiring(Wiring::Wire)
    }

    /// Builds client, switch and two nodes, wired as `wiring` says.
    pub fn with_wiring(wiring: Wiring) -> Self {
        Self::with_layout(wiring, PodLayout::Routed)
    }

    /// Builds client, switch and two nodes, wired as `wiring` says, whose
    /// pods will be wired as `layout` says.
    pub fn with_layout(wiring: Wiring, layout: PodLayout) -> Self {
        Self::build(wiring, layout, false, 2)
    }

    /// A dual-stack sandbox: as [`Cluster::with_layout`], every host and
    /// pod with an IPv6 address too.
    pub fn dual_stack(wiring: Wiring, layout: PodLayout) -> Self {
        Self::build(wiring, layout, true, 2)
    }

    /// A dual-stack sandbox of `nodes` nodes (2 or 3), routed pods.
    pub fn with_nodes(nodes: usize, wiring: Wiring) -> Self {
        Self::build(wiring, PodLayout::Routed, true, nodes)
    }

    fn build(wiring: Wiring, layout: PodLayout, dual_stack: bool, nodes: usize) -> Self {
        assert!((2..=NODE_IPS.len()).contains(&nodes), "{nodes} nodes");
        crate::require_privileges();
        let prefix = unique_prefix();
        let switch = NetNs::new(&format!("{prefix}-sw"));
        quiet_ipv6(&switch);
        // Without multicast snooping the bridge floods neighbour
        // solicitations as a plain segment would.
        switch.ip_batch("link add br0 type bridge mcast_snooping 0\nlink set br0 up\n");

        let client = Host {
            ns: NetNs::new(&format!("{prefix}-client")),
            ip: CLIENT_IP,
            ip6: dual_stack.then_some(CLIENT_IP6),
        };
        plug_into_lan(&client, &switch, "client", wiring);

        let nodes: Vec<Node> = NODE_IPS[..nodes]
            .iter()
            .enumerate()
            .map(|(index, &ip)| {
                let name = format!("node{}", index + 1);
                let host = Host {
                    ns: NetNs::new(&format!("{prefix}-{name}")),
                    ip,
                    ip6: dual_stack.then_some(NODE_IPS6[index]),
                };
                plug_into_lan(&host, &switch, &name, wiring);
                host.ns.sysctl("net/ipv4/ip_forward", "1");
                if dual_stack {
                    host.ns.sysctl("net/ipv6/conf/all/forwarding", "1");
                }
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
        if layout == PodLayout::Bridge {
            for node in &nodes {
                node.ns().ip_batch(&format!(
                    "link add {POD_BRIDGE} type bridge\n\
                     addr add {}/24 dev {POD_BRIDGE}\n\
                     link set {POD_BRIDGE} up\n",
                    node.pod_gateway()
                ));
                if dual_stack {
                    node.ns().ip_batch(&format!(
                        "addr add {}/64 dev {POD_BRIDGE} nodad\n",
                        node.pod_gateway6()
                    ));
                }
            }
        }
        // Each node reaches the other nodes' pods through them.
        for node in &nodes {
            for other in nodes.iter().filter(|o| o.index != node.index) {
                node.ns()
                    .ip_batch(&format!("route add {} via {}\n", other.pod_cidr(), other.ip()));
                if dual_stack {
                    node.ns()
                        .ip_batch(&format!("route add {} via {}\n", other.pod_cidr6(), other.ip6()));
                }
            }
        }

        let ports: Vec<String> = std::iter::once("client".to_owned())
            .chain(nodes.iter().map(|n| n.name.clone()))
            .collect();
        let port_xdp = (wiring == Wiring::Wire).then(|| {
            let ports: Vec<&str> = ports.iter().map(String::as_str).collect();
            switch.run(|| pass_through_xdp(&ports))
        });
        let bpffs = BpffsDir::new(&prefix);
        Self {
            _port_xdp: port_xdp,
            wiring,
            layout,
            dual_stack,
            pods: Vec::new(),
            nodes,
            client,
            switch,
            bpffs,
            prefix,
        }
    }

    /// Adds a pod named `name` on node `node` (0, 1, 2) and returns its index
    /// in [`Cluster::pods`].
    pub fn add_pod(&mut self, node: usize, name: &str) -> usize {
        let index = self.pods.len();
        let n = &mut self.nodes[node];
        let host_byte = n.next_pod;
        n.next_pod += 1;
        let ip = Ipv4Addr::new(10, 244, node as u8 + 1, host_byte);
        let ip6 = self
            .dual_stack
            .then(|| Ipv6Addr::new(0xfd00, 0x10, 0x244, node as u16 + 1, 0, 0, 0, host_byte as u16));
        let gw = n.pod_gateway();
        let gw6 = n.pod_gateway6();
        let ns = NetNs::new(&format!("{}-p{index}", self.prefix));
        if self.dual_stack {
            ipv6_on(&ns);
        } else {
            quiet_ipv6(&ns);
        }
        // Host-side name: unique per node, at most 15 bytes.
        let host_veth = match self.layout {
            PodLayout::Routed => format!("veth{index}{}", &name[..name.len().min(9)]),
            PodLayout::RoutedUnusualNames => format!("pod3f2a{index}"),
            PodLayout::Bridge => format!("veth{:08x}", 0x3f2a_0000 + index),
        };
        let pod = ns.name();
        if self.layout == PodLayout::Bridge {
            n.ns().ip_batch(&format!(
                "link add {host_veth} type veth peer name eth0 netns {pod}\n\
                 link set {host_veth} master {POD_BRIDGE}\n\
                 link set {host_veth} up\n"
            ));
        } else {
            n.ns().ip_batch(&format!(
                "link add {host_veth} type veth peer name eth0 netns {pod}\n\
                 addr add {gw}/32 dev {host_veth}\n\
                 link set {host_veth} up\n\
                 route add {ip}/32 dev {host_veth} scope link\n"
            ));
            n.ns()
                .sysctl(&format!("net/ipv4/conf/{host_veth}/rp_filter"), "0");
        }
        if self.wiring == Wiring::Wire {
            n.ns().ethtool_features(&host_veth, &["tx", "off"]);
            ns.ethtool_features("eth0", &["tx", "off"]);
        }
        if self.layout == PodLayout::Bridge {
            ns.ip_batch(&format!(
                "addr add {ip}/24 dev eth0\n\
                 link set eth0 up\n\
                 route add default via {gw} dev eth0\n"
            ));
        } else {
            ns.ip_batch(&format!(
                "addr add {ip}/32 dev eth0\n\
                 link set eth0 up\n\
                 route add {gw} dev eth0 scope link\n\
                 route add default via {gw} dev eth0\n"
            ));
        }
        if let Some(ip6) = ip6 {
            if self.layout == PodLayout::Bridge {
                ns.ip_batch(&format!(
                    "addr add {ip6}/64 dev eth0 nodad\n\
                     route add default via {gw6} dev eth0\n"
                ));
            } else {
                // The gateway on every host end, as for IPv4.
                n.ns().ip_batch(&format!(
                    "addr add {gw6}/128 dev {host_veth} nodad\n\
                     route add {ip6}/128 dev {host_veth}\n"
                ));
                ns.ip_batch(&format!(
                    "addr add {ip6}/128 dev eth0 nodad\n\
                     route add {gw6} dev eth0\n\
                     route add default via {gw6} dev eth0\n"
                ));
            }
        }
        self.pods.push(Pod {
            name: name.to_owned(),
            ns,
            ip,
            ip6,
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

    /// The external client reaches `prefix` (e.g. an LB IP range, either
    /// family) through node `node`, as an upstream router would route it.
    pub fn route_from_client(&self, prefix: &str, node: usize) {
        let via: IpAddr = if prefix.contains(':') {
            self.nodes[node].ip6().into()
        } else {
            self.nodes[node].ip().into()
        };
        self.client
            .ns
            .ip_batch(&format!("route replace {prefix} via {via}\n"));
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

/// IPv6 on, as a statically configured host: no router advertisements or
/// solicitations, no autoconfiguration, no duplicate address detection
/// (addresses are usable at once).
fn ipv6_on(ns: &NetNs) {
    for key in ["all", "default"] {
        for (name, value) in [
            ("accept_ra", "0"),
            ("autoconf", "0"),
            ("router_solicitations", "0"),
            ("accept_dad", "0"),
            ("dad_transmits", "0"),
            ("disable_ipv6", "0"),
        ] {
            ns.sysctl(&format!("net/ipv6/conf/{key}/{name}"), value);
        }
    }
}

/// Gives `host` an `eth0` on the LAN bridge with its address(es).
fn plug_into_lan(host: &Host, switch: &NetNs, port: &str, wiring: Wiring) {
    if host.ip6.is_some() {
        ipv6_on(&host.ns);
    } else {
        quiet_ipv6(&host.ns);
    }
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
    if let Some(ip6) = host.ip6 {
        host.ns.ip_batch(&format!(
            "addr add {ip6}/{LAN6_PREFIX_LEN} dev {EXTERNAL_DEVICE} nodad\n"
        ));
    }
    ip_batch(
        switch.name(),
        &format!("link set {port} master br0\nlink set {port} up\n"),
    );
    if wiring == Wiring::Wire {
        host.ns.ethtool_features(EXTERNAL_DEVICE, &["tx", "off"]);
        switch.ethtool_features(port, &["tx", "off"]);
    }
}

/// Loads the datapath object with minimal maps and attaches its
/// `xdp_floor` (parse, pass) to `ports` of the calling thread's namespace.
pub fn pass_through_xdp(ports: &[&str]) -> aya::Ebpf {
    use dataplane_common::names;
    let mut loader = aya::EbpfLoader::new();
    for map in names::ALL_MAPS {
        loader.map_max_entries(map, names::min_entries(map));
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
