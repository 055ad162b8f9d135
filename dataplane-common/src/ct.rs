//! Connection tracking: one LRU map of entries keyed by a 5-tuple as a hook
//! sees the packet, each holding the tuple the packet ends up with.
//!
//! Destinations are rewritten where packets enter the node (ingress hooks),
//! sources where they leave it (egress hooks), as netfilter does in
//! PREROUTING and POSTROUTING. A flow has two entries:
//!
//! | role      | key (as seen)                                 | hook    | rewrites             |
//! |-----------|-----------------------------------------------|---------|----------------------|
//! | `FWD_IN`  | client → frontend                             | ingress | dst → backend        |
//! | `REP_IN`  | backend → node : SNAT port (masqueraded flows)| ingress | dst → client         |
//! | `REP_OUT` | backend → client (flows kept unmasqueraded)   | egress  | src → frontend       |
//!
//! A masqueraded flow's SNAT port is a hash of the client's address and port
//! (`snat_port_hash`), so egress hooks find its `REP_IN` entry from the
//! packet alone: forward packets (client → backend) get the node's address
//! and that port as source, replies (backend → client) the frontend's. When
//! the hashed port is held by a live flow to the same backend, another port
//! is taken and the flow gets explicit egress entries (`FWD_OUT`: client →
//! backend, src → node : port; `REP_OUT`: backend → client), flagged
//! [`ct_flags::EXPLICIT`].
//!
//! The flow's state (TCP FIN/RST, whether a reply was seen) lives in the
//! `FWD_IN` entry and in the *owner*: the entry the flow's replies hit
//! first (`REP_IN` when masqueraded, `REP_OUT` otherwise). Each of the two
//! can compute the other's key (the reverse of its own translated tuple), so
//! a state change or a refresh seen by one is written to both.

use crate::addr::{Addr, Ip6};

/// A 5-tuple as a hook sees it. Addresses and ports in network order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CtKey<A> {
    pub saddr: A,
    pub daddr: A,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// Padding as scalars, not a byte array: zeroing `[u8; 3]` compiles to
    /// a `memset` call in BPF (a subprogram call per key built).
    pub _pad0: u8,
    pub _pad1: u16,
}
pub type Ct4Key = CtKey<u32>;
pub type Ct6Key = CtKey<Ip6>;
crate::assert_layout!(Ct4Key, 16, 4);
crate::assert_layout!(Ct6Key, 40, 4);

impl<A: Addr> CtKey<A> {
    #[inline(always)]
    pub fn new(saddr: A, daddr: A, sport: u16, dport: u16, proto: u8) -> Self {
        Self {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            _pad0: 0,
            _pad1: 0,
        }
    }

    /// The key of the packets flowing the other way.
    #[inline(always)]
    pub fn reversed(&self) -> Self {
        Self::new(self.daddr, self.saddr, self.dport, self.sport, self.proto)
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntry<A> {
    /// The datapath clock (monotonic ns at tick resolution, see the
    /// eBPF side's `ct::now`) when a packet of the flow last used it
    /// (refreshed at most once per second, on both of the flow's state
    /// entries at once).
    pub last_seen_ns: u64,
    /// The tuple packets end up with (network order); ingress hooks apply the
    /// destination half, egress hooks the source half.
    pub nat_saddr: A,
    pub nat_daddr: A,
    pub nat_sport: u16,
    pub nat_dport: u16,
    pub service_id: u32,
    /// [`ct_flags`]: the entry's role, SNAT and EXPLICIT; written once.
    pub flags: u8,
    /// The flow's state, one byte per fact ([`state`] indexes), each 0 or 1:
    /// hooks on different CPUs set different facts at once without locks
    /// or atomics, since a byte store cannot clobber its neighbours.
    pub state: [u8; 4],
    /// Scalars, as in [`CtKey`].
    pub _pad0: u8,
    pub _pad1: u16,
}
pub type Ct4Entry = CtEntry<u32>;
pub type Ct6Entry = CtEntry<Ip6>;
crate::assert_layout!(Ct4Entry, 32, 8);
crate::assert_layout!(Ct6Entry, 56, 8);

impl<A: Addr> CtEntry<A> {
    /// Idle timeout of the entry in seconds, by its flow's state (TCP
    /// before a reply, established, half-closed, closed; UDP/SCTP before
    /// and after a reply): what the datapath ignores it after, and what the
    /// agent collects its assured copy after.
    #[inline(always)]
    pub fn timeout_s(&self, proto: u8, t: &crate::config::CtTimeouts) -> u32 {
        if proto == crate::proto::TCP {
            if self.tcp_closed() {
                t.tcp_closed
            } else if self.has(state::FIN_FWD) || self.has(state::FIN_REP) {
                t.tcp_half_closed
            } else if self.has(state::REPLIED) {
                t.tcp_established
            } else {
                t.tcp_syn
            }
        } else if self.has(state::REPLIED) {
            t.udp
        } else {
            t.udp_unreplied
        }
    }

    #[inline(always)]
    pub fn role(&self) -> u8 {
        self.flags & ct_flags::ROLE_MASK
    }

    /// The translated tuple, as a key.
    #[inline(always)]
    pub fn nat_key(&self, proto: u8) -> CtKey<A> {
        CtKey::new(
            self.nat_saddr,
            self.nat_daddr,
            self.nat_sport,
            self.nat_dport,
            proto,
        )
    }

    #[inline(always)]
    pub fn has(&self, fact: usize) -> bool {
        self.state[fact] != 0
    }

    /// Whether a TCP flow has ended: a RST, or a FIN each way.
    #[inline(always)]
    pub fn tcp_closed(&self) -> bool {
        self.has(state::RST) || (self.has(state::FIN_FWD) && self.has(state::FIN_REP))
    }
}

pub mod ct_flags {
    /// Bits 0-1: the entry's role (see the module docs).
    pub const ROLE_MASK: u8 = 0b11;
    pub const FWD_IN: u8 = 0;
    pub const FWD_OUT: u8 = 1;
    pub const REP_IN: u8 = 2;
    pub const REP_OUT: u8 = 3;
    /// The flow is masqueraded (SNAT to the node).
    pub const SNAT: u8 = 1 << 2;
    /// Masqueraded with a port other than its hash: explicit egress
    /// entries exist.
    pub const EXPLICIT: u8 = 1 << 3;
    /// A `FWD_IN` of a direct-server-return flow, on the node that chose
    /// its backend: packets are sent to `nat_daddr` (the backend, on
    /// another node) encapsulated, untranslated; the replies never come
    /// back here, so the flow has no other entry on this node.
    pub const DSR: u8 = 1 << 4;
    /// The flow is assured: the entry has a copy in the assured table
    /// (`CT4_ASSURED`), which no flood of new flows can evict from (see
    /// [`super::assured`]).
    pub const ASSURED: u8 = 1 << 5;
}

/// Conntrack lives in an LRU map, which a flood of new flows evicts from,
/// least recently used first, established connections as readily as the
/// flood's own flows. A flow becomes assured as netfilter marks a
/// connection assured; from then on its entries also have a copy in the
/// assured table (a hash map that never evicts; the agent collects expired
/// copies). When the LRU has evicted one of them, the flow's next packet
/// finds the copy and puts it back: a flood cannot break an assured flow.
/// Its copies follow its state (facts as they are learnt, the timestamp on
/// each once-a-second refresh). A flow is assured:
///
/// - TCP: the client's first segment after the server answered (the
///   handshake's last ACK): a packet from the client side, not a SYN, with
///   a reply seen.
/// - UDP and SCTP: traffic both ways, still flowing after a second (the
///   first refresh of an entry that has seen a reply): a stream, not a
///   probe (netfilter waits two seconds).
/// - A DSR flow (its replies never come through this node): when the
///   client's first segment after the SYN shows it was answered.
pub mod assured {}

/// Indexes of [`Ct4Entry::state`].
pub mod state {
    /// A FIN was seen from the client side.
    pub const FIN_FWD: usize = 0;
    /// A FIN was seen from the backend side.
    pub const FIN_REP: usize = 1;
    /// A RST was seen (either way).
    pub const RST: usize = 2;
    /// A reply was seen: the flow is established (TCP) or a stream (UDP).
    pub const REPLIED: usize = 3;
}

/// SNAT port of a masqueraded flow from `client:port` (network order), in
/// `[min, max]` (host order): what egress hooks compute to find the flow.
/// `seed` is a per-node secret kept across agent restarts.
#[inline(always)]
pub fn snat_port_hash<A: Addr>(client: A, port: u16, seed: u32, min: u16, max: u16) -> u16 {
    // A 32-bit finaliser (murmur3 fmix32) over the address and port.
    let mut h = client.fold() ^ seed ^ ((port as u32) << 16 | port as u32).rotate_left(7);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    let range = (max as u32).wrapping_sub(min as u32).wrapping_add(1);
    if range == 0 || max < min {
        return min;
    }
    (min as u32 + h % range) as u16
}

crate::impl_pod_generic!(CtKey, CtEntry);

/// Per CPU and backend id: the SNAT port search's state (`DP_SNAT_CURSORS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnatCursor {
    /// Where the fallback search resumes (0: not started).
    pub next: u32,
    /// Until when (the datapath clock in ms, wrapping) new flows to this
    /// backend try only their hashed port: the last full search found every
    /// port it tried held by a live flow (the backend's ports are
    /// exhausted), and another would cost as much for nothing.
    pub backoff_until_ms: u32,
}
crate::assert_layout!(SnatCursor, 8, 4);
crate::impl_pod!(SnatCursor);

/// A masqueraded TCP flow whose backend closed it first (FIN, then the
/// client's FIN), by its `REP_IN` key (backend → node : SNAT port): when,
/// and whose it was. The backend holds the tuple in TIME_WAIT (60 s on
/// Linux); a SYN from another client on that tuple, whose sequence numbers and
/// timestamps bear no relation to the old connection's, may then be
/// answered with an ACK of the old one. Kept apart from conntrack, whose
/// entries a busy node turns over in seconds.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnatClosed {
    /// The datapath clock when the flow closed.
    pub closed_ns: u64,
    /// The client's address ([`Addr::fold`]: the address itself for IPv4)
    /// and port (network order): the same client port reopening the tuple
    /// is not held back (its new connection's sequence numbers and
    /// timestamps follow the old one's, and TIME_WAIT accepts it).
    pub client: u32,
    pub client_port: u16,
    pub _pad: u16,
}
crate::assert_layout!(SnatClosed, 16, 8);
crate::impl_pod!(SnatClosed);

/// Connect-time translation: which Service address a socket's backend
/// stands for (getpeername, recvmsg).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sock4RevKey {
    pub cookie: u64,
    /// Backend address and port (network order).
    pub addr: u32,
    pub port: u16,
    pub _pad: u16,
}
crate::assert_layout!(Sock4RevKey, 16, 8);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sock4RevValue {
    /// Service address and port (network order).
    pub addr: u32,
    pub port: u16,
    pub _pad: u16,
}
crate::assert_layout!(Sock4RevValue, 8, 4);

crate::impl_pod!(Sock4RevKey, Sock4RevValue);

/// [`Sock4RevKey`] for IPv6 sockets.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sock6RevKey {
    pub cookie: u64,
    /// Backend address and port (network order).
    pub addr: Ip6,
    pub port: u16,
    /// Scalars, as in [`CtKey`].
    pub _pad0: u16,
    pub _pad1: u32,
}
crate::assert_layout!(Sock6RevKey, 32, 8);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sock6RevValue {
    /// Service address and port (network order).
    pub addr: Ip6,
    pub port: u16,
    pub _pad: u16,
}
crate::assert_layout!(Sock6RevValue, 20, 4);

crate::impl_pod!(Sock6RevKey, Sock6RevValue);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashed_ports_stay_in_range_and_spread() {
        let mut seen = [0u32; 64];
        for i in 0..100_000u32 {
            let p = snat_port_hash(
                0x0a00_0001u32.to_be() ^ i,
                (40_000 + (i % 20_000)) as u16,
                7,
                1024,
                32767,
            );
            assert!((1024..=32767).contains(&p));
            seen[((p - 1024) as usize * 64) / 31744] += 1;
        }
        // Every 1/64th of the range gets between half and twice its share.
        assert!(
            seen.iter().all(|&n| n > 100_000 / 128 && n < 100_000 / 32),
            "{seen:?}"
        );
        assert_eq!(snat_port_hash(1, 2, 3, 5000, 5000), 5000);
    }
}
