//! A dedicated cgroup (v2) per sandbox node, for the connect-time programs:
//! never the root cgroup. Removed on drop.

use std::path::{Path, PathBuf};

/// Where cgroup v2 is mounted (`/sys/fs/cgroup` on unified hosts,
/// `/sys/fs/cgroup/unified` on hybrid ones).
pub fn cgroup2_root() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/mounts").expect("read /proc/mounts");
    mounts
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace().skip(1);
            let (path, fstype) = (f.next()?, f.next()?);
            (fstype == "cgroup2").then(|| PathBuf::from(path))
        })
        .expect("no cgroup v2 mount: the connect-time tests need cgroup2 (mount -t cgroup2 none /sys/fs/cgroup/unified)")
}

/// A second mount of the cgroup2 hierarchy, not under /sys.
pub const OUTSIDE_SYS_MOUNT: &str = "/run/dataplane-tests/cgroup2";

fn outside_sys_mounted() -> bool {
    std::fs::read_to_string("/proc/mounts")
        .expect("read /proc/mounts")
        .lines()
        .any(|l| {
            let mut f = l.split_whitespace().skip(1);
            f.next() == Some(OUTSIDE_SYS_MOUNT) && f.next() == Some("cgroup2")
        })
}

/// Mounts cgroup2 at [`OUTSIDE_SYS_MOUNT`] when it is not mounted yet (the
/// same hierarchy as the machine's cgroup2 mount: nothing new is created).
fn ensure_outside_sys_mount() {
    if outside_sys_mounted() {
        return;
    }
    std::fs::create_dir_all(OUTSIDE_SYS_MOUNT).expect("create the cgroup2 mount point");
    let out = std::process::Command::new("mount")
        .args(["-t", "cgroup2", "none", OUTSIDE_SYS_MOUNT])
        .output()
        .expect("run mount");
    // Another test process may have mounted it in the meantime.
    assert!(
        out.status.success() || outside_sys_mounted(),
        "cannot mount cgroup2 at {OUTSIDE_SYS_MOUNT} (needs root): {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

#[derive(Debug)]
pub struct CgroupDir {
    path: PathBuf,
}

impl CgroupDir {
    pub fn new(name: &str) -> Self {
        let path = cgroup2_root().join(name);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("create cgroup {}: {e}", path.display()));
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The same cgroup through a cgroup2 mount outside /sys, for processes
    /// started with `ip netns exec` (which remounts /sys in its own mount
    /// namespace, hiding /sys/fs/cgroup): agents given `--cgroup-path`.
    pub fn outside_sys(&self) -> PathBuf {
        ensure_outside_sys_mount();
        let relative = self
            .path
            .strip_prefix(cgroup2_root())
            .expect("a sandbox cgroup is under the cgroup2 root");
        Path::new(OUTSIDE_SYS_MOUNT).join(relative)
    }

    /// The file a process writes its pid to, to join.
    pub fn procs(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }
}

impl Drop for CgroupDir {
    fn drop(&mut self) {
        // Processes that joined it have exited by now; rmdir may still race
        // with their release for a moment.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        eprintln!("warning: cgroup {} left behind", self.path.display());
    }
}
