//! `dataplane-agent inspect interfaces`: the devices the datapath is
//! attached to. Hooks, link ids and program ids come from the pinned links
//! (so it works while the agent is down); whether the ingress path is XDP or
//! TC from the hook's name; why each device was chosen, and the local
//! endpoints no pod interface reaches, from the running agent.

use std::{collections::BTreeMap, path::Path};

use aya::programs::links::{FdLink, PinnedLink};
use dataplane_common::names;
use serde_json::{Value, json};

use super::shared::{agent_get, print};
use crate::os::interfaces;

/// One pinned link: `<program>@<device>`.
struct Hook {
    program: String,
    link_id: Option<u32>,
    program_id: Option<u32>,
}

fn mode(program: &str) -> &'static str {
    match program {
        names::XDP_INGRESS => "native XDP",
        names::TC_INGRESS | names::TC_EGRESS | names::TC_POD_INGRESS => "TC (TCX)",
        _ => "cgroup (connect-time)",
    }
}

fn role(hooks: &[Hook]) -> &'static str {
    let has = |p: &str| hooks.iter().any(|h| h.program == p);
    if has(names::XDP_INGRESS) || has(names::TC_INGRESS) {
        "external"
    } else if has(names::TC_POD_INGRESS) {
        "pod"
    } else if hooks.iter().any(|h| h.program.starts_with("sock_")) {
        "cgroup"
    } else {
        "other"
    }
}

pub fn run(output: &str, bpffs_dir: &Path, health_address: &str) -> anyhow::Result<()> {
    let links_dir = bpffs_dir.join("links");
    let entries = std::fs::read_dir(&links_dir).map_err(|e| {
        anyhow::anyhow!(
            "cannot read the pinned links under {}: {e} (is --bpffs-dir the agent's?)",
            links_dir.display()
        )
    })?;
    let mut devices: BTreeMap<String, Vec<Hook>> = BTreeMap::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((program, device)) = name.split_once('@') else {
            continue;
        };
        let info = PinnedLink::from_pin(e.path())
            .ok()
            .and_then(|l| FdLink::from(l).info().ok());
        devices.entry(device.to_owned()).or_default().push(Hook {
            program: program.to_owned(),
            link_id: info.as_ref().map(|i| i.id()),
            program_id: info.as_ref().map(|i| i.program_id()),
        });
    }
    // Reasons from the agent; the pins answer without it.
    let (agent, agent_error) = match agent_get(health_address, "/debug/interfaces") {
        Ok((200, v)) => (v, None),
        Ok((status, _)) => (Value::Null, Some(format!("the agent answered {status}"))),
        Err(e) => (Value::Null, Some(format!("{e:#}"))),
    };
    let why_of = |device: &str| -> Option<String> {
        for list in ["external", "pods"] {
            for d in agent[list].as_array().into_iter().flatten() {
                if d["name"] == device {
                    return Some(match list {
                        "external" => d["why"].as_str().unwrap_or_default().to_owned(),
                        _ => match d["reason"].as_str() {
                            Some("route") => {
                                format!("route {} leads through it", d["route"].as_str().unwrap_or(""))
                            }
                            Some("bridgePort") => format!(
                                "port of bridge {}, which holds {}",
                                d["bridge"].as_str().unwrap_or(""),
                                d["gateway"].as_str().unwrap_or("")
                            ),
                            Some("pattern") => {
                                format!("matches --pod-interfaces {}", d["pattern"].as_str().unwrap_or(""))
                            }
                            _ => String::new(),
                        },
                    });
                }
            }
        }
        None
    };
    let present: BTreeMap<String, u32> = interfaces::links()
        .unwrap_or_default()
        .into_iter()
        .map(|l| (l.name, l.index))
        .collect();
    let mut rows = Vec::new();
    for (device, mut hooks) in devices {
        hooks.sort_by(|a, b| a.program.cmp(&b.program));
        let role = role(&hooks);
        let (label, ifindex) = if role == "cgroup" {
            (device.replace('_', "/"), None)
        } else {
            (device.clone(), present.get(&device).copied())
        };
        rows.push(json!({
            "device": label,
            "role": role,
            "ifindex": ifindex,
            "hooks": hooks.iter().map(|h| json!({
                "hook": h.program,
                "mode": mode(&h.program),
                "linkId": h.link_id,
                "programId": h.program_id,
            })).collect::<Vec<_>>(),
            "why": if role == "cgroup" {
                Some("connect-time translation of the processes in this cgroup (--cgroup-path)".to_owned())
            } else {
                why_of(&device)
            },
        }));
    }
    let unreachable = agent["unreachableLocalEndpoints"].clone();
    let value = json!({
        "devices": rows,
        "discovery": agent["discovery"],
        "unreachableLocalEndpoints": unreachable,
        "agentError": agent_error,
    });
    print(output, value, || {
        let mut out = format!(
            "{:<16} {:<9} {:<15} {:<22} {:>7} {:>7}  WHY\n",
            "DEVICE", "ROLE", "HOOK", "MODE", "LINK", "PROG"
        );
        for r in &rows {
            for (i, h) in r["hooks"].as_array().into_iter().flatten().enumerate() {
                let id = |v: &Value| v.as_u64().map_or_else(|| "-".to_owned(), |n| n.to_string());
                let (device, role, why) = if i == 0 {
                    (
                        r["device"].as_str().unwrap_or(""),
                        r["role"].as_str().unwrap_or(""),
                        r["why"].as_str().unwrap_or("?"),
                    )
                } else {
                    ("", "", "")
                };
                out.push_str(&format!(
                    "{:<16} {:<9} {:<15} {:<22} {:>7} {:>7}  {}\n",
                    device,
                    role,
                    h["hook"].as_str().unwrap_or(""),
                    h["mode"].as_str().unwrap_or(""),
                    id(&h["linkId"]),
                    id(&h["programId"]),
                    why
                ));
            }
        }
        if let Some(d) = agent["discovery"].as_str() {
            out.push_str(&format!("\npod interfaces: {d}\n"));
        }
        if let Some(e) = &agent_error {
            out.push_str(&format!("\nreasons unknown: {e}\n"));
        }
        for u in unreachable.as_array().into_iter().flatten() {
            out.push_str(&format!(
                "WARNING: local endpoint {} ({}) is reached by no attached pod interface ({})\n",
                u["address"].as_str().unwrap_or(""),
                u["service"].as_str().unwrap_or(""),
                u["route"].as_str().unwrap_or("")
            ));
        }
        out
    })
}
