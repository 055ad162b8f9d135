//! The fuzzer's reading of a frame: lenient where
//! [`parse_and_verify`](crate::packet::parse_and_verify) asserts (a fuzzed
//! frame may be malformed, its checksums wrong: the oracle must know how,
//! not panic), and reading as the datapath parses (how far it follows an
//! IPv6 extension header chain, what it takes for a whole L4 header). The
//! VLAN tags and the checksums are read with the harness's helpers.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::packet::{
    ICMP, ICMPV6, SCTP, TCP, UDP, ethertype, internet_checksum, pseudo_header_of, sctp_crc_ok,
};

/// A frame as the model reads it: lenient, never panics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct View {
    pub(super) v6: bool,
    pub(super) l3: usize,
    /// Where the L4 header starts (after IPv4 options or IPv6 extension
    /// headers) and where the IP packet ends.
    pub(super) l4: usize,
    pub(super) end: usize,
    pub(super) src: IpAddr,
    pub(super) dst: IpAddr,
    /// The L4 protocol (IPv6: the last next header seen).
    pub(super) proto: u8,
    /// An IPv4 fragment, or an IPv6 fragment header in the chain.
    pub(super) frag: bool,
    /// As the datapath parses: not a fragment, an IPv6 chain of at most 4
    /// hop-by-hop, routing and destination options headers (the L4 header
    /// within 200 bytes of the frame start; no AH, ESP, "no next header"),
    /// the L4 header whole (TCP's data offset at least 5). Only such frames
    /// may be translated, dropped or rejected.
    pub(super) parsed: bool,
    pub(super) ports: Option<(u16, u16)>,
    /// IPv4 header checksum (IPv6 has none: always true).
    pub(super) ip_check_ok: bool,
    /// One's-complement residual of the L4 checksum (0 or 0xffff: valid),
    /// `None` for an IPv4 zero UDP checksum or when not computable.
    pub(super) l4_residual: Option<u16>,
    /// A zero UDP checksum: "none" in IPv4, invalid in IPv6.
    pub(super) udp_zero: bool,
    /// TCP: the data offset at least 5 and within the segment.
    pub(super) tcp_clean: bool,
}

impl View {
    /// Whether the L4 checksum is valid; `None`: none (IPv4 zero UDP
    /// checksum) or not computable.
    pub(super) fn l4_valid(&self) -> Option<bool> {
        if self.udp_zero {
            return (self.v6).then_some(false);
        }
        self.l4_residual.map(|x| x == 0 || x == 0xffff)
    }

    /// Parses cleanly, with ports, every checksum valid.
    pub(super) fn clean(&self) -> bool {
        self.parsed
            && self.ports.is_some()
            && self.ip_check_ok
            && self.l4_valid() != Some(false)
            && (self.proto != TCP || self.tcp_clean)
    }

    pub(super) fn icmp(&self) -> u8 {
        if self.v6 { ICMPV6 } else { ICMP }
    }
}

pub(super) fn be16(f: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([f[at], f[at + 1]])
}

pub(super) fn view(f: &[u8]) -> Option<View> {
    // At most two VLAN tags, as the datapath takes them.
    match ethertype(f)? {
        (0x0800, l3) => view4(f, l3),
        (0x86dd, l3) => view6(f, l3),
        _ => None,
    }
}

fn view4(f: &[u8], l3: usize) -> Option<View> {
    if f.len() < l3 + 20 || f[l3] >> 4 != 4 {
        return None;
    }
    let ihl = (f[l3] & 0x0f) as usize * 4;
    let tot = be16(f, l3 + 2) as usize;
    if ihl < 20 || tot < ihl || f.len() < l3 + tot {
        return None;
    }
    let ip = &f[l3..l3 + ihl];
    let head = Head {
        v6: false,
        l3,
        l4: l3 + ihl,
        end: l3 + tot,
        src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]).into(),
        dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]).into(),
        proto: ip[9],
        frag: be16(ip, 6) & 0x3fff != 0,
        walkable: true,
        ip_check_ok: internet_checksum(&[ip]) == 0,
    };
    Some(head.view(f))
}

fn view6(f: &[u8], l3: usize) -> Option<View> {
    if f.len() < l3 + 40 || f[l3] >> 4 != 6 {
        return None;
    }
    let payload = be16(f, l3 + 4) as usize;
    let end = l3 + 40 + payload;
    // A jumbogram or a truncated packet: the datapath's "malformed".
    if payload == 0 || end > f.len() {
        return None;
    }
    let addr = |at: usize| IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&f[at..at + 16]).unwrap()));
    let (mut next, mut at, mut frag, mut walkable) = (f[l3 + 6], l3 + 40, false, true);
    for _ in 0..4 {
        match next {
            0 | 43 | 60 => {
                if at + 2 > f.len() {
                    walkable = false;
                    break;
                }
                next = f[at];
                at += (f[at + 1] as usize + 1) * 8;
                if at > 200 {
                    walkable = false;
                    break;
                }
            }
            44 => {
                frag = true;
                break;
            }
            _ => break,
        }
    }
    // Still an extension header, IPsec, or "no next header".
    if !frag && matches!(next, 0 | 43 | 44 | 50 | 51 | 59 | 60) {
        walkable = false;
    }
    let head = Head {
        v6: true,
        l3,
        l4: at,
        end,
        src: addr(l3 + 8),
        dst: addr(l3 + 24),
        proto: next,
        frag,
        walkable,
        ip_check_ok: true,
    };
    Some(head.view(f))
}

/// An IP header as read, before its L4 header.
struct Head {
    v6: bool,
    l3: usize,
    l4: usize,
    end: usize,
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    frag: bool,
    walkable: bool,
    ip_check_ok: bool,
}

impl Head {
    fn view(self, f: &[u8]) -> View {
        let seg = f.get(self.l4..self.end).unwrap_or(&[]);
        let icmp = if self.v6 { ICMPV6 } else { ICMP };
        let doff = seg.get(12).map_or(0, |b| (b >> 4) as usize * 4);
        let whole = match self.proto {
            TCP => seg.len() >= 20 && doff >= 20,
            UDP => seg.len() >= 8,
            SCTP => seg.len() >= 12,
            p if p == icmp => seg.len() >= 8,
            _ => true,
        };
        let parsed = self.walkable && !self.frag && self.l4 <= self.end && whole;
        let mut v = View {
            v6: self.v6,
            l3: self.l3,
            l4: self.l4,
            end: self.end,
            src: self.src,
            dst: self.dst,
            proto: self.proto,
            frag: self.frag,
            parsed,
            ports: None,
            ip_check_ok: self.ip_check_ok,
            l4_residual: None,
            udp_zero: false,
            tcp_clean: false,
        };
        if !parsed {
            return v;
        }
        let sum = |proto| internet_checksum(&[&pseudo_header_of(self.src, self.dst, proto, seg.len()), seg]);
        let ports = || (be16(seg, 0), be16(seg, 2));
        match self.proto {
            TCP => {
                v.ports = Some(ports());
                v.l4_residual = Some(sum(TCP));
                v.tcp_clean = doff <= seg.len();
            }
            UDP => {
                v.ports = Some(ports());
                v.udp_zero = seg[6] == 0 && seg[7] == 0;
                if !v.udp_zero {
                    v.l4_residual = Some(sum(UDP));
                }
            }
            // A CRC32c, not a sum: 0 when right (or left to the device).
            SCTP => {
                v.ports = Some(ports());
                v.l4_residual = Some(u16::from(sctp_crc_ok(seg) != Some(true)));
            }
            ICMPV6 if self.v6 => v.l4_residual = Some(sum(ICMPV6)),
            ICMP if !self.v6 => v.l4_residual = Some(internet_checksum(&[seg])),
            _ => {}
        }
        v
    }
}
