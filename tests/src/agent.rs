//! Agents as processes on the sandbox's nodes (`ip netns exec NODE agent
//! run ...`), fed by a manifests directory the test edits.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddrV4, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use crate::{
    cluster::{CLUSTER_CIDR, Cluster},
    netns::NetNs,
    services::SERVICE_CIDR,
};

pub const HEALTH_PORT: u16 = 10256;
pub const METRICS_PORT: u16 = 10249;

/// A directory of manifests, removed on drop. Writes are atomic (rename), so
/// the agent never reads half a file.
#[derive(Debug)]
pub struct ManifestDir {
    path: PathBuf,
}

impl ManifestDir {
    pub fn new(prefix: &str) -> Self {
        let path = std::env::temp_dir().join(format!("{prefix}-manifests"));
        std::fs::create_dir_all(&path).expect("create manifests dir");
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes (or replaces) `name` with `yaml`.
    pub fn write(&self, name: &str, yaml: &str) {
        let tmp = self.path.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, yaml).expect("write manifest");
        std::fs::rename(&tmp, self.path.join(name)).expect("rename manifest");
    }

    pub fn remove(&self, name: &str) {
        let _ = std::fs::remove_file(self.path.join(name));
    }
}

impl Drop for ManifestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A running agent; stopped (SIGTERM) on drop. Its pins stay under the
/// sandbox's bpffs directory, which the sandbox removes.
#[derive(Debug)]
pub struct AgentProcess {
    child: Option<Child>,
    pub node: usize,
    pub node_ip: std::net::Ipv4Addr,
    pub log: PathBuf,
    /// Its `--bpffs-dir`.
    pub pin_dir: PathBuf,
    bin: String,
    args: Vec<String>,
    ns: String,
    /// `sh` commands run in its private mount namespace before it starts
    /// (`NetNs::command_after`): the machine's cgroup2 mount by default.
    mounts: String,
}

impl Cluster {
    /// Starts the agent on node `node` with the sandbox's settings, reading
    /// `manifests`, and waits until it has synced (its /healthz answers 200).
    /// `bin` is the agent binary: `env!("CARGO_BIN_EXE_agent")` in a test
    /// (this package's copy of `dataplane-agent`, always current).
    pub fn start_agent(
        &self,
        bin: &str,
        node: usize,
        manifests: &ManifestDir,
        extra: &[&str],
    ) -> AgentProcess {
        let source = format!("manifests:{}", manifests.path().display());
        self.start_agent_with_source(bin, node, &source, extra)
    }

    /// As [`Cluster::start_agent`], with any `--source` (e.g. `kubernetes`).
    pub fn start_agent_with_source(
        &self,
        bin: &str,
        node: usize,
        source: &str,
        extra: &[&str],
    ) -> AgentProcess {
        let mounts = crate::cgroup::system_mount_script();
        self.spawn_agent(bin, node, source, extra, &[], &mounts, true)
    }

    /// As [`Cluster::start_agent_with_source`], without the sandbox's
    /// settings `omit` names (e.g. `--service-cidr`).
    pub fn start_agent_omitting(
        &self,
        bin: &str,
        node: usize,
        source: &str,
        extra: &[&str],
        omit: &[&str],
    ) -> AgentProcess {
        let mounts = crate::cgroup::system_mount_script();
        self.spawn_agent(bin, node, source, extra, omit, &mounts, true)
    }

    /// As [`Cluster::start_agent`], with no `--cgroup-path` unless `extra`
    /// has one (the agent chooses a cgroup2 mount itself and attaches at its
    /// root), after the `sh` commands `mounts` ran in the agent's private
    /// mount namespace instead of the usual ones. `mounts` must leave only
    /// sandbox cgroups in its view (bind mounts of them): never the root
    /// cgroup.
    pub fn start_agent_with_mounts(
        &self,
        bin: &str,
        node: usize,
        manifests: &ManifestDir,
        extra: &[&str],
        mounts: &str,
    ) -> AgentProcess {
        let source = format!("manifests:{}", manifests.path().display());
        self.spawn_agent(bin, node, &source, extra, &[], mounts, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn spawn_agent(
        &self,
        bin: &str,
        node: usize,
        source: &str,
        extra: &[&str],
        omit: &[&str],
        mounts: &str,
        cgroup_none_by_default: bool,
    ) -> AgentProcess {
        let n = &self.nodes[node];
        let pin_dir = self.bpffs.path().join(&n.name);
        // A dual-stack node is described by both families, as kube-proxy's
        // dual-stack nodes are.
        let both = |v4: &str, v6: &str| {
            if self.dual_stack {
                format!("{v4},{v6}")
            } else {
                v4.to_owned()
            }
        };
        let node_ips = both(
            &n.ip().to_string(),
            &n.host.ip6.map(|a| a.to_string()).unwrap_or_default(),
        );
        let cluster_cidr = both(CLUSTER_CIDR, crate::cluster::CLUSTER_CIDR6);
        let service_cidr = both(SERVICE_CIDR, crate::services::SERVICE_CIDR6);
        let pins = pin_dir.display().to_string();
        let health = format!("0.0.0.0:{HEALTH_PORT}");
        let metrics = format!("{}:{METRICS_PORT}", n.ip());
        // The sandbox's settings, each of which `extra` may replace.
        let defaults: [(&str, &str); 11] = [
            ("--node-name", &n.name),
            ("--node-ip", &node_ips),
            // No --devices: the device holding the node IP (eth0) is found.
            ("--bpffs-dir", &pins),
            ("--source", source),
            ("--cluster-cidr", &cluster_cidr),
            ("--service-cidr", &service_cidr),
            ("--health-bind-address", &health),
            ("--metrics-bind-address", &metrics),
            ("--max-services", "256"),
            ("--max-backends", "1024"),
            ("--conntrack-entries", "16384"),
        ];
        let mut args = vec!["run".to_owned()];
        for (flag, value) in defaults {
            if !extra.contains(&flag) && !omit.contains(&flag) {
                args.extend([flag.to_owned(), value.to_owned()]);
            }
        }
        if cgroup_none_by_default && !extra.contains(&"--cgroup-path") {
            // Without it the agent would attach at the root of the cgroup2
            // mount it sees (the machine's): no connect-time translation
            // unless the test gives its node's cgroup (`CgroupDir::path`).
            args.extend(["--cgroup-path".to_owned(), "none".to_owned()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut agent = AgentProcess {
            child: None,
            node,
            node_ip: n.ip(),
            pin_dir: pin_dir.clone(),
            log: std::env::temp_dir().join(format!("{}-{}-agent.log", self.prefix(), n.name)),
            bin: bin.to_owned(),
            args,
            ns: n.ns().name().to_owned(),
            mounts: mounts.to_owned(),
        };
        agent.start();
        agent.wait_healthy(n.ns());
        agent
    }
}

impl AgentProcess {
    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("agent log");
        let child = NetNs::adopt(&self.ns)
            .command_after(&self.mounts, &self.bin)
            .args(&self.args)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("start the agent");
        self.child = Some(child);
    }

    /// The agent's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET `path` on the agent's health port, from inside the node.
    pub fn http_get(
        ns: &NetNs,
        addr: impl Into<std::net::SocketAddr>,
        path: &str,
    ) -> std::io::Result<(u16, String)> {
        let addr = addr.into();
        let mut s = ns.run(|| TcpStream::connect_timeout(&addr, Duration::from_secs(1)))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        let status = out
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = out
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((status, body))
    }

    /// Waits until /healthz answers 200 (the first sync is done).
    pub fn wait_healthy(&mut self, ns: &NetNs) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = SocketAddrV4::new(self.node_ip, HEALTH_PORT);
        while Instant::now() < deadline {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("the agent exited ({status}):\n{}", self.log_text());
            }
            if matches!(Self::http_get(ns, addr, "/healthz"), Ok((200, _))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "the agent did not become healthy within 20 s:\n{}",
            self.log_text()
        );
    }

    /// SIGKILL: no cleanup at all, as a crash or an OOM kill.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            // `ip netns exec` execs `sh`, which execs the agent: the child
            // is the agent.
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the same agent again (same pins, same flags).
    pub fn restart(&mut self, ns: &NetNs) {
        self.kill9();
        self.start();
        self.wait_healthy(ns);
    }

    /// Sets `flag` to `value` for the next (re)start.
    pub fn set_flag(&mut self, flag: &str, value: &str) {
        match self.args.iter().position(|a| a == flag) {
            Some(i) => self.args[i + 1] = value.to_owned(),
            None => self.args.extend([flag.to_owned(), value.to_owned()]),
        }
    }

    /// The `run` arguments of this agent.
    pub fn run_args(&self) -> Vec<String> {
        self.args.clone()
    }

    /// Runs the agent binary with `args` in this agent's node (another
    /// `run` on the same pins, `cleanup`, `inspect`) and waits for it, at
    /// most `timeout` (then it is killed).
    pub fn run_in_node(&self, args: &[String], timeout: Duration) -> std::process::Output {
        let mut child = NetNs::adopt(&self.ns)
            .command_after(&self.mounts, &self.bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the agent binary");
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline && child.try_wait().ok().flatten().is_none() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        child.wait_with_output().expect("agent output")
    }

    /// Waits until the agent exits by itself, at most `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl AgentProcess {
    /// Stops it as the kubelet does (SIGTERM; SIGKILL after 5 s) and waits;
    /// the log stays.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: plain kill(2) on our child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if c.try_wait().ok().flatten().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// An endpoint in a manifest: address, port, node name, conditions.
#[derive(Clone, Debug)]
pub struct ManifestEndpoint {
    pub ip: std::net::Ipv4Addr,
    pub node: String,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl ManifestEndpoint {
    pub fn ready(ip: std::net::Ipv4Addr, node: &str) -> Self {
        Self {
            ip,
            node: node.into(),
            ready: true,
            serving: true,
            terminating: false,
        }
    }
    pub fn terminating(mut self) -> Self {
        self.ready = false;
        self.terminating = true;
        self
    }
}

/// A Service and its EndpointSlice as YAML. `spec` holds the spec's extra
/// lines (type, nodePort, policies), indented by two spaces.
pub fn service_yaml(
    name: &str,
    spec: &str,
    port: u16,
    node_port: Option<u16>,
    target: u16,
    eps: &[ManifestEndpoint],
) -> String {
    let node_port = node_port.map(|p| format!(", nodePort: {p}")).unwrap_or_default();
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n{spec}  ports: [{{name: p, port: {port}, protocol: TCP{node_port}}}]\n"
    );
    y.push_str(&format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: p, port: {target}, protocol: TCP}}]\nendpoints:\n"
    ));
    if eps.is_empty() {
        y.push_str("  []\n");
    }
    for e in eps {
        y.push_str(&format!(
            "  - {{addresses: [{}], nodeName: {}, conditions: {{ready: {}, serving: {}, terminating: {}}}}}\n",
            e.ip, e.node, e.ready, e.serving, e.terminating
        ));
    }
    y
}
