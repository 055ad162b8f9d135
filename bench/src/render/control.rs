//! Markdown and JSON of the control plane: programming and single changes, in
//! process and through an agent's sources.

use std::fmt::Write as _;

use crate::control::{AgentRow, CHANGES, EPS, IDLE, InProcess, ROUNDS, SPACING};

fn ms(s: f64) -> String {
    if s < 0.01 {
        format!("{:.3}", s * 1000.0)
    } else {
        format!("{:.0}", s * 1000.0)
    }
}

pub(crate) fn render(md: &mut String, ours: &[InProcess], agents: &[AgentRow]) {
    let _ = writeln!(md, "\n## Control plane: programming and single changes\n");
    let _ = writeln!(
        md,
        "N Services × {EPS} endpoints (ClusterIP), one EndpointSlice each. **In-process**: the agent's syncer (store → \
         changed Services → desired table → plan → batched map writes) on a private datapath: programming everything \
         from empty maps (median of {ROUNDS} interleaved rounds, min–max; CPU time of that round), and 200 single \
         endpoint changes (one endpoint of one Service moves; p50/p99, all rounds). **Agent**: a `dataplane-agent run` \
         process in a sandbox node, fed by the fake API server's watch (paginated lists, as the API server) or by \
         manifest files (1000 Services per file; the slices that change in files of their own, rewritten atomically); \
         {} single changes {} ms apart (each after a quiet spell, as the agent's default \
         `--min-sync-period-ms 100` syncs those at once), timed from the event (the API server writing the watch \
         event, or the rename) until the kernel map sends the Service to the new endpoint (the benchmark polls the \
         pinned maps). Idle: the API-fed agent's CPU over {} s after programming (periodic syncs, counters export, \
         interface rescans; the reconcile's period adapts to cost at most 0.5% of a core), its resident memory then \
         and its peak.\n",
        CHANGES,
        SPACING.as_millis(),
        IDLE.as_secs()
    );
    let _ = writeln!(
        md,
        "| services | in-process: program all (CPU) | split recompute / plan / write | one change p50 / p99 |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|");
    for r in ours {
        let _ = writeln!(
            md,
            "| {} | {:.3} s ({:.3}–{:.3}; CPU {:.3} s) | {} / {} / {} ms | {:.3} / {:.3} ms |",
            r.services,
            r.program_all_s,
            r.program_range.0,
            r.program_range.1,
            r.program_all_cpu_s,
            ms(r.split[0]),
            ms(r.split[1]),
            ms(r.split[2]),
            r.change_ms.median,
            r.change_p99_ms
        );
    }
    let _ = writeln!(
        md,
        "\n| services | agent source | start → programmed | first sync | event → maps p50 / p99 | idle CPU | RSS idle (peak) | reconcile |"
    );
    let _ = writeln!(md, "|---:|---|---:|---:|---:|---:|---:|---:|");
    for a in agents {
        let (cpu, rss, reconcile) = match a.idle {
            Some((cpu, rss, peak, rec)) => (
                format!("{cpu:.2}% of a core"),
                format!("{rss:.0} MB ({peak:.0} MB)"),
                if rec.is_nan() {
                    "not in the window".into()
                } else {
                    format!("{rec:.0} ms")
                },
            ),
            None => ("".into(), "".into(), "".into()),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {:.2} s | {:.3} s | {:.2} / {:.2} ms | {cpu} | {rss} | {reconcile} |",
            a.services, a.source, a.start_to_programmed_s, a.first_sync_s, a.event_ms.median, a.event_p99_ms
        );
    }
}

/// `,"control_plane_agent":[...]` for the results file.
pub(crate) fn json(ours: &[InProcess], agents: &[AgentRow]) -> String {
    let o: Vec<String> = ours
        .iter()
        .map(|r| {
            format!(
                "{{\"services\":{},\"program_all_s\":{:.4},\"program_all_cpu_s\":{:.4},\"recompute_s\":{:.4},\"plan_s\":{:.4},\"write_s\":{:.4},\"change_p50_ms\":{:.4},\"change_p99_ms\":{:.4}}}",
                r.services, r.program_all_s, r.program_all_cpu_s, r.split[0], r.split[1], r.split[2], r.change_ms.median, r.change_p99_ms
            )
        })
        .collect();
    let num = |v: f64| {
        if v.is_finite() {
            format!("{v:.3}")
        } else {
            "null".into()
        }
    };
    let a: Vec<String> = agents
        .iter()
        .map(|r| {
            let idle = r.idle.map_or("null".into(), |(cpu, rss, peak, rec)| {
                format!(
                    "{{\"cpu_percent\":{},\"rss_mb\":{},\"peak_rss_mb\":{},\"reconcile_ms\":{}}}",
                    num(cpu),
                    num(rss),
                    num(peak),
                    num(rec)
                )
            });
            format!(
                "{{\"services\":{},\"source\":{:?},\"start_to_programmed_s\":{:.3},\"first_sync_s\":{:.3},\"event_p50_ms\":{:.3},\"event_p99_ms\":{:.3},\"idle\":{idle}}}",
                r.services, r.source, r.start_to_programmed_s, r.first_sync_s, r.event_ms.median, r.event_p99_ms
            )
        })
        .collect();
    format!(
        ",\"control_plane_in_process\":[{}],\"control_plane_agent\":[{}]",
        o.join(","),
        a.join(",")
    )
}
