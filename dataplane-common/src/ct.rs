//! Connection tracking: one LRU map; a flow has an entry per place a hook
//! sees it (two without SNAT, four with), each keyed by the tuple as that
//! hook sees the packet and holding the tuple the packet ends up with.
//! Ingress hooks rewrite destinations, egress hooks sources. A flow is
//! translated once; every later packet (and every reply) is an exact-match
//! lookup.

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ct4Key {
    /// Network order.
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}
crate::assert_layout!(Ct4Key, 16, 4);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ct4Entry {
    /// `bpf_ktime_get_coarse_ns` when a packet last used the entry (refreshed at
    /// most once per second).
    pub last_seen_ns: u64,
    /// The tuple packets end up with (network order); ingress hooks apply the
    /// destination half, egress hooks the source half.
    pub nat_saddr: u32,
    pub nat_daddr: u32,
    pub nat_sport: u16,
    pub nat_dport: u16,
    pub backend_id: u32,
    pub service_id: u32,
    /// [`ct_flags`].
    pub flags: u16,
    pub _pad: u16,
}
crate::assert_layout!(Ct4Entry, 32, 8);

pub mod ct_flags {
    /// The entry translates replies (backend → client) rather than the
    /// original direction.
    pub const REPLY: u16 = 1 << 0;
    /// The flow was SNATed to the node.
    pub const SNAT: u16 = 1 << 1;
    /// A TCP FIN or RST was seen: the short close timeout applies.
    pub const CLOSING: u16 = 1 << 2;
}

crate::impl_pod!(Ct4Key, Ct4Entry);

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
