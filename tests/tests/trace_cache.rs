//! `trace` keeps the programs it verified pinned in a cache directory
//! (bpffs), and the next trace reuses them: here in a private bpffs
//! directory of the test, removed on drop (also after a panic), never the
//! default one. A second trace must reuse the pins and answer as the first
//! did (the maps start empty again: a conntrack entry left by the first
//! would make the second see an established flow), a changed table must be
//! seen, another object's entry and an incomplete entry are replaced, and
//! `cleanup` removes the cache.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use dataplane_tests::{agent::ManifestDir, bpffs::BpffsDir};

const BIN: &str = env!("CARGO_BIN_EXE_agent");

/// One NodePort Service with one endpoint on another node: forwarded and
/// masqueraded (eTP=Cluster), the backend known in advance.
fn service(endpoints: &str) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec: {{type: NodePort, clusterIP: 10.96.0.10, ports: [{{name: http, port: 80, nodePort: 30080}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{endpoints}]
"
    )
}

struct Traced {
    json: serde_json::Value,
    stderr: String,
}

fn trace(manifests: &Path, cache: &[&str], from: &str, src: &str, dst: &str) -> Traced {
    let out = Command::new(BIN)
        .arg("trace")
        .arg("--manifests")
        .arg(manifests)
        .args(["--node-name", "node1", "--node-ip", "198.18.0.11"])
        .args([
            "--cluster-cidr",
            "10.244.0.0/16",
            "--service-cidr",
            "10.96.0.0/16",
        ])
        .args(["--from", from, "--src", src, "--dst", dst, "--proto", "tcp"])
        .args(["-o", "json", "--verbose"])
        .args(cache)
        .output()
        .expect("run trace");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "trace failed: {stderr}");
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("trace output: {e}: {}", String::from_utf8_lossy(&out.stdout)));
    Traced { json, stderr }
}

/// The answer without the SNAT port (a hash seeded at random per load).
fn answer(t: &Traced) -> serde_json::Value {
    let mut v = t.json.clone();
    let src = v["src"].as_str().expect("src").to_owned();
    let ip = src.rsplit_once(':').expect("IP:PORT").0.to_owned();
    v["src"] = ip.into();
    v
}

/// The pins under the cache's entries: `KEY/programs/PATH/NAME`,
/// `KEY/maps/NAME`.
fn pins(cache: &Path) -> Vec<String> {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = format!("{rel}{}", e.file_name().to_string_lossy());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&e.path(), &format!("{name}/"), out);
            } else {
                out.push(name);
            }
        }
    }
    let mut out = Vec::new();
    walk(cache, "", &mut out);
    out.sort();
    out
}

#[test]
fn a_second_trace_reuses_the_cached_programs_and_answers_the_same() {
    dataplane_tests::require_privileges();
    let prefix = dataplane_tests::unique_prefix();
    let bpffs = BpffsDir::new(&format!("{prefix}-trace-cache"));
    let cache: PathBuf = bpffs.path().join("cache");
    let cache_arg = ["--cache-dir", cache.to_str().expect("UTF-8 path")];
    let manifests = ManifestDir::new(&format!("{prefix}-trace-cache"));
    manifests.write(
        "web.yaml",
        &service("{addresses: [10.244.2.10], nodeName: node2}"),
    );
    let external = |m: &Path| trace(m, &cache_arg, "external", "203.0.113.7", "198.18.0.11:30080");

    // Another agent build's entry (another key): replaced.
    let stale = cache.join("0123456789abcdef");
    std::fs::create_dir_all(stale.join("programs")).expect("create a stale entry");

    let first = external(manifests.path());
    assert!(
        first
            .stderr
            .contains("loaded and verified xdp_ingress, tc_egress")
            && first.stderr.contains("pinned under"),
        "the first trace loads its two programs: {}",
        first.stderr
    );
    assert!(
        first.stderr.contains("removed") && !stale.exists(),
        "the other object's entry is removed: {}",
        first.stderr
    );
    assert_eq!(first.json["verdict"], "forward", "{}", first.json);
    assert_eq!(first.json["backend"], "10.244.2.10:8080");
    assert_eq!(first.json["snat"], true);
    assert_eq!(first.json["service"], "default/web:http");
    let pinned = pins(&cache);
    let key = pinned
        .first()
        .and_then(|p| p.split('/').next())
        .unwrap_or_else(|| panic!("nothing pinned under {}", cache.display()))
        .to_owned();
    for program in ["xdp_ingress", "tc_egress"] {
        assert!(
            pinned.contains(&format!("{key}/programs/external/{program}")),
            "{program} pinned: {pinned:?}"
        );
    }
    assert_eq!(
        pinned.iter().filter(|p| p.contains("/programs/")).count(),
        2,
        "only the programs the packet's path needs are verified: {pinned:?}"
    );
    assert!(pinned.contains(&format!("{key}/maps/CT4_V2")), "{pinned:?}");

    // The second trace: the same programs, reopened; the conntrack entry
    // and counters of the first are gone (else: an established flow).
    let second = external(manifests.path());
    assert!(
        second.stderr.contains("reused the verified programs") && !second.stderr.contains("verified xdp"),
        "the second trace reuses the pins: {}",
        second.stderr
    );
    assert_eq!(answer(&second), answer(&first), "the same answer from the cache");
    assert_eq!(pins(&cache), pinned, "nothing added");

    // The table is the one of this trace's manifests, not the last one's.
    manifests.write("web.yaml", &service(""));
    let empty = external(manifests.path());
    assert!(
        empty.stderr.contains("reused the verified programs"),
        "{}",
        empty.stderr
    );
    assert_eq!(
        empty.json["verdict"], "reject",
        "no endpoints any more: {}",
        empty.json
    );
    manifests.write(
        "web.yaml",
        &service("{addresses: [10.244.2.10], nodeName: node2}"),
    );

    // Another path adds its own programs to the entry (loaded together, as
    // the agent loads them), sharing its maps.
    let pod = trace(manifests.path(), &cache_arg, "pod", "10.244.1.5", "10.96.0.10:80");
    assert!(
        pod.stderr
            .contains("loaded and verified tc_pod_ingress, tc_egress in"),
        "the pod path's programs are verified: {}",
        pod.stderr
    );
    assert_eq!(pod.json["verdict"], "forward", "{}", pod.json);
    assert_eq!(pod.json["snat"], false);
    let with_pod = pins(&cache);
    assert!(
        with_pod.contains(&format!("{key}/programs/pod/tc_pod_ingress")),
        "{with_pod:?}"
    );
    assert_eq!(
        with_pod.iter().filter(|p| p.contains("/maps/")).count(),
        pinned.iter().filter(|p| p.contains("/maps/")).count(),
        "the maps are shared: {with_pod:?}"
    );
    let pod_again = trace(manifests.path(), &cache_arg, "pod", "10.244.1.5", "10.96.0.10:80");
    assert!(
        pod_again.stderr.contains("reused the verified programs"),
        "{}",
        pod_again.stderr
    );
    assert_eq!(answer(&pod_again), answer(&pod));

    // A path whose programs are only partly pinned (an interrupted load)
    // loads them all again.
    std::fs::remove_file(cache.join(&key).join("programs/pod/tc_egress")).expect("remove a program pin");
    let pod_reloaded = trace(manifests.path(), &cache_arg, "pod", "10.244.1.5", "10.96.0.10:80");
    assert!(
        pod_reloaded
            .stderr
            .contains("loaded and verified tc_pod_ingress, tc_egress in"),
        "{}",
        pod_reloaded.stderr
    );
    assert_eq!(answer(&pod_reloaded), answer(&pod));

    // An entry missing a map is rebuilt, not half used.
    std::fs::remove_file(cache.join(&key).join("maps").join("CT4_V2")).expect("remove a map pin");
    let rebuilt = external(manifests.path());
    assert!(
        rebuilt
            .stderr
            .contains("loaded and verified xdp_ingress, tc_egress"),
        "an incomplete entry is loaded afresh: {}",
        rebuilt.stderr
    );
    assert_eq!(answer(&rebuilt), answer(&first));

    // --no-cache leaves nothing, and answers the same.
    let elsewhere = bpffs.path().join("unused");
    let uncached = trace(
        manifests.path(),
        &["--no-cache", "--cache-dir", elsewhere.to_str().unwrap()],
        "external",
        "203.0.113.7",
        "198.18.0.11:30080",
    );
    assert!(uncached.stderr.contains("not used"), "{}", uncached.stderr);
    assert!(!elsewhere.exists(), "--no-cache created {}", elsewhere.display());
    assert_eq!(answer(&uncached), answer(&first));

    // `cleanup` removes the cache (an agent pin directory that does not
    // exist: only the cache is there to remove).
    let out = Command::new(BIN)
        .arg("cleanup")
        .arg("--bpffs-dir")
        .arg(bpffs.path().join("no-agent"))
        .arg("--trace-cache-dir")
        .arg(&cache)
        .output()
        .expect("run cleanup");
    assert!(
        out.status.success(),
        "cleanup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !cache.exists(),
        "the cache is gone after cleanup: {:?}",
        pins(&cache)
    );
}

#[test]
fn the_cache_is_refused_inside_an_agents_pin_directory() {
    dataplane_tests::require_privileges();
    let prefix = dataplane_tests::unique_prefix();
    let bpffs = BpffsDir::new(&format!("{prefix}-trace-cache-refused"));
    // Looks like an agent's pin directory (its maps/ and links/).
    let agent = bpffs.path().join("agent");
    std::fs::create_dir_all(agent.join("maps")).unwrap();
    std::fs::create_dir_all(agent.join("links")).unwrap();
    let cache = agent.join("trace");
    let manifests = ManifestDir::new(&format!("{prefix}-trace-cache-refused"));
    manifests.write(
        "web.yaml",
        &service("{addresses: [10.244.2.10], nodeName: node2}"),
    );
    let t = trace(
        manifests.path(),
        &["--cache-dir", cache.to_str().unwrap()],
        "external",
        "203.0.113.7",
        "198.18.0.11:30080",
    );
    assert!(
        t.stderr.contains("inside an agent's pin directory") && t.stderr.contains("not used"),
        "warned, traced without the cache: {}",
        t.stderr
    );
    assert_eq!(t.json["verdict"], "forward", "{}", t.json);
    assert!(!cache.exists(), "nothing created among the agent's pins");
}

/// The cached copy's services maps are smaller than the agent's (it stays
/// in kernel memory): a table that does not fit (one Service of 4096
/// endpoints on 18 frontends: over 70,000 entries) is traced on a full-size copy
/// loaded for that trace alone, with the same answer a fitting one gets.
#[test]
fn a_table_larger_than_the_cached_copy_is_traced_on_a_full_size_copy() {
    dataplane_tests::require_privileges();
    let prefix = dataplane_tests::unique_prefix();
    let bpffs = BpffsDir::new(&format!("{prefix}-trace-cache-large"));
    let cache = bpffs.path().join("cache");
    let endpoints: Vec<String> = (0..4096)
        .map(|i| {
            format!(
                "{{addresses: [10.244.{}.{}], nodeName: node2}}",
                i / 250,
                i % 250 + 1
            )
        })
        .collect();
    let external_ips: Vec<String> = (1..=16).map(|i| format!("198.51.100.{i}")).collect();
    let yaml = service(&endpoints.join(", ")).replace(
        "spec: {type: NodePort,",
        &format!(
            "spec: {{externalIPs: [{}], type: NodePort,",
            external_ips.join(", ")
        ),
    );
    let manifests = ManifestDir::new(&format!("{prefix}-trace-cache-large"));
    manifests.write("large.yaml", &yaml);
    let t = trace(
        manifests.path(),
        &["--cache-dir", cache.to_str().unwrap()],
        "external",
        "203.0.113.7",
        "198.51.100.16:80",
    );
    assert!(
        t.stderr.contains("tracing on a full-size copy") && t.stderr.contains("not used"),
        "{}",
        t.stderr
    );
    assert_eq!(t.json["verdict"], "forward", "{}", t.json);
    assert_eq!(t.json["service"], "default/web:http");
    let backend = t.json["backend"].as_str().expect("a backend");
    assert!(
        endpoints
            .iter()
            .any(|e| e.contains(&format!("[{}]", backend.trim_end_matches(":8080")))),
        "{backend} is one of the endpoints"
    );
}
