//! A Service port's [`Contribution`] as the incremental table keeps it: the
//! same content in a fraction of the memory (a hundred thousand are kept).
//!
//! - The port's backends (one protocol, one family) are packed: an IPv4
//!   backend takes 8 bytes instead of 24.
//! - A frontend's backend sets name backends by position; a set that lists
//!   backends in their order, out of at most 64 (the usual case), is a bit
//!   mask and takes no allocation at all.
//! - The ClusterIPs are the addresses of the ClusterIP frontends, not a list
//!   of their own.
//!
//! [`StoredContribution::new`] and the accessors give back exactly what the
//! contribution held (a unit test checks the round trip).

use std::{net::IpAddr, time::Duration};

use super::{
    desired::Contribution,
    table::{Backend, BackendKey, BackendSet, EmptyVerdict, Frontend, FrontendEntry, FrontendKind},
};
use crate::net::{IpCidr, Protocol};

/// An IPv4 backend of a port of protocol `proto`: address, port, flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PackedV4 {
    addr: u32,
    port: u16,
    flags: u8,
}

const SERVING: u8 = 1;
const TERMINATING: u8 = 2;
const LOCAL: u8 = 4;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Backends {
    /// IPv4 backends of one protocol.
    V4(Protocol, Box<[PackedV4]>),
    /// Anything else (IPv6, or a mix).
    Any(Box<[Backend]>),
}

impl Backends {
    fn new(list: Vec<Backend>) -> Self {
        let proto = list.first().map_or(Protocol::Tcp, |b| b.proto);
        let packed: Option<Vec<PackedV4>> = list
            .iter()
            .map(|b| match b.addr {
                IpAddr::V4(a) if b.proto == proto => Some(PackedV4 {
                    addr: a.into(),
                    port: b.port,
                    flags: (b.serving as u8 * SERVING)
                        | (b.terminating as u8 * TERMINATING)
                        | (b.local as u8 * LOCAL),
                }),
                _ => None,
            })
            .collect();
        match packed {
            Some(p) => Backends::V4(proto, p.into_boxed_slice()),
            None => Backends::Any(list.into_boxed_slice()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Backends::V4(_, l) => l.len(),
            Backends::Any(l) => l.len(),
        }
    }

    fn get(&self, i: usize) -> Backend {
        match self {
            Backends::V4(proto, l) => {
                let p = l[i];
                Backend {
                    addr: IpAddr::V4(p.addr.into()),
                    port: p.port,
                    proto: *proto,
                    serving: p.flags & SERVING != 0,
                    terminating: p.flags & TERMINATING != 0,
                    local: p.flags & LOCAL != 0,
                }
            }
            Backends::Any(l) => l[i],
        }
    }

    fn key(&self, i: usize) -> BackendKey {
        match self {
            Backends::V4(proto, l) => BackendKey {
                addr: IpAddr::V4(l[i].addr.into()),
                port: l[i].port,
                proto: *proto,
            },
            Backends::Any(l) => l[i].key(),
        }
    }
}

/// A backend set: positions in the port's backends.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Members {
    /// Positions in increasing order, as a bit mask (at most 64 backends).
    Mask(u64),
    List(Box<[u32]>),
}

impl Members {
    /// The positions of `set`'s keys among `backends`.
    fn new(set: &[BackendKey], backends: &Backends) -> Self {
        let n = backends.len();
        // Usually the set lists some of the backends in their order: one
        // pass finds them.
        let mut positions = Vec::with_capacity(set.len());
        let mut at = 0;
        for key in set {
            match (at..n).find(|i| backends.key(*i) == *key) {
                Some(i) => {
                    positions.push(i as u32);
                    at = i + 1;
                }
                None => {
                    // Out of order (or a key named twice): look everywhere.
                    let i = (0..n)
                        .find(|i| backends.key(*i) == *key)
                        .expect("a set names backends of its own port (see `contribution`)");
                    positions.push(i as u32);
                    at = n;
                }
            }
        }
        let increasing = positions.windows(2).all(|w| w[0] < w[1]);
        if n <= 64 && increasing {
            Members::Mask(positions.iter().fold(0, |m, p| m | 1 << p))
        } else {
            Members::List(positions.into_boxed_slice())
        }
    }

    fn len(&self) -> usize {
        match self {
            Members::Mask(m) => m.count_ones() as usize,
            Members::List(l) => l.len(),
        }
    }

    fn positions(&self) -> Positions<'_> {
        match self {
            Members::Mask(m) => Positions::Mask(*m),
            Members::List(l) => Positions::List(l.iter()),
        }
    }
}

enum Positions<'a> {
    Mask(u64),
    List(std::slice::Iter<'a, u32>),
}

impl Iterator for Positions<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        match self {
            Positions::Mask(0) => None,
            Positions::Mask(m) => {
                let i = m.trailing_zeros() as usize;
                *m &= *m - 1;
                Some(i)
            }
            Positions::List(l) => l.next().map(|p| *p as usize),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct StoredSet {
    members: Members,
    when_empty: EmptyVerdict,
}

impl StoredSet {
    fn new(set: &BackendSet<BackendKey>, backends: &Backends) -> Self {
        Self {
            members: Members::new(&set.backends, backends),
            when_empty: set.when_empty,
        }
    }

    fn named<C>(&self, backends: &Backends, name: &mut dyn FnMut(&BackendKey) -> Option<C>) -> BackendSet<C> {
        let mut out = Vec::with_capacity(self.members.len());
        out.extend(self.members.positions().filter_map(|i| name(&backends.key(i))));
        BackendSet {
            backends: out,
            when_empty: self.when_empty,
        }
    }
}

/// A frontend entry with its sets stored as [`StoredSet`]s.
#[derive(Clone, Debug, PartialEq, Eq)]
struct StoredFrontend {
    frontend: Frontend,
    service_id: u32,
    kind: FrontendKind,
    backends: StoredSet,
    internal_backends: Option<StoredSet>,
    masquerade: bool,
    affinity_timeout: Option<Duration>,
    source_ranges: bool,
    external_local: bool,
    internal_local: bool,
    dsr: bool,
    maglev: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredContribution {
    backends: Backends,
    frontends: Box<[StoredFrontend]>,
    /// The ClusterIPs when they are not exactly the ClusterIP frontends'
    /// addresses.
    service_addresses: Option<Box<[IpAddr]>>,
    source_ranges: Box<[IpCidr]>,
}

impl StoredContribution {
    pub fn new(c: Contribution) -> Self {
        let backends = Backends::new(c.backends);
        let frontends: Box<[StoredFrontend]> = c
            .frontends
            .iter()
            .map(|(fe, e)| StoredFrontend {
                frontend: *fe,
                service_id: e.service_id,
                kind: e.kind,
                backends: StoredSet::new(&e.backends, &backends),
                internal_backends: e.internal_backends.as_ref().map(|s| StoredSet::new(s, &backends)),
                masquerade: e.masquerade,
                affinity_timeout: e.affinity_timeout,
                source_ranges: e.source_ranges,
                external_local: e.external_local,
                internal_local: e.internal_local,
                dsr: e.dsr,
                maglev: e.maglev,
            })
            .collect();
        let derived = frontends
            .iter()
            .filter(|f| f.kind == FrontendKind::ClusterIp)
            .map(|f| f.frontend.addr);
        let service_addresses = (!derived.eq(c.service_addresses.iter().copied()))
            .then(|| c.service_addresses.into_boxed_slice());
        Self {
            backends,
            frontends,
            service_addresses,
            source_ranges: c.source_ranges.into_iter().collect(),
        }
    }

    /// Every backend of the port (whatever its conditions).
    pub fn backends(&self) -> impl Iterator<Item = Backend> + '_ {
        (0..self.backends.len()).map(|i| self.backends.get(i))
    }

    pub fn service_addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let derived = match &self.service_addresses {
            Some(_) => None,
            None => Some(
                self.frontends
                    .iter()
                    .filter(|f| f.kind == FrontendKind::ClusterIp)
                    .map(|f| f.frontend.addr),
            ),
        };
        let listed = self.service_addresses.iter().flat_map(|l| l.iter().copied());
        derived.into_iter().flatten().chain(listed)
    }

    pub fn source_ranges(&self) -> &[IpCidr] {
        &self.source_ranges
    }

    /// The frontends it claims.
    pub fn frontends(&self) -> impl Iterator<Item = Frontend> + '_ {
        self.frontends.iter().map(|f| f.frontend)
    }

    /// The `i`th frontend it claims.
    pub fn frontend_at(&self, i: usize) -> Option<Frontend> {
        self.frontends.get(i).map(|f| f.frontend)
    }

    fn find(&self, fe: &Frontend) -> Option<&StoredFrontend> {
        self.frontends.iter().find(|f| f.frontend == *fe)
    }

    /// The kind of frontend `fe` it claims.
    pub fn kind_of(&self, fe: &Frontend) -> Option<FrontendKind> {
        self.find(fe).map(|f| f.kind)
    }

    /// The entry it wants for `fe`, its backends named by `name` (those
    /// `name` cannot name are left out).
    pub fn entry<C>(
        &self,
        fe: &Frontend,
        name: &mut dyn FnMut(&BackendKey) -> Option<C>,
    ) -> Option<FrontendEntry<C>> {
        let f = self.find(fe)?;
        Some(FrontendEntry {
            service_id: f.service_id,
            kind: f.kind,
            backends: f.backends.named(&self.backends, name),
            internal_backends: f
                .internal_backends
                .as_ref()
                .map(|s| s.named(&self.backends, name)),
            masquerade: f.masquerade,
            affinity_timeout: f.affinity_timeout,
            source_ranges: f.source_ranges,
            external_local: f.external_local,
            internal_local: f.internal_local,
            dsr: f.dsr,
            maglev: f.maglev,
        })
    }

    /// The contribution it was made from.
    #[cfg(test)]
    pub fn to_contribution(&self) -> Contribution {
        Contribution {
            frontends: self
                .frontends()
                .map(|fe| (fe, self.entry(&fe, &mut |k| Some(*k)).expect("its own")))
                .collect(),
            backends: self.backends().collect(),
            service_addresses: self.service_addresses().collect(),
            source_ranges: self.source_ranges.iter().copied().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::table::BackendSet;

    fn backend(last: u16, port: u16, proto: Protocol, v6: bool) -> Backend {
        Backend {
            addr: if v6 {
                IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, last])
            } else {
                IpAddr::from([10, 0, (last >> 8) as u8, last as u8])
            },
            port,
            proto,
            serving: last.is_multiple_of(2),
            terminating: last.is_multiple_of(3),
            local: last.is_multiple_of(5),
        }
    }

    fn contribution(backends: Vec<Backend>, sets: Vec<Vec<usize>>) -> Contribution {
        let keys = |s: &Vec<usize>| BackendSet {
            backends: s.iter().map(|i| backends[*i].key()).collect(),
            when_empty: EmptyVerdict::Drop,
        };
        let cluster_ip = Frontend {
            addr: IpAddr::from([10, 96, 0, 1]),
            port: 80,
            proto: Protocol::Tcp,
        };
        let node_port = Frontend {
            addr: IpAddr::from([192, 168, 0, 1]),
            port: 30080,
            proto: Protocol::Tcp,
        };
        let entry = |kind, set: &Vec<usize>, internal: Option<&Vec<usize>>| FrontendEntry {
            service_id: 7,
            kind,
            backends: keys(set),
            internal_backends: internal.map(keys),
            masquerade: kind != FrontendKind::ClusterIp,
            affinity_timeout: Some(Duration::from_secs(30)),
            source_ranges: false,
            external_local: internal.is_some(),
            internal_local: false,
            dsr: false,
            maglev: false,
        };
        Contribution {
            frontends: vec![
                (cluster_ip, entry(FrontendKind::ClusterIp, &sets[0], None)),
                (node_port, entry(FrontendKind::NodePort, &sets[1], sets.get(2))),
            ],
            backends,
            service_addresses: vec![cluster_ip.addr],
            source_ranges: [IpCidr::new(IpAddr::from([198, 51, 100, 0]), 24).unwrap()].into(),
        }
    }

    #[test]
    fn a_stored_contribution_gives_back_what_it_was_made_of() {
        let tcp = |n: u16| {
            (0..n)
                .map(|i| backend(i, 8080, Protocol::Tcp, false))
                .collect::<Vec<_>>()
        };
        let cases = vec![
            // In order, a mask.
            contribution(tcp(10), vec![vec![0, 2, 3, 9], vec![], vec![1, 5]]),
            // More than 64 backends: a list.
            contribution(tcp(100), vec![(0..100).collect(), vec![70, 99], vec![3]]),
            // Out of order, and a backend named twice.
            contribution(tcp(5), vec![vec![3, 1, 2], vec![4, 4], vec![0]]),
            // IPv6, and a mix of protocols.
            contribution(
                (0..4).map(|i| backend(i, 53, Protocol::Udp, true)).collect(),
                vec![vec![0, 1, 2, 3], vec![2]],
            ),
            contribution(
                vec![
                    backend(1, 53, Protocol::Udp, false),
                    backend(2, 53, Protocol::Tcp, false),
                ],
                vec![vec![0, 1], vec![1, 0]],
            ),
            contribution(Vec::new(), vec![vec![], vec![]]),
        ];
        for c in cases {
            let stored = StoredContribution::new(c.clone());
            assert_eq!(stored.to_contribution(), c);
            assert_eq!(stored, StoredContribution::new(c.clone()));
        }
        // ClusterIPs that are not the ClusterIP frontends' are kept as such.
        let mut c = contribution(tcp(2), vec![vec![0], vec![1]]);
        c.service_addresses.push(IpAddr::from([10, 96, 0, 2]));
        assert_eq!(StoredContribution::new(c.clone()).to_contribution(), c);
    }
}
