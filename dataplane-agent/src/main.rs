//! `dataplane-agent`: parses the command line and dispatches.
use anyhow::Context as _;
use clap::{Parser, Subcommand};
use dataplane_common::names;

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
    /// Check that this kernel and these privileges can load the datapath.
    ///
    /// Loads the embedded eBPF object and every program in it through the
    /// verifier, attaches nothing, prints the counters it created and exits.
    ///
    /// Example: dataplane-agent check
    Check,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Check => {
            let datapath = dataplane_agent::dataplane::Datapath::load()
                .context("the datapath cannot be loaded on this machine")?;
            println!("ok: eBPF object loaded and verified");
            let programs = [names::XDP_INGRESS, names::TC_EGRESS, names::TC_POD_INGRESS];
            println!("  programs: {}", programs.join(", "));
            println!(
                "  counters: {} (all zero: nothing attached)",
                datapath.maps().counters()?.len()
            );
            Ok(())
        }
    }
}
