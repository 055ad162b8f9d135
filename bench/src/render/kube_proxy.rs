//! Markdown and JSON of the control plane and memory against kube-proxy's
//! rule sets (iptables, nftables): load times, single changes, map memory.

use std::fmt::Write as _;

use crate::kube_proxy::ControlRow;

pub(crate) fn render(md: &mut String, control: &[ControlRow]) {
    let _ = writeln!(md, "\n## Control plane and memory (10 endpoints per Service)\n");
    let _ = writeln!(
        md,
        "Ours: the agent's own syncer in-process from empty maps, then single endpoint changes (incremental syncs; \
         p50/p99; see the next section for the same through a running agent and its sources). iptables: \
         `iptables-legacy-restore` of kube-proxy's rules, and `--noflush` of one Service's rewritten chains. \
         nftables: `nft -f` of the whole table, and of one Service's chains. The rule sets are not loaded at 100k \
         Services (1.1M chains; `nft -f` grows ~N² on this kernel, see BENCHMARKING.md). Memory: the services and backends maps' \
         memlock (preallocated, sized to the table) per Service and per backend.\n"
    );
    let _ = writeln!(
        md,
        "| services | ours: program all | ours: one change p50 / p99 | iptables-restore all | iptables one Service | nft -f all | nft one Service | map bytes per Service | per backend |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for c in control {
        let opt = |v: Option<f64>| v.map_or("not run".to_owned(), |s| format!("{s:.3} s"));
        let _ = writeln!(
            md,
            "| {} | {:.3} s | {:.3} / {:.3} ms | {} | {} | {} | {} | {:.0} | {:.0} |",
            c.services,
            c.ours_full_s,
            c.ours_change_p50_ms,
            c.ours_change_p99_ms,
            opt(c.iptables_full_s),
            opt(c.iptables_one_s),
            opt(c.nft_full_s),
            opt(c.nft_one_s),
            c.map_bytes_per_service,
            c.map_bytes_per_backend
        );
    }
    if let Some(c) = control.iter().rfind(|c| c.iptables_full_s.is_some()) {
        let _ = writeln!(
            md,
            "\nReading it: programming the whole table at {} Services is {:.0}× faster than iptables-restore and \
             {:.0}× faster than nft -f. A single change recomputes only the Service whose objects changed and writes \
             only what differs: {:.3} ms p50 in-process here, against {:.2} s for iptables-restore --noflush of one \
             Service's chains.",
            c.services,
            c.iptables_full_s.unwrap_or(0.0) / c.ours_full_s,
            c.nft_full_s.unwrap_or(0.0) / c.ours_full_s,
            c.ours_change_p50_ms,
            c.iptables_one_s.unwrap_or(0.0)
        );
    }
}

/// `,"control_plane":[...]` for the results file.
pub(crate) fn json(control: &[ControlRow]) -> String {
    let opt = |v: Option<f64>| v.map_or("null".to_owned(), |s| format!("{s:.4}"));
    let c: Vec<String> = control
        .iter()
        .map(|r| {
            format!(
                "{{\"services\":{},\"ours_program_all_s\":{:.4},\"ours_change_p50_ms\":{:.2},\"ours_change_p99_ms\":{:.2},\"iptables_restore_all_s\":{},\"iptables_one_service_s\":{},\"nft_all_s\":{},\"nft_one_service_s\":{},\"map_bytes_per_service\":{:.0},\"map_bytes_per_backend\":{:.0}}}",
                r.services,
                r.ours_full_s,
                r.ours_change_p50_ms,
                r.ours_change_p99_ms,
                opt(r.iptables_full_s),
                opt(r.iptables_one_s),
                opt(r.nft_full_s),
                opt(r.nft_one_s),
                r.map_bytes_per_service,
                r.map_bytes_per_backend
            )
        })
        .collect();
    format!(",\"control_plane\":[{}]", c.join(","))
}
