//! The datapath: the embedded kernel object, loaded, attached, and its maps.
//!
//! [`Datapath`] owns one loaded copy of the object. Attaching happens in the
//! network namespace of the calling thread, so a test (or an agent started
//! with `ip netns exec`) attaches to the devices of its own namespace.
//! [`LbMaps`] is the typed API to program services and backends; the
//! Kubernetes control plane and the tests both go through it.

mod maps;

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, MapError, PerCpuArray},
    programs::{ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode},
};
use dataplane_common::{limits, names};
pub use maps::{
    Backend, BackendId, BackendSet, DatapathConfig, EmptyVerdict, Frontend, FrontendEntry, FrontendKind,
    LbMaps,
};

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
}

impl Datapath {
    /// Loads the embedded object with default map sizes (nothing attached).
    pub fn load() -> Result<Self, DatapathError> {
        Self::load_with(&LoadOptions::default())
    }

    pub fn load_with(opts: &LoadOptions) -> Result<Self, DatapathError> {
        let mut ebpf = EbpfLoader::new()
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
        for name in [names::TC_EGRESS, names::TC_POD_INGRESS] {
            program::<SchedClassifier>(&mut ebpf, name)?
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
            max_services: opts.max_services,
            max_backends: opts.max_backends,
        };
        Ok(Self { ebpf, maps })
    }

    /// Attaches the north-south programs to an external device of the
    /// calling thread's network namespace: XDP (native mode where the
    /// driver has it) and TC egress. Detached when the `Datapath` drops.
    pub fn attach_external(&mut self, device: &str) -> Result<(), DatapathError> {
        let attach_err = |name, source| DatapathError::Attach {
            name,
            device: device.to_owned(),
            source,
        };
        program::<Xdp>(&mut self.ebpf, names::XDP_INGRESS)?
            .attach(device, XdpMode::default())
            .map_err(|e| attach_err(names::XDP_INGRESS, e))?;
        program::<SchedClassifier>(&mut self.ebpf, names::TC_EGRESS)?
            .attach(device, TcAttachType::Egress)
            .map_err(|e| attach_err(names::TC_EGRESS, e))?;
        Ok(())
    }

    /// Attaches to a pod-facing host interface: TC ingress (replies from
    /// local backends) and TC egress (SNAT towards local backends).
    pub fn attach_pod_interface(&mut self, device: &str) -> Result<(), DatapathError> {
        for (name, direction) in [
            (names::TC_POD_INGRESS, TcAttachType::Ingress),
            (names::TC_EGRESS, TcAttachType::Egress),
        ] {
            program::<SchedClassifier>(&mut self.ebpf, name)?
                .attach(device, direction)
                .map_err(|source| DatapathError::Attach {
                    name,
                    device: device.to_owned(),
                    source,
                })?;
        }
        Ok(())
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

    /// A TC program by name ([`names::TC_EGRESS`], [`names::TC_POD_INGRESS`]).
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

fn take<T>(
    ebpf: &mut Ebpf,
    name: &'static str,
    convert: impl FnOnce(aya::maps::Map) -> Result<T, MapError>,
) -> Result<T, DatapathError> {
    let map = ebpf.take_map(name).ok_or(DatapathError::MissingMap(name))?;
    convert(map).map_err(|source| DatapathError::Map { name, source })
}
