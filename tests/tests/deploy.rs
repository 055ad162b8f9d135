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
    let k: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(deploy_dir().join("kustomization.yaml")).unwrap())
            .unwrap();
    let listed: Vec<&str> = k["resources"]
        .as_sequence()
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
    let ds: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(deploy_dir().join("daemonset.yaml")).unwrap()).unwrap();
    let container = &ds["spec"]["template"]["spec"]["containers"][0];
    let cm_docs: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(deploy_dir().join("configmap.yaml")).unwrap()).unwrap();
    let config = cm_docs["data"]["config.yaml"]
        .as_str()
        .expect("config.yaml in the ConfigMap");
    let config_file = std::env::temp_dir().join(format!("dpt-{}-configmap.yaml", std::process::id()));
    std::fs::write(&config_file, config).unwrap();
    let mut argv = vec!["dataplane-agent".to_owned()];
    for a in container["args"].as_sequence().unwrap() {
        let a = a.as_str().unwrap();
        // What the kubelet substitutes, and the ConfigMap's mount.
        let a = a
            .replace("$(NODE_NAME)", "node1")
            .replace("$(NODE_IP)", "10.0.0.21")
            .replace("/etc/dataplane/config.yaml", config_file.to_str().unwrap());
        argv.push(a);
    }
    let resolved = dataplane_agent::cli::resolve_run_args(&argv);
    let _ = std::fs::remove_file(&config_file);
    let cfg = resolved.unwrap_or_else(|e| panic!("the agent rejects the DaemonSet's {argv:?}: {e:#}"));
    assert_eq!(cfg.node_name, "node1");
    assert_eq!(cfg.k8s_api_server.as_deref(), Some("https://10.0.0.10:6443"));
    assert!(cfg.cluster_cidr.is_some() && !cfg.service_cidrs.is_empty());
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
    let volumes = ds["spec"]["template"]["spec"]["volumes"].as_sequence().unwrap();
    assert!(volumes.iter().any(|v| v["hostPath"]["path"] == "/sys/fs/bpf"));
    assert!(cfg.bpffs_dir.starts_with("/sys/fs/bpf"));
}
