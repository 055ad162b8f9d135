//! `dataplane-agent trace`: what happens to one packet, answered by the real
//! programs. A private copy of the datapath (nothing attached, no live map
//! touched) is programmed from Kubernetes objects through exactly the code
//! path `run` uses; the packet goes through the program that would see it
//! first, then, when forwarded, through `tc_egress` (SNAT), and the result
//! is read back from the packet, the counters and conntrack.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
};

use anyhow::{Context as _, bail};
use aya::programs::{TestRun as _, TestRunOptions};
use dataplane_common::{
    ct::CtKey,
    names,
    stats::{Event, Hook},
};
use serde_json::json;

use crate::{
    agent::sync::{Syncer, node_context},
    dataplane::{
        AbiAddr, DatapathConfig, FamilyMaps, LbMaps, LoadOptions,
        trace_cache::{self, Origin, TraceCacheError, TraceDatapath},
    },
    k8s::{manifests, store::Store},
    net::NodePortAddresses,
    net::{IpCidr, Protocol},
    state::table::MapTable,
};

#[derive(clap::Args, Debug)]
pub struct TraceArgs {
    /// Services, EndpointSlices (and optionally the Node): files or directories.
    #[arg(long = "manifests", required_unless_present = "live")]
    pub manifests: Vec<PathBuf>,
    /// The node traced (EndpointSlice nodeName of its local endpoints).
    #[arg(long)]
    pub node_name: String,
    /// The node's IPs, one per family it serves (`198.18.0.11,2001:db8::11`).
    #[arg(long, value_delimiter = ',', required = true)]
    pub node_ip: Vec<IpAddr>,
    /// Where pods come from (kube-proxy's clusterCIDR), one per family.
    #[arg(long, value_delimiter = ',')]
    pub cluster_cidr: Vec<IpCidr>,
    /// Traffic to an unallocated address inside these is dropped.
    #[arg(long, value_delimiter = ',')]
    pub service_cidr: Vec<IpCidr>,
    /// `primary` (as `run`: the first --node-ip of each family), `all` or
    /// CIDR[,CIDR...] (the node's addresses are --node-ip).
    #[arg(long, default_value = "primary")]
    pub node_port_addresses: NodePortAddresses,
    /// As `run --masquerade-all` (kube-proxy's masqueradeAll).
    #[arg(long)]
    pub masquerade_all: bool,
    /// `external` (a client off the node, on an external device), `pod` (a pod
    /// on this node, --src is its IP) or `host` (a process of the node).
    #[arg(long)]
    pub from: String,
    /// IP[:PORT] (port 40000 when omitted): `203.0.113.7`, `[2001:db8::7]:5000`.
    #[arg(long)]
    pub src: String,
    /// IP:PORT, `10.96.0.10:80` or `[fd00:10:96::a]:80`.
    #[arg(long)]
    pub dst: SocketAddr,
    /// `tcp`, `udp` or `sctp`.
    #[arg(long)]
    pub proto: String,
    /// `table` or `json`.
    #[arg(short = 'o', long, default_value = "table")]
    pub output: String,
    /// Use a running agent's pinned maps (copied, read-only) instead of
    /// --manifests.
    #[arg(long)]
    pub live: bool,
    #[arg(long, default_value = "/sys/fs/bpf/dataplane")]
    pub bpffs_dir: PathBuf,
    /// Where the verified programs are kept between traces (bpffs; removed
    /// by `cleanup`).
    #[arg(long, default_value = trace_cache::DEFAULT_TRACE_CACHE_DIR)]
    pub cache_dir: PathBuf,
    /// Load and verify the programs for this trace alone: nothing is kept.
    #[arg(long)]
    pub no_cache: bool,
    /// Also say (on stderr) where the programs came from and what it cost.
    #[arg(short = 'v', long)]
    pub verbose: bool,
}

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

/// What a trace found.
struct Outcome {
    verdict: &'static str,
    program: &'static str,
    event: Option<Event>,
    src: SocketAddr,
    dst: SocketAddr,
    snat: bool,
    backend: Option<SocketAddr>,
    service_id: Option<u32>,
    steps: Vec<String>,
}

pub fn run(args: TraceArgs) -> anyhow::Result<()> {
    let proto = match args.proto.to_ascii_lowercase().as_str() {
        "tcp" => Protocol::Tcp,
        "udp" => Protocol::Udp,
        "sctp" => Protocol::Sctp,
        other => bail!("--proto {other}: expected tcp, udp or sctp"),
    };
    if proto == Protocol::Sctp && args.from == "host" {
        bail!(
            "--from host traces a connect(2), and this tool opens no SCTP sockets: trace SCTP from outside or a pod"
        );
    }
    let src: SocketAddr = match args.src.parse::<SocketAddr>() {
        Ok(s) => s,
        Err(_) => SocketAddr::new(
            args.src
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse()
                .with_context(|| format!("--src {}: expected IP or IP:PORT", args.src))?,
            40000,
        ),
    };
    if src.is_ipv4() != args.dst.is_ipv4() {
        bail!("--src {src} and --dst {} are of different IP families", args.dst);
    }
    crate::agent::config::check_cluster_cidrs(&args.cluster_cidr)
        .map_err(|e| anyhow::anyhow!("--cluster-cidr: {e}"))?;
    if !matches!(args.from.as_str(), "external" | "pod" | "host") {
        bail!("--from {}: expected external, pod or host", args.from);
    }
    // Bad input is refused before the datapath costs anything.
    let objects = if args.live {
        None
    } else {
        Some(manifests::load(&args.manifests).context("cannot use --manifests")?)
    };
    let (mut dp, names) = match prepare(&args, &CACHED_MAPS, !args.no_cache, objects.clone())? {
        Some(ready) => ready,
        None => {
            eprintln!(
                "note: the table has more than the {} services-map entries the cached copy holds: tracing \
                 on a full-size copy loaded for this trace alone",
                CACHED_MAPS.max_service_entries
            );
            prepare(&args, &FULL_MAPS, false, objects)?.expect("the full-size copy holds any table")
        }
    };
    let outcome = match args.from.as_str() {
        "host" => trace_host(&mut dp, src, args.dst, proto)?,
        from => trace_packet(&dp, from, src, args.dst, proto)?,
    };
    // The Service the destination belongs to, also when it was not forwarded.
    let service_id = match outcome.service_id {
        Some(id) => Some(id),
        None => dp
            .maps()
            .read_table()?
            .frontends
            .iter()
            .find(|(f, _)| f.addr == args.dst.ip() && f.port == args.dst.port() && f.proto == proto)
            .map(|(_, e)| e.service_id),
    };
    let service = service_id.and_then(|id| names.iter().find(|(i, _)| *i == id).map(|(_, n)| n.clone()));
    let reason = outcome.event.map_or_else(|| "not translated".to_owned(), explain);
    let value = json!({
        "verdict": outcome.verdict,
        "service": service,
        "backend": outcome.backend.map(|b| b.to_string()),
        "src": outcome.src.to_string(),
        "dst": outcome.dst.to_string(),
        "snat": outcome.snat,
        "program": outcome.program,
        "reason": reason,
    });
    match args.output.as_str() {
        "json" => println!("{value}"),
        "table" => {
            println!("packet {src} -> {} {} from {}", args.dst, proto, args.from);
            for s in &outcome.steps {
                println!("  {s}");
            }
            println!("verdict: {} ({reason})", outcome.verdict);
            if let Some(s) = &service {
                println!("service: {s}");
            }
            if let Some(b) = outcome.backend {
                println!("backend: {b}");
            }
            println!(
                "as the backend sees it: {} -> {} (snat: {})",
                outcome.src, outcome.dst, outcome.snat
            );
        }
        other => bail!("-o {other}: expected table or json"),
    }
    Ok(())
}

/// Map sizes of a copy loaded for one trace: the agent's defaults, room for
/// any table a node with default limits holds (`--live`).
const FULL_MAPS: LoadOptions = LoadOptions {
    max_services: 65_536,
    max_backends: 131_072,
    max_service_entries: 524_288,
    ct_entries: 4096,
    affinity_entries: 1024,
    ipv6: true,
};

/// The cached copy stays in kernel memory between traces: its services
/// maps (preallocated hashes, most of a copy's memory) are an eighth of the
/// full size. A table that does not fit is traced on a [`FULL_MAPS`] copy.
const CACHED_MAPS: LoadOptions = LoadOptions {
    max_service_entries: 65_536,
    ..FULL_MAPS
};

/// Service ids → `namespace/name:port`.
type ServiceNames = Vec<(u32, String)>;

/// Opens the private datapath (`opts`; from the cache when `cached`), sets
/// its configuration and programs the table (`objects`, or the live one
/// under --bpffs-dir): the datapath and the service names by id, or `None`
/// when the table does not fit.
fn prepare(
    args: &TraceArgs,
    opts: &LoadOptions,
    cached: bool,
    objects: Option<manifests::Objects>,
) -> anyhow::Result<Option<(TraceDatapath, ServiceNames)>> {
    let live = match objects {
        Some(_) => None,
        None => {
            let (live, notes) = LbMaps::open_pins(&args.bpffs_dir)
                .with_context(|| format!("opening the maps pinned under {}", args.bpffs_dir.display()))?;
            if live.service_entries()? > opts.max_service_entries as usize {
                return Ok(None);
            }
            Some((live, notes))
        }
    };
    let mut dp = open_datapath(args, opts, cached)?;
    if args.verbose {
        describe(&dp);
    }
    let mut config = DatapathConfig::for_node(&args.node_ip);
    // With --manifests, their ServiceCIDRs count too, as for `run`.
    let service_cidrs = match &objects {
        Some(o) => {
            use crate::k8s::service_cidrs::{self, MAX_SERVICE_CIDRS, ServiceCidrInfo, ServiceCidrObjects};
            let mut set = ServiceCidrObjects::default();
            set.replace(o.service_cidrs.iter().map(ServiceCidrInfo::parse));
            let all = service_cidrs::union(&args.service_cidr, set.cidrs());
            service_cidrs::limit(&all, &crate::net::IpFamily::BOTH, MAX_SERVICE_CIDRS).kept
        }
        None => args.service_cidr.clone(),
    };
    config.set_cidrs(&args.cluster_cidr, &service_cidrs);
    config.masquerade_all = args.masquerade_all;
    dp.maps_mut().set_config(&config)?;
    let names = match (live, objects) {
        (Some((live, notes)), _) => copy_live(&live, &notes, dp.maps_mut())?,
        (None, Some(objects)) => match program_from_manifests(args, objects, dp.maps_mut())? {
            Some(names) => names,
            None => return Ok(None),
        },
        (None, None) => unreachable!("either the live table or manifests"),
    };
    Ok(Some((dp, names)))
}

/// The private datapath: from the cache (loading what it lacks), or loaded
/// for this trace alone with `--no-cache` or when the cache cannot be used.
fn open_datapath(args: &TraceArgs, opts: &LoadOptions, cached: bool) -> anyhow::Result<TraceDatapath> {
    const LOADING: &str = "loading a private copy of the datapath (needs root or CAP_BPF)";
    if !cached {
        return TraceDatapath::load(opts, &args.from).context(LOADING);
    }
    match TraceDatapath::open_cached(opts, &args.from, &args.cache_dir) {
        Ok(dp) => Ok(dp),
        // The programs themselves failed: without the cache they would too.
        Err(TraceCacheError::Datapath(e)) => Err(anyhow::Error::new(e).context(LOADING)),
        Err(e) => {
            eprintln!(
                "warning: the trace cache at {} cannot be used ({e}): loading the programs for this trace \
                 alone (--no-cache skips the cache)",
                args.cache_dir.display()
            );
            TraceDatapath::load(opts, &args.from).context(LOADING)
        }
    }
}

/// `--verbose`: where the programs came from, and what it cost.
fn describe(dp: &TraceDatapath) {
    let r = dp.report();
    for e in &r.invalidated {
        eprintln!("trace cache: removed {} (another agent build's)", e.display());
    }
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    match &r.origin {
        Origin::Loaded { programs } => eprintln!(
            "trace cache: not used; loaded and verified {} in {:.0} ms",
            programs.join(", "),
            ms(r.load)
        ),
        Origin::Cached { entry } => eprintln!(
            "trace cache: reused the verified programs pinned under {} ({:.1} ms to open and empty)",
            entry.display(),
            ms(r.reuse)
        ),
        Origin::Built { entry, verified } => eprintln!(
            "trace cache: loaded and verified {} in {:.0} ms, pinned under {} for the next trace",
            verified.join(", "),
            ms(r.load),
            entry.display()
        ),
    }
}

fn explain(e: Event) -> String {
    match e {
        Event::NewFlow => "new flow: backend chosen, translated".into(),
        Event::Pass => "not a Service destination: passed untouched".into(),
        Event::RejectNoEndpoints => "the Service has no usable endpoint: ICMP port-unreachable".into(),
        Event::RejectUnknownPort => {
            "a Service address on a port it does not serve: ICMP port-unreachable".into()
        }
        Event::DropNoLocalEndpoint => "Local traffic policy and no endpoint on this node: dropped".into(),
        Event::DropSourceRange => "source outside loadBalancerSourceRanges: dropped".into(),
        Event::DropUnallocatedServiceIp => {
            "an address in a service CIDR that no Service holds: dropped".into()
        }
        other => other.name().replace('_', " "),
    }
}

/// service ids → `namespace/name:port`, from the manifests, through `run`'s
/// own sync; `None` when some of the table could not be written (the maps
/// are too small for it).
fn program_from_manifests(
    args: &TraceArgs,
    objects: manifests::Objects,
    maps: &mut LbMaps,
) -> anyhow::Result<Option<ServiceNames>> {
    for p in &objects.problems {
        eprintln!("warning: {p}");
    }
    if objects.services.is_empty() {
        eprintln!(
            "warning: no Service in {}: every packet is traced against an empty table",
            args.manifests
                .iter()
                .map(|m| m.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let mut store = Store::default();
    objects.replace_store(&mut store, &args.node_name);
    let local: Vec<(String, IpAddr)> = args.node_ip.iter().map(|ip| ("node".to_owned(), *ip)).collect();
    let node = node_context(&args.node_ip, &args.node_port_addresses, &local);
    let mut syncer = Syncer::adopt(&MapTable::default(), &args.node_name, 65_536, 131_072);
    let report = syncer.sync(&mut store, &node, maps);
    let (_, _, capacity) = maps.capacities();
    if report.failed_ops > 0 && capacity < FULL_MAPS.max_service_entries {
        return Ok(None);
    }
    for p in &report.problems {
        eprintln!("warning: {p}");
    }
    Ok(Some(
        maps.service_names()?
            .into_iter()
            .map(|(id, n)| (id, n.to_string()))
            .collect(),
    ))
}

/// Copies a running agent's table (`live`, opened from its pins) into the
/// private maps: the live maps are only read.
fn copy_live(live: &LbMaps, notes: &[String], maps: &mut LbMaps) -> anyhow::Result<ServiceNames> {
    for n in notes {
        eprintln!("note: {n}");
    }
    let table = live.read_table()?;
    for (id, b) in &table.backends {
        maps.set_backend(*id, b)?;
    }
    for (id, r) in &table.source_ranges {
        maps.add_source_range(*id, *r)?;
    }
    for a in &table.service_addresses {
        maps.set_service_address(*a)?;
    }
    for (fe, e) in &table.frontends {
        maps.set_frontend(fe, e)?;
    }
    Ok(table
        .service_names
        .into_iter()
        .map(|(id, n)| (id, n.to_string()))
        .collect())
}

/// A first packet (a TCP SYN, a UDP datagram, an SCTP common header) from
/// `src` to `dst`, either family, with valid checksums.
fn frame(src: SocketAddr, dst: SocketAddr, proto: Protocol) -> Vec<u8> {
    let l4_len = match proto {
        Protocol::Tcp => 20,
        Protocol::Udp => 8,
        // The common header alone; its CRC32c stays zero ("left to the
        // device"), which the datapath keeps: nothing here depends on it.
        Protocol::Sctp => 12,
    };
    let (ethertype, l3_len) = if src.is_ipv4() {
        (0x0800u16, 20)
    } else {
        (0x86ddu16, 40)
    };
    let mut f = vec![0u8; 14 + l3_len + l4_len];
    f[..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 2]);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    f[12..14].copy_from_slice(&ethertype.to_be_bytes());
    let octets = |a: IpAddr| match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let (s, d) = (octets(src.ip()), octets(dst.ip()));
    let ip = &mut f[14..14 + l3_len];
    if src.is_ipv4() {
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&((20 + l4_len) as u16).to_be_bytes());
        ip[8] = 64;
        ip[9] = proto.number();
        ip[12..16].copy_from_slice(&s);
        ip[16..20].copy_from_slice(&d);
        let c = checksum(ip, 0);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
    } else {
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
        ip[6] = proto.number();
        ip[7] = 64;
        ip[8..24].copy_from_slice(&s);
        ip[24..40].copy_from_slice(&d);
    }
    let l4_at = 14 + l3_len;
    let l4 = &mut f[l4_at..];
    l4[0..2].copy_from_slice(&src.port().to_be_bytes());
    l4[2..4].copy_from_slice(&dst.port().to_be_bytes());
    match proto {
        Protocol::Tcp => {
            l4[12] = 5 << 4;
            l4[13] = 0x02; // SYN
            l4[14..16].copy_from_slice(&64240u16.to_be_bytes());
        }
        Protocol::Udp => l4[4..6].copy_from_slice(&8u16.to_be_bytes()),
        Protocol::Sctp => return f,
    }
    // The pseudo-header: both addresses, the protocol, the L4 length (the
    // same sum for IPv4's and IPv6's layouts).
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&s);
    pseudo.extend_from_slice(&d);
    pseudo.extend_from_slice(&[0, proto.number()]);
    pseudo.extend_from_slice(&(l4_len as u16).to_be_bytes());
    let sum = pseudo
        .chunks(2)
        .map(|w| u16::from_be_bytes([w[0], w[1]]) as u32)
        .sum::<u32>();
    let c = checksum(&f[l4_at..], sum);
    let at = if proto == Protocol::Tcp {
        l4_at + 16
    } else {
        l4_at + 6
    };
    f[at..at + 2].copy_from_slice(&c.to_be_bytes());
    f
}

fn checksum(bytes: &[u8], start: u32) -> u16 {
    let mut sum = start;
    for w in bytes.chunks(2) {
        sum += u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]) as u32;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// (src, dst, protocol) of an IPv4 or IPv6 TCP/UDP/SCTP frame without
/// VLAN tags or IPv6 extension headers (what [`frame`] builds).
fn addresses(f: &[u8]) -> Option<(SocketAddr, SocketAddr, u8)> {
    let port = |o: usize| -> Option<u16> { Some(u16::from_be_bytes([*f.get(o)?, *f.get(o + 1)?])) };
    match f.get(12..14)? {
        [0x08, 0x00] => {
            let ihl = (f.get(14)? & 0x0f) as usize * 4;
            let l4 = 14 + ihl;
            let ip = |o: usize| Ipv4Addr::new(f[o], f[o + 1], f[o + 2], f[o + 3]);
            (f.len() >= l4 + 4).then_some(())?;
            Some((
                SocketAddr::new(ip(26).into(), port(l4)?),
                SocketAddr::new(ip(30).into(), port(l4 + 2)?),
                f[23],
            ))
        }
        [0x86, 0xdd] => {
            let l4 = 14 + 40;
            (f.len() >= l4 + 4).then_some(())?;
            let ip = |o: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&f[o..o + 16]).expect("16 bytes"));
            Some((
                SocketAddr::new(ip(22).into(), port(l4)?),
                SocketAddr::new(ip(38).into(), port(l4 + 2)?),
                f[20],
            ))
        }
        _ => None,
    }
}

/// The service id of the conntrack entry of `src` → `dst`, in the family's
/// conntrack.
fn flow_service<A: AbiAddr>(
    maps: &FamilyMaps<A>,
    src: SocketAddr,
    dst: SocketAddr,
    proto: Protocol,
) -> anyhow::Result<Option<u32>> {
    let (Some(saddr), Some(daddr)) = (A::from_ip(src.ip()), A::from_ip(dst.ip())) else {
        return Ok(None);
    };
    let key = CtKey::new(
        saddr,
        daddr,
        src.port().to_be(),
        dst.port().to_be(),
        proto.number(),
    );
    Ok(maps
        .conntrack()?
        .into_iter()
        .find(|(k, _)| *k == key)
        .map(|(_, e)| e.service_id))
}

/// The event a hook counted during one run (counters are compared).
fn counted(maps: &LbMaps, hook: Hook, before: &[(Event, u64)]) -> Option<Event> {
    Event::ALL.iter().copied().find(|e| {
        let now = maps.hook_counter(hook, *e).map_or(0, |c| c.packets);
        let then = before.iter().find(|(b, _)| b == e).map_or(0, |(_, n)| *n);
        now > then
    })
}

fn snapshot(maps: &LbMaps, hook: Hook) -> Vec<(Event, u64)> {
    Event::ALL
        .iter()
        .map(|e| (*e, maps.hook_counter(hook, *e).map_or(0, |c| c.packets)))
        .collect()
}

fn trace_packet(
    dp: &TraceDatapath,
    from: &str,
    src: SocketAddr,
    dst: SocketAddr,
    proto: Protocol,
) -> anyhow::Result<Outcome> {
    let input = frame(src, dst, proto);
    let mut out = vec![0u8; input.len() + 256];
    let (hook, program) = if from == "external" {
        (Hook::XdpIngress, names::XDP_INGRESS)
    } else {
        (Hook::TcPodIngress, names::TC_POD_INGRESS)
    };
    let before = snapshot(dp.maps(), hook);
    let opts = TestRunOptions {
        data_in: Some(&input),
        data_out: Some(&mut out),
        repeat: 1,
        ..Default::default()
    };
    let r = if from == "external" {
        dp.xdp(names::XDP_INGRESS)?.test_run(opts)?
    } else {
        dp.tc(program)?.test_run(opts)?
    };
    out.truncate(r.data_size_out as usize);
    let event = counted(dp.maps(), hook, &before);
    let mut steps = vec![format!(
        "{program}: returned {} ({})",
        r.return_value,
        event.map_or("no counter moved", |e| e.name())
    )];
    let mut o = Outcome {
        verdict: "pass",
        program,
        event,
        src,
        dst,
        snat: false,
        backend: None,
        service_id: None,
        steps: Vec::new(),
    };
    let forwarded = matches!(
        (from, r.return_value),
        ("external", XDP_PASS) | ("pod", TC_ACT_OK)
    );
    o.verdict = match (from, r.return_value) {
        (_, _) if forwarded && event == Some(Event::NewFlow) => "forward",
        ("external", XDP_DROP) | ("pod", TC_ACT_SHOT) => "drop",
        ("external", XDP_TX) | ("pod", TC_ACT_REDIRECT) => "reject",
        _ => "pass",
    };
    if o.verdict == "forward" {
        let (_, translated_dst, _) = addresses(&out).context("unexpected output frame")?;
        o.dst = translated_dst;
        o.backend = Some(translated_dst);
        steps.push(format!(
            "destination rewritten to {translated_dst} (conntrack entry created)"
        ));
        o.service_id = match src.ip() {
            IpAddr::V4(_) => flow_service(dp.maps().v4(), src, dst, proto)?,
            IpAddr::V6(_) => flow_service(dp.maps().v6(), src, dst, proto)?,
        };
        // Routed towards the backend: tc_egress on the way out (SNAT).
        let mut out2 = vec![0u8; out.len() + 256];
        let r2 = dp.tc(names::TC_EGRESS)?.test_run(TestRunOptions {
            data_in: Some(&out),
            data_out: Some(&mut out2),
            repeat: 1,
            ..Default::default()
        })?;
        out2.truncate(r2.data_size_out as usize);
        let (final_src, final_dst, _) = addresses(&out2).context("unexpected tc_egress output")?;
        o.snat = final_src != src;
        o.src = final_src;
        o.dst = final_dst;
        steps.push(if o.snat {
            format!("tc_egress: source masqueraded to {final_src}")
        } else {
            "tc_egress: source kept (no SNAT)".to_owned()
        });
    }
    o.steps = steps;
    Ok(o)
}

/// Host processes are translated at connect(): the private copy's cgroup
/// programs are attached to a throwaway cgroup this process joins, and a
/// socket connects in a throwaway network namespace (the hook runs before
/// routing; nothing leaves).
fn trace_host(
    dp: &mut TraceDatapath,
    src: SocketAddr,
    dst: SocketAddr,
    proto: Protocol,
) -> anyhow::Result<Outcome> {
    let root = crate::os::cgroup_mount::system_cgroup2_mount()
        .context("tracing a host process needs cgroup v2")?
        .path;
    let cgroup = root.join(format!("dataplane-trace-{}", std::process::id()));
    std::fs::create_dir_all(&cgroup).with_context(|| format!("creating {}", cgroup.display()))?;
    let result = (|| -> anyhow::Result<Outcome> {
        dp.attach_cgroup(&cgroup)?;
        let before = snapshot(dp.maps(), Hook::Socket);
        std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())?;
        let connected = std::thread::spawn(move || -> std::io::Result<()> {
            // SAFETY: unshare on this thread only.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let any: SocketAddr = if dst.is_ipv4() {
                (Ipv4Addr::UNSPECIFIED, 0).into()
            } else {
                (Ipv6Addr::UNSPECIFIED, 0).into()
            };
            match proto {
                Protocol::Udp => std::net::UdpSocket::bind(any)?.connect(dst),
                _ => std::net::TcpStream::connect_timeout(&dst, std::time::Duration::from_millis(200))
                    .map(drop),
            }
        })
        .join()
        .expect("connect thread");
        std::fs::write(root.join("cgroup.procs"), std::process::id().to_string())?;
        let event = counted(dp.maps(), Hook::Socket, &before);
        let program = if dst.is_ipv4() {
            names::SOCK_CONNECT4
        } else {
            names::SOCK_CONNECT6
        };
        let mut o = Outcome {
            verdict: "pass",
            program,
            event,
            src,
            dst,
            snat: false,
            backend: None,
            service_id: None,
            steps: vec![format!(
                "{program}: {}",
                event.map_or("no counter moved", |e| e.name())
            )],
        };
        match event {
            Some(Event::NewFlow) => {
                let table = dp.maps().read_table()?;
                o.service_id = table
                    .frontends
                    .iter()
                    .find(|(f, _)| f.addr == dst.ip() && f.port == dst.port() && f.proto == proto)
                    .map(|(_, e)| e.service_id);
                let backend = dp.maps().sock_translations()?.into_iter().next();
                o.backend = backend;
                o.dst = backend.unwrap_or(dst);
                o.verdict = "forward";
                o.steps.push(format!(
                    "connect() goes to {} (getpeername still shows {dst})",
                    o.dst
                ));
            }
            Some(Event::RejectNoEndpoints) | Some(Event::RejectUnknownPort) => o.verdict = "reject",
            Some(e) if e.is_drop() => o.verdict = "drop",
            _ => {}
        }
        if let Err(e) = connected {
            // After a translation the connect() itself fails in the
            // throwaway namespace (no routes: nothing may leave); only a
            // rejected or untouched connect's error tells something.
            if o.verdict == "forward" {
                o.steps.push(format!(
                    "connect() then returned \"{e}\" in the trace's empty network namespace (expected: nothing is sent)"
                ));
            } else {
                o.steps.push(format!("connect(): {e}"));
            }
        }
        Ok(o)
    })();
    let _ = std::fs::write(root.join("cgroup.procs"), std::process::id().to_string());
    let _ = std::fs::remove_dir(&cgroup);
    result
}
