//! `dataplane-agent inspect`: what a running (or stopped) agent's pinned
//! maps hold. Read-only; works while the agent is down.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use anyhow::Context as _;
use dataplane_common::{
    ct::{CtEntry, ct_flags, state},
    names,
    stats::{Event, Hook},
};
use serde_json::{Value, json};

use super::shared::{agent_get, print};
use crate::{
    dataplane::{AbiAddr, FamilyMaps, LbMaps},
    net::{Protocol, host_port},
    state::table::{Backend, BackendSet, EmptyVerdict, FrontendEntry},
};

#[derive(clap::Args)]
pub struct InspectArgs {
    /// The agent's pin directory.
    #[arg(long, default_value = "/sys/fs/bpf/dataplane", global = true)]
    pub bpffs_dir: PathBuf,
    /// `table` (for people) or `json` (stable, see docs/inspect.md).
    #[arg(short = 'o', long, default_value = "table", global = true)]
    pub output: String,
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand)]
pub enum What {
    /// One row per frontend: address, type, flags, Service, backends, traffic.
    Services,
    /// Backends by id, their state and the Services using them.
    Backends,
    /// Connection-tracking entries (filters combine), with count and capacity.
    Conntrack {
        /// Entries with this address (IPv4 or IPv6) on either side.
        #[arg(long)]
        address: Option<IpAddr>,
        /// Entries with this port on either side.
        #[arg(long)]
        port: Option<u16>,
        #[arg(long)]
        proto: Option<String>,
    },
    /// Packets by program and outcome (drops by reason), and per Service port.
    Stats,
    /// The agent's health answers: /healthz, /livez and every
    /// healthCheckNodePort server.
    Health {
        /// The agent's --health-bind-address (as reachable from here).
        #[arg(long, default_value = "127.0.0.1:10256")]
        health_address: String,
    },
    /// BGP (`--bgp`): whether the speaker answers, each session's state,
    /// prefixes exported and last error, objects left out; from the running
    /// agent's `/healthz`.
    Bgp {
        /// The agent's --health-bind-address (as reachable from here).
        #[arg(long, default_value = "127.0.0.1:10256")]
        health_address: String,
    },
    /// Devices the datapath is attached to: hooks (xdp_ingress, tc_ingress,
    /// tc_egress, tc_pod_ingress, connect-time), XDP or TC, link and program
    /// ids (from the pinned links), and why each device was chosen (from the
    /// running agent), with the local endpoints no pod interface reaches.
    /// Run it in the node's network namespace.
    Interfaces {
        /// The agent's --health-bind-address (as reachable from here); the
        /// reasons come from it, the rest from the pins.
        #[arg(long, default_value = "127.0.0.1:10256")]
        health_address: String,
    },
}

fn flags(e: &FrontendEntry) -> Vec<&'static str> {
    let mut f = Vec::new();
    if e.external_local {
        f.push("eTP=Local");
    }
    if e.internal_local {
        f.push("iTP=Local");
    }
    if e.masquerade {
        f.push("masquerade");
    }
    if e.affinity_timeout.is_some() {
        f.push("affinity");
    }
    if e.source_ranges {
        f.push("source-ranges");
    }
    if e.dsr {
        f.push("dsr");
    }
    if e.maglev {
        f.push("maglev");
    }
    f
}

fn set_json(s: &BackendSet) -> Value {
    json!({
        "backends": s.backends.iter().map(|b| b.get()).collect::<Vec<_>>(),
        "whenEmpty": if s.when_empty == EmptyVerdict::Reject { "reject" } else { "drop" },
    })
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    match &args.what {
        What::Health { health_address } => return health(&args.output, health_address),
        What::Bgp { health_address } => return bgp(&args.output, health_address),
        What::Interfaces { health_address } => {
            return super::inspect_interfaces::run(&args.output, &args.bpffs_dir, health_address);
        }
        _ => {}
    }
    let (maps, notes) = LbMaps::open_pins(&args.bpffs_dir)
        .with_context(|| format!("opening the maps pinned under {}", args.bpffs_dir.display()))?;
    // Old or foreign pins: show what can be read, and say what cannot.
    for n in &notes {
        eprintln!("note: {n}");
    }
    let table = maps.read_table()?;
    let names: BTreeMap<u32, String> = table
        .service_names
        .iter()
        .map(|(id, n)| (*id, n.to_string()))
        .collect();
    let name_of = |id: u32| names.get(&id).cloned().unwrap_or_else(|| format!("#{id}"));
    match &args.what {
        What::Services => {
            let mut rows = Vec::new();
            for (fe, e) in &table.frontends {
                // An id beyond the stats array (pins of another capacity): no figures.
                let stats = maps.service_stats(e.service_id).unwrap_or_default();
                rows.push(json!({
                    "frontend": fe.to_string(),
                    "type": e.kind.as_str(),
                    "service": name_of(e.service_id),
                    "serviceId": e.service_id,
                    "flags": flags(e),
                    "external": set_json(&e.backends),
                    "internal": e.internal_backends.as_ref().map(set_json),
                    "affinityTimeoutSeconds": e.affinity_timeout.map(|d| d.as_secs()),
                    "packets": stats.packets,
                    "bytes": stats.bytes,
                }));
            }
            print(&args.output, json!({ "services": rows }), || {
                // IPv6 frontends are wider.
                let w = table
                    .frontends
                    .iter()
                    .map(|(fe, _)| fe.to_string().len())
                    .max()
                    .unwrap_or(0)
                    .max(24);
                let mut out = format!(
                    "{:<w$} {:<12} {:<36} {:<28} {:>8} {:>10} {:>12}\n",
                    "FRONTEND", "TYPE", "SERVICE PORT", "FLAGS", "BACKENDS", "SVC PKTS", "SVC BYTES"
                );
                for (fe, e) in &table.frontends {
                    let stats = maps.service_stats(e.service_id).unwrap_or_default();
                    let count = match &e.internal_backends {
                        Some(i) => format!("{}/{}", e.backends.backends.len(), i.backends.len()),
                        None => e.backends.backends.len().to_string(),
                    };
                    out.push_str(&format!(
                        "{:<w$} {:<12} {:<36} {:<28} {:>8} {:>10} {:>12}\n",
                        fe.to_string(),
                        e.kind.as_str(),
                        name_of(e.service_id),
                        flags(e).join(","),
                        count,
                        stats.packets,
                        stats.bytes
                    ));
                }
                out
            })
        }
        What::Backends => {
            let mut users: BTreeMap<u32, Vec<String>> = BTreeMap::new();
            for (_, e) in &table.frontends {
                let sets = std::iter::once(&e.backends).chain(e.internal_backends.as_ref());
                for id in sets.flat_map(|s| &s.backends) {
                    let v = users.entry(id.get()).or_default();
                    let n = name_of(e.service_id);
                    if !v.contains(&n) {
                        v.push(n);
                    }
                }
            }
            let state = |b: &Backend| {
                let mut s = vec![if b.serving { "serving" } else { "not-serving" }];
                if b.terminating {
                    s.push("terminating");
                }
                if b.local {
                    s.push("local");
                }
                s
            };
            let rows: Vec<Value> = table
                .backends
                .iter()
                .map(|(id, b)| {
                    json!({"id": id.get(), "address": format!("{}/{}", host_port(b.addr, b.port), b.proto),
                           "state": state(b), "services": users.get(&id.get()).cloned().unwrap_or_default()})
                })
                .collect();
            print(&args.output, json!({ "backends": rows }), || {
                let mut out = format!("{:>6} {:<48} {:<28} {}\n", "ID", "ADDRESS", "STATE", "SERVICES");
                for (id, b) in &table.backends {
                    out.push_str(&format!(
                        "{:>6} {:<48} {:<28} {}\n",
                        id.get(),
                        format!("{}/{}", host_port(b.addr, b.port), b.proto),
                        state(b).join(","),
                        users.get(&id.get()).cloned().unwrap_or_default().join(" ")
                    ));
                }
                out
            })
        }
        What::Conntrack { address, port, proto } => {
            let proto = match proto.as_deref() {
                None => None,
                Some(p) => Some(match p.to_ascii_lowercase().as_str() {
                    "tcp" => Protocol::Tcp.number(),
                    "udp" => Protocol::Udp.number(),
                    other => anyhow::bail!("--proto {other}: expected tcp or udp"),
                }),
            };
            let filter = CtFilter {
                address: *address,
                port: *port,
                proto,
            };
            // Both families' conntrack, IPv4 first.
            let (mut rows, mut total) = conntrack_rows(maps.v4(), &filter, &name_of)?;
            let (rows6, total6) = conntrack_rows(maps.v6(), &filter, &name_of)?;
            rows.extend(rows6);
            total += total6;
            let occupancy = maps.occupancy();
            // The LRU tables hold every flow; the assured tables hold copies
            // of established flows only (restored when the LRU evicts them).
            let sum = |tables: [&str; 2]| -> (u64, u64) {
                tables
                    .iter()
                    .filter_map(|n| occupancy.get(*n))
                    .fold((0, 0), |(e, c), (n, cap)| (e + n, c + cap))
            };
            let (_, capacity) = sum([names::CT4, names::CT6]);
            let (assured, assured_capacity) = sum([names::CT4_ASSURED, names::CT6_ASSURED]);
            let count = rows.len();
            print(
                &args.output,
                json!({
                    "entries": rows,
                    "count": count,
                    "total": total,
                    "capacity": capacity,
                    "assured": {"entries": assured, "capacity": assured_capacity},
                }),
                || {
                    let w = rows
                        .iter()
                        .map(|r| r["key"].as_str().unwrap_or("").len())
                        .max()
                        .unwrap_or(0)
                        .max(46);
                    let mut out = format!(
                        "{:<5} {:<w$} {:<w$} {:<16} {}\n",
                        "PROTO", "SEEN AS", "TRANSLATED TO", "FLAGS", "SERVICE"
                    );
                    for r in &rows {
                        out.push_str(&format!(
                            "{:<5} {:<w$} {:<w$} {:<16} {}\n",
                            r["proto"].as_str().unwrap_or(""),
                            r["key"].as_str().unwrap_or(""),
                            r["translatedTo"].as_str().unwrap_or(""),
                            r["flags"]
                                .as_array()
                                .map(|a| a.iter().filter_map(|v| v.as_str()).collect::<Vec<_>>().join(","))
                                .unwrap_or_default(),
                            r["service"].as_str().unwrap_or("")
                        ));
                    }
                    out.push_str(&format!(
                        "{count} shown, {total} entries, capacity {capacity}; \
                         assured copies {assured} of {assured_capacity}\n"
                    ));
                    out
                },
            )
        }
        What::Stats => {
            let mut events = Vec::new();
            for hook in Hook::ALL {
                for event in Event::ALL {
                    let c = maps.hook_counter(hook, event)?;
                    if c.packets > 0 {
                        events.push(
                            json!({"hook": hook.name(), "event": event.name(), "drop": event.is_drop(),
                                           "packets": c.packets, "bytes": c.bytes}),
                        );
                    }
                }
            }
            let mut services = Vec::new();
            for (id, name) in &names {
                let c = maps.service_stats(*id).unwrap_or_default();
                services
                    .push(json!({"service": name, "serviceId": id, "packets": c.packets, "bytes": c.bytes}));
            }
            let flows: Vec<Value> = maps
                .flow_stats()?
                .into_iter()
                .map(|(stat, n)| json!({"stat": stat.name(), "count": n}))
                .collect();
            print(
                &args.output,
                json!({"events": events, "services": services, "flows": flows}),
                || {
                    let mut out = format!(
                        "{:<16} {:<28} {:>12} {:>14}\n",
                        "PROGRAM", "OUTCOME", "PACKETS", "BYTES"
                    );
                    for e in &events {
                        out.push_str(&format!(
                            "{:<16} {:<28} {:>12} {:>14}\n",
                            e["hook"].as_str().unwrap_or(""),
                            e["event"].as_str().unwrap_or(""),
                            e["packets"].as_u64().unwrap_or(0),
                            e["bytes"].as_u64().unwrap_or(0)
                        ));
                    }
                    out.push_str(&format!("\n{:<45} {:>12}\n", "NEW FLOWS", "COUNT"));
                    for f in &flows {
                        out.push_str(&format!(
                            "{:<45} {:>12}\n",
                            f["stat"].as_str().unwrap_or(""),
                            f["count"].as_u64().unwrap_or(0)
                        ));
                    }
                    out.push_str(&format!(
                        "\n{:<48} {:>12} {:>14}\n",
                        "SERVICE PORT", "PACKETS", "BYTES"
                    ));
                    for s in &services {
                        out.push_str(&format!(
                            "{:<48} {:>12} {:>14}\n",
                            s["service"].as_str().unwrap_or(""),
                            s["packets"].as_u64().unwrap_or(0),
                            s["bytes"].as_u64().unwrap_or(0)
                        ));
                    }
                    out
                },
            )
        }
        What::Health { .. } | What::Bgp { .. } | What::Interfaces { .. } => unreachable!("handled above"),
    }
}

fn health(output: &str, addr: &str) -> anyhow::Result<()> {
    let get = |path: &str| agent_get(addr, path);
    let (hz, hz_body) = get("/healthz")?;
    let (lz, lz_body) = get("/livez")?;
    let (_, checks) = get("/debug/healthchecks")?;
    let value = json!({"healthz": {"status": hz, "body": hz_body}, "livez": {"status": lz, "body": lz_body},
                       "healthCheckNodePorts": checks});
    print(output, value, || {
        let mut out = format!("/healthz {hz} {hz_body}\n/livez   {lz} {lz_body}\n\n");
        out.push_str(&format!(
            "{:<40} {:>6} {:>8} {:>6}\n",
            "SERVICE", "PORT", "LOCAL", "ANSWER"
        ));
        for c in checks.as_array().into_iter().flatten() {
            out.push_str(&format!(
                "{:<40} {:>6} {:>8} {:>6}\n",
                format!(
                    "{}/{}",
                    c["namespace"].as_str().unwrap_or(""),
                    c["name"].as_str().unwrap_or("")
                ),
                c["port"].to_string(),
                c["localEndpoints"].to_string(),
                c["status"].to_string()
            ));
        }
        out
    })
}

fn bgp(output: &str, addr: &str) -> anyhow::Result<()> {
    let (_, health) = agent_get(addr, "/healthz")?;
    let Some(bgp) = health.get("bgp").cloned() else {
        anyhow::bail!("the agent at {addr} does not announce through BGP (started without --bgp)");
    };
    print(output, bgp.clone(), || {
        let mut out = format!(
            "speaker: {}{}
announced prefixes: {}, peers: {}

",
            if bgp["speakerUp"] == true { "up" } else { "DOWN" },
            bgp["speakerError"]
                .as_str()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default(),
            bgp["announced"],
            bgp["peers"],
        );
        out.push_str(&format!(
            "{:<24} {:<40} {:<12} {:<14} {:>8}  {}\n",
            "PEER", "NEIGHBOR", "STATE", "SINCE", "EXPORTED", "LAST ERROR"
        ));
        for x in bgp["sessions"].as_array().into_iter().flatten() {
            let f = |k: &str| x[k].as_str().unwrap_or("").to_owned();
            out.push_str(&format!(
                "{:<24} {:<40} {:<12} {:<14} {:>8}  {}\n",
                f("peer"),
                f("neighbor"),
                f("state"),
                f("since"),
                x["exported"].to_string(),
                f("error")
            ));
        }
        for (k, why) in bgp["invalid"].as_object().into_iter().flatten() {
            out.push_str(&format!("left out: {k}: {}\n", why.as_str().unwrap_or("")));
        }
        out
    })
}

/// What `inspect conntrack` selects (filters combine).
struct CtFilter {
    address: Option<IpAddr>,
    port: Option<u16>,
    proto: Option<u8>,
}

/// The entries of one family's conntrack that `filter` selects, as rows,
/// and how many entries there are in all.
fn conntrack_rows<A: AbiAddr>(
    maps: &FamilyMaps<A>,
    filter: &CtFilter,
    name_of: &dyn Fn(u32) -> String,
) -> anyhow::Result<(Vec<Value>, usize)> {
    let all = maps.conntrack()?;
    let total = all.len();
    let rows = all
        .iter()
        .filter(|(k, e)| {
            let addrs = [k.saddr, k.daddr, e.nat_saddr, e.nat_daddr].map(A::to_ip);
            let ports = [k.sport, k.dport, e.nat_sport, e.nat_dport].map(u16::from_be);
            filter.address.is_none_or(|a| addrs.contains(&a))
                && filter.port.is_none_or(|p| ports.contains(&p))
                && filter.proto.is_none_or(|p| k.proto == p)
        })
        .map(|(k, e)| {
            let pair = |sa: A, sp: u16, da: A, dp: u16| {
                format!(
                    "{} -> {}",
                    host_port(sa.to_ip(), u16::from_be(sp)),
                    host_port(da.to_ip(), u16::from_be(dp))
                )
            };
            json!({
                "proto": Protocol::from_number(k.proto).map_or("?", |p| p.as_str()),
                "key": pair(k.saddr, k.sport, k.daddr, k.dport),
                "translatedTo": pair(e.nat_saddr, e.nat_sport, e.nat_daddr, e.nat_dport),
                "service": name_of(e.service_id),
                "flags": ct_flag_names(e),
            })
        })
        .collect();
    Ok((rows, total))
}

/// An entry's role and its flow's state, as words: `fwd-in`, `fwd-out`,
/// `rep-in`, `rep-out`; `snat`, `explicit`, `dsr`, `assured` (in the
/// established table); `replied`, `fin-fwd`,
/// `fin-rep`, `rst`.
pub fn ct_flag_names<A: AbiAddr>(e: &CtEntry<A>) -> Vec<&'static str> {
    let mut f = vec![match e.role() {
        ct_flags::FWD_IN => "fwd-in",
        ct_flags::FWD_OUT => "fwd-out",
        ct_flags::REP_IN => "rep-in",
        _ => "rep-out",
    }];
    for (bit, name) in [
        (ct_flags::SNAT, "snat"),
        (ct_flags::EXPLICIT, "explicit"),
        (ct_flags::DSR, "dsr"),
        (ct_flags::ASSURED, "assured"),
    ] {
        if e.flags & bit != 0 {
            f.push(name);
        }
    }
    for (fact, name) in [
        (state::REPLIED, "replied"),
        (state::FIN_FWD, "fin-fwd"),
        (state::FIN_REP, "fin-rep"),
        (state::RST, "rst"),
    ] {
        if e.has(fact) {
            f.push(name);
        }
    }
    f
}
