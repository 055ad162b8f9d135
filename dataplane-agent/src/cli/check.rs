//! `dataplane-agent check`: the node preflight (see [`crate::preflight`]),
//! one line per finding; exits non-zero only when something blocks the
//! agent.

use std::path::PathBuf;

use anyhow::Context as _;

use crate::{
    agent::config::ConfigFile,
    dataplane::XdpMode,
    net::NodePortAddresses,
    preflight::{self, Options, Severity},
};

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The agent's config file (as `run --config`): its bpffsDir,
    /// cgroupPath, devices, nodeIp, nodePortAddresses, podInterfaces and
    /// xdpMode are checked; flags win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The agent's pin directory (as `run --bpffs-dir`); default
    /// /sys/fs/bpf/dataplane.
    #[arg(long)]
    pub bpffs_dir: Option<PathBuf>,
    /// The cgroup v2 directory of connect-time translation (as `run
    /// --cgroup-path`); default: the system's cgroup2 mount, chosen as
    /// `run` chooses it (stray mounts under /run or /tmp are passed over).
    #[arg(long)]
    pub cgroup_path: Option<PathBuf>,
    /// External devices (as `run --devices`); default: those holding
    /// --node-ip, else those of the default routes.
    #[arg(long, value_delimiter = ',')]
    pub devices: Vec<String>,
    /// The node's IPs (as `run --node-ip`): they pick the default devices.
    #[arg(long, value_delimiter = ',')]
    pub node_ip: Vec<std::net::IpAddr>,
    /// As `run --pod-interfaces`: pod interfaces the patterns miss (found
    /// from routes and bridges) are named.
    #[arg(long, value_delimiter = ',')]
    pub pod_interfaces: Vec<String>,
    /// As `run --node-port-addresses` (`primary`, `all` or CIDRs; default
    /// primary): the addresses NodePorts would be served on are named, with
    /// a warning when pod-facing interfaces (pods' gateways, CNI bridges)
    /// hold some.
    #[arg(long)]
    pub node_port_addresses: Option<NodePortAddresses>,
    /// As `run --xdp-mode`: decides whether a device without native XDP, or
    /// with another XDP program, blocks; default auto.
    #[arg(long)]
    pub xdp_mode: Option<XdpMode>,
    /// `table` (one line per finding) or `json`.
    #[arg(short = 'o', long, default_value = "table")]
    pub output: String,
}

/// The flag's values, or the config file's when the flag is not given.
fn or_file<T: Clone>(flag: &[T], file: Option<Vec<T>>) -> Vec<T> {
    if flag.is_empty() {
        file.unwrap_or_default()
    } else {
        flag.to_vec()
    }
}

pub fn run(args: &CheckArgs) -> anyhow::Result<()> {
    if !["table", "json"].contains(&args.output.as_str()) {
        anyhow::bail!("-o {}: expected table or json", args.output);
    }
    let file: ConfigFile = match &args.config {
        Some(p) => serde_saphyr::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("reading config file {}", p.display()))?,
        )
        .map_err(|e| anyhow::anyhow!("parsing config file {}: {e}", p.display()))?,
        None => ConfigFile::default(),
    };
    let xdp_mode = match (args.xdp_mode, file.xdp_mode) {
        (Some(m), _) => m,
        (None, Some(m)) => m
            .parse()
            .map_err(|e| anyhow::anyhow!("config file xdpMode: {e}"))?,
        (None, None) => XdpMode::Auto,
    };
    let node_port_addresses = match (args.node_port_addresses.clone(), file.node_port_addresses) {
        (Some(n), _) => n,
        (None, Some(n)) => n
            .parse()
            .map_err(|e| anyhow::anyhow!("config file nodePortAddresses: {e}"))?,
        (None, None) => NodePortAddresses::Primary,
    };
    let findings = preflight::run(&Options {
        bpffs_dir: args
            .bpffs_dir
            .clone()
            .or(file.bpffs_dir)
            .unwrap_or_else(|| PathBuf::from("/sys/fs/bpf/dataplane")),
        // `none` turns connect-time translation off: nothing to check.
        cgroup_path: match args.cgroup_path.clone().or(file.cgroup_path.map(PathBuf::from)) {
            Some(p) if p.as_os_str() == "none" => Some(PathBuf::new()),
            other => other,
        },
        devices: or_file(&args.devices, file.devices),
        node_ips: or_file(&args.node_ip, file.node_ip),
        xdp_mode,
        pod_interfaces: or_file(&args.pod_interfaces, file.pod_interfaces),
        node_port_addresses,
    });
    let blockers = findings
        .iter()
        .filter(|f| f.severity == Severity::Blocker)
        .count();
    let warnings = findings.iter().filter(|f| f.severity == Severity::Warn).count();
    if args.output == "json" {
        let v = serde_json::json!({"findings": findings, "blockers": blockers, "warnings": warnings});
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for f in &findings {
            let fix = f.fix.as_ref().map(|x| format!(" (fix: {x})")).unwrap_or_default();
            println!("{:<7} {:<12} {}{fix}", f.severity.as_str(), f.subject, f.message);
        }
        println!("{blockers} blockers, {warnings} warnings");
    }
    if blockers > 0 {
        anyhow::bail!("{blockers} blocker(s): the agent cannot run on this node as configured");
    }
    Ok(())
}
