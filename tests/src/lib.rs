//! The test harness every end-to-end test uses: a small cluster in network
//! namespaces on one machine ([`cluster::Cluster`]), echo servers that report
//! the source address they saw and clients to reach them ([`echo`]), and
//! cleanup guaranteed by RAII (also on panic). Leftovers of a process that
//! died without unwinding (SIGKILL) are swept by the next sandbox.
//!
//! Every name a sandbox creates starts with `dpt-<pid>-<seq>`, so tests can run
//! in parallel and a sweep can tell a dead owner from a live one.

pub mod agent;
pub mod bgp;
pub mod bpffs;
pub mod cgroup;
pub mod cluster;
pub mod echo;
pub mod fake_api;
pub mod fixture;
pub mod fuzz;
pub mod lb;
pub mod load;
pub mod netns;
pub mod packet;
pub mod plan;
pub mod sandbox;
pub mod sctp;
pub mod services;
pub mod testrun;

use std::{
    sync::{
        Once,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

/// Prefix of every namespace, mount point, cgroup and temporary file the
/// harness creates.
pub const NAME_PREFIX: &str = "dpt-";

/// A fresh `dpt-<pid>-<seq>` prefix; the first call also sweeps leftovers
/// of dead test processes.
pub fn unique_prefix() -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    static SWEEP: Once = Once::new();
    SWEEP.call_once(sweep_orphans);
    format!(
        "{NAME_PREFIX}{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Retries `check` every 100 ms until it holds; after 10 s panics with
/// `what` and `context()` (an agent's log, say). For state that converges
/// (an agent applying an edit), not for timing.
pub fn eventually(what: &str, check: impl Fn() -> bool, context: impl Fn() -> String) {
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        what,
        check,
        context,
    );
}

/// The one wait of the harness: retries `check` every `every` until it
/// holds; after `within` panics with `what` and `context()`. A test that
/// reports how long something took polls often (20 ms) so that the figure
/// is not off by a whole poll; it never asserts the figure.
pub fn poll_until(
    within: Duration,
    every: Duration,
    what: &str,
    check: impl Fn() -> bool,
    context: impl Fn() -> String,
) {
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        if check() {
            return;
        }
        std::thread::sleep(every);
    }
    panic!("{what}: not reached in {within:?}\n{}", context());
}

/// Panics, saying why, unless this process can create network namespaces and
/// load BPF programs. Privileged tests never pass by skipping.
pub fn require_privileges() {
    // SAFETY: plain syscall.
    let euid = unsafe { libc::geteuid() };
    assert!(
        euid == 0,
        "this test needs root (network namespaces, BPF, bpffs); run it as root, e.g. `sudo -E cargo xtask test`"
    );
    assert!(
        std::path::Path::new("/sys/kernel/btf/vmlinux").exists(),
        "this kernel has no BTF (/sys/kernel/btf/vmlinux missing): the datapath needs CONFIG_DEBUG_INFO_BTF=y"
    );
}

/// Deletes namespaces, bpffs mounts, cgroups and temporary files whose
/// owning process is gone (a killed run's). The first sandbox of a process
/// runs it.
pub fn sweep_orphans() {
    remove_matching(|name| {
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else {
            return false;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            return false;
        };
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
    });
}

/// Stops this process's child processes (agents) and deletes every
/// namespace, bpffs directory, cgroup and temporary file it created; for a
/// signal handler that exits without unwinding.
pub fn remove_own() {
    let me = std::process::id().to_string();
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for p in procs.flatten() {
            let Ok(stat) = std::fs::read_to_string(p.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ppid ...: comm may hold spaces, so split after ')'.
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().nth(1));
            if ppid == Some(me.as_str())
                && let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>()
            {
                // SAFETY: plain kill(2) of our own child.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let own = format!("{NAME_PREFIX}{}-", std::process::id());
    remove_matching(|name| name.starts_with(&own));
}

fn remove_matching(matches: impl Fn(&str) -> bool) {
    if let Ok(dir) = std::fs::read_dir("/run/netns") {
        for name in dir.flatten().filter_map(|e| e.file_name().into_string().ok()) {
            if matches(&name) {
                let _ = std::process::Command::new("ip")
                    .args(["netns", "del", &name])
                    .output();
            }
        }
    }
    // bpffs mounts (`dpt-<pid>-bpffs`, pins and all), mount points of
    // tests, manifests directories and agent logs.
    if let Ok(dir) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in dir.flatten() {
            if entry.file_name().to_str().is_some_and(&matches) {
                bpffs::unmount_and_remove(&entry.path());
                let _ = std::fs::remove_dir_all(entry.path()).or_else(|_| std::fs::remove_file(entry.path()));
            }
        }
    }
    if let Ok(root) = dataplane_agent::os::cgroup_mount::system_cgroup2_mount()
        && let Ok(dir) = std::fs::read_dir(root.path)
    {
        for entry in dir.flatten() {
            if entry.file_name().to_str().is_some_and(&matches) {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
}

/// Makes SIGINT and SIGTERM remove this process's sandboxes before exiting
/// (Drop does not run when a signal kills the process). Call before spawning
/// threads, so they inherit the blocked mask.
pub fn cleanup_on_signal() {
    // SAFETY: signal mask manipulation with valid, initialised sets.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        std::thread::spawn(move || {
            let mut sig = 0;
            libc::sigwait(&set, &mut sig);
            eprintln!("\ninterrupted: removing the sandbox");
            remove_own();
            std::process::exit(128 + sig);
        });
    }
}
