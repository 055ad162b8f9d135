//! BIRD 2, the BGP speaker beside the agent: its configuration rendered
//! from a [`Plan`], and its control socket (`birdc`'s protocol) to apply it
//! (`configure`: BIRD compares the new configuration with the running one
//! and restarts only the protocols whose options changed, so a changed
//! route set never resets a session) and to read the sessions back
//! (`show protocols all`).
//!
//! The rendered configuration has no `kernel` protocol: BIRD neither reads
//! nor writes the node's routing table. Announced prefixes are blackhole
//! routes inside BIRD only (the datapath serves the addresses); each
//! session exports the prefixes meant for it, its own family only.

use std::{fmt::Write as _, path::Path, time::Duration};

use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    net::UnixStream,
};

use super::plan::{Community, Peer, Plan, Prefix};

/// The names the configuration gives BIRD's protocols.
pub const ROUTES4: &str = "dp_routes4";
pub const ROUTES6: &str = "dp_routes6";
pub const PEER_PREFIX: &str = "dp_peer_";

/// A peer's protocol name: `dp_peer_` + the name's letters and digits + a
/// hash of the whole name (Kubernetes names may hold `-` and `.`, BIRD's
/// identifiers may not; two names never share a protocol).
pub fn protocol_name(peer: &str) -> String {
    let clean: String = peer
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(40)
        .collect();
    // FNV-1a, 32 bits: stable across releases (a renamed protocol would
    // reset its session).
    let hash = peer.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    format!("{PEER_PREFIX}{clean}_{hash:08x}")
}

/// A router ID for a node without IPv4 addresses: derived from its name.
fn fallback_router_id(node_name: &str) -> std::net::Ipv4Addr {
    let hash = node_name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    std::net::Ipv4Addr::from(hash.max(1))
}

fn route_line(
    out: &mut String,
    prefix: &Prefix,
    communities: &std::collections::BTreeSet<Community>,
    pref: Option<u32>,
) {
    let _ = write!(out, "  route {prefix} blackhole");
    if communities.is_empty() && pref.is_none() {
        out.push_str(";\n");
        return;
    }
    out.push_str(" {");
    for c in communities {
        let _ = match c {
            Community::Standard(a, b) => write!(out, " bgp_community.add(({a},{b}));"),
            Community::Large(a, b, c) => write!(out, " bgp_large_community.add(({a},{b},{c}));"),
        };
    }
    if let Some(p) = pref {
        let _ = write!(out, " bgp_local_pref = {p};");
    }
    out.push_str(" };\n");
}

fn peer_block(out: &mut String, peer: &Peer, exports: &[&Prefix]) {
    let name = protocol_name(&peer.name);
    let _ = writeln!(out, "protocol bgp {name} {{");
    let _ = writeln!(out, "  description \"{}\";", peer.name);
    let _ = writeln!(out, "  local as {};", peer.my_asn);
    let port = peer.port.map(|p| format!(" port {p}")).unwrap_or_default();
    let _ = writeln!(out, "  neighbor {}{port} as {};", peer.address, peer.peer_asn);
    if let Some(pw) = &peer.password {
        let _ = writeln!(out, "  password \"{pw}\";");
    }
    let _ = writeln!(out, "  hold time {};", peer.hold_time);
    // Connect soon after a start and retry soon after a refused connection
    // (BIRD's defaults: 5 s and 120 s).
    out.push_str("  connect delay time 1;\n  connect retry time 5;\n");
    out.push_str("  error wait time 1, 30;\n");
    if let Some(b) = &peer.bfd {
        let _ = writeln!(
            out,
            "  bfd {{ min rx interval {} ms; min tx interval {} ms; multiplier {}; }};",
            b.min_rx_ms, b.min_tx_ms, b.multiplier
        );
    }
    let _ = writeln!(
        out,
        "  graceful restart {};",
        if peer.graceful_restart { "on" } else { "off" }
    );
    let family = if peer.address.is_ipv4() { "ipv4" } else { "ipv6" };
    if exports.is_empty() {
        let _ = writeln!(out, "  {family} {{ import none; export none; }};");
    } else {
        let set: Vec<String> = exports.iter().map(|p| p.to_string()).collect();
        let _ = writeln!(
            out,
            "  {family} {{ import none; export where net ~ [ {} ]; }};",
            set.join(", ")
        );
    }
    out.push_str("}\n");
}

/// The configuration for `plan` on `node_name`; with `withdraw`, every
/// session stays up and nothing is exported (graceful shutdown).
pub fn render(plan: &Plan, node_name: &str, withdraw: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Rendered by dataplane-agent on node {node_name}: do not edit, the agent rewrites it on every change.\n\
         # BGP announcements (docs/loadbalancer.md); no kernel protocol: BIRD never touches the node's routes."
    );
    let id = plan.router_id.unwrap_or_else(|| fallback_router_id(node_name));
    let _ = writeln!(out, "router id {id};");
    out.push_str("protocol device dp_device { scan time 60; }\n");
    if plan.peers.values().any(|p| p.bfd.is_some()) {
        out.push_str("protocol bfd dp_bfd {}\n");
    }
    for (proto, v4) in [(ROUTES4, true), (ROUTES6, false)] {
        let _ = writeln!(
            out,
            "protocol static {proto} {{\n  {};",
            if v4 { "ipv4" } else { "ipv6" }
        );
        for (prefix, route) in plan.routes.iter().filter(|(p, _)| p.addr.is_ipv4() == v4) {
            route_line(&mut out, prefix, &route.communities, route.local_preference);
        }
        out.push_str("}\n");
    }
    for peer in plan.peers.values() {
        let exports: Vec<&Prefix> = if withdraw {
            Vec::new()
        } else {
            plan.routes
                .iter()
                .filter(|(_, r)| r.peers.contains(&peer.name))
                .map(|(p, _)| p)
                .collect()
        };
        peer_block(&mut out, peer, &exports);
    }
    out
}

/// Writes `text` to `path` atomically (a temporary file renamed over it):
/// BIRD never reads half a file.
pub fn write_config(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[derive(Debug, thiserror::Error)]
pub enum BirdError {
    #[error("cannot reach BIRD's control socket {path}: {source}")]
    Connect { path: String, source: std::io::Error },
    #[error("BIRD's control socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("BIRD did not answer within {0:?}")]
    Timeout(Duration),
    #[error("BIRD refused `{command}`: {message}")]
    Refused { command: String, message: String },
}

/// One reply: its final code and every line's text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    pub code: u16,
    /// (code of the block, text) for every line.
    pub lines: Vec<(u16, String)>,
}

impl Reply {
    /// BIRD's codes: 0xxx done, 1xxx/2xxx data, 8xxx/9xxx errors.
    pub fn is_error(&self) -> bool {
        self.code >= 8000
    }
}

/// A connection to BIRD's control socket.
pub struct Control {
    stream: BufReader<UnixStream>,
    timeout: Duration,
}

/// Parses one line of the control protocol: `NNNN-text` (more follows),
/// `NNNN text` (the last line), or ` text` (continues the block before).
fn parse_line(line: &str, block: u16) -> (u16, bool, String) {
    let b = line.as_bytes();
    if b.len() >= 5 && b[..4].iter().all(u8::is_ascii_digit) && (b[4] == b'-' || b[4] == b' ') {
        let code = line[..4].parse().unwrap_or(0);
        return (code, b[4] == b' ', line[5..].to_owned());
    }
    (block, false, line.strip_prefix(' ').unwrap_or(line).to_owned())
}

impl Control {
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Self, BirdError> {
        let connect = async {
            let stream = UnixStream::connect(path).await?;
            let mut c = Self {
                stream: BufReader::new(stream),
                timeout,
            };
            c.read_reply().await?; // 0001 BIRD x.y ready.
            Ok::<_, BirdError>(c)
        };
        match tokio::time::timeout(timeout, connect).await {
            Err(_) => Err(BirdError::Timeout(timeout)),
            Ok(Err(BirdError::Io(source))) => Err(BirdError::Connect {
                path: path.display().to_string(),
                source,
            }),
            Ok(r) => r,
        }
    }

    async fn read_reply(&mut self) -> Result<Reply, BirdError> {
        let mut reply = Reply::default();
        let mut block = 0;
        loop {
            let mut line = String::new();
            if self.stream.read_line(&mut line).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            let (code, last, text) = parse_line(line.trim_end_matches('\n'), block);
            block = code;
            if last {
                reply.code = code;
                if !text.is_empty() {
                    reply.lines.push((code, text));
                }
                return Ok(reply);
            }
            reply.lines.push((code, text));
        }
    }

    /// Runs `command`; an error reply is [`BirdError::Refused`].
    pub async fn command(&mut self, command: &str) -> Result<Reply, BirdError> {
        let timeout = self.timeout;
        let run = async {
            self.stream
                .get_mut()
                .write_all(format!("{command}\n").as_bytes())
                .await?;
            self.read_reply().await
        };
        let reply = tokio::time::timeout(timeout, run)
            .await
            .map_err(|_| BirdError::Timeout(timeout))??;
        if reply.is_error() {
            return Err(BirdError::Refused {
                command: command.to_owned(),
                message: reply.lines.last().map(|(_, t)| t.clone()).unwrap_or_default(),
            });
        }
        Ok(reply)
    }

    /// Makes BIRD read its configuration file again.
    pub async fn configure(&mut self) -> Result<(), BirdError> {
        self.command("configure").await.map(|_| ())
    }

    /// The sessions of our peer protocols.
    pub async fn sessions(&mut self) -> Result<Vec<Session>, BirdError> {
        Ok(parse_sessions(&self.command("show protocols all").await?))
    }
}

/// A BGP session as BIRD reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Session {
    /// The BGPPeer's name (the protocol's description).
    pub peer: String,
    pub protocol: String,
    pub neighbor: String,
    /// BGP's state: Idle, Connect, Active, OpenSent, OpenConfirm,
    /// Established (BIRD's `Down` when the protocol is stopped).
    pub state: String,
    pub since: String,
    /// Prefixes exported to the peer (while established).
    pub exported: u64,
    /// The last error, if BIRD reports one.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub error: String,
}

impl Session {
    pub fn up(&self) -> bool {
        self.state == "Established"
    }
}

/// The `dp_peer_*` protocols of a `show protocols all` reply.
pub fn parse_sessions(reply: &Reply) -> Vec<Session> {
    let mut out: Vec<Session> = Vec::new();
    for (code, text) in &reply.lines {
        match code {
            1002 => {
                let fields: Vec<&str> = text.split_whitespace().collect();
                if fields.len() >= 5 && fields[0].starts_with(PEER_PREFIX) {
                    let info = fields[5..].join(" ");
                    let (state, error) = match info.split_once("Error: ") {
                        Some((s, e)) => (s.trim().to_owned(), e.trim().to_owned()),
                        None => (info.trim().to_owned(), String::new()),
                    };
                    out.push(Session {
                        protocol: fields[0].to_owned(),
                        peer: fields[0].to_owned(),
                        state: if state.is_empty() { "Down".into() } else { state },
                        since: fields[4].to_owned(),
                        error,
                        ..Session::default()
                    });
                } else if !fields.is_empty() {
                    // Another protocol's row: its details are not ours.
                    out.push(Session::default());
                }
            }
            1006 => {
                let Some(s) = out.last_mut().filter(|s| !s.protocol.is_empty()) else {
                    continue;
                };
                let Some((key, value)) = text.trim().split_once(':') else {
                    continue;
                };
                let value = value.trim();
                match key {
                    "Description" => s.peer = value.to_owned(),
                    "Neighbor address" => s.neighbor = value.to_owned(),
                    "Last error" if s.error.is_empty() => s.error = value.to_owned(),
                    "Routes" => {
                        // `0 imported, 1 exported, 0 preferred`
                        s.exported = value
                            .split(',')
                            .find_map(|p| p.trim().strip_suffix(" exported")?.trim().parse().ok())
                            .unwrap_or(0);
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    out.retain(|s| !s.protocol.is_empty());
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::lb::{
        bgp::plan::{Inputs, plan},
        crd::{BgpAdvertisement, BgpPeer},
        request::ClassFilter,
    };

    #[test]
    fn protocol_names_are_identifiers_and_distinct() {
        let a = protocol_name("tor-1.rack");
        let b = protocol_name("tor.1-rack");
        assert!(a.starts_with("dp_peer_tor_1_rack_"));
        assert_ne!(a, b);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    }

    #[test]
    fn renders_sessions_routes_and_a_withdrawal() {
        let peers: Vec<BgpPeer> = vec![
            serde_json::from_value(json!({"metadata": {"name": "tor"}, "spec": {
                "peerAddress": "198.18.0.254", "peerASN": 64500, "myASN": 64512, "port": 1179,
                "password": "s3cret", "holdTimeSeconds": 9, "bfd": {"minRxMs": 100}}}))
            .unwrap(),
            serde_json::from_value(json!({"metadata": {"name": "tor6"}, "spec": {
                "peerAddress": "2001:db8::fe", "peerASN": 64500, "myASN": 64512}}))
            .unwrap(),
        ];
        let ads: Vec<BgpAdvertisement> = vec![
            serde_json::from_value(json!({"metadata": {"name": "a"}, "spec": {
                "serviceCIDRs": ["10.96.0.0/16"], "communities": ["64512:100", "64512:7:8"], "localPreference": 150}}))
            .unwrap(),
        ];
        let classes = ClassFilter {
            class: "x".into(),
            default_class: false,
        };
        let p = plan(&Inputs {
            node_name: "n1",
            node: None,
            classes: &classes,
            services: vec![],
            slices: vec![],
            peers: peers.iter().collect(),
            advertisements: ads.iter().collect(),
            pools: vec![],
        });
        let text = render(&p, "n1", false);
        let tor = protocol_name("tor");
        assert!(text.contains(&format!("protocol bgp {tor} {{")), "{text}");
        assert!(text.contains("neighbor 198.18.0.254 port 1179 as 64500;"));
        assert!(text.contains("password \"s3cret\";"));
        assert!(text.contains("hold time 9;"));
        assert!(text.contains("bfd { min rx interval 100 ms; min tx interval 300 ms; multiplier 3; };"));
        assert!(text.contains("protocol bfd dp_bfd {}"));
        assert!(text.contains(
            "route 10.96.0.0/16 blackhole { bgp_community.add((64512,100)); bgp_large_community.add((64512,7,8)); bgp_local_pref = 150; };"
        ));
        assert!(text.contains("ipv4 { import none; export where net ~ [ 10.96.0.0/16 ]; };"));
        assert!(
            text.contains("ipv6 { import none; export none; };"),
            "no IPv6 prefix: {text}"
        );
        assert!(
            !text.contains("protocol kernel"),
            "BIRD must not touch the node's routes"
        );
        let withdrawn = render(&p, "n1", true);
        assert!(withdrawn.contains("ipv4 { import none; export none; };"));
        assert!(
            withdrawn.contains(&format!("protocol bgp {tor} {{")),
            "sessions stay up"
        );
    }

    #[test]
    fn parses_birds_protocol_report() {
        let raw = "2002-Name       Proto      Table      State  Since         Info\n\
                   1002-device1    Device     ---        up     02:29:58.863  \n\
                   1006-\n\
                   1002-dp_peer_tor_1234abcd BGP        ---        up     02:30:02.808  Established   \n\
                   1006-  Description:    tor\n   BGP state:          Established\n     Neighbor address: 198.18.0.254\n\
                   \x20    Routes:         0 imported, 3 exported, 0 preferred\n\
                   1002-dp_peer_x_00000001 BGP        ---        start  02:30:26.664  Idle          Error: BFD session down\n\
                   1006-  Description:    x\n     Neighbor address: 198.18.0.253\n\
                   0000 \n";
        let mut reply = Reply::default();
        let mut block = 0;
        for l in raw.lines() {
            let (code, last, text) = parse_line(l, block);
            block = code;
            if last {
                reply.code = code;
            } else {
                reply.lines.push((code, text));
            }
        }
        let s = parse_sessions(&reply);
        assert_eq!(s.len(), 2, "{s:?}");
        assert_eq!((s[0].peer.as_str(), s[0].up(), s[0].exported), ("tor", true, 3));
        assert_eq!(s[0].neighbor, "198.18.0.254");
        assert_eq!((s[1].peer.as_str(), s[1].state.as_str()), ("x", "Idle"));
        assert_eq!(s[1].error, "BFD session down");
    }
}
