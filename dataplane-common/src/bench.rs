//! The forwarding benchmark's configuration (`DP_BENCH_V1`): what its
//! generator writes into every frame, and where its floor redirects.

/// Bytes of the frame template: Ethernet, IPv4, UDP and a little payload.
pub const TEMPLATE_LEN: usize = 64;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BenchConfig {
    pub template: [u8; TEMPLATE_LEN],
    /// Frames sent (the generator counts).
    pub sent: u32,
    /// Destination ports cycle over `first_port .. first_port + ports`
    /// (host order), written at `port_offset` of the frame.
    pub ports: u32,
    pub first_port: u16,
    pub port_offset: u16,
    /// Where `xdp_bench_redirect` sends frames.
    pub redirect_ifindex: u32,
    /// A second port cycling with the first (the source port: one flow per
    /// destination port), written at `second_offset` (0: none).
    pub second_port: u16,
    pub second_offset: u16,
}
crate::assert_layout!(BenchConfig, 84, 4);

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            template: [0; TEMPLATE_LEN],
            sent: 0,
            ports: 1,
            first_port: 0,
            port_offset: 0,
            redirect_ifindex: 0,
            second_port: 0,
            second_offset: 0,
        }
    }
}

crate::impl_pod!(BenchConfig);
