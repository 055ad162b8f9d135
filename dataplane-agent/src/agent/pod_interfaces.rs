//! Which host interfaces face pods, found without configuration, and the
//! datapath's pod hooks (`tc_pod_ingress`, `tc_egress`) on them.
//!
//! Discovery (`crate::os::pod_discovery`, which says how routed and bridge
//! CNIs are recognised) reads the node's links, addresses and routes
//! (rtnetlink, see [`crate::os::interfaces`]); this module follows their
//! notifications and attaches to what it finds.
//!
//! Once attached, an interface stays attached until it disappears: CNIs
//! tear routes down before deleting the veth, and detaching first would
//! only race the deletion.
//!
//! Every local endpoint (an EndpointSlice endpoint with this node's name) is
//! then looked up in the kernel's routing table (`ip route get`): one whose
//! route does not lead through an attached interface (or a bridge with an
//! attached port) would get untranslated replies, so it is reported loudly:
//! a log line, `dataplane_unreachable_local_endpoints`, and a field of
//! `/healthz`.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Mutex,
};

use serde::Serialize;
use tracing::{info, warn};

use super::{health::HealthState, metrics::Metrics};
use crate::{
    dataplane::{Attached, Datapath},
    os::{
        interfaces::{self, Address, ChangeWatch, Link, Route, RouteType},
        pod_discovery::{self, UnreachableEndpoint, Why},
    },
};

/// One attached pod interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodInterface {
    pub name: String,
    pub index: u32,
    #[serde(flatten)]
    pub why: Why,
}

/// An external device (north-south hooks) and why it is one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExternalDevice {
    pub name: String,
    /// `holds node IP 198.18.0.11` or `--devices`.
    pub why: String,
    /// `xdp_ingress` or `tc_ingress`, once attached.
    pub ingress: Option<&'static str>,
}

/// The external devices: `given` (`--devices`), or those holding the node
/// IPs in this network namespace.
pub fn external_devices(given: &[String], node_ips: &[IpAddr]) -> Result<Vec<ExternalDevice>, String> {
    if !given.is_empty() {
        return Ok(given
            .iter()
            .map(|d| ExternalDevice {
                name: d.clone(),
                why: "--devices".into(),
                ingress: None,
            })
            .collect());
    }
    let mut out: Vec<ExternalDevice> = Vec::new();
    for (dev, ip) in interfaces::ip_addresses() {
        if node_ips.contains(&ip) && !out.iter().any(|d| d.name == dev) {
            out.push(ExternalDevice {
                name: dev,
                why: format!("holds node IP {ip}"),
                ingress: None,
            });
        }
    }
    if out.is_empty() {
        return Err(format!(
            "no device holds the node IPs {node_ips:?} in this network namespace; pass --devices"
        ));
    }
    Ok(out)
}

/// What a reachability check looked at: routes, attached interfaces' indexes,
/// local endpoints.
type CheckedState = (Vec<Route>, BTreeSet<u32>, BTreeMap<IpAddr, String>);

/// The pod interfaces this agent has attached to, kept up to date.
pub struct PodInterfaces {
    /// `--pod-interfaces`: when not empty, only these patterns are used.
    patterns: Vec<String>,
    external: Vec<String>,
    /// External devices whose ingress path runs in TC, and in XDP.
    external_tc: Vec<String>,
    external_xdp: Vec<String>,
    /// The devices egress trusts the ingress word of, as last written, and
    /// their names (for `/healthz`).
    hint_devices: Option<BTreeSet<u32>>,
    trusted: Vec<String>,
    attached: BTreeMap<String, PodInterface>,
    local_endpoints: BTreeMap<IpAddr, String>,
    unreachable: Vec<UnreachableEndpoint>,
    /// What the reachability check last looked at (routes, attached set,
    /// endpoints): it reruns only when that changes.
    checked: Option<CheckedState>,
    watch: Option<ChangeWatch>,
    /// Local endpoints changed since the last poll.
    pending: bool,
}

impl PodInterfaces {
    /// `patterns` empty: discovery. Opens the netlink notification socket
    /// (without it, interfaces are found by the periodic rescan alone).
    pub fn new(patterns: Vec<String>, external: Vec<String>) -> Self {
        let watch = ChangeWatch::open()
            .map_err(|e| {
                warn!(error = %e, "no netlink notifications; pod interfaces are found by rescanning every second")
            })
            .ok();
        if patterns.is_empty() {
            info!("pod interfaces: discovered from routes and bridges (no --pod-interfaces given)");
        } else {
            info!(patterns = ?patterns, "pod interfaces: --pod-interfaces given, discovery is off");
        }
        Self {
            patterns,
            external,
            external_tc: Vec::new(),
            external_xdp: Vec::new(),
            hint_devices: None,
            trusted: Vec::new(),
            attached: BTreeMap::new(),
            local_endpoints: BTreeMap::new(),
            unreachable: Vec::new(),
            checked: None,
            watch,
            pending: true,
        }
    }

    /// The external devices attached, and which ingress program each runs
    /// (for the devices whose ingress word egress trusts).
    pub fn set_external_hooks(&mut self, external: &[ExternalDevice]) {
        let named = |hook: &str| {
            external
                .iter()
                .filter(|d| d.ingress == Some(hook))
                .map(|d| d.name.clone())
                .collect()
        };
        self.external_tc = named(dataplane_common::names::TC_INGRESS);
        self.external_xdp = named(dataplane_common::names::XDP_INGRESS);
        self.pending = true;
    }

    /// The notification socket, for a caller that waits on it (the agent's
    /// control loop) and then polls with `rescan`.
    pub fn take_watch(&mut self) -> Option<ChangeWatch> {
        self.watch.take()
    }

    /// The local endpoints to check (after a sync: address → a Service port
    /// it backs); the next poll rechecks them when they changed.
    pub fn set_local_endpoints(&mut self, endpoints: BTreeMap<IpAddr, String>) {
        if endpoints != self.local_endpoints {
            self.local_endpoints = endpoints;
            self.pending = true;
        }
    }

    /// Rescans when netlink said something changed, or always when
    /// `rescan`; attaches to new pod interfaces and rechecks local
    /// endpoints. True when the report changed.
    pub fn poll(&mut self, dp: &mut Datapath, rescan: bool) -> bool {
        let notified = self.watch.as_ref().is_some_and(|w| w.changed());
        if !(notified || rescan || self.pending) {
            return false;
        }
        self.pending = false;
        let (links, addresses, routes) =
            match (interfaces::links(), interfaces::addresses(), interfaces::routes()) {
                (Ok(l), Ok(a), Ok(r)) => (l, a, r),
                (l, a, r) => {
                    let e = [l.err(), a.err(), r.err()].into_iter().flatten().next();
                    warn!(error = ?e, "cannot read links, addresses and routes; will retry");
                    return false;
                }
            };
        let before = (self.attached.clone(), self.unreachable.clone());
        self.attach(dp, &links, &addresses, &routes);
        self.trust_words(dp, &links);
        self.check_endpoints(&links, routes);
        before != (self.attached.clone(), self.unreachable.clone())
    }

    fn attach(&mut self, dp: &mut Datapath, links: &[Link], addresses: &[Address], routes: &[Route]) {
        let wanted = if self.patterns.is_empty() {
            pod_discovery::discover(links, addresses, routes, &self.external)
        } else {
            pod_discovery::by_pattern(links, &self.patterns, &self.external)
        };
        let present: BTreeMap<&str, u32> = links.iter().map(|l| (l.name.as_str(), l.index)).collect();
        let gone: Vec<String> = self
            .attached
            .iter()
            .filter(|(name, a)| present.get(name.as_str()) != Some(&a.index))
            .map(|(name, _)| name.clone())
            .collect();
        if !gone.is_empty()
            && let Some(pins) = dp.pins()
        {
            // Pins of links whose device went with its pod.
            pins.remove_stale_links();
        }
        for name in gone {
            info!(interface = %name, "pod interface gone");
            self.attached.remove(&name);
        }
        for (name, why) in wanted {
            if self.attached.contains_key(&name) {
                continue;
            }
            let Some(&index) = present.get(name.as_str()) else {
                continue;
            };
            match dp.attach_pod_interface(&name) {
                Ok(how) => {
                    info!(interface = %name, why = %why, replaced = how == Attached::Replaced, "attached to pod interface");
                    self.attached
                        .insert(name.clone(), PodInterface { name, index, why });
                }
                Err(e) => {
                    warn!(interface = %name, why = %why, error = %e, "cannot attach to pod interface; will retry")
                }
            }
        }
    }

    /// Tells egress whose ingress word to trust: the attached pod
    /// interfaces and TC external devices on no stack with another hook
    /// (this run's, or one an earlier run left pinned).
    fn trust_words(&mut self, dp: &mut Datapath, links: &[Link]) {
        // By name, or an altname given in --devices; a device that is gone
        // carries no packets.
        let index = |name: &String| {
            links
                .iter()
                .find(|l| &l.name == name)
                .map(|l| l.index)
                .or_else(|| interfaces::index_of(name))
        };
        let tc: BTreeSet<u32> = self
            .external_tc
            .iter()
            .filter_map(index)
            .chain(self.attached.values().map(|a| a.index))
            .collect();
        let pinned = dp.pins().map(|p| p.ingress_link_devices()).unwrap_or_default();
        let hooked: BTreeSet<u32> = self
            .external_xdp
            .iter()
            .chain(&pinned)
            .filter_map(index)
            .collect();
        let set = pod_discovery::hint_devices(links, &tc, &hooked);
        if self.hint_devices.as_ref() == Some(&set) {
            return;
        }
        let name = |i: &u32| {
            links
                .iter()
                .find(|l| l.index == *i)
                .map_or(i.to_string(), |l| l.name.clone())
        };
        match dp.maps_mut().set_hint_devices(&set) {
            Ok(_) => {
                let (beyond, stacked): (Vec<u32>, Vec<u32>) = tc
                    .iter()
                    .filter(|i| !set.contains(i))
                    .partition(|i| dataplane_common::hint::device_slot(**i).is_none());
                if !stacked.is_empty() {
                    info!(devices = ?stacked.iter().map(name).collect::<Vec<_>>(), "egress looks up every packet from these devices that may be ours: each shares a stack with another ingress hook, whose translation its own could not see");
                }
                if !beyond.is_empty() {
                    info!(devices = ?beyond.iter().map(name).collect::<Vec<_>>(), "egress looks up every packet from these devices that may be ours: their index is beyond the trusted-device bitmap");
                }
                self.trusted = set.iter().map(name).collect();
                self.hint_devices = Some(set);
            }
            Err(e) => {
                warn!(error = %e, "cannot write the devices whose ingress word egress trusts; will retry")
            }
        }
    }

    fn check_endpoints(&mut self, links: &[Link], routes: Vec<Route>) {
        let attached: BTreeSet<u32> = self.attached.values().map(|a| a.index).collect();
        let key = (routes, attached, self.local_endpoints.clone());
        if self.checked.as_ref() == Some(&key) {
            return;
        }
        let (_, attached, endpoints) = &key;
        let mut unreachable = Vec::new();
        for (addr, service) in endpoints {
            let route = match interfaces::route_to(*addr) {
                Ok(r) => r,
                Err(e) => {
                    warn!(endpoint = %addr, error = %e, "cannot look up the route to a local endpoint");
                    continue;
                }
            };
            // Host-network endpoints live on the node itself.
            if route.as_ref().is_some_and(|r| r.kind == RouteType::Local) {
                continue;
            }
            if pod_discovery::reaches_attached(route.as_ref(), links, attached) {
                continue;
            }
            let via = route
                .as_ref()
                .and_then(|r| r.oif)
                .and_then(|i| links.iter().find(|l| l.index == i))
                .map_or_else(|| "no route".to_owned(), |l| format!("route via {}", l.name));
            unreachable.push(UnreachableEndpoint {
                address: *addr,
                service: service.clone(),
                route: via,
            });
        }
        for u in &unreachable {
            if !self.unreachable.iter().any(|o| o.address == u.address) {
                warn!(
                    endpoint = %u.address,
                    service = %u.service,
                    route = %u.route,
                    "local endpoint is not reachable through any pod interface the datapath is attached to: \
                     its Services' traffic from this node is not translated (is the CNI's host interface \
                     missing, or --pod-interfaces too narrow?)"
                );
            }
        }
        for o in &self.unreachable {
            if !unreachable.iter().any(|u| u.address == o.address) {
                info!(endpoint = %o.address, "local endpoint reachable through a pod interface again, or gone");
            }
        }
        self.unreachable = unreachable;
        self.checked = Some(key);
    }

    pub fn attached(&self) -> impl Iterator<Item = &PodInterface> {
        self.attached.values()
    }

    pub fn unreachable(&self) -> &[UnreachableEndpoint] {
        &self.unreachable
    }

    /// Hands the current state to `/healthz`, `/debug/interfaces` and the
    /// metrics.
    pub fn publish(
        &self,
        external: &[ExternalDevice],
        health: &Mutex<HealthState>,
        metrics: &Mutex<Metrics>,
    ) {
        {
            let mut h = health.lock().expect("health");
            h.unreachable_local_endpoints = self.unreachable.clone();
            h.interfaces = serde_json::json!({
                "discovery": if self.patterns.is_empty() { "routes and bridges".to_owned() } else {
                    format!("--pod-interfaces {}", self.patterns.join(","))
                },
                "external": external,
                "pods": self.attached.values().collect::<Vec<_>>(),
                // Where egress skips its lookups on the ingress hook's word.
                "egressTrustsIngressWord": self.trusted,
            });
        }
        let mut m = metrics.lock().expect("metrics");
        m.pod_interfaces = self.attached.len() as u64;
        m.unreachable_local_endpoints = self.unreachable.len() as u64;
    }
}
