//! The Grafana dashboard (`deploy/grafana/dataplane-dashboard.json`) asks only
//! for what the agent exports: every metric its queries (and its `node`
//! variable) name has a `# TYPE` line in a running agent's `/metrics` after
//! traffic (a histogram's `_bucket`, `_sum` and `_count` count as its own),
//! and has samples there unless it is one of the few families only an
//! LB-IPAM leader fills; every label a selector or a `by (...)` names is one
//! the family carries; every value a matcher asks for (each alternative of a
//! regex) is one the scrape shows, or, for `event` and `hook`, one the
//! datapath can count (`dataplane_common::stats`); every function is
//! PromQL's. The dashboard itself: importable (schema, the `datasource` and
//! `node` variables, every panel on `${datasource}`), and its kustomization
//! generates the sidecar's ConfigMap from it.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddrV4,
    path::{Path, PathBuf},
    time::Duration,
};

use dataplane_common::stats::{Event, FlowStat, Hook};
use dataplane_tests::{
    agent::{AgentProcess, METRICS_PORT, ManifestDir, ManifestEndpoint as Ep, service_yaml},
    cluster::Cluster,
    echo::{EchoServer, tcp_request},
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_agent");

fn grafana_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana")
}

fn dashboard() -> Value {
    let path = grafana_dir().join("dataplane-dashboard.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every query of the dashboard: each `expr` anywhere in it, and the
/// metric selector of each `label_values(SELECTOR, LABEL)` variable.
fn queries(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(o) => {
            for (k, v) in o {
                match (k.as_str(), v) {
                    ("expr", Value::String(s)) => out.push(s.clone()),
                    ("definition", Value::String(s)) => {
                        if let Some(inner) = s.strip_prefix("label_values(").and_then(|s| s.strip_suffix(')'))
                        {
                            let selector = inner.rsplit_once(',').map_or(inner, |(sel, _)| sel);
                            out.push(selector.trim().to_owned());
                        } else if !s.is_empty() {
                            panic!("a variable query this test does not read: {s}");
                        }
                    }
                    _ => queries(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

/// A metric selector: its name and (label, operator, value) matchers.
#[derive(Debug, PartialEq)]
struct Selector {
    metric: String,
    matchers: Vec<(String, String, String)>,
}

/// What a PromQL expression names.
#[derive(Debug, Default, PartialEq)]
struct Query {
    selectors: Vec<Selector>,
    /// Labels of `by`, `without`, `on` and `ignoring` clauses.
    grouping: Vec<String>,
    functions: Vec<String>,
}

const KEYWORDS: [&str; 5] = ["bool", "and", "or", "unless", "offset"];
const GROUPING: [&str; 6] = ["by", "without", "on", "ignoring", "group_left", "group_right"];
/// PromQL's aggregations and functions.
const FUNCTIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "abs",
    "absent",
    "absent_over_time",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "day_of_month",
    "day_of_week",
    "day_of_year",
    "days_in_month",
    "delta",
    "deriv",
    "exp",
    "floor",
    "histogram_quantile",
    "histogram_count",
    "histogram_sum",
    "histogram_avg",
    "histogram_fraction",
    "holt_winters",
    "hour",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "ln",
    "log2",
    "log10",
    "minute",
    "month",
    "predict_linear",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sort",
    "sort_desc",
    "sqrt",
    "time",
    "timestamp",
    "vector",
    "year",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
    "sum_over_time",
    "count_over_time",
    "quantile_over_time",
    "stddev_over_time",
    "stdvar_over_time",
    "last_over_time",
    "present_over_time",
];

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Reads a quoted string starting at `chars[*i]` (the quote); returns its
/// content (escapes resolved) and leaves `i` after the closing quote.
fn string(chars: &[char], i: &mut usize) -> String {
    let quote = chars[*i];
    *i += 1;
    let mut s = String::new();
    while *i < chars.len() && chars[*i] != quote {
        if chars[*i] == '\\' && *i + 1 < chars.len() {
            *i += 1;
        }
        s.push(chars[*i]);
        *i += 1;
    }
    *i += 1;
    s
}

fn skip_space(chars: &[char], i: &mut usize) {
    while *i < chars.len() && chars[*i].is_whitespace() {
        *i += 1;
    }
}

fn ident(chars: &[char], i: &mut usize) -> String {
    let start = *i;
    while *i < chars.len() && is_ident(chars[*i]) {
        *i += 1;
    }
    chars[start..*i].iter().collect()
}

/// What `expr` names: a small PromQL scanner (strings, durations, numbers
/// and Grafana's `$variables` are skipped).
fn parse(expr: &str) -> Query {
    let chars: Vec<char> = expr.chars().collect();
    let mut q = Query::default();
    let mut i = 0;
    // Whether the last token was a metric name (a `{` then belongs to it).
    let mut after_metric = false;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if c == '"' || c == '\'' || c == '`' {
            string(&chars, &mut i);
        } else if c == '[' {
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
            continue; // `metric[5m]`: still the metric's (no `{` follows)
        } else if c == '$' {
            i += 1;
            if chars.get(i) == Some(&'{') {
                while i < chars.len() && chars[i] != '}' {
                    i += 1;
                }
                i += 1;
            } else {
                ident(&chars, &mut i);
            }
        } else if c == '{' {
            i += 1;
            let mut matchers = Vec::new();
            loop {
                skip_space(&chars, &mut i);
                match chars.get(i) {
                    None => panic!("unclosed selector in {expr}"),
                    Some('}') => break,
                    Some(',') => i += 1,
                    Some(&c) if is_ident_start(c) => {
                        let label = ident(&chars, &mut i);
                        skip_space(&chars, &mut i);
                        let op: String = chars[i..]
                            .iter()
                            .take_while(|c| matches!(c, '=' | '!' | '~'))
                            .collect();
                        i += op.len();
                        skip_space(&chars, &mut i);
                        assert!(
                            matches!(chars.get(i), Some('"' | '\'' | '`')),
                            "matcher without a value in {expr}"
                        );
                        let value = string(&chars, &mut i);
                        matchers.push((label, op, value));
                    }
                    Some(c) => panic!("unexpected {c:?} in a selector of {expr}"),
                }
            }
            i += 1;
            match q.selectors.last_mut() {
                Some(s) if after_metric => s.matchers.extend(matchers),
                _ => panic!("a selector without a metric name in {expr}"),
            }
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (is_ident(chars[i]) || chars[i] == '.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let name = ident(&chars, &mut i);
            let mut j = i;
            skip_space(&chars, &mut j);
            // `sum by (l) (...)`: an aggregation whose clause comes first.
            let rest: String = chars[j..].iter().take(8).collect();
            let clause_first = ["by", "without"]
                .iter()
                .any(|k| rest.strip_prefix(k).is_some_and(|r| r.starts_with([' ', '('])));
            let call = chars.get(j) == Some(&'(') || clause_first;
            if GROUPING.contains(&name.as_str()) {
                if call {
                    let close = chars[j..].iter().position(|&c| c == ')').unwrap() + j;
                    let labels: String = chars[j + 1..close].iter().collect();
                    q.grouping.extend(
                        labels
                            .split(',')
                            .map(|l| l.trim().to_owned())
                            .filter(|l| !l.is_empty()),
                    );
                    i = close + 1;
                }
            } else if call {
                q.functions.push(name);
            } else if !KEYWORDS.contains(&name.as_str()) {
                q.selectors.push(Selector {
                    metric: name,
                    matchers: Vec::new(),
                });
                after_metric = true;
                continue;
            }
        } else {
            i += 1;
        }
        after_metric = false;
    }
    q
}

/// A scrape: family (its `# TYPE` name) → type, and sample name → label →
/// values seen.
#[derive(Default)]
struct Scrape {
    types: BTreeMap<String, String>,
    samples: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
}

fn read_scrape(text: &str) -> Scrape {
    let mut s = Scrape::default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            s.types.insert(name.to_owned(), kind.to_owned());
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let chars: Vec<char> = line.chars().collect();
            let mut i = 0;
            let name = ident(&chars, &mut i);
            let labels = s.samples.entry(name).or_default();
            if chars.get(i) == Some(&'{') {
                i += 1;
                while chars.get(i) != Some(&'}') {
                    if chars[i] == ',' {
                        i += 1;
                        continue;
                    }
                    let label = ident(&chars, &mut i);
                    assert_eq!(chars[i], '=', "{line}");
                    i += 1;
                    let value = string(&chars, &mut i);
                    labels.entry(label).or_default().insert(value);
                }
            }
        }
    }
    s
}

/// Families the agent fills only under conditions this test does not make:
/// pools and Services are the LB-IPAM leader's view (their `# TYPE` lines
/// are still checked).
const CONDITIONAL: [&str; 2] = ["dataplane_lb_pool_addresses", "dataplane_lb_services"];

/// Labels Prometheus adds to every series of a target.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

/// Values a label can take beyond what one scrape shows: the datapath's
/// outcomes and flow events happen only when their packets do.
fn known_values(metric: &str, label: &str) -> Vec<&'static str> {
    match (metric, label) {
        ("dataplane_packets_total" | "dataplane_bytes_total", "event") => {
            Event::ALL.iter().map(|e| e.name()).collect()
        }
        ("dataplane_packets_total" | "dataplane_bytes_total", "hook") => {
            Hook::ALL.iter().map(|h| h.name()).collect()
        }
        ("dataplane_flow_events_total", "event") => FlowStat::ALL.iter().map(|s| s.name()).collect(),
        _ => Vec::new(),
    }
}

/// The top-level alternatives of a regex (`a|b(c|d)` → `a`, `b(c|d)`).
fn alternatives(re: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0);
    for c in re.chars() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            '|' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out
}

/// What the dashboard's queries ask for that `scrape` does not export.
fn problems(queries: &[String], scrape: &Scrape) -> Vec<String> {
    let mut out = Vec::new();
    for expr in queries {
        let q = parse(expr);
        if q.selectors.is_empty() {
            out.push(format!("no metric in {expr}"));
        }
        for f in &q.functions {
            if !FUNCTIONS.contains(&f.as_str()) {
                out.push(format!("{f}() is not a PromQL function, in {expr}"));
            }
        }
        let mut labels_of_query: BTreeSet<&str> = TARGET_LABELS.into();
        let mut unknown_labels = false;
        for sel in &q.selectors {
            let m = sel.metric.as_str();
            let histogram = ["_bucket", "_sum", "_count"].iter().any(|suffix| {
                m.strip_suffix(suffix)
                    .is_some_and(|base| scrape.types.get(base).is_some_and(|t| t == "histogram"))
            });
            if !histogram && !scrape.types.contains_key(m) {
                out.push(format!("{m} is not exported (no `# TYPE {m}`), in {expr}"));
                unknown_labels = true;
                continue;
            }
            if m.ends_with("_bucket") {
                labels_of_query.insert("le");
            }
            let Some(sample_labels) = scrape.samples.get(m) else {
                if CONDITIONAL.contains(&m) {
                    unknown_labels = true;
                } else {
                    out.push(format!("{m} has no sample after traffic, in {expr}"));
                }
                continue;
            };
            labels_of_query.extend(sample_labels.keys().map(String::as_str));
            for (label, op, value) in &sel.matchers {
                if TARGET_LABELS.contains(&label.as_str()) {
                    continue;
                }
                let Some(seen) = sample_labels.get(label) else {
                    out.push(format!("{m} has no label {label}, in {expr}"));
                    continue;
                };
                let mut values: BTreeSet<&str> = seen.iter().map(String::as_str).collect();
                values.extend(known_values(m, label));
                let patterns = match op.as_str() {
                    "=" | "!=" => vec![regex::escape(value)],
                    "=~" | "!~" => alternatives(value),
                    _ => {
                        out.push(format!("operator {op} in {expr}"));
                        continue;
                    }
                };
                for p in patterns {
                    let re = regex::Regex::new(&format!("^(?:{p})$"))
                        .unwrap_or_else(|e| panic!("{p} in {expr}: {e}"));
                    if !values.iter().any(|v| re.is_match(v)) {
                        out.push(format!(
                            "{label}{op}{p:?} matches no value of {m} ({values:?}), in {expr}"
                        ));
                    }
                }
            }
        }
        if !unknown_labels {
            for l in &q.grouping {
                if !labels_of_query.contains(l.as_str()) {
                    out.push(format!("no metric of {expr} has the label {l}"));
                }
            }
        }
    }
    out
}

#[test]
fn the_query_check_finds_unknown_metrics_labels_values_and_functions() {
    let scrape = read_scrape(
        "# TYPE a_seconds histogram\n\
         a_seconds_bucket{le=\"+Inf\"} 1\n\
         a_seconds_sum 1\n\
         a_seconds_count 1\n\
         # TYPE dataplane_flow_events_total counter\n\
         dataplane_flow_events_total{event=\"ct_inserted\"} 3\n\
         # TYPE m gauge\n\
         m{map=\"CT4_V2\",x=\"a\\\"b\"} 1\n",
    );
    let ok = [
        r#"histogram_quantile(0.99, sum by (le, instance) (rate(a_seconds_bucket{instance=~"$node"}[$__rate_interval])))"#,
        r#"sum(rate(a_seconds_sum[5m])) / sum(rate(a_seconds_count[5m]))"#,
        r#"sum by (event) (rate(dataplane_flow_events_total{event=~"ct_.*|snat_ports_busy"}[1m]))"#,
        r#"time() - max by (map) (m{map=~"CT[46]_V[0-9]+", x="a\"b"}) > bool 0.5"#,
    ];
    let ok: Vec<String> = ok.iter().map(|s| s.to_string()).collect();
    let mut tpl = Vec::new();
    queries(
        &serde_json::json!({"panels": [{"targets": [{"expr": ok[0]}]}],
                            "templating": {"list": [{"definition": "label_values(m{x=\"y\"}, instance)"}]}}),
        &mut tpl,
    );
    assert_eq!(tpl, [ok[0].clone(), "m{x=\"y\"}".to_owned()]);
    assert_eq!(problems(&ok, &scrape), Vec::<String>::new());
    for (bad, needle) in [
        ("rate(nope_total[5m])", "nope_total is not exported"),
        ("a_seconds_total", "a_seconds_total is not exported"),
        (
            "sum by (pool) (m)",
            "no metric of sum by (pool) (m) has the label pool",
        ),
        ("m{mapp=\"CT4_V2\"}", "m has no label mapp"),
        ("m{map=\"CT4_V3\"}", "map=\"CT4_V3\" matches no value"),
        (
            "dataplane_flow_events_total{event=~\"ct_.*|snat_port_busy\"}",
            "event=~\"snat_port_busy\" matches no value",
        ),
        ("rates(m[5m])", "rates() is not a PromQL function"),
    ] {
        let found = problems(&[bad.to_owned()], &scrape);
        assert!(found.iter().any(|p| p.contains(needle)), "{bad}: {found:?}");
    }
}

#[test]
fn the_dashboard_is_importable_and_its_kustomization_makes_the_sidecars_config_map() {
    let d = dashboard();
    assert!(
        d["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion"
    );
    assert!(d["uid"].is_string() && d["title"].is_string());
    let vars = d["templating"]["list"].as_array().unwrap();
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("${name}"))
    };
    assert_eq!(var("datasource")["type"], "datasource");
    assert_eq!(var("datasource")["query"], "prometheus");
    assert_eq!(var("node")["datasource"]["uid"], "${datasource}");
    let mut ids = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "duplicate panel id {}",
            p["id"]
        );
        if p["type"] == "row" {
            continue;
        }
        let title = p["title"].as_str().unwrap();
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
            let expr = t["expr"].as_str().unwrap();
            assert!(
                expr.contains("instance=~\"$node\""),
                "{title}: {expr} ignores $node"
            );
        }
    }
    let k: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(grafana_dir().join("kustomization.yaml")).unwrap())
            .unwrap();
    let generator = &k["configMapGenerator"][0];
    assert_eq!(generator["files"][0], "dataplane-dashboard.json");
    assert_eq!(generator["options"]["labels"]["grafana_dashboard"], "1");
}

/// A scrape of an agent that served a NodePort Service to a few clients
/// (with counters read after the traffic).
fn scrape_after_traffic() -> (String, String) {
    let mut cluster = Cluster::new();
    cluster.add_pod(0, "a");
    let pod = cluster.pod("a");
    let _server = EchoServer::tcp(&pod.ns, "a", SocketAddrV4::new(pod.ip, 8080));
    let manifests = ManifestDir::new(cluster.prefix());
    manifests.write(
        "web.yaml",
        &service_yaml(
            "web",
            "  type: NodePort\n  clusterIP: 10.96.0.10\n",
            80,
            Some(30080),
            8080,
            &[Ep::ready(pod.ip, "node1")],
        ),
    );
    let agent = cluster.start_agent(BIN, 0, &manifests, &[]);
    let node = &cluster.nodes[0];
    let dst = SocketAddrV4::new(node.ip(), 30080);
    for i in 0..5 {
        tcp_request(&cluster.client.ns, dst, "x")
            .unwrap_or_else(|e| panic!("request {i} to {dst}: {e}\n{}", agent.log_text()));
    }
    // The datapath's counters are read at most once a second, at a scrape.
    let metrics = || {
        let (status, body) =
            AgentProcess::http_get(node.ns(), SocketAddrV4::new(node.ip(), METRICS_PORT), "/metrics")
                .unwrap_or_else(|e| panic!("/metrics: {e}"));
        assert_eq!(status, 200, "{body}");
        body
    };
    let last = std::cell::RefCell::new(String::new());
    dataplane_tests::poll_until(
        Duration::from_secs(10),
        Duration::from_millis(250),
        "a per-Service counter after the traffic",
        || {
            let body = metrics();
            let counted = body
                .lines()
                .any(|l| l.starts_with("dataplane_service_packets_total{"));
            *last.borrow_mut() = body;
            counted
        },
        || format!("{}\n{}", last.borrow(), agent.log_text()),
    );
    (last.into_inner(), agent.log_text())
}

#[test]
fn the_dashboard_queries_only_metrics_a_running_agent_exports() {
    let mut qs = Vec::new();
    queries(&dashboard(), &mut qs);
    assert!(qs.len() > 40, "{} queries", qs.len());
    let (text, log) = scrape_after_traffic();
    let scrape = read_scrape(&text);
    let found = problems(&qs, &scrape);
    assert!(
        found.is_empty(),
        "the dashboard asks for what the agent does not export:\n{}\n\nscrape:\n{text}\n{}",
        found.join("\n"),
        log
    );
}
