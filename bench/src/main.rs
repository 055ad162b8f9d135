//! `cargo xtask bench`: measures the datapath (ns/packet through the real
//! programs with BPF_PROG_TEST_RUN at 1 to 100k services, against a floor
//! program in the same run), end to end against kube-proxy's rule sets, and
//! the control plane; writes docs/benchmarks.md (keeping its hand-written
//! notes, see `notes`) and docs/bench-results.json.
//!
//! The measuring modules (`datapath`, `protocols`, `exhaustion`, `e2e`,
//! `forwarding`, `kube_proxy`, `control`, `probes`) return plain result
//! structs (medians with their range: `stat`); `render` alone turns them
//! into Markdown and JSON. This file only picks what to measure and writes
//! the files.

mod control;
mod datapath;
mod e2e;
mod exhaustion;
mod forwarding;
mod kube_proxy;
mod notes;
mod probes;
mod protocols;
mod render;
mod stat;

use std::time::Duration;

use datapath::{CT_ENTRIES, ROUNDS, SMALL_CT_ENTRIES};
use render::Results;

/// How much a run measures: `--quick` fewer sizes and shorter runs.
pub(crate) struct Plan {
    pub quick: bool,
    /// Services of the per-packet rows.
    pub sizes: Vec<u32>,
    /// Services of the control-plane rows.
    pub control_sizes: Vec<u32>,
    pub e2e_rounds: usize,
    pub e2e_duration: Duration,
    pub sustained_duration: Duration,
    pub fwd_rounds: usize,
    pub fwd_packets: u32,
    pub probe_rounds: usize,
    pub probes_per_round: usize,
    /// Services of the sustained and clocked runs.
    pub big: u32,
}

impl Plan {
    fn new(quick: bool) -> Self {
        let (e2e_rounds, e2e_duration, sustained_duration) = if quick {
            (1, Duration::from_secs(2), Duration::from_secs(5))
        } else {
            (3, Duration::from_secs(5), Duration::from_secs(60))
        };
        let (fwd_rounds, fwd_packets) = if quick { (1, 1_000_000) } else { (3, 4_000_000) };
        let (probe_rounds, probes_per_round) = if quick { (1, 100) } else { (ROUNDS, 300) };
        Self {
            quick,
            sizes: if quick {
                vec![1, 1_000]
            } else {
                vec![1, 1_000, 10_000, 100_000]
            },
            control_sizes: if quick {
                vec![1_000]
            } else {
                vec![1_000, 10_000, 100_000]
            },
            e2e_rounds,
            e2e_duration,
            sustained_duration,
            fwd_rounds,
            fwd_packets,
            probe_rounds,
            probes_per_round,
            big: if quick { 1_000 } else { 10_000 },
        }
    }
}

fn main() {
    let plan = Plan::new(std::env::args().any(|a| a == "--quick"));
    dataplane_tests::require_privileges();
    // `--only SECTION` runs one section and prints it (docs untouched).
    let only = std::env::args().skip_while(|a| a != "--only").nth(1);
    if let Some(section) = only.as_deref()
        && let Some(md) = only_section(&plan, section)
    {
        print!("{md}");
        return;
    }
    let results = measure(&plan, only.as_deref() == Some("datapath"));
    let md = render::markdown(&results);
    if only.as_deref() == Some("datapath") {
        print!("{md}");
        return;
    }
    write(&md, &render::json(&results));
}

/// One section measured and rendered (`--only`), or `None` for `datapath`
/// (the per-packet rows, measured as in a full run) and unknown names (a
/// full run, as before there were sections).
fn only_section(plan: &Plan, section: &str) -> Option<String> {
    let mut md = String::new();
    match section {
        "control" => {
            let (ours, agents) = control::measure(&plan.control_sizes);
            render::control::render(&mut md, &ours, &agents);
        }
        "e2e" => {
            // `--variants a,b`: only these variants (names as in
            // `e2e::Variant`, lowercase), without the sustained pair: for
            // profiling one path.
            let pick = std::env::args().skip_while(|a| a != "--variants").nth(1);
            let cases = e2e::cases(plan.quick)
                .into_iter()
                .filter(|c| {
                    pick.as_deref()
                        .is_none_or(|p| p.split(',').any(|v| c.variant.is(v)))
                })
                .collect::<Vec<_>>();
            let rows = e2e::run(&cases, plan.e2e_rounds, plan.e2e_duration);
            let (sustained, costs) = if pick.is_some() {
                (Vec::new(), Vec::new())
            } else {
                let services = if plan.quick { 1_000 } else { 10_000 };
                (
                    e2e::sustained(plan.sustained_duration, services),
                    e2e::program_costs(plan.e2e_duration, services),
                )
            };
            render::e2e::render(
                &mut md,
                &rows,
                &sustained,
                plan.e2e_duration,
                plan.sustained_duration,
                plan.e2e_rounds,
            );
            render::e2e::render_costs(&mut md, &costs);
        }
        "forwarding" => {
            let pick = std::env::args().skip_while(|a| a != "--variants").nth(1);
            let rows = forwarding::measure(plan.fwd_rounds, plan.fwd_packets, pick.as_deref());
            render::forwarding::render(&mut md, &rows, plan.fwd_rounds);
            if pick.is_none() {
                let conns = forwarding::connections(plan.e2e_rounds, plan.e2e_duration);
                render::forwarding::render_connections(&mut md, &conns, plan.e2e_rounds, plan.e2e_duration);
                render::forwarding::render_maglev(&mut md, &forwarding::maglev_builds(ROUNDS));
            }
        }
        "exhaustion" => render::exhaustion::render(&mut md, &exhaustion::measure(ROUNDS)),
        "protocols" => render::protocols::render(&mut md, &protocols::measure()),
        _ => return None,
    }
    Some(md)
}

/// Everything a full run measures, in the order it always has; with
/// `datapath_only`, the per-packet sections alone (the rest left empty).
fn measure(plan: &Plan, datapath_only: bool) -> Results {
    let mut rows = Vec::new();
    for &n in &plan.sizes {
        eprintln!("bench: {n} services: programming the maps");
        rows.push(datapath::measure(n, CT_ENTRIES));
    }
    // The same fixture with a conntrack map that fits the caches: what a new
    // flow costs besides the kernel's inserts into a large LRU hash.
    eprintln!("bench: new flows with a small conntrack map");
    let small_ct = datapath::measure(1, SMALL_CT_ENTRIES);
    eprintln!("bench: per packet by protocol and address family");
    let protocols = protocols::measure();
    eprintln!("bench: new flows when SNAT ports run out");
    let exhaustion = exhaustion::measure(ROUNDS);
    let mut results = Results {
        machine: String::new(),
        rows,
        small_ct,
        protocols,
        exhaustion,
        rest: None,
    };
    if datapath_only {
        results.machine = datapath::machine();
        return results;
    }
    let connect = [1, *plan.sizes.last().unwrap()]
        .into_iter()
        .map(|n| {
            eprintln!("bench: connect-time translation with {n} services");
            datapath::measure_connect(n)
        })
        .collect();
    let e2e = e2e::run(&e2e::cases(plan.quick), plan.e2e_rounds, plan.e2e_duration);
    eprintln!("bench: forwarding to a remote backend");
    let forwarding = forwarding::measure(plan.fwd_rounds, plan.fwd_packets, None);
    let connections = forwarding::connections(plan.e2e_rounds, plan.e2e_duration);
    eprintln!("bench: sustained masquerading");
    let sustained = e2e::sustained(plan.sustained_duration, plan.big);
    let costs = e2e::program_costs(plan.e2e_duration, plan.big);
    eprintln!("bench: control plane (in-process syncer, then agents through their sources)");
    let (ours, agents) = control::measure(&plan.control_sizes);
    let kube_proxy = plan
        .control_sizes
        .iter()
        .zip(&ours)
        .map(|(&n, ours)| {
            eprintln!("bench: rule sets for {n} services x 10 endpoints");
            // 100k Services x 10 endpoints is 1.1M chains for the rule sets.
            kube_proxy::control(n, n <= 10_000, ours)
        })
        .collect();
    let probes = probes::measure(plan.probe_rounds, plan.probes_per_round);
    results.machine = datapath::machine();
    let maglev = forwarding::maglev_builds(ROUNDS);
    results.rest = Some(render::Rest {
        connect,
        e2e,
        sustained,
        costs,
        forwarding,
        connections,
        maglev,
        kube_proxy,
        control: ours,
        agents,
        probes,
        e2e_rounds: plan.e2e_rounds,
        e2e_duration: plan.e2e_duration,
        sustained_duration: plan.sustained_duration,
        fwd_rounds: plan.fwd_rounds,
        probe_rounds: plan.probe_rounds,
    });
    results
}

/// Writes docs/benchmarks.md (keeping its hand-written notes, see `notes`;
/// when they cannot all be kept, docs/benchmarks.md.new and exit 1) and
/// docs/bench-results.json; prints the Markdown.
fn write(md: &str, json: &str) {
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let path = out.join("benchmarks.md");
    let old = match std::fs::read_to_string(&path) {
        Ok(old) => old,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => panic!("read docs/benchmarks.md: {e}"),
    };
    let refused = match notes::keep(&old, md) {
        Ok(notes::Kept { md, kept }) => {
            print!("{md}");
            std::fs::write(&path, &md).expect("write docs/benchmarks.md");
            if !kept.is_empty() {
                eprintln!(
                    "bench: kept the hand-written notes {kept:?} of docs/benchmarks.md: they quote the previous \
                     run's figures, read them again against this run's"
                );
            }
            false
        }
        Err(why) => {
            print!("{md}");
            std::fs::write(out.join("benchmarks.md.new"), md).expect("write docs/benchmarks.md.new");
            eprintln!(
                "bench: docs/benchmarks.md left alone, its notes could not all be kept ({why}); this run is in \
                 docs/benchmarks.md.new"
            );
            true
        }
    };
    std::fs::write(out.join("bench-results.json"), json).expect("write results");
    if refused {
        eprintln!("bench: wrote docs/benchmarks.md.new and docs/bench-results.json");
        std::process::exit(1);
    }
    eprintln!("bench: wrote docs/benchmarks.md and docs/bench-results.json");
}
