//! The model: the programmed table as the fuzzer knows it (frontends, their
//! backends, which translate every flow) and the flows the run has opened,
//! remembered to aim new frames at and to judge translations by.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
};

use dataplane_agent::net::{IpFamily, Protocol};

use super::{cluster::snat_ip, view::View};
use crate::{
    packet::{SCTP, TCP, UDP},
    services::TestService,
};

/// A frontend the model knows: where it may go, and whether every clean
/// packet to it from a client (not the node, not a backend) is translated.
#[derive(Clone, Debug)]
pub(super) struct Frontend {
    pub(super) backends: BTreeSet<SocketAddr>,
    pub(super) always: bool,
}

/// The programmed table, as the model sees it.
pub struct Model {
    pub(super) frontends: BTreeMap<(IpAddr, u16, u8), Frontend>,
    /// The frontends of each family (IPv4, IPv6), to aim frames at.
    pub(super) targets: [Vec<(IpAddr, u16, u8)>; 2],
    /// Addresses holding a frontend (rejects and drops may only touch these).
    pub(super) service_addresses: BTreeSet<IpAddr>,
    pub(super) backend_ips: BTreeSet<IpAddr>,
    /// Clients whose flows the run opened, and recent ones of each family
    /// to aim new frames at.
    pub(super) clients: HashSet<SocketAddr>,
    pub(super) recent: [Vec<SocketAddr>; 2],
    /// Recent flows of each family as the ingress programs translated them,
    /// and masqueraded packets as tc_egress sent them (SNAT address and
    /// port, backend, protocol): what replies and ICMP errors are aimed at.
    pub(super) flows: [Vec<Flow>; 2],
    pub(super) snat: [Vec<(SocketAddr, SocketAddr, u8)>; 2],
    pub(super) remembered: usize,
    /// Every flow the run opened (the datapath may forget flows, the model
    /// does not): (client, frontend, protocol), and the frontends of each
    /// (backend, client, protocol).
    pub(super) client_frontend: HashSet<(SocketAddr, SocketAddr, u8)>,
    pub(super) backend_client: HashMap<(SocketAddr, SocketAddr, u8), BTreeSet<SocketAddr>>,
    /// Judging the inner packet of an encapsulated one (see `oracle::check`).
    pub(super) decapsulating: bool,
}

/// A flow the run opened: client → frontend, translated to the backend.
#[derive(Clone, Copy, Debug)]
pub(super) struct Flow {
    pub(super) client: SocketAddr,
    pub(super) frontend: SocketAddr,
    pub(super) backend: SocketAddr,
    pub(super) proto: u8,
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
    pub(super) fn opened(&mut self, flow: Flow) {
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

    pub(super) fn masqueraded(&mut self, snat: SocketAddr, backend: SocketAddr, proto: u8) {
        self.remembered += 1;
        remember(
            &mut self.snat[usize::from(snat.is_ipv6())],
            (snat, backend, proto),
            self.remembered,
        );
    }

    pub(super) fn new(svcs: &[TestService]) -> Self {
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
    pub(super) fn must_translate(&self, v: &View) -> bool {
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
