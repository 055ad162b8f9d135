use std::path::PathBuf;

use crate::dataplane::PinDir;
use anyhow::Context as _;

#[derive(clap::Args)]
pub struct CleanupArgs {
    /// The agent's pin directory in bpffs.
    #[arg(long, default_value = "/sys/fs/bpf/dataplane")]
    pub bpffs_dir: PathBuf,
}

pub fn run(args: &CleanupArgs) -> anyhow::Result<()> {
    if !args.bpffs_dir.exists() {
        println!("nothing pinned at {}", args.bpffs_dir.display());
        return Ok(());
    }
    PinDir::create(&args.bpffs_dir)?
        .remove_all()
        .with_context(|| format!("removing {}", args.bpffs_dir.display()))?;
    println!(
        "removed {}: programs detached, maps released",
        args.bpffs_dir.display()
    );
    Ok(())
}
