//! A dedicated cgroup (v2) per sandbox node, for the connect-time programs:
//! never the root cgroup. Created under the machine's own cgroup2 mount,
//! removed on drop.
//!
//! Processes started with `ip netns exec` (agents) get a fresh /sys in their
//! own mount namespace, which hides the machine's cgroup2 mount;
//! [`system_mount_script`] mounts it again at the same place inside that
//! namespace only (gone with the process), so a cgroup's [`CgroupDir::path`]
//! is the same for the test and for the agent, and nothing is mounted on
//! the machine.

use std::path::{Path, PathBuf};

/// The machine's cgroup v2 mount, chosen as the agent chooses it
/// (`/sys/fs/cgroup` on unified hosts, `/sys/fs/cgroup/unified` on hybrid
/// ones; never a stray mount under /run or /tmp).
pub fn cgroup2_root() -> PathBuf {
    dataplane_agent::os::cgroup_mount::system_cgroup2_mount()
        .unwrap_or_else(|e| {
            panic!("{e}: the connect-time tests need the machine's cgroup v2 (mounted at /sys/fs/cgroup or /sys/fs/cgroup/unified)")
        })
        .path
}

/// The mount options of the machine's cgroup2 mount. A cgroup2 mount's
/// options (nsdelegate, memory_recursiveprot, ...) apply to the whole
/// hierarchy: mounting it again with others would change them for the
/// machine, so every mount the harness makes repeats these.
pub fn cgroup2_options() -> String {
    let root = cgroup2_root();
    std::fs::read_to_string("/proc/self/mounts")
        .expect("read /proc/self/mounts")
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 3 && Path::new(f[1]) == root && f[2] == "cgroup2").then(|| f[3].to_owned())
        })
        .next_back()
        .expect("the cgroup2 mount is in /proc/self/mounts")
}

/// `sh` commands that mount the machine's cgroup2 hierarchy at `at` (with
/// its options), for a private mount namespace.
pub fn mount_cgroup2_command(at: &Path) -> String {
    format!(
        "mount -t cgroup2 -o {} none '{}'",
        cgroup2_options(),
        at.display()
    )
}

/// `sh` commands, run in `ip netns exec`'s private mount namespace, that put
/// the machine's cgroup2 mount back where the machine has it (hidden by the
/// fresh /sys). Nothing when the mount is not under /sys (still visible).
pub fn system_mount_script() -> String {
    at_system_mount(mount_cgroup2_command)
}

/// `sh` commands that run `mount_at(path)` for the place of the machine's
/// cgroup2 mount in `ip netns exec`'s fresh /sys: a hybrid host's
/// `/sys/fs/cgroup/unified` needs a tmpfs at `/sys/fs/cgroup` to be made in.
pub fn at_system_mount(mount_at: impl Fn(&Path) -> String) -> String {
    let root = cgroup2_root();
    if root == Path::new("/sys/fs/cgroup") {
        mount_at(&root)
    } else if root.parent() == Some(Path::new("/sys/fs/cgroup")) {
        format!(
            "mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup\nmkdir '{}'\n{}",
            root.display(),
            mount_at(&root)
        )
    } else if root.starts_with("/sys") {
        panic!(
            "cgroup2 at {}: the harness knows /sys/fs/cgroup and /sys/fs/cgroup/unified only",
            root.display()
        )
    } else {
        String::new()
    }
}

/// An empty directory under the temporary directory, named `<prefix>-<what>`
/// (swept with the sandbox's other files), for mounts made in a private
/// mount namespace; unmounted (should anything be mounted there) and
/// removed on drop.
#[derive(Debug)]
pub struct MountPoint {
    path: PathBuf,
}

impl MountPoint {
    pub fn new(prefix: &str, what: &str) -> Self {
        let path = std::env::temp_dir().join(format!("{prefix}-{what}"));
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for MountPoint {
    fn drop(&mut self) {
        crate::bpffs::unmount_and_remove(&self.path);
    }
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

    /// The cgroup's directory: for the test process, and for agents started
    /// through the harness (`NetNs::node_command`), which see the machine's
    /// cgroup2 mount at the same place.
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
