//! Counters kept by the kernel programs in per-CPU arrays.

/// One packets/bytes pair. Per-CPU, so the kernel increments without atomics
/// and userspace sums the CPUs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}
crate::assert_layout!(Counter, 16, 8);
crate::impl_pod!(Counter);

impl Counter {
    /// Adds another CPU's share.
    pub fn merge(&mut self, other: &Counter) {
        self.packets = self.packets.wrapping_add(other.packets);
        self.bytes = self.bytes.wrapping_add(other.bytes);
    }
}

/// What happened to a packet: slots of [`crate::names::COUNTERS`].
/// Append-only: the numbers are ABI (inspect and metrics read them).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Every frame `xdp_ingress` saw.
    XdpRx = 0,
    /// Passed untouched: not for a Service.
    Pass = 1,
    /// First packet of a flow: backend chosen, translated.
    NewFlow = 2,
    /// Translated by an existing conntrack entry (original direction).
    Established = 3,
    /// Reply reverse-translated.
    Reply = 4,
    /// ICMP error about a translated flow rewritten for the client.
    IcmpErrorTranslated = 5,
    /// Fragment of a datagram: passed untouched (not translated).
    Fragment = 6,
    /// Rejected with ICMP port-unreachable: the service has no endpoints.
    RejectNoEndpoints = 7,
    /// Rejected with ICMP port-unreachable: a Service address on a port it
    /// does not serve.
    RejectUnknownPort = 8,
    /// Dropped: a Local traffic policy and no local endpoint.
    DropNoLocalEndpoint = 9,
    /// Dropped: source outside loadBalancerSourceRanges.
    DropSourceRange = 10,
    /// Dropped: an address in a service CIDR that no Service holds.
    DropUnallocatedServiceIp = 11,
    /// Malformed or truncated header: passed untouched (the kernel's own
    /// validation drops it), never translated.
    Malformed = 12,
    /// Dropped: no free SNAT port for this backend.
    DropSnatExhausted = 13,
    /// Dropped: conntrack insert failed.
    DropCtFull = 14,
    /// Dropped: frontend points at a missing backend (agent mid-update).
    DropNoBackend = 15,
    /// Passed: protocol the datapath does not translate (e.g. SCTP port
    /// rewrite, which needs a CRC32c recompute).
    UnsupportedProto = 16,
    /// Frames `tc_egress`/`tc_pod_ingress` saw.
    TcRx = 17,
    /// A reject could not be built (buffer too small, options): dropped.
    DropRejectFailed = 18,
}

impl Event {
    pub const ALL: [Event; 19] = [
        Event::XdpRx,
        Event::Pass,
        Event::NewFlow,
        Event::Established,
        Event::Reply,
        Event::IcmpErrorTranslated,
        Event::Fragment,
        Event::RejectNoEndpoints,
        Event::RejectUnknownPort,
        Event::DropNoLocalEndpoint,
        Event::DropSourceRange,
        Event::DropUnallocatedServiceIp,
        Event::Malformed,
        Event::DropSnatExhausted,
        Event::DropCtFull,
        Event::DropNoBackend,
        Event::UnsupportedProto,
        Event::TcRx,
        Event::DropRejectFailed,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Event::XdpRx => "xdp_rx",
            Event::Pass => "pass",
            Event::NewFlow => "new_flow",
            Event::Established => "established",
            Event::Reply => "reply",
            Event::IcmpErrorTranslated => "icmp_error_translated",
            Event::Fragment => "fragment",
            Event::RejectNoEndpoints => "reject_no_endpoints",
            Event::RejectUnknownPort => "reject_unknown_port",
            Event::DropNoLocalEndpoint => "drop_no_local_endpoint",
            Event::DropSourceRange => "drop_source_range",
            Event::DropUnallocatedServiceIp => "drop_unallocated_service_ip",
            Event::Malformed => "malformed",
            Event::DropSnatExhausted => "drop_snat_exhausted",
            Event::DropCtFull => "drop_ct_full",
            Event::DropNoBackend => "drop_no_backend",
            Event::UnsupportedProto => "unsupported_proto",
            Event::TcRx => "tc_rx",
            Event::DropRejectFailed => "drop_reject_failed",
        }
    }

    pub const fn is_drop(self) -> bool {
        matches!(
            self,
            Event::DropNoLocalEndpoint
                | Event::DropSourceRange
                | Event::DropUnallocatedServiceIp
                | Event::DropSnatExhausted
                | Event::DropCtFull
                | Event::DropNoBackend
                | Event::DropRejectFailed
        )
    }
}

/// Number of slots in [`crate::names::COUNTERS`]; room to append.
pub const COUNTER_SLOTS: u32 = 64;
