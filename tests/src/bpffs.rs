//! A private directory in bpffs for one sandbox's pins, removed on drop.
//!
//! Each test process mounts its own bpffs at `/tmp/dpt-<pid>-bpffs`
//! ([`process_mount`]) while it has a [`BpffsDir`], and unmounts it when the
//! last one drops (also while unwinding from a panic): a test run leaves no
//! mount behind. A killed process's mount is unmounted by the next sandbox's
//! sweep (`crate::sweep_orphans`). Not under /sys: `ip netns exec` (how agents
//! run on the sandbox's nodes) remounts /sys in its own mount namespace,
//! which would hide /sys/fs/bpf from the agent.

use std::{
    path::{Path, PathBuf},
    sync::Mutex,
};

/// How many [`BpffsDir`]s of this process exist: the mount lives while
/// one does.
static USERS: Mutex<usize> = Mutex::new(0);

/// This process's bpffs mount point.
pub fn process_mount() -> PathBuf {
    std::env::temp_dir().join(format!("{}{}-bpffs", crate::NAME_PREFIX, std::process::id()))
}

/// Whether `path` is a mount point of type `fstype` (per /proc/self/mounts).
pub fn is_mounted(path: &Path, fstype: &str) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .expect("read /proc/self/mounts")
        .lines()
        .any(|l| {
            let mut f = l.split_whitespace().skip(1);
            f.next().map(Path::new) == Some(path) && f.next() == Some(fstype)
        })
}

/// Unmounts whatever is mounted at `path` (lazily: processes still inside
/// keep their view) and removes the directory. For cleanup: errors ignored.
pub fn unmount_and_remove(path: &Path) {
    use std::os::unix::ffi::OsStrExt as _;
    if let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) {
        // Stacked mounts: one umount each.
        for _ in 0..8 {
            // SAFETY: a NUL-terminated path that outlives the call.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
                break;
            }
        }
    }
    let _ = std::fs::remove_dir(path);
}

#[derive(Debug)]
pub struct BpffsDir {
    path: PathBuf,
}

impl BpffsDir {
    pub fn new(name: &str) -> Self {
        let mount = process_mount();
        {
            let mut users = USERS.lock().unwrap_or_else(|p| p.into_inner());
            if *users == 0 && !is_mounted(&mount, "bpf") {
                std::fs::create_dir_all(&mount).expect("create the test process's bpffs mount point");
                let out = std::process::Command::new("mount")
                    .args(["-t", "bpf", "bpf"])
                    .arg(&mount)
                    .output()
                    .expect("run mount");
                assert!(
                    out.status.success(),
                    "cannot mount bpffs at {} (needs root): {}",
                    mount.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            *users += 1;
        }
        let dir = Self {
            path: mount.join(name),
        };
        std::fs::create_dir_all(&dir.path).unwrap_or_else(|e| panic!("create {}: {e}", dir.path.display()));
        dir
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
        let mut users = USERS.lock().unwrap_or_else(|p| p.into_inner());
        *users -= 1;
        if *users == 0 {
            unmount_and_remove(&process_mount());
        }
    }
}
