//! What the privileged tests may leave on the machine, snapshotted before
//! and after them: mounts, network namespaces, the project's pins under
//! /sys/fs/bpf, and the cgroups the harness creates. Anything new afterwards
//! is a leftover, and `cargo xtask test` fails listing it.
//!
//! `/run/netns` itself becoming a mount point is not counted: iproute2 makes
//! it one at the first `ip netns add` on a machine and keeps it.
//!
//! The harness names what it creates `dpt-<pid>-...`; an item with such a name
//! whose process is still alive belongs to another run on the same machine
//! (ours have all exited when `cargo test` returns) and is not counted.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

/// Each item of the machine's state, with how many times it is there
/// (a path can be mounted twice).
#[derive(Debug, Default)]
pub struct Snapshot(BTreeMap<String, usize>);

impl Snapshot {
    pub fn take() -> Self {
        let mut items = BTreeMap::new();
        let mut add = |item: String| *items.entry(item).or_insert(0) += 1;
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        for line in mounts.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            // iproute2's own: the first `ip netns add` on a machine makes
            // /run/netns a (shared) mount point, for good, by design.
            if f.len() > 2 && f[1] != "/run/netns" {
                add(format!("mount {} ({})", f[1], f[2]));
            }
        }
        for name in netns() {
            add(format!("network namespace {name}"));
        }
        if mounts
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf"))
        {
            for pin in project_pins(Path::new("/sys/fs/bpf")) {
                add(format!("bpffs {}", pin.display()));
            }
        }
        for root in cgroup2_roots(&mounts) {
            for cg in harness_cgroups(&root) {
                add(format!("cgroup {}", cg.display()));
            }
        }
        Self(items)
    }

    /// What `after` holds more of than `self`, but items of live processes
    /// of other runs.
    pub fn leftovers(&self, after: &Snapshot) -> Vec<String> {
        after
            .0
            .iter()
            .filter(|(item, n)| **n > self.0.get(*item).copied().unwrap_or(0) && !owner_alive(item))
            .map(|(item, _)| item.clone())
            .collect()
    }
}

/// `ip netns list`: the names.
fn netns() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

/// Everything under `bpffs` whose path has a component of the project's:
/// `dataplane*` (the agent's default pin directory and the like) or `dpt-*`
/// (the harness's).
fn project_pins(bpffs: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![(bpffs.to_owned(), false)];
    while let Some((dir, ours)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = ours || name.starts_with("dataplane") || name.starts_with("dpt-");
            if ours {
                out.push(e.path());
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push((e.path(), ours));
            }
        }
    }
    out
}

/// The machine's cgroup2 mounts the harness creates cgroups in.
fn cgroup2_roots(mounts: &str) -> Vec<PathBuf> {
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "cgroup2" && ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"].contains(&f[1]))
                .then(|| PathBuf::from(f[1]))
        })
        .collect()
}

/// Cgroups the harness (`dpt-*`) and `trace` (`dataplane-trace-*`) create.
fn harness_cgroups(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            e.file_type().is_ok_and(|t| t.is_dir())
                && (name.starts_with("dpt-") || name.starts_with("dataplane-"))
        })
        .map(|e| e.path())
        .collect()
}

/// Whether `item` names a `dpt-<pid>-` thing whose process is alive.
fn owner_alive(item: &str) -> bool {
    item.match_indices("dpt-").any(|(i, _)| {
        let rest = &item[i + 4..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        !digits.is_empty()
            && rest[digits.len()..].starts_with('-')
            && Path::new(&format!("/proc/{digits}")).exists()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_items_are_leftovers_and_removed_ones_are_not() {
        let items = |v: &[(&str, usize)]| Snapshot(v.iter().map(|(k, n)| (k.to_string(), *n)).collect());
        let before = items(&[
            ("mount / (ext4)", 1),
            ("mount /dev/pts (devpts)", 2),
            ("network namespace a", 1),
        ]);
        let after = items(&[
            ("mount / (ext4)", 1),
            ("mount /dev/pts (devpts)", 3),
            ("mount /run/dataplane-tests/cgroup2 (cgroup2)", 1),
            // The pid of this process: alive, another run's.
            (
                &format!("network namespace dpt-{}-0-node1", std::process::id()),
                1,
            ),
            ("network namespace dpt-999999999-0-node1", 1),
        ]);
        assert_eq!(
            before.leftovers(&after),
            [
                "mount /dev/pts (devpts)",
                "mount /run/dataplane-tests/cgroup2 (cgroup2)",
                "network namespace dpt-999999999-0-node1",
            ]
        );
    }
}
