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
