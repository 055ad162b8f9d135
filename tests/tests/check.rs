//! `dataplane-agent check` on a node namespace with planted problems:
//! kube-proxy's leftovers (iptables-legacy and iptables-nft KUBE-* chains,
//! an nftables `ip kube-proxy` table) and a foreign XDP program on the
//! node's device. Each is named in one finding with its cleanup command;
//! only blockers fail the check.

use std::process::Output;

use dataplane_tests::{
    bpffs::BpffsDir,
    cgroup::{CgroupDir, MountPoint, cgroup2_root, mount_cgroup2_command, system_mount_script},
    cluster::pass_through_xdp,
    netns::NetNs,
    unique_prefix,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_agent");

/// A node: a namespace with `eth0` (a veth) holding 198.18.0.11/24, its
/// pin directory, and its own cgroup (given as a node's agent is given it;
/// `check` runs as the agent does, `NetNs::node_command`).
struct Node {
    ns: NetNs,
    pins: BpffsDir,
    cgroup: CgroupDir,
}

fn node() -> Node {
    dataplane_tests::require_privileges();
    let prefix = unique_prefix();
    let ns = NetNs::new(&format!("{prefix}-chk"));
    ns.ip_batch(
        "link add eth0 type veth peer name peer0\n\
         addr add 198.18.0.11/24 dev eth0\n\
         link set eth0 up\nlink set peer0 up\n",
    );
    Node {
        ns,
        pins: BpffsDir::new(&prefix),
        cgroup: CgroupDir::new(&format!("{prefix}-chk.slice")),
    }
}

/// `check` on `node` with `extra` arguments: the exit status and the
/// `-o json` report.
fn check(node: &Node, extra: &[&str]) -> (Output, Value) {
    let out = check_command(node)
        .args(["-o", "json"])
        .args(extra)
        .output()
        .expect("run check");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("check -o json: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    (out, v)
}

fn check_command(node: &Node) -> std::process::Command {
    check_command_with_pins(node, node.pins.path())
}

fn check_command_with_pins(node: &Node, pins: &std::path::Path) -> std::process::Command {
    let mut cmd = node.ns.node_command(BIN);
    cmd.arg("check")
        .arg("--bpffs-dir")
        .arg(pins)
        .arg("--cgroup-path")
        .arg(node.cgroup.path())
        .args(["--node-ip", "198.18.0.11"]);
    cmd
}

fn findings<'a>(v: &'a Value, subject: &str, severity: &str) -> Vec<&'a Value> {
    v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["subject"] == subject && f["severity"] == severity)
        .collect()
}

fn run_in(ns: &NetNs, program: &str, args: &[&str]) {
    let out = ns.command(program).args(args).output().expect(program);
    assert!(
        out.status.success(),
        "{program} {args:?} (installed by `cargo xtask setup`): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_clean_node_passes_and_every_check_is_reported() {
    let node = node();
    let ns = &node.ns;
    // A routed CNI's pod, host end named like no CNI's.
    ns.ip_batch(
        "link add pod3f2a1 type veth peer name podpeer\n\
         link set pod3f2a1 up\n\
         route add 10.244.1.10/32 dev pod3f2a1 scope link\n",
    );
    let (out, v) = check(&node, &[]);
    assert!(out.status.success(), "{v}");
    assert_eq!(v["blockers"], 0, "{v}");
    for subject in [
        "kernel",
        "btf",
        "datapath",
        "bpffs",
        "cgroup",
        "eth0",
        "kube-proxy",
    ] {
        assert_eq!(findings(&v, subject, "ok").len(), 1, "{subject}: {v}");
    }
    let eth0 = findings(&v, "eth0", "ok")[0]["message"].as_str().unwrap();
    assert!(
        eth0.contains("driver veth") && eth0.contains("runs in TC"),
        "a veth device, read without attaching anything: {eth0}"
    );
    let pods = findings(&v, "pods", "info");
    assert_eq!(
        pods[0]["message"],
        "pod interfaces: 1 found without configuration (1 with a route to their pod, 0 bridge ports)",
        "{v}"
    );
    // Nothing was attached to find that out.
    let link = ns.run(|| {
        dataplane_agent::os::interfaces::links()
            .unwrap()
            .into_iter()
            .find(|l| l.name == "eth0")
            .unwrap()
    });
    assert_eq!(link.xdp, None);
}

/// Without `--cgroup-path`, `check` reports the mount `run` would attach
/// at: the system's, not a stray cgroup2 mount listed before it in
/// /proc/mounts (as a test harness's leftover under /run or /tmp would be).
/// Both mounts exist only in `check`'s private mount namespace, and `check`
/// only queries the cgroup (BPF_PROG_QUERY): nothing is attached.
#[test]
fn without_a_cgroup_path_the_system_mount_is_reported_not_a_stray_one() {
    let node = node();
    let stray = MountPoint::new(node.ns.name(), "stray-cgroup2");
    let script = format!(
        "{}\n{}",
        mount_cgroup2_command(stray.path()),
        system_mount_script()
    );
    let out = node
        .ns
        .command_after(&script, BIN)
        .arg("check")
        .arg("--bpffs-dir")
        .arg(node.pins.path())
        .args(["--node-ip", "198.18.0.11", "-o", "json"])
        .output()
        .expect("run check");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("check -o json: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    let ok = findings(&v, "cgroup", "ok");
    assert_eq!(ok.len(), 1, "{v}");
    let message = ok[0]["message"].as_str().unwrap();
    let root = cgroup2_root();
    assert!(
        message.starts_with(&format!(
            "cgroup v2 at {} (chosen: the system's cgroup v2 mount",
            root.display()
        )),
        "the system's mount, {}: {message}",
        root.display()
    );
    assert!(
        message.contains(&format!("passed over: {}", stray.path().display())),
        "the stray mount at {} is named: {message}",
        stray.path().display()
    );
}

#[test]
fn a_pod_interface_pattern_that_misses_pods_is_named() {
    let node = node();
    node.ns.ip_batch(
        "link add pod3f2a1 type veth peer name podpeer\n\
         link set pod3f2a1 up\n\
         route add 10.244.1.10/32 dev pod3f2a1 scope link\n\
         link add veth7 type veth peer name vethpeer\n\
         link set veth7 up\n\
         route add 10.244.1.11/32 dev veth7 scope link\n",
    );
    let (out, v) = check(&node, &["--pod-interfaces", "veth*"]);
    assert!(out.status.success(), "a warning, not a blocker: {v}");
    let warn = findings(&v, "pods", "warn");
    assert_eq!(warn.len(), 1, "{v}");
    let message = warn[0]["message"].as_str().unwrap();
    assert!(
        message.contains("misses pod interfaces: pod3f2a1 (route 10.244.1.10/32 leads through it)")
            && !message.contains("veth7"),
        "names the interface the pattern misses, and only it: {message}"
    );
    assert!(warn[0]["fix"].as_str().unwrap().contains("drop --pod-interfaces"));
    // Patterns that cover every pod interface: information only.
    let (_, v) = check(&node, &["--pod-interfaces", "veth*,pod3f2a*"]);
    assert!(findings(&v, "pods", "warn").is_empty(), "{v}");
    assert_eq!(findings(&v, "pods", "info").len(), 1, "{v}");
}

#[test]
fn kube_proxy_leftovers_are_named_with_their_cleanup_command() {
    let node = node();
    let ns = &node.ns;
    for (table, chain) in [
        ("nat", "KUBE-SERVICES"),
        ("nat", "KUBE-POSTROUTING"),
        ("filter", "KUBE-FIREWALL"),
    ] {
        run_in(ns, "iptables-legacy", &["-t", table, "-N", chain]);
    }
    run_in(
        ns,
        "iptables-legacy",
        &["-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES"],
    );
    run_in(ns, "iptables-nft", &["-t", "nat", "-N", "KUBE-MARK-MASQ"]);
    run_in(
        ns,
        "nft",
        &["add table ip kube-proxy; add chain ip kube-proxy services"],
    );

    let (out, v) = check(&node, &[]);
    assert!(out.status.success(), "leftovers warn, they do not block: {v}");
    let warns = findings(&v, "kube-proxy", "warn");
    let find = |needle: &str| {
        warns
            .iter()
            .find(|f| f["message"].as_str().unwrap().contains(needle))
            .unwrap_or_else(|| panic!("{needle} in {v}"))
    };
    let nat = find("iptables-legacy table nat has 2 KUBE-* chains");
    assert!(
        nat["message"].as_str().unwrap().contains("KUBE-SERVICES"),
        "{nat}"
    );
    assert!(
        nat["fix"]
            .as_str()
            .unwrap()
            .contains("iptables-legacy-save | grep -v KUBE | iptables-legacy-restore")
    );
    find("iptables-legacy table filter has 1 KUBE-* chains (KUBE-FIREWALL)");
    let nft = find("nftables table ip nat (iptables-nft) has 1 KUBE-* chains (KUBE-MARK-MASQ)");
    assert!(
        nft["fix"]
            .as_str()
            .unwrap()
            .contains("iptables-nft-save | grep -v KUBE | iptables-nft-restore")
    );
    let table = find("nftables table ip kube-proxy exists");
    assert!(
        table["fix"]
            .as_str()
            .unwrap()
            .contains("nft delete table ip kube-proxy")
    );
    assert!(findings(&v, "kube-proxy", "ok").is_empty());

    // The table output: one line per finding, the fix on it.
    let out = check_command(&node).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines().any(|l| l.starts_with("warn")
            && l.contains("nftables table ip kube-proxy exists")
            && l.contains("nft delete table ip kube-proxy")),
        "{text}"
    );
    assert!(
        text.lines().last().unwrap().ends_with("0 blockers, 4 warnings"),
        "{text}"
    );
}

#[test]
fn a_foreign_xdp_program_warns_and_blocks_native_mode() {
    let node = node();
    let ns = &node.ns;
    // Any program the agent does not attach is foreign: the benchmarks'
    // pass-through one, in generic mode on the veth.
    let _xdp = ns.run(|| pass_through_xdp(&["eth0"]));

    let (out, v) = check(&node, &[]);
    assert!(out.status.success(), "auto mode runs in TC on a veth: {v}");
    let warn = findings(&v, "eth0", "warn");
    assert_eq!(warn.len(), 1, "{v}");
    let message = warn[0]["message"].as_str().unwrap();
    assert!(
        message.contains("another XDP program (xdp_floor, id "),
        "{message}"
    );
    assert!(
        warn[0]["fix"]
            .as_str()
            .unwrap()
            .contains("ip link set dev eth0 xdp off")
    );

    let (out, v) = check(&node, &["--xdp-mode", "native"]);
    assert_eq!(out.status.code(), Some(1), "a blocker fails the check: {v}");
    assert!(v["blockers"].as_u64().unwrap() >= 1, "{v}");
    assert!(
        findings(&v, "eth0", "blocker")
            .iter()
            .any(|f| f["message"].as_str().unwrap().contains("xdp_floor")),
        "{v}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("blocker"));
}

#[test]
fn a_pin_directory_off_bpffs_blocks() {
    let node = node();
    let dir = std::env::temp_dir().join(format!("{}-not-bpffs", node.ns.name()));
    let out = check_command_with_pins(&node, &dir)
        .args(["-o", "json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{v}");
    let b = findings(&v, "bpffs", "blocker");
    assert_eq!(b.len(), 1, "{v}");
    assert!(
        b[0]["message"]
            .as_str()
            .unwrap()
            .contains("is not on a bpffs mount")
    );
}

/// Two copies of the datapath on one device (an agent run on another pin
/// directory, or its leftover): both translate the same packets. Named, with
/// the cleanup command, as a warning.
#[test]
fn a_second_copy_of_the_datapath_on_a_device_is_named() {
    use dataplane_agent::dataplane::{Datapath, LoadOptions, XdpMode};
    let node = node();
    let attach = || {
        node.ns.run(|| {
            let opts = LoadOptions {
                max_services: 16,
                max_backends: 16,
                max_service_entries: 64,
                ct_entries: 64,
                affinity_entries: 16,
                ipv6: false,
            };
            let mut dp = Datapath::load_with(&opts).expect("load the datapath");
            dp.attach_external("eth0", XdpMode::Off).expect("attach to eth0");
            dp
        })
    };
    let _first = attach();
    let (out, v) = check(&node, &[]);
    assert!(out.status.success(), "{v}");
    assert!(findings(&v, "eth0", "warn").is_empty(), "one copy is fine: {v}");

    let _second = attach();
    let (out, v) = check(&node, &[]);
    assert!(out.status.success(), "a warning, not a blocker: {v}");
    let warn = findings(&v, "eth0", "warn");
    assert_eq!(warn.len(), 2, "ingress and egress: {v}");
    for w in warn {
        let message = w["message"].as_str().unwrap();
        assert!(message.contains("2 copies of the datapath"), "{message}");
        assert!(
            w["fix"].as_str().unwrap().contains("dataplane-agent cleanup"),
            "{w}"
        );
    }
}

/// A node IP no device holds would be a SNAT address whose replies never
/// come back: named.
#[test]
fn a_node_ip_no_device_holds_is_named() {
    let node = node();
    let (out, v) = check(&node, &["--node-ip", "203.0.113.1"]);
    assert!(out.status.success(), "a warning, not a blocker: {v}");
    let warn = findings(&v, "node-ip", "warn");
    assert_eq!(warn.len(), 1, "{v}");
    assert!(
        warn[0]["message"].as_str().unwrap().contains("203.0.113.1"),
        "{v}"
    );
}
