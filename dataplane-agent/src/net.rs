//! Small address types the agent needs (no dependency for them).

use std::{fmt, net::Ipv4Addr, str::FromStr};

/// An IPv4 prefix such as `10.244.0.0/16`. The address is stored masked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Cidr {
    addr: Ipv4Addr,
    prefix_len: u8,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("`{input}` is not an IPv4 CIDR such as 10.0.0.0/8: {why}")]
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
        assert!(
            "0.0.0.0/0"
                .parse::<Ipv4Cidr>()
                .unwrap()
                .contains(Ipv4Addr::new(8, 8, 8, 8))
        );
    }
}
