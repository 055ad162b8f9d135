//! Packet fuzzer: random and mutated frames through every packet program
//! with BPF_PROG_TEST_RUN, each output checked against a model of what the
//! program may do with it. One Service balances with Maglev, one by DSR to
//! a local backend, and encapsulated packets (DSR's) come among the frames:
//! one taken apart must be judged as its inner packet, translated. The datapath is a dual-stack node's: every
//! Service twice, an IPv4 and an IPv6 Service port, and frames of both
//! families (IPv6 ones with extension headers now and then). The model knows
//! the programmed Services and the flows the run has opened, not the
//! programs' code:
//!
//! - a frame may pass untouched, except at ingress a clean packet (it
//!   parses as the datapath parses, every checksum valid) to a frontend
//!   whose Service translates every flow from anybody (backends, no source
//!   ranges, an eTP=Local one with a local backend), from neither the node
//!   nor a backend: nothing but a DNAT may come of it (no drop, no
//!   reject);
//! - a changed frame must be one the datapath parses (no fragment, no IPsec,
//!   an IPv6 extension header chain it follows), parse, keep its length and
//!   its L2 header, and differ only in the fields its hook rewrites
//!   (ingress: the destination address and port, un-SNAT included; egress:
//!   the source; ICMP errors: the outer destination and the quoted packet's
//!   addresses, ports and L4 checksum), and only within the IP packet:
//!   never the TTL or hop limit, flow label, lengths, next headers or
//!   extension headers. Every checksum stays exactly as valid as it was
//!   (incremental updates carry an input's error over; a valid checksum
//!   stays valid; a zero UDP checksum stays zero: "none" in IPv4, invalid
//!   in IPv6);
//! - a translation must go where the model allows, by the flows the run
//!   opened (each frontend → backend translation it saw): a frontend's
//!   destination to one of its backends; the SNAT address (the node's, per
//!   family) of a backend's reply to the client of a flow to that backend;
//!   the source of a flow's forward packet to the SNAT address (port in
//!   range), of its reply to its frontend; an ICMP error's quote to a
//!   packet of a flow as its sender sent it (client → frontend, backend →
//!   client, backend → SNAT address), the outer destination (if changed) to
//!   that sender;
//! - a reject must be a well-formed ICMP (IPv4: type 3 code 3) or ICMPv6
//!   (type 1 code 4) port-unreachable for the frame, sent back from the
//!   address tried, quoting its IP header and 8 bytes, and only for a
//!   Service address; a drop only for a Service address or one in a
//!   service CIDR (10.96.0.0/16, fd00:10:96::/112).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use dataplane_agent::{
    dataplane::Datapath,
    net::{IpFamily, Protocol},
};
use dataplane_common::{names, stats::Event};

use crate::{
    packet::{
        Ext, Frame, ICMP, ICMPV6, SCTP, TCP, UDP, icmp_error, icmp6_echo_request, icmp6_error,
        internet_checksum, pseudo_header_of, sctp_crc_ok,
    },
    services::{TestEndpoint, TestService},
    testrun::{self, fixture_datapath_dual},
};

pub const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
pub const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11);
const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 10);
const LOCAL_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x10);
const REMOTE_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 0x10);
const SNAT_PORTS: (u16, u16) = (1024, 32767);
/// The DSR Service's NodePort (its backend is local).
const DSR_NODE_PORT: u16 = 30083;

/// splitmix64: deterministic, seedable, good enough to pick mutations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len() as u64) as usize]
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// One family's addresses, as the Services and the seeds use them.
struct Fam {
    v6: bool,
    node: IpAddr,
    local_pod: IpAddr,
    remote_pod: IpAddr,
    /// Off-cluster, inside the ranged Service's source range, a pod of this
    /// node, a backend, the node.
    clients: [IpAddr; 5],
    /// Where ICMP errors come from.
    router: IpAddr,
    /// Nobody's.
    elsewhere: IpAddr,
    /// In the service CIDR, no Service's.
    unallocated: IpAddr,
    /// Frontend addresses: the eTP=Local LB IP, the UDP external IP, the
    /// source-ranged LB IP, two ClusterIPs.
    lb_local: IpAddr,
    ext_udp: IpAddr,
    lb_ranged: IpAddr,
    cip: IpAddr,
    cip_hairpin: IpAddr,
    source_range: &'static str,
}

fn fam(v6: bool) -> Fam {
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
fn snat_ip(v6: bool) -> IpAddr {
    if v6 { NODE6.into() } else { NODE.into() }
}

fn is_service_cidr(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(a) => a.octets()[..2] == [10, 96],
        IpAddr::V6(a) => a.segments()[..7] == [0xfd00, 0x10, 0x96, 0, 0, 0, 0],
    }
}

/// A frontend the model knows: where it may go, and whether every clean
/// packet to it from a client (not the node, not a backend) is translated.
#[derive(Clone, Debug)]
struct Frontend {
    backends: BTreeSet<SocketAddr>,
    always: bool,
}

/// The programmed table, as the model sees it.
pub struct Model {
    frontends: BTreeMap<(IpAddr, u16, u8), Frontend>,
    /// The frontends of each family (IPv4, IPv6), to aim frames at.
    targets: [Vec<(IpAddr, u16, u8)>; 2],
    /// Addresses holding a frontend (rejects and drops may only touch these).
    service_addresses: BTreeSet<IpAddr>,
    backend_ips: BTreeSet<IpAddr>,
    /// Clients whose flows the run opened, and recent ones of each family
    /// to aim new frames at.
    clients: HashSet<SocketAddr>,
    recent: [Vec<SocketAddr>; 2],
    /// Recent flows of each family as the ingress programs translated them,
    /// and masqueraded packets as tc_egress sent them (SNAT address and
    /// port, backend, protocol): what replies and ICMP errors are aimed at.
    flows: [Vec<Flow>; 2],
    snat: [Vec<(SocketAddr, SocketAddr, u8)>; 2],
    remembered: usize,
    /// Every flow the run opened (the datapath may forget flows, the model
    /// does not): (client, frontend, protocol), and the frontends of each
    /// (backend, client, protocol).
    client_frontend: HashSet<(SocketAddr, SocketAddr, u8)>,
    backend_client: HashMap<(SocketAddr, SocketAddr, u8), BTreeSet<SocketAddr>>,
    /// Judging the inner packet of an encapsulated one (see `check`).
    decapsulating: bool,
}

/// A flow the run opened: client → frontend, translated to the backend.
#[derive(Clone, Copy, Debug)]
struct Flow {
    client: SocketAddr,
    frontend: SocketAddr,
    backend: SocketAddr,
    proto: u8,
}

/// Keeps `x` among 4096 recent ones in `v` (`n`, a running count, picks the
/// one it replaces).
fn remember<T>(v: &mut Vec<T>, x: T, n: usize) {
    if v.len() < 4096 {
        v.push(x);
    } else {
        v[n % 4096] = x;
    }
}

impl Model {
    fn opened(&mut self, flow: Flow) {
        let family = usize::from(flow.client.is_ipv6());
        self.remembered += 1;
        remember(&mut self.flows[family], flow, self.remembered);
        self.client_frontend
            .insert((flow.client, flow.frontend, flow.proto));
        self.backend_client
            .entry((flow.backend, flow.client, flow.proto))
            .or_default()
            .insert(flow.frontend);
        if self.clients.insert(flow.client) {
            remember(&mut self.recent[family], flow.client, self.clients.len());
        }
    }

    fn masqueraded(&mut self, snat: SocketAddr, backend: SocketAddr, proto: u8) {
        self.remembered += 1;
        remember(
            &mut self.snat[usize::from(snat.is_ipv6())],
            (snat, backend, proto),
            self.remembered,
        );
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
            .lb_mode(dataplane_agent::state::model::LbMode::Dsr)
            .endpoint(local(8082)),
    ]
}

fn services() -> Vec<TestService> {
    let mut all = services_of(false);
    all.extend(services_of(true));
    all
}

impl Model {
    fn new(svcs: &[TestService]) -> Self {
        let mut frontends = BTreeMap::new();
        let mut service_addresses = BTreeSet::new();
        let mut backend_ips = BTreeSet::new();
        for s in svcs {
            let p = s.for_node(0);
            let proto = match p.proto {
                Protocol::Udp => UDP,
                Protocol::Sctp => SCTP,
                Protocol::Tcp => TCP,
            };
            let backends: BTreeSet<SocketAddr> = s
                .endpoints
                .iter()
                .map(|e| SocketAddr::new(e.addr, e.port))
                .collect();
            backend_ips.extend(backends.iter().map(|b| b.ip()));
            // ClusterIPs translate whenever there are backends (iTP=Cluster);
            // external destinations also need a local backend under
            // eTP=Local (in-cluster sources get the cluster set, which holds
            // it too). Source ranges: not for every source.
            let ranged = !p.load_balancer_source_ranges.is_empty();
            let internal = !backends.is_empty() && !ranged;
            let external = internal && (!p.external_policy_local || s.endpoints.iter().any(|e| e.node == 0));
            let mut add = |addr: IpAddr, port: u16, always: bool| {
                service_addresses.insert(addr);
                frontends.insert(
                    (addr, port, proto),
                    Frontend {
                        backends: backends.clone(),
                        always,
                    },
                );
            };
            for ip in &p.cluster_ips {
                add(*ip, p.port, internal);
            }
            for ip in p.external_ips.iter().chain(&p.load_balancer_ips) {
                add(*ip, p.port, external);
            }
            if let Some(np) = p.node_port {
                add(snat_ip(p.family == IpFamily::V6), np, external);
            }
        }
        let targets = [false, true].map(|v6| {
            frontends
                .keys()
                .filter(|(a, _, _)| a.is_ipv6() == v6)
                .copied()
                .collect()
        });
        Self {
            frontends,
            targets,
            service_addresses,
            backend_ips,
            clients: HashSet::new(),
            recent: [Vec::new(), Vec::new()],
            flows: [Vec::new(), Vec::new()],
            snat: [Vec::new(), Vec::new()],
            remembered: 0,
            client_frontend: HashSet::new(),
            backend_client: HashMap::new(),
            decapsulating: false,
        }
    }

    /// A clean packet to a frontend that translates every flow, from a
    /// client that is neither the node nor a backend: the ingress programs
    /// must translate it (not pass it untouched, reject or drop it). Such a
    /// packet matches no conntrack entry but its own flow's `FWD_IN`, which
    /// translates it: `REP_IN` and `REP_OUT` entries are keyed by a
    /// backend's address as the source, `FWD_OUT` ones by a backend's as the
    /// destination, which no frontend is. Without an entry it is a new flow,
    /// which a Service with backends always gets.
    fn must_translate(&self, v: &View) -> bool {
        let Some((_, dport)) = v.ports else {
            return false;
        };
        v.clean()
            && v.src != snat_ip(v.v6)
            && !self.backend_ips.contains(&v.src)
            && self
                .frontends
                .get(&(v.dst, dport, v.proto))
                .is_some_and(|f| f.always)
    }
}

/// A frame as the model reads it: lenient, never panics.
#[derive(Clone, Debug, PartialEq, Eq)]
struct View {
    v6: bool,
    l3: usize,
    /// Where the L4 header starts (after IPv4 options or IPv6 extension
    /// headers) and where the IP packet ends.
    l4: usize,
    end: usize,
    src: IpAddr,
    dst: IpAddr,
    /// The L4 protocol (IPv6: the last next header seen).
    proto: u8,
    /// An IPv4 fragment, or an IPv6 fragment header in the chain.
    frag: bool,
    /// As the datapath parses: not a fragment, an IPv6 chain of at most 4
    /// hop-by-hop, routing and destination options headers (the L4 header
    /// within 200 bytes of the frame start; no AH, ESP, "no next header"),
    /// the L4 header whole (TCP's data offset at least 5). Only such frames
    /// may be translated, dropped or rejected.
    parsed: bool,
    ports: Option<(u16, u16)>,
    /// IPv4 header checksum (IPv6 has none: always true).
    ip_check_ok: bool,
    /// One's-complement residual of the L4 checksum (0 or 0xffff: valid),
    /// `None` for an IPv4 zero UDP checksum or when not computable.
    l4_residual: Option<u16>,
    /// A zero UDP checksum: "none" in IPv4, invalid in IPv6.
    udp_zero: bool,
    /// TCP: the data offset at least 5 and within the segment.
    tcp_clean: bool,
}

impl View {
    /// Whether the L4 checksum is valid; `None`: none (IPv4 zero UDP
    /// checksum) or not computable.
    fn l4_valid(&self) -> Option<bool> {
        if self.udp_zero {
            return (self.v6).then_some(false);
        }
        self.l4_residual.map(|x| x == 0 || x == 0xffff)
    }

    /// Parses cleanly, with ports, every checksum valid.
    fn clean(&self) -> bool {
        self.parsed
            && self.ports.is_some()
            && self.ip_check_ok
            && self.l4_valid() != Some(false)
            && (self.proto != TCP || self.tcp_clean)
    }

    fn icmp(&self) -> u8 {
        if self.v6 { ICMPV6 } else { ICMP }
    }
}

fn be16(f: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([f[at], f[at + 1]])
}

fn view(f: &[u8]) -> Option<View> {
    let mut l3 = 14;
    if f.len() < 14 {
        return None;
    }
    let mut et = be16(f, 12);
    let mut tags = 0;
    while (et == 0x8100 || et == 0x88a8) && tags < 2 {
        if f.len() < l3 + 4 {
            return None;
        }
        et = be16(f, l3 + 2);
        l3 += 4;
        tags += 1;
    }
    match et {
        0x0800 => view4(f, l3),
        0x86dd => view6(f, l3),
        _ => None,
    }
}

fn view4(f: &[u8], l3: usize) -> Option<View> {
    if f.len() < l3 + 20 || f[l3] >> 4 != 4 {
        return None;
    }
    let ihl = (f[l3] & 0x0f) as usize * 4;
    let tot = be16(f, l3 + 2) as usize;
    if ihl < 20 || tot < ihl || f.len() < l3 + tot {
        return None;
    }
    let ip = &f[l3..l3 + ihl];
    let head = Head {
        v6: false,
        l3,
        l4: l3 + ihl,
        end: l3 + tot,
        src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]).into(),
        dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]).into(),
        proto: ip[9],
        frag: be16(ip, 6) & 0x3fff != 0,
        walkable: true,
        ip_check_ok: internet_checksum(&[ip]) == 0,
    };
    Some(head.view(f))
}

fn view6(f: &[u8], l3: usize) -> Option<View> {
    if f.len() < l3 + 40 || f[l3] >> 4 != 6 {
        return None;
    }
    let payload = be16(f, l3 + 4) as usize;
    let end = l3 + 40 + payload;
    // A jumbogram or a truncated packet: the datapath's "malformed".
    if payload == 0 || end > f.len() {
        return None;
    }
    let addr = |at: usize| IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&f[at..at + 16]).unwrap()));
    let (mut next, mut at, mut frag, mut walkable) = (f[l3 + 6], l3 + 40, false, true);
    for _ in 0..4 {
        match next {
            0 | 43 | 60 => {
                if at + 2 > f.len() {
                    walkable = false;
                    break;
                }
                next = f[at];
                at += (f[at + 1] as usize + 1) * 8;
                if at > 200 {
                    walkable = false;
                    break;
                }
            }
            44 => {
                frag = true;
                break;
            }
            _ => break,
        }
    }
    // Still an extension header, IPsec, or "no next header".
    if !frag && matches!(next, 0 | 43 | 44 | 50 | 51 | 59 | 60) {
        walkable = false;
    }
    let head = Head {
        v6: true,
        l3,
        l4: at,
        end,
        src: addr(l3 + 8),
        dst: addr(l3 + 24),
        proto: next,
        frag,
        walkable,
        ip_check_ok: true,
    };
    Some(head.view(f))
}

/// An IP header as read, before its L4 header.
struct Head {
    v6: bool,
    l3: usize,
    l4: usize,
    end: usize,
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    frag: bool,
    walkable: bool,
    ip_check_ok: bool,
}

impl Head {
    fn view(self, f: &[u8]) -> View {
        let seg = f.get(self.l4..self.end).unwrap_or(&[]);
        let icmp = if self.v6 { ICMPV6 } else { ICMP };
        let doff = seg.get(12).map_or(0, |b| (b >> 4) as usize * 4);
        let whole = match self.proto {
            TCP => seg.len() >= 20 && doff >= 20,
            UDP => seg.len() >= 8,
            SCTP => seg.len() >= 12,
            p if p == icmp => seg.len() >= 8,
            _ => true,
        };
        let parsed = self.walkable && !self.frag && self.l4 <= self.end && whole;
        let mut v = View {
            v6: self.v6,
            l3: self.l3,
            l4: self.l4,
            end: self.end,
            src: self.src,
            dst: self.dst,
            proto: self.proto,
            frag: self.frag,
            parsed,
            ports: None,
            ip_check_ok: self.ip_check_ok,
            l4_residual: None,
            udp_zero: false,
            tcp_clean: false,
        };
        if !parsed {
            return v;
        }
        let sum = |proto| internet_checksum(&[&pseudo_header_of(self.src, self.dst, proto, seg.len()), seg]);
        let ports = || (be16(seg, 0), be16(seg, 2));
        match self.proto {
            TCP => {
                v.ports = Some(ports());
                v.l4_residual = Some(sum(TCP));
                v.tcp_clean = doff <= seg.len();
            }
            UDP => {
                v.ports = Some(ports());
                v.udp_zero = seg[6] == 0 && seg[7] == 0;
                if !v.udp_zero {
                    v.l4_residual = Some(sum(UDP));
                }
            }
            // A CRC32c, not a sum: 0 when right (or left to the device).
            SCTP => {
                v.ports = Some(ports());
                v.l4_residual = Some(u16::from(sctp_crc_ok(seg) != Some(true)));
            }
            ICMPV6 if self.v6 => v.l4_residual = Some(sum(ICMPV6)),
            ICMP if !self.v6 => v.l4_residual = Some(internet_checksum(&[seg])),
            _ => {}
        }
        v
    }
}

/// Which side of the tuple a program rewrites.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Ingress,
    Egress,
}

#[derive(Clone, Copy, Debug)]
struct Program {
    name: &'static str,
    side: Side,
    xdp: bool,
}

const PROGRAMS: [Program; 4] = [
    Program {
        name: names::XDP_INGRESS,
        side: Side::Ingress,
        xdp: true,
    },
    Program {
        name: names::TC_INGRESS,
        side: Side::Ingress,
        xdp: false,
    },
    Program {
        name: names::TC_POD_INGRESS,
        side: Side::Ingress,
        xdp: false,
    },
    Program {
        name: names::TC_EGRESS,
        side: Side::Egress,
        xdp: false,
    },
];

/// What a run found. Counts are of program runs (`packets`: of frames); the
/// `…6` ones count those of IPv6 packets among them.
#[derive(Debug, Default)]
pub struct Report {
    pub packets: u64,
    pub packets6: u64,
    pub runs: u64,
    pub untouched: u64,
    pub translated: u64,
    pub dropped: u64,
    pub rejected: u64,
    pub untouched6: u64,
    pub translated6: u64,
    pub dropped6: u64,
    pub rejected6: u64,
    /// Ingress runs of clean packets to a frontend that translates every
    /// flow (which must be translated), and the IPv6 ones.
    pub must_translate: u64,
    pub must_translate6: u64,
    /// Translated ICMP errors (included in `translated`), and the ICMPv6
    /// ones.
    pub icmp_translated: u64,
    pub icmp_translated6: u64,
    /// Frames the kernel would not run (too short to make an skb of).
    pub refused: u64,
    /// Drops of new flows whose client port and backend a live flow through
    /// another frontend holds (`drop_tuple_clash`, counted by the datapath):
    /// the fuzzer draws client ports from a small set, so it makes them.
    pub clashes: u64,
    /// Encapsulated packets taken apart (DSR's backend-node half).
    pub decapsulated: u64,
    /// Model violations: how many, and the first 20 (program, why, input
    /// frame as hex).
    pub violation_count: u64,
    pub violations: Vec<(String, String, String)>,
}

/// Runs `packets` frames (seeded by `seed`) through every packet program.
pub fn run(packets: u64, seed: u64) -> Report {
    let svcs = services();
    let dp = fixture_datapath_dual(NODE, NODE6, &svcs);
    let mut model = Model::new(&svcs);
    let mut rng = Rng::new(seed);
    let mut report = Report::default();
    let mut clashes_seen = 0;
    for _ in 0..packets {
        let input = frame(&mut rng, &model);
        let iv = view(&input);
        report.packets += 1;
        if iv.as_ref().is_some_and(|v| v.v6) {
            report.packets6 += 1;
        }
        for p in PROGRAMS {
            let Ok((verdict, out)) = run_one(&dp, p, &input) else {
                // The kernel builds no skb of a frame too short for the
                // headers it claims (no device would deliver one either).
                report.refused += 1;
                continue;
            };
            report.runs += 1;
            // Whether this run was a clash drop: the datapath's counter moved.
            let clash = verdict == verdicts(p).1 && {
                let n = dp.maps().counter(Event::DropTupleClash).map_or(0, |c| c.packets);
                let moved = n > clashes_seen;
                clashes_seen = n;
                moved
            };
            if let Err(why) = check(
                &mut model,
                p,
                &input,
                iv.as_ref(),
                (verdict, clash),
                &out,
                &mut report,
            ) {
                report.violation_count += 1;
                if report.violations.len() < 20 {
                    report.violations.push((p.name.to_owned(), why, hex(&input)));
                }
            }
        }
    }
    report
}

/// (verdict, output), or the kernel's refusal to run the frame at all.
fn run_one(dp: &Datapath, p: Program, input: &[u8]) -> Result<(u32, Vec<u8>), String> {
    let r = if p.xdp {
        testrun::try_run(dp.xdp_program(p.name).expect("program"), input, 1)
    } else {
        testrun::try_run(dp.tc(p.name).expect("program"), input, 1)
    };
    r.map(|(v, out, _)| (v, out)).map_err(|e| e.to_string())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn drop_of(p: Program) -> u32 {
    verdicts(p).1
}

/// Verdict numbers of a program type: (pass, drop, sent back).
fn verdicts(p: Program) -> (u32, u32, u32) {
    if p.xdp { (2, 1, 3) } else { (0, 2, 7) }
}

fn check(
    model: &mut Model,
    p: Program,
    input: &[u8],
    iv: Option<&View>,
    // The program's verdict, and whether it counted a tuple clash.
    (verdict, clash): (u32, bool),
    out: &[u8],
    r: &mut Report,
) -> Result<(), String> {
    let (pass, drop, back) = verdicts(p);
    // An encapsulated packet (DSR's) taken apart at an external device's
    // ingress: judged as its inner packet would be, which must have been
    // translated (a DSR frontend to its local backend).
    // (A drop of one is its inner flow's tuple clash, counted.)
    if p.side == Side::Ingress
        && p.name != names::TC_POD_INGRESS
        && verdict == drop_of(p)
        && iv.and_then(|v| decapsulated(input, v)).is_some()
    {
        if clash {
            r.clashes += 1;
            return Ok(());
        }
        return Err("dropped an encapsulated packet (no tuple clash counted)".into());
    }
    if p.side == Side::Ingress
        && p.name != names::TC_POD_INGRESS
        && verdict == pass
        && let Some(inner) = iv.and_then(|v| decapsulated(input, v))
        && out.len() == inner.len()
        && out != &inner[..]
    {
        r.decapsulated += 1;
        let inner_view = view(&inner);
        // A DSR NodePort reached on any node's address is the frontend.
        model.decapsulating = true;
        let judged = check(model, p, &inner, inner_view.as_ref(), (verdict, clash), out, r);
        model.decapsulating = false;
        return judged;
    }
    let v6 = iv.is_some_and(|v| v.v6);
    let must = p.side == Side::Ingress && iv.is_some_and(|v| model.must_translate(v));
    if must {
        r.must_translate += 1;
        r.must_translate6 += u64::from(v6);
    }
    if verdict == drop {
        r.dropped += 1;
        r.dropped6 += u64::from(v6);
        let iv = iv
            .filter(|v| v.parsed && v.ports.is_some())
            .ok_or("dropped a frame that is no TCP, UDP or SCTP packet the datapath parses")?;
        if !model.service_addresses.contains(&iv.dst) && !is_service_cidr(iv.dst) {
            return Err(format!("dropped a frame to {}, not a Service address", iv.dst));
        }
        // Nor for want of resources: the LRU conntrack (4096 entries) never
        // holds more than a few of a backend's 31,744 SNAT ports, of which
        // a new flow tries 33. A clash is the one reason (see `clashes`).
        if must && clash {
            r.clashes += 1;
            return Ok(());
        }
        if must {
            return Err(format!(
                "dropped a frame to {}, a frontend with backends",
                SocketAddr::new(iv.dst, iv.ports.unwrap_or_default().1)
            ));
        }
        return Ok(());
    }
    if verdict == back && p.side == Side::Ingress {
        r.rejected += 1;
        r.rejected6 += u64::from(v6);
        return check_reject(model, input, iv, out, must);
    }
    if verdict != pass {
        return Err(format!("verdict {verdict}"));
    }
    if out == input {
        r.untouched += 1;
        r.untouched6 += u64::from(v6);
        if must && let Some(iv) = iv {
            let (_, dport) = iv.ports.unwrap_or_default();
            return Err(format!(
                "a frame to a frontend passed untouched ({} -> {})",
                SocketAddr::new(iv.src, iv.ports.unwrap_or_default().0),
                SocketAddr::new(iv.dst, dport)
            ));
        }
        return Ok(());
    }
    r.translated += 1;
    r.translated6 += u64::from(v6);
    let iv = iv.ok_or("changed a frame that is not IP")?;
    if !iv.parsed {
        return Err("changed a frame the datapath does not parse (a fragment, IPsec, malformed)".into());
    }
    let ov = view(out)
        .filter(|v| v.parsed)
        .ok_or("the changed frame does not parse")?;
    if out.len() != input.len() || out[..iv.l3] != input[..iv.l3] {
        return Err("length or L2 header changed".into());
    }
    if let Some(i) = (iv.end..input.len()).find(|&i| input[i] != out[i]) {
        return Err(format!(
            "byte {i} changed beyond the IP packet (which ends at {})",
            iv.end
        ));
    }
    if ov.ip_check_ok != iv.ip_check_ok {
        return Err("IP header checksum validity changed".into());
    }
    if iv.udp_zero != ov.udp_zero {
        return Err("a zero UDP checksum was not kept zero (or became zero)".into());
    }
    if iv.l4_valid() != ov.l4_valid() {
        return Err(format!(
            "L4 checksum validity changed: {:?} -> {:?}",
            iv.l4_residual, ov.l4_residual
        ));
    }
    if (iv.proto, iv.l4, iv.end) != (ov.proto, ov.l4, ov.end) {
        return Err("protocol, header length or packet length changed".into());
    }
    if iv.proto == iv.icmp() {
        r.icmp_translated += 1;
        r.icmp_translated6 += u64::from(v6);
        return check_icmp(model, p, input, out, iv, &ov);
    }
    let (isp, idp) = iv.ports.ok_or("a frame without ports changed")?;
    let (osp, odp) = ov.ports.ok_or("ports vanished")?;
    // Only the hook's side of the tuple, and the checksums, may differ
    // (IPv6: no header checksum; hop limit, flow label, payload length and
    // extension headers stay).
    let (l3, l4) = (iv.l3, iv.l4);
    let (check_at, check_len) = match iv.proto {
        TCP => (l4 + 16, 2),
        SCTP => (l4 + 8, 4),
        _ => (l4 + 6, 2),
    };
    let (src_at, dst_at, alen) = if v6 {
        (l3 + 8, l3 + 24, 16)
    } else {
        (l3 + 12, l3 + 16, 4)
    };
    let side_fields: [(usize, usize); 2] = match p.side {
        Side::Ingress => [(dst_at, alen), (l4 + 2, 2)],
        Side::Egress => [(src_at, alen), (l4, 2)],
    };
    let allowed = |i: usize| {
        i < iv.end
            && (side_fields.iter().any(|(at, n)| i >= *at && i < at + n)
                || (!v6 && (l3 + 10..l3 + 12).contains(&i))
                || (check_at..check_at + check_len).contains(&i))
    };
    if let Some(i) = (0..input.len()).find(|&i| input[i] != out[i] && !allowed(i)) {
        return Err(format!("byte {i} changed outside the {:?} fields", p.side));
    }
    let in_snat_range = |port: u16| (SNAT_PORTS.0..=SNAT_PORTS.1).contains(&port);
    match p.side {
        Side::Ingress => {
            let (from, to) = ((iv.dst, idp, iv.proto), SocketAddr::new(ov.dst, odp));
            if osp != isp || ov.src != iv.src {
                return Err("ingress changed the source".into());
            }
            let frontend = model.frontends.get(&from).or_else(|| {
                // Taken apart by DSR's backend-node half: a NodePort on
                // another node's address.
                model
                    .decapsulating
                    .then(|| model.frontends.get(&(snat_ip(v6), idp, iv.proto)))
                    .flatten()
            });
            if let Some(fe) = frontend
                && fe.backends.contains(&to)
            {
                model.opened(Flow {
                    client: SocketAddr::new(iv.src, isp),
                    frontend: SocketAddr::new(iv.dst, idp),
                    backend: to,
                    proto: iv.proto,
                });
                return Ok(());
            }
            // A reply to a masqueraded flow, from its backend, to its client
            // (the SNAT port may be a NodePort's number too: the REP_IN
            // entry, keyed by the backend, decides).
            let from_backend = (SocketAddr::new(iv.src, isp), to, iv.proto);
            if iv.dst == snat_ip(v6) && in_snat_range(idp) && model.backend_client.contains_key(&from_backend)
            {
                return Ok(());
            }
            if frontend.is_some() {
                return Err(format!(
                    "{} translated to {to}, not one of its backends",
                    SocketAddr::new(iv.dst, idp)
                ));
            }
            if iv.dst == snat_ip(v6) && in_snat_range(idp) {
                return Err(format!(
                    "un-SNAT of {} to {to}: no flow the run opened from that client to that backend",
                    SocketAddr::new(iv.src, isp)
                ));
            }
            Err(format!(
                "{} is no frontend and no SNAT port, yet translated to {to}",
                SocketAddr::new(iv.dst, idp)
            ))
        }
        Side::Egress => {
            if odp != idp || ov.dst != iv.dst {
                return Err("egress changed the destination".into());
            }
            let (from, to, new) = (
                SocketAddr::new(iv.src, isp),
                SocketAddr::new(iv.dst, idp),
                SocketAddr::new(ov.src, osp),
            );
            // The frontend restored on a flow's reply (backend to client),
            // or SNAT of its forward packet (client to backend; NodePorts
            // lie in the SNAT port range too).
            if model
                .backend_client
                .get(&(from, to, iv.proto))
                .is_some_and(|f| f.contains(&new))
            {
                return Ok(());
            }
            if ov.src == snat_ip(v6) && in_snat_range(osp) {
                if !model.backend_client.contains_key(&(to, from, iv.proto)) {
                    return Err(format!(
                        "{from} -> {to} masqueraded to {new}: no flow the run opened"
                    ));
                }
                model.masqueraded(new, to, iv.proto);
                return Ok(());
            }
            Err(format!(
                "{from} -> {to}: source rewritten to {new}, neither the SNAT address nor the frontend of a flow of theirs"
            ))
        }
    }
}

/// The inner packet of an encapsulated one (IPIP, IPv6-in-IPv6: the outer
/// header removed, the L2 header kept), if `iv` is one.
fn decapsulated(f: &[u8], iv: &View) -> Option<Vec<u8>> {
    let olen = if iv.v6 { 40 } else { 20 };
    let encap = if iv.v6 { 41 } else { 4 };
    // Bytes after the IP packet (a frame's padding) stay where they were.
    (iv.proto == encap && iv.l4 == iv.l3 + olen && iv.end <= f.len())
        .then(|| [&f[..iv.l3], &f[iv.l4..]].concat())
}

fn check_reject(
    model: &Model,
    input: &[u8],
    iv: Option<&View>,
    out: &[u8],
    must: bool,
) -> Result<(), String> {
    let iv = iv
        .filter(|v| v.parsed && v.ports.is_some())
        .ok_or("rejected a frame that is no TCP, UDP or SCTP packet the datapath parses")?;
    if !model.service_addresses.contains(&iv.dst) {
        return Err(format!("rejected a frame to {}, not a Service address", iv.dst));
    }
    if must {
        return Err("rejected a frame to a frontend with backends".into());
    }
    let ov = view(out)
        .filter(|v| v.parsed)
        .ok_or("the reject does not parse")?;
    // IP header, ICMP header (8), quote (the frame's IP header and 8 bytes).
    let (hlen, quote, icmp_type, code) = if iv.v6 { (40, 48, 1, 4) } else { (20, 28, 3, 3) };
    if ov.v6 != iv.v6 || ov.proto != iv.icmp() || ov.l4 != ov.l3 + hlen {
        return Err("not an ICMP message of the frame's family".into());
    }
    if !ov.ip_check_ok || ov.l4_valid() != Some(true) {
        return Err("the reject's checksums are wrong".into());
    }
    let l4 = ov.l4;
    if out[l4] != icmp_type || out[l4 + 1] != code {
        return Err("not an ICMP port-unreachable".into());
    }
    if (ov.src, ov.dst) != (iv.dst, iv.src) {
        return Err("not from the address tried to the sender".into());
    }
    if out.get(l4 + 8..l4 + 8 + quote) != input.get(iv.l3..iv.l3 + quote) {
        return Err("does not quote the frame's IP header and 8 bytes".into());
    }
    if ov.end != out.len() || out.len() != l4 + 8 + quote {
        return Err("the reject's length is wrong".into());
    }
    if out[..6] != input[6..12] || out[6..12] != input[..6] {
        return Err("MAC addresses not swapped".into());
    }
    if out[12..ov.l3] != input[12..iv.l3] {
        return Err("the reject's VLAN tags or ethertype differ from the frame's".into());
    }
    Ok(())
}

fn check_icmp(
    model: &Model,
    p: Program,
    input: &[u8],
    out: &[u8],
    iv: &View,
    ov: &View,
) -> Result<(), String> {
    // Ingress leaves the outer source alone; egress may set it (checked
    // below, once the quote is known).
    if ov.src != iv.src && p.side == Side::Ingress {
        return Err("an ICMP error's outer source changed at ingress".into());
    }
    let (l3, l4, v6) = (iv.l3, iv.l4, iv.v6);
    let errors: &[u8] = if v6 { &[1, 2, 3, 4] } else { &[3, 11, 12] };
    if !errors.contains(&input[l4]) {
        return Err(format!("ICMP type {} translated: not an error", input[l4]));
    }
    // The quoted IP header at l4 + 8. Outer destination, ICMP checksum, and
    // in the quote: addresses, ports, the UDP or TCP checksum (IPv4: the
    // outer and quoted header checksums too), all within the IP packet.
    let q = l4 + 8;
    // The quote the datapath translates: IPv4 without options, IPv6 with
    // the L4 header right after it; TCP, UDP or SCTP.
    let (qproto, qlen) = if v6 {
        (input.get(q + 6).copied(), 40)
    } else {
        (input.get(q + 9).copied(), 20)
    };
    let version_ok = input
        .get(q)
        .is_some_and(|b| if v6 { b >> 4 == 6 } else { *b == 0x45 });
    let Some(qproto @ (TCP | UDP | SCTP)) = qproto.filter(|_| version_ok && out.len() >= q + qlen + 4) else {
        return Err("translated an ICMP error whose quote is no TCP, UDP or SCTP packet".into());
    };
    // The quoted L4 checksum: UDP's (8 bytes in), TCP's (16; most errors
    // quote it); SCTP's CRC32c is left alone.
    let (qaddr, ql4) = (if v6 { q + 8 } else { q + 12 }, q + qlen);
    let qcheck = match qproto {
        UDP => ql4 + 6..ql4 + 8,
        TCP => ql4 + 16..ql4 + 18,
        _ => 0..0,
    };
    let allowed = |i: usize| {
        i < iv.end
            && ((qaddr..ql4 + 4).contains(&i)
                || qcheck.contains(&i)
                || (l4 + 2..l4 + 4).contains(&i)
                || if v6 {
                    (l3 + 8..l3 + 40).contains(&i)
                } else {
                    (l3 + 12..l3 + 20).contains(&i)
                        || (l3 + 10..l3 + 12).contains(&i)
                        || (q + 10..q + 12).contains(&i)
                })
    };
    if let Some(i) = (0..input.len()).find(|&i| input[i] != out[i] && !allowed(i)) {
        return Err(format!(
            "byte {i} of an ICMP error changed outside its translated fields"
        ));
    }
    if !v6 {
        let inner_ok = |f: &[u8]| internet_checksum(&[&f[q..q + 20]]) == 0;
        if inner_ok(input) != inner_ok(out) {
            return Err("the quoted IP header's checksum validity changed".into());
        }
    }
    // The quote now is a packet of a flow the run opened as its sender sent
    // it: client to frontend, backend to client, backend to the SNAT
    // address; the outer destination, if it changed, that sender.
    let addr = |f: &[u8], at: usize| -> IpAddr {
        if v6 {
            Ipv6Addr::from(<[u8; 16]>::try_from(&f[at..at + 16]).unwrap()).into()
        } else {
            Ipv4Addr::new(f[at], f[at + 1], f[at + 2], f[at + 3]).into()
        }
    };
    let (qs, qd) = if v6 {
        (addr(out, q + 8), addr(out, q + 24))
    } else {
        (addr(out, q + 12), addr(out, q + 16))
    };
    let (qs, qd) = (
        SocketAddr::new(qs, be16(out, ql4)),
        SocketAddr::new(qd, be16(out, ql4 + 2)),
    );
    let flow = model.client_frontend.contains(&(qs, qd, qproto))
        || model.backend_client.contains_key(&(qs, qd, qproto))
        || (qd.ip() == snat_ip(v6)
            && (SNAT_PORTS.0..=SNAT_PORTS.1).contains(&qd.port())
            && model.backend_ips.contains(&qs.ip()));
    if !flow {
        return Err(format!(
            "quote rewritten to {qs} -> {qd}, no packet of a flow the run opened ({:?})",
            p.side
        ));
    }
    if ov.dst != iv.dst && ov.dst != qs.ip() {
        return Err(format!(
            "ICMP error sent to {}, not to the quoted packet's sender {}",
            ov.dst,
            qs.ip()
        ));
    }
    // Egress (POSTROUTING's half of netfilter's translation): an error to
    // the quoted packet's sender leaves from the address it sent to.
    if ov.src != iv.src && (ov.src != qd.ip() || ov.dst != qs.ip()) {
        return Err(format!(
            "an ICMP error's outer source set to {}, not the quoted destination {} of its sender {}",
            ov.src,
            qd.ip(),
            qs.ip()
        ));
    }
    Ok(())
}

/// A frame: mostly mutations of well-formed frames about the model's
/// Services and the flows the run opened.
fn frame(rng: &mut Rng, model: &Model) -> Vec<u8> {
    let mut f = seed(rng, model);
    if rng.chance(60) {
        for _ in 0..=rng.below(3) {
            mutate(rng, &mut f);
        }
    }
    // BPF_PROG_TEST_RUN takes frames of an Ethernet header at least.
    if f.len() < 14 {
        f.resize(14, 0);
    }
    f
}

fn random_client(rng: &mut Rng, fm: &Fam) -> SocketAddr {
    SocketAddr::new(*rng.pick(&fm.clients), 1024 + rng.below(64_000) as u16)
}

fn seed(rng: &mut Rng, model: &Model) -> Vec<u8> {
    let fm = fam(rng.chance(50));
    let targets = &model.targets[usize::from(fm.v6)];
    let clients = &model.recent[usize::from(fm.v6)];
    let snat_port = |rng: &mut Rng| SNAT_PORTS.0 + rng.below(31_744) as u16;
    let flags = [0x02, 0x10, 0x11, 0x04, 0x18, 0x12, 0x01, 0x14];
    let kind = rng.below(10);
    let mut fr = match kind {
        // To a frontend (new or established flows); now and then to an
        // unallocated address of the service CIDR, or a port the frontend's
        // address does not serve.
        0..=3 => {
            let (mut addr, mut port, proto) = *rng.pick(targets);
            match rng.below(20) {
                0 => addr = fm.unallocated,
                1 => port = rng.below(65_536) as u16,
                _ => {}
            }
            let src = if !clients.is_empty() && rng.chance(50) {
                *rng.pick(clients)
            } else {
                random_client(rng, &fm)
            };
            let mut f = Frame::tcp(src, SocketAddr::new(addr, port), *rng.pick(&flags));
            f.proto = proto;
            f
        }
        // A reply to a masqueraded flow (to the node, a SNAT port), or from a
        // backend towards a client (egress): half of them to flows the run
        // opened.
        4 | 5 => {
            let flows = &model.flows[usize::from(fm.v6)];
            let snat = &model.snat[usize::from(fm.v6)];
            let (src, dst, proto) = if kind == 4 && !snat.is_empty() && rng.chance(50) {
                let (at, backend, proto) = *rng.pick(snat);
                (backend, at, proto)
            } else if kind == 5 && !flows.is_empty() && rng.chance(50) {
                let f = *rng.pick(flows);
                (f.backend, f.client, f.proto)
            } else {
                let backends = [
                    (fm.remote_pod, 8080, TCP),
                    (fm.local_pod, 8080, TCP),
                    (fm.remote_pod, 5353, UDP),
                    (fm.remote_pod, 9090, SCTP),
                ];
                let (ip, port, proto) = *rng.pick(&backends);
                let dst = if kind == 4 || clients.is_empty() {
                    SocketAddr::new(fm.node, snat_port(rng))
                } else {
                    *rng.pick(clients)
                };
                (SocketAddr::new(ip, port), dst, proto)
            };
            let mut f = Frame::tcp(src, dst, *rng.pick(&flags));
            f.proto = proto;
            f
        }
        // Forward packets after DNAT (egress).
        6 => {
            let flows = &model.flows[usize::from(fm.v6)];
            if !flows.is_empty() && rng.chance(50) {
                let f = *rng.pick(flows);
                let mut fr = Frame::tcp(f.client, f.backend, 0x10);
                fr.proto = f.proto;
                fr
            } else {
                let src = if clients.is_empty() {
                    random_client(rng, &fm)
                } else {
                    *rng.pick(clients)
                };
                Frame::tcp(src, SocketAddr::new(fm.remote_pod, 8080), 0x10)
            }
        }
        // ICMP errors about flows; now and then an encapsulated packet
        // (DSR's) to the local backend of the DSR frontend, or elsewhere.
        7 if rng.chance(40) => return encapsulated_seed(rng, &fm),
        7 => return icmp_seed(rng, &fm, model),
        // Anything else: not ours; ICMPv6 echo requests to frontends (no
        // errors: never translated) among them.
        8 if fm.v6 && rng.chance(20) => {
            let (IpAddr::V6(src), (IpAddr::V6(dst), _, _)) =
                (random_client(rng, &fm).ip(), *rng.pick(targets))
            else {
                unreachable!("IPv6 clients and frontends");
            };
            return icmp6_echo_request(src, dst);
        }
        8 => Frame::udp(random_client(rng, &fm), SocketAddr::new(fm.elsewhere, 53)),
        _ => {
            let mut f = vec![0u8; 14 + rng.below(80) as usize];
            for b in &mut f {
                *b = rng.next_u64() as u8;
            }
            if fm.v6 {
                // An IPv6 ethertype, and now and then the version too.
                f[12..14].copy_from_slice(&[0x86, 0xdd]);
                if f.len() > 14 && rng.chance(50) {
                    f[14] = 0x60 | (f[14] & 0x0f);
                }
            }
            return f;
        }
    };
    if fr.proto == UDP {
        fr.tcp_flags = 0;
        // Invalid in IPv6: the datapath may pass it, never make it valid.
        fr.udp_zero_checksum = rng.chance(if fm.v6 { 5 } else { 10 });
    }
    if rng.chance(10) {
        fr.vlans = (0..=rng.below(2)).map(|_| rng.below(4096) as u16).collect();
    }
    if fm.v6 {
        if rng.chance(20) {
            fr.ext = random_ext(rng);
        }
    } else if rng.chance(10) {
        fr.ip_options = vec![1; 4 * (1 + rng.below(3) as usize)];
    }
    fr.payload = (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect();
    fr.build()
}

/// An IPIP (IPv6-in-IPv6) packet from another node: inside, a client's
/// packet to the DSR Service's NodePort (on some node's address) or to
/// another port; outside, to the DSR backend or another address.
fn encapsulated_seed(rng: &mut Rng, fm: &Fam) -> Vec<u8> {
    let node = if rng.chance(70) { fm.node } else { fm.router };
    let port = if rng.chance(80) {
        DSR_NODE_PORT
    } else {
        30000 + rng.below(100) as u16
    };
    let mut inner = Frame::tcp(
        random_client(rng, fm),
        SocketAddr::new(node, port),
        *rng.pick(&[0x02u8, 0x10, 0x11, 0x18]),
    );
    inner.payload = (0..rng.below(32)).map(|_| rng.next_u64() as u8).collect();
    let inner = inner.build();
    let to = if rng.chance(80) {
        fm.local_pod
    } else {
        fm.remote_pod
    };
    let from = fm.router;
    let payload = &inner[14..];
    let outer = match (from, to) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 4, 0, 0];
            ip[2..4].copy_from_slice(&((20 + payload.len()) as u16).to_be_bytes());
            ip.extend_from_slice(&s.octets());
            ip.extend_from_slice(&d.octets());
            let c = internet_checksum(&[&ip]);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            ip
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut ip = vec![0x60, 0, 0, 0, 0, 0, 41, 64];
            ip[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
            ip.extend_from_slice(&s.octets());
            ip.extend_from_slice(&d.octets());
            ip
        }
        _ => unreachable!("one family"),
    };
    [&inner[..14], &outer[..], payload].concat()
}

/// An IPv6 extension header chain: mostly short ones of options and
/// routing headers (translated after them), fragment and authentication
/// headers (never translated), now and then longer than the datapath
/// follows (4).
fn random_ext(rng: &mut Rng) -> Vec<Ext> {
    let n = if rng.chance(10) {
        4 + rng.below(2)
    } else {
        1 + rng.below(3)
    };
    (0..n)
        .map(|_| match rng.below(8) {
            0 | 1 => Ext::Options {
                kind: 0,
                units: rng.below(3) as u8,
            },
            2 | 3 => Ext::Options {
                kind: 60,
                units: rng.below(2) as u8,
            },
            4 | 5 => Ext::Routing,
            6 => {
                let any = rng.below(8192) as u16;
                Ext::Fragment {
                    offset: *rng.pick(&[0, 185, any]),
                    more: rng.chance(50),
                }
            }
            _ => Ext::Auth,
        })
        .collect()
}

/// An ICMP error (IPv4: types 3, 11, 12; IPv6: 1 to 4) about a flow: a
/// packet from a client to a frontend, a reply from a frontend to a client,
/// or a masqueraded one from the node to a backend; and about flows the run
/// opened, each way and on each side of the node.
fn icmp_seed(rng: &mut Rng, fm: &Fam, model: &Model) -> Vec<u8> {
    let family = usize::from(fm.v6);
    let (targets, clients) = (&model.targets[family], &model.recent[family]);
    let (flows, snat) = (&model.flows[family], &model.snat[family]);
    let client = if clients.is_empty() {
        random_client(rng, fm)
    } else {
        *rng.pick(clients)
    };
    let (addr, port, _) = *rng.pick(targets);
    let frontend = SocketAddr::new(addr, port);
    let with = |mut f: Frame, proto| {
        f.proto = proto;
        f
    };
    let mut quoted = match rng.below(8) {
        0 => Frame::tcp(client, frontend, 0x10),
        1 => Frame::tcp(frontend, client, 0x10),
        2 => Frame::udp(
            SocketAddr::new(fm.node, SNAT_PORTS.0 + rng.below(31_744) as u16),
            SocketAddr::new(fm.remote_pod, 5353),
        ),
        // A forward packet after DNAT, a reply as the client saw it, a
        // reply after un-SNAT.
        3..=5 if !flows.is_empty() => {
            let f = *rng.pick(flows);
            match rng.below(3) {
                0 => with(Frame::tcp(f.client, f.backend, 0x10), f.proto),
                1 => with(Frame::tcp(f.frontend, f.client, 0x10), f.proto),
                _ => with(Frame::tcp(f.backend, f.client, 0x10), f.proto),
            }
        }
        // A masqueraded packet, and its reply.
        _ if !snat.is_empty() => {
            let (at, backend, proto) = *rng.pick(snat);
            if rng.chance(50) {
                with(Frame::tcp(at, backend, 0x10), proto)
            } else {
                with(Frame::tcp(backend, at, 0x10), proto)
            }
        }
        _ => Frame::tcp(client, frontend, 0x10),
    };
    let dst = *rng.pick(&[fm.node, client.ip(), fm.remote_pod]);
    let (IpAddr::V6(router), IpAddr::V6(dst)) = (fm.router, dst) else {
        let (IpAddr::V4(router), IpAddr::V4(dst)) = (fm.router, dst) else {
            unreachable!("one family");
        };
        return icmp_error(
            router,
            dst,
            *rng.pick(&[3u8, 11, 12]),
            rng.below(5) as u8,
            1400,
            &quoted.build(),
        );
    };
    // A quote with extension headers (left alone), and quotes of the header
    // and 8 bytes only, as well as whole packets.
    if rng.chance(10) {
        quoted.ext = random_ext(rng);
    }
    let quoted = quoted.build();
    let about = if rng.chance(30) {
        &quoted[..quoted.len().min(14 + 48)]
    } else {
        &quoted[..]
    };
    let f = icmp6_error(
        router,
        dst,
        *rng.pick(&[1u8, 2, 3, 4]),
        rng.below(5) as u8,
        1280 + rng.below(220) as u32,
        about,
    );
    if rng.chance(10) { with_hop_by_hop(f) } else { f }
}

/// An IPv6 frame (no VLAN tags) with an 8-byte hop-by-hop options header
/// put in front of its chain (no checksum covers it).
fn with_hop_by_hop(f: Vec<u8>) -> Vec<u8> {
    let (l3, hbh) = (14, 14 + 40);
    let mut g = f[..hbh].to_vec();
    g.extend_from_slice(&[f[l3 + 6], 0, 1, 4, 0, 0, 0, 0]);
    g.extend_from_slice(&f[hbh..]);
    g[l3 + 6] = 0;
    let payload = be16(&f, l3 + 4) + 8;
    g[l3 + 4..l3 + 6].copy_from_slice(&payload.to_be_bytes());
    g
}

/// Where an IPv6 frame's IP header starts (after up to two VLAN tags).
fn ipv6_l3(f: &[u8]) -> Option<usize> {
    let mut l3 = 14;
    let mut et = be16(f, 12);
    for _ in 0..2 {
        if !(et == 0x8100 || et == 0x88a8) || f.len() < l3 + 4 {
            break;
        }
        et = be16(f, l3 + 2);
        l3 += 4;
    }
    (et == 0x86dd).then_some(l3)
}

fn mutate(rng: &mut Rng, f: &mut Vec<u8>) {
    if f.is_empty() {
        return;
    }
    if f.len() >= 14
        && let Some(l3) = ipv6_l3(f)
    {
        return mutate6(rng, f, l3);
    }
    let l3 = 14;
    match rng.below(9) {
        0 => {
            let i = rng.below(f.len() as u64) as usize;
            f[i] ^= 1 << rng.below(8);
        }
        1 => {
            let i = rng.below(f.len() as u64) as usize;
            f[i] = rng.next_u64() as u8;
        }
        2 => f.truncate(rng.below(f.len() as u64 + 1) as usize),
        3 => f.extend((0..rng.below(32)).map(|_| rng.next_u64() as u8)),
        // IHL.
        4 if f.len() > l3 => f[l3] = 0x40 | rng.below(16) as u8,
        // Total length.
        5 if f.len() > l3 + 4 => {
            let v = rng.below(2000) as u16;
            f[l3 + 2..l3 + 4].copy_from_slice(&v.to_be_bytes());
        }
        // Fragment field.
        6 if f.len() > l3 + 8 => {
            let any = rng.next_u64() as u16;
            let v = *rng.pick(&[0x2000u16, 0x0001, 0x20b9, 0x4000, any]);
            f[l3 + 6..l3 + 8].copy_from_slice(&v.to_be_bytes());
        }
        // TCP flags and data offset (no IP options in the seed's fast case).
        7 if f.len() > l3 + 34 => {
            f[l3 + 32] = (rng.below(16) as u8) << 4;
            f[l3 + 33] = rng.next_u64() as u8;
        }
        // Stack a VLAN tag.
        8 => push_vlan(rng, f),
        _ => {}
    }
}

fn push_vlan(rng: &mut Rng, f: &mut Vec<u8>) {
    if f.len() >= 14 {
        let tag = [0x81, 0x00, rng.next_u64() as u8 & 0x0f, rng.next_u64() as u8];
        let mut v = f[..12].to_vec();
        v.extend_from_slice(&tag);
        v.extend_from_slice(&f[12..]);
        *f = v;
    }
}

/// IPv6 mutations: the payload length, next headers, hop limit and flow
/// label, an extension header's length, TCP's flags and data offset,
/// truncations within the headers; and the generic ones.
fn mutate6(rng: &mut Rng, f: &mut Vec<u8>, l3: usize) {
    let len = f.len();
    match rng.below(11) {
        0 => {
            let i = rng.below(len as u64) as usize;
            f[i] ^= 1 << rng.below(8);
        }
        1 => {
            let i = rng.below(len as u64) as usize;
            f[i] = rng.next_u64() as u8;
        }
        2 => f.truncate(rng.below(len as u64 + 1) as usize),
        3 => f.extend((0..rng.below(32)).map(|_| rng.next_u64() as u8)),
        // Payload length: none (a jumbogram), about right, beyond the frame.
        4 if len >= l3 + 6 => {
            let actual = len.saturating_sub(l3 + 40) as u64;
            let (less, more, any) = (rng.below(16), rng.below(16), rng.below(2000));
            let v = *rng.pick(&[0, actual.saturating_sub(less), actual + more, any]) as u16;
            f[l3 + 4..l3 + 6].copy_from_slice(&v.to_be_bytes());
        }
        // The IPv6 header's next header, or the first extension header's.
        5 if len > l3 + 6 => {
            let at = if len > l3 + 40 && rng.chance(30) {
                l3 + 40
            } else {
                l3 + 6
            };
            let any = rng.next_u64() as u8;
            f[at] = *rng.pick(&[0, 6, 17, 43, 44, 50, 51, 58, 59, 60, 132, any]);
        }
        // Hop limit, traffic class and flow label (never rewritten).
        6 if len >= l3 + 8 => {
            if rng.chance(50) {
                f[l3 + 7] = rng.next_u64() as u8;
            } else {
                f[l3 + 1 + rng.below(3) as usize] = rng.next_u64() as u8;
            }
        }
        // The first extension header's length (whatever lies there).
        7 if len > l3 + 41 => {
            let any = rng.next_u64() as u8;
            f[l3 + 41] = *rng.pick(&[0, 1, 2, 3, 25, 200, any]);
        }
        // TCP flags and data offset.
        8 => {
            if let Some(v) = view(f)
                && v.proto == TCP
                && len > v.l4 + 13
            {
                f[v.l4 + 12] = (rng.below(16) as u8) << 4;
                f[v.l4 + 13] = rng.next_u64() as u8;
            }
        }
        // Truncated within the headers.
        9 => f.truncate((l3 + rng.below(80) as usize).min(len)),
        _ => push_vlan(rng, f),
    }
}
