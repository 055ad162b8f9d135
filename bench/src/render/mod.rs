//! Rendering: the one place results become docs/benchmarks.md's Markdown
//! (with the slots for its hand-written notes, see `notes`) and
//! docs/bench-results.json. No measuring here: one submodule per section,
//! each a pure function of that section's result structs.

pub(crate) mod control;
pub(crate) mod datapath;
pub(crate) mod e2e;
pub(crate) mod exhaustion;
pub(crate) mod forwarding;
pub(crate) mod kube_proxy;
pub(crate) mod probes;
pub(crate) mod protocols;

use std::time::Duration;

use crate::{notes, stat::Stat};

/// What a run measured: the per-packet sections always, the rest in a full
/// run.
pub(crate) struct Results {
    /// CPUs, CPU model and kernel of the machine.
    pub machine: String,
    pub rows: Vec<crate::datapath::Row>,
    /// The new-flow row with a conntrack map that fits the caches.
    pub small_ct: crate::datapath::Row,
    pub protocols: Vec<crate::protocols::ProtoRow>,
    pub exhaustion: crate::exhaustion::Row,
    pub rest: Option<Rest>,
}

/// The sections of a full run beyond the per-packet ones, and how they were
/// measured (their text quotes it).
pub(crate) struct Rest {
    pub connect: Vec<crate::datapath::ConnectRow>,
    pub e2e: Vec<crate::e2e::Row>,
    pub sustained: Vec<crate::e2e::Row>,
    pub costs: Vec<crate::e2e::Cost>,
    pub forwarding: Vec<crate::forwarding::Row>,
    pub connections: Vec<crate::forwarding::ConnRow>,
    /// Maglev table builds: (backends, table size, ms).
    pub maglev: Vec<(usize, u32, Stat)>,
    pub kube_proxy: Vec<crate::kube_proxy::ControlRow>,
    pub control: Vec<crate::control::InProcess>,
    pub agents: Vec<crate::control::AgentRow>,
    pub probes: Vec<crate::probes::ProbeRow>,
    pub e2e_rounds: usize,
    pub e2e_duration: Duration,
    pub sustained_duration: Duration,
    pub fwd_rounds: usize,
    pub probe_rounds: usize,
}

/// A median and its range, as the tables show them: `median (min–max)`.
pub(crate) fn cell(s: Stat) -> String {
    format!("{:.0} ({:.0}–{:.0})", s.median, s.min, s.max)
}

/// docs/benchmarks.md as generated (its notes' slots empty).
pub(crate) fn markdown(r: &Results) -> String {
    let mut md = datapath::render(&r.machine, &r.rows, &r.small_ct);
    protocols::render(&mut md, &r.protocols);
    exhaustion::render(&mut md, &r.exhaustion);
    let Some(x) = &r.rest else {
        return md;
    };
    datapath::render_connect(&mut md, &x.connect);
    e2e::render(
        &mut md,
        &x.e2e,
        &x.sustained,
        x.e2e_duration,
        x.sustained_duration,
        x.e2e_rounds,
    );
    e2e::render_costs(&mut md, &x.costs);
    forwarding::render(&mut md, &x.forwarding, x.fwd_rounds);
    forwarding::render_connections(&mut md, &x.connections, x.e2e_rounds, x.e2e_duration);
    forwarding::render_maglev(&mut md, &x.maglev);
    // A blank line before the slot; kube_proxy::render begins with the one
    // after it.
    md.push('\n');
    notes::slot(&mut md, "where-the-time-goes");
    kube_proxy::render(&mut md, &x.kube_proxy);
    control::render(&mut md, &x.control, &x.agents);
    probes::render(&mut md, &x.probes, x.probe_rounds);
    md
}

/// docs/bench-results.json (a full run's).
pub(crate) fn json(r: &Results) -> String {
    let mut results = datapath::json(&r.machine, &r.rows);
    results.truncate(results.trim_end().len() - 1);
    results.push_str(&protocols::json(&r.protocols));
    results.push_str(&exhaustion::json(&r.exhaustion));
    if let Some(x) = &r.rest {
        results.push_str(&e2e::json(&x.e2e, &x.sustained));
        results.push_str(&forwarding::json(&x.forwarding, &x.connections));
        results.push_str(&kube_proxy::json(&x.kube_proxy));
        results.push_str(&control::json(&x.control, &x.agents));
        results.push_str(&probes::json(&x.probes));
    }
    results.push_str("}\n");
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(median: f64) -> Stat {
        Stat {
            median,
            min: median - 1.0,
            max: median + 1.0,
        }
    }

    fn row(services: u32) -> crate::datapath::Row {
        crate::datapath::Row {
            services,
            program_s: 0.5,
            floor_repeat: s(20.0),
            floor_single: s(100.0),
            non_service: s(25.0),
            established: s(60.0),
            new_flow: s(300.0),
            new_flow_median: s(250.0),
            new_flow_stalled: 0.01,
            tc_floor: s(40.0),
            tc_floor_single: s(150.0),
            ew_established: s(90.0),
            ew_new_flow: s(400.0),
            ew_new_flow_median: s(350.0),
            ew_new_flow_stalled: 0.0,
        }
    }

    /// The per-packet sections (what `--only datapath` measures).
    fn datapath_only() -> Results {
        Results {
            machine: "2 × a CPU, Linux 6.x".into(),
            rows: vec![row(1), row(1_000)],
            small_ct: row(1),
            protocols: vec![crate::protocols::ProtoRow {
                name: "TCP, IPv4",
                established_repeat: s(30.0),
                repeat_ratio: s(1.0),
                established: s(45.0),
                new_flow: s(1400.0),
            }],
            exhaustion: crate::exhaustion::Row {
                rounds: 5,
                ordinary_mean: s(300.0),
                ordinary_median: s(250.0),
                full_mean: s(900.0),
                full_median: s(800.0),
                ratio: s(3.2),
                full_flows: 1000,
                exhausted_drops: 10,
                ports_busy: 33_000,
                backoff: 5,
                fill_flows: 31_744,
                ports: 31_744,
                ordinary_drops: 0,
            },
            rest: None,
        }
    }

    #[test]
    fn the_markdown_has_its_sections_and_note_slots_in_order() {
        let md = markdown(&datapath_only());
        let at = |what: &str| md.find(what).unwrap_or_else(|| panic!("no {what:?} in\n{md}"));
        assert!(md.starts_with("# Benchmarks\n"));
        assert!(at("<!-- notes: about-this-run -->") < at("## Datapath per packet"));
        assert!(at("## Datapath per packet") < at("<!-- notes: per-packet -->"));
        assert!(at("<!-- notes: per-packet -->") < at("## East-west per packet"));
        assert!(at("## East-west per packet") < at("## Per packet by protocol"));
        // Cells: median (min–max).
        assert!(md.contains("| 1000 | 20 (19–21) |"), "{md}");
        // Notes of an earlier file are kept at their slots.
        let old = md.replace(
            "<!-- notes: per-packet -->\n",
            "<!-- notes: per-packet -->\nA hand-written note.\n",
        );
        let kept = notes::keep(&old, &md).expect("notes kept");
        assert_eq!(kept.kept, vec!["per-packet".to_owned()]);
        assert!(kept.md.contains("A hand-written note."));
    }

    #[test]
    fn the_json_is_one_object_with_every_section() {
        let json = json(&datapath_only());
        let v: serde_json::Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
        assert_eq!(v["machine"], "2 × a CPU, Linux 6.x");
        assert_eq!(v["datapath"][1]["services"], 1000);
        assert_eq!(v["datapath"][0]["established_ns"]["median"], 60.0);
        assert!(v.get("snat_exhaustion").is_some(), "{json}");
        assert_eq!(v.as_object().unwrap().len(), 4, "{json}");
    }
}
