//! One sandbox for the end-to-end tests: a [`Cluster`] with pods, echo
//! servers on them, the agents' configuration (a [`ManifestDir`] or a
//! [`FakeApiServer`]), and the agents ([`AgentProcess`]) or in-test
//! datapaths ([`NodeDatapath`]) on the nodes. A test says which of these it
//! needs with [`Sandbox::builder`]; its own extras (BIRD daemons, a Lease
//! name) go in a small struct of its own beside this one.
//!
//! Teardown is in field order: the agents stop (and withdraw what they
//! announced) and the datapaths detach while the API server, the servers,
//! the manifests and every namespace are still there; the cluster goes last.
//!
//! ```ignore
//! let s = Sandbox::builder(Cluster::new())
//!     .pods(&[("a", 0), ("b", 1)])
//!     .tcp_echo(8080)
//!     .manifest("web.yaml", |c| web(c))
//!     .agents(2, |s, i| s.start_agent(BIN, i, &[]));
//! ```

use std::net::IpAddr;

use serde_json::Value;

use crate::{
    agent::{AgentProcess, ManifestDir},
    cluster::{Cluster, Pod},
    echo::EchoServer,
    fake_api::FakeApiServer,
    services::NodeDatapath,
};

/// A cluster and what runs in it; see the module docs. Fields drop in
/// declaration order.
pub struct Sandbox {
    /// Stopped first: an agent withdraws and releases while everything it
    /// talks to still runs.
    pub agents: Vec<AgentProcess>,
    /// In-test datapaths (no agent), detached next.
    pub datapaths: Vec<NodeDatapath>,
    api: Option<FakeApiServer>,
    pub servers: Vec<EchoServer>,
    manifests: Option<ManifestDir>,
    pub cluster: Cluster,
}

/// Builds a [`Sandbox`] step by step, in the order the steps are called.
pub struct SandboxBuilder {
    sandbox: Sandbox,
}

impl Sandbox {
    /// A builder on `cluster` (any of its constructors: wiring, layout,
    /// dual stack, three nodes).
    pub fn builder(cluster: Cluster) -> SandboxBuilder {
        SandboxBuilder {
            sandbox: Sandbox {
                agents: Vec::new(),
                datapaths: Vec::new(),
                api: None,
                servers: Vec::new(),
                manifests: None,
                cluster,
            },
        }
    }

    /// The manifests directory; panics if the builder made none.
    pub fn manifests(&self) -> &ManifestDir {
        self.manifests
            .as_ref()
            .expect("a sandbox with a manifests directory")
    }

    /// The fake API server; panics if the builder started none.
    pub fn api(&self) -> &FakeApiServer {
        self.api.as_ref().expect("a sandbox with a fake API server")
    }

    /// Starts the agent on node `node` reading the manifests directory,
    /// with `extra` flags ([`Cluster::start_agent`]).
    pub fn start_agent(&self, bin: &str, node: usize, extra: &[&str]) -> AgentProcess {
        self.cluster.start_agent(bin, node, self.manifests(), extra)
    }

    /// Starts the agent on node `node` watching the fake API server
    /// (`--source kubernetes --k8s-api-server URL`), with `extra` flags.
    pub fn start_agent_on_api(&self, bin: &str, node: usize, extra: &[&str]) -> AgentProcess {
        let url = self.api().url();
        let mut args = vec!["--k8s-api-server", url.as_str()];
        args.extend_from_slice(extra);
        self.cluster
            .start_agent_with_source(bin, node, "kubernetes", &args)
    }

    /// Restarts agent `i` ([`AgentProcess::restart`]) on its node.
    pub fn restart_agent(&mut self, i: usize) {
        let node = self.agents[i].node;
        self.agents[i].restart(self.cluster.nodes[node].ns());
    }

    /// Stops (and drops) every agent, in order: for a test's own Drop that
    /// must see them gone before its other parts.
    pub fn stop_agents(&mut self) {
        self.agents.clear();
    }

    /// Every agent's log, each headed by its node.
    pub fn logs(&self) -> String {
        self.agents
            .iter()
            .map(|a| format!("node{}:\n{}", a.node + 1, a.log_text()))
            .collect::<Vec<_>>()
            .join("\n---\n")
    }
}

impl SandboxBuilder {
    /// Adds pods (name, node index), in this order.
    pub fn pods(mut self, pods: &[(&str, usize)]) -> Self {
        for (name, node) in pods {
            self.sandbox.cluster.add_pod(*node, name);
        }
        self
    }

    fn serve(mut self, every_address: bool, start: impl Fn(&Pod, IpAddr) -> EchoServer) -> Self {
        for p in &self.sandbox.cluster.pods {
            let ips =
                std::iter::once(IpAddr::V4(p.ip)).chain(p.ip6.filter(|_| every_address).map(IpAddr::V6));
            for ip in ips {
                self.sandbox.servers.push(start(p, ip));
            }
        }
        self
    }

    /// A TCP echo server on `port` of every pod's IPv4 address.
    pub fn tcp_echo(self, port: u16) -> Self {
        self.serve(false, |p, ip| EchoServer::tcp(&p.ns, &p.name, (ip, port)))
    }

    /// A UDP echo server on `port` of every pod's IPv4 address.
    pub fn udp_echo(self, port: u16) -> Self {
        self.serve(false, |p, ip| EchoServer::udp(&p.ns, &p.name, (ip, port)))
    }

    /// A TCP echo server on `port` of every pod's addresses (IPv6 too when
    /// the pod has one).
    pub fn tcp_echo_every_address(self, port: u16) -> Self {
        self.serve(true, |p, ip| EchoServer::tcp(&p.ns, &p.name, (ip, port)))
    }

    /// A UDP echo server on `port` of every pod's addresses.
    pub fn udp_echo_every_address(self, port: u16) -> Self {
        self.serve(true, |p, ip| EchoServer::udp(&p.ns, &p.name, (ip, port)))
    }

    /// Writes manifest `name` with what `yaml` makes of the cluster; the
    /// first call creates the manifests directory.
    pub fn manifest(mut self, name: &str, yaml: impl FnOnce(&Cluster) -> String) -> Self {
        let s = &mut self.sandbox;
        let dir = s
            .manifests
            .get_or_insert_with(|| ManifestDir::new(s.cluster.prefix()));
        dir.write(name, &yaml(&s.cluster));
        self
    }

    /// An empty manifests directory (unless one exists).
    pub fn manifest_dir(mut self) -> Self {
        let s = &mut self.sandbox;
        s.manifests
            .get_or_insert_with(|| ManifestDir::new(s.cluster.prefix()));
        self
    }

    /// Starts the fake API server on 127.0.0.1 inside node `node` (as a
    /// real one is reachable from it).
    pub fn api_in_node(mut self, node: usize) -> Self {
        let api = FakeApiServer::start(self.sandbox.cluster.nodes[node].ns());
        self.sandbox.api = Some(api);
        self
    }

    /// Gives the switch `address` (on the LAN) and starts the fake API
    /// server there, for agents on several nodes.
    pub fn api_on_switch(mut self, address: &str) -> Self {
        let c = &self.sandbox.cluster;
        c.switch().ip_batch(&format!("addr add {address}/24 dev br0\n"));
        self.sandbox.api = Some(FakeApiServer::start_at(c.switch(), &format!("{address}:0")));
        self
    }

    /// Applies what `objects` makes of the cluster to the fake API server.
    pub fn apply(self, objects: impl FnOnce(&Cluster) -> Vec<Value>) -> Self {
        let api = self.sandbox.api();
        for o in objects(&self.sandbox.cluster) {
            api.apply(&o);
        }
        self
    }

    /// Runs `step` on the sandbox so far (a test's own setup between the
    /// others).
    pub fn then(mut self, step: impl FnOnce(&mut Sandbox)) -> Self {
        step(&mut self.sandbox);
        self
    }

    /// Routes `prefix` from the client through node `node`.
    pub fn route_from_client(self, prefix: &str, node: usize) -> Self {
        self.sandbox.cluster.route_from_client(prefix, node);
        self
    }

    /// Starts `n` agents, the `i`th by `start(sandbox, i)` (on nodes
    /// `0..n` as a rule), in order, and hands over the sandbox.
    pub fn agents(mut self, n: usize, mut start: impl FnMut(&Sandbox, usize) -> AgentProcess) -> Sandbox {
        for i in 0..n {
            let agent = start(&self.sandbox, i);
            self.sandbox.agents.push(agent);
        }
        self.sandbox
    }

    /// Starts a datapath per node, the `i`th by `start(cluster, i)`, and
    /// hands over the sandbox.
    pub fn datapaths(mut self, start: impl Fn(&Cluster, usize) -> NodeDatapath) -> Sandbox {
        let c = &self.sandbox.cluster;
        self.sandbox.datapaths = (0..c.nodes.len()).map(|i| start(c, i)).collect();
        self.sandbox
    }

    /// The sandbox, with no agent or datapath started.
    pub fn build(self) -> Sandbox {
        self.sandbox
    }
}

/// Lets a test file's own sandbox type (the shared one in field `$field`,
/// plus the file's helpers and extras) be used as the shared [`Sandbox`]:
/// `s.cluster`, `s.agents`, `s.api()`.
///
/// ```ignore
/// struct Sandbox(dataplane_tests::sandbox::Sandbox);
/// dataplane_tests::deref_sandbox!(Sandbox, 0);
/// ```
#[macro_export]
macro_rules! deref_sandbox {
    ($ty:ty, $field:tt) => {
        impl ::std::ops::Deref for $ty {
            type Target = $crate::sandbox::Sandbox;
            fn deref(&self) -> &Self::Target {
                &self.$field
            }
        }

        impl ::std::ops::DerefMut for $ty {
            fn deref_mut(&mut self) -> &mut Self::Target {
                &mut self.$field
            }
        }
    };
}
