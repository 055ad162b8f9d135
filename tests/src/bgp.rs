//! BIRD 2 (Debian's `bird2`) in the sandbox's namespaces: the nodes'
//! speakers (configured by their agents) and the router that peers with
//! them. A [`Bird`] is killed on drop; its files live in a directory of its
//! own, removed on drop.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::Duration,
};

use crate::netns::NetNs;

/// The router's and the nodes' AS numbers in the sandbox.
pub const ROUTER_ASN: u32 = 64500;
pub const NODE_ASN: u32 = 64512;

/// A directory for BIRD's files, removed on drop.
pub struct BirdDir(PathBuf);

impl BirdDir {
    pub fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("{prefix}bird"));
        std::fs::create_dir_all(&dir).expect("BIRD's directory");
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for BirdDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `bird -f` in a namespace.
pub struct Bird {
    child: Option<Child>,
    pub socket: PathBuf,
    pub config: PathBuf,
    pub log: PathBuf,
    ns: String,
}

impl Bird {
    /// Starts BIRD in `ns` on `config`, its control socket and log beside
    /// it; waits until the socket answers.
    pub fn start(ns: &NetNs, config: &Path) -> Self {
        let socket = config.with_extension("ctl");
        let log = config.with_extension("log");
        let mut b = Self {
            child: None,
            socket,
            config: config.to_owned(),
            log,
            ns: ns.name().to_owned(),
        };
        b.spawn();
        b
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(&self.log).expect("BIRD's log");
        let child = std::process::Command::new("ip")
            .args(["netns", "exec", &self.ns, "bird", "-f", "-c"])
            .arg(&self.config)
            .arg("-s")
            .arg(&self.socket)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run bird (Debian's bird2; `cargo xtask setup`): {e}"));
        self.child = Some(child);
        for _ in 0..200 {
            if self
                .try_birdc("show status")
                .is_some_and(|s| s.contains("Daemon is up"))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!(
            "BIRD did not come up on {}:\n{}",
            self.config.display(),
            self.log_text()
        );
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn try_birdc(&self, command: &str) -> Option<String> {
        let out = std::process::Command::new("birdc")
            .arg("-s")
            .arg(&self.socket)
            .args(command.split_whitespace())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `birdc` on this instance's socket.
    pub fn birdc(&self, command: &str) -> String {
        self.try_birdc(command)
            .unwrap_or_else(|| panic!("birdc {command} failed\n{}", self.log_text()))
    }

    /// Kills BIRD (SIGKILL: a crash; its sessions' TCP connections close).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    /// Starts it again on the same files.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The router's configuration: sessions with `nodes` (passive: the nodes
/// connect), routes learned into its kernel table with ECMP (`merge
/// paths`), BFD at 100 ms × 3 when `bfd`.
pub fn router_config(router: Ipv4Addr, nodes: &[Ipv4Addr], bfd: bool, hold_time: u32) -> String {
    let mut c = format!(
        "router id {router};\n\
         protocol device {{ scan time 10; }}\n\
         protocol kernel {{ ipv4 {{ import none; export all; }}; merge paths on; }}\n"
    );
    if bfd {
        c.push_str(
            "protocol bfd { interface \"*\" { min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }; }\n",
        );
    }
    for (i, n) in nodes.iter().enumerate() {
        c.push_str(&format!(
            "protocol bgp node{} {{ local {router} as {ROUTER_ASN}; neighbor {n} as {NODE_ASN}; hold time {hold_time}; \
             connect retry time 1; error wait time 1, 5; {}ipv4 {{ import all; export none; }}; }}\n",
            i + 1,
            if bfd { "bfd on; " } else { "" }
        ));
    }
    c
}

/// The next hops of `prefix` in `ns`'s main table (empty: no route).
pub fn next_hops(ns: &NetNs, prefix: &str) -> Vec<Ipv4Addr> {
    let out = ns
        .command("ip")
        .args(["-j", "route", "show", prefix])
        .output()
        .expect("ip route");
    let routes: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let mut hops: Vec<Ipv4Addr> = Vec::new();
    for r in routes.as_array().into_iter().flatten() {
        if let Some(g) = r["gateway"].as_str().and_then(|g| g.parse().ok()) {
            hops.push(g);
        }
        for h in r["nexthops"].as_array().into_iter().flatten() {
            if let Some(g) = h["gateway"].as_str().and_then(|g| g.parse().ok()) {
                hops.push(g);
            }
        }
    }
    hops.sort();
    hops
}
