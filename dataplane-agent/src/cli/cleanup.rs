use std::path::PathBuf;

use crate::dataplane::{PinDir, PinDirError, trace_cache};
use anyhow::Context as _;

#[derive(clap::Args)]
pub struct CleanupArgs {
    /// The agent's pin directory in bpffs.
    #[arg(long, default_value = "/sys/fs/bpf/dataplane")]
    pub bpffs_dir: PathBuf,
    /// Remove the pins even while an agent runs on them (it notices within a
    /// second and exits; its restart attaches afresh).
    #[arg(long)]
    pub force: bool,
    /// `trace`'s cache of verified programs (its --cache-dir), removed too.
    #[arg(long, default_value = trace_cache::DEFAULT_TRACE_CACHE_DIR)]
    pub trace_cache_dir: PathBuf,
}

pub fn run(args: &CleanupArgs) -> anyhow::Result<()> {
    remove_trace_cache(&args.trace_cache_dir)?;
    if !args.bpffs_dir.exists() {
        println!("nothing pinned at {}", args.bpffs_dir.display());
        return Ok(());
    }
    // Only an agent's pin directory: never whatever else lives in bpffs
    // (a bpffs root, another tool's pins).
    let Some(pins) = PinDir::open_partial(&args.bpffs_dir) else {
        anyhow::bail!(
            "{} is not an agent's pin directory (it has no maps/ or links/): nothing removed; pass the \
             directory the agent runs with (--bpffs-dir of `dataplane-agent run`, default /sys/fs/bpf/dataplane)",
            args.bpffs_dir.display()
        );
    };
    // Held while removing, so that no agent starts on the pins meanwhile.
    let _lock = match pins.lock() {
        Ok(lock) => Some(lock),
        Err(PinDirError::Locked { holder, .. }) if args.force => {
            eprintln!(
                "warning: an agent{} holds {}; removing its pins anyway (--force)",
                holder.map(|p| format!(" (pid {p})")).unwrap_or_default(),
                args.bpffs_dir.display()
            );
            None
        }
        Err(e @ PinDirError::Locked { .. }) => {
            return Err(anyhow::Error::new(e).context(
                "refusing to remove the pins of a running agent: stop it first (its datapath stays attached \
                 while it is down), or pass --force",
            ));
        }
        Err(e) => return Err(e.into()),
    };
    pins.remove_all()
        .with_context(|| format!("removing {}", args.bpffs_dir.display()))?;
    println!(
        "removed {}: programs detached, maps released",
        args.bpffs_dir.display()
    );
    Ok(())
}

/// `trace`'s cache holds no agent state: it goes whatever the agent does
/// (a trace using it keeps what it opened; the next one loads afresh).
fn remove_trace_cache(dir: &std::path::Path) -> anyhow::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    // Not under a trace that is adding programs to it.
    let lock = std::fs::File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}", dir.display()))?;
    let removed = trace_cache::remove_cache(dir)
        .with_context(|| format!("removing the trace cache {}", dir.display()))?;
    if !removed.is_empty() {
        println!(
            "removed the trace cache {} ({} object(s))",
            dir.display(),
            removed.len()
        );
    }
    Ok(())
}
