//! Test packets: built and checked here, independently of the datapath's
//! own code (its checksum arithmetic is what these tests check).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;
pub const SCTP: u8 = 132;
pub const ICMPV6: u8 = 58;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// RFC 1071 checksum, straightforward (no incremental tricks).
pub fn internet_checksum(chunks: &[&[u8]]) -> u16 {
    let bytes: Vec<u8> = chunks.concat();
    let mut sum: u64 = 0;
    for pair in bytes.chunks(2) {
        let word = if pair.len() == 2 {
            u16::from_be_bytes([pair[0], pair[1]])
        } else {
            u16::from_be_bytes([pair[0], 0])
        };
        sum += word as u64;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A frame description; [`Frame::build`] makes the bytes with correct
/// checksums.
#[derive(Clone, Debug)]
pub struct Frame {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    /// 802.1Q tags (outermost first).
    pub vlans: Vec<u16>,
    /// Both IPv4 or both IPv6: the frame's family.
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub proto: u8,
    pub tcp_flags: u8,
    /// TTL (IPv4) or hop limit (IPv6).
    pub ttl: u8,
    /// IPv4 options (a multiple of 4 bytes).
    pub ip_options: Vec<u8>,
    /// IPv6 extension headers, in order, before the L4 header.
    pub ext: Vec<Ext>,
    pub payload: Vec<u8>,
    /// UDP: send a zero ("none") checksum.
    pub udp_zero_checksum: bool,
    pub ip_id: u16,
    /// Fragment field (flags + offset, host order).
    pub frag: u16,
}

impl Frame {
    pub fn tcp(src: impl Into<SocketAddr>, dst: impl Into<SocketAddr>, flags: u8) -> Self {
        Self {
            src_mac: [0x02, 0, 0, 0, 0, 0x01],
            dst_mac: [0x02, 0, 0, 0, 0, 0x02],
            vlans: Vec::new(),
            src: src.into(),
            dst: dst.into(),
            proto: TCP,
            tcp_flags: flags,
            ttl: 64,
            ip_options: Vec::new(),
            ext: Vec::new(),
            payload: b"hello".to_vec(),
            udp_zero_checksum: false,
            ip_id: 0x1234,
            frag: 0,
        }
    }

    pub fn udp(src: impl Into<SocketAddr>, dst: impl Into<SocketAddr>) -> Self {
        Self {
            proto: UDP,
            tcp_flags: 0,
            ..Self::tcp(src, dst, 0)
        }
    }

    /// An SCTP packet: the common header and a DATA chunk carrying the
    /// payload, with its CRC32c.
    pub fn sctp(src: impl Into<SocketAddr>, dst: impl Into<SocketAddr>) -> Self {
        Self {
            proto: SCTP,
            tcp_flags: 0,
            ..Self::tcp(src, dst, 0)
        }
    }

    pub fn l4(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend_from_slice(&self.src.port().to_be_bytes());
        l4.extend_from_slice(&self.dst.port().to_be_bytes());
        match self.proto {
            TCP => {
                l4.extend_from_slice(&1000u32.to_be_bytes()); // seq
                l4.extend_from_slice(&0u32.to_be_bytes()); // ack
                l4.push(5 << 4);
                l4.push(self.tcp_flags);
                l4.extend_from_slice(&64240u16.to_be_bytes());
                l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
            }
            SCTP => {
                l4.extend_from_slice(&0x1234_5678u32.to_be_bytes()); // verification tag
                l4.extend_from_slice(&[0; 4]); // CRC32c, below
                // A DATA chunk: type, flags, length, TSN, stream, SSN, PPID.
                let chunk_len = 16 + self.payload.len();
                l4.extend_from_slice(&[0, 0x03]);
                l4.extend_from_slice(&(chunk_len as u16).to_be_bytes());
                l4.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
                l4.extend_from_slice(&self.payload);
                while l4.len() % 4 != 0 {
                    l4.push(0);
                }
                let crc = crc32c::crc32c(&l4);
                l4[8..12].copy_from_slice(&crc.to_le_bytes());
                return l4;
            }
            _ => {
                l4.extend_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
                l4.extend_from_slice(&[0, 0]);
            }
        }
        l4.extend_from_slice(&self.payload);
        let check_at = if self.proto == TCP { 16 } else { 6 };
        if !(self.proto == UDP && self.udp_zero_checksum) {
            let pseudo = pseudo_header_of(self.src.ip(), self.dst.ip(), self.proto, l4.len());
            let mut c = internet_checksum(&[&pseudo, &l4]);
            if self.proto == UDP && c == 0 {
                c = 0xffff;
            }
            l4[check_at..check_at + 2].copy_from_slice(&c.to_be_bytes());
        }
        l4
    }

    pub fn build(&self) -> Vec<u8> {
        let l4 = self.l4();
        let mut f = Vec::new();
        f.extend_from_slice(&self.dst_mac);
        f.extend_from_slice(&self.src_mac);
        for vid in &self.vlans {
            f.extend_from_slice(&0x8100u16.to_be_bytes());
            f.extend_from_slice(&vid.to_be_bytes());
        }
        let (src, dst) = match (self.src.ip(), self.dst.ip()) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => (src, dst),
            (IpAddr::V6(src), IpAddr::V6(dst)) => {
                f.extend_from_slice(&0x86ddu16.to_be_bytes());
                f.extend_from_slice(&self.ipv6_header(src, dst, l4.len()));
                f.extend_from_slice(&l4);
                return f;
            }
            _ => panic!("a frame from {} to {} mixes families", self.src, self.dst),
        };
        f.extend_from_slice(&0x0800u16.to_be_bytes());
        let ihl = 5 + self.ip_options.len() / 4;
        let mut ip = vec![(4 << 4) | ihl as u8, 0];
        ip.extend_from_slice(&((ihl * 4 + l4.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&self.ip_id.to_be_bytes());
        ip.extend_from_slice(&self.frag.to_be_bytes());
        ip.push(self.ttl);
        ip.push(self.proto);
        ip.extend_from_slice(&[0, 0]);
        ip.extend_from_slice(&src.octets());
        ip.extend_from_slice(&dst.octets());
        ip.extend_from_slice(&self.ip_options);
        let c = internet_checksum(&[&ip]);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        f.extend_from_slice(&ip);
        f.extend_from_slice(&l4);
        f
    }

    /// The IPv6 header and extension headers for `l4_len` bytes of L4.
    fn ipv6_header(&self, src: Ipv6Addr, dst: Ipv6Addr, l4_len: usize) -> Vec<u8> {
        assert!(self.ip_options.is_empty(), "IPv4 options on an IPv6 frame");
        let mut chain = Vec::new();
        for (i, e) in self.ext.iter().enumerate() {
            let next = self.ext.get(i + 1).map_or(self.proto, Ext::kind);
            chain.extend_from_slice(&e.bytes(next));
        }
        let first = self.ext.first().map_or(self.proto, Ext::kind);
        let mut ip = vec![0x60, 0, 0, 0];
        ip.extend_from_slice(&((chain.len() + l4_len) as u16).to_be_bytes());
        ip.push(first);
        ip.push(self.ttl);
        ip.extend_from_slice(&src.octets());
        ip.extend_from_slice(&dst.octets());
        ip.extend_from_slice(&chain);
        ip
    }
}

/// An IPv6 extension header.
#[derive(Clone, Copy, Debug)]
pub enum Ext {
    /// Hop-by-hop (0) or destination (60) options: padding, `units` more
    /// 8-byte units than the minimum.
    Options { kind: u8, units: u8 },
    /// A routing header (43) with no segments left (ignored by the node).
    Routing,
    /// A fragment header (44): offset in 8-byte units, more-fragments flag.
    Fragment { offset: u16, more: bool },
    /// An authentication header (51, IPsec): its length counts 4-byte units.
    Auth,
}

impl Ext {
    pub fn kind(&self) -> u8 {
        match self {
            Ext::Options { kind, .. } => *kind,
            Ext::Routing => 43,
            Ext::Fragment { .. } => 44,
            Ext::Auth => 51,
        }
    }

    /// The header's bytes, `next` its next header.
    pub fn bytes(&self, next: u8) -> Vec<u8> {
        match *self {
            Ext::Options { units, .. } => {
                let len = 8 * (usize::from(units) + 1);
                // PadN over the rest of the header.
                let mut h = vec![next, units, 1, (len - 4) as u8];
                h.resize(len, 0);
                h
            }
            Ext::Routing => vec![next, 0, 253, 0, 0, 0, 0, 0],
            Ext::Fragment { offset, more } => {
                let mut h = vec![next, 0];
                h.extend_from_slice(&((offset << 3) | u16::from(more)).to_be_bytes());
                h.extend_from_slice(&0x0bad_f00du32.to_be_bytes());
                h
            }
            // 12 bytes of header and a 12-byte ICV: (24 / 4) - 2.
            Ext::Auth => {
                let mut h = vec![next, 4, 0, 0];
                h.extend_from_slice(&0x100u32.to_be_bytes());
                h.extend_from_slice(&1u32.to_be_bytes());
                h.resize(24, 0xab);
                h
            }
        }
    }
}

/// The TCP/UDP/ICMPv6 pseudo-header of either family.
pub fn pseudo_header_of(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => pseudo_header(src, dst, proto, len),
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let mut p = Vec::new();
            p.extend_from_slice(&src.octets());
            p.extend_from_slice(&dst.octets());
            p.extend_from_slice(&(len as u32).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, proto]);
            p
        }
        _ => panic!("pseudo-header mixing families"),
    }
}

pub fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.push(0);
    p.push(proto);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p
}

/// A received frame, parsed and checked: panics with a clear message when
/// an IP or L4 checksum is wrong.
#[derive(Clone, Debug)]
pub struct Parsed {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub l3: usize,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// The L4 protocol (after IPv6 extension headers).
    pub proto: u8,
    /// TTL or hop limit.
    pub ttl: u8,
    pub sport: u16,
    pub dport: u16,
    /// Everything after the IP header (and IPv6 extension headers).
    pub l4: Vec<u8>,
    /// The IP header (with IPv4 options or IPv6 extension headers).
    pub ip_header: Vec<u8>,
}

impl Parsed {
    pub fn src_addr(&self) -> SocketAddr {
        SocketAddr::new(self.src, self.sport)
    }
    pub fn dst_addr(&self) -> SocketAddr {
        SocketAddr::new(self.dst, self.dport)
    }
}

pub fn parse_and_verify(frame: &[u8]) -> Parsed {
    assert!(frame.len() >= 34, "frame too short: {}", frame.len());
    let mut l3 = 14;
    let mut ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    while ethertype == 0x8100 || ethertype == 0x88a8 {
        ethertype = u16::from_be_bytes([frame[l3 + 2], frame[l3 + 3]]);
        l3 += 4;
    }
    let (src, dst, proto, ttl, ip, l4): (IpAddr, IpAddr, u8, u8, &[u8], &[u8]) = match ethertype {
        0x0800 => {
            let ihl = (frame[l3] & 0x0f) as usize * 4;
            let tot_len = u16::from_be_bytes([frame[l3 + 2], frame[l3 + 3]]) as usize;
            assert!(
                frame.len() >= l3 + tot_len,
                "IP total length {tot_len} beyond the frame"
            );
            let ip = &frame[l3..l3 + ihl];
            assert_eq!(internet_checksum(&[ip]), 0, "IP header checksum is wrong");
            (
                Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]).into(),
                Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]).into(),
                ip[9],
                ip[8],
                ip,
                &frame[l3 + ihl..l3 + tot_len],
            )
        }
        0x86dd => {
            let h = &frame[l3..l3 + 40];
            let payload_len = u16::from_be_bytes([h[4], h[5]]) as usize;
            assert!(
                frame.len() >= l3 + 40 + payload_len,
                "IPv6 payload length {payload_len} beyond the frame"
            );
            let addr = |o: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&h[o..o + 16]).unwrap());
            // Walk the extension headers to the L4 header.
            let (mut next, mut at) = (h[6], l3 + 40);
            loop {
                match next {
                    0 | 43 | 60 => {
                        let len = 8 * (usize::from(frame[at + 1]) + 1);
                        next = frame[at];
                        at += len;
                    }
                    51 => {
                        let len = 4 * (usize::from(frame[at + 1]) + 2);
                        next = frame[at];
                        at += len;
                    }
                    _ => break,
                }
            }
            (
                addr(8).into(),
                addr(24).into(),
                next,
                h[7],
                &frame[l3..at],
                &frame[at..l3 + 40 + payload_len],
            )
        }
        other => panic!("neither IPv4 nor IPv6: ethertype {other:#06x}"),
    };
    let (mut sport, mut dport) = (0, 0);
    match proto {
        TCP | UDP => {
            sport = u16::from_be_bytes([l4[0], l4[1]]);
            dport = u16::from_be_bytes([l4[2], l4[3]]);
            let zero_udp = proto == UDP && l4[6] == 0 && l4[7] == 0;
            assert!(
                !(zero_udp && src.is_ipv6()),
                "a zero UDP checksum is invalid in IPv6"
            );
            if !zero_udp {
                let pseudo = pseudo_header_of(src, dst, proto, l4.len());
                assert_eq!(
                    internet_checksum(&[&pseudo, l4]),
                    0,
                    "{} checksum is wrong",
                    if proto == TCP { "TCP" } else { "UDP" }
                );
            }
        }
        ICMP => assert_eq!(internet_checksum(&[l4]), 0, "ICMP checksum is wrong"),
        ICMPV6 => assert_eq!(
            internet_checksum(&[&pseudo_header_of(src, dst, ICMPV6, l4.len()), l4]),
            0,
            "ICMPv6 checksum is wrong"
        ),
        SCTP => {
            sport = u16::from_be_bytes([l4[0], l4[1]]);
            dport = u16::from_be_bytes([l4[2], l4[3]]);
            assert_eq!(sctp_crc_ok(l4), Some(true), "SCTP CRC32c is wrong");
        }
        _ => {}
    }
    Parsed {
        src_mac: frame[6..12].try_into().unwrap(),
        dst_mac: frame[0..6].try_into().unwrap(),
        l3,
        src,
        dst,
        proto,
        ttl,
        sport,
        dport,
        l4: l4.to_vec(),
        ip_header: ip.to_vec(),
    }
}

/// An Ethernet frame carrying an ICMP error (`icmp_type`/`code`, e.g. 3/4
/// "fragmentation needed" with `mtu`) from `src` to `dst`, quoting the first
/// 28 bytes (IP header and 8 bytes of L4) of the IP packet in `about` (a
/// frame as [`Frame::build`] makes it).
pub fn icmp_error(src: Ipv4Addr, dst: Ipv4Addr, icmp_type: u8, code: u8, mtu: u16, about: &[u8]) -> Vec<u8> {
    let quote = &about[14..14 + 28];
    let mut icmp = vec![icmp_type, code, 0, 0, 0, 0];
    icmp.extend_from_slice(&mtu.to_be_bytes());
    icmp.extend_from_slice(quote);
    let c = internet_checksum(&[&icmp]);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let mut f = vec![0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x08, 0x00];
    let mut ip = vec![0x45, 0xc0];
    ip.extend_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0, 0, 0, 0, 64, ICMP, 0, 0]);
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let c = internet_checksum(&[&ip]);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&icmp);
    f
}

/// An Ethernet frame carrying an ICMPv6 error (`icmp_type`/`code`, e.g.
/// 2/0 "packet too big" with `mtu`, 1/4 "port unreachable") from `src` to
/// `dst`, quoting as much of the IPv6 packet in `about` (a frame as
/// [`Frame::build`] makes it, without VLAN tags) as fits in 1280 bytes.
pub fn icmp6_error(src: Ipv6Addr, dst: Ipv6Addr, icmp_type: u8, code: u8, mtu: u32, about: &[u8]) -> Vec<u8> {
    let quote = &about[14..about.len().min(14 + 1280 - 48)];
    let mut icmp = vec![icmp_type, code, 0, 0];
    icmp.extend_from_slice(&mtu.to_be_bytes());
    icmp.extend_from_slice(quote);
    icmp6_frame(src, dst, icmp)
}

/// An Ethernet frame carrying an ICMPv6 echo request from `src` to `dst`.
pub fn icmp6_echo_request(src: Ipv6Addr, dst: Ipv6Addr) -> Vec<u8> {
    icmp6_frame(src, dst, vec![128, 0, 0, 0, 0x12, 0x34, 0, 1])
}

/// An Ethernet frame carrying the ICMPv6 message `icmp` (its checksum
/// filled in) from `src` to `dst`.
fn icmp6_frame(src: Ipv6Addr, dst: Ipv6Addr, mut icmp: Vec<u8>) -> Vec<u8> {
    let c = internet_checksum(&[
        &pseudo_header_of(src.into(), dst.into(), ICMPV6, icmp.len()),
        &icmp,
    ]);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let mut f = vec![0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x86, 0xdd];
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    f.extend_from_slice(&[ICMPV6, 64]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(&icmp);
    f
}

/// Whether an SCTP packet's CRC32c (computed with its field zeroed, stored
/// little-endian) is right, or zero: left for the device to compute, which
/// the datapath must preserve; `None` if it has no common header.
pub fn sctp_crc_ok(l4: &[u8]) -> Option<bool> {
    if l4.len() < 12 {
        return None;
    }
    let stored = u32::from_le_bytes([l4[8], l4[9], l4[10], l4[11]]);
    let mut zeroed = l4.to_vec();
    zeroed[8..12].fill(0);
    Some(stored == 0 || crc32c::crc32c(&zeroed) == stored)
}

/// A frame's ethertype and where its L3 header starts, after at most two
/// VLAN tags (802.1Q or 802.1ad, as many as the datapath takes; behind a
/// third, the tag's type is returned). `None` when the frame is shorter
/// than an Ethernet header or a tag is cut short. Never panics: for frames
/// that may be malformed (the fuzzer's).
pub fn ethertype(frame: &[u8]) -> Option<(u16, usize)> {
    if frame.len() < 14 {
        return None;
    }
    let be16 = |at: usize| u16::from_be_bytes([frame[at], frame[at + 1]]);
    let (mut ethertype, mut l3) = (be16(12), 14);
    for _ in 0..2 {
        if !(ethertype == 0x8100 || ethertype == 0x88a8) {
            break;
        }
        if frame.len() < l3 + 4 {
            return None;
        }
        ethertype = be16(l3 + 2);
        l3 += 4;
    }
    Some((ethertype, l3))
}

/// `frame` (as [`Frame::build`] makes it, without VLAN tags) with its IP
/// packet encapsulated from `from` to `to`, its Ethernet header kept: IPIP
/// (IPv4: DF set, TTL 64) or IPv6-in-IPv6 (hop limit 64), as DSR sends a
/// packet to a backend's node.
pub fn encapsulate(frame: &[u8], from: IpAddr, to: IpAddr) -> Vec<u8> {
    let payload = &frame[14..];
    let outer = match (from, to) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 4, 0, 0];
            ip[2..4].copy_from_slice(&((20 + payload.len()) as u16).to_be_bytes());
            ip.extend_from_slice(&s.octets());
            ip.extend_from_slice(&d.octets());
            let c = internet_checksum(&[&ip]);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            ip
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut ip = vec![0x60, 0, 0, 0, 0, 0, 41, 64];
            ip[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
            ip.extend_from_slice(&s.octets());
            ip.extend_from_slice(&d.octets());
            ip
        }
        _ => panic!("an encapsulation from {from} to {to} mixes families"),
    };
    [&frame[..14], &outer[..], payload].concat()
}
