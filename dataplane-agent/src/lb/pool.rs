//! Address allocation for LoadBalancer Services, pure: pools and requests in,
//! an assignment per Service and usage per pool out. No IO, no clock; the
//! controller ([`super::allocator`]) feeds it the whole picture each time
//! (level-triggered) and writes what changed.
//!
//! Rules, in the order [`plan`] applies them (Services oldest first, then by
//! namespace/name, so the outcome does not depend on event order):
//! 1. **Keep.** An address a Service already holds (what the allocator last
//!    wrote, or after a restart its `status.loadBalancer.ingress`) stays
//!    while a pool that selects the Service contains it and no older holder
//!    refuses to share it. A Service that holds an address is never moved to
//!    another one; requested addresses are the exception (the user asked).
//! 2. **Requested.** `spec.loadBalancerIP` or the `ips` annotation: each
//!    address must lie in a pool that selects the Service and takes new
//!    allocations, and be free or shareable.
//! 3. **Allocate.** One address per wanted family: an address held by
//!    Services with the same sharing key where sharing is allowed, else the
//!    lowest free usable address of the first pool (by name) that selects
//!    the Service.
//!
//! Sharing needs the same namespace, the same sharing key, no common
//! (port, protocol), and the same traffic policy (both Cluster, or both
//! Local with the same pod selector, so that the node announcing the address
//! has local endpoints for all of them).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::crd::LoadBalancerIPPool;

/// Pseudo-labels a pool's selector can match besides a Service's labels.
pub const NAMESPACE_LABEL: &str = "io.kubernetes.service.namespace";
pub const NAME_LABEL: &str = "io.kubernetes.service.name";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: &IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// `spec.ipFamilies` spelling.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "IPv4" => Some(Family::V4),
            "IPv6" => Some(Family::V6),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    fn bits(self) -> u32 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u32::from(a) as u128,
        IpAddr::V6(a) => u128::from(a),
    }
}

fn from_u128(family: Family, v: u128) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::from(v as u32)),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(v)),
    }
}

/// An inclusive range of addresses of one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub first: IpAddr,
    pub last: IpAddr,
}

impl Range {
    pub fn family(&self) -> Family {
        Family::of(&self.first)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        Family::of(&ip) == self.family() && self.first <= ip && ip <= self.last
    }

    /// Number of addresses (saturating: all of IPv6 is 2^128).
    pub fn size(&self) -> u128 {
        (to_u128(self.last) - to_u128(self.first)).saturating_add(1)
    }

    pub fn overlaps(&self, other: &Range) -> bool {
        self.family() == other.family() && self.first <= other.last && other.first <= self.last
    }
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

/// `ADDR/LEN` → the whole prefix. The address must be the prefix's first
/// (as Kubernetes validates CIDRs: `10.0.0.1/24` is a typo, not a pool).
pub fn parse_cidr(s: &str) -> Result<Range, String> {
    let (addr, len) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}` is not a CIDR (ADDRESS/LENGTH)"))?;
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| format!("`{s}`: `{addr}` is not an IP address"))?;
    let family = Family::of(&addr);
    let len: u32 = len
        .parse()
        .ok()
        .filter(|l| *l <= family.bits())
        .ok_or_else(|| format!("`{s}`: prefix length must be 0..={}", family.bits()))?;
    let host_bits = family.bits() - len;
    let host_mask: u128 = if host_bits == 0 {
        0
    } else {
        u128::MAX >> (128 - host_bits)
    };
    let first = to_u128(addr);
    if first & host_mask != 0 {
        return Err(format!(
            "`{s}` has host bits set (the prefix is {}/{len})",
            from_u128(family, first & !host_mask)
        ));
    }
    Ok(Range {
        first: addr,
        last: from_u128(family, first | host_mask),
    })
}

/// A pool's block → (every address in it, the ones new allocations may use).
fn parse_block(block: &super::crd::Block, allow_first_last: bool) -> Result<(Range, Range), String> {
    match (&block.cidr, &block.start, &block.stop) {
        (Some(cidr), None, None) => {
            let raw = parse_cidr(cidr)?;
            // /31 and /32 (/127, /128) have no network or broadcast address
            // worth sparing.
            let usable = if allow_first_last || raw.size() <= 2 {
                raw
            } else {
                let f = raw.family();
                Range {
                    first: from_u128(f, to_u128(raw.first) + 1),
                    last: from_u128(f, to_u128(raw.last) - 1),
                }
            };
            Ok((raw, usable))
        }
        (None, Some(start), Some(stop)) => {
            let parse = |s: &str| {
                s.parse::<IpAddr>()
                    .map_err(|_| format!("`{s}` is not an IP address"))
            };
            let (first, last) = (parse(start)?, parse(stop)?);
            if Family::of(&first) != Family::of(&last) {
                return Err(format!("range {start}-{stop} mixes IPv4 and IPv6"));
            }
            if first > last {
                return Err(format!("range {start}-{stop}: start is after stop"));
            }
            let r = Range { first, last };
            Ok((r, r))
        }
        _ => Err("a block has either `cidr`, or `start` and `stop`".into()),
    }
}

/// A label selector (matchLabels and matchExpressions, Kubernetes semantics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    requirements: Vec<(String, Op)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    In(BTreeSet<String>),
    NotIn(BTreeSet<String>),
    Exists,
    DoesNotExist,
}

impl Selector {
    /// Absent selects everything.
    pub fn parse(sel: Option<&LabelSelector>) -> Result<Self, String> {
        let mut requirements = Vec::new();
        let Some(sel) = sel else {
            return Ok(Self { requirements });
        };
        for (k, v) in sel.match_labels.iter().flatten() {
            requirements.push((k.clone(), Op::In(BTreeSet::from([v.clone()]))));
        }
        for e in sel.match_expressions.iter().flatten() {
            let values: BTreeSet<String> = e.values.iter().flatten().cloned().collect();
            let op = match e.operator.as_str() {
                "In" | "NotIn" if values.is_empty() => {
                    return Err(format!("selector on `{}`: {} needs values", e.key, e.operator));
                }
                "In" => Op::In(values),
                "NotIn" => Op::NotIn(values),
                "Exists" | "DoesNotExist" if !values.is_empty() => {
                    return Err(format!("selector on `{}`: {} takes no values", e.key, e.operator));
                }
                "Exists" => Op::Exists,
                "DoesNotExist" => Op::DoesNotExist,
                other => return Err(format!("selector on `{}`: unknown operator `{other}`", e.key)),
            };
            requirements.push((e.key.clone(), op));
        }
        Ok(Self { requirements })
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|(k, op)| match op {
            Op::In(vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Op::NotIn(vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Op::Exists => labels.contains_key(k),
            Op::DoesNotExist => !labels.contains_key(k),
        })
    }
}

/// Which pool an address is from, by the pools' blocks (the first pool
/// holding it, in the order given).
pub struct PoolIndex<'a>(Vec<(&'a LoadBalancerIPPool, Vec<Range>)>);

impl<'a> PoolIndex<'a> {
    pub fn new(pools: impl IntoIterator<Item = &'a LoadBalancerIPPool>) -> Self {
        Self(pools.into_iter().map(|p| (p, Pool::parse(p).ranges)).collect())
    }

    pub fn pool_of(&self, ip: IpAddr) -> Option<&'a LoadBalancerIPPool> {
        self.0
            .iter()
            .find(|(_, ranges)| ranges.iter().any(|r| r.contains(ip)))
            .map(|(p, _)| *p)
    }

    /// Whether L2 announcements answer for `ip` (its pool does not say no).
    pub fn l2_announced(&self, ip: IpAddr) -> bool {
        self.pool_of(ip).is_none_or(|p| p.spec.l2_announce != Some(false))
    }
}

/// A pool as the allocator uses it.
#[derive(Clone, Debug)]
pub struct Pool {
    pub name: String,
    /// Every address of every valid block: a held address in one is kept.
    pub ranges: Vec<Range>,
    /// What new allocations may use (first/last of CIDRs spared).
    pub usable: Vec<Range>,
    /// `None`: the selector is invalid and selects nothing.
    pub selector: Option<Selector>,
    pub disabled: bool,
    /// Blocks or selector that cannot be used, as messages.
    pub problems: Vec<String>,
    /// Set when the pool overlaps an older one: no new allocations from it.
    pub conflict: Option<String>,
    /// creationTimestamp (RFC 3339): the older of two overlapping pools wins.
    pub created: String,
}

impl Pool {
    pub fn parse(obj: &LoadBalancerIPPool) -> Self {
        let mut pool = Pool {
            name: obj.name().to_owned(),
            ranges: Vec::new(),
            usable: Vec::new(),
            selector: None,
            disabled: obj.spec.disabled,
            problems: Vec::new(),
            conflict: None,
            created: obj
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.to_string())
                .unwrap_or_default(),
        };
        for (i, b) in obj.spec.blocks.iter().enumerate() {
            match parse_block(b, obj.spec.allow_first_last_ips) {
                Ok((raw, usable)) => {
                    if let Some(other) = pool.ranges.iter().find(|r| r.overlaps(&raw)) {
                        pool.problems
                            .push(format!("block {i} ({raw}) overlaps {other} of the same pool"));
                        continue;
                    }
                    pool.ranges.push(raw);
                    pool.usable.push(usable);
                }
                Err(e) => pool.problems.push(format!("block {i}: {e}")),
            }
        }
        match Selector::parse(obj.spec.service_selector.as_ref()) {
            Ok(s) => pool.selector = Some(s),
            Err(e) => pool.problems.push(format!("serviceSelector: {e}")),
        }
        pool
    }

    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.selector.as_ref().is_some_and(|s| s.matches(labels))
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.ranges.iter().any(|r| r.contains(ip))
    }

    /// Takes new allocations at all.
    pub fn open(&self) -> bool {
        !self.disabled && self.conflict.is_none()
    }

    pub fn total(&self) -> u128 {
        self.usable.iter().fold(0u128, |n, r| n.saturating_add(r.size()))
    }
}

/// Every pool, with overlaps between pools resolved: the older pool (then
/// the smaller name) keeps the addresses, the other is marked conflicting.
#[derive(Clone, Debug, Default)]
pub struct Pools {
    /// Sorted by name: the allocation order.
    pools: Vec<Pool>,
}

impl Pools {
    pub fn new(mut pools: Vec<Pool>) -> Self {
        pools.sort_by(|a, b| (&a.created, &a.name).cmp(&(&b.created, &b.name)));
        for i in 0..pools.len() {
            let (older, rest) = pools.split_at_mut(i);
            let pool = &mut rest[0];
            pool.conflict = older.iter().find_map(|o| {
                pool.ranges.iter().find_map(|mine| {
                    o.ranges
                        .iter()
                        .find(|theirs| theirs.overlaps(mine))
                        .map(|theirs| format!("{mine} overlaps {theirs} of the older pool {}", o.name))
                })
            });
        }
        pools.sort_by(|a, b| a.name.cmp(&b.name));
        Self { pools }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Pool> {
        self.pools.iter()
    }

    /// A pool that selects the Service and contains `ip`: it may keep it.
    fn keeping(&self, ip: IpAddr, labels: &BTreeMap<String, String>) -> Option<&Pool> {
        self.pools.iter().find(|p| p.contains(ip) && p.selects(labels))
    }

    /// A pool from which the Service may newly take `ip`.
    fn granting(&self, ip: IpAddr, labels: &BTreeMap<String, String>) -> Option<&Pool> {
        self.pools
            .iter()
            .find(|p| p.open() && p.selects(labels) && p.usable.iter().any(|r| r.contains(ip)))
    }
}

/// externalTrafficPolicy, as sharing cares about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Traffic {
    Cluster,
    /// Local, with the Service's pod selector (canonical text).
    Local(String),
}

/// spec.ipFamilyPolicy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FamilyPolicy {
    #[default]
    SingleStack,
    PreferDualStack,
    RequireDualStack,
}

/// One Service's request, from [`super::request::Request::of`].
#[derive(Clone, Debug)]
pub struct Request {
    /// namespace/name.
    pub key: String,
    pub namespace: String,
    /// creationTimestamp (RFC 3339): older Services win contested addresses.
    pub created: String,
    /// The Service's labels plus the pseudo-labels.
    pub labels: BTreeMap<String, String>,
    /// spec.ipFamilies (empty: the requested addresses' families, else IPv4).
    pub families: Vec<Family>,
    pub policy: FamilyPolicy,
    /// Requested addresses (empty: any); `Err` when the request is invalid.
    pub requested: Result<Vec<IpAddr>, String>,
    pub sharing_key: Option<String>,
    /// (port, protocol) of every Service port.
    pub ports: BTreeSet<(i32, String)>,
    pub traffic: Traffic,
    /// What the Service holds now.
    pub current: Vec<IpAddr>,
}

impl Request {
    fn wanted_families(&self) -> Vec<Family> {
        let mut fams: Vec<Family> = if !self.families.is_empty() {
            self.families.clone()
        } else {
            match &self.requested {
                Ok(ips) if !ips.is_empty() => ips.iter().map(Family::of).collect(),
                _ => vec![Family::V4],
            }
        };
        let mut seen = BTreeSet::new();
        fams.retain(|f| seen.insert(*f));
        if self.policy == FamilyPolicy::SingleStack {
            fams.truncate(1);
        }
        fams
    }

    fn shares_with(&self, other: &Request) -> bool {
        self.namespace == other.namespace
            && self.sharing_key.is_some()
            && self.sharing_key == other.sharing_key
            && self.ports.is_disjoint(&other.ports)
            && self.traffic == other.traffic
    }
}

/// Why a Service lacks (some of) what it asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// The request itself is wrong (unparsable address, conflicting fields,
    /// a family the Service does not have).
    InvalidRequest(String),
    /// No pool selects the Service for this family.
    NoPool(Family),
    /// Pools select the Service but have no free address of this family.
    Exhausted(Family),
    /// A requested address is in no pool that selects the Service and takes
    /// new allocations.
    NotInPool(IpAddr),
    /// A requested address is held by a Service it cannot be shared with.
    InUse { ip: IpAddr, by: String },
}

impl Problem {
    /// The condition's and the Event's reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Problem::InvalidRequest(_) => "InvalidRequest",
            Problem::NoPool(_) => "NoMatchingPool",
            Problem::Exhausted(_) => "PoolExhausted",
            Problem::NotInPool(_) => "RequestedIPNotInPool",
            Problem::InUse { .. } => "IPInUse",
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::InvalidRequest(why) => write!(f, "invalid request: {why}"),
            Problem::NoPool(fam) => write!(f, "no {fam} pool selects this Service"),
            Problem::Exhausted(fam) => {
                write!(f, "every {fam} pool that selects this Service is exhausted")
            }
            Problem::NotInPool(ip) => write!(
                f,
                "requested {ip} is in no enabled pool that selects this Service"
            ),
            Problem::InUse { ip, by } => write!(
                f,
                "requested {ip} is used by {by}, which does not share it with this Service \
                 (sharing needs the same namespace and sharing key, no common port, the same traffic policy)"
            ),
        }
    }
}

/// What a Service gets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// One address per family, in the Service's family order.
    pub ips: Vec<IpAddr>,
    pub problems: Vec<Problem>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub total: u128,
    pub used: u128,
}

impl Usage {
    pub fn available(&self) -> u128 {
        self.total.saturating_sub(self.used)
    }
}

#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// namespace/name → outcome.
    pub services: BTreeMap<String, Outcome>,
    /// pool name → usage.
    pub pools: BTreeMap<String, Usage>,
}

struct Allocation<'a> {
    requests: &'a [Request],
    /// address → indexes of the Services holding it.
    holders: BTreeMap<IpAddr, Vec<usize>>,
    claims: Vec<BTreeMap<Family, IpAddr>>,
}

impl Allocation<'_> {
    /// The first holder of `ip` that `i` may not share it with.
    fn refusing_holder(&self, ip: IpAddr, i: usize) -> Option<usize> {
        let me = &self.requests[i];
        self.holders
            .get(&ip)
            .and_then(|hs| hs.iter().copied().find(|&h| !me.shares_with(&self.requests[h])))
    }

    fn claim(&mut self, i: usize, ip: IpAddr) {
        self.holders.entry(ip).or_default().push(i);
        self.claims[i].insert(Family::of(&ip), ip);
    }

    /// The lowest usable address of `pool` of `family` that nobody holds.
    fn first_free(&self, pool: &Pool, family: Family) -> Option<IpAddr> {
        pool.usable.iter().filter(|r| r.family() == family).find_map(|r| {
            let mut candidate = to_u128(r.first);
            for held in self.holders.range(r.first..=r.last).map(|(ip, _)| to_u128(*ip)) {
                if held != candidate {
                    break;
                }
                candidate += 1;
            }
            (candidate <= to_u128(r.last)).then(|| from_u128(family, candidate))
        })
    }

    /// An address already held by Services with `i`'s sharing key that `i`
    /// may join.
    fn shared(&self, pools: &Pools, i: usize, family: Family) -> Option<IpAddr> {
        let me = &self.requests[i];
        me.sharing_key.as_ref()?;
        self.holders
            .iter()
            .filter(|(ip, _)| Family::of(ip) == family)
            .find(|(ip, hs)| {
                hs.iter().all(|&h| me.shares_with(&self.requests[h]))
                    && pools.keeping(**ip, &me.labels).is_some()
            })
            .map(|(ip, _)| *ip)
    }
}

/// Assigns addresses to every request. See the module documentation.
pub fn plan(pools: &Pools, requests: &[Request]) -> Plan {
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by(|&a, &b| {
        (&requests[a].created, &requests[a].key).cmp(&(&requests[b].created, &requests[b].key))
    });
    let mut a = Allocation {
        requests,
        holders: BTreeMap::new(),
        claims: vec![BTreeMap::new(); requests.len()],
    };
    let mut problems: Vec<Vec<Problem>> = vec![Vec::new(); requests.len()];
    let wanted: Vec<Vec<Family>> = requests.iter().map(Request::wanted_families).collect();

    // 1. Keep what is held.
    for &i in &order {
        let r = &requests[i];
        for &ip in &r.current {
            let family = Family::of(&ip);
            let still_requested = match &r.requested {
                Ok(req) if !req.is_empty() => req.contains(&ip),
                _ => true,
            };
            if still_requested
                && wanted[i].contains(&family)
                && !a.claims[i].contains_key(&family)
                && pools.keeping(ip, &r.labels).is_some()
                && a.refusing_holder(ip, i).is_none()
            {
                a.claim(i, ip);
            }
        }
    }

    // 2. Requested addresses.
    for &i in &order {
        let r = &requests[i];
        let requested = match &r.requested {
            Ok(ips) => ips,
            Err(why) => {
                problems[i].push(Problem::InvalidRequest(why.clone()));
                continue;
            }
        };
        for &ip in requested {
            let family = Family::of(&ip);
            if a.claims[i].get(&family) == Some(&ip) {
                continue;
            }
            if !wanted[i].contains(&family) {
                let fams: Vec<&str> = wanted[i].iter().map(|f| f.name()).collect();
                problems[i].push(Problem::InvalidRequest(format!(
                    "{ip} is {family}, the Service's families are {}",
                    fams.join(",")
                )));
            } else if pools.granting(ip, &r.labels).is_none() {
                problems[i].push(Problem::NotInPool(ip));
            } else if let Some(h) = a.refusing_holder(ip, i) {
                problems[i].push(Problem::InUse {
                    ip,
                    by: requests[h].key.clone(),
                });
            } else {
                a.claim(i, ip);
            }
        }
    }

    // 3. Allocate for Services that asked for nothing in particular.
    for &i in &order {
        let r = &requests[i];
        if !matches!(&r.requested, Ok(ips) if ips.is_empty()) {
            continue;
        }
        for &family in &wanted[i] {
            if a.claims[i].contains_key(&family) {
                continue;
            }
            if let Some(ip) = a.shared(pools, i, family) {
                a.claim(i, ip);
                continue;
            }
            let mut selected = false;
            let mut got = None;
            for pool in pools.iter().filter(|p| p.open() && p.selects(&r.labels)) {
                if !pool.usable.iter().any(|x| x.family() == family) {
                    continue;
                }
                selected = true;
                if let Some(ip) = a.first_free(pool, family) {
                    got = Some(ip);
                    break;
                }
            }
            match got {
                Some(ip) => a.claim(i, ip),
                None if selected => problems[i].push(Problem::Exhausted(family)),
                None => problems[i].push(Problem::NoPool(family)),
            }
        }
        // PreferDualStack: one family is enough.
        if r.policy == FamilyPolicy::PreferDualStack && !a.claims[i].is_empty() {
            problems[i].retain(|p| !matches!(p, Problem::NoPool(_) | Problem::Exhausted(_)));
        }
    }

    let mut plan = Plan::default();
    for (i, r) in requests.iter().enumerate() {
        let ips = wanted[i]
            .iter()
            .filter_map(|f| a.claims[i].get(f).copied())
            .collect();
        plan.services.insert(
            r.key.clone(),
            Outcome {
                ips,
                problems: std::mem::take(&mut problems[i]),
            },
        );
    }
    for pool in pools.iter() {
        let used = a
            .holders
            .keys()
            .filter(|ip| pool.usable.iter().any(|r| r.contains(**ip)))
            .count() as u128;
        plan.pools.insert(
            pool.name.clone(),
            Usage {
                total: pool.total(),
                used,
            },
        );
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lb::crd::{Block, PoolSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn cidr(c: &str) -> Block {
        Block {
            cidr: Some(c.into()),
            ..Default::default()
        }
    }

    fn range(a: &str, b: &str) -> Block {
        Block {
            start: Some(a.into()),
            stop: Some(b.into()),
            ..Default::default()
        }
    }

    fn pool(name: &str, blocks: Vec<Block>) -> Pool {
        Pool::parse(&LoadBalancerIPPool::new(
            name,
            PoolSpec {
                blocks,
                ..Default::default()
            },
        ))
    }

    fn req(key: &str) -> Request {
        let (ns, name) = key.split_once('/').unwrap();
        Request {
            key: key.into(),
            namespace: ns.into(),
            created: String::new(),
            labels: BTreeMap::from([
                (NAMESPACE_LABEL.into(), ns.into()),
                (NAME_LABEL.into(), name.into()),
            ]),
            families: vec![Family::V4],
            policy: FamilyPolicy::SingleStack,
            requested: Ok(vec![]),
            sharing_key: None,
            ports: BTreeSet::from([(80, "TCP".into())]),
            traffic: Traffic::Cluster,
            current: vec![],
        }
    }

    fn ips(plan: &Plan, key: &str) -> Vec<String> {
        plan.services[key].ips.iter().map(|i| i.to_string()).collect()
    }

    fn reasons(plan: &Plan, key: &str) -> Vec<&'static str> {
        plan.services[key].problems.iter().map(|p| p.reason()).collect()
    }

    #[test]
    fn cidrs_and_ranges_parse_with_first_and_last_spared() {
        let (raw, usable) = parse_block(&cidr("198.18.0.240/28"), false).unwrap();
        assert_eq!(raw.to_string(), "198.18.0.240-198.18.0.255");
        assert_eq!(usable.to_string(), "198.18.0.241-198.18.0.254");
        assert_eq!(usable.size(), 14);
        let (_, usable) = parse_block(&cidr("198.18.0.240/28"), true).unwrap();
        assert_eq!(usable.size(), 16);
        for small in ["10.0.0.4/31", "10.0.0.4/32", "fd00::/127", "fd00::1/128"] {
            let (raw, usable) = parse_block(&cidr(small), false).unwrap();
            assert_eq!(raw, usable, "{small}: every address is usable");
        }
        let (_, usable) = parse_block(&cidr("fd00::/120"), false).unwrap();
        assert_eq!(usable.to_string(), "fd00::1-fd00::fe");
        let (raw, _) = parse_block(&cidr("::/0"), false).unwrap();
        assert_eq!(raw.size(), u128::MAX, "saturates");
        let (_, usable) = parse_block(&range("10.0.0.5", "10.0.0.9"), false).unwrap();
        assert_eq!(usable.size(), 5, "ranges are used whole");

        for (bad, why) in [
            (cidr("10.0.0.1/24"), "host bits"),
            (cidr("10.0.0.0/33"), "prefix length"),
            (cidr("10.0.0.0"), "not a CIDR"),
            (cidr("10.0.0.x/24"), "not an IP"),
            (range("10.0.0.9", "10.0.0.5"), "after stop"),
            (range("10.0.0.1", "fd00::1"), "mixes"),
            (Block::default(), "either"),
            (
                Block {
                    cidr: Some("10.0.0.0/24".into()),
                    start: Some("10.0.0.1".into()),
                    stop: None,
                },
                "either",
            ),
        ] {
            let e = parse_block(&bad, false).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn selectors_follow_kubernetes_semantics() {
        let labels = BTreeMap::from([("tier".to_string(), "edge".to_string())]);
        let expr = |key: &str, op: &str, values: &[&str]| LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: key.into(),
                operator: op.into(),
                values: (!values.is_empty()).then(|| values.iter().map(|s| s.to_string()).collect()),
            }]),
            match_labels: None,
        };
        let m = |sel: &LabelSelector| Selector::parse(Some(sel)).unwrap().matches(&labels);
        assert!(Selector::parse(None).unwrap().matches(&labels));
        assert!(m(&expr("tier", "In", &["edge", "core"])));
        assert!(!m(&expr("tier", "NotIn", &["edge"])));
        assert!(m(&expr("zone", "NotIn", &["a"])), "NotIn matches an absent key");
        assert!(m(&expr("tier", "Exists", &[])));
        assert!(m(&expr("zone", "DoesNotExist", &[])));
        assert!(!m(&LabelSelector {
            match_labels: Some(BTreeMap::from([("tier".into(), "core".into())])),
            match_expressions: None,
        }));
        assert!(Selector::parse(Some(&expr("tier", "In", &[]))).is_err());
        assert!(Selector::parse(Some(&expr("tier", "Exists", &["x"]))).is_err());
        assert!(Selector::parse(Some(&expr("tier", "Near", &["x"]))).is_err());
    }

    #[test]
    fn allocates_the_lowest_free_address_and_keeps_what_is_held() {
        let pools = Pools::new(vec![pool("a", vec![cidr("10.0.0.0/29")])]);
        let mut web = req("default/web");
        web.current = vec![ip("10.0.0.5")];
        let plan = plan(&pools, &[req("default/api"), web, req("default/db")]);
        assert_eq!(
            ips(&plan, "default/web"),
            ["10.0.0.5"],
            "kept, though lower ones are free"
        );
        assert_eq!(ips(&plan, "default/api"), ["10.0.0.1"]);
        assert_eq!(ips(&plan, "default/db"), ["10.0.0.2"]);
        assert_eq!(plan.pools["a"], Usage { total: 6, used: 3 });
    }

    #[test]
    fn exhaustion_and_missing_pools_are_reported_and_older_services_win() {
        let pools = Pools::new(vec![pool("a", vec![range("10.0.0.1", "10.0.0.1")])]);
        let mut old = req("default/old");
        old.created = "2024-01-01T00:00:00Z".into();
        let mut new = req("default/new");
        new.created = "2024-01-02T00:00:00Z".into();
        let mut v6 = req("default/v6");
        v6.families = vec![Family::V6];
        let plan = plan(&pools, &[new, old, v6]);
        assert_eq!(ips(&plan, "default/old"), ["10.0.0.1"]);
        assert!(plan.services["default/new"].ips.is_empty());
        assert_eq!(reasons(&plan, "default/new"), ["PoolExhausted"]);
        assert_eq!(reasons(&plan, "default/v6"), ["NoMatchingPool"]);
        assert_eq!(plan.pools["a"].available(), 0);
    }

    #[test]
    fn requested_addresses_must_be_in_a_selecting_enabled_pool_and_free() {
        let mut edge = pool("edge", vec![cidr("10.0.1.0/24")]);
        edge.selector = Some(
            Selector::parse(Some(&LabelSelector {
                match_labels: Some(BTreeMap::from([(NAMESPACE_LABEL.into(), "edge".into())])),
                match_expressions: None,
            }))
            .unwrap(),
        );
        let mut off = pool("off", vec![cidr("10.0.2.0/24")]);
        off.disabled = true;
        let pools = Pools::new(vec![pool("a", vec![cidr("10.0.0.0/24")]), edge, off]);
        let want = |key: &str, ips: &[&str]| {
            let mut r = req(key);
            r.requested = Ok(ips.iter().map(|s| ip(s)).collect());
            r
        };
        let mut holder = req("default/holder");
        holder.current = vec![ip("10.0.0.7")];
        let mut bad = req("default/bad");
        bad.requested = Err("`10.0.0.x` is not an IP address".into());
        bad.current = vec![ip("10.0.0.9")];
        let plan = plan(
            &pools,
            &[
                holder,
                want("default/ok", &["10.0.0.50"]),
                want("default/taken", &["10.0.0.7"]),
                want("default/foreign", &["10.0.1.5"]),
                want("edge/mine", &["10.0.1.5"]),
                want("default/disabled", &["10.0.2.5"]),
                want("default/nowhere", &["192.0.2.1"]),
                want("default/v6", &["fd00::1"]),
                bad,
            ],
        );
        assert_eq!(ips(&plan, "default/ok"), ["10.0.0.50"]);
        assert_eq!(ips(&plan, "edge/mine"), ["10.0.1.5"]);
        assert_eq!(reasons(&plan, "default/taken"), ["IPInUse"]);
        assert!(
            plan.services["default/taken"].problems[0]
                .to_string()
                .contains("default/holder")
        );
        assert_eq!(reasons(&plan, "default/foreign"), ["RequestedIPNotInPool"]);
        assert_eq!(reasons(&plan, "default/disabled"), ["RequestedIPNotInPool"]);
        assert_eq!(reasons(&plan, "default/nowhere"), ["RequestedIPNotInPool"]);
        assert_eq!(reasons(&plan, "default/v6"), ["InvalidRequest"]);
        // A bad request loses nothing: the held address stays.
        assert_eq!(reasons(&plan, "default/bad"), ["InvalidRequest"]);
        assert_eq!(ips(&plan, "default/bad"), ["10.0.0.9"]);
    }

    #[test]
    fn a_changed_request_moves_the_service_to_the_requested_address() {
        let pools = Pools::new(vec![pool("a", vec![cidr("10.0.0.0/24")])]);
        let mut r = req("default/web");
        r.current = vec![ip("10.0.0.1")];
        r.requested = Ok(vec![ip("10.0.0.20")]);
        assert_eq!(ips(&plan(&pools, &[r]), "default/web"), ["10.0.0.20"]);
    }

    #[test]
    fn sharing_needs_same_namespace_key_disjoint_ports_and_policy() {
        let pools = Pools::new(vec![pool("a", vec![cidr("10.0.0.0/24")])]);
        let shared = |key: &str, port: i32, sharing: Option<&str>, traffic: Traffic| {
            let mut r = req(key);
            r.requested = Ok(vec![ip("10.0.0.10")]);
            r.ports = BTreeSet::from([(port, "TCP".into())]);
            r.sharing_key = sharing.map(Into::into);
            r.traffic = traffic;
            r.created = "2024-01-02T00:00:00Z".into();
            r
        };
        // The oldest claims the address; the others ask to join it.
        let mut first = shared("default/a", 80, Some("k"), Traffic::Cluster);
        first.created = "2024-01-01T00:00:00Z".into();
        let plan = plan(
            &pools,
            &[
                first,
                shared("default/b", 443, Some("k"), Traffic::Cluster),
                shared("default/clash", 80, Some("k"), Traffic::Cluster),
                shared("default/other-key", 53, Some("j"), Traffic::Cluster),
                shared("default/no-key", 54, None, Traffic::Cluster),
                shared("other/b", 55, Some("k"), Traffic::Cluster),
                shared("default/local", 56, Some("k"), Traffic::Local("app=x".into())),
            ],
        );
        assert_eq!(ips(&plan, "default/a"), ["10.0.0.10"]);
        assert_eq!(ips(&plan, "default/b"), ["10.0.0.10"]);
        for refused in [
            "default/clash",
            "default/other-key",
            "default/no-key",
            "other/b",
            "default/local",
        ] {
            assert_eq!(reasons(&plan, refused), ["IPInUse"], "{refused}");
        }
        assert_eq!(plan.pools["a"].used, 1);
    }

    #[test]
    fn services_with_a_sharing_key_join_an_address_of_their_group() {
        let pools = Pools::new(vec![pool("a", vec![cidr("10.0.0.0/24")])]);
        let mut dns_udp = req("default/dns-udp");
        dns_udp.sharing_key = Some("dns".into());
        dns_udp.ports = BTreeSet::from([(53, "UDP".into())]);
        dns_udp.created = "1".into();
        let mut dns_tcp = req("default/dns-tcp");
        dns_tcp.sharing_key = Some("dns".into());
        dns_tcp.ports = BTreeSet::from([(53, "TCP".into())]);
        dns_tcp.created = "2".into();
        let mut clash = dns_tcp.clone();
        clash.key = "default/dns-tcp2".into();
        clash.created = "3".into();
        let plan = plan(&pools, &[clash, dns_tcp, dns_udp]);
        assert_eq!(ips(&plan, "default/dns-udp"), ["10.0.0.1"]);
        assert_eq!(ips(&plan, "default/dns-tcp"), ["10.0.0.1"]);
        assert_eq!(
            ips(&plan, "default/dns-tcp2"),
            ["10.0.0.2"],
            "port clash: its own address"
        );
    }

    #[test]
    fn dual_stack_policies() {
        let pools = Pools::new(vec![
            pool("v4", vec![cidr("10.0.0.0/30")]),
            pool("v6", vec![cidr("fd00::/126")]),
        ]);
        let mut dual = req("default/dual");
        dual.families = vec![Family::V6, Family::V4];
        dual.policy = FamilyPolicy::RequireDualStack;
        let mut single = dual.clone();
        single.key = "default/single".into();
        single.policy = FamilyPolicy::SingleStack;
        let plan1 = plan(&pools, &[dual.clone(), single]);
        assert_eq!(
            ips(&plan1, "default/dual"),
            ["fd00::1", "10.0.0.1"],
            "family order kept"
        );
        assert_eq!(ips(&plan1, "default/single"), ["fd00::2"]);

        let v4_only = Pools::new(vec![pool("v4", vec![cidr("10.0.0.0/30")])]);
        let mut prefer = dual.clone();
        prefer.policy = FamilyPolicy::PreferDualStack;
        let plan2 = plan(&v4_only, &[dual]);
        assert_eq!(reasons(&plan2, "default/dual"), ["NoMatchingPool"]);
        let plan3 = plan(&v4_only, &[prefer]);
        assert_eq!(plan3.services.len(), 1);
        assert_eq!(ips(&plan3, "default/dual"), ["10.0.0.1"]);
        assert!(plan3.services["default/dual"].problems.is_empty());
    }

    #[test]
    fn disabled_and_conflicting_pools_keep_addresses_but_give_no_new_ones() {
        let mut old = pool("z-old", vec![cidr("10.0.0.0/28")]);
        old.created = "2024-01-01T00:00:00Z".into();
        let mut overlapping = pool("a-new", vec![cidr("10.0.0.8/29")]);
        overlapping.created = "2024-02-01T00:00:00Z".into();
        let mut off = pool("off", vec![cidr("10.1.0.0/30")]);
        off.disabled = true;
        let pools = Pools::new(vec![old, overlapping, off]);
        let conflicting: Vec<_> = pools
            .iter()
            .filter(|p| p.conflict.is_some())
            .map(|p| &p.name)
            .collect();
        assert_eq!(conflicting, ["a-new"]);
        let mut held = req("default/held");
        held.current = vec![ip("10.1.0.1")];
        let plan = plan(&pools, &[held, req("default/new")]);
        assert_eq!(ips(&plan, "default/held"), ["10.1.0.1"]);
        assert_eq!(
            ips(&plan, "default/new"),
            ["10.0.0.1"],
            "from z-old, not the conflicting a-new"
        );
    }

    #[test]
    fn an_address_outside_every_selecting_pool_is_replaced() {
        let pools = Pools::new(vec![pool("a", vec![cidr("10.0.0.0/24")])]);
        let mut r = req("default/web");
        r.current = vec![ip("192.0.2.1")];
        assert_eq!(ips(&plan(&pools, &[r]), "default/web"), ["10.0.0.1"]);
    }

    #[test]
    fn two_holders_of_one_address_the_older_keeps_it() {
        let pools = Pools::new(vec![pool("a", vec![cidr("10.0.0.0/24")])]);
        let mut a = req("default/a");
        a.current = vec![ip("10.0.0.5")];
        a.created = "2".into();
        let mut b = a.clone();
        b.key = "default/b".into();
        b.created = "1".into();
        let plan = plan(&pools, &[a, b]);
        assert_eq!(ips(&plan, "default/b"), ["10.0.0.5"]);
        assert_eq!(ips(&plan, "default/a"), ["10.0.0.1"]);
    }

    #[test]
    fn pool_problems_are_reported_and_valid_blocks_still_serve() {
        let p = Pool::parse(&LoadBalancerIPPool::new(
            "p",
            PoolSpec {
                blocks: vec![cidr("10.0.0.0/30"), cidr("bogus"), cidr("10.0.0.2/31")],
                ..Default::default()
            },
        ));
        assert_eq!(p.ranges.len(), 1);
        assert_eq!(p.problems.len(), 2, "{:?}", p.problems);
        assert_eq!(p.total(), 2);
    }

    #[test]
    fn the_pool_index_finds_an_address_pool_and_whether_l2_announces_it() {
        let mut bgp = LoadBalancerIPPool::new(
            "bgp",
            PoolSpec {
                blocks: vec![Block {
                    cidr: Some("203.0.113.0/28".into()),
                    ..Default::default()
                }],
                ..Default::default()
            },
        );
        bgp.spec.l2_announce = Some(false);
        let lan = LoadBalancerIPPool::new(
            "lan",
            PoolSpec {
                blocks: vec![Block {
                    cidr: Some("198.18.0.240/29".into()),
                    ..Default::default()
                }],
                ..Default::default()
            },
        );
        let index = PoolIndex::new([&bgp, &lan]);
        assert_eq!(
            index.pool_of("203.0.113.5".parse().unwrap()).map(|p| p.name()),
            Some("bgp")
        );
        assert!(!index.l2_announced("203.0.113.5".parse().unwrap()));
        assert!(index.l2_announced("198.18.0.241".parse().unwrap()));
        assert!(
            index.l2_announced("192.0.2.1".parse().unwrap()),
            "from no pool: announced"
        );
    }
}
