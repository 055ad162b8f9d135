//! The node preflight behind `dataplane-agent check` (the DaemonSet's init
//! container): can this node run the datapath, and what is in its way.
//!
//! Each check yields one-line [`Finding`]s; only a [`Severity::Blocker`]
//! fails the check. What is probed, all read-only except the verifier load:
//! - kernel release (TCX needs 6.6) and BTF (`/sys/kernel/btf/vmlinux`);
//! - the datapath object: loaded and verified, nothing attached;
//! - bpffs at the pin directory, cgroup v2 for connect-time translation;
//! - per external device: driver and bus (ethtool `GDRVINFO`), the kernel's
//!   XDP feature flags (the `netdev` generic netlink family, Linux 6.3+),
//!   XDP programs already attached (`IFLA_XDP`), TCX programs
//!   (`BPF_PROG_QUERY`) and old-style tc BPF filters (a filter dump). No
//!   program is attached to find out whether native XDP works;
//! - connect-time (cgroup sock_addr) programs effective on the cgroup;
//! - the pod interfaces `run` would find now (routes and bridges);
//! - the addresses NodePorts would be served on, and whether pod-facing
//!   interfaces hold any of them (pods' gateways, CNI bridges);
//! - kube-proxy's leftovers ([`kube_proxy`]).

pub mod kube_proxy;
pub mod netlink;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::Serialize;

use crate::{
    dataplane::{self, Datapath, DeviceKind, XdpMode, pins},
    net::NodePortAddresses,
    os::{
        device,
        interfaces::{self, Address, Link},
        pod_discovery::{self, Why},
    },
};

#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error("netlink socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("the kernel refused the netlink request: {0}")]
    Kernel(std::io::Error),
    #[error("netlink: {0}")]
    Netlink(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Ok,
    Info,
    Warn,
    /// The agent cannot work on this node as configured.
    Blocker,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Info => "info",
            Self::Warn => "warn",
            Self::Blocker => "BLOCKER",
        }
    }
}

/// One line of the preflight's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub severity: Severity,
    /// What it is about: `kernel`, `bpffs`, `eth0`, `kube-proxy`...
    pub subject: String,
    pub message: String,
    /// What to run or change, when there is something to do.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    pub fn new(severity: Severity, subject: &str, message: String, fix: Option<String>) -> Self {
        Self {
            severity,
            subject: subject.to_owned(),
            message,
            fix,
        }
    }
}

/// What to check.
#[derive(Clone, Debug)]
pub struct Options {
    /// The agent's pin directory.
    pub bpffs_dir: PathBuf,
    /// The cgroup the agent attaches connect-time translation to (`None`:
    /// the cgroup2 mount; empty: none, connect-time translation is off).
    pub cgroup_path: Option<PathBuf>,
    /// External devices; empty: those holding `node_ips`, else those of
    /// the default routes.
    pub devices: Vec<String>,
    pub node_ips: Vec<std::net::IpAddr>,
    pub xdp_mode: XdpMode,
    /// `--pod-interfaces` patterns (empty: discovery, as `run` does).
    pub pod_interfaces: Vec<String>,
    /// `--node-port-addresses`.
    pub node_port_addresses: NodePortAddresses,
}

/// Every check, in order.
pub fn run(opts: &Options) -> Vec<Finding> {
    let mut out = kernel();
    out.push(load());
    out.push(bpffs(&opts.bpffs_dir));
    out.extend(cgroup(opts.cgroup_path.clone()));
    out.extend(devices(opts));
    out.push(pod_interfaces(opts));
    out.push(node_ports(opts));
    out.extend(kube_proxy::check());
    out
}

/// The kernel release as (major, minor).
fn release() -> Option<(String, u32, u32)> {
    // SAFETY: uname fills the struct we own.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return None;
    }
    // SAFETY: uname NUL-terminates its fields.
    let text = unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut parts = text.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((text, major, minor))
}

fn kernel() -> Vec<Finding> {
    let mut out = Vec::new();
    match release() {
        Some((text, major, minor)) if (major, minor) >= (6, 6) => out.push(Finding::new(
            Severity::Ok,
            "kernel",
            format!("Linux {text} (TCX and bpf_link attachments need 6.6)"),
            None,
        )),
        Some((text, ..)) => out.push(Finding::new(
            Severity::Blocker,
            "kernel",
            format!("Linux {text} is older than 6.6: TC programs are attached through TCX links"),
            Some("upgrade the node's kernel to 6.6 or newer".into()),
        )),
        None => out.push(Finding::new(
            Severity::Warn,
            "kernel",
            "cannot read the kernel release".into(),
            None,
        )),
    }
    if Path::new("/sys/kernel/btf/vmlinux").exists() {
        out.push(Finding::new(
            Severity::Ok,
            "btf",
            "/sys/kernel/btf/vmlinux present".into(),
            None,
        ));
    } else {
        out.push(Finding::new(
            Severity::Blocker,
            "btf",
            "the kernel has no BTF (/sys/kernel/btf/vmlinux missing)".into(),
            Some(
                "a kernel built with CONFIG_DEBUG_INFO_BTF=y (every major distribution's 6.x kernels)".into(),
            ),
        ));
    }
    out
}

fn load() -> Finding {
    match Datapath::load() {
        Ok(_) => Finding::new(
            Severity::Ok,
            "datapath",
            "eBPF object loaded and verified (nothing attached)".into(),
            None,
        ),
        Err(e) => Finding::new(
            Severity::Blocker,
            "datapath",
            format!("the eBPF object does not load: {e}"),
            Some("run with CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON and CAP_SYS_ADMIN (the DaemonSet's capabilities)".into()),
        ),
    }
}

fn bpffs(dir: &Path) -> Finding {
    let existing = dir.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
    if pins::on_bpffs(existing) {
        return Finding::new(
            Severity::Ok,
            "bpffs",
            format!("{} is on bpffs: pins outlive the agent", dir.display()),
            None,
        );
    }
    if dir.starts_with(pins::BPFFS_ROOT) {
        return Finding::new(
            Severity::Warn,
            "bpffs",
            format!(
                "bpffs is not mounted at {}: the agent mounts it (CAP_SYS_ADMIN), but inside a pod the mount \
                 goes with the pod, and upgrades lose the pinned state",
                pins::BPFFS_ROOT
            ),
            Some(format!("on the node: mount -t bpf bpf {}", pins::BPFFS_ROOT)),
        );
    }
    Finding::new(
        Severity::Blocker,
        "bpffs",
        format!(
            "{} is not on a bpffs mount: the agent cannot pin there",
            dir.display()
        ),
        Some(format!(
            "use a --bpffs-dir under {} or mount -t bpf bpf DIR",
            pins::BPFFS_ROOT
        )),
    )
}

/// Attach types of connect-time programs (`enum bpf_attach_type`).
const SOCK_ATTACH_TYPES: [(u32, &str); 8] = [
    (10, "connect4"),
    (11, "connect6"),
    (14, "sendmsg4"),
    (15, "sendmsg6"),
    (19, "recvmsg4"),
    (20, "recvmsg6"),
    (29, "getpeername4"),
    (30, "getpeername6"),
];

/// Ids of the programs effective on `cgroup` for `attach_type`
/// (`BPF_PROG_QUERY` with `BPF_F_QUERY_EFFECTIVE`).
fn cgroup_programs(cgroup: &std::fs::File, attach_type: u32) -> std::io::Result<Vec<u32>> {
    use std::os::fd::AsRawFd as _;
    #[repr(C)]
    #[derive(Default)]
    struct Query {
        target_fd: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        prog_cnt: u32,
        _pad: u32,
        prog_attach_flags: u64,
        link_ids: u64,
        link_attach_flags: u64,
        revision: u64,
    }
    const BPF_PROG_QUERY: libc::c_long = 16;
    const BPF_F_QUERY_EFFECTIVE: u32 = 1;
    let mut ids = [0u32; 64];
    let mut q = Query {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_type,
        query_flags: BPF_F_QUERY_EFFECTIVE,
        prog_ids: ids.as_mut_ptr() as u64,
        prog_cnt: ids.len() as u32,
        ..Default::default()
    };
    // SAFETY: bpf(2) with a query attr we own and an id buffer that
    // outlives the call; the kernel writes at most prog_cnt ids.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_QUERY,
            &mut q as *mut Query,
            std::mem::size_of::<Query>() as u32,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ids[..(q.prog_cnt as usize).min(ids.len())].to_vec())
}

/// id → name of every loaded BPF program.
fn program_names() -> std::collections::BTreeMap<u32, String> {
    aya::programs::loaded_programs()
        .flatten()
        .map(|p| (p.id(), p.name_as_str().unwrap_or("?").to_owned()))
        .collect()
}

/// Programs the agent attaches (the floor programs are benchmarks' and
/// tests', never attached by the agent).
fn ours(name: &str) -> bool {
    use dataplane_common::names;
    [
        names::XDP_INGRESS,
        names::TC_INGRESS,
        names::TC_EGRESS,
        names::TC_POD_INGRESS,
    ]
    .contains(&name)
        || crate::dataplane::SOCK_PROGRAMS.contains(&name)
}

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

fn is_cgroup2(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs fills the struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0) && st.f_type as i64 == CGROUP2_SUPER_MAGIC
}

fn cgroup(path: Option<PathBuf>) -> Vec<Finding> {
    if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
        return vec![Finding::new(
            Severity::Info,
            "cgroup",
            "connect-time translation is off (cgroupPath none): host processes reach Services per packet only".into(),
            None,
        )];
    }
    if let Some(p) = &path
        && !is_cgroup2(p)
    {
        return vec![Finding::new(
            Severity::Blocker,
            "cgroup",
            format!(
                "{} is not a cgroup v2 directory: the agent cannot attach connect-time translation there",
                p.display()
            ),
            Some(format!(
                "set cgroupPath to the cgroup2 mount ({}), or none",
                crate::os::cgroup_mount::system_cgroup2_mount()
                    .map_or_else(|e| e.to_string(), |m| m.path.display().to_string())
            )),
        )];
    }
    let (path, how) = match path {
        Some(p) => (p, "given".to_owned()),
        None => match crate::os::cgroup_mount::system_cgroup2_mount() {
            Ok(m) => {
                let passed = if m.passed_over.is_empty() {
                    String::new()
                } else {
                    let list: Vec<String> = m.passed_over.iter().map(|p| p.display().to_string()).collect();
                    format!("; passed over: {}", list.join(", "))
                };
                (m.path, format!("chosen: {}{passed}", m.reason))
            }
            Err(e) => {
                return vec![Finding::new(
                    Severity::Warn,
                    "cgroup",
                    format!("{e}: host processes get no connect-time translation (the agent runs without it)"),
                    Some(
                        "mount cgroup2 at /sys/fs/cgroup (mount -t cgroup2 none /sys/fs/cgroup), or pass --cgroup-path"
                            .into(),
                    ),
                )];
            }
        },
    };
    let mut out = vec![Finding::new(
        Severity::Ok,
        "cgroup",
        format!(
            "cgroup v2 at {} ({how}): connect-time translation attaches there",
            path.display()
        ),
        None,
    )];
    let Ok(dir) = std::fs::File::open(&path) else {
        out[0] = Finding::new(
            Severity::Warn,
            "cgroup",
            format!("cannot open cgroup {}", path.display()),
            None,
        );
        return out;
    };
    let names = program_names();
    for (attach_type, hook) in SOCK_ATTACH_TYPES {
        let ids = match cgroup_programs(&dir, attach_type) {
            Ok(ids) => ids,
            Err(e) => {
                out.push(Finding::new(
                    Severity::Warn,
                    "cgroup",
                    format!("cannot query {hook} programs on {}: {e}", path.display()),
                    None,
                ));
                break;
            }
        };
        for id in ids {
            let name = names.get(&id).map_or("?", String::as_str);
            if !ours(name) {
                out.push(Finding::new(
                    Severity::Warn,
                    "cgroup",
                    format!(
                        "another {hook} program ({name}, id {id}) is effective on {}: a second connect-time \
                         translator (another kube-proxy replacement?) rewrites the same sockets",
                        path.display()
                    ),
                    Some("remove the other Service proxy before installing this one".into()),
                ));
            }
        }
    }
    out
}

/// The pod interfaces the agent would find now (none on a node without
/// pods yet), as `run` discovers them; with `--pod-interfaces`, the
/// discovered ones the patterns miss (`run` would attach nothing to them, so
/// their pods' Services break) are a warning naming each.
fn pod_interfaces(opts: &Options) -> Finding {
    use crate::os::pod_discovery::{Why, by_pattern, discover};
    let (Ok(links), Ok(addresses), Ok(routes)) =
        (interfaces::links(), interfaces::addresses(), interfaces::routes())
    else {
        return Finding::new(
            Severity::Warn,
            "pods",
            "cannot read links, addresses and routes".into(),
            None,
        );
    };
    let external = external_devices(opts, &links);
    let found = discover(&links, &addresses, &routes, &external);
    if !opts.pod_interfaces.is_empty() {
        let matched = by_pattern(&links, &opts.pod_interfaces, &external);
        let patterns = opts.pod_interfaces.join(",");
        let missed: Vec<String> = found
            .iter()
            .filter(|(name, _)| !matched.contains_key(*name))
            .map(|(name, why)| format!("{name} ({why})"))
            .collect();
        if !missed.is_empty() {
            return Finding::new(
                Severity::Warn,
                "pods",
                format!(
                    "--pod-interfaces {patterns} misses pod interfaces: {}; the agent would attach nothing to them, so \
                     their pods' Service traffic (and replies to masqueraded flows) would not be translated",
                    missed.join(", ")
                ),
                Some(
                    "drop --pod-interfaces (podInterfaces) to find pod interfaces from routes and bridges, or add \
                     patterns for these"
                        .into(),
                ),
            );
        }
        return Finding::new(
            Severity::Info,
            "pods",
            format!(
                "pod interfaces: {} match --pod-interfaces {patterns} (every one routes and bridges show is among them)",
                matched.len()
            ),
            None,
        );
    }
    let routed = found.values().filter(|w| matches!(w, Why::Route { .. })).count();
    let bridges: std::collections::BTreeSet<&str> = found
        .values()
        .filter_map(|w| match w {
            Why::BridgePort { bridge, .. } => Some(bridge.as_str()),
            _ => None,
        })
        .collect();
    Finding::new(
        Severity::Info,
        "pods",
        format!(
            "pod interfaces: {} found without configuration ({routed} with a route to their pod, {} bridge ports{})",
            found.len(),
            found.len() - routed,
            if bridges.is_empty() {
                String::new()
            } else {
                format!(" of {}", bridges.into_iter().collect::<Vec<_>>().join(", "))
            }
        ),
        None,
    )
}

/// The NodePort addresses held by pod-facing interfaces, with the
/// interfaces holding each (pure: no IO): the pod interfaces themselves (a
/// routed CNI's gateway address on every host veth) and bridges with a pod
/// interface among their ports (a bridge CNI's gateway, `cni0`'s
/// 10.244.1.1). `pods` are the pod interfaces by name.
pub fn pod_facing_node_port_addresses(
    selected: &BTreeSet<IpAddr>,
    links: &[Link],
    addresses: &[Address],
    pods: &BTreeMap<String, Why>,
) -> BTreeMap<IpAddr, BTreeSet<String>> {
    let pod_facing = |link: &Link| {
        pods.contains_key(&link.name)
            || (link.kind.as_deref() == Some("bridge")
                && links
                    .iter()
                    .any(|port| port.master == Some(link.index) && pods.contains_key(&port.name)))
    };
    let mut out: BTreeMap<IpAddr, BTreeSet<String>> = BTreeMap::new();
    for a in addresses.iter().filter(|a| selected.contains(&a.addr)) {
        if let Some(link) = links.iter().find(|l| l.index == a.link)
            && pod_facing(link)
        {
            out.entry(a.addr).or_default().insert(link.name.clone());
        }
    }
    out
}

/// The addresses `run` would serve NodePorts on, warning when pod-facing
/// interfaces hold some: with `all` (kube-proxy's iptables-mode default),
/// pods' gateways and CNI bridges serve every NodePort too.
fn node_ports(opts: &Options) -> Finding {
    let choice = &opts.node_port_addresses;
    if *choice == NodePortAddresses::Primary && opts.node_ips.is_empty() {
        return Finding::new(
            Severity::Info,
            "node-ports",
            "nodePortAddresses primary: NodePorts on the node IPs (not given: pass --node-ip to see them)"
                .into(),
            None,
        );
    }
    let (Ok(links), Ok(addresses), Ok(routes)) =
        (interfaces::links(), interfaces::addresses(), interfaces::routes())
    else {
        return Finding::new(
            Severity::Warn,
            "node-ports",
            "cannot read links, addresses and routes".into(),
            None,
        );
    };
    let external = external_devices(opts, &links);
    let mut pods = pod_discovery::discover(&links, &addresses, &routes, &external);
    if !opts.pod_interfaces.is_empty() {
        pods.extend(pod_discovery::by_pattern(&links, &opts.pod_interfaces, &external));
    }
    let local: Vec<IpAddr> = interfaces::ip_addresses().into_iter().map(|(_, a)| a).collect();
    let selected = choice.select(&opts.node_ips, &local);
    let list = |set: &BTreeSet<IpAddr>| set.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
    if selected.is_empty() {
        return Finding::new(
            Severity::Warn,
            "node-ports",
            format!(
                "nodePortAddresses {choice} selects none of this node's addresses: no NodePort would be served"
            ),
            Some("nodePortAddresses: primary (the node IPs), or CIDRs holding the node's addresses".into()),
        );
    }
    let exposed = pod_facing_node_port_addresses(&selected, &links, &addresses, &pods);
    if exposed.is_empty() {
        return Finding::new(
            Severity::Ok,
            "node-ports",
            format!(
                "nodePortAddresses {choice}: NodePorts on {} (no pod-facing interface holds them)",
                list(&selected)
            ),
            None,
        );
    }
    let named: Vec<String> = exposed
        .iter()
        .map(|(addr, on)| {
            let mut on: Vec<&str> = on.iter().map(String::as_str).collect();
            let more = on.len().saturating_sub(3);
            on.truncate(3);
            let more = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            format!("{addr} (on {}{more})", on.join(", "))
        })
        .collect();
    Finding::new(
        Severity::Warn,
        "node-ports",
        format!(
            "nodePortAddresses {choice} serves NodePorts on addresses of pod-facing interfaces: {}; every NodePort \
             answers there too (pods' gateways, CNI bridges), which kube-proxy's nftables mode does not do",
            named.join(", ")
        ),
        Some(
            "nodePortAddresses: primary (the default: the node IPs only), or CIDRs that leave these out"
                .into(),
        ),
    )
}

/// `NETDEV_XDP_ACT_*` bits, named.
const XDP_FEATURES: [(u64, &str); 7] = [
    (1, "basic"),
    (2, "redirect"),
    (4, "ndo-xmit"),
    (8, "xsk-zerocopy"),
    (16, "hw-offload"),
    (32, "rx-sg"),
    (64, "ndo-xmit-sg"),
];

fn external_devices(opts: &Options, links: &[interfaces::Link]) -> Vec<String> {
    if !opts.devices.is_empty() {
        return opts.devices.clone();
    }
    let mut out: Vec<String> = Vec::new();
    for (dev, ip) in interfaces::ip_addresses() {
        if opts.node_ips.contains(&ip) && !out.contains(&dev) {
            out.push(dev);
        }
    }
    if out.is_empty() {
        for r in interfaces::routes().unwrap_or_default() {
            if r.prefix_len == 0
                && r.gateway.is_some()
                && let Some(l) = links.iter().find(|l| Some(l.index) == r.oif)
                && !out.contains(&l.name)
            {
                out.push(l.name.clone());
            }
        }
    }
    out
}

fn devices(opts: &Options) -> Vec<Finding> {
    let links = match interfaces::links() {
        Ok(l) => l,
        Err(e) => {
            return vec![Finding::new(
                Severity::Warn,
                "devices",
                format!("cannot list devices: {e}"),
                None,
            )];
        }
    };
    let devices = external_devices(opts, &links);
    let mut out = Vec::new();
    // Each node IP is the SNAT address of its family: one no device holds
    // would masquerade flows to an address whose replies never come back.
    let local: Vec<std::net::IpAddr> = interfaces::ip_addresses().into_iter().map(|(_, ip)| ip).collect();
    for ip in &opts.node_ips {
        if !local.contains(ip) {
            out.push(Finding::new(
                Severity::Warn,
                "node-ip",
                format!(
                    "{ip} is held by no device of this network namespace: it would be the SNAT address of \
                     masqueraded flows, whose replies then never come back"
                ),
                Some("pass the node's own address (--node-ip, from the downward API's status.hostIP)".into()),
            ));
        }
    }
    if devices.is_empty() {
        out.push(Finding::new(
            Severity::Blocker,
            "devices",
            "no external device: none holds the node IPs and there is no default route".into(),
            Some("pass --devices (and to `run`)".into()),
        ));
        return out;
    }
    let features = netlink::xdp_features().unwrap_or(None);
    let names = program_names();
    for dev in devices {
        let Some(link) = links.iter().find(|l| l.name == dev) else {
            out.push(Finding::new(
                Severity::Blocker,
                &dev,
                "no such device in this network namespace".into(),
                Some("check --devices (the init container needs hostNetwork like the agent)".into()),
            ));
            continue;
        };
        let kind = dataplane::device_kind(&dev);
        let driver = device::driver_info(&dev)
            .map(|d| {
                if d.bus.is_empty() || d.bus == "N/A" {
                    format!("driver {}", d.driver)
                } else {
                    format!("driver {} at {}", d.driver, d.bus)
                }
            })
            .unwrap_or_else(|| "no driver info".into());
        let flags = features
            .as_ref()
            .and_then(|f| f.iter().find(|(i, _)| *i == link.index).map(|(_, f)| *f));
        let native = flags.map(|f| f & 1 != 0);
        let named = flags
            .map(|f| {
                XDP_FEATURES
                    .iter()
                    .filter(|(b, _)| f & b != 0)
                    .map(|(_, n)| *n)
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let want_xdp = match opts.xdp_mode {
            XdpMode::Native => true,
            XdpMode::Off => false,
            XdpMode::Auto => kind == DeviceKind::Physical,
        };
        let support = match native {
            Some(true) => format!("native XDP supported ({named})"),
            Some(false) => "no native XDP in its driver".to_owned(),
            None => "XDP features unknown (the netdev netlink family needs Linux 6.3)".to_owned(),
        };
        let path = match (want_xdp, native) {
            (true, Some(false)) if opts.xdp_mode == XdpMode::Native => {
                out.push(Finding::new(
                    Severity::Blocker,
                    &dev,
                    format!("{driver}: {support}, and --xdp-mode native needs it"),
                    Some("use --xdp-mode auto (TC on this device)".into()),
                ));
                continue;
            }
            (true, Some(false)) => "the ingress path falls back to TC",
            (true, _) => "the ingress path runs in native XDP",
            (false, _) if kind == DeviceKind::Veth => {
                "a veth: the ingress path runs in TC (XDP_TX on veth needs XDP on the peer)"
            }
            (false, _) => "the ingress path runs in TC",
        };
        out.push(Finding::new(
            Severity::Ok,
            &dev,
            format!("{driver}: {support}; {path}"),
            None,
        ));
        if let Some(xdp) = link.xdp {
            let name = names.get(&xdp.id).map_or("?", String::as_str);
            if !ours(name) {
                out.push(Finding::new(
                    if want_xdp {
                        Severity::Blocker
                    } else {
                        Severity::Warn
                    },
                    &dev,
                    format!(
                        "another XDP program ({name}, id {}, {}) is attached: it sees every packet first{}",
                        xdp.id,
                        xdp.mode.as_str(),
                        if want_xdp {
                            ", and native XDP cannot attach beside it"
                        } else {
                            "; what it drops or redirects never reaches Services"
                        }
                    ),
                    Some(format!(
                        "detach it (ip link set dev {dev} xdp off) if it is a leftover"
                    )),
                ));
            }
        }
        for direction in [
            aya::programs::TcAttachType::Ingress,
            aya::programs::TcAttachType::Egress,
        ] {
            if let Ok((_, progs)) = aya::programs::SchedClassifier::query_tcx(&dev, direction) {
                // Two of our programs on one hook: a second datapath (an
                // agent run on another pin directory, or its leftover) runs
                // beside the live one, translating packets twice.
                let mine: Vec<String> = progs
                    .iter()
                    .filter(|p| p.name_as_str().is_some_and(ours))
                    .map(|p| format!("{} (id {})", p.name_as_str().unwrap_or("?"), p.id()))
                    .collect();
                if mine.len() > 1 {
                    out.push(Finding::new(
                        Severity::Warn,
                        &dev,
                        format!(
                            "{} copies of the datapath on {direction:?}: {}; an agent on another pin directory \
                             or its leftover translates the same packets",
                            mine.len(),
                            mine.join(", ")
                        ),
                        Some(
                            "remove the stale copy: `dataplane-agent cleanup --bpffs-dir DIR` with the directory it \
                             was run with (see `ls /sys/fs/bpf`)"
                                .into(),
                        ),
                    ));
                }
                for p in progs {
                    let name = p.name_as_str().unwrap_or("?");
                    if !ours(name) {
                        out.push(Finding::new(
                            Severity::Warn,
                            &dev,
                            format!(
                                "another TCX program ({name}, id {}) on {direction:?}: it runs beside the datapath's",
                                p.id()
                            ),
                            None,
                        ));
                    }
                }
            }
        }
        for f in interfaces::tc_bpf_filters(link.index).unwrap_or_default() {
            out.push(Finding::new(
                Severity::Warn,
                &dev,
                format!(
                    "a tc BPF filter ({}, id {}) on {:?}: it runs after the datapath's TCX programs",
                    f.name,
                    f.prog_id.map_or("?".into(), |i| i.to_string()),
                    f.direction
                ),
                Some(format!(
                    "tc filter show dev {dev} {}",
                    format!("{:?}", f.direction).to_lowercase()
                )),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::pod_discovery::{discover, tests::link};

    fn addr(link: u32, a: &str, prefix_len: u8) -> Address {
        Address {
            link,
            addr: a.parse().unwrap(),
            prefix_len,
        }
    }

    fn route(destination: &str, prefix_len: u8, oif: u32) -> interfaces::Route {
        interfaces::Route {
            destination: destination.parse().unwrap(),
            prefix_len,
            oif: Some(oif),
            gateway: None,
            table: 254,
            kind: interfaces::RouteType::Unicast,
        }
    }

    /// A node with both CNI layouts: `eth0` (the LAN, 198.18.0.11), routed
    /// pods on `veth1`/`veth2` (each holding the pods' gateway 10.244.1.1,
    /// as this project's test sandbox wires them), a `cni0` bridge holding
    /// 10.88.0.1 with a pod's veth as its port, and a `docker0`-like bridge
    /// without ports (not pod-facing: no pod interface among its ports).
    fn node() -> (Vec<Link>, Vec<Address>, BTreeMap<String, Why>) {
        let links = vec![
            link(1, "lo", None, None),
            link(2, "eth0", None, None),
            link(3, "veth1", Some("veth"), None),
            link(4, "veth2", Some("veth"), None),
            link(5, "cni0", Some("bridge"), None),
            link(6, "vethb", Some("veth"), Some(5)),
            link(7, "docker0", Some("bridge"), None),
        ];
        let addresses = vec![
            addr(1, "127.0.0.1", 8),
            addr(2, "198.18.0.11", 24),
            addr(3, "10.244.1.1", 32),
            addr(4, "10.244.1.1", 32),
            addr(5, "10.88.0.1", 16),
            addr(7, "172.17.0.1", 16),
        ];
        let routes = vec![
            route("198.18.0.0", 24, 2),
            route("10.244.1.10", 32, 3),
            route("10.244.1.11", 32, 4),
        ];
        let pods = discover(&links, &addresses, &routes, &["eth0".to_owned()]);
        assert_eq!(
            pods.keys().map(String::as_str).collect::<Vec<_>>(),
            ["veth1", "veth2", "vethb"]
        );
        (links, addresses, pods)
    }

    fn exposed(choice: &str) -> Vec<(String, Vec<String>)> {
        let (links, addresses, pods) = node();
        let local: Vec<IpAddr> = addresses.iter().map(|a| a.addr).collect();
        let choice: NodePortAddresses = choice.parse().unwrap();
        let selected = choice.select(&["198.18.0.11".parse().unwrap()], &local);
        pod_facing_node_port_addresses(&selected, &links, &addresses, &pods)
            .into_iter()
            .map(|(a, on)| (a.to_string(), on.into_iter().collect()))
            .collect()
    }

    #[test]
    fn node_ports_on_pod_gateways_and_cni_bridges_are_named() {
        // In address order: 10.88.0.1 < 10.244.1.1.
        let pod_facing = vec![
            ("10.88.0.1".to_owned(), vec!["cni0".to_owned()]),
            (
                "10.244.1.1".to_owned(),
                vec!["veth1".to_owned(), "veth2".to_owned()],
            ),
        ];
        assert_eq!(exposed("all"), pod_facing);
        assert_eq!(exposed("0.0.0.0/0"), pod_facing);
        assert_eq!(exposed("10.88.0.0/16"), vec![pod_facing[0].clone()]);
        // The node IP alone, or the LAN and the portless bridge: nothing
        // pod-facing.
        assert!(exposed("primary").is_empty());
        assert!(exposed("198.18.0.0/24,172.17.0.0/16").is_empty());
    }
}
