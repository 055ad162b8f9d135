//! The conformance suite: scenario files under tests/conformance/ (objects,
//! node settings, flows with the expected verdict, allowed backends and
//! SNAT), each flow run through `dataplane-agent trace` (the real programs),
//! each scenario naming the kube-proxy rule it checks.

use std::{collections::BTreeMap, path::PathBuf, process::Command};

use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    rule: String,
    #[serde(default)]
    node: Node,
    objects: String,
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
    let mut failures = Vec::new();
    let mut flows = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let s: Scenario = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let objects = std::env::temp_dir().join(format!(
            "dpt-{}-conformance-{}",
            std::process::id(),
            file.file_name().unwrap().to_string_lossy()
        ));
        std::fs::write(&objects, &s.objects).unwrap();
        for f in &s.flows {
            flows += 1;
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_agent"));
            cmd.arg("trace")
                .arg("--manifests")
                .arg(&objects)
                .args(["--node-name", &s.node.name, "--node-ip", &s.node.ips.join(",")])
                .args([
                    "--cluster-cidr",
                    &s.node.cluster_cidr,
                    "--service-cidr",
                    &s.node.service_cidr,
                ])
                .args(["--node-port-addresses", &s.node.node_port_addresses])
                .args([
                    "--from", &f.from, "--src", &f.src, "--dst", &f.dst, "--proto", &f.proto, "-o", "json",
                ]);
            if s.node.masquerade_all {
                cmd.arg("--masquerade-all");
            }
            let out = cmd.output().expect("run trace");
            let label = format!(
                "{} [{}] {}",
                file.file_name().unwrap().to_string_lossy(),
                s.rule,
                f.name
            );
            if !out.status.success() {
                failures.push(format!(
                    "{label}: trace failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
                continue;
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
            if !problems.is_empty() {
                failures.push(format!(
                    "{label}: {} — reason: {}",
                    problems.join(", "),
                    got["reason"]
                ));
            }
        }
        let _ = std::fs::remove_file(&objects);
    }
    assert!(
        failures.is_empty(),
        "{} of {flows} flows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!("conformance: {} scenarios, {flows} flows", files.len());
}
