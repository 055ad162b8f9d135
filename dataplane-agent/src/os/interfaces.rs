//! The node's network interfaces, addresses and routes, as this network
//! namespace sees them, through rtnetlink: `netlink-packet-route` encodes
//! and decodes the messages, `netlink-sys` is the (blocking) socket.
//!
//! Dumps give links (with their bridge/bond master, kind and XDP program),
//! IPv4 and IPv6 addresses per link, routes with their destination prefix
//! and output interface (what pod-interface discovery needs: routes into the
//! pod CIDR, ports of a bridge), the kernel's own route lookup for one
//! address, and the BPF classifiers of a device's clsact hooks.
//! [`ChangeWatch`] delivers link, address and route notifications.

use std::{
    net::{IpAddr, Ipv4Addr},
    os::fd::AsRawFd as _,
};

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
/// Unicast, local, broadcast, ... (a route's `kind`).
pub use netlink_packet_route::route::RouteType;
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkFlags, LinkInfo, LinkMessage, LinkXdp, XdpAttached},
    route::{RouteAddress, RouteAttribute, RouteMessage},
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("cannot decode a netlink message: {0}")]
    Decode(String),
    #[error("the kernel refused the netlink request: {0}")]
    Kernel(std::io::Error),
    #[error("the dump kept changing while it was read (retried {0} times)")]
    Interrupted(u32),
}

/// A network interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub up: bool,
    /// The bridge (or bond) this link is a port of (`IFLA_MASTER`).
    pub master: Option<u32>,
    /// The link of this namespace it is stacked on (`IFLA_LINK`: a VLAN's,
    /// macvlan's or ipvlan's parent); `None` when that link is in another
    /// namespace (a veth's peer: `IFLA_LINK_NETNSID`) or is itself.
    pub lower: Option<u32>,
    /// `veth`, `bridge`, `vxlan`, ... (`IFLA_INFO_KIND`; none for physical
    /// devices and loopback).
    pub kind: Option<String>,
    /// The XDP program attached to it, if any (`IFLA_XDP`).
    pub xdp: Option<XdpProgram>,
    /// Its link-layer address, when it is an Ethernet one (`IFLA_ADDRESS`).
    pub mac: Option<[u8; 6]>,
}

/// An XDP program on a link, as `IFLA_XDP` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XdpProgram {
    /// The program's id (the driver-mode one when several are attached).
    pub id: u32,
    pub mode: XdpAttachMode,
}

/// How an XDP program is attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpAttachMode {
    /// In the driver (native XDP).
    Native,
    /// Generic XDP on the skb (`xdpgeneric`).
    Generic,
    /// Offloaded to the NIC.
    Offload,
    /// Several at once (driver and generic, ...).
    Multiple,
}

impl XdpAttachMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Generic => "generic",
            Self::Offload => "offload",
            Self::Multiple => "multiple",
        }
    }
}

/// An address on a link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Address {
    pub link: u32,
    pub addr: IpAddr,
    pub prefix_len: u8,
}

/// A route of any table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Destination prefix (`0.0.0.0`/`::` with length 0 for a default route).
    pub destination: IpAddr,
    pub prefix_len: u8,
    /// Output interface, when the route names one.
    pub oif: Option<u32>,
    pub gateway: Option<IpAddr>,
    pub table: u32,
    /// Unicast, local, broadcast, ...
    pub kind: RouteType,
}

/// The index of the device named `name` (or one of its altnames) in this
/// network namespace; `None` when there is none.
pub fn index_of(name: &str) -> Option<u32> {
    super::device::ifindex(name)
}

/// Every link of this network namespace.
pub fn links() -> Result<Vec<Link>, NetlinkError> {
    let request = RouteNetlinkMessage::GetLink(LinkMessage::default());
    Ok(dump(request)?
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => Some(link(l)),
            _ => None,
        })
        .collect())
}

fn link(m: LinkMessage) -> Link {
    let mut out = Link {
        index: m.header.index,
        name: String::new(),
        up: m.header.flags.contains(LinkFlags::Up),
        master: None,
        lower: None,
        kind: None,
        xdp: None,
        mac: None,
    };
    let mut other_netns = false;
    for a in m.attributes {
        match a {
            LinkAttribute::IfName(n) => out.name = n,
            LinkAttribute::Address(a) => out.mac = <[u8; 6]>::try_from(a.as_slice()).ok(),
            LinkAttribute::Xdp(xdp) => out.xdp = xdp_program(&xdp),
            LinkAttribute::Controller(i) if i != 0 => out.master = Some(i),
            LinkAttribute::Link(i) if i != 0 && i != out.index => out.lower = Some(i),
            LinkAttribute::LinkNetNsId(_) => other_netns = true,
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        out.kind = Some(k.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    if other_netns {
        out.lower = None;
    }
    out
}

fn xdp_program(attrs: &[LinkXdp]) -> Option<XdpProgram> {
    let mut mode = None;
    let (mut any, mut drv) = (None, None);
    for a in attrs {
        match a {
            LinkXdp::Attached(XdpAttached::Driver) => mode = Some(XdpAttachMode::Native),
            LinkXdp::Attached(XdpAttached::SocketBuffer) => mode = Some(XdpAttachMode::Generic),
            LinkXdp::Attached(XdpAttached::Hardware) => mode = Some(XdpAttachMode::Offload),
            LinkXdp::Attached(XdpAttached::Multiple) => mode = Some(XdpAttachMode::Multiple),
            LinkXdp::ProgId(id) => any = Some(*id),
            LinkXdp::DrvProgId(id) => drv = Some(*id),
            _ => {}
        }
    }
    Some(XdpProgram {
        id: drv.or(any)?,
        mode: mode?,
    })
}

/// Every IPv4 and IPv6 address of this network namespace.
pub fn addresses() -> Result<Vec<Address>, NetlinkError> {
    let request = RouteNetlinkMessage::GetAddress(AddressMessage::default());
    Ok(dump(request)?
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewAddress(a) => address(a),
            _ => None,
        })
        .collect())
}

fn address(m: AddressMessage) -> Option<Address> {
    // IFA_LOCAL is the interface's own address; IFA_ADDRESS is the peer's
    // on point-to-point links (and the same as IFA_LOCAL elsewhere). IPv6
    // sends IFA_ADDRESS alone.
    let mut local = None;
    let mut addr = None;
    for a in m.attributes {
        match a {
            AddressAttribute::Local(ip) => local = Some(ip),
            AddressAttribute::Address(ip) => addr = Some(ip),
            _ => {}
        }
    }
    Some(Address {
        link: m.header.index,
        addr: local.or(addr)?,
        prefix_len: m.header.prefix_len,
    })
}

/// Every IPv4 and IPv6 route of every table.
pub fn routes() -> Result<Vec<Route>, NetlinkError> {
    let request = RouteNetlinkMessage::GetRoute(RouteMessage::default());
    Ok(dump(request)?
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewRoute(r) => route(r),
            _ => None,
        })
        .collect())
}

fn ip(a: RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(v4.into()),
        RouteAddress::Inet6(v6) => Some(v6.into()),
        _ => None,
    }
}

fn route(m: RouteMessage) -> Option<Route> {
    let unspecified: IpAddr = match m.header.address_family {
        AddressFamily::Inet => Ipv4Addr::UNSPECIFIED.into(),
        AddressFamily::Inet6 => std::net::Ipv6Addr::UNSPECIFIED.into(),
        _ => return None,
    };
    let mut out = Route {
        destination: unspecified,
        prefix_len: m.header.destination_prefix_length,
        oif: None,
        gateway: None,
        table: u32::from(m.header.table),
        kind: m.header.kind,
    };
    for a in m.attributes {
        match a {
            RouteAttribute::Destination(d) => out.destination = ip(d)?,
            RouteAttribute::Gateway(g) => out.gateway = ip(g),
            RouteAttribute::Oif(i) => out.oif = Some(i),
            RouteAttribute::Table(t) => out.table = t,
            _ => {}
        }
    }
    Some(out)
}

/// The route the kernel would take to `destination` (`ip route get`):
/// policy rules and every table included. `None` when there is none (the
/// address is unreachable from here).
pub fn route_to(destination: IpAddr) -> Result<Option<Route>, NetlinkError> {
    let mut m = RouteMessage::default();
    m.header.address_family = match destination {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    m.header.destination_prefix_length = if destination.is_ipv4() { 32 } else { 128 };
    m.attributes.push(RouteAttribute::Destination(match destination {
        IpAddr::V4(v4) => RouteAddress::Inet(v4),
        IpAddr::V6(v6) => RouteAddress::Inet6(v6),
    }));
    match request(RouteNetlinkMessage::GetRoute(m), NLM_F_REQUEST) {
        Ok(answers) => Ok(answers.into_iter().find_map(|m| match m {
            RouteNetlinkMessage::NewRoute(r) => route(r),
            _ => None,
        })),
        // ENETUNREACH, EHOSTUNREACH...: no route.
        Err(NetlinkError::Kernel(e))
            if matches!(
                e.raw_os_error(),
                Some(libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EINVAL | libc::EACCES)
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Which clsact hook of a device a classifier runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcDirection {
    Ingress,
    Egress,
}

/// A BPF classifier attached the old way (a `bpf` filter on the clsact
/// qdisc, as `tc filter add ... bpf` does), not through TCX.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcBpfFilter {
    pub direction: TcDirection,
    /// The program's name as tc shows it (`file.o:[section]` or the
    /// program's name).
    pub name: String,
    pub prog_id: Option<u32>,
}

/// The BPF classifiers on the clsact hooks of the link `index` (empty when
/// it has no clsact qdisc).
pub fn tc_bpf_filters(index: u32) -> Result<Vec<TcBpfFilter>, NetlinkError> {
    let mut out = Vec::new();
    for (direction, minor) in [
        (TcDirection::Ingress, TcHandle::MIN_INGRESS),
        (TcDirection::Egress, TcHandle::MIN_EGRESS),
    ] {
        let mut m = TcMessage::default();
        m.header.index = index as i32;
        m.header.parent = TcHandle { major: 0xffff, minor };
        let answers = match dump(RouteNetlinkMessage::GetTrafficFilter(m)) {
            Ok(a) => a,
            // No clsact qdisc on the device: nothing attached the old way.
            Err(NetlinkError::Kernel(e)) if e.raw_os_error() == Some(libc::EINVAL) => continue,
            Err(e) => return Err(e),
        };
        for a in answers {
            let RouteNetlinkMessage::NewTrafficFilter(f) = a else {
                continue;
            };
            let mut kind = None;
            let (mut name, mut prog_id) = (String::new(), None);
            for attr in f.attributes {
                match attr {
                    TcAttribute::Kind(k) => kind = Some(k),
                    TcAttribute::Options(opts) => {
                        for o in opts {
                            match o {
                                TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => name = n,
                                TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => prog_id = Some(id),
                                _ => {}
                            }
                        }
                    }
                    _ => {}
                }
            }
            if kind.as_deref() == Some("bpf") {
                out.push(TcBpfFilter {
                    direction,
                    name,
                    prog_id,
                });
            }
        }
    }
    Ok(out)
}

/// (interface, IPv4 address) of every IPv4 address in this network
/// namespace.
pub fn ip_addresses() -> Vec<(String, IpAddr)> {
    let (Ok(links), Ok(addrs)) = (links(), addresses()) else {
        return Vec::new();
    };
    addrs
        .into_iter()
        .filter_map(|a| {
            // IPv6 link-local addresses exist on every link, the same one on
            // several: not an address a Service can be reached on.
            if let IpAddr::V6(v6) = a.addr
                && v6.is_unicast_link_local()
            {
                return None;
            }
            let name = links.iter().find(|l| l.index == a.link)?.name.clone();
            Some((name, a.addr))
        })
        .collect()
}

/// How often a dump interrupted by concurrent changes is retried.
const DUMP_RETRIES: u32 = 5;

/// Sends a dump request and collects every answer.
fn dump(request: RouteNetlinkMessage) -> Result<Vec<RouteNetlinkMessage>, NetlinkError> {
    for _ in 0..DUMP_RETRIES {
        if let Some(out) = request_once(request.clone(), NLM_F_REQUEST | NLM_F_DUMP)? {
            return Ok(out);
        }
    }
    Err(NetlinkError::Interrupted(DUMP_RETRIES))
}

/// Sends a request that is not a dump (one answer, or an error).
fn request(request: RouteNetlinkMessage, flags: u16) -> Result<Vec<RouteNetlinkMessage>, NetlinkError> {
    request_once(request, flags).map(Option::unwrap_or_default)
}

/// None when the kernel flagged a dump as interrupted (NLM_F_DUMP_INTR).
fn request_once(
    request: RouteNetlinkMessage,
    flags: u16,
) -> Result<Option<Vec<RouteNetlinkMessage>>, NetlinkError> {
    let is_dump = flags & NLM_F_DUMP != 0;
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = 1;
    let mut message = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(request));
    message.finalize();
    let mut buf = vec![0; message.buffer_len()];
    message.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let mut out = Vec::new();
    let mut interrupted = false;
    loop {
        let (datagram, _) = socket.recv_from_full()?;
        let mut rest = &datagram[..];
        while !rest.is_empty() {
            let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(rest)
                .map_err(|e| NetlinkError::Decode(e.to_string()))?;
            let len = (m.header.length as usize).min(rest.len());
            if len == 0 {
                break;
            }
            // Messages are 4-byte aligned within a datagram.
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
            interrupted |= m.header.flags & NLM_F_DUMP_INTR != 0;
            match m.payload {
                NetlinkPayload::Done(_) => return Ok((!interrupted).then_some(out)),
                NetlinkPayload::Error(e) if e.code.is_some() => return Err(NetlinkError::Kernel(e.to_io())),
                NetlinkPayload::InnerMessage(inner) if !is_dump => return Ok(Some(vec![inner])),
                NetlinkPayload::InnerMessage(inner) => out.push(inner),
                _ => {}
            }
        }
    }
}

/// Link, address and route notifications from the kernel (the RTNLGRP_LINK,
/// IPv4/IPv6 IFADDR and ROUTE groups): interfaces appearing and going,
/// bridge ports and gateway addresses changing, the routes a CNI adds for a
/// new pod, so pod interfaces are attached as soon as the CNI has wired
/// them. The caller still rescans periodically (a notification can be lost
/// when the socket buffer overflows).
pub struct ChangeWatch {
    socket: Socket,
}

impl ChangeWatch {
    pub fn open() -> std::io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        let groups = libc::RTMGRP_LINK
            | libc::RTMGRP_IPV4_IFADDR
            | libc::RTMGRP_IPV4_ROUTE
            | libc::RTMGRP_IPV6_IFADDR
            | libc::RTMGRP_IPV6_ROUTE;
        socket.bind(&SocketAddr::new(0, groups as u32))?;
        socket.set_non_blocking(true)?;
        Ok(Self { socket })
    }

    /// Blocks until a link, an address or a route changes (then drained);
    /// false if the socket fails.
    pub fn wait(&self) -> bool {
        loop {
            let mut pfd = libc::pollfd {
                fd: self.socket.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd on our own socket.
            let rc = unsafe { libc::poll(&mut pfd, 1, -1) };
            if rc < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return false;
            }
            if rc > 0 && self.changed() {
                return true;
            }
        }
    }

    /// Drains pending notifications; true if anything changed.
    pub fn changed(&self) -> bool {
        let mut buf = Vec::with_capacity(8192);
        let mut any = false;
        loop {
            buf.clear();
            match self.socket.recv(&mut buf, 0) {
                Ok(n) if n > 0 => any = true,
                // ENOBUFS: notifications were dropped, so something changed.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => any = true,
                // EAGAIN: drained.
                _ => return any,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_listed_with_its_addresses_and_local_routes() {
        let links = links().expect("link dump");
        let lo = links.iter().find(|l| l.name == "lo").expect("lo");
        assert_eq!(lo.master, None);
        assert!(lo.up, "{lo:?}");
        let addrs = addresses().expect("address dump");
        assert!(
            addrs
                .iter()
                .any(|a| a.link == lo.index && a.addr == IpAddr::from(Ipv4Addr::LOCALHOST)),
            "{addrs:?}"
        );
        let routes = routes().expect("route dump");
        assert!(
            routes.iter().any(|r| r.kind == RouteType::Local
                && r.destination == IpAddr::from(Ipv4Addr::LOCALHOST)
                && r.oif == Some(lo.index)),
            "{routes:?}"
        );
        let to_lo = route_to(Ipv4Addr::LOCALHOST.into()).expect("route lookup");
        assert_eq!(to_lo.and_then(|r| r.oif), Some(lo.index));
    }
}
