//! Loading, attaching and reading the kernel programs.
//!
//! [`Datapath`] owns one loaded copy of the embedded object: its programs and
//! maps. Attaching happens in the network namespace of the calling thread, so
//! a test (or an agent started with `ip netns exec`) attaches to the devices
//! of its own namespace.

use aya::{
    Ebpf, EbpfLoader,
    maps::{MapError, PerCpuArray},
    programs::{ProgramError, Xdp, XdpMode},
};
use dataplane_common::{
    names,
    stats::{Counter, CounterIndex},
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
        "attaching `{name}` to device `{device}` failed: {source}. Check that the device exists in this network namespace"
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
}

/// One loaded copy of the datapath: programs verified and loaded, maps created.
pub struct Datapath {
    ebpf: Ebpf,
}

impl Datapath {
    /// Loads the embedded object and every program in it (nothing attached).
    pub fn load() -> Result<Self, DatapathError> {
        let mut ebpf = EbpfLoader::new().load(EBPF_OBJECT)?;
        let xdp = xdp_mut(&mut ebpf)?;
        xdp.load().map_err(|source| DatapathError::Program {
            name: names::XDP_PROG,
            source,
        })?;
        Ok(Self { ebpf })
    }

    /// Attaches the XDP entry point to `device` (in the calling thread's
    /// network namespace). Detached when the `Datapath` is dropped.
    pub fn attach_xdp(&mut self, device: &str) -> Result<(), DatapathError> {
        xdp_mut(&mut self.ebpf)?
            .attach(device, XdpMode::default())
            .map_err(|source| DatapathError::Attach {
                name: names::XDP_PROG,
                device: device.to_owned(),
                source,
            })?;
        Ok(())
    }

    /// The XDP entry point, e.g. to run packets through it with
    /// `BPF_PROG_TEST_RUN` (`aya::programs::TestRun`).
    pub fn xdp(&self) -> Result<&Xdp, DatapathError> {
        self.ebpf
            .program(names::XDP_PROG)
            .ok_or(DatapathError::MissingProgram(names::XDP_PROG))?
            .try_into()
            .map_err(|source| DatapathError::Program {
                name: names::XDP_PROG,
                source,
            })
    }

    /// The XDP counters, summed over CPUs.
    pub fn xdp_counters(&self) -> Result<Vec<(CounterIndex, Counter)>, DatapathError> {
        let name = names::XDP_COUNTERS;
        let map_err = |source| DatapathError::Map { name, source };
        let map: PerCpuArray<_, Counter> =
            PerCpuArray::try_from(self.ebpf.map(name).ok_or(DatapathError::MissingMap(name))?)
                .map_err(map_err)?;
        CounterIndex::ALL
            .iter()
            .map(|&index| {
                let per_cpu = map.get(&(index as u32), 0).map_err(map_err)?;
                let mut total = Counter::default();
                per_cpu.iter().for_each(|c| total.merge(c));
                Ok((index, total))
            })
            .collect()
    }

    /// One XDP counter, summed over CPUs.
    pub fn xdp_counter(&self, index: CounterIndex) -> Result<Counter, DatapathError> {
        Ok(self
            .xdp_counters()?
            .into_iter()
            .find(|(i, _)| *i == index)
            .map(|(_, c)| c)
            .unwrap_or_default())
    }
}

fn xdp_mut(ebpf: &mut Ebpf) -> Result<&mut Xdp, DatapathError> {
    ebpf.program_mut(names::XDP_PROG)
        .ok_or(DatapathError::MissingProgram(names::XDP_PROG))?
        .try_into()
        .map_err(|source| DatapathError::Program {
            name: names::XDP_PROG,
            source,
        })
}
