//! Small address types the agent needs (no dependency for them).

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

/// An IP family. kube-proxy keeps one table per family; here both live in
/// one table, every address knowing its family, and the map layer writes
/// each to its family's maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub const BOTH: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    pub fn of(ip: &IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    /// `IPv4` / `IPv6`, as the Kubernetes API spells them (`ipFamilies`,
    /// EndpointSlice `addressType`).
    pub fn as_str(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }

    /// The family an EndpointSlice `addressType` names (`FQDN`: none).
    pub fn from_address_type(t: &str) -> Option<Self> {
        match t {
            "IPv4" => Some(IpFamily::V4),
            "IPv6" => Some(IpFamily::V6),
            _ => None,
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `ip:port` as people write it: `10.0.0.1:80`, `[fd00::1]:80`.
pub fn host_port(ip: IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(ip, port).to_string()
}

/// An IPv4 prefix such as `10.244.0.0/16`. The address is stored masked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Cidr {
    addr: Ipv4Addr,
    prefix_len: u8,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("`{input}` is not a CIDR such as 10.0.0.0/8 or fd00::/64: {why}")]
pub struct CidrError {
    input: String,
    why: &'static str,
}

impl Ipv4Cidr {
    pub fn new(addr: Ipv4Addr, prefix_len: u8) -> Option<Self> {
        (prefix_len <= 32).then(|| Self {
            addr: Ipv4Addr::from(u32::from(addr) & Self::mask_of(prefix_len)),
            prefix_len,
        })
    }

    fn mask_of(prefix_len: u8) -> u32 {
        if prefix_len == 0 {
            0
        } else {
            u32::MAX << (32 - prefix_len)
        }
    }

    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }
    /// Host-order mask.
    pub fn mask(&self) -> u32 {
        Self::mask_of(self.prefix_len)
    }
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.addr)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why| CidrError {
            input: s.to_owned(),
            why,
        };
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, l.parse::<u8>().map_err(|_| err("bad prefix length"))?),
            None => (s, 32),
        };
        let addr: Ipv4Addr = addr.parse().map_err(|_| err("bad address"))?;
        Self::new(addr, len).ok_or_else(|| err("prefix length above 32"))
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// An IPv6 prefix such as `fd00:10:96::/112`. The address is stored masked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv6Cidr {
    addr: Ipv6Addr,
    prefix_len: u8,
}

impl Ipv6Cidr {
    pub fn new(addr: Ipv6Addr, prefix_len: u8) -> Option<Self> {
        (prefix_len <= 128).then(|| Self {
            addr: Ipv6Addr::from(u128::from(addr) & Self::mask_of(prefix_len)),
            prefix_len,
        })
    }

    fn mask_of(prefix_len: u8) -> u128 {
        if prefix_len == 0 {
            0
        } else {
            u128::MAX << (128 - prefix_len)
        }
    }

    pub fn addr(&self) -> Ipv6Addr {
        self.addr
    }
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }
    /// Host-order mask.
    pub fn mask(&self) -> u128 {
        Self::mask_of(self.prefix_len)
    }
    pub fn contains(&self, ip: Ipv6Addr) -> bool {
        u128::from(ip) & self.mask() == u128::from(self.addr)
    }
}

impl FromStr for Ipv6Cidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why| CidrError {
            input: s.to_owned(),
            why,
        };
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, l.parse::<u8>().map_err(|_| err("bad prefix length"))?),
            None => (s, 128),
        };
        let addr: Ipv6Addr = addr.parse().map_err(|_| err("bad address"))?;
        Self::new(addr, len).ok_or_else(|| err("prefix length above 128"))
    }
}

impl fmt::Display for Ipv6Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// A prefix of either family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpCidr {
    V4(Ipv4Cidr),
    V6(Ipv6Cidr),
}

impl IpCidr {
    pub fn family(&self) -> IpFamily {
        match self {
            IpCidr::V4(_) => IpFamily::V4,
            IpCidr::V6(_) => IpFamily::V6,
        }
    }
    pub fn addr(&self) -> IpAddr {
        match self {
            IpCidr::V4(c) => IpAddr::V4(c.addr()),
            IpCidr::V6(c) => IpAddr::V6(c.addr()),
        }
    }
    pub fn prefix_len(&self) -> u8 {
        match self {
            IpCidr::V4(c) => c.prefix_len(),
            IpCidr::V6(c) => c.prefix_len(),
        }
    }
    /// An address of the other family is never contained.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self, ip) {
            (IpCidr::V4(c), IpAddr::V4(a)) => c.contains(a),
            (IpCidr::V6(c), IpAddr::V6(a)) => c.contains(a),
            _ => false,
        }
    }
    /// `addr/prefix_len` (the address is masked).
    pub fn new(addr: IpAddr, prefix_len: u8) -> Option<Self> {
        match addr {
            IpAddr::V4(a) => Ipv4Cidr::new(a, prefix_len).map(IpCidr::V4),
            IpAddr::V6(a) => Ipv6Cidr::new(a, prefix_len).map(IpCidr::V6),
        }
    }
}

impl FromStr for IpCidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.contains(':') {
            s.parse().map(IpCidr::V6)
        } else {
            s.parse().map(IpCidr::V4)
        }
    }
}

impl fmt::Display for IpCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpCidr::V4(c) => c.fmt(f),
            IpCidr::V6(c) => c.fmt(f),
        }
    }
}

impl From<Ipv4Cidr> for IpCidr {
    fn from(c: Ipv4Cidr) -> Self {
        IpCidr::V4(c)
    }
}

impl From<Ipv6Cidr> for IpCidr {
    fn from(c: Ipv6Cidr) -> Self {
        IpCidr::V6(c)
    }
}

/// An address in the layout the datapath stores IPv6 addresses: four
/// words, each as it lies in the packet (network order).
pub fn ip6_words(a: Ipv6Addr) -> [u32; 4] {
    let o = a.octets();
    std::array::from_fn(|i| u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]))
}

/// The inverse of [`ip6_words`].
pub fn ip6_from_words(w: [u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (i, word) in w.iter().enumerate() {
        o[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

/// L4 protocols of Service ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => dataplane_common::proto::TCP,
            Protocol::Udp => dataplane_common::proto::UDP,
            Protocol::Sctp => dataplane_common::proto::SCTP,
        }
    }
    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            dataplane_common::proto::TCP => Some(Protocol::Tcp),
            dataplane_common::proto::UDP => Some(Protocol::Udp),
            dataplane_common::proto::SCTP => Some(Protocol::Sctp),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_parses_masks_and_contains() {
        let c: Ipv4Cidr = "10.244.1.7/16".parse().unwrap();
        assert_eq!(c.to_string(), "10.244.0.0/16");
        assert!(c.contains(Ipv4Addr::new(10, 244, 200, 1)));
        assert!(!c.contains(Ipv4Addr::new(10, 245, 0, 1)));
        assert_eq!("1.2.3.4".parse::<Ipv4Cidr>().unwrap().prefix_len(), 32);
        assert!("1.2.3.4/33".parse::<Ipv4Cidr>().is_err());
        assert!("x/8".parse::<Ipv4Cidr>().is_err());
        let c: Ipv6Cidr = "fd00:10:96::1:7/112".parse().unwrap();
        assert_eq!(c.to_string(), "fd00:10:96::1:0/112");
        assert!(c.contains("fd00:10:96::1:ffff".parse().unwrap()));
        assert!(!c.contains("fd00:10:96::2:0".parse().unwrap()));
        let a: Ipv6Addr = "2001:db8::1".parse().unwrap();
        assert_eq!(ip6_from_words(ip6_words(a)), a);
        assert_eq!(ip6_words(a)[0].to_ne_bytes(), [0x20, 0x01, 0x0d, 0xb8]);
        let dual: IpCidr = "fd00::1/64".parse().unwrap();
        assert_eq!(dual.family(), IpFamily::V6);
        assert!(dual.contains("fd00::ffff".parse().unwrap()));
        assert!(!dual.contains("10.0.0.1".parse().unwrap()));
        assert_eq!("10.1.2.3/8".parse::<IpCidr>().unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(host_port("fd00::1".parse().unwrap(), 80), "[fd00::1]:80");
        assert!(
            "0.0.0.0/0"
                .parse::<Ipv4Cidr>()
                .unwrap()
                .contains(Ipv4Addr::new(8, 8, 8, 8))
        );
    }
}
