//! Test packets: built and checked here, independently of the datapath's
//! own code (its checksum arithmetic is what these tests check).

use std::net::{Ipv4Addr, SocketAddrV4};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;
pub const TCP_SYN: u8 = 0x02;
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
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub proto: u8,
    pub tcp_flags: u8,
    pub ttl: u8,
    /// IP options (a multiple of 4 bytes).
    pub ip_options: Vec<u8>,
    pub payload: Vec<u8>,
    /// UDP: send a zero ("none") checksum.
    pub udp_zero_checksum: bool,
    pub ip_id: u16,
    /// Fragment field (flags + offset, host order).
    pub frag: u16,
}

impl Frame {
    pub fn tcp(src: SocketAddrV4, dst: SocketAddrV4, flags: u8) -> Self {
        Self {
            src_mac: [0x02, 0, 0, 0, 0, 0x01],
            dst_mac: [0x02, 0, 0, 0, 0, 0x02],
            vlans: Vec::new(),
            src,
            dst,
            proto: TCP,
            tcp_flags: flags,
            ttl: 64,
            ip_options: Vec::new(),
            payload: b"hello".to_vec(),
            udp_zero_checksum: false,
            ip_id: 0x1234,
            frag: 0,
        }
    }

    pub fn udp(src: SocketAddrV4, dst: SocketAddrV4) -> Self {
        Self {
            proto: UDP,
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
            _ => {
                l4.extend_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
                l4.extend_from_slice(&[0, 0]);
            }
        }
        l4.extend_from_slice(&self.payload);
        let check_at = if self.proto == TCP { 16 } else { 6 };
        if !(self.proto == UDP && self.udp_zero_checksum) {
            let pseudo = pseudo_header(*self.src.ip(), *self.dst.ip(), self.proto, l4.len());
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
        f.extend_from_slice(&0x0800u16.to_be_bytes());
        let ihl = 5 + self.ip_options.len() / 4;
        let mut ip = vec![(4 << 4) | ihl as u8, 0];
        ip.extend_from_slice(&((ihl * 4 + l4.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&self.ip_id.to_be_bytes());
        ip.extend_from_slice(&self.frag.to_be_bytes());
        ip.push(self.ttl);
        ip.push(self.proto);
        ip.extend_from_slice(&[0, 0]);
        ip.extend_from_slice(&self.src.ip().octets());
        ip.extend_from_slice(&self.dst.ip().octets());
        ip.extend_from_slice(&self.ip_options);
        let c = internet_checksum(&[&ip]);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        f.extend_from_slice(&ip);
        f.extend_from_slice(&l4);
        f
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
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub ttl: u8,
    pub sport: u16,
    pub dport: u16,
    /// Everything after the IP header.
    pub l4: Vec<u8>,
    pub ip_header: Vec<u8>,
}

impl Parsed {
    pub fn src_addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.src, self.sport)
    }
    pub fn dst_addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.dst, self.dport)
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
    assert_eq!(ethertype, 0x0800, "not IPv4");
    let ihl = (frame[l3] & 0x0f) as usize * 4;
    let tot_len = u16::from_be_bytes([frame[l3 + 2], frame[l3 + 3]]) as usize;
    assert!(
        frame.len() >= l3 + tot_len,
        "IP total length {tot_len} beyond the frame"
    );
    let ip = &frame[l3..l3 + ihl];
    assert_eq!(internet_checksum(&[ip]), 0, "IP header checksum is wrong");
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let proto = ip[9];
    let l4 = frame[l3 + ihl..l3 + tot_len].to_vec();
    let (mut sport, mut dport) = (0, 0);
    match proto {
        TCP | UDP => {
            sport = u16::from_be_bytes([l4[0], l4[1]]);
            dport = u16::from_be_bytes([l4[2], l4[3]]);
            let zero_udp = proto == UDP && l4[6] == 0 && l4[7] == 0;
            if !zero_udp {
                let pseudo = pseudo_header(src, dst, proto, l4.len());
                assert_eq!(
                    internet_checksum(&[&pseudo, &l4]),
                    0,
                    "{} checksum is wrong",
                    if proto == TCP { "TCP" } else { "UDP" }
                );
            }
        }
        ICMP => assert_eq!(internet_checksum(&[&l4]), 0, "ICMP checksum is wrong"),
        _ => {}
    }
    Parsed {
        src_mac: frame[6..12].try_into().unwrap(),
        dst_mac: frame[0..6].try_into().unwrap(),
        l3,
        src,
        dst,
        proto,
        ttl: ip[8],
        sport,
        dport,
        l4,
        ip_header: ip.to_vec(),
    }
}
