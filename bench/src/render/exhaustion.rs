//! Markdown and JSON of new flows when SNAT ports run out.

use std::fmt::Write as _;

use super::cell;
use crate::{datapath::NEW_FLOWS_PER_ROUND, exhaustion::Row};

pub(crate) fn render(md: &mut String, r: &Row) {
    let per = |n: u64| n as f64 / r.full_flows.max(1) as f64;
    writeln!(md, "\n## New flows when SNAT ports run out (`xdp_ingress`)\n").unwrap();
    writeln!(
        md,
        "ns per new flow above the floor, BPF_PROG_TEST_RUN single runs (min–max over {} rounds of {} flows each). \
         Two masqueraded NodePorts: *ordinary* has 8 backends whose SNAT ports stay mostly free; *ports exhausted* \
         has one backend whose {} SNAT ports were first all taken by {} unanswered SYNs from distinct clients. The \
         runs alternate floor, exhausted, ordinary, each a new client port. An exhausted flow tries its hashed port \
         and up to 8 fallback ports, then (per CPU and backend, for 100 ms) its hashed port alone, and is dropped \
         (`drop_snat_exhausted`): the client sees its SYN go unanswered and retransmits, as when netfilter's \
         masquerade finds no free port.\n",
        r.rounds, NEW_FLOWS_PER_ROUND, r.ports, r.fill_flows
    )
    .unwrap();
    writeln!(md, "| new flow | mean | median | median vs ordinary |").unwrap();
    writeln!(md, "|---|---:|---:|---:|").unwrap();
    writeln!(
        md,
        "| ordinary (a free hashed port, mostly) | {} | {} | 1.00× |",
        cell(r.ordinary_mean),
        cell(r.ordinary_median)
    )
    .unwrap();
    writeln!(
        md,
        "| ports exhausted | {} | {} | {:.2}× ({:.2}–{:.2}) |",
        cell(r.full_mean),
        cell(r.full_median),
        r.ratio.median,
        r.ratio.min,
        r.ratio.max
    )
    .unwrap();
    writeln!(
        md,
        "\nOf the {} exhausted flows: {:.3} dropped as `drop_snat_exhausted` each, {:.2} ports found busy each \
         (`snat_ports_busy`), {:.3} in backoff each (`snat_backoff`). Drops among the ordinary flows: {}.",
        r.full_flows,
        per(r.exhausted_drops),
        per(r.ports_busy),
        per(r.backoff),
        r.ordinary_drops
    )
    .unwrap();
}

pub(crate) fn json(r: &Row) -> String {
    format!(
        ",\n\"snat_exhaustion\": {{\"ordinary_median_ns\": {:.1}, \"exhausted_median_ns\": {:.1}, \"ratio\": {:.3}, \
         \"ports_busy_per_flow\": {:.3}, \"exhausted_drops\": {}, \"flows\": {}}}",
        r.ordinary_median.median,
        r.full_median.median,
        r.ratio.median,
        r.ports_busy as f64 / r.full_flows.max(1) as f64,
        r.exhausted_drops,
        r.full_flows
    )
}
