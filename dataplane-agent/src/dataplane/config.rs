//! The datapath's node-wide settings (`DP_CONFIG_V4`), typed.

use std::net::{Ipv4Addr, Ipv6Addr};

use dataplane_common::config::{Cidr4, Cidr6, CtTimeouts, DpConfig, MAX_SERVICE_CIDRS, config_flags};

use super::DatapathError;
use crate::net::{Ipv4Cidr, Ipv6Cidr, ip6_words};

/// Node-wide settings of the datapath.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatapathConfig {
    /// Source address of SNATed IPv4 flows (the node's primary IPv4
    /// address; `None` on an IPv6-only node).
    pub snat_ip: Option<Ipv4Addr>,
    /// Where pods come from; `None`: no source counts as a pod.
    pub cluster_cidr: Option<Ipv4Cidr>,
    /// Traffic to an address in these that no Service holds is dropped.
    pub service_cidrs: Vec<Ipv4Cidr>,
    /// IPv6: the SNAT address (`None`: IPv6 flows that need SNAT are
    /// dropped, counted as `drop_snat_exhausted`), the cluster CIDR, the
    /// service CIDRs.
    pub snat_ip6: Option<Ipv6Addr>,
    pub cluster_cidr6: Option<Ipv6Cidr>,
    pub service_cidrs6: Vec<Ipv6Cidr>,
    pub masquerade_all: bool,
    /// SNAT source ports (inclusive).
    pub snat_ports: (u16, u16),
    /// Conntrack idle timeouts by flow state, in seconds.
    pub timeouts: CtTimeouts,
    /// Connect-time translation only for sockets in this network namespace
    /// (the node's); pods keep per-packet translation.
    pub socket_lb_host_only: bool,
    /// The node's own sockets reach NodePorts on 127.0.0.1 and ::1
    /// ([`config_flags::LOCALHOST_NODEPORTS`]).
    pub localhost_nodeports: bool,
    /// Packets translated by the TC ingress paths go straight to the device
    /// of their route ([`config_flags::HOST_ROUTING`]).
    pub host_routing: bool,
    /// The node's network namespace cookie (this process's, by default).
    pub host_netns_cookie: u64,
    /// Maglev's flow hash seed (the same on every node) and table size (a
    /// prime; 0: no frontend uses Maglev).
    pub maglev_seed: u32,
    pub maglev_size: u32,
}

/// Cookie of the calling thread's network namespace (SO_NETNS_COOKIE,
/// Linux 5.14); 0 when unknown.
pub fn current_netns_cookie() -> u64 {
    const SO_NETNS_COOKIE: i32 = 71;
    // SAFETY: a throwaway socket and a getsockopt into a local u64.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        if fd < 0 {
            return 0;
        }
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        let rc = libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        );
        libc::close(fd);
        if rc == 0 { cookie } else { 0 }
    }
}

impl DatapathConfig {
    /// Settings for a node whose first address of each family in `node_ips`
    /// is that family's SNAT address; everything else at its default.
    pub fn for_node(node_ips: &[std::net::IpAddr]) -> Self {
        Self {
            snat_ip: node_ips.iter().find_map(|ip| match ip {
                std::net::IpAddr::V4(a) => Some(*a),
                _ => None,
            }),
            snat_ip6: node_ips.iter().find_map(|ip| match ip {
                std::net::IpAddr::V6(a) => Some(*a),
                _ => None,
            }),
            ..Self::new(Ipv4Addr::UNSPECIFIED)
        }
    }

    /// The cluster CIDR of each family (at most one each; the first wins)
    /// and the service CIDRs, split by family. Those of a family the node
    /// does not serve (no SNAT address of it: no node IP) are left out: the
    /// node leaves that family's traffic alone, as kube-proxy runs no
    /// proxier for it.
    pub fn set_cidrs(&mut self, cluster: &[crate::net::IpCidr], service: &[crate::net::IpCidr]) {
        use crate::net::{IpCidr, IpFamily};
        let served = |c: &&IpCidr| match c.family() {
            IpFamily::V4 => self.snat_ip.is_some(),
            IpFamily::V6 => self.snat_ip6.is_some(),
        };
        let cluster: Vec<IpCidr> = cluster.iter().filter(served).copied().collect();
        let service: Vec<IpCidr> = service.iter().filter(served).copied().collect();
        self.cluster_cidr = cluster.iter().find_map(|c| match c {
            IpCidr::V4(c) => Some(*c),
            IpCidr::V6(_) => None,
        });
        self.cluster_cidr6 = cluster.iter().find_map(|c| match c {
            IpCidr::V6(c) => Some(*c),
            IpCidr::V4(_) => None,
        });
        self.service_cidrs = service
            .iter()
            .filter_map(|c| match c {
                IpCidr::V4(c) => Some(*c),
                IpCidr::V6(_) => None,
            })
            .collect();
        self.service_cidrs6 = service
            .iter()
            .filter_map(|c| match c {
                IpCidr::V6(c) => Some(*c),
                IpCidr::V4(_) => None,
            })
            .collect();
    }

    pub fn new(snat_ip: Ipv4Addr) -> Self {
        Self {
            snat_ip: (!snat_ip.is_unspecified()).then_some(snat_ip),
            cluster_cidr: None,
            service_cidrs: Vec::new(),
            snat_ip6: None,
            cluster_cidr6: None,
            service_cidrs6: Vec::new(),
            masquerade_all: false,
            snat_ports: DpConfig::DEFAULT_SNAT_PORTS,
            timeouts: CtTimeouts::default(),
            socket_lb_host_only: false,
            localhost_nodeports: false,
            host_routing: false,
            host_netns_cookie: current_netns_cookie(),
            maglev_seed: 0,
            maglev_size: dataplane_common::maglev::DEFAULT_TABLE_SIZE,
        }
    }

    /// The ABI value. `previous` is what the map held: its SNAT hash seed
    /// is kept (live masqueraded flows are found by hashing with it) and so
    /// is the filter's readiness (the filter map outlives the agent).
    pub(super) fn to_abi(&self, previous: &DpConfig) -> Result<DpConfig, DatapathError> {
        if self.service_cidrs.len() > MAX_SERVICE_CIDRS || self.service_cidrs6.len() > MAX_SERVICE_CIDRS {
            return Err(DatapathError::TooManyServiceCidrs {
                v4: self.service_cidrs.len(),
                v6: self.service_cidrs6.len(),
                max: MAX_SERVICE_CIDRS,
            });
        }
        if self.snat_ports.0 == 0 || self.snat_ports.0 > self.snat_ports.1 {
            return Err(DatapathError::SnatPorts(self.snat_ports.0, self.snat_ports.1));
        }
        let cidr = |c: &Ipv4Cidr| Cidr4 {
            addr: u32::from(c.addr()).to_be(),
            mask: c.mask().to_be(),
        };
        let mut service_cidrs = [Cidr4::default(); MAX_SERVICE_CIDRS];
        for (slot, c) in service_cidrs.iter_mut().zip(&self.service_cidrs) {
            *slot = cidr(c);
        }
        let cidr6 = |c: &Ipv6Cidr| Cidr6 {
            addr: ip6_words(c.addr()),
            mask: ip6_words(Ipv6Addr::from(c.mask())),
        };
        let mut service_cidrs6 = [Cidr6::default(); MAX_SERVICE_CIDRS];
        for (slot, c) in service_cidrs6.iter_mut().zip(&self.service_cidrs6) {
            *slot = cidr6(c);
        }
        let mut flags = config_flags::CONFIGURED | (previous.flags & config_flags::FILTER_READY);
        if self.masquerade_all {
            flags |= config_flags::MASQUERADE_ALL;
        }
        if self.socket_lb_host_only {
            flags |= config_flags::SOCKET_LB_HOST_ONLY;
        }
        if self.host_routing {
            flags |= config_flags::HOST_ROUTING;
        }
        if self.localhost_nodeports {
            flags |= config_flags::LOCALHOST_NODEPORTS;
        }
        let snat_hash_seed = if previous.flags & config_flags::CONFIGURED != 0 {
            previous.snat_hash_seed
        } else {
            random_u32()
        };
        let secs = |s: u32| s.max(1);
        let t = &self.timeouts;
        Ok(DpConfig {
            flags,
            host_netns_cookie: self.host_netns_cookie,
            snat_ip: self.snat_ip.map_or(0, |ip| u32::from(ip).to_be()),
            cluster_cidr: self.cluster_cidr.as_ref().map(cidr).unwrap_or_default(),
            service_cidrs,
            snat_port_min: self.snat_ports.0,
            snat_port_max: self.snat_ports.1,
            snat_hash_seed,
            timeouts: CtTimeouts {
                tcp_syn: secs(t.tcp_syn),
                tcp_established: secs(t.tcp_established),
                tcp_half_closed: secs(t.tcp_half_closed),
                tcp_closed: secs(t.tcp_closed),
                udp_unreplied: secs(t.udp_unreplied),
                udp: secs(t.udp),
            },
            snat_ip6: self.snat_ip6.map(ip6_words).unwrap_or_default(),
            cluster_cidr6: self.cluster_cidr6.as_ref().map(cidr6).unwrap_or_default(),
            service_cidrs6,
            maglev_seed: self.maglev_seed,
            maglev_size: self.maglev_size,
        })
    }
}

/// A random u32 from the kernel (getrandom(2)).
fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: writes at most 4 bytes into a local buffer.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 4 {
        u32::from_ne_bytes(b)
    } else {
        std::process::id().wrapping_mul(0x9e37_79b9)
    }
}
