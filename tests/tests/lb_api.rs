//! The LoadBalancer allocator and the Lease election against the in-process
//! API server: addresses from pools into the Services' status (ipMode VIP),
//! conditions and Events for what cannot be done, requested and shared
//! addresses, class filtering, release, status writes through 409
//! Conflicts, re-learning after a restart or a change of leader, and
//! election hand-over on expiry and on release.

use std::time::{Duration, Instant};

use dataplane_agent::{
    lb::metrics::SharedLbMetrics,
    lb::{
        ApiAccess, IPAM_LEASE, LbConfig, LbController,
        lease::{Candidate, Elector, Intent, LeaseTiming},
        request::ClassFilter,
    },
};
use dataplane_tests::{
    eventually,
    fake_api::FakeApiServer,
    lb::{CLASS, IPS_ANNOTATION, SHARING_KEY_ANNOTATION, annotated, condition, ingress, pool, service},
    netns::NetNs,
    require_privileges, unique_prefix,
};
use serde_json::{Value, json};

const LEASE_NS: &str = "kube-dataplane";

struct Setup {
    api: FakeApiServer,
    metrics: SharedLbMetrics,
    ns: NetNs,
}

impl Setup {
    fn new() -> Self {
        require_privileges();
        let ns = NetNs::new(&format!("{}-api", unique_prefix()));
        Self {
            api: FakeApiServer::start(&ns),
            metrics: SharedLbMetrics::default(),
            ns,
        }
    }

    /// An allocator (no announcer) named `identity`, running in the API
    /// server's namespace.
    fn allocator(&self, identity: &str, default_class: bool) -> LbController {
        let cfg = LbConfig {
            ipam: true,
            classes: ClassFilter {
                class: CLASS.into(),
                default_class,
            },
            lease_namespace: LEASE_NS.into(),
            ipam_lease: LeaseTiming {
                duration: Duration::from_secs(2),
                renew_period: Duration::from_millis(200),
                renew_deadline: Some(Duration::from_millis(1500)),
            },
            ..LbConfig::default()
        };
        let access = ApiAccess {
            api_server: Some(self.api.url()),
            kubeconfig: None,
        };
        let metrics = self.metrics.clone();
        self.ns
            .run(|| LbController::start(access, identity, &cfg, &[], metrics))
            .expect("start the allocator")
            .expect("enabled")
    }

    fn svc(&self, key: &str) -> Value {
        let (ns, name) = key.split_once('/').unwrap();
        self.api
            .get("Service", ns, name)
            .unwrap_or_else(|| panic!("no Service {key}"))
    }

    fn ips(&self, key: &str) -> Vec<String> {
        ingress(&self.svc(key))
    }

    fn reason(&self, key: &str) -> Option<String> {
        condition(&self.svc(key)).map(|c| c.1)
    }

    fn wait(&self, what: &str, check: impl Fn() -> bool) {
        eventually(what, check, || {
            let services: Vec<String> = self
                .api
                .list("Service")
                .iter()
                .map(|s| format!("{}: {}", s["metadata"]["name"], s["status"]))
                .collect();
            format!(
                "services:\n{}\nwrites:\n{:#?}",
                services.join("\n"),
                self.api.writes()
            )
        });
    }

    /// Events with this reason, as (type, regarding name).
    fn events(&self, reason: &str) -> Vec<(String, String)> {
        self.api
            .events()
            .iter()
            .filter(|e| e["reason"] == reason)
            .map(|e| {
                (
                    e["type"].as_str().unwrap_or("").to_owned(),
                    e["regarding"]["name"].as_str().unwrap_or("").to_owned(),
                )
            })
            .collect()
    }

    /// Status writes to the Service `name` in default, as their status codes.
    fn status_writes(&self, name: &str) -> Vec<String> {
        let path = format!("PUT /api/v1/namespaces/default/services/{name}/status ");
        self.api
            .writes()
            .iter()
            .filter_map(|w| w.strip_prefix(&path).map(str::to_owned))
            .collect()
    }
}

fn with_spec(mut svc: Value, field: &str, value: Value) -> Value {
    svc["spec"][field] = value;
    svc
}

#[test]
fn the_allocator_serves_its_class_only_and_writes_status_conditions_and_events() {
    let s = Setup::new();
    s.api.apply(&pool("lan", &["198.18.0.240/29"]));
    for svc in [
        service("default/web", Some(CLASS), &[80]),
        service("default/ccm", Some("cloud.example.com/ccm"), &[80]),
        service("default/classless", None, &[80]),
        with_spec(service("default/np", None, &[80]), "type", json!("NodePort")),
        annotated(
            service("default/pinned", Some(CLASS), &[80]),
            IPS_ANNOTATION,
            "198.18.0.246",
        ),
        with_spec(
            service("default/legacy", Some(CLASS), &[80]),
            "loadBalancerIP",
            json!("198.18.0.245"),
        ),
        annotated(
            service("default/bad", Some(CLASS), &[80]),
            IPS_ANNOTATION,
            "198.18.0.x",
        ),
        annotated(
            service("default/outside", Some(CLASS), &[80]),
            IPS_ANNOTATION,
            "192.0.2.1",
        ),
    ] {
        s.api.apply(&svc);
    }
    let _allocator = s.allocator("node1", false);
    s.wait("every Service of our class handled", || {
        !s.ips("default/web").is_empty()
            && s.reason("default/bad").is_some()
            && s.reason("default/outside").is_some()
            && s.reason("default/pinned").is_some()
            && s.reason("default/legacy").is_some()
    });
    let web = s.svc("default/web");
    assert_eq!(ingress(&web), ["198.18.0.241"], "the lowest usable address");
    assert_eq!(web["status"]["loadBalancer"]["ingress"][0]["ipMode"], "VIP");
    let (state, reason, message) = condition(&web).unwrap();
    assert_eq!(
        (state.as_str(), reason.as_str()),
        ("True", "Assigned"),
        "{message}"
    );
    assert_eq!(
        s.ips("default/pinned"),
        ["198.18.0.246"],
        "the annotation's address"
    );
    assert_eq!(s.ips("default/legacy"), ["198.18.0.245"], "spec.loadBalancerIP");
    let (state, reason, message) = condition(&s.svc("default/bad")).unwrap();
    assert_eq!((state.as_str(), reason.as_str()), ("False", "InvalidRequest"));
    assert!(message.contains("198.18.0.x"), "{message}");
    assert!(s.ips("default/bad").is_empty());
    assert_eq!(
        s.reason("default/outside").as_deref(),
        Some("RequestedIPNotInPool")
    );

    // Other classes, no class, other types: never written.
    for other in ["ccm", "classless", "np"] {
        assert!(
            s.svc(&format!("default/{other}"))["status"].is_null(),
            "{other} untouched"
        );
        assert!(s.status_writes(other).is_empty(), "{other}: no status write");
    }
    // Each Service's event is posted on its own: wait for the ones asserted.
    s.wait("events posted", || {
        s.events("IPAllocated").contains(&("Normal".into(), "web".into()))
            && !s.events("InvalidRequest").is_empty()
    });
    assert!(s.events("IPAllocated").contains(&("Normal".into(), "web".into())));
    assert_eq!(
        s.events("InvalidRequest"),
        [("Warning".to_string(), "bad".to_string())]
    );
    assert_eq!(
        s.events("RequestedIPNotInPool"),
        [("Warning".to_string(), "outside".to_string())]
    );

    // Pool status: 6 usable (.241-.246), 3 used.
    s.wait("pool status written", || {
        s.api.get("LoadBalancerIPPool", "", "lan").unwrap()["status"]["ipsUsed"] == 3
    });
    let status = &s.api.get("LoadBalancerIPPool", "", "lan").unwrap()["status"];
    assert_eq!(
        (status["ipsTotal"].as_i64(), status["ipsAvailable"].as_i64()),
        (Some(6), Some(3))
    );
    let valid = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Valid")
        .unwrap();
    assert_eq!(valid["status"], "True");

    let lease = s
        .api
        .get("Lease", LEASE_NS, IPAM_LEASE)
        .expect("the allocator's Lease");
    assert_eq!(lease["spec"]["holderIdentity"], "node1");
    assert!(s.metrics.lock().unwrap().ipam_leader);

    // Allocation latency: from the Service's creation to its status.
    let started = Instant::now();
    s.api.apply(&service("default/late", Some(CLASS), &[80]));
    dataplane_tests::poll_until(
        Duration::from_secs(10),
        Duration::from_millis(1),
        "late: an address",
        || !s.ips("default/late").is_empty(),
        String::new,
    );
    eprintln!(
        "allocation latency (creation to status, fake API server): {:.1} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    assert_eq!(s.ips("default/late"), ["198.18.0.242"]);
}

#[test]
fn exhaustion_is_reported_and_released_addresses_are_reused() {
    let s = Setup::new();
    s.api.apply(&pool("small", &["10.10.0.1-10.10.0.2"]));
    for name in ["a", "b", "c"] {
        s.api
            .apply(&service(&format!("default/{name}"), Some(CLASS), &[80]));
    }
    let _allocator = s.allocator("node1", false);
    s.wait("c reported as waiting", || s.reason("default/c").is_some());
    assert_eq!(s.ips("default/a"), ["10.10.0.1"]);
    assert_eq!(s.ips("default/b"), ["10.10.0.2"]);
    assert!(s.ips("default/c").is_empty());
    assert_eq!(s.reason("default/c").as_deref(), Some("PoolExhausted"));
    s.wait("exhaustion events on the Service and the pool", || {
        s.events("PoolExhausted").len() >= 2
    });
    let regarding: Vec<String> = s.events("PoolExhausted").into_iter().map(|e| e.1).collect();
    assert!(regarding.contains(&"c".to_string()) && regarding.contains(&"small".to_string()));
    let pool_status = &s.api.get("LoadBalancerIPPool", "", "small").unwrap()["status"];
    let exhausted = pool_status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Exhausted")
        .unwrap();
    assert_eq!(exhausted["status"], "True");

    // Deleted: its address goes to the waiting Service.
    s.api.delete("Service", "default", "a");
    s.wait("c gets a's address", || s.ips("default/c") == ["10.10.0.1"]);
    assert_eq!(s.reason("default/c").as_deref(), Some("Assigned"));

    // No longer a LoadBalancer (the API server drops the class with the
    // type): status cleared, address free again.
    let mut b = service("default/b", None, &[80]);
    b["spec"]["type"] = json!("ClusterIP");
    s.api.apply(&b);
    s.wait("b released", || {
        s.ips("default/b").is_empty() && s.reason("default/b").is_none()
    });
    s.wait("release event", || !s.events("IPReleased").is_empty());
    s.api.apply(&service("default/d", Some(CLASS), &[80]));
    s.wait("d gets b's address", || s.ips("default/d") == ["10.10.0.2"]);
}

#[test]
fn addresses_are_shared_only_with_the_same_key_namespace_and_distinct_ports() {
    let s = Setup::new();
    s.api.apply(&pool("shared", &["10.20.0.0/24"]));
    let want = |key: &str, port: i32, sharing: &str| {
        annotated(
            annotated(service(key, Some(CLASS), &[port]), IPS_ANNOTATION, "10.20.0.10"),
            SHARING_KEY_ANNOTATION,
            sharing,
        )
    };
    let mut first = want("default/http", 80, "front");
    // Older: it holds the address, the others ask to join.
    first["metadata"]["creationTimestamp"] = json!("2020-01-01T00:00:00Z");
    for svc in [
        first,
        want("default/https", 443, "front"),
        want("default/clash", 80, "front"),
        want("default/stranger", 8443, "back"),
        want("other/https", 443, "front"),
        annotated(
            service("default/grp-a", Some(CLASS), &[1]),
            SHARING_KEY_ANNOTATION,
            "grp",
        ),
        annotated(
            service("default/grp-b", Some(CLASS), &[2]),
            SHARING_KEY_ANNOTATION,
            "grp",
        ),
    ] {
        s.api.apply(&svc);
    }
    let _allocator = s.allocator("node1", false);
    s.wait("all handled", || {
        ["http", "https", "clash", "stranger", "grp-a", "grp-b"]
            .iter()
            .all(|n| s.reason(&format!("default/{n}")).is_some())
            && s.reason("other/https").is_some()
    });
    assert_eq!(s.ips("default/http"), ["10.20.0.10"]);
    assert_eq!(
        s.ips("default/https"),
        ["10.20.0.10"],
        "same key, other port: shared"
    );
    for refused in ["default/clash", "default/stranger", "other/https"] {
        assert_eq!(s.reason(refused).as_deref(), Some("IPInUse"), "{refused}");
        assert!(s.ips(refused).is_empty());
    }
    let (_, _, message) = condition(&s.svc("default/clash")).unwrap();
    assert!(message.contains("default/http"), "names the holder: {message}");
    assert_eq!(
        s.ips("default/grp-a"),
        s.ips("default/grp-b"),
        "a group shares an allocated address"
    );
    assert_eq!(s.ips("default/grp-a").len(), 1);
}

#[test]
fn services_without_a_class_are_served_only_when_configured() {
    let s = Setup::new();
    s.api.apply(&pool("lan", &["10.30.0.0/30"]));
    s.api.apply(&service("default/classless", None, &[80]));
    s.api
        .apply(&service("default/ccm", Some("cloud.example.com/ccm"), &[80]));
    let _allocator = s.allocator("node1", true);
    s.wait("the class-less Service gets an address", || {
        s.ips("default/classless") == ["10.30.0.1"]
    });
    assert!(s.svc("default/ccm")["status"].is_null());
    assert!(
        s.status_writes("ccm").is_empty(),
        "another class's Service is never written"
    );
}

#[test]
fn status_writes_are_retried_after_rereading_on_resource_version_conflicts() {
    let s = Setup::new();
    s.api.apply(&pool("lan", &["10.40.0.0/30"]));
    let _allocator = s.allocator("node1", false);
    // The pool's first status write done, the next write is the Service's.
    s.wait("the pool's status written", || {
        !s.api.get("LoadBalancerIPPool", "", "lan").unwrap()["status"].is_null()
    });
    s.api.conflict_next_status_writes(3);
    s.api.apply(&service("default/web", Some(CLASS), &[80]));
    s.wait("assigned despite the conflicts", || {
        s.ips("default/web") == ["10.40.0.1"]
    });
    assert_eq!(s.status_writes("web"), ["409", "409", "409", "200"]);
    let web = s.svc("default/web");
    assert_eq!(
        web["metadata"]["annotations"]["fake-api/concurrent-writes"], "3",
        "the concurrent writer's changes are kept"
    );
    let rereads = s
        .api
        .writes()
        .iter()
        .filter(|w| w.starts_with("GET /api/v1/namespaces/default/services/web "))
        .count();
    assert_eq!(rereads, 3, "one read after each conflict");
    assert_eq!(s.metrics.lock().unwrap().status_conflicts, 3);
}

#[test]
fn a_restarted_or_new_allocator_relearns_addresses_and_rewrites_nothing() {
    let s = Setup::new();
    s.api.apply(&pool("lan", &["198.18.0.240/28"]));
    // Addresses given before (by an allocator that has gone away).
    for (name, ip) in [("a", "198.18.0.250"), ("b", "198.18.0.244")] {
        let mut svc = service(&format!("default/{name}"), Some(CLASS), &[80]);
        svc["status"] = json!({"loadBalancer": {"ingress": [{"ip": ip, "ipMode": "VIP"}]}});
        s.api.apply(&svc);
    }
    s.api.apply(&service("default/c", Some(CLASS), &[80]));
    let first = s.allocator("node1", false);
    s.wait("all three handled", || {
        ["a", "b", "c"]
            .iter()
            .all(|n| s.reason(&format!("default/{n}")).is_some())
    });
    assert_eq!(
        s.ips("default/a"),
        ["198.18.0.250"],
        "kept, not moved to a lower address"
    );
    assert_eq!(s.ips("default/b"), ["198.18.0.244"]);
    assert_eq!(s.ips("default/c"), ["198.18.0.241"]);

    // Stopped: it releases the Lease; another agent takes over at once and
    // re-learns everything from the statuses.
    first.stop();
    let lease = s.api.get("Lease", LEASE_NS, IPAM_LEASE).unwrap();
    assert!(lease["spec"]["holderIdentity"].is_null(), "released: {lease}");
    let writes_before = s.api.writes().iter().filter(|w| w.contains("/services/")).count();
    let _second = s.allocator("node2", false);
    s.api.apply(&service("default/d", Some(CLASS), &[80]));
    s.wait("the new leader serves d", || {
        s.ips("default/d") == ["198.18.0.242"]
    });
    let lease = s.api.get("Lease", LEASE_NS, IPAM_LEASE).unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], "node2");
    assert_eq!(
        lease["spec"]["leaseTransitions"], 0,
        "a released Lease is taken without a transition"
    );
    let service_writes: Vec<String> = s
        .api
        .writes()
        .into_iter()
        .filter(|w| w.contains("/services/"))
        .skip(writes_before)
        .collect();
    assert_eq!(
        service_writes,
        ["PUT /api/v1/namespaces/default/services/d/status 200"],
        "nothing rewritten but the new Service"
    );
    assert_eq!(s.ips("default/a"), ["198.18.0.250"]);
    assert_eq!(s.ips("default/b"), ["198.18.0.244"]);
    assert_eq!(s.ips("default/c"), ["198.18.0.241"]);
}

/// Steps `elector` until `done(elector)` or 10 s; the other electors are
/// stepped too (so that the holder keeps renewing).
async fn step_until(
    electors: &mut [(&mut Elector, Intent)],
    done: impl Fn(&[(&mut Elector, Intent)]) -> bool,
    what: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done(electors) {
        assert!(Instant::now() < deadline, "{what}: not reached in 10 s");
        for (e, intent) in electors.iter_mut() {
            e.step(*intent).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn lease_election_acquires_renews_and_hands_over_on_expiry_and_on_release() {
    let s = Setup::new();
    let url = s.api.url();
    let api = &s.api;
    s.ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let client = dataplane_agent::k8s::client::client(Some(url), None)
                .await
                .expect("client");
            // a writes 1 s Leases, b 30 s ones: b's release is taken over in
            // far less than its duration, so not by expiry.
            let timing = |secs| LeaseTiming {
                duration: Duration::from_secs(secs),
                renew_period: Duration::from_millis(100),
                renew_deadline: Some(Duration::from_millis(700)),
            };
            let elector = |who: &str, secs: u64| {
                let meta = kube::api::ObjectMeta {
                    name: Some("election".into()),
                    namespace: Some(LEASE_NS.into()),
                    ..Default::default()
                };
                Elector::new(
                    kube::Api::namespaced(client.clone(), LEASE_NS),
                    Candidate::new(who, meta, timing(secs), true),
                )
            };
            let (mut a, mut b) = (elector("a", 1), elector("b", 30));
            let leading = |e: &Elector| e.leading(Instant::now());
            step_until(
                &mut [(&mut a, Intent::Lead)],
                |es| leading(&*es[0].0),
                "a acquires",
            )
            .await;
            let holder = |api: &FakeApiServer| {
                api.get("Lease", LEASE_NS, "election").unwrap()["spec"]["holderIdentity"].clone()
            };
            assert_eq!(holder(api), "a");

            // While a renews, b never takes over (three lease durations).
            let until = Instant::now() + Duration::from_secs(3);
            while Instant::now() < until {
                a.step(Intent::Lead).await;
                b.step(Intent::Lead).await;
                assert!(!leading(&b), "b took over a renewed Lease");
                assert!(leading(&a));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(b.holder(), Some("a"));

            // a stops renewing (as if killed): b takes over once the Lease
            // has not been renewed for its duration.
            let lease_of = |api: &FakeApiServer| -> k8s_openapi::api::coordination::v1::Lease {
                serde_json::from_value(api.get("Lease", LEASE_NS, "election").unwrap()).unwrap()
            };
            let last_renewal = lease_of(api).spec.unwrap().renew_time.unwrap().0;
            let stopped = Instant::now();
            step_until(
                &mut [(&mut b, Intent::Lead)],
                |es| leading(&*es[0].0),
                "b takes over",
            )
            .await;
            eprintln!(
                "election hand-over after the holder stopped renewing: {:?} (lease 1 s)",
                stopped.elapsed()
            );
            // Safety: b took the Lease no sooner than a lease duration after
            // a's last renewal (both stamped by this machine's clock).
            let acquired = lease_of(api).spec.unwrap().acquire_time.unwrap().0;
            let gap_ms = acquired.as_millisecond() - last_renewal.as_millisecond();
            assert!(gap_ms >= 1000, "b took over {gap_ms} ms after a's last renewal");
            let lease = api.get("Lease", LEASE_NS, "election").unwrap();
            assert_eq!(lease["spec"]["holderIdentity"], "b");
            assert_eq!(lease["spec"]["leaseTransitions"], 1);

            // a comes back: its renewal conflicts, it sees b and follows.
            a.step(Intent::Lead).await;
            a.step(Intent::Lead).await;
            assert!(!leading(&a), "a saw b holding the Lease");
            assert_eq!(a.holder(), Some("b"));

            // b releases (shutdown): a takes over without waiting for expiry.
            b.step(Intent::Follow).await;
            assert!(!leading(&b));
            assert!(holder(api).is_null());
            // b's Lease says 30 s: taking it within step_until's 10 s means
            // a did not wait for it to expire.
            step_until(
                &mut [(&mut a, Intent::Lead)],
                |es| leading(&*es[0].0),
                "a takes the released Lease",
            )
            .await;
            assert_eq!(holder(api), "a");
            assert_eq!(
                api.get("Lease", LEASE_NS, "election").unwrap()["spec"]["leaseTransitions"],
                1
            );
        });
    });
}
