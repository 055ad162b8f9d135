//! The control plane's promises that need a kernel: one agent per pin
//! directory, `cleanup` that will not pull the pins from under a running
//! agent, maps resized when the limits change between runs (connections
//! kept), `inspect` on pins it does not fully understand, and the
//! incremental syncer against real BPF maps: a write failing at every
//! position of a sync, and a table tampered with behind its back.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use dataplane_agent::{
    agent::sync::Syncer,
    dataplane::{Datapath, DatapathError, LbMaps, LoadOptions},
    k8s::{manifests::Objects, manifests::load_text, store::Store},
    net::Protocol,
    state::{
        diff::{MapWriter, Op},
        inputs::NodeContext,
        table::{Backend, BackendId, BackendKey, Frontend, MapTable, ServicePortName, StraySlot},
    },
};
use dataplane_common::names;
use dataplane_tests::{
    agent::{ManifestEndpoint as Ep, service_yaml},
    cluster::Cluster,
    echo::{TcpClient, tcp_request},
};

const BIN: &str = env!("CARGO_BIN_EXE_agent");
const NODE_PORT: u16 = 30080;

/// The shared sandbox, with this file's helpers.
struct Sandbox(dataplane_tests::sandbox::Sandbox);

dataplane_tests::deref_sandbox!(Sandbox, 0);

/// Pods a and b on node1 behind a NodePort, an agent on node1.
fn sandbox(extra: &[&str]) -> Sandbox {
    let web = |c: &Cluster| {
        let eps: Vec<Ep> = c.pods.iter().map(|p| Ep::ready(p.ip, &c.nodes[0].name)).collect();
        service_yaml(
            "web",
            "  type: NodePort\n  clusterIP: 10.96.0.10\n",
            80,
            Some(NODE_PORT),
            8080,
            &eps,
        )
    };
    Sandbox(
        dataplane_tests::sandbox::Sandbox::builder(Cluster::new())
            .pods(&[("a", 0), ("b", 0)])
            .tcp_echo(8080)
            .manifest("web.yaml", web)
            .agents(1, |s, i| s.start_agent(BIN, i, extra)),
    )
}

impl Sandbox {
    fn dst(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.cluster.nodes[0].ip(), NODE_PORT)
    }

    fn served(&self) -> bool {
        tcp_request(&self.cluster.client.ns, self.dst(), "x").is_ok()
    }

    fn run(&self, args: &[&str]) -> std::process::Output {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        self.agents[0].run_in_node(&args, Duration::from_secs(20))
    }

    fn pins(&self) -> String {
        self.agents[0].pin_dir.display().to_string()
    }
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn one_agent_per_pin_directory_and_cleanup_refuses_a_running_one() {
    let mut s = sandbox(&[]);
    assert!(s.served());

    // A second agent on the same pins stops at once, saying who holds them.
    let second = s.agents[0].run_in_node(&s.agents[0].run_args(), Duration::from_secs(20));
    assert!(!second.status.success(), "the second agent must not run");
    let why = stderr(&second);
    assert!(
        why.contains("another agent (pid ") && why.contains(&s.pins()),
        "the error names the holder and the directory: {why}"
    );
    assert!(s.served(), "the first agent is undisturbed");

    // cleanup refuses while the agent runs, and removes nothing.
    let cleanup = s.run(&["cleanup", "--bpffs-dir", &s.pins()]);
    assert!(!cleanup.status.success());
    assert!(stderr(&cleanup).contains("--force"), "{}", stderr(&cleanup));
    assert!(s.served());
    assert!(s.agents[0].pin_dir.join("maps").exists());

    // Pointed at the bpffs directory holding the pins (not a pin directory
    // itself), cleanup removes nothing, even with --force: other agents' and
    // other tools' pins live there.
    let parent = s.agents[0].pin_dir.parent().unwrap().to_str().unwrap().to_owned();
    let wrong = s.run(&["cleanup", "--bpffs-dir", &parent, "--force"]);
    assert!(!wrong.status.success(), "cleanup of {parent} must refuse");
    assert!(
        stderr(&wrong).contains("not an agent's pin directory"),
        "{}",
        stderr(&wrong)
    );
    assert!(s.agents[0].pin_dir.join("maps").exists());
    assert!(s.served());

    // --force removes the pins, and only them; the agent notices within a
    // second and exits (a restart pins and attaches again).
    let foreign = s.agents[0].pin_dir.join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    let forced = s.run(&["cleanup", "--bpffs-dir", &s.pins(), "--force"]);
    assert!(forced.status.success(), "{}", stderr(&forced));
    assert!(!s.agents[0].pin_dir.join("maps").exists() && !s.agents[0].pin_dir.join("links").exists());
    assert!(foreign.is_dir(), "what is not the agent's stays");
    std::fs::remove_dir(&foreign).unwrap();
    let status = s.agents[0].wait_exit(Duration::from_secs(15)).unwrap_or_else(|| {
        panic!(
            "the agent kept running without its pins:\n{}",
            s.agents[0].log_text()
        )
    });
    assert!(!status.success());
    assert!(
        s.agents[0]
            .log_text()
            .contains("was removed under the running agent"),
        "{}",
        s.agents[0].log_text()
    );
    let ns = s.cluster.nodes[0].ns().name().to_owned();
    s.agents[0].restart(&dataplane_tests::netns::NetNs::adopt(&ns));
    assert!(s.served(), "served again after the restart");
}

/// A start that fails on a port in use (here: the health port, held by the
/// running agent) fails before it attaches anything: no second copy of the
/// datapath is left on the node's device.
#[test]
fn a_start_failing_on_a_port_in_use_attaches_nothing() {
    let s = sandbox(&[]);
    let other_pins = s.agents[0].pin_dir.with_file_name("second-agent");
    let mut args = s.agents[0].run_args();
    let at = args.iter().position(|a| a == "--bpffs-dir").unwrap() + 1;
    args[at] = other_pins.display().to_string();
    let second = s.agents[0].run_in_node(&args, Duration::from_secs(20));
    assert!(!second.status.success(), "the second agent must not run");
    let why = stderr(&second);
    assert!(why.contains("binding the health server"), "{why}");
    let links: Vec<_> = std::fs::read_dir(other_pins.join("links"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(links.is_empty(), "attached before failing: {links:?}");
    assert!(s.served(), "the running agent is undisturbed");
    let cleanup = s.run(&["cleanup", "--bpffs-dir", &other_pins.display().to_string()]);
    assert!(cleanup.status.success(), "{}", stderr(&cleanup));
}

#[test]
fn a_restart_with_other_limits_resizes_the_pinned_maps_and_keeps_connections() {
    let mut s = sandbox(&[]);
    let mut long = TcpClient::connect(&s.cluster.client.ns, s.dst()).unwrap();
    let backend = long.request("before").unwrap().server;
    let conntrack = |s: &Sandbox| -> serde_json::Value {
        let out = s.run(&["inspect", "--bpffs-dir", &s.pins(), "-o", "json", "conntrack"]);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    assert_eq!(conntrack(&s)["capacity"], 16384);
    assert_eq!(conntrack(&s)["assured"]["capacity"], 16384);

    // Larger limits: every sized map is resized; the table and the flows
    // move along.
    s.agents[0].set_flag("--max-services", "512");
    s.agents[0].set_flag("--max-backends", "2048");
    s.agents[0].set_flag("--conntrack-entries", "32768");
    let ns = s.cluster.nodes[0].ns().name().to_owned();
    s.agents[0].restart(&dataplane_tests::netns::NetNs::adopt(&ns));
    let log = s.agents[0].log_text();
    for map in [
        names::LB4_BACKENDS,
        names::SERVICE_STATS,
        names::CT4,
        names::LB4_SERVICES,
    ] {
        assert!(
            log.contains(&format!("map=\"{map}\"")) || log.contains(&format!("map={map}")),
            "{map} resized: {log}"
        );
    }
    assert_eq!(
        long.request("after")
            .expect("the long connection survives the resize")
            .server,
        backend
    );
    assert_eq!(conntrack(&s)["capacity"], 32768);
    assert_eq!(conntrack(&s)["assured"]["capacity"], 32768);
    let after_restart = log.rsplit("adopted the pinned service table").next().unwrap();
    assert!(
        after_restart.contains(" ops=0 "),
        "the table moved as it was: {after_restart}"
    );
    let services = s.run(&["inspect", "--bpffs-dir", &s.pins(), "-o", "json", "services"]);
    assert!(services.status.success(), "{}", stderr(&services));
    assert!(
        stderr(&services).is_empty(),
        "nothing to note: {}",
        stderr(&services)
    );

    // Too small for what the maps hold: refused, saying what would fit;
    // nothing changes.
    s.agents[0].kill9();
    let mut args = s.agents[0].run_args();
    let at = args.iter().position(|a| a == "--max-backends").unwrap();
    args[at + 1] = "2".into();
    let refused = s.agents[0].run_in_node(&args, Duration::from_secs(20));
    assert!(!refused.status.success());
    let why = stderr(&refused);
    assert!(
        why.contains("--max-backends 2 is too small") && why.contains("use at least 3"),
        "{why}"
    );
    assert!(s.served(), "the datapath keeps forwarding");
    // Conntrack too: a smaller copy would drop established flows.
    let mut args = s.agents[0].run_args();
    let at = args.iter().position(|a| a == "--conntrack-entries").unwrap();
    args[at + 1] = "2".into();
    let refused = s.agents[0].run_in_node(&args, Duration::from_secs(20));
    assert!(!refused.status.success());
    let why = stderr(&refused);
    assert!(
        why.contains("--conntrack-entries 2 is too small") && why.contains("tracked flow entries"),
        "{why}"
    );
    s.agents[0].restart(&dataplane_tests::netns::NetNs::adopt(&ns));
    assert_eq!(long.request("again").unwrap().server, backend);
}

#[test]
fn inspect_reads_pins_of_another_version_and_says_what_it_cannot() {
    let mut s = sandbox(&[]);
    assert!(s.served());
    s.agents[0].kill9();
    // As an older agent would have left them: no conntrack map of this
    // version, and the service-names map with another layout.
    let maps = s.agents[0].pin_dir.join("maps");
    std::fs::remove_file(maps.join(names::CT4)).unwrap();
    std::fs::remove_file(maps.join(names::LB4_SERVICE_NAMES)).unwrap();
    let odd = aya::maps::HashMap::<aya::maps::MapData, u64, u64>::create(8, 0).unwrap();
    odd.pin(maps.join(names::LB4_SERVICE_NAMES)).unwrap();
    for what in [&["services"][..], &["backends"], &["conntrack"], &["stats"]] {
        let mut args = vec!["inspect", "--bpffs-dir"];
        let pins = s.pins();
        args.push(&pins);
        args.extend(["-o", "json"]);
        args.extend(what);
        let out = s.run(&args);
        assert!(out.status.success(), "inspect {what:?}: {}", stderr(&out));
        let _: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let notes = stderr(&out);
        assert!(
            notes.contains(&format!("{} is not pinned", names::CT4)),
            "{notes}"
        );
        assert!(
            notes.contains(names::LB4_SERVICE_NAMES) && notes.contains("key/value sizes"),
            "{notes}"
        );
    }
    let out = s.run(&["inspect", "--bpffs-dir", &s.pins(), "-o", "json", "services"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["services"].as_array().unwrap().len(),
        2,
        "the ClusterIP and the NodePort on the node's primary address: {v}"
    );
}

// The syncer against real maps.

const NODE: &str = "node-a";

fn objects(yaml: &str) -> Objects {
    let mut o = Objects::default();
    load_text(yaml, "test", &mut o);
    assert!(o.problems.is_empty(), "{:?}", o.problems);
    o
}

/// Services `first..first+n` with `eps` endpoints each (some shared with the
/// neighbour), a LoadBalancer with source ranges and eTP=Local among them.
fn table(first: u32, n: u32, eps: u32) -> Objects {
    let mut yaml = String::new();
    for i in first..first + n {
        let extra = if i % 3 == 0 {
            "  type: LoadBalancer\n  externalTrafficPolicy: Local\n  loadBalancerSourceRanges: [198.51.100.0/24]\n".to_owned()
        } else {
            String::new()
        };
        let node_port = (i % 3 == 0).then_some(30000 + i as u16);
        let endpoints: Vec<Ep> = (0..eps)
            .map(|k| {
                let mut e = Ep::ready(
                    Ipv4Addr::new(10, 0, (i + k) as u8 / 2, 1 + k as u8),
                    if k % 2 == 0 { NODE } else { "other" },
                );
                if k == eps - 1 && i % 2 == 1 {
                    e = e.terminating();
                }
                e
            })
            .collect();
        yaml += &service_yaml(
            &format!("s{i}"),
            &format!("{extra}  clusterIP: 10.96.1.{i}\n"),
            80,
            node_port,
            8080,
            &endpoints,
        );
        yaml += "---\n";
    }
    let mut o = objects(&yaml);
    for s in &mut o.services {
        let n: u32 = s.metadata.name.as_ref().unwrap()[1..].parse().unwrap();
        if n.is_multiple_of(3) {
            s.status = Some(
                serde_json::from_value(
                    serde_json::json!({"loadBalancer": {"ingress": [{"ip": format!("198.18.2.{n}")}]}}),
                )
                .unwrap(),
            );
        }
    }
    o
}

fn load(store: &mut Store, o: &Objects) {
    store.replace_services(o.services.clone());
    store.replace_slices(o.slices.clone());
}

fn node_context() -> NodeContext {
    NodeContext {
        node_port_addresses: vec![Ipv4Addr::new(192, 168, 0, 1).into()],
        node_ips: vec![Ipv4Addr::new(192, 168, 0, 1).into()],
        lb: Default::default(),
    }
}

/// The maps' table in names and addresses (ids differ between runs).
fn resolved(
    t: &MapTable,
) -> (
    BTreeMap<Frontend, String>,
    BTreeSet<BackendKey>,
    BTreeSet<std::net::IpAddr>,
    usize,
) {
    let names: BTreeMap<u32, &ServicePortName> = t.service_names.iter().map(|(i, n)| (*i, n)).collect();
    let backends: BTreeMap<BackendId, &Backend> = t.backends.iter().map(|(i, b)| (*i, b)).collect();
    let frontends = t
        .frontends
        .iter()
        .map(|(f, e)| {
            let keys = |s: &dataplane_agent::state::table::BackendSet| -> Vec<String> {
                s.backends
                    .iter()
                    .map(|id| {
                        backends
                            .get(id)
                            .map_or_else(|| format!("DANGLING {id:?}"), |b| format!("{:?}", b.key()))
                    })
                    .collect()
            };
            let text = format!(
                "{} {:?} {:?} {:?} {}",
                names.get(&e.service_id).map_or("?".into(), |n| n.to_string()),
                e.kind,
                keys(&e.backends),
                e.internal_backends.as_ref().map(keys),
                e.source_ranges
            );
            (*f, text)
        })
        .collect();
    let keys = t.backends.iter().map(|(_, b)| b.key()).collect();
    (
        frontends,
        keys,
        t.service_addresses.iter().copied().collect(),
        t.source_ranges.len() + t.stray_slots.len() + t.damaged.len(),
    )
}

/// What a fresh syncer writes for `o` into fresh maps: the reference.
fn reference(
    o: &Objects,
) -> (
    BTreeMap<Frontend, String>,
    BTreeSet<BackendKey>,
    BTreeSet<std::net::IpAddr>,
    usize,
) {
    let mut dp = Datapath::load_with(&opts()).expect("load");
    let mut store = Store::default();
    load(&mut store, o);
    let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 256, 256);
    let r = syncer.sync(&mut store, &node_context(), dp.maps_mut());
    assert_eq!(r.failed_ops, 0);
    resolved(&dp.maps().read_table().unwrap())
}

fn opts() -> LoadOptions {
    LoadOptions {
        max_services: 256,
        max_backends: 256,
        max_service_entries: 4096,
        ct_entries: 1024,
        affinity_entries: 1024,
        ipv6: false,
    }
}

/// The real maps, failing the operation with number `fail_at` (counted
/// over its life) without applying it.
struct Failing<'a> {
    maps: &'a mut LbMaps,
    ops: usize,
    fail_at: Option<usize>,
}

impl MapWriter for Failing<'_> {
    type Error = DatapathError;
    fn apply(&mut self, op: &Op) -> Result<(), DatapathError> {
        self.apply_all(std::slice::from_ref(op)).map_err(|(_, e)| e)
    }
    fn apply_all(&mut self, ops: &[Op]) -> Result<(), (usize, DatapathError)> {
        let fail = self
            .fail_at
            .and_then(|at| at.checked_sub(self.ops))
            .filter(|i| *i < ops.len());
        let Some(i) = fail else {
            self.ops += ops.len();
            return self.maps.apply_all(ops);
        };
        self.fail_at = None;
        self.maps.apply_all(&ops[..i])?;
        self.ops += i + 1;
        Err((i, DatapathError::BackendIdOutOfRange { id: 0, capacity: 0 }))
    }
    fn read_table(&self) -> Result<MapTable, DatapathError> {
        self.maps.read_table()
    }
}

#[test]
fn a_write_failing_at_any_point_of_a_sync_leaves_real_maps_equal_to_the_desired_table() {
    let (before, after) = (table(0, 6, 3), table(3, 6, 4));
    let want = reference(&after);
    let node = node_context();
    let mut dp = Datapath::load_with(&opts()).expect("load");
    // How many operations the change takes.
    let total = {
        let mut store = Store::default();
        load(&mut store, &before);
        let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 256, 256);
        syncer.sync(&mut store, &node, dp.maps_mut());
        load(&mut store, &after);
        syncer.sync(&mut store, &node, dp.maps_mut()).summary.ops
    };
    assert!(total > 20, "a change worth failing: {total} operations");
    for n in 0..total {
        // Back to `before`, from whatever the maps hold.
        let mut store = Store::default();
        load(&mut store, &before);
        let kernel = dp.maps().read_table().unwrap();
        let mut syncer = Syncer::adopt(&kernel, NODE, 256, 256);
        let r = syncer.sync(&mut store, &node, dp.maps_mut());
        assert_eq!(r.failed_ops, 0);
        // The change, with operation n failing.
        load(&mut store, &after);
        let mut failing = Failing {
            maps: dp.maps_mut(),
            ops: 0,
            fail_at: Some(n),
        };
        let r = syncer.sync(&mut store, &node, &mut failing);
        assert_eq!(r.failed_ops, 1, "operation {n} failed");
        assert!(!r.unsettled, "operation {n}: recovered within the sync");
        let got = resolved(&dp.maps().read_table().unwrap());
        assert_eq!(got, want, "failed at operation {n} of {total}");
        assert!(!format!("{got:?}").contains("DANGLING"));
    }
}

#[test]
fn a_reconcile_repairs_real_maps_changed_behind_the_agents_back() {
    let o = table(0, 6, 3);
    let want = reference(&o);
    let node = node_context();
    let mut dp = Datapath::load_with(&opts()).expect("load");
    let mut store = Store::default();
    load(&mut store, &o);
    let mut syncer = Syncer::adopt(&MapTable::default(), NODE, 256, 256);
    syncer.sync(&mut store, &node, dp.maps_mut());
    assert_eq!(resolved(&dp.maps().read_table().unwrap()), want);

    // Another writer: a frontend removed, a slot of another one deleted
    // (damaged), stray slots left, a backend a frontend names cleared
    // (dangling), a bogus backend and ClusterIP added.
    let maps = dp.maps_mut();
    let table = maps.read_table().unwrap();
    let (gone, _) = &table.frontends[0];
    maps.remove_frontend(gone).unwrap();
    let (damaged, entry) = table
        .frontends
        .iter()
        .find(|(_, e)| e.backends.backends.len() >= 2)
        .unwrap()
        .clone();
    maps.apply(&Op::RemoveStraySlot(StraySlot {
        frontend: damaged,
        internal: false,
        slot: 2,
    }))
    .unwrap();
    let stray = Frontend {
        addr: Ipv4Addr::new(10, 96, 9, 9).into(),
        port: 9,
        proto: Protocol::Tcp,
    };
    maps.set_frontend(&stray, &entry).unwrap();
    maps.apply(&Op::RemoveStraySlot(StraySlot {
        frontend: stray,
        internal: false,
        slot: 0,
    }))
    .unwrap();
    let named = table
        .frontends
        .iter()
        .find_map(|(f, e)| {
            (*f != damaged && *f != *gone)
                .then(|| e.backends.backends.first().copied())
                .flatten()
        })
        .unwrap();
    let named_addr = maps.backend(named).unwrap().unwrap().addr;
    maps.remove_backend(named, named_addr).unwrap();
    maps.set_backend(
        BackendId::new(200).unwrap(),
        &Backend {
            addr: Ipv4Addr::new(10, 9, 9, 9).into(),
            port: 1,
            proto: Protocol::Tcp,
            serving: true,
            terminating: false,
            local: false,
        },
    )
    .unwrap();
    maps.set_service_address(Ipv4Addr::new(10, 96, 9, 8).into())
        .unwrap();
    assert_ne!(resolved(&maps.read_table().unwrap()), want);

    let r = syncer.reconcile(&mut store, &node, dp.maps_mut());
    assert!(r.drift >= 6, "every change counted: {}", r.drift);
    assert_eq!(resolved(&dp.maps().read_table().unwrap()), want);
    let r = syncer.reconcile(&mut store, &node, dp.maps_mut());
    assert_eq!((r.drift, r.summary.ops), (0, 0), "settled");
}

#[test]
fn connect_time_programs_attach_and_replace_under_a_pin_directory() {
    // A dot in the cgroup's name (as systemd's `kubepods.slice`), and the
    // replacement pin: both must be names bpffs accepts.
    let cgroup =
        dataplane_tests::cgroup::CgroupDir::new(&format!("{}.slice", dataplane_tests::unique_prefix()));
    let pins = dataplane_tests::bpffs::BpffsDir::new(&format!("{}-cg", dataplane_tests::unique_prefix()));
    {
        let mut dp = Datapath::open_pinned(&opts(), pins.path()).expect("open pinned");
        let how = dp.attach_cgroup(cgroup.path()).expect("attach with pins");
        assert_eq!(how, dataplane_agent::dataplane::Attached::New);
    }
    let mut dp = Datapath::open_pinned(&opts(), pins.path()).expect("open pinned again");
    let how = dp.attach_cgroup(cgroup.path()).expect("replace with pins");
    assert_eq!(how, dataplane_agent::dataplane::Attached::Replaced);
    let links: Vec<String> = std::fs::read_dir(pins.path().join("links"))
        .unwrap_or_else(|e| {
            let held: Vec<_> = std::fs::read_dir(pins.path())
                .map(|d| d.flatten().map(|e| e.file_name()).collect())
                .unwrap_or_default();
            panic!(
                "read {}/links: {e}; the directory holds {held:?}",
                pins.path().display()
            )
        })
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    // connect, sendmsg, recvmsg and getpeername, for IPv4 and IPv6.
    assert_eq!(links.len(), 8, "one pin per connect-time program: {links:?}");
    drop(dp);
    // Unpinning detaches before the cgroup goes.
    std::fs::remove_dir_all(pins.path().join("links")).unwrap();
}

/// An upgrade over pins of the previous config layout (`DP_CONFIG_V3`)
/// keeps its SNAT hash seed: live masqueraded flows are found at egress by
/// hashing their client with it, and a new seed would orphan them all.
#[test]
fn an_upgrade_keeps_the_snat_hash_seed_of_the_previous_config_layout() {
    let dir = dataplane_tests::bpffs::BpffsDir::new(&format!("{}-upgrade", dataplane_tests::unique_prefix()));
    std::fs::create_dir_all(dir.path().join("maps")).unwrap();
    // The old map: flags CONFIGURED at 0, the seed at 52.
    let mut old = aya::maps::Array::<aya::maps::MapData, [u8; 264]>::create(1, 0).expect("create");
    let mut value = [0u8; 264];
    value[..4].copy_from_slice(&1u32.to_ne_bytes());
    value[52..56].copy_from_slice(&0x5eed_1234u32.to_ne_bytes());
    old.set(0, value, 0).unwrap();
    old.pin(dir.path().join("maps/DP_CONFIG_V3")).expect("pin");
    let opts = LoadOptions {
        max_services: 64,
        max_backends: 64,
        max_service_entries: 256,
        ct_entries: 256,
        affinity_entries: 64,
        ipv6: false,
    };
    let mut dp = Datapath::open_pinned(&opts, dir.path()).expect("open the pins");
    dp.maps_mut()
        .set_config(&dataplane_agent::dataplane::DatapathConfig::for_node(&[
            "198.18.0.11".parse().unwrap(),
        ]))
        .unwrap();
    assert_eq!(dp.maps().config().unwrap().snat_hash_seed, 0x5eed_1234);
    drop(dp);
    // Without the old map, a first start picks its own.
    let fresh = dataplane_tests::bpffs::BpffsDir::new(&format!("{}-fresh", dataplane_tests::unique_prefix()));
    let mut dp = Datapath::open_pinned(&opts, fresh.path()).expect("open");
    dp.maps_mut()
        .set_config(&dataplane_agent::dataplane::DatapathConfig::for_node(&[
            "198.18.0.11".parse().unwrap(),
        ]))
        .unwrap();
    assert_ne!(dp.maps().config().unwrap().snat_hash_seed, 0x5eed_1234);
}
