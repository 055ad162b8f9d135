//! The per-instance pin directory in bpffs: `<dir>/maps/<MAP_V1>` and
//! `<dir>/links/<program>@<device>`. Maps and links pinned there outlive the
//! agent, so the datapath keeps forwarding while it is down, and a restarted
//! agent adopts them.

use std::{
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::maps::MapData;
use dataplane_common::{
    config::DpConfig,
    ct::{Ct4Entry, Ct4Key, Sock4RevKey, Sock4RevValue},
    lb4::{Lb4AffinityKey, Lb4AffinityValue, Lb4Backend, Lb4Service, Lb4ServiceKey, Lb4ServiceName},
    names,
    stats::Counter,
};

use super::DatapathError;

pub const BPFFS_ROOT: &str = "/sys/fs/bpf";

/// Key and value sizes every pinned map must have to be reused.
fn expected_layout(name: &str) -> Option<(u32, u32)> {
    use std::mem::size_of;
    let s = |k: usize, v: usize| Some((k as u32, v as u32));
    match name {
        names::CONFIG => s(4, size_of::<DpConfig>()),
        names::LB4_SERVICES => s(size_of::<Lb4ServiceKey>(), size_of::<Lb4Service>()),
        names::LB4_BACKENDS => s(4, size_of::<Lb4Backend>()),
        names::LB4_AFFINITY => s(size_of::<Lb4AffinityKey>(), size_of::<Lb4AffinityValue>()),
        // LPM key: prefix length + service id + address.
        names::LB4_SOURCE_RANGES => s(12, 1),
        names::CT4 => s(size_of::<Ct4Key>(), size_of::<Ct4Entry>()),
        names::COUNTERS | names::SERVICE_STATS => s(4, size_of::<Counter>()),
        names::LB4_SERVICE_NAMES => s(4, size_of::<Lb4ServiceName>()),
        names::SOCK4_REVNAT => s(size_of::<Sock4RevKey>(), size_of::<Sock4RevValue>()),
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
    pub fn create(root: &Path) -> Result<Self, DatapathError> {
        if root.starts_with(BPFFS_ROOT) {
            ensure_bpffs()?;
        }
        let parent = root.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
        if !on_bpffs(parent) {
            return Err(DatapathError::Invalid(format!(
                "{} is not on a bpffs mount: pins elsewhere would not outlive the agent (mount -t bpf bpf DIR, \
                 or use a directory under {BPFFS_ROOT})",
                root.display()
            )));
        }
        for sub in ["maps", "links"] {
            std::fs::create_dir_all(root.join(sub)).map_err(|e| {
                DatapathError::Invalid(format!(
                    "cannot create the pin directory {}: {e} (is {BPFFS_ROOT} a bpffs mount?)",
                    root.join(sub).display()
                ))
            })?;
        }
        Ok(Self {
            root: root.to_owned(),
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
    pub fn check_layouts(&self) -> Result<(), DatapathError> {
        for name in names::ALL_MAPS {
            let path = self.map(name);
            if !path.exists() {
                continue;
            }
            let map = MapData::from_pin(&path).map_err(|source| DatapathError::Map { name, source })?;
            let info = map.info().map_err(|source| DatapathError::Map { name, source })?;
            let (key, value) = expected_layout(name).expect("every map has a layout");
            if info.key_size() != key || info.value_size() != value {
                return Err(DatapathError::Invalid(format!(
                    "pinned map {} has key/value sizes {}/{}, this version needs {key}/{value}; remove it \
                     (`dataplane-agent cleanup --bpffs-dir {}`) to start afresh",
                    path.display(),
                    info.key_size(),
                    info.value_size(),
                    self.root.display()
                )));
            }
            let _ = map.fd().as_fd();
        }
        Ok(())
    }

    /// Pinned maps this version does not use (older layouts), removed once
    /// the new programs are attached: replaced deliberately.
    pub fn remove_foreign_maps(&self) -> Vec<String> {
        let mut removed = Vec::new();
        if let Ok(dir) = std::fs::read_dir(self.root.join("maps")) {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
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
                let Some((_, device)) = name.split_once('@') else {
                    continue;
                };
                if !Path::new("/sys/class/net").join(device).exists()
                    && std::fs::remove_file(e.path()).is_ok()
                {
                    removed.push(name);
                }
            }
        }
        removed
    }

    /// Removes every pin: links detach, maps go once unused.
    pub fn remove_all(&self) -> std::io::Result<()> {
        match std::fs::remove_dir_all(&self.root) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

fn on_bpffs(path: &Path) -> bool {
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
pub fn ensure_bpffs() -> Result<(), DatapathError> {
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
        return Err(DatapathError::Invalid(format!(
            "bpffs is not mounted at {BPFFS_ROOT} and mounting it failed: {} (needs CAP_SYS_ADMIN, or mount it \
             on the host: mount -t bpf bpf {BPFFS_ROOT})",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}
