//! Markdown and JSON of the end-to-end rows (wrk and nginx, against kube-
//! proxy's rule sets), the sustained runs and the programs' own clocked cost.

use std::{fmt::Write as _, time::Duration};

use crate::{
    e2e::{CONNECTIONS, Cost, Mode, Row, Variant},
    stat::Stat,
};

pub(crate) fn render_costs(md: &mut String, costs: &[Cost]) {
    if costs.iter().all(|c| c.programs.is_empty()) {
        return;
    }
    let _ = writeln!(
        md,
        "\n### Our programs under this load\n\nOne more run of each case, with the kernel clocking every BPF program \
         run (`BPF_ENABLE_STATS`, which adds two clock reads per run, so these runs are not in the table above): runs \
         and ns per run of each program, and what that adds up to per request. `xdp_floor` is the harness's \
         pass-through XDP program on the switch side of the veth pairs, run in every variant, direct included, and \
         not counted as ours; it only parses and passes, so its ns per run here against the per-packet table's \
         floor shows what the clock reads add to every run.\n"
    );
    let _ = writeln!(
        md,
        "| services | variant | mode | program | runs per request | ns per run | ns per request |"
    );
    let _ = writeln!(md, "|---:|---|---|---|---:|---:|---:|");
    for c in costs {
        let mut total = 0.0;
        for (name, runs, ns) in &c.programs {
            let per_request = *ns as f64 / c.requests.max(1.0);
            if name != "xdp_floor" && name != "tc_floor" {
                total += per_request;
            }
            let _ = writeln!(
                md,
                "| {} | {} | {} | `{name}` | {:.2} | {:.0} | {per_request:.0} |",
                c.case.services,
                c.case.variant.name(),
                c.case.mode.name(),
                *runs as f64 / c.requests.max(1.0),
                *ns as f64 / (*runs).max(1) as f64,
            );
        }
        let _ = writeln!(
            md,
            "| {} | {} | {} | **ours, all** | | | **{total:.0}** over both CPUs (each CPU has {:.0} per request) |",
            c.case.services,
            c.case.variant.name(),
            c.case.mode.name(),
            1e9 / c.rate.max(1.0),
        );
    }
}

fn baseline<'a>(rows: &'a [Row], r: &Row) -> Option<&'a Row> {
    rows.iter().find(|b| {
        b.case.variant == r.case.variant.baseline()
            && b.case.mode == r.case.mode
            && b.case.variant != r.case.variant
    })
}

pub(crate) fn render(
    md: &mut String,
    rows: &[Row],
    sustained: &[Row],
    duration: Duration,
    sustained_duration: Duration,
    rounds: usize,
) {
    let _ = writeln!(md, "\n## End to end, against kube-proxy's rule sets\n");
    let _ = writeln!(
        md,
        "Client namespace → node1 (our programs, or kube-proxy's rules) → a pod on node1 over veth. Load: Debian's \
         `wrk -t1 -c{CONNECTIONS}` (epoll, {CONNECTIONS} connections in flight) pinned to CPU 0; `nginx` (event-driven, \
         one worker answering `200 ok`) in the server pod pinned to CPU 1. *New connections*: `Connection: close` (nginx \
         closes first; `tcp_max_tw_buckets=0` in the pods and the client, as for every masquerading benchmark); \
         *keep-alive*: 16 connections for the whole run. {:.0} s per run after a 1 s warm-up, a fresh sandbox per \
         run, median of {rounds} interleaved rounds (min–max). The measured ClusterIP has 2 endpoints among N \
         Services of 2 endpoints each; its two endpoints are two ports of that one nginx, so that every variant, the \
         direct baseline included, is served by the same single process (with two nginx processes taking turns on \
         CPU 1, keep-alive connections to the one descheduled waited a scheduler tick: p99 ≈ 4.5 ms instead of 0.2 ms, \
         and about 0.1 of the ratio). kube-proxy's rules have its shapes (nftables: the `service-ips` verdict map, \
         per-service chains, `numgen random`; iptables-legacy: KUBE-SERVICES → KUBE-SVC → KUBE-SEP, the measured \
         Service last). Our datapath runs its ingress path in TC on these veth devices (`--xdp-mode auto`) except \
         where the variant says native XDP (the switch side runs a pass-through XDP program so that XDP's frames \
         get through). *CPU*: each CPU's busy share during the run and the kernel's part of it (system + softirq + \
         irq); *drops*: our datapath's dropped packets (any reason) and SNAT exhaustion over all rounds.\n",
        duration.as_secs_f64()
    );
    let _ = writeln!(
        md,
        "| services | variant | mode | requests/s | vs baseline | p50 (µs) | p99 (µs) | CPU0 busy (kernel) | CPU1 busy (kernel) | errors | drops (SNAT exhausted) |"
    );
    let _ = writeln!(md, "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows.iter().chain(sustained) {
        let ratio = baseline(rows, r).map_or("—".to_owned(), |b| {
            format!("{:.2}×", r.rate.median / b.rate.median)
        });
        let cpu = |k: usize| {
            r.cpus.get(k).map_or("—".to_owned(), |(busy, kernel)| {
                format!("{:.0}% ({:.0}%)", busy * 100.0, kernel * 100.0)
            })
        };
        let drops = if r.case.variant.ours() {
            format!("{} ({})", r.drops, r.snat_exhausted)
        } else {
            "—".to_owned()
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.0} ({:.0}–{:.0}) | {ratio} | {:.0} | {:.0} | {} | {} | {} | {drops} |",
            r.case.services,
            r.case.variant.name(),
            r.case.mode.name(),
            r.rate.median,
            r.rate.min,
            r.rate.max,
            r.p50.median,
            r.p99.median,
            cpu(0),
            cpu(1),
            r.errors,
        );
    }
    let find = |v: Variant, mode: Mode| rows.iter().rfind(|r| r.case.variant == v && r.case.mode == mode);
    // A variant left out of this run (`--variants`) has no ratio.
    let ratio = |a: Option<&Row>, b: Option<&Row>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}×", a.rate.median / b.rate.median),
        _ => "not run".to_owned(),
    };
    let masq = find(Variant::Masqueraded, Mode::Close);
    let direct = find(Variant::Direct, Mode::Close);
    let _ = writeln!(
        md,
        "\nGoals at {} Services (issue 11): new connections ≥ 0.95× direct: **{}**; ≥ 1.3× kube-proxy nftables: \
         **{}**; non-service traffic ≥ 0.98× direct: **{}** (keep-alive: {}); keep-alive ≥ 0.98× direct: **{}**; \
         native XDP vs TC on veth for the same load: {}. With host routing (`--host-routing`): new connections \
         **{}** direct, **{}** nftables; keep-alive **{}** direct; pod → ClusterIP {} pod → pod.",
        masq.map_or(0, |r| r.case.services),
        ratio(masq, direct),
        ratio(masq, find(Variant::Nftables, Mode::Close)),
        ratio(find(Variant::NonService, Mode::Close), direct),
        ratio(
            find(Variant::NonService, Mode::KeepAlive),
            find(Variant::Direct, Mode::KeepAlive)
        ),
        ratio(
            find(Variant::Masqueraded, Mode::KeepAlive),
            find(Variant::Direct, Mode::KeepAlive)
        ),
        ratio(find(Variant::MasqueradedXdp, Mode::Close), masq),
        ratio(find(Variant::MasqueradedHostRouting, Mode::Close), direct),
        ratio(
            find(Variant::MasqueradedHostRouting, Mode::Close),
            find(Variant::Nftables, Mode::Close)
        ),
        ratio(
            find(Variant::MasqueradedHostRouting, Mode::KeepAlive),
            find(Variant::Direct, Mode::KeepAlive)
        ),
        ratio(
            find(Variant::PodClusterIpHostRouting, Mode::Close),
            find(Variant::PodDirect, Mode::Close)
        ),
    );
    if let (Some(d), Some(s)) = (direct, sustained.first()) {
        let (busy, kernel) = d.cpus.first().copied().unwrap_or_default();
        let (busy1, kernel1) = d.cpus.get(1).copied().unwrap_or_default();
        let _ = writeln!(
            md,
            "\nWhat bounds the direct baseline: CPU 0 (wrk, and the kernel path its packets take through the node) \
             is {:.0}% busy, {:.0}% of that in the kernel, and wrk's own user space takes {:.0}% of a CPU; CPU 1 \
             (nginx, and the replies' path) is {:.0}% busy, {:.0}% in the kernel, nginx's user space {:.0}%. \
             Sustained masquerading: {:.0} s of new connections through SNAT at {:.0}/s vs {:.0}/s without SNAT \
             ({:.2}×), {} SNAT exhaustion drops; new flows: {}.",
            busy * 100.0,
            kernel * 100.0,
            d.wrk_user * 100.0,
            busy1 * 100.0,
            kernel1 * 100.0,
            d.nginx_user * 100.0,
            sustained_duration.as_secs_f64(),
            s.rate.median,
            sustained.get(1).map_or(0.0, |n| n.rate.median),
            s.rate.median / sustained.get(1).map_or(f64::NAN, |n| n.rate.median),
            s.snat_exhausted,
            s.flows
                .iter()
                .map(|(k, n)| format!("{} {n}", k.name()))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

pub(crate) fn json(rows: &[Row], sustained: &[Row]) -> String {
    let st = |x: Stat| {
        format!(
            "{{\"median\":{:.1},\"min\":{:.1},\"max\":{:.1}}}",
            x.median, x.min, x.max
        )
    };
    let e: Vec<String> = rows
        .iter()
        .chain(sustained)
        .map(|r| {
            format!(
                "{{\"services\":{},\"variant\":{:?},\"mode\":{:?},\"requests_per_s\":{},\"p50_us\":{},\"p99_us\":{},\"errors\":{},\"drops\":{},\"snat_exhausted\":{}}}",
                r.case.services,
                r.case.variant.name(),
                r.case.mode.name(),
                st(r.rate),
                st(r.p50),
                st(r.p99),
                r.errors,
                r.drops,
                r.snat_exhausted
            )
        })
        .collect();
    format!(",\"end_to_end\":[{}]", e.join(","))
}
