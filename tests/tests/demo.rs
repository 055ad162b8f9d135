//! `cargo xtask demo` is the README's first command: it must run green. The
//! demo binary is run here and its output checked.

#[test]
fn the_demo_runs_green() {
    dataplane_tests::require_privileges();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_demo"))
        .output()
        .expect("run the demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for expected in [
        "saw 10.244.1.11",        // ClusterIP from the tester pod: no SNAT
        "saw 198.18.0.11:",       // NodePort eTP=Cluster: SNAT to node1
        "web-a saw 198.18.0.100", // LB IP eTP=Local: the client's address
        "Connection refused",     // no endpoints: ICMP reject
        "LoadBalancer default/web-local:p",
        "done: sandbox removed",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    assert!(!text.contains("error:"), "{text}");
}
