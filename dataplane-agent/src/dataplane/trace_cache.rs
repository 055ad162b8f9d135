//! The private datapath `trace` runs a packet through, and the verified copy
//! of it kept in bpffs between traces.
//!
//! Loading the object costs the verifier's time for every program loaded
//! (seconds for the packet programs); running one packet through them costs
//! microseconds. So a trace loads only the programs its packet's path needs
//! ([`needed_programs`]) and pins them, with every map they use, under
//! `<cache dir>/<key>/` (`programs/<path>/<name>`, `maps/<MAP>`); the next
//! trace opens them from the pins instead of verifying them again, and
//! starts from maps emptied to what a fresh load has ([`reset_maps`]).
//!
//! The programs of one path (`external`, `pod`, `host`) are loaded
//! together, as the agent loads all of its own: they share every map of the
//! object and the load-time clock constants (`tc_egress` reads the
//! conntrack entries `xdp_ingress` stamped). Paths share the pinned maps,
//! never programs: a program two paths run is verified once for each.
//!
//! The key is a hash of the embedded object and the map sizes: another
//! agent build is another key, and opening the cache removes the entries of
//! other keys (a process still using one keeps its descriptors). One trace
//! at a time uses the cache: an exclusive `flock` on the cache directory,
//! held for the whole trace (a trace holds it for milliseconds; one that
//! loads programs for as long as the verifier takes, which the waiting one
//! would have spent too).
//!
//! Nothing here is attached anywhere, and nothing reads or writes an agent's
//! pins: a cache directory inside an agent's pin directory is refused.

use std::{
    fs::File,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::{
    maps::{MapData, MapType},
    programs::{CgroupAttachMode, CgroupSockAddr, CgroupSockAddrAttachType, SchedClassifier, Xdp},
};
use aya_obj::programs::XdpAttachType;
use dataplane_common::names;

use super::{Datapath, DatapathError, EBPF_OBJECT, LbMaps, LoadOptions, PinDir, SOCK_PROGRAMS, batch, pins};

/// Where `trace` keeps its verified programs unless told otherwise.
pub const DEFAULT_TRACE_CACHE_DIR: &str = "/sys/fs/bpf/dataplane-trace";

/// Bumped when what an entry holds changes meaning (part of the key).
const CACHE_FORMAT: &str = "trace-cache-v1";

/// What can go wrong with the cache (the trace then goes on without it).
#[derive(Debug, thiserror::Error)]
pub enum TraceCacheError {
    #[error(transparent)]
    Pins(#[from] pins::PinDirError),
    #[error(
        "{0} is inside an agent's pin directory: the trace cache never lives among an agent's pins \
         (use another --cache-dir)"
    )]
    InsideAgentPins(PathBuf),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("resetting the cached map {path}: {source}")]
    Reset {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cached map {path}: {source}")]
    Map {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cached program {path}: {source}")]
    Program {
        path: PathBuf,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error(transparent)]
    Datapath(#[from] DatapathError),
}

/// The programs a trace from `from` (`external`, `pod`, `host`) runs.
pub fn needed_programs(from: &str) -> &'static [&'static str] {
    match from {
        "external" => &[names::XDP_INGRESS, names::TC_EGRESS],
        "pod" => &[names::TC_POD_INGRESS, names::TC_EGRESS],
        // What the agent attaches to a cgroup, all of it.
        _ => &SOCK_PROGRAMS,
    }
}

/// How a [`TraceDatapath`] was obtained (shown by `trace --verbose`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Loaded for this trace alone (`--no-cache`, or the cache unusable).
    Loaded { programs: Vec<&'static str> },
    /// Every program from the cache entry `entry`.
    Cached { entry: PathBuf },
    /// The path's programs (`verified`) loaded now and added to `entry`
    /// (its maps, when there, came from it).
    Built {
        entry: PathBuf,
        verified: Vec<&'static str>,
    },
}

/// What opening the datapath did, for `trace --verbose`.
#[derive(Clone, Debug)]
pub struct OpenReport {
    pub origin: Origin,
    /// Entries of other keys (another agent build) removed.
    pub invalidated: Vec<PathBuf>,
    /// Time spent loading and verifying programs.
    pub load: Duration,
    /// Time spent opening pins and emptying the cached maps.
    pub reuse: Duration,
}

enum Programs {
    /// Owned by the loaded object.
    Loaded(Datapath),
    /// Opened from the cache's pins.
    Pinned {
        maps: LbMaps,
        xdp: Vec<(&'static str, Xdp)>,
        tc: Vec<(&'static str, SchedClassifier)>,
        sock: Vec<(&'static str, CgroupSockAddr)>,
    },
}

/// A private datapath for one trace: its maps, and the programs the trace
/// runs (nothing attached, except the connect-time programs to a throwaway
/// cgroup by [`TraceDatapath::attach_cgroup`]).
pub struct TraceDatapath {
    programs: Programs,
    report: OpenReport,
    /// The cache's lock, held until the trace is done.
    _lock: Option<File>,
}

impl TraceDatapath {
    /// Loads the programs of the path `path` ([`needed_programs`]) with
    /// private maps (nothing pinned).
    pub fn load(opts: &LoadOptions, path: &str) -> Result<Self, DatapathError> {
        let programs = needed_programs(path);
        let started = Instant::now();
        let dp = Datapath::load_programs(opts, None, programs)?;
        Ok(Self {
            programs: Programs::Loaded(dp),
            report: OpenReport {
                origin: Origin::Loaded {
                    programs: programs.to_vec(),
                },
                invalidated: Vec::new(),
                load: started.elapsed(),
                reuse: Duration::ZERO,
            },
            _lock: None,
        })
    }

    /// The programs of the path `path` ([`needed_programs`]) from the cache
    /// under `dir` (bpffs), loaded and added to it first when they are not
    /// there; the maps emptied.
    pub fn open_cached(opts: &LoadOptions, path: &str, dir: &Path) -> Result<Self, TraceCacheError> {
        let programs = needed_programs(path);
        if dir.ancestors().any(PinDir::is_pin_dir) {
            return Err(TraceCacheError::InsideAgentPins(dir.to_owned()));
        }
        if dir.starts_with(pins::BPFFS_ROOT) {
            pins::ensure_bpffs()?;
        }
        let parent = dir.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
        if !pins::on_bpffs(parent) {
            return Err(pins::PinDirError::NotBpffs(dir.to_owned()).into());
        }
        let io = |what: &'static str, path: &Path| {
            let path = path.to_owned();
            move |source| TraceCacheError::Io { what, path, source }
        };
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
        let lock = File::open(dir).map_err(io("opening", dir))?;
        lock.lock().map_err(io("locking", dir))?;

        let key = cache_key(opts);
        let entry = dir.join(&key);
        let invalidated = remove_entries(dir, Some(&key)).map_err(io("removing stale entries in", dir))?;
        // An entry is usable when every map is pinned (the programs were
        // pinned after their maps): otherwise it is rebuilt.
        let maps_dir = entry.join("maps");
        if entry.exists() && !names::ALL_MAPS.iter().all(|m| maps_dir.join(m).exists()) {
            std::fs::remove_dir_all(&entry).map_err(io("removing the incomplete entry", &entry))?;
        }
        let programs_dir = entry.join("programs").join(path);
        let complete = programs.iter().all(|p| programs_dir.join(p).exists());
        let started = Instant::now();
        if !complete {
            std::fs::create_dir_all(&maps_dir).map_err(io("creating", &maps_dir))?;
            // A path's programs come from one load: what is left of an
            // interrupted one goes.
            match std::fs::remove_dir_all(&programs_dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io("removing", &programs_dir)(e));
                }
                _ => {}
            }
            std::fs::create_dir_all(&programs_dir).map_err(io("creating", &programs_dir))?;
            // Maps already pinned in the entry are reused: the other paths'
            // programs and these share them.
            let mut dp = Datapath::load_programs(opts, Some(PinDir::open(&entry)?), programs)?;
            for p in programs {
                dp.pin_program(p, &programs_dir.join(p))?;
            }
        }
        let load = started.elapsed();

        let started = Instant::now();
        reset_maps(&maps_dir)?;
        let (maps, _) = LbMaps::open_pins(&entry)?;
        let (mut xdp, mut tc, mut sock) = (Vec::new(), Vec::new(), Vec::new());
        for &name in programs {
            let path = programs_dir.join(name);
            let err = |source| TraceCacheError::Program {
                path: path.clone(),
                source,
            };
            if name == names::XDP_INGRESS || name == names::XDP_FLOOR {
                xdp.push((name, Xdp::from_pin(&path, XdpAttachType::Interface).map_err(err)?));
            } else if let Some(kind) = sock_attach_type(name) {
                sock.push((name, CgroupSockAddr::from_pin(&path, kind).map_err(err)?));
            } else {
                tc.push((name, SchedClassifier::from_pin(&path).map_err(err)?));
            }
        }
        let reuse = started.elapsed();
        let origin = if complete {
            Origin::Cached { entry }
        } else {
            Origin::Built {
                entry,
                verified: programs.to_vec(),
            }
        };
        Ok(Self {
            programs: Programs::Pinned { maps, xdp, tc, sock },
            report: OpenReport {
                origin,
                invalidated,
                load,
                reuse,
            },
            _lock: Some(lock),
        })
    }

    pub fn report(&self) -> &OpenReport {
        &self.report
    }

    pub fn maps(&self) -> &LbMaps {
        match &self.programs {
            Programs::Loaded(dp) => dp.maps(),
            Programs::Pinned { maps, .. } => maps,
        }
    }

    pub fn maps_mut(&mut self) -> &mut LbMaps {
        match &mut self.programs {
            Programs::Loaded(dp) => dp.maps_mut(),
            Programs::Pinned { maps, .. } => maps,
        }
    }

    /// An XDP program this datapath was opened with.
    pub fn xdp(&self, name: &'static str) -> Result<&Xdp, DatapathError> {
        match &self.programs {
            Programs::Loaded(dp) => dp.xdp_program(name),
            Programs::Pinned { xdp, .. } => find(xdp, name),
        }
    }

    /// A TC program this datapath was opened with.
    pub fn tc(&self, name: &'static str) -> Result<&SchedClassifier, DatapathError> {
        match &self.programs {
            Programs::Loaded(dp) => dp.tc(name),
            Programs::Pinned { tc, .. } => find(tc, name),
        }
    }

    /// Attaches the connect-time programs to `cgroup` (a throwaway one:
    /// never the root); they detach when this datapath is dropped.
    pub fn attach_cgroup(&mut self, cgroup: &Path) -> Result<(), DatapathError> {
        let sock = match &mut self.programs {
            Programs::Loaded(dp) => return dp.attach_cgroup(cgroup).map(drop),
            Programs::Pinned { sock, .. } => sock,
        };
        let dir = File::open(cgroup).map_err(|source| DatapathError::Cgroup {
            path: cgroup.to_owned(),
            source,
        })?;
        for (name, prog) in sock {
            prog.attach(&dir, CgroupAttachMode::Single)
                .map_err(|source| DatapathError::Attach {
                    name,
                    device: cgroup.display().to_string(),
                    source,
                })?;
        }
        Ok(())
    }
}

fn find<'a, P>(programs: &'a [(&'static str, P)], name: &'static str) -> Result<&'a P, DatapathError> {
    programs
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, p)| p)
        .ok_or(DatapathError::MissingProgram(name))
}

fn sock_attach_type(name: &str) -> Option<CgroupSockAddrAttachType> {
    use CgroupSockAddrAttachType as T;
    Some(match name {
        names::SOCK_CONNECT4 => T::Connect4,
        names::SOCK_SENDMSG4 => T::UDPSendMsg4,
        names::SOCK_RECVMSG4 => T::UDPRecvMsg4,
        names::SOCK_GETPEERNAME4 => T::GetPeerName4,
        names::SOCK_CONNECT6 => T::Connect6,
        names::SOCK_SENDMSG6 => T::UDPSendMsg6,
        names::SOCK_RECVMSG6 => T::UDPRecvMsg6,
        names::SOCK_GETPEERNAME6 => T::GetPeerName6,
        _ => return None,
    })
}

/// The entry name for this agent's object and `opts`: 16 hex digits of a
/// 64-bit FNV-1a hash (a cache key, not a security boundary: only root
/// writes bpffs).
pub fn cache_key(opts: &LoadOptions) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let opts = format!("{opts:?}");
    let parts: [&[u8]; 3] = [CACHE_FORMAT.as_bytes(), opts.as_bytes(), EBPF_OBJECT];
    for part in parts {
        for b in part.iter().chain(&[0xff]) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// Whether `name` has the shape of a cache entry's name.
fn is_entry_name(name: &str) -> bool {
    name.len() == 16 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Removes the cache entries under `dir` (all but `keep`): only
/// directories named like an entry, nothing else that lives there. Returns
/// those removed.
pub fn remove_entries(dir: &Path, keep: Option<&str>) -> std::io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e),
    };
    for e in entries {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if is_entry_name(&name) && Some(name.as_str()) != keep && e.file_type()?.is_dir() {
            std::fs::remove_dir_all(e.path())?;
            removed.push(e.path());
        }
    }
    Ok(removed)
}

/// Removes the trace cache at `dir`: its entries, then the directory when
/// nothing else is left in it. Returns the entries removed; `Ok` with none
/// when there is no cache.
pub fn remove_cache(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let removed = remove_entries(dir, None)?;
    match std::fs::remove_dir(dir) {
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.kind() == std::io::ErrorKind::DirectoryNotEmpty => {}
        // A bpffs mount point itself cannot be removed.
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
        r => r?,
    }
    Ok(removed)
}

/// Empties every map pinned in `maps_dir` as a fresh load creates it: hash
/// maps (LRU, LPM, device maps) lose every entry, arrays (per-CPU ones
/// too) are zeroed. Writes only what is not already empty.
pub fn reset_maps(maps_dir: &Path) -> Result<(), TraceCacheError> {
    let reset = |name: &&str| -> Result<(), TraceCacheError> {
        let path = maps_dir.join(name);
        let map = MapData::from_pin(&path).map_err(|source| TraceCacheError::Map {
            path: path.clone(),
            source,
        })?;
        reset_map(&map).map_err(|source| TraceCacheError::Reset { path, source })
    };
    // Most of the time is the kernel copying the large arrays out: two
    // threads, each half of the maps.
    let (a, b) = names::ALL_MAPS.split_at(names::ALL_MAPS.len() / 2);
    std::thread::scope(|s| {
        let other = s.spawn(|| b.iter().try_for_each(reset));
        let mine = a.iter().try_for_each(reset);
        mine.and(other.join().expect("a map reset thread panicked"))
    })
}

fn reset_map(map: &MapData) -> std::io::Result<()> {
    let other = std::io::Error::other;
    let info = map.info().map_err(other)?;
    let map_type = info.map_type().map_err(other)?;
    let fd = map.fd().as_fd();
    let key_size = info.key_size() as usize;
    let per_cpu = matches!(
        map_type,
        MapType::PerCpuArray | MapType::PerCpuHash | MapType::LruPerCpuHash
    );
    let value_size = if per_cpu {
        let ncpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        (info.value_size() as usize).div_ceil(8) * 8 * ncpus
    } else {
        info.value_size() as usize
    };
    match map_type {
        MapType::Array | MapType::PerCpuArray => {
            // Read back (the kernel copies every element either way) and
            // zero only the entries in use. A slice comparison is a memcmp,
            // also in a debug build.
            let zero = vec![0u8; value_size];
            let mut keys = Vec::new();
            batch::for_each_raw(fd, key_size, value_size, |k, v| {
                if v != zero.as_slice() {
                    keys.extend_from_slice(k);
                }
            })?;
            let zeros = vec![0u8; keys.len() / key_size * value_size];
            batch::update_raw(fd, key_size, value_size, &keys, &zeros).map_err(|(_, e)| e)?;
        }
        MapType::Hash | MapType::LruHash | MapType::PerCpuHash | MapType::LruPerCpuHash => {
            let mut keys = Vec::new();
            batch::for_each_raw(fd, key_size, value_size, |k, _| keys.extend_from_slice(k))?;
            batch::delete_raw(fd, key_size, &keys).map_err(|(_, e)| e)?;
        }
        // Nothing a trace reads: a packet that is traced has no reader.
        MapType::RingBuf => {}
        // LPM tries and device maps have no batched operations.
        _ => {
            let keys = batch::keys_raw(fd, key_size)?;
            batch::delete_each_raw(fd, key_size, &keys)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_names_the_object_and_the_sizes() {
        let opts = LoadOptions::default();
        let key = cache_key(&opts);
        assert!(is_entry_name(&key), "{key}");
        assert_eq!(cache_key(&opts), key, "the same object and sizes: the same entry");
        let other = LoadOptions {
            max_service_entries: opts.max_service_entries / 8,
            ..opts
        };
        assert_ne!(cache_key(&other), key, "other sizes: another entry");
    }

    /// Only directories named like an entry go: whatever else lives in the
    /// cache directory stays.
    #[test]
    fn removing_entries_leaves_everything_else() {
        let dir = std::env::temp_dir().join(format!("dp-trace-cache-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in [
            "0123456789abcdef/maps",
            "fedcba9876543210/programs",
            "dataplane/maps",
            "0123",
        ] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        std::fs::write(dir.join("abcdefabcdefabcd"), b"a file, not an entry").unwrap();
        let mut removed = remove_entries(&dir, Some("fedcba9876543210")).unwrap();
        removed.sort();
        assert_eq!(removed, vec![dir.join("0123456789abcdef")]);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            ["0123", "abcdefabcdefabcd", "dataplane", "fedcba9876543210"]
        );
        assert_eq!(remove_cache(&dir).unwrap(), vec![dir.join("fedcba9876543210")]);
        assert!(dir.exists(), "not removed while something else is in it");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
