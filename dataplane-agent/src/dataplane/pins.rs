//! The per-instance pin directory in bpffs: `<dir>/maps/<MAP_V1>` and
//! `<dir>/links/<program>@<device>`. Maps and links pinned there outlive the
//! agent, so the datapath keeps forwarding while it is down, and a restarted
//! agent adopts them.
//!
//! One agent per directory: the agent holds an exclusive `flock` on the
//! directory for its whole life (released by the kernel when it exits, even
//! on SIGKILL); a second agent, or `cleanup` without `--force`, is refused
//! with the holder's pid.
//!
//! Map capacities are chosen when a map is created. A restart with other
//! limits (`--max-services`, `--max-backends`, `--conntrack-entries`)
//! migrates: the old map is set aside, a new one of the asked size is
//! created and filled from it, and the old one is dropped once the new
//! programs are attached ([`Migration`]). Shrinking below what is in use is
//! refused with the size that would fit.

use std::{
    io,
    os::{fd::AsFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
};

use aya::maps::MapData;
use dataplane_common::{
    config::DpConfig,
    ct::{Ct4Entry, Ct4Key, Ct6Entry, Ct6Key, Sock4RevKey, Sock4RevValue, Sock6RevKey, Sock6RevValue},
    lb::DsrValue,
    lb4::{
        Lb4AffinityKey, Lb4Backend, Lb4ServiceKey, Lb6AffinityKey, Lb6Backend, Lb6ServiceKey,
        LbAffinityValue, LbService, LbServiceName,
    },
    names,
    stats::Counter,
};

use super::batch;

/// What can go wrong with the pin directory.
#[derive(Debug, thiserror::Error)]
pub enum PinDirError {
    #[error(
        "{0} is not on a bpffs mount: pins elsewhere would not outlive the agent (mount -t bpf bpf DIR, \
         or use a directory under {BPFFS_ROOT})"
    )]
    NotBpffs(PathBuf),
    #[error("cannot create the pin directory {path}: {source} (is {BPFFS_ROOT} a bpffs mount?)")]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "bpffs is not mounted at {BPFFS_ROOT} and mounting it failed: {0} (needs CAP_SYS_ADMIN, or mount it \
         on the host: mount -t bpf bpf {BPFFS_ROOT})"
    )]
    Mount(#[source] io::Error),
    #[error("no pinned maps under {0}: is the agent's --bpffs-dir another one?")]
    NoPins(PathBuf),
    #[error(
        "pinned map {path} has key/value sizes {key}/{value}, this version needs {want_key}/{want_value}; \
         remove it (`dataplane-agent cleanup --bpffs-dir {root}`) to start afresh"
    )]
    Layout {
        path: PathBuf,
        key: u32,
        value: u32,
        want_key: u32,
        want_value: u32,
        root: PathBuf,
    },
    #[error(
        "another agent{} holds {dir}: one agent per pin directory (stop it, or give this one its own \
         --bpffs-dir)",
        holder.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    Locked { dir: PathBuf, holder: Option<u32> },
    #[error("cannot lock {dir}: {source}")]
    Lock {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "pinned map {map} holds {what}; {flag} {asked} is too small for it (use at least {needed}, or \
         `dataplane-agent cleanup --bpffs-dir {root}` to start afresh)"
    )]
    TooSmall {
        map: &'static str,
        what: String,
        flag: &'static str,
        asked: u32,
        needed: u64,
        root: PathBuf,
    },
    #[error("resizing pinned map {map}: {source}")]
    Resize {
        map: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("pinned map {map}: {source}")]
    Map {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
}

pub const BPFFS_ROOT: &str = "/sys/fs/bpf";

/// Key and value sizes every pinned map must have to be reused.
fn expected_layout(name: &str) -> Option<(u32, u32)> {
    use std::mem::size_of;
    let s = |k: usize, v: usize| Some((k as u32, v as u32));
    match name {
        names::CONFIG => s(4, size_of::<DpConfig>()),
        names::LB4_SERVICES => s(size_of::<Lb4ServiceKey>(), size_of::<LbService>()),
        names::LB4_BACKENDS => s(4, size_of::<Lb4Backend>()),
        names::LB4_AFFINITY => s(size_of::<Lb4AffinityKey>(), size_of::<LbAffinityValue>()),
        // LPM key: prefix length + service id + address.
        names::LB4_SOURCE_RANGES => s(12, 1),
        names::CT4 | names::CT4_ASSURED => s(size_of::<Ct4Key>(), size_of::<Ct4Entry>()),
        names::CT6 | names::CT6_ASSURED => s(size_of::<Ct6Key>(), size_of::<Ct6Entry>()),
        names::LB6_SERVICES => s(size_of::<Lb6ServiceKey>(), size_of::<LbService>()),
        names::LB6_BACKENDS => s(4, size_of::<Lb6Backend>()),
        names::LB6_AFFINITY => s(size_of::<Lb6AffinityKey>(), size_of::<LbAffinityValue>()),
        // LPM key: prefix length + service id + address.
        names::LB6_SOURCE_RANGES => s(24, 1),
        names::SOCK6_REVNAT => s(size_of::<Sock6RevKey>(), size_of::<Sock6RevValue>()),
        names::COUNTERS | names::SERVICE_STATS | names::FLOW_STATS => s(4, size_of::<Counter>()),
        names::ADDR_FILTER | names::HINT_DEVICES => s(4, 8),
        names::SNAT_CURSORS => s(4, size_of::<dataplane_common::ct::SnatCursor>()),
        names::SNAT4_CLOSED => s(size_of::<Ct4Key>(), size_of::<dataplane_common::ct::SnatClosed>()),
        names::SNAT6_CLOSED => s(size_of::<Ct6Key>(), size_of::<dataplane_common::ct::SnatClosed>()),
        names::LB4_SERVICE_NAMES => s(4, size_of::<LbServiceName>()),
        names::SOCK4_REVNAT => s(size_of::<Sock4RevKey>(), size_of::<Sock4RevValue>()),
        names::LB_MAGLEV => s(
            size_of::<dataplane_common::lb::MaglevKey>(),
            size_of::<dataplane_common::lb::MaglevChunk>(),
        ),
        names::LB4_DSR => s(size_of::<dataplane_common::lb::Dsr4Key>(), size_of::<DsrValue>()),
        names::LB6_DSR => s(size_of::<dataplane_common::lb::Dsr6Key>(), size_of::<DsrValue>()),
        // ifindex → `struct bpf_devmap_val` (ifindex, program fd/id).
        names::XDP_DEVICES => s(4, 8),
        // A ring buffer has neither keys nor values.
        names::MONITOR_EVENTS => s(0, 0),
        names::MONITOR_CTL => s(4, size_of::<dataplane_common::monitor::MonitorCtl>()),
        names::MONITOR_RATE => s(4, size_of::<dataplane_common::monitor::MonitorRate>()),
        names::MONITOR_SAMPLE => s(4, size_of::<dataplane_common::monitor::MonitorSample>()),
        _ => None,
    }
}

#[derive(Clone, Debug)]
pub struct PinDir {
    root: PathBuf,
}

impl PinDir {
    /// Creates `<root>/maps` and `<root>/links`, mounting bpffs at
    /// /sys/fs/bpf first when it is not mounted.
    pub fn create(root: &Path) -> Result<Self, PinDirError> {
        if root.starts_with(BPFFS_ROOT) {
            ensure_bpffs()?;
        }
        let parent = root.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
        if !on_bpffs(parent) {
            return Err(PinDirError::NotBpffs(root.to_owned()));
        }
        for sub in ["maps", "links"] {
            let path = root.join(sub);
            std::fs::create_dir_all(&path).map_err(|source| PinDirError::Create { path, source })?;
        }
        Ok(Self {
            root: root.to_owned(),
        })
    }

    /// An existing pin directory, created by an agent (nothing is created).
    pub fn open(root: &Path) -> Result<Self, PinDirError> {
        if !root.join("maps").is_dir() {
            return Err(PinDirError::NoPins(root.to_owned()));
        }
        Ok(Self {
            root: root.to_owned(),
        })
    }

    /// An existing pin directory, possibly partly removed (`cleanup`):
    /// `None` unless it holds `maps/` or `links/`.
    pub fn open_partial(root: &Path) -> Option<Self> {
        Self::is_pin_dir(root).then(|| Self {
            root: root.to_owned(),
        })
    }

    /// Takes the directory for this process (until it exits); refused while
    /// another process holds it.
    pub fn lock(&self) -> Result<PinLock, PinDirError> {
        let lock_err = |source| PinDirError::Lock {
            dir: self.root.clone(),
            source,
        };
        let dir = std::fs::File::open(&self.root).map_err(lock_err)?;
        match dir.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(PinDirError::Locked {
                    dir: self.root.clone(),
                    holder: self.holder(),
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(lock_err(e)),
        }
        let meta = dir.metadata().map_err(lock_err)?;
        Ok(PinLock {
            _dir: dir,
            root: self.root.clone(),
            dev_ino: (meta.dev(), meta.ino()),
        })
    }

    /// The pid holding the directory's lock, from /proc/locks.
    pub fn holder(&self) -> Option<u32> {
        let meta = std::fs::metadata(&self.root).ok()?;
        let dev = meta.dev();
        // SAFETY: major/minor only split the number.
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        let want = format!("{major:02x}:{minor:02x}:{}", meta.ino());
        let locks = std::fs::read_to_string("/proc/locks").ok()?;
        locks.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "1: FLOCK  ADVISORY  WRITE 4242 00:2f:1234 0 EOF"
            (f.len() > 5 && f[1] == "FLOCK" && f[5] == want).then(|| f[4].parse().ok())?
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.root.join("maps").join(name)
    }

    pub fn link(&self, program: &str, device: &str) -> PathBuf {
        self.root.join("links").join(format!("{program}@{device}"))
    }

    /// Checks that every pinned map this version uses has the layout it
    /// expects; a mismatch is an error, never a misread.
    pub fn check_layouts(&self) -> Result<(), PinDirError> {
        for name in names::ALL_MAPS {
            self.check_layout(name)?;
        }
        Ok(())
    }

    /// Checks one pinned map (if it is pinned); returns its capacity.
    pub fn check_layout(&self, name: &'static str) -> Result<Option<u32>, PinDirError> {
        let path = self.map(name);
        if !path.exists() {
            return Ok(None);
        }
        let map_err = |source| PinDirError::Map { map: name, source };
        let map = MapData::from_pin(&path).map_err(map_err)?;
        let info = map.info().map_err(map_err)?;
        let (want_key, want_value) = expected_layout(name).expect("every map has a layout");
        if info.key_size() != want_key || info.value_size() != want_value {
            return Err(PinDirError::Layout {
                path,
                key: info.key_size(),
                value: info.value_size(),
                want_key,
                want_value,
                root: self.root.clone(),
            });
        }
        Ok(Some(info.max_entries()))
    }

    /// The SNAT hash seed of a pinned config map of the previous layout
    /// (`DP_CONFIG_V3`, whose first 264 bytes the current one keeps), if
    /// one is configured: an agent upgraded over it keeps hashing live
    /// masqueraded flows' ports the same way.
    pub fn legacy_snat_seed(&self) -> Option<u32> {
        const V3: &str = "DP_CONFIG_V3";
        // `flags` at 0, `snat_hash_seed` at 52 in both layouts.
        const SEED_AT: usize = 52;
        const _: () = assert!(std::mem::offset_of!(DpConfig, snat_hash_seed) == SEED_AT);
        let data = MapData::from_pin(self.root.join("maps").join(V3)).ok()?;
        let map = aya::maps::Array::<_, [u8; 264]>::try_from(aya::maps::Map::Array(data)).ok()?;
        let v = map.get(&0, 0).ok()?;
        let flags = u32::from_ne_bytes(v[..4].try_into().ok()?);
        (flags & dataplane_common::config::config_flags::CONFIGURED != 0)
            .then(|| u32::from_ne_bytes(v[SEED_AT..SEED_AT + 4].try_into().expect("4 bytes")))
    }

    /// Pinned maps this version does not use (older layouts), removed once
    /// the new programs are attached: replaced deliberately.
    pub fn remove_foreign_maps(&self) -> Vec<String> {
        let mut removed = Vec::new();
        if let Ok(dir) = std::fs::read_dir(self.root.join("maps")) {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                // Also `<map>-retired`: the old copy of a resized map.
                if !names::ALL_MAPS.contains(&name.as_str()) && std::fs::remove_file(e.path()).is_ok() {
                    removed.push(name);
                }
            }
        }
        removed
    }

    /// Link pins whose device no longer exists in this network namespace
    /// (the link is defunct): removed.
    pub fn remove_stale_links(&self) -> Vec<String> {
        let mut removed = Vec::new();
        if let Ok(dir) = std::fs::read_dir(self.root.join("links")) {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Some((program, device)) = name.split_once('@') else {
                    continue;
                };
                // Connect-time links hang off a cgroup, not a device.
                if super::SOCK_PROGRAMS.contains(&program) {
                    continue;
                }
                if !Path::new("/sys/class/net").join(device).exists()
                    && std::fs::remove_file(e.path()).is_ok()
                {
                    removed.push(name);
                }
            }
        }
        removed
    }

    /// The devices with an ingress program's link pinned here (this run's,
    /// or an earlier run's that is still attached).
    pub fn ingress_link_devices(&self) -> Vec<String> {
        let Ok(dir) = std::fs::read_dir(self.root.join("links")) else {
            return Vec::new();
        };
        dir.flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let (program, device) = name.split_once('@')?;
                [names::XDP_INGRESS, names::TC_INGRESS, names::TC_POD_INGRESS]
                    .contains(&program)
                    .then(|| device.to_owned())
            })
            .collect()
    }

    /// Whether `root` holds an agent's pins (its `maps/` or `links/`).
    pub fn is_pin_dir(root: &Path) -> bool {
        root.join("maps").is_dir() || root.join("links").is_dir()
    }

    /// Removes the agent's pins: links first (the programs detach), then
    /// maps (released once unused). Only `links/` and `maps/` are removed,
    /// and the directory itself when nothing else is left in it: anything
    /// else under it (another tool's pins, another agent's directory) stays.
    pub fn remove_all(&self) -> std::io::Result<()> {
        let ignore_missing = |r: std::io::Result<()>| match r {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        for sub in ["links", "maps"] {
            ignore_missing(std::fs::remove_dir_all(self.root.join(sub)))?;
        }
        match std::fs::remove_dir(&self.root) {
            Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty => Ok(()),
            // A bpffs mount point itself cannot be removed: its pins are gone.
            Err(e)
                if e.kind() == std::io::ErrorKind::PermissionDenied
                    || e.raw_os_error() == Some(libc::EBUSY) =>
            {
                Ok(())
            }
            r => ignore_missing(r),
        }
    }
}

/// This process's hold on a pin directory, released when dropped (or when
/// the process exits, however it exits).
#[derive(Debug)]
pub struct PinLock {
    _dir: std::fs::File,
    root: PathBuf,
    dev_ino: (u64, u64),
}

impl PinLock {
    /// Whether the locked directory is still the pin directory (not removed
    /// by `cleanup --force`).
    pub fn intact(&self) -> bool {
        std::fs::metadata(&self.root).is_ok_and(|m| (m.dev(), m.ino()) == self.dev_ino)
            && self.root.join("maps").is_dir()
    }
}

// bpffs refuses names with a dot (EPERM): suffixes use a dash.
/// Suffix of a map set aside while a resized copy is filled (a crash here
/// puts it back at the next start).
const RESIZING: &str = "-resizing";
/// Suffix of the old map once the new one is filled: entries the old
/// programs added meanwhile are copied over once the new programs run, then
/// it goes.
const RETIRED: &str = "-retired";

/// A map whose capacity changes: `from` pinned, `to` asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resize {
    pub map: &'static str,
    pub from: u32,
    pub to: u32,
}

/// The maps whose capacity comes from the options, with the flag that sets
/// it. The IPv6 maps follow the IPv4 ones' sizes on a node that serves IPv6
/// (they grow when the node gains an IPv6 address); otherwise they are left
/// as they are pinned (one entry when created on an IPv4-only node; a node
/// that loses its IPv6 address keeps its IPv6 maps and their flows).
pub fn sized_maps(opts: &super::LoadOptions) -> Vec<(&'static str, u32, &'static str)> {
    let mut out = vec![
        (names::SERVICE_STATS, opts.max_services, "--max-services"),
        (names::LB4_SERVICE_NAMES, opts.max_services, "--max-services"),
        (names::LB4_BACKENDS, opts.max_backends, "--max-backends"),
        (
            names::LB4_SERVICES,
            opts.max_service_entries,
            "--max-services/--max-backends (services map entries)",
        ),
        (names::CT4, opts.ct_entries, "--conntrack-entries"),
        (names::CT4_ASSURED, opts.ct_entries, "--conntrack-entries"),
        (names::LB4_AFFINITY, opts.affinity_entries, "affinity entries"),
    ];
    if opts.ipv6 {
        out.extend([
            (names::LB6_BACKENDS, opts.max_backends, "--max-backends"),
            (
                names::LB6_SERVICES,
                opts.max_service_entries,
                "--max-services/--max-backends (services map entries)",
            ),
            (names::CT6, opts.ct_entries, "--conntrack-entries"),
            (names::CT6_ASSURED, opts.ct_entries, "--conntrack-entries"),
            (names::LB6_AFFINITY, opts.affinity_entries, "affinity entries"),
            (
                names::SOCK6_REVNAT,
                dataplane_common::limits::SOCK_REVNAT_ENTRIES,
                "connect-time translations",
            ),
            (
                names::SNAT6_CLOSED,
                dataplane_common::limits::SNAT_CLOSED_ENTRIES,
                "closed SNAT tuples",
            ),
        ]);
    }
    out
}

/// Raw shape of a map: what a byte-level copy needs.
struct Shape {
    array: bool,
    key_size: usize,
    /// Bytes of one element's value in a batch buffer (all CPUs for per-CPU
    /// maps).
    value_size: usize,
}

impl Shape {
    fn of(map: &MapData, name: &'static str) -> Result<Self, PinDirError> {
        let info = map
            .info()
            .map_err(|source| PinDirError::Map { map: name, source })?;
        use aya::maps::MapType;
        let map_type = info
            .map_type()
            .map_err(|source| PinDirError::Map { map: name, source })?;
        let per_cpu = matches!(
            map_type,
            MapType::PerCpuHash | MapType::PerCpuArray | MapType::LruPerCpuHash
        );
        let ncpus = if per_cpu {
            aya::util::nr_cpus().map_err(|(_, source)| PinDirError::Resize { map: name, source })?
        } else {
            1
        };
        let value = info.value_size() as usize;
        Ok(Self {
            array: matches!(map_type, MapType::Array | MapType::PerCpuArray),
            key_size: info.key_size() as usize,
            value_size: if per_cpu {
                value.div_ceil(8) * 8 * ncpus
            } else {
                value
            },
        })
    }

    fn is_array(&self) -> bool {
        self.array
    }
}

impl PinDir {
    fn aside(&self, name: &str, suffix: &str) -> PathBuf {
        self.root.join("maps").join(format!("{name}{suffix}"))
    }

    /// Moves a pinned map to another path (rename(2): atomic).
    fn move_pin(&self, map: &'static str, from: &Path, to: &Path) -> Result<(), PinDirError> {
        std::fs::rename(from, to).map_err(|source| PinDirError::Resize { map, source })
    }

    /// Puts back a map set aside by a resize that did not finish (the agent
    /// died while filling the new one).
    pub fn recover_resize(&self) -> Result<(), PinDirError> {
        for name in names::ALL_MAPS {
            let aside = self.aside(name, RESIZING);
            if aside.exists() {
                let _ = std::fs::remove_file(self.map(name));
                self.move_pin(name, &aside, &self.map(name))?;
            }
        }
        Ok(())
    }

    /// The pinned maps whose capacity differs from the one asked. Refused
    /// when a map would be too small for what it holds.
    pub fn plan_resize(&self, opts: &super::LoadOptions) -> Result<Vec<Resize>, PinDirError> {
        let mut out = Vec::new();
        for (map, to, flag) in sized_maps(opts) {
            let Some(from) = self.check_layout(map)? else {
                continue;
            };
            if from == to {
                continue;
            }
            if to < from {
                self.check_fits(map, to, flag)?;
            }
            out.push(Resize { map, from, to });
        }
        Ok(out)
    }

    /// Whether what `map` holds fits in `to` entries.
    fn check_fits(&self, map: &'static str, to: u32, flag: &'static str) -> Result<(), PinDirError> {
        let data = MapData::from_pin(self.map(map)).map_err(|source| PinDirError::Map { map, source })?;
        let shape = Shape::of(&data, map)?;
        let mut count: u64 = 0;
        let mut highest: Option<u32> = None;
        batch::for_each_raw(
            data.fd().as_fd(),
            shape.key_size,
            shape.value_size,
            |key, value| {
                if shape.is_array() && value.iter().all(|b| *b == 0) {
                    return;
                }
                count += 1;
                let index = u32::from_ne_bytes(key[..4].try_into().expect("4-byte keys"));
                highest = highest.max(Some(index));
            },
        )
        .map_err(|source| PinDirError::Resize { map, source })?;
        let too_small = |what: String, needed: u64| PinDirError::TooSmall {
            map,
            what,
            flag,
            asked: to,
            needed,
            root: self.root.clone(),
        };
        match map {
            names::LB4_BACKENDS | names::LB6_BACKENDS => match highest {
                Some(h) if h >= to => Err(too_small(format!("backend id {h}"), h as u64 + 1)),
                _ => Ok(()),
            },
            // Service ids must stay below the capacity.
            names::LB4_SERVICE_NAMES => match highest {
                Some(h) if h >= to || count > to as u64 => Err(too_small(
                    format!("{count} service ports, ids up to {h}"),
                    (h as u64 + 1).max(count),
                )),
                _ => Ok(()),
            },
            names::LB4_SERVICES | names::LB6_SERVICES if count > to as u64 => {
                Err(too_small(format!("{count} entries"), count))
            }
            // Conntrack is an LRU map, but a copy into a smaller one would
            // drop established flows: refused like the rest.
            names::CT4 | names::CT6 | names::CT4_ASSURED | names::CT6_ASSURED if count > to as u64 => {
                Err(too_small(format!("{count} tracked flow entries"), count))
            }
            // Counters of ids that cannot exist any more, and the affinity
            // maps (LRU: a client's affinity is only a preference).
            _ => Ok(()),
        }
    }

    /// Sets the pinned `map` aside before the new one is created.
    pub fn set_aside(&self, map: &'static str) -> Result<(), PinDirError> {
        self.move_pin(map, &self.map(map), &self.aside(map, RESIZING))
    }

    /// Fills the newly created `map` from the one set aside, then marks the
    /// old one retired.
    pub fn fill_resized(&self, map: &'static str) -> Result<usize, PinDirError> {
        let aside = self.aside(map, RESIZING);
        let n = self.copy(map, &aside, false)?;
        self.move_pin(map, &aside, &self.aside(map, RETIRED))?;
        Ok(n)
    }

    /// Once the new programs run (nothing writes the old map any more):
    /// copies what the old programs added meanwhile (hash maps: entries the
    /// new map lacks) and removes the old map.
    pub fn retire_resized(&self, map: &'static str) -> Result<usize, PinDirError> {
        let retired = self.aside(map, RETIRED);
        if !retired.exists() {
            return Ok(0);
        }
        let n = self.copy(map, &retired, true)?;
        std::fs::remove_file(&retired).map_err(|source| PinDirError::Resize { map, source })?;
        Ok(n)
    }

    /// Copies the entries of the map pinned at `from` into the pinned
    /// `map`, byte for byte (same layout, other capacity); array indexes
    /// beyond the new capacity are dropped (checked before). `only_missing`:
    /// entries already in the new map are kept.
    fn copy(&self, map: &'static str, from: &Path, only_missing: bool) -> Result<usize, PinDirError> {
        let map_err = |source| PinDirError::Map { map, source };
        let old = MapData::from_pin(from).map_err(map_err)?;
        let new = MapData::from_pin(self.map(map)).map_err(map_err)?;
        let shape = Shape::of(&old, map)?;
        if only_missing && shape.is_array() {
            return Ok(0);
        }
        let capacity = new.info().map_err(map_err)?.max_entries();
        let resize_err = |source| PinDirError::Resize { map, source };
        // Batched updates take no BPF_NOEXIST: the keys the new map has are
        // read first and skipped.
        let mut present = std::collections::HashSet::new();
        if only_missing {
            batch::for_each_raw(new.fd().as_fd(), shape.key_size, shape.value_size, |k, _| {
                present.insert(k.to_vec());
            })
            .map_err(resize_err)?;
        }
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        batch::for_each_raw(old.fd().as_fd(), shape.key_size, shape.value_size, |k, v| {
            if shape.is_array() {
                let index = u32::from_ne_bytes(k[..4].try_into().expect("4-byte keys"));
                if index >= capacity || v.iter().all(|b| *b == 0) {
                    return;
                }
            }
            if only_missing && present.contains(k) {
                return;
            }
            keys.extend_from_slice(k);
            values.extend_from_slice(v);
        })
        .map_err(resize_err)?;
        batch::update_raw(new.fd().as_fd(), shape.key_size, shape.value_size, &keys, &values)
            .map_err(|(_, source)| PinDirError::Resize { map, source })
    }
}

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// Whether `path` is on a bpffs mount.
pub fn on_bpffs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs fills the struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0) && st.f_type as i64 == BPF_FS_MAGIC
}

fn bpffs_mounted() -> bool {
    std::fs::read_to_string("/proc/mounts").is_ok_and(|m| {
        m.lines().any(|l| {
            let mut f = l.split_whitespace().skip(1);
            f.next() == Some(BPFFS_ROOT) && f.next() == Some("bpf")
        })
    })
}

/// Mounts bpffs at /sys/fs/bpf when absent (as the kubelet-less test
/// machines need; on nodes it usually is mounted already).
pub fn ensure_bpffs() -> Result<(), PinDirError> {
    if bpffs_mounted() {
        return Ok(());
    }
    let target = std::ffi::CString::new(BPFFS_ROOT).expect("no NUL");
    let fstype = std::ffi::CString::new("bpf").expect("no NUL");
    // SAFETY: valid NUL-terminated strings; no data argument.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 && !bpffs_mounted() {
        return Err(PinDirError::Mount(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_pinned_map_has_an_expected_layout() {
        for name in dataplane_common::names::ALL_MAPS {
            assert!(super::expected_layout(name).is_some(), "{name}");
        }
    }
}
