//! deploy/ as users apply it: every manifest validates against the
//! Kubernetes schemas (kubernetes-validate, installed by `cargo xtask setup`),
//! and the DaemonSet's arguments and ConfigMap's settings are ones the agent
//! accepts (its own command-line parser and config file reader).

use std::path::{Path, PathBuf};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn manifests() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in [deploy_dir(), deploy_dir().join("examples")] {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            let is_yaml = p.extension().is_some_and(|x| x == "yaml");
            // kustomization.yaml is kustomize's, not a Kubernetes object.
            if is_yaml && p.file_name().is_some_and(|n| n != "kustomization.yaml") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_manifest_validates_against_the_kubernetes_schemas() {
    let files = manifests();
    assert!(files.len() >= 5, "{files:?}");
    let out = std::process::Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict", "-k", "1.34.0"])
        .args(&files)
        .output()
        .expect("python3 (run `cargo xtask setup`, which installs kubernetes-validate)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "kubernetes-validate failed (is it installed? `cargo xtask setup`):\n{text}"
    );
    assert!(
        text.matches("passed").count() >= 9,
        "every object was checked:\n{text}"
    );
}

#[test]
fn kustomization_lists_every_manifest() {
    let k: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(deploy_dir().join("kustomization.yaml")).unwrap())
            .unwrap();
    let listed: Vec<&str> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    for f in manifests()
        .iter()
        .filter(|p| p.parent() == Some(deploy_dir().as_path()))
    {
        let name = f.file_name().unwrap().to_str().unwrap();
        assert!(
            listed.contains(&name),
            "{name} is missing from kustomization.yaml"
        );
    }
}

#[test]
fn the_daemonset_runs_the_agent_with_arguments_and_settings_it_accepts() {
    let ds: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(deploy_dir().join("daemonset.yaml")).unwrap())
            .unwrap();
    let container = &ds["spec"]["template"]["spec"]["containers"][0];
    let cm_docs: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(deploy_dir().join("configmap.yaml")).unwrap())
            .unwrap();
    let config = cm_docs["data"]["config.yaml"]
        .as_str()
        .expect("config.yaml in the ConfigMap");
    let config_file = std::env::temp_dir().join(format!("dpt-{}-configmap.yaml", std::process::id()));
    std::fs::write(&config_file, config).unwrap();
    let mut argv = vec!["dataplane-agent".to_owned()];
    for a in container["args"].as_array().unwrap() {
        let a = a.as_str().unwrap();
        // What the kubelet substitutes, and the ConfigMap's mount.
        let a = a
            .replace("$(NODE_NAME)", "node1")
            .replace("$(NODE_IP)", "10.0.0.21,fd00::21")
            .replace("/etc/dataplane/config.yaml", config_file.to_str().unwrap());
        argv.push(a);
    }
    let resolved = dataplane_agent::cli::resolve_run_args(&argv);
    let _ = std::fs::remove_file(&config_file);
    let cfg = resolved.unwrap_or_else(|e| panic!("the agent rejects the DaemonSet's {argv:?}: {e:#}"));
    assert_eq!(cfg.node_name, "node1");
    assert_eq!(cfg.k8s_api_server.as_deref(), Some("https://10.0.0.10:6443"));
    assert!(!cfg.cluster_cidrs.is_empty() && !cfg.service_cidrs.is_empty());
    // The probes hit the health server's port and paths.
    let port = cfg.health_bind_address.rsplit(':').next().unwrap().to_owned();
    for (probe, path) in [("livenessProbe", "/livez"), ("readinessProbe", "/healthz")] {
        assert_eq!(container[probe]["httpGet"]["path"].as_str(), Some(path));
        assert_eq!(
            container[probe]["httpGet"]["port"]
                .as_u64()
                .map(|p| p.to_string()),
            Some(port.clone())
        );
    }
    // Pins must outlive the pod: bpffs comes from the host.
    let volumes = ds["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
    assert!(volumes.iter().any(|v| v["hostPath"]["path"] == "/sys/fs/bpf"));
    assert!(cfg.bpffs_dir.starts_with("/sys/fs/bpf"));
    // The ConfigMap turns the load balancers on, with their Leases in the
    // namespace RBAC lets the agent write them in.
    assert!(cfg.lb.ipam && cfg.lb.l2_announce);
    assert_eq!(cfg.lb.classes.class, dataplane_agent::lb::DEFAULT_CLASS);
    let rbac = std::fs::read_to_string(deploy_dir().join("rbac.yaml")).unwrap();
    assert!(rbac.contains(&format!("namespace: {}", cfg.lb.lease_namespace)));
}

/// Validates `docs` (JSON objects) against the openAPIV3Schema of the CRD
/// in `file` whose kind is `kind` with Python's jsonschema (installed with
/// kubernetes-validate); one verdict each.
fn validate_against_the_crd(file: &str, kind: &str, docs: &[serde_json::Value]) -> Vec<Result<(), String>> {
    const SCRIPT: &str = r#"
import json, sys, yaml, jsonschema
crd = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d["spec"]["names"]["kind"] == sys.argv[2])
schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
validator = jsonschema.Draft4Validator(schema)
for doc in json.load(sys.stdin):
    errors = sorted(e.message for e in validator.iter_errors(doc))
    print("PASS" if not errors else "FAIL " + "; ".join(errors))
"#;
    use std::io::Write as _;
    let mut child = std::process::Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(deploy_dir().join(file))
        .arg(kind)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 (run `cargo xtask setup`)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(docs).unwrap().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "jsonschema/PyYAML missing? (`cargo xtask setup` installs kubernetes-validate, which brings both):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| match l.strip_prefix("FAIL ") {
            Some(why) => Err(why.to_owned()),
            None => Ok(()),
        })
        .collect()
}

#[test]
fn pools_validate_against_the_crd_schema_and_the_agent_reads_them() {
    use dataplane_agent::lb::{
        crd::{Block, LoadBalancerIPPool, PoolSpec, PoolStatus},
        pool::Pool,
    };
    // The examples' pools: valid for the API server and for the agent.
    let mut pools = Vec::new();
    for f in manifests() {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in text.split("\n---\n") {
            let v: serde_json::Value = serde_saphyr::from_str(doc).unwrap_or(serde_json::Value::Null);
            if v["kind"] == "LoadBalancerIPPool" {
                pools.push(v);
            }
        }
    }
    assert!(pools.len() >= 2, "the examples hold pools");
    for p in &pools {
        let pool: LoadBalancerIPPool = serde_json::from_value(p.clone()).unwrap();
        let parsed = Pool::parse(&pool);
        assert!(
            parsed.problems.is_empty(),
            "{}: {:?}",
            pool.name(),
            parsed.problems
        );
        assert!(parsed.total() > 0);
    }
    // What the agent writes (status with conditions) is valid too.
    let mut written = LoadBalancerIPPool::new(
        "written",
        PoolSpec {
            blocks: vec![Block {
                cidr: Some("10.0.0.0/24".into()),
                ..Default::default()
            }],
            ..Default::default()
        },
    );
    let parsed = Pool::parse(&written);
    written.status = Some(dataplane_agent::lb::allocator::pool_status(
        &parsed,
        dataplane_agent::lb::pool::Usage {
            total: 254,
            used: 254,
        },
        None::<&PoolStatus>,
        Some(1),
    ));
    let mut docs = pools.clone();
    docs.push(serde_json::to_value(&written).unwrap());
    // And what must be refused is.
    let both = serde_json::json!({"apiVersion": "dataplane.example.com/v1alpha1", "kind": "LoadBalancerIPPool",
        "metadata": {"name": "both"}, "spec": {"blocks": [{"cidr": "10.0.0.0/24", "start": "10.0.0.1"}]}});
    let half = serde_json::json!({"apiVersion": "dataplane.example.com/v1alpha1", "kind": "LoadBalancerIPPool",
        "metadata": {"name": "half"}, "spec": {"blocks": [{"start": "10.0.0.1"}]}});
    let op = serde_json::json!({"apiVersion": "dataplane.example.com/v1alpha1", "kind": "LoadBalancerIPPool",
        "metadata": {"name": "op"}, "spec": {"blocks": [{"cidr": "10.0.0.0/24"}],
            "serviceSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}}});
    docs.extend([both, half, op]);
    let verdicts = validate_against_the_crd("crd-loadbalancerippool.yaml", "LoadBalancerIPPool", &docs);
    assert_eq!(verdicts.len(), docs.len());
    let n = docs.len();
    for (doc, v) in docs.iter().zip(&verdicts).take(n - 3) {
        assert!(v.is_ok(), "{}: {v:?}", doc["metadata"]["name"]);
    }
    for (doc, v) in docs.iter().zip(&verdicts).skip(n - 3) {
        assert!(v.is_err(), "{} must be refused", doc["metadata"]["name"]);
    }
}

#[test]
fn the_init_container_checks_what_the_agent_will_use() {
    let ds: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(deploy_dir().join("daemonset.yaml")).unwrap())
            .unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    let (init, agent) = (&pod["initContainers"][0], &pod["containers"][0]);
    assert_eq!(init["image"], agent["image"], "one image for both");
    let mut argv = vec!["dataplane-agent".to_owned()];
    for a in init["args"].as_array().unwrap() {
        argv.push(a.as_str().unwrap().replace("$(NODE_IP)", "10.0.0.21,fd00::21"));
    }
    let args = dataplane_agent::cli::parse_check_args(&argv)
        .unwrap_or_else(|e| panic!("check rejects the init container's {argv:?}: {e:#}"));
    // The same config file as the agent, so the same pin directory, cgroup
    // and devices are checked.
    let agent_config = agent["args"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|a| a.as_str()?.strip_prefix("--config="))
        .unwrap();
    assert_eq!(args.config.as_deref(), Some(std::path::Path::new(agent_config)));
    // The agent's security context (less NET_RAW, which only the agent's
    // ARP/NDP answers need) and the mounts the checks read.
    let without_net_raw = |c: &serde_json::Value| {
        let mut c = c["securityContext"].clone();
        c["capabilities"]["add"]
            .as_array_mut()
            .unwrap()
            .retain(|cap| cap != "NET_RAW");
        c
    };
    assert_eq!(init["securityContext"], without_net_raw(init));
    assert_eq!(without_net_raw(init), without_net_raw(agent));
    let mounts = |c: &serde_json::Value| -> Vec<String> {
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["mountPath"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(mounts(init), mounts(agent));
}

#[test]
fn bgp_objects_validate_against_the_crd_schemas_and_the_agent_reads_them() {
    use dataplane_agent::lb::{
        bgp::plan::{Advertisement, Peer},
        crd::{BgpAdvertisement, BgpPeer},
    };
    let docs: Vec<serde_json::Value> = manifests()
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            text.split("\n---\n")
                .map(|d| serde_saphyr::from_str::<serde_json::Value>(d).unwrap_or(serde_json::Value::Null))
                .collect::<Vec<_>>()
        })
        .collect();
    let peers: Vec<serde_json::Value> = docs.iter().filter(|d| d["kind"] == "BGPPeer").cloned().collect();
    let ads: Vec<serde_json::Value> = docs
        .iter()
        .filter(|d| d["kind"] == "BGPAdvertisement")
        .cloned()
        .collect();
    assert!(
        !peers.is_empty() && !ads.is_empty(),
        "the examples hold BGP objects"
    );
    for p in &peers {
        Peer::parse(&serde_json::from_value::<BgpPeer>(p.clone()).unwrap())
            .expect("the agent reads the example");
    }
    for a in &ads {
        Advertisement::parse(&serde_json::from_value::<BgpAdvertisement>(a.clone()).unwrap())
            .expect("the agent reads the example");
    }
    assert!(
        validate_against_the_crd("crd-bgp.yaml", "BGPPeer", &peers)
            .iter()
            .all(Result::is_ok)
    );
    assert!(
        validate_against_the_crd("crd-bgp.yaml", "BGPAdvertisement", &ads)
            .iter()
            .all(Result::is_ok)
    );
    // What the schema refuses before the agent sees it.
    let bad_peer = serde_json::json!({"apiVersion": "dataplane.example.com/v1alpha1", "kind": "BGPPeer",
        "metadata": {"name": "x"}, "spec": {"peerAddress": "192.0.2.1", "peerASN": 0, "myASN": 1,
        "password": "a\"b"}});
    let bad_ad = serde_json::json!({"apiVersion": "dataplane.example.com/v1alpha1", "kind": "BGPAdvertisement",
        "metadata": {"name": "x"}, "spec": {"communities": ["no-export"]}});
    let v = validate_against_the_crd("crd-bgp.yaml", "BGPPeer", &[bad_peer]);
    assert!(
        v[0].as_ref()
            .is_err_and(|e| e.contains("minimum") && e.contains("does not match")),
        "{v:?}"
    );
    let v = validate_against_the_crd("crd-bgp.yaml", "BGPAdvertisement", &[bad_ad]);
    assert!(v[0].is_err(), "{v:?}");
}
