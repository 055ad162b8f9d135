//! Markdown and JSON of per packet by protocol and address family.

use std::fmt::Write as _;

use super::cell;
use crate::{
    datapath::{NEW_FLOWS_PER_ROUND, REPEAT, ROUNDS},
    protocols::{ProtoRow, REPEAT_ROUNDS},
    stat::Stat,
};

pub(crate) fn render(md: &mut String, rows: &[ProtoRow]) {
    let _ = writeln!(
        md,
        "\n## Per packet by protocol and address family (`xdp_ingress`)\n"
    );
    let _ = writeln!(
        md,
        "ns per packet minus the floor (min–max); ratios against the first row of the same run. *Established, \
         repeat {REPEAT}*: a NodePort whose endpoint is the node's own address and port (identity DNAT: every \
         lookup, checksum sum and store runs, the values stay), the kernel's average over {REPEAT} runs minus the \
         floor's the same way; {REPEAT_ROUNDS} rounds, each variant right after the baseline; the ratio is the median \
         of the per-round ratios (min–max), which cancels the machine's drift between rounds. An SCTP port that does not change needs no CRC32c update, \
         so for SCTP the translated column is the one to read. *Translated*: one NodePort (eTP=Cluster: DNAT with \
         port translation and masquerade), single runs alternated with the floor ({NEW_FLOWS_PER_ROUND} per round, \
         established packets and new flows in separate loops; means without the stalled runs, as above), since a translated packet cannot be rerun on the program's own \
         output; median of {ROUNDS} rounds. A single run's fixed cost (≈100 ns) varies from run to run more than \
         these paths differ.\n"
    );
    let _ = writeln!(
        md,
        "| variant | established, repeat {REPEAT} | ratio | established, translated | ratio | new flow | ratio |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|");
    let Some(base) = rows.first() else { return };
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.2}× | {} | {:.2}× |",
            r.name,
            cell(r.established_repeat),
            ratio_cell(r.repeat_ratio),
            cell(r.established),
            r.established.median / base.established.median,
            cell(r.new_flow),
            r.new_flow.median / base.new_flow.median,
        );
    }
    if let Some(v6) = rows.iter().find(|r| r.name == "TCP, IPv6") {
        let _ = writeln!(
            md,
            "\nIPv6 against IPv4 (TCP), established, repeated: {:.2}× (goal ≤ 1.2×); translated: {:.2}×; new flow: \
             {:.2}×. Where the difference goes (a `perf` profile of these runs): the kernel's hash of the 40-byte \
             conntrack key (16 bytes in IPv4) is about 60% of it, the program's own instructions (wider keys and \
             addresses to build, compare and store) about a third, the bucket walk and key compare the rest.",
            v6.repeat_ratio.median,
            v6.established.median / base.established.median,
            v6.new_flow.median / base.new_flow.median,
        );
    }
}

fn ratio_cell(s: Stat) -> String {
    format!("{:.2}× ({:.2}–{:.2})", s.median, s.min, s.max)
}

pub(crate) fn json(rows: &[ProtoRow]) -> String {
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"variant\":{:?},\"established_repeat_ns\":{:.1},\"established_repeat_ratio\":{:.3},\"established_ns\":{:.1},\"new_flow_ns\":{:.1}}}",
                r.name,
                r.established_repeat.median,
                r.repeat_ratio.median,
                r.established.median,
                r.new_flow.median
            )
        })
        .collect();
    format!(",\"protocols\":[{}]", rows.join(","))
}
