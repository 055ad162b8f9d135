//! Which cgroup v2 mount connect-time translation attaches to when no
//! `--cgroup-path` is given.
//!
//! The agent attaches at the root of the mount it picks, so every process of
//! the node (in every network namespace) has its `connect()` translated: the
//! mount must be the system's, never a second view of the hierarchy that a
//! test harness or a tool left under `/run` or `/tmp` (which may come first
//! in `/proc/mounts`). The choice, in order:
//!
//! 1. `/sys/fs/cgroup` when it is cgroup2 (a unified host);
//! 2. `/sys/fs/cgroup/unified` when it is cgroup2 (a hybrid v1/v2 host, as
//!    systemd mounts it);
//! 3. else the first cgroup2 mount not under a scratch directory
//!    ([`SCRATCH_DIRS`]);
//! 4. else none: the agent runs without connect-time translation and says
//!    why (only scratch mounts: it names them).
//!
//! Mounts hidden by a later mount on the same path or on a parent other than
//! `/` (a fresh sysfs over `/sys`, as `ip netns exec` may mount) do not count.

use std::path::{Path, PathBuf};

/// A unified host's cgroup v2 mount.
pub const UNIFIED_MOUNT: &str = "/sys/fs/cgroup";
/// A hybrid host's cgroup v2 mount (cgroup v1 controllers at /sys/fs/cgroup/*).
pub const HYBRID_MOUNT: &str = "/sys/fs/cgroup/unified";
/// cgroup2 mounts under these are not the system's, whatever their place in
/// /proc/mounts.
pub const SCRATCH_DIRS: [&str; 4] = ["/run", "/tmp", "/var/tmp", "/dev/shm"];

/// Why a mount was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Unified,
    Hybrid,
    FirstOutsideScratch,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reason::Unified => "the system's cgroup v2 mount (unified hierarchy)",
            Reason::Hybrid => "the system's cgroup v2 mount (hybrid v1/v2 hierarchy)",
            Reason::FirstOutsideScratch => {
                "the first cgroup v2 mount outside /run, /tmp, /var/tmp and /dev/shm \
                 (none at /sys/fs/cgroup or /sys/fs/cgroup/unified)"
            }
        })
    }
}

/// The chosen mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cgroup2Mount {
    pub path: PathBuf,
    pub reason: Reason,
    /// Other visible cgroup2 mounts, not taken (stray ones included).
    pub passed_over: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum Cgroup2MountError {
    #[error("cannot read /proc/self/mounts: {0}")]
    Read(#[source] std::io::Error),
    #[error("no cgroup v2 mount is visible")]
    NotMounted,
    #[error(
        "the only cgroup v2 mounts are under /run, /tmp, /var/tmp or /dev/shm ({}): not the system's \
         (leftovers of tests or tools?), so none is used",
        list(.0)
    )]
    OnlyScratch(Vec<PathBuf>),
}

fn list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The cgroup v2 mount of this machine, chosen from `/proc/self/mounts`.
pub fn system_cgroup2_mount() -> Result<Cgroup2Mount, Cgroup2MountError> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(Cgroup2MountError::Read)?;
    choose(&mounts)
}

/// The choice (see the module's documentation) over a `/proc/mounts` text.
pub fn choose(mounts: &str) -> Result<Cgroup2Mount, Cgroup2MountError> {
    let entries: Vec<(PathBuf, &str)> = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace().skip(1);
            Some((unescape(f.next()?), f.next()?))
        })
        .collect();
    // Visible: no later mount on the same path or a parent of it (but `/`,
    // which is not always listed first).
    let visible: Vec<&PathBuf> = entries
        .iter()
        .enumerate()
        .filter(|(i, (path, fstype))| {
            *fstype == "cgroup2"
                && !entries[i + 1..]
                    .iter()
                    .any(|(later, _)| later.as_path() != Path::new("/") && path.starts_with(later))
        })
        .map(|(_, (path, _))| path)
        .collect();
    let pick = |path: &Path, reason| Cgroup2Mount {
        path: path.to_owned(),
        reason,
        passed_over: visible
            .iter()
            .filter(|p| p.as_path() != path)
            .map(|p| (*p).clone())
            .collect(),
    };
    for (candidate, reason) in [(UNIFIED_MOUNT, Reason::Unified), (HYBRID_MOUNT, Reason::Hybrid)] {
        if visible.iter().any(|p| p.as_path() == Path::new(candidate)) {
            return Ok(pick(Path::new(candidate), reason));
        }
    }
    if let Some(p) = visible.iter().find(|p| !is_scratch(p)) {
        return Ok(pick(p, Reason::FirstOutsideScratch));
    }
    if visible.is_empty() {
        Err(Cgroup2MountError::NotMounted)
    } else {
        Err(Cgroup2MountError::OnlyScratch(
            visible.into_iter().cloned().collect(),
        ))
    }
}

fn is_scratch(path: &Path) -> bool {
    SCRATCH_DIRS.iter().any(|d| path.starts_with(d))
}

/// /proc/mounts writes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> PathBuf {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    use std::os::unix::ffi::OsStringExt as _;
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "proc /proc proc rw,relatime 0 0\n\
                        sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n\
                        /dev/vda / ext4 rw,relatime 0 0\n";

    fn paths(v: &[&str]) -> Vec<PathBuf> {
        v.iter().map(PathBuf::from).collect()
    }

    #[test]
    fn a_stray_mount_listed_first_is_passed_over_for_the_unified_mount() {
        let mounts = format!(
            "none /run/dataplane-tests/cgroup2 cgroup2 rw,relatime 0 0\n{BASE}\
             cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n\
             none /tmp/x cgroup2 rw 0 0\n"
        );
        let m = choose(&mounts).expect("a mount");
        assert_eq!(m.path, Path::new("/sys/fs/cgroup"));
        assert_eq!(m.reason, Reason::Unified);
        assert_eq!(m.passed_over, paths(&["/run/dataplane-tests/cgroup2", "/tmp/x"]));
    }

    #[test]
    fn a_hybrid_host_uses_the_unified_directory() {
        let mounts = format!(
            "{BASE}none /run/dataplane-tests/cgroup2 cgroup2 rw 0 0\n\
             tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n\
             cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n\
             cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n\
             cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0\n"
        );
        let m = choose(&mounts).expect("a mount");
        assert_eq!(m.path, Path::new("/sys/fs/cgroup/unified"));
        assert_eq!(m.reason, Reason::Hybrid);
        assert_eq!(m.passed_over, paths(&["/run/dataplane-tests/cgroup2"]));
    }

    #[test]
    fn elsewhere_the_first_mount_outside_scratch_directories_wins() {
        let mounts = format!(
            "{BASE}none /tmp/dpt-1-stray cgroup2 rw 0 0\n\
             none /dev/shm/c cgroup2 rw 0 0\n\
             none /mnt/cgroup\\040v2 cgroup2 rw 0 0\n\
             none /cgroup2 cgroup2 rw 0 0\n"
        );
        let m = choose(&mounts).expect("a mount");
        assert_eq!(m.path, Path::new("/mnt/cgroup v2"));
        assert_eq!(m.reason, Reason::FirstOutsideScratch);
        assert_eq!(
            m.passed_over,
            paths(&["/tmp/dpt-1-stray", "/dev/shm/c", "/cgroup2"])
        );
    }

    #[test]
    fn only_stray_mounts_is_an_error_naming_them() {
        let mounts =
            format!("{BASE}none /run/dataplane-tests/cgroup2 cgroup2 rw 0 0\nnone /tmp/c cgroup2 rw 0 0\n");
        let err = choose(&mounts).expect_err("no system mount");
        match &err {
            Cgroup2MountError::OnlyScratch(p) => {
                assert_eq!(p, &paths(&["/run/dataplane-tests/cgroup2", "/tmp/c"]))
            }
            other => panic!("expected OnlyScratch, got {other:?}"),
        }
        assert!(
            err.to_string().contains("/run/dataplane-tests/cgroup2, /tmp/c"),
            "{err}"
        );
    }

    #[test]
    fn no_cgroup2_at_all_is_an_error() {
        let mounts = format!("{BASE}cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n");
        assert!(matches!(choose(&mounts), Err(Cgroup2MountError::NotMounted)));
        assert!(matches!(choose(""), Err(Cgroup2MountError::NotMounted)));
    }

    #[test]
    fn mounts_hidden_by_a_later_mount_do_not_count() {
        // `ip netns exec` without unmounting the old /sys: a fresh sysfs on
        // top hides /sys/fs/cgroup; an over-mounted /sys/fs/cgroup as well.
        let under_new_sysfs =
            format!("{BASE}cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\nsysfs /sys sysfs rw 0 0\n");
        assert!(matches!(
            choose(&under_new_sysfs),
            Err(Cgroup2MountError::NotMounted)
        ));
        let overmounted = format!(
            "{BASE}cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\ntmpfs /sys/fs/cgroup tmpfs rw 0 0\n\
             cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
        );
        let m = choose(&overmounted).expect("a mount");
        assert_eq!(
            (m.path.as_path(), m.reason),
            (Path::new("/sys/fs/cgroup/unified"), Reason::Hybrid)
        );
        assert!(m.passed_over.is_empty(), "{:?}", m.passed_over);
    }
}
