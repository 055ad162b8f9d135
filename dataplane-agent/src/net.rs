//! Small address types the agent needs (no dependency for them).

use std::{
    collections::BTreeSet,
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

/// kube-proxy's nodePortAddresses: the node addresses NodePorts are served
/// on.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum NodePortAddresses {
    /// Every local address of the node except loopback and IPv6 link-local
    /// ones, both families (kube-proxy's iptables-mode default): pods'
    /// gateway and bridge addresses too.
    All,
    /// The node's primary IP of each family: the first `--node-ip` of that
    /// family (kube-proxy's `primary`, its nftables-mode default).
    #[default]
    Primary,
    /// Local addresses inside these prefixes (either family). As with
    /// kube-proxy, a family none of the prefixes belongs to takes all its
    /// addresses (`0.0.0.0/0` alone selects what `all` does).
    Cidrs(Vec<IpCidr>),
}

impl std::str::FromStr for NodePortAddresses {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => Ok(Self::All),
            "primary" | "" => Ok(Self::Primary),
            list => list
                .split(',')
                .map(|c| c.trim().parse::<IpCidr>().map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()
                .map(Self::Cidrs),
        }
    }
}

impl std::fmt::Display for NodePortAddresses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::All => f.write_str("all"),
            Self::Primary => f.write_str("primary"),
            Self::Cidrs(cidrs) => {
                let list: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
                f.write_str(&list.join(","))
            }
        }
    }
}

impl NodePortAddresses {
    /// The addresses NodePorts are served on, given the node's IPs
    /// (`--node-ip`) and the addresses its interfaces hold. Loopback and
    /// IPv6 link-local addresses never serve NodePorts. `all` with no
    /// usable local address (they could not be read) falls back to the node
    /// IPs rather than to nothing.
    pub fn select(&self, node_ips: &[IpAddr], local: &[IpAddr]) -> BTreeSet<IpAddr> {
        let usable = || {
            local
                .iter()
                .copied()
                .filter(|a| !a.is_loopback() && !matches!(a, IpAddr::V6(v6) if v6.is_unicast_link_local()))
        };
        match self {
            Self::All => {
                let all: BTreeSet<IpAddr> = usable().collect();
                if all.is_empty() {
                    node_ips.iter().copied().collect()
                } else {
                    all
                }
            }
            // kube-proxy takes the primary IP of each family, not a
            // loopback one; it need not be found among the interfaces'
            // addresses (a failed address dump must not take NodePorts away).
            Self::Primary => IpFamily::BOTH
                .into_iter()
                .filter_map(|f| node_ips.iter().find(|ip| IpFamily::of(ip) == f))
                .filter(|ip| !ip.is_loopback())
                .copied()
                .collect(),
            Self::Cidrs(cidrs) => usable()
                .filter(|a| {
                    let mut own = cidrs.iter().filter(|c| c.family() == IpFamily::of(a)).peekable();
                    own.peek().is_none() || own.any(|c| c.contains(*a))
                })
                .collect(),
        }
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

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    /// A dual-stack node: two node IPs of each family given, and its
    /// interfaces' addresses: the LAN's, a second LAN address, a pod
    /// gateway on a veth, a bridge's, loopback and IPv6 link-local.
    const NODE_IPS: [&str; 4] = ["198.18.0.11", "198.18.0.99", "2001:db8::11", "2001:db8::99"];
    const LOCAL: [&str; 9] = [
        "127.0.0.1",
        "198.18.0.11",
        "198.18.0.99",
        "10.244.1.1",
        "10.88.0.1",
        "::1",
        "fe80::1",
        "2001:db8::11",
        "fd00:10:244:1::1",
    ];

    fn select(choice: &str) -> Vec<IpAddr> {
        let choice: NodePortAddresses = choice.parse().unwrap();
        choice.select(&ips(&NODE_IPS), &ips(&LOCAL)).into_iter().collect()
    }

    #[test]
    fn node_port_addresses_default_to_the_primary_ip_of_each_family() {
        assert_eq!(NodePortAddresses::default(), NodePortAddresses::Primary);
        assert_eq!("".parse::<NodePortAddresses>(), Ok(NodePortAddresses::Primary));
        // The first node IP of each family; no pod gateway, no bridge, no
        // second address.
        assert_eq!(select("primary"), ips(&["198.18.0.11", "2001:db8::11"]));
        // A single-stack node: its one family.
        let v4 = NodePortAddresses::Primary.select(&ips(&["198.18.0.11"]), &ips(&LOCAL));
        assert_eq!(v4.into_iter().collect::<Vec<_>>(), ips(&["198.18.0.11"]));
        // The IPv6 node IP comes first: still one of each family.
        let v6_first = NodePortAddresses::Primary.select(&ips(&["2001:db8::11", "198.18.0.11"]), &[]);
        assert_eq!(
            v6_first.into_iter().collect::<Vec<_>>(),
            ips(&["198.18.0.11", "2001:db8::11"])
        );
    }

    #[test]
    fn node_port_addresses_all_is_every_address_but_loopback_and_link_local() {
        let every = ips(&[
            "10.88.0.1",
            "10.244.1.1",
            "198.18.0.11",
            "198.18.0.99",
            "2001:db8::11",
            "fd00:10:244:1::1",
        ]);
        assert_eq!(select("all"), every);
        // kube-proxy's spelling of the same: the zero CIDR (a family
        // without a CIDR of its own takes all its addresses).
        assert_eq!(select("0.0.0.0/0"), every);
        assert_eq!(select("0.0.0.0/0,::/0"), every);
        // Nothing readable: the node IPs rather than no NodePort at all.
        let none = NodePortAddresses::All.select(&ips(&["198.18.0.11"]), &ips(&["127.0.0.1"]));
        assert_eq!(none.into_iter().collect::<Vec<_>>(), ips(&["198.18.0.11"]));
        assert_eq!(NodePortAddresses::All.to_string(), "all");
    }

    #[test]
    fn node_port_addresses_cidrs_select_local_addresses_per_family() {
        // IPv4 only the LAN's; IPv6 has no CIDR: all of its (kube-proxy).
        assert_eq!(
            select("198.18.0.0/24"),
            ips(&["198.18.0.11", "198.18.0.99", "2001:db8::11", "fd00:10:244:1::1"])
        );
        assert_eq!(
            select("198.18.0.11/32, 2001:db8::/64"),
            ips(&["198.18.0.11", "2001:db8::11"])
        );
        // A CIDR that holds no local address selects none of its family;
        // loopback stays out even when a CIDR covers it.
        assert_eq!(select("192.0.2.0/24,2001:db8::/64"), ips(&["2001:db8::11"]));
        assert_eq!(select("127.0.0.0/8,::1/128"), Vec::<IpAddr>::new());
        let cidrs: NodePortAddresses = "198.18.0.0/24,2001:db8::/64".parse().unwrap();
        assert_eq!(cidrs.to_string(), "198.18.0.0/24,2001:db8::/64");
        assert!("198.18.0.0/33".parse::<NodePortAddresses>().is_err());
    }
}
