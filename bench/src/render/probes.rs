//! Markdown and JSON of health-check probe latency.

use std::fmt::Write as _;

use crate::{
    probes::{INTERVAL, ProbeRow, SLOW_CLIENTS},
    stat::Stat,
};

pub(crate) fn render(md: &mut String, rows: &[ProbeRow], rounds: usize) {
    let _ = writeln!(md, "\n## Health-check probes under slow clients\n");
    let _ = writeln!(
        md,
        "The agent's healthCheckNodePort server (its HTTP stack, in a network namespace, over loopback) probed as a \
         load balancer does: a new connection, `GET /`, the whole answer; a probe every {} ms; µs from connect to \
         the answer's last byte. With {SLOW_CLIENTS} other clients connected for the whole round: half sent a \
         request line and then one header line a second (slowloris), half sent nothing. Each round's p50 and p99, \
         median of {rounds} interleaved rounds (min–max).\n",
        INTERVAL.as_millis()
    );
    let _ = writeln!(md, "| other clients | probes | p50 (µs) | p99 (µs) | max (µs) |");
    let _ = writeln!(md, "|---|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.0} |",
            r.variant,
            r.probes,
            super::cell(r.p50_us),
            super::cell(r.p99_us),
            r.max_us
        );
    }
    let _ = writeln!(
        md,
        "\nThe goal is every probe answered within 100 ms whatever other clients do; the previous server (one \
         connection at a time) left probes unanswered for as long as one slow client kept sending."
    );
}

pub(crate) fn json(rows: &[ProbeRow]) -> String {
    let st = |x: Stat| {
        format!(
            "{{\"median\":{:.1},\"min\":{:.1},\"max\":{:.1}}}",
            x.median, x.min, x.max
        )
    };
    let r: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"variant\":{:?},\"probes\":{},\"p50_us\":{},\"p99_us\":{},\"max_us\":{:.0}}}",
                r.variant,
                r.probes,
                st(r.p50_us),
                st(r.p99_us),
                r.max_us
            )
        })
        .collect();
    format!(",\"health_probes\":[{}]", r.join(","))
}
