//! Named network namespaces with guaranteed cleanup.
//!
//! A [`NetNs`] is created with `ip netns add` (so it is visible to `ip netns
//! exec` and to processes such as the agent) and deleted on drop, also while
//! unwinding from a panic. Code runs inside it on a dedicated thread that has
//! joined the namespace with `setns(2)`: sockets created there stay in the
//! namespace for their whole life, whichever thread uses them afterwards.

use std::{
    fs::File,
    io::Write as _,
    os::fd::AsRawFd as _,
    path::PathBuf,
    process::{Command, Stdio},
};

/// The index of device `name` in the calling thread's network namespace
/// (run it inside the namespace); panics when there is no such device.
pub fn ifindex(name: &str) -> u32 {
    let c = std::ffi::CString::new(name).expect("device name");
    // SAFETY: a NUL-terminated string that outlives the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    assert_ne!(i, 0, "no device {name}: {}", std::io::Error::last_os_error());
    i
}

/// Runs `ip` with `args` and panics with its stderr on failure.
pub fn ip(args: &[&str]) {
    run_checked(Command::new("ip").args(args), &format!("ip {}", args.join(" ")));
}

/// Runs `ip -batch -` with `script` (one command per line) in `ns`.
pub fn ip_batch(ns: &str, script: &str) {
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run `ip` (is iproute2 installed? `cargo xtask setup`): {e}"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("write ip batch");
    let out = child.wait_with_output().expect("wait for ip");
    assert!(
        out.status.success(),
        "ip -n {ns} -batch failed: {}\nscript:\n{script}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub(crate) fn run_checked(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{what}`: {e}"));
    assert!(
        out.status.success(),
        "`{what}` failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A named network namespace, deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates the namespace `name` with loopback up. Panics with the reason
    /// when namespaces cannot be created (not root, no CAP_SYS_ADMIN).
    pub fn new(name: &str) -> Self {
        ip(&["netns", "add", name]);
        let ns = Self {
            name: name.to_owned(),
        };
        ip(&["-n", name, "link", "set", "lo", "up"]);
        ns
    }

    /// A handle on an existing namespace that does not delete it on drop
    /// (for threads that outlive a borrow of the owner).
    pub fn adopt(name: &str) -> NetNsRef {
        NetNsRef(NetNs {
            name: name.to_owned(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Runs `f` on a thread that has joined this namespace and returns its
    /// result. Panics in `f` propagate to the caller.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let file = File::open(self.path()).unwrap_or_else(|e| panic!("open {}: {e}", self.path().display()));
        std::thread::scope(|s| {
            s.spawn(move || {
                enter(&file, &self.name);
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    /// Spawns a detached thread living in this namespace.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let file = File::open(self.path()).unwrap_or_else(|e| panic!("open {}: {e}", self.path().display()));
        let name = self.name.clone();
        std::thread::spawn(move || {
            enter(&file, &name);
            f()
        })
    }

    /// `ip -n NS -batch -` with `script`.
    pub fn ip_batch(&self, script: &str) {
        ip_batch(&self.name, script);
    }

    /// Writes a sysctl of this namespace, e.g. `("net/ipv4/ip_forward", "1")`.
    pub fn sysctl(&self, key: &str, value: &str) {
        let path = format!("/proc/sys/{key}");
        self.run(|| {
            std::fs::write(&path, value).unwrap_or_else(|e| panic!("write {path}: {e}"));
        });
    }

    /// `ethtool -K DEVICE FEATURES...` inside this namespace.
    pub fn ethtool_features(&self, device: &str, features: &[&str]) {
        let mut cmd = self.command("ethtool");
        cmd.args(["-K", device]).args(features);
        run_checked(
            &mut cmd,
            &format!("ethtool -K {device} {} (in {})", features.join(" "), self.name),
        );
    }

    /// A command that runs inside this namespace (`ip netns exec`).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }

    /// A command that runs inside this namespace as on a node: `ip netns
    /// exec` with the machine's cgroup2 mount put back at its place in
    /// `ip netns exec`'s private mount namespace (see
    /// [`crate::cgroup::system_mount_script`]). For the agent binary.
    pub fn node_command(&self, program: &str) -> Command {
        self.command_after(&crate::cgroup::system_mount_script(), program)
    }

    /// `program` inside this namespace after the `sh` commands `script` ran
    /// in `ip netns exec`'s private mount namespace (stopping at the first
    /// that fails): mounts they make are the process's alone and vanish with
    /// it. `program` replaces the shell (same pid).
    pub fn command_after(&self, script: &str, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, "sh", "-c"])
            .arg(format!("set -e\n{script}\nexec \"$@\""))
            .args(["sh", program]);
        cmd
    }
}

fn enter(file: &File, name: &str) {
    // SAFETY: plain syscall on a valid fd; only this thread changes namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert!(
        rc == 0,
        "setns into network namespace {name}: {}",
        std::io::Error::last_os_error()
    );
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if self.name.is_empty() {
            return;
        }
        // Deleting the namespace destroys its devices (and their peers, and
        // any XDP/TC attachment on them) once nothing else holds it.
        let out = Command::new("ip").args(["netns", "del", &self.name]).output();
        if let Ok(out) = out
            && !out.status.success()
        {
            eprintln!(
                "warning: ip netns del {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
}

/// A non-owning [`NetNs`]: dereferences to it, never deletes it.
#[derive(Debug)]
pub struct NetNsRef(NetNs);

impl std::ops::Deref for NetNsRef {
    type Target = NetNs;
    fn deref(&self) -> &NetNs {
        &self.0
    }
}

impl Drop for NetNsRef {
    fn drop(&mut self) {
        // Forget the name so NetNs::drop deletes nothing.
        self.0.name.clear();
    }
}
