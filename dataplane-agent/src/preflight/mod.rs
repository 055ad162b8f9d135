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
//! - kube-proxy's leftovers ([`kube_proxy`]).

pub mod kube_proxy;
pub mod netlink;

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::{
    agent::interfaces,
    dataplane::{self, Datapath, DeviceKind, XdpMode, device, pins},
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
}

/// Every check, in order.
pub fn run(opts: &Options) -> Vec<Finding> {
    let mut out = kernel();
    out.push(load());
    out.push(bpffs(&opts.bpffs_dir));
    out.extend(cgroup(opts.cgroup_path.clone()));
    out.extend(devices(opts));
    out.push(pod_interfaces(opts));
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
                crate::agent::cgroup_mount::system_cgroup2_mount()
                    .map_or_else(|e| e.to_string(), |m| m.path.display().to_string())
            )),
        )];
    }
    let (path, how) = match path {
        Some(p) => (p, "given".to_owned()),
        None => match crate::agent::cgroup_mount::system_cgroup2_mount() {
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
    use crate::agent::pod_interfaces::{Why, by_pattern, discover};
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
