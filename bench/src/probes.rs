//! Health-check probes under slow clients: the agent's own
//! healthCheckNodePort server (`ServiceHealthServers` on its HTTP runtime)
//! in a network namespace, probed by a load balancer's pattern (a new
//! connection, `GET /`, the whole answer) with and without 500 slow and idle
//! clients holding connections; rounds interleaved.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use dataplane_agent::{
    agent::{
        health::{HealthState, ServiceHealthServers},
        http::ServerRuntime,
    },
    k8s::store::HealthCheck,
};
use dataplane_tests::netns::NetNs;

use crate::stat::{Stat, stat};

const PORT: u16 = 32000;
pub(crate) const SLOW_CLIENTS: usize = 500;
/// A probe every 10 ms (a load balancer probes every few seconds; many
/// probes make the percentiles meaningful).
pub(crate) const INTERVAL: Duration = Duration::from_millis(10);

pub struct ProbeRow {
    pub variant: &'static str,
    pub probes: usize,
    /// Each round's percentile, µs: median of the rounds (min–max).
    pub p50_us: Stat,
    pub p99_us: Stat,
    pub max_us: f64,
}

/// Probe latencies without and with the slow clients, `rounds` interleaved
/// rounds of `probes` probes each.
pub fn measure(rounds: usize, probes: usize) -> Vec<ProbeRow> {
    let ns = NetNs::new(&format!("{}-probes", dataplane_tests::unique_prefix()));
    let runtime = ServerRuntime::start().expect("HTTP runtime");
    let health = Arc::new(Mutex::new(HealthState {
        node_eligible: true,
        last_sync: Some(SystemTime::now()),
        ..Default::default()
    }));
    // A sync period long enough that the state stays healthy all along.
    let mut servers = ServiceHealthServers::new(
        &runtime,
        std::net::Ipv4Addr::LOCALHOST.into(),
        health,
        Duration::from_secs(3600),
    );
    let check = HealthCheck {
        namespace: "default".into(),
        name: "lb".into(),
        port: PORT,
        local_endpoints: 1,
    };
    let failed = ns.run(|| servers.update(std::slice::from_ref(&check)));
    assert!(failed.is_empty(), "health server: {failed:?}");
    let addr: SocketAddr = ([127, 0, 0, 1], PORT).into();
    let variants = ["no other clients", "500 slow and idle clients connected"];
    let mut per_variant: Vec<(Vec<f64>, Vec<f64>, f64)> = vec![(Vec::new(), Vec::new(), 0.0); 2];
    for round in 0..rounds {
        for (v, name) in variants.iter().enumerate() {
            eprintln!("bench: probes, round {}, {name}", round + 1);
            let attack = (v == 1).then(|| SlowClients::start(&ns, addr));
            let mut lat = probe(&ns, addr, probes);
            drop(attack);
            lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let at = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize];
            per_variant[v].0.push(at(0.5));
            per_variant[v].1.push(at(0.99));
            per_variant[v].2 = per_variant[v].2.max(lat[lat.len() - 1]);
        }
    }
    drop(servers);
    variants
        .iter()
        .zip(per_variant)
        .map(|(variant, (p50, p99, max))| ProbeRow {
            variant,
            probes: rounds * probes,
            p50_us: stat(p50),
            p99_us: stat(p99),
            max_us: max,
        })
        .collect()
}

/// µs from connect to the last byte of the answer, for each probe.
fn probe(ns: &NetNs, addr: SocketAddr, n: usize) -> Vec<f64> {
    ns.run(|| {
        (0..n)
            .map(|i| {
                let started = Instant::now();
                let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                    .unwrap_or_else(|e| panic!("probe {i}: {e}"));
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                s.write_all(b"GET / HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n")
                    .unwrap();
                let mut answer = Vec::new();
                s.read_to_end(&mut answer)
                    .unwrap_or_else(|e| panic!("probe {i} not answered: {e}"));
                let took = started.elapsed();
                assert!(
                    answer.starts_with(b"HTTP/1.1 200"),
                    "probe {i}: {:?}",
                    String::from_utf8_lossy(&answer)
                );
                std::thread::sleep(INTERVAL.saturating_sub(took));
                took.as_secs_f64() * 1e6
            })
            .collect()
    })
}

/// Half send a request line and then a header line a second; half send
/// nothing. Closed on drop.
struct SlowClients {
    stop: Arc<AtomicBool>,
    drip: Option<std::thread::JoinHandle<()>>,
}

impl SlowClients {
    fn start(ns: &NetNs, addr: SocketAddr) -> Self {
        let conns: Vec<TcpStream> = ns.run(|| {
            (0..SLOW_CLIENTS)
                .map(|i| {
                    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("slow client {i}: {e}"));
                    if i % 2 == 0 {
                        s.write_all(b"GET / HTTP/1.1\r\nHost: lb\r\n").unwrap();
                    }
                    s
                })
                .collect()
        });
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let drip = std::thread::spawn(move || {
            let mut n = 0;
            while !stop2.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                n += 1;
                if n % 10 == 0 {
                    for s in conns.iter().step_by(2) {
                        let _ = (&*s).write_all(format!("X-Slow-{n}: y\r\n").as_bytes());
                    }
                }
            }
        });
        Self {
            stop,
            drip: Some(drip),
        }
    }
}

impl Drop for SlowClients {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(d) = self.drip.take() {
            let _ = d.join();
        }
    }
}
