//! Leftovers of kube-proxy in this network namespace: iptables KUBE-*
//! chains (iptables-legacy, read with the kernel's getsockopt interface;
//! iptables-nft, which keeps them in nf_tables), nftables-mode tables
//! (`ip kube-proxy`, `ip6 kube-proxy`) and IPVS virtual services with the
//! `kube-ipvs0` device. Read-only: no table is loaded or changed (a legacy
//! table is read only when /proc/net/ip_tables_names already lists it).

use super::{Finding, Severity, netlink};

/// `struct ipt_getinfo` size and `struct ipt_get_entries` header size.
const IPT_GETINFO_LEN: usize = 84;
const IPT_GET_ENTRIES_HDR: usize = 40;
const IPT_SO_GET_INFO: libc::c_int = 64;
const IPT_SO_GET_ENTRIES: libc::c_int = 65;
/// Offsets in `struct ipt_entry` and `struct xt_entry_target`.
const TARGET_OFFSET: usize = 88;
const NEXT_OFFSET: usize = 90;
const TARGET_NAME: usize = 2;
const TARGET_DATA: usize = 32;

/// User-defined chains of the legacy iptables table `table` (their
/// definitions are entries whose target is ERROR, named by its data).
pub fn legacy_chains(table: &str) -> std::io::Result<Vec<String>> {
    // SAFETY: a raw socket we close; getsockopt writes at most `len` bytes
    // into buffers we own.
    unsafe {
        let fd = libc::socket(
            libc::AF_INET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        );
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let result = (|| {
            let mut info = [0u8; IPT_GETINFO_LEN];
            info[..table.len().min(31)].copy_from_slice(&table.as_bytes()[..table.len().min(31)]);
            let mut len = info.len() as libc::socklen_t;
            if libc::getsockopt(
                fd,
                libc::SOL_IP,
                IPT_SO_GET_INFO,
                info.as_mut_ptr().cast(),
                &mut len,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            let size = u32::from_ne_bytes(info[80..84].try_into().expect("4")) as usize;
            let mut entries = vec![0u8; IPT_GET_ENTRIES_HDR + size];
            entries[..32].copy_from_slice(&info[..32]);
            entries[32..36].copy_from_slice(&(size as u32).to_ne_bytes());
            let mut len = entries.len() as libc::socklen_t;
            if libc::getsockopt(
                fd,
                libc::SOL_IP,
                IPT_SO_GET_ENTRIES,
                entries.as_mut_ptr().cast(),
                &mut len,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(entries)
        })();
        libc::close(fd);
        let entries = result?;
        let mut chains = Vec::new();
        let mut at = IPT_GET_ENTRIES_HDR;
        while at + NEXT_OFFSET + 2 <= entries.len() {
            let u16_at = |o: usize| u16::from_ne_bytes([entries[at + o], entries[at + o + 1]]) as usize;
            let (target, next) = (u16_at(TARGET_OFFSET), u16_at(NEXT_OFFSET));
            let t = at + target;
            if next == 0 || t + TARGET_DATA > entries.len() {
                break;
            }
            if netlink::text(&entries[t + TARGET_NAME..t + TARGET_DATA - 1]) == "ERROR" {
                let name = netlink::text(&entries[t + TARGET_DATA..(at + next).min(entries.len())]);
                if name != "ERROR" {
                    chains.push(name);
                }
            }
            at += next;
        }
        Ok(chains)
    }
}

fn kube_chains(chains: impl IntoIterator<Item = String>) -> Vec<String> {
    chains.into_iter().filter(|c| c.starts_with("KUBE-")).collect()
}

fn summary(chains: &[String]) -> String {
    let mut shown: Vec<&str> = chains.iter().take(4).map(String::as_str).collect();
    if chains.len() > shown.len() {
        shown.push("...");
    }
    shown.join(", ")
}

/// Every finding about kube-proxy's leftovers (none when the node is clean:
/// then one `ok` finding).
pub fn check() -> Vec<Finding> {
    let mut out = Vec::new();
    let subject = "kube-proxy";
    // iptables-legacy: tables the kernel already has.
    let legacy_tables = std::fs::read_to_string("/proc/net/ip_tables_names").unwrap_or_default();
    for table in legacy_tables
        .lines()
        .filter(|t| ["nat", "filter", "mangle"].contains(t))
    {
        match legacy_chains(table) {
            Ok(chains) => {
                let kube = kube_chains(chains);
                if !kube.is_empty() {
                    out.push(Finding::new(
                        Severity::Warn,
                        subject,
                        format!(
                            "iptables-legacy table {table} has {} KUBE-* chains ({}): kube-proxy's rules are still there",
                            kube.len(),
                            summary(&kube)
                        ),
                        Some(
                            "on the node: `kube-proxy --cleanup`, or `iptables-legacy-save | grep -v KUBE | \
                             iptables-legacy-restore` and the same with ip6tables-legacy-save/-restore"
                                .into(),
                        ),
                    ));
                }
            }
            Err(e) => out.push(Finding::new(
                Severity::Warn,
                subject,
                format!("cannot read iptables-legacy table {table}: {e} (needs CAP_NET_ADMIN)"),
                None,
            )),
        }
    }
    // nf_tables: iptables-nft's tables and kube-proxy's nftables mode.
    match netlink::nft_chains() {
        Ok(chains) => {
            let mut iptables_nft: std::collections::BTreeMap<String, Vec<String>> = Default::default();
            let mut tables = std::collections::BTreeSet::new();
            for (family, table, chain) in chains {
                let family = match family {
                    2 => "ip",
                    10 => "ip6",
                    1 => "inet",
                    _ => "other",
                };
                if table == "kube-proxy" {
                    tables.insert(family);
                } else if chain.starts_with("KUBE-") && ["ip", "ip6"].contains(&family) {
                    iptables_nft
                        .entry(format!("{family} {table}"))
                        .or_default()
                        .push(chain);
                }
            }
            for (table, kube) in iptables_nft {
                let tool = if table.starts_with("ip6") {
                    "ip6tables-nft"
                } else {
                    "iptables-nft"
                };
                out.push(Finding::new(
                    Severity::Warn,
                    subject,
                    format!(
                        "nftables table {table} (iptables-nft) has {} KUBE-* chains ({}): kube-proxy's rules are still there",
                        kube.len(),
                        summary(&kube)
                    ),
                    Some(format!(
                        "on the node: `kube-proxy --cleanup`, or `{tool}-save | grep -v KUBE | {tool}-restore`"
                    )),
                ));
            }
            for family in tables {
                out.push(Finding::new(
                    Severity::Warn,
                    subject,
                    format!("nftables table {family} kube-proxy exists: kube-proxy's nftables-mode rules are still there"),
                    Some(format!("on the node: `kube-proxy --cleanup`, or `nft delete table {family} kube-proxy`")),
                ));
            }
        }
        Err(e) => out.push(Finding::new(
            Severity::Warn,
            subject,
            format!("cannot list nftables chains: {e} (needs CAP_NET_ADMIN)"),
            None,
        )),
    }
    // IPVS.
    let services = std::fs::read_to_string("/proc/net/ip_vs")
        .map(|t| {
            t.lines()
                .filter(|l| ["TCP ", "UDP ", "SCTP ", "FWM "].iter().any(|p| l.starts_with(p)))
                .count()
        })
        .unwrap_or(0);
    let dummy = std::path::Path::new("/sys/class/net/kube-ipvs0").exists()
        || crate::os::interfaces::links()
            .unwrap_or_default()
            .iter()
            .any(|l| l.name == "kube-ipvs0");
    if services > 0 || dummy {
        out.push(Finding::new(
            Severity::Warn,
            subject,
            format!(
                "IPVS has {services} virtual services{}: kube-proxy's IPVS mode left them",
                if dummy {
                    " and the kube-ipvs0 device exists"
                } else {
                    ""
                }
            ),
            Some(
                "on the node: `kube-proxy --cleanup`, or `ipvsadm --clear && ip link delete kube-ipvs0`"
                    .into(),
            ),
        ));
    }
    if out.is_empty() {
        out.push(Finding::new(
            Severity::Ok,
            subject,
            "no kube-proxy rules (iptables-legacy, iptables-nft, nftables, IPVS)".into(),
            None,
        ));
    }
    out
}
