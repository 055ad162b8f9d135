//! End to end through a node, against kube-proxy's rule sets: Debian's
//! `wrk` (epoll, concurrent connections) in the client namespace and
//! `nginx` (event-driven) in the server pod, each pinned to its own CPU; new
//! connections (`Connection: close`) and keep-alive; a fresh sandbox per
//! measurement; variants interleaved round by round. The CPUs' time split
//! (user vs kernel) is recorded to show what bounds the direct baseline,
//! and our datapath's drop counters are read after every run.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use dataplane_agent::{
    dataplane::{LoadOptions, XdpMode},
    net::Protocol,
};
use dataplane_common::stats::{Event, FlowStat};
use dataplane_tests::{
    cluster::Cluster,
    services::{NodeDatapath, TestEndpoint, TestService},
};

use crate::{
    kube_proxy::{iptables_rules, nft_rules, run_stdin, services},
    stat::{Stat, stat},
};

const MEASURED_VIP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 1);
const NODE_PORT: u16 = 30080;
const POD_PORT: u16 = 8080;
/// wrk's connections in flight and threads.
pub(crate) const CONNECTIONS: u32 = 16;

/// Filler Service i: VIP 10.96.x.y, endpoints 10.160.x.y.k (never used).
fn filler(i: u32) -> TestService {
    let ip = |base: Ipv4Addr, off: u32| Ipv4Addr::from(u32::from(base) + off);
    TestService::new(i, "filler", Protocol::Tcp, 80)
        .cluster_ip(ip(Ipv4Addr::new(10, 96, 0, 0), i))
        .endpoint(TestEndpoint::ready(
            ip(Ipv4Addr::new(10, 160, 0, 0), 2 * i),
            POD_PORT,
            1,
        ))
        .endpoint(TestEndpoint::ready(
            ip(Ipv4Addr::new(10, 160, 0, 1), 2 * i),
            POD_PORT,
            1,
        ))
}

/// One line of the table: what is measured, with how many Services.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Client → pod IP, routed by the node, nothing attached.
    Direct,
    /// Client → ClusterIP, masqueraded (the client is off-cluster).
    Masqueraded,
    /// The same in native XDP (the sandbox's veth peers run XDP).
    MasqueradedXdp,
    /// The same in TC with host routing (`--host-routing`).
    MasqueradedHostRouting,
    /// Client → NodePort of an eTP=Local Service: no SNAT.
    LocalNodePort,
    /// Client → pod IP with the datapath attached: non-service traffic.
    NonService,
    /// kube-proxy's nftables rules, the Service's map entry among N.
    Nftables,
    /// kube-proxy's iptables-legacy rules, the Service last of N.
    IptablesLast,
    /// A pod on the node → another pod on it, directly.
    PodDirect,
    /// A pod → a ClusterIP with its endpoint on the same node.
    PodClusterIp,
    /// The same with host routing.
    PodClusterIpHostRouting,
}

impl Variant {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Variant::Direct => "direct to the pod",
            Variant::Masqueraded => "ours: ClusterIP from outside (masqueraded), TC",
            Variant::MasqueradedXdp => "ours: ClusterIP from outside (masqueraded), native XDP",
            Variant::MasqueradedHostRouting => "ours: ClusterIP from outside (masqueraded), TC, host routing",
            Variant::LocalNodePort => "ours: eTP=Local NodePort (no SNAT)",
            Variant::NonService => "ours attached: non-service traffic (direct to the pod)",
            Variant::Nftables => "kube-proxy nftables",
            Variant::IptablesLast => "kube-proxy iptables-legacy, Service last",
            Variant::PodDirect => "pod → pod direct",
            Variant::PodClusterIp => "ours: pod → ClusterIP",
            Variant::PodClusterIpHostRouting => "ours: pod → ClusterIP, host routing",
        }
    }

    /// Whether `name` (the variant's name in lowercase) names it.
    pub fn is(self, name: &str) -> bool {
        format!("{self:?}").eq_ignore_ascii_case(name)
    }

    pub(crate) fn ours(self) -> bool {
        !matches!(
            self,
            Variant::Direct | Variant::Nftables | Variant::IptablesLast | Variant::PodDirect
        )
    }

    /// The baseline a ratio is taken against.
    pub(crate) fn baseline(self) -> Variant {
        match self {
            Variant::PodDirect | Variant::PodClusterIp | Variant::PodClusterIpHostRouting => {
                Variant::PodDirect
            }
            _ => Variant::Direct,
        }
    }
}

/// New connections per request, or one connection for many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Close,
    KeepAlive,
}

impl Mode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Close => "new connections",
            Mode::KeepAlive => "keep-alive",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub services: u32,
    pub variant: Variant,
    pub mode: Mode,
}

/// What one run measured.
#[derive(Clone, Debug, Default)]
pub(super) struct Sample {
    pub(super) requests_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// wrk's socket errors (connect, read, write, timeout) and non-2xx.
    pub(super) errors: u64,
    /// Per CPU: (busy share, kernel share of the busy time).
    pub cpus: Vec<(f64, f64)>,
    /// Share of one CPU that wrk and the nginx serving the measured
    /// Service spent in user space.
    pub wrk_user: f64,
    pub nginx_user: f64,
    /// Our datapath: dropped packets (any reason), and SNAT exhaustion.
    pub drops: u64,
    pub snat_exhausted: u64,
    pub flows: Vec<(FlowStat, u64)>,
    /// With `Stats`: each loaded program's (name, runs, ns) during the run.
    pub programs: Vec<(String, u64, u64)>,
}

pub struct Row {
    pub case: Case,
    pub rate: Stat,
    pub p50: Stat,
    pub p99: Stat,
    pub errors: u64,
    pub drops: u64,
    pub snat_exhausted: u64,
    /// Median of the rounds' CPU shares.
    pub cpus: Vec<(f64, f64)>,
    pub wrk_user: f64,
    pub nginx_user: f64,
    pub flows: Vec<(FlowStat, u64)>,
}

/// An nginx in a pod namespace, pinned to `cpu`; stopped on drop.
pub(super) struct Nginx {
    pub(super) child: Child,
    dir: PathBuf,
}

/// User-space CPU seconds of process `pid` so far.
fn user_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces): state is field 3,
    // utime field 14.
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let utime: f64 = after
        .split_whitespace()
        .nth(11)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    utime / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// User-space CPU seconds of this process's waited-for children.
fn children_user_seconds() -> f64 {
    // SAFETY: getrusage fills the zeroed struct.
    unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut u);
        u.ru_utime.tv_sec as f64 + u.ru_utime.tv_usec as f64 / 1e6
    }
}

impl Nginx {
    /// One worker on `cpu`, listening on each of `addrs`.
    pub(super) fn start(ns: &str, addrs: &[SocketAddrV4], cpu: usize) -> Self {
        let dir = std::env::temp_dir().join(format!("dp-bench-nginx-{ns}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("nginx dir");
        let conf = format!(
            "worker_processes 1;\ndaemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
             events {{ worker_connections 8192; }}\n\
             http {{\n access_log off;\n client_body_temp_path {d};\n proxy_temp_path {d};\n fastcgi_temp_path {d};\n \
             uwsgi_temp_path {d};\n scgi_temp_path {d};\n keepalive_requests 1000000;\n \
             server {{ {listen}location / {{ return 200 \"ok\\n\"; }} }}\n}}\n",
            d = dir.display(),
            listen = addrs
                .iter()
                .map(|a| format!("listen {a} backlog=8192; "))
                .collect::<String>()
        );
        let conf_path = dir.join("nginx.conf");
        std::fs::write(&conf_path, conf).expect("nginx.conf");
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "taskset",
                "-c",
                &cpu.to_string(),
                "nginx",
                "-c",
            ])
            .arg(&conf_path)
            .args(["-p", &dir.display().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("nginx (cargo xtask setup installs nginx-light)");
        let n = Self { child, dir };
        // Listening when a connect to each address succeeds.
        let probe = addrs
            .iter()
            .map(|a| format!("exec 3<>/dev/tcp/{}/{} && exec 3>&-", a.ip(), a.port()))
            .collect::<Vec<_>>()
            .join(" && ");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let up = Command::new("ip")
                .args(["netns", "exec", ns, "bash", "-c"])
                .arg(&probe)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if up {
                return n;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "nginx did not start in {ns}: {}",
            std::fs::read_to_string(n.dir.join("error.log")).unwrap_or_default()
        );
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Per-CPU (busy jiffies, kernel jiffies, total jiffies) from /proc/stat.
fn cpu_times() -> Vec<(u64, u64, u64)> {
    std::fs::read_to_string("/proc/stat")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
        .map(|l| {
            let v: Vec<u64> = l
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            // user nice system idle iowait irq softirq steal
            let get = |i: usize| v.get(i).copied().unwrap_or(0);
            let total: u64 = v.iter().take(8).sum();
            let idle = get(3) + get(4);
            let kernel = get(2) + get(5) + get(6);
            (total - idle, kernel, total)
        })
        .collect()
}

/// Runs wrk from `ns` against `dst` for `duration`, watching `server`'s
/// CPU time too.
pub(super) fn wrk(ns: &str, dst: SocketAddrV4, mode: Mode, duration: Duration, server: u32) -> Sample {
    let (wrk_before, nginx_before) = (children_user_seconds(), user_seconds(server));
    let started = Instant::now();
    let before = cpu_times();
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, "taskset", "-c", "0", "wrk", "-t1"])
        .arg(format!("-c{CONNECTIONS}"))
        .arg(format!("-d{}s", duration.as_secs()))
        .args(["--latency", "--timeout", "2s"]);
    if mode == Mode::Close {
        cmd.args(["-H", "Connection: close"]);
    }
    let out = cmd
        .arg(format!("http://{dst}/"))
        .output()
        .expect("wrk (cargo xtask setup installs it)");
    let after = cpu_times();
    let wall = started.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "wrk: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut s = parse_wrk(&text, &before, &after);
    s.wrk_user = (children_user_seconds() - wrk_before) / wall;
    s.nginx_user = (user_seconds(server) - nginx_before) / wall;
    s
}

fn parse_wrk(text: &str, before: &[(u64, u64, u64)], after: &[(u64, u64, u64)]) -> Sample {
    let mut s = Sample::default();
    let us = |v: &str| -> f64 {
        let (num, unit) = v.split_at(v.find(|c: char| c.is_alphabetic()).unwrap_or(v.len()));
        let n: f64 = num.parse().unwrap_or(0.0);
        match unit {
            "us" => n,
            "ms" => n * 1e3,
            "s" => n * 1e6,
            _ => n,
        }
    };
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["Requests/sec:", v] => s.requests_per_s = v.parse().unwrap_or(0.0),
            ["50%", v] => s.p50_us = us(v),
            ["99%", v] => s.p99_us = us(v),
            ["Socket", "errors:", rest @ ..] => {
                s.errors += rest
                    .iter()
                    .filter_map(|x| x.trim_end_matches(',').parse::<u64>().ok())
                    .sum::<u64>();
            }
            ["Non-2xx", "or", "3xx", "responses:", n] => s.errors += n.parse::<u64>().unwrap_or(0),
            _ => {}
        }
    }
    s.cpus = before
        .iter()
        .zip(after)
        .map(|(b, a)| {
            let (busy, kernel, total) = (a.0 - b.0, a.1 - b.1, (a.2 - b.2).max(1));
            (busy as f64 / total as f64, kernel as f64 / busy.max(1) as f64)
        })
        .collect();
    s
}

/// One measurement in a fresh sandbox (as BENCHMARKING.md advises: a reused
/// node namespace keeps netfilter state from the previous variant).
fn once(case: Case, duration: Duration, stats: Stats) -> Sample {
    let Case {
        services: n,
        variant,
        mode,
    } = case;
    let mut cluster = Cluster::new();
    cluster.add_pod(0, "a");
    cluster.add_pod(0, "c"); // the client pod of the pod variants
    for p in &cluster.pods {
        // Server-side TIME_WAIT would refuse reused (masqueraded) tuples.
        p.ns.sysctl("net/ipv4/tcp_max_tw_buckets", "0");
    }
    cluster.client.ns.sysctl("net/ipv4/tcp_max_tw_buckets", "0");
    cluster.route_from_client("10.96.0.0/11", 0);
    cluster.route_from_client("10.244.1.0/24", 0);
    // Both endpoints of the measured Service are one nginx in pod a, on two
    // ports: the Service's backend choice is made among 2, and every variant,
    // the direct baseline included, is served by the same single process on
    // CPU 1 (two nginx processes sharing CPU 1 take turns by scheduler
    // slices: connections to the one not running wait ~4 ms).
    let a = cluster.pod("a");
    let eps = [
        SocketAddrV4::new(a.ip, POD_PORT),
        SocketAddrV4::new(a.ip, POD_PORT + 1),
    ];
    let server = Nginx::start(a.ns.name(), &eps, 1);
    let node_ns = cluster.nodes[0].ns().name().to_owned();
    let mut node: Option<NodeDatapath> = None;
    let dst = match variant {
        Variant::Direct | Variant::PodDirect => eps[0],
        Variant::Nftables => {
            run_stdin(&node_ns, "nft", &["-f", "-"], &nft_rules(&services(n, &eps, 2)));
            SocketAddrV4::new(MEASURED_VIP, 80)
        }
        Variant::IptablesLast => {
            run_stdin(
                &node_ns,
                "iptables-legacy-restore",
                &[],
                &iptables_rules(&services(n, &eps, 2)),
            );
            SocketAddrV4::new(MEASURED_VIP, 80)
        }
        _ => {
            let xdp = if variant == Variant::MasqueradedXdp {
                XdpMode::Native
            } else {
                XdpMode::Auto
            };
            let opts = LoadOptions {
                max_services: n + 16,
                max_backends: 2 * n + 16,
                max_service_entries: 4 * n + 64,
                ct_entries: 262_144,
                affinity_entries: 1024,
                ipv6: true,
            };
            let mut dp = cluster.start_datapath_with(0, &opts, xdp);
            if matches!(
                variant,
                Variant::MasqueradedHostRouting | Variant::PodClusterIpHostRouting
            ) {
                dp.config.host_routing = true;
                dp.reconfigure();
            }
            let mut measured = TestService::new(0, "measured", Protocol::Tcp, 80)
                .cluster_ip(MEASURED_VIP)
                .endpoint(TestEndpoint::ready(*eps[0].ip(), eps[0].port(), 0))
                .endpoint(TestEndpoint::ready(*eps[1].ip(), eps[1].port(), 0));
            if variant == Variant::LocalNodePort {
                measured = measured.node_port(NODE_PORT).external_local();
            }
            let mut svcs = vec![measured];
            svcs.extend((1..n).map(filler));
            let refs: Vec<&TestService> = svcs.iter().collect();
            dp.program(&refs);
            node = Some(dp);
            match variant {
                Variant::LocalNodePort => SocketAddrV4::new(cluster.nodes[0].ip(), NODE_PORT),
                Variant::NonService => eps[0],
                _ => SocketAddrV4::new(MEASURED_VIP, 80),
            }
        }
    };
    let from = match variant {
        Variant::PodDirect | Variant::PodClusterIp | Variant::PodClusterIpHostRouting => {
            cluster.pod("c").ns.name().to_owned()
        }
        _ => cluster.client.ns.name().to_owned(),
    };
    // Warm-up: ARP, caches, first connections.
    let server = server.child.id();
    let _ = wrk(&from, dst, mode, Duration::from_secs(1), server);
    let before = node.as_ref().map(counters);
    // DP_BENCH_PERF=DIR: a system-wide profile of each measured run, in
    // DIR/<variant>-<mode>.data (for finding where a path's time goes).
    let perf = std::env::var_os("DP_BENCH_PERF").map(|dir| {
        let out = PathBuf::from(dir).join(format!("{variant:?}-{mode:?}.data"));
        Command::new("perf")
            .args(["record", "-a", "-g", "-q", "-o"])
            .arg(out)
            .stdout(Stdio::null())
            .spawn()
            .expect("perf")
    });
    // The kernel clocks every BPF program run while this fd is open.
    let clocked = (stats == Stats::On)
        .then(|| match aya::sys::enable_stats(aya::sys::Stats::RunTime) {
            Ok(fd) => Some((fd, program_times())),
            Err(e) => {
                eprintln!("bench: BPF_ENABLE_STATS: {e}; programs not clocked");
                None
            }
        })
        .flatten();
    let mut s = wrk(&from, dst, mode, duration, server);
    if let Some((fd, before)) = clocked {
        let after = program_times();
        drop(fd);
        s.programs = program_deltas(&before, after);
    }
    if let Some(mut p) = perf {
        // SAFETY: signals our own child.
        unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
        let _ = p.wait();
    }
    if let (Some(dp), Some(before)) = (&node, before) {
        let after = counters(dp);
        s.drops = after.0 - before.0;
        s.snat_exhausted = after.1 - before.1;
        s.flows = after
            .2
            .iter()
            .zip(&before.2)
            .map(|((k, a), (_, b))| (*k, a - b))
            .collect();
    }
    s
}

/// Whether a run clocks the BPF programs (`BPF_ENABLE_STATS`): two clock
/// reads per program run, so such runs stay out of the ratios.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stats {
    Off,
    On,
}

/// The BPF programs the sandbox loads (the kernel keeps 15 characters of a
/// name): ours, and the harness's pass-through `xdp_floor`.
const CLOCKED: [&str; 13] = [
    "xdp_floor",
    "xdp_ingress",
    "tc_ingress",
    "tc_pod_ingress",
    "tc_egress",
    "sock_connect4",
    "sock_sendmsg4",
    "sock_recvmsg4",
    "sock_getpeernam",
    "sock_connect6",
    "sock_sendmsg6",
    "sock_recvmsg6",
    "tc_floor",
];

/// (id, name, runs, ns) of each loaded program named in [`CLOCKED`].
fn program_times() -> Vec<(u32, String, u64, u64)> {
    programs_named(&CLOCKED)
}

/// (id, name, runs, ns) of each loaded program named in `names` (as the
/// kernel keeps them: 15 characters).
pub(super) fn programs_named(names: &[&str]) -> Vec<(u32, String, u64, u64)> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter_map(|p| {
            let name = p.name_as_str()?.to_owned();
            names
                .contains(&name.as_str())
                .then(|| (p.id(), name, p.run_count(), p.run_time().as_nanos() as u64))
        })
        .collect()
}

/// What each program (by name) ran between two [`program_times`]: by id,
/// so a program loaded in between counts from zero and one unloaded in
/// between is left out.
pub(super) fn program_deltas(
    before: &[(u32, String, u64, u64)],
    after: Vec<(u32, String, u64, u64)>,
) -> Vec<(String, u64, u64)> {
    let mut v: Vec<(String, u64, u64)> = Vec::new();
    for (id, name, runs, ns) in after {
        let (r0, n0) = before.iter().find(|b| b.0 == id).map_or((0, 0), |b| (b.2, b.3));
        let (runs, ns) = (runs.saturating_sub(r0), ns.saturating_sub(n0));
        match v.iter_mut().find(|x| x.0 == name) {
            Some(x) => {
                x.1 += runs;
                x.2 += ns;
            }
            None => v.push((name, runs, ns)),
        }
    }
    v.retain(|p| p.1 > 0);
    v
}

/// Our programs' own time under load: one clocked run of each case.
pub struct Cost {
    pub case: Case,
    pub rate: f64,
    pub requests: f64,
    pub programs: Vec<(String, u64, u64)>,
}

pub fn program_costs(duration: Duration, services: u32) -> Vec<Cost> {
    let c = |variant, mode| Case {
        services,
        variant,
        mode,
    };
    [
        c(Variant::Masqueraded, Mode::Close),
        c(Variant::Masqueraded, Mode::KeepAlive),
        c(Variant::NonService, Mode::KeepAlive),
    ]
    .into_iter()
    .map(|case| {
        eprintln!(
            "bench: end to end, programs clocked: {}, {}",
            case.variant.name(),
            case.mode.name()
        );
        let s = once(case, duration, Stats::On);
        Cost {
            case,
            rate: s.requests_per_s,
            requests: s.requests_per_s * duration.as_secs_f64(),
            programs: s.programs,
        }
    })
    .collect()
}

/// (dropped packets, SNAT exhaustion drops, flow stats) of a datapath.
fn counters(dp: &NodeDatapath) -> (u64, u64, Vec<(FlowStat, u64)>) {
    let maps = dp.datapath.maps();
    let drops = maps
        .counters()
        .unwrap()
        .iter()
        .filter(|(e, _)| e.is_drop())
        .map(|(_, c)| c.packets)
        .sum();
    let snat = maps.counter(Event::DropSnatExhausted).unwrap().packets;
    (drops, snat, maps.flow_stats().unwrap())
}

/// The cases of a full (or quick) run.
pub fn cases(quick: bool) -> Vec<Case> {
    let c = |services, variant, mode| Case {
        services,
        variant,
        mode,
    };
    let big = if quick { 1_000 } else { 10_000 };
    let mut v = vec![
        c(1, Variant::Direct, Mode::Close),
        c(1, Variant::Masqueraded, Mode::Close),
    ];
    if !quick {
        v.push(c(1_000, Variant::Masqueraded, Mode::Close));
    }
    v.extend([
        c(big, Variant::Masqueraded, Mode::Close),
        c(big, Variant::MasqueradedXdp, Mode::Close),
        c(big, Variant::MasqueradedHostRouting, Mode::Close),
        c(big, Variant::LocalNodePort, Mode::Close),
        c(big, Variant::NonService, Mode::Close),
        c(big, Variant::Nftables, Mode::Close),
        c(big, Variant::IptablesLast, Mode::Close),
        c(1, Variant::PodDirect, Mode::Close),
        c(big, Variant::PodClusterIp, Mode::Close),
        c(big, Variant::PodClusterIpHostRouting, Mode::Close),
        c(1, Variant::Direct, Mode::KeepAlive),
        c(big, Variant::NonService, Mode::KeepAlive),
        c(big, Variant::Masqueraded, Mode::KeepAlive),
        c(big, Variant::MasqueradedHostRouting, Mode::KeepAlive),
        c(big, Variant::Nftables, Mode::KeepAlive),
    ]);
    v
}

/// Runs every case `rounds` times, interleaved (A B C A B C ...).
pub fn run(cases: &[Case], rounds: usize, duration: Duration) -> Vec<Row> {
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); cases.len()];
    for round in 0..rounds {
        for (i, case) in cases.iter().enumerate() {
            eprintln!(
                "bench: end to end, round {}/{rounds}: {} Services, {}, {}",
                round + 1,
                case.services,
                case.variant.name(),
                case.mode.name()
            );
            samples[i].push(once(*case, duration, Stats::Off));
        }
    }
    cases
        .iter()
        .zip(samples)
        .map(|(case, s)| {
            let cpu_count = s[0].cpus.len();
            let cpus = (0..cpu_count)
                .map(|k| {
                    (
                        stat(s.iter().map(|x| x.cpus[k].0).collect()).median,
                        stat(s.iter().map(|x| x.cpus[k].1).collect()).median,
                    )
                })
                .collect();
            let mut flows: Vec<(FlowStat, u64)> = Vec::new();
            for x in &s {
                for (k, n) in &x.flows {
                    match flows.iter_mut().find(|(f, _)| f == k) {
                        Some((_, total)) => *total += n,
                        None => flows.push((*k, *n)),
                    }
                }
            }
            Row {
                case: *case,
                rate: stat(s.iter().map(|x| x.requests_per_s).collect()),
                p50: stat(s.iter().map(|x| x.p50_us).collect()),
                p99: stat(s.iter().map(|x| x.p99_us).collect()),
                errors: s.iter().map(|x| x.errors).sum(),
                wrk_user: stat(s.iter().map(|x| x.wrk_user).collect()).median,
                nginx_user: stat(s.iter().map(|x| x.nginx_user).collect()).median,
                drops: s.iter().map(|x| x.drops).sum(),
                snat_exhausted: s.iter().map(|x| x.snat_exhausted).sum(),
                cpus,
                flows,
            }
        })
        .collect()
}

/// Sustained masqueraded churn for `duration` (the SNAT port space goes
/// round several times), against the same load without SNAT.
pub fn sustained(duration: Duration, services: u32) -> Vec<Row> {
    let cases = [
        Case {
            services,
            variant: Variant::Masqueraded,
            mode: Mode::Close,
        },
        Case {
            services,
            variant: Variant::LocalNodePort,
            mode: Mode::Close,
        },
    ];
    run(&cases, 1, duration)
}
