//! Header layouts, the TCP flags the datapath reads, and [`Pkt`]: what a
//! parsed packet is. Offsets come from the `network-types` header structs.
//! Plain data: every module that reads or writes a header names its fields
//! from here, below the context (`ctx`) and the parser (`parse`).

use core::mem::{offset_of, size_of};

use dataplane_common::{addr::Addr, ct::CtKey, proto};
use network_types::{
    eth::EthHdr,
    icmp::{Icmpv4Hdr, Icmpv6Hdr},
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
    vlan::VlanHdr,
};

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// Ethernet.
pub mod eth {
    use super::*;
    pub const HLEN: usize = EthHdr::LEN;
    pub const ETHERTYPE: usize = offset_of!(EthHdr, ether_type);
    pub const DST: usize = offset_of!(EthHdr, dst_addr);
    pub const SRC: usize = offset_of!(EthHdr, src_addr);
    /// A VLAN tag's length, and where its inner ethertype sits in it.
    pub const VLAN_HLEN: usize = size_of::<VlanHdr>();
    pub const VLAN_ETHERTYPE: usize = offset_of!(VlanHdr, ether_type);
}

/// IPv4 header fields, from the start of the header.
pub mod ip {
    use super::*;
    pub const HLEN: usize = Ipv4Hdr::LEN;
    pub const TOT_LEN: usize = offset_of!(Ipv4Hdr, tot_len);
    pub const FRAG_OFF: usize = offset_of!(Ipv4Hdr, frags);
    pub const TTL: usize = offset_of!(Ipv4Hdr, ttl);
    pub const PROTO: usize = offset_of!(Ipv4Hdr, proto);
    pub const CHECK: usize = offset_of!(Ipv4Hdr, check);
    pub const SADDR: usize = offset_of!(Ipv4Hdr, src_addr);
    pub const DADDR: usize = offset_of!(Ipv4Hdr, dst_addr);
}

/// IPv6 header fields, from the start of the header.
pub mod ip6 {
    use super::*;
    pub const HLEN: usize = Ipv6Hdr::LEN;
    pub const PAYLOAD_LEN: usize = offset_of!(Ipv6Hdr, payload_len);
    pub const NEXT_HDR: usize = offset_of!(Ipv6Hdr, next_hdr);
    pub const HOP_LIMIT: usize = offset_of!(Ipv6Hdr, hop_limit);
    pub const SADDR: usize = offset_of!(Ipv6Hdr, src_addr);
    pub const DADDR: usize = offset_of!(Ipv6Hdr, dst_addr);
    /// Extension headers: hop-by-hop options, routing, fragment,
    /// authentication, destination options; "no next header".
    pub const HOPOPTS: u8 = 0;
    pub const ROUTING: u8 = 43;
    pub const FRAGMENT: u8 = 44;
    pub const ESP: u8 = 50;
    pub const AUTH: u8 = 51;
    pub const NONE: u8 = 59;
    pub const DSTOPTS: u8 = 60;
    /// Extension headers followed before giving up (passing the packet).
    pub const MAX_EXT: usize = 4;
    /// The L4 header must start within this many bytes of the frame start:
    /// offsets travel in one byte between subprograms (`path::Step`).
    pub const MAX_L4: usize = 200;
}

/// L4 header fields, from the start of the header. TCP and UDP (and SCTP)
/// share the port layout.
pub mod l4 {
    use super::*;
    pub const SPORT: usize = offset_of!(TcpHdr, source);
    pub const DPORT: usize = offset_of!(TcpHdr, dest);
    pub const TCP_HLEN: usize = TcpHdr::LEN;
    /// The data-offset nibble (high half of the bitfield's first byte) and
    /// the flags byte (its second byte).
    pub const TCP_DOFF: usize = offset_of!(TcpHdr, _bitfield_1);
    pub const TCP_FLAGS: usize = TCP_DOFF + 1;
    pub const TCP_CHECK: usize = offset_of!(TcpHdr, check);
    pub const UDP_HLEN: usize = UdpHdr::LEN;
    pub const UDP_CHECK: usize = offset_of!(UdpHdr, check);
    /// SCTP's common header: ports, verification tag, CRC32c.
    pub const SCTP_HLEN: usize = 12;
    pub const SCTP_CHECK: usize = 8;
    pub const ICMP_HLEN: usize = Icmpv4Hdr::LEN;
    pub const ICMP_CHECK: usize = offset_of!(Icmpv4Hdr, check);
    const _: () = assert!(Icmpv6Hdr::LEN == ICMP_HLEN && offset_of!(Icmpv6Hdr, check) == ICMP_CHECK);
    const _: () = assert!(offset_of!(UdpHdr, src) == SPORT && offset_of!(UdpHdr, dst) == DPORT);
}

/// An IP packet whose L4 header (TCP, UDP, SCTP's ports, or the first 8
/// bytes of ICMP) is in the linear data. Offsets are from the frame start.
#[derive(Clone, Copy)]
pub struct Pkt<A> {
    pub l3: usize,
    pub l4: usize,
    /// saddr, daddr, ports (ICMP: 0), proto (the L4 protocol, after IPv6
    /// extension headers); as they lie in the packet.
    pub tuple: CtKey<A>,
    /// TCP flags byte (0 for other protocols).
    pub tcp_flags: u8,
    /// Bytes of the IP packet (host order).
    pub tot_len: u16,
}

impl<A: Addr> Pkt<A> {
    /// Offset of the L4 checksum field, for the protocols we rewrite.
    #[inline(always)]
    pub fn l4_check(&self) -> usize {
        if self.tuple.proto == proto::TCP {
            self.l4 + l4::TCP_CHECK
        } else {
            self.l4 + l4::UDP_CHECK
        }
    }

    /// A TCP SYN without ACK: a client opening a connection.
    #[inline(always)]
    pub fn is_syn(&self) -> bool {
        self.tuple.proto == proto::TCP && self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }
}
