//! The datapath: the embedded kernel object, loaded, attached, and its maps.
//!
//! [`Datapath`] owns one loaded copy of the object. Attaching happens in the
//! network namespace of the calling thread, so a test (or an agent started
//! with `ip netns exec`) attaches to the devices of its own namespace.
//! [`LbMaps`] is the typed API to program services and backends; the
//! Kubernetes control plane and the tests both go through it. It converts
//! the service table's types ([`crate::state::table`]) to the kernel ABI.

pub mod batch;
pub mod clock;
mod config;
pub mod derived;
pub mod family;
mod filter;
mod maps;
pub mod pins;
mod table;
pub mod trace_cache;

use std::path::Path;

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, MapError, PerCpuArray},
    programs::{
        CgroupAttachMode, CgroupSockAddr, ProgramError, SchedClassifier, TcAttachType, Xdp,
        links::{FdLink, PinnedLink},
        tc::SchedClassifierLink,
        xdp::XdpLink,
    },
};
pub use clock::Clock;
pub use config::{DatapathConfig, current_netns_cookie};
use dataplane_common::{limits, names};

use crate::os::device;
pub use family::{AbiAddr, FamilyMaps};
pub use maps::{LbMaps, RETIRE_GRACE};
pub use pins::{PinDir, PinDirError, PinLock, Resize};

/// The kernel object built by build.rs (`dataplane-ebpf`, release, with BTF).
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dataplane"));

fn err(name: &'static str) -> impl Fn(MapError) -> DatapathError {
    move |source| DatapathError::Map { name, source }
}

/// A missing key is not an error when deleting.
fn removed(r: Result<(), MapError>, name: &'static str) -> Result<(), DatapathError> {
    match r {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err(name)(e)),
    }
}

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
    #[error("devices XDP may redirect to (`DP_XDP_DEVICES_V1`): {0}")]
    XdpDevices(#[source] aya::maps::xdp::XdpMapError),
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
    #[error("map `{name}`: batched operation failed: {source}")]
    Batch {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Pins(#[from] PinDirError),
    #[error("backend id {id} is beyond the backends map capacity {capacity} (raise --max-backends)")]
    BackendIdOutOfRange { id: u32, capacity: u32 },
    #[error("service id {id} is beyond the capacity of {capacity} service ports (raise --max-services)")]
    ServiceIdOutOfRange { id: u32, capacity: u32 },
    #[error("{frontend} has more than {max} backends")]
    TooManyBackends { frontend: String, max: u16 },
    #[error("at most {max} service CIDRs per family are supported, got {v4} IPv4 and {v6} IPv6")]
    TooManyServiceCidrs { v4: usize, v6: usize, max: usize },
    #[error("bad SNAT port range {0}-{1}")]
    SnatPorts(u16, u16),
    #[error("cannot open cgroup {path}: {source} (a cgroup v2 directory)")]
    Cgroup {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the {what} link on {device} is not a bpf_link{hint}: {source}")]
    NotABpfLink {
        what: &'static str,
        device: String,
        hint: &'static str,
        #[source]
        source: aya::programs::links::LinkError,
    },
    #[error("cannot pin link at {path}: {source}")]
    PinLink {
        path: std::path::PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("cannot pin program `{name}` at {path}: {source}")]
    PinProgram {
        name: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("cannot replace pin {path}: {source}")]
    ReplacePin {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
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
    /// Size the IPv6 maps as the IPv4 ones; `false` (an IPv4-only node)
    /// gives them one entry each, so that they cost no memory.
    pub ipv6: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            max_services: limits::MAX_SERVICES,
            max_backends: limits::MAX_BACKENDS,
            max_service_entries: limits::MAX_SERVICE_ENTRIES,
            ct_entries: limits::CT_ENTRIES,
            affinity_entries: limits::AFFINITY_ENTRIES,
            ipv6: true,
        }
    }
}

/// One loaded copy of the datapath: programs verified and loaded, maps created.
pub struct Datapath {
    ebpf: Ebpf,
    maps: LbMaps,
    pins: Option<PinDir>,
    /// Held while this copy owns the pin directory.
    lock: Option<PinLock>,
    /// Maps resized at load, whose old copies go once the new programs run.
    resized: Vec<Resize>,
    /// The clock the programs stamp entries with.
    clock: Clock,
}

/// Where the north-south ingress path runs on external devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum XdpMode {
    /// Native XDP on physical devices whose driver has it, TC elsewhere
    /// (veth and other virtual devices: XDP there converts every skb back
    /// into a frame, and cannot send a reject back unless the peer runs
    /// XDP too).
    #[default]
    Auto,
    /// Native XDP, or fail.
    Native,
    /// TC ingress only.
    Off,
}

impl std::str::FromStr for XdpMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "native" => Ok(Self::Native),
            "off" => Ok(Self::Off),
            other => Err(format!("{other}: expected auto, native or off")),
        }
    }
}

/// What kind of device an external device is, as far as XDP cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// Backed by a driver with hardware (PCI, ...): native XDP if it has it.
    Physical,
    /// veth: native XDP exists but costs a copy per skb, and XDP_TX reaches
    /// the peer only if it runs XDP too.
    Veth,
    /// Bridges, bonds, tunnels, dummies...
    Virtual,
}

/// The device's kind, from its driver and bus (ETHTOOL_GDRVINFO, in the
/// calling thread's network namespace).
pub fn device_kind(device: &str) -> DeviceKind {
    match device::driver_info(device) {
        Some(info) if info.driver == "veth" => DeviceKind::Veth,
        Some(info) if !info.bus.is_empty() && info.bus != "N/A" => DeviceKind::Physical,
        _ => DeviceKind::Virtual,
    }
}

/// The outcome of [`Datapath::attach_external`].
#[derive(Clone, Debug)]
pub struct ExternalAttach {
    pub how: Attached,
    /// `xdp_ingress` or `tc_ingress`.
    pub ingress: &'static str,
    pub kind: DeviceKind,
    /// Why native XDP was not used in `auto` mode on a physical device.
    pub xdp_error: Option<String>,
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
        Self::load_inner(opts, None, None)
    }

    /// Loads with only `programs` verified and loaded (the others stay in
    /// the object, unloaded: using them fails), every map created, or reused
    /// and pinned under `pins` when given: `trace`, which needs two
    /// programs of the object and would otherwise wait for the verifier to
    /// go through all of them.
    pub fn load_programs(
        opts: &LoadOptions,
        pins: Option<PinDir>,
        programs: &[&'static str],
    ) -> Result<Self, DatapathError> {
        Self::load_inner(opts, pins, Some(programs))
    }

    /// Pins the loaded program `name` at `path` (bpffs): it stays loaded,
    /// with the maps it uses, after this copy is dropped.
    pub fn pin_program(&mut self, name: &'static str, path: &Path) -> Result<(), DatapathError> {
        self.ebpf
            .program_mut(name)
            .ok_or(DatapathError::MissingProgram(name))?
            .pin(path)
            .map_err(|source| DatapathError::PinProgram {
                name,
                path: path.to_owned(),
                source,
            })
    }

    /// Loads with every map pinned under `dir` (bpffs): maps already pinned
    /// there are reused with their contents, so a restarted agent adopts the
    /// running datapath; links are pinned too when attached.
    ///
    /// The directory is locked for this process (a second agent is refused),
    /// and pinned maps of another capacity than `opts` asks are resized
    /// (refused if what they hold would not fit).
    pub fn open_pinned(opts: &LoadOptions, dir: &Path) -> Result<Self, DatapathError> {
        let pins = PinDir::create(dir)?;
        let lock = pins.lock()?;
        pins.recover_resize()?;
        pins.check_layouts()?;
        let resized = pins.plan_resize(opts)?;
        for r in &resized {
            pins.set_aside(r.map)?;
        }
        let mut dp = match Self::load_inner(opts, Some(pins.clone()), None) {
            Ok(dp) => dp,
            Err(e) => {
                // Put the old maps back: nothing changed.
                let _ = pins.recover_resize();
                return Err(e);
            }
        };
        for r in &resized {
            pins.fill_resized(r.map)?;
        }
        // The address filter from what the (adopted or resized) maps hold.
        dp.maps.rebuild_filter()?;
        // An upgrade from the previous config layout: the SNAT hash seed
        // live masqueraded flows were hashed with carries over.
        if let Some(seed) = pins.legacy_snat_seed() {
            dp.maps.inherited_snat_seed = Some(seed);
        }
        dp.lock = Some(lock);
        dp.resized = resized;
        Ok(dp)
    }

    /// Maps resized when they were opened (pinned capacity → asked).
    pub fn resized(&self) -> &[Resize] {
        &self.resized
    }

    /// Once the programs are attached (nothing writes the old maps any
    /// more): copies what the old programs added to the maps that were
    /// resized since they were filled, and drops the old maps. Returns the
    /// entries copied per map.
    pub fn finish_resize(&mut self) -> Result<Vec<(&'static str, usize)>, DatapathError> {
        let Some(pins) = &self.pins else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for r in std::mem::take(&mut self.resized) {
            out.push((r.map, pins.retire_resized(r.map)?));
        }
        Ok(out)
    }

    /// The clock the programs stamp conntrack and affinity entries with.
    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// Whether this process still owns an intact pin directory (false once
    /// `cleanup --force` removed it under the running agent).
    pub fn pins_intact(&self) -> bool {
        self.lock.as_ref().is_none_or(PinLock::intact)
    }

    /// `programs`: the programs to verify and load, `None` for all of them.
    fn load_inner(
        opts: &LoadOptions,
        pins: Option<PinDir>,
        programs: Option<&[&'static str]>,
    ) -> Result<Self, DatapathError> {
        let wanted = |name: &str| programs.is_none_or(|p| p.contains(&name));
        let map_paths: Vec<(&'static str, std::path::PathBuf)> = match &pins {
            Some(p) => names::ALL_MAPS.iter().map(|n| (*n, p.map(n))).collect(),
            None => Vec::new(),
        };
        let v6 = |n: u32| if opts.ipv6 { n } else { 1 };
        // Told once per process: the offset it measures holds for the
        // process's life.
        static CLOCK: std::sync::OnceLock<Clock> = std::sync::OnceLock::new();
        let clock = *CLOCK.get_or_init(|| {
            let c = Clock::detect(EBPF_OBJECT);
            tracing::info!(clock = %c.describe(), "datapath clock");
            c
        });
        let (jiffy_ns, jiffies_offset_ns) = clock.constants();
        let mut loader = EbpfLoader::new();
        loader
            .override_global("JIFFY_NS", &jiffy_ns, true)
            .override_global("JIFFIES_OFFSET_NS", &jiffies_offset_ns, true);
        for (name, path) in &map_paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader
            .map_max_entries(names::SERVICE_STATS, opts.max_services)
            .map_max_entries(names::LB4_BACKENDS, opts.max_backends)
            .map_max_entries(names::SNAT_CURSORS, opts.max_backends)
            .map_max_entries(names::LB4_SERVICES, opts.max_service_entries)
            .map_max_entries(names::CT4, opts.ct_entries)
            .map_max_entries(names::CT4_ASSURED, opts.ct_entries)
            .map_max_entries(names::LB4_AFFINITY, opts.affinity_entries)
            .map_max_entries(names::LB4_SERVICE_NAMES, opts.max_services)
            .map_max_entries(names::LB6_BACKENDS, v6(opts.max_backends))
            .map_max_entries(names::LB6_SERVICES, v6(opts.max_service_entries))
            .map_max_entries(names::CT6, v6(opts.ct_entries))
            .map_max_entries(names::CT6_ASSURED, v6(opts.ct_entries))
            .map_max_entries(names::LB6_AFFINITY, v6(opts.affinity_entries))
            // An LPM trie is never preallocated (it costs what it holds), and
            // cannot be copied in batches: one size for every node.
            .map_max_entries(names::LB6_SOURCE_RANGES, limits::SOURCE_RANGE_ENTRIES)
            .map_max_entries(names::SOCK6_REVNAT, v6(limits::SOCK_REVNAT_ENTRIES))
            .map_max_entries(names::SNAT6_CLOSED, v6(limits::SNAT_CLOSED_ENTRIES))
            .load(EBPF_OBJECT)?;
        for name in [names::XDP_INGRESS, names::XDP_FLOOR]
            .into_iter()
            .filter(|n| wanted(n))
        {
            let p = program::<Xdp>(&mut ebpf, name)?;
            load_retrying(name, || p.load())?;
        }
        for name in [
            names::TC_INGRESS,
            names::TC_EGRESS,
            names::TC_POD_INGRESS,
            names::TC_FLOOR,
        ]
        .into_iter()
        .filter(|n| wanted(n))
        {
            let p = program::<SchedClassifier>(&mut ebpf, name)?;
            load_retrying(name, || p.load())?;
        }
        for name in SOCK_PROGRAMS.into_iter().filter(|n| wanted(n)) {
            let p = program::<CgroupSockAddr>(&mut ebpf, name)?;
            load_retrying(name, || p.load())?;
        }
        fn family<A: family::AbiAddr>(
            ebpf: &mut Ebpf,
            opts: &LoadOptions,
            size: impl Fn(u32) -> u32,
        ) -> Result<family::FamilyMaps<A>, DatapathError> {
            Ok(family::FamilyMaps {
                services: take(ebpf, A::SERVICES, HashMap::try_from)?,
                backends: take(ebpf, A::BACKENDS, Array::try_from)?,
                affinity: take(ebpf, A::AFFINITY, HashMap::try_from)?,
                source_ranges: take(ebpf, A::SOURCE_RANGES, LpmTrie::try_from)?,
                ct: take(ebpf, A::CT, HashMap::try_from)?,
                ct_assured: take(ebpf, A::CT_ASSURED, HashMap::try_from)?,
                ct_capacity: size(opts.ct_entries),
                affinity_capacity: size(opts.affinity_entries),
                service_entries_capacity: size(opts.max_service_entries),
                backends_capacity: size(opts.max_backends),
            })
        }
        let maps = LbMaps {
            config: take(&mut ebpf, names::CONFIG, Array::try_from)?,
            v4: family::<u32>(&mut ebpf, opts, |n| n)?,
            v6: family::<dataplane_common::addr::Ip6>(&mut ebpf, opts, v6)?,
            counters: take(&mut ebpf, names::COUNTERS, PerCpuArray::try_from)?,
            service_stats: take(&mut ebpf, names::SERVICE_STATS, PerCpuArray::try_from)?,
            service_names: take(&mut ebpf, names::LB4_SERVICE_NAMES, HashMap::try_from)?,
            sock_revnat: take(&mut ebpf, names::SOCK4_REVNAT, HashMap::try_from)?,
            sock_revnat6: take(&mut ebpf, names::SOCK6_REVNAT, HashMap::try_from)?,
            addr_filter: take(&mut ebpf, names::ADDR_FILTER, Array::try_from)?,
            hint_devices: take(&mut ebpf, names::HINT_DEVICES, Array::try_from)?,
            hint_shadow: None,
            flow_stats: take(&mut ebpf, names::FLOW_STATS, PerCpuArray::try_from)?,
            inherited_snat_seed: None,
            derived: derived::DerivedMaps::new(
                take(&mut ebpf, names::LB_MAGLEV, HashMap::try_from)?,
                take(&mut ebpf, names::LB4_DSR, HashMap::try_from)?,
                take(&mut ebpf, names::LB6_DSR, HashMap::try_from)?,
                Some(take(
                    &mut ebpf,
                    names::XDP_DEVICES,
                    aya::maps::xdp::DevMapHash::try_from,
                )?),
            ),
            filter: Default::default(),
            retired: Vec::new(),
            max_services: opts.max_services,
            max_backends: opts.max_backends,
        };
        Ok(Self {
            ebpf,
            maps,
            pins,
            lock: None,
            resized: Vec::new(),
            clock,
        })
    }

    pub fn pins(&self) -> Option<&PinDir> {
        self.pins.as_ref()
    }

    /// Attaches the north-south programs to an external device of the
    /// calling thread's network namespace: the ingress path in XDP or in
    /// TC as `mode` and the device decide, and TC egress. Unpinned, they
    /// detach when the `Datapath` drops; pinned, they stay until the pins
    /// are removed. Switching between XDP and TC attaches the new program
    /// before the old one goes (a packet seen by both is translated once:
    /// the second finds it translated).
    pub fn attach_external(&mut self, device: &str, mode: XdpMode) -> Result<ExternalAttach, DatapathError> {
        let kind = device_kind(device);
        let want_xdp = match mode {
            XdpMode::Native => true,
            XdpMode::Off => false,
            XdpMode::Auto => kind == DeviceKind::Physical,
        };
        let mut xdp_error = None;
        let ingress = if want_xdp {
            match self.attach_xdp(names::XDP_INGRESS, device, aya::programs::XdpMode::Driver) {
                Ok(a) => Some(a),
                Err(e) if mode == XdpMode::Auto => {
                    xdp_error = Some(e.to_string());
                    None
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        // XDP may send forwarded frames to a device that runs it natively
        // (host routing): the devmap lists those.
        let ifindex = device::ifindex(device);
        let (how, hook) = match ingress {
            Some(a) => {
                self.detach_pinned(names::TC_INGRESS, device);
                if let Some(i) = ifindex {
                    self.maps.set_xdp_device(i, true)?;
                }
                (a, names::XDP_INGRESS)
            }
            None => {
                if let Some(i) = ifindex {
                    self.maps.set_xdp_device(i, false)?;
                }
                let a = self.attach_tc(names::TC_INGRESS, TcAttachType::Ingress, device)?;
                self.detach_pinned(names::XDP_INGRESS, device);
                (a, names::TC_INGRESS)
            }
        };
        self.attach_tc(names::TC_EGRESS, TcAttachType::Egress, device)?;
        Ok(ExternalAttach {
            how,
            ingress: hook,
            kind,
            xdp_error,
        })
    }

    /// Removes the pinned link of `program` on `device`, if any: the kernel
    /// detaches it when the last reference goes.
    fn detach_pinned(&mut self, program: &'static str, device: &str) {
        if let Some(pins) = &self.pins {
            let _ = std::fs::remove_file(pins.link(program, device));
        }
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
        let dir = std::fs::File::open(cgroup).map_err(|source| DatapathError::Cgroup {
            path: cgroup.to_owned(),
            source,
        })?;
        // bpffs refuses names with a dot (EPERM), e.g. `kubepods.slice`.
        let tag = cgroup.display().to_string().replace(['/', '.'], "_");
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
                .map_err(|source| DatapathError::NotABpfLink {
                    what: "cgroup",
                    device: cgroup.display().to_string(),
                    hint: "",
                    source,
                })?;
            let path = pins.link(name, &tag);
            // bpffs refuses names with a dot (EPERM): no `.new` extension.
            let mut fresh = path.clone().into_os_string();
            fresh.push("-new");
            let fresh = std::path::PathBuf::from(fresh);
            let _ = std::fs::remove_file(&fresh);
            pin_link(link, &fresh)?;
            if path.exists() {
                how = Attached::Replaced;
            }
            // Atomically replaces the old pin: the old link goes with it.
            std::fs::rename(&fresh, &path).map_err(|source| DatapathError::ReplacePin { path, source })?;
        }
        Ok(how)
    }

    fn attach_xdp(
        &mut self,
        name: &'static str,
        device: &str,
        xdp_mode: aya::programs::XdpMode,
    ) -> Result<Attached, DatapathError> {
        let attach_err = |source| DatapathError::Attach {
            name,
            device: device.to_owned(),
            source,
        };
        let prog = program::<Xdp>(&mut self.ebpf, name)?;
        let Some(pins) = &self.pins else {
            prog.attach(device, xdp_mode).map_err(attach_err)?;
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
        let id = prog.attach(device, xdp_mode).map_err(attach_err)?;
        let link: FdLink = prog
            .take_link(id)
            .map_err(attach_err)?
            .try_into()
            .map_err(|source| DatapathError::NotABpfLink {
                what: "XDP",
                device: device.to_owned(),
                hint: "",
                source,
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
        let link: FdLink = prog
            .take_link(id)
            .map_err(attach_err)?
            .try_into()
            .map_err(|source| DatapathError::NotABpfLink {
                what: "TC",
                device: device.to_owned(),
                hint: " (TCX needs Linux 6.6)",
                source,
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

/// How many times a program load is tried when the verifier gives up with
/// EAGAIN (libbpf's count).
const LOAD_ATTEMPTS: u32 = 5;

/// Loads one program, again when the verifier gave up with EAGAIN: it does
/// whenever a signal is pending on the loading thread (a child process's
/// SIGCHLD delivered to it, say), which says nothing about the program.
/// libbpf retries the same way; aya does not.
fn load_retrying(
    name: &'static str,
    load: impl FnMut() -> Result<(), ProgramError>,
) -> Result<(), DatapathError> {
    let gave_up = |e: &ProgramError| matches!(e, ProgramError::LoadError { io_error, .. } if io_error.raw_os_error() == Some(libc::EAGAIN));
    retry(LOAD_ATTEMPTS, load, gave_up).map_err(|source| DatapathError::Program { name, source })
}

/// `f` up to `attempts` times while it fails with an error `again` accepts.
fn retry<T, E>(
    attempts: u32,
    mut f: impl FnMut() -> Result<T, E>,
    again: impl Fn(&E) -> bool,
) -> Result<T, E> {
    let mut attempt = 1;
    loop {
        match f() {
            Err(e) if again(&e) && attempt < attempts => {
                tracing::debug!(attempt, "the verifier gave up with EAGAIN; loading again");
                attempt += 1;
            }
            r => return r,
        }
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
pub(crate) const SOCK_PROGRAMS: [&str; 8] = [
    names::SOCK_CONNECT4,
    names::SOCK_SENDMSG4,
    names::SOCK_RECVMSG4,
    names::SOCK_GETPEERNAME4,
    names::SOCK_CONNECT6,
    names::SOCK_SENDMSG6,
    names::SOCK_RECVMSG6,
    names::SOCK_GETPEERNAME6,
];

impl LbMaps {
    /// Opens a running (or stopped) agent's pinned maps, without loading
    /// any program: what `inspect` reads. Nothing is written through it.
    /// A map that is not pinned, or pinned with another layout (an agent of
    /// another version), is replaced by an empty private one and named in
    /// the returned notes: whatever can be read is.
    pub fn open_pins(dir: &Path) -> Result<(Self, Vec<String>), DatapathError> {
        use aya::maps::{Map, MapData};
        let pins = PinDir::open(dir)?;
        if !pins.map(names::LB4_SERVICES).exists() && !pins.map(names::LB4_BACKENDS).exists() {
            return Err(PinDirError::NoPins(dir.to_owned()).into());
        }
        let mut notes = Vec::new();
        // The pinned map and its capacity, if it is there with the right layout.
        let mut find = |name: &'static str| -> Result<Option<(MapData, u32)>, DatapathError> {
            match pins.check_layout(name) {
                Ok(Some(max)) => {
                    let data = MapData::from_pin(pins.map(name))
                        .map_err(|source| DatapathError::Map { name, source })?;
                    Ok(Some((data, max)))
                }
                Ok(None) => {
                    notes.push(format!(
                        "map {name} is not pinned under {}: shown empty",
                        dir.display()
                    ));
                    Ok(None)
                }
                Err(e) => {
                    notes.push(format!("{e}: shown empty"));
                    Ok(None)
                }
            }
        };
        // The typed pinned map, or an empty private stand-in.
        fn or_empty<T>(
            name: &'static str,
            found: Option<(MapData, u32)>,
            pinned: impl FnOnce(MapData) -> Result<T, MapError>,
            empty: impl FnOnce() -> Result<T, MapError>,
        ) -> Result<(T, u32), DatapathError> {
            let map_err = |source| DatapathError::Map { name, source };
            match found {
                Some((data, max)) => Ok((pinned(data).map_err(map_err)?, max)),
                None => Ok((empty().map_err(map_err)?, 0)),
            }
        }
        const NO_PREALLOC: u32 = 1;
        let (config, _) = or_empty(
            names::CONFIG,
            find(names::CONFIG)?,
            |d| Array::try_from(Map::Array(d)),
            || Array::create(1, 0),
        )?;
        fn family<A: family::AbiAddr>(
            find: &mut impl FnMut(&'static str) -> Result<Option<(MapData, u32)>, DatapathError>,
        ) -> Result<family::FamilyMaps<A>, DatapathError> {
            let (services, service_entries_capacity) = or_empty(
                A::SERVICES,
                find(A::SERVICES)?,
                |d| HashMap::try_from(Map::HashMap(d)),
                || HashMap::create(1, NO_PREALLOC),
            )?;
            let (backends, backends_capacity) = or_empty(
                A::BACKENDS,
                find(A::BACKENDS)?,
                |d| Array::try_from(Map::Array(d)),
                || Array::create(1, 0),
            )?;
            let (affinity, affinity_capacity) = or_empty(
                A::AFFINITY,
                find(A::AFFINITY)?,
                |d| HashMap::try_from(Map::LruHashMap(d)),
                || HashMap::create(1, NO_PREALLOC),
            )?;
            let (source_ranges, _) = or_empty(
                A::SOURCE_RANGES,
                find(A::SOURCE_RANGES)?,
                |d| LpmTrie::try_from(Map::LpmTrie(d)),
                || LpmTrie::create(1, NO_PREALLOC),
            )?;
            let (ct, ct_capacity) = or_empty(
                A::CT,
                find(A::CT)?,
                |d| HashMap::try_from(Map::LruHashMap(d)),
                || HashMap::create(1, NO_PREALLOC),
            )?;
            let (ct_assured, _) = or_empty(
                A::CT_ASSURED,
                find(A::CT_ASSURED)?,
                |d| HashMap::try_from(Map::HashMap(d)),
                || HashMap::create(1, NO_PREALLOC),
            )?;
            Ok(family::FamilyMaps {
                services,
                backends,
                affinity,
                source_ranges,
                ct,
                ct_assured,
                ct_capacity,
                affinity_capacity,
                service_entries_capacity,
                backends_capacity,
            })
        }
        let v4 = family::<u32>(&mut find)?;
        let v6 = family::<dataplane_common::addr::Ip6>(&mut find)?;
        let max_backends = v4.backends_capacity;
        let (counters, _) = or_empty(
            names::COUNTERS,
            find(names::COUNTERS)?,
            |d| PerCpuArray::try_from(Map::PerCpuArray(d)),
            || PerCpuArray::create(dataplane_common::stats::COUNTER_SLOTS, 0),
        )?;
        let (service_stats, max_services) = or_empty(
            names::SERVICE_STATS,
            find(names::SERVICE_STATS)?,
            |d| PerCpuArray::try_from(Map::PerCpuArray(d)),
            || PerCpuArray::create(1, 0),
        )?;
        let (service_names, _) = or_empty(
            names::LB4_SERVICE_NAMES,
            find(names::LB4_SERVICE_NAMES)?,
            |d| HashMap::try_from(Map::HashMap(d)),
            || HashMap::create(1, NO_PREALLOC),
        )?;
        let (sock_revnat, _) = or_empty(
            names::SOCK4_REVNAT,
            find(names::SOCK4_REVNAT)?,
            |d| HashMap::try_from(Map::LruHashMap(d)),
            || HashMap::create(1, NO_PREALLOC),
        )?;
        let (sock_revnat6, _) = or_empty(
            names::SOCK6_REVNAT,
            find(names::SOCK6_REVNAT)?,
            |d| HashMap::try_from(Map::LruHashMap(d)),
            || HashMap::create(1, NO_PREALLOC),
        )?;
        let (addr_filter, _) = or_empty(
            names::ADDR_FILTER,
            find(names::ADDR_FILTER)?,
            |d| Array::try_from(Map::Array(d)),
            || Array::create(dataplane_common::filter::FILTER_WORDS * 2, 0),
        )?;
        let (hint_devices, _) = or_empty(
            names::HINT_DEVICES,
            find(names::HINT_DEVICES)?,
            |d| Array::try_from(Map::Array(d)),
            || Array::create(dataplane_common::hint::DEVICE_WORDS, 0),
        )?;
        let (flow_stats, _) = or_empty(
            names::FLOW_STATS,
            find(names::FLOW_STATS)?,
            |d| PerCpuArray::try_from(Map::PerCpuArray(d)),
            || PerCpuArray::create(64, 0),
        )?;
        let (maglev, _) = or_empty(
            names::LB_MAGLEV,
            find(names::LB_MAGLEV)?,
            |d| HashMap::try_from(Map::HashMap(d)),
            || HashMap::create(1, NO_PREALLOC),
        )?;
        let (dsr4, _) = or_empty(
            names::LB4_DSR,
            find(names::LB4_DSR)?,
            |d| HashMap::try_from(Map::HashMap(d)),
            || HashMap::create(1, NO_PREALLOC),
        )?;
        let (dsr6, _) = or_empty(
            names::LB6_DSR,
            find(names::LB6_DSR)?,
            |d| HashMap::try_from(Map::HashMap(d)),
            || HashMap::create(1, NO_PREALLOC),
        )?;
        let xdp_devices = find(names::XDP_DEVICES)?
            .and_then(|(d, _)| aya::maps::xdp::DevMapHash::try_from(Map::DevMapHash(d)).ok());
        let mut derived = derived::DerivedMaps::new(maglev, dsr4, dsr6, xdp_devices);
        if let Ok(c) = Array::<_, dataplane_common::config::DpConfig>::get(&config, &0, 0) {
            derived.size = c.maglev_size;
            derived.seed = c.maglev_seed;
        }
        Ok((
            LbMaps {
                config,
                v4,
                v6,
                counters,
                service_stats,
                service_names,
                sock_revnat,
                sock_revnat6,
                addr_filter,
                hint_devices,
                hint_shadow: None,
                flow_stats,
                inherited_snat_seed: None,
                derived,
                filter: Default::default(),
                retired: Vec::new(),
                max_services,
                max_backends,
            },
            notes,
        ))
    }
}

/// The link pinned at `path`, if there is one of the right type.
fn pinned_link<L: TryFrom<FdLink>>(path: &Path) -> Option<L> {
    let pinned = PinnedLink::from_pin(path).ok()?;
    L::try_from(FdLink::from(pinned)).ok()
}

fn pin_link(link: FdLink, path: &Path) -> Result<(), DatapathError> {
    link.pin(path).map(drop).map_err(|source| DatapathError::PinLink {
        path: path.to_owned(),
        source,
    })
}

fn take<T>(
    ebpf: &mut Ebpf,
    name: &'static str,
    convert: impl FnOnce(aya::maps::Map) -> Result<T, MapError>,
) -> Result<T, DatapathError> {
    let map = ebpf.take_map(name).ok_or(DatapathError::MissingMap(name))?;
    convert(map).map_err(|source| DatapathError::Map { name, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_load_the_verifier_gave_up_on_is_tried_again_a_few_times() {
        let eagain = |e: &std::io::Error| e.raw_os_error() == Some(libc::EAGAIN);
        let calls = std::cell::Cell::new(0);
        let answer = |errno: i32, ok_at: u32| {
            calls.set(calls.get() + 1);
            if calls.get() >= ok_at {
                Ok(())
            } else {
                Err(std::io::Error::from_raw_os_error(errno))
            }
        };
        assert!(retry(LOAD_ATTEMPTS, || answer(libc::EAGAIN, 3), eagain).is_ok());
        assert_eq!(calls.get(), 3);
        calls.set(0);
        assert!(retry(LOAD_ATTEMPTS, || answer(libc::EAGAIN, 99), eagain).is_err());
        assert_eq!(calls.get(), LOAD_ATTEMPTS);
        calls.set(0);
        assert!(retry(LOAD_ATTEMPTS, || answer(libc::EACCES, 99), eagain).is_err());
        assert_eq!(calls.get(), 1, "a verifier refusal is not retried");
    }
}
