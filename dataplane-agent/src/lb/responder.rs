//! Answers ARP requests (IPv4) and neighbour solicitations (IPv6) for the
//! addresses this node announces, from userspace, on raw `AF_PACKET`
//! sockets; sends gratuitous ARP and unsolicited neighbour advertisements
//! when it takes an address over.
//!
//! Why userspace and not XDP: ARP and NDP are a few packets per client and
//! cache lifetime, so the cost is nil; a packet socket sees them after XDP
//! has passed them, needs no change to the datapath or its verifier budget,
//! and keeps working while the agent restarts the datapath. The kernel does
//! not answer for these addresses: they are on no interface (the datapath
//! translates them in XDP/TC).
//!
//! Per interface one thread polls two sockets: one bound to `ETH_P_ARP`, one
//! to `ETH_P_IPV6` with a classic BPF filter that only lets neighbour
//! solicitations through (so ordinary IPv6 traffic is not copied to
//! userspace). For each announced IPv6 address the socket joins the
//! solicited-node multicast group at the link layer (`PACKET_ADD_MEMBERSHIP`),
//! so NICs with multicast filters deliver the solicitations.

use std::{
    collections::BTreeSet,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

pub type Mac = [u8; 6];

const ETH_HLEN: usize = 14;
const ETH_P_ARP: u16 = 0x0806;
const ETH_P_IPV6: u16 = 0x86dd;
const ARP_LEN: usize = 28;
const IPV6_HLEN: usize = 40;
const ICMPV6: u8 = 58;
const NEIGHBOR_SOLICITATION: u8 = 135;
const NEIGHBOR_ADVERTISEMENT: u8 = 136;
const OPT_SOURCE_LLADDR: u8 = 1;
const OPT_TARGET_LLADDR: u8 = 2;
const BROADCAST: Mac = [0xff; 6];
/// ff02::1 at the link layer.
const ALL_NODES_MAC: Mac = [0x33, 0x33, 0, 0, 0, 1];
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
/// Gratuitous announcements after a takeover: now, and repeated in case
/// the first frame is lost.
const GRATUITOUS_REPEATS: [Duration; 3] =
    [Duration::ZERO, Duration::from_millis(500), Duration::from_secs(2)];

/// The reply to an ARP request for one of `ours`, from `mac`.
pub fn arp_reply(frame: &[u8], mac: Mac, ours: &BTreeSet<IpAddr>) -> Option<Vec<u8>> {
    let arp = frame.get(ETH_HLEN..ETH_HLEN + ARP_LEN)?;
    if u16::from_be_bytes([frame[12], frame[13]]) != ETH_P_ARP
        || arp[0..2] != [0, 1]
        || arp[2..4] != [0x08, 0x00]
        || arp[4] != 6
        || arp[5] != 4
        || arp[6..8] != [0, 1]
    {
        return None;
    }
    let sha: Mac = arp[8..14].try_into().ok()?;
    let spa = Ipv4Addr::new(arp[14], arp[15], arp[16], arp[17]);
    let tpa = Ipv4Addr::new(arp[24], arp[25], arp[26], arp[27]);
    // Somebody else announcing the address (gratuitous ARP) is not asking.
    if spa == tpa || !ours.contains(&IpAddr::V4(tpa)) {
        return None;
    }
    Some(arp_frame(2, mac, sha, tpa, sha, spa))
}

/// A gratuitous ARP request announcing that `ip` is at `mac`.
pub fn gratuitous_arp(mac: Mac, ip: Ipv4Addr) -> Vec<u8> {
    arp_frame(1, mac, BROADCAST, ip, [0; 6], ip)
}

fn arp_frame(op: u16, mac: Mac, eth_dst: Mac, spa: Ipv4Addr, tha: Mac, tpa: Ipv4Addr) -> Vec<u8> {
    let mut f = Vec::with_capacity(60);
    f.extend_from_slice(&eth_dst);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&ETH_P_ARP.to_be_bytes());
    f.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4]);
    f.extend_from_slice(&op.to_be_bytes());
    f.extend_from_slice(&mac);
    f.extend_from_slice(&spa.octets());
    f.extend_from_slice(&tha);
    f.extend_from_slice(&tpa.octets());
    // Ethernet's minimum frame size (without the FCS).
    f.resize(60, 0);
    f
}

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32)
        .sum()
}

/// ICMPv6 checksum of `icmp` (checksum field included as it is) between
/// `src` and `dst`: zero when an incoming message's checksum is right.
fn icmpv6_checksum(src: &Ipv6Addr, dst: &Ipv6Addr, icmp: &[u8]) -> u16 {
    let mut sum = sum16(&src.octets()) + sum16(&dst.octets());
    sum += (icmp.len() as u32 >> 16) + (icmp.len() as u32 & 0xffff);
    sum += ICMPV6 as u32;
    sum += sum16(icmp);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The advertisement answering a neighbour solicitation for one of `ours`
/// (RFC 4861 §7.1.1 validity checks, §7.2.4 reply rules).
pub fn neighbor_advertisement(frame: &[u8], mac: Mac, ours: &BTreeSet<IpAddr>) -> Option<Vec<u8>> {
    let ip6 = frame.get(ETH_HLEN..ETH_HLEN + IPV6_HLEN)?;
    let payload_len = u16::from_be_bytes([ip6[4], ip6[5]]) as usize;
    if u16::from_be_bytes([frame[12], frame[13]]) != ETH_P_IPV6
        || ip6[0] >> 4 != 6
        || ip6[6] != ICMPV6
        || ip6[7] != 255
        || payload_len < 24
    {
        return None;
    }
    let icmp = frame.get(ETH_HLEN + IPV6_HLEN..ETH_HLEN + IPV6_HLEN + payload_len)?;
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip6[8..24]).ok()?);
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip6[24..40]).ok()?);
    if icmp[0] != NEIGHBOR_SOLICITATION || icmp[1] != 0 || icmpv6_checksum(&src, &dst, icmp) != 0 {
        return None;
    }
    let target = Ipv6Addr::from(<[u8; 16]>::try_from(&icmp[8..24]).ok()?);
    if target.is_multicast() || !ours.contains(&IpAddr::V6(target)) {
        return None;
    }
    // Options: the solicitor's link-layer address, if it gave one.
    let mut solicitor_mac: Option<Mac> = None;
    let mut opts = &icmp[24..];
    while opts.len() >= 2 {
        let len = opts[1] as usize * 8;
        if len == 0 || len > opts.len() {
            return None;
        }
        if opts[0] == OPT_SOURCE_LLADDR && len >= 8 {
            solicitor_mac = opts[2..8].try_into().ok();
        }
        opts = &opts[len..];
    }
    if src.is_unspecified() {
        // Duplicate address detection: answer all nodes, unsolicited.
        if solicitor_mac.is_some() {
            return None;
        }
        return Some(na_frame(mac, ALL_NODES_MAC, target, ALL_NODES, false));
    }
    let eth_dst = solicitor_mac.unwrap_or_else(|| frame[6..12].try_into().unwrap_or(BROADCAST));
    Some(na_frame(mac, eth_dst, target, src, true))
}

/// An unsolicited advertisement to all nodes that `ip` is at `mac`.
pub fn unsolicited_advertisement(mac: Mac, ip: Ipv6Addr) -> Vec<u8> {
    na_frame(mac, ALL_NODES_MAC, ip, ALL_NODES, false)
}

fn na_frame(mac: Mac, eth_dst: Mac, target: Ipv6Addr, dst: Ipv6Addr, solicited: bool) -> Vec<u8> {
    let mut icmp = Vec::with_capacity(32);
    icmp.extend_from_slice(&[NEIGHBOR_ADVERTISEMENT, 0, 0, 0]);
    // Override, and Solicited when answering.
    icmp.extend_from_slice(&[if solicited { 0x60 } else { 0x20 }, 0, 0, 0]);
    icmp.extend_from_slice(&target.octets());
    icmp.extend_from_slice(&[OPT_TARGET_LLADDR, 1]);
    icmp.extend_from_slice(&mac);
    // The announced address is the source: it is ours on this link.
    let csum = icmpv6_checksum(&target, &dst, &icmp);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let mut f = Vec::with_capacity(ETH_HLEN + IPV6_HLEN + icmp.len());
    f.extend_from_slice(&eth_dst);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    f.extend_from_slice(&[ICMPV6, 255]);
    f.extend_from_slice(&target.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(&icmp);
    f
}

/// The link-layer address of `ip`'s solicited-node multicast group
/// (33:33:ff + the address's last three bytes).
pub fn solicited_node_mac(ip: &Ipv6Addr) -> Mac {
    let o = ip.octets();
    [0x33, 0x33, 0xff, o[13], o[14], o[15]]
}

#[derive(Debug, thiserror::Error)]
pub enum ResponderError {
    #[error("L2 announcements: interface {0} not found in this network namespace")]
    NoSuchInterface(String),
    #[error("L2 announcements: interface {0} has no Ethernet address")]
    NoMac(String),
    #[error("L2 announcements on {interface}: {what}: {source}")]
    Socket {
        interface: String,
        what: &'static str,
        source: io::Error,
    },
}

/// Counters the metrics read.
#[derive(Debug, Default)]
pub struct Counters {
    pub arp_replies: AtomicU64,
    pub na_replies: AtomicU64,
    pub gratuitous: AtomicU64,
    pub send_errors: AtomicU64,
}

struct Interface {
    name: String,
    index: i32,
    mac: Mac,
    arp: OwnedFd,
    nd: OwnedFd,
}

struct Shared {
    addresses: RwLock<BTreeSet<IpAddr>>,
    /// (when, address) of gratuitous announcements still to send.
    pending: Mutex<Vec<(Instant, IpAddr)>>,
    stop: AtomicBool,
    counters: Arc<Counters>,
    interfaces: Vec<Interface>,
}

/// The running responder; stops (and leaves its multicast groups) on drop.
pub struct Responder {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

fn sock_err<'a>(interface: &'a str, what: &'static str) -> impl FnOnce(io::Error) -> ResponderError + 'a {
    move |source| ResponderError::Socket {
        interface: interface.to_owned(),
        what,
        source,
    }
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn sockaddr_ll(index: i32, protocol: u16) -> libc::sockaddr_ll {
    // SAFETY: a plain C struct; zero is a valid value.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_protocol = protocol.to_be();
    sa.sll_ifindex = index;
    sa
}

/// A raw packet socket bound to `index` for `protocol` (created with
/// protocol 0 so that nothing from other interfaces is queued before bind).
fn packet_socket(index: i32, protocol: u16) -> io::Result<OwnedFd> {
    // SAFETY: plain syscalls on an fd we own.
    unsafe {
        let fd = cvt(libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        ))?;
        let fd = OwnedFd::from_raw_fd(fd);
        let sa = sockaddr_ll(index, protocol);
        cvt(libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        ))?;
        Ok(fd)
    }
}

/// Lets only ICMPv6 neighbour solicitations through (offsets from the
/// Ethernet header: IPv6 next header at 20, ICMPv6 type at 54).
fn attach_ns_filter(fd: &OwnedFd) -> io::Result<()> {
    // BPF_LD | BPF_B | BPF_ABS, BPF_JMP | BPF_JEQ | BPF_K, BPF_RET | BPF_K.
    const LD_B_ABS: u16 = 0x10 | 0x20;
    const JEQ_K: u16 = 0x05 | 0x10;
    const RET_K: u16 = 0x06;
    let mut prog = [
        libc::sock_filter {
            code: LD_B_ABS,
            jt: 0,
            jf: 0,
            k: 20,
        },
        libc::sock_filter {
            code: JEQ_K,
            jt: 0,
            jf: 3,
            k: ICMPV6 as u32,
        },
        libc::sock_filter {
            code: LD_B_ABS,
            jt: 0,
            jf: 0,
            k: 54,
        },
        libc::sock_filter {
            code: JEQ_K,
            jt: 0,
            jf: 1,
            k: NEIGHBOR_SOLICITATION as u32,
        },
        libc::sock_filter {
            code: RET_K,
            jt: 0,
            jf: 0,
            k: 0xffff,
        },
        libc::sock_filter {
            code: RET_K,
            jt: 0,
            jf: 0,
            k: 0,
        },
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: a valid program that outlives the call (the kernel copies it).
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as u32,
        )
    })?;
    Ok(())
}

fn membership(fd: &OwnedFd, index: i32, mac: Mac, add: bool) -> io::Result<()> {
    // SAFETY: a plain C struct; zero is a valid value.
    let mut mreq: libc::packet_mreq = unsafe { std::mem::zeroed() };
    mreq.mr_ifindex = index;
    mreq.mr_type = libc::PACKET_MR_MULTICAST as u16;
    mreq.mr_alen = 6;
    mreq.mr_address[..6].copy_from_slice(&mac);
    let op = if add {
        libc::PACKET_ADD_MEMBERSHIP
    } else {
        libc::PACKET_DROP_MEMBERSHIP
    };
    // SAFETY: setsockopt with a correctly sized struct.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            op,
            (&mreq as *const libc::packet_mreq).cast(),
            std::mem::size_of::<libc::packet_mreq>() as u32,
        )
    })?;
    Ok(())
}

/// The interface's index and MAC address, from rtnetlink in this thread's
/// network namespace (whatever /sys shows).
fn interface(name: &str) -> Result<(i32, Mac), ResponderError> {
    let links = crate::os::interfaces::links().map_err(|e| ResponderError::Socket {
        interface: name.into(),
        what: "listing links",
        source: io::Error::other(e.to_string()),
    })?;
    let link = links
        .into_iter()
        .find(|l| l.name == name)
        .ok_or_else(|| ResponderError::NoSuchInterface(name.into()))?;
    let mac = link.mac.ok_or_else(|| ResponderError::NoMac(name.into()))?;
    Ok((link.index as i32, mac))
}

impl Interface {
    fn send(&self, frame: &[u8], counters: &Counters) {
        let fd = if u16::from_be_bytes([frame[12], frame[13]]) == ETH_P_ARP {
            &self.arp
        } else {
            &self.nd
        };
        let sa = sockaddr_ll(self.index, u16::from_be_bytes([frame[12], frame[13]]));
        // SAFETY: sendto with our buffer and a correctly sized address.
        let rc = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&sa as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc < 0 {
            counters.send_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(interface = %self.name, error = %io::Error::last_os_error(), "cannot send an ARP/NDP frame");
        }
    }

    fn announce(&self, ip: IpAddr, counters: &Counters) {
        let frame = match ip {
            IpAddr::V4(a) => gratuitous_arp(self.mac, a),
            IpAddr::V6(a) => unsolicited_advertisement(self.mac, a),
        };
        self.send(&frame, counters);
        counters.gratuitous.fetch_add(1, Ordering::Relaxed);
    }
}

impl Responder {
    /// Opens the sockets on `interfaces` and starts answering (for no
    /// address until [`Responder::set_addresses`]).
    pub fn start(interfaces: &[String], counters: Arc<Counters>) -> Result<Self, ResponderError> {
        let mut ifaces = Vec::new();
        for name in interfaces {
            let (index, mac) = interface(name)?;
            let arp = packet_socket(index, ETH_P_ARP).map_err(sock_err(name, "ARP socket"))?;
            let nd = packet_socket(index, ETH_P_IPV6).map_err(sock_err(name, "NDP socket"))?;
            attach_ns_filter(&nd).map_err(sock_err(name, "NDP filter"))?;
            ifaces.push(Interface {
                name: name.clone(),
                index,
                mac,
                arp,
                nd,
            });
        }
        let shared = Arc::new(Shared {
            addresses: RwLock::default(),
            pending: Mutex::default(),
            stop: AtomicBool::new(false),
            counters,
            interfaces: ifaces,
        });
        let threads = (0..shared.interfaces.len())
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("l2-{}", shared.interfaces[i].name))
                    .spawn(move || serve(&shared, i))
            })
            .collect::<Result<_, _>>()
            .map_err(sock_err("-", "responder thread"))?;
        Ok(Self { shared, threads })
    }

    /// The MAC address the responder answers with on `interface`.
    pub fn mac(&self, interface: &str) -> Option<Mac> {
        self.shared
            .interfaces
            .iter()
            .find(|i| i.name == interface)
            .map(|i| i.mac)
    }

    /// Answers for exactly `addresses` from now on.
    pub fn set_addresses(&self, addresses: &BTreeSet<IpAddr>) {
        let mut current = self.shared.addresses.write().expect("addresses");
        for (ip, add) in current
            .difference(addresses)
            .map(|ip| (ip, false))
            .chain(addresses.difference(&current).map(|ip| (ip, true)))
        {
            if let IpAddr::V6(a) = ip {
                for i in &self.shared.interfaces {
                    if let Err(e) = membership(&i.nd, i.index, solicited_node_mac(a), add) {
                        tracing::warn!(interface = %i.name, address = %a, error = %e, "cannot change a solicited-node multicast membership");
                    }
                }
            }
        }
        *current = addresses.clone();
    }

    /// Sends gratuitous ARP / unsolicited NA for `ip` on every interface,
    /// now and twice more shortly after.
    pub fn announce(&self, ip: IpAddr) {
        let now = Instant::now();
        for i in &self.shared.interfaces {
            i.announce(ip, &self.shared.counters);
        }
        self.shared
            .pending
            .lock()
            .expect("pending")
            .extend(GRATUITOUS_REPEATS[1..].iter().map(|d| (now + *d, ip)));
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.set_addresses(&BTreeSet::new());
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Interface `i`'s loop: answer, and send due repeats (thread 0 sends them
/// for every interface).
fn serve(shared: &Shared, i: usize) {
    let iface = &shared.interfaces[i];
    let mut buf = vec![0u8; 2048];
    while !shared.stop.load(Ordering::Relaxed) {
        let mut fds = [
            libc::pollfd {
                fd: iface.arp.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: iface.nd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll on our own fds.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
        for (pfd, fd) in fds.iter().zip([&iface.arp, &iface.nd]) {
            if pfd.revents & libc::POLLIN == 0 {
                continue;
            }
            loop {
                // SAFETY: a plain C struct; zero is a valid value.
                let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                // SAFETY: recvfrom into our buffer and address.
                let n = unsafe {
                    libc::recvfrom(
                        fd.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        (&mut from as *mut libc::sockaddr_ll).cast(),
                        &mut len,
                    )
                };
                if n <= 0 {
                    break;
                }
                if from.sll_pkttype == libc::PACKET_OUTGOING {
                    continue;
                }
                let frame = &buf[..n as usize];
                let ours = shared.addresses.read().expect("addresses");
                if let Some(reply) = arp_reply(frame, iface.mac, &ours) {
                    iface.send(&reply, &shared.counters);
                    shared.counters.arp_replies.fetch_add(1, Ordering::Relaxed);
                } else if let Some(reply) = neighbor_advertisement(frame, iface.mac, &ours) {
                    iface.send(&reply, &shared.counters);
                    shared.counters.na_replies.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if i == 0 {
            let now = Instant::now();
            let due: Vec<IpAddr> = {
                let mut pending = shared.pending.lock().expect("pending");
                let (due, later): (Vec<_>, Vec<_>) = pending.drain(..).partition(|(t, _)| *t <= now);
                *pending = later;
                due.into_iter().map(|(_, ip)| ip).collect()
            };
            let ours = shared.addresses.read().expect("addresses").clone();
            for ip in due.into_iter().filter(|ip| ours.contains(ip)) {
                for iface in &shared.interfaces {
                    iface.announce(ip, &shared.counters);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: Mac = [2, 0, 0, 0, 0, 0xaa];
    const CLIENT: Mac = [2, 0, 0, 0, 0, 0xcc];

    fn ours(ips: &[&str]) -> BTreeSet<IpAddr> {
        ips.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn arp_request(spa: &str, tpa: &str) -> Vec<u8> {
        let mut f = arp_frame(
            1,
            CLIENT,
            BROADCAST,
            spa.parse().unwrap(),
            [0; 6],
            tpa.parse().unwrap(),
        );
        f.truncate(42);
        f
    }

    #[test]
    fn answers_arp_requests_for_announced_addresses_only() {
        let set = ours(&["198.18.0.241"]);
        let reply = arp_reply(&arp_request("198.18.0.100", "198.18.0.241"), MAC, &set).unwrap();
        assert_eq!(reply.len(), 60);
        assert_eq!(&reply[0..6], &CLIENT, "unicast to the asker");
        assert_eq!(&reply[6..12], &MAC);
        assert_eq!(&reply[20..22], &[0, 2], "a reply");
        assert_eq!(&reply[22..28], &MAC, "sender hardware address: ours");
        assert_eq!(&reply[28..32], &[198, 18, 0, 241]);
        assert_eq!(&reply[32..38], &CLIENT);
        assert_eq!(&reply[38..42], &[198, 18, 0, 100]);
        assert!(arp_reply(&arp_request("198.18.0.100", "198.18.0.242"), MAC, &set).is_none());
        // Another node's gratuitous ARP, our own reply, a truncated frame.
        assert!(arp_reply(&arp_request("198.18.0.241", "198.18.0.241"), MAC, &set).is_none());
        assert!(arp_reply(&reply, MAC, &set).is_none());
        assert!(arp_reply(&arp_request("198.18.0.100", "198.18.0.241")[..30], MAC, &set).is_none());
        // A probe (duplicate address detection) is answered: the address is taken.
        assert!(arp_reply(&arp_request("0.0.0.0", "198.18.0.241"), MAC, &set).is_some());
    }

    #[test]
    fn gratuitous_arp_is_a_broadcast_request_for_the_address_itself() {
        let g = gratuitous_arp(MAC, "198.18.0.241".parse().unwrap());
        assert_eq!(&g[0..6], &BROADCAST);
        assert_eq!(&g[20..22], &[0, 1]);
        assert_eq!(&g[28..32], &g[38..42], "sender and target address are the same");
    }

    fn solicitation(src: Ipv6Addr, target: Ipv6Addr, with_lladdr: bool) -> Vec<u8> {
        let mut icmp = vec![NEIGHBOR_SOLICITATION, 0, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(&target.octets());
        if with_lladdr {
            icmp.extend_from_slice(&[OPT_SOURCE_LLADDR, 1]);
            icmp.extend_from_slice(&CLIENT);
        }
        let o = target.octets();
        let dst = Ipv6Addr::new(
            0xff02,
            0,
            0,
            0,
            0,
            1,
            0xff00 | o[13] as u16,
            u16::from_be_bytes([o[14], o[15]]),
        );
        let c = icmpv6_checksum(&src, &dst, &icmp);
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
        let mut f = Vec::new();
        f.extend_from_slice(&solicited_node_mac(&target));
        f.extend_from_slice(&CLIENT);
        f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
        f.extend_from_slice(&[0x60, 0, 0, 0]);
        f.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
        f.extend_from_slice(&[ICMPV6, 255]);
        f.extend_from_slice(&src.octets());
        f.extend_from_slice(&dst.octets());
        f.extend_from_slice(&icmp);
        f
    }

    fn check_na(na: &[u8], dst: Ipv6Addr, eth_dst: Mac, flags: u8) {
        assert_eq!(&na[0..6], &eth_dst);
        assert_eq!(&na[6..12], &MAC);
        assert_eq!(na[20], ICMPV6);
        assert_eq!(na[21], 255, "hop limit 255");
        let src = Ipv6Addr::from(<[u8; 16]>::try_from(&na[22..38]).unwrap());
        assert_eq!(Ipv6Addr::from(<[u8; 16]>::try_from(&na[38..54]).unwrap()), dst);
        let icmp = &na[54..];
        assert_eq!(icmp.len(), 32);
        assert_eq!(icmp[0], NEIGHBOR_ADVERTISEMENT);
        assert_eq!(icmp[4], flags);
        assert_eq!(icmpv6_checksum(&src, &dst, icmp), 0, "checksum verifies");
        assert_eq!(&icmp[24..26], &[OPT_TARGET_LLADDR, 1]);
        assert_eq!(&icmp[26..32], &MAC);
    }

    #[test]
    fn answers_neighbor_solicitations_for_announced_addresses_only() {
        let lb: Ipv6Addr = "fd00::f1".parse().unwrap();
        let client: Ipv6Addr = "fd00::64".parse().unwrap();
        let set = ours(&["fd00::f1"]);
        let na = neighbor_advertisement(&solicitation(client, lb, true), MAC, &set).unwrap();
        check_na(&na, client, CLIENT, 0x60);
        assert_eq!(&na[62..78], &lb.octets(), "target");
        // Without the option: back to the frame's source.
        let na = neighbor_advertisement(&solicitation(client, lb, false), MAC, &set).unwrap();
        check_na(&na, client, CLIENT, 0x60);
        // Duplicate address detection: to all nodes, not solicited.
        let na = neighbor_advertisement(&solicitation(Ipv6Addr::UNSPECIFIED, lb, false), MAC, &set).unwrap();
        check_na(&na, ALL_NODES, ALL_NODES_MAC, 0x20);
        // Not ours; a bad checksum; a hop limit that is not 255.
        let other = solicitation(client, "fd00::f2".parse().unwrap(), true);
        assert!(neighbor_advertisement(&other, MAC, &set).is_none());
        let mut bad = solicitation(client, lb, true);
        bad[56] ^= 1;
        assert!(neighbor_advertisement(&bad, MAC, &set).is_none());
        let mut far = solicitation(client, lb, true);
        far[21] = 64;
        assert!(neighbor_advertisement(&far, MAC, &set).is_none());
        assert!(neighbor_advertisement(&solicitation(client, lb, true)[..70], MAC, &set).is_none());
    }

    #[test]
    fn unsolicited_advertisements_override_and_go_to_all_nodes() {
        let na = unsolicited_advertisement(MAC, "fd00::f1".parse().unwrap());
        check_na(&na, ALL_NODES, ALL_NODES_MAC, 0x20);
        assert_eq!(
            solicited_node_mac(&"fd00::12:3456".parse().unwrap()),
            [0x33, 0x33, 0xff, 0x12, 0x34, 0x56]
        );
    }
}
