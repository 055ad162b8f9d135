//! `dataplane-agent inspect`: what a running (or stopped) agent's pinned
//! maps hold. Read-only; works while the agent is down.

use std::{collections::BTreeMap, net::Ipv4Addr, path::PathBuf};

use anyhow::Context as _;
use dataplane_common::{
    ct::ct_flags,
    names,
    stats::{Event, Hook},
};
use serde_json::{Value, json};

use crate::{
    dataplane::{BackendSet, EmptyVerdict, FrontendEntry, LbMaps},
    net::Protocol,
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
        /// Entries with this address on either side.
        #[arg(long)]
        address: Option<Ipv4Addr>,
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
}

fn ip(be: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from_be(be))
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
    f
}

fn set_json(s: &BackendSet) -> Value {
    json!({
        "backends": s.backends.iter().map(|b| b.get()).collect::<Vec<_>>(),
        "whenEmpty": if s.when_empty == EmptyVerdict::Reject { "reject" } else { "drop" },
    })
}

fn print(output: &str, value: Value, table: impl FnOnce() -> String) -> anyhow::Result<()> {
    match output {
        "json" => println!("{}", serde_json::to_string_pretty(&value)?),
        "table" => print!("{}", table()),
        other => anyhow::bail!("-o {other}: expected table or json"),
    }
    Ok(())
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    if let What::Health { health_address } = &args.what {
        return health(&args.output, health_address);
    }
    let maps = LbMaps::open_pins(&args.bpffs_dir)
        .with_context(|| format!("opening the maps pinned under {}", args.bpffs_dir.display()))?;
    let table = maps.read_table()?;
    let names: BTreeMap<u32, String> = table
        .service_names
        .iter()
        .map(|(id, (ns, name, port, _))| (*id, format!("{ns}/{name}:{port}")))
        .collect();
    let name_of = |id: u32| names.get(&id).cloned().unwrap_or_else(|| format!("#{id}"));
    match &args.what {
        What::Services => {
            let mut rows = Vec::new();
            for (fe, e) in &table.frontends {
                let stats = maps.service_stats(e.service_id)?;
                rows.push(json!({
                    "frontend": format!("{}:{}/{}", fe.addr, fe.port, fe.proto),
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
                let mut out = format!(
                    "{:<24} {:<12} {:<36} {:<28} {:>8} {:>10} {:>12}\n",
                    "FRONTEND", "TYPE", "SERVICE PORT", "FLAGS", "BACKENDS", "SVC PKTS", "SVC BYTES"
                );
                for (fe, e) in &table.frontends {
                    let stats = maps.service_stats(e.service_id).unwrap_or_default();
                    let count = match &e.internal_backends {
                        Some(i) => format!("{}/{}", e.backends.backends.len(), i.backends.len()),
                        None => e.backends.backends.len().to_string(),
                    };
                    out.push_str(&format!(
                        "{:<24} {:<12} {:<36} {:<28} {:>8} {:>10} {:>12}\n",
                        format!("{}:{}/{}", fe.addr, fe.port, fe.proto),
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
            let state = |b: &crate::dataplane::Backend| {
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
                    json!({"id": id.get(), "address": format!("{}:{}/{}", b.addr, b.port, b.proto),
                           "state": state(b), "services": users.get(&id.get()).cloned().unwrap_or_default()})
                })
                .collect();
            print(&args.output, json!({ "backends": rows }), || {
                let mut out = format!("{:>6} {:<24} {:<28} {}\n", "ID", "ADDRESS", "STATE", "SERVICES");
                for (id, b) in &table.backends {
                    out.push_str(&format!(
                        "{:>6} {:<24} {:<28} {}\n",
                        id.get(),
                        format!("{}:{}/{}", b.addr, b.port, b.proto),
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
            let all = maps.conntrack()?;
            let capacity = maps.occupancy().get(names::CT4).map_or(0, |(_, c)| *c);
            let rows: Vec<Value> = all
                .iter()
                .filter(|(k, e)| {
                    let addrs = [k.saddr, k.daddr, e.nat_saddr, e.nat_daddr].map(ip);
                    let ports = [k.sport, k.dport, e.nat_sport, e.nat_dport].map(u16::from_be);
                    address.is_none_or(|a| addrs.contains(&a))
                        && port.is_none_or(|p| ports.contains(&p))
                        && proto.is_none_or(|p| k.proto == p)
                })
                .map(|(k, e)| {
                    let mut f = Vec::new();
                    if e.flags & ct_flags::REPLY != 0 {
                        f.push("reply");
                    }
                    if e.flags & ct_flags::SNAT != 0 {
                        f.push("snat");
                    }
                    if e.flags & ct_flags::CLOSING != 0 {
                        f.push("closing");
                    }
                    json!({
                        "proto": Protocol::from_number(k.proto).map_or("?", |p| p.as_str()),
                        "key": format!("{}:{} -> {}:{}", ip(k.saddr), u16::from_be(k.sport), ip(k.daddr), u16::from_be(k.dport)),
                        "translatedTo": format!("{}:{} -> {}:{}", ip(e.nat_saddr), u16::from_be(e.nat_sport), ip(e.nat_daddr), u16::from_be(e.nat_dport)),
                        "service": name_of(e.service_id),
                        "backendId": e.backend_id,
                        "flags": f,
                    })
                })
                .collect();
            let (count, total) = (rows.len(), all.len());
            print(
                &args.output,
                json!({"entries": rows, "count": count, "total": total, "capacity": capacity}),
                || {
                    let mut out = format!(
                        "{:<5} {:<46} {:<46} {:<16} {}\n",
                        "PROTO", "SEEN AS", "TRANSLATED TO", "FLAGS", "SERVICE"
                    );
                    for r in &rows {
                        out.push_str(&format!(
                            "{:<5} {:<46} {:<46} {:<16} {}\n",
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
                    out.push_str(&format!("{count} shown, {total} entries, capacity {capacity}\n"));
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
                let c = maps.service_stats(*id)?;
                services
                    .push(json!({"service": name, "serviceId": id, "packets": c.packets, "bytes": c.bytes}));
            }
            print(
                &args.output,
                json!({"events": events, "services": services}),
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
                            e["packets"],
                            e["bytes"]
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
                            s["packets"],
                            s["bytes"]
                        ));
                    }
                    out
                },
            )
        }
        What::Health { .. } => unreachable!("handled above"),
    }
}

fn health(output: &str, addr: &str) -> anyhow::Result<()> {
    let get = |path: &str| -> anyhow::Result<(u16, Value)> {
        use std::io::{Read as _, Write as _};
        let mut s = std::net::TcpStream::connect(addr).with_context(|| {
            format!("cannot reach the agent's health server at {addr} (--health-address)")
        })?;
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        Ok((status, serde_json::from_str(body).unwrap_or(Value::Null)))
    };
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
                c["port"],
                c["localEndpoints"],
                c["status"]
            ));
        }
        out
    })
}
