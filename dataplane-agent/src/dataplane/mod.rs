//! The datapath: the embedded kernel object, loaded, attached, and its maps.
//!
//! [`Datapath`] owns one loaded copy of the object. Attaching happens in the
//! network namespace of the calling thread, so a test (or an agent started
//! with `ip netns exec`) attaches to the devices of its own namespace.
//! [`LbMaps`] is the typed API to program services and backends; the
//! Kubernetes control plane and the tests both go through it.

mod maps;
pub mod pins;

use std::path::Path;

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, MapError, PerCpuArray},
    programs::{
        CgroupAttachMode, CgroupSockAddr, ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        tc::SchedClassifierLink,
        xdp::XdpLink,
    },
};
use dataplane_common::{limits, names};
pub use maps::{
    Backend, BackendId, BackendSet, DatapathConfig, EmptyVerdict, Frontend, FrontendEntry, FrontendKind,
    LbMaps, MapTable, ServicePortName, current_netns_cookie,
};
pub use pins::PinDir;

/// The kernel object built by build.rs (`dataplane-ebpf`, release, with BTF).
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dataplane"));

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error(
        "loading the eBPF object failed: {0}. The kernel must have BTF (/sys/kernel/btf/vmlinux) \
         and the process needs root or CAP_BPF + CAP_NET_ADMIN"
    )]
    Load(#[from] aya::EbpfError),
    #[error("program `{0}` is missing from the eBPF object (agent and object built from different sources?)")]
    MissingProgram(&'static str),
    #[error("map `{0}` is missing from the eBPF object (agent and object built from different sources?)")]
    MissingMap(&'static str),
    #[error("program `{name}`: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error(
        "attaching `{name}` to device `{device}` failed: {source}. Check that the device exists in this \
         network namespace and has no other XDP program attached"
    )]
    Attach {
        name: &'static str,
        device: String,
        #[source]
        source: ProgramError,
    },
    #[error("map `{name}`: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("{0}")]
    Invalid(String),
}

/// Map sizes chosen at load time.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Service ports (service ids are `0..max_services`).
    pub max_services: u32,
    /// Backends (ids are `1..max_backends`).
    pub max_backends: u32,
    /// Frontend and backend-slot entries of the services map.
    pub max_service_entries: u32,
    pub ct_entries: u32,
    pub affinity_entries: u32,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            max_services: limits::MAX_SERVICES,
            max_backends: limits::MAX_BACKENDS,
            max_service_entries: limits::MAX_SERVICE_ENTRIES,
            ct_entries: limits::CT_ENTRIES,
            affinity_entries: limits::AFFINITY_ENTRIES,
        }
    }
}

/// One loaded copy of the datapath: programs verified and loaded, maps created.
pub struct Datapath {
    ebpf: Ebpf,
    maps: LbMaps,
    pins: Option<PinDir>,
}

/// What happened to one attachment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    /// A new link.
    New,
    /// A pinned link now runs this program (atomic replacement).
    Replaced,
}

impl Datapath {
    /// Loads the embedded object with default map sizes (nothing attached,
    /// nothing pinned).
    pub fn load() -> Result<Self, DatapathError> {
        Self::load_with(&LoadOptions::default())
    }

    /// Loads with private maps (nothing pinned): tests, `trace`.
    pub fn load_with(opts: &LoadOptions) -> Result<Self, DatapathError> {
        Self::load_inner(opts, None)
    }

    /// Loads with every map pinned under `dir` (bpffs): maps already pinned
    /// there are reused with their contents, so a restarted agent adopts the
    /// running datapath; links are pinned too when attached.
    pub fn open_pinned(opts: &LoadOptions, dir: &Path) -> Result<Self, DatapathError> {
        let pins = PinDir::create(dir)?;
        pins.check_layouts()?;
        Self::load_inner(opts, Some(pins))
    }

    fn load_inner(opts: &LoadOptions, pins: Option<PinDir>) -> Result<Self, DatapathError> {
        let map_paths: Vec<(&'static str, std::path::PathBuf)> = match &pins {
            Some(p) => names::ALL_MAPS.iter().map(|n| (*n, p.map(n))).collect(),
            None => Vec::new(),
        };
        let mut loader = EbpfLoader::new();
        for (name, path) in &map_paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader
            .map_max_entries(names::SERVICE_STATS, opts.max_services)
            .map_max_entries(names::LB4_BACKENDS, opts.max_backends)
            .map_max_entries(names::LB4_SERVICES, opts.max_service_entries)
            .map_max_entries(names::CT4, opts.ct_entries)
            .map_max_entries(names::LB4_AFFINITY, opts.affinity_entries)
            .load(EBPF_OBJECT)?;
        for name in [names::XDP_INGRESS, names::XDP_FLOOR] {
            program::<Xdp>(&mut ebpf, name)?
                .load()
                .map_err(|source| DatapathError::Program { name, source })?;
        }
        for name in [names::TC_EGRESS, names::TC_POD_INGRESS, names::TC_FLOOR] {
            program::<SchedClassifier>(&mut ebpf, name)?
                .load()
                .map_err(|source| DatapathError::Program { name, source })?;
        }
        for name in SOCK_PROGRAMS {
            program::<CgroupSockAddr>(&mut ebpf, name)?
                .load()
                .map_err(|source| DatapathError::Program { name, source })?;
        }
        let maps = LbMaps {
            config: take(&mut ebpf, names::CONFIG, Array::try_from)?,
            services: take(&mut ebpf, names::LB4_SERVICES, HashMap::try_from)?,
            backends: take(&mut ebpf, names::LB4_BACKENDS, Array::try_from)?,
            affinity: take(&mut ebpf, names::LB4_AFFINITY, HashMap::try_from)?,
            source_ranges: take(&mut ebpf, names::LB4_SOURCE_RANGES, LpmTrie::try_from)?,
            ct: take(&mut ebpf, names::CT4, HashMap::try_from)?,
            counters: take(&mut ebpf, names::COUNTERS, PerCpuArray::try_from)?,
            service_stats: take(&mut ebpf, names::SERVICE_STATS, PerCpuArray::try_from)?,
            service_names: take(&mut ebpf, names::LB4_SERVICE_NAMES, HashMap::try_from)?,
            sock_revnat: take(&mut ebpf, names::SOCK4_REVNAT, HashMap::try_from)?,
            max_services: opts.max_services,
            max_backends: opts.max_backends,
            ct_capacity: opts.ct_entries,
            service_entries_capacity: opts.max_service_entries,
            affinity_capacity: opts.affinity_entries,
        };
        Ok(Self { ebpf, maps, pins })
    }

    pub fn pins(&self) -> Option<&PinDir> {
        self.pins.as_ref()
    }

    /// Attaches the north-south programs to an external device of the
    /// calling thread's network namespace: XDP (native mode where the
    /// driver has it) and TC egress. Unpinned, they detach when the
    /// `Datapath` drops; pinned, they stay until the pins are removed.
    pub fn attach_external(&mut self, device: &str) -> Result<Attached, DatapathError> {
        let a = self.attach_xdp(names::XDP_INGRESS, device)?;
        self.attach_tc(names::TC_EGRESS, TcAttachType::Egress, device)?;
        Ok(a)
    }

    /// Attaches to a pod-facing host interface: TC ingress (replies from
    /// local backends) and TC egress (SNAT towards local backends).
    pub fn attach_pod_interface(&mut self, device: &str) -> Result<Attached, DatapathError> {
        let a = self.attach_tc(names::TC_POD_INGRESS, TcAttachType::Ingress, device)?;
        self.attach_tc(names::TC_EGRESS, TcAttachType::Egress, device)?;
        Ok(a)
    }

    /// Attaches the connect-time programs (connect4, sendmsg4, recvmsg4,
    /// getpeername4) to the cgroup v2 directory `cgroup`: the node's own
    /// processes in it reach Services without per-packet translation.
    /// Pinned, a new attachment replaces the old one without a gap (both run
    /// for an instant; the second sees an already translated address).
    pub fn attach_cgroup(&mut self, cgroup: &Path) -> Result<Attached, DatapathError> {
        let dir = std::fs::File::open(cgroup).map_err(|e| {
            DatapathError::Invalid(format!(
                "cannot open cgroup {}: {e} (a cgroup v2 directory)",
                cgroup.display()
            ))
        })?;
        let tag = cgroup.display().to_string().replace('/', "_");
        let mut how = Attached::New;
        for name in SOCK_PROGRAMS {
            let attach_err = |source| DatapathError::Attach {
                name,
                device: cgroup.display().to_string(),
                source,
            };
            let prog = program::<CgroupSockAddr>(&mut self.ebpf, name)?;
            // bpf_link attachments to a cgroup are always "multi"; the flag must be 0.
            let id = prog.attach(&dir, CgroupAttachMode::Single).map_err(attach_err)?;
            let Some(pins) = &self.pins else { continue };
            let link: FdLink = prog
                .take_link(id)
                .map_err(attach_err)?
                .try_into()
                .map_err(|e| DatapathError::Invalid(format!("cgroup link is not a bpf_link: {e}")))?;
            let path = pins.link(name, &tag);
            let fresh = path.with_extension("new");
            let _ = std::fs::remove_file(&fresh);
            pin_link(link, &fresh)?;
            if path.exists() {
                how = Attached::Replaced;
            }
            // Atomically replaces the old pin: the old link goes with it.
            std::fs::rename(&fresh, &path)
                .map_err(|e| DatapathError::Invalid(format!("cannot replace pin {}: {e}", path.display())))?;
        }
        Ok(how)
    }

    fn attach_xdp(&mut self, name: &'static str, device: &str) -> Result<Attached, DatapathError> {
        let attach_err = |source| DatapathError::Attach {
            name,
            device: device.to_owned(),
            source,
        };
        let prog = program::<Xdp>(&mut self.ebpf, name)?;
        let Some(pins) = &self.pins else {
            prog.attach(device, XdpMode::default()).map_err(attach_err)?;
            return Ok(Attached::New);
        };
        let path = pins.link(name, device);
        if let Some(link) = pinned_link::<XdpLink>(&path) {
            if let Ok(id) = prog.attach_to_link(link) {
                // The pin keeps the link; the program's handle can go.
                drop(prog.take_link(id));
                return Ok(Attached::Replaced);
            }
            let _ = std::fs::remove_file(&path);
        }
        let id = prog.attach(device, XdpMode::default()).map_err(attach_err)?;
        let link: FdLink =
            prog.take_link(id).map_err(attach_err)?.try_into().map_err(|e| {
                DatapathError::Invalid(format!("XDP link on {device} is not a bpf_link: {e}"))
            })?;
        pin_link(link, &path)?;
        Ok(Attached::New)
    }

    fn attach_tc(
        &mut self,
        name: &'static str,
        kind: TcAttachType,
        device: &str,
    ) -> Result<Attached, DatapathError> {
        let attach_err = |source| DatapathError::Attach {
            name,
            device: device.to_owned(),
            source,
        };
        let prog = program::<SchedClassifier>(&mut self.ebpf, name)?;
        let Some(pins) = &self.pins else {
            prog.attach(device, kind).map_err(attach_err)?;
            return Ok(Attached::New);
        };
        let path = pins.link(name, device);
        if let Some(link) = pinned_link::<SchedClassifierLink>(&path) {
            if let Ok(id) = prog.attach_to_link(link) {
                drop(prog.take_link(id));
                return Ok(Attached::Replaced);
            }
            let _ = std::fs::remove_file(&path);
        }
        let id = prog.attach(device, kind).map_err(attach_err)?;
        let link: FdLink = prog.take_link(id).map_err(attach_err)?.try_into().map_err(|e| {
            DatapathError::Invalid(format!(
                "TC link on {device} is not a bpf_link (TCX needs Linux 6.6): {e}"
            ))
        })?;
        pin_link(link, &path)?;
        Ok(Attached::New)
    }

    /// The XDP entry point, e.g. to run packets through it with
    /// `BPF_PROG_TEST_RUN` (`aya::programs::TestRun`).
    pub fn xdp(&self) -> Result<&Xdp, DatapathError> {
        program_ref(&self.ebpf, names::XDP_INGRESS)
    }

    /// An XDP program by name ([`names::XDP_INGRESS`], [`names::XDP_FLOOR`]).
    pub fn xdp_program(&self, name: &'static str) -> Result<&Xdp, DatapathError> {
        program_ref(&self.ebpf, name)
    }

    /// A TC program by name ([`names::TC_EGRESS`], [`names::TC_POD_INGRESS`],
    /// [`names::TC_FLOOR`]).
    pub fn tc(&self, name: &'static str) -> Result<&SchedClassifier, DatapathError> {
        program_ref(&self.ebpf, name)
    }

    pub fn maps(&self) -> &LbMaps {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut LbMaps {
        &mut self.maps
    }
}

fn program<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, DatapathError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(DatapathError::MissingProgram(name))?
        .try_into()
        .map_err(|source| DatapathError::Program { name, source })
}

fn program_ref<'a, P>(ebpf: &'a Ebpf, name: &'static str) -> Result<&'a P, DatapathError>
where
    &'a P: TryFrom<&'a aya::programs::Program, Error = ProgramError>,
{
    ebpf.program(name)
        .ok_or(DatapathError::MissingProgram(name))?
        .try_into()
        .map_err(|source| DatapathError::Program { name, source })
}

/// The connect-time programs.
const SOCK_PROGRAMS: [&str; 4] = [
    names::SOCK_CONNECT4,
    names::SOCK_SENDMSG4,
    names::SOCK_RECVMSG4,
    names::SOCK_GETPEERNAME4,
];

impl LbMaps {
    /// Opens a running (or stopped) agent's pinned maps, without loading
    /// any program: what `inspect` reads. Nothing is written through it.
    pub fn open_pins(dir: &Path) -> Result<Self, DatapathError> {
        use aya::maps::{Map, MapData};
        let pins = PinDir::create(dir)?;
        if !pins.map(names::LB4_SERVICES).exists() {
            return Err(DatapathError::Invalid(format!(
                "no pinned maps under {}: is the agent's --bpffs-dir another one?",
                dir.display()
            )));
        }
        pins.check_layouts()?;
        let open = |name: &'static str, wrap: fn(MapData) -> Map| -> Result<(Map, u32), DatapathError> {
            let data =
                MapData::from_pin(pins.map(name)).map_err(|source| DatapathError::Map { name, source })?;
            let max = data
                .info()
                .map_err(|source| DatapathError::Map { name, source })?
                .max_entries();
            Ok((wrap(data), max))
        };
        fn typed<T>(
            name: &'static str,
            m: (Map, u32),
            f: impl FnOnce(Map) -> Result<T, MapError>,
        ) -> Result<(T, u32), DatapathError> {
            let (map, max) = m;
            Ok((f(map).map_err(|source| DatapathError::Map { name, source })?, max))
        }
        let (config, _) = typed(names::CONFIG, open(names::CONFIG, Map::Array)?, Array::try_from)?;
        let (services, service_entries_capacity) = typed(
            names::LB4_SERVICES,
            open(names::LB4_SERVICES, Map::HashMap)?,
            HashMap::try_from,
        )?;
        let (backends, max_backends) = typed(
            names::LB4_BACKENDS,
            open(names::LB4_BACKENDS, Map::Array)?,
            Array::try_from,
        )?;
        let (affinity, affinity_capacity) = typed(
            names::LB4_AFFINITY,
            open(names::LB4_AFFINITY, Map::LruHashMap)?,
            HashMap::try_from,
        )?;
        let (source_ranges, _) = typed(
            names::LB4_SOURCE_RANGES,
            open(names::LB4_SOURCE_RANGES, Map::LpmTrie)?,
            LpmTrie::try_from,
        )?;
        let (ct, ct_capacity) = typed(names::CT4, open(names::CT4, Map::LruHashMap)?, HashMap::try_from)?;
        let (counters, _) = typed(
            names::COUNTERS,
            open(names::COUNTERS, Map::PerCpuArray)?,
            PerCpuArray::try_from,
        )?;
        let (service_stats, max_services) = typed(
            names::SERVICE_STATS,
            open(names::SERVICE_STATS, Map::PerCpuArray)?,
            PerCpuArray::try_from,
        )?;
        let (service_names, _) = typed(
            names::LB4_SERVICE_NAMES,
            open(names::LB4_SERVICE_NAMES, Map::HashMap)?,
            HashMap::try_from,
        )?;
        let (sock_revnat, _) = typed(
            names::SOCK4_REVNAT,
            open(names::SOCK4_REVNAT, Map::LruHashMap)?,
            HashMap::try_from,
        )?;
        Ok(LbMaps {
            config,
            services,
            backends,
            affinity,
            source_ranges,
            ct,
            counters,
            service_stats,
            service_names,
            sock_revnat,
            max_services,
            max_backends,
            ct_capacity,
            service_entries_capacity,
            affinity_capacity,
        })
    }
}

/// The link pinned at `path`, if there is one of the right type.
fn pinned_link<L: TryFrom<FdLink>>(path: &Path) -> Option<L> {
    let pinned = PinnedLink::from_pin(path).ok()?;
    L::try_from(FdLink::from(pinned)).ok()
}

fn pin_link(link: FdLink, path: &Path) -> Result<(), DatapathError> {
    link.pin(path)
        .map(drop)
        .map_err(|e| DatapathError::Invalid(format!("cannot pin link at {}: {e}", path.display())))
}

fn take<T>(
    ebpf: &mut Ebpf,
    name: &'static str,
    convert: impl FnOnce(aya::maps::Map) -> Result<T, MapError>,
) -> Result<T, DatapathError> {
    let map = ebpf.take_map(name).ok_or(DatapathError::MissingMap(name))?;
    convert(map).map_err(|source| DatapathError::Map { name, source })
}
