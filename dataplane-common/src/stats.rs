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

/// The program that counted: [`crate::names::COUNTERS`] has one block of
/// [`HOOK_STRIDE`] slots per hook, indexed by [`Event`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    XdpIngress = 0,
    TcEgress = 1,
    TcPodIngress = 2,
    /// Connect-time translation (cgroup hooks); counts sockets, not packets.
    Socket = 3,
    /// `tc_ingress`: the north-south path in TC, on external devices.
    TcIngress = 4,
}

impl Hook {
    pub const ALL: [Hook; 5] = [
        Hook::XdpIngress,
        Hook::TcIngress,
        Hook::TcEgress,
        Hook::TcPodIngress,
        Hook::Socket,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Hook::XdpIngress => "xdp_ingress",
            Hook::TcEgress => "tc_egress",
            Hook::TcPodIngress => "tc_pod_ingress",
            Hook::Socket => "socket",
            Hook::TcIngress => "tc_ingress",
        }
    }
}

/// Slots per hook in [`crate::names::COUNTERS`].
pub const HOOK_STRIDE: u32 = 32;

/// Index of (hook, event) in [`crate::names::COUNTERS`].
#[inline(always)]
pub const fn counter_index(hook: Hook, event: Event) -> u32 {
    hook as u32 * HOOK_STRIDE + event as u32
}

/// Declares [`Event`] once: each event's number (ABI), name (as `inspect`,
/// metrics and `monitor` show it) and kind; the enum, [`Event::ALL`],
/// [`Event::name`] and [`Event::kind`] follow.
macro_rules! events {
    ($($(#[doc = $doc:literal])* $event:ident = $n:literal, $name:literal, $kind:ident;)*) => {
        /// What happened to a packet. Every packet a hook sees is counted under
        /// exactly one event, so a hook's packets are the sum of its events.
        /// Append-only: the numbers are ABI (inspect and metrics read them).
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Event {
            $($(#[doc = $doc])* $event = $n,)*
        }

        impl Event {
            pub const ALL: [Event; [$(Event::$event),*].len()] = [$(Event::$event),*];

            pub const fn name(self) -> &'static str {
                match self {
                    $(Event::$event => $name,)*
                }
            }

            pub const fn kind(self) -> EventKind {
                match self {
                    $(Event::$event => EventKind::$kind,)*
                }
            }
        }
    };
}

/// What an [`Event`] did with the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// Let it go on untranslated.
    Pass,
    /// Translated it (DNAT, SNAT, un-NAT, an ICMP error's quote).
    Translate,
    /// Answered it with an ICMP error instead of forwarding it.
    Reject,
    /// Dropped it.
    Drop,
}

events! {
    /// Passed untouched: not for a Service.
    Pass = 0, "pass", Pass;
    /// First packet of a flow: backend chosen, translated.
    NewFlow = 1, "new_flow", Translate;
    /// Translated by an existing conntrack entry (original direction).
    Established = 2, "established", Translate;
    /// Reply reverse-translated.
    Reply = 3, "reply", Translate;
    /// ICMP error about a translated flow rewritten for the client.
    IcmpErrorTranslated = 4, "icmp_error_translated", Translate;
    /// Fragment of a datagram: passed untouched (not translated).
    Fragment = 5, "fragment", Pass;
    /// Rejected with ICMP port-unreachable: the service has no endpoints.
    RejectNoEndpoints = 6, "reject_no_endpoints", Reject;
    /// Rejected with ICMP port-unreachable: a Service address on a port it
    /// does not serve.
    RejectUnknownPort = 7, "reject_unknown_port", Reject;
    /// Dropped: a Local traffic policy and no local endpoint.
    DropNoLocalEndpoint = 8, "drop_no_local_endpoint", Drop;
    /// Dropped: source outside loadBalancerSourceRanges.
    DropSourceRange = 9, "drop_source_range", Drop;
    /// Dropped: an address in a service CIDR that no Service holds.
    DropUnallocatedServiceIp = 10, "drop_unallocated_service_ip", Drop;
    /// Malformed or truncated header: passed untouched (the kernel's own
    /// validation drops it), never translated.
    Malformed = 11, "malformed", Pass;
    /// Dropped: no free SNAT port for this backend.
    DropSnatExhausted = 12, "drop_snat_exhausted", Drop;
    /// Dropped: conntrack insert failed.
    DropCtFull = 13, "drop_ct_full", Drop;
    /// Dropped: frontend points at a missing backend (agent mid-update).
    DropNoBackend = 14, "drop_no_backend", Drop;
    /// Reserved: counted SCTP passed untranslated before SCTP was
    /// translated; kept so that the other slots keep their numbers.
    UnsupportedProto = 15, "unsupported_proto", Pass;
    /// A reject could not be built (buffer too small, options): dropped.
    DropRejectFailed = 16, "drop_reject_failed", Drop;
    /// Dropped: a live flow from the same client address and port to the
    /// same backend, through another frontend, holds the tuple the backend
    /// sees. Egress hooks know a flow by that tuple alone, so the new one
    /// would be translated as the live one.
    DropTupleClash = 17, "drop_tuple_clash", Drop;
    /// Passed untouched by egress without a conntrack lookup: the ingress
    /// hook that saw the packet on this node left a word saying that nothing is to be
    /// done there (see [`crate::hint`]).
    PassByIngress = 18, "pass_by_ingress", Pass;
    /// Not forwarded: too big for the path to the backend once
    /// encapsulated (DSR); answered with ICMP "fragmentation needed"
    /// (IPv6: "packet too big") naming the MTU left for it, so that the
    /// client's path MTU discovery adapts.
    RejectTooBig = 19, "reject_too_big", Reject;
    /// Dropped: a DSR flow's packet that XDP could not send to the
    /// backend's node (no complete route: the neighbour unresolved, say)
    /// and cannot pass to the stack encapsulated (see docs/datapath.md).
    DropDsrUnroutable = 20, "drop_dsr_unroutable", Drop;
    /// Dropped: an IPv4 packet without "don't fragment" too big for the
    /// path once encapsulated (XDP does not fragment).
    DropDsrTooBig = 21, "drop_dsr_too_big", Drop;
    /// Dropped: host routing found the translated packet's route but could
    /// not write its forwarding headers (TTL, MAC addresses); the flow
    /// statistics count it under `fwd_other` too.
    DropForwardFailed = 22, "drop_forward_failed", Drop;
}

impl Event {
    pub const fn is_drop(self) -> bool {
        matches!(self.kind(), EventKind::Drop)
    }
}

// Every event fits a hook's block of counters, and its number is its place
// in `ALL` (readers index `ALL` by the number).
const _: () = {
    assert!(Event::ALL.len() <= HOOK_STRIDE as usize);
    let mut i = 0;
    while i < Event::ALL.len() {
        assert!(Event::ALL[i] as usize == i);
        i += 1;
    }
};

/// Number of slots in [`crate::names::COUNTERS`]: one block per hook, with
/// room to append events and hooks.
pub const COUNTER_SLOTS: u32 = 8 * HOOK_STRIDE;

/// What new flows needed, beyond their per-packet event: indexes of
/// [`crate::names::FLOW_STATS`]. Append-only.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowStat {
    /// Masqueraded with its hashed SNAT port (no egress entries).
    SnatHashed = 0,
    /// Masqueraded with another port (the hashed one was held by a live
    /// flow to the same backend): explicit egress entries.
    SnatFallback = 1,
    /// A port held by a closed or expired flow was taken over.
    SnatTakeover = 2,
    /// A TCP SYN reopened the tuple of a closed flow (new backend choice).
    Reopened = 3,
    /// Fallback ports tried and found held by live flows.
    SnatPortsBusy = 4,
    /// A closed or expired flow from the same client address and port to
    /// the same backend (through another frontend) gave its tuple up to a
    /// new flow.
    TupleTakeover = 5,
    /// Packets sent by host routing straight to the device of their route
    /// (counted per packet, not per flow).
    HostRouted = 6,
    /// Packets XDP forwarded itself (`XDP_TX` out of the device they came
    /// in on, `XDP_REDIRECT` to another), never climbing the node's stack.
    XdpForwarded = 7,
    /// Translated packets host routing or XDP forwarding left to the stack,
    /// by reason (counted per packet): the next hop's neighbour entry is
    /// not resolved...
    FwdNoNeighbour = 8,
    /// ... the packet exceeds the route's MTU (the stack answers with
    /// ICMP)...
    FwdFragNeeded = 9,
    /// ... the FIB does not forward it (a local destination, no route,
    /// forwarding disabled on the device)...
    FwdNotForwarded = 10,
    /// ... its TTL (hop limit) would expire (the stack answers with ICMP)...
    FwdTtl = 11,
    /// ... the route's device does not take XDP frames (not one of ours in
    /// native XDP: a veth to a pod, say)...
    FwdDevice = 12,
    /// ... anything else: a VLAN tag, a masqueraded flow whose SNAT port's
    /// entry no longer names its client (egress passes such packets
    /// untranslated, as before).
    FwdOther = 13,
    /// Packets sent to a backend on another node encapsulated (DSR).
    DsrEncapsulated = 14,
    /// Encapsulated packets received for a local backend and translated.
    DsrDecapsulated = 15,
    /// New DSR flows XDP could not route to the backend's node at their
    /// first packet, served masqueraded instead (the stack resolves the
    /// neighbour meanwhile).
    DsrFallbackSnat = 16,
    /// New masqueraded flows dropped without a search: their CPU found the
    /// backend's SNAT ports exhausted less than `SNAT_BACKOFF_MS` ago.
    SnatBackoff = 17,
    /// Conntrack entries of flows that became assured (see
    /// `ct::assured`), copied into the assured table, which no flood of
    /// new flows can evict from.
    CtAssured = 18,
    /// Entries of assured flows left unprotected because the assured table
    /// is full (they work; a flood can evict them for good).
    CtAssuredFull = 19,
    /// Entries of new flows the datapath wrote into the conntrack LRU.
    /// What the LRU evicted is these and the restored ones
    /// ([`FlowStat::CtRestored`]), less those the datapath removed
    /// ([`FlowStat::CtRemoved`]), less those the agent deleted
    /// ([`FlowStat::CtDeleted`]), less those it holds: the agent's
    /// `dataplane_conntrack_evictions`.
    CtInserted = 20,
    /// Entries the datapath removed from the LRU (taken over by a new
    /// flow).
    CtRemoved = 21,
    /// Entries of assured flows the LRU had evicted, put back from their
    /// copy when their flow's next packet looked for them: each is an
    /// established connection a flood would have broken.
    CtRestored = 22,
    /// New flows started by a TCP segment other than a SYN: a connection
    /// whose entries were evicted (unassured), expired or collected sending
    /// again (it is picked up, as netfilter's loose TCP tracking does,
    /// possibly to another backend).
    CtMidstream = 23,
    /// Entries the agent deleted from the LRU (the UDP flows of an endpoint
    /// that stopped serving). Written by the agent alone (its count on the
    /// first CPU's slot).
    CtDeleted = 24,
    /// Expired copies the agent collected from the assured table. Written
    /// by the agent alone, as above.
    CtCollected = 25,
    /// New masqueraded flows given a port although another client's flow
    /// on it was closed by its backend first less than 120 s ago (the
    /// backend holds the tuple in TIME_WAIT): no free port among those
    /// tried (or, in a backoff, the hashed port alone). Each may stall.
    SnatTimeWaitReuse = 26,
    /// New masqueraded flows whose hashed port was passed over because
    /// another client's flow on it was closed by its backend first less
    /// than 120 s ago (netfilter keeps such a tuple in TIME_WAIT).
    SnatTimeWaitHeld = 27,
}

impl FlowStat {
    pub const ALL: [FlowStat; 28] = [
        FlowStat::SnatHashed,
        FlowStat::SnatFallback,
        FlowStat::SnatTakeover,
        FlowStat::Reopened,
        FlowStat::SnatPortsBusy,
        FlowStat::TupleTakeover,
        FlowStat::HostRouted,
        FlowStat::XdpForwarded,
        FlowStat::FwdNoNeighbour,
        FlowStat::FwdFragNeeded,
        FlowStat::FwdNotForwarded,
        FlowStat::FwdTtl,
        FlowStat::FwdDevice,
        FlowStat::FwdOther,
        FlowStat::DsrEncapsulated,
        FlowStat::DsrDecapsulated,
        FlowStat::DsrFallbackSnat,
        FlowStat::SnatBackoff,
        FlowStat::CtAssured,
        FlowStat::CtAssuredFull,
        FlowStat::CtInserted,
        FlowStat::CtRemoved,
        FlowStat::CtRestored,
        FlowStat::CtMidstream,
        FlowStat::CtDeleted,
        FlowStat::CtCollected,
        FlowStat::SnatTimeWaitReuse,
        FlowStat::SnatTimeWaitHeld,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            FlowStat::SnatHashed => "snat_hashed_port",
            FlowStat::SnatFallback => "snat_fallback_port",
            FlowStat::SnatTakeover => "snat_port_takeover",
            FlowStat::Reopened => "reopened_closed_flow",
            FlowStat::SnatPortsBusy => "snat_ports_busy",
            FlowStat::TupleTakeover => "tuple_takeover",
            FlowStat::HostRouted => "host_routed",
            FlowStat::XdpForwarded => "xdp_forwarded",
            FlowStat::FwdNoNeighbour => "forward_fallback_no_neighbour",
            FlowStat::FwdFragNeeded => "forward_fallback_frag_needed",
            FlowStat::FwdNotForwarded => "forward_fallback_not_forwarded",
            FlowStat::FwdTtl => "forward_fallback_ttl",
            FlowStat::FwdDevice => "forward_fallback_device",
            FlowStat::FwdOther => "forward_fallback_other",
            FlowStat::DsrEncapsulated => "dsr_encapsulated",
            FlowStat::DsrDecapsulated => "dsr_decapsulated",
            FlowStat::DsrFallbackSnat => "dsr_fallback_snat",
            FlowStat::SnatBackoff => "snat_backoff",
            FlowStat::CtAssured => "ct_assured",
            FlowStat::CtAssuredFull => "ct_assured_table_full",
            FlowStat::CtInserted => "ct_inserted",
            FlowStat::CtRemoved => "ct_removed",
            FlowStat::CtRestored => "ct_restored",
            FlowStat::CtMidstream => "ct_midstream_pickup",
            FlowStat::CtDeleted => "ct_deleted",
            FlowStat::CtCollected => "ct_collected",
            FlowStat::SnatTimeWaitReuse => "snat_time_wait_reuse",
            FlowStat::SnatTimeWaitHeld => "snat_time_wait_held",
        }
    }
}

/// Slots in [`crate::names::FLOW_STATS`].
pub const FLOW_STAT_SLOTS: u32 = 32;
