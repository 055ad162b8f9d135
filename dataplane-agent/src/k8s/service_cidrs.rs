//! The service CIDRs in force: `--service-cidr` (`serviceCidr`) and the
//! CIDRs of every `networking.k8s.io/v1` ServiceCIDR object, as kube-proxy
//! 1.33+ takes them (the union over every object the API returns, those
//! being deleted included: an address of a ServiceCIDR that still exists may
//! still be allocated). Pure: no IO.
//!
//! Traffic to an address in a service CIDR that no Service holds is dropped
//! (`drop_unallocated_service_ip`); nothing else depends on these CIDRs.
//! The datapath holds [`MAX_SERVICE_CIDRS`] per family: beyond that, the
//! first ones in a stable order are kept (the flags' first, in their order;
//! then the objects' by object name, each object's in its order) and the
//! rest are not enforced (reported, never an error).

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::ServiceCIDR;

pub use dataplane_common::config::MAX_SERVICE_CIDRS;

use crate::net::{IpCidr, IpFamily};

/// One ServiceCIDR object, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCidrInfo {
    pub name: String,
    /// Its `spec.cidrs` (empty when the object is invalid).
    pub cidrs: Vec<IpCidr>,
    /// Why the object was skipped, if it was: a CIDR that does not parse
    /// (the API server validates them; a manifest may not have been).
    pub problem: Option<String>,
}

impl ServiceCidrInfo {
    pub fn parse(obj: &ServiceCIDR) -> Self {
        let name = obj.metadata.name.clone().unwrap_or_default();
        let texts = obj
            .spec
            .as_ref()
            .and_then(|s| s.cidrs.clone())
            .unwrap_or_default();
        Self::of(name, &texts)
    }

    /// An object named `name` with `spec.cidrs` `texts`: skipped whole if
    /// one of them is not a CIDR.
    pub fn of(name: String, texts: &[String]) -> Self {
        let mut cidrs = Vec::new();
        for t in texts {
            match t.parse::<IpCidr>() {
                Ok(c) => cidrs.push(c),
                Err(e) => {
                    return Self {
                        name,
                        cidrs: Vec::new(),
                        problem: Some(format!("spec.cidrs: {e}")),
                    };
                }
            }
        }
        Self {
            name,
            cidrs,
            problem: None,
        }
    }
}

/// The ServiceCIDR objects the source delivered, by name, and whether the
/// set changed since the control loop last looked.
#[derive(Clone, Debug, Default)]
pub struct ServiceCidrObjects {
    objects: BTreeMap<String, ServiceCidrInfo>,
    changed: bool,
    /// Objects newly found invalid (name, why), to log and count once.
    problems: Vec<(String, String)>,
}

impl ServiceCidrObjects {
    /// A complete list (initial, relist, or every manifest file's).
    pub fn replace(&mut self, items: impl IntoIterator<Item = ServiceCidrInfo>) {
        let mut next = BTreeMap::new();
        for i in items {
            next.insert(i.name.clone(), i);
        }
        for (name, i) in &next {
            note_problem(&mut self.problems, self.objects.get(name), i);
        }
        if next != self.objects {
            self.objects = next;
            self.changed = true;
        }
    }

    pub fn upsert(&mut self, info: ServiceCidrInfo) {
        note_problem(&mut self.problems, self.objects.get(&info.name), &info);
        if self.objects.get(&info.name) != Some(&info) {
            self.objects.insert(info.name.clone(), info);
            self.changed = true;
        }
    }

    pub fn remove(&mut self, name: &str) {
        if self.objects.remove(name).is_some() {
            self.changed = true;
        }
    }

    /// Whether the set changed since the last call.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// Objects found invalid since the last call: (name, why).
    pub fn take_problems(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.problems)
    }

    /// Every object's CIDRs, objects by name.
    pub fn cidrs(&self) -> impl Iterator<Item = IpCidr> + '_ {
        self.objects.values().flat_map(|o| o.cidrs.iter().copied())
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }
}

/// Notes `new`'s problem unless `old` had it already.
fn note_problem(problems: &mut Vec<(String, String)>, old: Option<&ServiceCidrInfo>, new: &ServiceCidrInfo) {
    if let Some(why) = &new.problem
        && old.and_then(|o| o.problem.as_ref()) != Some(why)
    {
        problems.push((new.name.clone(), why.clone()));
    }
}

/// The union of `flags` and `objects`, in that order, without duplicates
/// and without CIDRs inside another one of the set (they add no address and
/// would take a slot of the datapath's).
pub fn union(flags: &[IpCidr], objects: impl IntoIterator<Item = IpCidr>) -> Vec<IpCidr> {
    let mut all: Vec<IpCidr> = Vec::new();
    for c in flags.iter().copied().chain(objects) {
        if !all.contains(&c) {
            all.push(c);
        }
    }
    let covered = |c: &IpCidr| {
        all.iter()
            .any(|d| d != c && d.prefix_len() <= c.prefix_len() && d.contains(c.addr()))
    };
    all.iter().copied().filter(|c| !covered(c)).collect()
}

/// What the datapath enforces of a set of service CIDRs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limited {
    /// Of the served families, at most `max` per family, in the set's order.
    pub kept: Vec<IpCidr>,
    /// Of the served families, the ones beyond `max`: not enforced.
    pub over_limit: Vec<IpCidr>,
}

/// The CIDRs of `cidrs` the datapath enforces on a node serving `families`
/// (another family's are left out, as kube-proxy runs no proxier for it):
/// the first `max` of each family.
pub fn limit(cidrs: &[IpCidr], families: &[IpFamily], max: usize) -> Limited {
    let mut out = Limited::default();
    for c in cidrs.iter().filter(|c| families.contains(&c.family())) {
        let taken = out.kept.iter().filter(|k| k.family() == c.family()).count();
        if taken < max {
            out.kept.push(*c);
        } else {
            out.over_limit.push(*c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> IpCidr {
        s.parse().unwrap()
    }

    fn cs(v: &[&str]) -> Vec<IpCidr> {
        v.iter().map(|s| c(s)).collect()
    }

    fn info(name: &str, cidrs: &[&str]) -> ServiceCidrInfo {
        ServiceCidrInfo::of(
            name.into(),
            &cidrs.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
    }

    #[test]
    fn union_keeps_flags_first_then_objects_by_name_without_duplicates_or_covered_cidrs() {
        let mut o = ServiceCidrObjects::default();
        o.replace([
            info("zz-extra", &["10.100.0.0/24", "fd00:100::/112"]),
            info("kubernetes", &["10.96.0.0/16", "fd00:10:96::/112"]),
            info("inside", &["10.96.5.0/24"]),
        ]);
        let u = union(&cs(&["10.96.0.0/16"]), o.cidrs());
        assert_eq!(
            u,
            cs(&[
                "10.96.0.0/16",
                "fd00:10:96::/112",
                "10.100.0.0/24",
                "fd00:100::/112"
            ]),
            "the flag's first; objects by name (inside < kubernetes < zz-extra); \
             the duplicate and 10.96.5.0/24 (inside 10.96.0.0/16) left out"
        );
        // Without flags: the objects alone.
        assert_eq!(
            union(&[], o.cidrs()),
            cs(&[
                "10.96.0.0/16",
                "fd00:10:96::/112",
                "10.100.0.0/24",
                "fd00:100::/112"
            ])
        );
        // A narrower flag inside an object's CIDR gives way to it.
        assert_eq!(
            union(&cs(&["10.96.1.0/24"]), [c("10.96.0.0/16")]),
            cs(&["10.96.0.0/16"])
        );
    }

    #[test]
    fn limit_keeps_the_first_of_each_served_family() {
        let set = cs(&[
            "10.1.0.0/16",
            "fd00:1::/112",
            "10.2.0.0/16",
            "10.3.0.0/16",
            "10.4.0.0/16",
            "10.5.0.0/16",
            "10.6.0.0/16",
        ]);
        let l = limit(&set, &[IpFamily::V4, IpFamily::V6], 4);
        assert_eq!(
            l.kept,
            cs(&[
                "10.1.0.0/16",
                "fd00:1::/112",
                "10.2.0.0/16",
                "10.3.0.0/16",
                "10.4.0.0/16"
            ])
        );
        assert_eq!(l.over_limit, cs(&["10.5.0.0/16", "10.6.0.0/16"]));
        // An IPv4-only node: IPv6 CIDRs are neither kept nor over the limit.
        let l = limit(&set, &[IpFamily::V4], 4);
        assert!(l.kept.iter().all(|k| k.family() == IpFamily::V4));
        assert_eq!(l.kept.len(), 4);
        assert_eq!(l.over_limit.len(), 2);
        // The same input always gives the same answer, whatever came first
        // from the source: objects are ordered by name.
        let mut a = ServiceCidrObjects::default();
        let mut b = ServiceCidrObjects::default();
        let objs: Vec<_> = (1..=6)
            .map(|i| info(&format!("cidr-{i}"), &[&format!("10.{i}.0.0/16")]))
            .collect();
        a.replace(objs.clone());
        b.replace(objs.into_iter().rev());
        assert_eq!(
            limit(&union(&[], a.cidrs()), &[IpFamily::V4], 4),
            limit(&union(&[], b.cidrs()), &[IpFamily::V4], 4)
        );
    }

    #[test]
    fn objects_follow_additions_removals_and_skip_invalid_ones() {
        let mut o = ServiceCidrObjects::default();
        assert!(!o.take_changed());
        o.upsert(info("a", &["10.96.0.0/16"]));
        assert!(o.take_changed());
        o.upsert(info("a", &["10.96.0.0/16"]));
        assert!(!o.take_changed(), "the same object again changes nothing");
        o.upsert(info("b", &["10.97.0.0/16", "not-a-cidr"]));
        assert!(o.take_changed());
        assert_eq!(o.take_problems().len(), 1, "the invalid object is reported");
        assert_eq!(
            o.cidrs().collect::<Vec<_>>(),
            cs(&["10.96.0.0/16"]),
            "and skipped whole"
        );
        // A relist with the same invalid object: reported once only.
        o.replace([
            info("a", &["10.96.0.0/16"]),
            info("b", &["10.97.0.0/16", "not-a-cidr"]),
        ]);
        assert!(o.take_problems().is_empty());
        assert!(!o.take_changed());
        // Fixed: it counts.
        o.upsert(info("b", &["10.97.0.0/16"]));
        assert!(o.take_changed());
        assert_eq!(
            o.cidrs().collect::<Vec<_>>(),
            cs(&["10.96.0.0/16", "10.97.0.0/16"])
        );
        o.remove("a");
        assert!(o.take_changed());
        o.remove("a");
        assert!(!o.take_changed(), "removing what is not there changes nothing");
        assert_eq!(o.cidrs().collect::<Vec<_>>(), cs(&["10.97.0.0/16"]));
        o.replace([]);
        assert!(o.take_changed());
        assert!(o.is_empty());
    }

    #[test]
    fn parses_a_service_cidr_object() {
        let obj: ServiceCIDR = serde_json::from_value(serde_json::json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "ServiceCIDR",
            "metadata": {"name": "kubernetes", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"cidrs": ["10.96.0.0/16", "fd00:10:96::/112"]},
        }))
        .unwrap();
        let i = ServiceCidrInfo::parse(&obj);
        assert_eq!(i.name, "kubernetes");
        assert_eq!(
            i.cidrs,
            cs(&["10.96.0.0/16", "fd00:10:96::/112"]),
            "being deleted still counts"
        );
        assert_eq!(i.problem, None);
    }
}
