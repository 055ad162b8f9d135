//! The address plan of the BPF_PROG_TEST_RUN fixtures, once per family
//! ([`V4`], [`V6`]), and the ingress fixtures' Services programmed on it
//! ([`datapath`]): a fixture table or test written once as a function of a
//! [`Plan`] runs for both families ([`for_both_families!`]), so that a
//! verdict rule added once is checked for IPv4 and IPv6.
//!
//! The IPv4 plan's node is single-stack (198.18.0.11); the IPv6 plan's is
//! dual-stack (198.18.0.11 and 2001:db8::11), its Services beside the
//! IPv4 half of a dual-stack one.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use dataplane_agent::{dataplane::Datapath, net::Protocol};

use crate::{
    packet::{icmp_error, icmp6_error},
    services::{TestEndpoint, TestService},
    testrun::fixture_datapath_configured,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

/// One family's addresses.
#[derive(Debug)]
pub struct Plan {
    pub family: Family,
    /// The node's address of this family.
    pub node: IpAddr,
    /// Every address of the node (the IPv6 plan's node is dual-stack).
    pub node_ips: &'static [IpAddr],
    /// A client on the node's network.
    pub client: IpAddr,
    /// A router on the node's network.
    pub router: IpAddr,
    /// Pods on this node (the endpoints' one, another) and on node2.
    pub local_pod: IpAddr,
    pub other_local_pod: IpAddr,
    pub remote_pod: IpAddr,
    /// The LB IP of `lb-local` (eTP=Local), the external IP of `ext-udp`
    /// (eTP=Local), the LB IP of `ranged` (source ranges) and of
    /// `np-cluster-local` (eTP=Cluster, the `lb-local` backend).
    pub lb_local: IpAddr,
    pub ext_udp: IpAddr,
    pub lb_ranged: IpAddr,
    pub lb_cluster_local: IpAddr,
    /// `cip`'s ClusterIP.
    pub cluster_ip: IpAddr,
    /// `ranged`'s loadBalancerSourceRanges, and a client inside it.
    pub source_range: &'static str,
    pub in_range: IpAddr,
    /// An address outside every Service and the service CIDR.
    pub elsewhere: IpAddr,
    /// An address of the service CIDR no Service has.
    pub unallocated: IpAddr,
    /// The IP header's length without options or extension headers.
    pub ip_header_len: usize,
}

const fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

#[allow(clippy::too_many_arguments)]
const fn v6(a: u16, b: u16, c: u16, d: u16, e: u16, f: u16, g: u16, h: u16) -> IpAddr {
    IpAddr::V6(Ipv6Addr::new(a, b, c, d, e, f, g, h))
}

pub const V4: Plan = Plan {
    family: Family::V4,
    node: v4(198, 18, 0, 11),
    node_ips: &[v4(198, 18, 0, 11)],
    client: v4(198, 18, 0, 100),
    router: v4(198, 18, 0, 1),
    local_pod: v4(10, 244, 1, 10),
    other_local_pod: v4(10, 244, 1, 20),
    remote_pod: v4(10, 244, 2, 10),
    lb_local: v4(198, 19, 0, 10),
    ext_udp: v4(198, 19, 0, 20),
    lb_ranged: v4(198, 19, 0, 30),
    lb_cluster_local: v4(198, 19, 0, 40),
    cluster_ip: v4(10, 96, 0, 10),
    source_range: "203.0.113.0/24",
    in_range: v4(203, 0, 113, 7),
    elsewhere: v4(1, 1, 1, 1),
    unallocated: v4(10, 96, 9, 9),
    ip_header_len: 20,
};

pub const V6: Plan = Plan {
    family: Family::V6,
    node: v6(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11),
    node_ips: &[v4(198, 18, 0, 11), v6(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11)],
    client: v6(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100),
    router: v6(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1),
    local_pod: v6(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x10),
    other_local_pod: v6(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x20),
    remote_pod: v6(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 0x10),
    lb_local: v6(0x2001, 0xdb8, 0x19, 0, 0, 0, 0, 0x10),
    ext_udp: v6(0x2001, 0xdb8, 0x19, 0, 0, 0, 0, 0x20),
    lb_ranged: v6(0x2001, 0xdb8, 0x19, 0, 0, 0, 0, 0x30),
    lb_cluster_local: v6(0x2001, 0xdb8, 0x19, 0, 0, 0, 0, 0x40),
    cluster_ip: v6(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10),
    source_range: "2001:db8:203::/48",
    in_range: v6(0x2001, 0xdb8, 0x203, 0, 0, 0, 0, 7),
    elsewhere: v6(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 1),
    unallocated: v6(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x999),
    ip_header_len: 40,
};

/// ICMP errors by meaning, as each family says them.
#[derive(Clone, Copy, Debug)]
pub enum IcmpError {
    /// "Fragmentation needed" (ICMP 3/4) or "packet too big" (ICMPv6 2/0).
    TooBig(u16),
    /// Port unreachable (ICMP 3/3, ICMPv6 1/4).
    PortUnreachable,
}

impl Plan {
    pub fn name(&self) -> &'static str {
        match self.family {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    pub fn sa(&self, ip: IpAddr, port: u16) -> SocketAddr {
        assert_eq!(
            ip.is_ipv4(),
            self.family == Family::V4,
            "{ip} in the {} plan",
            self.name()
        );
        SocketAddr::new(ip, port)
    }

    /// The loopback address.
    pub fn localhost(&self) -> IpAddr {
        match self.family {
            Family::V4 => Ipv4Addr::LOCALHOST.into(),
            Family::V6 => Ipv6Addr::LOCALHOST.into(),
        }
    }

    /// The ClusterIP of fixture Service `id` (other than `cip`):
    /// 10.96.1.id, fd00:10:96::100 + id.
    pub fn service_ip(&self, id: u32) -> IpAddr {
        match self.family {
            Family::V4 => v4(10, 96, 1, id as u8),
            Family::V6 => v6(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x100 + id as u16),
        }
    }

    /// Pod `i` of node2 (`i` below 0x100).
    pub fn node2_pod(&self, i: u16) -> IpAddr {
        match self.family {
            Family::V4 => v4(10, 244, 2, i as u8),
            Family::V6 => v6(0xfd00, 0x10, 0x244, 2, 0, 0, 0, i),
        }
    }

    /// The `spread` Service's 4 endpoints (node2).
    pub fn spread_pods(&self) -> Vec<IpAddr> {
        (1..=4).map(|i| self.node2_pod(20 + i)).collect()
    }

    /// The `sticky` Service's 8 endpoints (node2): 10.244.2.101-108,
    /// fd00:10:244:2::101-108.
    pub fn sticky_pods(&self) -> Vec<IpAddr> {
        (1..=8)
            .map(|i| match self.family {
                Family::V4 => v4(10, 244, 2, 100 + i as u8),
                Family::V6 => self.node2_pod(0x100 + i),
            })
            .collect()
    }

    /// Client `i` of `source_range` (`i` below 0x100).
    pub fn range_client(&self, i: u16) -> IpAddr {
        match self.family {
            Family::V4 => v4(203, 0, 113, i as u8),
            Family::V6 => v6(0x2001, 0xdb8, 0x203, 0, 0, 0, 0, i),
        }
    }

    /// An Ethernet frame carrying the ICMP (ICMPv6) error `error` from
    /// `src` to `dst` about the packet of `about` (see
    /// [`icmp_error`], [`icmp6_error`]).
    pub fn icmp_error(&self, src: IpAddr, dst: IpAddr, error: IcmpError, about: &[u8]) -> Vec<u8> {
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let (t, c, mtu) = match error {
                    IcmpError::TooBig(mtu) => (3, 4, mtu),
                    IcmpError::PortUnreachable => (3, 3, 0),
                };
                icmp_error(s, d, t, c, mtu, about)
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let (t, c, mtu) = match error {
                    IcmpError::TooBig(mtu) => (2, 0, mtu),
                    IcmpError::PortUnreachable => (1, 4, 0),
                };
                icmp6_error(s, d, t, c, mtu.into(), about)
            }
            _ => panic!("an ICMP error from {src} to {dst}"),
        }
    }
}

/// The ingress fixtures' Services on `p`'s addresses, as node1 (endpoints
/// on node1 are local, on node2 remote):
///
/// | id | name | frontend | endpoints |
/// |----|------|----------|-----------|
/// | 1 | np-cluster | NodePort 30080 | remote:8080 |
/// | 2 | lb-local | LB IP `lb_local`:80, eTP=Local | local:8080 |
/// | 3 | ext-udp | UDP external IP `ext_udp`:53, eTP=Local | local:5353 |
/// | 4 | empty | NodePort 30081 | none |
/// | 5 | local-none | NodePort 30082, eTP=Local | remote:8080 |
/// | 6 | ranged | LB IP `lb_ranged`:80, source ranges | remote:8080 |
/// | 7 | cip | ClusterIP `cluster_ip`:80 | remote:8080 |
/// | 8 | spread | NodePort 30083 | 4 on node2 |
/// | 9 | sctp | SCTP NodePort 30090, eTP=Local | local:9090 |
/// | 10 | np-cluster-local | NodePort 30084, LB IP `lb_cluster_local`:80 | local:8080 |
/// | 11 | sticky | NodePort 30111, ClientIP affinity | 8 on node2 |
///
/// Every Service but `cip` has the ClusterIP [`Plan::service_ip`]. The
/// IPv6 plan's node also has `cip`'s IPv4 half (id 17: [`V4`]'s
/// `cluster_ip`, its `remote_pod`), as the model splits a dual-stack
/// Service.
pub fn services(p: &Plan) -> Vec<TestService> {
    let local = |port| TestEndpoint::ready(p.local_pod, port, 0);
    let remote = |port| TestEndpoint::ready(p.remote_pod, port, 1);
    let svc = |id, name, proto, port| TestService::new(id, name, proto, port).cluster_ip(p.service_ip(id));
    let mut services = vec![
        svc(1, "np-cluster", Protocol::Tcp, 80)
            .node_port(30080)
            .endpoint(remote(8080)),
        svc(2, "lb-local", Protocol::Tcp, 80)
            .load_balancer_ip(p.lb_local)
            .external_local()
            .endpoint(local(8080)),
        svc(3, "ext-udp", Protocol::Udp, 53)
            .external_ip(p.ext_udp)
            .external_local()
            .endpoint(local(5353)),
        svc(4, "empty", Protocol::Tcp, 80).node_port(30081),
        svc(5, "local-none", Protocol::Tcp, 80)
            .node_port(30082)
            .external_local()
            .endpoint(remote(8080)),
        svc(6, "ranged", Protocol::Tcp, 80)
            .load_balancer_ip(p.lb_ranged)
            .source_range(p.source_range)
            .endpoint(remote(8080)),
        TestService::new(7, "cip", Protocol::Tcp, 80)
            .cluster_ip(p.cluster_ip)
            .endpoint(remote(8080)),
        p.spread_pods()
            .into_iter()
            .fold(svc(8, "spread", Protocol::Tcp, 80).node_port(30083), |s, ip| {
                s.endpoint(TestEndpoint::ready(ip, 8080, 1))
            }),
        svc(9, "sctp", Protocol::Sctp, 9999)
            .node_port(30090)
            .external_local()
            .endpoint(local(9090)),
        // The lb-local backend behind a masqueraded frontend as well.
        svc(10, "np-cluster-local", Protocol::Tcp, 80)
            .node_port(30084)
            .load_balancer_ip(p.lb_cluster_local)
            .endpoint(local(8080)),
        p.sticky_pods().into_iter().fold(
            svc(11, "sticky", Protocol::Tcp, 80)
                .node_port(30111)
                .affinity(Duration::from_secs(600)),
            |s, ip| s.endpoint(TestEndpoint::ready(ip, 8080, 1)),
        ),
    ];
    if p.family == Family::V6 {
        services.push(
            TestService::new(17, "cip", Protocol::Tcp, 80)
                .cluster_ip(V4.cluster_ip)
                .endpoint(TestEndpoint::ready(V4.remote_pod, 8080, 1)),
        );
    }
    services
}

/// A private datapath (nothing attached) holding [`services`] of `p`, as
/// node1.
pub fn datapath(p: &Plan) -> Datapath {
    fixture_datapath_configured(p.node_ips, &services(p), |_| {})
}

/// Tests `$name::ipv4` and `$name::ipv6` calling `$body(&V4)` and
/// `$body(&V6)`: `for_both_families!(fn my_table => check_my_table);`.
#[macro_export]
macro_rules! for_both_families {
    ($(fn $name:ident => $body:ident;)+) => {
        $(
            mod $name {
                #[test]
                fn ipv4() {
                    super::$body(&$crate::plan::V4);
                }
                #[test]
                fn ipv6() {
                    super::$body(&$crate::plan::V6);
                }
            }
        )+
    };
}
