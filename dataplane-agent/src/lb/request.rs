//! Services as the load-balancer controllers see them, pure: whose they are
//! (`spec.loadBalancerClass`), what they ask for (a [`Request`]), and the
//! status the allocator writes for an [`Outcome`].

use std::{collections::BTreeSet, net::IpAddr};

use k8s_openapi::{
    api::{
        core::v1::{LoadBalancerIngress, LoadBalancerStatus, Service, ServiceStatus},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
};

use super::{
    CONDITION_TYPE, IPS_ANNOTATION, SHARING_KEY_ANNOTATION,
    pool::{Family, FamilyPolicy, NAME_LABEL, NAMESPACE_LABEL, Outcome, Request, Traffic},
};

/// Which Services are ours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassFilter {
    /// Our `spec.loadBalancerClass`.
    pub class: String,
    /// Also Services of type LoadBalancer without a class (act as the
    /// cluster's default load-balancer implementation).
    pub default_class: bool,
}

impl ClassFilter {
    /// A Service of type LoadBalancer of our class (or without a class, when
    /// configured).
    pub fn owns(&self, svc: &Service) -> bool {
        let Some(spec) = &svc.spec else { return false };
        spec.type_.as_deref() == Some("LoadBalancer")
            && match spec.load_balancer_class.as_deref() {
                Some(c) => c == self.class,
                None => self.default_class,
            }
    }

    /// Another controller's Service (a class that is not ours): never touched.
    pub fn foreign(&self, svc: &Service) -> bool {
        svc.spec
            .as_ref()
            .and_then(|s| s.load_balancer_class.as_deref())
            .is_some_and(|c| c != self.class)
    }
}

/// namespace/name.
pub fn key(svc: &Service) -> String {
    format!(
        "{}/{}",
        svc.metadata.namespace.as_deref().unwrap_or("default"),
        svc.metadata.name.as_deref().unwrap_or("")
    )
}

/// The addresses in `status.loadBalancer.ingress` (hostnames and unparsable
/// entries skipped).
pub fn ingress_ips(svc: &Service) -> Vec<IpAddr> {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|i| i.ip.as_deref()?.parse().ok())
        .collect()
}

/// (namespace, Service) of the EndpointSlices with a ready endpoint on
/// `node_name`: where externalTrafficPolicy Local may be announced.
pub fn with_ready_endpoint_on<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    node_name: &str,
) -> BTreeSet<(String, String)> {
    slices
        .into_iter()
        .filter(|s| {
            s.endpoints.iter().any(|e| {
                e.node_name.as_deref() == Some(node_name)
                    && e.conditions.as_ref().and_then(|c| c.ready) != Some(false)
            })
        })
        .filter_map(|s| {
            let svc = s.metadata.labels.as_ref()?.get("kubernetes.io/service-name")?;
            Some((s.metadata.namespace.clone().unwrap_or_default(), svc.clone()))
        })
        .collect()
}

/// Whether the allocator has written its condition on this Service.
pub fn has_our_condition(svc: &Service) -> bool {
    our_condition(svc).is_some()
}

/// The allocator's condition on this Service.
pub fn our_condition(svc: &Service) -> Option<&Condition> {
    svc.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION_TYPE)
}

fn parse_ip(what: &str, s: &str) -> Result<IpAddr, String> {
    s.parse()
        .map_err(|_| format!("{what}: `{s}` is not an IP address"))
}

/// `spec.loadBalancerIP` and the ips annotation → the requested addresses.
fn requested(svc: &Service) -> Result<Vec<IpAddr>, String> {
    let from_spec = svc
        .spec
        .as_ref()
        .and_then(|s| s.load_balancer_ip.as_deref())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| parse_ip("spec.loadBalancerIP", s))
        .transpose()?;
    let from_annotation: Option<Vec<IpAddr>> = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(IPS_ANNOTATION))
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| parse_ip(&format!("annotation {IPS_ANNOTATION}"), s))
                .collect::<Result<_, _>>()
        })
        .transpose()?;
    let ips = match (from_spec, from_annotation) {
        (None, None) => Vec::new(),
        (Some(ip), None) => vec![ip],
        (None, Some(ips)) => ips,
        (Some(ip), Some(ips)) => {
            if ips != [ip] {
                return Err(format!(
                    "spec.loadBalancerIP ({ip}) and annotation {IPS_ANNOTATION} disagree; set one of them"
                ));
            }
            ips
        }
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for ip in ips {
        if !seen.insert(Family::of(&ip)) {
            if out.contains(&ip) {
                continue;
            }
            return Err(format!(
                "more than one {} address requested (one per family)",
                Family::of(&ip)
            ));
        }
        out.push(ip);
    }
    Ok(out)
}

/// What `svc` asks the allocator for; `current` is what it holds now.
pub fn request(svc: &Service, current: Vec<IpAddr>) -> Request {
    let namespace = svc.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let name = svc.metadata.name.clone().unwrap_or_default();
    let mut labels = svc.metadata.labels.clone().unwrap_or_default();
    labels.insert(NAMESPACE_LABEL.into(), namespace.clone());
    labels.insert(NAME_LABEL.into(), name);
    let spec = svc.spec.clone().unwrap_or_default();
    let traffic = if spec.external_traffic_policy.as_deref() == Some("Local") {
        let selector: Vec<String> = spec
            .selector
            .iter()
            .flatten()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        Traffic::Local(selector.join(","))
    } else {
        Traffic::Cluster
    };
    Request {
        key: key(svc),
        namespace,
        created: svc
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default(),
        labels,
        families: spec
            .ip_families
            .iter()
            .flatten()
            .filter_map(|f| Family::parse(f))
            .collect(),
        policy: match spec.ip_family_policy.as_deref() {
            Some("PreferDualStack") => FamilyPolicy::PreferDualStack,
            Some("RequireDualStack") => FamilyPolicy::RequireDualStack,
            _ => FamilyPolicy::SingleStack,
        },
        requested: requested(svc),
        sharing_key: svc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SHARING_KEY_ANNOTATION))
            .map(|k| k.trim().to_owned())
            .filter(|k| !k.is_empty()),
        ports: spec
            .ports
            .iter()
            .flatten()
            .map(|p| (p.port, p.protocol.clone().unwrap_or_else(|| "TCP".into())))
            .collect(),
        traffic,
        current,
    }
}

/// The condition for an outcome: (status, reason, message).
pub fn condition_of(outcome: &Outcome) -> (&'static str, &'static str, String) {
    let assigned: Vec<String> = outcome.ips.iter().map(|i| i.to_string()).collect();
    match outcome.problems.first() {
        None => ("True", "Assigned", format!("assigned {}", assigned.join(", "))),
        Some(first) => {
            let mut msg: Vec<String> = outcome.problems.iter().map(|p| p.to_string()).collect();
            if !assigned.is_empty() {
                msg.insert(0, format!("assigned {}", assigned.join(", ")));
            }
            ("False", first.reason(), msg.join("; "))
        }
    }
}

/// `svc`'s status with `ips` as its ingress (ipMode VIP) and our condition
/// set to `condition` (removed when `None`); other conditions are kept, and
/// so is our condition's lastTransitionTime when its status is unchanged.
pub fn with_assignment(
    svc: &Service,
    ips: &[IpAddr],
    condition: Option<(&str, &str, String)>,
    now: jiff::Timestamp,
) -> ServiceStatus {
    let mut status = svc.status.clone().unwrap_or_default();
    let ingress: Vec<LoadBalancerIngress> = ips
        .iter()
        .map(|ip| LoadBalancerIngress {
            ip: Some(ip.to_string()),
            ip_mode: Some("VIP".into()),
            ..Default::default()
        })
        .collect();
    status.load_balancer = (!ingress.is_empty()).then_some(LoadBalancerStatus {
        ingress: Some(ingress),
    });
    let previous = our_condition(svc).cloned();
    let mut conditions: Vec<Condition> = status
        .conditions
        .take()
        .unwrap_or_default()
        .into_iter()
        .filter(|c| c.type_ != CONDITION_TYPE)
        .collect();
    if let Some((state, reason, message)) = condition {
        let since = previous
            .filter(|p| p.status == state)
            .map(|p| p.last_transition_time)
            .unwrap_or(Time(now));
        conditions.push(Condition {
            type_: CONDITION_TYPE.into(),
            status: state.into(),
            reason: reason.into(),
            message,
            observed_generation: svc.metadata.generation,
            last_transition_time: since,
        });
    }
    status.conditions = (!conditions.is_empty()).then_some(conditions);
    // An empty LoadBalancerStatus is what the API server returns.
    if status.load_balancer.is_none() {
        status.load_balancer = Some(LoadBalancerStatus::default());
    }
    status
}

/// Whether two statuses say the same (an absent and an empty load balancer
/// status are the same).
pub fn same_status(a: Option<&ServiceStatus>, b: &ServiceStatus) -> bool {
    let norm = |s: Option<&ServiceStatus>| {
        let mut s = s.cloned().unwrap_or_default();
        if s.load_balancer
            .as_ref()
            .is_none_or(|lb| lb.ingress.as_ref().is_none_or(Vec::is_empty))
        {
            s.load_balancer = None;
        }
        if s.conditions.as_ref().is_some_and(Vec::is_empty) {
            s.conditions = None;
        }
        s
    };
    norm(a) == norm(Some(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lb::pool::Problem;

    fn svc(yaml: &str) -> Service {
        serde_json::from_value(serde_saphyr::from_str::<serde_json::Value>(yaml).unwrap()).unwrap()
    }

    const OURS: &str = "dataplane.example.com/lb";

    fn filter(default_class: bool) -> ClassFilter {
        ClassFilter {
            class: OURS.into(),
            default_class,
        }
    }

    #[test]
    fn ownership_follows_type_and_class() {
        let ours = svc(&format!(
            "metadata: {{name: a, namespace: x}}\nspec: {{type: LoadBalancer, loadBalancerClass: {OURS}}}"
        ));
        let classless = svc("metadata: {name: b}\nspec: {type: LoadBalancer}");
        let ccm =
            svc("metadata: {name: c}\nspec: {type: LoadBalancer, loadBalancerClass: cloud.example/ccm}");
        let node_port = svc("metadata: {name: d}\nspec: {type: NodePort}");
        assert!(filter(false).owns(&ours));
        assert!(!filter(false).owns(&classless));
        assert!(filter(true).owns(&classless));
        assert!(!filter(true).owns(&ccm) && filter(true).foreign(&ccm));
        assert!(!filter(true).owns(&node_port) && !filter(true).foreign(&node_port));
        assert_eq!(key(&ours), "x/a");
    }

    #[test]
    fn requests_read_spec_annotations_and_status() {
        let s = svc(&format!(
            r#"
metadata:
  name: web
  namespace: shop
  creationTimestamp: "2024-05-01T10:00:00Z"
  labels: {{tier: edge}}
  annotations: {{"{IPS_ANNOTATION}": "10.0.0.5, fd00::5", "{SHARING_KEY_ANNOTATION}": " k "}}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  selector: {{app: web, z: "1"}}
  ipFamilies: [IPv6, IPv4]
  ipFamilyPolicy: RequireDualStack
  ports: [{{port: 80}}, {{port: 53, protocol: UDP}}]
status:
  loadBalancer: {{ingress: [{{ip: 10.0.0.5}}, {{hostname: lb.example}}]}}
"#
        ));
        let r = request(&s, ingress_ips(&s));
        assert_eq!(r.key, "shop/web");
        assert_eq!(r.created, "2024-05-01T10:00:00Z");
        assert_eq!(r.labels["tier"], "edge");
        assert_eq!(r.labels[NAMESPACE_LABEL], "shop");
        assert_eq!(r.labels[NAME_LABEL], "web");
        assert_eq!(r.families, [Family::V6, Family::V4]);
        assert_eq!(r.policy, FamilyPolicy::RequireDualStack);
        assert_eq!(
            r.requested,
            Ok(vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()])
        );
        assert_eq!(r.sharing_key.as_deref(), Some("k"));
        assert_eq!(
            r.ports,
            BTreeSet::from([(80, "TCP".to_string()), (53, "UDP".to_string())])
        );
        assert_eq!(r.traffic, Traffic::Local("app=web,z=1".into()));
        assert_eq!(r.current, ["10.0.0.5".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn bad_requests_are_errors_that_say_what_is_wrong() {
        let with = |lb_ip: &str, ann: &str| {
            svc(&format!(
                "metadata: {{name: a, annotations: {{\"{IPS_ANNOTATION}\": \"{ann}\"}}}}\nspec: {{type: LoadBalancer, loadBalancerIP: \"{lb_ip}\"}}"
            ))
        };
        let err = |s: &Service| request(s, vec![]).requested.unwrap_err();
        assert!(err(&with("10.0.0.x", "")).contains("spec.loadBalancerIP"));
        assert!(err(&with("", "10.0.0.1,nope")).contains("`nope`"));
        assert!(err(&with("10.0.0.1", "10.0.0.2")).contains("disagree"));
        assert!(err(&with("", "10.0.0.1,10.0.0.2")).contains("one per family"));
        assert_eq!(
            request(&with("10.0.0.1", "10.0.0.1"), vec![])
                .requested
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            request(&with("", "10.0.0.1, 10.0.0.1"), vec![])
                .requested
                .unwrap()
                .len(),
            1,
            "duplicates collapse"
        );
    }

    #[test]
    fn status_carries_the_assignment_and_keeps_other_conditions() {
        let mut s = svc(
            "metadata: {name: a, generation: 3}\nspec: {type: LoadBalancer}\nstatus: {conditions: [{type: Other, status: \"True\", reason: R, message: m, lastTransitionTime: \"2024-01-01T00:00:00Z\"}]}",
        );
        let t0: jiff::Timestamp = "2024-06-01T00:00:00Z".parse().unwrap();
        let ok = Outcome {
            ips: vec!["10.0.0.1".parse().unwrap()],
            problems: vec![],
        };
        let st = with_assignment(&s, &ok.ips, Some(condition_of(&ok)), t0);
        let ingress = &st.load_balancer.as_ref().unwrap().ingress.as_ref().unwrap()[0];
        assert_eq!(ingress.ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(ingress.ip_mode.as_deref(), Some("VIP"));
        let conds = st.conditions.as_ref().unwrap();
        assert_eq!(conds.len(), 2);
        let ours = conds.iter().find(|c| c.type_ == CONDITION_TYPE).unwrap();
        assert_eq!((ours.status.as_str(), ours.reason.as_str()), ("True", "Assigned"));
        assert_eq!(ours.message, "assigned 10.0.0.1");
        assert_eq!(ours.observed_generation, Some(3));
        assert!(!same_status(s.status.as_ref(), &st));
        s.status = Some(st.clone());

        // Same outcome later: nothing to write, the transition time stays.
        let t1: jiff::Timestamp = "2024-06-02T00:00:00Z".parse().unwrap();
        let again = with_assignment(&s, &ok.ips, Some(condition_of(&ok)), t1);
        assert!(same_status(s.status.as_ref(), &again));

        // A problem: False, its reason, the transition time moves.
        let bad = Outcome {
            ips: vec![],
            problems: vec![Problem::Exhausted(Family::V4)],
        };
        let st = with_assignment(&s, &bad.ips, Some(condition_of(&bad)), t1);
        let ours = st
            .conditions
            .as_ref()
            .unwrap()
            .iter()
            .find(|c| c.type_ == CONDITION_TYPE)
            .unwrap();
        assert_eq!(
            (ours.status.as_str(), ours.reason.as_str()),
            ("False", "PoolExhausted")
        );
        assert_eq!(ours.last_transition_time, Time(t1));
        assert!(st.load_balancer.unwrap().ingress.is_none());

        // Released: no ingress, no condition of ours, the other one stays.
        let st = with_assignment(&s, &[], None, t1);
        assert_eq!(st.conditions.as_ref().unwrap().len(), 1);
        assert!(!has_our_condition(&Service {
            status: Some(st),
            ..Default::default()
        }));
    }
}
