//! A private directory in bpffs for one sandbox's pins, removed on drop.
//!
//! The sandbox's bpffs is mounted at [`BPFFS_ROOT`], not under /sys:
//! `ip netns exec` (how agents run on the sandbox's nodes) remounts /sys in
//! its own mount namespace, which would hide /sys/fs/bpf from the agent.

use std::path::{Path, PathBuf};

pub const BPFFS_ROOT: &str = "/run/dataplane-tests/bpffs";

/// Mounts bpffs at [`BPFFS_ROOT`] when it is not mounted yet.
///
/// Under a lock shared by every test thread and process: two that both find
/// it unmounted would otherwise both mount it, the second on top of the
/// first, hiding what the first had already pinned there (leaked until
/// unmounted).
pub fn ensure_bpffs() {
    std::fs::create_dir_all(BPFFS_ROOT).expect("create the sandbox bpffs mount point");
    let lock = std::fs::File::create(Path::new(BPFFS_ROOT).with_extension("lock"))
        .expect("create the bpffs mount lock");
    lock.lock().expect("take the bpffs mount lock");
    if bpffs_mounted() {
        return;
    }
    let out = std::process::Command::new("mount")
        .args(["-t", "bpf", "bpf", BPFFS_ROOT])
        .output()
        .expect("run mount");
    // Another test process may have mounted it in the meantime.
    assert!(
        out.status.success() || bpffs_mounted(),
        "cannot mount bpffs at {BPFFS_ROOT} (needs root): {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

fn bpffs_mounted() -> bool {
    std::fs::read_to_string("/proc/mounts")
        .expect("read /proc/mounts")
        .lines()
        .any(|l| {
            let mut f = l.split_whitespace().skip(1);
            f.next() == Some(BPFFS_ROOT) && f.next() == Some("bpf")
        })
}

#[derive(Debug)]
pub struct BpffsDir {
    path: PathBuf,
}

impl BpffsDir {
    pub fn new(name: &str) -> Self {
        ensure_bpffs();
        let path = Path::new(BPFFS_ROOT).join(name);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BpffsDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("warning: remove {}: {e}", self.path.display());
        }
    }
}
