//! `dataplane-agent monitor`: the packets a running node's datapath drops
//! or rejects, and on request samples of those it translates (before and
//! after), live, from its pinned ring buffer (see
//! `dataplane_common::monitor`). The kernel writes events only while a
//! reader renews its lease in `DP_MONITOR_CTL_V1`, at most `--rate` a
//! second per CPU; the events it had to leave out are counted and shown.
//! Nothing else is written: like `inspect`, it works beside the agent and
//! across its restarts (the ring buffer is pinned and adopted).

use std::{
    collections::HashMap,
    io::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsFd as _, AsRawFd as _},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{Array, Map, MapData, PerCpuArray, RingBuf};
use dataplane_common::{
    monitor::{self as events, DEFAULT_RATE, LEASE_NS, MonitorCtl, MonitorEvent, MonitorRate, MonitorTrace},
    names,
    stats::{Event, Hook},
};
use serde_json::{Value, json};

use crate::{
    dataplane::{LbMaps, PinDir, clock::monotonic_ns},
    net::{Protocol, host_port},
};

#[derive(clap::Args)]
pub struct MonitorArgs {
    /// The agent's pin directory.
    #[arg(long, default_value = "/sys/fs/bpf/dataplane")]
    pub bpffs_dir: PathBuf,
    /// `text` (one line per event) or `json` (one object per line, schema
    /// in docs/inspect.md).
    #[arg(short = 'o', long, default_value = "text")]
    pub output: String,
    /// Which events: drops, rejects (ICMP unreachable answered), trace
    /// (translated packets, before and after, sampled: see --sample).
    /// Repeat or separate with commas; drops and rejects when not given.
    #[arg(long = "type", value_delimiter = ',')]
    pub kinds: Vec<Kind>,
    /// With `--type trace`: one translated packet in this many (drawn at
    /// random, per packet) is traced; the rate limit applies on top.
    #[arg(long, default_value_t = 1)]
    pub sample: u32,
    /// Only packets to this Service's frontends (NAMESPACE/NAME).
    #[arg(long)]
    pub service: Option<String>,
    /// Only packets with this address (either side).
    #[arg(long)]
    pub address: Option<IpAddr>,
    /// Only packets with this port (either side).
    #[arg(long)]
    pub port: Option<u16>,
    /// tcp, udp or sctp.
    #[arg(long)]
    pub proto: Option<String>,
    /// Events per second per CPU the kernel writes at most; the rest are
    /// counted as lost (shown).
    #[arg(long, default_value_t = DEFAULT_RATE)]
    pub rate: u32,
    /// Stop after this many events shown.
    #[arg(long)]
    pub count: Option<u64>,
    /// Stop after this many seconds.
    #[arg(long)]
    pub seconds: Option<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    Drop,
    Reject,
    Trace,
}

impl Kind {
    fn of(event: Event) -> Self {
        if events::traced(event as u32) {
            Kind::Trace
        } else if event.is_drop() {
            Kind::Drop
        } else {
            Kind::Reject
        }
    }
    fn as_str(self) -> &'static str {
        match self {
            Kind::Drop => "drop",
            Kind::Reject => "reject",
            Kind::Trace => "trace",
        }
    }
}

/// A record of the ring: a dropped or rejected packet, or a translated
/// one's trace (before and after).
enum Record {
    Event(MonitorEvent),
    Trace(Box<MonitorTrace>),
}

impl Record {
    /// The record in `item` (the kernel's bytes), `None` when it is too
    /// short for what its event says it is.
    fn parse(item: &[u8]) -> Option<Self> {
        if item.len() < std::mem::size_of::<MonitorEvent>() {
            return None;
        }
        // SAFETY: at least a MonitorEvent's bytes (checked), read unaligned.
        let ev: MonitorEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
        if !events::traced(ev.event as u32) {
            return Some(Self::Event(ev));
        }
        if item.len() < std::mem::size_of::<MonitorTrace>() {
            return None;
        }
        // SAFETY: as above, a MonitorTrace's bytes.
        Some(Self::Trace(Box::new(unsafe {
            std::ptr::read_unaligned(item.as_ptr().cast())
        })))
    }

    /// The packet as the hook received it.
    fn head(&self) -> &MonitorEvent {
        match self {
            Self::Event(e) => e,
            Self::Trace(t) => &t.before,
        }
    }

    /// A translated packet's first bytes as the hook let it go, and its
    /// length.
    fn after(&self) -> Option<(&[u8], u32)> {
        match self {
            Self::Event(_) => None,
            Self::Trace(t) => Some((
                &t.after[..(t.after_captured as usize).min(t.after.len())],
                t.after_len,
            )),
        }
    }
}

/// What a captured packet says: addresses, L4 protocol, ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Headers {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    /// 0 for protocols without ports.
    pub sport: u16,
    pub dport: u16,
}

/// Decodes the start of an Ethernet frame (up to two VLAN tags, IPv4 or
/// IPv6 with extension headers): `None` when it is not an IP packet or is
/// cut before its addresses.
pub fn decode(frame: &[u8]) -> Option<Headers> {
    let be16 = |b: &[u8], at: usize| -> Option<u16> {
        Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
    };
    let mut at = 12;
    let mut ethertype = be16(frame, at)?;
    for _ in 0..2 {
        if ethertype == 0x8100 || ethertype == 0x88a8 {
            at += 4;
            ethertype = be16(frame, at)?;
        }
    }
    let l3 = at + 2;
    let ip = frame.get(l3..)?;
    let (src, dst, mut proto, mut l4) = match ethertype {
        0x0800 => {
            let ihl = (*ip.first()? as usize & 0xf) * 4;
            let a: [u8; 4] = ip.get(12..16)?.try_into().ok()?;
            let b: [u8; 4] = ip.get(16..20)?.try_into().ok()?;
            // A fragment after the first carries no ports.
            let frag_off = be16(ip, 6)? & 0x1fff;
            let l4 = if frag_off == 0 { ihl } else { usize::MAX };
            (
                IpAddr::from(Ipv4Addr::from(a)),
                IpAddr::from(Ipv4Addr::from(b)),
                ip[9],
                l4,
            )
        }
        0x86dd => {
            let a: [u8; 16] = ip.get(8..24)?.try_into().ok()?;
            let b: [u8; 16] = ip.get(24..40)?.try_into().ok()?;
            (
                IpAddr::from(Ipv6Addr::from(a)),
                IpAddr::from(Ipv6Addr::from(b)),
                *ip.get(6)?,
                40,
            )
        }
        _ => return None,
    };
    // IPv6 extension headers: hop-by-hop, routing, destination options,
    // fragment (a later fragment has no ports).
    // A capture cut inside them keeps the addresses (no ports, protocol
    // as far as known).
    while ethertype == 0x86dd && matches!(proto, 0 | 43 | 60 | 44) && l4 != usize::MAX {
        let (Some(&next), Some(&len)) = (ip.get(l4), ip.get(l4 + 1)) else {
            l4 = usize::MAX;
            break;
        };
        if proto == 44 {
            let later = be16(ip, l4 + 2).is_none_or(|o| o & 0xfff8 != 0);
            proto = next;
            l4 = if later { usize::MAX } else { l4 + 8 };
        } else {
            proto = next;
            l4 += (len as usize + 1) * 8;
        }
    }
    let (sport, dport) = match proto {
        6 | 17 | 132 if l4 != usize::MAX => be16(ip, l4).zip(be16(ip, l4 + 2)).unwrap_or((0, 0)),
        _ => (0, 0),
    };
    Some(Headers {
        src,
        dst,
        proto,
        sport,
        dport,
    })
}

/// Service names of the frontends in the pinned maps, read again (at most
/// once a second) when a destination is not found.
struct Services {
    dir: PathBuf,
    frontends: HashMap<(IpAddr, u16, u8), u32>,
    names: HashMap<u32, crate::state::table::ServicePortName>,
    loaded: Option<Instant>,
}

impl Services {
    fn load(&mut self) {
        if self.loaded.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        self.loaded = Some(Instant::now());
        let Ok((maps, _)) = LbMaps::open_pins(&self.dir) else {
            return;
        };
        let Ok(table) = maps.read_table() else { return };
        self.frontends = table
            .frontends
            .iter()
            .map(|(fe, e)| ((fe.addr, fe.port, fe.proto.number()), e.service_id))
            .collect();
        self.names = table.service_names.into_iter().collect();
    }

    /// The Service (id, name) whose frontend `h` is addressed to.
    fn of(&mut self, h: &Headers) -> Option<(u32, &crate::state::table::ServicePortName)> {
        self.frontend((h.dst, h.dport, h.proto))
    }

    /// The Service whose frontend `h` comes from (a reply given the
    /// frontend's address back).
    fn of_source(&mut self, h: &Headers) -> Option<(u32, &crate::state::table::ServicePortName)> {
        self.frontend((h.src, h.sport, h.proto))
    }

    fn frontend(&mut self, key: (IpAddr, u16, u8)) -> Option<(u32, &crate::state::table::ServicePortName)> {
        if !self.frontends.contains_key(&key) {
            self.load();
        }
        let id = *self.frontends.get(&key)?;
        Some((id, self.names.get(&id)?))
    }
}

fn device_name(ifindex: u32) -> String {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` holds IF_NAMESIZE bytes, as the call requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return format!("if{ifindex}");
    }
    // SAFETY: on success the buffer holds a NUL-terminated name.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// The ring buffer pinned under `pins`, and its map id (a new id: the agent
/// created the map again, so read the new one).
fn open_ring(pins: &PinDir) -> anyhow::Result<(RingBuf<MapData>, u32)> {
    let path = pins.map(names::MONITOR_EVENTS);
    let data = MapData::from_pin(&path).with_context(|| {
        format!(
            "opening {} (an agent of a version without `monitor`?)",
            path.display()
        )
    })?;
    let id = data.info()?.id();
    Ok((RingBuf::try_from(Map::RingBuf(data))?, id))
}

fn pinned_id(pins: &PinDir, name: &str) -> Option<u32> {
    MapData::from_pin(pins.map(name))
        .ok()?
        .info()
        .ok()
        .map(|i| i.id())
}

/// Events the kernel left out since the maps were created (every CPU).
fn lost(rate: &PerCpuArray<MapData, MonitorRate>) -> u64 {
    rate.get(&0, 0).map_or(0, |v| v.iter().map(|r| r.lost).sum())
}

pub fn run(args: &MonitorArgs) -> anyhow::Result<()> {
    if !matches!(args.output.as_str(), "text" | "json") {
        anyhow::bail!("-o {}: expected text or json", args.output);
    }
    let proto = match args.proto.as_deref() {
        None => None,
        Some(p) => Some(match p.to_ascii_lowercase().as_str() {
            "tcp" => Protocol::Tcp.number(),
            "udp" => Protocol::Udp.number(),
            "sctp" => Protocol::Sctp.number(),
            other => anyhow::bail!("--proto {other}: expected tcp, udp or sctp"),
        }),
    };
    let service = match &args.service {
        None => None,
        Some(s) => Some(
            s.split_once('/')
                .filter(|(ns, n)| !ns.is_empty() && !n.is_empty())
                .with_context(|| format!("--service {s}: expected NAMESPACE/NAME"))?,
        ),
    };
    if args.rate == 0 {
        anyhow::bail!("--rate 0: nothing would be shown");
    }
    let kinds = if args.kinds.is_empty() {
        vec![Kind::Drop, Kind::Reject]
    } else {
        args.kinds.clone()
    };
    let trace = kinds.contains(&Kind::Trace);
    if trace && args.sample == 0 {
        anyhow::bail!("--sample 0: expected one packet in N, N at least 1");
    }
    let filter = Filter {
        kinds,
        service,
        address: args.address,
        port: args.port,
        proto,
    };
    let pins = PinDir::open(&args.bpffs_dir)
        .with_context(|| format!("opening the pin directory {}", args.bpffs_dir.display()))?;
    let open_ctl = || -> anyhow::Result<Array<MapData, MonitorCtl>> {
        Ok(Array::try_from(Map::Array(MapData::from_pin(
            pins.map(names::MONITOR_CTL),
        )?))?)
    };
    let open_rate = || -> anyhow::Result<PerCpuArray<MapData, MonitorRate>> {
        Ok(PerCpuArray::try_from(Map::PerCpuArray(MapData::from_pin(
            pins.map(names::MONITOR_RATE),
        )?))?)
    };
    let (mut ring, mut ring_id) = open_ring(&pins)?;
    let mut ctl = open_ctl()?;
    let mut rate = open_rate()?;
    let mut services = Services {
        dir: args.bpffs_dir.clone(),
        frontends: HashMap::new(),
        names: HashMap::new(),
        loaded: None,
    };
    services.load();
    // Wall-clock time of the kernel's CLOCK_MONOTONIC stamps.
    let wall_offset = jiff::Timestamp::now().as_nanosecond() - monotonic_ns() as i128;
    let json = args.output == "json";
    let started = Instant::now();
    let started_ns = monotonic_ns();
    let mut out = Output {
        json,
        rate: args.rate,
        lost_seen: lost(&rate),
        lost_shown: 0,
        shown: 0,
        stdout: std::io::stdout().lock(),
    };
    let mut renewed: Option<Instant> = None;
    // Said once the kernel writes events: from then on nothing is missed.
    let mut announced = false;
    let done = |out: &Output| args.count.is_some_and(|c| out.shown >= c);
    loop {
        if renewed.is_none_or(|t| t.elapsed() >= Duration::from_nanos(LEASE_NS / 2)) {
            renewed = Some(Instant::now());
            // A restarted agent that created its maps again: follow it.
            if pinned_id(&pins, names::MONITOR_EVENTS).is_some_and(|id| id != ring_id) {
                (ring, ring_id) = open_ring(&pins)?;
                ctl = open_ctl()?;
                rate = open_rate()?;
                out.lost_seen = lost(&rate);
            }
            let lease = MonitorCtl {
                until_ns: monotonic_ns() + LEASE_NS,
                rate: args.rate,
                sample: if trace { args.sample } else { 0 },
            };
            ctl.set(0, lease, 0).context("renewing the monitor lease")?;
            if !announced {
                announced = true;
                let what = filter
                    .kinds
                    .iter()
                    .map(|k| k.as_str())
                    .collect::<Vec<_>>()
                    .join(", ");
                let sampled = if trace {
                    format!(", trace one translated packet in {}", args.sample)
                } else {
                    String::new()
                };
                eprintln!(
                    "following the events ({what}) of {} (at most {}/s per CPU{sampled})",
                    args.bpffs_dir.display(),
                    args.rate
                );
            }
            out.lost(&rate)?;
        }
        if done(&out)
            || args
                .seconds
                .is_some_and(|s| started.elapsed() >= Duration::from_secs(s))
        {
            break;
        }
        let mut fds = [libc::pollfd {
            fd: ring.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, 200) };
        // At most a ring's worth before the lease is looked at again.
        for _ in 0..2048 {
            let Some(item) = ring.next() else { break };
            let rec = Record::parse(&item);
            drop(item);
            // Left in the ring before this reader came (for an earlier one).
            let Some(rec) = rec.filter(|r| r.head().ts_ns >= started_ns) else {
                continue;
            };
            if !done(&out)
                && let Some(line) = render(&rec, &filter, &mut services, wall_offset, json)
            {
                out.line(&line)?;
            }
        }
        out.stdout.flush()?;
    }
    // The kernel stops writing at once; what it wrote or left out until
    // then is shown or counted.
    let _ = ctl.set(0, MonitorCtl::default(), 0);
    while let Some(item) = ring.next() {
        let rec = Record::parse(&item);
        drop(item);
        if let Some(rec) = rec.filter(|r| r.head().ts_ns >= started_ns)
            && !done(&out)
            && let Some(line) = render(&rec, &filter, &mut services, wall_offset, json)
        {
            out.line(&line)?;
        }
    }
    out.lost(&rate)?;
    out.stdout.flush()?;
    eprintln!(
        "{} events shown, {} lost (over the rate, or the ring was full)",
        out.shown, out.lost_shown
    );
    Ok(())
}

/// Where events and losses are written, and their tally.
struct Output {
    json: bool,
    rate: u32,
    /// The kernel's lost count last looked at, and what was shown of it.
    lost_seen: u64,
    lost_shown: u64,
    shown: u64,
    stdout: std::io::StdoutLock<'static>,
}

impl Output {
    fn line(&mut self, line: &str) -> std::io::Result<()> {
        self.shown += 1;
        writeln!(self.stdout, "{line}")
    }

    /// A line for the events the kernel left out since the last look.
    fn lost(&mut self, rate: &PerCpuArray<MapData, MonitorRate>) -> std::io::Result<()> {
        let now = lost(rate);
        if now > self.lost_seen {
            let n = now - self.lost_seen;
            self.lost_shown += n;
            if self.json {
                writeln!(self.stdout, "{}", json!({"type": "lost", "count": n}))?;
            } else {
                writeln!(
                    self.stdout,
                    "-- {n} events lost (over {}/s per CPU, or the ring was full)",
                    self.rate
                )?;
            }
        }
        self.lost_seen = now;
        Ok(())
    }
}

/// What to show.
struct Filter<'a> {
    kinds: Vec<Kind>,
    service: Option<(&'a str, &'a str)>,
    address: Option<IpAddr>,
    port: Option<u16>,
    proto: Option<u8>,
}

impl Filter<'_> {
    /// Whether packet headers (of a trace: either of its two) pass the
    /// address, port and protocol filters.
    fn headers(&self, hs: &[Option<Headers>]) -> bool {
        let any = |f: &dyn Fn(&Headers) -> bool| hs.iter().flatten().any(f);
        self.address.is_none_or(|a| any(&|h| h.src == a || h.dst == a))
            && self.port.is_none_or(|p| any(&|h| h.sport == p || h.dport == p))
            && self.proto.is_none_or(|p| any(&|h| h.proto == p))
    }
}

/// A packet's protocol and two ends as text: TCP, UDP and SCTP by name,
/// with ports (when the capture has them); any other protocol by number,
/// addresses alone.
fn ends(h: &Headers) -> (Value, String, String) {
    let known = Protocol::from_number(h.proto);
    let ported = known.is_some() && (h.sport, h.dport) != (0, 0);
    let end = |a: IpAddr, p: u16| if ported { host_port(a, p) } else { a.to_string() };
    (
        known.map_or_else(|| json!(h.proto), |p| json!(p.as_str())),
        end(h.src, h.sport),
        end(h.dst, h.dport),
    )
}

/// The record's line, or `None` when a filter leaves it out.
fn render(
    rec: &Record,
    filter: &Filter,
    services: &mut Services,
    wall_offset: i128,
    json: bool,
) -> Option<String> {
    let ev = rec.head();
    let event = *Event::ALL.get(ev.event as usize)?;
    let kind = Kind::of(event);
    if !filter.kinds.contains(&kind) {
        return None;
    }
    let hook = Hook::ALL.into_iter().find(|h| *h as u8 == ev.hook)?;
    let h = decode(&ev.data[..(ev.captured as usize).min(ev.data.len())]);
    let after = rec.after().map(|(bytes, len)| (decode(bytes), len));
    let after_h = after.and_then(|(h, _)| h);
    if !filter.headers(&[h, after_h]) {
        return None;
    }
    // The frontend is the destination as received, or the source a reply
    // leaves with.
    let mut svc = h
        .as_ref()
        .and_then(|h| services.of(h))
        .map(|(id, n)| (id, n.clone()));
    if svc.is_none()
        && let Some(a) = &after_h
    {
        svc = services.of_source(a).map(|(id, n)| (id, n.clone()));
    }
    if let Some((ns, name)) = filter.service
        && svc
            .as_ref()
            .is_none_or(|(_, n)| &*n.namespace != ns || &*n.name != name)
    {
        return None;
    }
    let time = jiff::Timestamp::from_nanosecond(ev.ts_ns as i128 + wall_offset).ok()?;
    let device = device_name(ev.ifindex);
    let ends_before = h.as_ref().map(ends);
    let ends_after = after_h.as_ref().map(ends);
    if json {
        let mut v: Value = json!({
            "time": time.to_string(),
            "type": kind.as_str(),
            "reason": event.name(),
            "hook": hook.name(),
            "device": device,
            "ifindex": ev.ifindex,
            "proto": ends_before.as_ref().map(|e| e.0.clone()),
            "source": ends_before.as_ref().map(|e| e.1.clone()),
            "destination": ends_before.as_ref().map(|e| e.2.clone()),
            "service": svc.as_ref().map(|(_, n)| n.to_string()),
            "serviceId": svc.as_ref().map(|(id, _)| id),
            "length": ev.len,
        });
        if let Some((_, len)) = after {
            v["after"] = json!({
                "source": ends_after.as_ref().map(|e| e.1.clone()),
                "destination": ends_after.as_ref().map(|e| e.2.clone()),
                "length": len,
            });
        }
        return Some(v.to_string());
    }
    let text = |e: Option<(Value, String, String)>| {
        e.map_or_else(
            || ("?".into(), "?".into(), "?".into()),
            |(p, s, d)| (p.as_str().map_or_else(|| p.to_string(), str::to_owned), s, d),
        )
    };
    let (p, s, d) = text(ends_before);
    let translated = if after.is_some() {
        let (_, s, d) = text(ends_after);
        format!(" => {s} -> {d}")
    } else {
        String::new()
    };
    Some(format!(
        "{}Z {:<14} {:<10} {:<28} {:<4} {} -> {}{translated} {}",
        time.strftime("%H:%M:%S%.3f"),
        hook.name(),
        device,
        event.name(),
        p,
        s,
        d,
        svc.map_or_else(|| "-".to_owned(), |(_, n)| n.to_string())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(ethertype: u16, ip: &[u8], tags: &[u16]) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        for t in tags {
            f.extend_from_slice(&t.to_be_bytes());
            f.extend_from_slice(&[0, 100]);
        }
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(ip);
        f
    }

    fn ipv4(proto: u8, frag: u16, l4: &[u8]) -> Vec<u8> {
        let mut ip = vec![0x45, 0, 0, 0, 0, 0];
        ip.extend_from_slice(&frag.to_be_bytes());
        ip.extend_from_slice(&[64, proto, 0, 0, 198, 18, 0, 100, 198, 18, 0, 11]);
        ip.extend_from_slice(l4);
        ip
    }

    #[test]
    fn decodes_ipv4_with_tags_ports_and_fragments() {
        let ports = [0x9c, 0x40, 0x75, 0x62]; // 40000 -> 30050
        let h = decode(&frame(0x0800, &ipv4(6, 0, &ports), &[0x8100, 0x8100])).unwrap();
        assert_eq!(h.src, "198.18.0.100".parse::<IpAddr>().unwrap());
        assert_eq!(h.dst, "198.18.0.11".parse::<IpAddr>().unwrap());
        assert_eq!((h.proto, h.sport, h.dport), (6, 40000, 30050));
        // A later fragment: addresses, no ports.
        let h = decode(&frame(0x0800, &ipv4(17, 0x00b9, &ports), &[])).unwrap();
        assert_eq!((h.proto, h.sport, h.dport), (17, 0, 0));
        // Cut before its ports: addresses only.
        let h = decode(&frame(0x0800, &ipv4(17, 0, &ports[..2]), &[])).unwrap();
        assert_eq!((h.sport, h.dport), (0, 0));
        // Cut before its addresses, or not IP: nothing.
        assert_eq!(decode(&frame(0x0800, &ipv4(6, 0, &[])[..14], &[])), None);
        assert_eq!(decode(&frame(0x0806, &[0; 28], &[])), None);
        assert_eq!(decode(&[0; 5]), None);
    }

    #[test]
    fn decodes_ipv6_through_extension_headers() {
        let mut ip = vec![0x60, 0, 0, 0, 0, 16, 0 /* hop-by-hop */, 64];
        ip.extend_from_slice(&"2001:db8::100".parse::<Ipv6Addr>().unwrap().octets());
        ip.extend_from_slice(&"2001:db8::11".parse::<Ipv6Addr>().unwrap().octets());
        ip.extend_from_slice(&[60 /* dst opts */, 0, 0, 0, 0, 0, 0, 0]);
        ip.extend_from_slice(&[17, 0, 0, 0, 0, 0, 0, 0]);
        ip.extend_from_slice(&[0, 53, 0x75, 0x62]);
        let h = decode(&frame(0x86dd, &ip, &[])).unwrap();
        assert_eq!(h.dst, "2001:db8::11".parse::<IpAddr>().unwrap());
        assert_eq!((h.proto, h.sport, h.dport), (17, 53, 30050));
        // Cut inside an extension header: the addresses stay, no ports.
        let h = decode(&frame(0x86dd, &ip[..48], &[])).unwrap();
        assert_eq!(h.dst, "2001:db8::11".parse::<IpAddr>().unwrap());
        assert_eq!((h.sport, h.dport), (0, 0));
    }

    /// A trace record (before and after), as the kernel writes it, from
    /// bytes to a JSON line; filters look at both packets.
    #[test]
    fn a_trace_record_shows_both_packets_and_filters_on_either() {
        let udp = |src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16| {
            let mut ip = vec![0x45, 0, 0, 28, 0, 0, 0, 0, 64, 17, 0, 0];
            ip.extend_from_slice(&src);
            ip.extend_from_slice(&dst);
            ip.extend_from_slice(&sport.to_be_bytes());
            ip.extend_from_slice(&dport.to_be_bytes());
            ip.extend_from_slice(&[0, 8, 0, 0]);
            frame(0x0800, &ip, &[])
        };
        let capture = |f: &[u8]| {
            let mut d = [0u8; events::CAPTURE];
            d[..f.len()].copy_from_slice(f);
            d
        };
        let before = udp([198, 18, 0, 100], [198, 18, 0, 11], 40000, 30083);
        let after = udp([198, 18, 0, 100], [10, 244, 2, 10], 40000, 5353);
        let t = MonitorTrace {
            before: MonitorEvent {
                ts_ns: 1,
                ifindex: 1,
                hook: Hook::TcIngress as u8,
                event: Event::NewFlow as u8,
                captured: before.len() as u16,
                len: before.len() as u32,
                _pad: 0,
                data: capture(&before),
            },
            after_len: after.len() as u32,
            after_captured: after.len() as u16,
            _pad: 0,
            after: capture(&after),
        };
        // SAFETY: a plain-old-data record viewed as its bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts((&raw const t).cast::<u8>(), std::mem::size_of::<MonitorTrace>())
        };
        // Cut short: not a trace (nor mistaken for a drop).
        assert!(Record::parse(&bytes[..std::mem::size_of::<MonitorEvent>()]).is_none());
        let rec = Record::parse(bytes).expect("a trace");
        let mut services = Services {
            dir: PathBuf::from("/nonexistent"),
            frontends: HashMap::new(),
            names: HashMap::new(),
            loaded: Some(Instant::now()),
        };
        let filter = |kinds: Vec<Kind>, address: Option<&str>| Filter {
            kinds,
            service: None,
            address: address.map(|a| a.parse().unwrap()),
            port: None,
            proto: None,
        };
        let line = render(&rec, &filter(vec![Kind::Trace], None), &mut services, 0, true).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["type"], "trace");
        assert_eq!(v["reason"], "new_flow");
        assert_eq!(v["destination"], "198.18.0.11:30083");
        assert_eq!(v["after"]["destination"], "10.244.2.10:5353");
        assert_eq!(v["after"]["source"], "198.18.0.100:40000");
        // The backend's address is only in the packet after: it matches.
        let by_backend = filter(vec![Kind::Trace], Some("10.244.2.10"));
        assert!(render(&rec, &by_backend, &mut services, 0, true).is_some());
        let elsewhere = filter(vec![Kind::Trace], Some("10.244.9.9"));
        assert!(render(&rec, &elsewhere, &mut services, 0, true).is_none());
        // Not asked for: left out.
        let drops = filter(vec![Kind::Drop, Kind::Reject], None);
        assert!(render(&rec, &drops, &mut services, 0, true).is_none());
        let text = render(&rec, &filter(vec![Kind::Trace], None), &mut services, 0, false).unwrap();
        assert!(
            text.contains(
                "198.18.0.100:40000 -> 198.18.0.11:30083 => 198.18.0.100:40000 -> 10.244.2.10:5353"
            ),
            "{text}"
        );
    }
}
