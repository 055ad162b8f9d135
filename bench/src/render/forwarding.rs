//! Markdown and JSON of forwarding to a backend on another node: packets per
//! second, connections per second, Maglev table builds.

use std::fmt::Write as _;

use dataplane_common::stats::FlowStat;

use crate::{
    forwarding::{ConnRow, ConnVariant, Row, SERVICES, Variant},
    stat::Stat,
};

pub(crate) fn render(md: &mut String, rows: &[Row], rounds: usize) {
    let floor = rows
        .iter()
        .find(|r| r.variant == Variant::Floor)
        .map(|r| r.pps.median);
    let nft = rows
        .iter()
        .find(|r| r.variant == Variant::Nftables)
        .map(|r| r.pps.median);
    let _ = writeln!(
        md,
        "\n## Packets per second to a backend on another node\n\n\
         UDP to {SERVICES} NodePorts whose endpoint runs behind a second node (eTP=Cluster: masqueraded, or by DSR), \
         64-byte frames from our live-frame generator on the client's veth (`xdp_bench_gen`, BPF_PROG_TEST_RUN with \
         `BPF_F_TEST_XDP_LIVE_FRAMES`: the sending CPU runs the whole receive path inline), counted where they \
         arrive on the backend node's device by an XDP drop program; a fresh set of namespaces per measurement, \
         variants interleaved, {rounds} rounds, median (min–max) of frames per second delivered. The node's \
         receiving veth runs our XDP or has GRO on, as a NIC would (a veth takes redirected frames only then).\n"
    );
    let _ = writeln!(
        md,
        "| path | Mpps | vs floor | vs nftables | programs' ns/frame | our drops | forwarding counters |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---|");
    for r in rows {
        let ratio = |b: Option<f64>| b.map_or("–".to_owned(), |b| format!("{:.2}x", r.pps.median / b));
        let flows: Vec<String> = r
            .flows
            .iter()
            .filter(|(k, _)| {
                matches!(
                    k,
                    FlowStat::XdpForwarded
                        | FlowStat::HostRouted
                        | FlowStat::DsrEncapsulated
                        | FlowStat::FwdNoNeighbour
                        | FlowStat::FwdDevice
                        | FlowStat::FwdOther
                )
            })
            .map(|(k, n)| format!("{} {n}", k.name()))
            .collect();
        let program_ns = if matches!(
            r.variant,
            Variant::Kernel | Variant::Nftables | Variant::IptablesLegacy
        ) {
            "–".to_owned()
        } else {
            format!("{:.0}", r.program_ns.median)
        };
        let _ = writeln!(
            md,
            "| {} | {:.2} ({:.2}–{:.2}) | {} | {} | {program_ns} | {} | {} |",
            r.variant.name(),
            r.pps.median / 1e6,
            r.pps.min / 1e6,
            r.pps.max / 1e6,
            ratio(floor),
            ratio(nft),
            if matches!(
                r.variant,
                Variant::Floor | Variant::Kernel | Variant::Nftables | Variant::IptablesLegacy
            ) {
                "–".to_owned()
            } else {
                r.drops.to_string()
            },
            flows.join(", ")
        );
    }
}

pub(crate) fn json(rows: &[Row], conns: &[ConnRow]) -> String {
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"variant\": \"{:?}\", \"pps\": {:.0}, \"min\": {:.0}, \"max\": {:.0}, \"drops\": {}}}",
                r.variant, r.pps.median, r.pps.min, r.pps.max, r.drops
            )
        })
        .collect();
    let conns: Vec<String> = conns
        .iter()
        .map(|r| {
            format!(
                "{{\"variant\": \"{:?}\", \"rate\": {:.0}, \"min\": {:.0}, \"max\": {:.0}}}",
                r.variant, r.rate.median, r.rate.min, r.rate.max
            )
        })
        .collect();
    format!(
        ",\n\"forwarding\": [{}],\n\"remote_connections\": [{}]",
        items.join(", "),
        conns.join(", ")
    )
}

pub(crate) fn render_connections(
    md: &mut String,
    rows: &[ConnRow],
    rounds: usize,
    duration: std::time::Duration,
) {
    let snat = rows
        .iter()
        .find(|r| r.variant == ConnVariant::Snat)
        .map(|r| r.rate.median);
    let direct = rows
        .iter()
        .find(|r| r.variant == ConnVariant::Direct)
        .map(|r| r.rate.median);
    let _ = writeln!(
        md,
        "\n### New connections per second to a backend on another node, SNAT against DSR\n\n\
         `wrk -t1 -c16` with `Connection: close` from the client (CPU 0) to a NodePort on node1 whose backend \
         (nginx, CPU 1) runs on node2, {}s per run, {rounds} rounds, a fresh sandbox per run; our datapath on both \
         nodes in TC (veth); `tcp_max_tw_buckets=0` in the pod. In DSR the SYN-ACKs and responses go from node2 \
         straight to the client.\n",
        duration.as_secs()
    );
    let _ = writeln!(
        md,
        "| path | connections/s | vs SNAT | vs direct | errors | our drops |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|");
    for r in rows {
        let ratio = |b: Option<f64>| b.map_or("–".to_owned(), |b| format!("{:.2}x", r.rate.median / b));
        let _ = writeln!(
            md,
            "| {} | {:.0} ({:.0}–{:.0}) | {} | {} | {} | {} |",
            r.variant.name(),
            r.rate.median,
            r.rate.min,
            r.rate.max,
            ratio(snat),
            ratio(direct),
            r.errors,
            r.drops
        );
    }
}

pub(crate) fn render_maglev(md: &mut String, rows: &[(usize, u32, Stat)]) {
    let _ = writeln!(
        md,
        "\n### Maglev table builds\n\n\
         One table per backend set of a Maglev Service port, rebuilt when the set changes (and only the chunks that \
         differ written): the agent's build time, median (min–max) over rounds.\n"
    );
    let _ = writeln!(md, "| backends | table size | ms per build |");
    let _ = writeln!(md, "|---:|---:|---:|");
    for (n, size, s) in rows {
        let _ = writeln!(
            md,
            "| {n} | {size} | {:.2} ({:.2}–{:.2}) |",
            s.median, s.min, s.max
        );
    }
}
