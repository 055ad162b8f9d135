//! The agent's real image: `cargo xtask image` builds deploy/Containerfile
//! (FROM scratch, the static agent), and podman runs it on a sandbox node
//! exactly as the DaemonSet says: its init container (`check`) first, then
//! the agent, with the DaemonSet's capabilities and no others, read-only,
//! without privilege escalation, in the node's network namespace
//! (hostNetwork), with bpffs and the cgroup mounted where the DaemonSet
//! mounts them. It serves a Service end to end. Then the BGP sidecar's image
//! (BIRD 2) runs as the `deploy/bgp/` overlay says and a router learns a
//! prefix from it. The images and containers go on drop.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use dataplane_tests::{
    agent::{AgentProcess, HEALTH_PORT, ManifestDir, ManifestEndpoint as Ep, service_yaml},
    cluster::{CLUSTER_CIDR, Cluster, PodLayout, Wiring},
    echo::{EchoServer, tcp_request},
    services::SERVICE_CIDR,
};
use serde_json::Value;

const NODE_PORT: u16 = 30080;
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TARGET: u16 = 8080;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn podman(args: &[&str]) -> Output {
    Command::new("podman")
        .args(args)
        .output()
        .expect("podman (installed by `cargo xtask setup`)")
}

/// An image built by `cargo xtask image`, removed on drop.
struct Image(String);

impl Image {
    /// The agent's image and the BGP sidecar's (`cargo xtask image` prints
    /// both tags).
    fn build(tag: &str) -> (Self, Self) {
        // Owned before they exist: a failed build's leftovers go too.
        let image = Self(tag.to_owned());
        let (repo, version) = tag.rsplit_once(':').expect("REPO:VERSION");
        let bird = Self(format!("{repo}-bird:{version}"));
        let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["xtask", "image", "--tag", tag])
            .current_dir(root())
            .output()
            .expect("run cargo xtask image");
        assert!(
            out.status.success(),
            "cargo xtask image failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // podman's build steps, then the two tags.
        let stdout = String::from_utf8_lossy(&out.stdout);
        let tags: Vec<&str> = stdout.lines().rev().take(2).collect();
        assert_eq!(tags, [bird.0.as_str(), image.0.as_str()], "{stdout}");
        (image, bird)
    }

    fn size(&self) -> u64 {
        let out = podman(&["image", "inspect", "--format", "{{.Size}}", &self.0]);
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("image size")
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        podman(&["rmi", "--force", &self.0]);
    }
}

/// A running container, removed (SIGTERM, then SIGKILL after 5 s) on drop.
struct Container(String);

impl Container {
    /// `podman run --detach --name=NAME` with `args` (which hold them).
    fn run(name: String, args: &[String]) -> Self {
        let out = podman(&args.iter().map(String::as_str).collect::<Vec<_>>());
        // Owned from here: a half-started container goes too.
        let container = Self(name);
        assert!(
            out.status.success(),
            "podman run: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        container
    }

    fn logs(&self) -> String {
        let out = podman(&["logs", &self.0]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        podman(&["rm", "--force", "--time", "5", &self.0]);
    }
}

/// The soft limit of `resource`, at most `cap`: podman must not raise a
/// limit (no CAP_SYS_RESOURCE here), and runc sets them all.
fn limit(resource: libc::__rlimit_resource_t, cap: u64) -> u64 {
    // SAFETY: getrlimit fills the struct we own.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrlimit(resource, &mut r) }, 0);
    r.rlim_cur.min(cap)
}

/// `podman run` flags for a DaemonSet container (init or not): its
/// securityContext and its volumes, hostPaths mapped to the sandbox's.
fn run_flags(container: &Value, volumes: &Value, netns: &Path, host_paths: &[(&str, &Path)]) -> Vec<String> {
    let sc = &container["securityContext"];
    assert_eq!(sc["privileged"], false);
    let mut flags = vec![
        "--runtime=runc".to_owned(),
        format!("--network=ns:{}", netns.display()),
        format!("--ulimit=nofile={0}:{0}", limit(libc::RLIMIT_NOFILE, 4096)),
        format!("--ulimit=nproc={0}:{0}", limit(libc::RLIMIT_NPROC, 4096)),
    ];
    let caps = |k: &str| -> Vec<String> {
        sc["capabilities"][k]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(caps("drop"), ["ALL"]);
    flags.push("--cap-drop=ALL".into());
    for cap in caps("add") {
        flags.push(format!("--cap-add=CAP_{cap}"));
    }
    if sc["readOnlyRootFilesystem"] == true {
        flags.push("--read-only".into());
    }
    if sc["allowPrivilegeEscalation"] == false {
        flags.push("--security-opt=no-new-privileges".into());
    }
    if let Some(uid) = sc["runAsUser"].as_u64() {
        flags.push(format!("--user={uid}:{uid}"));
    }
    for m in container["volumeMounts"].as_array().unwrap() {
        let volume = volumes
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap();
        // An emptyDir is found in `host_paths` by the volume's name.
        let host = volume["hostPath"]["path"]
            .as_str()
            .or_else(|| volume.get("emptyDir").and(volume["name"].as_str()));
        let Some(host) = host else {
            continue; // the ConfigMap: the test passes its settings as flags
        };
        let (_, sandbox) = host_paths
            .iter()
            .find(|(h, _)| *h == host)
            .unwrap_or_else(|| panic!("no sandbox path for hostPath {host}"));
        let mut options = vec![if m["readOnly"] == true { "ro" } else { "rw" }];
        if m["mountPropagation"] == "HostToContainer" {
            options.push("rslave");
        }
        flags.push(format!(
            "--volume={}:{}:{}",
            sandbox.display(),
            m["mountPath"].as_str().unwrap(),
            options.join(",")
        ));
    }
    flags
}

/// Containers and images of test processes that died without unwinding
/// (SIGKILL): `dpt-<pid>-...` whose pid is gone.
fn sweep_orphans() {
    let dead = |name: &str| {
        let name = name.trim_start_matches("localhost/");
        name.strip_prefix(dataplane_tests::NAME_PREFIX)
            .and_then(|rest| rest.split('-').next()?.parse::<u32>().ok())
            .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    };
    let list = |args: &[&str]| -> Vec<String> {
        String::from_utf8_lossy(&podman(args).stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    };
    for c in list(&["ps", "--all", "--format", "{{.Names}}"]) {
        if dead(&c) {
            podman(&["rm", "--force", &c]);
        }
    }
    for i in list(&["images", "--format", "{{.Repository}}:{{.Tag}}"]) {
        if dead(&i) {
            podman(&["rmi", "--force", &i]);
        }
    }
}

#[test]
fn the_image_runs_as_the_daemonset_says_and_serves_a_service() {
    let started = Instant::now();
    sweep_orphans();
    let mut cluster = Cluster::with_layout(Wiring::VethNode, PodLayout::RoutedUnusualNames);
    cluster.add_pod(0, "a");
    cluster.add_pod(1, "b");
    let _servers: Vec<EchoServer> = cluster
        .pods
        .iter()
        .map(|p| EchoServer::tcp(&p.ns, &p.name, SocketAddrV4::new(p.ip, TARGET)))
        .collect();
    let manifests = ManifestDir::new(cluster.prefix());
    let eps: Vec<Ep> = cluster
        .pods
        .iter()
        .map(|p| Ep::ready(p.ip, &cluster.nodes[p.node].name))
        .collect();
    manifests.write(
        "web.yaml",
        &service_yaml(
            "web",
            &format!("  type: NodePort\n  clusterIP: {CLUSTER_IP}\n"),
            80,
            Some(NODE_PORT),
            TARGET,
            &eps,
        ),
    );

    let (image, bird_image) = Image::build(&format!("localhost/{}-agent:test", cluster.prefix()));
    let size = image.size();
    eprintln!("image size: {:.1} MB", size as f64 / 1e6);
    assert!(size < 40_000_000, "a static binary on scratch: {size} bytes");

    let ds: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(root().join("deploy/daemonset.yaml")).unwrap())
            .unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    let node = &cluster.nodes[0];
    let host_paths: [(&str, &Path); 2] = [
        ("/sys/fs/bpf", cluster.bpffs.path()),
        ("/sys/fs/cgroup", node.cgroup.path()),
    ];
    let node_ip = node.ip().to_string();

    // The init container: the preflight passes on this node.
    let init = &pod["initContainers"][0];
    assert_eq!(init["args"][0], "check");
    let mut args: Vec<String> = vec!["run".into(), "--rm".into()];
    args.extend(run_flags(init, &pod["volumes"], &node.ns().path(), &host_paths));
    args.push(image.0.clone());
    args.extend(
        [
            "check",
            "--node-ip",
            &node_ip,
            "--cgroup-path",
            "/sys/fs/cgroup",
            "-o",
            "json",
        ]
        .map(String::from),
    );
    let out = podman(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "check in the init container: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let check: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(check["blockers"], 0, "{check}");

    // The agent.
    let agent = &pod["containers"][0];
    let name = format!("{}-agent", cluster.prefix());
    let mut args: Vec<String> = vec!["run".into(), "--detach".into(), format!("--name={name}")];
    args.extend(run_flags(agent, &pod["volumes"], &node.ns().path(), &host_paths));
    // The manifests instead of the API server (the ConfigMap's mount).
    args.push(format!(
        "--volume={}:/etc/dataplane:ro",
        manifests.path().display()
    ));
    args.push(image.0.clone());
    args.extend(
        [
            "run",
            "--node-name",
            "node1",
            "--node-ip",
            &node_ip,
            "--source",
            "manifests:/etc/dataplane",
            "--cluster-cidr",
            CLUSTER_CIDR,
            "--service-cidr",
            SERVICE_CIDR,
            "--cgroup-path",
            "/sys/fs/cgroup",
            "--max-services",
            "256",
            "--max-backends",
            "1024",
            "--conntrack-entries",
            "16384",
        ]
        .map(String::from),
    );
    let container = Container::run(name, &args);
    let health = SocketAddrV4::new(node.ip(), HEALTH_PORT);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !matches!(
        AgentProcess::http_get(node.ns(), health, "/healthz"),
        Ok((200, _))
    ) {
        assert!(
            Instant::now() < deadline,
            "not healthy in 30 s:\n{}",
            container.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // North-south: both backends, masqueraded.
    let dst = SocketAddrV4::new(node.ip(), NODE_PORT);
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..20 {
        let r = tcp_request(&cluster.client.ns, dst, "x")
            .unwrap_or_else(|e| panic!("request {i} to {dst}: {e}\n{}", container.logs()));
        assert_eq!(r.peer.ip(), node.ip());
        seen.insert(r.server);
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    // East-west: a pod on this node reaches the ClusterIP (its interface
    // was found without a pattern).
    let a = cluster.pod("a");
    let r = tcp_request(&a.ns, SocketAddrV4::new(CLUSTER_IP, 80), "x")
        .unwrap_or_else(|e| panic!("pod to ClusterIP: {e}\n{}", container.logs()));
    assert!(r.server == "a" || r.server == "b");
    // Host processes: connect-time translation in the mounted cgroup.
    let out = Command::new(env!("CARGO_BIN_EXE_sockclient"))
        .arg(node.ns().path())
        .arg(node.cgroup.procs())
        .args(["tcp", &format!("{CLUSTER_IP}:80")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("peer={CLUSTER_IP}:80")),
        "host process to the ClusterIP: {text}\n{}",
        container.logs()
    );
    let logs = container.logs();
    assert!(logs.contains("attached to pod interface"), "{logs}");
    assert!(logs.contains("attached connect-time translation"), "{logs}");
    drop(container);
    drop(image);
    bird_sidecar(&cluster, &bird_image, &ds);
    drop(bird_image);
    eprintln!("image test: {:.1} s", started.elapsed().as_secs_f64());
}

/// Applies the `add` operations of a JSON patch (RFC 6902) to `doc`.
fn json_patch_add(doc: &mut Value, ops: &Value) {
    for op in ops.as_array().expect("a JSON patch") {
        assert_eq!(op["op"], "add", "only `add` is used: {op}");
        let path = op["path"].as_str().unwrap();
        let (parent, last) = path.rsplit_once('/').unwrap();
        let target = doc.pointer_mut(parent).unwrap_or_else(|| panic!("no {parent}"));
        match (target, last) {
            (Value::Array(a), "-") => a.push(op["value"].clone()),
            (Value::Array(a), i) => a.insert(i.parse().unwrap(), op["value"].clone()),
            (Value::Object(o), k) => {
                o.insert(k.to_owned(), op["value"].clone());
            }
            (other, _) => panic!("cannot add under {other}"),
        }
    }
}

/// The BGP overlay (deploy/bgp/): BIRD's image runs as it says, on the
/// configuration the agent renders (the agent's code, a peer and a
/// prefix), in node1's network namespace; a router (BIRD on the client's
/// side of the LAN) learns the prefix from it, and the control socket in
/// the shared volume answers from outside the container (as for the agent).
fn bird_sidecar(cluster: &Cluster, image: &Image, ds: &Value) {
    use dataplane_agent::lb::{
        bgp::{bird, plan},
        crd::{BgpAdvertisement, BgpPeer},
        request::ClassFilter,
    };
    use dataplane_tests::{
        bgp::{Bird, BirdDir, NODE_ASN, ROUTER_ASN, next_hops, router_config},
        cluster::CLIENT_IP,
    };
    let mut ds = ds.clone();
    let patch: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(root().join("deploy/bgp/daemonset-bird.yaml")).unwrap(),
    )
    .unwrap();
    json_patch_add(&mut ds, &patch);
    let pod = &ds["spec"]["template"]["spec"];
    assert!(
        pod["containers"][0]["args"]
            .as_array()
            .unwrap()
            .contains(&"--bgp".into())
    );
    let sidecar = pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "bird")
        .expect("the bird container");
    let node = &cluster.nodes[0];
    let volume = BirdDir::new(&format!("{}-sidecar", cluster.prefix()));
    let peer: BgpPeer = serde_json::from_value(serde_json::json!({"metadata": {"name": "tor"}, "spec": {
        "peerAddress": CLIENT_IP.to_string(), "peerASN": ROUTER_ASN, "myASN": NODE_ASN, "holdTimeSeconds": 3}}))
    .unwrap();
    let ad: BgpAdvertisement = serde_json::from_value(
        serde_json::json!({"metadata": {"name": "cidr"}, "spec": {"serviceCIDRs": [SERVICE_CIDR]}}),
    )
    .unwrap();
    let classes = ClassFilter {
        class: dataplane_agent::lb::DEFAULT_CLASS.into(),
        default_class: false,
    };
    let plan = plan::plan(&plan::Inputs {
        node_name: "node1",
        node: None,
        classes: &classes,
        services: vec![],
        slices: vec![],
        peers: vec![&peer],
        advertisements: vec![&ad],
        pools: vec![],
    });
    std::fs::write(
        volume.path().join("bird.conf"),
        bird::render(&plan, "node1", false),
    )
    .unwrap();
    let router_dir = BirdDir::new(&format!("{}-router", cluster.prefix()));
    let router_conf = router_dir.path().join("router.conf");
    std::fs::write(&router_conf, router_config(CLIENT_IP, &[node.ip()], false, 3)).unwrap();
    let router = Bird::start(&cluster.client.ns, &router_conf);

    let name = format!("{}-bird", cluster.prefix());
    let mut args: Vec<String> = vec!["run".into(), "--detach".into(), format!("--name={name}")];
    args.extend(run_flags(
        sidecar,
        &pod["volumes"],
        &node.ns().path(),
        &[("bird", volume.path())],
    ));
    args.push(image.0.clone());
    let container = Container::run(name, &args);
    let deadline = Instant::now() + Duration::from_secs(30);
    while next_hops(&cluster.client.ns, SERVICE_CIDR) != [node.ip()] {
        assert!(
            Instant::now() < deadline,
            "the router did not learn {SERVICE_CIDR} from the sidecar in 30 s:\n{}\nrouter:\n{}",
            container.logs(),
            router.birdc("show protocols all")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = Command::new("birdc")
        .arg("-s")
        .arg(volume.path().join("bird.ctl"))
        .args(["show", "protocols"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Established"),
        "the control socket in the shared volume: {text}"
    );
    drop(container);
}
