//! The command line: parsing, and one module per verb. The
//! `dataplane-agent` binary is `cli::main`.
pub mod check;
pub mod cleanup;
pub mod inspect;
mod inspect_interfaces;
pub mod monitor;
pub mod run;
mod shared;
pub mod trace;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "dataplane-agent",
    version,
    about = "eBPF/XDP node dataplane that replaces kube-proxy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent: program the datapath from Services and EndpointSlices.
    ///
    /// Example (a node of the test sandbox):
    ///   ip netns exec node1 dataplane-agent run --node-name node1 --node-ip 198.18.0.11 \
    ///     --devices eth0 --bpffs-dir /sys/fs/bpf/node1 --source manifests:/etc/dataplane/services \
    ///     --cluster-cidr 10.244.0.0/16 --service-cidr 10.96.0.0/16
    #[command(verbatim_doc_comment)]
    Run(Box<run::RunArgs>),
    /// Preflight this node: kernel and BTF, the datapath through the
    /// verifier, bpffs, cgroup v2, XDP support of the external devices,
    /// programs already attached, kube-proxy's leftover rules. One line per
    /// finding; exits non-zero only on blockers. Attaches nothing.
    ///
    /// Examples:
    ///   dataplane-agent check
    ///   dataplane-agent check --node-ip 10.0.0.21 -o json
    #[command(verbatim_doc_comment)]
    Check(check::CheckArgs),
    /// Remove a stopped agent's pins: its programs detach and its maps
    /// (conntrack included) go. `trace`'s cache of verified programs goes
    /// too.
    ///
    /// Example: dataplane-agent cleanup --bpffs-dir /sys/fs/bpf/dataplane
    Cleanup(cleanup::CleanupArgs),
    /// Show what a running (or stopped) agent's pinned maps hold.
    ///
    /// Examples:
    ///   dataplane-agent inspect services
    ///   dataplane-agent inspect conntrack --address 10.96.0.10 -o json
    ///   dataplane-agent inspect --bpffs-dir /sys/fs/bpf/node1 stats
    #[command(verbatim_doc_comment)]
    Inspect(inspect::InspectArgs),
    /// Follow the packets the running datapath drops or rejects, live, and
    /// with --type trace a sample of those it translates (before and
    /// after): one line (or JSON object) per packet, with the hook, the
    /// device, the reason, the addresses and the Service. Read from the
    /// pinned ring buffer; the kernel writes events only while someone
    /// follows them, at most --rate a second per CPU (what it leaves out is
    /// counted).
    ///
    /// Examples:
    ///   dataplane-agent monitor
    ///   dataplane-agent monitor --type drop --service default/web -o json
    ///   dataplane-agent monitor --type trace --sample 100 --port 30080
    ///   dataplane-agent monitor --bpffs-dir /sys/fs/bpf/node1 --address 203.0.113.7
    #[command(verbatim_doc_comment)]
    Monitor(monitor::MonitorArgs),
    /// Run one packet through the real programs and say what happens to it.
    ///
    /// A private copy of the datapath (nothing attached, no live map touched)
    /// is programmed from the manifests exactly as `run` programs it. Its
    /// programs, once verified, are kept in bpffs (--cache-dir) for the
    /// next trace.
    ///
    /// Example:
    ///   dataplane-agent trace --manifests services.yaml --node-name node1 --node-ip 198.18.0.11 \
    ///     --cluster-cidr 10.244.0.0/16 --from external --src 203.0.113.7 --dst 198.18.0.11:30080 --proto tcp
    #[command(verbatim_doc_comment)]
    Trace(Box<trace::TraceArgs>),
}

/// Parses `argv` as a `run` command line and resolves its settings (config
/// file included) without starting anything: the deployment tests check the
/// DaemonSet's arguments with it.
pub fn resolve_run_args(argv: &[String]) -> anyhow::Result<crate::agent::config::RunConfig> {
    match Cli::try_parse_from(argv)?.command {
        Command::Run(args) => Ok(run::resolve(*args)?.0),
        _ => anyhow::bail!("not a `run` command line"),
    }
}

/// Parses `argv` as a `check` command line (the DaemonSet's init container
/// arguments) without running it.
pub fn parse_check_args(argv: &[String]) -> anyhow::Result<check::CheckArgs> {
    match Cli::try_parse_from(argv)?.command {
        Command::Check(args) => Ok(args),
        _ => anyhow::bail!("not a `check` command line"),
    }
}

/// Parses the command line and runs the verb.
pub fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run(args) => run::run(*args),
        Command::Check(args) => check::run(&args),
        Command::Cleanup(args) => cleanup::run(&args),
        Command::Inspect(args) => inspect::run(&args),
        Command::Monitor(args) => monitor::run(&args),
        Command::Trace(args) => trace::run(*args),
    }
}
