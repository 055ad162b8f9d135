//! Node-wide settings the agent writes into a one-entry array.

use crate::addr::Ip6;

/// An IPv4 prefix as address and mask, both in network order. `mask == 0`
/// with `addr == 0` means unset.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cidr4 {
    pub addr: u32,
    pub mask: u32,
}
crate::assert_layout!(Cidr4, 8, 4);

impl Cidr4 {
    #[inline(always)]
    pub fn is_set(&self) -> bool {
        self.mask != 0
    }
    /// `ip` in network order.
    #[inline(always)]
    pub fn contains(&self, ip: u32) -> bool {
        self.mask != 0 && (ip & self.mask) == self.addr
    }
}

/// An IPv6 prefix as address and mask, both in network order (words as
/// they lie in the packet). An all-zero mask means unset.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cidr6 {
    pub addr: Ip6,
    pub mask: Ip6,
}
crate::assert_layout!(Cidr6, 32, 4);

impl Cidr6 {
    #[inline(always)]
    pub fn is_set(&self) -> bool {
        self.mask != [0; 4]
    }
    #[inline(always)]
    pub fn contains(&self, ip: &Ip6) -> bool {
        self.is_set()
            && ip[0] & self.mask[0] == self.addr[0]
            && ip[1] & self.mask[1] == self.addr[1]
            && ip[2] & self.mask[2] == self.addr[2]
            && ip[3] & self.mask[3] == self.addr[3]
    }
}

pub const MAX_SERVICE_CIDRS: usize = 4;

/// Idle timeouts of conntrack entries, in seconds, by flow state
/// (kube-proxy's and netfilter's defaults).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtTimeouts {
    /// TCP before any reply (netfilter's SYN_SENT is 120 s).
    pub tcp_syn: u32,
    /// TCP established (kube-proxy's `conntrack.tcpEstablishedTimeout`).
    pub tcp_established: u32,
    /// TCP after a FIN one way (kube-proxy's `tcpCloseWaitTimeout`).
    pub tcp_half_closed: u32,
    /// TCP after a FIN each way or a RST. A new connection may take over
    /// the flow's tuple (and its SNAT port) at once, as netfilter lets a SYN
    /// reopen a TIME_WAIT entry.
    pub tcp_closed: u32,
    /// UDP before any reply (netfilter's `udp_timeout`).
    pub udp_unreplied: u32,
    /// UDP after a reply (netfilter's `udp_timeout_stream`).
    pub udp: u32,
}
crate::assert_layout!(CtTimeouts, 24, 4);

impl Default for CtTimeouts {
    fn default() -> Self {
        Self {
            tcp_syn: 60,
            tcp_established: 24 * 3600,
            tcp_half_closed: 3600,
            tcp_closed: 10,
            udp_unreplied: 30,
            udp: 120,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DpConfig {
    /// [`config_flags`]; 0 until the agent has written the config, and the
    /// datapath passes everything untouched until then.
    pub flags: u32,
    /// Address new flows are SNATed to (the node's primary IP, network order).
    pub snat_ip: u32,
    /// Where pods come from ("local traffic" in kube-proxy's terms).
    pub cluster_cidr: Cidr4,
    /// Traffic to an address inside these without a Service is dropped.
    pub service_cidrs: [Cidr4; MAX_SERVICE_CIDRS],
    /// SNAT source ports, host order, inclusive.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// Secret of [`crate::ct::snat_port_hash`]: chosen once per node and
    /// kept across restarts (egress hooks recompute live flows' ports).
    pub snat_hash_seed: u32,
    pub timeouts: CtTimeouts,
    /// Network namespace cookie of the node (the agent's namespace): with
    /// [`config_flags::SOCKET_LB_HOST_ONLY`], connect-time translation only
    /// applies to sockets in it.
    pub host_netns_cookie: u64,
    /// IPv6: the SNAT address (all zero: none, masquerading IPv6 flows is
    /// impossible and they are dropped as `drop_snat_exhausted`), the
    /// cluster CIDR, the service CIDRs.
    pub snat_ip6: Ip6,
    pub cluster_cidr6: Cidr6,
    pub service_cidrs6: [Cidr6; MAX_SERVICE_CIDRS],
    /// Maglev ([`crate::maglev`]): the seed of the flow hash, the same on
    /// every node (so that every node picks the same backend for a flow),
    /// and the table size M (a prime; 0 when no frontend uses Maglev).
    pub maglev_seed: u32,
    pub maglev_size: u32,
}
crate::assert_layout!(DpConfig, 272, 8);

impl DpConfig {
    /// `ip` (network order) is in one of the IPv6 service CIDRs.
    #[inline(always)]
    pub fn in_service_cidr6(&self, ip: &Ip6) -> bool {
        let mut i = 0;
        while i < MAX_SERVICE_CIDRS {
            if self.service_cidrs6[i].contains(ip) {
                return true;
            }
            i += 1;
        }
        false
    }

    /// `ip` (network order) is in one of the service CIDRs.
    #[inline(always)]
    pub fn in_service_cidr(&self, ip: u32) -> bool {
        let mut i = 0;
        while i < MAX_SERVICE_CIDRS {
            if self.service_cidrs[i].contains(ip) {
                return true;
            }
            i += 1;
        }
        false
    }
}

pub mod config_flags {
    /// The agent wrote this config.
    pub const CONFIGURED: u32 = 1 << 0;
    /// kube-proxy's masqueradeAll: SNAT every new flow to a ClusterIP.
    pub const MASQUERADE_ALL: u32 = 1 << 1;
    /// Connect-time (socket) translation only for the host's own sockets;
    /// pods (other network namespaces) keep per-packet translation, which
    /// service meshes that redirect traffic per packet rely on.
    pub const SOCKET_LB_HOST_ONLY: u32 = 1 << 2;
    /// The address filters (`DP_ADDR_FILTER_V2`) are written: a clear bit
    /// may be trusted. Until then every address passes the filter.
    pub const FILTER_READY: u32 = 1 << 3;
    /// Host routing: packets the ingress paths translated go straight to
    /// the device the kernel's FIB names for their new destination,
    /// skipping the node's IP stack: TC redirects them, XDP forwards them
    /// (`XDP_TX`, or `XDP_REDIRECT` to a device in
    /// [`crate::names::XDP_DEVICES`]) after applying the source rewrite the
    /// egress hook would have made (see `dataplane-ebpf/src/route.rs`).
    pub const HOST_ROUTING: u32 = 1 << 4;
    /// Localhost NodePorts (kube-proxy's iptables `localhostNodePorts`):
    /// the node's own sockets connecting to 127.0.0.1:NODEPORT or
    /// [::1]:NODEPORT get the NodePort of the node's primary address of
    /// that family, at connect time. Packets never are translated for a
    /// loopback destination.
    pub const LOCALHOST_NODEPORTS: u32 = 1 << 5;
}

impl DpConfig {
    /// Below Linux's default ephemeral range (32768-60999), so SNATed flows
    /// never share a tuple with the node's own outgoing connections. Ports
    /// the node listens on do not matter: replies are matched in conntrack
    /// before the stack sees them. 31,744 concurrent SNATed flows per backend
    /// address and port.
    pub const DEFAULT_SNAT_PORTS: (u16, u16) = (1_024, 32_767);
}

crate::impl_pod!(Cidr4, Cidr6, DpConfig);
