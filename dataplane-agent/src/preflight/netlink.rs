//! Raw netlink for the two families the preflight reads and
//! `netlink-packet-route` does not cover: generic netlink's `netdev` family
//! (a device's XDP features, Linux 6.3+) and nfnetlink's nf_tables (chains
//! of every table). Read-only dumps; the messages are a header and
//! attributes, built and parsed here in a few lines rather than through
//! another crate.

use netlink_sys::{Socket, SocketAddr};

use super::PreflightError;

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;

/// One netlink attribute: (type without flags, payload).
pub type Attr<'a> = (u16, &'a [u8]);

/// Parses the attributes of `buf`.
pub fn attrs(mut buf: &[u8]) -> Vec<Attr<'_>> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            break;
        }
        out.push((kind, &buf[4..len]));
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
    }
    out
}

/// Appends an attribute to `buf`.
pub fn push_attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    buf.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// A NUL-terminated string attribute's value.
pub fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload.split(|b| *b == 0).next().unwrap_or_default()).into_owned()
}

/// Sends one request (`body` follows the netlink header) on a socket of
/// `protocol` and returns the payloads of every answer (each one's bytes
/// after the netlink header), until NLMSG_DONE (dumps) or the first answer.
pub fn request(protocol: isize, kind: u16, flags: u16, body: &[u8]) -> Result<Vec<Vec<u8>>, PreflightError> {
    let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
    let mut socket = Socket::new(protocol)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut msg = Vec::with_capacity(NLMSG_HDRLEN + body.len());
    msg.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(body);
    socket.send(&msg, 0)?;
    let mut out = Vec::new();
    loop {
        let (datagram, _) = socket.recv_from_full()?;
        let mut rest = &datagram[..];
        while rest.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
            let kind = u16::from_ne_bytes([rest[4], rest[5]]);
            if len < NLMSG_HDRLEN || len > rest.len() {
                return Err(PreflightError::Netlink("truncated message".into()));
            }
            let payload = &rest[NLMSG_HDRLEN..len];
            match kind {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(payload[..4].try_into().expect("4 bytes"));
                    if code != 0 {
                        return Err(PreflightError::Kernel(std::io::Error::from_raw_os_error(-code)));
                    }
                    return Ok(out);
                }
                _ => out.push(payload.to_vec()),
            }
            if !dump {
                return Ok(out);
            }
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        }
    }
}

/// A dump request.
pub fn dump(protocol: isize, kind: u16, body: &[u8]) -> Result<Vec<Vec<u8>>, PreflightError> {
    request(protocol, kind, NLM_F_DUMP, body)
}

const NETLINK_GENERIC: isize = 16;
const NETLINK_NETFILTER: isize = 12;
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;

/// Every device's XDP feature bits (`NETDEV_XDP_ACT_*`) by ifindex, from the
/// `netdev` generic netlink family. `None` when the kernel has no such
/// family (before Linux 6.3).
pub fn xdp_features() -> Result<Option<Vec<(u32, u64)>>, PreflightError> {
    let mut body = vec![CTRL_CMD_GETFAMILY, 1, 0, 0];
    push_attr(&mut body, CTRL_ATTR_FAMILY_NAME, b"netdev\0");
    let family = match request(NETLINK_GENERIC, GENL_ID_CTRL, 0, &body) {
        Ok(answers) => answers.first().and_then(|a| {
            attrs(a.get(4..)?)
                .into_iter()
                .find(|(k, _)| *k == CTRL_ATTR_FAMILY_ID)
                .and_then(|(_, v)| Some(u16::from_ne_bytes(v.get(..2)?.try_into().ok()?)))
        }),
        Err(PreflightError::Kernel(e)) if e.raw_os_error() == Some(libc::ENOENT) => None,
        Err(e) => return Err(e),
    };
    let Some(family) = family else { return Ok(None) };
    let mut out = Vec::new();
    for answer in dump(NETLINK_GENERIC, family, &[NETDEV_CMD_DEV_GET, 1, 0, 0])? {
        let (mut index, mut features) = (None, None);
        for (k, v) in attrs(answer.get(4..).unwrap_or_default()) {
            match k {
                NETDEV_A_DEV_IFINDEX => {
                    index = v.get(..4).map(|b| u32::from_ne_bytes(b.try_into().expect("4")))
                }
                NETDEV_A_DEV_XDP_FEATURES => {
                    features = v.get(..8).map(|b| u64::from_ne_bytes(b.try_into().expect("8")))
                }
                _ => {}
            }
        }
        if let (Some(i), Some(f)) = (index, features) {
            out.push((i, f));
        }
    }
    Ok(Some(out))
}

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;

/// An nf_tables chain: (family, table, chain); family 2 is `ip`, 10 `ip6`,
/// 1 `inet`.
pub type NftChain = (u8, String, String);

/// Every nf_tables chain of this network namespace (iptables-nft's tables
/// included). Empty when nf_tables is not loaded.
pub fn nft_chains() -> Result<Vec<NftChain>, PreflightError> {
    // struct nfgenmsg: family (unspec: all), version 0, resource id 0.
    let answers = match dump(
        NETLINK_NETFILTER,
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETCHAIN,
        &[0, 0, 0, 0],
    ) {
        Ok(a) => a,
        // No nf_tables in this kernel (or module not loaded).
        Err(PreflightError::Kernel(e))
            if matches!(e.raw_os_error(), Some(libc::EPROTONOSUPPORT | libc::ENOENT)) =>
        {
            return Ok(Vec::new());
        }
        Err(PreflightError::Io(e)) if e.raw_os_error() == Some(libc::EPROTONOSUPPORT) => {
            return Ok(Vec::new());
        }
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for a in answers {
        let Some(&family) = a.first() else { continue };
        let (mut table, mut chain) = (String::new(), String::new());
        for (k, v) in attrs(a.get(4..).unwrap_or_default()) {
            match k {
                NFTA_CHAIN_TABLE => table = text(v),
                NFTA_CHAIN_NAME => chain = text(v),
                _ => {}
            }
        }
        out.push((family, table, chain));
    }
    Ok(out)
}
