use std::{net::IpAddr, path::PathBuf, time::Duration};

use crate::{
    agent::{
        self,
        config::{ConfigFile, RunConfig, Source},
    },
    dataplane::XdpMode,
    net::{IpCidr, NodePortAddresses},
};
use anyhow::{Context as _, bail};
use dataplane_common::limits;

/// Flags of `run`; each may also come from `--config` (flags win).
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// YAML file with any of the settings below (camelCase keys, e.g.
    /// `nodeName`, `clusterCidr`, `nodePortAddresses`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// This node's name (EndpointSlice nodeName of local endpoints).
    #[arg(long)]
    pub node_name: Option<String>,
    /// The node's primary IPs, one or one per family (dual-stack: e.g.
    /// `198.18.0.11,2001:db8::11`); the first of each family is its SNAT
    /// address, and the node serves the families given.
    #[arg(long, value_delimiter = ',')]
    pub node_ip: Vec<IpAddr>,
    /// External devices: XDP and TC egress are attached here. Default: the
    /// devices holding the node IPs.
    #[arg(long, value_delimiter = ',')]
    pub devices: Vec<String>,
    /// Pod-facing host interfaces (`prefix*` or exact names), followed as they
    /// come and go. Default: none given, so they are discovered (veth devices
    /// with a direct route, veth ports of a bridge holding an address); when
    /// given, only these patterns are used.
    #[arg(long, value_delimiter = ',')]
    pub pod_interfaces: Vec<String>,
    /// Per-instance pin directory in bpffs (maps and links survive restarts).
    /// Default: /sys/fs/bpf/dataplane.
    #[arg(long)]
    pub bpffs_dir: Option<PathBuf>,
    /// `manifests:PATH[,PATH...]` (YAML/JSON files or directories, reloaded on
    /// change) or `kubernetes`.
    #[arg(long)]
    pub source: Option<Source>,
    /// Where pods come from (kube-proxy's clusterCIDR): one CIDR, or one
    /// per family (`10.244.0.0/16,fd00:10:244::/56`).
    #[arg(long, value_delimiter = ',')]
    pub cluster_cidr: Vec<IpCidr>,
    /// Service CIDRs (either family): traffic to an address in them that no
    /// Service holds is dropped.
    #[arg(long, value_delimiter = ',')]
    pub service_cidr: Vec<IpCidr>,
    /// `primary` (the first --node-ip of each family; the default, as in
    /// kube-proxy's nftables mode), `all` (every local address but loopback
    /// and IPv6 link-local: pod gateways and bridges too) or CIDR[,CIDR...].
    #[arg(long)]
    pub node_port_addresses: Option<NodePortAddresses>,
    /// SNAT every flow to a ClusterIP (kube-proxy's masqueradeAll).
    #[arg(long)]
    pub masquerade_all: bool,
    /// NodePorts also on 127.0.0.1 and [::1] for the node's own processes
    /// (kube-proxy's iptables localhostNodePorts; off, as in its nftables
    /// mode). Needs connect-time translation (a cgroup path); the
    /// connection comes from the node's address, never from loopback.
    #[arg(long)]
    pub localhost_nodeports: bool,
    /// /healthz and /livez; healthCheckNodePort servers bind the same IP.
    /// Default: 0.0.0.0:10256 (kube-proxy's).
    #[arg(long)]
    pub health_bind_address: Option<String>,
    /// Prometheus metrics (/metrics). Default: 127.0.0.1:10249 (kube-proxy's).
    #[arg(long)]
    pub metrics_bind_address: Option<String>,
    /// Full resync period; /healthz fails after twice this without a sync.
    /// Default: 30.
    #[arg(long)]
    pub sync_period_seconds: Option<u64>,
    /// At most one sync per this many milliseconds: changes arriving faster
    /// are coalesced (a change after a quiet spell is synced at once).
    /// Default: 100.
    #[arg(long)]
    pub min_sync_period_ms: Option<u64>,
    /// API server URL (the `kubernetes` ClusterIP is served by this agent, so
    /// it cannot be used to reach the API server).
    #[arg(long)]
    pub k8s_api_server: Option<String>,
    /// Kubeconfig file for the API server's address and credentials.
    /// Default: inferred ($KUBECONFIG, ~/.kube/config, or the in-cluster service account).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// `text` or `json`. Default: text.
    #[arg(long)]
    pub log_format: Option<String>,
    /// Service ports the maps hold (sizes the services and names maps).
    /// Default: 65536.
    #[arg(long)]
    pub max_services: Option<u32>,
    /// Backends (endpoint address and port) the maps hold. Default: 131072.
    #[arg(long)]
    pub max_backends: Option<u32>,
    /// Conntrack entries (LRU): a flow takes two. Default: 262144.
    #[arg(long)]
    pub conntrack_entries: Option<u32>,
    /// cgroup v2 directory whose processes get connect-time translation
    /// (host-network pods, node daemons). Default: the system's cgroup2
    /// mount (/sys/fs/cgroup, /sys/fs/cgroup/unified on hybrid hosts, else
    /// the first one outside /run and /tmp; logged); `none` turns it off.
    #[arg(long)]
    pub cgroup_path: Option<String>,
    /// Connect-time translation only for sockets in the node's network
    /// namespace; pods keep per-packet translation (for service meshes that
    /// redirect per packet).
    #[arg(long)]
    pub socket_lb_host_only: bool,
    /// Host routing: packets translated where they enter the node go
    /// straight to the device of their route, skipping the node's IP stack,
    /// netfilter's FORWARD chain included: TC redirects them, XDP sends
    /// them itself (XDP_TX, or a redirect to another external device in
    /// native XDP) (docs/datapath.md).
    #[arg(long)]
    pub host_routing: bool,
    /// How new flows from outside to an eTP=Cluster NodePort, LoadBalancer
    /// IP or externalIP reach a backend on another node: `snat` (masquerade,
    /// kube-proxy's way), `dsr` (direct server return: the client's address
    /// kept, replies straight from the backend's node), `hybrid` (DSR for
    /// TCP, SNAT for the rest). Services choose for themselves with the
    /// annotation dataplane.example.com/lb-mode. Every node must agree.
    #[arg(long)]
    pub lb_mode: Option<crate::state::inputs::LbMode>,
    /// How a new flow's backend is picked: `random` (kube-proxy's way) or
    /// `maglev` (consistent hashing: every node picks the same backend for
    /// a flow). Annotation: dataplane.example.com/lb-algorithm.
    #[arg(long)]
    pub lb_algorithm: Option<crate::state::inputs::LbAlgorithm>,
    /// Entries of each Maglev table: a prime (default 16381; larger for
    /// services with many backends: 100 or more entries per backend keep
    /// flows within about 1% of their share). Every node must agree.
    #[arg(long)]
    pub maglev_table_size: Option<u32>,
    /// Seed of Maglev's hashes (any 32-bit number). Every node must agree:
    /// set it once in the DaemonSet's config.
    #[arg(long)]
    pub maglev_seed: Option<u32>,
    /// Where the north-south ingress path runs on external devices: `auto`
    /// (native XDP on physical devices whose driver has it, TC on veth and
    /// other virtual devices), `native` (XDP or fail) or `off` (TC).
    #[arg(long)]
    pub xdp_mode: Option<XdpMode>,
    #[command(flatten)]
    pub lb: crate::lb::config::LbArgs,
}

pub fn resolve(args: RunArgs) -> anyhow::Result<(RunConfig, String)> {
    let file: ConfigFile = match &args.config {
        Some(p) => serde_saphyr::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("reading config file {}", p.display()))?,
        )
        .map_err(|e| anyhow::anyhow!("parsing config file {}: {e}", p.display()))?,
        None => ConfigFile::default(),
    };
    let parse_err = |what: &str, e: String| anyhow::anyhow!("config file {what}: {e}");
    let node_name = args
        .node_name
        .or(file.node_name)
        .context("--node-name is required (this node's name, as EndpointSlices give it)")?;
    let node_ips = if args.node_ip.is_empty() {
        file.node_ip.unwrap_or_default()
    } else {
        args.node_ip
    };
    if node_ips.is_empty() {
        bail!(
            "--node-ip is required (the node's primary IPs, one per family it serves; the first of each family is its SNAT address)"
        );
    }
    // Empty: the devices holding the node IPs, found when the agent starts.
    let devices = if args.devices.is_empty() {
        file.devices.unwrap_or_default()
    } else {
        args.devices
    };
    let pod_interfaces = if !args.pod_interfaces.is_empty() {
        args.pod_interfaces
    } else {
        file.pod_interfaces.unwrap_or_default()
    };
    let source = match (args.source, file.source) {
        (Some(s), _) => s,
        (None, Some(s)) => s.parse().map_err(|e| parse_err("source", e))?,
        (None, None) => Source::Kubernetes,
    };
    let lb = crate::lb::config::resolve(args.lb, file.load_balancer, source == Source::Kubernetes)?;
    let cluster_cidrs = match (args.cluster_cidr.is_empty(), file.cluster_cidr) {
        (false, _) => args.cluster_cidr,
        (true, Some(c)) => c
            .split(',')
            .map(|c| {
                c.trim()
                    .parse()
                    .map_err(|e: crate::net::CidrError| parse_err("clusterCidr", e.to_string()))
            })
            .collect::<Result<_, _>>()?,
        (true, None) => Vec::new(),
    };
    agent::config::check_cluster_cidrs(&cluster_cidrs).map_err(|e| anyhow::anyhow!("--cluster-cidr: {e}"))?;
    let service_cidrs = if !args.service_cidr.is_empty() {
        args.service_cidr
    } else {
        file.service_cidr
            .unwrap_or_default()
            .iter()
            .map(|c| {
                c.parse()
                    .map_err(|e: crate::net::CidrError| parse_err("serviceCidr", e.to_string()))
            })
            .collect::<Result<_, _>>()?
    };
    let node_port_addresses = match (args.node_port_addresses, file.node_port_addresses) {
        (Some(n), _) => n,
        (None, Some(n)) => n.parse().map_err(|e| parse_err("nodePortAddresses", e))?,
        (None, None) => NodePortAddresses::Primary,
    };
    let log_format = args
        .log_format
        .or(file.log_format)
        .unwrap_or_else(|| "text".into());
    let cgroup_setting = args.cgroup_path.or(file.cgroup_path);
    let (cgroup_path, cgroup_origin) = agent::config::resolve_cgroup_path(cgroup_setting.as_deref());
    let localhost_nodeports = args.localhost_nodeports || file.localhost_nodeports.unwrap_or(false);
    if localhost_nodeports && cgroup_path.is_none() {
        let why = match &cgroup_origin {
            agent::config::CgroupOrigin::NotFound(why) => why.as_str(),
            _ => "--cgroup-path none",
        };
        bail!(
            "--localhost-nodeports needs connect-time translation, which is off ({why}): give --cgroup-path"
        );
    }
    Ok((
        RunConfig {
            node_name,
            node_ips,
            devices,
            pod_interfaces,
            bpffs_dir: args
                .bpffs_dir
                .or(file.bpffs_dir)
                .unwrap_or_else(|| PathBuf::from("/sys/fs/bpf/dataplane")),
            source,
            cluster_cidrs,
            service_cidrs,
            node_port_addresses,
            masquerade_all: args.masquerade_all || file.masquerade_all.unwrap_or(false),
            localhost_nodeports,
            health_bind_address: args
                .health_bind_address
                .or(file.health_bind_address)
                .unwrap_or_else(|| "0.0.0.0:10256".into()),
            metrics_bind_address: args
                .metrics_bind_address
                .or(file.metrics_bind_address)
                .unwrap_or_else(|| "127.0.0.1:10249".into()),
            sync_period: Duration::from_secs(
                args.sync_period_seconds
                    .or(file.sync_period_seconds)
                    .unwrap_or(30)
                    .max(1),
            ),
            min_sync_period: Duration::from_millis(
                args.min_sync_period_ms.or(file.min_sync_period_ms).unwrap_or(100),
            ),
            k8s_api_server: args.k8s_api_server.or(file.k8s_api_server),
            kubeconfig: args.kubeconfig.or(file.kubeconfig),
            max_services: args
                .max_services
                .or(file.max_services)
                .unwrap_or(limits::MAX_SERVICES),
            max_backends: args
                .max_backends
                .or(file.max_backends)
                .unwrap_or(limits::MAX_BACKENDS),
            conntrack_entries: args
                .conntrack_entries
                .or(file.conntrack_entries)
                .unwrap_or(limits::CT_ENTRIES),
            cgroup_path,
            cgroup_origin,
            socket_lb_host_only: args.socket_lb_host_only || file.socket_lb_host_only.unwrap_or(false),
            host_routing: args.host_routing || file.host_routing.unwrap_or(false),
            xdp_mode: match (args.xdp_mode, file.xdp_mode) {
                (Some(m), _) => m,
                (None, Some(m)) => m.parse().map_err(|e| parse_err("xdpMode", e))?,
                (None, None) => XdpMode::Auto,
            },
            lb_defaults: crate::state::inputs::LbDefaults {
                mode: match (args.lb_mode, file.lb_mode) {
                    (Some(m), _) => m,
                    (None, Some(m)) => m.parse().map_err(|e| parse_err("lbMode", e))?,
                    (None, None) => Default::default(),
                },
                algorithm: match (args.lb_algorithm, file.lb_algorithm) {
                    (Some(a), _) => a,
                    (None, Some(a)) => a.parse().map_err(|e| parse_err("lbAlgorithm", e))?,
                    (None, None) => Default::default(),
                },
            },
            maglev_size: {
                let m = args
                    .maglev_table_size
                    .or(file.maglev_table_size)
                    .unwrap_or(dataplane_common::maglev::DEFAULT_TABLE_SIZE);
                if !crate::state::maglev::valid_size(m) {
                    bail!(
                        "--maglev-table-size {m}: expected a prime from 3 to {} (16381 and 65521 are)",
                        dataplane_common::lb::MAGLEV_MAX_SIZE
                    );
                }
                m
            },
            maglev_seed: args.maglev_seed.or(file.maglev_seed).unwrap_or(0),
            lb,
        },
        log_format,
    ))
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let (cfg, log_format) = resolve(args)?;
    let subscriber = tracing_subscriber::fmt().with_ansi(false).with_target(false);
    match log_format.as_str() {
        "json" => subscriber.json().init(),
        "text" => subscriber.init(),
        other => bail!("--log-format {other:?}: expected text or json"),
    }
    agent::run::run(cfg)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    fn resolved(extra: &[&str]) -> anyhow::Result<RunConfig> {
        let base = [
            "run",
            "--node-name",
            "n1",
            "--node-ip",
            "198.18.0.11",
            "--source",
            "manifests:/nonexistent",
        ];
        let cli = Cli::try_parse_from(base.iter().chain(extra)).expect("flags parse");
        resolve(cli.run).map(|(cfg, _)| cfg)
    }

    #[test]
    fn localhost_nodeports_are_off_by_default_and_need_connect_time_translation() {
        let cfg = resolved(&["--cgroup-path", "/sys/fs/cgroup/x"]).unwrap();
        assert!(!cfg.localhost_nodeports);
        assert!(!agent::run::datapath_config(&cfg).localhost_nodeports);
        let cfg = resolved(&["--cgroup-path", "/sys/fs/cgroup/x", "--localhost-nodeports"]).unwrap();
        assert!(agent::run::datapath_config(&cfg).localhost_nodeports);
        let file: ConfigFile = serde_saphyr::from_str("localhostNodePorts: true\n").unwrap();
        assert_eq!(file.localhost_nodeports, Some(true));
        let err = resolved(&["--cgroup-path", "none", "--localhost-nodeports"]).unwrap_err();
        assert!(
            err.to_string()
                .contains("--localhost-nodeports needs connect-time translation"),
            "{err}"
        );
    }
}
