//! The control plane, measured: programming N Services × 10 endpoints from
//! empty, one EndpointSlice change → maps written, through the agent's own
//! code in-process and through a running agent (the fake API server's
//! watch, and a manifests file), and the agent's memory and CPU while idle.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use dataplane_agent::{
    agent::sync::Syncer,
    dataplane::{Datapath, DatapathConfig, LbMaps, LoadOptions},
    k8s::{
        model::{
            ObjectKey, PortSpec, ServiceInfo, ServiceSpecInfo, SliceEndpoint, SliceInfo, SlicePort, Topology,
        },
        store::Store,
    },
    net::Protocol,
    state::{
        inputs::NodeContext,
        table::{Frontend, MapTable, intern},
    },
};
use dataplane_tests::{cluster::Cluster, fake_api::FakeApiServer};
use serde_json::json;

use crate::stat::{Stat, stat};

pub const EPS: u32 = 10;

/// Single changes measured per size and path.
pub(crate) const CHANGES: usize = 60;
/// Changes are this far apart: each is a change after a quiet spell (the
/// agent's --min-sync-period-ms is 100), as single changes are.
pub(crate) const SPACING: Duration = Duration::from_millis(200);
/// The idle window (two periodic reconciles at the default 30 s).
pub(crate) const IDLE: Duration = Duration::from_secs(65);

pub fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i + 1)
}

/// Endpoint k of Service i; `salt` (unique per change) moves the first.
fn ep(i: u32, k: u32, salt: u32) -> Ipv4Addr {
    if k == 0 && salt > 0 {
        return Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 200, 0, 0)) + salt);
    }
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i * 16 + k)
}

/// CPU time (user + system) of this process so far.
pub fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn service_info(i: u32) -> ServiceInfo {
    ServiceInfo {
        key: ObjectKey::new("bench", &format!("svc{i}")),
        uid: None,
        created: None,
        spec: Some(ServiceSpecInfo {
            cluster_ips: vec![vip(i).into()].into(),
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            external_policy_local: false,
            internal_policy_local: false,
            affinity_timeout: None,
            topology: Topology::Off,
            health_check_node_port: None,
            ports: vec![PortSpec {
                name: intern("http"),
                proto: Protocol::Tcp,
                port: 80,
                node_port: None,
            }]
            .into(),
            lb: Default::default(),
        }),
        problems: vec![],
    }
}

fn slice_info(i: u32, salt: u32) -> SliceInfo {
    SliceInfo {
        key: ObjectKey::new("bench", &format!("svc{i}-1")),
        service: Some(format!("svc{i}").into()),
        family: Some(dataplane_agent::net::IpFamily::V4),
        ports: vec![SlicePort {
            name: intern("http"),
            proto: Protocol::Tcp,
            port: 8080,
        }]
        .into(),
        endpoints: (0..EPS)
            .map(|k| SliceEndpoint {
                addr: ep(i, k, salt).into(),
                ready: true,
                serving: true,
                terminating: false,
                node: None,
                hints: None,
            })
            .collect(),
        trigger_time: None,
        problems: vec![],
    }
}

fn node() -> NodeContext {
    NodeContext {
        node_port_addresses: vec![Ipv4Addr::new(198, 18, 0, 11).into()],
        node_ips: vec![Ipv4Addr::new(198, 18, 0, 11).into()],
        lb: Default::default(),
    }
}

/// Map sizes for `n` Services × [`EPS`] endpoints.
pub fn load_options(n: u32) -> LoadOptions {
    LoadOptions {
        max_services: n + 16,
        max_backends: n * EPS + 16,
        max_service_entries: n * (EPS + 2) + 64,
        ct_entries: 1024,
        affinity_entries: 1024,
        ipv6: false,
    }
}

/// In-process: the agent's sync (store → desired table → diff → batched
/// map writes) from empty maps, then single endpoint changes.
pub struct InProcess {
    pub services: u32,
    pub program_all_s: f64,
    /// Min–max over the rounds.
    pub program_range: (f64, f64),
    pub program_all_cpu_s: f64,
    /// Recompute, plan, write (s).
    pub split: [f64; 3],
    pub change_ms: Stat,
    pub change_p99_ms: f64,
    /// (key size, value size, max entries, memlock bytes) of the maps.
    pub maps: Vec<(u32, u32, u32, u64)>,
}

pub fn in_process(n: u32) -> InProcess {
    let opts = load_options(n);
    let mut dp = Datapath::load_with(&opts).expect("load");
    dp.maps_mut()
        .set_config(&DatapathConfig::new(Ipv4Addr::new(198, 18, 0, 11)))
        .unwrap();
    let mut store = Store::default();
    store.replace_service_infos((0..n).map(service_info));
    store.replace_slice_infos((0..n).map(|i| slice_info(i, 0)));
    let node = node();
    let mut syncer = Syncer::adopt(
        &MapTable::default(),
        "node1",
        opts.max_services,
        opts.max_backends,
    );
    let started = Instant::now();
    let cpu = cpu_time();
    let report = syncer.sync(&mut store, &node, dp.maps_mut());
    let program_all_s = started.elapsed().as_secs_f64();
    let program_all_cpu_s = (cpu_time() - cpu).as_secs_f64();
    let split = [report.recompute_time, report.plan_time, report.write_time].map(|d| d.as_secs_f64());
    assert_eq!(report.failed_ops, 0, "{:?}", report.problems);
    assert_eq!(report.frontends, n as usize);
    let mut lat = Vec::new();
    for c in 1..=200u32 {
        let i = c * 7919 % n;
        store.upsert_slice_info(slice_info(i, c));
        let t = Instant::now();
        let r = syncer.sync(&mut store, &node, dp.maps_mut());
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(r.summary.backends_set, 1, "one endpoint moved");
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let p99 = p99(&lat);
    InProcess {
        services: n,
        program_all_s,
        program_range: (program_all_s, program_all_s),
        program_all_cpu_s,
        split,
        change_ms: stat(lat),
        change_p99_ms: p99,
        maps: crate::kube_proxy::map_memory(),
    }
}

/// The 99th percentile of sorted figures.
fn p99(sorted: &[f64]) -> f64 {
    sorted[(sorted.len() * 99).div_ceil(100).saturating_sub(1)]
}

/// A running agent (its own process in the sandbox's node1).
struct BenchAgent {
    child: Child,
    log: PathBuf,
    pins: PathBuf,
    started: Instant,
}

impl Drop for BenchAgent {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

impl BenchAgent {
    fn start(cluster: &Cluster, n: u32, source: &[&str]) -> Self {
        let bin = std::env::current_exe().unwrap().with_file_name("agent");
        assert!(
            bin.exists(),
            "{} is missing: cargo build --release -p dataplane-tests --bins",
            bin.display()
        );
        let node = &cluster.nodes[0];
        let pins = cluster.bpffs.path().join(format!("bench-{n}"));
        let log = std::env::temp_dir().join(format!("{}-bench-agent.log", cluster.prefix()));
        let out = std::fs::File::create(&log).unwrap();
        let (services, backends) = (n + 64, n * EPS + 64);
        let child = Command::new("ip")
            .args(["netns", "exec", node.ns().name()])
            .arg(&bin)
            .args([
                "run",
                "--node-name",
                &node.name,
                "--node-ip",
                &node.ip().to_string(),
            ])
            .args([
                "--devices",
                dataplane_tests::cluster::EXTERNAL_DEVICE,
                "--cgroup-path",
                "none",
            ])
            .arg("--bpffs-dir")
            .arg(&pins)
            .args([
                "--max-services",
                &services.to_string(),
                "--max-backends",
                &backends.to_string(),
            ])
            .args(["--conntrack-entries", "16384"])
            .args([
                "--health-bind-address",
                "127.0.0.1:10256",
                "--metrics-bind-address",
                "127.0.0.1:10249",
            ])
            .args(source)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .expect("start the agent");
        Self {
            child,
            log,
            pins,
            started: Instant::now(),
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for a log line containing `needle`; returns it.
    fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self.log_text().lines().find(|l| l.contains(needle)) {
                return l.to_owned();
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the agent exited ({status}):\n{}", self.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "no `{needle}` in {timeout:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// (user + system CPU, resident MB, peak resident MB) from /proc.
    fn usage(&self) -> (Duration, f64, f64) {
        let pid = self.child.id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // Fields after the command name (which may hold spaces).
        let f: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kb = |k: &str| -> f64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
                .unwrap_or(0.0)
        };
        (
            Duration::from_secs_f64(ticks / hz),
            kb("VmRSS:") / 1024.0,
            kb("VmHWM:") / 1024.0,
        )
    }
}

/// `key=value` of a log line.
fn field(line: &str, key: &str) -> f64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.trim_matches('"').parse().ok())
        .unwrap_or(f64::NAN)
}

/// A Service and its EndpointSlice as API objects.
fn objects(i: u32, salt: u32) -> (serde_json::Value, serde_json::Value) {
    let svc = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc{i}"), "namespace": "bench"},
        "spec": {"clusterIP": vip(i).to_string(), "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}});
    (svc, slice_object(i, salt))
}

fn slice_object(i: u32, salt: u32) -> serde_json::Value {
    let eps: Vec<serde_json::Value> = (0..EPS)
        .map(|k| json!({"addresses": [ep(i, k, salt).to_string()], "conditions": {"ready": true}}))
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("svc{i}-1"), "namespace": "bench", "labels": {"kubernetes.io/service-name": format!("svc{i}")}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "endpoints": eps})
}

/// Waits until the maps send Service `i`'s ClusterIP to `addr`; the time it
/// took from `since`.
fn until_programmed(maps: &LbMaps, i: u32, addr: Ipv4Addr, since: Instant) -> f64 {
    let fe = Frontend {
        addr: vip(i).into(),
        port: 80,
        proto: Protocol::Tcp,
    };
    let deadline = since + Duration::from_secs(10);
    loop {
        if let Ok(Some((_, ids))) = maps.frontend(&fe, 0)
            && ids.iter().any(|id| {
                dataplane_agent::state::table::BackendId::new(*id)
                    .and_then(|id| maps.backend(id).ok().flatten())
                    .is_some_and(|b| b.addr == addr)
            })
        {
            return since.elapsed().as_secs_f64() * 1000.0;
        }
        assert!(
            Instant::now() < deadline,
            "service {i} not programmed with {addr} in 10 s"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// A running agent, measured.
pub struct AgentRow {
    pub services: u32,
    pub source: &'static str,
    /// Process start → first full sync done.
    pub start_to_programmed_s: f64,
    /// The first (full) sync itself, from the agent's log.
    pub first_sync_s: f64,
    pub event_ms: Stat,
    pub event_p99_ms: f64,
    /// Idle: % of one core, resident and peak resident MB; the periodic
    /// reconcile's duration (ms).
    pub idle: Option<(f64, f64, f64, f64)>,
}

/// Single changes through a running agent: `change(i, salt)` makes
/// Service `i`'s first endpoint `ep(i, 0, salt)`.
fn measure_changes(agent: &BenchAgent, n: u32, mut change: impl FnMut(u32, u32)) -> (Stat, f64) {
    let (maps, _) = LbMaps::open_pins(&agent.pins).expect("open the agent's pins");
    let mut lat = Vec::new();
    for c in 0..CHANGES as u32 {
        let i = c * 7919 % n;
        let salt = 1_000_000 + n + c;
        std::thread::sleep(SPACING);
        let t = Instant::now();
        change(i, salt);
        lat.push(until_programmed(&maps, i, ep(i, 0, salt), t));
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let p = p99(&lat);
    (stat(lat), p)
}

/// The agent fed by the fake API server's watch.
pub fn through_api(n: u32, measure_idle: bool) -> AgentRow {
    let cluster = Cluster::new();
    let api = FakeApiServer::start(cluster.nodes[0].ns());
    for i in 0..n {
        let (svc, slice) = objects(i, 0);
        api.apply(&svc);
        api.apply(&slice);
    }
    let url = api.url();
    let mut agent = BenchAgent::start(&cluster, n, &["--source", "kubernetes", "--k8s-api-server", &url]);
    let first = agent.wait_for("synced kind=\"full\"", Duration::from_secs(600));
    let start_to_programmed_s = agent.started.elapsed().as_secs_f64();
    eprintln!("bench: {n} services, API watch, first sync: {first}");
    let (event_ms, event_p99_ms) = measure_changes(&agent, n, |i, salt| api.apply(&slice_object(i, salt)));
    let idle = measure_idle.then(|| {
        std::thread::sleep(Duration::from_secs(3));
        let (cpu0, _, _) = agent.usage();
        std::thread::sleep(IDLE);
        let (cpu1, rss, peak) = agent.usage();
        let reconcile = agent
            .log_text()
            .lines()
            .rfind(|l| l.contains("kind=\"reconcile\""))
            .map_or(f64::NAN, |l| field(l, "duration_ms"));
        (
            (cpu1 - cpu0).as_secs_f64() / IDLE.as_secs_f64() * 100.0,
            rss,
            peak,
            reconcile,
        )
    });
    AgentRow {
        services: n,
        source: "API watch",
        start_to_programmed_s,
        first_sync_s: field(&first, "duration_ms") / 1000.0,
        event_ms,
        event_p99_ms,
        idle,
    }
}

/// Writes `text` to `dir/name` atomically (as the agent expects writers to).
fn write_file(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

/// The agent fed by manifest files: 1000 Services per file, the slices of
/// the Services that change in files of their own (a file's reload costs
/// its size).
pub fn through_manifests(n: u32) -> AgentRow {
    let cluster = Cluster::new();
    let dir = std::env::temp_dir().join(format!("{}-bench-manifests", cluster.prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let changing: std::collections::BTreeSet<u32> = (0..CHANGES as u32).map(|c| c * 7919 % n).collect();
    let yaml = |v: &serde_json::Value| format!("---\n{}\n", serde_json::to_string(v).unwrap());
    for chunk in 0..n.div_ceil(1000) {
        let mut text = String::new();
        for i in chunk * 1000..((chunk + 1) * 1000).min(n) {
            let (svc, slice) = objects(i, 0);
            text += &yaml(&svc);
            if !changing.contains(&i) {
                text += &yaml(&slice);
            }
        }
        write_file(&dir, &format!("bulk-{chunk:04}.yaml"), &text);
    }
    for &i in &changing {
        write_file(&dir, &format!("slice-{i}.yaml"), &yaml(&slice_object(i, 0)));
    }
    let source = format!("manifests:{}", dir.display());
    let mut agent = BenchAgent::start(&cluster, n, &["--source", &source]);
    let first = agent.wait_for("synced kind=\"full\"", Duration::from_secs(600));
    let start_to_programmed_s = agent.started.elapsed().as_secs_f64();
    let (event_ms, event_p99_ms) = measure_changes(&agent, n, |i, salt| {
        write_file(&dir, &format!("slice-{i}.yaml"), &yaml(&slice_object(i, salt)))
    });
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
    AgentRow {
        services: n,
        source: "manifests",
        start_to_programmed_s,
        first_sync_s: field(&first, "duration_ms") / 1000.0,
        event_ms,
        event_p99_ms,
        idle: None,
    }
}

/// Rounds of the in-process measurement (interleaved over the sizes).
pub(crate) const ROUNDS: usize = 3;

/// Every control-plane measurement: in-process rounds interleaved over the
/// sizes, then an agent per size and source.
///
/// For quicker iterations: `--control-sizes 1000,100000` measures only those
/// sizes, `--control-parts in-process` (or `agent`, `api`, `manifests`) only
/// those parts, `--control-rounds N` another number of in-process rounds.
pub fn measure(sizes: &[u32]) -> (Vec<InProcess>, Vec<AgentRow>) {
    let arg = |name: &str| std::env::args().skip_while(|a| a != name).nth(1);
    let chosen: Vec<u32>;
    let sizes = match arg("--control-sizes") {
        Some(list) => {
            chosen = list
                .split(',')
                .map(|n| {
                    n.trim()
                        .parse()
                        .expect("--control-sizes: numbers, comma-separated")
                })
                .collect();
            &chosen[..]
        }
        None => sizes,
    };
    let parts = arg("--control-parts").unwrap_or_else(|| "in-process,agent".into());
    let part = |p: &str| {
        parts
            .split(',')
            .any(|x| x == p || (x == "agent" && (p == "api" || p == "manifests")))
    };
    let rounds_n = arg("--control-rounds").map_or(ROUNDS, |n| n.parse().expect("--control-rounds: a number"));
    let mut rounds: Vec<Vec<InProcess>> = sizes.iter().map(|_| Vec::new()).collect();
    for round in 0..if part("in-process") { rounds_n } else { 0 } {
        for (i, &n) in sizes.iter().enumerate() {
            eprintln!(
                "bench: control plane in-process, {n} services x {EPS} endpoints (round {})",
                round + 1
            );
            rounds[i].push(in_process(n));
        }
    }
    let ours = rounds
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(median_round)
        .collect();
    let mut agents = Vec::new();
    for &n in sizes {
        if part("api") {
            eprintln!(
                "bench: agent fed by the API watch, {n} services (then idle {} s)",
                IDLE.as_secs()
            );
            agents.push(through_api(n, true));
        }
        if part("manifests") {
            eprintln!("bench: agent fed by manifests, {n} services");
            agents.push(through_manifests(n));
        }
    }
    (ours, agents)
}

/// The round with the median programming time; change latencies pooled
/// from all rounds.
fn median_round(mut rounds: Vec<InProcess>) -> InProcess {
    rounds.sort_by(|a, b| a.program_all_s.partial_cmp(&b.program_all_s).unwrap());
    let min = rounds[0].program_all_s;
    let max = rounds[rounds.len() - 1].program_all_s;
    let mid = rounds.len() / 2;
    let mut r = rounds.swap_remove(mid);
    r.program_range = (min, max);
    r
}
