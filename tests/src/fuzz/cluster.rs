//! The node the fuzzer programs: a dual-stack node's addresses, each
//! family's clients, routers and frontends, and the Services (the same set
//! in both families).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use dataplane_agent::net::{IpFamily, Protocol};

use crate::services::{TestEndpoint, TestService};

pub const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
pub const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11);
const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 10);
const LOCAL_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x10);
const REMOTE_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 0x10);
pub(super) const SNAT_PORTS: (u16, u16) = (1024, 32767);
/// The DSR Service's NodePort (its backend is local).
pub(super) const DSR_NODE_PORT: u16 = 30083;

/// One family's addresses, as the Services and the seeds use them.
pub(super) struct Fam {
    pub(super) v6: bool,
    pub(super) node: IpAddr,
    pub(super) local_pod: IpAddr,
    pub(super) remote_pod: IpAddr,
    /// Off-cluster, inside the ranged Service's source range, a pod of this
    /// node, a backend, the node.
    pub(super) clients: [IpAddr; 5],
    /// Where ICMP errors come from.
    pub(super) router: IpAddr,
    /// Nobody's.
    pub(super) elsewhere: IpAddr,
    /// In the service CIDR, no Service's.
    pub(super) unallocated: IpAddr,
    /// Frontend addresses: the eTP=Local LB IP, the UDP external IP, the
    /// source-ranged LB IP, two ClusterIPs.
    pub(super) lb_local: IpAddr,
    pub(super) ext_udp: IpAddr,
    pub(super) lb_ranged: IpAddr,
    pub(super) cip: IpAddr,
    pub(super) cip_hairpin: IpAddr,
    pub(super) source_range: &'static str,
}

pub(super) fn fam(v6: bool) -> Fam {
    let v4 = |a, b, c, d| IpAddr::V4(Ipv4Addr::new(a, b, c, d));
    let v6a = |a, b, c, d, h| IpAddr::V6(Ipv6Addr::new(a, b, c, d, 0, 0, 0, h));
    if v6 {
        Fam {
            v6,
            node: NODE6.into(),
            local_pod: LOCAL_POD6.into(),
            remote_pod: REMOTE_POD6.into(),
            clients: [
                v6a(0x2001, 0xdb8, 0, 0, 0x100),
                v6a(0x2001, 0xdb8, 0x203, 0, 7),
                v6a(0xfd00, 0x10, 0x244, 1, 0x20),
                LOCAL_POD6.into(),
                NODE6.into(),
            ],
            router: v6a(0x2001, 0xdb8, 0, 0, 1),
            elsewhere: v6a(0x2001, 0x4860, 0, 0, 0x8888),
            unallocated: v6a(0xfd00, 0x10, 0x96, 0, 0x999),
            lb_local: v6a(0x2001, 0xdb8, 0x19, 0, 0x10),
            ext_udp: v6a(0x2001, 0xdb8, 0x19, 0, 0x20),
            lb_ranged: v6a(0x2001, 0xdb8, 0x19, 0, 0x30),
            cip: v6a(0xfd00, 0x10, 0x96, 0, 0x10),
            cip_hairpin: v6a(0xfd00, 0x10, 0x96, 0, 0x11),
            source_range: "2001:db8:203::/64",
        }
    } else {
        Fam {
            v6,
            node: NODE.into(),
            local_pod: LOCAL_POD.into(),
            remote_pod: REMOTE_POD.into(),
            clients: [
                v4(198, 18, 0, 100),
                v4(203, 0, 113, 7),
                v4(10, 244, 1, 20),
                LOCAL_POD.into(),
                NODE.into(),
            ],
            router: v4(198, 18, 0, 1),
            elsewhere: v4(1, 1, 1, 1),
            unallocated: v4(10, 96, 0, 99),
            lb_local: v4(198, 19, 0, 10),
            ext_udp: v4(198, 19, 0, 20),
            lb_ranged: v4(198, 19, 0, 30),
            cip: v4(10, 96, 0, 10),
            cip_hairpin: v4(10, 96, 0, 11),
            source_range: "203.0.113.0/24",
        }
    }
}

/// The node's SNAT address in a family.
pub(super) fn snat_ip(v6: bool) -> IpAddr {
    if v6 { NODE6.into() } else { NODE.into() }
}

pub(super) fn is_service_cidr(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(a) => a.octets()[..2] == [10, 96],
        IpAddr::V6(a) => a.segments()[..7] == [0xfd00, 0x10, 0x96, 0, 0, 0, 0],
    }
}

/// The Services of one family: the same set in both, ids of IPv6 ones
/// +32 (the fixture datapath holds 64 Services).
fn services_of(v6: bool) -> Vec<TestService> {
    let f = fam(v6);
    let local = |port| TestEndpoint::ready(f.local_pod, port, 0);
    let remote = |port| TestEndpoint::ready(f.remote_pod, port, 1);
    let new = |id: u32, name: &str, proto, port| {
        let mut s = TestService::new(if v6 { id + 32 } else { id }, name, proto, port);
        if v6 {
            s.port.family = IpFamily::V6;
        }
        s
    };
    vec![
        new(1, "np-cluster", Protocol::Tcp, 80)
            .node_port(30080)
            .maglev()
            .endpoint(remote(8080))
            .endpoint(local(8080)),
        new(2, "lb-local", Protocol::Tcp, 80)
            .load_balancer_ip(f.lb_local)
            .external_local()
            .endpoint(local(8080)),
        new(3, "ext-udp", Protocol::Udp, 53)
            .external_ip(f.ext_udp)
            .node_port(30053)
            .endpoint(local(5353))
            .endpoint(remote(5353)),
        new(4, "empty", Protocol::Tcp, 80).node_port(30081),
        new(5, "local-none", Protocol::Tcp, 80)
            .node_port(30082)
            .external_local()
            .endpoint(remote(8080)),
        new(6, "ranged", Protocol::Tcp, 80)
            .load_balancer_ip(f.lb_ranged)
            .source_range(f.source_range)
            .endpoint(remote(8080)),
        new(7, "cip", Protocol::Tcp, 80)
            .cluster_ip(f.cip)
            .endpoint(remote(8080))
            .endpoint(local(8080)),
        new(8, "cip-udp", Protocol::Udp, 53)
            .cluster_ip(f.cip)
            .endpoint(remote(5353)),
        new(9, "hairpin", Protocol::Tcp, 81)
            .cluster_ip(f.cip_hairpin)
            .endpoint(local(8081)),
        new(10, "sctp", Protocol::Sctp, 9000)
            .node_port(30090)
            .endpoint(remote(9090))
            .endpoint(local(9090)),
        // DSR with a local backend: translated here unmasqueraded, and
        // encapsulated packets to it through the frontend (from whichever
        // node) taken apart and translated.
        new(11, "dsr", Protocol::Tcp, 80)
            .node_port(DSR_NODE_PORT)
            .lb_mode(dataplane_agent::state::inputs::LbMode::Dsr)
            .endpoint(local(8082)),
    ]
}

pub(super) fn services() -> Vec<TestService> {
    let mut all = services_of(false);
    all.extend(services_of(true));
    all
}
