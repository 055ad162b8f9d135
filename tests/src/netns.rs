//! Named network namespaces with guaranteed cleanup.
//!
//! A [`NetNs`] is created with `ip netns add` (so it is visible to `ip netns
//! exec` and to processes such as the agent) and deleted on drop, also while
//! unwinding from a panic. [`NetNs::run`] runs code on a thread that has
//! joined the namespace with `setns(2)`: sockets created there stay in the
//! namespace for their whole life, whichever thread uses them afterwards
//! (which is how clients connect from a namespace and then talk from the
//! caller's thread).
//!
//! Those threads are long-lived workers, not a thread per call: each
//! `NetNs` value keeps the workers it has started (they entered the
//! namespace once) and hands each `run` to an idle one, starting another
//! only when every one is busy, so concurrent callers still run in parallel
//! and a `run` nested in another gets a worker of its own. A fresh thread
//! per call (one per `TcpStream::connect`) made the traffic generators of
//! the agent suite create tens of thousands of threads per test binary,
//! more than `pid_max` (32768) so that thread ids wrapped, and one run hung
//! for good in `pthread_join` on a thread whose id had been taken by
//! another. The workers exit, and are joined, when the `NetNs` is dropped,
//! before the namespace is deleted (they would keep it, and its devices,
//! alive).

use std::{
    fs::File,
    io::Write as _,
    os::fd::AsRawFd as _,
    panic::AssertUnwindSafe,
    path::PathBuf,
    process::{Command, Stdio},
    sync::{Mutex, PoisonError, mpsc},
    thread::JoinHandle,
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
    /// Idle threads inside the namespace, for [`NetNs::run`].
    workers: Workers,
}

impl NetNs {
    /// Creates the namespace `name` with loopback up. Panics with the reason
    /// when namespaces cannot be created (not root, no CAP_SYS_ADMIN).
    pub fn new(name: &str) -> Self {
        ip(&["netns", "add", name]);
        let ns = Self {
            name: name.to_owned(),
            workers: Workers::default(),
        };
        ip(&["-n", name, "link", "set", "lo", "up"]);
        ns
    }

    /// A handle on an existing namespace that does not delete it on drop
    /// (for threads that outlive a borrow of the owner).
    pub fn adopt(name: &str) -> NetNsRef {
        NetNsRef(NetNs {
            name: name.to_owned(),
            workers: Workers::default(),
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
    ///
    /// The thread is an idle worker of this `NetNs`, or a new one when all
    /// are busy (callers on several threads run in parallel; a `run` inside
    /// `f` gets another worker). A worker whose closure panicked is retired.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let mut result = None;
        let worker = self.workers.take().unwrap_or_else(|| Worker::start(self));
        worker.run(Box::new(|| {
            result = Some(std::panic::catch_unwind(AssertUnwindSafe(f)));
        }));
        match result.expect("the worker ran the closure") {
            Ok(value) => {
                self.workers.put_back(worker);
                value
            }
            Err(panic) => {
                drop(worker);
                std::panic::resume_unwind(panic)
            }
        }
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
    if let Err(e) = try_enter(file, name) {
        panic!("{e}");
    }
}

fn try_enter(file: &File, name: &str) -> Result<(), String> {
    // SAFETY: plain syscall on a valid fd; only this thread changes namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!(
            "setns into network namespace {name}: {}",
            std::io::Error::last_os_error()
        ))
    }
}

/// A closure for a worker, its borrows' lifetime erased (see
/// [`Worker::run`]).
type Job = Box<dyn FnOnce() + Send + 'static>;

/// A thread inside a namespace that runs [`Job`]s one at a time until its
/// job channel closes.
struct Worker {
    jobs: Option<mpsc::Sender<Job>>,
    /// One message per job, sent after the job (and everything it
    /// captured) is gone.
    done: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts a thread that joins `ns`; panics as `run` did when the
    /// namespace cannot be opened or joined.
    fn start(ns: &NetNs) -> Self {
        let file = File::open(ns.path()).unwrap_or_else(|e| panic!("open {}: {e}", ns.path().display()));
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let name = ns.name.clone();
        let thread = std::thread::Builder::new()
            .name(format!("netns {name}"))
            .spawn(move || {
                let entered = try_enter(&file, &name);
                drop(file);
                let ok = entered.is_ok();
                let _ = ready_tx.send(entered);
                if !ok {
                    return;
                }
                while let Ok(job) = job_rx.recv() {
                    job();
                    if done_tx.send(()).is_err() {
                        break;
                    }
                }
            })
            .unwrap_or_else(|e| panic!("spawn a thread for network namespace {}: {e}", ns.name));
        let worker = Self {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => worker,
            Ok(Err(e)) => panic!("{e}"),
            Err(_) => panic!("the thread for network namespace {} died", ns.name),
        }
    }

    /// Runs `job` on this worker and waits until it is done.
    fn run<'a>(&self, job: Box<dyn FnOnce() + Send + 'a>) {
        // SAFETY: only the lifetime changes (same layout). The job's
        // borrows outlive its use: this function returns only after
        // `done` said the job ran (the worker sends it after the call,
        // which consumed the job and what it captured) or after the worker
        // dropped its end of `done`, which it does only after leaving its
        // loop, past any job it held; a job the worker never received
        // comes back in the `SendError` and is dropped here.
        let job: Job = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + 'a>, Job>(job) };
        let sent = self.jobs.as_ref().expect("a live worker").send(job);
        assert!(sent.is_ok(), "a network namespace worker exited");
        self.done
            .recv()
            .expect("a network namespace worker exited during a job");
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the job channel ends the worker's loop: it is idle (no
        // job runs on a worker outside `run`), so the join is immediate.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The idle workers of a [`NetNs`].
#[derive(Default)]
struct Workers(Mutex<Vec<Worker>>);

impl Workers {
    fn take(&self) -> Option<Worker> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).pop()
    }

    fn put_back(&self, worker: Worker) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(worker);
    }

    /// Stops and joins every worker.
    fn stop(&mut self) {
        let workers = std::mem::take(self.0.get_mut().unwrap_or_else(PoisonError::into_inner));
        drop(workers);
    }
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.try_lock() {
            Ok(idle) => write!(f, "Workers {{ idle: {} }}", idle.len()),
            Err(_) => f.write_str("Workers { .. }"),
        }
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // The workers first: a thread inside the namespace keeps it alive.
        self.workers.stop();
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
