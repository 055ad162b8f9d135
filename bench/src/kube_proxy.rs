//! The comparison with kube-proxy: the same Services as kube-proxy's
//! iptables (legacy) and nftables rule sets, generated with the chain and map
//! shapes kube-proxy writes (the end-to-end runs through them are in `e2e`),
//! control-plane costs, and our map memory.

use std::{
    fmt::Write as _,
    io::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

const CLUSTER_CIDR: &str = "10.244.0.0/16";
const MEASURED_VIP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 1);

/// Filler Service i: VIP 10.96.x.y, endpoints 10.160.x.y.k (unreachable, never used).
fn filler_vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i)
}
fn filler_ep(i: u32, k: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 160, 0, 0)) + i * 16 + k)
}

pub struct Svc {
    pub name: String,
    pub vip: Ipv4Addr,
    pub eps: Vec<SocketAddrV4>,
}

/// N Services of `eps_per` endpoints, the measured one (with `measured`
/// endpoints) last: the worst case of iptables' linear KUBE-SERVICES walk.
pub fn services(n: u32, measured: &[SocketAddrV4], eps_per: u32) -> Vec<Svc> {
    let mut v: Vec<Svc> = (0..n.saturating_sub(1))
        .map(|i| Svc {
            name: format!("svc{i}"),
            vip: filler_vip(i + 1),
            eps: (0..eps_per)
                .map(|k| SocketAddrV4::new(filler_ep(i, k), 8080))
                .collect(),
        })
        .collect();
    let m = Svc {
        name: "measured".into(),
        vip: MEASURED_VIP,
        eps: measured.to_vec(),
    };
    v.push(m);
    v
}

fn chain_id(s: &str) -> String {
    // kube-proxy hashes names to 16 characters; any unique tag will do.
    let h = s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    });
    format!("{h:016X}")
}

/// kube-proxy's iptables (nat table) rules for ClusterIP Services.
pub fn iptables_rules(svcs: &[Svc]) -> String {
    let mut chains = String::new();
    let mut rules = String::new();
    for s in svcs {
        let svc_chain = format!("KUBE-SVC-{}", chain_id(&s.name));
        let _ = writeln!(chains, ":{svc_chain} - [0:0]");
        let _ = writeln!(
            rules,
            "-A KUBE-SERVICES -d {}/32 -p tcp -m comment --comment \"default/{}:p cluster IP\" -m tcp --dport 80 -j {svc_chain}",
            s.vip, s.name
        );
        let _ = writeln!(
            rules,
            "-A {svc_chain} ! -s {CLUSTER_CIDR} -d {}/32 -p tcp -m comment --comment \"default/{}:p cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ",
            s.vip, s.name
        );
        let n = s.eps.len();
        for (k, ep) in s.eps.iter().enumerate() {
            let sep = format!("KUBE-SEP-{}", chain_id(&format!("{}{ep}", s.name)));
            let _ = writeln!(chains, ":{sep} - [0:0]");
            let left = n - k;
            if left > 1 {
                let _ = writeln!(
                    rules,
                    "-A {svc_chain} -m comment --comment \"default/{}:p -> {ep}\" -m statistic --mode random --probability {:.10} -j {sep}",
                    s.name,
                    1.0 / left as f64
                );
            } else {
                let _ = writeln!(
                    rules,
                    "-A {svc_chain} -m comment --comment \"default/{}:p -> {ep}\" -j {sep}",
                    s.name
                );
            }
            let _ = writeln!(
                rules,
                "-A {sep} -s {}/32 -m comment --comment \"default/{}:p\" -j KUBE-MARK-MASQ",
                ep.ip(),
                s.name
            );
            let _ = writeln!(
                rules,
                "-A {sep} -p tcp -m comment --comment \"default/{}:p\" -m tcp -j DNAT --to-destination {ep}",
                s.name
            );
        }
    }
    format!(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
         :KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n{chains}\
         -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
         -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n\
         -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
         -A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n\
         -A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n\
         {rules}-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n\
         COMMIT\n"
    )
}

/// kube-proxy's nftables rules: the `service-ips` verdict map, a chain per
/// Service with `numgen random` over per-endpoint chains.
pub fn nft_rules(svcs: &[Svc]) -> String {
    let mut out = String::from(
        "table ip kube-proxy {\n\
         chain mark-for-masquerade {\n meta mark set meta mark | 0x4000\n}\n\
         chain masquerading {\n meta mark & 0x4000 == 0 return\n meta mark set meta mark ^ 0x4000\n masquerade fully-random\n}\n\
         chain nat-prerouting {\n type nat hook prerouting priority dstnat; policy accept;\n jump services\n}\n\
         chain nat-output {\n type nat hook output priority -100; policy accept;\n jump services\n}\n\
         chain nat-postrouting {\n type nat hook postrouting priority srcnat; policy accept;\n jump masquerading\n}\n",
    );
    let mut elements = Vec::new();
    for s in svcs {
        let id = chain_id(&s.name);
        let _ = write!(
            out,
            "chain service-{id} {{\n ip daddr {} tcp dport 80 ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade\n numgen random mod {} vmap {{ ",
            s.vip,
            s.eps.len()
        );
        let arms: Vec<String> = (0..s.eps.len())
            .map(|k| {
                format!(
                    "{k} : goto endpoint-{}",
                    chain_id(&format!("{}{}", s.name, s.eps[k]))
                )
            })
            .collect();
        let _ = writeln!(out, "{} }}\n}}", arms.join(", "));
        for ep in &s.eps {
            let _ = writeln!(
                out,
                "chain endpoint-{} {{\n ip saddr {} jump mark-for-masquerade\n meta l4proto tcp dnat to {ep}\n}}",
                chain_id(&format!("{}{ep}", s.name)),
                ep.ip()
            );
        }
        elements.push(format!("{} . tcp . 80 : goto service-{id}", s.vip));
    }
    let _ = writeln!(
        out,
        "map service-ips {{\n type ipv4_addr . inet_proto . inet_service : verdict\n elements = {{ {} }}\n}}",
        elements.join(", ")
    );
    out.push_str(
        "chain nodeports {\n}\n\
         chain services {\n ip daddr . meta l4proto . th dport vmap @service-ips\n fib daddr type local ip daddr != 127.0.0.0/8 jump nodeports\n}\n}\n",
    );
    out
}

pub fn run_stdin(ns: &str, program: &str, args: &[&str], input: &str) -> Duration {
    let started = Instant::now();
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, program])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e} (cargo xtask setup installs iptables and nftables)"));
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{program} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    started.elapsed()
}

pub struct ControlRow {
    pub services: u32,
    pub ours_full_s: f64,
    pub ours_change_p50_ms: f64,
    pub ours_change_p99_ms: f64,
    pub iptables_full_s: Option<f64>,
    pub iptables_one_s: Option<f64>,
    pub nft_full_s: Option<f64>,
    pub nft_one_s: Option<f64>,
    pub map_bytes_per_service: f64,
    pub map_bytes_per_backend: f64,
}

/// Memory of the maps this process holds, from /proc/self/fdinfo:
/// (key size, value size, max entries, memlock bytes).
pub fn map_memory() -> Vec<(u32, u32, u32, u64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/fdinfo")
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_owned())
        };
        if let (Some(ks), Some(vs), Some(me), Some(ml)) = (
            field("key_size:"),
            field("value_size:"),
            field("max_entries:"),
            field("memlock:"),
        ) {
            out.push((
                ks.parse().unwrap_or(0),
                vs.parse().unwrap_or(0),
                me.parse().unwrap_or(0),
                ml.parse().unwrap_or(0),
            ));
        }
    }
    out
}

/// Programming costs with 10 endpoints per Service: ours (in-process: the
/// agent's incremental syncer from empty maps, then single endpoint
/// changes; see `control::in_process`), iptables-restore and nft -f of the
/// equivalent rules.
pub fn control(n: u32, with_rules: bool, ours: &crate::control::InProcess) -> ControlRow {
    const EPS: u32 = crate::control::EPS;
    let ours_full_s = ours.program_all_s;
    let lat = [ours.change_ms.median, ours.change_p99_ms];
    let mem = |k: u32, v: u32| {
        ours.maps
            .iter()
            .filter(|m| m.0 == k && m.1 == v)
            .map(|m| m.3)
            .sum::<u64>() as f64
    };
    // services (frontend + slots), backends array.
    let per_service = mem(12, 16) / n as f64;
    let per_backend = mem(4, 8) / (n * EPS) as f64;

    let ns = dataplane_tests::netns::NetNs::new(&format!("{}-cp", dataplane_tests::unique_prefix()));
    let eps_of = |i: u32, salt: u32| -> Vec<SocketAddrV4> {
        (0..EPS)
            .map(|k| SocketAddrV4::new(filler_ep(i, (k + salt) % 16), 8080))
            .collect()
    };
    let all: Vec<Svc> = (0..n)
        .map(|i| Svc {
            name: format!("svc{i}"),
            vip: filler_vip(i + 1),
            eps: eps_of(i, 0),
        })
        .collect();
    if !with_rules {
        return ControlRow {
            services: n,
            ours_full_s,
            ours_change_p50_ms: lat[0],
            ours_change_p99_ms: lat[1],
            iptables_full_s: None,
            iptables_one_s: None,
            nft_full_s: None,
            nft_one_s: None,
            map_bytes_per_service: per_service,
            map_bytes_per_backend: per_backend,
        };
    }
    let iptables_full_s =
        Some(run_stdin(ns.name(), "iptables-legacy-restore", &[], &iptables_rules(&all)).as_secs_f64());
    // One Service's endpoints change: kube-proxy rewrites that Service's
    // chains (--noflush keeps the rest).
    let one = Svc {
        name: "svc0".into(),
        vip: filler_vip(1),
        eps: eps_of(0, 3),
    };
    let svc_chain = format!("KUBE-SVC-{}", chain_id("svc0"));
    let mut partial = format!("*nat\n:{svc_chain} - [0:0]\n");
    for ep in &one.eps {
        let _ = writeln!(partial, ":KUBE-SEP-{} - [0:0]", chain_id(&format!("svc0{ep}")));
    }
    let body = iptables_rules(std::slice::from_ref(&one));
    for l in body
        .lines()
        .filter(|l| l.starts_with(&format!("-A {svc_chain}")) || l.starts_with("-A KUBE-SEP-"))
    {
        let _ = writeln!(partial, "{l}");
    }
    partial.push_str("COMMIT\n");
    let iptables_one_s =
        Some(run_stdin(ns.name(), "iptables-legacy-restore", &["--noflush"], &partial).as_secs_f64());
    let (nft_full_s, nft_one_s) = {
        let full = run_stdin(ns.name(), "nft", &["-f", "-"], &nft_rules(&all)).as_secs_f64();
        let id = chain_id("svc0");
        let mut change = format!("flush chain ip kube-proxy service-{id}\n");
        for ep in &one.eps {
            let _ = writeln!(
                change,
                "add chain ip kube-proxy endpoint-{} {{\n ip saddr {} jump mark-for-masquerade\n meta l4proto tcp dnat to {ep}\n}}",
                chain_id(&format!("svc0{ep}")),
                ep.ip()
            );
        }
        let arms: Vec<String> = (0..one.eps.len())
            .map(|k| format!("{k} : goto endpoint-{}", chain_id(&format!("svc0{}", one.eps[k]))))
            .collect();
        let _ = writeln!(
            change,
            "add rule ip kube-proxy service-{id} numgen random mod {} vmap {{ {} }}",
            one.eps.len(),
            arms.join(", ")
        );
        (
            Some(full),
            Some(run_stdin(ns.name(), "nft", &["-f", "-"], &change).as_secs_f64()),
        )
    };
    ControlRow {
        services: n,
        ours_full_s,
        ours_change_p50_ms: lat[0],
        ours_change_p99_ms: lat[1],
        iptables_full_s,
        iptables_one_s,
        nft_full_s,
        nft_one_s,
        map_bytes_per_service: per_service,
        map_bytes_per_backend: per_backend,
    }
}
