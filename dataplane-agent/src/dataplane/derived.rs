//! The maps derived from the frontends ([`crate::state::derived`]): Maglev
//! tables (`LB_MAGLEV_V1`, in chunks), the backend node's DSR entries
//! (`LB4_DSR_V1`, `LB6_DSR_V1`), and the devices XDP may redirect to
//! (`DP_XDP_DEVICES_V1`, which follows the attachments, not the table).

use std::net::IpAddr;

use aya::maps::{HashMap, MapData, MapError, xdp::DevMapHash};
use dataplane_common::{
    addr::Ip6,
    lb::{Dsr4Key, Dsr6Key, DsrKey, DsrValue, MAGLEV_CHUNK, MAGLEV_MAX_SIZE, MaglevChunk, MaglevKey},
    maglev::DEFAULT_TABLE_SIZE,
    names,
};

use super::{
    DatapathError, err,
    family::{AbiAddr, abi},
    removed,
};
use crate::state::{
    derived::{Derived, DerivedOp, DsrEntry, TableSet},
    maglev,
    table::{Backend, BackendId, MapTable},
};

/// The derived maps, and what has been written to them.
pub struct DerivedMaps {
    pub(super) maglev: HashMap<MapData, MaglevKey, MaglevChunk>,
    pub(super) dsr4: HashMap<MapData, Dsr4Key, DsrValue>,
    pub(super) dsr6: HashMap<MapData, Dsr6Key, DsrValue>,
    /// `None` for `inspect` on pins without it.
    pub(super) xdp_devices: Option<DevMapHash<MapData>>,
    pub(super) state: Derived,
    /// Maglev's table size and seed (the datapath config's).
    pub(super) size: u32,
    pub(super) seed: u32,
}

/// Chunks a table of `size` entries takes.
fn chunks(size: u32) -> u32 {
    size.div_ceil(MAGLEV_CHUNK as u32)
}

fn dsr_key<A: AbiAddr>(e: &DsrEntry) -> DsrKey<A> {
    DsrKey {
        address: e.address.map(abi).unwrap_or_default(),
        backend: abi(e.backend),
        port: e.port.to_be(),
        proto: e.proto.number(),
        _pad: 0,
    }
}

impl DerivedMaps {
    pub(super) fn new(
        maglev: HashMap<MapData, MaglevKey, MaglevChunk>,
        dsr4: HashMap<MapData, Dsr4Key, DsrValue>,
        dsr6: HashMap<MapData, Dsr6Key, DsrValue>,
        xdp_devices: Option<DevMapHash<MapData>>,
    ) -> Self {
        Self {
            maglev,
            dsr4,
            dsr6,
            xdp_devices,
            state: Derived::new(),
            size: DEFAULT_TABLE_SIZE,
            seed: 0,
        }
    }

    /// The table chunks for `set`, as the kernel reads them (backend ids;
    /// 0 past the end).
    fn table(&self, set: &TableSet) -> Vec<MaglevChunk> {
        let owners = maglev::build(&set.identities, self.size, self.seed);
        let mut out = vec![[0u32; MAGLEV_CHUNK]; chunks(self.size) as usize];
        for (i, owner) in owners.iter().enumerate() {
            out[i / MAGLEV_CHUNK][i % MAGLEV_CHUNK] = set.ids[*owner as usize].get();
        }
        out
    }

    /// Writes one derived operation.
    pub(super) fn apply(&mut self, op: &DerivedOp) -> Result<(), DatapathError> {
        let name = names::LB_MAGLEV;
        match op {
            DerivedOp::SetTable { table, set, previous } => {
                let new = self.table(set);
                // Only the chunks that change: a backend joining or leaving
                // moves a few percent of the entries (see `state::maglev`).
                let old = previous.as_ref().map(|p| self.table(p));
                for (chunk, value) in new.iter().enumerate() {
                    if old.as_ref().is_some_and(|o| o.get(chunk) == Some(value)) {
                        continue;
                    }
                    let key = MaglevKey {
                        table: *table,
                        chunk: chunk as u32,
                    };
                    self.maglev.insert(key, value, 0).map_err(err(name))?;
                }
                Ok(())
            }
            DerivedOp::RemoveTable(table) => {
                // Whatever size wrote it (a restart may change the size).
                for chunk in 0..chunks(MAGLEV_MAX_SIZE) {
                    let key = MaglevKey { table: *table, chunk };
                    removed(self.maglev.remove(&key), name)?;
                }
                Ok(())
            }
            DerivedOp::SetDsr(e, t) => {
                let value = DsrValue {
                    backend_id: t.backend_id.get(),
                    service_id: t.service_id,
                };
                match e.backend {
                    IpAddr::V4(_) => self
                        .dsr4
                        .insert(dsr_key::<u32>(e), value, 0)
                        .map_err(err(names::LB4_DSR)),
                    IpAddr::V6(_) => self
                        .dsr6
                        .insert(dsr_key::<Ip6>(e), value, 0)
                        .map_err(err(names::LB6_DSR)),
                }
            }
            DerivedOp::RemoveDsr(e) => match e.backend {
                IpAddr::V4(_) => removed(self.dsr4.remove(&dsr_key::<u32>(e)), names::LB4_DSR),
                IpAddr::V6(_) => removed(self.dsr6.remove(&dsr_key::<Ip6>(e)), names::LB6_DSR),
            },
        }
    }

    /// Rebuilds what is derived from `table` (what the maps hold: a
    /// restarted agent, or one that re-read the maps), writes all of it
    /// (tables whole) and removes whatever the maps hold beyond it.
    pub(super) fn adopt(
        &mut self,
        table: &MapTable,
        backend: &dyn Fn(BackendId) -> Option<Backend>,
    ) -> Result<(usize, usize), DatapathError> {
        self.state = Derived::new();
        let mut ops = Vec::new();
        for (fe, entry) in &table.frontends {
            self.state.set_frontend(fe, entry, backend, &mut ops);
        }
        for op in &ops {
            self.apply(op)?;
        }
        // What no frontend derives any more (written by a run that did not
        // live to remove it).
        let wanted_tables: std::collections::BTreeSet<u32> = ops
            .iter()
            .filter_map(|o| match o {
                DerivedOp::SetTable { table, .. } => Some(*table),
                _ => None,
            })
            .collect();
        let stale: Vec<MaglevKey> = self
            .maglev
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !wanted_tables.contains(&k.table) || k.chunk >= chunks(self.size))
            .collect();
        for k in &stale {
            removed(self.maglev.remove(k), names::LB_MAGLEV)?;
        }
        let wanted_dsr: std::collections::HashSet<DsrEntry> = ops
            .iter()
            .filter_map(|o| match o {
                DerivedOp::SetDsr(e, _) => Some(*e),
                _ => None,
            })
            .collect();
        let keep4: std::collections::HashSet<Dsr4Key> = wanted_dsr.iter().map(dsr_key::<u32>).collect();
        let keep6: std::collections::HashSet<Dsr6Key> = wanted_dsr.iter().map(dsr_key::<Ip6>).collect();
        let stale4: Vec<Dsr4Key> = self
            .dsr4
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !keep4.contains(k))
            .collect();
        for k in &stale4 {
            removed(self.dsr4.remove(k), names::LB4_DSR)?;
        }
        let stale6: Vec<Dsr6Key> = self
            .dsr6
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !keep6.contains(k))
            .collect();
        for k in &stale6 {
            removed(self.dsr6.remove(k), names::LB6_DSR)?;
        }
        Ok((stale.len(), stale4.len() + stale6.len()))
    }

    /// Table `table` as the kernel reads it: backend ids by entry, `None`
    /// when a chunk is missing.
    pub fn read_table(&self, table: u32) -> Result<Option<Vec<u32>>, DatapathError> {
        let mut out = Vec::with_capacity(self.size as usize);
        for chunk in 0..chunks(self.size) {
            match self.maglev.get(&MaglevKey { table, chunk }, 0) {
                Ok(c) => out.extend_from_slice(&c),
                Err(MapError::KeyNotFound) => return Ok(None),
                Err(e) => return Err(err(names::LB_MAGLEV)(e)),
            }
        }
        out.truncate(self.size as usize);
        Ok(Some(out))
    }

    /// Lets XDP redirect forwarded packets to `ifindex` (a device that runs
    /// our XDP natively), or no longer.
    pub(super) fn set_xdp_device(&mut self, ifindex: u32, on: bool) -> Result<(), DatapathError> {
        let name = names::XDP_DEVICES;
        let Some(devices) = &mut self.xdp_devices else {
            return Err(DatapathError::MissingMap(name));
        };
        if on {
            devices
                .insert(ifindex, ifindex, None, 0)
                .map_err(DatapathError::XdpDevices)
        } else {
            removed(devices.remove(ifindex), name)
        }
    }

    /// The devices XDP may redirect to.
    pub fn xdp_devices(&self) -> Vec<u32> {
        self.xdp_devices
            .iter()
            .flat_map(|d| d.iter().filter_map(Result::ok).map(|(k, _)| k))
            .collect()
    }
}
