//! The conformance suite: scenario files under tests/conformance/ (objects,
//! node settings, flows with the expected verdict, allowed backends and
//! SNAT), each flow run through `dataplane-agent trace` (the real programs),
//! each scenario naming the kube-proxy rule it checks.

use std::{collections::BTreeMap, path::PathBuf, process::Command};

use serde::Deserialize;

/// A scenario: objects, and flows through them on a node; or the same
/// objects on several nodes (`variants`: e.g. kube-proxy's masquerade
/// matrix with and without masqueradeAll, IPv4-only and dual-stack nodes),
/// each with its own flows.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    rule: String,
    #[serde(default)]
    node: Node,
    objects: String,
    #[serde(default)]
    flows: Vec<Flow>,
    #[serde(default)]
    variants: Vec<Variant>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Variant {
    name: String,
    #[serde(default)]
    node: Node,
    flows: Vec<Flow>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Node {
    #[serde(default = "node_name")]
    name: String,
    #[serde(default = "node_ips")]
    ips: Vec<String>,
    #[serde(default = "cluster_cidr")]
    cluster_cidr: String,
    #[serde(default = "service_cidr")]
    service_cidr: String,
    #[serde(default = "all")]
    node_port_addresses: String,
    #[serde(default)]
    masquerade_all: bool,
}

fn node_name() -> String {
    "node1".into()
}
fn node_ips() -> Vec<String> {
    vec!["198.18.0.11".into()]
}
fn cluster_cidr() -> String {
    "10.244.0.0/16".into()
}
fn service_cidr() -> String {
    "10.96.0.0/16".into()
}
fn all() -> String {
    "all".into()
}

impl Default for Node {
    fn default() -> Self {
        Self {
            name: node_name(),
            ips: node_ips(),
            cluster_cidr: cluster_cidr(),
            service_cidr: service_cidr(),
            node_port_addresses: all(),
            masquerade_all: false,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Flow {
    name: String,
    from: String,
    src: String,
    dst: String,
    #[serde(default = "tcp")]
    proto: String,
    verdict: String,
    /// The backend must be one of these (IP:PORT).
    #[serde(default)]
    backends: Vec<String>,
    snat: Option<bool>,
    service: Option<String>,
}

fn tcp() -> String {
    "tcp".into()
}

/// One flow of one scenario (and variant), ready to run.
struct Job<'a> {
    /// `file [rule] (variant)`.
    label: String,
    node: &'a Node,
    flow: &'a Flow,
    objects: PathBuf,
}

/// Runs one flow through `trace` (the programs from the suite's own cache
/// at `cache`); the problems found, if any.
fn check(job: &Job, cache: &std::path::Path) -> Option<String> {
    let (node, f) = (job.node, job.flow);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_agent"));
    cmd.arg("trace")
        .arg("--manifests")
        .arg(&job.objects)
        .args(["--node-name", &node.name, "--node-ip", &node.ips.join(",")])
        .args(["--service-cidr", &node.service_cidr])
        .args(["--node-port-addresses", &node.node_port_addresses])
        .args([
            "--from", &f.from, "--src", &f.src, "--dst", &f.dst, "--proto", &f.proto, "-o", "json",
        ])
        .arg("--cache-dir")
        .arg(cache);
    // No cluster CIDR: kube-proxy without a local traffic detector.
    if !node.cluster_cidr.is_empty() {
        cmd.args(["--cluster-cidr", &node.cluster_cidr]);
    }
    if node.masquerade_all {
        cmd.arg("--masquerade-all");
    }
    let out = cmd.output().expect("run trace");
    let label = format!("{} {}", job.label, f.name);
    if !out.status.success() {
        return Some(format!(
            "{label}: trace failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let got: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let mut problems = Vec::new();
    if got["verdict"] != f.verdict.as_str() {
        problems.push(format!("verdict {} (want {})", got["verdict"], f.verdict));
    }
    if !f.backends.is_empty() && !f.backends.iter().any(|b| got["backend"] == b.as_str()) {
        problems.push(format!(
            "backend {} (want one of {:?})",
            got["backend"], f.backends
        ));
    }
    if let Some(snat) = f.snat
        && got["snat"] != snat
    {
        problems.push(format!("snat {} (want {snat})", got["snat"]));
    }
    if let Some(svc) = &f.service
        && got["service"] != svc.as_str()
    {
        problems.push(format!("service {} (want {svc})", got["service"]));
    }
    (!problems.is_empty()).then(|| format!("{label}: {} — reason: {}", problems.join(", "), got["reason"]))
}

#[test]
fn conformance_scenarios() {
    dataplane_tests::require_privileges();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("conformance");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/conformance")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "the suite has {} scenarios", files.len());
    let scenarios: Vec<(String, Scenario, PathBuf)> = files
        .iter()
        .map(|file| {
            let text = std::fs::read_to_string(file).unwrap();
            let s: Scenario =
                serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let name = file.file_name().unwrap().to_string_lossy().into_owned();
            let objects = std::env::temp_dir().join(format!("dpt-{}-conformance-{name}", std::process::id()));
            std::fs::write(&objects, &s.objects).unwrap();
            (name, s, objects)
        })
        .collect();
    let mut jobs: Vec<Job> = Vec::new();
    for (file, s, objects) in &scenarios {
        let plain = (!s.flows.is_empty()).then_some((String::new(), &s.node, &s.flows));
        let variants = s
            .variants
            .iter()
            .map(|v| (format!(" ({})", v.name), &v.node, &v.flows));
        for (variant, node, flows) in plain.into_iter().chain(variants) {
            assert!(!flows.is_empty(), "{file}{variant}: no flows");
            jobs.extend(flows.iter().map(|flow| Job {
                label: format!("{file} [{}]{variant}", s.rule),
                node,
                flow,
                objects: objects.clone(),
            }));
        }
    }
    // The programs are verified once, by the first trace of each path, and
    // kept in a cache of the suite's own (removed on drop, also after a
    // panic); traces take turns on it.
    let bpffs =
        dataplane_tests::bpffs::BpffsDir::new(&format!("{}-conformance", dataplane_tests::unique_prefix()));
    let cache = bpffs.path().join("trace-cache");
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut failures: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut found = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(job) = jobs.get(i) else { break };
                        found.extend(check(job, &cache));
                    }
                    found
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    failures.sort();
    for (_, _, objects) in &scenarios {
        let _ = std::fs::remove_file(objects);
    }
    assert!(
        failures.is_empty(),
        "{} of {} flows failed:\n{}",
        failures.len(),
        jobs.len(),
        failures.join("\n")
    );
    eprintln!("conformance: {} scenarios, {} flows", scenarios.len(), jobs.len());
}
