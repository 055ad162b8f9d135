//! Which host interfaces face pods, read from a snapshot of the node's
//! links, addresses and routes (pure: no IO; the daemon follows the node's
//! changes and attaches to what this finds, the preflight reports it):
//! - **Routed (ptp) CNIs** (Calico, kindnet, AWS VPC CNI, Cilium in
//!   routing mode...): the host end of each pod's veth carries a direct
//!   route to the pod (`10.244.1.10 dev cali1234 scope link`). A veth (or
//!   netkit) device with a unicast route through it and no gateway is a pod
//!   interface, whatever its name.
//! - **Bridge CNIs** (flannel, the reference `bridge` plugin, docker0-like
//!   setups): pods' veths are ports of a bridge that holds their gateway
//!   address (`cni0` with 10.244.1.1/24). Every veth port of a bridge that
//!   holds an address is a pod interface.
//!
//! External devices (those holding the node IPs, or `--devices`) never are;
//! neither are tunnels (vxlan, wireguard, ipip...: they carry other nodes'
//! pods, whose Service traffic was translated where it started). A name
//! pattern (`--pod-interfaces`) replaces discovery entirely when given.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use serde::Serialize;

use super::interfaces::{Address, Link, Route, RouteType};

/// Why an interface is a pod interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "reason", rename_all = "camelCase")]
pub enum Why {
    /// It matches a `--pod-interfaces` pattern.
    Pattern { pattern: String },
    /// A route to pods leads through it (routed CNIs).
    Route { route: String },
    /// It is a port of a bridge holding a pod gateway address.
    BridgePort { bridge: String, gateway: String },
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::Pattern { pattern } => write!(f, "matches --pod-interfaces {pattern}"),
            Why::Route { route } => write!(f, "route {route} leads through it"),
            Why::BridgePort { bridge, gateway } => {
                write!(f, "port of bridge {bridge}, which holds {gateway}")
            }
        }
    }
}

/// Device kinds whose host end faces one pod.
fn pod_facing_kind(link: &Link) -> bool {
    matches!(link.kind.as_deref(), Some("veth" | "netkit"))
}

/// The pod interfaces of a snapshot of the node's links, addresses and
/// routes (pure: no IO). `external` are the node's external devices.
pub fn discover(
    links: &[Link],
    addresses: &[Address],
    routes: &[Route],
    external: &[String],
) -> BTreeMap<String, Why> {
    let by_index: BTreeMap<u32, &Link> = links.iter().map(|l| (l.index, l)).collect();
    let is_external = |l: &Link| external.contains(&l.name);
    let mut out = BTreeMap::new();
    // Routed CNIs: a direct route through a pod-facing device that is not
    // a bridge port (ports are found through their bridge below). The most
    // specific route names the reason.
    // IPv6 link-local prefixes (fe80::/64 on every IPv6 interface) say
    // nothing about pods.
    let link_local = |r: &Route| matches!(r.destination, IpAddr::V6(v6) if v6.is_unicast_link_local());
    let mut direct: Vec<&Route> = routes
        .iter()
        .filter(|r| r.kind == RouteType::Unicast && r.gateway.is_none() && !link_local(r))
        .collect();
    direct.sort_by_key(|r| std::cmp::Reverse(r.prefix_len));
    for r in direct {
        let Some(link) = r.oif.and_then(|i| by_index.get(&i)) else {
            continue;
        };
        if pod_facing_kind(link) && link.master.is_none() && !is_external(link) {
            out.entry(link.name.clone()).or_insert_with(|| Why::Route {
                route: format!("{}/{}", r.destination, r.prefix_len),
            });
        }
    }
    // Bridge CNIs: veth ports of a bridge that holds an address.
    for bridge in links
        .iter()
        .filter(|l| l.kind.as_deref() == Some("bridge") && !is_external(l))
    {
        let Some(gateway) = addresses
            .iter()
            .filter(|a| a.link == bridge.index)
            // IPv4 first, then IPv6 (not link-local: every bridge has one).
            .filter(|a| !matches!(a.addr, IpAddr::V6(v6) if v6.is_unicast_link_local()))
            .min_by_key(|a| a.addr.is_ipv6())
        else {
            continue;
        };
        for port in links
            .iter()
            .filter(|l| l.master == Some(bridge.index) && pod_facing_kind(l) && !is_external(l))
        {
            out.entry(port.name.clone()).or_insert_with(|| Why::BridgePort {
                bridge: bridge.name.clone(),
                gateway: format!("{}/{}", gateway.addr, gateway.prefix_len),
            });
        }
    }
    out
}

/// The interfaces matching `patterns` (the `--pod-interfaces` override).
pub fn by_pattern(links: &[Link], patterns: &[String], external: &[String]) -> BTreeMap<String, Why> {
    links
        .iter()
        .filter(|l| !external.contains(&l.name) && l.name != "lo")
        .filter_map(|l| {
            let pattern = patterns
                .iter()
                .find(|p| interface_matches(std::slice::from_ref(p), &l.name))?;
            Some((
                l.name.clone(),
                Why::Pattern {
                    pattern: pattern.clone(),
                },
            ))
        })
        .collect()
}

/// Whether the route the kernel takes to a local endpoint leads through an
/// attached interface (or a bridge with an attached port). `None` route:
/// the address is unreachable from the node.
pub fn reaches_attached(route: Option<&Route>, links: &[Link], attached: &BTreeSet<u32>) -> bool {
    let Some(oif) = route.and_then(|r| r.oif) else {
        return false;
    };
    attached.contains(&oif)
        || links
            .iter()
            .any(|l| l.master == Some(oif) && attached.contains(&l.index))
}

/// One local endpoint the datapath cannot reach (its route does not lead through an attached
/// interface: replies would leave untranslated).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnreachableEndpoint {
    pub address: IpAddr,
    /// A Service port it backs (`namespace/name:port`).
    pub service: String,
    /// Where its route leads instead (`eth0`, `no route`).
    pub route: String,
}

/// The devices whose ingress word egress may trust (see
/// `dataplane_common::hint`): those of `tc` (indexes of devices where our
/// TC ingress runs, writing a word on every packet) that share no stack
/// with another device of `hooked` (where an ingress hook of ours runs) or
/// carrying any XDP program. On a stack (a VLAN, macvlan or ipvlan on its
/// parent, a bond or bridge over its ports, an Open vSwitch port and the
/// switch's other ports, at any depth) a packet passes the lower device's
/// hook and then the upper's, and the first could translate what the second
/// judges untranslated.
pub fn hint_devices(links: &[Link], tc: &BTreeSet<u32>, hooked: &BTreeSet<u32>) -> BTreeSet<u32> {
    let by_index: BTreeMap<u32, &Link> = links.iter().map(|l| (l.index, l)).collect();
    let mut ports: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for l in links {
        if let Some(m) = l.master {
            ports.entry(m).or_default().push(l.index);
        }
    }
    let ovs = |i: &u32| {
        by_index
            .get(i)
            .is_some_and(|l| l.kind.as_deref() == Some("openvswitch"))
    };
    // Every device a packet received on `top` may have been received on
    // before: its parent, its ports, theirs...; for an Open vSwitch port,
    // the switch's other ports (the datapath delivers to internal ports).
    let below = |top: u32| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![top];
        while let Some(i) = todo.pop() {
            let l = by_index.get(&i);
            let parent = l.and_then(|l| l.lower);
            let switch = l.and_then(|l| l.master).filter(ovs);
            let siblings = switch.iter().flat_map(|m| ports.get(m)).flatten().copied();
            let own = ports.get(&i).into_iter().flatten().copied();
            for d in parent.into_iter().chain(own).chain(siblings) {
                if d != top && seen.insert(d) {
                    todo.push(d);
                }
            }
        }
        seen
    };
    let hooked: BTreeSet<u32> = hooked
        .iter()
        .chain(tc)
        .copied()
        .chain(links.iter().filter(|l| l.xdp.is_some()).map(|l| l.index))
        .collect();
    let under: BTreeMap<u32, BTreeSet<u32>> = hooked.iter().map(|&h| (h, below(h))).collect();
    tc.iter()
        .copied()
        .filter(|&d| {
            !under.iter().any(|(&h, below_h)| {
                h != d && (below_h.contains(&d) || under.get(&d).is_some_and(|b| b.contains(&h)))
            })
        })
        .collect()
}

/// `*` at the end matches any suffix; otherwise exact.
pub fn interface_matches(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == p,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An up link without XDP or address (shared with the preflight's tests).
    pub(crate) fn link(index: u32, name: &str, kind: Option<&str>, master: Option<u32>) -> Link {
        Link {
            index,
            name: name.into(),
            up: true,
            master,
            lower: None,
            kind: kind.map(Into::into),
            xdp: None,
            mac: None,
        }
    }

    #[test]
    fn egress_trusts_the_word_of_devices_on_no_stack_with_another_hook() {
        let on = |index, name, lower| Link {
            lower: Some(lower),
            ..link(index, name, Some("vlan"), None)
        };
        let links = vec![
            link(2, "eth0", None, Some(9)),
            link(3, "eth1", None, Some(9)),
            link(4, "eth2", None, None),
            on(5, "eth2.100", 4),
            link(9, "bond0", Some("bond"), None),
            on(10, "bond0.7", 9),
            link(20, "veth1", Some("veth"), None),
            link(21, "veth2", Some("veth"), Some(30)),
            link(30, "cni0", Some("bridge"), None),
            link(40, "ovs-system", Some("openvswitch"), None),
            link(41, "eth3", None, Some(40)),
            link(42, "br-ex", Some("openvswitch"), Some(40)),
        ];
        let set = |v: &[u32]| v.iter().copied().collect::<BTreeSet<u32>>();
        let trusted = |tc: &[u32], other: &[u32]| hint_devices(&links, &set(tc), &set(other));
        // Side by side: every one.
        assert_eq!(trusted(&[4, 20, 21], &[]), set(&[4, 20, 21]));
        // A VLAN in TC on a parent in XDP (auto mode on a NIC): not the VLAN.
        assert_eq!(trusted(&[5, 20], &[4]), set(&[20]));
        // Both in TC: neither.
        assert_eq!(trusted(&[4, 5], &[]), set(&[]));
        // Two levels: a port of a bond and a VLAN on the bond.
        assert_eq!(trusted(&[2, 10], &[]), set(&[]));
        // A bridge port and its bridge (--pod-interfaces patterns).
        assert_eq!(trusted(&[21, 30], &[]), set(&[]));
        // An Open vSwitch uplink and the switch's internal port.
        assert_eq!(trusted(&[41, 42], &[]), set(&[]));
        // A hook left from an earlier run (a pinned link) on the parent.
        assert_eq!(trusted(&[5], &[4]), set(&[]));
        // An XDP program we did not attach counts as a hook.
        let mut with_xdp = links.clone();
        with_xdp[2].xdp = Some(super::super::interfaces::XdpProgram {
            id: 7,
            mode: super::super::interfaces::XdpAttachMode::Native,
        });
        assert_eq!(hint_devices(&with_xdp, &set(&[5]), &set(&[])), set(&[]));
    }

    fn route(dst: &str, len: u8, oif: u32, gateway: Option<&str>) -> Route {
        Route {
            destination: dst.parse().unwrap(),
            prefix_len: len,
            oif: Some(oif),
            gateway: gateway.map(|g| g.parse().unwrap()),
            table: 254,
            kind: RouteType::Unicast,
        }
    }

    fn addr(link: u32, a: &str, len: u8) -> Address {
        Address {
            link,
            addr: a.parse().unwrap(),
            prefix_len: len,
        }
    }

    fn names(m: &BTreeMap<String, Why>) -> Vec<&str> {
        m.keys().map(String::as_str).collect()
    }

    #[test]
    fn routed_cni_host_ends_are_found_by_their_routes_whatever_their_names() {
        let links = [
            link(1, "lo", None, None),
            link(2, "eth0", Some("veth"), None),
            link(3, "pod3f2a1", Some("veth"), None),
            link(4, "cali12ab", Some("veth"), None),
            // No route yet: the CNI has not finished wiring it.
            link(5, "pod9", Some("veth"), None),
            link(6, "vxlan.calico", Some("vxlan"), None),
            link(7, "wg0", Some("wireguard"), None),
        ];
        let routes = [
            route("198.18.0.0", 24, 2, None),
            route("0.0.0.0", 0, 2, Some("198.18.0.1")),
            route("10.244.1.10", 32, 3, None),
            route("10.244.1.11", 32, 4, None),
            route("10.244.2.0", 24, 6, Some("10.244.2.0")),
            route("10.244.3.0", 24, 7, None),
            // Every IPv6 interface's link-local prefix, an unwired veth's too.
            route("fe80::", 64, 5, None),
            route("fe80::", 64, 3, None),
        ];
        let found = discover(&links, &[], &routes, &["eth0".into()]);
        assert_eq!(names(&found), ["cali12ab", "pod3f2a1"]);
        assert_eq!(
            found["pod3f2a1"],
            Why::Route {
                route: "10.244.1.10/32".into()
            }
        );
        assert_eq!(
            found["pod3f2a1"].to_string(),
            "route 10.244.1.10/32 leads through it"
        );
    }

    #[test]
    fn bridge_cni_ports_are_found_through_the_bridge_holding_the_gateway() {
        let links = [
            link(2, "eth0", None, None),
            link(3, "cni0", Some("bridge"), None),
            link(4, "vethab", Some("veth"), Some(3)),
            link(5, "vethcd", Some("veth"), Some(3)),
            link(6, "flannel.1", Some("vxlan"), None),
            // A bridge with no address (an L2-only switch) is not a pod bridge.
            link(7, "br-l2", Some("bridge"), None),
            link(8, "vethl2", Some("veth"), Some(7)),
            // The node's own bridge (holding the node IP) is external.
            link(9, "br0", Some("bridge"), None),
            link(10, "vethhost", Some("veth"), Some(9)),
        ];
        let addresses = [
            addr(3, "fe80::1", 64),
            addr(3, "10.244.1.1", 24),
            addr(7, "fe80::2", 64),
            addr(9, "198.18.0.11", 24),
        ];
        let routes = [
            route("10.244.1.0", 24, 3, None),
            route("10.244.2.0", 24, 6, Some("10.244.2.0")),
        ];
        let found = discover(&links, &addresses, &routes, &["br0".into()]);
        assert_eq!(names(&found), ["vethab", "vethcd"]);
        assert_eq!(
            found["vethab"].to_string(),
            "port of bridge cni0, which holds 10.244.1.1/24"
        );
    }

    #[test]
    fn patterns_replace_discovery() {
        let links = [
            link(2, "eth0", Some("veth"), None),
            link(3, "pod1", Some("veth"), None),
            link(4, "veth9", Some("veth"), None),
        ];
        let found = by_pattern(&links, &["veth*".into(), "eth0".into()], &["eth0".into()]);
        assert_eq!(names(&found), ["veth9"]);
        assert_eq!(found["veth9"].to_string(), "matches --pod-interfaces veth*");
    }

    #[test]
    fn an_endpoint_is_reachable_through_an_attached_interface_or_bridge_port() {
        let links = [
            link(2, "eth0", None, None),
            link(3, "cni0", Some("bridge"), None),
            link(4, "vethab", Some("veth"), Some(3)),
            link(5, "pod1", Some("veth"), None),
        ];
        let to = |oif| Route {
            oif: Some(oif),
            ..route("10.244.1.5", 32, oif, None)
        };
        let attached = BTreeSet::from([4, 5]);
        assert!(reaches_attached(Some(&to(5)), &links, &attached));
        assert!(
            reaches_attached(Some(&to(3)), &links, &attached),
            "via the bridge"
        );
        assert!(!reaches_attached(Some(&to(2)), &links, &attached));
        assert!(!reaches_attached(None, &links, &attached));
        assert!(!reaches_attached(Some(&to(3)), &links, &BTreeSet::from([5])));
    }

    #[test]
    fn reasons_serialize_with_a_tag() {
        let json = serde_json::to_value(Why::BridgePort {
            bridge: "cni0".into(),
            gateway: "10.244.1.1/24".into(),
        })
        .unwrap();
        assert_eq!(
            json,
            serde_json::json!({"reason": "bridgePort", "bridge": "cni0", "gateway": "10.244.1.1/24"})
        );
    }
}
