//! The load-balancer flags of `run` and their config-file section
//! (`loadBalancer:`); flags win.

use std::time::Duration;

use serde::Deserialize;

use super::{DEFAULT_CLASS, DEFAULT_LEASE_NAMESPACE, LbConfig, lease::LeaseTiming};

/// Flags (see docs/loadbalancer.md).
#[derive(clap::Args, Debug, Default)]
pub struct LbArgs {
    /// Run a LoadBalancer address allocator candidate (one is active in the
    /// cluster, elected through a Lease); needs `--source kubernetes`.
    #[arg(long)]
    pub lb_ipam: bool,
    /// The `spec.loadBalancerClass` this agent serves.
    #[arg(long, value_name = "CLASS")]
    pub lb_class: Option<String>,
    /// Also serve LoadBalancer Services without a class (be the cluster's
    /// default load-balancer implementation).
    #[arg(long)]
    pub lb_default_class: bool,
    /// Namespace of the allocator's and the announcements' Leases (default:
    /// $POD_NAMESPACE, else the service account's namespace, else
    /// kube-dataplane).
    #[arg(long, value_name = "NAMESPACE")]
    pub lb_lease_namespace: Option<String>,
    /// Answer ARP/NDP for the LoadBalancer addresses this node is elected
    /// for; needs `--source kubernetes`.
    #[arg(long)]
    pub l2_announce: bool,
    /// Interfaces to answer on (default: the external devices).
    #[arg(long, value_delimiter = ',', value_name = "IFACE")]
    pub l2_interfaces: Vec<String>,
    /// How long an announcement Lease lasts without renewal: the failover
    /// time after a node dies.
    #[arg(long, value_name = "SECONDS")]
    pub l2_lease_duration_seconds: Option<u64>,
    /// How often the announcing node renews its Leases (one API write per
    /// address per period).
    #[arg(long, value_name = "MS")]
    pub l2_lease_renew_ms: Option<u64>,
    /// Announce the addresses to BGP routers through the BIRD speaker
    /// beside the agent, as the BGPPeer and BGPAdvertisement objects say;
    /// needs `--source kubernetes`.
    #[arg(long)]
    pub bgp: bool,
    /// The configuration file the agent renders for BIRD (`bird -c`).
    #[arg(long, value_name = "PATH")]
    pub bgp_config: Option<std::path::PathBuf>,
    /// BIRD's control socket (`bird -s`).
    #[arg(long, value_name = "PATH")]
    pub bgp_socket: Option<std::path::PathBuf>,
}

/// The config file's `loadBalancer:` section.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LbConfigFile {
    pub ipam: Option<bool>,
    pub class: Option<String>,
    pub default_class: Option<bool>,
    pub lease_namespace: Option<String>,
    pub l2_announce: Option<bool>,
    pub l2_interfaces: Option<Vec<String>>,
    pub l2_lease_duration_seconds: Option<u64>,
    pub l2_lease_renew_ms: Option<u64>,
    pub bgp: Option<bool>,
    pub bgp_config_path: Option<std::path::PathBuf>,
    pub bgp_socket: Option<std::path::PathBuf>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LbConfigError {
    #[error("--lb-ipam, --l2-announce and --bgp need --source kubernetes")]
    NeedsKubernetes,
    #[error(
        "the L2 lease renew period ({renew_ms} ms) must be at least 100 ms and shorter than the lease duration ({duration_s} s)"
    )]
    Timing { renew_ms: u64, duration_s: u64 },
    #[error("--lb-class must not be empty")]
    EmptyClass,
}

/// The namespace the agent runs in, as far as it can tell.
fn own_namespace() -> String {
    std::env::var("POD_NAMESPACE")
        .ok()
        .or_else(|| std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace").ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_LEASE_NAMESPACE.into())
}

pub fn resolve(
    args: LbArgs,
    file: Option<LbConfigFile>,
    kubernetes: bool,
) -> Result<LbConfig, LbConfigError> {
    let file = file.unwrap_or_default();
    let mut cfg = LbConfig {
        ipam: args.lb_ipam || file.ipam.unwrap_or(false),
        l2_announce: args.l2_announce || file.l2_announce.unwrap_or(false),
        lease_namespace: args
            .lb_lease_namespace
            .or(file.lease_namespace)
            .unwrap_or_else(own_namespace),
        l2_interfaces: if args.l2_interfaces.is_empty() {
            file.l2_interfaces.unwrap_or_default()
        } else {
            args.l2_interfaces
        },
        ..LbConfig::default()
    };
    cfg.classes.class = args
        .lb_class
        .or(file.class)
        .unwrap_or_else(|| DEFAULT_CLASS.into());
    if cfg.classes.class.is_empty() {
        return Err(LbConfigError::EmptyClass);
    }
    cfg.classes.default_class = args.lb_default_class || file.default_class.unwrap_or(false);
    let duration_s = args
        .l2_lease_duration_seconds
        .or(file.l2_lease_duration_seconds)
        .unwrap_or(cfg.l2_lease.duration.as_secs());
    let renew_ms = args
        .l2_lease_renew_ms
        .or(file.l2_lease_renew_ms)
        .unwrap_or(cfg.l2_lease.renew_period.as_millis() as u64);
    if renew_ms < 100 || renew_ms >= duration_s.saturating_mul(1000) {
        return Err(LbConfigError::Timing { renew_ms, duration_s });
    }
    cfg.l2_lease = LeaseTiming {
        duration: Duration::from_secs(duration_s),
        renew_period: Duration::from_millis(renew_ms),
        renew_deadline: None,
    };
    if args.bgp || file.bgp.unwrap_or(false) {
        let defaults = super::bgp::BgpConfig::default();
        cfg.bgp = Some(super::bgp::BgpConfig {
            config_path: args
                .bgp_config
                .or(file.bgp_config_path)
                .unwrap_or(defaults.config_path),
            socket: args.bgp_socket.or(file.bgp_socket).unwrap_or(defaults.socket),
        });
    }
    if (cfg.ipam || cfg.l2_announce || cfg.bgp.is_some()) && !kubernetes {
        return Err(LbConfigError::NeedsKubernetes);
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_bad_timings_are_refused() {
        let file = LbConfigFile {
            ipam: Some(true),
            class: Some("file.example/lb".into()),
            lease_namespace: Some("ns-file".into()),
            l2_interfaces: Some(vec!["bond0".into()]),
            ..Default::default()
        };
        let args = LbArgs {
            lb_class: Some("flag.example/lb".into()),
            l2_announce: true,
            l2_lease_duration_seconds: Some(3),
            l2_lease_renew_ms: Some(500),
            ..Default::default()
        };
        let cfg = resolve(args, Some(file), true).unwrap();
        assert!(cfg.ipam && cfg.l2_announce);
        assert_eq!(cfg.classes.class, "flag.example/lb");
        assert_eq!(cfg.lease_namespace, "ns-file");
        assert_eq!(cfg.l2_interfaces, ["bond0"]);
        assert_eq!(cfg.l2_lease.duration, Duration::from_secs(3));
        assert_eq!(cfg.l2_lease.renew_period, Duration::from_millis(500));

        let off = resolve(LbArgs::default(), None, false).unwrap();
        assert!(!off.ipam && !off.l2_announce && off.bgp.is_none());
        let bgp = LbConfigFile {
            bgp: Some(true),
            bgp_socket: Some("/run/bird.ctl".into()),
            ..Default::default()
        };
        let cfg = resolve(LbArgs::default(), Some(bgp.clone()), true)
            .unwrap()
            .bgp
            .unwrap();
        assert_eq!(cfg.socket, std::path::Path::new("/run/bird.ctl"));
        assert_eq!(
            cfg.config_path,
            std::path::Path::new(crate::lb::bgp::DEFAULT_CONFIG)
        );
        assert_eq!(
            resolve(LbArgs::default(), Some(bgp), false).unwrap_err(),
            LbConfigError::NeedsKubernetes
        );
        assert_eq!(off.classes.class, DEFAULT_CLASS);
        let needs = LbArgs {
            lb_ipam: true,
            ..Default::default()
        };
        assert_eq!(
            resolve(needs, None, false).unwrap_err(),
            LbConfigError::NeedsKubernetes
        );
        let slow = LbArgs {
            l2_lease_duration_seconds: Some(2),
            l2_lease_renew_ms: Some(2000),
            ..Default::default()
        };
        assert!(matches!(
            resolve(slow, None, true),
            Err(LbConfigError::Timing { .. })
        ));
    }
}
