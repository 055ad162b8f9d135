//! Node-wide settings the agent writes into a one-entry array.

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

pub const MAX_SERVICE_CIDRS: usize = 4;

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
    pub ct_tcp_timeout_s: u32,
    pub ct_tcp_close_timeout_s: u32,
    pub ct_udp_timeout_s: u32,
    /// Network namespace cookie of the node (the agent's namespace): with
    /// [`config_flags::SOCKET_LB_HOST_ONLY`], connect-time translation only
    /// applies to sockets in it.
    pub host_netns_cookie: u64,
}
crate::assert_layout!(DpConfig, 72, 8);

pub mod config_flags {
    /// The agent wrote this config.
    pub const CONFIGURED: u32 = 1 << 0;
    /// kube-proxy's masqueradeAll: SNAT every new service flow.
    pub const MASQUERADE_ALL: u32 = 1 << 1;
    /// Connect-time (socket) translation only for the host's own sockets;
    /// pods (other network namespaces) keep per-packet translation, which
    /// service meshes that redirect traffic per packet rely on.
    pub const SOCKET_LB_HOST_ONLY: u32 = 1 << 2;
}

impl DpConfig {
    /// Below Linux's default ephemeral range (32768-60999), so SNATed flows
    /// never share a tuple with the node's own outgoing connections. Ports
    /// the node listens on do not matter: replies are matched in conntrack
    /// before the stack sees them. 31,744 concurrent SNATed flows per backend
    /// address and port.
    pub const DEFAULT_SNAT_PORTS: (u16, u16) = (1_024, 32_767);
    pub const DEFAULT_TCP_TIMEOUT_S: u32 = 6 * 3600;
    pub const DEFAULT_TCP_CLOSE_TIMEOUT_S: u32 = 10;
    pub const DEFAULT_UDP_TIMEOUT_S: u32 = 120;
}

crate::impl_pod!(Cidr4, DpConfig);
